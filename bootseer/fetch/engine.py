"""The striped, prioritised, memory-bounded range-fetch engine.

This module is the engine's orchestration (the table of stripes, holds, memory, failures); which
stripe is fetched next and which neighbours ride with it is :mod:`bootseer.fetch.queue`, the
worker tasks that fetch them (their connections, threads, deadlines and the disk cache) are
:mod:`bootseer.fetch.workers`, how much a fetch may hold and whom it evicts is
:mod:`bootseer.fetch.memory`, which keys fail at once is :mod:`bootseer.fetch.failures`; what it
fetches is :mod:`bootseer.fetch.stripes` (priorities, file versions, extents, the stripe state
machine), an open file's read-ahead and the bound on windows is :mod:`bootseer.fetch.reader`,
when a failure is retried is :mod:`bootseer.fetch.retry`, and what it counts is
:mod:`bootseer.fetch.metrics` (with :class:`EngineStatistics`) and :meth:`Engine.statistics`.

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

Digest lists: a file opened with one (:meth:`Engine.find_digests`, then :meth:`Engine.open`;
:mod:`bootseer.fetch.digests`) has its stripes checked in the worker, chunk by chunk, before anyone
gets a byte; its chunk size must divide ``stripe_size`` so every stripe is whole chunks.  A stripe
that fails is fetched once more on another connection (``MISMATCH_RETRIES``), then fails (EIO).  The
list is part of the file version's key, so stripes of readers with and without a list never meet.

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

import itertools
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from bootseer.counters import Counters
from bootseer.fetch.failures import FailureMemory
from bootseer.fetch.file_cache import StripeCache
from bootseer.fetch.memory import MemoryBound, eviction_candidates
from bootseer.fetch.digests import SUFFIX as DIGESTS_SUFFIX
from bootseer.fetch.digests import DigestList, DigestListError, load as load_digests
from bootseer.fetch.metrics import (
    BYTES_FETCHED, CHUNKS, COUNTED, DIGEST_LISTS, EXTENT_JOINS, EXTENTS, HELD_BYTES, RETRIES, STRIPES, EngineStatistics,
)
from bootseer.fetch.queue import StripeQueue
from bootseer.fetch.reader import ReadaheadWindows, Reader
from bootseer.fetch.retry import RetryPolicy, is_permanent
from bootseer.fetch.source import (
    Entry, NotADirectory, NotFound, PermanentError, ProxiedSource, RangeSource, SourceError,
)  # fmt: skip
from bootseer.fetch.stripes import (
    Extent, ExtentKey, FetchError, FileVersion, Priority, Stripe, StripeKey, StripeState, check_same_place,
)
from bootseer.fetch.workers import ChunkMismatch, FetchWorkers, display_url, run_abandoning
from bootseer.log import get_logger

log = get_logger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

T = TypeVar("T")

#: Times a stripe that failed its digest list is fetched again before its read fails (EIO).
MISMATCH_RETRIES = 1

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
        self._stats: Counters[EngineStatistics] = Counters(EngineStatistics, COUNTED)
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
        self._stripes: dict[StripeKey, Stripe] = {}
        self._buffered: dict[StripeKey, Stripe] = {}  # the DONE stripes
        self._clock = itertools.count(1)  # use order, for LRU
        #: The stripes waiting for a worker, their retries and the neighbours a request takes along.
        self._queue = StripeQueue(stripe_size=config.stripe_size, coalesce_gap=config.coalesce_gap,
                                  readahead_join=config.readahead_join)  # fmt: skip
        #: The readers holding a read-ahead window, at most ``max_windows`` of them.
        self.windows = ReadaheadWindows(config.max_windows)
        # The holder of extents queued by readahead_extents until they are fetched (then loose).
        self._speculative = object()
        self.url = display_url(source)  #: the source's URL as logs and messages show it (no secrets)
        #: The ``streams`` tasks that fetch what the queue gives them, each on a connection of its own.
        self._workers = FetchWorkers(
            source, url=self.url, streams=self.streams, stripe_size=self.stripe_size, queue=self._queue,
            retry=self.retry, cache=StripeCache(config.cache_dir, config.cache_size) if config.cache_dir else None,
            stats=self._stats, reserve=self._reserve, unreserve=self._unreserve, publish=self._publish,
            failed=self._fetch_failed)  # fmt: skip
        self._running = False
        self._stopped = False

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
                    nursery.start_soon(self._workers.worker, number, name=f"fetch worker {number} {self.url}")
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
                    return await run_abandoning(function, *args)
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

    def open(
        self, path: str, size: int, mtime: float | None = None, version: str = "", digests: DigestList | None = None
    ) -> Reader:
        """A :class:`Reader` of the version of ``path`` that is ``size`` bytes long.

        ``version`` (the :attr:`Entry.version` of a stat or listing) pins the reader to
        that version: stripes are shared only by readers of one version, every range
        read asks the source for it, and a file that has changed since fails the
        read with FetchError (EIO) rather than mixing versions.  ``mtime`` keys the
        disk cache where the source gives no version; without either, the engine asks
        the source when the cache first needs it.  ``digests`` (from :meth:`find_digests`):
        every stripe is checked against it before any reader gets a byte of it, and one
        that fails is fetched again once, on another connection, then fails with FetchError.
        """
        self.check_running()
        if size < 0:
            raise ValueError(f"file size must not be negative, not {size}")
        if digests is not None and (reason := self._unusable(digests, size, version)) is not None:
            raise ValueError(f"{self.url}: {path or '.'}: {reason}")
        return Reader(self, path, size, version=version, mtime=mtime, digests=digests)

    def _unusable(self, digests: DigestList, size: int, version: str) -> str | None:
        """Why reads of a file of ``size`` bytes, ``version``, cannot be verified against ``digests``."""
        reason = digests.mismatch(Entry("", size, False, 0.0, version))
        if reason is None and self.stripe_size % digests.chunk_size:
            reason = f"its chunk size ({digests.chunk_size}) does not divide the stripe size ({self.stripe_size})"
        return reason

    async def find_digests(
        self, path: str, entry: Entry, *, source: RangeSource | None = None, list_path: str | None = None
    ) -> DigestList | None:
        """The digest list stored beside ``path`` (``entry``: its stat now) to verify its reads against, or None.

        Read from storage itself (one attempt, within ``retry_timeout``), at ``list_path`` of
        ``source`` (default: ``path`` plus ``.bootseer-digests`` at this engine's source).  A
        list of another size or version than ``entry``, a malformed or unreadable one, or
        one whose chunk size does not divide the stripe size is not used: logged, counted
        (``digest_lists_ignored``), and the file is read as without a list.
        """
        self.check_running()
        source = self.source if source is None else source
        list_path = path + DIGESTS_SUFFIX if list_path is None else list_path
        shown = f"{display_url(source)}: {list_path or '.'}"
        reason: str | None = None
        digests: DigestList | None = None
        with trio.move_on_after(self.config.retry_timeout or float("inf")) as deadline:
            try:
                digests = await run_abandoning(load_digests, source, list_path)
            except (DigestListError, SourceError, OSError) as exc:
                reason = str(exc)
        if deadline.cancelled_caught:
            reason = f"no answer in {self.config.retry_timeout:g}s"
        if digests is None and reason is None:
            return None  # there is none
        if digests is not None:
            reason = self._unusable(digests, entry.size, entry.version)
        if reason is not None:
            self._stats.digest_lists_ignored += 1
            DIGEST_LISTS.labels("ignored").inc()
            log.warning("digest list not used; the file is read without one", list=shown, path=path or ".",
                        reason=reason)  # fmt: skip
            return None
        self._stats.digest_lists_used += 1
        DIGEST_LISTS.labels("used").inc()
        return digests


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
            self._queue.enqueue(stripe, priority)
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
                self._queue.evictable_changed()
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
            self._queue.enqueue(stripe, priority)
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
            self._queue.enqueue(stripe, priority)  # a more urgent entry; the old one goes stale
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
        self._queue.evictable_changed()
        if stripe.wanted():
            return
        if stripe.state in (StripeState.QUEUED, StripeState.BACKOFF) or (drop and stripe.state is StripeState.DONE):
            self._forget(stripe)

    def _forget(self, stripe: Stripe) -> None:
        """Take a stripe out of the engine (cancelled, dropped or evicted), freeing its bytes."""
        self._queue.unindex(stripe)
        if self._stripes.get(stripe.key) is stripe:
            del self._stripes[stripe.key]
        if stripe.state is StripeState.DONE:
            del self._buffered[stripe.key]
            self._unreserve(stripe.length)
        stripe.state = StripeState.GONE
        stripe.data = None

    def _fail(self, stripe: Stripe, error: BaseException) -> None:
        self._queue.unindex(stripe)
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
        self._queue.notify()

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
        if isinstance(exc, ChunkMismatch):
            stripe.mismatches += 1
            self._stats.chunks_failed += 1
            CHUNKS.labels("failed").inc()
        # Nobody waits for a read-ahead extent: unless someone wants it now, it is not retried.
        stripe.holders.pop(self._speculative, None)
        self._unreserve(stripe.length)
        stripe.state = StripeState.BACKOFF  # no longer fetching; the bytes are no longer counted
        # A wrong answer is asked for again once (on another connection), not until the deadline:
        # storage that answers wrong twice will not be trusted with a third.
        if (self.retry.gives_up(exc, stripe.attempts, stripe.first_attempt, now)
                or stripe.mismatches > MISMATCH_RETRIES):  # fmt: skip
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
        self._queue.back_off(stripe, now + delay)

    # -- what a Reader uses ------------------------------------------------------------
    #
    # A Reader keeps one handle's stream (position, window); the engine keeps the
    # stripes and who holds them.  These, check_running, the windows and the sizes a
    # Reader plans with (stripe_size, read_lookahead, readahead_*_stripes) are all a
    # Reader asks of the engine: bootseer.fetch.reader.ReaderEngine, which it satisfies.

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
