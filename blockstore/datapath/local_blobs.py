"""The ``fanotify`` data path's blobs: sparse files on the node's disk, filled on the kernel's pre-access events.

On this path a layer's EROFS image (local and complete, as on ``erofs``) is mounted with
``device=`` a :class:`LocalBlob`: a sparse file of the layer's blob geometry
(:meth:`LayerIndex.blob_offset`) in ``CACHE/blobs/<index>.blob``, marked for pre-access
events of the node's fanotify group (:mod:`.fanotify`).  EROFS reads it buffered, as any
file; a read of a range whose blocks are not all on disk raises an event, which
:class:`FanotifyBlobs` answers: it fetches the missing blocks (memory, node cache, peers,
store: the one :class:`~bootseer.blockstore.node.layer_reader.LayerReader` path, read-ahead
included, every block SHA-256-verified by the fetcher), writes them into the blob through
the blob's *writer* (a descriptor opened before the mark: its writes raise no event), notes
them in the blob's fill map, and allows the read; a block that cannot be had or fails
verification is answered ``EIO``, and nothing is written.  A read whose blocks are all on
disk is allowed at once, and a blob whose every block is on disk loses its mark: from then
on the kernel reads it with no userspace at all.

Which blocks are on disk is the fill map ``CACHE/blobs/<index>.filled`` (a header naming
the boot, then a byte per block), written after the block: a crash leaves it behind the
blob, never ahead.  After a reboot the page cache the map relied on is gone (a block noted in
the map may never have reached the disk), so a map of another boot is trusted only block by
block: every block it claims is hashed against its digest (:mod:`.blob_check`, as for a blob
no server held cleanly), those that fail are missing again, and the header then names this boot.

The group is held, and its events read, by the event holder (:mod:`.event_holder`): the
layer server may be killed or upgraded at any time and the reads waiting on it resume when
the next server is up.  :class:`HolderLink` is the server's end of that socket.

A layer's blob is the node's copy of its blocks: it outlives its mounts and the server's
restarts (the last unmount closes it cleanly and keeps it; the next mount of its index opens it
again with its fill map), within ``--cache-size`` together with the node cache, evicted whole,
least recently used first, once no layer uses it (:mod:`.blob_store`).  Peers are served from
the blocks on disk in the open blobs (:mod:`.blob_blocks`, the block fetcher's
:class:`~bootseer.blockstore.node.local_blocks.LocalBlocks`).  The node cache is content-addressed
(deduplicated across layers); it holds the blocks the fetcher gets for anything but a blob fill
(the per-file tree's reads, the other data paths' FUSE blob reads, the EROFS images' blocks).
"""

from __future__ import annotations

import errno
import fcntl
import bisect
import dataclasses
import functools
import os
import socket
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Collection, Container, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import prometheus_client
import trio

from bootseer import cpu
from bootseer.blockstore.datapath import blob_check, fanotify
from bootseer.blockstore.datapath.blob_blocks import FilledBlocks, FilledBlocksStatistics
from bootseer.blockstore.datapath.blob_store import BlobStore, BlobStoreStatistics
from bootseer.blockstore.datapath.background_fill import BackgroundFill, BackgroundFillStatistics
from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.datapath.fill_group import FILL_GROUP, group_starts
from bootseer.blockstore.datapath.event_holder import (
    AHEAD,
    ANSWERED,
    BATCH,
    FIRST_READ,
    DONE,
    EVENT,
    EVENTS,
    FIRST,
    FORGET,
    GROUP,
    HELLO,
    HOLE_WAIT,
    IDLE_EXIT,
    KEEP,
    MESSAGE_SIZE,
    READY,
    REFUSED,
    RELEASE,
    WRITER,
    holder_argv,
    mirror_message,
    received_fds,
    rights,
)
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.fetch.retry import is_permanent
from bootseer.fetch.stripes import FetchError
from bootseer.log import get_logger
from bootseer.paths import ServerPaths

if TYPE_CHECKING:
    from bootseer.blockstore.datapath.tree import LayerTree

log = get_logger(__name__)

EVENT_OUTCOMES = prometheus_client.Counter(
    "bootseer_fanotify_events",
    "Pre-access events of local blobs answered, by outcome: present (every block on disk already), filled "
    "(blocks fetched and written first), denied (a block could not be had or failed verification: EIO), "
    "store_failing (blocks to fetch from a store whose fetch failed within the engine's failure memory: EIO at "
    "once, nothing fetched), write_failed (fetched blocks could not be written into the blob, a full disk say: "
    "ENOSPC or EDQUOT as the write failed, else EIO; nothing noted as on disk), "
    "unknown (a file this server serves no blob of: EIO)",
    ["outcome"],
)
for _outcome in ("present", "filled", "denied", "store_failing", "write_failed", "unknown"):
    EVENT_OUTCOMES.labels(_outcome)
FILL_SECONDS = prometheus_client.Histogram(
    "bootseer_fanotify_fill_seconds", "Seconds from a pre-access event's arrival to its answer, for events that filled blocks",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BLOBS = prometheus_client.Gauge("bootseer_local_blobs", "Local blobs of served layers, by state", ["state"])

_MAP_MAGIC = b"BSBLOBMAP1"
FILLED, UNREAD = 1, 2  #: a fill map's bytes: 0 missing, 1 on disk, 2 addressed by no file of the image (3: AHEAD)
_MAP_HEADER = struct.Struct("<10s36sQ")  #: magic, boot id, blocks
HOLDER_CONNECT_TIMEOUT = 30.0
#: Worker threads writing fills into blobs at once (page-cache writes: they release the interpreter lock).
WRITE_THREADS = 4
#: Seconds between two looks at which blobs a recording watches (:meth:`FanotifyBlobs._settle`).
SETTLE_INTERVAL = 0.5
#: Seconds a whole blob with blocks written ahead and not read keeps its mark after the last recording of its layer
#: (:meth:`FanotifyBlobs._watched`): a recording that starts meanwhile still sees their first reads.
WATCH_HOLD = 60.0


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a short write goes on; no progress at all is ENOSPC)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "a write into a local blob made no progress")
        view, offset = view[written:], offset + written


