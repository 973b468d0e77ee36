"""What a node's block reads count: the fetcher's counters and the Prometheus metrics of blocks and reads.

:class:`FetcherStats` is what :meth:`BlockFetcher.statistics
<bootseer.blockstore.node.fetcher.BlockFetcher.statistics>` answers (a copy: callers never
hold the live counters).  The metrics, beside the engine's ``bootseer_fetch_*``:
``bootseer_blocks_total`` (blocks served, by layer, source and outcome: memory, cached,
fetched, peer, joined, zero), ``bootseer_block_fetched_bytes_total`` (compressed bytes
fetched, by layer and source), ``bootseer_block_corrupt_total`` (blocks that failed
verification, by what followed: refetched, failed), ``bootseer_block_readahead_bytes_total``
(compressed bytes read ahead, by layer, source and outcome: queued, read; queued minus read is
what was read ahead and never read) and ``bootseer_layer_read_seconds`` (read latency, by
source).  A layer is labelled by its short diff ID (:func:`layer_label`), the same for reads
and prefetch; :class:`LayerCounters` are one layer's and source's labelled children, looked up
once rather than per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import prometheus_client

from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import LayerImage

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
    """Counters of one :class:`~bootseer.blockstore.node.fetcher.BlockFetcher`, for status output and tests."""

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
    cache_ahead_blocks: int = 0  #: blocks read ahead from the node cache into memory, with a read the cache served


class LayerCounters:
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


def layer_label(index: LayerBlocks | LayerImage) -> str:
    """A layer's name in metrics: its diff ID, shortened as ``docker images`` does."""
    return index.diff_id[: len("sha256:") + 12]
