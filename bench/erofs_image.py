"""How long building a layer's EROFS image takes, how large it is, and that the kernel mounts it, on a real tree.

Walks a directory (``/usr`` by default) into a layer index of its metadata -- every
entry with its owner, mode, mtime, xattrs, link target, device number and hard links;
regular files get blocks of the right sizes with made-up digests, nothing is read --
then times :func:`blockstore.objects.erofs_image.write_image` (the median of ``--reps``), reports the
image's size, bytes per entry and the writer's peak Python memory, runs ``fsck.erofs``
on it (against a sparse blob of the right size) and, as root, mounts it and checks that
a stat walk of the mount sees every entry with the tree's metadata.

    .venv/bin/python -m bench.erofs_image [--root /usr] [--block-size 1048576] [--reps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from bootseer.blockstore.objects.erofs_image import write_image
from bootseer.blockstore.datapath.erofs_mount import mount_erofs, unmount_erofs
from bootseer.blockstore.objects.format import Block, Entry, EntryType, LayerIndex

_TYPES = {stat.S_IFREG: EntryType.FILE, stat.S_IFDIR: EntryType.DIR, stat.S_IFLNK: EntryType.SYMLINK,
          stat.S_IFCHR: EntryType.CHAR, stat.S_IFBLK: EntryType.BLOCK, stat.S_IFIFO: EntryType.FIFO}  # fmt: skip
_XATTR_NAMESPACES = ("user.", "trusted.", "security.")


def index_of_tree(root: Path, block_size: int) -> LayerIndex:
    """A layer index of ``root``'s metadata (depth first, children sorted; sockets and other devices' mounts skipped)."""
    entries: list[Entry] = []
    blocks: list[Block] = []
    first_path: dict[tuple[int, int], int] = {}
    device = os.lstat(root).st_dev

    def add(path: Path, relative: str) -> None:
        st = os.lstat(path)
        kind = _TYPES.get(stat.S_IFMT(st.st_mode))
        if kind is None or st.st_dev != device:
            return
        xattrs = {}
        if kind is not EntryType.SYMLINK:
            for name in os.listxattr(path, follow_symlinks=False):
                if name.startswith(_XATTR_NAMESPACES):
                    xattrs[name] = os.getxattr(path, name, follow_symlinks=False)
        common = dict(mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns, xattrs=xattrs)
        if kind is EntryType.FILE:
            if st.st_nlink > 1 and (st.st_dev, st.st_ino) in first_path:
                entries.append(Entry(relative, kind, link=first_path[(st.st_dev, st.st_ino)], **common))  # type: ignore[arg-type]
                return
            first_path[(st.st_dev, st.st_ino)] = len(entries)
            numbers = []
            for offset in range(0, st.st_size, block_size):
                length = min(block_size, st.st_size - offset)
                digest = hashlib.sha256(f"{relative}\0{offset}".encode("utf-8", "surrogateescape")).hexdigest()
                numbers.append(len(blocks))
                blocks.append(Block(digest, 0, 0, 1, length))
            entries.append(Entry(relative, kind, size=st.st_size, blocks=tuple(numbers), **common))  # type: ignore[arg-type]
        elif kind is EntryType.SYMLINK:
            target = os.readlink(path)
            entries.append(Entry(relative, kind, size=len(os.fsencode(target)), target=target, **common))  # type: ignore[arg-type]
        elif kind in (EntryType.CHAR, EntryType.BLOCK):
            entries.append(Entry(relative, kind, rdev=(os.major(st.st_rdev), os.minor(st.st_rdev)), **common))  # type: ignore[arg-type]
        else:
            entries.append(Entry(relative, kind, **common))  # type: ignore[arg-type]
        if kind is EntryType.DIR:
            for name in sorted(os.listdir(path)):
                add(path / name, f"{relative}/{name}" if relative else name)

    add(root, "")
    index = LayerIndex("sha256:" + "0" * 64, block_size, entries, blocks, ["0" * 64])
    index.validate()
    return index


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/usr"))
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sys.setrecursionlimit(10_000)
    started = time.perf_counter()
    index = index_of_tree(args.root, args.block_size)
    walked = time.perf_counter() - started
    files = sum(e.type is EntryType.FILE and e.link is None for e in index.entries)
    print(f"tree {args.root}: {len(index.entries)} entries ({files} files, {len(index.blocks)} blocks of {args.block_size}), "
          f"indexed in {walked:.2f} s")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="erofs-bench-", dir="/var/tmp") as work:
        image, blob = Path(work, "image.erofs"), Path(work, "blob")
        times, cpu_times = [], []
        for _ in range(args.reps):
            started, cpu_started = time.perf_counter(), time.process_time()
            with open(image, "wb") as out:
                size = write_image(index, out)
            times.append(time.perf_counter() - started)
            cpu_times.append(time.process_time() - cpu_started)
        tracemalloc.start()
        with open(os.devnull, "wb") as out:
            write_image(index, out)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        cpu = statistics.median(cpu_times)
        print(f"image: {size} bytes ({size / len(index.entries):.0f} per entry), built in {statistics.median(times):.2f} s wall, "
              f"{cpu:.2f} s CPU (medians of {args.reps}; {len(index.entries) / cpu:,.0f} entries per CPU second), "
              f"writer's peak Python memory {peak / 1e6:.1f} MB")  # fmt: skip
        with open(blob, "wb") as f:
            f.truncate(index.blob_size)
        checked = subprocess.run(["fsck.erofs", f"--device={blob}", str(image)], capture_output=True, text=True)
        print(f"fsck.erofs: {'ok' if checked.returncode == 0 else 'FAILED ' + checked.stderr.strip()}")
        if os.geteuid() != 0:
            return checked.returncode
        point = Path(work, "mnt")
        point.mkdir()
        mounted = mount_erofs(image, point, device=blob)
        try:
            seen = mismatched = 0
            for entry in index.entries[1:]:
                st = os.lstat(point / entry.path)
                seen += 1
                owner = index.entries[entry.link] if entry.link is not None else entry
                if (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns) != (owner.st_mode, owner.uid, owner.gid, owner.mtime_ns):
                    mismatched += 1
            print(f"kernel mount ({mounted.mode}): {seen} entries stat'ed, {mismatched} with other metadata than the tree's")
        finally:
            unmount_erofs(point)
        return 1 if checked.returncode or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
