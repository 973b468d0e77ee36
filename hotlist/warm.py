"""Warming the kernel's page cache with an image's hot blocks, so the job's first reads never reach FUSE.

Prefetching a hot list puts its blocks in the node cache, but a read of one still costs a
FUSE request: in the layer server a round trip through the kernel, pyfuse3 and trio, a
node-cache read and a SHA-256 check: on a restored torch environment whose every hot block
was already in the node cache, most of the import's time (bench/results/deps.md).
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
* :class:`BlobTarget` (the ``fanotify`` data path: EROFS over a local blob filled on the kernel's
  pre-access events, :mod:`bootseer.blockstore.datapath.local_blobs`): each block is written into
  the blob at its blob offset, in the hot list's order; it is then on disk and in the blob's page
  cache, and the job's read of it raises an event answered at once (or none, once the blob is
  whole).  Nothing is read back through the mount.
* :class:`ErofsTarget` (EROFS answers the tree, its files' chunks in the layer's blob):
  EROFS reads the blob with direct I/O (see :mod:`bootseer.blockstore.datapath.erofs_mount`), so
  the only page cache a block lands in is that of the EROFS files that hold it, and a
  store notification into the blob would be seen by no one.  The warmer reads the
  block's range of each such file through the EROFS mount instead (from its worker
  thread, ``POSIX_FADV_RANDOM`` so the read is exactly that range, no read-ahead into
  the file's next block): EROFS fills those pages from the blob, whose reads the layer
  server answers from the blocks the prefetch just put in the node cache.  Those blob
  reads are the warmer's, not a job's: while it reads, the block is listed in
  :class:`WarmReads`, which the hot-list service consults before it accounts a blob read.
  Files are opened beneath the mount's directory descriptor without following a symlink
  (``confined.open_beneath``): the tree is the store's word.

On the tree nothing is opened or read through the mount, and on EROFS the warmer's blob
reads are left out (:class:`WarmReads`), so the hot-list accounting (of opens and reads)
sees none of it.  What was stored is remembered (per block, the ranges), so that at
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

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, Union

from bootseer import confined, cpu
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import EntryType, LayerIndex
from bootseer.blockstore.datapath.local_blobs import BlobFill, LocalBlob
from bootseer.blockstore.datapath.tree import inode_number
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
class ErofsTarget:
    """A layer whose tree the kernel's EROFS answers: its blocks are read through the mount into its files' pages."""

    directory: str  #: the layer's EROFS mount (``ROOT/layers/lower/<slot>``)


@dataclass(frozen=True)
class BlobTarget:
    """A layer on the ``fanotify`` data path: its blocks are written into its local blob (disk and page
    cache), where EROFS reads them with no event answered late: nothing is read back through the mount."""

    blob: LocalBlob


#: Where a layer's blocks live in the kernel's page cache (chosen by the layer's data path).
WarmTarget = Union[TreeTarget, ErofsTarget, BlobTarget]


class WarmReads:
    """The blocks a warmer is reading through an EROFS mount at this moment, by (layer, block number).

    A blob read of such a block is the warmer's own (EROFS names no reader: the blob's
    opener is the server), so the hot-list service leaves it out of recordings and
    prefetch accounting.  Thread-safe: warmers mark from worker threads, the service
    asks from the FUSE loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading: Counter[tuple[str, int]] = Counter()

    @contextlib.contextmanager
    def reading(self, layer: str, ref: int) -> Iterator[None]:
        key = (layer, ref)
        with self._lock:
            self._reading[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[key] -= 1
                if not self._reading[key]:
                    del self._reading[key]

    def others(self, layer: str, refs: Iterable[int]) -> list[int]:
        """Those of ``refs`` (blocks of ``layer`` a blob read covers) that no warmer is reading."""
        with self._lock:
            if not self._reading:
                return list(refs)
            return [ref for ref in refs if (layer, ref) not in self._reading]


@dataclass(frozen=True)
class Placement:
    """Where a block's bytes go: a file of the layer (its path in the mount, its inode) and an offset."""

    path: str
    inode: int  #: for a store notification (a tree target's file); 0 on EROFS
    offset: int
    length: int  #: the block's bytes stored there (the last block of a file may be short)
    relpath: str = ""  #: the file beneath its EROFS mount (an EROFS target's)


class PageCacheWarmer:
    """Put hot blocks in the page cache of the files the kernel reads them from (see the module docstring).

    ``indexes`` maps each layer's ChainID to its index and ``targets`` to where its
    blocks live; ``digests`` are the blocks worth placing (the hot list's): only those
    are mapped to files, in one pass over each index.  ``reads`` is where an EROFS
    target's reads are announced (the hot-list service's :class:`WarmReads`).
    """

    def __init__(
        self,
        indexes: dict[str, LayerBlocks],
        targets: dict[str, WarmTarget],
        digests: set[str],
        store: Store = _notify_store,
        reads: WarmReads | None = None,
    ) -> None:
        self._store = store
        self._reads = reads if reads is not None else WarmReads()
        self._indexes = indexes
        self._targets = targets
        self._where: dict[tuple[str, str], list[Placement]] = {}
        for layer, index in indexes.items():
            if not isinstance(targets[layer], BlobTarget):  # a blob takes blocks at their blob offsets
                self._place_in_files(layer, index, targets[layer], digests)
        self._looked_up: set[str] = set()
        #: (layer, digest) -> where its bytes were stored, for :meth:`resident`
        self.stored: dict[tuple[str, str], list[Placement]] = {}
        #: The local blobs warmed (by path): mapped through their writers (see :func:`cached_ranges`).
        self._blobs: dict[str, LocalBlob] = {}
        self.enabled = True
        self.stored_bytes = 0
        self.skipped = 0

    def _place_in_files(self, layer: str, index: LayerBlocks, target: WarmTarget, digests: set[str]) -> None:
        if not isinstance(index, LayerIndex):  # a block table lists no files: the prefetch hands in the index
            raise ValueError(f"layer {layer}: placing blocks in files takes the layer's index, not its block table")
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
                if length <= 0 or len(places) >= MAX_PLACEMENTS:
                    continue
                path = os.path.join(target.directory, entry.path)
                if isinstance(target, TreeTarget):
                    places.append(Placement(path, inode_number(target.slot, number), offset, length))
                else:
                    places.append(Placement(path, 0, offset, length, relpath=entry.path))

    def placements(self, layer: str, block: ResolvedBlock) -> list[Placement]:
        """Where ``block`` of ``layer`` goes: the files that hold it (up to :data:`MAX_PLACEMENTS`)."""
        return self._where.get((layer, block.hot.digest), [])

    def wants_bytes(self, layer: str) -> bool:
        """Whether :meth:`warm` needs ``layer``'s blocks' bytes (a tree target's stores do; EROFS reads its own)."""
        return isinstance(self._targets[layer], (TreeTarget, BlobTarget))

    def sink(self, layer: str, refs: Sequence[int]) -> BlobFill | None:
        """A blob target's: the fetcher writes the blocks it fetches for ``refs`` straight into the layer's local
        blob (the one copy of them on the node; :meth:`warm` then finds them there), not the node cache."""
        target = self._targets.get(layer)
        return BlobFill(target.blob, refs, None) if isinstance(target, BlobTarget) else None

    def warm(self, layer: str, blocks: Sequence[ResolvedBlock], data: Sequence[bytes] | None) -> int:
        """Blocking (a worker thread): put ``blocks`` of ``layer`` in the page cache; file bytes placed.

        ``data`` are their raw bytes (verified), which a tree target stores; an EROFS
        target reads them through its mount and takes None.
        """
        with cpu.stage("page_cache_warm"):
            return self._warm(layer, blocks, data)

    def _warm(self, layer: str, blocks: Sequence[ResolvedBlock], data: Sequence[bytes] | None) -> int:
        target = self._targets[layer]
        if isinstance(target, BlobTarget):
            if data is None:
                raise ValueError("a blob target's warming writes the blocks' bytes: give them")
            try:
                target.blob.write([block.ref for block in blocks], data)
            except OSError as exc:  # a full disk, say: those blocks stay missing (a read fills them, or fails)
                self.skipped += len(blocks)
                log.warning("page-cache warming cannot write hot blocks into a local blob; skipped",
                            blob=str(target.blob.path), blocks=len(blocks), error=str(exc))  # fmt: skip
                return 0
            done = sum(len(payload) for payload in data)
            index = self._indexes[layer]
            self._blobs[str(target.blob.path)] = target.blob
            for block, payload in zip(blocks, data):  # what resident() asks the blob's page cache about
                where = Placement(str(target.blob.path), 0, index.blob_offset(block.ref), len(payload))
                self.stored.setdefault((layer, block.hot.digest), []).append(where)
        elif isinstance(target, ErofsTarget):
            done = self._read_through(layer, target, blocks)
        else:
            if data is None:
                raise ValueError("a tree target's warming stores the blocks' bytes: give them")
            done = self._notify(layer, blocks, data)
        self.stored_bytes += done
        return done

    def _notify(self, layer: str, blocks: Sequence[ResolvedBlock], data: Sequence[bytes]) -> int:
        done = 0
        for block, payload in zip(blocks, data):
            for where in self.placements(layer, block):
                if not self.enabled:
                    return done
                if len(payload) < where.length:
                    continue
                try:
                    if where.path not in self._looked_up:
                        os.stat(where.path)  # the kernel stores only into an inode it holds
                        self._looked_up.add(where.path)
                    self._store(where.inode, where.offset, payload if len(payload) == where.length else payload[: where.length])
                except OSError as exc:
                    self._skip(where, exc)
                    continue
                done += where.length
                self.stored.setdefault((layer, block.hot.digest), []).append(where)
        return done

    def _read_through(self, layer: str, target: ErofsTarget, blocks: Sequence[ResolvedBlock]) -> int:
        done = 0
        try:
            directory = confined.open_dir(target.directory)
        except OSError as exc:
            log.debug("page-cache warming cannot open the layer's EROFS mount", directory=target.directory, error=str(exc))
            self.skipped += len(blocks)
            return 0
        buffer = memoryview(bytearray(self._indexes[layer].block_size))
        try:
            for block in blocks:
                for where in self.placements(layer, block):
                    try:
                        with self._reads.reading(layer, block.ref):
                            _read_range(directory, where.relpath, where.offset, where.length, buffer)
                    except OSError as exc:
                        self._skip(where, exc)
                        continue
                    done += where.length
                    self.stored.setdefault((layer, block.hot.digest), []).append(where)
        finally:
            os.close(directory)
        return done

    def _skip(self, where: Placement, exc: OSError) -> None:
        self.skipped += 1
        if exc.errno == errno.ENOSYS and where.inode:
            self.enabled = False
            log.warning("the kernel takes no FUSE store notifications: prefetch warms no page cache")
        else:
            log.debug("page-cache warming skipped a block", path=where.path, offset=where.offset, error=str(exc))

    def resident(self) -> set[tuple[str, str]]:
        """Blocking: the (layer, digest) of the placed blocks whose every page is still in the page cache
        of at least one file it was placed in.  A file that cannot be checked counts as evicted."""
        by_path: dict[str, list[tuple[tuple[str, str], Placement]]] = {}
        for key, places in self.stored.items():
            for place in places:
                by_path.setdefault(place.path, []).append((key, place))
        found: set[tuple[str, str]] = set()
        for path, items in by_path.items():
            blob = self._blobs.get(path)
            if blob is not None and blob.closed:
                continue  # its layer is gone: nothing to ask
            try:
                cached = cached_ranges(path, [(p.offset, p.length) for _key, p in items],
                                       opened=blob.writer if blob is not None else None)  # fmt: skip
            except OSError as exc:
                log.debug("cannot tell which warmed pages are still cached", path=path, error=str(exc))
                continue
            found.update(key for (key, _place), whole in zip(items, cached) if whole)
        return found


def _read_range(directory: int, relpath: str, offset: int, length: int, buffer: memoryview) -> None:
    """Read ``length`` bytes at ``offset`` of ``relpath`` beneath ``directory`` (into ``buffer``, discarded),
    no read-ahead past them."""
    fd = confined.open_beneath(directory, relpath, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        # Without this the read's read-ahead would run into the file's next block, which no hot list named.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        position, end = offset, offset + length
        while position < end:
            got = os.preadv(fd, [buffer[: min(len(buffer), end - position)]], position)
            if got <= 0:
                raise OSError(errno.EIO, f"{relpath}: short read at {position} (the file ends before its block)")
            position += got
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached_ranges(path: str, ranges: Iterable[tuple[int, int]], *, opened: int | None = None) -> list[bool]:
    """Blocking: for each (offset, length) of file ``path``, whether all its pages are in the page cache.

    ``mincore(2)`` of a shared read-only mapping: the kernel answers from the file's page
    cache, reading and faulting nothing (the mapping is never touched).  For a file that
    is not the caller's, the kernel answers only to its owner or a writer (root here).
    ``opened``: map this descriptor of the file instead of opening ``path``.  A local blob
    must be mapped through its writer: the kernel raises a pre-access event for the whole
    mapped range of a marked file, and the writer was opened before the mark (no events).
    """
    ranges = list(ranges)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC) if opened is None else os.dup(opened)
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


__all__ = ["ErofsTarget", "Placement", "PageCacheWarmer", "Store", "TreeTarget", "WarmReads", "WarmTarget", "cached_ranges"]
