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
blob, never ahead.  After a reboot the page cache the map relied on is gone, so a blob of
another boot starts again empty (its blocks come back from the node cache).

The group is held, and its events read, by the event holder (:mod:`.event_holder`): the
layer server may be killed or upgraded at any time and the reads waiting on it resume when
the next server is up.  :class:`HolderLink` is the server's end of that socket.

The node cache and the blob stay two things: the node cache is content-addressed
(deduplicated across layers, what peers are served from, bounded by ``--cache-size`` with
LRU eviction); a blob is one layer's bytes at their EROFS addresses, kept while a layer
with that index is mounted and removed with the last one.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import prometheus_client
import trio

from bootseer import cpu
from bootseer.blockstore.datapath import fanotify
from bootseer.blockstore.datapath.event_holder import (
    ANSWERED,
    DONE,
    EVENT,
    EVENTS,
    FORGET,
    HELLO,
    KEEP,
    MESSAGE_SIZE,
    READY,
    RELEASE,
    WRITER,
    received_fds,
    rights,
)
from bootseer.blockstore.objects.format import EntryType, LayerIndex
from bootseer.log import get_logger
from bootseer.paths import ServerPaths

if TYPE_CHECKING:
    from bootseer.blockstore.datapath.tree import LayerTree

log = get_logger(__name__)

EVENT_OUTCOMES = prometheus_client.Counter(
    "bootseer_fanotify_events",
    "Pre-access events of local blobs answered, by outcome: present (every block on disk already), filled "
    "(blocks fetched and written first), denied (a block could not be had or failed verification: EIO), "
    "unknown (a file this server serves no blob of: EIO)",
    ["outcome"],
)
for _outcome in ("present", "filled", "denied", "unknown"):
    EVENT_OUTCOMES.labels(_outcome)
