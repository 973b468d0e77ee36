"""Verified blocks of converted layers, and file reads over them: the read path below the FUSE layer server.

:class:`BlockFetcher` turns block references of a :class:`~bootseer.blockstore.objects.format.LayerIndex`
into raw bytes: first from the node's :class:`~bootseer.blockstore.node.block_cache.BlockCache`,
the rest with one :meth:`Engine.fetch_extents <bootseer.fetch.engine.Engine.fetch_extents>`
call on the store's engine (each block is an extent of its pack, so neighbours in a
pack go out as one range request, and priorities, retries, EIO after
``retry_timeout`` and the fetch metrics are the engine's).  Every fetched block is
decompressed (never to more than its raw length) and checked against its SHA-256
before anyone sees it; one that fails is reported to the engine
(:meth:`Engine.corrupt <bootseer.fetch.engine.Engine.corrupt>`: its buffer dropped, and its
source told, so a store proxy that served it is set aside and the refetch goes to the
store direct) and fetched once more, and if it fails again the call fails with FetchError (EIO);
one fetched for a peer's request (:meth:`BlockFetcher.block_for_peer`, whose place and digest
the peer names) is dropped and refused at once, never fetched again, and the source is not
told (a made-up digest says nothing of the route: it must not set a store proxy aside).  A corrupt
byte is never served and never cached.  Small blocks are decoded on the trio thread
(a thread hop costs more than the work); verified blocks are written into the node
cache behind the read by one writer thread (:meth:`BlockFetcher.flush` waits for it),
so a read never waits for the disk.  All-zero blocks are stored nowhere and cost
nothing.  The fetcher keeps the blocks it served lately in memory (the kernel reads a
block in several pieces) and lets a call wait for a block another call is getting
rather than get it twice.  The hot-block prefetcher calls the same
:meth:`BlockFetcher.blocks` at ``Priority.PREFETCH``: a read then overtakes it, and a
read of a block being prefetched waits on that fetch instead of making another
(``joined`` in the metrics).

:class:`LayerReader` serves ``read(entry, offset, size)`` for one layer: the blocks
the range touches, sliced.  When a read has to go to the store it also reads ahead:
the blocks that follow the last one it needs in the pack (the rest of the file, then
the files next to it in the layer's tar: the same Python package), up to a window of
compressed bytes that doubles while reads land on blocks read ahead and halves when
they do not (:data:`READAHEAD_MIN` .. :data:`READAHEAD_MAX`).  They are queued with
:meth:`Engine.readahead_extents <bootseer.fetch.engine.Engine.readahead_extents>` right
before the read's own fetch, so the first of them ride in its range request and the
rest follow at READAHEAD priority, behind every demand read.  Nothing read ahead is
served or cached before it is read: it waits as compressed bytes in the engine's
buffer, and the read that wants it takes it from there and verifies it like any
fetched block (a tampered one is refetched, then EIO).  Blocks in memory, pending,
in the node cache or known to the engine are never read ahead.

:meth:`LayerReader.read_blob` reads the other view of a layer, its blob: every block
of the index end to end, block ``i`` at offset ``i * block_size`` padded with zeros
(the extra device an EROFS image of the layer names its chunks in).  A range maps to
block numbers by one division; the blocks, the read-ahead (the blob being the
"file": its next block is usually its pack's next) and the window are :meth:`read`'s.

Metrics (beside the engine's ``bootseer_fetch_*``): ``bootseer_blocks_total`` (blocks
served, by layer, source and outcome: memory, cached, fetched, joined, zero),
``bootseer_block_fetched_bytes_total`` (compressed bytes fetched, by layer and
source), ``bootseer_block_corrupt_total`` (blocks that failed verification, by what
followed: refetched, failed), ``bootseer_block_readahead_bytes_total`` (compressed
bytes read ahead, by layer, source and outcome: queued, read; queued minus read is
what was read ahead and never read) and ``bootseer_layer_read_seconds`` (read
latency, by source).  A layer is labelled by its short diff ID (``sha256:`` and 12 hex digits),
the same for reads and prefetch.
"""

from __future__ import annotations

import dataclasses

import functools
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import prometheus_client
import trio

from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.objects.format import Block, Entry, EntryType, LayerIndex, decode_block, max_stored_length, pack_object
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.fetch.engine import Engine, Extent, FetchError, Priority
from bootseer.log import get_logger

log = get_logger(__name__)

#: A call whose blocks (compressed and raw bytes together) exceed this decompresses and
#: hashes them in a worker thread (zstd and hashlib release the GIL there); below it
#: the thread hop (tens of microseconds) costs more than the work.
OFF_THREAD_BYTES = 256 << 10

