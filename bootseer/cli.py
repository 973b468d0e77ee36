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

# Modules that contribute subcommands, in the order ``bootseer --help`` lists them.
SUBCOMMAND_MODULES = [
    "bootseer.ckptmount.cli",
    "bootseer.blockstore.cli",
    "bootseer.rpull_cli",
    "bootseer.blockstore.server_cli",
    "bootseer.hotlist.cli",
    "bootseer.profile.cli",
    "bootseer.depsnap.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bootseer", description="BootSeer: faster start-up for training jobs.")
    parser.add_argument("--version", action="version", version=f"bootseer {__version__}")
    parser.add_argument("--log-level", choices=LEVELS, default="info")
    parser.add_argument("--log-format", choices=FORMATS, default="text")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    # Every subcommand sets ``func``; it returns the process's exit status.
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
