"""The event holder: the processes that hold and read a node's fanotify group, so that no read ever sees a zero for a hole.

On the ``fanotify`` data path a layer's blob is a sparse file that the layer server fills
on the kernel's pre-access events (:mod:`.fanotify`).  Two facts of the kernel (Linux 6.18)
decide who may hold and read the group:

* when the group's last descriptor closes, every pending and later read of a marked file
  is allowed, and a range not yet filled reads as **zeros**;
* an event read by a process that dies before answering stays pending (its reader blocks,
  killable) until the group closes: a new reader is never given it again, but any holder of
  the group may still answer it by the descriptor number the reading process got.

So neither the layer server nor anything that may crash or be upgraded can be the group's
only holder or its reader.  The holder is: a small process of its own session, started by
the first layer server of a root (``ROOT/layers/events.sock``), that creates the group,
reads every event and keeps, until each is answered, the event's descriptor and range.

**Two holders.**  The *active* holder keeps a *standby*: a second process of this module, of
a session of its own, that holds a dup of the group, of every kept blob writer and fill map
and of every event passed on and not yet answered, each at **the same descriptor number**
(the number the kernel answers by).  The active mirrors each change to it before it passes
anything to the server.  If the active dies the standby sees its socket close, takes over
(reads the group, accepts the server, passes the events it mirrored on again) and starts a
standby of its own; if the standby dies the active starts a new one.  Numbers stay unique:
both keep their own descriptors at or above :data:`FD_FLOOR` and the events' below it, so an
event read after a take-over never gets the number of one read before.  The layer server
holds the group too: if both holders die, it starts a holder seeded with what it holds (the
group, the blobs' writers and maps, the events it was given) in the same way.  So any two of
the three (active, standby, server) may die at once and the reads waiting resume with the
right bytes once a server answers; only an event the active had read and not yet mirrored
when it died waits until the group closes.  Killing all three at once (a whole cgroup)
closes the group: docs/lazy-layers.md says what narrows that.

It hands the server, over a ``SOCK_SEQPACKET`` socket (descriptors by ``SCM_RIGHTS``):

* on connection, a dup of the group (the server marks blobs and writes the answers
  itself, naming each event by the holder's descriptor number) and the blob writers it
  keeps for the server (descriptors opened before their file was marked: their writes
  raise no event, and a restarted server could not open one again);
* then every pending event, first those a dead server had been given and not answered,
  with a dup of the event's descriptor.

One server at a time: a connection while a live server is connected is refused
(:data:`REFUSED`, then closed), so a health check or a stray client never takes the
server's place; a connection after the server's socket closed takes it over.

An event whose blocks are all on disk already is answered by the holder itself: it reads
each kept blob's fill map (``pread``: a map truncated under it only passes the event on;
a byte is set only after its block is written) and allows the read when no block of the
range is missing, without the server.  It tells the server how many it answered, every half
second, and, at once, each read it allowed that reached a block written ahead of any read
(:data:`AHEAD`: a fill group's or the background fill's), so that the server sees every
block's first read (the hot-list recorder does) without the read waiting on it.

The server says back which events it answered (the holder closes their descriptors only
then: the kernel names an event by that number, which must not be reused while it is
pending), which writers to keep or forget, and ``release`` at an orderly stop.  The holder
acts on its own fill maps, never on a client's word: it releases the group only when no
event is pending and no kept blob has a hole.  Anything malformed a client sends is logged
and dropped.

**Bounds.**  An event that waits with no server connected longer than ``--hole-wait``
seconds (the layer server's ``[datapath] hole_wait``) is denied ``EIO`` and logged: a read
of a hole never waits forever for a server nobody restarts.  The holder exits when its root
is gone (its socket's path removed or replaced), or when no kept blob has a hole, no event
is pending and no server has connected for ``--idle-exit`` seconds; it ignores SIGTERM,
SIGINT and SIGHUP while a blob has a hole (a service manager stopping the layer server's
unit must leave it: systemd's ``KillMode=process``) and exits on them otherwise.  It does
nothing else (no dependency beyond the standard library), and it logs to
``ROOT/layers/events.log``.
"""

