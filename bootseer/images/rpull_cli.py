"""``bootseer rpull REF``: pull an image into containerd, unpacking it through a (remote) snapshotter.

Exit status: 0 when the image is pulled and unpacked (``ctr run --snapshotter NAME REF``
can start it), 1 when the image or containerd failed (the message says which step),
2 for a bad option or reference.
"""

from __future__ import annotations

import argparse
import sys

from bootseer.images import registry as images
from bootseer.log import get_logger
from bootseer.images.rpull import DEFAULT_ADDRESS, DEFAULT_NAMESPACE, DEFAULT_SNAPSHOTTER, Progress, RpullError, rpull

log = get_logger(__name__)

EXIT_FAILURE = 1
EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rpull", help="pull an image into containerd; layers the snapshotter has are not downloaded",
        description="Pull REF (host[:port]/name[:tag][@digest] or oci:DIR[:TAG]) into containerd's content "
                    "store and unpack it on SNAPSHOTTER as containerd's client-side pull does: layers the "
                    "snapshotter serves remotely (ALREADY_EXISTS on Prepare) are not fetched.")
    parser.add_argument("ref", metavar="REF", help="image reference")
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help=f"containerd's socket (default {DEFAULT_ADDRESS})")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"containerd namespace (default {DEFAULT_NAMESPACE})")
    parser.add_argument("--snapshotter", default=DEFAULT_SNAPSHOTTER,
                        help=f"snapshotter to unpack on (default {DEFAULT_SNAPSHOTTER})")
    parser.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to the registry")
    parser.add_argument("--platform", default=None,
                        help="os/arch[/variant] to pick from an image index (default linux on this machine's arch)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = rpull(args.ref, address=args.address, namespace=args.namespace, snapshotter=args.snapshotter,
                       plain_http=args.plain_http, platform=args.platform, progress=Progress())
    except images.BadReference as e:
        print(f"bootseer rpull: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (images.ImageError, RpullError) as e:
        print(f"bootseer rpull: {args.ref}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    print(result.summary())
    return 0
