"""The node block cache keeps its own file pages out of the page cache (issue 15, "Memory").

Residency is what ``mincore(2)`` says of a mapping of the entry file: which of its
pages the kernel's page cache holds.  A block written by the cache must be written
back and dropped, a block read to serve it must be dropped, and what the cache
serves stays exactly what it verified.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import random
import subprocess
from pathlib import Path

import pytest

from bootseer.blockstore.node.block_cache import BlockCache

BLOCK = 4 << 20  # a large block: 1,024 pages that would all stay resident

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (``mincore`` of a shared read-only mapping).

    Mapping a file faults nothing in, so the count is the page cache's, not ours.
    """
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the entry failed")
    finally:
        os.close(fd)
    try:
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(address, size, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(page & 1 for page in vector)
    finally:
        _libc.munmap(address, size)


@pytest.fixture
def cache(tmp_path: Path) -> BlockCache:
    # tmpfs pages are its storage: nothing can drop them, and the check would mean nothing.
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind}, whose pages are its storage")
    return BlockCache(str(tmp_path / "cache"), 64 << 20)


def block(seed: int) -> tuple[str, bytes]:
    data = random.Random(seed).randbytes(BLOCK)
    return hashlib.sha256(data).hexdigest(), data


def test_a_block_written_by_the_cache_is_not_left_resident(cache):
    digest, data = block(1)
    cache.put(digest, data)
    path = cache.path_of(digest)
    assert os.path.getsize(path) > BLOCK  # the whole entry is on disk
    assert resident_pages(path) == 0
    assert cache.get(digest) == data  # and reads back, verified


def test_a_block_read_by_the_cache_is_not_left_resident(cache):
    digest, data = block(2)
    cache.put(digest, data)
    path = cache.path_of(digest)
    with open(path, "rb") as entry:  # someone else's read puts the entry's pages in the page cache
        entry.read()
    assert resident_pages(path) > 0  # the measure sees pages when there are some
    assert cache.get(digest) == data
    assert resident_pages(path) == 0


def test_verification_is_unchanged_a_flipped_bit_is_a_miss_and_deleted(cache):
    digest, data = block(3)
    cache.put(digest, data)
    path = cache.path_of(digest)
    with open(path, "r+b") as entry:
        entry.seek(-1, os.SEEK_END)
        last = entry.read(1)
        entry.seek(-1, os.SEEK_END)
        entry.write(bytes([last[0] ^ 1]))
    assert cache.get(digest) is None
    assert not os.path.exists(path)
    assert cache.stats().corrupt == 1