from __future__ import annotations

import argparse
import array
import errno
import fcntl
import os
import re
import resource
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bootseer.blockstore.datapath.fanotify import ALLOW, READ_SIZE, Event, FanotifyError, answer, deny, init_group, parse_events

#: One event on the wire to the server: the holder's descriptor number, the reader's pid, offset, count.
EVENT = struct.Struct("<iiQQ")
#: One event mirrored to a standby (or seeded into a new holder): as :data:`EVENT`, then since when it
#: waits (``CLOCK_MONOTONIC`` nanoseconds: one clock for every process of the node).
MIRRORED = struct.Struct("<iiQQq")
#: Events (and descriptors) per message: below the kernel's 253 descriptors per SCM_RIGHTS.
BATCH = 64
MESSAGE_SIZE = 1 + BATCH * MIRRORED.size + 4096
#: A fill map's header (magic, boot id, blocks), then a byte per block: 0 missing (local_blobs.LocalBlob).
MAP_HEADER = struct.Struct("<10s36sQ")
#: A fill map's byte for a block written ahead of any read (a fill group's, the background fill's): on disk, so the
#: holder allows its read, and tells the server the first read of it (:data:`FIRST_READ`), which notes it filled.
AHEAD = 3
#: A first read of blocks written ahead, holder -> server: the reader's pid, offset, count, then the blob's name.
FIRST = struct.Struct("<iQQ")
#: Seconds between the holder's counts of events it answered itself, sent to the server.
COUNT_INTERVAL = 0.5
#: Seconds between the holder's checks of its root, its waits and its standby.
TICK = 0.5
#: Default of ``--hole-wait``: seconds an event may wait with no server connected before it is denied EIO.
HOLE_WAIT = 120.0
#: Default of ``--idle-exit``: seconds with no server, no pending event and no blob with a hole before it exits.
IDLE_EXIT = 60.0
#: Seconds at least between two standbys started (a standby that dies at once is not restarted in a loop).
RESPAWN_INTERVAL = 1.0
#: Seconds a send to a standby may block before that standby is given up (and replaced).
STANDBY_SEND_TIMEOUT = 5.0
#: Blob writers kept at most (each is two descriptors).
MAX_BLOBS = 4096
#: Message kinds (first byte).
HELLO, WRITER, READY, EVENTS, ANSWERED, REFUSED, FIRST_READ = b"H", b"K", b"Z", b"E", b"S", b"X", b"A"  # holder -> server
DONE, KEEP, FORGET, RELEASE = b"D", b"K", b"F", b"R"  # server -> holder
GROUP, BYE = b"G", b"B"  # holder (or a server seeding one) -> standby, with KEEP, FORGET, EVENTS (MIRRORED), DONE
#: This module, as the holders' command lines name it (``python -P -m``: never a module of the working directory).
MODULE = "bootseer.blockstore.datapath.event_holder"
#: A blob's name: what the server calls it (its index's digest), never a path.
_NAME = re.compile(r"[0-9A-Za-z._:-]{1,255}")
#: The holder's own descriptors are moved at or above this number; the events' stay below it (set by main).
FD_FLOOR = 1024