def _runs(refs: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ``refs`` as runs of adjacent numbers: (start, stop) each."""
    out: list[tuple[int, int]] = []
    for ref in refs:
        if out and out[-1][1] == ref:
            out[-1] = (out[-1][0], ref + 1)
        else:
            out.append((ref, ref + 1))
    return out


class BlobFill:
    """A fill's :class:`~bootseer.blockstore.objects.format.BlockSink`: the blocks the fetcher verifies go straight
    into the blob (one worker-thread call decodes, hashes and writes a batch), never into the node cache.

    With ``read`` (the blocks a waiting read needs) those are written first, and ``on_read`` is called (from the
    worker thread: it must be thread-safe) once they are all on disk, before the rest of the batch is written: the
    read goes on while the fill group's other blocks are written."""

    def __init__(self, blob: LocalBlob, refs: Sequence[int], read: Container[int] | None,
                 on_read: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.blob, self.read, self.on_read = blob, read, on_read
        self._refs: dict[str, list[int]] = {}
        for ref in refs:
            self._refs.setdefault(blob.index.blocks[ref].digest, []).append(ref)
        self.completed = False  #: a put completed the blob

    def put(self, blocks: Sequence[tuple[str, bytes]]) -> None:
        first: list[tuple[int, bytes]] = []
        rest: list[tuple[int, bytes]] = []
        read = self.read
        for digest, raw in blocks:
            for ref in self._refs.get(digest, ()):
                (first if read is not None and ref in read else rest).append((ref, raw))
        try:
            for part in (first, rest):
                if part and self.blob.write([ref for ref, _ in part], [raw for _, raw in part], read):
                    self.completed = True
                if part is first and first and self.on_read is not None and not self.blob.missing_of(read):
                    self.on_read()
        except OSError as exc:
            raise BlobWriteError(exc.errno or errno.EIO, f"writing into {self.blob.path}: {exc.strerror or exc}") from None


class BlobWriteError(OSError):
    """Verified blocks could not be written into a local blob (a full disk, say): raised through the fetch that
    handed them over, and told apart from the fetch's own failures (the read fails with this errno)."""


def boot_id() -> str:
    """This boot's id (the kernel's random ``boot_id``)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as source:
        return source.read().strip()


class LocalBlob:
    """One layer's blob on the node's disk: its writer, its fill map, and whether it is still marked.

    Made by :meth:`FanotifyBlobs.open`; every method that touches the disk blocks (worker threads).  Opened
    again over a kept blob and its map (made anew, or adopted from the event holder's kept writer), it first
    checks every block the map claims against the blob (:mod:`.blob_check`: size, holes, and digests unless
    the files are as this boot's last clean close left them: a map of another boot is always hashed in full)
    and drops those that fail: they are fetched again.
    """

    def __init__(self, directory: Path, index_name: str, index: LayerBlocks, writer: int | None, group: int,
                 addressed: Callable[[], Collection[int]] | None = None, *,
                 fill_group: int = FILL_GROUP) -> None:  # fmt: skip
        self.name = index_name
        self.index = index
        self.path = directory / f"{index_name}.blob"
        self.map_path = directory / f"{index_name}.filled"
        self.group = group
        self.trees: list[LayerTree] = []  #: the served layers whose device it is (their reader, observer, name)
        blocks = len(index.blocks)
        boot = self._boot = boot_id()
        adopted = writer is not None
        filled = bytearray(blocks)
        #: What checking this boot's blob against its map found when it was opened again (None: started anew).
        self.check: blob_check.CheckResult | None = None
        #: An adopted blob that was whole (unmarked) lost blocks to the check: it is marked again, and a kept mount
        #: that opened it while it had holes raises events for them again; one that opened it whole (its open raises
        #: no events, ever) would read their holes: to be sure, the server mounts it again over the marked blob.
        self.needs_remount = False
        record = self._take_close_record()  # opened for serving: no record until the next clean close
        map_fd = os.open(self.map_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        opened = -1
        was_missing = True
        try:
            header = os.pread(map_fd, _MAP_HEADER.size, 0)
            magic, their_boot, their_blocks = _MAP_HEADER.unpack(header) if len(header) == _MAP_HEADER.size else (b"", b"", -1)
            layers = magic == _MAP_MAGIC and their_blocks == blocks  # a map of this layer's geometry
            ours = layers and their_boot == boot.encode()
            #: The map is of an earlier boot (the node rebooted since it was written): every block it claims is
            #: hashed against its digest before it is served (the page cache it relied on is gone).
            self.other_boot = layers and not ours and not adopted
            trusted = (ours or self.other_boot) and (adopted or self.path.is_file())
            if trusted:
                got = os.pread(map_fd, blocks, _MAP_HEADER.size)
                filled[: len(got)] = bytes(b if b in (FILLED, UNREAD, AHEAD) else 0 for b in got)
                was_missing = 0 in filled
            elif adopted:
                raise OSError(errno.EUCLEAN, f"the fill map {self.map_path} of a blob still marked is not this boot's")
            else:  # a new blob, or a map not of this layer's (or a blob gone): start it again, empty
                # All-zero blocks are holes in the image (never read through it): never missing.
                for ref, block in enumerate(index.blocks):
                    if block.is_zero:
                        filled[ref] = UNREAD
                os.ftruncate(map_fd, 0)
                os.pwrite(map_fd, _MAP_HEADER.pack(_MAP_MAGIC, boot.encode(), blocks) + bytes(filled), 0)
                with open(self.path, "wb"):
                    pass
            if not adopted:
                # Opened before the mark: writes through it never wait for the group.
                writer = opened = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            assert writer is not None
            if trusted:  # before the blob is extended: a blob cut short loses the blocks past its end
                self.check = self._check_claims(writer, map_fd, filled, record, adopted)
                if self.other_boot:  # checked (and what failed dropped): the map is this boot's from now on
                    os.pwrite(map_fd, _MAP_HEADER.pack(_MAP_MAGIC, boot.encode(), blocks), 0)
                self.needs_remount = adopted and not was_missing and bool(self.check.dropped)
                if self.needs_remount:
                    log.warning("a whole local blob kept across a restart lost blocks to its check: a mount made over "
                                "it while it was whole reads their holes until it is mounted again", index=index_name)  # fmt: skip
            if os.fstat(writer).st_size != index.blob_size:
                os.ftruncate(writer, index.blob_size)
        except BaseException:
            if opened >= 0:
                os.close(opened)
            os.close(map_fd)
            raise
        self.writer = writer
        self.map_fd = map_fd  #: the fill map (the event holder maps it too)
        self.filled = filled
        self.missing_count = filled.count(0)
        stat = os.fstat(writer)
        self.inode = (stat.st_dev, stat.st_ino)
        self.marked = adopted and was_missing  # an adopted blob with holes is marked; a whole one was unmarked
        self._lock = threading.Lock()  #: event fills and the hot-list prefetch write from worker threads
        self.closed = False
        #: The blocks the image's files address (a parse of the image: asked only when the blob is nearly whole).
        self._addressed = addressed
        #: An upper bound of the blocks no file may address: those of one-block files that fit a block (their
        #: data may be inline in the image).  Below it, the blob may be whole already: the image is asked.
        self._maybe_unread = index.small_files
        self._noted = False
        self._cursor = 0  #: where :meth:`next_missing` looks next
        self._group_starts = group_starts(index.blocks, fill_group)  #: each fill group's first block (.fill_group)
        #: A recording takes this layer's first reads (:meth:`FanotifyBlobs.settle`): a whole blob with blocks
        #: written ahead and not yet read stays marked, so that their first reads are still seen.
        self.watched = False

    def _take_close_record(self) -> blob_check.CloseRecord | None:
        """The record of this blob's last clean close, taken (deleted): any crash from now on leaves none."""
        return blob_check.take_record(blob_check.record_path(self.path))

    def _check_claims(self, writer: int, map_fd: int, filled: bytearray, record: blob_check.CloseRecord | None,
                      adopted: bool) -> blob_check.CheckResult:  # fmt: skip
        """Check the blocks this boot's map claims against the blob before any is served (:mod:`.blob_check`:
        size, holes, and digests unless ``record`` shows both files as their last clean close left them); those
        that fail are 0 in ``filled`` and the map, and holes in the blob.  One log line per blob."""
        # A record of another boot never matches (it names its boot): a rebooted node's blob is hashed in full.
        verify = self.other_boot or not blob_check.unchanged_since(record, writer, map_fd, self._boot)
        result = blob_check.check_claims(writer, self.index, filled, verify=verify)
        if result.dropped:
            blob_check.drop(writer, map_fd, _MAP_HEADER.size, self.index, result.dropped)
        hashed = result.claimed - len(result.beyond_end) - len(result.in_holes) if verify else 0
        (log.warning if result.dropped else log.info)(
            "local blob checked before it is served" + ("; blocks that failed are fetched again" if result.dropped else ""),
            index=self.name, adopted=adopted, other_boot=self.other_boot, claimed=result.claimed, verified=verify, hashed=hashed,
            dropped=len(result.dropped), beyond_end=len(result.beyond_end), in_holes=len(result.in_holes),
            corrupt=len(result.corrupt), seconds=round(result.seconds, 3),
        )  # fmt: skip
        return result

    def record_clean_close(self) -> bool:
        """Record that the blob and its fill map are as a clean stop leaves them (``<index>.closed``,
        :func:`.blob_check.write_record`), so that the next server to open the blob skips re-hashing its blocks
        if neither file changed meanwhile.  Call it once no fill writes any more (the server's orderly stop;
        :meth:`close` does it): a later write only costs the next open a full re-verification.  False if no
        record was written (closed, or an error: logged).  Blocking."""
        if self.closed:
            return False
        try:
            with self._lock:
                blob_check.write_record(blob_check.record_path(self.path), self.writer, self.map_fd, self._boot)
        except OSError as exc:  # no record: the next open verifies every block, as after a crash
            log.warning("cannot record a local blob's clean close", index=self.name, error=str(exc))
            return False
        return True

    @property
    def complete(self) -> bool:
        return self.missing_count == 0

    def missing(self, refs: range) -> list[int]:
        filled = self.filled
        return [ref for ref in refs if not filled[ref]]

    def missing_of(self, refs: Container[int] | None) -> bool:
        """Whether a block of ``refs`` (a range, or None: none) is not on disk."""
        return isinstance(refs, range) and 0 in self.filled[refs.start : refs.stop]

    def next_missing(self, limit: int) -> list[int]:
        """The next run of missing blocks, adjacent in the blob (one range of its packs, mostly), of at most
        ``limit`` stored bytes (one block at least), after the last run this gave; [] if none is missing."""
        start = self.filled.find(0, self._cursor)
        if start < 0:
            start = self.filled.find(0)
        if start < 0:
            return []
        refs, total, blocks = [], 0, self.index.blocks
        for ref in range(start, len(self.filled)):
            if self.filled[ref] or (refs and total + blocks[ref].clen > limit):
                break
            refs.append(ref)
            total += blocks[ref].clen
        self._cursor = refs[-1] + 1
        return refs

    def stored_bytes(self, refs: Sequence[int]) -> int:
        """The stored (compressed) bytes of blocks ``refs``."""
        blocks = self.index.blocks
        return sum(blocks[ref].clen for ref in refs)

    def group_of(self, refs: range) -> range:
        """The blocks of the fill groups ``refs`` touches: runs of adjacent blocks of the blob of at most the fill
        group's raw bytes (or one block), fixed by the index alone, so that reads of one group coalesce."""
        if not refs:
            return refs
        starts = self._group_starts
        first = starts[bisect.bisect_right(starts, refs.start) - 1]
        after = bisect.bisect_right(starts, refs.stop - 1)
        return range(first, starts[after] if after < len(starts) else len(self.filled))

    def first_reads(self, refs: range) -> list[int]:
        """The blocks of ``refs`` written ahead of any read (:data:`AHEAD`), now read: noted filled (map and
        memory); which.  A page-cache write of a few bytes: any thread."""
        if AHEAD not in self.filled[refs.start : refs.stop]:
            return []
        read: list[int] = []
        with self._lock:
            if self.closed:
                return []
            for ref in refs:
                if self.filled[ref] == AHEAD:
                    self.filled[ref] = FILLED
                    read.append(ref)
            for start, stop in _runs(read):
                os.pwrite(self.map_fd, bytes(self.filled[start:stop]), _MAP_HEADER.size + start)
        return read

    def mark(self) -> None:
        """Mark the blob (before EROFS opens it), unless every block is on disk."""
        if not self.complete and not self.marked:
            fanotify.mark(self.group, self.writer)
            self.marked = True

    def note_unread_if_near(self) -> bool:
        """Ask the image which blocks its files address, once, when the blob may be whole but for blocks no file
        reads (:meth:`note_unread`); True if that completed it.  Blocking; any thread."""
        if self._noted or self._addressed is None or self.missing_count > self._maybe_unread or self.closed:
            return False
        self._noted = True
        try:
            addressed = self._addressed()
        except (OSError, ValueError) as exc:  # refused now, but it was checked before it was mounted: stay marked
            log.warning("cannot tell which blocks of a local blob its image addresses; it stays marked",
                        index=self.name, error=str(exc))  # fmt: skip
            return False
        return self.note_unread(addressed)

    def note_unread(self, addressed: Collection[int]) -> bool:
        """Note the blocks that no file of the EROFS image addresses (``addressed``: those it does; the others'
        files have their data in the image) as never read: they never keep the blob from being whole.  True
        if that completed it.  Blocking; any thread; idempotent."""
        addressed = set(addressed)
        with self._lock:
            if self.closed:
                return False
            for ref, state in enumerate(self.filled):
                if not state and ref not in addressed:
                    self.filled[ref] = UNREAD
                    self.missing_count -= 1
            os.pwrite(self.map_fd, bytes(self.filled), _MAP_HEADER.size)  # behind the blob at worst, never ahead
        return self.complete_if_whole()

    def write(self, refs: Sequence[int], data: Sequence[bytes], read: Container[int] | None = None) -> bool:
        """Put verified blocks ``refs`` (``data``, each as stored) in the blob, then in the fill map, those not on
        disk yet: as :data:`FILLED` those of ``read`` (all when None), as :data:`AHEAD` the others (written ahead of
        any read: their first read is still told to the server).  True if that completed the blob (its mark is then
        removed).  Adjacent full blocks go in one ``pwritev``.  Blocking; any thread."""
        with cpu.stage("blob_fill"):
            return self._write(refs, data, read)

    def _write(self, refs: Sequence[int], data: Sequence[bytes], read: Container[int] | None) -> bool:
        filled, block_size = self.filled, self.index.block_size
        todo = sorted((ref, block) for ref, block in zip(refs, data) if not filled[ref])
        if not todo:
            return False
        # Runs of adjacent slots, each block but the run's last filling its slot: one write each.
        run: list[tuple[int, bytes]] = []
        for item in todo:
            if run and (item[0] != run[-1][0] + 1 or len(run[-1][1]) != block_size):
                self._write_run(run)
                run = []
            run.append(item)
        self._write_run(run)
        noted: list[int] = []
        with self._lock:
            if self.closed:
                return False
            for ref, _ in todo:
                if not filled[ref]:
                    filled[ref] = FILLED if read is None or ref in read else AHEAD
                    self.missing_count -= 1
                    noted.append(ref)
            for start, stop in _runs(noted):  # behind the blob's bytes, never ahead
                os.pwrite(self.map_fd, bytes(filled[start:stop]), _MAP_HEADER.size + start)
        return self.note_unread_if_near() or self.complete_if_whole()

    def _write_run(self, run: Sequence[tuple[int, bytes]]) -> None:
        """Write blocks of adjacent slots, whole (or OSError: never noted as on disk half-written)."""
        offset = self.index.blob_offset(run[0][0])
        if len(run) == 1:
            _pwrite_all(self.writer, run[0][1], offset)
            return
        buffers = [block for _, block in run]
        total = sum(len(block) for block in buffers)
        written = os.pwritev(self.writer, buffers, offset)
        if written < total:  # a short write (a signal, a nearly full disk): the rest one block at a time
            done = 0
            for block in buffers:
                if done + len(block) > written:
                    skip = max(0, written - done)
                    _pwrite_all(self.writer, memoryview(block)[skip:], offset + done + skip)
                done += len(block)

    def complete_if_whole(self) -> bool:
        """Unmark the blob if every block is on disk, unless it is :attr:`watched` with blocks written ahead and not
        yet read; True if it was unmarked now.  Blocking (a syscall); any thread."""
        with self._lock:
            if not (self.complete and self.marked) or (self.watched and AHEAD in self.filled):
                return False
            self.marked = False
            try:
                fanotify.unmark(self.group, self.writer)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
        log.info("local blob complete: its mark is removed, the kernel reads it alone now", index=self.name)
        return True

    def duplicate_writer(self) -> int | None:
        """A duplicate of the blob's writer (its reads raise no event), for the caller to close; None once the blob
        is closed.  Any thread: taken under the blob's lock, so a writer closed meanwhile is never duplicated."""
        with self._lock:
            return None if self.closed else os.dup(self.writer)

    def close(self, *, remove: bool) -> None:
        """Unmark (a blob whose layer is gone), close, and with ``remove`` delete the clean-close record, the map and
        the blob, in that order (a kill between leaves a blob without its map: :meth:`.BlobStore.sweep` removes it);
        without, record the clean close first (:meth:`record_clean_close`): the blob is kept, for the next mount of
        its index, within the blob directory's budget (:mod:`.blob_store`)."""
        if self.marked:
            try:
                fanotify.unmark(self.group, self.writer)
            except OSError:
                pass
            self.marked = False
        if not remove:
            self.record_clean_close()
        with self._lock:
            self.closed = True
            os.close(self.writer)
            os.close(self.map_fd)
        if remove:
            blob_check.record_path(self.path).unlink(missing_ok=True)
            self.map_path.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)


class HolderLink:
    """The layer server's end of the event holder's socket (:mod:`.event_holder`), made again whenever the
    holder it talks to dies (its standby takes over, or this server starts a holder seeded with what it holds)."""

    def __init__(self, paths: ServerPaths, *, hole_wait: float = HOLE_WAIT, idle_exit: float = IDLE_EXIT,
                 lock_fd: int | None = None) -> None:  # fmt: skip
        self.paths = paths
        self.hole_wait, self.idle_exit = hole_wait, idle_exit
        self.lock_fd = lock_fd  #: the blob directory's lock (:func:`hold_blob_directory`): the holders hold it too
        self.sock: trio.socket.SocketType | None = None
        self.group = -1  #: the group (a dup of the holder's): marks and answers go through it
        self.writers: dict[str, int] = {}  #: the blob writers the holder kept, by blob name (taken by :meth:`FanotifyBlobs.open`)
        self.adopted = False  #: the holder was up already: the group, its marks and mounts outlived a server
        self._sending = trio.Lock()

    async def connect(self, seed: Callable[[], HolderSeed] | None = None) -> set[str]:
        """Connect to the root's holder, starting one if none answers: seeded by ``seed()`` once this server
        holds the group (both holders died), else with a new group.  The names of the blobs whose writers
        the holder offered (on the first connection, :attr:`writers` takes the writers; later they are closed).
        FanotifyError if the holder refuses (another server is connected) or does not answer."""
        first = self.group < 0
        sock = await _connect(self.paths.events_socket)
        started = sock is None
        if sock is None:
            _start_holder(self.paths, hole_wait=self.hole_wait, idle_exit=self.idle_exit, lock_fd=self.lock_fd,
                          seed=seed() if seed is not None and not first else None)  # fmt: skip
            sock = await _connect(self.paths.events_socket)
            if sock is None:
                raise fanotify.FanotifyError(errno.ECONNREFUSED, f"the event holder did not answer on {self.paths.events_socket}")
        offered: set[str] = set()
        try:
            with trio.fail_after(HOLDER_CONNECT_TIMEOUT):
                while True:
                    data, ancillary, _flags, _ = await sock.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * 4))
                    fds = received_fds(ancillary)
                    if not data:
                        raise fanotify.FanotifyError(errno.ECONNRESET, "the event holder closed the connection")
                    if data[:1] == REFUSED:
                        raise fanotify.FanotifyError(errno.EBUSY, f"the event holder refused: {data[1:].decode(errors='replace')}")
                    if data[:1] == HELLO and fds:
                        fd = fds.pop(0)
                        if first and self.group < 0:
                            self.group = fd
                        else:
                            os.close(fd)  # the same group: this server holds it already
                    elif data[:1] == WRITER and fds:
                        name = data[1:].decode(errors="replace")
                        offered.add(name)
                        if first:
                            self.writers[name] = fds.pop(0)
                    elif data[:1] == READY:
                        break
                    for fd in fds:
                        os.close(fd)
        except BaseException:
            sock.close()
            raise
        if self.group < 0:
            sock.close()
            raise fanotify.FanotifyError(errno.EPROTO, "the event holder sent no group")
        if first:
            self.adopted = not started
        self.sock = sock
        log.info("event holder connected", adopted=not started, writers=len(offered), socket=str(self.paths.events_socket),
                 again=not first)  # fmt: skip
        return offered

    def disconnect(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    async def _send(self, data: bytes, fds: Sequence[int] = ()) -> bool:
        """Send one message; False if the holder is gone (what it missed is sent again once a holder is back)."""
        async with self._sending:
            if self.sock is None:
                return False
            try:
                await self.sock.sendmsg([data], rights(fds))
            except OSError as exc:
                log.debug("the event holder did not take a message", kind=data[:1].decode(errors="replace"), error=str(exc))
                return False
            return True

    async def done(self, numbers: Sequence[int]) -> None:
        for start in range(0, len(numbers), 1000):
            await self._send(DONE + struct.pack(f"<{len(numbers[start:start + 1000])}i", *numbers[start : start + 1000]))

    async def keep(self, name: str, writer: int, fill_map: int) -> None:
        """The holder keeps blob ``name``'s writer (for the next server) and its fill map (to answer itself
        the events whose blocks are all on disk)."""
        await self._send(KEEP + name.encode(), [writer, fill_map])

    async def forget(self, name: str) -> None:
        await self._send(FORGET + name.encode())

    async def release(self) -> None:
        await self._send(RELEASE)

    async def events(self) -> HolderMessage:
        """The holder's next message: a batch of events (holder's number, event with this process's descriptor),
        the count of events it answered itself, or a first read of blocks written ahead; ``alive`` False: the
        holder is gone."""
        assert self.sock is not None
        try:
            data, ancillary, _flags, _ = await self.sock.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * 64))
        except OSError:
            return HolderMessage(alive=False)
        fds = received_fds(ancillary)
        if not data or data[:1] != EVENTS:
            for fd in fds:
                os.close(fd)
            kind, body = data[:1], data[1:]
            if kind == ANSWERED and len(body) >= 8:
                return HolderMessage(answered=struct.unpack("<Q", body[:8])[0])
            if kind == FIRST_READ and len(body) > FIRST.size:
                pid, offset, count = FIRST.unpack(body[: FIRST.size])
                name = body[FIRST.size :].decode("ascii", "replace")
                return HolderMessage(first_read=FirstRead(name, pid, offset, count))
            return HolderMessage(alive=bool(data))
        out = []
        for position, (number, pid, offset, count) in enumerate(EVENT.iter_unpack(data[1 : 1 + EVENT.size * len(fds)])):
            out.append((number, fanotify.Event(fds[position], pid, offset, count)))
        return HolderMessage(events=out)


