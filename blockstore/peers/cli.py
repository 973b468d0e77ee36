"""``bootseer peers status`` and the layer server's ``--peer-*`` options (docs/peers.md).

``bootseer peers status [--root ROOT] [--json]`` asks the node's layer server how
its peer group looks from here: its members and which are skipped, blocks received
from and served to peers, late answers, fallbacks to the store, bad blocks, requests
refused over a peer's fetch budget or answered busy, and the memory held for peers.
Exit status: 0; 1 when the layer server cannot be asked; 3 when peer sharing is off.
"""

from __future__ import annotations

import argparse
import json
import sys

from bootseer.blockstore.peers.service import PeerConfig, PeerConfigError

EXIT_ERROR = 1
EXIT_OFF = 3


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


#: The option of each :class:`PeerConfig` setting the layer server takes: the options are made from it
#: (so none lacks an entry), and a refusal names the option that was (or was not) given.
OPTIONS = {"listen": "--peer-listen", "advertise": "--peer-advertise", "members": "--peers", "members_file": "--peers-file",
           "members_dns": "--peers-dns", "token_file": "--peer-token-file", "deadline": "--peer-deadline",
           "upload_rate": "--peer-upload-rate", "max_uploads": "--peer-max-uploads", "fetch_budget": "--peer-fetch-budget",
           "max_connections": "--peer-max-connections", "tls_cert": "--peer-tls-cert", "tls_key": "--peer-tls-key",
           "ca": "--peer-ca"}  # fmt: skip


