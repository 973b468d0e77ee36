"""The event holder: the one process that reads a node's fanotify group, so that no read ever sees a zero for a hole.

On the ``fanotify`` data path a layer's blob is a sparse file that the layer server fills
on the kernel's pre-access events (:mod:`.fanotify`).  Two facts of the kernel (Linux 6.18)
decide who may hold and read the group:

* when the group's last descriptor closes, every pending and later read of a marked file
  is allowed, and a range not yet filled reads as **zeros**;
* an event read by a process that dies before answering stays pending (its reader blocks,
  killable) until the group closes: a new reader is never given it again.

So neither the layer server nor anything that may crash or be upgraded can be the group's
reader.  The holder is: a small process of its own session, started by the first layer
server of a root (``ROOT/layers/events.sock``), that creates the group, reads every event
and keeps, until each is answered, the event's descriptor and range.  It hands the
server, over a ``SOCK_SEQPACKET`` socket (descriptors by ``SCM_RIGHTS``):

* on connection, a dup of the group (the server marks blobs and writes the answers
  itself, naming each event by the holder's descriptor number) and the blob writers it
  keeps for the server (descriptors opened before their file was marked: their writes
  raise no event, and a restarted server could not open one again);
* then every pending event, first those a dead server had been given and not answered,
  with a dup of the event's descriptor.

An event whose blocks are all on disk already is answered by the holder itself: it maps
each kept blob's fill map (shared: the server's writes show at once; a byte is set only
after its block is written) and allows the read when no block of the range is missing,
without the server (a round trip less on every read of a blob with holes whose bytes are on
the node: a second start).  It tells the server how many it answered, every half second.

The server says back which events it answered (the holder closes their descriptors only
then: the kernel names an event by that number, which must not be reused while it is
pending), which writers to keep or forget, and ``release`` when no marked blob has a hole
left: only then does the holder exit and the group close.  A server killed at any point
leaves every pending read waiting, and the next server (``bootseer layer-server`` again)
answers it: reads resume with the right bytes.  The holder itself is the one part that
must not die; it does nothing but this (about 300 lines, no dependency beyond the
standard library), it ignores SIGTERM, SIGINT and SIGHUP (a service manager stopping the
layer server's unit must leave it: systemd's ``KillMode=process``), and it logs to
``ROOT/layers/events.log``.
"""

from __future__ import annotations

import argparse
import array
import json
import mmap
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bootseer.blockstore.datapath.fanotify import ALLOW, READ_SIZE, Event, answer, init_group, parse_events

#: One event on the wire: the holder's descriptor number, the reader's pid, offset, count.
EVENT = struct.Struct("<iiQQ")
#: Events (and descriptors) per message: below the kernel's 253 descriptors per SCM_RIGHTS.
BATCH = 64
MESSAGE_SIZE = 1 + BATCH * EVENT.size + 4096
#: A fill map's header (magic, boot id, blocks), then a byte per block: 0 missing (local_blobs.LocalBlob).
MAP_HEADER = struct.Struct("<10s36sQ")
#: Seconds between the holder's counts of events it answered itself, sent to the server.
COUNT_INTERVAL = 0.5
#: Message kinds (first byte).
HELLO, WRITER, READY, EVENTS, ANSWERED = b"H", b"K", b"Z", b"E", b"S"  # holder -> server
DONE, KEEP, FORGET, RELEASE = b"D", b"K", b"F", b"R"  # server -> holder