@dataclass(frozen=True)
class FirstRead:
    """A read the holder allowed that reached blocks of blob ``name`` written ahead of any read."""

    name: str
    pid: int
    offset: int
    count: int


@dataclass(frozen=True)
class HolderMessage:
    """One message of the event holder, as :meth:`HolderLink.events` reads it."""

    events: list[tuple[int, fanotify.Event]] = dataclasses.field(default_factory=list)  #: (holder's number, event)
    alive: bool = True  #: False: the holder is gone
    answered: int | None = None  #: the count of events it answered itself, when the message is that
    first_read: FirstRead | None = None


@dataclass(frozen=True)
class HolderSeed:
    """What a server gives the holder it starts when both holders died: the group, each blob's name, writer
    and fill map, and the events it was given and has not answered (holder number, event)."""

    group: int
    blobs: list[tuple[str, int, int]]
    events: list[tuple[int, fanotify.Event]]


async def _connect(path: Path) -> trio.socket.SocketType | None:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        await sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


def _start_holder(paths: ServerPaths, *, hole_wait: float, idle_exit: float, seed: HolderSeed | None = None,
                  lock_fd: int | None = None) -> None:
    """Start the root's event holder on a listening socket made here (connections queue until it accepts):
    with a new group, or with ``seed`` (handed over on a socket pair it takes over from once it closes); it
    holds ``lock_fd`` (the blob directory's lock) for as long as it or a standby of it lives."""
    path = paths.events_socket
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if seed is not None else (None, None)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(8)
        with open(paths.events_log, "ab") as holder_log:
            subprocess.Popen(
                holder_argv(str(paths.root), listener.fileno(), hole_wait=hole_wait, idle_exit=idle_exit,
                            standby_fd=theirs.fileno() if theirs is not None else None, lock_fd=lock_fd),
                pass_fds=[listener.fileno()] + [fd for fd in (theirs and theirs.fileno(), lock_fd) if fd is not None],
                start_new_session=True, stdin=subprocess.DEVNULL, stdout=holder_log, stderr=holder_log,
            )  # fmt: skip
        if ours is not None and seed is not None:
            ours.settimeout(HOLDER_CONNECT_TIMEOUT)
            ours.sendmsg([GROUP], rights([seed.group]))
            for name, writer, fill_map in seed.blobs:
                ours.sendmsg([KEEP + name.encode()], rights([writer, fill_map]))
            now = time.monotonic()
            for start in range(0, len(seed.events), BATCH):
                batch = [(number, event, now) for number, event in seed.events[start : start + BATCH]]
                ours.sendmsg([mirror_message(batch)], rights([event.fd for _n, event, _s in batch]))
    finally:
        listener.close()
        for end in (ours, theirs):
            if end is not None:
                end.close()  # ours closed: the seeded holder takes over
    if seed is not None:
        log.warning("started an event holder seeded with this server's group, blobs and events (both holders were gone)",
                    blobs=len(seed.blobs), events=len(seed.events), socket=str(path))  # fmt: skip
    else:
        log.info("started the event holder (it holds the fanotify group across server restarts)", socket=str(path))


