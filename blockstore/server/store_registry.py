"""The layer server's stores: one fetch engine and one block fetcher per store URL, started on first use.

Layers name their store by URL (the node's default, or the one a mount request gave);
every layer of one store shares its engine (so range requests coalesce and one
``memory_limit`` bounds them) and its :class:`~bootseer.blockstore.node.fetcher.BlockFetcher`
(so a block is fetched once whichever layer or prefetch asks).  Engines run in the
nursery the registry is given, for the server's lifetime; a store's source is closed
when its engine ends.

With peer sharing on, every fetcher asks the group's members first (``peers``), and
names its store to them by :func:`~bootseer.blockstore.peers.ownership.peer_store_id`; a
peer's request names a store the same way, and :meth:`StoreRegistry.for_peer` finds
(or starts) the store of that name among the node's own, never one a peer made up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Iterator

import trio

from bootseer.blockstore.server.client import InvalidRequest
from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.local_blocks import LocalBlocks
from bootseer.blockstore.node.peers import PeerBlocks
from bootseer.fetch.engine import Engine, EngineConfig
from bootseer.fetch.source import SourceError
from bootseer.fetch.sources import open_source, redact_url
from bootseer.blockstore.peers.limits import peer_memory_share
from bootseer.blockstore.peers.ownership import peer_store_id


class StoreRegistry:
    """The engines and block fetchers of a layer server's stores, by URL (see the module docstring).

    ``cache`` is the node block cache every fetcher reads through and fills; ``threads``
    bounds their cache I/O, decompression and hashing together; ``peers`` is the peer
    group's client (None: no sharing) and ``known`` the store URLs this node is
    configured with, that peers may ask for before a layer of them is mounted here; ``local``
    the blocks on this node's disk outside the node cache (the ``fanotify`` path's blobs), which
    every fetcher serves peers from before the node cache and the store.
    """

    def __init__(self, nursery: trio.Nursery, engine: EngineConfig, source_options: dict[str, Any], cache: BlockCache | None,
                 threads: trio.CapacityLimiter, *, peers: PeerBlocks | None = None,
                 known: Iterable[str] = (), local: LocalBlocks | None = None) -> None:  # fmt: skip
        self._nursery = nursery
        self._local = local
        self._peers = peers
        if peers is not None:
            # A member fetches from the store only the blocks it owns, about one in N of them: a gap
            # between two of them is other owners' blocks, which bridging would fetch a second time
            # (bench/results/peers.md: the store's egress with peers).
            # Serving peers holds its buffers within peer_memory_share(engine) of memory_limit: the
            # engine gets the rest, so a node's buffers stay within memory_limit however many ask.
            engine = dataclasses.replace(engine, coalesce_gap=0,
                                         memory_limit=engine.memory_limit - peer_memory_share(engine))  # fmt: skip
        self._known = [url for url in known if url]
        self._engine_config = engine
        self._source_options = source_options
        self._cache = cache
        self._threads = threads
        self._engines: dict[str, Engine] = {}
        self._fetchers: dict[str, BlockFetcher] = {}
        self._opening: dict[str, trio.Lock] = {}

    async def fetcher(self, store: str) -> tuple[Engine, BlockFetcher]:
        """The engine and block fetcher of ``store``, started on first use (InvalidRequest for a URL no source takes)."""
        lock = self._opening.setdefault(store, trio.Lock())
        async with lock:
            if store not in self._engines:
                try:
                    source = open_source(store, **self._source_options)
                except (ValueError, TypeError, SourceError) as exc:
                    raise InvalidRequest(f"store {redact_url(store)!r}: {exc}") from None
                engine = Engine(source, self._engine_config)
                await self._nursery.start(self._run_engine, engine)
                self._engines[store] = engine
                self._fetchers[store] = BlockFetcher(
                    engine, self._cache, threads=self._threads, peers=self._peers,
                    peer_store=peer_store_id(redact_url(store)), local=self._local,
                )  # fmt: skip
        return self._engines[store], self._fetchers[store]

    async def for_peer(self, peer_store: str) -> BlockFetcher | None:
        """The fetcher of this node's store that peers call ``peer_store``, started if need be; None if none is."""
        for url in [*self._engines, *self._known]:
            if peer_store_id(redact_url(url)) == peer_store:
                try:
                    return (await self.fetcher(url))[1]
                except InvalidRequest:
                    return None
        return None

    def opened(self) -> Iterator[tuple[Engine, BlockFetcher]]:
        """The stores started so far, in the order they were: each one's engine and fetcher."""
        for url, engine in self._engines.items():
            yield engine, self._fetchers[url]

    def opened_fetcher(self, store: str) -> BlockFetcher | None:
        """The block fetcher of ``store`` if it was started, else None (nothing is started)."""
        return self._fetchers.get(store)

    def bytes_fetched(self) -> int:
        """Bytes every store's engine has fetched so far."""
        return sum(engine.statistics().bytes_fetched for engine in self._engines.values())

    def status(self) -> dict[str, dict[str, Any]]:
        """What the server's ``status`` answer shows of each started store, by URL: its engine's
        counters, its fetcher's ``blocks``, and an http store's ``proxy`` (its URL, whether it is up)."""
        stores: dict[str, dict[str, Any]] = {}
        for engine, fetcher in self.opened():
            stats = engine.statistics()
            stores[engine.url] = {
                "bytes_fetched": stats.bytes_fetched,
                "stripes_fetched": stats.stripes_fetched,
                "retries": stats.retries,
                "failures": stats.failures,
                "in_flight": stats.in_flight,
                "blocks": dataclasses.asdict(fetcher.statistics()),
            }
            if stats.proxy is not None:  # an http store's [store] proxy (fetch/sources/http_proxy.py)
                stores[engine.url]["proxy"] = {"proxy": stats.proxy.url, "up": stats.proxy.up}
        return stores

    @staticmethod
    async def _run_engine(engine: Engine, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await engine.run(task_status=task_status)
        finally:
            engine.source.close()


__all__ = ["StoreRegistry"]
