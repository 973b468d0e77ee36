"""``bootseer convert REF --store URL``: convert an image into a block store for lazy layers.

Exit status: 0 when every layer is in the store (converted now or before); 2 for bad
usage (a malformed reference, store URL or block size); 1 when the conversion failed
(the image cannot be read, a layer is refused, the store fails), with one line on
stderr saying which layer and why; 130 on Ctrl-C.  Layers finished before a failure
stay published; the one being converted is not.
"""

from __future__ import annotations

import argparse
import os
import sys

from bootseer.blockstore.convert.converter import ConversionError, Progress, check_block_size, convert_image
from bootseer.blockstore.convert.layer_image import DEFAULT_INLINE_MAX
from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE
from bootseer.blockstore.objects.signing import KeyFileError, load_signing_key
from bootseer.blockstore.objects.store import ReadOnlyStore, StoreError, open_store_writer
from bootseer.blockstore.convert.tarlayer import DEFAULT_MAX_LAYER_BYTES, TarLimits
from bootseer.units import parse_size
from bootseer.fetch.source import SourceError
from bootseer.fetch.sources import redact_url
from bootseer.log import get_logger

log = get_logger(__name__)

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


def _block_size(text: str) -> int:
    size = parse_size(text)
    try:
        return check_block_size(size)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layer_size(text: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the layer size limit must be positive, not {text!r}")
    return size


def _platform(text: str) -> str:
    from bootseer.images.registry import ImageError, Platform

    try:
        Platform.parse(text)
    except (ImageError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _inline_max(text: str) -> int:
    value = parse_size(text)
    if value < 0 or value > MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"at most {MAX_BLOCK_SIZE} (a file inline is one block)")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    convert = subparsers.add_parser(
        "convert",
        help="convert an image into a block store (lazy layers)",
        description=(
            "Convert image REF (a registry reference host[:port]/name[:tag][@digest], or oci:DIR[:TAG]) "
            "into the block store at URL (a path, file://, s3://bucket/prefix or hdfs://namenode/path), "
            "layer by layer: an index of each layer's tree, its file contents in zstd blocks deduplicated "
            "across the store, and last a chain record that makes the layer visible to nodes.  Layers "
            "already converted are skipped; everything uploaded is read back and checked."
        ),
        epilog="Sizes: 1M, 512K, 4MiB (powers of 1024).  S3 credentials: boto3's standard chain; "
        "endpoint: AWS_ENDPOINT_URL or the profile's endpoint_url.",
    )
    convert.add_argument("ref", metavar="REF")
    convert.add_argument("--store", required=True, metavar="URL", help="where to write the converted layers")
    convert.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to the registry")
    convert.add_argument("--platform", type=_platform, default="linux/amd64", metavar="OS/ARCH[/VARIANT]",
                         help="the platform to pick from an image index (default linux/amd64)")  # fmt: skip
    convert.add_argument("--block-size", type=_block_size, default=DEFAULT_BLOCK_SIZE, metavar="SIZE",
                         help="bytes of file contents per block, a power of two (default 1M)")  # fmt: skip
    convert.add_argument("--spool-dir", metavar="DIR", help="where packs are spooled before upload (default: TMPDIR)")
    convert.add_argument("--sign-key", metavar="FILE",
                         help="sign the chain records with this converter key (bootseer keys generate; docs/trust.md)")  # fmt: skip
    convert.add_argument("--max-layer-size", type=_layer_size, default=DEFAULT_MAX_LAYER_BYTES, metavar="SIZE",
                         help="refuse a layer whose uncompressed tar, or whose files' sizes together (holes of "
                              "sparse files included), exceed SIZE (default 64G)")  # fmt: skip
    convert.add_argument("--no-verify-existing", dest="verify_existing", action="store_false",
                         help="skip a layer already converted once its record, index and packs exist (default: "
                              "also read back every block it references, and convert it again if one is wrong)")  # fmt: skip
    convert.add_argument("--inline-max", type=_inline_max, default=DEFAULT_INLINE_MAX, metavar="SIZE",
                         help="regular files of at most SIZE bytes hold their data in the layer's EROFS image "
                              f"(default {DEFAULT_INLINE_MAX}; 0: none; docs/FORMAT.md)")  # fmt: skip
    convert.add_argument("--no-image", dest="image", action="store_false",
                         help="publish no EROFS image of each layer (nodes then build one from the index, as "
                              "for conversions made before images existed)")  # fmt: skip
    convert.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from bootseer.images.registry import BadReference, ImageError, open_image

    if args.spool_dir is not None and not os.path.isdir(args.spool_dir):
        print(f"bootseer convert: --spool-dir {args.spool_dir}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    sign_key = None
    if args.sign_key is not None:
        try:
            sign_key = load_signing_key(args.sign_key)
        except KeyFileError as exc:
            print(f"bootseer convert: --sign-key: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        writer = open_store_writer(args.store)
    except ReadOnlyStore as exc:
        print(f"bootseer convert: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"bootseer convert: bad --store: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (StoreError, SourceError) as exc:
        print(f"bootseer convert: store {redact_url(args.store)}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        with writer:
            try:
                image = open_image(args.ref, plain_http=args.plain_http, platform=args.platform)
            except (BadReference, ValueError) as exc:
                print(f"bootseer convert: {exc}", file=sys.stderr)
                return EXIT_USAGE
            with image:
                result = convert_image(image, writer, block_size=args.block_size, spool_dir=args.spool_dir,
                                       limits=TarLimits(max_layer_bytes=args.max_layer_size),
                                       verify_existing=args.verify_existing, progress=Progress(),
                                       sign_key=sign_key, inline_max=args.inline_max if args.image else None)  # fmt: skip
    except (ConversionError, ImageError, StoreError, SourceError, OSError) as exc:  # OSError: the spool (disk full)
        message = str(exc)
        if not message.startswith(args.ref):
            message = f"{args.ref}: {message}"
        print(f"bootseer convert: {message}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        # The layer being converted has no chain record: nothing of it is visible; a rerun resumes.
        print(f"bootseer convert: {args.ref}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(result.summary())
    return 0
