"""The striped, prioritised, memory-bounded range-fetch engine.

This module is the engine's orchestration (queue, holds, memory, workers, failures, the disk
cache); how much a fetch may hold and whom it evicts is :mod:`bootseer.fetch.memory`, which keys
fail at once is :mod:`bootseer.fetch.failures`; what it fetches is :mod:`bootseer.fetch.stripes` (priorities, file versions, extents, the
stripe state machine), an open file's read-ahead is :mod:`bootseer.fetch.reader`, when a failure
is retried is :mod:`bootseer.fetch.retry`, and what it counts is :mod:`bootseer.fetch.metrics` and
:meth:`Engine.statistics`.

Files at a :class:`~bootseer.fetch.source.RangeSource` are cut into fixed-size
*stripes*.  A stripe is fetched once, by one of ``streams`` worker tasks, and shared
by every reader that wants it.  Workers take stripes from one priority queue
(:class:`Priority`: demand reads first, then read-ahead, then prefetch; first come,
first served within a priority) and run the blocking ``Connection.read_range`` in a
worker thread, each worker keeping a connection of its own.

Callers that know which bytes they want (the block store's packs) ask for
:class:`Extent` s instead (:meth:`Engine.fetch_extents`): ranges they name with a
key of their own (a block's digest and place).  An extent is one more kind of
stripe: it is held, queued, prioritised, bounded in memory, retried, failed and
counted by the very same code, and equal keys share one fetch and one buffer.  What
extents add is coalescing: a worker that takes a queued extent also takes the queued
extents of the same object and priority that lie next to it (gaps up to
``coalesce_gap``), up to ``stripe_size`` in all, fetches them with one range
request and splits the bytes.  A caller that expects to want more extents soon
queues them with :meth:`Engine.readahead_extents` (at READAHEAD, nobody waiting):
those next to a DEMAND extent ride in its request, up to ``readahead_join`` bytes,
the rest go in requests of their own behind every demand fetch, and once fetched
they are loose buffers that a later ``fetch_extents`` of the same key takes without
a fetch.  Extents skip the stripe disk cache: the caller
verifies and caches what it asked for (``blockstore/node/block_cache.py``), keyed by content
rather than by place.

Who wants a stripe is recorded as *holds*: a read holds the stripes it is copying
from (at DEMAND), a :class:`Reader` holds its read-ahead window (at READAHEAD) and
:meth:`Engine.prefetch` holds the stripes it brings in (at PREFETCH).  A queued
stripe nobody holds any more is cancelled; a buffered stripe nobody holds stays as
a *loose* stripe (a small in-memory cache) until memory is needed, except that a
stripe a sequential reader has left more than a stripe behind is dropped at once.

Memory: every stripe byte in flight or buffered is counted, and a worker starts a
fetch only when its bytes fit under ``memory_limit``.  To make room it evicts
buffered stripes nobody is waiting on, least wanted first (loose, then prefetched,
then read-ahead, then a long read's later stripes, which only a demand fetch may
evict), least recently used first among equals.  Read-ahead and prefetch also
leave one stripe of memory to demand reads, so read-ahead yields to demand.  A
stripe a task is waiting on is never evicted, and every in-flight fetch ends, so
demand reads always make progress.

Versions: a stripe belongs to one version of a file (path, size and the source's
:attr:`~bootseer.fetch.source.Entry.version`), every range read asks the source for
that version, and a source that finds another raises ``Changed``: bytes of two
versions never meet in one read, in memory or in the disk cache.

Faults: a failed fetch (TransientError, OSError, anything unexpected, a short read
before the end of the file) closes that worker's connection and puts the stripe
back in the queue after a backoff, so the retry runs on another connection.
NotFound, PermanentError (``Changed`` included) and a file whose size changed fail
at once (when to retry, how long to wait, when to give up: :class:`~bootseer.fetch.retry.RetryPolicy`,
shared with the registry client).  A stripe not fetched ``retry_timeout`` seconds after its first attempt
began fails, even if that attempt is still waiting on a source that never answers:
the blocked call is abandoned and its connection closed from another thread, which
aborts it where the backend allows.  Either way the tasks waiting on it get
:class:`FetchError` (EIO), never short or wrong bytes, and the engine goes on
serving everything else.  Bytes a caller finds corrupt are reported with
:meth:`Engine.corrupt`: the source learns of it (a store proxy that served them is
set aside) and the buffer goes, so the caller's refetch asks the store again.
A stripe or extent that failed for good keeps failing at
once for ``Engine.failure_memory`` seconds (:mod:`bootseer.fetch.failures`), so a read
the kernel retries right after a failure does not wait out a second timeout.  Stopping the engine abandons calls in flight the same
way, so it never waits on a silent source.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import heapq
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from bootseer import cpu
from bootseer.counters import Counters
from bootseer.fetch.failures import FailureMemory
from bootseer.fetch.file_cache import StripeCache
from bootseer.fetch.memory import MemoryBound, eviction_candidates
from bootseer.fetch.metrics import (
    BYTES_FETCHED, EXTENT_JOINS, EXTENT_REQUESTS, EXTENTS, GAP_BYTES, HELD_BYTES, IN_FLIGHT, RETRIES, STRIPES,
)
from bootseer.fetch.reader import Reader
from bootseer.fetch.retry import RetryPolicy, is_permanent
from bootseer.fetch.source import (
    Connection, Entry, NotADirectory, NotFound, PermanentError, ProxiedSource, ProxyStatus, RangeSource, TransientError,
)  # fmt: skip
from bootseer.fetch.sources import redact_url
from bootseer.fetch.stripes import (
    Extent, ExtentKey, FetchError, FileVersion, Priority, Stripe, StripeKey, StripeState, check_same_place, span,
)
from bootseer.log import get_logger

log = get_logger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

T = TypeVar("T")

@dataclass(frozen=True)
class EngineConfig:
    """How an :class:`Engine` stripes, parallelises, buffers and retries."""

    stripe_size: int = 8 * MiB  #: 8-16 MiB suits remote stores; reads are split on stripe boundaries
    streams: int | None = None  #: parallel range requests; None: the source's ``default_streams`` or 16
    readahead_max: int = 256 * MiB  #: largest read-ahead window of one open file
    memory_limit: int = 1 * GiB  #: stripe bytes held (in flight + buffered), all files together
    max_windows: int = 64  #: open files that may hold a read-ahead window at once
    retry_timeout: float = 60.0  #: a stripe that keeps failing this long fails with FetchError (EIO)
    cache_dir: str | None = None  #: optional verified on-disk stripe cache (off by default)
    cache_size: int = 16 * GiB  #: bytes the on-disk cache may hold
    #: Largest gap between queued extents that one range request bridges (the gap's
    #: bytes are fetched and dropped).  128 KiB costs about 1 ms at 1 Gbit/s, less than
    #: the round trip of a second request to an object store or a CDN (several ms), and
    #: bridges the hole a block already in the node cache leaves between its neighbours
    #: when blocks are small and compress well.
    coalesce_gap: int = 128 * KiB
    #: Most bytes of READAHEAD extents (:meth:`Engine.readahead_extents`) that a DEMAND
    #: extent's range request carries besides the extents at its own priority: at
    #: 1 Gbit/s 256 KiB adds about 2 ms to that read, while the read-ahead beyond it
    #: goes in requests of its own that the waiting read does not wait for.
    readahead_join: int = 256 * KiB

    def __post_init__(self) -> None:
        problems = []
        if self.stripe_size < 1:
            problems.append(f"stripe_size must be positive, not {self.stripe_size}")
        if self.streams is not None and self.streams < 1:
            problems.append(f"streams must be at least 1, not {self.streams}")
        if self.readahead_max < 0:
            problems.append(f"readahead_max must not be negative, not {self.readahead_max}")
        if self.memory_limit < self.stripe_size:
            problems.append(f"memory_limit ({self.memory_limit}) must hold at least one stripe ({self.stripe_size})")
        if self.max_windows < 0:
            problems.append(f"max_windows must not be negative, not {self.max_windows}")
        if not self.retry_timeout >= 0:
            problems.append(f"retry_timeout must not be negative, not {self.retry_timeout}")
        if self.cache_dir is not None and self.cache_size < self.stripe_size:
            problems.append(f"cache_size ({self.cache_size}) must hold at least one stripe ({self.stripe_size})")
        if self.coalesce_gap < 0:
            problems.append(f"coalesce_gap must not be negative, not {self.coalesce_gap}")
        if self.readahead_join < 0:
            problems.append(f"readahead_join must not be negative, not {self.readahead_join}")
        if problems:
            raise ValueError("invalid fetch engine configuration: " + "; ".join(problems))


@dataclass(frozen=True)
class EngineStatistics:
    """One engine at one moment (:meth:`Engine.statistics`): for status answers, metrics samplers, tests
    and benchmarks.  The engine counts into a :class:`~bootseer.counters.Counters` of it, its own."""

    bytes_fetched: int = 0  #: bytes read from the source
    stripes_fetched: int = 0  #: stripes read from the source
    cache_hits: int = 0  #: stripes served by the disk cache
    retries: int = 0  #: failed fetches put back to be retried
    failures: int = 0  #: stripes that failed for good
    evictions: int = 0  #: buffered stripes evicted to make room
    in_flight: int = 0  #: fetches running now
    held_bytes: int = 0  #: stripe bytes in flight or buffered now
    peak_held_bytes: int = 0  #: the most ``held_bytes`` has ever been
    extents_fetched: int = 0  #: caller extents read from the source
    extent_requests: int = 0  #: range requests that fetched extents
    coalesced_requests: int = 0  #: of those, requests that carried more than one extent
    gap_bytes: int = 0  #: bytes between coalesced extents, fetched and dropped (in ``bytes_fetched``)
    discards: int = 0  #: buffered extents and stripes dropped by :meth:`Engine.discard` and :meth:`Engine.corrupt`
    extents_joined_in_flight: int = 0  #: urgent asks for an extent a less urgent fetch was already fetching
    extents_raised: int = 0  #: urgent asks for an extent queued at a lower priority, which they raised
    extents_read_ahead: int = 0  #: extents queued by :meth:`Engine.readahead_extents`
    proxy: ProxyStatus | None = None  #: the store proxy the source reads through, if it has one


#: What the engine counts itself (the rest of :class:`EngineStatistics` it asks for when asked).
_COUNTED = tuple(field.name for field in dataclasses.fields(EngineStatistics) if field.name != "proxy")


class _SizeChanged(PermanentError):
    """The file no longer has the size it was opened with."""


class _Stream:
    """A worker's connection, shared by the worker and the thread that reads with it.

    A read blocked on a silent source is aborted by :meth:`abort` from the trio
    thread: the connection is closed from a thread of its own (a backend's ``close``
    may wait for the read it aborts) and the stream is dead for good; the abandoned
    read fails on its own and the worker goes on with a new stream.
    """

    def __init__(self) -> None:
        self.connection: Connection | None = None
        self.aborted = False
        self._lock = threading.Lock()

    def connect(self, source: RangeSource) -> Connection:
        """In the reading thread: the connection, opened if there is none."""
        with self._lock:
            if self.connection is not None:
                return self.connection
        connection = source.connect()
        with self._lock:
            if not self.aborted:
                self.connection = connection
                return connection
        _close_quietly(connection)  # aborted while connecting: nobody will use it
        raise TransientError(f"{display_url(source)}: connection abandoned")

    def discard(self) -> None:
        """In the reading thread: close the connection after a failure (the next read opens another)."""
        with self._lock:
            connection, self.connection = self.connection, None
        if connection is not None:
            _close_quietly(connection)

    def abort(self) -> None:
        """From the trio thread, without blocking: close the connection under a blocked read."""
        with self._lock:
            self.aborted = True
            connection, self.connection = self.connection, None
        if connection is not None:
            threading.Thread(target=_close_quietly, args=(connection,), name="bootseer-fetch-abort", daemon=True).start()


def display_url(source: RangeSource) -> str:
    """What logs and messages show of ``source``: its URL without credentials or query."""
    shown = getattr(source, "display_url", None)
    return shown if isinstance(shown, str) else redact_url(source.url)


def _close_quietly(connection: Connection) -> None:
    try:
        connection.close()
    except Exception as exc:  # a broken connection may fail to close; it is gone either way
        log.debug("closing a connection failed", error=repr(exc))


async def _run_abandoning(function: Callable[..., T], *args: Any, on_abandon: Callable[[], None] | None = None) -> T:
    """``function(*args)`` in a worker thread that is abandoned if this task is cancelled.

    ``on_abandon`` (say, closing the connection the thread reads from) runs first, so
    the thread fails soon rather than at the backend's own timeout.  Each call has a
    limiter of its own: the callers bound the threads (one per stream), and an
    abandoned thread must not hold a slot of the engine's until it ends.
    """
    try:
        return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True, limiter=trio.CapacityLimiter(1))
    except trio.Cancelled:
        if on_abandon is not None:
            on_abandon()
        raise


# -- the engine ----------------------------------------------------------------------


class Engine:
    """Serves striped range reads of one source; run it with :meth:`run` (or :func:`open_engine`).

    All methods are called from the trio thread that runs :meth:`run`.
    """

    def __init__(self, source: RangeSource, config: EngineConfig = EngineConfig()) -> None:
        self.source = source
        self.config = config
        self.stripe_size = config.stripe_size
        self.streams = config.streams or int(getattr(source, "default_streams", 16))
        if self.streams < 1:
            raise ValueError(f"{source!r}: default_streams must be at least 1, not {self.streams}")
        self._stats: Counters[EngineStatistics] = Counters(EngineStatistics, _COUNTED)
        stripes_in_memory = config.memory_limit // config.stripe_size
        # How many stripes of one long read are held (and so fetched in parallel) ahead
        # of the one being copied: enough for every stream, no more than memory allows.
        self.read_lookahead = max(1, min(2 * self.streams, stripes_in_memory // 2))
        self.readahead_max_stripes = config.readahead_max // config.stripe_size
        self.readahead_initial_stripes = min(2, self.readahead_max_stripes)
        #: Stripes and extents that failed for good lately keep failing at once.
        self._failures = FailureMemory(config.retry_timeout)
        #: When a failing stripe or metadata call is tried again, and when it fails (EIO).
        self.retry = RetryPolicy(timeout=config.retry_timeout)
        # How much memory a fetch at each priority may fill (demand reads keep a stripe's worth).
        self._memory = MemoryBound.for_stripes(config.memory_limit, config.stripe_size)
        self._cache = StripeCache(config.cache_dir, config.cache_size) if config.cache_dir else None
        # One thread per stream: trio's default limiter (40 threads, shared by everything
        # in the process) would cap a wide engine and let one engine starve another.
        self._threads = trio.CapacityLimiter(self.streams)
        self._stripes: dict[StripeKey, Stripe] = {}
        self._buffered: dict[StripeKey, Stripe] = {}  # the DONE stripes
        self._queue: list[tuple[int, int, Stripe]] = []  # (priority, seq, stripe); stale entries skipped
        self._backoff: list[tuple[float, int, Stripe]] = []  # (due time, seq, stripe)
        self._seq = itertools.count()
        self._clock = itertools.count(1)  # use order, for LRU
        self._changed = trio.Event()
        self._starved = False  # a worker waits for memory that evictions could not free
        self._windows: OrderedDict[Reader, None] = OrderedDict()  # readers holding a window, LRU first
        # The queued extents of each object version, by offset: where workers find neighbours to coalesce.
        self._queued_extents: dict[tuple[str, str], list[tuple[int, int, Stripe]]] = {}
        # The holder of extents queued by readahead_extents until they are fetched (then loose).
        self._speculative = object()
        self._running = False
        self._stopped = False
        self.url = display_url(source)  #: the source's URL as logs and messages show it (no secrets)

    def __repr__(self) -> str:
        return f"<Engine {self.url} streams={self.streams} stripe={self.stripe_size}>"

    # -- lifecycle ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the workers until cancelled; then fail whatever is still pending."""
        if self._running or self._stopped:
            raise RuntimeError(f"{self!r} runs only once")
        self._running = True
        log.debug("fetch engine starting", url=self.url, streams=self.streams, stripe_size=self.stripe_size)
        try:
            async with trio.open_nursery() as nursery:
                for number in range(self.streams):
                    nursery.start_soon(self._worker, number, name=f"fetch worker {number} {self.url}")
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._stopped = True
            self._fail_all(FetchError(f"{self.url}: the fetch engine stopped"))

    def check_running(self) -> None:
        """FetchError (EIO) once the engine has stopped: nothing more can be read through it."""
        if self._stopped:
            raise FetchError(f"{self.url}: the fetch engine stopped")

    def statistics(self) -> EngineStatistics:
        """What this engine has counted, what it holds now, and its source's proxy (a frozen copy)."""
        proxy = self.source.proxy_status() if isinstance(self.source, ProxiedSource) else None
        return self._stats.frozen(proxy=proxy)

    def _fail_all(self, error: FetchError) -> None:
        for stripe in list(self._stripes.values()):
            if stripe.state is StripeState.DONE:
                self._forget(stripe)
            else:
                self._fail(stripe, error)

    # -- metadata ------------------------------------------------------------------

    async def stat(self, path: str) -> Entry:
        """The source's :class:`Entry` for ``path``, retried like a stripe.

        Raises NotFound / NotADirectory as the source does, FetchError otherwise.
        The entry's ``version`` is what :meth:`open` takes.
        """
        return await self._call_retrying(f"stat {path or '.'}", self.source.stat, path)

    async def listdir(self, path: str) -> list[Entry]:
        """The entries of directory ``path`` (with their versions), retried like a stripe."""
        return await self._call_retrying(f"list {path or '.'}", self.source.listdir, path)

    async def _call_retrying(self, what: str, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in a thread, retried with backoff until ``retry_timeout``
        after the first attempt began (a call still waiting on the source then is abandoned)."""
        self.check_running()
        first_attempt = trio.current_time()
        attempts = 0
        while True:
            attempts += 1
            try:
                with trio.move_on_at(self.retry.deadline(first_attempt)):
                    return await _run_abandoning(function, *args)
                error: Exception = TimeoutError(f"no answer in {self.config.retry_timeout:g}s")
            except (NotFound, NotADirectory):
                raise
            except PermanentError as exc:
                raise FetchError(f"{self.url}: {what}: {exc}") from exc
            except Exception as exc:
                error = exc
            now = trio.current_time()
            if self.retry.gives_up(error, attempts, first_attempt, now):
                raise FetchError(
                    f"{self.url}: {what}: still failing after {now - first_attempt:.1f}s "
                    f"and {attempts} attempts: {error!r}"
                ) from error
            log.warning("source call failed; retrying", url=self.url, call=what, attempt=attempts,
                        error=repr(error))  # fmt: skip
            await trio.sleep(self.retry.wait(attempts, first_attempt, now))

    # -- reading -------------------------------------------------------------------

    def open(self, path: str, size: int, mtime: float | None = None, version: str = "") -> Reader:
        """A :class:`Reader` of the version of ``path`` that is ``size`` bytes long.

        ``version`` (the :attr:`Entry.version` of a stat or listing) pins the reader to
        that version: stripes are shared only by readers of one version, every range
        read asks the source for it, and a file that has changed since fails the
        read with FetchError (EIO) rather than mixing versions.  ``mtime`` keys the
        disk cache where the source gives no version; without either, the engine asks
        the source when the cache first needs it.
        """
        self.check_running()
        if size < 0:
            raise ValueError(f"file size must not be negative, not {size}")
        return Reader(self, path, size, version=version, mtime=mtime)

    async def prefetch(
        self,
        path: str,
        size: int,
        offset: int,
        length: int,
        priority: Priority = Priority.PREFETCH,
        *,
        version: str = "",
        mtime: float | None = None,
    ) -> None:
        """Bring bytes ``offset`` to ``offset + length`` of ``path`` into memory (and the disk cache).

        ``version`` and ``mtime`` are those :meth:`open` takes; the stripes serve
        readers of that version.  Returns when they have been fetched; they then stay
        buffered until memory is needed.  Raises FetchError if a stripe cannot be fetched.
        """
        self.check_running()
        if offset < 0 or length < 0:
            raise ValueError(f"invalid prefetch range: offset={offset} length={length}")
        end = min(offset + length, size)
        if offset >= end:
            return
        file = FileVersion.of(path, size, version, mtime)
        await self._walk(file, offset, end, Priority(priority), None, drop_passed=False)

    async def fetch_extents(self, extents: Sequence[Extent], priority: Priority = Priority.DEMAND) -> list[bytes]:
        """The bytes of each extent, exactly its length, in the order given.

        Extents with equal keys share one fetch and one buffer, with those of other
        callers too; a buffered extent is served without a fetch until memory is
        needed or :meth:`discard` drops it.  Queued extents of one object next to
        each other are fetched with one range request (see :class:`EngineConfig`'s
        ``coalesce_gap``).  A DEMAND fetch goes ahead of PREFETCH ones, and of an
        extent already queued at a lower priority it raises the priority; one
        already in flight is waited on, never fetched twice.  Like a stripe's read,
        this holds the extents a bounded number of bytes ahead of the one it waits
        for, so a long list stays within the memory bound.

        Raises FetchError (EIO) if an extent cannot be fetched (its object is
        missing, shorter than the extent, another version than ``version``, or
        failing for ``retry_timeout``); ValueError if a key names two places.
        """
        self.check_running()
        priority = Priority(priority)
        results: list[bytes] = [b""] * len(extents)
        wanted: dict[ExtentKey, tuple[Extent, list[int]]] = {}  # each key once, in first-seen order
        for position, extent in enumerate(extents):
            if not isinstance(extent, Extent):
                raise TypeError(f"fetch_extents takes Extent objects, not {extent!r}")
            if extent.length == 0:
                continue
            if extent.length > self.config.memory_limit:
                raise ValueError(
                    f"extent {extent.key!r} is {extent.length} bytes, more than the engine's memory_limit "
                    f"({self.config.memory_limit}) can hold"
                )
            key = ExtentKey(extent.key)
            seen = wanted.get(key)
            if seen is None:
                wanted[key] = (extent, [position])
            else:
                check_same_place(seen[0], extent)
                seen[1].append(position)
        order = [extent for extent, _ in wanted.values()]
        token = object()  # the holder of this call's holds
        held: dict[int, Stripe] = {}
        budget = self.read_lookahead * self.stripe_size  # bytes held beyond the one waited on, as a read holds stripes
        ahead, ahead_bytes = 0, 0  # order[:ahead] have been held; ahead_bytes of them not yet taken
        try:
            for number, (extent, positions) in enumerate(wanted.values()):
                while ahead < len(order) and (ahead <= number or ahead_bytes + order[ahead].length <= budget):
                    held[ahead] = self._hold_extent(token, order[ahead], priority)
                    ahead_bytes += order[ahead].length
                    ahead += 1
                stripe = held[number]
                if stripe.state is StripeState.GONE:  # evicted or discarded before its turn: hold it again
                    stripe = held[number] = self._hold_extent(token, extent, priority)
                data = await self._wait(stripe)
                for position in positions:
                    results[position] = data
                ahead_bytes -= extent.length
                self._release(token, held.pop(number))
        finally:
            for stripe in held.values():
                self._release(token, stripe)
        return results

    def readahead_extents(self, extents: Sequence[Extent], priority: Priority = Priority.READAHEAD) -> list[Extent]:
        """Queue ``extents`` that a caller expects to want soon, without waiting for them; returns those queued.

        An extent the engine already knows (queued, in flight, buffered, or failed
        within :attr:`failure_memory`) is left alone, so nothing is fetched twice.
        Queued ones are fetched behind every more urgent fetch; those next to a
        DEMAND extent join its range request, up to ``readahead_join`` bytes.  Once
        fetched an extent is a loose buffer, evicted before anything held, that a
        later :meth:`fetch_extents` of its key takes without a fetch; one that fails
        is dropped (the caller who wants it after all fetches it with a clock of
        its own).  Call it right before the :meth:`fetch_extents` whose request its
        extents should join: a worker takes them at its next checkpoint.  Raises
        ValueError if a key names two places.
        """
        self.check_running()
        priority = Priority(priority)
        queued = []
        for extent in extents:
            if not isinstance(extent, Extent):
                raise TypeError(f"readahead_extents takes Extent objects, not {extent!r}")
            if extent.length == 0 or extent.length > self.config.memory_limit:
                continue
            key = ExtentKey(extent.key)
            known = self._stripes.get(key)
            if known is not None:
                assert known.extent is not None
                check_same_place(known.extent, extent)
                continue
            if self._failures.recent(key) is not None:
                continue
            stripe = Stripe(FileVersion(extent.path, -1, extent.version), -1, self.stripe_size, extent)
            self._stripes[key] = stripe
            stripe.holders[self._speculative] = priority
            self._enqueue(stripe, priority)
            queued.append(extent)
        self._stats.extents_read_ahead += len(queued)
        return queued

    def discard(self, key: Hashable) -> None:
        """Drop the buffered bytes of extent ``key``, which its caller found corrupt; the next fetch refetches it.

        An extent not buffered (unknown, queued or in flight) is left alone: the
        bytes on their way are a new fetch.
        """
        stripe = self._stripes.get(ExtentKey(key))
        if stripe is not None and stripe.state is StripeState.DONE:
            self._stats.discards += 1
            log.info("dropping a buffered extent its reader found corrupt", url=self.url, extent=stripe.describe())
            self._forget(stripe)

    def corrupt(self, path: str, offset: int, length: int, version: str = "", *, key: Hashable | None = None) -> None:
        """The caller found bytes ``offset`` to ``offset + length`` of ``path`` (``version``), which this
        engine fetched, corrupt (they failed its checksum); it is about to fetch them again.

        The source is told (:meth:`RangeSource.corrupt <bootseer.fetch.source.RangeSource.corrupt>`: one
        that served them by a route it can avoid, a store proxy, stops using it, so the
        refetch asks the store itself), and the engine drops its buffer of them: extent
        ``key``'s (as :meth:`discard`), or without a key every buffered stripe of that
        file version the range touches.  Retries and EIO stay the engine's one policy:
        the refetch is a new fetch with its own ``retry_timeout``.  The optional disk
        cache of stripes is not purged (the layer server runs without it).
        """
        try:
            self.source.corrupt(path, offset, length, version)
        except Exception as exc:  # a source must not raise here; a read must not fail because one did
            log.warning("the source failed to take a corruption report", url=self.url, error=repr(exc))
        if key is not None:
            self.discard(key)
            return
        end = offset + length
        for stripe in list(self._buffered.values()):
            if (stripe.extent is None and stripe.path == path and stripe.file.version == version
                    and stripe.offset < end and offset < stripe.offset + stripe.length):  # fmt: skip
                self._stats.discards += 1
                log.info("dropping a buffered stripe its reader found corrupt", url=self.url, stripe=stripe.describe())
                self._forget(stripe)

    def _hold_extent(self, holder: object, extent: Extent, priority: Priority) -> Stripe:
        return self._hold(holder, FileVersion(extent.path, -1, extent.version), -1, priority, extent)

    async def _walk(
        self,
        file: FileVersion,
        offset: int,
        end: int,
        priority: Priority,
        deliver: Callable[[int, memoryview], None] | None,
        *,
        drop_passed: bool,
        token: object | None = None,
    ) -> None:
        """Hold the stripes of [offset, end) ``read_lookahead`` ahead, and hand each to ``deliver`` in order.

        ``deliver(position, piece)`` gets the piece of a stripe that lies in the range
        and its position relative to ``offset``; it must copy what it keeps.
        """
        token = object() if token is None else token  # the holder of this call's holds
        first, last = offset // self.stripe_size, (end - 1) // self.stripe_size
        held: dict[int, Stripe] = {}
        try:
            for index in range(first, last + 1):
                for ahead in range(index, min(last, index + self.read_lookahead - 1) + 1):
                    if ahead not in held:
                        held[ahead] = self._hold(token, file, ahead, priority)
                stripe = held[index]
                if stripe.state is StripeState.GONE:  # evicted before its turn: hold it again
                    stripe = held[index] = self._hold(token, file, index, priority)
                data = await self._wait(stripe)
                if deliver is not None:
                    lo = max(offset, stripe.offset) - stripe.offset
                    hi = min(end, stripe.offset + stripe.length) - stripe.offset
                    with memoryview(data) as view:
                        deliver(stripe.offset + lo - offset, view[lo:hi])
                passed = stripe.offset + stripe.length <= end
                self._release(token, held.pop(index), drop=drop_passed and passed)
        finally:
            for stripe in held.values():
                self._release(token, stripe)

    async def _wait(self, stripe: Stripe) -> bytes:
        """The bytes of ``stripe`` once fetched; FetchError if it failed."""
        if stripe.state is not StripeState.DONE:
            stripe.waiters += 1
            try:
                await stripe.done.wait()
            finally:
                stripe.waiters -= 1
                if not stripe.wanted() and stripe.state in (StripeState.QUEUED, StripeState.BACKOFF):
                    self._forget(stripe)  # the waiting read was cancelled
                self._evictable_changed()
        if stripe.state is StripeState.DONE:
            assert stripe.data is not None
            stripe.last_used = next(self._clock)
            return stripe.data
        if stripe.state is StripeState.FAILED:
            assert stripe.error is not None
            # A fresh exception per waiter: one object raised in many tasks would
            # collect all their tracebacks.
            # (Its message, not str(): that would say "[Errno 5]" twice.)
            message = stripe.error.strerror if isinstance(stripe.error, OSError) and stripe.error.strerror else str(stripe.error)
            raise FetchError(message) from stripe.error.__cause__
        raise FetchError(f"{self.url}: {stripe.describe()}: the fetch engine stopped")

    # -- holds -----------------------------------------------------------------------

    def _hold(
        self, holder: object, file: FileVersion, index: int, priority: Priority, extent: Extent | None = None
    ) -> Stripe:
        """Record that ``holder`` wants a stripe (or ``extent``), queueing it if it is not fetched or on its way."""
        self.check_running()
        key: StripeKey | ExtentKey = (file, index) if extent is None else ExtentKey(extent.key)
        stripe = self._stripes.get(key)
        if stripe is not None and extent is not None:
            assert stripe.extent is not None
            check_same_place(stripe.extent, extent)
        if stripe is None and (failed := self._failures.recent(key)) is not None:
            if extent is not None and failed.extent is not None:
                check_same_place(failed.extent, extent)
            return failed
        if stripe is None:
            stripe = Stripe(file, index, self.stripe_size, extent)
            self._stripes[key] = stripe
            stripe.holders[holder] = priority
            self._enqueue(stripe, priority)
            return stripe
        if not stripe.wanted() and stripe.state is StripeState.BACKOFF:
            # Wanted again after everyone gave up on it: its retry time starts anew.
            stripe.first_attempt = None
            stripe.attempts = 0
        held = stripe.holders.get(holder)
        if extent is not None and held is None and priority < stripe.queued_priority:
            self._count_join(stripe)
        if held is None or priority < held:
            stripe.holders[holder] = priority
        if stripe.state is StripeState.QUEUED and priority < stripe.queued_priority:
            self._enqueue(stripe, priority)  # a more urgent entry; the old one goes stale
        elif stripe.state is StripeState.BACKOFF:
            stripe.queued_priority = min(stripe.queued_priority, priority)
        stripe.last_used = next(self._clock)
        return stripe

    def _count_join(self, stripe: Stripe) -> None:
        """An urgent caller met an extent on its way at a lower priority (a read meeting a prefetch)."""
        if stripe.state is StripeState.FETCHING:
            self._stats.extents_joined_in_flight += 1  # it waits for that fetch instead of making one
            EXTENT_JOINS.labels("in_flight").inc()
        elif stripe.state in (StripeState.QUEUED, StripeState.BACKOFF):
            self._stats.extents_raised += 1  # its priority goes up
            EXTENT_JOINS.labels("queued").inc()

    def _holding(self, holder: object, key: StripeKey, priority: Priority) -> bool:
        """Add ``holder`` to a stripe that is fetched or on its way, without queueing anything."""
        stripe = self._stripes.get(key)
        if stripe is None:
            return False
        if priority < stripe.holders.get(holder, Priority.PREFETCH + 1):
            stripe.holders[holder] = priority
        return True

    def _release(self, holder: object, stripe_or_key: Stripe | StripeKey, *, drop: bool = False) -> None:
        """``holder`` no longer wants the stripe; cancel or (with ``drop``) free it if nobody else does."""
        stripe = stripe_or_key if isinstance(stripe_or_key, Stripe) else self._stripes.get(stripe_or_key)
        if stripe is None or stripe.holders.pop(holder, None) is None:
            return
        self._evictable_changed()
        if stripe.wanted():
            return
        if stripe.state in (StripeState.QUEUED, StripeState.BACKOFF) or (drop and stripe.state is StripeState.DONE):
            self._forget(stripe)

    def _enqueue(self, stripe: Stripe, priority: Priority) -> None:
        stripe.state = StripeState.QUEUED
        stripe.queued_priority = priority
        heapq.heappush(self._queue, (priority, next(self._seq), stripe))
        if stripe.extent is not None and not stripe.indexed:
            bisect.insort(self._queued_extents.setdefault(stripe.object(), []), (stripe.offset, id(stripe), stripe))
            stripe.indexed = True
        self._notify()

    def _unindex(self, stripe: Stripe) -> None:
        """Take a queued extent out of the table of neighbours (it is taken, cancelled or failed)."""
        if not stripe.indexed:
            return
        stripe.indexed = False
        queued = self._queued_extents[stripe.object()]
        position = bisect.bisect_left(queued, (stripe.offset, id(stripe)))
        assert queued[position][2] is stripe
        del queued[position]
        if not queued:
            del self._queued_extents[stripe.object()]

    def _coalesce(self, head: Stripe) -> list[Stripe]:
        """``head`` and the queued extents beside it that one range request fetches with it, in offset order.

        Only extents queued at ``head``'s priority join it, and READAHEAD ones a
        DEMAND head, up to ``readahead_join`` bytes of them: a demand read must not
        wait for the prefetch of its neighbours, nor for much read-ahead.  Extents
        that overlap are not joined (each keeps a buffer of its own); gaps up to
        ``coalesce_gap`` are, and the request spans at most ``stripe_size`` bytes.
        """
        if head.extent is None or not head.indexed:
            return [head]
        queued = self._queued_extents[head.object()]
        at = bisect.bisect_left(queued, (head.offset, id(head)))
        cap, gap = self.stripe_size, self.config.coalesce_gap
        own = head.queued_priority
        riders = self.config.readahead_join if own is Priority.DEMAND else 0  # READAHEAD bytes still allowed

        def joins(stripe: Stripe) -> bool:
            nonlocal riders
            if stripe.queued_priority == own:
                return True
            if stripe.queued_priority is Priority.READAHEAD and stripe.length <= riders:
                riders -= stripe.length
                return True
            return False

        start, end = head.offset, head.offset + head.length
        after: list[Stripe] = []
        for _, _, stripe in queued[at + 1 :]:
            if not end <= stripe.offset <= end + gap or stripe.offset + stripe.length - start > cap:
                break
            if not joins(stripe):
                break
            after.append(stripe)
            end = stripe.offset + stripe.length
        before: list[Stripe] = []
        for _, _, stripe in reversed(queued[:at]):
            stripe_end = stripe.offset + stripe.length
            if not start - gap <= stripe_end <= start or end - stripe.offset > cap:
                break
            if not joins(stripe):
                break
            before.append(stripe)
            start = stripe.offset
        return [*reversed(before), head, *after]

    def _forget(self, stripe: Stripe) -> None:
        """Take a stripe out of the engine (cancelled, dropped or evicted), freeing its bytes."""
        self._unindex(stripe)
        if self._stripes.get(stripe.key) is stripe:
            del self._stripes[stripe.key]
        if stripe.state is StripeState.DONE:
            del self._buffered[stripe.key]
            self._unreserve(stripe.length)
        stripe.state = StripeState.GONE
        stripe.data = None

    def _fail(self, stripe: Stripe, error: BaseException) -> None:
        self._unindex(stripe)
        if stripe.state is StripeState.FETCHING:
            self._unreserve(stripe.length)
        if self._stripes.get(stripe.key) is stripe:
            del self._stripes[stripe.key]
        stripe.state = StripeState.FAILED
        stripe.error = error
        stripe.done.set()

    @property
    def failure_memory(self) -> float:
        """Seconds a stripe or extent that failed for good keeps failing at once (see :mod:`bootseer.fetch.failures`)."""
        return self._failures.seconds

    def _remember_failure(self, stripe: Stripe) -> None:
        self._failures.remember(stripe)

    def _notify(self) -> None:
        """Wake the workers waiting in :meth:`_take`: the queue, memory or evictable stripes changed."""
        self._starved = False
        self._changed.set()
        self._changed = trio.Event()

    def _evictable_changed(self) -> None:
        """A stripe lost a holder or a waiter, so it may be evictable now."""
        if self._starved:
            self._notify()

    # -- memory ----------------------------------------------------------------------

    def _reserve(self, stripe: Stripe, length: int | None = None) -> bool:
        """Count ``stripe``'s bytes (or ``length`` bytes fetched for it) as held if they fit,
        evicting less wanted stripes to make room."""
        length = stripe.length if length is None else length
        priority = stripe.priority()
        priority = stripe.queued_priority if priority is None else priority
        limit = self._memory.limit_for(priority)
        short = self._stats.held_bytes + length - limit
        if short > 0:
            victims = eviction_candidates(self._buffered.values(), priority)
            if sum(victim.length for victim in victims) < short:
                return False  # wait for fetches to land and readers to take their bytes
            for victim in victims:
                if short <= 0:
                    break
                short -= victim.length
                self._stats.evictions += 1
                self._forget(victim)
        self._stats.held_bytes += length
        self._stats.peak_held_bytes = max(self._stats.peak_held_bytes, self._stats.held_bytes)
        HELD_BYTES.inc(length)
        return True

    def _unreserve(self, length: int) -> None:
        self._stats.held_bytes -= length
        HELD_BYTES.dec(length)
        self._notify()

    # -- workers -----------------------------------------------------------------------

    async def _worker(self, number: int) -> None:
        stream = _Stream()
        try:
            while True:
                stripes = await self._take()
                if stream.aborted:  # its connection was closed under a hung read
                    stream = _Stream()
                await self._fetch(stripes, stream)
        finally:
            # Idle here (a fetch in flight was aborted), so closing cannot hang.
            if stream.connection is not None and not stream.aborted:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_close_quietly, stream.connection, limiter=self._threads)

    async def _take(self) -> list[Stripe]:
        """The most urgent queued stripe whose bytes fit in memory, marked FETCHING; for
        an extent, with the neighbours one range request fetches with it (in offset order)."""
        while True:
            now = trio.current_time()
            while self._backoff and self._backoff[0][0] <= now:
                _, _, stripe = heapq.heappop(self._backoff)
                if stripe.state is StripeState.BACKOFF:
                    held = stripe.priority()
                    self._enqueue(stripe, stripe.queued_priority if held is None else held)
            while self._queue and self._queue[0][2].state is not StripeState.QUEUED:
                heapq.heappop(self._queue)  # stale: cancelled, or queued again more urgently
            if self._queue:
                head = self._queue[0][2]
                group = self._coalesce(head)
                if len(group) > 1 and not self._reserve(head, span(group)):
                    group = [head]  # no room for its neighbours now: the head alone, like any stripe
                if len(group) > 1 or self._reserve(head):
                    heapq.heappop(self._queue)  # the others' entries go stale: they are no longer QUEUED
                    for stripe in group:
                        self._unindex(stripe)
                        stripe.state = StripeState.FETCHING
                    return group
                self._starved = True  # wake me when a buffered stripe may have become evictable
            with trio.move_on_at(self._backoff[0][0] if self._backoff else float("inf")):
                await self._changed.wait()

    async def _fetch(self, group: list[Stripe], stream: _Stream) -> None:
        """Fetch reserved stripes (one stripe, or extents one range request covers) and
        publish each, or put it back to retry, or fail it."""
        stripe = group[0]
        self._stats.in_flight += 1
        IN_FLIGHT.inc()
        now = trio.current_time()
        for member in group:
            if member.first_attempt is None:
                member.first_attempt = now
        # The bytes between coalesced extents were reserved with them; they go when the request ends.
        gap = span(group) - sum(member.length for member in group)
        cached, cache_key = False, None
        try:
            # Past the deadline the attempt is abandoned and its connection closed: a
            # source that accepts and never answers fails the stripe after
            # retry_timeout, not after the backend's read timeout on top.
            deadline_at = min(self.retry.deadline(member.first_attempt) for member in group if member.first_attempt is not None)
            with trio.move_on_at(deadline_at) as deadline:
                if stripe.extent is None:
                    data, cached, cache_key = await _run_abandoning(
                        self._fetch_blocking, stripe, stream, on_abandon=stream.abort
                    )
                    outcomes: list[bytes | Exception] = [data]
                else:
                    self._count_request(group)
                    outcomes = await _run_abandoning(
                        self._fetch_extents_blocking, group, stream, on_abandon=stream.abort
                    )
            if deadline.cancelled_caught:
                raise TimeoutError(f"no answer in {self.config.retry_timeout:g}s")
        except Exception as exc:
            for member in group:
                self._fetch_failed(member, exc)
            return
        finally:
            # A cancelled fetch (the engine stopping) stays FETCHING: run() fails it.
            self._stats.in_flight -= 1
            IN_FLIGHT.dec()
            if gap:
                self._unreserve(gap)
        if gap and not any(isinstance(outcome, Exception) for outcome in outcomes):
            self._stats.gap_bytes += gap
            self._stats.bytes_fetched += gap
            GAP_BYTES.inc(gap)
            BYTES_FETCHED.inc(gap)
        for member, outcome in zip(group, outcomes):
            if isinstance(outcome, Exception):
                self._fetch_failed(member, outcome)
            else:
                self._publish(member, outcome, cached)
        if self._cache is not None and not cached and cache_key is not None:
            await trio.to_thread.run_sync(self._cache.put, cache_key, data, limiter=self._threads)

    def _count_request(self, group: list[Stripe]) -> None:
        kind = "coalesced" if len(group) > 1 else "single"
        self._stats.extent_requests += 1
        self._stats.coalesced_requests += len(group) > 1
        EXTENT_REQUESTS.labels(kind).inc()

    def _fetch_extents_blocking(self, group: list[Stripe], stream: _Stream) -> list[bytes | Exception]:
        """In a worker thread: the bytes of extents of one object, in offset order, with one range request.

        Returns each extent's bytes, or the error it failed with where the answer
        was short: an extent beyond the object's end fails for good, one the
        answer was merely cut off before is retried.  On any failure the stream's
        connection is closed.
        """
        first, last = group[0], group[-1]
        start, end = first.offset, last.offset + last.length
        try:
            with cpu.stage("fetch"):
                connection = stream.connect(self.source)
                data = connection.read_range(first.path, start, end - start, first.file.version)
            if len(data) > end - start:
                raise PermanentError(
                    f"{self.url}: {first.path or '.'} bytes {start}-{end - 1}: the source returned "
                    f"{len(data)} bytes for a range of {end - start}"
                )
            size = None
            if len(data) < end - start:
                size = self.source.stat(first.path).size  # a truncated object, or a cut-off answer?
                stream.discard()
        except BaseException:
            stream.discard()
            raise
        outcomes: list[bytes | Exception] = []
        for member in group:
            lo, hi = member.offset - start, member.offset + member.length - start
            if hi <= len(data):
                outcomes.append(data if lo == 0 and hi == len(data) else data[lo:hi])
            elif size is not None and member.offset + member.length > size:
                outcomes.append(PermanentError(
                    f"{self.url}: {member.describe()}: the object is only {size} bytes long"
                ))  # fmt: skip
            else:
                outcomes.append(OSError(
                    errno.EIO, f"{self.url}: {member.describe()}: short read, {len(data)} of {end - start} bytes"
                ))  # fmt: skip
        return outcomes

    def _fetch_blocking(self, stripe: Stripe, stream: _Stream) -> tuple[bytes, bool, str | None]:
        """In a worker thread: the stripe's bytes from the disk cache or the source.

        Returns (bytes, whether they came from the cache, the cache key when the cache
        is on).  On any failure the stream's connection is closed.
        """
        cache_key = None
        if self._cache is not None:
            file = stripe.file
            mtime = file.mtime
            if not file.version and mtime is None:
                entry = self.source.stat(stripe.path)
                self._check_size(stripe, entry.size)
                mtime = entry.mtime
            cache_key = self._cache_key(stripe, mtime or 0.0)
            data = self._cache.get(cache_key)
            if data is not None and len(data) == stripe.length:
                return data, True, cache_key
        try:
            with cpu.stage("fetch"):
                connection = stream.connect(self.source)
                data = connection.read_range(stripe.path, stripe.offset, stripe.length, stripe.file.version)
            if len(data) > stripe.length:
                raise PermanentError(
                    f"{self.url}: {stripe.describe()}: the source returned {len(data)} bytes "
                    f"for a range of {stripe.length}"
                )
            if len(data) < stripe.length:
                # Short before the end of the file we were told about: a cut-off response,
                # or the file shrank.  Only the latter is worth failing at once for.
                self._check_size(stripe, self.source.stat(stripe.path).size)
                raise OSError(
                    errno.EIO,
                    f"{self.url}: {stripe.describe()}: short read, {len(data)} of {stripe.length} bytes",
                )
        except BaseException:
            stream.discard()
            raise
        return data, False, cache_key

    def _check_size(self, stripe: Stripe, size: int) -> None:
        if size != stripe.file_size:
            raise _SizeChanged(
                f"{self.url}: {stripe.path or '.'}: the file is now {size} bytes, "
                f"not the {stripe.file_size} it was opened with"
            )

    def _cache_key(self, stripe: Stripe, mtime: float) -> str:
        # The full URL, not the display one: a query may select the content.
        file = stripe.file
        return StripeCache.key(
            self.source.url, file.path, file.size, file.version, mtime, stripe.index, self.stripe_size
        )

    def _publish(self, stripe: Stripe, data: bytes, cached: bool) -> None:
        stripe.holders.pop(self._speculative, None)  # read ahead: a loose buffer from now on
        stripe.state = StripeState.DONE
        stripe.data = data
        stripe.first_attempt = None
        stripe.last_used = next(self._clock)
        self._buffered[stripe.key] = stripe
        if stripe.extent is not None:
            self._stats.extents_fetched += 1
            self._stats.bytes_fetched += len(data)
            EXTENTS.labels("fetched").inc()
            BYTES_FETCHED.inc(len(data))
        elif cached:
            self._stats.cache_hits += 1
            STRIPES.labels("cached").inc()
        else:
            self._stats.stripes_fetched += 1
            self._stats.bytes_fetched += len(data)
            STRIPES.labels("fetched").inc()
            BYTES_FETCHED.inc(len(data))
        stripe.done.set()

    def _fetch_failed(self, stripe: Stripe, exc: Exception) -> None:
        now = trio.current_time()
        assert stripe.first_attempt is not None
        failing_for = now - stripe.first_attempt
        stripe.attempts += 1
        # Nobody waits for a read-ahead extent: unless someone wants it now, it is not retried.
        stripe.holders.pop(self._speculative, None)
        self._unreserve(stripe.length)
        stripe.state = StripeState.BACKOFF  # no longer fetching; the bytes are no longer counted
        if self.retry.gives_up(exc, stripe.attempts, stripe.first_attempt, now):
            reason = str(exc) if is_permanent(exc) else (
                f"still failing after {failing_for:.1f}s and {stripe.attempts} attempts: {exc!r}"
            )  # fmt: skip
            message = f"{self.url}: {stripe.describe()}: {reason}"
            log.error("stripe fetch failed", url=self.url, path=stripe.path, offset=stripe.offset,
                      length=stripe.length, attempts=stripe.attempts, error=repr(exc))  # fmt: skip
            error = FetchError(message)
            error.__cause__ = exc
            self._stats.failures += 1
            (STRIPES if stripe.extent is None else EXTENTS).labels("failed").inc()
            self._fail(stripe, error)
            self._remember_failure(stripe)
            return
        if not stripe.wanted():
            self._forget(stripe)
            return
        self._stats.retries += 1
        RETRIES.inc()
        delay = self.retry.wait(stripe.attempts, stripe.first_attempt, now)
        # Attempts 1, 2, 4, 8...: a source that is down for a minute must not flood the log.
        level = logging.WARNING if stripe.attempts & (stripe.attempts - 1) == 0 else logging.DEBUG
        log.log(level, "stripe fetch failed; retrying on a new connection", url=self.url, path=stripe.path,
                offset=stripe.offset, attempt=stripe.attempts, delay=round(delay, 3), error=repr(exc))  # fmt: skip
        stripe.state = StripeState.BACKOFF
        heapq.heappush(self._backoff, (now + delay, next(self._seq), stripe))
        self._notify()

    # -- what a Reader uses ------------------------------------------------------------
    #
    # A Reader keeps one handle's stream (position, window); the engine keeps the
    # stripes and who holds them.  These, check_running and the sizes a Reader plans
    # with (stripe_size, read_lookahead, readahead_*_stripes, config.max_windows) are
    # all a Reader asks of the engine.

    def hold_stripe(self, holder: object, file: FileVersion, index: int, priority: Priority) -> None:
        """``holder`` wants stripe ``index`` of ``file`` at ``priority``: queued unless fetched or on its way."""
        self._hold(holder, file, index, priority)

    def keep_stripe(self, holder: object, file: FileVersion, index: int, priority: Priority) -> bool:
        """Add ``holder`` to stripe ``index`` of ``file`` if it is fetched or on its way (queueing nothing); whether it is."""
        return self._holding(holder, (file, index), priority)

    def release_stripe(self, holder: object, file: FileVersion, index: int, *, drop: bool = False) -> None:
        """``holder`` no longer wants the stripe: cancelled if queued and nobody else wants it, or, with
        ``drop``, its buffer freed (a sequential reader has passed it)."""
        self._release(holder, (file, index), drop=drop)

    async def read_range(
        self, file: FileVersion, offset: int, end: int, deliver: Callable[[int, memoryview], None], *,
        holder: object, sequential: bool,
    ) -> None:  # fmt: skip
        """Hand bytes [offset, end) of ``file`` to ``deliver`` at DEMAND priority, stripe by stripe, in order.

        ``deliver(position, piece)`` gets each piece and its position relative to
        ``offset`` and must copy what it keeps.  ``holder`` holds the stripes on the
        way; ``sequential`` (the read moved a stream) drops each stripe it passes.
        Raises FetchError (EIO) if a stripe cannot be fetched.
        """
        await self._walk(file, offset, end, Priority.DEMAND, deliver, drop_passed=sequential, token=holder)

    def take_window(self, reader: Reader) -> None:
        """``reader`` holds a window now; take the window of the least recently used reader beyond ``max_windows``."""
        self._windows[reader] = None
        self._windows.move_to_end(reader)
        while len(self._windows) > self.config.max_windows:
            victim, _ = self._windows.popitem(last=False)
            victim.lose_window()

    def drop_window(self, reader: Reader) -> None:
        """``reader`` holds no window any more."""
        self._windows.pop(reader, None)


@asynccontextmanager
async def open_engine(source: RangeSource, config: EngineConfig = EngineConfig()) -> AsyncIterator[Engine]:
    """An :class:`Engine` running in a nursery of its own for the duration of the block."""
    engine = Engine(source, config)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
