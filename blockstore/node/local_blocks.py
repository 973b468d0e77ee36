"""The seam through which the block fetcher finds a block already on this node outside its node cache.

On the ``fanotify`` data path a layer's blob is the node's copy of that layer's blocks (a fill
writes a verified block into the blob only, not into the node cache), so a peer asking for a block
this node holds must be served from the blobs, not sent to the store.  The fetcher knows no blob:
it asks a :class:`LocalBlocks` that the daemon hands it (the layer server's ``FanotifyBlobs``
gives one), after its memory and before the node cache and the store
(:meth:`~bootseer.blockstore.node.fetcher.BlockFetcher.block_for_peer`).

What it returns is verified by whoever implements it (SHA-256 of the raw bytes against ``digest``,
as the fetcher checks a fetched block): bytes on a local disk are never served on a map's word
alone.
"""

from __future__ import annotations

from typing import Protocol


class LocalBlocks(Protocol):
    """Blocks this node holds on disk outside the node cache, by digest."""

    def read(self, digest: str, rlen: int) -> bytes | None:
        """The ``rlen`` raw bytes of block ``digest`` if a local copy holds them and they hash to ``digest``; else
        None (none held, or the copy failed its check: the caller gets the block elsewhere).  Blocking: call it
        from a worker thread."""
        ...


__all__ = ["LocalBlocks"]
