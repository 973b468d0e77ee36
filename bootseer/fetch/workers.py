"""The fetch engine's workers: ``streams`` tasks that fetch what the queue gives them, each on a connection of its own.

:class:`FetchWorkers` runs the loop of every worker of an :class:`~bootseer.fetch.engine.Engine`:
take the next group from the :class:`~bootseer.fetch.queue.StripeQueue` (one stripe, or caller
extents that one range request covers), read it in a worker thread over the worker's own
:class:`Stream`, and hand each stripe's outcome back (``publish``: its bytes; ``failed``: the error,
which the engine retries or fails for good).

* A stripe of a file is read from the optional verified disk cache of stripes
  (:class:`~bootseer.fetch.file_cache.StripeCache`) when it holds it, else from the source, and
  kept there once fetched; extents never touch that cache (their callers verify and cache by
  content).
* The read runs in a thread of its own (:func:`run_abandoning`), at most one per stream: past the
  deadline of the group's first attempt (``retry_timeout``) or when the engine stops, the call is
  abandoned and its connection closed from another thread (:meth:`Stream.abort`), so a source that
  never answers fails the stripe then, not at the backend's own timeout.
* A stripe of a file opened with a digest list (:mod:`bootseer.fetch.digests`) is checked against it,
  chunk by chunk, in the worker thread, whether it came from the source or the disk cache: a stripe
  that fails is never published or cached; it fails with :class:`ChunkMismatch` (the source is told,
  a cache entry deleted, the connection closed), which the engine retries once, then fails for good.
* A short or long answer is never served: a range answered long fails for good, one cut short is
  retried unless the object is now shorter (then the extents beyond its end fail for good, and a
  stripe of a file whose size changed fails with :class:`SizeChanged`).  Any failure closes the
  worker's connection, so the retry runs on another.

The workers count their requests in the engine's counters (``in_flight``, ``gap_bytes``, the extent
requests) and ask the engine's memory bound through ``reserve``/``unreserve``; the stripe table
(who holds what, buffers, failures) stays the engine's, reached only through the callables it
passes in.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from bootseer import cpu
from bootseer.counters import Counters
from bootseer.fetch.file_cache import StripeCache
from bootseer.fetch.metrics import BYTES_FETCHED, CHUNKS, EXTENT_REQUESTS, GAP_BYTES, IN_FLIGHT, EngineStatistics
from bootseer.fetch.queue import StripeQueue
from bootseer.fetch.retry import RetryPolicy
from bootseer.fetch.source import Connection, PermanentError, RangeSource, TransientError
from bootseer.fetch.sources import redact_url
from bootseer.fetch.stripes import Stripe, span
from bootseer.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")


class SizeChanged(PermanentError):
    """The file no longer has the size it was opened with."""


class ChunkMismatch(TransientError):
    """A stripe's bytes do not match its file's digest list; never served (fetched again once, then EIO)."""


class Stream:
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
        close_quietly(connection)  # aborted while connecting: nobody will use it
        raise TransientError(f"{display_url(source)}: connection abandoned")

    def discard(self) -> None:
        """In the reading thread: close the connection after a failure (the next read opens another)."""
        with self._lock:
            connection, self.connection = self.connection, None
        if connection is not None:
            close_quietly(connection)

    def abort(self) -> None:
        """From the trio thread, without blocking: close the connection under a blocked read."""
        with self._lock:
            self.aborted = True
            connection, self.connection = self.connection, None
        if connection is not None:
            threading.Thread(target=close_quietly, args=(connection,), name="bootseer-fetch-abort", daemon=True).start()


def display_url(source: RangeSource) -> str:
    """What logs and messages show of ``source``: its URL without credentials or query."""
    shown = getattr(source, "display_url", None)
    return shown if isinstance(shown, str) else redact_url(source.url)


def close_quietly(connection: Connection) -> None:
    """Close ``connection``; a broken one that fails to close is logged (it is gone either way)."""
    try:
        connection.close()
    except Exception as exc:  # a broken connection may fail to close; it is gone either way
        log.debug("closing a connection failed", error=repr(exc))


async def run_abandoning(function: Callable[..., T], *args: Any, on_abandon: Callable[[], None] | None = None) -> T:
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


class FetchWorkers:
    """The fetch workers of one engine: run :meth:`worker` once per stream (see the module)."""

    def __init__(self, source: RangeSource, *, url: str, streams: int, stripe_size: int, queue: StripeQueue,
                 retry: RetryPolicy, cache: StripeCache | None, stats: Counters[EngineStatistics],
                 reserve: Callable[[Stripe, int | None], bool], unreserve: Callable[[int], None],
                 publish: Callable[[Stripe, bytes, bool], None],
                 failed: Callable[[Stripe, Exception], None]) -> None:  # fmt: skip
        """``url``: the source as messages show it; ``retry``: the deadline of a group's attempt; ``cache``: the
        disk cache of stripes (None: off); ``stats``: the engine's counters; ``reserve``/``unreserve``: the
        engine's memory bound (bytes held, or given back); ``publish(stripe, data, cached)``: a stripe's bytes,
        fetched; ``failed(stripe, error)``: a stripe's fetch failed (the engine retries or fails it)."""
        self.source = source
        self.url = url
        self.stripe_size = stripe_size
        self.queue = queue
        self.retry = retry
        self.cache = cache
        self._stats = stats
        self._reserve = reserve
        self._unreserve = unreserve
        self._publish = publish
        self._failed = failed
        # One thread per stream: trio's default limiter (40 threads, shared by everything
        # in the process) would cap a wide engine and let one engine starve another.
        self.threads = trio.CapacityLimiter(streams)

    async def worker(self, number: int) -> None:
        """One worker's loop, until cancelled: take a group, fetch it on this worker's stream."""
        stream = Stream()
        try:
            while True:
                stripes = await self.queue.take(self._reserve)
                if stream.aborted:  # its connection was closed under a hung read
                    stream = Stream()
                await self._fetch(stripes, stream)
        finally:
            # Idle here (a fetch in flight was aborted), so closing cannot hang.
            if stream.connection is not None and not stream.aborted:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(close_quietly, stream.connection, limiter=self.threads)

    async def _fetch(self, group: list[Stripe], stream: Stream) -> None:
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
                    data, cached, cache_key, cache_wrong = await run_abandoning(
                        self._fetch_blocking, stripe, stream, on_abandon=stream.abort
                    )
                    if cache_wrong:
                        self._stats.chunks_failed += cache_wrong
                        CHUNKS.labels("failed").inc(cache_wrong)
                    outcomes: list[bytes | Exception] = [data]
                    if (digests := stripe.file.digests) is not None:
                        verified = digests.chunks_in(len(data))
                        self._stats.chunks_verified += verified
                        CHUNKS.labels("verified").inc(verified)
                else:
                    self._count_request(group)
                    outcomes = await run_abandoning(
                        self._fetch_extents_blocking, group, stream, on_abandon=stream.abort
                    )
            if deadline.cancelled_caught:
                raise TimeoutError(f"no answer in {self.retry.timeout:g}s")
        except Exception as exc:
            for member in group:
                self._failed(member, exc)
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
                self._failed(member, outcome)
            else:
                self._publish(member, outcome, cached)
        if self.cache is not None and not cached and cache_key is not None:
            await trio.to_thread.run_sync(self.cache.put, cache_key, data, limiter=self.threads)

    def _count_request(self, group: list[Stripe]) -> None:
        kind = "coalesced" if len(group) > 1 else "single"
        self._stats.extent_requests += 1
        self._stats.coalesced_requests += len(group) > 1
        EXTENT_REQUESTS.labels(kind).inc()

    def _fetch_extents_blocking(self, group: list[Stripe], stream: Stream) -> list[bytes | Exception]:
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

    def _fetch_blocking(self, stripe: Stripe, stream: Stream) -> tuple[bytes, bool, str | None, int]:
        """In a worker thread: the stripe's bytes from the disk cache or the source.

        Returns (bytes, whether they came from the cache, the cache key when the cache
        is on, 1 if the cache held a copy that failed the file's digest list, deleted and
        fetched from the source instead, else 0).  On any failure the stream's connection is closed.
        """
        cache_key, cache_wrong = None, 0
        if self.cache is not None:
            file = stripe.file
            mtime = file.mtime
            if not file.version and mtime is None:
                entry = self.source.stat(stripe.path)
                self._check_size(stripe, entry.size)
                mtime = entry.mtime
            cache_key = self._cache_key(stripe, mtime or 0.0)
            data = self.cache.get(cache_key)
            if data is not None and len(data) == stripe.length:
                if self._verify(stripe, data, "the disk cache") is None:
                    return data, True, cache_key, 0
                self.cache.discard(cache_key)  # and fetch it from the source
                cache_wrong = 1
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
            if (mismatch := self._verify(stripe, data, "the source")) is not None:
                self.source.corrupt(stripe.path, stripe.offset, stripe.length, stripe.file.version)
                raise mismatch
        except BaseException:
            stream.discard()
            raise
        return data, False, cache_key, cache_wrong

    def _verify(self, stripe: Stripe, data: bytes, origin: str) -> ChunkMismatch | None:
        """In a worker thread: None if ``stripe``'s file has no digest list or ``data`` matches it, else the error."""
        digests = stripe.file.digests
        if digests is None:
            return None
        with cpu.stage("decode"):  # verifying, as blocks are
            bad = digests.first_mismatch(stripe.offset, data)
        if bad is None:
            return None
        start = bad * digests.chunk_size
        end = min(start + digests.chunk_size, digests.size)
        log.error("a chunk does not match its digest list; not served", url=self.url, path=stripe.path or ".",
                  chunk=bad, offset=start, length=end - start, origin=origin)  # fmt: skip
        return ChunkMismatch(
            f"{self.url}: {stripe.path or '.'}: chunk {bad} (bytes {start}-{end - 1}) from {origin} "
            f"does not match the file's digest list"
        )

    def _check_size(self, stripe: Stripe, size: int) -> None:
        if size != stripe.file_size:
            raise SizeChanged(
                f"{self.url}: {stripe.path or '.'}: the file is now {size} bytes, "
                f"not the {stripe.file_size} it was opened with"
            )

    def _cache_key(self, stripe: Stripe, mtime: float) -> str:
        # The full URL, not the display one: a query may select the content.
        file = stripe.file
        return StripeCache.key(
            self.source.url, file.path, file.size, file.version, mtime, stripe.index, self.stripe_size
        )


__all__ = ["ChunkMismatch", "FetchWorkers", "SizeChanged", "Stream", "close_quietly", "display_url", "run_abandoning"]