FILL_SECONDS = prometheus_client.Histogram(
    "bootseer_fanotify_fill_seconds", "Seconds from a pre-access event's arrival to its answer, for events that filled blocks",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BLOBS = prometheus_client.Gauge("bootseer_local_blobs", "Local blobs of served layers, by state", ["state"])

_MAP_MAGIC = b"BSBLOBMAP1"
FILLED, UNREAD = 1, 2  #: a fill map's bytes: 0 missing, 1 on disk, 2 addressed by no file of the image
_MAP_HEADER = struct.Struct("<10s36sQ")  #: magic, boot id, blocks
HOLDER_CONNECT_TIMEOUT = 30.0
#: Worker threads writing fills into blobs at once (page-cache writes: they release the interpreter lock).
WRITE_THREADS = 4


def boot_id() -> str:
    """This boot's id (the kernel's random ``boot_id``)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as source:
        return source.read().strip()


class LocalBlob:
    """One layer's blob on the node's disk: its writer, its fill map, and whether it is still marked.

    Made by :meth:`FanotifyBlobs.open`; every method that touches the disk blocks (worker threads).
    """

    def __init__(self, directory: Path, index_name: str, index: LayerIndex, writer: int | None, group: int,
                 addressed: Callable[[], Collection[int]] | None = None) -> None:  # fmt: skip
        self.name = index_name
        self.index = index
        self.path = directory / f"{index_name}.blob"
        self.map_path = directory / f"{index_name}.filled"
        self.group = group
        self.trees: list[LayerTree] = []  #: the served layers whose device it is (their reader, observer, name)
        blocks = len(index.blocks)
        boot = boot_id()
        adopted = writer is not None
        filled = bytearray(blocks)
        map_fd = os.open(self.map_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            header = os.pread(map_fd, _MAP_HEADER.size, 0)
            ours = len(header) == _MAP_HEADER.size and _MAP_HEADER.unpack(header) == (_MAP_MAGIC, boot.encode(), blocks)
            if ours and (adopted or self.path.is_file()):
                got = os.pread(map_fd, blocks, _MAP_HEADER.size)
                filled[: len(got)] = bytes(b if b in (FILLED, UNREAD) else 0 for b in got)
            elif adopted:
                raise OSError(errno.EUCLEAN, f"the fill map {self.map_path} of a blob still marked is not this boot's")
            else:  # a new blob, or one of another boot: start it again, empty
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
                writer = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                os.ftruncate(writer, index.blob_size)
        except BaseException:
            os.close(map_fd)
            raise
        assert writer is not None
        self.writer = writer
        self.map_fd = map_fd  #: the fill map (the event holder maps it too)
        self.filled = filled
        self.missing_count = filled.count(0)
        stat = os.fstat(writer)
        self.inode = (stat.st_dev, stat.st_ino)
        self.marked = adopted and self.missing_count > 0
        self._lock = threading.Lock()  #: event fills and the hot-list prefetch write from worker threads
        self.closed = False
        #: The blocks the image's files address (a parse of the image: asked only when the blob is nearly whole).
        self._addressed = addressed
        #: An upper bound of the blocks no file may address: those of one-block files that fit a block (their
        #: data may be inline in the image).  Below it, the blob may be whole already: the image is asked.
        self._maybe_unread = sum(1 for entry in index.entries if entry.type is EntryType.FILE and entry.link is None
                                 and len(entry.blocks) == 1 and 0 < entry.size <= index.block_size)  # fmt: skip
        self._noted = False

    @property
    def complete(self) -> bool:
        return self.missing_count == 0

    def missing(self, refs: range) -> list[int]:
        filled = self.filled
        return [ref for ref in refs if not filled[ref]]

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
        return self._complete_if_whole()

    def write(self, refs: Sequence[int], data: Sequence[bytes]) -> bool:
        """Put verified blocks ``refs`` (``data``, each as stored) in the blob, then in the fill map; True if
        that completed the blob (its mark is then removed).  Blocking; any thread."""
        with cpu.stage("blob_fill"):
            return self._write(refs, data)

    def _write(self, refs: Sequence[int], data: Sequence[bytes]) -> bool:
        for ref, block in zip(refs, data):
            if self.filled[ref]:
                continue
            os.pwrite(self.writer, block, self.index.blob_offset(ref))
            os.pwrite(self.map_fd, b"\x01", _MAP_HEADER.size + ref)
            with self._lock:
                if not self.filled[ref]:
                    self.filled[ref] = FILLED
                    self.missing_count -= 1
        return self.note_unread_if_near() or self._complete_if_whole()

    def _complete_if_whole(self) -> bool:
        with self._lock:
            if not (self.complete and self.marked):
                return False
            self.marked = False
            try:
                fanotify.unmark(self.group, self.writer)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
        log.info("local blob complete: its mark is removed, the kernel reads it alone now", index=self.name)
        return True

    def close(self, *, remove: bool) -> None:
        """Unmark (a blob whose layer is gone), close, and with ``remove`` delete the blob and its map."""
        if self.marked:
            try:
                fanotify.unmark(self.group, self.writer)
            except OSError:
                pass
            self.marked = False
        self.closed = True
        os.close(self.writer)
        os.close(self.map_fd)
        if remove:
            self.path.unlink(missing_ok=True)
            self.map_path.unlink(missing_ok=True)


class HolderLink:
    """The layer server's end of the event holder's socket (:mod:`.event_holder`)."""

    def __init__(self, sock: trio.socket.SocketType, group: int, writers: dict[str, int], adopted: bool) -> None:
        self.sock = sock
        self.group = group  #: the group (a dup of the holder's): marks and answers go through it
        self.writers = writers  #: the blob writers the holder kept, by blob name (taken by :meth:`FanotifyBlobs.open`)
        self.adopted = adopted  #: the holder was up already: the group, its marks and mounts outlived a server
        self._sending = trio.Lock()

    @classmethod
    async def connect(cls, paths: ServerPaths) -> HolderLink:
        """Connect to the root's holder, starting one (and with it a new group) if none is up."""
        adopted = True
        sock = await _connect(paths.events_socket)
        if sock is None:
            adopted = False
            _start_holder(paths)
            sock = await _connect(paths.events_socket)
            if sock is None:
                raise fanotify.FanotifyError(errno.ECONNREFUSED, f"the event holder did not answer on {paths.events_socket}")
        group, writers = -1, {}
        with trio.fail_after(HOLDER_CONNECT_TIMEOUT):
            while True:
                data, ancillary, _flags, _ = await sock.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * 4))
                fds = received_fds(ancillary)
                if not data:
                    raise fanotify.FanotifyError(errno.ECONNRESET, "the event holder closed the connection")
                if data[:1] == HELLO and fds:
                    group = fds.pop(0)
                elif data[:1] == WRITER and fds:
                    writers[data[1:].decode()] = fds.pop(0)
                elif data[:1] == READY:
                    break
                for fd in fds:
                    os.close(fd)
        if group < 0:
            raise fanotify.FanotifyError(errno.EPROTO, "the event holder sent no group")
        log.info("event holder connected", adopted=adopted, writers=len(writers), socket=str(paths.events_socket))
        return cls(sock, group, writers, adopted)

    async def _send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        async with self._sending:
            await self.sock.sendmsg([data], rights(fds))

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

    async def events(self) -> tuple[list[tuple[int, fanotify.Event]], bool, int | None]:
        """The next batch of events (holder's number, event with this process's descriptor); False: the holder
        is gone; and the count of events the holder answered itself, when this message is that count."""
        data, ancillary, _flags, _ = await self.sock.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * 64))
        fds = received_fds(ancillary)
        if not data or data[:1] != EVENTS:
            for fd in fds:
                os.close(fd)
            answered = struct.unpack("<Q", data[1:9])[0] if data[:1] == ANSWERED and len(data) >= 9 else None
            return [], bool(data), answered
        out = []
        for position, (number, pid, offset, count) in enumerate(EVENT.iter_unpack(data[1 : 1 + EVENT.size * len(fds)])):
            out.append((number, fanotify.Event(fds[position], pid, offset, count)))
        return out, True, None