def rights(fds: Sequence[int]) -> list[tuple[int, int, array.array[int]]]:
    """The ancillary data that passes ``fds`` with a message (none for no descriptor)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def send_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """One message with ``fds`` attached (blocking)."""
    sock.sendmsg([data], rights(fds))


def received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a message carried (each now open in this process)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(array.array("i", data[:usable]))
    return fds


def blob_name(body: bytes) -> str:
    """The blob name a KEEP or FORGET message carries; ValueError unless it is one (ASCII, no path)."""
    name = body.decode("ascii")
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"not a blob name: {body[:80]!r}")
    return name


def mirrored_events(body: bytes, fds: Sequence[int]) -> list[tuple[Event, float]]:
    """The events of a mirrored EVENTS message (each with its descriptor in ``fds``, in order) and since when
    each waits (monotonic seconds); ValueError if records and descriptors do not pair up."""
    if len(body) % MIRRORED.size or len(body) // MIRRORED.size != len(fds):
        raise ValueError(f"{len(body)} bytes of events with {len(fds)} descriptors")
    return [(Event(fd, pid, offset, count), since / 1e9)
            for fd, (_number, pid, offset, count, since) in zip(fds, MIRRORED.iter_unpack(body))]  # fmt: skip


def mirrored_numbers(body: bytes) -> list[int]:
    """The holder numbers of a mirrored EVENTS message, in order."""
    return [record[0] for record in MIRRORED.iter_unpack(body[: len(body) - len(body) % MIRRORED.size])]


def mirror_message(numbered: Sequence[tuple[int, Event, float]]) -> bytes:
    """An EVENTS message for a standby (or a seeded holder): each event's number, range and since when it waits."""
    return EVENTS + b"".join(MIRRORED.pack(number, e.pid, e.offset, e.count, int(since * 1e9)) for number, e, since in numbered)


def _log(message: str, **fields: object) -> None:
    detail = " ".join(f"{key}={value}" for key, value in fields.items())
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} event-holder[{os.getpid()}] {message} {detail}".rstrip(),
          file=sys.stderr, flush=True)  # fmt: skip


