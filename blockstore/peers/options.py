"""The layer server's ``--peer-*`` options, parsed into a :class:`~.config.PeerConfig` (docs/peers.md).

The ``bootseer layer-server`` command adds these to its parser and builds its peer
configuration from them; the configuration file's ``[peers]`` section reaches the same
:class:`PeerConfig`.  This module imports no trio (the daemon's start-up path loads it).
"""

from __future__ import annotations

import argparse

from bootseer.blockstore.peers.config import PeerConfig, PeerConfigError

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


__all__ = ["add_layer_server_arguments", "layer_server_peer_config"]