#: A layer's read-ahead window (compressed bytes beyond a read that misses) starts at
#: READAHEAD_INITIAL, doubles up to READAHEAD_MAX while reads land on blocks read
#: ahead, and halves down to READAHEAD_MIN when a read misses without one.  The
#: ceiling was chosen on the torch benchmark: a larger one fetched more for no faster
#: start (bench/results/lazy.md).
READAHEAD_MIN = 128 << 10
READAHEAD_INITIAL = 512 << 10
READAHEAD_MAX = 2 << 20
#: At most this many blocks read ahead per miss (each is an extent: bounded work per read).
READAHEAD_MAX_BLOCKS = 256
#: Blocks read ahead and not yet read that the fetcher remembers (to count them when read).
_AHEAD_REMEMBERED = 1 << 16

BLOCKS = prometheus_client.Counter(
    "bootseer_blocks",
    "Blocks served to layer reads and prefetch, by layer, source and where they came from (memory: "
    "recently served, cached: the node cache, fetched: the store, peer: another node of the peer group, "
    "joined: another call's fetch, zero: stored nowhere)",
    ["layer", "source", "outcome"],
)
FETCHED_BYTES = prometheus_client.Counter(
    "bootseer_block_fetched_bytes", "Compressed block bytes fetched from stores, by layer and source", ["layer", "source"]
)
CORRUPT = prometheus_client.Counter(
    "bootseer_block_corrupt",
    "Fetched blocks that failed verification, by layer, source and what followed (refetched, failed: EIO)",
    ["layer", "source", "outcome"],
)
READAHEAD_BYTES = prometheus_client.Counter(
    "bootseer_block_readahead_bytes",
    "Compressed block bytes read ahead of reads, by layer, source and outcome (queued: asked of the store; "
    "read: later read; queued minus read is what was read ahead and never read)",
    ["layer", "source", "outcome"],
)
READ_SECONDS = prometheus_client.Histogram(
    "bootseer_layer_read_seconds",
    "Latency of reads of lazy layers' files (cache hits and fetches alike), by source",
    ["source"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


@dataclass
class FetcherStats:
    """Counters of one :class:`BlockFetcher`, for status output and tests."""

    blocks_from_memory: int = 0  #: blocks served from the fetcher's memory of recent blocks
    blocks_cached: int = 0  #: blocks served from the node cache
    blocks_joined: int = 0  #: blocks another call was getting, waited for (a read meeting a prefetch)
    blocks_fetched: int = 0  #: blocks fetched from the store and verified
    blocks_from_peers: int = 0  #: blocks another node of the peer group served (verified by it and here)
    bytes_fetched: int = 0  #: their compressed bytes
    zero_blocks: int = 0  #: all-zero blocks served without a fetch
    corrupt: int = 0  #: fetches that failed verification (each refetched once)
    failed: int = 0  #: blocks that failed verification twice (EIO)
    readahead_blocks: int = 0  #: blocks queued as read-ahead of a read that went to the store
    readahead_bytes: int = 0  #: their compressed bytes
    readahead_read: int = 0  #: of those, blocks later read (served from the engine's buffer: no request of their own)
    readahead_read_bytes: int = 0  #: their compressed bytes (``readahead_bytes - readahead_read_bytes``: never read)


class _Place(NamedTuple):
    """A block's extent key: its digest and where it lies (one block may be stored in several packs)."""

    digest: str
    pack: str
    offset: int
    clen: int


class _Counters:
    """The labelled metric children of one layer and source, looked up once rather than per block."""

    __slots__ = ("memory", "cached", "fetched", "peer", "joined", "zero", "fetched_bytes", "refetched", "failed",
                 "ahead_queued", "ahead_read")  # fmt: skip

    def __init__(self, layer: str, source: str) -> None:
        self.memory, self.cached, self.fetched, self.peer, self.joined, self.zero = (
            BLOCKS.labels(layer, source, outcome)
            for outcome in ("memory", "cached", "fetched", "peer", "joined", "zero")
        )
        self.fetched_bytes = FETCHED_BYTES.labels(layer, source)
        self.refetched, self.failed = (CORRUPT.labels(layer, source, outcome) for outcome in ("refetched", "failed"))
        self.ahead_queued, self.ahead_read = (
            READAHEAD_BYTES.labels(layer, source, outcome) for outcome in ("queued", "read")
        )


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


class _PeerRequest(NamedTuple):
    """The one pack of a block a peer asked for (a :class:`PackList`)."""

    packs: Sequence[str]
    diff_id: str = "(asked by a peer)"


class PeerAllowance(Protocol):
    """What one peer's request may make this node fetch from the store (:class:`bootseer.blockstore.peers.service.PeerServer`)."""

    def charge(self, store_bytes: int) -> None:
        """Count ``store_bytes`` about to be fetched from the store for the peer; raises to refuse them."""


class _Uncharged:
    """The allowance of a peer's request nobody counts (a caller without a per-peer budget)."""

    def charge(self, store_bytes: int) -> None:
        pass


_UNCHARGED = _Uncharged()


class PeerBlocks(Protocol):
    """Other nodes that may hold a block (:class:`bootseer.blockstore.peers.service.PeerClient`), asked before the store."""

    def owner(self, digest: str) -> str | None:
        """The member to ask for block ``digest``, or None when this node gets it from the store itself."""

    async def fetch(self, store: str, places: Sequence[BlockPlace], priority: Priority,
                    deliver: Callable[[str, bytes], None], late: Callable[[str], None]) -> None:  # fmt: skip
        """``deliver`` each block a peer served and this node verified; name each one to get from the store
        too ``late`` (every block is one or both); never raises for what a peer does."""


def _extent(index: PackList, block: Block) -> Extent:
    """The extent of stored ``block`` in its pack, keyed by its digest and place."""
    pack = _pack_path(index.packs[block.pack])
    return Extent(_Place(block.digest, pack, block.offset, block.clen), pack, block.offset, block.clen)


def layer_label(index: LayerIndex) -> str:
    """A layer's name in metrics: its diff ID, shortened as ``docker images`` does."""
    return index.diff_id[: len("sha256:") + 12]


@functools.lru_cache(maxsize=8)
def _zeros(length: int) -> bytes:
    return bytes(length)


#: Verified blocks that may wait in memory for the node cache's writer: a layer server's memory
#: beyond ``--memory-limit`` (the stripes) by at most this much (a slow cache disk fills it).
CACHE_WRITE_QUEUE_BYTES = 64 << 20


class _CacheWriter:
    """Writes verified blocks into the node cache behind the reads that fetched them.

    A write costs a few hundred microseconds (a temporary file, a rename), more than
    decoding a small block: a read should not wait for it.  Blocks go into a queue
    that one thread at a time drains, started when the queue fills from empty; it is
    not a daemon thread, so a process that exits normally writes what is queued
    first (a killed one loses it: the next read fetches again).  At most
    ``limit_bytes`` wait; beyond that :meth:`submit` refuses and the caller writes
    itself.  Until written, a block is in the fetcher's memory of recent blocks.
    """

    def __init__(self, cache: BlockCache, limit_bytes: int = CACHE_WRITE_QUEUE_BYTES) -> None:
        self.cache = cache
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[tuple[str, bytes]] = deque()
        #: digest -> raw bytes of the blocks queued or being written: read as if in memory meanwhile
        self.pending: dict[str, bytes] = {}
        self._bytes = 0  # queued or being written
        self._thread: threading.Thread | None = None

    def submit(self, blocks: list[tuple[str, bytes]]) -> bool:
        """Queue ``(digest, raw bytes)`` pairs to be written; False (nothing queued) when the queue is full."""
        size = sum(len(data) for _, data in blocks)
        with self._lock:
            if self._bytes + size > self.limit_bytes:
                return False
            self._queue.extend(blocks)
            self.pending.update(blocks)
            self._bytes += size
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="bootseer block cache writer", daemon=False)
                self._thread.start()
        return True

    def write(self, blocks: list[tuple[str, bytes]]) -> None:
        """Blocking: write ``blocks`` now, in the caller's thread."""
        for digest, data in blocks:
            self._put(digest, data)

    def wait_idle(self) -> None:
        """Blocking: return once everything queued is written."""
        with self._lock:
            self._idle.wait_for(lambda: self._thread is None)

    def _put(self, digest: str, data: bytes) -> None:
        try:
            self.cache.put(digest, data)  # counts and logs its own OSErrors
        except Exception as exc:  # a bug must not kill the writer and strand the queue
            log.error("writing a block into the node cache failed", block=digest, error=repr(exc))

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    self._idle.notify_all()
                    return
                digest, data = self._queue.popleft()
            try:
                self._put(digest, data)
            finally:
                with self._lock:
                    self._bytes -= len(data)
                    if self.pending.get(digest) is data:
                        del self.pending[digest]


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
    never read (bench/results/peers.md).
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
    ) -> None:
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must not be negative, not {memory_bytes}")
        self.engine = engine
        self.cache = cache
        self.source_label = source_label if source_label is not None else engine.url
        self.memory_bytes = memory_bytes
        self.stats = FetcherStats()
        # Cache I/O, decompression and hashing: one thread per core is all they can use.
        self._threads = threads or trio.CapacityLimiter(os.cpu_count() or 2)
        self._recent: OrderedDict[str, bytes] = OrderedDict()  # digest -> verified raw bytes, LRU first
        self._recent_bytes = 0
        self._pending: dict[str, _Pending] = {}  # digest -> the call getting it now
        # Blocks read ahead and not read yet: digest -> (compressed length, whether reading it
        # reads further ahead: the middle block of each batch, as the kernel's PG_readahead), oldest first.
        self._ahead: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self._counters: dict[str, _Counters] = {}  # layer label -> its metric children
        self._writer = _CacheWriter(cache) if cache is not None else None
        self.peers = peers
        self.peer_store = peer_store
        self._peer_counters = _Counters("peers", self.source_label)  # blocks this node got for its peers

    def statistics(self) -> FetcherStats:
        """A copy of the fetcher's counters (callers never read the live ones)."""
        return dataclasses.replace(self.stats)

    @property
    def threads(self) -> trio.CapacityLimiter:
        """The limiter of the worker threads that cache I/O, decompression and hashing run in."""
        return self._threads

    def _counters_of(self, index: LayerIndex) -> _Counters:
        label = layer_label(index)
        counters = self._counters.get(label)
        if counters is None:
            counters = self._counters[label] = _Counters(label, self.source_label)
        return counters

    def __repr__(self) -> str:
        return f"<BlockFetcher {self.source_label} cache={self.cache!r}>"

    async def blocks(
        self,
        index: LayerIndex,
        refs: Sequence[int],
        priority: Priority = Priority.DEMAND,
        *,
        ahead: Callable[[], Sequence[int]] | None = None,
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
                out[position] = _zeros(block.rlen)
                zero += 1
            else:
                wanted.setdefault(block.digest, []).append(position)
        if zero:
            self.stats.zero_blocks += zero
            counters.zero.inc(zero)

        def serve(digest: str, data: bytes) -> None:
            for position in wanted.pop(digest):
                out[position] = data

        writing = self._writer.pending if self._writer is not None else {}
        while wanted:
            in_memory = 0
            for digest in list(wanted):
                data = self._recent.get(digest)
                if data is not None:
                    self._recent.move_to_end(digest)
                else:
                    data = writing.get(digest)  # on its way into the node cache (one lookup: the writer may finish)
                    if data is None:
                        continue
                serve(digest, data)
                in_memory += 1
            if in_memory:
                self.stats.blocks_from_memory += in_memory
                counters.memory.inc(in_memory)
            # A block a peer's request is getting (below this read's priority, and never refetched) is not
            # waited for: this read fetches it itself, joining that fetch in the engine at its own priority.
            theirs = [(digest, pending) for digest in wanted
                      if (pending := self._pending.get(digest)) is not None and not pending.for_peer]  # fmt: skip
            joined = {digest for digest, _ in theirs}
            mine = {digest: blocks[positions[0]] for digest, positions in wanted.items() if digest not in joined}
            if mine:
                for digest, data in (await self._get(index, mine, priority, counters, ahead)).items():
                    serve(digest, data)
                ahead = None  # read ahead once per call
            for digest, pending in theirs:
                await pending.done.wait()
                if pending.data is not None:
                    self.stats.blocks_joined += 1
                    counters.joined.inc()
                    serve(digest, pending.data)
                # Else the call getting it failed or was cancelled: the next round gets it.
        return out

    async def _get(
        self,
        index: PackList,
        mine: dict[str, Block],
        priority: Priority,
        counters: _Counters,
        ahead: Callable[[], Sequence[int]] | None,
        *,
        for_peer: PeerAllowance | None = None,
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
            if ahead is not None and (probe or any(self._ahead[digest][1] for digest in mine)):
                assert isinstance(index, LayerIndex)  # ``ahead`` comes with a layer's read
                candidates = self._ahead_candidates(index, ahead(), mine)
            if self.cache is not None and (probe or candidates):
                got, cached = await trio.to_thread.run_sync(
                    self._cache_get, probe, [block.digest for block in candidates], limiter=self._threads
                )
                if got:
                    self.stats.blocks_cached += len(got)
                    counters.cached.inc(len(got))
                for digest, data in got.items():
                    self._remember(digest, data)
                    pending[digest].data = data
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
                    fetched = await self._fetch_via_peers(index, rest, priority, counters, candidates, ready)
                else:
                    fetched = await self._fetch_verified(index, rest, priority, counters, candidates)
                for block, data in zip(rest, fetched):
                    self._remember(block.digest, data)
                    pending[block.digest].data = data
                    got[block.digest] = data
            return got
        finally:
            for digest, entry in pending.items():
                if self._pending.get(digest) is entry:
                    del self._pending[digest]
                entry.done.set()

    def _remember(self, digest: str, data: bytes) -> None:
        """Keep a verified block in memory, least recently used blocks out beyond ``memory_bytes``."""
        if len(data) > self.memory_bytes // 4:  # a block that would push out a quarter of the others is not worth it
            return
        if digest not in self._recent:
            self._recent_bytes += len(data)
        self._recent[digest] = data
        self._recent.move_to_end(digest)
        while self._recent_bytes > self.memory_bytes:
            _, dropped = self._recent.popitem(last=False)
            self._recent_bytes -= len(dropped)

    def _ahead_candidates(self, index: LayerIndex, refs: Sequence[int], mine: dict[str, Block]) -> list[Block]:
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

    def _cache_get(self, digests: list[str], probe: list[str]) -> tuple[dict[str, bytes], set[str]]:
        """In a worker thread: the blocks of ``digests`` the cache holds (each verified by it), and
        which of ``probe`` (read-ahead candidates: not worth fetching if cached) it holds."""
        assert self.cache is not None
        found = {}
        for digest in digests:
            data = self.cache.get(digest)
            if data is not None:
                found[digest] = data
        return found, {digest for digest in probe if self.cache.contains(digest)}

    def _read_ahead(self, index: PackList, candidates: Sequence[Block], counters: _Counters) -> None:
        """Queue ``candidates`` in the engine at READAHEAD and remember them, to count them when read."""
        queued = self.engine.readahead_extents([_extent(index, block) for block in candidates])
        queued_bytes = 0
        middle = len(queued) // 2
        for number, extent in enumerate(queued):
            self._ahead[extent.key.digest] = (extent.length, number == middle)
            queued_bytes += extent.length
        while len(self._ahead) > _AHEAD_REMEMBERED:
            self._ahead.popitem(last=False)  # unread so long it has surely left the engine's buffer
        self.stats.readahead_blocks += len(queued)
        self.stats.readahead_bytes += queued_bytes
        counters.ahead_queued.inc(queued_bytes)

    async def block_for_peer(self, place: BlockPlace, priority: Priority,
                             allowance: PeerAllowance | None = None) -> bytes | None:  # fmt: skip
        """The verified raw bytes of a block a peer asks for, from memory, the node cache or the store.

        Never from another peer (so requests never go round in circles), and once
        however many peers ask at once (they join one call).  A store fetch is charged
        to ``allowance`` first (whatever it raises to refuse it goes to the caller), and
        a block that fails verification is not fetched again: a peer names the place
        and the digest, and a made-up pair must cost the store one fetch at most.
        None when the store fails, holds no such block or the bytes there are not that
        block (the peer then asks the store itself).
        """
        digest = place.digest
        data = self._recent.get(digest)
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
        block = Block(digest, 0, place.offset, place.clen, place.rlen)
        try:
            got = await self._get(_PeerRequest((place.pack,)), {digest: block}, priority, self._peer_counters, None,
                                  for_peer=allowance or _UNCHARGED)  # fmt: skip
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
        counters: _Counters,
        ahead: Sequence[Block] = (),
        ready: Callable[[str, bytes], None] = lambda digest, data: None,
    ) -> list[bytes]:
        """Distinct stored ``blocks``, each from its owner in the peer group or, where this node owns it or
        the owner is late or fails, from the store (:meth:`_fetch_verified`); the first answer wins.

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
        # A block stored larger than zstd's worst case for it (only a hand-made index has one) is
        # never asked of a peer: owners refuse such a request (peers.wire), and it would cost a skip.
        theirs = [block for block in blocks
                  if block.clen <= max_stored_length(block.rlen) and peers.owner(block.digest) is not None]  # fmt: skip
        if not theirs:
            return await self._fetch_verified(index, blocks, priority, counters)
        got: dict[str, bytes] = {}
        asked_store: set[str] = set()
        failures: list[FetchError] = []
        complete = trio.Event()
        by_digest = {block.digest: block for block in blocks}
        late_send, late_receive = trio.open_memory_channel[str](len(blocks) + 1)
        theirs_digests = {block.digest for block in theirs}
        for block in blocks:
            if block.digest not in theirs_digests:
                late_send.send_nowait(block.digest)  # this node owns it: the store, at once

        def deliver(digest: str, data: bytes) -> None:
            if digest in by_digest and digest not in got:
                got[digest] = data
                ready(digest, data)
                self.stats.blocks_from_peers += 1
                counters.peer.inc()
                if len(got) == len(by_digest):
                    complete.set()

        def late(digest: str) -> None:
            if digest in by_digest and digest not in got and digest not in asked_store:
                asked_store.add(digest)
                late_send.send_nowait(digest)

        async def from_store(batch: list[Block]) -> None:
            try:
                fetched = await self._fetch_verified(index, batch, priority, counters)
            except FetchError as exc:
                if any(block.digest not in got for block in batch):
                    failures.append(exc)
                    complete.set()
                return
            for block, data in zip(batch, fetched):
                if block.digest not in got:
                    got[block.digest] = data
                    ready(block.digest, data)
            if len(got) == len(by_digest):
                complete.set()

        async def store_when_late(nursery: trio.Nursery) -> None:
            async for digest in late_receive:
                batch = [digest]
                while True:  # every block late by now goes in one call (neighbours coalesce)
                    try:
                        batch.append(late_receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                wanted = [by_digest[digest] for digest in dict.fromkeys(batch) if digest not in got]
                if wanted:
                    nursery.start_soon(from_store, wanted)

        async def from_peers() -> None:
            places = [BlockPlace(b.digest, index.packs[b.pack], b.offset, b.clen, b.rlen) for b in theirs]
            await peers.fetch(self.peer_store, places, priority, deliver, late)
            for block in theirs:  # the client names every block it did not deliver; in case it did not:
                late(block.digest)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store_when_late, nursery)
            nursery.start_soon(from_peers)
            await complete.wait()
            nursery.cancel_scope.cancel()
        if failures and len(got) < len(by_digest):
            raise failures[0]
        return [got[block.digest] for block in blocks]

    async def _fetch_verified(
        self,
        index: PackList,
        blocks: list[Block],
        priority: Priority,
        counters: _Counters,
        ahead: Sequence[Block] = (),
        *,
        refetch: bool = True,
    ) -> list[bytes]:
        """Fetch distinct stored ``blocks`` from the store, verify and cache them; refetch a failure once.

        ``ahead`` is queued as read-ahead right before (so its first blocks join the
        same range request).  Without ``refetch`` (a peer's request) a failure is not
        fetched again: FetchError at once.
        """
        extents = [_extent(index, block) for block in blocks]
        if ahead:
            self._read_ahead(index, ahead, counters)
        stored = await self.engine.fetch_extents(extents, priority)
        if self._ahead:
            used = used_bytes = 0
            for block in blocks:
                known = self._ahead.pop(block.digest, None)
                if known is not None:
                    used += 1
                    used_bytes += known[0]
            if used:
                self.stats.readahead_read += used
                self.stats.readahead_read_bytes += used_bytes
                counters.ahead_read.inc(used_bytes)
        raw = await self._decode_and_cache(blocks, stored)
        bad = [number for number, data in enumerate(raw) if data is None]
        if bad and not refetch:
            for number in bad:
                # Dropped, but the source is not told: the peer named the digest, so a failure may be its
                # made-up block rather than the route's bytes (a store proxy would be set aside for nothing).
                self.engine.discard(extents[number].key)
            self.stats.corrupt += len(bad)
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
            self.stats.corrupt += len(bad)
            counters.refetched.inc(len(bad))
            again = await self.engine.fetch_extents([extents[number] for number in bad], priority)
            redone = await self._decode_and_cache([blocks[number] for number in bad], again)
            for number, data in zip(bad, redone):
                if data is None:
                    bad_extent = extents[number]  # the next read asks the store again
                    self.engine.corrupt(bad_extent.path, bad_extent.offset, bad_extent.length, bad_extent.version,
                                        key=bad_extent.key)  # fmt: skip
                    self.stats.failed += 1
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
        self.stats.blocks_fetched += len(blocks)
        fetched_bytes = sum(block.clen for block in blocks)
        self.stats.bytes_fetched += fetched_bytes
        counters.fetched.inc(len(blocks))
        counters.fetched_bytes.inc(fetched_bytes)
        return raw  # type: ignore[return-value]  # no None is left

    async def _decode_and_cache(self, blocks: list[Block], stored: list[bytes]) -> list[bytes | None]:
        """Each block's verified raw bytes (None where ``stored`` is not that block), the good ones cached.

        Small blocks are decoded on this thread (a thread hop costs more); the node
        cache is written behind the read (:class:`_CacheWriter`), or in the same
        worker thread when the writer is full.
        """
        size = sum(block.clen + block.rlen for block in blocks)
        if size <= OFF_THREAD_BYTES:
            raw = [decode_block(block, data) for block, data in zip(blocks, stored)]
            if self._writer is not None:
                behind = [(block.digest, data) for block, data in zip(blocks, raw) if data is not None]
                if behind and not self._writer.submit(behind):
                    await trio.to_thread.run_sync(self._writer.write, behind, limiter=self._threads)
            return raw
        return await trio.to_thread.run_sync(self._decode_and_cache_blocking, blocks, stored, limiter=self._threads)

    def _decode_and_cache_blocking(self, blocks: list[Block], stored: list[bytes]) -> list[bytes | None]:
        raw = [decode_block(block, data) for block, data in zip(blocks, stored)]
        if self._writer is not None:
            behind = [(block.digest, data) for block, data in zip(blocks, raw) if data is not None]
            if behind and not self._writer.submit(behind):
                self._writer.write(behind)
        return raw

    async def flush(self) -> None:
        """Return once every block served so far is in the node cache (its writes behind the reads are done)."""
        if self._writer is not None:
            await trio.to_thread.run_sync(self._writer.wait_idle, limiter=self._threads)


class LayerReader:
    """Reads of one layer's files: the blocks a range touches, fetched through a :class:`BlockFetcher`, sliced.

    ``layer_id`` (the layer's chain ID, say) names the layer in messages;
    ``readahead_max`` caps the read-ahead window (compressed bytes; 0: no read-ahead,
    only the blocks a read touches are fetched).
    """

    def __init__(
        self, index: LayerIndex, fetcher: BlockFetcher, layer_id: str = "", *, readahead_max: int = READAHEAD_MAX
    ) -> None:
        if readahead_max < 0:
            raise ValueError(f"readahead_max must not be negative, not {readahead_max}")
        self.index = index
        self.fetcher = fetcher
        self.layer_id = layer_id or index.diff_id
        self.readahead_max = readahead_max
        self._readahead_min = min(READAHEAD_MIN, readahead_max)
        #: compressed bytes read ahead of a read that goes to the store (see the module's docstring)
        self.readahead_window = min(READAHEAD_INITIAL, readahead_max)
        self._next: list[int] | None = None  # block ref -> the next stored block in its pack (-1: none)
        self._read_seconds = READ_SECONDS.labels(fetcher.source_label)
        self._ordering = trio.Lock()

    def __repr__(self) -> str:
        return f"<LayerReader {self.layer_id} via {self.fetcher!r}>"

    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes of regular file ``entry`` from ``offset``; fewer only at its end, ``b""`` past it.

        A hard link reads the file it links to.  Raises FetchError (EIO) as
        :meth:`BlockFetcher.blocks` does, ValueError for a bad range or an entry
        that is not a regular file.
        """
        if entry.type is not EntryType.FILE:
            raise ValueError(f"layer {self.layer_id}: {entry.path!r} is not a regular file")
        if offset < 0 or size < 0:
            raise ValueError(f"invalid read of {entry.path!r}: offset={offset} size={size}")
        target = self.index.entries[entry.link] if entry.link is not None else entry
        end = min(offset + size, target.size)
        if end <= offset:
            return b""
        block_size = self.index.block_size
        first, last = offset // block_size, (end - 1) // block_size
        data = await self._read_blocks(target.blocks, first, last)
        return _slice(data, offset - first * block_size, end - first * block_size, block_size)

    async def read_blob(self, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes of the layer's blob from ``offset``; fewer only at its end, ``b""`` past it.

        The blob is the layer's blocks laid end to end in index order, block
        ``number`` at ``number * block_size`` and padded with zeros to ``block_size``
        (:attr:`LayerIndex.blob_size` in all): the extra device an EROFS image of the layer names
        its files' chunks in.  Blocks come through :meth:`BlockFetcher.blocks` and
        are read ahead as :meth:`read`'s are, the blob being the "file".  Raises
        FetchError (EIO) as :meth:`BlockFetcher.blocks` does, ValueError for a bad range.
        """
        if offset < 0 or size < 0:
            raise ValueError(f"invalid read of layer {self.layer_id}'s blob: offset={offset} size={size}")
        end = min(offset + size, self.index.blob_size)
        if end <= offset:
            return b""
        refs = self.index.blob_blocks(offset, end - offset)
        first, last = refs.start, refs.stop - 1
        data = await self._read_blocks(range(len(self.index.blocks)), first, last)
        start = self.index.blob_offset(first)
        return _padded_slice(data, offset - start, end - start, self.index.block_size)

    async def _read_blocks(self, sequence: Sequence[int], first: int, last: int) -> list[bytes]:
        """Blocks ``sequence[first : last + 1]`` at DEMAND, reading ahead of ``sequence[last]`` on a miss.

        ``sequence`` is what is being read, a file's blocks or the whole blob's, so
        that read-ahead follows it (:meth:`_ahead_of`) and the window adapts to
        whether the last guess landed; this is the one place both views read by.
        """
        refs = sequence[first : last + 1]
        if not self.readahead_max:
            started = time.perf_counter()
            try:
                return await self.fetcher.blocks(self.index, refs, Priority.DEMAND)
            finally:
                self._read_seconds.observe(time.perf_counter() - started)
        if self._next is None:
            await self._order_blocks()
        stats = self.fetcher.stats
        before = (stats.readahead_read, stats.blocks_fetched)
        started = time.perf_counter()
        try:
            data = await self.fetcher.blocks(
                self.index, refs, Priority.DEMAND, ahead=lambda: self._ahead_of(sequence, last)
            )
        finally:
            self._read_seconds.observe(time.perf_counter() - started)
        landed, fetched = stats.readahead_read - before[0], stats.blocks_fetched - before[1]
        if landed:  # the last guess was right: guess further
            self.readahead_window = min(self.readahead_max, self.readahead_window * 2)
        elif fetched:  # a read the last guess missed
            self.readahead_window = max(self._readahead_min, self.readahead_window // 2)
        return data

    def _ahead_of(self, file_blocks: Sequence[int], last: int) -> list[int]:
        """The blocks to read ahead of a read whose last block is ``file_blocks[last]``.

        The stored blocks that follow it in its pack (the rest of the file, then the
        next files of the tar), up to :attr:`readahead_window` compressed bytes;
        where a file's next block lies elsewhere (stored earlier by another file or
        layer), the rest of the file first.  ``file_blocks`` is a file's blocks or,
        for the blob, ``range(len(index.blocks))`` (sliced without a copy).
        """
        assert self._next is not None
        blocks, following = self.index.blocks, self._next
        budget = self.readahead_window
        out: list[int] = []
        ref = file_blocks[last]
        rest = file_blocks[last + 1 :]
        if rest and following[ref] != rest[0]:  # the file does not go on in the pack: take its blocks first
            for ref in rest:
                if budget <= 0 or len(out) >= READAHEAD_MAX_BLOCKS:
                    return out
                out.append(ref)
                budget -= blocks[ref].clen
        ref = following[ref]
        while ref >= 0 and budget > 0 and len(out) < READAHEAD_MAX_BLOCKS:
            out.append(ref)
            budget -= blocks[ref].clen
            ref = following[ref]
        return out

    async def _order_blocks(self) -> None:
        """Learn the order of the layer's blocks in their packs (once; O(blocks log blocks), in a worker thread)."""
        async with self._ordering:
            if self._next is None:
                self._next = await trio.to_thread.run_sync(_pack_successors, self.index, limiter=self.fetcher.threads)


def _slice(data: list[bytes], lo: int, hi: int, block_size: int) -> bytes:
    """Bytes ``lo`` to ``hi`` of consecutive blocks ``data`` (each ``block_size`` long but the last)."""
    if len(data) == 1:
        return data[0][lo:hi]
    # One copy: the first and last blocks through views, the middle ones whole.
    tail = hi - (len(data) - 1) * block_size
    return b"".join([memoryview(data[0])[lo:], *data[1:-1], memoryview(data[-1])[:tail]])


def _padded_slice(data: list[bytes], lo: int, hi: int, block_size: int) -> bytes:
    """Bytes ``lo`` to ``hi`` of consecutive blocks ``data``, each padded with zeros to ``block_size``."""
    pieces: list[bytes | memoryview] = []
    zeros = memoryview(_zeros(block_size))
    for number, raw in enumerate(data):
        start = lo if number == 0 else 0
        stop = hi - number * block_size if number == len(data) - 1 else block_size
        piece = memoryview(raw)[start:stop]
        pieces.append(piece)
        if len(piece) < stop - start:  # past the block's raw bytes (a file's short last block)
            pieces.append(zeros[: stop - start - len(piece)])
    return b"".join(pieces)


def _pack_successors(index: LayerIndex) -> list[int]:
    """For each block ref of ``index``, the ref of the stored block that follows it in its pack, -1 if none.

    Refs that share a place (one stored block named twice) follow each other.
    Zero blocks are stored nowhere and follow nothing.
    """
    blocks = index.blocks
    stored = sorted((ref for ref, block in enumerate(blocks) if not block.is_zero),
                    key=lambda ref: (blocks[ref].pack, blocks[ref].offset, ref))  # fmt: skip
    following = [-1] * len(blocks)
    for ref, after in zip(stored, stored[1:]):
        if blocks[after].pack == blocks[ref].pack:
            following[ref] = after
    return following
