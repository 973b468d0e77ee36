"""Verified blocks of converted layers: the read path below the layer reader, the hot-block prefetcher and the peers.

:class:`BlockFetcher` turns block references of a :class:`~bootseer.blockstore.objects.format.LayerIndex`
into raw bytes: first from its memory of blocks it served lately
(:class:`~bootseer.blockstore.node.memory.RecentBlocks`: the kernel reads a block in several
pieces), then from the node's :class:`~bootseer.blockstore.node.block_cache.BlockCache`, the rest
from peers (:mod:`~bootseer.blockstore.node.peers`) or with one
:meth:`Engine.fetch_extents <bootseer.fetch.engine.Engine.fetch_extents>` call on the store's
engine (each block is an extent of its pack, so neighbours in a pack go out as one range
request, and priorities, retries, EIO after ``retry_timeout`` and the fetch metrics are the
engine's).  It lets a call wait for a block another call is getting rather than get it twice
(``joined`` in the metrics): the hot-block prefetcher calls the same :meth:`BlockFetcher.blocks`
at ``Priority.PREFETCH``, so a read overtakes it, and a read of a block being prefetched waits
on that fetch instead of making another.

Every fetched block is decompressed (never to more than its raw length) and checked against its
SHA-256 before anyone sees it; one that fails is reported to the engine
(:meth:`Engine.corrupt <bootseer.fetch.engine.Engine.corrupt>`: its buffer dropped, and its
source told, so a store proxy that served it is set aside and the refetch goes to the store
direct) and fetched once more, and if it fails again the call fails with FetchError (EIO); one
fetched for a peer's request (:meth:`BlockFetcher.block_for_peer`, whose place and digest the
peer names) is dropped and refused at once, never fetched again, and the source is not told (a
made-up digest says nothing of the route: it must not set a store proxy aside).  A corrupt byte
is never served and never cached.  Small blocks are decoded on the trio thread (a thread hop
costs more than the work); verified blocks are written into the node cache behind the read
(:mod:`~bootseer.blockstore.node.cache_writer`; :meth:`BlockFetcher.flush` waits for it), so a
read never waits for the disk.  A call given a :class:`~bootseer.blockstore.objects.format.BlockSink`
(a ``fanotify`` fill: the layer's local blob) hands it the blocks it fetches instead, in the one
worker-thread call that decodes and verifies them: the blob is their one copy on the node.  All-zero blocks are stored nowhere and cost nothing.

A read the node cache serves takes its read-ahead candidates from the cache too, in the same
worker-thread call (up to :data:`CACHE_AHEAD_BYTES`, each verified by the cache), into memory: on
a restarted node the reads that follow are memory hits, with no thread hop or disk wait of their
own.  Read-ahead (:mod:`~bootseer.blockstore.node.readahead`) is queued in the engine with a read that
goes to the store; a block read ahead is verified when read, like any fetched block.  Blocks in
memory, pending, in the node cache or known to the engine are never read ahead.  What the fetcher
counts is :class:`~bootseer.blockstore.node.metrics.FetcherStats` (:meth:`BlockFetcher.statistics`)
and the metrics of :mod:`~bootseer.blockstore.node.metrics`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, Protocol

import trio

from bootseer import cpu
from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.node.cache_writer import CacheWriter
from bootseer.blockstore.node.local_blocks import LocalBlocks
from bootseer.blockstore.node.memory import RecentBlocks
from bootseer.blockstore.node.metrics import FetcherStats, LayerCounters, layer_label
from bootseer.blockstore.node.peers import UNCHARGED, PeerAllowance, PeerBlocks, PeerPayload, fetch_hedged
from bootseer.blockstore.node.readahead import READAHEAD_MAX_BLOCKS, AheadLedger
from bootseer.blockstore.objects.format import (
    Block, BlockPlace, BlockSink, decode_block, max_stored_length, pack_object,
)  # fmt: skip
from bootseer.fetch.engine import Engine
from bootseer.fetch.stripes import Extent, FetchError, Priority
from bootseer.log import get_logger

log = get_logger(__name__)

#: Raw bytes of read-ahead candidates a read that goes to the node cache takes from it too, into the
#: fetcher's memory, in the same worker-thread call: the reads that follow are memory hits, with no
#: thread hop and no disk wait of their own.
CACHE_AHEAD_BYTES = 4 << 20
#: A call whose blocks (compressed and raw bytes together) exceed this decompresses and
#: hashes them in a worker thread (zstd and hashlib release the GIL there); below it
#: the thread hop (tens of microseconds) costs more than the work.
OFF_THREAD_BYTES = 256 << 10


class _Place(NamedTuple):
    """A block's extent key: its digest and where it lies (one block may be stored in several packs)."""

    digest: str
    pack: str
    offset: int
    clen: int


