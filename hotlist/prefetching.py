"""The prefetches a layer server runs: each started from a hot list, run, and ended with its summary.

A prefetch is keyed by (image, profile): one per pair, whoever triggers it (a mounted image
top, a prepared container, a recording that found a list).  It stays in :attr:`Prefetches.running`
(read accounting classifies the job's reads against it) until its last container is gone; one
that no container joins within the recording window ends by itself.  Its end waits, shielded
and bounded, for the page cache's answer on what the warmed files served, and keeps a summary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import prometheus_client
import trio

from bootseer.blockstore.datapath.choice import EROFS_PATHS
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import FormatError, LayerIndex
from bootseer.blockstore.server.client import LayerServerError
from bootseer.blockstore.server.extension import LayerHost
from bootseer.fetch.source import SourceError
from bootseer.fetch.stripes import FetchError
from bootseer.hotlist.format import HotList, HotListError, resolve
from bootseer.hotlist.lookup import IGNORED, HotListLookup
from bootseer.hotlist.prefetch import UNREAD_BYTES, Prefetch, PrefetchLimits, cache_checker, sample_prefetch
from bootseer.hotlist.tasks import spawn_guarded
from bootseer.hotlist.warm import BlobTarget, ErofsTarget, PageCacheWarmer, TreeTarget, WarmReads, WarmTarget
from bootseer.log import get_logger

log = get_logger(__name__)

PREFETCHES = prometheus_client.Gauge("bootseer_hotlist_prefetches", "Hot-list prefetches running")

#: Seconds a prefetch's end waits for the page-cache residency check (one mincore per warmed file).
SETTLE_TIMEOUT = 30.0


class Prefetches:
    """The running prefetches of ``server``'s images (see the module docstring).

    ``limits`` bound each prefetch; ``window`` is how long one no container joins lives;
    ``warm_reads`` is where page-cache warmers say what they read; ``finished`` takes each
    ended prefetch's summary.
    """

    def __init__(self, server: LayerHost, lookup: HotListLookup, limits: PrefetchLimits, window: float,
                 warm_reads: WarmReads, finished: collections.deque[dict[str, Any]]) -> None:  # fmt: skip
        self.server = server
        self.lookup = lookup
        self.limits = limits
        self.window = window
        self.warm_reads = warm_reads
        self.finished = finished
        self.running: dict[tuple[str, str], Prefetch] = {}  #: (image, profile) -> running prefetch

    async def start(self, hot: HotList) -> Prefetch | None:
        """Start prefetching ``hot`` (or return the prefetch of its image and profile already running)."""
        running = self.running.get((hot.image, hot.profile))
        if running is not None:
            return running
        layers = self.lookup.image_layers(hot.image)
        if layers is None:
            return None
        indexes = {layer: self.server.layers[layer].tree.index for layer in layers}
        try:
            plan = resolve(hot, layers, indexes)
        except HotListError as exc:
            IGNORED.labels("mismatch").inc()
            log.warning("hot list ignored: it does not match the image's layers", image=hot.image, profile=hot.profile, error=str(exc))
            return None
        engines, fetchers = {}, {}
        for layer in layers:
            engines[layer], fetchers[layer] = await self.server.fetcher(self.server.layers[layer].store)
        running = self.running.get((hot.image, hot.profile))
        if running is not None:  # started by another trigger while we waited for a fetcher
            return running
        # Never more batches in flight than half an engine's streams: a read always finds a free one.
        streams = min(engine.streams for engine in engines.values())
        limits = dataclasses.replace(self.limits, concurrency=max(1, min(self.limits.concurrency, streams // 2)))
        warmer = None
        if limits.page_cache and self.server.session is not None:  # no FUSE session (tests): no page cache to fill
            targets = {layer: self.warm_target(layer) for layer in layers}
            digests = {block.hot.digest for block in plan}
            placed = await self._with_files(indexes, targets)
            # One pass over every entry of the image's tree-served layers: not in the FUSE session's thread.
            warmer = None if placed is None else await trio.to_thread.run_sync(functools.partial(
                PageCacheWarmer, placed, targets, digests, reads=self.warm_reads))  # fmt: skip
        prefetch = Prefetch(
            image=hot.image, profile=hot.profile, plan=plan, indexes=indexes, fetchers=fetchers,
            cached=cache_checker(self.server.cache), limits=limits, warmer=warmer,
        )  # fmt: skip
        self.running[(hot.image, hot.profile)] = prefetch
        PREFETCHES.set(len(self.running))
        log.info("hot-list prefetch started", image=hot.image, profile=hot.profile, blocks=len(plan),
                 bytes=prefetch.stats.planned_bytes, recorded_on=hot.node, recorded_at=hot.recorded_at)  # fmt: skip
        spawn_guarded(self.server.nursery, self._run, prefetch)
        spawn_guarded(self.server.nursery, sample_prefetch, prefetch)  # start-up profiler: start, progress, end
        return prefetch

    async def _with_files(self, indexes: dict[str, LayerBlocks], targets: dict[str, WarmTarget]) -> dict[str, LayerBlocks] | None:
        """``indexes`` with the JSON index in the place of each block table whose layer is warmed through its files
        (an EROFS mount's: a block table lists no files; :meth:`LayerHost.layer_index`); None, logged, if one
        cannot be had (the prefetch then warms no page cache)."""
        placed = dict(indexes)
        for layer, index in indexes.items():
            if isinstance(targets[layer], BlobTarget) or isinstance(index, LayerIndex):
                continue
            try:
                placed[layer] = await self.server.layer_index(layer)
            except (LayerServerError, FormatError, FetchError, SourceError, OSError) as exc:  # warming only ever saves time
                log.warning("hot-list prefetch warms no page cache: a layer's index cannot be had", layer=layer,
                            error=str(exc))  # fmt: skip
                return None
        return placed

    def warm_target(self, chain_id: str) -> WarmTarget:
        """Where the kernel caches ``chain_id``'s blocks: the files of its EROFS mount or of its FUSE tree.

        The layer's row in the server's table says how it is served (``Layer.data_path``).
        """
        layer = self.server.layers[chain_id]
        blob = self.server.local_blob(chain_id) if layer.data_path == "fanotify" else None
        if blob is not None:
            return BlobTarget(blob)
        if layer.data_path in EROFS_PATHS:
            return ErofsTarget(self.server.paths.lower_dir(layer.slot, layer.data_path))
        return TreeTarget(layer.slot, self.server.paths.lower_dir(layer.slot, "tree"))

    @staticmethod
    def attach(prefetch: Prefetch, key: str) -> None:
        """Container ``key`` runs on ``prefetch``'s image and profile: the prefetch lives until it is gone."""
        prefetch.containers.add(key)
        prefetch.had_container = True
        prefetch.attached.set()

    async def _run(self, prefetch: Prefetch) -> None:
        try:
            await prefetch.run()
            # What the fetch did only: its reads are counted when its last container goes (end(), the
            # page cache's share included); here they would say 0 hits and every byte unread.
            log.info("hot-list prefetch done", image=prefetch.image, profile=prefetch.profile,
                     cancelled=prefetch.cancel_scope.cancelled_caught, **log_fields(prefetch, reads=False))  # fmt: skip
        finally:
            # It stays in ``running`` (for read accounting) until its containers are gone;
            # one started at pull that no container joins within the recording window ends then.
            if not prefetch.had_container:
                with trio.move_on_after(self.window):
                    await prefetch.attached.wait()
            if not prefetch.containers:
                await self.end(prefetch)

    async def end(self, prefetch: Prefetch) -> None:
        """Stop ``prefetch``, count what its warmed page cache served, and keep its summary."""
        prefetch.stop()
        if self.running.get((prefetch.image, prefetch.profile)) is prefetch:
            del self.running[(prefetch.image, prefetch.profile)]
            PREFETCHES.set(len(self.running))
            # Asking the kernel is quick (mincore, nothing read); a shutdown does not lose the summary.
            with trio.CancelScope(shield=True), trio.move_on_after(SETTLE_TIMEOUT):
                try:
                    await prefetch.settle_page_cache()
                except OSError as exc:
                    log.warning("cannot tell what the page cache served", image=prefetch.image, error=str(exc))
            UNREAD_BYTES.inc(prefetch.unread_bytes())
            self.finished.append({"kind": "prefetch", "image": prefetch.image, "profile": prefetch.profile,
                                  **prefetch.stats.as_dict(), "unread_bytes": prefetch.unread_bytes()})  # fmt: skip
        PREFETCHES.set(len(self.running))


def log_fields(prefetch: Prefetch, *, reads: bool = True) -> dict[str, Any]:
    """A prefetch's log fields: what it fetched and warmed, and with ``reads`` how the job's reads went."""
    stats = prefetch.stats.as_dict()
    fields = {
        "prefetched_blocks": stats["fetched_blocks"], "prefetched_bytes": stats["fetched_bytes"],
        "cached_blocks": stats["cached_blocks"], "failed_blocks": stats["failed_blocks"],
        "warmed_bytes": stats["warmed_bytes"],
    }  # fmt: skip
    if reads:
        fields.update({
            "hits": stats["hits"], "waited": stats["waited"], "misses": stats["misses"], "hit_rate": stats["hit_rate"],
            "lead_median_s": stats["lead_median_s"], "served_from_page_cache_blocks": stats["served_from_page_cache_blocks"],
            "unread_bytes": prefetch.unread_bytes(),
        })  # fmt: skip
    return fields


__all__ = ["PREFETCHES", "SETTLE_TIMEOUT", "Prefetches", "log_fields"]
