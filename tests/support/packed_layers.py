"""Layers hand-packed into a store directory, for tests of the block fetcher and what uses it.

:func:`pack_layer` is a tiny packer over ``blockstore/objects/format.py``: the files' :data:`BLOCK`
(4 KiB, the format's smallest block size: many blocks from little data) blocks compressed
with zstd into two packs (files alternate between them, so reads cross packs), deduplicated,
zero blocks stored nowhere, hard links as the converter writes them.  It is not the converter
(:func:`tests.support.layer_store.build_store` runs that): a test here controls exactly which
block lands where.  :func:`engine_config` is a small fetch engine for such stores.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import zstandard

from bootseer.blockstore.objects.format import ZERO_PACK, Block, Entry, EntryType, LayerIndex, pack_object
from bootseer.fetch.engine import EngineConfig

KiB = 1024
BLOCK = 4 * KiB  #: the block size of :func:`pack_layer`'s layers: the format's smallest


def engine_config(**fields: Any) -> EngineConfig:
    """An :class:`EngineConfig` for small stores: 64 KiB stripes, 4 streams, 4 MiB of memory, a 30 s retry
    timeout, unless ``fields`` say otherwise."""
    fields.setdefault("stripe_size", 64 * KiB)
    fields.setdefault("streams", 4)
    fields.setdefault("memory_limit", 4 << 20)
    fields.setdefault("retry_timeout", 30.0)
    return EngineConfig(**fields)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_layer(store: Path, files: dict[str, bytes], links: dict[str, str] | None = None) -> LayerIndex:
    """Write ``files`` into ``store`` as one layer (two packs, so reads cross packs) and return its index;
    ``links`` maps a hard link's name to the file it links to."""
    entries = [Entry("", EntryType.DIR, 0o755)]
    blocks: list[Block] = []
    by_digest: dict[str, int] = {}
    packs = [bytearray(), bytearray()]
    compressor = zstandard.ZstdCompressor(level=3)
    for number, (name, data) in enumerate(files.items()):
        pack = number % 2  # files alternate between the packs
        refs = []
        for offset in range(0, len(data), BLOCK):
            raw = data[offset : offset + BLOCK]
            digest = sha(raw)
            if digest not in by_digest:
                if raw.count(0) == len(raw):
                    block = Block(digest, ZERO_PACK, 0, 0, len(raw))
                else:
                    stored = compressor.compress(raw)
                    block = Block(digest, pack, len(packs[pack]), len(stored), len(raw))
                    packs[pack] += stored
                by_digest[digest] = len(blocks)
                blocks.append(block)
            refs.append(by_digest[digest])
        entries.append(Entry(name, EntryType.FILE, 0o644, size=len(data), blocks=tuple(refs)))
    for name, target in (links or {}).items():
        number = next(n for n, e in enumerate(entries) if e.path == target)
        entries.append(Entry(name, EntryType.FILE, 0o644, size=entries[number].size, link=number))
    names = []
    for pack in packs:
        names.append(sha(bytes(pack)))
        path = store / pack_object(names[-1])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(pack))
    index = LayerIndex(diff_id="sha256:" + sha(repr(sorted(files)).encode()), block_size=BLOCK, entries=entries,
                       blocks=blocks, packs=names)  # fmt: skip
    index.validate()
    return index


def entry(index: LayerIndex, path: str) -> Entry:
    """The entry of ``path`` in ``index``."""
    return next(e for e in index.entries if e.path == path)
