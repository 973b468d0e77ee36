"""Replaying a hot list: fetch an image's hot blocks in recorded order before its container reads them.

A :class:`Prefetch` walks the resolved hot list (:func:`bootseer.hotlist.format.resolve`)
in order, in batches of consecutive blocks of one layer (at most ``batch_bytes``
compressed), with at most ``concurrency`` batches in flight, each one call of the
layer's :meth:`BlockFetcher.blocks <bootseer.blockstore.node.fetcher.BlockFetcher.blocks>`
at ``Priority.PREFETCH``: the same fetch path as reads (verification, node cache,
the engine's coalescing of neighbours into range requests, retries).  Because each
batch is small, the engine always holds only a few MiB of prefetch in its queue, so
a read (``Priority.DEMAND``) goes out ahead of everything still queued, and a read
of a block a batch is fetching waits on that fetch instead of making another (the
engine shares extents by key).  Blocks already in the node cache are skipped (an
existence check; the read verifies as always).

The prefetch keeps, per block digest, whether it was skipped, is in flight or has
been fetched (and when), so the read hook can classify each read's blocks
(:meth:`Prefetch.classify`): ``hit`` (prefetched before the read), ``waited`` (the
read waited on an in-flight prefetch), ``cached`` (in the node cache before the
prefetch began), ``miss`` (not prefetched yet: fetched on demand).

With a ``warmer`` (the layer server's :class:`PageCacheWarmer
<bootseer.hotlist.warm.PageCacheWarmer>`), each batch, once fetched (the verified bytes
the fetch returned; those found in the node cache are read from it, where the warmer
wants bytes at all), is also put into the kernel's page cache by one worker thread, in
the list's order, so the
job's first reads of it are page-cache hits that never reach the layer server (and so
are not classified).  What they served is counted at the prefetch's end instead
(:meth:`Prefetch.settle_page_cache`, with the warmer's :meth:`resident
<bootseer.hotlist.warm.PageCacheWarmer.resident>`): a
block warmed, never read through FUSE and still in the page cache then is
``served_from_page_cache``, not ``unread``.  ``mincore`` says which pages are cached, not
which were read, so a warmed block the job never read counts there too: it is an upper
bound on the page cache's hits, exact for every block the job did read (see
docs/hotlist.md).

An optional cold pass (``cold_rate`` bytes/s, off by default) then fetches every
other block of the image's layers, rate-limited, in index order.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import prometheus_client
import trio

from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import BlockSink
from bootseer.fetch.stripes import Priority
from bootseer.hotlist.format import ResolvedBlock
from bootseer.log import get_logger
from bootseer.profile import events as profile_events
from bootseer.profile.hooks import SAMPLE_INTERVAL

log = get_logger(__name__)

PREFETCHED_BLOCKS = prometheus_client.Counter(
    "bootseer_hotlist_prefetch_blocks",
    "Hot-list blocks handled by prefetch, by outcome (fetched, cached: already in the node cache, failed)",
    ["outcome"],
)
PREFETCHED_BYTES = prometheus_client.Counter(
    "bootseer_hotlist_prefetch_bytes", "Compressed bytes fetched by hot-list prefetch (hot and cold passes)", ["pass"]
)
READS = prometheus_client.Counter(
    "bootseer_hotlist_reads",
    "Blocks read by containers of prefetched images, by outcome (hit: prefetched before the read; waited: "
    "the read waited on an in-flight prefetch; cached: in the node cache before prefetch; miss: fetched on demand)",
    ["outcome"],
)
UNREAD_BYTES = prometheus_client.Counter(
    "bootseer_hotlist_prefetch_unread_bytes",
    "Compressed bytes prefetched that no read used before the prefetch ended (neither through FUSE nor from the "
    "page cache the prefetch warmed)",
)
PAGE_CACHE_BYTES = prometheus_client.Counter(
    "bootseer_hotlist_prefetch_served_from_page_cache_bytes",
    "Compressed bytes of hot blocks the prefetch warmed into the page cache that no read fetched through FUSE and "
    "that were still cached when the prefetch ended",
)


@dataclass(frozen=True)
class PrefetchLimits:
    """How much a prefetch may do at once."""

    concurrency: int = 4  #: batches in flight
    batch_bytes: int = 4 << 20  #: compressed bytes per batch (memory: concurrency x batch_bytes)
    cold_rate: int = 0  #: bytes/s of the cold pass after the hot list; 0: no cold pass
    page_cache: bool = True  #: also store each fetched batch in the kernel's page cache (hotlist.warm)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.batch_bytes < 1 or self.cold_rate < 0:
            raise ValueError("prefetch concurrency and batch size must be positive, the cold rate not negative")


#: A batch for the page-cache warmer: (layer, blocks, their bytes or None: read them from the node cache).
_Warm = tuple[str, list[ResolvedBlock], "list[bytes] | None"]


class Warmer(Protocol):
    """Puts fetched hot blocks in the kernel's page cache (:class:`bootseer.hotlist.warm.PageCacheWarmer`)."""

    def wants_bytes(self, layer: str) -> bool:
        """Whether :meth:`warm` needs the blocks' bytes for ``layer`` (else it is given None)."""
        ...

    def sink(self, layer: str, refs: Sequence[int]) -> BlockSink | None:
        """Where the fetcher puts blocks ``refs`` of ``layer`` it fetches for a batch, if not the node cache (a
        local blob: the one copy on the node; :meth:`warm` then finds them there)."""
        ...

    def warm(self, layer: str, blocks: Sequence[ResolvedBlock], data: Sequence[bytes] | None) -> int:
        """Blocking: put ``blocks`` in the page cache; the file bytes placed."""
        ...

    def resident(self) -> set[tuple[str, str]]:
        """Blocking: (layer, digest) of the placed blocks still in the page cache."""
        ...