def rights(fds: Sequence[int]) -> list[tuple[int, int, array.array[int]]]:
    """The ancillary data that passes ``fds`` with a message (none for no descriptor)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def send_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
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


def _log(message: str, **fields: object) -> None:
    detail = " ".join(f"{key}={value}" for key, value in fields.items())
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} event-holder[{os.getpid()}] {message} {detail}".rstrip(),
          file=sys.stderr, flush=True)  # fmt: skip


class BlobView:
    """What the holder reads of a local blob to answer an event itself: its fill map, mapped shared (the
    server's writes to it show at once), and its block size."""

    def __init__(self, writer: int, map_fd: int) -> None:
        self.writer, self.map_fd = writer, map_fd
        stat = os.fstat(writer)
        self.key = (stat.st_dev, stat.st_ino)
        self.map = mmap.mmap(map_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        _magic, _boot, self.blocks = MAP_HEADER.unpack_from(self.map, 0)
        self.block_size = stat.st_size // self.blocks if self.blocks else 0

    def present(self, offset: int, count: int) -> bool:
        """Whether every block of the range is on disk (or addressed by no file): the read may go on."""
        if not count or not self.block_size:
            return False
        first, last = offset // self.block_size, min(self.blocks, -(-(offset + count) // self.block_size)) - 1
        if last < first:
            return False
        return 0 not in self.map[MAP_HEADER.size + first : MAP_HEADER.size + last + 1]

    def close(self) -> None:
        self.map.close()
        os.close(self.writer)
        os.close(self.map_fd)


class Holder:
    """The holder's state: the group, the events read and not yet answered, the writers kept, the server."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.group = init_group()
        self.pending: dict[int, Event] = {}  #: holder descriptor -> event, until the server says it answered
        self.writers: dict[str, BlobView] = {}  #: blob key -> its writer and fill map, kept for the server
        self.views: dict[tuple[int, int], BlobView] = {}  #: the same, by the blob's inode
        self.answered = 0  #: events answered here (every block on disk already), not passed on
        self._counted, self._count_sent = 0, 0.0
        self.server: socket.socket | None = None

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.group, select.POLLIN)
        poller.register(self.listener, select.POLLIN)
        while True:
            ready = poller.poll(COUNT_INTERVAL * 1000)
            self.send_count()
            for fd, _flags in ready:
                if fd == self.group:
                    self.read_group()
                elif fd == self.listener.fileno():
                    if self.server is not None:
                        poller.unregister(self.server)
                    self.accept()
                    if self.server is not None:
                        poller.register(self.server, select.POLLIN)
                elif self.server is not None and fd == self.server.fileno():
                    if not self.from_server():
                        poller.unregister(fd)
                        self.drop_server("the server closed its end")
                    elif self.server is None:  # released
                        return

    def read_group(self) -> None:
        events = []
        for event in parse_events(os.read(self.group, READ_SIZE)):
            if event.fd < 0:
                continue
            if self.answer_present(event):
                continue
            self.pending[event.fd] = event
            events.append(event)
        self.send_events(events)

    def answer_present(self, event: Event) -> bool:
        """Allow a read whose blocks are all on disk here, without the server (True: answered and closed)."""
        try:
            stat = os.fstat(event.fd)
            view = self.views.get((stat.st_dev, stat.st_ino))
            if view is None or not view.present(event.offset, event.count):
                return False
            answer(self.group, event.fd, ALLOW)
        except (OSError, ValueError) as exc:  # anything odd: the server decides
            _log("event passed on after an error", error=str(exc))
            return False
        os.close(event.fd)
        self.answered += 1
        return True

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

    def send_events(self, events: list[Event]) -> None:
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
        connection, _ = self.listener.accept()
        uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != 0:
            _log("refused a connection that is not root's", uid=uid)
            connection.close()
            return
        if self.server is not None:
            self.drop_server("a new server connected")
        self.server = connection
        try:
            send_fds(connection, HELLO, [self.group])
            for key, view in self.writers.items():
                send_fds(connection, WRITER + key.encode(), [view.writer])
            send_fds(connection, READY + json.dumps({"pending": len(self.pending)}).encode(), [])
        except OSError as exc:
            self.drop_server(f"cannot greet it: {exc}")
            return
        _log("server connected", writers=len(self.writers), pending=len(self.pending))
        self.send_events(list(self.pending.values()))

    def forget(self, key: str) -> None:
        view = self.writers.pop(key, None)
        if view is not None:
            self.views.pop(view.key, None)
            view.close()

    def drop_server(self, why: str) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            _log("server gone; its unanswered events wait for the next", why=why, pending=len(self.pending))

    def from_server(self) -> bool:
        """Handle one message of the server; False when it is gone."""
        assert self.server is not None
        try:
            data, ancillary, _flags, _ = self.server.recvmsg(MESSAGE_SIZE, socket.CMSG_SPACE(4 * 4))
        except OSError:
            return False
        fds = received_fds(ancillary)
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        kind, body = data[:1], data[1:]
        if kind == DONE:
            for (number,) in struct.iter_unpack("<i", body[: len(body) - len(body) % 4]):
                if self.pending.pop(number, None) is not None:
                    os.close(number)
        elif kind == KEEP and len(fds) == 2:
            self.forget(body.decode())
            try:
                view = BlobView(fds[0], fds[1])
            except (OSError, ValueError, struct.error) as exc:
                _log("cannot keep a blob's writer and map", key=body.decode(), error=str(exc))
            else:
                self.writers[body.decode()] = self.views[view.key] = view
                fds = []
        elif kind == FORGET:
            self.forget(body.decode())
        elif kind == RELEASE:
            if self.pending:
                _log("release refused: events are pending", pending=len(self.pending))
            else:
                _log("released: closing the group")
                self.server.close()
                self.server = None
        else:
            _log("unknown message from the server", kind=kind)
        for fd in fds:
            os.close(fd)
        return True


def _ignored(signum: int, _frame: object) -> None:
    _log("signal ignored: the holder ends when a layer server releases it (no blob with a hole left), or by SIGKILL",
         signal=signal.Signals(signum).name)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bootseer-event-holder", description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the layer server's root (names the holder in ps)")
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket, inherited")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one descriptor per pending event
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a service manager's stop must not drop the group
        signal.signal(signum, _ignored)
    listener = socket.socket(fileno=args.listen_fd)
    holder = Holder(listener)
    _log("holding the fanotify group", root=args.root, socket=listener.getsockname())
    holder.serve()
    os.close(holder.group)
    Path(listener.getsockname()).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
