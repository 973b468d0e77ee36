"""What "small" should mean for the converter's EROFS images: bytes added to the images against FUSE reads saved.

One command (``.venv/bin/python -m bench.inline_choice``), no root, nothing started: it reads the benchmark's
converted store (``CACHE/store``, :mod:`bench.lazy_bench`'s) and one recorded start's hot list (the
``hot-cold`` scenario's copy of a store, ``CACHE/store-hot-built`` by default: a start on node-built images,
where every file read reaches the layer's blob), and for each ``inline_max`` of ``--thresholds``
(0, 2K, 4K, 8K, 16K, 32K, 64K) reports, per layer and in all:

* the files the converter would put inline (``layer_image.inline_candidates``: regular files of at most
  ``inline_max`` bytes, its own choice and bound) and their bytes;
* the image it would publish: written by the converter's writer (``erofs_image.write_image``) with those
  files' real bytes (read from the store's packs and checked), raw, and cut into blocks of the layer's block
  size each zstd-compressed at the converter's level (what the store holds and a node fetches at the pull;
  dedup between blocks left out);
* FUSE reads saved per start: the hot list's blocks (a start's first touches, by layer and digest) that belong
  to inlined files alone: each such file is one read of the blob on the EROFS path that the image serves
  instead (``inline_max`` 0 saves none);
* the change of the bytes over the link before the first output, estimated: the image's stored bytes added
  (fetched whole at the pull) less the stored bytes of the inlined blocks the start read (no longer fetched
  from the blob), against ``--link-mb START=MB`` (today's starts on node-built images: lazy-cold's and
  hot-cold's bytes from bench/results/lazy-images.md), the issue's bound being 1.1x.

Writes ``bench/results/inline-choice.md`` (``--output``).  Confirming a threshold for real is
``lazy_bench --modes lazy --image-sources converter --inline-max N`` (a store converted with that bound).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import zstandard

from bench import image_build
from bench.common import code_version, log
from bootseer.blockstore.convert.converter import BLOCK_ZSTD_LEVEL
from bootseer.blockstore.convert.layer_image import inline_candidates
from bootseer.blockstore.objects.erofs_image import build_image
from bootseer.blockstore.objects.format import (
    ChainRecord, LayerIndex, StoredBlock, chain_object, decode_block, index_object, pack_object,
)
from bootseer.hotlist.format import HotList, hotlist_object
from bootseer.units import parse_size
from tests.support.oci import chain_ids

KIB = 1024
MB = 1_000_000
THRESHOLDS = (0, 2 * KIB, 4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB)
#: The issue's bound: bytes over the link before the first output, against today's (node-built images).
TARGET_LINK_RATIO = 1.1


def layer_indexes(store: Path, image: image_build.Image) -> list[tuple[str, str, LayerIndex]]:
    """(layer name, ChainID, index) of each layer of the benchmark image in ``store``, bottom first."""
    found = []
    for layer, chain in zip(image.layers, chain_ids([layer.diff_id for layer in image.layers])):
        record = ChainRecord.decode((store / chain_object(chain)).read_bytes(), expected_chain_id=chain)
        index = LayerIndex.decode((store / index_object(record.index)).read_bytes(), expected_sha256=record.index,
                                  record=record)
        found.append((layer.name, chain, index))
    return found


def hot_list(hot_store: Path, image: image_build.Image) -> HotList:
    """The image's default hot list in ``hot_store``."""
    top = chain_ids([layer.diff_id for layer in image.layers])[-1]
    return HotList.decode((hot_store / hotlist_object(top)).read_bytes(), expected_image=top, expected_profile="")


def small_file_bytes(store: Path, index: LayerIndex, numbers: dict[int, Any]) -> dict[int, bytes]:
    """The bytes of the files ``numbers`` (entry number -> its one block), read from ``store``'s packs and checked
    against their digests."""
    out: dict[int, bytes] = {}
    packs: dict[str, Any] = {}
    try:
        for number, block in sorted(numbers.items(), key=lambda item: (item[1].pack, item[1].offset)):
            if block.is_zero:
                out[number] = bytes(block.rlen)
                continue
            name = index.packs[block.pack]
            if name not in packs:
                packs[name] = open(store / pack_object(name), "rb")  # noqa: SIM115 - closed below
            pack = packs[name]
            pack.seek(block.offset)
            raw = decode_block(StoredBlock(block.digest, name, block.offset, block.clen, block.rlen),
                               pack.read(block.clen))
            if raw is None:
                raise SystemExit(f"block sha256:{block.digest} of {index.entries[number].path!r} does not read back")
            out[number] = raw
    finally:
        for pack in packs.values():
            pack.close()
    return out