@functools.lru_cache(maxsize=4096)
def _pack_path(name: str) -> str:
    return pack_object(name)


class PackList(Protocol):
    """What fetching a stored block needs of its layer: the pack names its blocks refer to, and a name.

    A :class:`~bootseer.blockstore.objects.format.LayerIndex`, or the one pack of a peer's request.
    """

    @property
    def diff_id(self) -> str: ...

    @property
    def packs(self) -> Sequence[str]: ...


class BlockTable(PackList, Protocol):
    """Blocks to fetch by number and the packs they lie in: a layer's index, or the table of a layer's
    EROFS image (:class:`~bootseer.blockstore.objects.format.LayerImage`), whose blocks are fetched,
    verified, cached and shared with peers as a layer's are."""

    @property
    def blocks(self) -> Sequence[Block]: ...


class _PeerRequest(NamedTuple):
    """The one pack of a block a peer asked for (a :class:`PackList`)."""

    packs: Sequence[str]
    diff_id: str = "(asked by a peer)"


def _extent(index: PackList, block: Block) -> Extent:
    """The extent of stored ``block`` in its pack, keyed by its digest and place."""
    pack = _pack_path(index.packs[block.pack])
    return Extent(_Place(block.digest, pack, block.offset, block.clen), pack, block.offset, block.clen)


@functools.lru_cache(maxsize=8)
def zeros(length: int) -> bytes:
    """``length`` zero bytes (one object per length: an all-zero block costs nothing)."""
    return bytes(length)


class _Pending:
    """A block one call is getting (from the node cache or the store) that others wait for."""

    __slots__ = ("done", "data", "asks_peer", "for_peer")

    def __init__(self, for_peer: bool = False) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None  # None once done: its call failed or was cancelled
        self.asks_peer = False  # its call asks another node for it (a peer's request must not wait on that)
        self.for_peer = for_peer  # a peer's request gets it, below this node's reads (which never wait on it)