async def _connect(path: Path) -> trio.socket.SocketType | None:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        await sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


def _start_holder(paths: ServerPaths) -> None:
    """Start the root's event holder on a listening socket made here (connections queue until it accepts)."""
    path = paths.events_socket
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(8)
        with open(paths.events_log, "ab") as holder_log:
            subprocess.Popen(
                [sys.executable, "-m", "bootseer.blockstore.datapath.event_holder", "--root", str(paths.root),
                 "--listen-fd", str(listener.fileno())],
                pass_fds=[listener.fileno()], start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=holder_log, stderr=holder_log,
            )  # fmt: skip
    finally:
        listener.close()
    log.info("started the event holder (it holds the fanotify group across server restarts)", socket=str(path))


@dataclass(frozen=True)
class FanotifyStatistics:
    """What :meth:`FanotifyBlobs.statistics` reports."""

    blobs: int  #: local blobs open
    complete: int  #: of them, every block on disk (unmarked)
    missing_blocks: int  #: blocks not yet on disk, all blobs together
    pending: int  #: events being answered now
    answered: int  #: events answered by this server
    answered_by_holder: int  #: events the event holder answered itself (every block on disk), since it started
    holder_adopted: bool  #: the group outlived a server: this one took it over


class FanotifyBlobs:
    """The local blobs of one layer server and the answers to their events (see the module docstring)."""

    def __init__(self, paths: ServerPaths, directory: Path,
                 addressed: Callable[[Path, LayerIndex], Collection[int]]) -> None:  # fmt: skip
        self.paths = paths
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
        self._pending = 0
        self._answered_total = 0
        self._holder_answered = 0
        #: Set once the layers are restored: events before that wait (a restart's pending ones included).
        self.ready = trio.Event()

    async def start(self, nursery: trio.Nursery) -> bool:
        """Connect to (or start) the holder and serve its events; True if the group outlived an earlier
        server (its marks and the EROFS mounts on them stand: keep them)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.link = await HolderLink.connect(self.paths)
        nursery.start_soon(self._serve_events)
        nursery.start_soon(self._report_answered)
        return self.link.adopted

    def statistics(self) -> FanotifyStatistics:
        return FanotifyStatistics(
            blobs=len(self.blobs),
            complete=sum(1 for blob in self.blobs.values() if blob.complete),
            missing_blocks=sum(blob.missing_count for blob in self.blobs.values()),
            pending=self._pending,
            answered=self._answered_total,
            answered_by_holder=self._holder_answered,
            holder_adopted=bool(self.link and self.link.adopted),
        )

    def _gauge(self) -> None:
        complete = sum(1 for blob in self.blobs.values() if blob.complete)
        BLOBS.labels("complete").set(complete)
        BLOBS.labels("partial").set(len(self.blobs) - complete)

    async def open(self, index_name: str, tree: LayerTree, image: Path) -> Path:
        """The marked local blob of ``tree``'s layer (index ``index_name``, EROFS image ``image``), made or
        taken over; its path."""
        assert self.link is not None
        blob = self.blobs.get(index_name)
        if blob is None:
            writer = self.link.writers.pop(index_name, None)

            def make() -> LocalBlob:
                addressed = functools.partial(self._addressed, image, tree.index)
                made = LocalBlob(self.directory, index_name, tree.index, writer, self.link.group, addressed)  # type: ignore[union-attr]
                made.note_unread_if_near()  # a layer of small files only: whole, or nearly, from the start
                made.mark()
                return made

            blob = await trio.to_thread.run_sync(make)
            if writer is None:  # a new writer: the holder keeps it, and the fill map it answers from (it kept both else)
                await self.link.keep(index_name, blob.writer, blob.map_fd)
            self.blobs[index_name] = blob
            self._by_inode[blob.inode] = blob
            self._gauge()
        if tree not in blob.trees:
            blob.trees.append(tree)
        return blob.path

    async def close(self, index_name: str, tree: LayerTree, *, remove: bool) -> None:
        """``tree``'s layer no longer uses its blob; the last one closes it (``remove``: and deletes it)."""
        blob = self.blobs.get(index_name)
        if blob is None:
            return
        if tree in blob.trees:
            blob.trees.remove(tree)
        if blob.trees:
            return
        del self.blobs[index_name]
        self._by_inode.pop(blob.inode, None)
        if self.link is not None:
            await self.link.forget(index_name)
        await trio.to_thread.run_sync(lambda: blob.close(remove=remove))
        self._gauge()

    async def forget_unclaimed(self, wanted: set[str]) -> None:
        """After the restore: the writers the holder kept for blobs of no layer in the table (``wanted``: the
        table's index names; a row whose restore failed keeps its writer for its retry) are closed and
        forgotten, and their blobs deleted (a layer unmounted as its server died).  Their marks stay: a
        read of such a blob through a mount still open gets EIO, never a zero."""
        if self.link is None:
            return
        for name in [name for name in self.link.writers if name not in wanted]:
            log.warning("the event holder kept the writer of a blob no layer has; forgetting it", index=name)
            os.close(self.link.writers.pop(name))
            await self.link.forget(name)
            for suffix in (".blob", ".filled"):
                (self.directory / f"{name}{suffix}").unlink(missing_ok=True)

    def blob_of(self, index_name: str) -> LocalBlob | None:
        return self.blobs.get(index_name)

    def holes(self) -> int:
        """Blobs with a block not on disk (marked: their reads need a server)."""
        return sum(1 for blob in self.blobs.values() if not blob.complete)

    async def release_if_whole(self) -> bool:
        """At a server's stop: tell the holder to close the group if no blob has a hole left (nothing then
        depends on a server); True if released.  Otherwise the holder stays, and the next server answers."""
        if self.link is None:
            return False
        if self.holes():
            log.info("blobs with holes stay marked: the event holder keeps the group for the next server",
                     blobs=self.holes())  # fmt: skip
            return False
        await self.link.release()
        return True

    async def write_blocks(self, blob: LocalBlob, refs: Sequence[int], data: Sequence[bytes]) -> None:
        """Write verified blocks into ``blob`` (the hot-list prefetch's way in): in a worker thread."""
        # Threads of their own: a fill's write must not queue behind the fetcher's decodes (a reader waits on it).
        if await trio.to_thread.run_sync(blob.write, refs, data, limiter=self._writers):
            self._gauge()

    # -- events ---------------------------------------------------------------------------

    async def _serve_events(self) -> None:
        assert self.link is not None
        async with trio.open_nursery() as nursery:
            while True:
                batch, alive, answered = await self.link.events()
                if not alive:
                    log.error("the event holder is gone: reads of blobs with holes now fail or wait; restart the layer server")
                    return
                if answered is not None:  # the holder's own answers (present), counted with ours
                    EVENT_OUTCOMES.labels("present").inc(max(0, answered - self._holder_answered))
                    self._holder_answered = answered
                for number, event in batch:
                    self._pending += 1
                    nursery.start_soon(self._answer, number, event)

    async def _report_answered(self) -> None:
        assert self.link is not None
        while True:
            await self._have_answered.wait()
            self._have_answered = trio.Event()
            answered, self._answered = self._answered, []
            try:
                await self.link.done(answered)
            except OSError as exc:
                log.error("cannot tell the event holder which events are answered", error=str(exc))
                return

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
                log.warning("pre-access event denied (EIO)", reason=str(exc), offset=event.offset, count=event.count, pid=event.pid)
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
        await self.ready.wait()
        stat = os.fstat(event.fd)
        blob = self._by_inode.get((stat.st_dev, stat.st_ino))
        if blob is None or not blob.trees:
            raise _Denied("unknown", f"no served layer's blob is inode {stat.st_ino}")
        refs = blob.index.blob_blocks(event.offset, event.count)
        tree = blob.trees[0]
        if tree.observer is not None and len(refs):
            tree.observer.blob_read(tree.name, tree.index, refs, event.pid)
        wanted = blob.missing(refs)
        if not wanted:
            return "present"
        log.debug("filling blocks for a pre-access event", index=blob.name, offset=event.offset, count=event.count,
                  blocks=len(wanted), pid=event.pid)  # fmt: skip
        waits, mine = [], []
        for ref in wanted:
            filling = self._filling.get((blob.name, ref))
            if filling is None:
                self._filling[(blob.name, ref)] = trio.Event()
                mine.append(ref)
            else:
                waits.append(filling)
        try:
            if mine:
                try:
                    data = await tree.reader.blob_blocks(mine)
                except Exception as exc:  # FetchError (EIO after the retries), a refused block: never written
                    raise _Denied("denied", f"blocks {mine[0]}..{mine[-1]} of layer {tree.name}: {exc}") from None
                await self.write_blocks(blob, mine, data)
        finally:
            for ref in mine:
                self._filling.pop((blob.name, ref)).set()
        for filling in waits:
            await filling.wait()
        if blob.missing(refs):
            raise _Denied("denied", f"blocks of layer {tree.name} could not be filled")
        return "filled"


class _Denied(Exception):
    def __init__(self, outcome: str, why: str) -> None:
        super().__init__(why)
        self.outcome = outcome


__all__ = ["BLOBS", "EVENT_OUTCOMES", "FILL_SECONDS", "FanotifyBlobs", "FanotifyStatistics", "HolderLink", "LocalBlob", "boot_id"]
