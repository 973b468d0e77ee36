"""``bootseer ckpt ...`` subcommands."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ckpt", help="striped checkpoint mount")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