class Fetcher(Protocol):
    """What a prefetch fetches through: ``blockstore.node.fetcher.BlockFetcher``."""

    async def blocks(self, index: LayerBlocks, refs: Sequence[int], priority: Priority = Priority.DEMAND, *,
                     sink: BlockSink | None = None) -> list[bytes]:  # fmt: skip
        """The raw, verified blocks ``refs`` of ``index`` (OSError, EIO, when they cannot be had); those fetched
        go to ``sink`` rather than the node cache."""
        ...


@dataclass
class PrefetchStats:
    """What a prefetch did and how the reads fared, for the summary line and ``status``."""

    planned_blocks: int = 0
    planned_bytes: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    cached_blocks: int = 0  #: skipped: already in the node cache
    failed_blocks: int = 0
    cold_blocks: int = 0
    cold_bytes: int = 0
    hits: int = 0
    waited: int = 0
    cached_reads: int = 0
    misses: int = 0
    lead_times: list[float] = field(default_factory=list)  #: per hit: seconds the block was ready before its read
    finished: bool = False
    warmed_bytes: int = 0  #: file bytes put in the kernel's page cache (store notifications, or reads through EROFS)
    warm_finished: bool = False
    #: at the end: blocks warmed, never read through FUSE, still in the page cache (and their compressed bytes)
    served_from_page_cache_blocks: int = 0
    served_from_page_cache_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        # A block the warmed page cache served is a hit the layer server never saw (settle_page_cache counts
        # it at the end): without it, a job whose every read the warming answered showed hit_rate None.
        served = self.hits + self.waited + self.served_from_page_cache_blocks
        reads = served + self.misses
        lead = sorted(self.lead_times)
        return {
            "planned_blocks": self.planned_blocks,
            "planned_bytes": self.planned_bytes,
            "fetched_blocks": self.fetched_blocks,
            "fetched_bytes": self.fetched_bytes,
            "cached_blocks": self.cached_blocks,
            "failed_blocks": self.failed_blocks,
            "cold_blocks": self.cold_blocks,
            "cold_bytes": self.cold_bytes,
            "hits": self.hits,
            "waited": self.waited,
            "cached_reads": self.cached_reads,
            "misses": self.misses,
            "hit_rate": round(served / reads, 4) if reads else None,
            "lead_median_s": round(statistics.median(lead), 4) if lead else None,
            "lead_min_s": round(lead[0], 4) if lead else None,
            "finished": self.finished,
            "warmed_bytes": self.warmed_bytes,
            "warm_finished": self.warm_finished,
            "served_from_page_cache_blocks": self.served_from_page_cache_blocks,
            "served_from_page_cache_bytes": self.served_from_page_cache_bytes,
        }


