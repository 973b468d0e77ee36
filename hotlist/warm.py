"""Warming the kernel's page cache with an image's hot blocks, so the job's first reads never reach FUSE.

Prefetching a hot list puts its blocks in the node cache, but a read of one still costs a
FUSE request: in the layer server a round trip through the kernel, pyfuse3 and trio, a
node-cache read and a SHA-256 check.  Measured on a restored torch environment whose every
hot block was already in the node cache: 3,240 FUSE reads took 9.5 s of a 16.7 s import.
The kernel can serve those reads from its page cache instead, with no request at all, if
the pages are there: the layer server's files are opened with ``keep_cache``.

So, as each batch of the hot list is fetched (the raw blocks just verified, in memory), a
:class:`PageCacheWarmer` hands them to the kernel with FUSE's store notification
(``pyfuse3.notify_store``: the bytes go straight into the file's page cache, no read
request, no second verification), in the hot list's order, into the file the kernel reads
the layer's blocks from.  Which file that is depends on how the layer is served, which the
warmer is told per layer by a :data:`WarmTarget`:

* :class:`TreeTarget` (the per-file FUSE tree): overlayfs reads a lower file through that
  file's own page cache, so each block goes to the file offsets it backs.  The kernel takes
  a store only for an inode it holds, so the warmer first looks each file up through the
  server's own mount (``os.stat`` from the worker thread; the lookup is answered by the
  server's trio loop meanwhile), which also leaves the file's dentry cached for the job.  A
  block shared by several files (dedup: the same small ``INSTALLER``, ``__init__.py`` or
  licence in many packages) is stored into each of them, up to :data:`MAX_PLACEMENTS`
  files (the page cache is per file).
* :class:`BlobTarget` (EROFS answers the tree, its files' chunks in the layer's blob,
  ``blobs/<slot>``): EROFS reads the blob file buffered, through the blob's page cache, so
  block ``i`` goes to the blob at ``i * block_size``, once however many files share it, and
  no file is looked up.  Only the block's own bytes are stored, padded with zeros to the
  page (the blob holds zeros there): EROFS reads a chunk only up to its file's end, never
  the padding to ``block_size`` (measured: reads of 1.08x the data), and the kernel marks a
  stored page up to date only when it is whole.  The blob is looked up once (EROFS holds it
  open while it is mounted; the lookup makes the store land even before).

Nothing is opened or read through the mount, so the hot-list accounting (of opens and
reads) sees none of it.  What was stored is remembered (per block, the ranges), so that at
the prefetch's end :meth:`PageCacheWarmer.resident` can ask the kernel which of those
pages are still cached (``mincore(2)`` of a mapping of the file: no read, no fault): the
prefetch's account of what the page cache served (``hotlist.prefetch``).

The page cache stays the kernel's to manage: under memory pressure it drops the pages and
the job's read reaches FUSE and the node cache as without warming.  What is stored is
bounded by the hot list (the bytes the recorded boot read first).  A store that fails (an
inode the kernel dropped meanwhile: ENOENT; a kernel without store notifications: ENOSYS,
which turns warming off) is skipped: warming only ever saves time.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

from bootseer.blockstore.format import EntryType, LayerIndex
from bootseer.blockstore.layerfs import inode_number
from bootseer.hotlist.format import ResolvedBlock
from bootseer.log import get_logger

log = get_logger(__name__)

#: Files one block is stored into at most (a block in more files is a common small file).
MAX_PLACEMENTS = 16

PAGE_SIZE = mmap.PAGESIZE

#: ``store(inode, offset, data)``: put ``data`` into the kernel's page cache of ``inode``.
Store = Callable[[int, int, bytes], None]


def _notify_store(inode: int, offset: int, data: bytes) -> None:
    import pyfuse3

    pyfuse3.notify_store(inode, offset, data)


@dataclass(frozen=True)
class TreeTarget:
    """A layer served as a per-file FUSE tree: its blocks are cached in the files that hold them."""

    slot: int  #: the layer's slot (its files' inode numbers: ``layerfs.inode_number``)
    directory: str  #: the slot's directory in the server's mount (``ROOT/layers/mnt/<slot>``)


@dataclass(frozen=True)
class BlobTarget:
    """A layer whose tree the kernel's EROFS answers: its blocks are cached in its blob file."""

    path: str  #: the blob in the server's mount (``ROOT/layers/mnt/blobs/<slot>``)
    inode: int  #: its inode number (``layerfs.blob_inode_number``)


#: Where a layer's blocks live in the kernel's page cache (chosen by the layer's data path).
WarmTarget = Union[TreeTarget, BlobTarget]


@dataclass(frozen=True)
class Placement:
    """Where a block's bytes go: a file of the layer (its path in the mount, its inode) and an offset."""

    path: str
    inode: int
    offset: int
    length: int  #: the block's bytes stored there (the last block of a file may be short)
    padding: int = 0  #: zeros stored after them, to the page's end (a blob's partial last page)


