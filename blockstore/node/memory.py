"""The fetcher's memory of blocks it served lately: verified raw blocks, least recently used out first.

The kernel reads a file in pieces smaller than a block (128 KiB for FUSE): without this
memory every piece would read, decompress and hash its whole block again.  It holds only
verified bytes, at most ``limit_bytes`` of them; a block larger than a quarter of that is
not kept (it would push out a quarter of the others for one block).
"""

from __future__ import annotations

from collections import OrderedDict


class RecentBlocks:
    """Verified raw blocks by digest, at most ``limit_bytes`` in all, least recently used dropped first (0: none)."""

    __slots__ = ("limit_bytes", "_blocks", "_bytes")

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"memory_bytes must not be negative, not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._blocks: OrderedDict[str, bytes] = OrderedDict()  # digest -> verified raw bytes, LRU first
        self._bytes = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._blocks

    def get(self, digest: str) -> bytes | None:
        """The block's bytes, now the most recently used; None if not held."""
        data = self._blocks.get(digest)
        if data is not None:
            self._blocks.move_to_end(digest)
        return data

    def peek(self, digest: str) -> bytes | None:
        """The block's bytes without marking it used (a peer's request is not this node's read)."""
        return self._blocks.get(digest)

    def remember(self, digest: str, data: bytes) -> None:
        """Keep a verified block, least recently used blocks out beyond ``limit_bytes``."""
        if len(data) > self.limit_bytes // 4:  # a block that would push out a quarter of the others is not worth it
            return
        if digest not in self._blocks:
            self._bytes += len(data)
        self._blocks[digest] = data
        self._blocks.move_to_end(digest)
        while self._bytes > self.limit_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self._bytes -= len(dropped)
