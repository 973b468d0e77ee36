"""Converted layers in a ``file://`` store for the layer server's tests, and a tar extraction to compare with.

:func:`build_store` turns :class:`~tests.support.layers.Layer` specs into what the
converter writes: one pack per layer (zstd blocks, deduplicated within the layer,
zero blocks stored nowhere), the index and the chain record, at the paths
:mod:`blockstore.format` names.  It parses the tars with the converter's own tar
reader (:func:`blockstore.tarlayer.read_layer`), so the trees are the converter's.
:func:`extract_layer` runs GNU ``tar -x`` as root on the same tar, keeping owners,
modes, ns mtimes, xattrs and device nodes: the reference the FUSE view must equal.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
from dataclasses import dataclass
from pathlib import Path

import zstandard

from bootseer.blockstore.format import (
    ZERO_PACK,
    Block,
    ChainRecord,
    LayerIndex,
    chain_id,
    chain_object,
    index_object,
    pack_object,
)
from tests.support.layers import Layer, layer_tar


@dataclass
class BuiltLayer:
    chain_id: str
    diff_id: str
    tar: bytes
    index: LayerIndex
    record: ChainRecord
    pack: str  #: the layer's pack object path in the store ("" if it has no stored block)


class _PackSink:
    """The converter's BlockSink, in miniature: one pack, blocks deduplicated by digest."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.pack = io.BytesIO()
        self._by_digest: dict[str, int] = {}
        self._compressor = zstandard.ZstdCompressor(level=3)

    def add(self, data: bytes) -> int:
        digest = hashlib.sha256(data).hexdigest()
        if digest in self._by_digest:
            return self._by_digest[digest]
        if data.count(0) == len(data):
            block = Block(digest, ZERO_PACK, 0, 0, len(data))
        else:
            compressed = self._compressor.compress(data)
            block = Block(digest, 0, self.pack.tell(), len(compressed), len(data))
            self.pack.write(compressed)
        self.blocks.append(block)
        self._by_digest[digest] = len(self.blocks) - 1
        return len(self.blocks) - 1


def _put(store: Path, name: str, data: bytes) -> None:
    path = store / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def build_store(store: Path, layers: list[Layer], *, block_size: int = 64 << 10) -> list[BuiltLayer]:
    """Convert ``layers`` (bottom first) into the store directory ``store``."""
    from bootseer.blockstore.tarlayer import read_layer

    built: list[BuiltLayer] = []
    parent = ""
    for layer in layers:
        tar = layer_tar(layer)
        sink = _PackSink()
        parsed = read_layer(io.BytesIO(tar), sink, block_size=block_size)
        packs: list[str] = []
        pack_path = ""
        if sink.pack.tell():
            pack_hex = hashlib.sha256(sink.pack.getvalue()).hexdigest()
            packs = [pack_hex]
            pack_path = pack_object(pack_hex)
            _put(store, pack_path, sink.pack.getvalue())
        index = LayerIndex(parsed.diff_id, block_size, parsed.entries, sink.blocks, packs)
        encoded = index.encode()
        index_hex = hashlib.sha256(encoded).hexdigest()
        _put(store, index_object(index_hex), encoded)
        chain = chain_id(parent, parsed.diff_id)
        record = ChainRecord(
            chain_id=chain, parent=parent, diff_id=parsed.diff_id, digest=parsed.diff_id,
            media_type="application/vnd.oci.image.layer.v1.tar", size=len(tar), index=index_hex,
            block_size=block_size, files=len(index.entries),
        )  # fmt: skip
        _put(store, chain_object(chain), record.encode())
        built.append(BuiltLayer(chain, parsed.diff_id, tar, LayerIndex.decode(encoded), record, pack_path))
        parent = chain
    return built


def extract_layer(tar: bytes, dest: Path) -> None:
    """``tar -x`` as root, keeping everything a layer carries (the reference tree)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["tar", "-x", "-C", str(dest), "--numeric-owner", "--same-owner", "--same-permissions",
         "--xattrs", "--xattrs-include=*"],
        input=tar, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
