"""One open file of the fetch engine: its reads, and the read-ahead window of its handle.

:class:`Reader` (from :meth:`Engine.open <bootseer.fetch.engine.Engine.open>`) follows one sequential
stream per handle and holds stripes ahead of it.  It asks its engine only what :class:`ReaderEngine`
names (holding, keeping and releasing stripes, reading a range, the sizes it plans with): a Protocol
the :class:`~bootseer.fetch.engine.Engine` satisfies, so this module imports nothing of the engine.
:class:`ReadaheadWindows` bounds how many open files of one engine hold a window at once: the
least recently used reader beyond ``max_windows`` loses its window.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Protocol

from bootseer.fetch.bytes_builder import BytesBuilder
from bootseer.fetch.stripes import FileVersion, Priority

if TYPE_CHECKING:
    from bootseer.fetch.digests import DigestList

_MAX_AHEAD_EXTENTS = 16  # extents read ahead of a stream that a reader remembers


class ReadaheadWindows:
    """The readers of one engine that hold a read-ahead window, least recently used first: at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  #: open files that may hold a read-ahead window at once (``EngineConfig.max_windows``)
        self._readers: OrderedDict[Reader, None] = OrderedDict()

    def take(self, reader: Reader) -> None:
        """``reader`` holds a window now; the least recently used reader beyond ``limit`` loses its window."""
        self._readers[reader] = None
        self._readers.move_to_end(reader)
        while len(self._readers) > self.limit:
            victim, _ = self._readers.popitem(last=False)
            victim.lose_window()

    def drop(self, reader: Reader) -> None:
        """``reader`` holds no window any more."""
        self._readers.pop(reader, None)


class ReaderEngine(Protocol):
    """What a :class:`Reader` asks of its engine: the stripes' holds, a range read, and the sizes it plans with."""

    url: str  #: the source's URL as messages show it
    stripe_size: int
    read_lookahead: int  #: stripes of one long read held ahead of the one being copied
    readahead_max_stripes: int  #: the largest read-ahead window, in stripes
    readahead_initial_stripes: int  #: a new stream's window, in stripes
    windows: ReadaheadWindows  #: who holds a window now

    def check_running(self) -> None:
        """FetchError (EIO) once the engine has stopped."""

    def hold_stripe(self, holder: object, file: FileVersion, index: int, priority: Priority) -> None:
        """``holder`` wants stripe ``index`` of ``file`` at ``priority``: queued unless fetched or on its way."""

    def keep_stripe(self, holder: object, file: FileVersion, index: int, priority: Priority) -> bool:
        """Add ``holder`` to the stripe if it is fetched or on its way (queueing nothing); whether it is."""

    def release_stripe(self, holder: object, file: FileVersion, index: int, *, drop: bool = False) -> None:
        """``holder`` no longer wants the stripe (with ``drop``, its buffer goes if nobody else wants it)."""

    async def read_range(
        self, file: FileVersion, offset: int, end: int, deliver: Callable[[int, memoryview], None], *,
        holder: object, sequential: bool,
    ) -> None:  # fmt: skip
        """Hand bytes [offset, end) of ``file`` to ``deliver`` at DEMAND priority, stripe by stripe, in order."""


