"""``bootseer keys generate|show``: make and inspect the Ed25519 keys of docs/trust.md.

``generate --out PATH`` writes PATH (the private key, PEM PKCS#8, 0600) and PATH.pub
(one line, ``bootseer-ed25519 <base64> <name>``: what nodes are configured to trust);
it never overwrites a key.  ``show FILE`` prints a key's id and public line (from a
private or a public key file).  Exit status 0, or 2 with one line naming the cause.
"""

from __future__ import annotations

import argparse
import sys

from bootseer.blockstore.objects.signing import KeyFileError, generate_key, show_key

EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="make and show signing keys (docs/trust.md)",
                                 description="Ed25519 keys that sign conversions, hot lists and deps records.")  # fmt: skip
    commands = keys.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)
    generate = commands.add_parser("generate", help="write a new key pair: PATH (private, 0600) and PATH.pub")
    generate.add_argument("--out", required=True, metavar="PATH", help="the private key file to write")
    generate.add_argument("--name", default="", help="a label in the public line (default: PATH's name)")
    generate.set_defaults(func=run_generate)
    show = commands.add_parser("show", help="print a key's id and public line")
    show.add_argument("file", metavar="FILE", help="a private key or a .pub file")
    show.set_defaults(func=run_show)


def run_generate(args: argparse.Namespace) -> int:
    try:
        key = generate_key(args.out, args.name)
    except KeyFileError as exc:
        print(f"bootseer keys generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.out} (private, 0600) and {args.out}.pub; key id {key.public.id}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    try:
        public = show_key(args.file)
    except KeyFileError as exc:
        print(f"bootseer keys show: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"id {public.id}\n{public.line()}", end="")
    return 0
