"""``bootseer hotlist show|clear|record|seal|status``, and the layer server's hot-list options.

* ``show REF|CHAINID --store URL [--profile NAME]``: what the store's hot list(s) of an
  image hold: blocks, bytes, per layer, time span, when, where and how it was recorded.
* ``clear REF|CHAINID --store URL [--profile NAME | --all]``: remove it, so the next
  boot records a new one (``--store`` is the writable store: the directory or bucket
  behind a read-only http front).
* ``record REF|CHAINID --store URL``: re-record on demand: clear, and say so; the next
  boot of the image records.
* ``seal CONTAINER [--root ROOT]``: end the recording of a container now (the layer
  server publishes the list).
* ``status [--root ROOT]``: the layer server's recordings and prefetches.

A REF is an image reference (``host/name:tag``, ``--plain-http``) or ``oci:DIR[:TAG]``,
resolved to its top ChainID from its config's diff_ids; a ``sha256:`` ChainID is used
as it is.  Exit status: 0 done, 1 nothing there (show, clear), 2 bad input or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import trio

from bootseer.blockstore.objects.format import FormatError, check_digest

from bootseer.images.chains import chain_ids
from bootseer.blockstore.objects.format import max_blocks as record_max_blocks
from bootseer.fetch.sources import redact_url
from bootseer.hotlist.format import (
    MAX_LAYERS,
    HotList,
    HotListError,
    check_profile,
    hotlist_dir,
    hotlist_object,
    read_hot_list_object,
    profile_of_object,
    summary,
)
from bootseer.hotlist.prefetch import PrefetchLimits
from bootseer.hotlist.recorder import RecordingLimits
from bootseer.hotlist.service import HotListConfig
from bootseer.paths import DEFAULT_ROOT

if TYPE_CHECKING:
    from bootseer.blockstore.objects.store import StoreReader
    from bootseer.blockstore.server.client import LayerServerClient

EXIT_MISSING = 1
EXIT_ERROR = 2


# -- the layer server's options --------------------------------------------------------------


def add_layer_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--publish-store`` and the ``--hotlist-*``/``--prefetch-*`` options to ``bootseer layer-server``."""
    from bootseer.units import parse_size

    group = parser.add_argument_group("hot lists (record first boots, prefetch later ones)")
    group.add_argument("--publish-store", metavar="URL",
                       help="writable store hot lists are written to, where the read store is read-only (an http "
                            "front); default: the layers' store")  # fmt: skip
    group.add_argument("--publish-store-file", metavar="FILE",
                       help="read --publish-store from the first line of FILE (keeps a credential out of the "
                            "command line)")  # fmt: skip
    group.add_argument("--no-hotlist", action="store_true", help="neither record nor prefetch hot lists")
    group.add_argument("--hotlist-quiet", type=float, default=RecordingLimits.quiet, metavar="SECONDS",
                       help=f"end a recording after this long without a new block ({RecordingLimits.quiet:g})")  # fmt: skip
    group.add_argument("--hotlist-window", type=float, default=RecordingLimits.window, metavar="SECONDS",
                       help=f"end a recording this long after the container's snapshot was prepared ({RecordingLimits.window:g})")  # fmt: skip
    group.add_argument("--hotlist-marker", default=RecordingLimits.marker, metavar="NAME",
                       help=f"a file of this name at the container's root ends its recording ({RecordingLimits.marker})")  # fmt: skip
    group.add_argument("--prefetch-concurrency", type=int, default=PrefetchLimits.concurrency, metavar="N",
                       help=f"prefetch batches in flight ({PrefetchLimits.concurrency})")  # fmt: skip
    group.add_argument("--prefetch-batch", type=parse_size, default=PrefetchLimits.batch_bytes, metavar="SIZE",
                       help=f"compressed bytes per prefetch batch ({PrefetchLimits.batch_bytes >> 20}M)")  # fmt: skip
    group.add_argument("--prefetch-cold-rate", type=parse_size, default=PrefetchLimits.cold_rate, metavar="SIZE",
                       help="after the hot blocks, fetch the rest of the image at this many bytes/s (0: off)")  # fmt: skip
    group.add_argument("--no-prefetch-page-cache", action="store_true",
                       help="prefetch hot blocks into the node cache only, not also into the kernel's page cache")  # fmt: skip


