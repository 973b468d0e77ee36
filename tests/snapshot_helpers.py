"""Shared helpers of the snapshotter tests: perform returned mounts for real, always undo them."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from bootseer.snapshotter.types import Mount


def mount_all(mounts: Sequence[Mount], target: str | os.PathLike) -> None:
    """Mount like containerd's ``mount.All``, using util-linux mount(8)."""
    for m in mounts:
        command = ["mount"]
        if m.type != "bind":
            command += ["-t", m.type]
        if m.options:
            command += ["-o", ",".join(m.options)]
        subprocess.run(command + [m.source, os.fspath(target)], check=True, capture_output=True, timeout=30)


def is_mountpoint(path: str | os.PathLike) -> bool:
    """From the mount table: ``os.path.ismount`` misses bind mounts within one filesystem."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as table:
        return any(line.split()[4] == path for line in table)


def unmount(target: str | os.PathLike) -> None:
    """Unmount everything on ``target`` (lazily if busy); fine if nothing is mounted."""
    for _ in range(16):  # mounts may be stacked
        if not is_mountpoint(target):
            return
        result = subprocess.run(["umount", os.fspath(target)], capture_output=True, timeout=30)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", os.fspath(target)], capture_output=True, timeout=30)
    assert not is_mountpoint(target), f"could not unmount {target}"


@contextmanager
def mounted(mounts: Sequence[Mount], target: str | os.PathLike) -> Iterator[Path]:
    """The mounts performed on ``target`` (created if needed) for the block."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    try:
        mount_all(mounts, target)
        yield target
    finally:
        unmount(target)


def write_files(root: str | os.PathLike, files: dict[str, str]) -> None:
    """Create ``files`` (relative path -> text) under ``root``, with parent dirs."""
    for name, text in files.items():
        path = Path(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def read_tree(root: str | os.PathLike) -> dict[str, str]:
    """Every regular file under ``root`` (relative path -> text) and every directory (-> '/')."""
    tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            tree[os.path.relpath(os.path.join(dirpath, name), root)] = "/"
        for name in filenames:
            path = os.path.join(dirpath, name)
            tree[os.path.relpath(path, root)] = Path(path).read_text()
    return tree


def snapshot_dirs(root: str | os.PathLike) -> set[str]:
    return set(os.listdir(Path(root, "snapshots")))