@dataclass(frozen=True)
class FanotifyStatistics:
    """What :meth:`FanotifyBlobs.statistics` reports."""

    blobs: int  #: local blobs open
    complete: int  #: of them, every block on disk (unmarked, unless held)
    held_marked: int  #: of the complete ones, those kept marked while a recording watches their unread blocks
    settle_rounds: int  #: looks at which blobs a recording watches so far (every SETTLE_INTERVAL seconds)
    missing_blocks: int  #: blocks not yet on disk, all blobs together
    pending: int  #: events being answered now
    answered: int  #: events answered by this server
    answered_by_holder: int  #: events the event holder answered itself (every block on disk), since it started
    fills: int  #: fills made (each the missing blocks of a read's fill groups, in one batch)
    first_reads: int  #: blocks written ahead of any read whose first read the holder told this server
    holder_adopted: bool  #: the group outlived a server: this one took it over
    background_fill: BackgroundFillStatistics  #: the fill of the blobs' rest while the link is idle
    store: BlobStoreStatistics  #: the blob directory's budget: blobs kept with no layer, evictions
    peer_reads: FilledBlocksStatistics  #: blocks peers were served from the blobs


#: The lock file of a blob directory (:func:`hold_blob_directory`): the pid and root of the server holding it.
BLOB_DIRECTORY_LOCK = "server.lock"