class BlockFetcher:
    """Raw, verified blocks of any layer of one store, through memory, the node cache and the store's engine.

    ``engine`` is the store's (rooted at the store URL, running); ``cache`` the node's
    block cache (None: no cache); ``source_label`` names the store in metrics (the
    engine's URL without credentials by default); ``memory_bytes`` bounds the
    verified blocks kept in memory, least recently used first out (0: none).  The
    kernel reads a file in pieces smaller than a block (128 KiB for FUSE), so
    without them every piece would read, decompress and hash its whole block again.
    One fetcher serves every layer of its store; all methods run in the engine's
    trio thread.

    ``peers`` (with ``peer_store``, the name the peer group gives this store) are asked
    first for blocks another node owns (docs/peers.md): a block a peer serves is
    checked here like a store block, and a block a peer does not answer in time or at
    all is fetched from the store (hedged: both may run, the first answer wins).
    Read-ahead then takes only the blocks this node owns (into the engine's buffer, as
    without peers): reading ahead another owner's blocks moved raw blocks that were
    never read (bench/results/peers.md).  With peers, the store's compressed frames of
    the blocks verified lately are kept too (as many bytes as ``memory_bytes``, least
    recently used out first), so that an owner sends a peer the frame the store sent
    rather than the raw block (:meth:`served_for_peer`).
    """

    def __init__(
        self,
        engine: Engine,
        cache: BlockCache | None,
        *,
        source_label: str | None = None,
        memory_bytes: int = 64 << 20,
        threads: trio.CapacityLimiter | None = None,
        peers: PeerBlocks | None = None,
        peer_store: str = "",
        local: LocalBlocks | None = None,
    ) -> None:
        self.engine = engine
        self.cache = cache
        self.source_label = source_label if source_label is not None else engine.url
        self.memory_bytes = memory_bytes
        self._stats = FetcherStats()
        # Cache I/O, decompression and hashing: one thread per core is all they can use.
        self._threads = threads or trio.CapacityLimiter(os.cpu_count() or 2)
        self._recent = RecentBlocks(memory_bytes)  # raises ValueError for a negative one
        # The store's frames of verified blocks, for peers (an owner sends the frame, not the raw block).
        self._frames = RecentBlocks(memory_bytes if peers is not None else 0)
        self._pending: dict[str, _Pending] = {}  # digest -> the call getting it now
        self._ahead = AheadLedger()  # blocks read ahead and not read yet
        self._counters: dict[str, LayerCounters] = {}  # layer label -> its metric children
        self._writer = CacheWriter(cache) if cache is not None else None
        self.peers = peers
        self.peer_store = peer_store
        self._peer_counters = LayerCounters("peers", self.source_label)  # blocks this node got for its peers
        #: Blocks on this node's disk outside the node cache (the ``fanotify`` path's blobs): what a peer's request
        #: is served from before the node cache and the store (:mod:`~bootseer.blockstore.node.local_blocks`).
        self.local = local

    def statistics(self) -> FetcherStats:
        """A copy of the fetcher's counters (callers never read the live ones)."""
        return dataclasses.replace(self._stats)

    def read_ahead_progress(self) -> tuple[int, int]:
        """Blocks read ahead and later read, and blocks fetched from the store, so far.

        What a :class:`~bootseer.blockstore.node.layer_reader.LayerReader` adapts its window by,
        around each read: cheaper than :meth:`statistics` (no copy).
        """
        return self._stats.readahead_read, self._stats.blocks_fetched

    @property
    def threads(self) -> trio.CapacityLimiter:
        """The limiter of the worker threads that cache I/O, decompression and hashing run in."""
        return self._threads

    def _counters_of(self, index: PackList) -> LayerCounters:
        label = layer_label(index)
        counters = self._counters.get(label)
        if counters is None:
            counters = self._counters[label] = LayerCounters(label, self.source_label)
        return counters

    def __repr__(self) -> str:
        return f"<BlockFetcher {self.source_label} cache={self.cache!r}>"

    async def blocks(
        self,
        index: BlockTable,
        refs: Sequence[int],
        priority: Priority = Priority.DEMAND,
        *,
        ahead: Callable[[], Sequence[int]] | None = None,
        sink: BlockSink | None = None,
    ) -> list[bytes]:
        """The raw bytes of blocks ``refs`` (indexes into ``index.blocks``), in order, each verified.

        Each block comes from memory, else from the node cache, else from the store:
        those are fetched with one ``fetch_extents`` call at ``priority``, verified,
        and cached.  A block another call is getting already is waited for, not got
        twice.  Everything asked for is returned at once, so callers with long lists
        (prefetch) ask a few MiB at a time.  Raises FetchError (EIO) when the store
        fails (after the engine's ``retry_timeout``) or holds a block that fails
        verification twice, and ValueError for a reference the index does not have.

        ``ahead``, called only when a block must come from the store, names blocks
        to read ahead of this call (see the module's docstring); they are queued,
        not waited for, and those already in memory, pending, cached or known to
        the engine are skipped.

        With ``sink``, the blocks this call fetches from the store go to it (:class:`BlockSink`, in the
        worker thread that verified them), not to the node cache; those from memory, the node cache, a peer or
        another call are only returned.
        """
        counters = self._counters_of(index)
        blocks: list[Block] = []
        for ref in refs:
            if not isinstance(ref, int) or not 0 <= ref < len(index.blocks):
                raise ValueError(f"layer {index.diff_id} has no block {ref!r} (it has {len(index.blocks)})")
            blocks.append(index.blocks[ref])
        out: list[bytes] = [b""] * len(blocks)
        wanted: dict[str, list[int]] = {}  # digest -> positions in ``out``, for stored blocks
        zero = 0
        for position, block in enumerate(blocks):
            if block.is_zero:
                out[position] = zeros(block.rlen)
                zero += 1
            else:
                wanted.setdefault(block.digest, []).append(position)
        if zero:
            self._stats.zero_blocks += zero
            counters.zero.inc(zero)

        def serve(digest: str, data: bytes) -> None:
            for position in wanted.pop(digest):
                out[position] = data

        writing = self._writer.pending if self._writer is not None else {}
        while wanted:
            in_memory = 0
            for digest in list(wanted):
                data = self._recent.get(digest)
                if data is None:
                    data = writing.get(digest)  # on its way into the node cache (one lookup: the writer may finish)
                    if data is None:
                        continue
                serve(digest, data)
                in_memory += 1
            if in_memory:
                self._stats.blocks_from_memory += in_memory
                counters.memory.inc(in_memory)
            # A block a peer's request is getting (below this read's priority, and never refetched) is not
            # waited for: this read fetches it itself, joining that fetch in the engine at its own priority.
            theirs = [(digest, pending) for digest in wanted
                      if (pending := self._pending.get(digest)) is not None and not pending.for_peer]  # fmt: skip
            joined = {digest for digest, _ in theirs}
            mine = {digest: blocks[positions[0]] for digest, positions in wanted.items() if digest not in joined}
            if mine:
                for digest, data in (await self._get(index, mine, priority, counters, ahead, sink=sink)).items():
                    serve(digest, data)
                ahead = None  # read ahead once per call
            for digest, pending in theirs:
                await pending.done.wait()
                if pending.data is not None:
                    self._stats.blocks_joined += 1
                    counters.joined.inc()
                    serve(digest, pending.data)
                # Else the call getting it failed or was cancelled: the next round gets it.
        return out

    async def _get(
        self,
        index: PackList,
        mine: dict[str, Block],
        priority: Priority,
        counters: LayerCounters,
        ahead: Callable[[], Sequence[int]] | None,
        *,
        for_peer: PeerAllowance | None = None,
        sink: BlockSink | None = None,
    ) -> dict[str, bytes]:
        """The blocks ``mine`` (by digest) from the node cache, peers or the store; other calls may wait for them meanwhile.

        If any comes from the store, the candidates ``ahead`` names (those not in
        memory, pending, cached or the engine) are read ahead with it.  With
        ``for_peer`` (a peer's own request) no peer is asked, the store bytes are
        charged to it first (it raises to refuse them), and a block that fails
        verification is not fetched again (FetchError).
        """
        pending = {digest: _Pending(for_peer is not None) for digest in mine}
        self._pending.update(pending)
        try:
            got: dict[str, bytes] = {}
            # A block read ahead was not in the node cache then: it waits in the engine's buffer.
            probe = [digest for digest in mine if digest not in self._ahead]
            candidates: list[Block] = []
            # Read further ahead on a miss, or on reaching the middle of the last batch read ahead.
            if ahead is not None and (probe or self._ahead.marked(mine)):
                candidates = self._ahead_candidates(index, ahead(), mine)
            if self.cache is not None and (probe or candidates):
                got, cached, loaded = await trio.to_thread.run_sync(
                    self._cache_get, probe, [block.digest for block in candidates], bool(probe),
                    limiter=self._threads,
                )  # fmt: skip
                if got:
                    self._stats.blocks_cached += len(got)
                    counters.cached.inc(len(got))
                for digest, data in got.items():
                    self._recent.remember(digest, data)
                    pending[digest].data = data
                for digest, data in loaded.items():  # read ahead from the node cache: the next reads' memory hits
                    self._recent.remember(digest, data)
                self._stats.cache_ahead_blocks += len(loaded)
                if cached:
                    candidates = [block for block in candidates if block.digest not in cached]
            rest = [block for digest, block in mine.items() if digest not in got]
            if rest:
                if for_peer is not None:
                    for_peer.charge(sum(block.clen for block in rest))
                    fetched = await self._fetch_verified(index, rest, priority, counters, refetch=False)
                elif self.peers is not None:

                    def ready(digest: str, data: bytes) -> None:
                        # Each block's waiters go on as it arrives, not when the call's last one does: a
                        # peer waiting here for a block this node owns must never wait on a block this
                        # node awaits from that peer (two nodes reading the same blocks would deadlock).
                        pending[digest].data = data
                        pending[digest].done.set()

                    for block in rest:
                        pending[block.digest].asks_peer = self.peers.owner(block.digest) is not None
                    fetched = await self._fetch_via_peers(index, rest, priority, counters, candidates, ready, sink)
                else:
                    fetched = await self._fetch_verified(index, rest, priority, counters, candidates, sink=sink)
                for block, data in zip(rest, fetched):
                    self._recent.remember(block.digest, data)
                    pending[block.digest].data = data
                    got[block.digest] = data
            return got
        finally:
            for digest, entry in pending.items():
                if self._pending.get(digest) is entry:
                    del self._pending[digest]
                entry.done.set()

    def _ahead_candidates(self, index: BlockTable, refs: Sequence[int], mine: dict[str, Block]) -> list[Block]:
        """The distinct stored blocks of ``refs`` worth reading ahead: not asked for, in memory, pending or read ahead."""
        chosen: dict[str, Block] = {}
        for ref in refs[:READAHEAD_MAX_BLOCKS]:
            block = index.blocks[ref]
            digest = block.digest
            if block.is_zero or digest in mine or digest in chosen or digest in self._recent:
                continue
            if digest in self._pending or digest in self._ahead:
                continue
            chosen[digest] = block
        return list(chosen.values())

    def _cache_get(self, digests: list[str], probe: list[str],
                   load: bool) -> tuple[dict[str, bytes], set[str], dict[str, bytes]]:  # fmt: skip
        """In a worker thread: the blocks of ``digests`` the cache holds (each verified by it), which
        of ``probe`` (read-ahead candidates: not worth fetching if cached) it holds, and, with
        ``load`` when every one of ``digests`` was there, the first of those candidates read (and
        verified) too, up to :data:`CACHE_AHEAD_BYTES`."""
        assert self.cache is not None
        found = {}
        loaded: dict[str, bytes] = {}
        with cpu.stage("cache_read"):
            for digest in digests:
                data = self.cache.get(digest)
                if data is not None:
                    found[digest] = data
            held = {digest for digest in probe if self.cache.contains(digest)}
            if load and len(found) == len(digests):  # a read the node cache served: its next blocks likely are too
                room = CACHE_AHEAD_BYTES
                for digest in probe:
                    if digest not in held or room <= 0:
                        break  # in order: up to the first one the cache does not hold
                    data = self.cache.get(digest)
                    if data is None:
                        break
                    loaded[digest] = data
                    room -= len(data)
            return found, held, loaded

    def _read_ahead(self, index: PackList, candidates: Sequence[Block], counters: LayerCounters) -> None:
        """Queue ``candidates`` in the engine at READAHEAD and remember them, to count them when read."""
        queued = self.engine.readahead_extents([_extent(index, block) for block in candidates])
        queued_bytes = self._ahead.queued([(extent.key.digest, extent.length) for extent in queued])
        self._stats.readahead_blocks += len(queued)
        self._stats.readahead_bytes += queued_bytes
        counters.ahead_queued.inc(queued_bytes)

    async def served_for_peer(self, place: BlockPlace, priority: Priority, allowance: PeerAllowance | None = None,
                              *, compressed: bool = False) -> PeerPayload | None:  # fmt: skip
        """What to send a peer that asks for ``place``: with ``compressed`` (the peer takes frames) the
        store's frame of the block when this node verified one lately, else its raw bytes
        (:meth:`block_for_peer`, whose contract this keeps).  A frame is sent only when no larger
        than the block's worst case (:func:`~bootseer.blockstore.objects.format.max_stored_length`)."""
        def frame() -> PeerPayload | None:
            kept = self._frames.peek(place.digest) if compressed else None
            return PeerPayload(kept, True) if kept is not None and len(kept) <= max_stored_length(place.rlen) else None

        if (payload := frame()) is not None:
            return payload
        data = await self.block_for_peer(place, priority, allowance)
        if data is None:
            return None
        return frame() or PeerPayload(data, False)  # a block fetched from the store just now: its frame is kept

    async def block_for_peer(self, place: BlockPlace, priority: Priority,
                             allowance: PeerAllowance | None = None) -> bytes | None:  # fmt: skip
        """The verified raw bytes of a block a peer asks for, from memory, this node's blobs (:attr:`local`,
        which verifies what it reads), the node cache or the store.

        Never from another peer (so requests never go round in circles), and once
        however many peers ask at once (they join one call).  A store fetch is charged
        to ``allowance`` first (whatever it raises to refuse it goes to the caller), and
        a block that fails verification is not fetched again: a peer names the place
        and the digest, and a made-up pair must cost the store one fetch at most.
        None when the store fails, holds no such block or the bytes there are not that
        block (the peer then asks the store itself).
        """
        digest = place.digest
        data = self._recent.peek(digest)
        if data is None and self._writer is not None:
            data = self._writer.pending.get(digest)
        if data is not None:
            return data
        pending = self._pending.get(digest)
        # Joined only if that call gets it without a peer: while members disagree on an owner,
        # waiting on a call that asks a peer could close a loop of nodes each waiting on the next.
        if pending is not None and not pending.asks_peer:
            await pending.done.wait()
            if pending.data is not None:
                return pending.data
        if self.local is not None:
            data = await trio.to_thread.run_sync(self.local.read, digest, place.rlen, limiter=self._threads)
            if data is not None:
                return data
        block = Block(digest, 0, place.offset, place.clen, place.rlen)
        try:
            got = await self._get(_PeerRequest((place.pack,)), {digest: block}, priority, self._peer_counters, None,
                                  for_peer=allowance or UNCHARGED)  # fmt: skip
        except FetchError as exc:
            log.warning("a block a peer asked for cannot be fetched", store=self.source_label, block=digest,
                        error=str(exc))  # fmt: skip
            return None
        return got.get(digest)

    async def _fetch_via_peers(
        self,
        index: PackList,
        blocks: list[Block],
        priority: Priority,
        counters: LayerCounters,
        ahead: Sequence[Block] = (),
        ready: Callable[[str, bytes], None] = lambda digest, data: None,
        sink: BlockSink | None = None,
    ) -> list[bytes]:
        """Distinct stored ``blocks``, each from its owner in the peer group or from the store
        (:func:`~bootseer.blockstore.node.peers.fetch_hedged`, through :meth:`_fetch_verified`).

        Of ``ahead``, the blocks this node owns are read ahead from the store (the others
        are asked of their owners when read).  ``ready`` is told each block (digest, verified bytes)
        as soon as it is had, before the others.
        """
        assert self.peers is not None
        peers = self.peers
        if ahead:
            # Read ahead only what this node owns (from the store, into the engine's buffer: compressed and
            # not decoded until read); another owner's block is asked for when it is read.
            own = [block for block in ahead if peers.owner(block.digest) is None]
            if own:
                self._read_ahead(index, own, counters)
        by_digest = {block.digest: block for block in blocks}

        def from_store(places: list[BlockPlace]) -> Awaitable[list[bytes]]:
            return self._fetch_verified(index, [by_digest[place.digest] for place in places], priority, counters,
                                        sink=sink)  # fmt: skip

        def from_peer() -> None:
            self._stats.blocks_from_peers += 1
            counters.peer.inc()

        places = [BlockPlace(b.digest, index.packs[b.pack], b.offset, b.clen, b.rlen) for b in blocks]
        return await fetch_hedged(peers, self.peer_store, places, priority, from_store, ready, from_peer)

    async def _fetch_verified(
        self,
        index: PackList,
        blocks: list[Block],
        priority: Priority,
        counters: LayerCounters,
        ahead: Sequence[Block] = (),
        *,
        refetch: bool = True,
        sink: BlockSink | None = None,
    ) -> list[bytes]:
        """Fetch distinct stored ``blocks`` from the store, verify and cache them (or hand them to ``sink``);
        refetch a failure once.

        ``ahead`` is queued as read-ahead right before (so its first blocks join the
        same range request).  Without ``refetch`` (a peer's request) a failure is not
        fetched again: FetchError at once.
        """
        extents = [_extent(index, block) for block in blocks]
        if ahead:
            self._read_ahead(index, ahead, counters)
        stored = await self.engine.fetch_extents(extents, priority)
        if self._ahead:
            used, used_bytes = self._ahead.read(block.digest for block in blocks)
            if used:
                self._stats.readahead_read += used
                self._stats.readahead_read_bytes += used_bytes
                counters.ahead_read.inc(used_bytes)
        raw = await self._decode_and_cache(blocks, stored, sink)
        self._keep_frames(blocks, stored, raw)
        bad = [number for number, data in enumerate(raw) if data is None]
        if bad and not refetch:
            for number in bad:
                # Dropped, but the source is not told: the peer named the digest, so a failure may be its
                # made-up block rather than the route's bytes (a store proxy would be set aside for nothing).
                self.engine.discard(extents[number].key)
            self._stats.corrupt += len(bad)
            counters.failed.inc(len(bad))
            block, extent = blocks[bad[0]], extents[bad[0]]
            raise FetchError(
                f"{self.source_label}: {extent.path} bytes {block.offset}-{block.offset + block.clen - 1} are not "
                f"block sha256:{block.digest}: refused, not fetched again"
            )
        if bad:
            for number in bad:
                # The source learns of it (a store proxy that served it is set aside: the refetch goes direct).
                bad_extent = extents[number]
                self.engine.corrupt(bad_extent.path, bad_extent.offset, bad_extent.length, bad_extent.version,
                                    key=bad_extent.key)  # fmt: skip
                log.warning("fetched block fails verification; fetching it again", store=self.source_label,
                            layer=index.diff_id, block=blocks[number].digest, pack=extents[number].path,
                            offset=blocks[number].offset, length=blocks[number].clen)  # fmt: skip
            self._stats.corrupt += len(bad)
            counters.refetched.inc(len(bad))
            again = await self.engine.fetch_extents([extents[number] for number in bad], priority)
            redone = await self._decode_and_cache([blocks[number] for number in bad], again, sink)
            self._keep_frames([blocks[number] for number in bad], again, redone)
            for number, data in zip(bad, redone):
                if data is None:
                    bad_extent = extents[number]  # the next read asks the store again
                    self.engine.corrupt(bad_extent.path, bad_extent.offset, bad_extent.length, bad_extent.version,
                                        key=bad_extent.key)  # fmt: skip
                    self._stats.failed += 1
                    counters.failed.inc()
                    block = blocks[number]
                    log.error("block fails verification twice; the read fails with EIO", store=self.source_label,
                              layer=index.diff_id, block=block.digest, pack=extents[number].path)  # fmt: skip
                    raise FetchError(
                        f"{self.source_label}: block sha256:{block.digest} of layer {index.diff_id} "
                        f"({extents[number].path} bytes {block.offset}-{block.offset + block.clen - 1}) "
                        f"fails verification twice: the store holds a corrupt copy"
                    )
                raw[number] = data
        self._stats.blocks_fetched += len(blocks)
        fetched_bytes = sum(block.clen for block in blocks)
        self._stats.bytes_fetched += fetched_bytes
        counters.fetched.inc(len(blocks))
        counters.fetched_bytes.inc(fetched_bytes)
        return raw  # type: ignore[return-value]  # no None is left

    def _keep_frames(self, blocks: Sequence[Block], stored: Sequence[bytes], raw: Sequence[bytes | None]) -> None:
        """Keep the store's frames of the blocks that verified, for peers (nothing without peers)."""
        if self._frames.limit_bytes:
            for block, frame, data in zip(blocks, stored, raw):
                if data is not None:
                    self._frames.remember(block.digest, frame)

    async def _decode_and_cache(self, blocks: list[Block], stored: list[bytes],
                                sink: BlockSink | None = None) -> list[bytes | None]:  # fmt: skip
        """Each block's verified raw bytes (None where ``stored`` is not that block), the good ones cached, or
        with ``sink`` handed to it instead.

        Small blocks are decoded on this thread (a thread hop costs more); the node
        cache is written behind the read (:class:`~bootseer.blockstore.node.cache_writer.CacheWriter`), or in the same
        worker thread when the writer is full.  With ``sink`` the decode and the sink's write are one worker-thread
        call, whatever the size.
        """
        size = sum(block.clen + block.rlen for block in blocks)
        if sink is None and size <= OFF_THREAD_BYTES:
            with cpu.stage("decode"):
                raw = [decode_block(block, data) for block, data in zip(blocks, stored)]
            if self._writer is not None:
                behind = [(block.digest, data) for block, data in zip(blocks, raw) if data is not None]
                if behind and not self._writer.submit(behind):
                    await trio.to_thread.run_sync(self._writer.write, behind, limiter=self._threads)
            return raw
        return await trio.to_thread.run_sync(self._decode_and_cache_blocking, blocks, stored, sink,
                                             limiter=self._threads)  # fmt: skip

    def _decode_and_cache_blocking(self, blocks: list[Block], stored: list[bytes],
                                   sink: BlockSink | None) -> list[bytes | None]:  # fmt: skip
        with cpu.stage("decode"):
            raw = [decode_block(block, data) for block, data in zip(blocks, stored)]
        good = [(block.digest, data) for block, data in zip(blocks, raw) if data is not None]
        if sink is not None:
            if good:
                sink.put(good)
        elif self._writer is not None and good and not self._writer.submit(good):
            self._writer.write(good)
        return raw

    async def flush(self) -> None:
        """Return once every block served so far is in the node cache (its writes behind the reads are done)."""
        if self._writer is not None:
            await trio.to_thread.run_sync(self._writer.wait_idle, limiter=self._threads)
