"""How long the bounded image check takes on a layer the size of the benchmark's torch layer.

Builds a seeded 25,000-entry layer index shaped like a Python site-packages layer
(directories of ``.py``/``.pyc``/``.so`` files, half of them small, some symlinks, hard
links and xattrs; 1 MiB blocks), writes its converter-built image (files of at most
4 KiB inline, as ``bootseer convert`` does by default), and times
:func:`blockstore.datapath.erofs_check.check_image` on it: the median of ``--reps`` runs on
one core. The baseline, measured in the same run, is what a node does without a
converter image: :func:`blockstore.objects.erofs_image.write_image` of the same index.

    .venv/bin/python -m bench.erofs_check_speed [--entries 25000] [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import random
import statistics
import time
from typing import Callable

from bootseer.blockstore.datapath.erofs_check import check_image
from bootseer.blockstore.objects.erofs_image import write_image
from bootseer.blockstore.objects.format import Block, Entry, EntryType, LayerIndex

BLOCK_SIZE = 1 << 20
INLINE_MAX = 4096


def site_packages_index(entries: int, seed: int = 24) -> tuple[LayerIndex, dict[int, bytes]]:
    """A valid index of about ``entries`` entries and the bytes of its files of at most 4 KiB (to inline)."""
    rng = random.Random(seed)
    blocks: list[Block] = []
    out = [Entry("", EntryType.DIR, 0o755)]
    inline: dict[int, bytes] = {}
    directories = [""]
    while len(out) < entries:
        parent = rng.choice(directories[-50:])  # mostly the newer directories: a deep, bushy tree
        if rng.random() < 0.08:
            path = f"{parent}/pkg{len(out)}" if parent else f"pkg{len(out)}"
            out.append(Entry(path, EntryType.DIR, 0o755, mtime_ns=1_700_000_000_000_000_000))
            directories.append(path)
            continue
        stem = f"{parent}/module_{len(out)}" if parent else f"module_{len(out)}"
        kind = rng.random()
        if kind < 0.03:
            out.append(Entry(stem + ".link", EntryType.SYMLINK, 0o777, size=len("../target.py"), target="../target.py"))
            continue
        size = rng.choice((rng.randrange(1, INLINE_MAX + 1), rng.randrange(INLINE_MAX, 3 * BLOCK_SIZE)))
        numbers = []
        for position in range(-(-size // BLOCK_SIZE)):
            rlen = min(BLOCK_SIZE, size - position * BLOCK_SIZE)
            numbers.append(len(blocks))
            blocks.append(Block(hashlib.sha256(len(blocks).to_bytes(8, "little")).hexdigest(), 0, 0, rlen // 2 + 1, rlen))
        xattrs = {"security.capability": bytes(20)} if kind < 0.05 else {}
        out.append(Entry(stem + (".py" if kind < 0.6 else ".so"), EntryType.FILE, 0o644, size=size, blocks=tuple(numbers), xattrs=xattrs))
        if size <= INLINE_MAX:
            inline[len(out) - 1] = rng.randbytes(size)
        if kind > 0.98 and len(out) < entries:
            out.append(Entry(stem + ".hardlink", EntryType.FILE, 0o644, link=len(out) - 1))
    return LayerIndex("sha256:" + "e" * 64, BLOCK_SIZE, out, blocks, ["f" * 64]), inline  # parents come before children


def timed(function: Callable[[], object], reps: int) -> tuple[float, float]:
    """The median and the least of ``reps`` wall times of ``function()`` (on a shared machine the least is the cost)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=25_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    index, inline = site_packages_index(args.entries)
    index.validate()
    out = io.BytesIO()
    write_image(index, out, inline=inline)
    image = out.getvalue()
    limits = dict(blob_size=index.blob_size, chunk_size=index.block_size, max_inodes=len(index.entries))
    summary = check_image(image, **limits)
    check, check_least = timed(lambda: check_image(image, **limits), args.reps)
    build, _ = timed(lambda: write_image(index, io.BytesIO()), args.reps)
    print(f"entries {len(index.entries)}, inodes {summary.inodes} ({summary.directories} directories, {summary.files} files), "
          f"image {len(image) / 1e6:.1f} MB with {summary.inline_bytes / 1e6:.1f} MB of small files inline, {summary.chunks} chunks")
    print(f"check_image: {check * 1000:.1f} ms (median of {args.reps}, least {check_least * 1000:.1f} ms; "
          f"{check / summary.inodes * 1e6:.1f} µs per inode)")
    print(f"baseline, write_image of the same index (node-built, no inline data): {build * 1000:.1f} ms "
          f"(check / build = {check / build:.2f})")


if __name__ == "__main__":
    main()
