"""What a byte written into a local blob costs the node's kernel: new page-cache pages against reused ones.

A ``fanotify`` fill writes each verified block into the layer's blob (its one copy on the node), so its CPU
is the decompression and the hash of the block plus the kernel's cost of putting the bytes in new
page-cache pages of a sparse file.  This measures that cost per MB on this machine, beside the
decompression and SHA-256 of the same bytes, to say how much of the layer server's CPU in
``bench/lazy_bench.py`` is the kernel's:

* ``pages freed 15 s before``: ``pwrite`` of 1 MiB blocks into a new sparse file, the page cache
  dropped ``--settle`` seconds before (on a VM whose free pages go back to the host, each page is a
  new page for the host too: what a node that did other things meanwhile pays);
* ``pages freed just before``: the same right after a file of the same size was written and deleted
  (the pages freed a moment ago are taken again);
* ``zstd + sha256``: decompress frames of the same bytes (level 3) and hash them, one core.

Usage (root: it drops the page cache): ``python -m bench.page_cache_cost [--mb 300] [--dir /var/tmp]
[--settle 15] [--output bench/results/page-cache-cost.md]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import time
from pathlib import Path

import zstandard

from bench.common import drop_caches

BLOCK = 1 << 20


def _write(path: Path, blocks: list[bytes]) -> tuple[float, float]:
    """Seconds of wall and of this process's CPU (user + system) to write ``blocks`` into a new file at ``path``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, len(blocks) * BLOCK)
        wall, cpu = time.perf_counter(), time.process_time()
        for number, block in enumerate(blocks):
            os.pwrite(fd, block, number * BLOCK)
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        os.close(fd)
        path.unlink()


def _decode(frames: list[bytes], blocks: list[bytes]) -> tuple[float, float]:
    decompressor = zstandard.ZstdDecompressor()
    wall, cpu = time.perf_counter(), time.process_time()
    for frame, block in zip(frames, blocks):
        raw = decompressor.decompress(frame, max_output_size=len(block))
        hashlib.sha256(raw).digest()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=300, help="MiB written per case (300)")
    parser.add_argument("--dir", default="/var/tmp", help="a directory on the node cache's filesystem (/var/tmp)")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds between dropping the page cache and the first case (15)")
    parser.add_argument("--output", default="bench/results/page-cache-cost.md")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root: it drops the page cache")
    # Half random (incompressible), half repetitive: a frame of each kind, as a layer's blocks are.
    blocks = [os.urandom(BLOCK // 2) + bytes([n % 251]) * (BLOCK // 2) for n in range(args.mb)]
    frames = [zstandard.ZstdCompressor(level=3).compress(block) for block in blocks]
    path = Path(args.dir) / f".page-cache-cost-{os.getpid()}"
    rows = []
    drop_caches()
    time.sleep(args.settle)  # the pages freed go back to the host meanwhile (a VM's free page reporting)
    rows.append((f"sparse, pages freed {args.settle:g} s before (page cache dropped)", *_write(path, blocks)))
    _write(path, blocks)  # pages to free, taken again at once
    rows.append(("sparse, pages freed just before (a file of the same size written and deleted)", *_write(path, blocks)))
    rows.append(("zstd decompress + SHA-256 of the same bytes (one core)", *_decode(frames, blocks)))
    lines = [
        "# What a byte written into a local blob costs the kernel (bench/page_cache_cost.py)",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {os.cpu_count()} cores, "
        f"Linux {platform.release()}; directory {args.dir}; {args.mb} MiB per case in 1 MiB writes",
        f"- Command: `python -m bench.page_cache_cost --mb {args.mb} --dir {args.dir} --settle {args.settle:g} "
        f"--output {args.output}`",
        "",
        "| case | wall ms per MiB | CPU ms per MiB |",
        "|---|---|---|",
        *(f"| {name} | {wall * 1000 / args.mb:.2f} | {cpu * 1000 / args.mb:.2f} |" for name, wall, cpu in rows),
        "",
    ]
    Path(args.output).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
