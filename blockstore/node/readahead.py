"""Read-ahead of a layer's reads: the window's bounds, and the ledger of blocks read ahead and not yet read.

When a read has to go to the store, the :class:`~bootseer.blockstore.node.layer_reader.LayerReader`
names the blocks that follow it in their pack (the rest of the file, then the files next to it
in the layer's tar), up to a window of compressed bytes that doubles while reads land on
blocks read ahead and halves when they do not (:data:`READAHEAD_MIN` .. :data:`READAHEAD_MAX`).
The :class:`~bootseer.blockstore.node.fetcher.BlockFetcher` queues them with
:meth:`Engine.readahead_extents <bootseer.fetch.engine.Engine.readahead_extents>` right before the
read's own fetch, so the first of them ride in its range request and the rest follow at
READAHEAD priority, behind every demand read.  Nothing read ahead is served or cached before it
is read: it waits as compressed bytes in the engine's buffer.

:class:`AheadLedger` is the fetcher's record of what it queued: to count a block read ahead when
a read takes it (``readahead_read`` in :class:`~bootseer.blockstore.node.metrics.FetcherStats`),
to skip the node cache for it (it was not there when queued), and to read further ahead when a
read reaches the middle block of the last batch (as the kernel's ``PG_readahead`` mark does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

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
AHEAD_REMEMBERED = 1 << 16


class AheadLedger:
    """Blocks read ahead and not read yet, oldest first: each one's compressed length and whether it is a mark.

    At most :data:`AHEAD_REMEMBERED` are remembered: one unread that long has surely left
    the engine's buffer.
    """

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        # digest -> (compressed length, whether reading it reads further ahead: the middle block of its batch)
        self._blocks: OrderedDict[str, tuple[int, bool]] = OrderedDict()

    def __contains__(self, digest: str) -> bool:
        return digest in self._blocks

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def marked(self, digests: Iterable[str]) -> bool:
        """Whether any of ``digests`` is the mark of its batch (reading it reads further ahead)."""
        return any(entry[1] for digest in digests if (entry := self._blocks.get(digest)) is not None)

    def queued(self, blocks: Sequence[tuple[str, int]]) -> int:
        """Remember a batch of ``(digest, compressed length)`` just read ahead, its middle one the mark; its bytes."""
        total = 0
        middle = len(blocks) // 2
        for number, (digest, length) in enumerate(blocks):
            self._blocks[digest] = (length, number == middle)
            total += length
        while len(self._blocks) > AHEAD_REMEMBERED:
            self._blocks.popitem(last=False)
        return total

    def read(self, digests: Iterable[str]) -> tuple[int, int]:
        """Forget ``digests`` now read; how many of them were read ahead, and their compressed bytes."""
        used = used_bytes = 0
        for digest in digests:
            known = self._blocks.pop(digest, None)
            if known is not None:
                used += 1
                used_bytes += known[0]
        return used, used_bytes