def add_layer_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--peer-*`` options to ``bootseer layer-server``."""
    from bootseer.units import parse_size

    defaults = PeerConfig()
    group = parser.add_argument_group("peer block sharing (off unless --peer-listen is given; docs/peers.md)")
    group.add_argument(OPTIONS["listen"], metavar="HOST:PORT", help="serve verified blocks to peers on this address")
    group.add_argument(OPTIONS["advertise"], metavar="HOST:PORT",
                       help="this node's address as the members list it (default: --peer-listen)")  # fmt: skip
    group.add_argument(OPTIONS["members"], type=_addresses, default=(), metavar="HOST:PORT,...",
                       help="the peer group's members (this node may be among them)")  # fmt: skip
    group.add_argument(OPTIONS["members_file"], metavar="FILE",
                       help="members, one HOST:PORT a line, re-read when the file changes")  # fmt: skip
    group.add_argument(OPTIONS["members_dns"], metavar="NAME:PORT",
                       help="members: every address NAME resolves to (a Kubernetes headless Service)")  # fmt: skip
    group.add_argument(OPTIONS["token_file"], metavar="FILE",
                       help="the group's shared token (needed unless --peer-listen is loopback)")  # fmt: skip
    group.add_argument(OPTIONS["deadline"], type=float, default=defaults.deadline, metavar="SECONDS",
                       help=f"a silent peer is given this long before the store is asked too ({defaults.deadline})")  # fmt: skip
    group.add_argument(OPTIONS["upload_rate"], type=parse_size, default=0, metavar="RATE",
                       help="bytes per second served to peers in all, e.g. 100M (0: no limit)")  # fmt: skip
    group.add_argument(OPTIONS["max_uploads"], type=int, default=defaults.max_uploads, metavar="N",
                       help=f"blocks served to peers at once ({defaults.max_uploads})")  # fmt: skip
    group.add_argument(OPTIONS["fetch_budget"], type=parse_size, default=defaults.fetch_budget, metavar="SIZE",
                       help="store bytes one asking peer may make this node fetch per 10 s, e.g. 1G (0: no limit; "
                            "1G)")  # fmt: skip
    group.add_argument(OPTIONS["max_connections"], type=int, default=defaults.max_connections, metavar="N",
                       help="connections peers may hold open at once; unauthenticated ones are dropped first "
                            f"({defaults.max_connections}; at most half the file descriptor limit)")  # fmt: skip
    group.add_argument(OPTIONS["tls_cert"], metavar="FILE", help="serve peers over HTTPS with this certificate (PEM)")
    group.add_argument(OPTIONS["tls_key"], metavar="FILE", help="the key of --peer-tls-cert (PEM)")
    group.add_argument(OPTIONS["ca"], metavar="FILE", help="ask peers over HTTPS, trusting this CA (PEM)")


def layer_server_peer_config(args: argparse.Namespace) -> PeerConfig:
    """The :class:`PeerConfig` the options ask for; ValueError (one line, naming the option) for settings
    that cannot work."""
    config = PeerConfig(
        listen=args.peer_listen,
        advertise=args.peer_advertise,
        members=tuple(args.peers),
        members_file=args.peers_file,
        members_dns=args.peers_dns,
        token_file=args.peer_token_file,
        deadline=args.peer_deadline,
        upload_rate=args.peer_upload_rate,
        max_uploads=args.peer_max_uploads,
        fetch_budget=args.peer_fetch_budget,
        max_connections=args.peer_max_connections,
        tls_cert=args.peer_tls_cert,
        tls_key=args.peer_tls_key,
        ca=args.peer_ca,
    )
    if config.enabled:
        try:
            config.check()  # a members file that cannot be read is refused now, not at the first fetch
        except PeerConfigError as exc:
            raise ValueError(f"{OPTIONS[exc.key]}: {exc.why}" if exc.key in OPTIONS else str(exc)) from None
    return config


def register(subparsers: argparse._SubParsersAction) -> None:
    from bootseer.blockstore.server.cli import DEFAULT_ROOT

    peers = subparsers.add_parser("peers", help="the node's peer group (block sharing between nodes)")
    commands = peers.add_subparsers(dest="peers_command", required=True, metavar="COMMAND")
    status = commands.add_parser("status", help="members, blocks received and served, fallbacks, bad blocks")
    status.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR", help=f"the node's BootSeer root ({DEFAULT_ROOT})")
    status.add_argument("--json", action="store_true", help="print the layer server's answer as JSON")
    status.set_defaults(func=status_command)


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024  # type: ignore[assignment]
    return str(count)


def status_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.server.client import LayerServerClient, LayerServerError, ServerPaths
    from pathlib import Path

    try:
        answer = LayerServerClient(ServerPaths(Path(args.root)).socket).call({"op": "peers.status"})
    except LayerServerError as exc:
        print(f"bootseer peers status: {exc}", file=sys.stderr)
        return EXIT_ERROR
    answer.pop("ok", None)
    if args.json:
        print(json.dumps(answer, indent=1))
        return 0 if answer.get("enabled", True) else EXIT_OFF
    if answer.get("enabled") is False:
        print("peer sharing is off on this node (no --peer-listen / [peers] listen)")
        return EXIT_OFF
    print(f"this node: {answer['self']} (listening on {answer['listen']}; token {'on' if answer['token'] else 'off'}, "
          f"TLS {'on' if answer['tls'] else 'off'}); members from {answer['membership'].get('kind')}")  # fmt: skip
    for member in answer["members"]:
        extra = ""
        if member["state"] == "skipped":
            extra = f"  skipped for {member['skipped_for']} s: {member['last_error']}"
        elif "ok" in member:
            extra = f"  {member['ok']} blocks, {member['failures']} failures"
        print(f"  {member['address']:<24} {member['state']}{extra}")
    received, served = answer["received"], answer["served"]
    print(f"received from peers: {received['blocks']} blocks, {_size(received['bytes'])}")
    print(f"served to peers:     {served['blocks']} blocks, {_size(served['bytes'])}")
    print(f"late answers: {answer['late']}  slow: {answer.get('slow', 0)}  fallbacks to the store: "
          f"{answer['fallbacks']}  bad blocks: {answer['bad_blocks']}  errors: {answer['errors']}")  # fmt: skip
    connections = answer.get("connections")
    if connections is not None:  # not from a layer server older than this command
        print(f"connections from peers: {connections['open']} open ({connections['authenticated']} authenticated, "
              f"at most {connections['limit']}); failed authentications: {answer['auth_failures']}")  # fmt: skip
    if answer.get("self_listed") is False:
        print("this node is not in its member list: it owns no block and asks the members for every one")
    if "over_budget" in answer:
        held = answer["held_for_peers"]
        print(f"refused over a peer's fetch budget: {answer['over_budget']}  busy: {answer.get('busy', 0)}  held for "
              f"peers: {_size(held['bytes'])} (peak {_size(held['peak'])} of {_size(held['limit'])})")  # fmt: skip
    return 0


__all__ = ["add_layer_server_arguments", "layer_server_peer_config", "register", "status_command"]
