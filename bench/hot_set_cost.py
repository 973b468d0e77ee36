"""What decompressing and hashing an image's hot set costs on one core: the yardstick of the layer server's CPU.

Issue 36 holds the layer server's CPU over a hot-list start to at most 2x the bare work its blocks need: each
stored zstd frame of the hot list decompressed and its SHA-256 checked against the block's digest, what the
block fetcher does to every block it fetches (:func:`blockstore.objects.format.decode_block`, one reused
decompressor per thread).  :func:`measure` does exactly that to the frames of a hot list in a store directory,
on the calling thread alone, so what it times is one core's work:

* the frames are read from their packs first (each block's ``[offset, offset + clen)`` of its pack, through the
  store's own reader, :class:`~blockstore.objects.store.FileStoreWriter`), all into memory: reading is not counted;
* then each frame is decoded in the list's order, timed as the thread's CPU time (:func:`time.thread_time`) and
  wall, the best (least CPU) of ``repeats`` passes, to lessen what other load on the machine adds;
* a frame that is not its block (missing, short, not decompressing to its raw length, another digest) raises
  :class:`HotSetError` naming the block: it is never counted.

``bench.lazy_bench`` measures the list each recording boot published (in the same run as the starts it is held
against), and ``bench.lazy_report`` sets the layer server's CPU over a hot-list start against it.  Standalone,
on a store directory holding a published hot list (the benchmark's ``CACHE/store-hot``)::

    .venv/bin/python -m bench.hot_set_cost --store /var/tmp/bootseer-bench/store-hot [--image sha256:TOP] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bench.common import BenchError
from bench.node import stored_hot_list
from bootseer.blockstore.objects.format import decode_block, pack_object
from bootseer.blockstore.objects.store import FileStoreWriter, StoreError
from bootseer.hotlist.format import HOTLIST_PREFIX, HotBlock, HotList, HotListError

MB = 1_000_000
#: Passes over the frames; the least CPU of them is the figure.
REPEATS = 3


class HotSetError(BenchError):
    """The hot set could not be measured: no list, or a frame that is not the block the list names."""


@dataclass(frozen=True)
class HotSetCost:
    """One core's decompression and SHA-256 check of every frame of a hot list (the best of the passes)."""

    blocks: int  #: the list's blocks (each frame decoded once per pass)
    stored_bytes: int  #: their frames' bytes, as the store holds them (the sum of ``clen``)
    raw_bytes: int  #: the bytes they decompress to (the sum of ``rlen``)
    cpu_seconds: float  #: the thread's CPU time for one pass (the least of the passes)
    wall_seconds: float  #: that pass's wall time


def _what(number: int, block: HotBlock) -> str:
    return (f"hot list block {number} (sha256:{block.digest} of layer {block.layer}, pack {block.pack} at "
            f"{block.offset}, {block.clen} bytes stored, {block.rlen} raw)")


def read_frames(store: Path, hot: HotList) -> list[tuple[HotBlock, bytes]]:
    """Each block of ``hot`` with its stored frame, read from its pack in the store directory ``store``;
    :class:`HotSetError` naming the first block whose frame is not there whole."""
    if not (store / "v1").is_dir():
        raise HotSetError(f"{store} is not a store directory (no v1/)")
    reader = FileStoreWriter(store)
    frames = []
    for number, block in enumerate(hot.blocks):
        try:
            data = reader.get_range(pack_object(block.pack), block.offset, block.clen)
        except StoreError as e:
            raise HotSetError(f"{_what(number, block)}: {e}") from None
        if data is None or len(data) != block.clen:
            got = "no such pack" if data is None else f"the pack ends after {len(data)} of its bytes"
            raise HotSetError(f"{_what(number, block)}: not in the store ({got})")
        frames.append((block, data))
    return frames


def decode_pass(frames: Sequence[tuple[HotBlock, bytes]]) -> HotSetCost:
    """Decompress and check every frame once on this thread; its CPU and wall time.  :class:`HotSetError` naming
    the first block whose frame does not decompress to its raw length with its digest."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for number, (block, data) in enumerate(frames):
        if decode_block(block, data) is None:
            raise HotSetError(f"{_what(number, block)}: its frame does not decompress to {block.rlen} bytes "
                              f"of that digest")
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return HotSetCost(blocks=len(frames), stored_bytes=sum(block.clen for block, _ in frames),
                      raw_bytes=sum(block.rlen for block, _ in frames), cpu_seconds=cpu, wall_seconds=wall)


def measure(store: Path, hot: HotList, repeats: int = REPEATS) -> HotSetCost:
    """The cost of decoding ``hot``'s frames from ``store`` on one core: the pass of least CPU of ``repeats``."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    frames = read_frames(store, hot)
    return min((decode_pass(frames) for _ in range(repeats)), key=lambda cost: cost.cpu_seconds)


def measure_published(store: Path, image: str, profile: str = "", repeats: int = REPEATS) -> HotSetCost:
    """:func:`measure` of the hot list of ``image`` (its top ChainID) and ``profile`` published in ``store``;
    :class:`HotSetError` if the store holds none, or one that does not decode."""
    try:
        hot = stored_hot_list(store, image, profile)
    except HotListError as e:
        raise HotSetError(f"{store}: the hot list of {image} does not decode: {e}") from None
    if hot is None:
        raise HotSetError(f"{store} holds no hot list of image {image}" + (f", profile {profile}" if profile else ""))
    return measure(store, hot, repeats)


def _only_image(store: Path) -> str:
    """The one image ``store`` holds hot lists of (``--image`` left out)."""
    found = sorted(path.name for path in (store / HOTLIST_PREFIX).glob("*") if path.is_dir())
    if len(found) != 1:
        raise HotSetError(f"{store / HOTLIST_PREFIX} holds hot lists of {len(found)} images "
                          f"({', '.join(found) or 'none'}): say which with --image")
    return f"sha256:{found[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="a store directory holding a published hot list")
    parser.add_argument("--image", help="the image's top ChainID (sha256:...; default: the one the store has lists of)")
    parser.add_argument("--profile", default="", help="the list's profile (default: the default list)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"passes; the least CPU is kept ({REPEATS})")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        image = args.image or _only_image(args.store)
        cost = measure_published(args.store, image, args.profile, args.repeats)
    except HotSetError as e:
        sys.exit(f"error: {e}")
    print(f"hot list of {image}{' profile ' + args.profile if args.profile else ''} in {args.store}: "
          f"{cost.blocks} blocks, {cost.stored_bytes / MB:.1f} MB stored, {cost.raw_bytes / MB:.1f} MB raw; "
          f"decompress + SHA-256 on one core, best of {args.repeats}: {cost.cpu_seconds:.3f} s CPU, "
          f"{cost.wall_seconds:.3f} s wall ({cost.cpu_seconds * 1000 / (cost.raw_bytes / MB or 1):.2f} ms CPU per "
          f"raw MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