class BlobDirectoryInUse(ValueError):
    """Another layer server holds the blob directory (the message names its pid and root, on one line).

    A ``ValueError``, as a cache directory that cannot be written is (``block_cache.check_cache_dir``): the
    server refuses to start with that line and exit status 2."""


def hold_blob_directory(directory: Path, root: Path) -> int:
    """Lock ``directory`` (a server's ``CACHE/blobs``) for this process's life, for the server of ``root``; the
    lock file's descriptor (closing it, or the process's end, releases it).

    Two servers on one ``--cache-dir`` would share its blobs and fill maps, each marking them with its own
    group, and readers would wait in both groups' events: the second one is refused here with
    :class:`BlobDirectoryInUse`.  The lock is an ``flock`` of ``directory/server.lock``, which records the
    holder's pid and root.  The root's event holders hold it too (:func:`_start_holder` passes it on), so a
    server killed while the holders keep its blobs leaves the directory locked for its root: the next server
    of the same root goes through (the lock's record names its root), any other is refused."""
    path = directory / BLOB_DIRECTORY_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip().split("\n", 1)
        if len(holder) > 1 and holder[1] == str(root):
            return fd  # held for this root by its event holders (a server before this one): ours to use
        os.close(fd)
        pid = holder[0] if holder and holder[0].isdigit() else "?"
        other = holder[1] if len(holder) > 1 else "?"
        raise BlobDirectoryInUse(f"the blob directory {directory} is another layer server's (pid {pid}, root {other}): "
                                 f"give each root its own --cache-dir") from None  # fmt: skip
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{root}\n".encode(), 0)
    return fd


class FailingStores:
    """The stores (each a layer reader's :attr:`~.tree.BlockReader.store`) whose fetch for a fill failed
    lately, each until the engine's failure memory of it ends (``Engine.failure_memory``: ``retry_timeout``, at most
    10 s; :mod:`bootseer.fetch.failures`).

    The kernel raises a read's pre-access events one after another (a block or a few each, the next once the
    last is denied): were each to fetch, a store that fails would make each wait its own ``retry_timeout`` (a
    1 MiB read waited four).  So while a store is failing, an event that needs blocks fetched from it is denied
    at once (EIO), as the engine fails a stripe it remembers failing: a read fails within one ``retry_timeout``
    whatever the number of its blocks, as on the other data paths.  Blocks on disk are still served, and a fill
    from that store that succeeds ends it.  Runs in the trio thread (trio's clock)."""

    def __init__(self) -> None:
        self._until: weakref.WeakKeyDictionary[Hashable, float] = weakref.WeakKeyDictionary()

    def failing(self, store: Hashable) -> float:
        """Seconds ``store`` is still taken as failing (0: it is not)."""
        until = self._until.get(store)
        if until is None:
            return 0.0
        left = until - trio.current_time()
        if left <= 0:
            self._until.pop(store, None)
            return 0.0
        return left

    def failed(self, store: Hashable, seconds: float) -> bool:
        """``store``'s fetch failed after its retries: take it as failing for ``seconds``; True if it was not yet."""
        new = not self.failing(store)
        if seconds > 0:
            self._until[store] = trio.current_time() + seconds
        return new

    def served(self, store: Hashable) -> None:
        """``store`` served a fill: it is no longer taken as failing."""
        self._until.pop(store, None)


