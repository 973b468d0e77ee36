"""``bootseer peers status`` (docs/peers.md): the node's peer group as its layer server sees it.

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
from pathlib import Path

from bootseer.blockstore.server.client import LayerServerClient, LayerServerError
from bootseer.paths import DEFAULT_ROOT, ServerPaths

EXIT_ERROR = 1
EXIT_OFF = 3


def register(subparsers: argparse._SubParsersAction) -> None:
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


__all__ = ["register", "status_command"]