class Prefetch:
    """One image's hot-list prefetch (see the module docstring).

    ``plan`` is the resolved list in order; ``indexes`` maps each layer's ChainID to
    its index; ``fetchers`` to the block fetcher of its store; ``cached`` tells
    whether a block digest is in the node cache (blocking; run in a thread).
    """

    def __init__(
        self,
        *,
        image: str,
        profile: str,
        plan: Sequence[ResolvedBlock],
        indexes: dict[str, LayerBlocks],
        fetchers: dict[str, Fetcher],
        cached: Callable[[str], bool] | None,
        limits: PrefetchLimits = PrefetchLimits(),
        warmer: Warmer | None = None,
    ) -> None:
        self.image = image
        self.profile = profile
        self.plan = list(plan)
        self.indexes = indexes
        self.fetchers = fetchers
        self._cached = cached
        self._warmer = warmer
        self._warm_send: trio.MemorySendChannel[_Warm] | None = None
        self.from_page_cache: set[str] = set()  #: digests counted as served by the page cache (settle_page_cache)
        self._settled = False
        self.limits = limits
        self.stats = PrefetchStats(planned_blocks=len(self.plan), planned_bytes=sum(b.hot.clen for b in self.plan))
        self.in_flight: set[str] = set()
        self.done: dict[str, float] = {}  #: digest -> trio time its prefetch finished
        self.skipped: set[str] = set()  #: digests in the node cache before prefetch reached them
        self.read: set[str] = set()  #: digests some read has touched (each counted once)
        self.cancel_scope = trio.CancelScope()
        self.containers: set[str] = set()
        self.had_container = False
        self.attached = trio.Event()  #: set when a container joins
        self.started = trio.current_time()
        self.ended = trio.Event()

    def __repr__(self) -> str:
        return f"<Prefetch {self.image[:19]} profile={self.profile!r} {len(self.done)}/{len(self.plan)}>"

    @property
    def layers(self) -> set[str]:
        return set(self.indexes)

    # -- the read side -----------------------------------------------------------------

    def classify(self, digest: str, now: float) -> str | None:
        """Count a read of block ``digest``: hit, waited, cached or miss; None if counted already."""
        if digest in self.read:
            return None
        self.read.add(digest)
        if digest in self.done:
            outcome = "hit"
            self.stats.hits += 1
            self.stats.lead_times.append(max(0.0, now - self.done[digest]))
        elif digest in self.in_flight:
            outcome = "waited"
            self.stats.waited += 1
        elif digest in self.skipped:
            outcome = "cached"
            self.stats.cached_reads += 1
        else:
            outcome = "miss"
            self.stats.misses += 1
        READS.labels(outcome).inc()
        return outcome

    def unread_bytes(self) -> int:
        """Compressed bytes prefetched that no read used: not through FUSE, not from the warmed page cache."""
        sizes = {b.hot.digest: b.hot.clen for b in self.plan}
        return sum(sizes.get(digest, 0) for digest in self.done
                   if digest not in self.read and digest not in self.from_page_cache)  # fmt: skip

    async def settle_page_cache(self) -> None:
        """At the end: count the warmed blocks no read fetched through FUSE that the page cache still holds.

        Those are what the job's reads of them were served from (a read that found them
        evicted reached FUSE and was classified); one the job never read is counted too
        (residency is all the kernel tells).  Once; nothing without ``resident``.
        """
        if self._warmer is None or self._settled:
            return
        self._settled = True
        # Abandoned on cancel (the caller's timeout): it opens files of the server's own mount,
        # which a server shutting down may no longer answer.
        resident = await trio.to_thread.run_sync(self._warmer.resident, abandon_on_cancel=True)
        sizes = {b.hot.digest: b.hot.clen for b in self.plan}
        self.from_page_cache = {digest for layer, digest in resident if digest in sizes and digest not in self.read}
        self.stats.served_from_page_cache_blocks = len(self.from_page_cache)
        self.stats.served_from_page_cache_bytes = sum(sizes[d] for d in self.from_page_cache)
        PAGE_CACHE_BYTES.inc(self.stats.served_from_page_cache_bytes)

    def stop(self) -> None:
        self.cancel_scope.cancel()

    # -- the fetch side -------------------------------------------------------------------

    def batches(self) -> list[tuple[str, list[ResolvedBlock]]]:
        """The plan cut into runs of one layer, each at most ``batch_bytes`` (at least one block)."""
        out: list[tuple[str, list[ResolvedBlock]]] = []
        size = 0
        for block in self.plan:
            if not out or out[-1][0] != block.layer or size + block.hot.clen > self.limits.batch_bytes:
                out.append((block.layer, []))
                size = 0
            out[-1][1].append(block)
            size += block.hot.clen
        return out

    async def run(self) -> None:
        """Fetch the plan (then the cold pass, if on) until done or :meth:`stop`."""
        try:
            with self.cancel_scope:
                async with trio.open_nursery() as warming:
                    if self._warmer is not None:
                        # Bounded: a batch's bytes wait here only while the warmer is behind.
                        self._warm_send, receive = trio.open_memory_channel[_Warm](self.limits.concurrency)
                        warming.start_soon(self._warm_batches, receive)
                    limiter = trio.Semaphore(self.limits.concurrency)
                    async with trio.open_nursery() as nursery:
                        for layer, batch in self.batches():
                            await limiter.acquire()
                            nursery.start_soon(self._fetch_batch, layer, batch, limiter)
                    self.stats.finished = True
                    if self._warm_send is not None:
                        self._warm_send.close()  # the warmer ends after the last batch
                if self.limits.cold_rate > 0:
                    await self._cold_pass()
        finally:
            self.in_flight.clear()
            self.ended.set()

    async def _warm_batches(self, receive: trio.MemoryReceiveChannel[_Warm]) -> None:
        """Store each fetched batch in the page cache, one at a time, in the order they arrive."""
        warmer = self._warmer
        assert warmer is not None
        async with receive:
            async for layer, blocks, data in receive:
                if data is None and warmer.wants_bytes(layer):  # found in the node cache: read (and verified) from it
                    try:
                        data = await self.fetchers[layer].blocks(self.indexes[layer], [b.ref for b in blocks],
                                                                 Priority.PREFETCH)  # fmt: skip
                    except (OSError, ValueError):
                        continue  # a read will say what is wrong
                self.stats.warmed_bytes += await trio.to_thread.run_sync(warmer.warm, layer, blocks, data)
        self.stats.warm_finished = True

    async def _to_warm(self, layer: str, blocks: list[ResolvedBlock], data: list[bytes] | None) -> None:
        if self._warm_send is not None and blocks:
            await self._warm_send.send((layer, blocks, data))

    async def _fetch_batch(self, layer: str, batch: list[ResolvedBlock], limiter: trio.Semaphore) -> None:
        try:
            wanted = [block for block in batch if block.hot.digest not in self.done and block.hot.digest not in self.skipped]
            if self._cached is not None and wanted:
                present = await trio.to_thread.run_sync(lambda: [self._cached(b.hot.digest) for b in wanted])  # type: ignore[misc]
                for block, hit in zip(list(wanted), present):
                    if hit:
                        self.skipped.add(block.hot.digest)
                        self.stats.cached_blocks += 1
                        PREFETCHED_BLOCKS.labels("cached").inc()
                wanted = [block for block, hit in zip(wanted, present) if not hit]
            # A read may have fetched some meanwhile; those it counted as misses stay so.
            skipped = [block for block in batch if block.hot.digest in self.skipped]
            await self._to_warm(layer, skipped, None)
            wanted = [block for block in wanted if block.hot.digest not in self.read]
            if not wanted:
                return
            digests = [block.hot.digest for block in wanted]
            self.in_flight.update(digests)
            refs = [block.ref for block in wanted]
            try:
                sink = self._warmer.sink(layer, refs) if self._warmer is not None else None
                data = await self.fetchers[layer].blocks(self.indexes[layer], refs, Priority.PREFETCH, sink=sink)
            except (OSError, ValueError) as exc:
                self.stats.failed_blocks += len(wanted)
                PREFETCHED_BLOCKS.labels("failed").inc(len(wanted))
                log.warning("hot-list prefetch batch failed; reads fetch those blocks on demand",
                            image=self.image, layer=layer, blocks=len(wanted), error=str(exc))  # fmt: skip
                return
            finally:
                self.in_flight.difference_update(digests)
            now = trio.current_time()
            size = sum(block.hot.clen for block in wanted)
            for digest in digests:
                self.done.setdefault(digest, now)
            self.stats.fetched_blocks += len(wanted)
            self.stats.fetched_bytes += size
            PREFETCHED_BLOCKS.labels("fetched").inc(len(wanted))
            PREFETCHED_BYTES.labels("hot").inc(size)
            await self._to_warm(layer, wanted, data)
        finally:
            limiter.release()

    async def _cold_pass(self) -> None:
        """Every other stored block of the image's layers, at most ``cold_rate`` bytes/s, one batch at a time."""
        rate = self.limits.cold_rate
        for layer, index in self.indexes.items():
            refs: list[int] = []
            size = 0
            seen: set[str] = set()
            for ref, block in enumerate(index.blocks):
                if block.is_zero or block.digest in self.done or block.digest in self.skipped or block.digest in seen:
                    continue
                if self._cached is not None and await trio.to_thread.run_sync(self._cached, block.digest):
                    continue
                seen.add(block.digest)
                refs.append(ref)
                size += block.clen
                if size >= min(self.limits.batch_bytes, max(rate, 1)):
                    await self._cold_batch(layer, index, refs, size)
                    refs, size = [], 0
            if refs:
                await self._cold_batch(layer, index, refs, size)

    async def _cold_batch(self, layer: str, index: LayerBlocks, refs: list[int], size: int) -> None:
        started = trio.current_time()
        try:
            await self.fetchers[layer].blocks(index, refs, Priority.PREFETCH)
        except (OSError, ValueError) as exc:
            log.warning("cold-block prefetch failed; stopping the cold pass", image=self.image, layer=layer, error=str(exc))
            self.stop()
            return
        self.stats.cold_blocks += len(refs)
        self.stats.cold_bytes += size
        PREFETCHED_BYTES.labels("cold").inc(size)
        # Rate limit: this batch may take size/rate seconds in all.
        await trio.sleep_until(started + size / self.limits.cold_rate)