def stored_bytes(data: bytes, block_size: int) -> int:
    """``data`` cut into ``block_size`` pieces, each zstd-compressed at the converter's level: its stored bytes."""
    compressor = zstandard.ZstdCompressor(level=BLOCK_ZSTD_LEVEL)
    return sum(min(len(piece), len(compressor.compress(piece)))
               for piece in (data[at:at + block_size] for at in range(0, len(data), block_size)))


def measure(store: Path, hot: HotList, layers: list[tuple[str, str, LayerIndex]],
            thresholds: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Per threshold, per layer: inlined files and bytes, the image's raw and stored bytes, reads saved."""
    hot_by_layer = Counter((block.layer, block.digest) for block in hot.blocks)
    hot_digests = {key[1] for key in hot_by_layer}
    results: dict[int, list[dict[str, Any]]] = {}
    largest = max(thresholds)
    for name, chain, index in layers:
        log(f"{name}: {len(index.entries)} entries")
        everything = small_file_bytes(store, index, inline_candidates(index, largest))
        # Which entries use each block: a block read is saved only when every file using it is inline.
        users: dict[int, list[int]] = {}
        for number, entry in enumerate(index.entries):
            for block_number in entry.blocks:
                users.setdefault(block_number, []).append(number)
        hot_blocks = {number for number, block in enumerate(index.blocks)
                      if block.digest in hot_digests and (chain, block.digest) in hot_by_layer}
        for threshold in thresholds:
            chosen = inline_candidates(index, threshold) if threshold else {}
            inline = {number: everything[number] for number in chosen}
            image = build_image(index, inline=inline)
            saved = [number for number in hot_blocks if users.get(number)
                     and all(user in chosen for user in users[number])]
            results.setdefault(threshold, []).append({
                "layer": name, "files": len(chosen), "inline_bytes": sum(map(len, inline.values())),
                "inline_stored": stored_bytes(b"".join(inline.values()), index.block_size),
                "image_raw": len(image), "image_stored": stored_bytes(image, index.block_size),
                "reads_saved": len(saved), "saved_stored": sum(index.blocks[number].clen for number in saved),
            })
            log(f"  inline_max {threshold}: {len(chosen)} files, image {len(image) / MB:.1f} MB, "
                f"reads saved {len(saved)}")
    return results


def report(args: argparse.Namespace, hot: HotList, results: dict[int, list[dict[str, Any]]],
           layers: list[tuple[str, str, LayerIndex]]) -> str:
    def total(threshold: int, key: str) -> int:
        return sum(row[key] for row in results[threshold])

    base_raw, base_stored = total(0, "image_raw"), total(0, "image_stored")
    lines = [
        "# What \"small\" means: files inline in the converter's EROFS images", "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Command: `{shlex.join(['python', '-m', 'bench.inline_choice', *sys.argv[1:]])}`",
        f"- Code: {code_version()}",
        f"- Store: `{args.store}` (the benchmark image, {len(layers)} layers, "
        f"{sum(len(index.entries) for _, _, index in layers)} entries); hot list: `{args.hot_store}` "
        f"({len(hot.blocks)} blocks, {hot.total_bytes / MB:.1f} MB stored, recorded by `{hot.recorder}`, "
        f"container {hot.container}, sealed by {hot.sealed_by})",
        "- Inline: the converter's own choice (`layer_image.inline_candidates`: regular files of 1..inline_max bytes "
        "in one block, within its bound on an image's inline bytes); image: the converter's writer "
        "(`erofs_image.write_image`) with those files' bytes from the store's packs; stored: the image cut into the "
        f"layer's blocks, each zstd level {BLOCK_ZSTD_LEVEL} (as the converter stores them, dedup left out)",
        "- Reads saved per start: the hot list's blocks (first touches by layer and digest) used only by inlined "
        "files: each is one FUSE read of the layer's blob on the EROFS path that the image now serves",
        "- Link change before the first output (estimate): image stored bytes added (fetched whole at the pull) "
        "less the stored bytes of the saved blocks (no longer fetched from the blob)", "",
        "| inline_max | files inline | inline bytes, raw (MB) | inline bytes, zstd (MB) | images raw (MB) | "
        "images stored (MB) | stored added (MB) | FUSE reads saved / start | blocks saved, stored (MB) | "
        "link change (MB) | " + " | ".join(f"× today's {start}" for start in args.link_mb) + " |",
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(args.link_mb),
    ]
    for threshold in sorted(results):
        added = total(threshold, "image_stored") - base_stored
        change = added - total(threshold, "saved_stored")
        lines.append(
            f"| {threshold // KIB}K | {total(threshold, 'files')} | {total(threshold, 'inline_bytes') / MB:.1f} | "
            f"{total(threshold, 'inline_stored') / MB:.1f} | {total(threshold, 'image_raw') / MB:.1f} | "
            f"{total(threshold, 'image_stored') / MB:.1f} | {added / MB:+.1f} | {total(threshold, 'reads_saved')} | "
            f"{total(threshold, 'saved_stored') / MB:.1f} | {change / MB:+.1f} | "
            + "".join(f"{(mb * MB + change) / (mb * MB):.3f}×"
                      f"{'' if mb * MB + change <= TARGET_LINK_RATIO * mb * MB else ' (over 1.1×)'} | "
                      for mb in args.link_mb.values()).rstrip())
    lines += ["", f"Images at inline_max 0 (the node-built image, metadata only): {base_raw / MB:.1f} MB raw, "
              f"{base_stored / MB:.1f} MB stored. Today's link bytes before the first output (node-built images, "
              "`--link-mb`): " + (", ".join(f"{start} {mb:.1f} MB" for start, mb in args.link_mb.items())
                                  or "not given") + "."]
    lines += ["", "Per layer (files inline / FUSE reads saved per start / image stored MB):", "",
              "| inline_max | " + " | ".join(name for name, _, _ in layers) + " |",
              "|---|" + "---|" * len(layers)]
    for threshold in sorted(results):
        lines.append(f"| {threshold // KIB}K | " + " | ".join(
            f"{row['files']} / {row['reads_saved']} / {row['image_stored'] / MB:.1f}" for row in results[threshold])
            + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=image_build.DEFAULT_CACHE_DIR,
                        help=f"the benchmark's cache (lazy_bench's; {image_build.DEFAULT_CACHE_DIR})")
    parser.add_argument("--store", type=Path, help="the converted store (CACHE/store)")
    parser.add_argument("--hot-store", type=Path,
                        help="a store holding the image's hot list (CACHE/store-hot-built: recorded on node-built "
                             "images; else CACHE/store-hot)")
    parser.add_argument("--thresholds", default=",".join(f"{t // KIB}K" for t in THRESHOLDS),
                        help="comma-separated inline_max values (0,2K,4K,8K,16K,32K,64K)")
    parser.add_argument("--link-mb", action="append", default=[], metavar="START=MB",
                        help="today's bytes over the link before the first output of a start on node-built images "
                             "(e.g. lazy-cold=172.5); repeatable")
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parent / "results" / "inline-choice.md")
    args = parser.parse_args(argv)
    try:
        args.link_mb = {start: float(mb) for start, _, mb in (item.partition("=") for item in args.link_mb)}
    except ValueError:
        parser.error("--link-mb takes START=MB, e.g. lazy-cold=172.5")
    args.store = args.store or args.cache_dir / "store"
    if args.hot_store is None:
        built = args.cache_dir / "store-hot-built"
        args.hot_store = built if (built / "v1" / "hotlists").is_dir() else args.cache_dir / "store-hot"
    args.thresholds = sorted({0, *(parse_size(t) if t.strip() != "0" else 0 for t in args.thresholds.split(","))})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    image = image_build.build_image(args.cache_dir, 2)  # cached: the built image's description
    layers = layer_indexes(args.store, image)
    hot = hot_list(args.hot_store, image)
    results = measure(args.store, hot, layers, args.thresholds)
    text = report(args, hot, results, layers)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    log(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