class Reader:
    """One open file: reads bytes and keeps the read-ahead window of this handle.

    Created by :meth:`Engine.open`.  The reader follows one sequential *stream*: its
    position is how far reads have come, give or take a stripe.  Reads near the
    position continue the stream, even when they arrive out of order, overlap, or
    step back a little (page-fault reads of an mmapped file and concurrent FUSE
    requests do all of that).  While the stream goes on it holds a read-ahead window
    that starts at two stripes and doubles each time the position enters a new
    stripe, up to ``readahead_max``.

    Two other kinds of read keep the stream alive: a read inside the window, ahead of
    the position, which the stream skips when it gets there (``memcpy`` of an mmapped
    tensor touches its last page first, then copies from the start), and a read
    elsewhere, which gives up the window but not the position, so that the next read
    near the position takes the window back.  A read that continues a read elsewhere
    starts a new stream there.  Any other read is random access: it fetches only the
    stripes it touches, so a seek into a huge file does not download it.

    Stripes the position has passed are dropped, except the stripe just behind it,
    which late reads of a read-around may still come back for.
    """

    def __init__(
        self, engine: ReaderEngine, path: str, size: int, *, version: str = "", mtime: float | None = None,
        digests: DigestList | None = None,
    ) -> None:
        self.engine = engine
        self.path = path
        self.size = size
        #: the version this handle reads (and the digest list its stripes are verified against, if any)
        self.file = FileVersion.of(path, size, version, mtime, digests)
        self.closed = False
        self._held: set[int] = set()  # stripe indexes this handle holds (the window, the stripes just behind it)
        self._position: int | None = None  # how far the stream has come
        self._last_stripe = -1  # the stripe of the stream's last byte read; the window lies beyond it
        self._window = 0  # read-ahead stripes beyond ``_last_stripe`` held now
        self._paused_window = 0  # the window given up on a read elsewhere, taken back if the stream goes on
        self._missed_end: int | None = None  # the end of the last read if it was elsewhere: a stream may start there
        self._ahead: list[tuple[int, int]] = []  # extents read inside the window, ahead of the position

    def __repr__(self) -> str:
        return f"<Reader {self.engine.url} {self.path!r} size={self.size}>"

    @property
    def window(self) -> int:
        """The read-ahead window now, in stripes beyond the one last read (0: none)."""
        return self._window

    async def read(self, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes from ``offset``; fewer only at the end of the file, ``b""`` past it.

        Raises FetchError (EIO) if a stripe cannot be fetched.
        """
        end = self._range(offset, size)
        if end <= offset:
            return b""
        builder = BytesBuilder(end - offset)

        def deliver(position: int, piece: memoryview) -> None:
            builder.view[position : position + len(piece)] = piece

        try:
            await self._read(offset, end, deliver)
        except BaseException:
            builder.view.release()
            raise
        return builder.result()

    async def read_into(self, offset: int, buffer: Any) -> int:
        """Fill writable ``buffer`` from ``offset``; returns the bytes written (fewer only at the end of the file)."""
        with memoryview(buffer) as view, view.cast("B") as target:
            end = self._range(offset, len(target))
            if end <= offset:
                return 0

            def deliver(position: int, piece: memoryview) -> None:
                target[position : position + len(piece)] = piece

            await self._read(offset, end, deliver)
            return end - offset

    def _range(self, offset: int, size: int) -> int:
        if self.closed:
            raise ValueError(f"read from a closed reader of {self.path!r}")
        if offset < 0 or size < 0:
            raise ValueError(f"invalid read: offset={offset} size={size}")
        self.engine.check_running()
        return min(offset + size, self.size)

    async def _read(self, offset: int, end: int, deliver: Callable[[int, memoryview], None]) -> None:
        engine = self.engine
        stripe_size = engine.stripe_size
        first, last = offset // stripe_size, (end - 1) // stripe_size
        # Queue this read's own stripes before the read-ahead beyond them.
        token = object()
        for index in range(first, min(last, first + engine.read_lookahead - 1) + 1):
            engine.hold_stripe(token, self.file, index, Priority.DEMAND)
        try:
            continues = self._follow(offset, end)
            await engine.read_range(self.file, offset, end, deliver, holder=token, sequential=continues)
        finally:
            for index in range(first, min(last, first + engine.read_lookahead - 1) + 1):
                engine.release_stripe(token, self.file, index)

    def _follow(self, offset: int, end: int) -> bool:
        """Place the read of [offset, end) in the stream and move the window; whether it moved the stream.

        Only a read that moved the stream may drop the stripes it passed: nothing
        else says the reader is done with them.
        """
        engine = self.engine
        stripe_size = engine.stripe_size
        position, missed_end = self._position, self._missed_end
        self._missed_end = None
        if position is None:
            if offset < stripe_size:  # a first read near the start: a scan is likely
                self._advance(end, restart=True)
                return True
        elif position - stripe_size <= offset <= position + stripe_size // 2:
            self._advance(max(end, position), restart=False)
            return True
        elif self._window and position < offset and (end - 1) // stripe_size <= self._last_stripe + self._window:
            # Ahead, inside the window: the stream is on its way there, and will pass
            # this extent without reading it again.
            self._ahead.append((offset, end))
            del self._ahead[:-_MAX_AHEAD_EXTENTS]
            engine.windows.take(self)
            return False
        if missed_end is not None and missed_end - stripe_size <= offset <= missed_end + stripe_size // 2:
            # Continues a read elsewhere: a new stream starts there.
            self._advance(end, restart=True)
            return True
        # Elsewhere: random access, or a one-off read away from a stream that goes on.
        self._missed_end = end
        if self._window:
            self._paused_window = self._window
            self._window = 0
            engine.windows.drop(self)
        for index in self._held:
            engine.release_stripe(self, self.file, index)
        self._held = set()
        return False

    def _advance(self, position: int, *, restart: bool) -> None:
        """Move the stream to ``position`` (a new stream if ``restart``) and hold its window."""
        engine = self.engine
        stripe_size = engine.stripe_size
        if restart:
            self._ahead = []
        ahead = []
        for start, stop in sorted(self._ahead):  # extents read ahead that the stream now reaches
            if start <= position + stripe_size // 2:
                position = max(position, stop)
            else:
                ahead.append((start, stop))
        self._ahead = ahead
        current = (position - 1) // stripe_size  # the stripe of the last byte read
        if not (engine.readahead_max_stripes and engine.windows.limit):
            self._window = 0
        elif restart or self._window == 0:
            paused = 0 if restart else self._paused_window
            self._window = max(engine.readahead_initial_stripes, min(paused, engine.readahead_max_stripes))
        elif current > self._last_stripe:
            self._window = min(2 * self._window, engine.readahead_max_stripes)
        self._paused_window = 0
        if self._window:
            engine.windows.take(self)
        else:
            engine.windows.drop(self)
        self._position = position
        self._last_stripe = current
        end_stripe = (self.size - 1) // stripe_size
        window = range(current + 1, min(current + self._window, end_stripe) + 1)
        for index in window:
            if index not in self._held:
                engine.hold_stripe(self, self.file, index, Priority.READAHEAD)
        # Keep what lies within a stripe behind the position, if it is here anyway: late
        # and reordered reads (an mmap's read-around, concurrent requests) come back for it.
        behind = range(max(0, position - stripe_size) // stripe_size, current + 1)
        wanted = set(window)
        wanted.update(index for index in behind if engine.keep_stripe(self, self.file, index, Priority.READAHEAD))
        for index in self._held - wanted:
            # A stream does not come back to what lies more than a stripe behind it.
            engine.release_stripe(self, self.file, index, drop=not restart and index < behind.start)
        self._held = wanted

    def lose_window(self) -> None:
        """Give up the read-ahead window (the engine has too many); called by :class:`ReadaheadWindows`."""
        self._window = 0
        self._paused_window = 0
        for index in self._held:
            if index > self._last_stripe:
                self.engine.release_stripe(self, self.file, index)
        self._held = {index for index in self._held if index <= self._last_stripe}

    def close(self) -> None:
        """Let go of everything this handle holds; buffered stripes stay until memory is needed."""
        if self.closed:
            return
        self.closed = True
        self.engine.windows.drop(self)
        for index in self._held:
            self.engine.release_stripe(self, self.file, index)
        self._held = set()