def cache_checker(cache: BlockCache | None) -> Callable[[str], bool] | None:
    """A cheap "is this block in the node cache" test (its file exists); None without a node cache."""
    if cache is None:
        return None
    return lambda digest: os.path.exists(cache.path_of(digest))

async def sample_prefetch(prefetch: Prefetch, interval: float = SAMPLE_INTERVAL) -> None:
    """The start-up profiler's view of a prefetch: its start, progress (``prefetch.bytes``) and end (a background
    span).  Returns when the prefetch has ended (its ``ended`` event), at once when profiling is off."""
    if not profile_events.enabled():
        return
    started = time.time()
    attrs = {"image": prefetch.image, "profile": prefetch.profile}
    profile_events.emit("prefetch.start", phase="image", background=True, planned_bytes=prefetch.stats.planned_bytes,
                        planned_blocks=prefetch.stats.planned_blocks, **attrs)  # fmt: skip
    last = -1
    try:
        while not prefetch.ended.is_set():
            if prefetch.stats.fetched_bytes != last:
                last = prefetch.stats.fetched_bytes
                profile_events.counter("prefetch.bytes", last, phase="image", **attrs)
            with trio.move_on_after(interval):
                await prefetch.ended.wait()
    finally:
        stats = prefetch.stats
        profile_events.counter("prefetch.bytes", stats.fetched_bytes, phase="image", **attrs)
        profile_events.emit("prefetch", "span", start=started, end=time.time(), phase="image", bytes=stats.fetched_bytes,
                            background=True, blocks=stats.fetched_blocks, cached_blocks=stats.cached_blocks,
                            failed_blocks=stats.failed_blocks, finished=stats.finished, **attrs)  # fmt: skip