def _high(fd: int) -> int:
    """``fd`` moved to a number at or above :data:`FD_FLOOR` (close-on-exec); the old number is closed."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, FD_FLOOR)
    os.close(fd)
    return moved


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _high_socket(sock: socket.socket) -> socket.socket:
    return socket.socket(fileno=_high(sock.detach()))


class BlobView:
    """What the holder reads of a local blob to answer an event itself, and keeps for the next server: its
    writer and its fill map (read with ``pread``: a map changed or truncated under it never faults)."""

    def __init__(self, writer: int, map_fd: int) -> None:
        for fd in (writer, map_fd):
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("a blob's writer and fill map are regular files")
        self.writer, self.map_fd = writer, map_fd
        self.name = ""  #: what the server calls the blob (set when kept)
        info = os.fstat(writer)
        self.key = (info.st_dev, info.st_ino)
        header = os.pread(map_fd, MAP_HEADER.size, 0)
        if len(header) != MAP_HEADER.size:
            raise ValueError("the fill map has no header")
        _magic, _boot, self.blocks = MAP_HEADER.unpack(header)
        if self.blocks > os.fstat(map_fd).st_size - MAP_HEADER.size:  # a map names no more blocks than it holds
            raise ValueError(f"the fill map claims {self.blocks} blocks it does not hold")
        self.block_size = info.st_size // self.blocks if self.blocks else 0

    def present(self, offset: int, count: int) -> bytes | None:
        """The fill map's bytes of the range's blocks if every one is on disk (or addressed by no file): the read
        may go on; else None."""
        if not count or not self.block_size:
            return None
        first, last = offset // self.block_size, min(self.blocks, -(-(offset + count) // self.block_size)) - 1
        if last < first:
            return None
        states = os.pread(self.map_fd, last - first + 1, MAP_HEADER.size + first)
        return states if len(states) == last - first + 1 and 0 not in states else None

    def has_hole(self) -> bool:
        """Whether a block is missing (or the map cannot say: then it counts as a hole)."""
        for start in range(0, self.blocks, 1 << 20):  # a megabyte of the map at a time
            want = min(1 << 20, self.blocks - start)
            try:
                states = os.pread(self.map_fd, want, MAP_HEADER.size + start)
            except OSError:
                return True
            if len(states) != want or 0 in states:
                return True
        return False

    def close(self) -> None:
        os.close(self.writer)
        os.close(self.map_fd)


@dataclass
class Pending:
    """An event read (or mirrored) and not yet answered: its descriptor sits at ``event.fd``, the number the
    kernel answers it by."""

    event: Event
    since: float  #: monotonic seconds: when it began to wait


class Holder:
    """One holder process's state: standby (mirrors the active) until it is :meth:`activate`\\ d."""

    def __init__(self, listener: socket.socket, root: str, *, hole_wait: float, idle_exit: float) -> None:
        self.listener = listener
        self.root = root
        self.hole_wait, self.idle_exit = hole_wait, idle_exit
        self.path = listener.getsockname()
        info = os.stat(self.path)
        self.path_key = (info.st_dev, info.st_ino)
        self.group = -1
        self.active = False
        self.pending: dict[int, Pending] = {}  #: holder number -> event, until the server says it answered
        self.writers: dict[str, BlobView] = {}  #: blob name -> its writer and fill map, kept for the server
        self.views: dict[tuple[int, int], BlobView] = {}  #: the same, by the blob's inode
        self.answered = 0  #: events answered here (every block on disk), not passed on
        self._counted, self._count_sent = 0, 0.0
        self.server: socket.socket | None = None
        self.server_since = time.monotonic()  #: when the last server went (or this holder started)
        self.upstream: socket.socket | None = None  #: a standby's link to its active (or to the server seeding it)
        self.standby: socket.socket | None = None  #: an active's link to its standby
        self.standby_process: subprocess.Popen[bytes] | None = None
        self.lock_fd: int | None = None  #: the blob directory's lock: held here, and passed on to each standby
        self._standby_started = 0.0
        self._stop_asked = False
        self._checked_root = 0.0
        self.done = False
        self.poller = select.poll()
        self._polled: set[int] = set()

    # -- the poll set -------------------------------------------------------------------------

    def _watch(self, fd: int) -> None:
        self.poller.register(fd, select.POLLIN)
        self._polled.add(fd)

    def _unwatch(self, fd: int) -> None:
        if fd in self._polled:
            self._polled.discard(fd)
            self.poller.unregister(fd)

    def serve(self) -> None:
        """Run until released, idle, or the root is gone (a standby: until its active says bye, or it takes over)."""
        while not self.done:
            ready = self.poller.poll(TICK * 1000)
            for fd, flags in ready:
                if self.done:
                    break
                if fd not in self._polled:
                    continue  # closed by an earlier handler of this round
                self._ready(fd, flags)
            if not self.done:
                self.tick()

    def _ready(self, fd: int, flags: int) -> None:
        if fd == self.group:
            self.read_group()
        elif fd == self.listener.fileno():
            self.accept()
        elif self.server is not None and fd == self.server.fileno():
            if not self.from_server():
                self.drop_server("the server closed its end")
        elif self.upstream is not None and fd == self.upstream.fileno():
            self.from_upstream()
        elif self.standby is not None and fd == self.standby.fileno():
            self.drop_standby(f"its socket signalled {flags:#x}")  # a standby sends nothing: it is gone
        else:
            self._unwatch(fd)

    def tick(self) -> None:
        now = time.monotonic()
        if self.active:
            self.send_count()
            self.expire(now)
            if self.standby is None and now - self._standby_started >= RESPAWN_INTERVAL:
                self.start_standby()
        if now - self._checked_root >= 2 * TICK:  # the checks that read files: once a second
            self._checked_root = now
            why = self._root_gone()
            if why:
                self.finish(f"its root is gone ({why})")
                return
            if self.standby_process is not None and self.standby_process.poll() is not None and self.standby is None:
                self.standby_process = None  # reaped
            idle = self.active and self.server is None and not self.pending and now - self.server_since >= self.idle_exit
            if idle and not self.any_hole():
                self.finish(f"idle: no server for {self.idle_exit:g}s, no event pending, no blob with a hole")
                return
        if self._stop_asked:
            self._stop_asked = False
            if self.pending or self.any_hole():
                _log("signal ignored: a blob has a hole or an event is pending (the group must outlive the server)",
                     pending=len(self.pending))  # fmt: skip
            else:
                self.finish("stopped by a signal: no blob has a hole")

    def _root_gone(self) -> str:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} is removed"
        except OSError as exc:
            return f"{self.path}: {exc.strerror}"
        if (info.st_dev, info.st_ino) != self.path_key:
            return f"{self.path} is another holder's now"
        return ""

    def stop_asked(self, signum: int, _frame: object) -> None:
        """SIGTERM, SIGINT, SIGHUP: exit at the next tick if nothing depends on the group, else log and stay."""
        self._stop_asked = True

    def any_hole(self) -> bool:
        return any(view.has_hole() for view in self.writers.values())

    def finish(self, why: str) -> None:
        """Stop holding: a standby is told bye (it exits too), the group closes with this process."""
        _log("exiting; the group closes", why=why, pending=len(self.pending), blobs=len(self.writers))
        if self.standby is not None:
            try:
                send_fds(self.standby, BYE, [])
            except OSError:
                pass
        self.done = True

    # -- the active holder ---------------------------------------------------------------------

    def activate(self, group: int | None = None) -> None:
        """Become the active holder: of a new group (``group`` None), or of the one mirrored so far."""
        if group is None:
            group = _high(init_group())
        self.group, self.active = group, True
        self.server_since = time.monotonic()
        self._watch(self.group)
        self._watch(self.listener.fileno())
        self.start_standby()
        if self.pending:
            _log("took over the group; the pending events wait for the next server", pending=len(self.pending),
                 blobs=len(self.writers))  # fmt: skip

    def start_standby(self) -> None:
        """Start a standby and give it the group, the writers and the pending events (mirrored from now on)."""
        self._standby_started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours = _high_socket(ours)
        try:
            self.standby_process = subprocess.Popen(
                holder_argv(self.root, self.listener.fileno(), hole_wait=self.hole_wait, idle_exit=self.idle_exit,
                            standby_fd=theirs.fileno(), lock_fd=self.lock_fd),
                pass_fds=[fd for fd in (self.listener.fileno(), theirs.fileno(), self.lock_fd) if fd is not None],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as exc:
            _log("cannot start a standby holder", error=str(exc))
            ours.close()
            return
        finally:
            theirs.close()
        ours.settimeout(STANDBY_SEND_TIMEOUT)
        self.standby = ours
        try:
            send_fds(ours, GROUP, [self.group])
            for name, view in self.writers.items():
                send_fds(ours, KEEP + name.encode(), [view.writer, view.map_fd])
            self._mirror_events([(number, p.event, p.since) for number, p in self.pending.items()])
        except OSError as exc:
            self.drop_standby(f"cannot seed it: {exc}")
            return
        self._watch(ours.fileno())
        _log("standby holder started", pid=self.standby_process.pid, pending=len(self.pending), blobs=len(self.writers))

    def drop_standby(self, why: str) -> None:
        if self.standby is None:
            return
        self._unwatch(self.standby.fileno())
        self.standby.close()
        self.standby = None
        if self.standby_process is not None and self.standby_process.poll() is None:
            self.standby_process.kill()  # it may hold a stale copy: a new one is seeded afresh
        _log("standby holder gone; a new one follows", why=why)

    def _mirror(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if self.standby is None:
            return
        try:
            send_fds(self.standby, data, fds)
        except OSError as exc:
            self.drop_standby(f"cannot mirror to it: {exc}")

    def _mirror_events(self, numbered: Sequence[tuple[int, Event, float]]) -> None:
        for start in range(0, len(numbered), BATCH):
            batch = numbered[start : start + BATCH]
            self._mirror(mirror_message(batch), [number for number, _e, _s in batch])

    def read_group(self) -> None:
        try:
            read = parse_events(os.read(self.group, READ_SIZE))
        except (OSError, FanotifyError) as exc:
            _log("cannot read the group", error=str(exc))
            return
        now, events = time.monotonic(), []
        for event in read:
            if event.fd < 0:
                continue
            if self.answer_present(event):
                continue
            self.pending[event.fd] = Pending(event, now)
            events.append(event)
        self._mirror_events([(e.fd, e, now) for e in events])  # the standby first: it must outlive this process
        self.send_events(events)

    def answer_present(self, event: Event) -> bool:
        """Allow a read whose blocks are all on disk here, without the server (True: answered and closed)."""
        try:
            info = os.fstat(event.fd)
            view = self.views.get((info.st_dev, info.st_ino))
            states = view.present(event.offset, event.count) if view is not None else None
            if states is None:
                return False
            answer(self.group, event.fd, ALLOW)
            if AHEAD in states:
                assert view is not None
                self.send_first_read(view.name, event)
        except (OSError, ValueError) as exc:  # anything odd: the server decides
            _log("event passed on after an error", error=str(exc))
            return False
        os.close(event.fd)
        self.answered += 1
        return True

    def expire(self, now: float) -> None:
        """Deny EIO the events that have waited past the hole wait with no server to answer them."""
        if self.server is not None or not self.pending:
            return
        late = [number for number, p in self.pending.items() if now - max(p.since, self.server_since) > self.hole_wait]
        for number in late:
            try:
                answer(self.group, number, deny(errno.EIO))
            except OSError as exc:
                _log("cannot deny a late event", number=number, error=str(exc))
            del self.pending[number]
            os.close(number)
        if late:
            _log("reads denied EIO: no layer server answered them in time", events=len(late), hole_wait_s=self.hole_wait)
            self._mirror(DONE + struct.pack(f"<{len(late)}i", *late))

    def send_count(self) -> None:
        """Tell the server how many events were answered here (at most every COUNT_INTERVAL s)."""
        now = time.monotonic()
        if self.server is None or self.answered == self._counted or now - self._count_sent < COUNT_INTERVAL:
            return
        try:
            send_fds(self.server, ANSWERED + struct.pack("<Q", self.answered), [])
        except OSError as exc:
            self.drop_server(f"cannot send it the count: {exc}")
            return
        self._counted, self._count_sent = self.answered, now

    def send_first_read(self, name: str, event: Event) -> None:
        """Tell the server a read allowed here reached blocks written ahead (lost with no server connected: the
        hot-list recorder then misses it, the read does not)."""
        if self.server is None:
            return
        try:
            send_fds(self.server, FIRST_READ + FIRST.pack(event.pid, event.offset, event.count) + name.encode(), [])
        except OSError as exc:
            self.drop_server(f"cannot send it a first read: {exc}")

    def send_events(self, events: Sequence[Event]) -> None:
        for start in range(0, len(events), BATCH):
            if self.server is None:
                return
            batch = events[start : start + BATCH]
            data = EVENTS + b"".join(EVENT.pack(e.fd, e.pid, e.offset, e.count) for e in batch)
            try:
                send_fds(self.server, data, [e.fd for e in batch])
            except OSError as exc:
                self.drop_server(f"cannot send it events: {exc}")

    def accept(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError as exc:
            _log("accept failed", error=str(exc))
            return
        connection = _high_socket(connection)
        uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != 0:
            _log("refused a connection that is not root's", uid=uid)
            connection.close()
            return
        if self.server is not None and self._server_alive():
            _log("refused a connection: a layer server is connected already")
            try:
                send_fds(connection, REFUSED + b"a layer server is connected to the event holder already", [])
            except OSError:
                pass
            connection.close()
            return
        if self.server is not None:
            self.drop_server("it is gone; a new server connected")
        self.server = connection
        try:
            connection.settimeout(STANDBY_SEND_TIMEOUT)  # a server that reads nothing must not stall the group
            send_fds(connection, HELLO, [self.group])
            for name, view in self.writers.items():
                send_fds(connection, WRITER + name.encode(), [view.writer])
            send_fds(connection, READY + b'{"pending": %d}' % len(self.pending), [])
        except OSError as exc:
            self.server = None
            connection.close()
            _log("cannot greet a server", error=str(exc))
            return
        self._watch(connection.fileno())
        _log("server connected", writers=len(self.writers), pending=len(self.pending))
        self.send_events([p.event for p in self.pending.values()])

    def _server_alive(self) -> bool:
        """Whether the connected server's end is still open (its queued messages handled first)."""
        probe = select.poll()
        for _ in range(10_000):
            if self.server is None:
                return False
            probe.register(self.server, select.POLLIN)
            ready = probe.poll(0)
            probe.unregister(self.server)
            if not ready:
                return True
            flags = ready[0][1]
            if not flags & select.POLLIN:
                self.drop_server(f"its socket signalled {flags:#x}")
                return False
            if not self.from_server():
                self.drop_server("the server closed its end")
                return False
        return True

    def forget(self, name: str) -> None:
        view = self.writers.pop(name, None)
        if view is not None:
            self.views.pop(view.key, None)
            view.close()

    def keep(self, name: str, writer: int, map_fd: int) -> BlobView:
        """Keep blob ``name``'s writer and fill map (replacing any kept under that name); ValueError if they are not one."""
        if name not in self.writers and len(self.writers) >= MAX_BLOBS:
            raise ValueError(f"{MAX_BLOBS} blobs kept already")
        view = BlobView(writer, map_fd)  # raises: the caller still owns (and closes) both
        view.writer, view.map_fd = _high(writer), _high(map_fd)
        view.name = name
        self.forget(name)
        self.writers[name] = self.views[view.key] = view
        return view

    def drop_server(self, why: str) -> None:
        if self.server is not None:
            self._unwatch(self.server.fileno())
            self.server.close()
            self.server = None
            self.server_since = time.monotonic()
            _log("server gone; its unanswered events wait for the next", why=why, pending=len(self.pending))

    def from_server(self) -> bool:
        """Handle one message of the server; False when it is gone."""
        assert self.server is not None
        try:
            data, ancillary, flags, _ = self.server.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * 4), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # a readiness of a socket since replaced: nothing to read
        except OSError:
            return False
        fds = received_fds(ancillary)
        try:
            if not data and not fds:
                return False
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError(f"a message longer than {MESSAGE_SIZE} bytes or with too many descriptors")
            kind, body = data[:1], data[1:]
            if kind == DONE:
                if len(body) % 4:
                    raise ValueError(f"DONE carries {len(body)} bytes, not whole numbers")
                closed = []
                for (number,) in struct.iter_unpack("<i", body[: len(body) - len(body) % 4]):
                    if self.pending.pop(number, None) is not None:
                        os.close(number)
                        closed.append(number)
                if closed:
                    self._mirror(DONE + struct.pack(f"<{len(closed)}i", *closed))
            elif kind == KEEP:
                if len(fds) != 2:
                    raise ValueError(f"KEEP carries {len(fds)} descriptors, not 2")
                name = blob_name(body)
                view = self.keep(name, *fds)
                fds = []
                self._mirror(KEEP + name.encode(), [view.writer, view.map_fd])
            elif kind == FORGET:
                name = blob_name(body)
                self.forget(name)
                self._mirror(FORGET + name.encode())
            elif kind == RELEASE:
                if self.pending or self.any_hole():
                    _log("release refused: a blob has a hole or an event is pending", pending=len(self.pending))
                else:
                    self.finish("released by the server: no blob has a hole")
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:
            _log("a malformed message from the server is ignored", error=str(exc)[:200], size=len(data))
        finally:
            _close_all(fds)
        return True

    # -- the standby ---------------------------------------------------------------------------

    def from_upstream(self) -> None:
        """One message of the active holder (or the server seeding this one); its end closed: take over."""
        assert self.upstream is not None
        try:
            data, ancillary, flags, _ = self.upstream.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * BATCH), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data, ancillary, flags = b"", [], 0
        fds = received_fds(ancillary)
        if not data and not fds:
            self._unwatch(self.upstream.fileno())
            self.upstream.close()
            self.upstream = None
            if self.group < 0:
                self.finish("the holder that started this one is gone before it gave the group")
            else:
                _log("the active holder is gone: taking over", pending=len(self.pending), blobs=len(self.writers))
                self.activate(self.group)
            return
        fds = [_high(fd) for fd in fds]  # first out of the event numbers' way
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("a truncated message")
            kind, body = data[:1], data[1:]
            if kind == GROUP and len(fds) == 1 and self.group < 0:
                self.group = fds.pop()
            elif kind == KEEP and len(fds) == 2:
                self.keep(blob_name(body), fds[0], fds[1])
                fds = []
            elif kind == FORGET:
                self.forget(blob_name(body))
            elif kind == EVENTS:
                self._place(mirrored_numbers(body), mirrored_events(body, fds))
                fds = []
            elif kind == DONE:
                for (number,) in struct.iter_unpack("<i", body[: len(body) - len(body) % 4]):
                    if self.pending.pop(number, None) is not None:
                        os.close(number)
            elif kind == BYE:
                self.finish("the active holder exits")
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:
            _log("a malformed message from the active holder is ignored", error=str(exc)[:200])
        finally:
            _close_all(fds)

    def _place(self, numbers: Sequence[int], events: Sequence[tuple[Event, float]]) -> None:
        """Keep each mirrored event's descriptor at its holder number (the number the kernel answers it by)."""
        for number, (event, since) in zip(numbers, events):
            if not 3 <= number < FD_FLOOR:
                _log("a mirrored event's number is out of range; it cannot be kept", number=number)
                os.close(event.fd)
                continue
            if self.pending.pop(number, None) is not None:
                os.close(number)  # a stale copy (its DONE never came): the active reused the number
            os.dup2(event.fd, number, inheritable=False)
            os.close(event.fd)
            self.pending[number] = Pending(Event(number, event.pid, event.offset, event.count), since)


def holder_argv(root: str, listen_fd: int, *, hole_wait: float, idle_exit: float, standby_fd: int | None = None,
                lock_fd: int | None = None) -> list[str]:  # fmt: skip
    """The command line of a holder (``-P``: the working directory is never on its path)."""
    argv = [sys.executable, "-P", "-m", MODULE, "--root", root, "--listen-fd", str(listen_fd),
            "--hole-wait", f"{hole_wait:g}", "--idle-exit", f"{idle_exit:g}"]  # fmt: skip
    if standby_fd is not None:
        argv += ["--standby-fd", str(standby_fd)]
    if lock_fd is not None:
        argv += ["--lock-fd", str(lock_fd)]
    return argv


def main(argv: list[str] | None = None) -> int:
    global FD_FLOOR
    parser = argparse.ArgumentParser(prog="bootseer-event-holder", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the layer server's root (names the holder in ps)")
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--standby-fd", type=int, help="a standby's link to its active holder (or a seeding server), inherited")
    parser.add_argument("--hole-wait", type=float, default=HOLE_WAIT, help="seconds an event waits with no server before EIO")
    parser.add_argument("--idle-exit", type=float, default=IDLE_EXIT, help="seconds with nothing to hold before exiting")
    parser.add_argument("--lock-fd", type=int, help="the blob directory's lock, inherited: held while a holder lives")
    args = parser.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one descriptor per pending event
    FD_FLOOR = max(256, min(hard // 2 if hard != resource.RLIM_INFINITY else 65536, 65536))
    listener = socket.socket(fileno=_high(args.listen_fd))
    holder = Holder(listener, args.root, hole_wait=args.hole_wait, idle_exit=args.idle_exit)
    holder.lock_fd = _high(args.lock_fd) if args.lock_fd is not None else None
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a service manager's stop must not drop the group
        signal.signal(signum, holder.stop_asked)
    if args.standby_fd is None:
        holder.activate()
        _log("holding the fanotify group", root=args.root, socket=holder.path, hole_wait_s=args.hole_wait)
    else:
        holder.upstream = socket.socket(fileno=_high(args.standby_fd))
        holder._watch(holder.upstream.fileno())
        _log("standing by", root=args.root, socket=holder.path)
    holder.serve()
    if holder.active and not holder._root_gone():
        os.unlink(holder.path)  # the next server starts a new holder
    return 0


if __name__ == "__main__":
    sys.exit(main())
