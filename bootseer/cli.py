"""The ``bootseer`` command line.

Each capability package contributes its subcommands through a ``register(subparsers)``
function in its ``cli`` module; this module only assembles them and sets up logging.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bootseer import __version__
from bootseer.log import FORMATS, LEVELS, setup_logging

# The module that contributes each subcommand, in the order ``bootseer --help`` lists
# them.  Only the module of the command being run is imported: the others pull in trio,
# pyfuse3, grpc and boto3, and a command such as ``bootseer rpull`` in a job's start-up
# path should not pay half a second for them.
SUBCOMMANDS: dict[str, str] = {
    "ckpt": "bootseer.ckptmount.cli",
    "convert": "bootseer.blockstore.convert.cli",
    "keys": "bootseer.blockstore.objects.keys_cli",
    "rpull": "bootseer.images.rpull_cli",
    "layer-server": "bootseer.snapshotter.layer_daemon",
    "peers": "bootseer.blockstore.server.peers_cli",
    "hotlist": "bootseer.hotlist.cli",
    "profile": "bootseer.profile.cli",
    "deps": "bootseer.depsnap.cli",
}
SUBCOMMAND_MODULES = list(dict.fromkeys(SUBCOMMANDS.values()))


def _command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option or an option's value)."""
    takes_value = {"--log-level", "--log-format"}
    words = iter(argv)
    for word in words:
        if word in takes_value:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv`` naming a known command, only that command's module is loaded."""
    parser = argparse.ArgumentParser(prog="bootseer", description="BootSeer: faster start-up for training jobs.")
    parser.add_argument("--version", action="version", version=f"bootseer {__version__}")
    parser.add_argument("--log-level", choices=LEVELS, default="info")
    parser.add_argument("--log-format", choices=FORMATS, default="text")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    command = _command_of(argv) if argv is not None else None
    modules = [SUBCOMMANDS[command]] if command in SUBCOMMANDS else SUBCOMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    # Every subcommand sets ``func``; it returns the process's exit status.
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