def layer_server_hotlist_config(args: argparse.Namespace) -> HotListConfig:
    """The :class:`HotListConfig` the options ask for; ValueError for a bad one."""
    if args.publish_store:
        from bootseer.blockstore.objects.store import ReadOnlyStore, open_store_writer

        try:
            open_store_writer(args.publish_store).close()
        except ReadOnlyStore as exc:
            raise ValueError(f"--publish-store: {exc}") from None
        except OSError as exc:
            raise ValueError(f"--publish-store {redact_url(args.publish_store)}: {exc}") from None
    return HotListConfig(
        enabled=not args.no_hotlist,
        publish_store=args.publish_store,
        recording=RecordingLimits(quiet=args.hotlist_quiet, window=args.hotlist_window, marker=args.hotlist_marker),
        prefetch=PrefetchLimits(concurrency=args.prefetch_concurrency, batch_bytes=args.prefetch_batch,
                                cold_rate=args.prefetch_cold_rate, page_cache=not args.no_prefetch_page_cache),  # fmt: skip
    )


# -- bootseer hotlist ----------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("hotlist", help="show, clear, re-record or seal an image's hot list",
                                   description="Hot lists: the blocks an image's first boot read, in order, "
                                               "which every later boot prefetches.")  # fmt: skip
    commands = parser.add_subparsers(dest="hotlist_command", metavar="ACTION", required=True)

    def image_command(name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("image", metavar="REF|CHAINID", help="image reference, oci:DIR[:TAG], or the top ChainID")
        store = os.environ.get("BOOTSEER_STORE") or None
        sub.add_argument("--store", required=store is None, default=store, metavar="URL",
                         help="the block store (writable for clear/record); default $BOOTSEER_STORE")  # fmt: skip
        sub.add_argument("--profile", metavar="NAME", help="the profile (bootseer.io/profile label); default: the default profile")
        sub.add_argument("--plain-http", action="store_true", help="talk HTTP to the registry")
        sub.set_defaults(func=func)
        return sub

    show = image_command("show", "what the store's hot list of an image holds", show_command)
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument("--blocks", action="store_true", help="list every block too")
    clear = image_command("clear", "remove an image's hot list (the next boot records a new one)", clear_command)
    clear.add_argument("--all", action="store_true", help="every profile's list")
    image_command("record", "re-record: clear the list, so the next boot records", record_command)
    seal = commands.add_parser("seal", help="end a container's recording now")
    seal.add_argument("container", help="the container ID (its snapshot key)")
    seal.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR")
    seal.set_defaults(func=seal_command)
    status = commands.add_parser("status", help="the layer server's recordings and prefetches")
    status.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR")
    status.set_defaults(func=status_command)


def _fail(message: str, status: int = EXIT_ERROR) -> int:
    print(f"bootseer hotlist: {message}", file=sys.stderr)
    return status


def top_chain_id(image: str, *, plain_http: bool = False) -> str:
    """The top ChainID of ``image`` (a ChainID, an image reference or ``oci:DIR[:TAG]``)."""
    if image.startswith("sha256:"):
        return check_digest(image, "ChainID")
    from bootseer.images.registry import open_image

    with open_image(image, plain_http=plain_http) as source:
        resolved = source.resolve()
    if not resolved.diff_ids:
        raise ValueError(f"{image} has no layers")
    return chain_ids(resolved.diff_ids)[-1]


def _profiles(args: argparse.Namespace) -> list[str] | None:
    return None if args.profile is None else [check_profile(args.profile)]


async def _image_blocks(store: StoreReader, top: str) -> int | None:
    """The most blocks the image ``top`` can have, from its layers' chain records (what
    bounds its hot lists' rows, as the layer server bounds them by the indexes it serves);
    None if a record is missing or the chain is longer than a hot list may name."""
    total, current = 0, top
    for _ in range(MAX_LAYERS):
        record = await store.chain(current)
        if record is None:
            return None
        total += record_max_blocks(record)
        current = record.parent
        if not current:
            return total
    return None


async def _read_lists(url: str, top: str, profiles: list[str] | None) -> dict[str, HotList | Exception | None]:
    from bootseer.blockstore.objects.store import open_store
    from bootseer.fetch.source import NotFound

    out: dict[str, HotList | Exception | None] = {}
    async with open_store(url) as store:
        if profiles is None:
            try:
                entries = await store.engine.listdir(hotlist_dir(top))
                found = [profile_of_object(entry.name) for entry in entries]
                profiles = sorted(p for p in found if p is not None) or [""]
            except (NotFound, OSError):
                profiles = [""]
        try:
            blocks = await _image_blocks(store, top)
        except (FormatError, OSError):
            blocks = None  # the format's own bound, then
        for profile in profiles:
            try:
                data = await read_hot_list_object(store, top, profile, blocks)
                out[profile] = None if data is None else HotList.decode(
                    data, expected_image=top, expected_profile=profile, max_blocks=blocks
                )
            except (HotListError, FormatError, OSError) as exc:
                out[profile] = exc
    return out


def show_command(args: argparse.Namespace) -> int:
    try:
        top = top_chain_id(args.image, plain_http=args.plain_http)
        lists = trio.run(_read_lists, args.store, top, _profiles(args))
    except (ValueError, OSError, FormatError) as exc:
        return _fail(str(exc))
    except Exception as exc:  # ImageError and friends: a clear line, not a traceback
        return _fail(f"{type(exc).__name__}: {exc}")
    status = 0
    documents = []
    for profile, hot in lists.items():
        if hot is None:
            print(f"no hot list for {top} profile {profile or '(default)'} in {redact_url(args.store)}", file=sys.stderr)
            status = max(status, EXIT_MISSING)
        elif isinstance(hot, Exception):
            print(f"hot list for {top} profile {profile or '(default)'} is unusable (ignored by nodes): {hot}", file=sys.stderr)
            status = EXIT_ERROR
        else:
            document = summary(hot)
            if args.blocks:
                document["block_list"] = [b.__dict__ for b in hot.blocks]
            documents.append(document)
    if args.json:
        print(json.dumps(documents, indent=1))
        return status
    for document in documents:
        print(f"image      {document['image']}\nprofile    {document['profile']}")
        print(f"blocks     {document['blocks']}  ({document['bytes']} bytes stored, {document['raw_bytes']} raw)")
        print(f"span       {document['first_s']}s .. {document['last_s']}s after prepare ({document['span_s']}s)")
        print(f"recorded   {document['recorded_at']} on {document['node']} (container {document['container']}, "
              f"{document['duration_s']}s, sealed by {document['sealed_by']}, {document['unattributed']} unattributed)")  # fmt: skip
        for layer in document["layers"]:
            print(f"  layer {layer['chain_id']}  {layer['blocks']:>7} blocks  {layer['bytes']:>12} bytes")
        for block in document.get("block_list", []):
            print(f"    {block['at']:10.6f}s {block['layer'][:19]} {block['digest'][:16]} {block['clen']:>9}")
    return status


def _clear(args: argparse.Namespace, *, every: bool) -> tuple[str, list[str]]:
    from bootseer.blockstore.objects.store import open_store_writer

    top = top_chain_id(args.image, plain_http=args.plain_http)
    removed = []
    with open_store_writer(args.store) as writer:
        if every:
            names = [n for n in writer.list(hotlist_dir(top)) if profile_of_object(n) is not None]
        else:
            names = [hotlist_object(top, check_profile(args.profile or ""))]
        for name in names:
            if writer.remove(name):
                removed.append(name)
    return top, removed


def clear_command(args: argparse.Namespace) -> int:
    try:
        top, removed = _clear(args, every=args.all)
    except (ValueError, OSError, FormatError) as exc:
        return _fail(str(exc))
    except Exception as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    for name in removed:
        print(f"removed {name}")
    if not removed:
        print(f"no hot list for {top} in {redact_url(args.store)}", file=sys.stderr)
        return EXIT_MISSING
    return 0


def record_command(args: argparse.Namespace) -> int:
    try:
        top, removed = _clear(args, every=False)
    except (ValueError, OSError, FormatError) as exc:
        return _fail(str(exc))
    except Exception as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    what = "removed the old hot list; " if removed else ""
    print(f"{what}the next boot of {top} (profile {args.profile or '(default)'}) on a node of this store records a new one")
    return 0


def _client(root: str) -> LayerServerClient:
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    return LayerServerClient(ServerPaths(Path(root)).socket)


def seal_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.server.client import LayerServerError

    try:
        answer = _client(args.root).call({"op": "hotlist.seal", "container": args.container})
    except LayerServerError as exc:
        return _fail(str(exc))
    if not answer.get("sealed"):
        return _fail(str(answer.get("reason", "not sealed")), EXIT_MISSING)
    print(f"sealed the recording of {args.container}: {answer.get('blocks')} blocks, {answer.get('outcome')}")
    return 0


def status_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.server.client import LayerServerError

    try:
        answer = _client(args.root).call({"op": "hotlist.status"})
    except LayerServerError as exc:
        return _fail(str(exc))
    answer.pop("ok", None)
    print(json.dumps(answer, indent=1))
    return 0
