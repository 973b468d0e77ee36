"""INTERIM, test-only: a direct block reader for the layer server's tests until
engineer R's blockstore/reader.py (BlockFetcher, LayerReader) and blockstore/cache.py
(BlockCache) land.  Reads each block's compressed bytes through the engine, checks
its SHA-256 after decompression, and counts blocks fetched.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import zstandard

from bootseer.blockstore.format import Entry, LayerIndex, pack_object
from bootseer.fetch.engine import FetchError


class BlockCache:
    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes


@dataclass
class FetchStats:
    blocks_fetched: int = 0
    bytes_fetched: int = 0


class BlockFetcher:
    def __init__(self, engine: Any, cache: BlockCache) -> None:
        self.engine = engine
        self.stats = FetchStats()
        self._sizes: dict[str, int] = {}

    async def blocks(self, index: LayerIndex, refs: list[int], priority: Any = None) -> list[bytes]:
        out = []
        for ref in refs:
            block = index.blocks[ref]
            if block.is_zero:
                out.append(bytes(block.rlen))
                continue
            path = pack_object(index.packs[block.pack])
            if path not in self._sizes:
                self._sizes[path] = (await self.engine.stat(path)).size
            reader = self.engine.open(path, self._sizes[path])
            try:
                compressed = await reader.read(block.offset, block.clen)
            finally:
                reader.close()
            data = zstandard.ZstdDecompressor().decompress(compressed, max_output_size=block.rlen)
            if hashlib.sha256(data).hexdigest() != block.digest:
                raise FetchError(f"block {block.digest} fails verification")
            self.stats.blocks_fetched += 1
            self.stats.bytes_fetched += block.clen
            out.append(data)
        return out


class LayerReader:
    def __init__(self, index: LayerIndex, fetcher: BlockFetcher, layer: str = "") -> None:
        self.index = index
        self.fetcher = fetcher

    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        refs = list(self.index.entries[entry.link].blocks if entry.link is not None else entry.blocks)
        bs = self.index.block_size
        first, last = offset // bs, (offset + size - 1) // bs
        data = b"".join(await self.fetcher.blocks(self.index, refs[first : last + 1]))
        start = offset - first * bs
        return data[start : start + size]