class PageCacheWarmer:
    """Store hot blocks in the page cache of the files the kernel reads them from (see the module docstring).

    ``indexes`` maps each layer's ChainID to its index and ``targets`` to where its
    blocks live; ``digests`` are the blocks worth placing (the hot list's): for a tree
    target only those are mapped to files, in one pass over its index.
    """

    def __init__(
        self,
        indexes: dict[str, LayerIndex],
        targets: dict[str, WarmTarget],
        digests: set[str],
        store: Store = _notify_store,
    ) -> None:
        self._store = store
        self._indexes = indexes
        self._targets = targets
        self._where: dict[tuple[str, str], list[Placement]] = {}
        for layer, index in indexes.items():
            target = targets[layer]
            if isinstance(target, TreeTarget):
                self._place_in_files(layer, index, target, digests)
        self._looked_up: set[str] = set()
        #: (layer, digest) -> where its bytes were stored, for :meth:`resident`
        self.stored: dict[tuple[str, str], list[Placement]] = {}
        self.enabled = True
        self.stored_bytes = 0
        self.skipped = 0

    def _place_in_files(self, layer: str, index: LayerIndex, target: TreeTarget, digests: set[str]) -> None:
        for number, entry in enumerate(index.entries):
            if entry.type is not EntryType.FILE or entry.link is not None or not entry.blocks:
                continue
            for position, ref in enumerate(entry.blocks):
                digest = index.blocks[ref].digest
                if digest not in digests:
                    continue
                places = self._where.setdefault((layer, digest), [])
                offset = position * index.block_size  # within the file
                length = min(index.block_size, entry.size - offset)
                if length > 0 and len(places) < MAX_PLACEMENTS:
                    places.append(Placement(os.path.join(target.directory, entry.path),
                                            inode_number(target.slot, number), offset, length))  # fmt: skip

    def placements(self, layer: str, block: ResolvedBlock, size: int) -> list[Placement]:
        """Where ``block`` (``size`` raw bytes) of ``layer`` goes."""
        target = self._targets[layer]
        if isinstance(target, TreeTarget):
            return self._where.get((layer, block.hot.digest), [])
        index = self._indexes[layer]
        offset = index.blob_offset(block.ref)
        stored = min(-(-size // PAGE_SIZE) * PAGE_SIZE, index.block_size, index.blob_size - offset)
        if size <= 0 or stored < size:
            return []
        return [Placement(target.path, target.inode, offset, size, stored - size)]

    def warm(self, layer: str, blocks: Sequence[ResolvedBlock], data: Sequence[bytes]) -> int:
        """Blocking (a worker thread): store ``data`` (the raw bytes of ``blocks``, of ``layer``); bytes stored."""
        done = 0
        for block, payload in zip(blocks, data):
            for where in self.placements(layer, block, len(payload)):
                if not self.enabled:
                    break
                if len(payload) < where.length:
                    continue
                try:
                    if where.path not in self._looked_up:
                        os.stat(where.path)  # the kernel stores only into an inode it holds
                        self._looked_up.add(where.path)
                    chunk = payload if len(payload) == where.length else payload[: where.length]
                    self._store(where.inode, where.offset, chunk + bytes(where.padding) if where.padding else chunk)
                    done += where.length
                    self.stored.setdefault((layer, block.hot.digest), []).append(where)
                except OSError as exc:
                    self.skipped += 1
                    if exc.errno == errno.ENOSYS:
                        self.enabled = False
                        log.warning("the kernel takes no FUSE store notifications: prefetch warms no page cache")
                    else:
                        log.debug("page-cache warming skipped a block", path=where.path, offset=where.offset,
                                  error=str(exc))  # fmt: skip
        self.stored_bytes += done
        return done

    def resident(self) -> set[tuple[str, str]]:
        """Blocking: the (layer, digest) of the stored blocks whose every stored page is still in the page cache
        of at least one file it was stored into.  A file that cannot be checked counts as evicted."""
        by_path: dict[str, list[tuple[tuple[str, str], Placement]]] = {}
        for key, places in self.stored.items():
            for place in places:
                by_path.setdefault(place.path, []).append((key, place))
        found: set[tuple[str, str]] = set()
        for path, items in by_path.items():
            try:
                cached = cached_ranges(path, [(p.offset, p.length + p.padding) for _key, p in items])
            except OSError as exc:
                log.debug("cannot tell which warmed pages are still cached", path=path, error=str(exc))
                continue
            found.update(key for (key, _place), whole in zip(items, cached) if whole)
        return found


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached_ranges(path: str, ranges: Iterable[tuple[int, int]]) -> list[bool]:
    """Blocking: for each (offset, length) of file ``path``, whether all its pages are in the page cache.

    ``mincore(2)`` of a shared read-only mapping: the kernel answers from the file's page
    cache, reading and faulting nothing (the mapping is never touched).  For a file that
    is not the caller's, the kernel answers only to its owner or a writer (root here).
    """
    ranges = list(ranges)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        pages = -(-os.fstat(fd).st_size // PAGE_SIZE)
        # Only the pages the ranges span are mapped and asked about (a blob may be many GiB).
        low = min((offset // PAGE_SIZE for offset, length in ranges if length > 0), default=pages)
        high = min(pages, max((-(-(offset + length) // PAGE_SIZE) for offset, length in ranges), default=0))
        if low >= high:
            return [False] * len(ranges)
        size = (high - low) * PAGE_SIZE
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, low * PAGE_SIZE)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"cannot map {path}: {os.strerror(ctypes.get_errno())}")
        try:
            vector = (ctypes.c_ubyte * (high - low))()
            if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            _libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    answers = []
    for offset, length in ranges:
        first, end = offset // PAGE_SIZE, min(high, -(-(offset + length) // PAGE_SIZE))
        answers.append(length > 0 and first < end and all(vector[page - low] & 1 for page in range(first, end)))
    return answers


__all__ = ["BlobTarget", "Placement", "PageCacheWarmer", "Store", "TreeTarget", "WarmTarget", "cached_ranges"]