def _store_failed(exc: BaseException) -> bool:
    """Whether a fill's fetch error is its store failing until the engine gave up retrying (``FetchError`` chained
    to what the store raised, a retried error): not an answer that failed at once (a missing object: no wait to
    spare), nor a block refused by its verification (which says nothing of the other blocks)."""
    return isinstance(exc, FetchError) and exc.__cause__ is not None and not is_permanent(exc.__cause__)


class FanotifyBlobs:
    """The local blobs of one layer server and the answers to their events (see the module docstring)."""

    def __init__(self, paths: ServerPaths, directory: Path, addressed: Callable[[Path, LayerBlocks], Collection[int]],
                 *, budget: int, hole_wait: float = HOLE_WAIT,
                 background: BackgroundFillConfig = BackgroundFillConfig(enabled=False),
                 fetched: Callable[[], int] = lambda: 0, cache_bytes: Callable[[], int] = lambda: 0,
                 fill_group: int = FILL_GROUP) -> None:  # fmt: skip
        self.paths = paths
        #: The blob directory's budget (``budget``: ``--cache-size``, shared with the node cache, whose bytes on disk
        #: ``cache_bytes`` gives): blobs kept once no layer uses them, evicted whole (:mod:`.blob_store`).
        self.store = BlobStore(directory, budget, in_use=self._in_use, cache_bytes=cache_bytes)
        #: The blocks on disk in the open blobs, by digest: what peers are served from (:mod:`.blob_blocks`).
        self.filled_blocks = FilledBlocks()
        #: Fills the rest of the blobs once the node is idle: nothing fetched (``fetched``: every store's bytes
        #: fetched so far) and no blob read (the events answered, here and by the holder).
        self.background: BackgroundFill[LocalBlob] = BackgroundFill(
            background, lambda: list(self.blobs.values()), self.fill_in_background,
            lambda: fetched() + self._answered_total + self._holder_answered)  # fmt: skip
        #: Seconds a read of a hole may wait with no server before the holder denies it EIO (``[datapath] hole_wait``).
        self.hole_wait = hole_wait
        #: Raw bytes an event fills at once (``[datapath] fill_group``: :mod:`.fill_group`).
        self.fill_group = fill_group
        #: The blocks an image's files address (blocking: the image checker's process parses it).
        self._addressed = addressed
        self.directory = directory
        self._writers = trio.CapacityLimiter(WRITE_THREADS)
        self.link: HolderLink | None = None
        self.blobs: dict[str, LocalBlob] = {}  #: by index name
        self._by_inode: dict[tuple[int, int], LocalBlob] = {}
        self._filling: dict[tuple[str, int], trio.Event] = {}
        self._answered: list[int] = []
        self._have_answered = trio.Event()
        #: The events being answered, by holder number (a holder that took over passes them on again).
        self._in_flight: dict[int, fanotify.Event] = {}
        self._released = False  #: the holder was told to release the group (an orderly stop with no hole left)
        #: The stores (their fetchers) whose fetch for a fill failed lately: later fills from them fail at once.
        self._failing = FailingStores()
        self._pending = 0
        self._answered_total = 0
        self._holder_answered = 0
        self._nursery: trio.Nursery | None = None  #: where events are answered and fill groups written
        self._settle_rounds = 0
        self._watched_at: dict[str, float] = {}  #: by blob name: when a recording last watched its layer (trio time)
        self._fills = 0  #: fills made (each a group's missing blocks in one batch)
        self._first_read_blocks = 0  #: blocks written ahead whose first read the holder told
        #: Set once the layers are restored: events before that wait (a restart's pending ones included).
        self.ready = trio.Event()

    async def start(self, nursery: trio.Nursery) -> bool:
        """Connect to (or start) the holder and serve its events; True if the group outlived an earlier
        server (its marks and the EROFS mounts on them stand: keep them)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._directory_lock = hold_blob_directory(self.directory, self.paths.root)  # held for the server's life
        await trio.to_thread.run_sync(self.store.sweep)  # what an eviction or a removal cut short left
        self.link = HolderLink(self.paths, hole_wait=self.hole_wait, lock_fd=self._directory_lock)
        await self.link.connect()
        nursery.start_soon(self._serve_events)
        nursery.start_soon(self.store.run, self.ready)
        nursery.start_soon(self.background.run)
        nursery.start_soon(self._report_answered)
        nursery.start_soon(self._settle)
        return self.link.adopted

    def statistics(self) -> FanotifyStatistics:
        return FanotifyStatistics(
            blobs=len(self.blobs),
            complete=sum(1 for blob in self.blobs.values() if blob.complete),
            held_marked=sum(1 for blob in self.blobs.values() if blob.complete and blob.marked),
            settle_rounds=self._settle_rounds,
            missing_blocks=sum(blob.missing_count for blob in self.blobs.values()),
            pending=self._pending,
            answered=self._answered_total,
            answered_by_holder=self._holder_answered,
            fills=self._fills,
            first_reads=self._first_read_blocks,
            holder_adopted=bool(self.link and self.link.adopted),
            background_fill=self.background.statistics(),
            store=self.store.statistics(),
            peer_reads=self.filled_blocks.statistics(),
        )

    def _in_use(self) -> set[str]:
        """The blobs a layer uses: open, or kept by the holder for a layer whose restore is retried (never evicted)."""
        return set(self.blobs) | (set(self.link.writers) if self.link is not None else set())

    def _gauge(self) -> None:
        complete = sum(1 for blob in self.blobs.values() if blob.complete)
        BLOBS.labels("complete").set(complete)
        BLOBS.labels("partial").set(len(self.blobs) - complete)

    async def open(self, index_name: str, tree: LayerTree, image: Path) -> Path:
        """The marked local blob of ``tree``'s layer (index ``index_name``, EROFS image ``image``), made, taken
        over, or opened again from the blob an earlier mount of the index kept (its fill map's blocks are not
        fetched again); its path."""
        assert self.link is not None
        blob = self.blobs.get(index_name)
        if blob is None:
            async with self.store.hold(index_name):  # never evicted while it is being opened
                blob = self.blobs.get(index_name)  # another layer of the index opened it meanwhile
                if blob is None:
                    blob = await self._make(index_name, tree, image)
        if tree not in blob.trees:
            blob.trees.append(tree)
        return blob.path

    async def _make(self, index_name: str, tree: LayerTree, image: Path) -> LocalBlob:
        assert self.link is not None
        writer = self.link.writers.pop(index_name, None)

        def make() -> LocalBlob:
            addressed = functools.partial(self._addressed, image, tree.index)
            made = LocalBlob(self.directory, index_name, tree.index, writer, self.link.group, addressed,  # type: ignore[union-attr]
                             fill_group=self.fill_group)  # fmt: skip
            made.note_unread_if_near()  # a layer of small files only: whole, or nearly, from the start
            made.mark()
            return made

        blob = await trio.to_thread.run_sync(make)
        if writer is None:  # a new writer: the holder keeps it, and the fill map it answers from (it kept both else)
            await self.link.keep(index_name, blob.writer, blob.map_fd)
        self.blobs[index_name] = blob
        self._by_inode[blob.inode] = blob
        self.filled_blocks.add(blob)
        self._gauge()
        return blob

    async def close(self, index_name: str, tree: LayerTree, *, remove: bool = False) -> None:
        """``tree``'s layer no longer uses its blob; the last one closes it cleanly and keeps it, within the blob
        directory's budget (checked now: :mod:`.blob_store`), or with ``remove`` deletes it."""
        blob = self.blobs.get(index_name)
        if blob is None:
            return
        if tree in blob.trees:
            blob.trees.remove(tree)
        if blob.trees:
            return
        del self.blobs[index_name]
        self._by_inode.pop(blob.inode, None)
        self.filled_blocks.remove(blob)
        async with self.store.hold(index_name):  # taken at once (nothing awaited since the blob left ``blobs``)
            if self.link is not None:
                await self.link.forget(index_name)
            await trio.to_thread.run_sync(lambda: blob.close(remove=remove))
        self._gauge()
        if self.ready.is_set():
            await self.store.check()

    async def forget_unclaimed(self, wanted: set[str]) -> None:
        """After the restore: the writers the holder kept for blobs of no layer in the table (``wanted``: the
        table's index names; a row whose restore failed keeps its writer for its retry) are closed and
        forgotten, and their blobs deleted (a layer unmounted as its server died), not kept as an unmount
        keeps them: their marks stay, so that a read of such a blob through a mount still open gets EIO,
        never a zero, and a writer opened after a mark would raise events of its own."""
        if self.link is None:
            return
        for name in [name for name in self.link.writers if name not in wanted]:
            log.warning("the event holder kept the writer of a blob no layer has; forgetting it", index=name)
            os.close(self.link.writers.pop(name))
            await self.link.forget(name)
            await self.store.remove(name)

    def blob_of(self, index_name: str) -> LocalBlob | None:
        return self.blobs.get(index_name)

    def holes(self) -> int:
        """Blobs with a block not on disk (marked: their reads need a server)."""
        return sum(1 for blob in self.blobs.values() if not blob.complete)

    async def release_if_whole(self) -> bool:
        """At a server's stop: record each blob's clean close (:meth:`LocalBlob.record_clean_close`), then tell
        the holder to close the group if no blob has a hole left (nothing then depends on a server); True if
        released.  Otherwise the holder stays, and the next server answers."""
        if self.link is None:
            return False
        for blob in list(self.blobs.values()):  # the next server need not re-hash what nobody changed meanwhile
            await trio.to_thread.run_sync(blob.record_clean_close)
        if self.holes():
            log.info("blobs with holes stay marked: the event holder keeps the group for the next server",
                     blobs=self.holes())  # fmt: skip
            return False
        self._released = True  # the holder exits now: no holder is started again
        await self.link.release()
        return True

    async def write_blocks(self, blob: LocalBlob, refs: Sequence[int], data: Sequence[bytes],
                           read: Container[int] | None = None) -> None:  # fmt: skip
        """Write verified blocks into ``blob`` (:meth:`LocalBlob.write`: ``read`` as there), those not on disk yet
        (the fetcher handed most to the blob already, :class:`BlobFill`), in a worker thread; OSError as the write
        raised it (ENOSPC, EIO: the blocks it did not write stay missing, never noted as on disk)."""
        rest = [(ref, block) for ref, block in zip(refs, data) if not blob.filled[ref]]
        if not rest:
            return
        # Threads of their own: a fill's write must not queue behind the fetcher's decodes (a reader waits on it).
        write = functools.partial(blob.write, [ref for ref, _ in rest], [block for _, block in rest], read)
        if await trio.to_thread.run_sync(write, limiter=self._writers):
            self._gauge()

    def _first_read(self, read: FirstRead) -> None:
        """The holder allowed a read that reached blocks written ahead: note them filled and tell the observer."""
        blob = self.blobs.get(read.name)
        if blob is None or not blob.trees or blob.closed:
            return
        try:
            refs = blob.index.blob_blocks(read.offset, read.count)
            first = blob.first_reads(refs)
        except (OSError, ValueError) as exc:
            log.warning("cannot note a first read of blocks written ahead", index=read.name, error=str(exc))
            return
        self._first_read_blocks += len(first)
        tree = blob.trees[0]
        if first and tree.observer is not None:
            tree.observer.blob_read(tree.name, tree.index, refs, read.pid)

    # -- events ---------------------------------------------------------------------------

    async def _serve_events(self) -> None:
        assert self.link is not None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                message = await self.link.events()
                if not message.alive:
                    if self._released:
                        return
                    await self._relink()
                    continue
                if message.answered is not None:  # the holder's own answers (present), counted with ours
                    EVENT_OUTCOMES.labels("present").inc(max(0, message.answered - self._holder_answered))
                    self._holder_answered = message.answered
                if message.first_read is not None:
                    self._first_read(message.first_read)
                for number, event in message.events:
                    if number in self._in_flight:  # passed on again by a holder that took over: being answered
                        os.close(event.fd)
                        continue
                    self._in_flight[number] = event
                    self._pending += 1
                    nursery.start_soon(self._answer_tracked, number, event)

    def _watched(self, blob: LocalBlob) -> bool:
        """Whether a recording watches ``blob``'s layer now, or did within :data:`WATCH_HOLD` seconds (another often
        follows: a profile's, a restarted job's): its whole blob keeps its mark meanwhile."""
        now = trio.current_time()
        if any(tree.observer is not None and tree.observer.watches(tree.name) for tree in blob.trees):
            self._watched_at[blob.name] = now
            return True
        return now - self._watched_at.get(blob.name, -WATCH_HOLD) < WATCH_HOLD

    async def _settle(self) -> None:
        """Every :data:`SETTLE_INTERVAL` seconds: note which blobs a recording watches (:attr:`LocalBlob.watched`),
        and unmark the whole ones no recording holds marked any more."""
        while True:
            await trio.sleep(SETTLE_INTERVAL)
            self._settle_rounds += 1
            for blob in list(self.blobs.values()):
                blob.watched = self._watched(blob)
                if blob.complete and blob.marked and not blob.closed:
                    if await trio.to_thread.run_sync(blob.complete_if_whole, limiter=self._writers):
                        self._gauge()

    async def fill_in_background(self, blob: LocalBlob, refs: list[int]) -> int:
        """Fill blocks ``refs`` of ``blob`` at prefetch priority (:mod:`.background_fill`), except those an event
        fills already (it waits for none); how many it wrote.  Its blocks are not reads: no observer sees them."""
        await self.ready.wait()
        if not blob.trees or blob.closed:
            return 0
        tree = blob.trees[0]
        mine = [ref for ref in refs if not blob.filled[ref] and (blob.name, ref) not in self._filling]
        if not mine:
            return 0
        for ref in mine:
            self._filling[(blob.name, ref)] = trio.Event()
        try:
            sink = BlobFill(blob, mine, ())  # written ahead of any read: a later first read is still seen
            data = await tree.reader.background_blocks(mine, sink)
            if sink.completed:
                self._gauge()
            await self.write_blocks(blob, mine, data, ())
        finally:
            for ref in mine:
                self._filling.pop((blob.name, ref)).set()
        return len(mine)

    async def _answer_tracked(self, number: int, event: fanotify.Event) -> None:
        try:
            await self._answer(number, event)
        finally:
            self._in_flight.pop(number, None)

    def _seed(self) -> HolderSeed:
        """What this server holds, for a holder it starts when both holders died."""
        assert self.link is not None
        return HolderSeed(self.link.group, [(name, blob.writer, blob.map_fd) for name, blob in self.blobs.items()],
                          list(self._in_flight.items()))  # fmt: skip

    async def _relink(self) -> None:
        """The holder died: connect to its standby (which takes over), or start a holder seeded with what this
        server holds; then hand it every open blob's writer and map again, and have it forget any other."""
        assert self.link is not None
        self.link.disconnect()
        log.warning("the event holder is gone; connecting to the holder that takes over", in_flight=len(self._in_flight))
        while True:
            try:
                offered = await self.link.connect(seed=self._seed)
                break
            except (OSError, trio.TooSlowError) as exc:
                log.error("cannot reach an event holder; trying again in 1s", error=str(exc) or type(exc).__name__)
                await trio.sleep(1)
        for name in sorted(offered - set(self.blobs)):
            await self.link.forget(name)
        for name, blob in list(self.blobs.items()):
            if not blob.closed:
                await self.link.keep(name, blob.writer, blob.map_fd)

    async def _report_answered(self) -> None:
        assert self.link is not None
        while True:
            await self._have_answered.wait()
            self._have_answered = trio.Event()
            answered, self._answered = self._answered, []
            await self.link.done(answered)  # lost with a dead holder: the one that takes over passes them on again

    async def _answer(self, number: int, event: fanotify.Event) -> None:
        assert self.link is not None
        started = time.perf_counter()
        response = fanotify.deny(errno.EIO)
        try:
            outcome = "denied"
            try:
                outcome = await self._fill(event)
                response = fanotify.ALLOW
            except _Denied as exc:
                outcome = exc.outcome
                response = fanotify.deny(exc.errno)
                # A failing store's later events (denied at once) were logged once, when it failed.
                (log.debug if outcome == "store_failing" else log.warning)(
                    f"pre-access event denied ({errno.errorcode.get(exc.errno, exc.errno)})", reason=str(exc),
                    offset=event.offset, count=event.count, pid=event.pid)  # fmt: skip
            EVENT_OUTCOMES.labels(outcome).inc()
            if outcome == "filled":
                FILL_SECONDS.observe(time.perf_counter() - started)
        finally:
            fanotify.answer(self.link.group, number, response)
            os.close(event.fd)
            self._pending -= 1
            self._answered_total += 1
            self._answered.append(number)
            self._have_answered.set()

    async def _fill(self, event: fanotify.Event) -> str:
        """Answer an event the holder passed on: the read's missing blocks, with the rest of their fill groups
        (:meth:`LocalBlob.group_of`), fetched, verified and written in one batch; a read of blocks another fill
        is writing waits for it.  The observer sees the read's blocks (and only those)."""
        await self.ready.wait()
        stat = os.fstat(event.fd)
        blob = self._by_inode.get((stat.st_dev, stat.st_ino))
        if blob is None or not blob.trees:
            raise _Denied("unknown", f"no served layer's blob is inode {stat.st_ino}")
        refs = blob.index.blob_blocks(event.offset, event.count)
        tree = blob.trees[0]
        blob.watched = self._watched(blob)  # before a fill may complete it
        if tree.observer is not None and len(refs):
            tree.observer.blob_read(tree.name, tree.index, refs, event.pid)
        wanted = blob.missing(refs)
        if not wanted:
            blob.first_reads(refs)  # written ahead by another fill meanwhile: read now (the observer was told)
            return "present"
        store = tree.reader.store  # one for every layer of a store
        failing = self._failing.failing(store)
        if failing and any((blob.name, ref) not in self._filling for ref in wanted):
            raise _Denied("store_failing", f"blocks of layer {tree.name}: its store failed a fill lately "
                                           f"(EIO at once for {failing:.1f}s more)")  # fmt: skip
        waits = [filling for ref in wanted if (filling := self._filling.get((blob.name, ref))) is not None]
        group = blob.group_of(refs)
        mine = [ref for ref in blob.missing(group) if (blob.name, ref) not in self._filling]
        log.debug("filling blocks for a pre-access event", index=blob.name, offset=event.offset, count=event.count,
                  blocks=len(wanted), group=len(mine), pid=event.pid)  # fmt: skip
        failed: list[_Denied] = []
        if mine:
            for ref in mine:
                self._filling[(blob.name, ref)] = trio.Event()
            self._fills += 1
            read_written = trio.Event()
            token = trio.lowlevel.current_trio_token()
            sink = BlobFill(blob, mine, refs, on_read=lambda: token.run_sync_soon(read_written.set))
            assert self._nursery is not None  # events are answered only while _serve_events runs
            self._nursery.start_soon(self._fill_group, blob, tree, mine, refs, sink, read_written, failed)
            await read_written.wait()  # the read's blocks are on disk (the group's others may still be written)
        for filling in waits:
            await filling.wait()
        if blob.missing(refs):
            if failed:
                raise failed[0]
            raise _Denied("denied", f"blocks of layer {tree.name} could not be filled")
        blob.first_reads(refs)  # those another fill wrote ahead while this one waited
        return "filled"

    async def _fill_group(self, blob: LocalBlob, tree: LayerTree, mine: list[int], refs: range, sink: BlobFill,
                          read_written: trio.Event, failed: list[_Denied]) -> None:  # fmt: skip
        """Fetch, verify and write the blocks ``mine`` of a fill group (the read's ``refs`` first: ``sink`` sets
        ``read_written`` once they are on disk); a failure goes in ``failed``.  Sets ``read_written`` at the end
        whatever happened, and frees the blocks for other fills."""
        store = tree.reader.store
        try:
            try:
                data = await tree.reader.blob_blocks(mine, sink)
            except BlobWriteError as exc:  # fetched and verified, but the blob's disk refused them
                failed.append(self._write_failed(blob, tree, mine, exc))
                return
            except Exception as exc:  # FetchError (EIO after the retries), a refused block: never written
                self._fetch_failed(store, tree, exc)
                failed.append(_Denied("denied", f"blocks {mine[0]}..{mine[-1]} of layer {tree.name}: {exc}"))
                return
            self._failing.served(store)
            if sink.completed:
                self._gauge()
            try:
                await self.write_blocks(blob, mine, data, refs)  # those that came from memory, a cache or a peer
            except OSError as exc:  # a full disk, say: this read fails with it (the kernel takes a few errnos)
                failed.append(self._write_failed(blob, tree, mine, exc))
            except Exception as exc:  # never the serving loop's end: this read fails, the next fill tries again
                log.error("a fill group could not be written", index=blob.name, error=repr(exc))
                failed.append(_Denied("denied", f"blocks {mine[0]}..{mine[-1]} of layer {tree.name}: {exc!r}"))
        finally:
            for ref in mine:
                self._filling.pop((blob.name, ref)).set()
            read_written.set()

    def _fetch_failed(self, store: Hashable, tree: LayerTree, exc: BaseException) -> None:
        if _store_failed(exc):
            seconds = tree.reader.failure_memory
            if self._failing.failed(store, seconds):
                log.error("the store failed a fill after its retries: for a while, reads that need its blocks fail "
                          "at once (EIO)", layer=tree.name, seconds=seconds, store=tree.reader.store_label,
                          error=str(exc))  # fmt: skip

    @staticmethod
    def _write_failed(blob: LocalBlob, tree: LayerTree, refs: Sequence[int], exc: OSError) -> _Denied:
        code = exc.errno if exc.errno in fanotify.DENY_ERRNOS else errno.EIO
        return _Denied("write_failed", f"blocks {refs[0]}..{refs[-1]} of layer {tree.name} cannot be written into "
                                       f"{blob.path}: {exc}", code)  # fmt: skip


class _Denied(Exception):
    """An event answered deny: ``outcome`` (its count's label), why, and the ``errno`` the read fails with (one
    of :data:`~.fanotify.DENY_ERRNOS`)."""

    def __init__(self, outcome: str, why: str, code: int = errno.EIO) -> None:
        super().__init__(why)
        self.outcome = outcome
        self.errno = code if code in fanotify.DENY_ERRNOS else errno.EIO


__all__ = ["BLOBS", "EVENT_OUTCOMES", "FILL_SECONDS", "FanotifyBlobs", "FanotifyStatistics", "HolderLink", "LocalBlob", "boot_id"]
