"""The forged-index attack of issue 14 item 9, done to a ``file://`` store as a writer with no key can.

:func:`forge_file` replaces a converted layer: a new index with the layer's own
``diff_id`` (so every check a node can make without the tar passes) whose file at
``path`` is the blocks of another layer's file (the attacker's, already in the store),
and a new chain record naming it, unsigned or signed by whatever key is given.
:func:`rewrite_index` stores any hand-written index for a layer the same way, and
:func:`replace_image` any bytes as a layer's EROFS image (a consistent table: every digest right).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable

import zstandard

from bootseer.blockstore.objects.format import (
    Block, ChainRecord, LayerImage, LayerIndex, chain_object, image_object, index_object, pack_object,
)  # fmt: skip
from bootseer.blockstore.objects.signing import SigningKey
from bootseer.blockstore.objects.store import FileStoreWriter


def _layer(writer: FileStoreWriter, chain: str) -> tuple[ChainRecord, LayerIndex]:
    data = writer.get(chain_object(chain))
    assert data is not None, f"{chain} is not converted"
    record = ChainRecord.decode(data, expected_chain_id=chain)
    index_data = writer.get(index_object(record.index))
    assert index_data is not None
    return record, LayerIndex.decode(index_data, expected_sha256=record.index)


def forge_file(store: Path, chain: str, path: str, donor_chain: str, donor_path: str,
               *, sign: SigningKey | None = None) -> ChainRecord:  # fmt: skip
    """Point ``path`` of layer ``chain`` at the blocks of ``donor_path`` of layer ``donor_chain``; the new record."""
    writer = FileStoreWriter(store)
    _, donor = _layer(writer, donor_chain)
    payload = next(e for e in donor.entries if e.path == donor_path)

    def repoint(index: LayerIndex) -> LayerIndex:
        packs = list(index.packs) + [p for p in donor.packs if p not in index.packs]
        blocks = list(index.blocks)
        numbers = []
        for number in payload.blocks:
            block = donor.blocks[number]
            pack = block.pack if block.is_zero else packs.index(donor.packs[block.pack])
            blocks.append(dataclasses.replace(block, pack=pack))
            numbers.append(len(blocks) - 1)
        entries = [dataclasses.replace(e, blocks=tuple(numbers), size=payload.size) if e.path == path else e
                   for e in index.entries]  # fmt: skip
        assert any(e.path == path for e in entries), f"{chain} has no {path}"
        forged = LayerIndex(diff_id=index.diff_id, block_size=index.block_size, entries=entries, blocks=blocks, packs=packs)
        forged.validate()  # well formed: only a signature tells it from the genuine one
        return forged

    return rewrite_index(store, chain, repoint, sign=sign)


def rewrite_index(store: Path, chain: str, change: Callable[[LayerIndex], LayerIndex],
                  *, sign: SigningKey | None = None) -> ChainRecord:  # fmt: skip
    """Replace layer ``chain``'s index with ``change(index)``, stored as it is (not validated: a hand-written
    index), and its chain record with one naming it and no EROFS image, unsigned or signed by ``sign``; the new record."""
    writer = FileStoreWriter(store)
    record, index = _layer(writer, chain)
    data = change(index).encode()
    name = hashlib.sha256(data).hexdigest()
    writer.put(index_object(name), data)
    # No image: the node builds one from this index (an image naming the old index would be refused).
    new = dataclasses.replace(record, index=name, image="", signatures=(), signed=None)
    if sign is not None:
        new = new.sign(sign)
    writer.put(chain_object(chain), new.encode())
    return new


def replace_image(store: Path, chain: str, image: bytes, *, sign: SigningKey | None = None,
                  sha256: str | None = None, blob_size: int | None = None) -> ChainRecord:  # fmt: skip
    """Make ``image`` layer ``chain``'s EROFS image: its blocks in a new pack, a table naming them (and
    ``sha256`` as the whole image's, ``blob_size`` as the layer's blob size: by default the right ones),
    a chain record naming the table, unsigned or signed by ``sign``.  What a writer with no converter
    key can do; the new record."""
    writer = FileStoreWriter(store)
    record, index = _layer(writer, chain)
    size = index.block_size
    pack, blocks = bytearray(), []
    for start in range(0, len(image), size):
        piece = image[start : start + size]
        compressed = zstandard.ZstdCompressor().compress(piece)
        blocks.append(Block(hashlib.sha256(piece).hexdigest(), 0, len(pack), len(compressed), len(piece)))
        pack += compressed
    pack_name = hashlib.sha256(pack).hexdigest()
    writer.put(pack_object(pack_name), bytes(pack))
    table = LayerImage(diff_id=record.diff_id, index=record.index, sha256=sha256 or hashlib.sha256(image).hexdigest(),
                       size=len(image), block_size=size, inline_max=4096, writer=1, blocks=blocks, packs=[pack_name],
                       blob_size=index.blob_size if blob_size is None else blob_size)  # fmt: skip
    data = table.encode()
    name = hashlib.sha256(data).hexdigest()
    writer.put(image_object(name), data)
    new = dataclasses.replace(record, image=name, signatures=(), signed=None)
    if sign is not None:
        new = new.sign(sign)
    writer.put(chain_object(chain), new.encode())
    return new
