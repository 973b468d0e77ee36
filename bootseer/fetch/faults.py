"""A RangeSource wrapper that records range reads and injects faults, for tests and drills.

:class:`FaultySource` wraps a real backend.  It logs every ``read_range`` (which
connection, which bytes, what happened), counts connections opened and closed, and
on request makes reads fail the way networks and stores do: an exception, a short
read, wrong bytes (one flipped, the length right: what only a checksum catches), or a
pause until released.  A connection that has failed stays broken, like a
reset TCP stream, so any later read on it fails too: a client that reuses a broken
connection shows up in :attr:`FaultySource.reads` as ``"broken"``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from bootseer.fetch.source import Connection, Entry, RangeSource, TransientError

PAUSE_LIMIT_SECONDS = 60.0  # a paused read gives up after this, so a forgotten resume() cannot hang a test


@dataclass
class Fault:
    """Make matching reads fail.

    ``path`` None matches every path; ``times`` None fails forever, else that many
    reads.  ``short`` returns half the bytes instead of raising ``error()``; ``garble``
    returns every byte with the first one flipped.
    """

    path: str | None = None
    times: int | None = None
    error: Callable[[], BaseException] = lambda: TransientError("injected fault")
    short: bool = False
    garble: bool = False

    def matches(self, path: str) -> bool:
        return (self.path is None or self.path == path) and (self.times is None or self.times > 0)


@dataclass(frozen=True)
class ReadRecord:
    connection: int  #: the id of the connection the read ran on
    path: str
    offset: int
    length: int
    outcome: str  #: "ok", "short", "garbled", "error" (injected) or "broken" (on a connection that failed before)
    returned: int  #: bytes returned


class FaultySource:
    """``inner`` with recorded reads and injected faults.  Thread-safe."""

    def __init__(self, inner: RangeSource) -> None:
        self.inner = inner
        self.url = inner.url
        self.display_url = getattr(inner, "display_url", inner.url)
        if hasattr(inner, "default_streams"):
            self.default_streams = inner.default_streams
        self.reads: list[ReadRecord] = []
        self.opened: list[int] = []  # connection ids, in order of opening
        self.closed: set[int] = set()
        self._faults: list[Fault] = []
        self._stat_faults: list[Fault] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._running = threading.Event()
        self._running.set()

    def __repr__(self) -> str:
        return f"FaultySource({self.inner!r})"

    # -- fault control -----------------------------------------------------------

    def fail(self, fault: Fault | None = None, **fields) -> Fault:
        """Add a fault for range reads (a :class:`Fault` or its fields); returns it."""
        fault = fault or Fault(**fields)
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail_stat(self, fault: Fault | None = None, **fields) -> Fault:
        """Add a fault for stat and listdir calls."""
        fault = fault or Fault(**fields)
        with self._lock:
            self._stat_faults.append(fault)
        return fault

    def heal(self) -> None:
        """Remove every fault; broken connections stay broken."""
        with self._lock:
            self._faults.clear()
            self._stat_faults.clear()

    def pause(self) -> None:
        """Make range reads block (after recording nothing) until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    # -- what happened ---------------------------------------------------------------

    def bytes_read(self, path: str | None = None) -> int:
        """Bytes returned by successful reads (of ``path``, or all)."""
        with self._lock:
            return sum(r.returned for r in self.reads if r.outcome == "ok" and path in (None, r.path))

    def outcomes(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for record in self.reads:
                counts[record.outcome] = counts.get(record.outcome, 0) + 1
            return counts

    # -- RangeSource -----------------------------------------------------------------

    def _take_fault(self, faults: list[Fault], path: str) -> Fault | None:
        with self._lock:
            for fault in faults:
                if fault.matches(path):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def stat(self, path: str) -> Entry:
        fault = self._take_fault(self._stat_faults, path)
        if fault is not None:
            raise fault.error()
        return self.inner.stat(path)

    def listdir(self, path: str) -> list[Entry]:
        fault = self._take_fault(self._stat_faults, path)
        if fault is not None:
            raise fault.error()
        return self.inner.listdir(path)

    def connect(self) -> FaultyConnection:
        connection = FaultyConnection(self, next(self._ids), self.inner.connect())
        with self._lock:
            self.opened.append(connection.id)
        return connection

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        self.inner.corrupt(path, offset, length, version)

    def close(self) -> None:
        self.inner.close()


class FaultyConnection:
    def __init__(self, source: FaultySource, id: int, inner: Connection) -> None:
        self.source = source
        self.id = id
        self.inner = inner
        self.broken = False

    def _record(self, path: str, offset: int, length: int, outcome: str, returned: int) -> None:
        with self.source._lock:
            self.source.reads.append(ReadRecord(self.id, path, offset, length, outcome, returned))

    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        source = self.source
        if not source._running.wait(PAUSE_LIMIT_SECONDS):
            raise TransientError("paused read was never resumed")
        if self.broken:
            self._record(path, offset, length, "broken", 0)
            raise TransientError(f"connection {self.id} is broken")
        fault = source._take_fault(source._faults, path)
        if fault is not None and not fault.short and not fault.garble:
            self.broken = True
            self._record(path, offset, length, "error", 0)
            raise fault.error()
        data = self.inner.read_range(path, offset, length, version)
        if fault is not None and fault.garble:
            self.broken = True
            data = bytes([data[0] ^ 0xFF]) + data[1:] if data else data
            self._record(path, offset, length, "garbled", len(data))
            return data
        if fault is not None:
            self.broken = True
            data = data[: len(data) // 2]
            self._record(path, offset, length, "short", len(data))
            return data
        self._record(path, offset, length, "ok", len(data))
        return data

    def close(self) -> None:
        with self.source._lock:
            self.source.closed.add(self.id)
        self.inner.close()
