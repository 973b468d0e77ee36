"""Reads of one layer, its files or its blob, over verified blocks: what the data paths call.

:class:`LayerReader` serves ``read(entry, offset, size)`` for one layer: the blocks the range
touches, got through the store's :class:`~bootseer.blockstore.node.fetcher.BlockFetcher`, sliced.
When a read has to go to the store it also reads ahead (:mod:`~bootseer.blockstore.node.readahead`):
the blocks that follow the last one it needs in the pack (the rest of the file, then the files
next to it in the layer's tar: the same Python package), up to a window of compressed bytes
that doubles while reads land on blocks read ahead and halves when they do not
(:data:`~bootseer.blockstore.node.readahead.READAHEAD_MIN` ..
:data:`~bootseer.blockstore.node.readahead.READAHEAD_MAX`).  Nothing read ahead is served or
cached before it is read: the read that wants it takes it from the engine's buffer and
verifies it like any fetched block (a tampered one is refetched, then EIO).

:meth:`LayerReader.read_blob` reads the other view of a layer, its blob: every block of the
index end to end, block ``i`` at offset ``i * block_size`` padded with zeros (the extra device
an EROFS image of the layer names its chunks in).  A range maps to block numbers by one
division; the blocks, the read-ahead (the blob being the "file": its next block is usually its
pack's next) and the window are :meth:`LayerReader.read`'s.  Read latency is
``bootseer_layer_read_seconds`` (:mod:`~bootseer.blockstore.node.metrics`), by source.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import trio

from bootseer.blockstore.node.fetcher import BlockFetcher, zeros
from bootseer.blockstore.node.metrics import READ_SECONDS
from bootseer.blockstore.node.readahead import READAHEAD_INITIAL, READAHEAD_MAX, READAHEAD_MAX_BLOCKS, READAHEAD_MIN
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import BlockSink, Entry, EntryType, LayerIndex
from bootseer.fetch.stripes import Priority


class LayerReader:
    """Reads of one layer's files: the blocks a range touches, fetched through a :class:`BlockFetcher`, sliced.

    ``layer_id`` (the layer's chain ID, say) names the layer in messages;
    ``readahead_max`` caps the read-ahead window (compressed bytes; 0: no read-ahead,
    only the blocks a read touches are fetched).
    """

    def __init__(
        self, index: LayerBlocks, fetcher: BlockFetcher, layer_id: str = "", *, readahead_max: int = READAHEAD_MAX
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
        target = entry
        if entry.link is not None:
            if not isinstance(self.index, LayerIndex):
                raise ValueError(f"layer {self.layer_id}: a hard link is read through its index (this layer has its block table)")
            target = self.index.entries[entry.link]
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

    @property
    def store(self) -> BlockFetcher:
        """What stands for this layer's store (its fetcher: one for every layer of a store)."""
        return self.fetcher

    @property
    def store_label(self) -> str:
        return self.fetcher.source_label

    @property
    def failure_memory(self) -> float:
        """Seconds this layer's store's engine keeps failing at once what failed for good (``Engine.failure_memory``)."""
        return self.fetcher.engine.failure_memory

    async def background_blocks(self, refs: Sequence[int], sink: BlockSink | None = None) -> list[bytes]:
        """Blocks ``refs`` as stored (verified), at prefetch priority and with no read-ahead: what a background
        fill writes into a local blob (not a read: nothing adapts to it).  ``sink``: as :meth:`blob_blocks`."""
        return await self.fetcher.blocks(self.index, refs, Priority.PREFETCH, sink=sink)

    async def blob_blocks(self, refs: Sequence[int], sink: BlockSink | None = None) -> list[bytes]:
        """Blocks ``refs`` (ascending numbers in the index) as stored (each ``rlen`` bytes, verified), and no
        other, read ahead of the last as a blob read is: what a local blob is filled with.  With ``sink``, those
        fetched from the store go to it as they are verified (:class:`BlockSink`: the blob itself), not to the
        node cache."""
        if not refs:
            return []
        if refs[-1] - refs[0] + 1 == len(refs):  # a run: the blob's own sequence, as read_blob reads it
            return await self._read_blocks(range(len(self.index.blocks)), refs[0], refs[-1], sink)
        return await self._read_blocks(refs, 0, len(refs) - 1, sink)  # only these, read ahead of the last

    async def _read_blocks(self, sequence: Sequence[int], first: int, last: int,
                           sink: BlockSink | None = None) -> list[bytes]:  # fmt: skip
        """Blocks ``sequence[first : last + 1]`` at DEMAND, reading ahead of ``sequence[last]`` on a miss.

        ``sequence`` is what is being read, a file's blocks or the whole blob's, so
        that read-ahead follows it (:meth:`_ahead_of`) and the window adapts to
        whether the last guess landed; this is the one place both views read by.
        """
        refs = sequence[first : last + 1]
        if not self.readahead_max:
            started = time.perf_counter()
            try:
                return await self.fetcher.blocks(self.index, refs, Priority.DEMAND, sink=sink)
            finally:
                self._read_seconds.observe(time.perf_counter() - started)
        if self._next is None:
            await self._order_blocks()
        landed_before, fetched_before = self.fetcher.read_ahead_progress()
        started = time.perf_counter()
        try:
            data = await self.fetcher.blocks(
                self.index, refs, Priority.DEMAND, ahead=lambda: self._ahead_of(sequence, last), sink=sink
            )
        finally:
            self._read_seconds.observe(time.perf_counter() - started)
        landed, fetched = self.fetcher.read_ahead_progress()
        landed, fetched = landed - landed_before, fetched - fetched_before
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
    padding = memoryview(zeros(block_size))
    for number, raw in enumerate(data):
        start = lo if number == 0 else 0
        stop = hi - number * block_size if number == len(data) - 1 else block_size
        piece = memoryview(raw)[start:stop]
        pieces.append(piece)
        if len(piece) < stop - start:  # past the block's raw bytes (a file's short last block)
            pieces.append(padding[: stop - start - len(piece)])
    return b"".join(pieces)


def _pack_successors(index: LayerBlocks) -> list[int]:
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
