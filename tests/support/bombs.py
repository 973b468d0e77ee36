"""Small store objects that decode into a lot: the hot-list and index bombs of issue 14.

Written independently of the code under test (the sealed header as docs/FORMAT.md
defines it, zstd streamed so the test process never holds the payload): what a
hostile store writer would put there.  Used by ``tests/blockstore/test_object_bombs.py`` and
``bench/object_bombs.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Iterator

import zstandard

from bootseer.blockstore.objects.format import ChainRecord, chain_object, index_object

from bootseer.images.chains import chain_id
from bootseer.blockstore.objects.store import FileStoreWriter

_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, payload SHA-256 (docs/FORMAT.md)
_PIECE = 1 << 20


def sealed(magic: bytes, version: int, payload: Iterator[bytes], *, level: int = 19) -> bytes:
    """A sealed object around the text ``payload`` yields, compressed as it comes."""
    compressor = zstandard.ZstdCompressor(level=level).compressobj()
    compressed = b"".join(compressor.compress(piece) for piece in payload) + compressor.flush()
    return _HEADER.pack(magic, version, len(compressed), hashlib.sha256(compressed).digest()) + compressed


def _repeated(head: bytes, row: bytes, total: int, tail: bytes) -> Iterator[bytes]:
    """``head``, then ``row`` joined by commas to about ``total`` bytes, then ``tail``, in pieces."""
    yield head
    rows = max(1, total // (len(row) + 1))
    per_piece = max(1, _PIECE // (len(row) + 1))
    written = 0
    while written < rows:
        count = min(per_piece, rows - written)
        yield (b"," if written else b"") + b",".join([row] * count)
        written += count
    yield tail


def _hotlist_head(image: str, layers: list[str], packs: list[str]) -> bytes:
    head = {"format": 1, "image": image, "profile": "", "layers": layers, "packs": packs}
    return json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"blocks":['


_HOTLIST_TAIL = b'],"recorded_at":"","node":"bomb","container":"","sealed_by":"seal","duration":0,"unattributed":0,"recorder":""}'


def hotlist_bomb(image: str, layers: list[str], payload_bytes: int = 64 << 20) -> bytes:
    """A hot list of ``image`` whose payload is ``payload_bytes`` of one tiny row repeated
    (about 6 KB stored for 64 MiB): what a store writer can make a node decode."""
    row = b'[0,"' + b"a" * 64 + b'",0,0,1,1,0]'
    return sealed(b"BSHOTL01", 1, _repeated(_hotlist_head(image, layers, ["b" * 64]), row, payload_bytes, _HOTLIST_TAIL))


def valid_hotlist(image: str, layers: list[str], rows: int) -> bytes:
    """A well-formed hot list of ``rows`` distinct blocks in time order (blocks no index holds:
    the list decodes, then does not match the image)."""

    def payload() -> Iterator[bytes]:
        yield _hotlist_head(image, layers, ["b" * 64])
        for start in range(0, rows, 10_000):
            stop = min(rows, start + 10_000)
            yield (b"," if start else b"") + ",".join(
                f'[{number % len(layers)},"{number:064x}",0,{number * 4096},4096,65536,{number}]' for number in range(start, stop)
            ).encode()
        yield _HOTLIST_TAIL

    return sealed(b"BSHOTL01", 1, payload(), level=3)


def index_bomb(diff_id: str, payload_bytes: int, *, block_size: int = 64 << 10) -> bytes:
    """A layer index of ``diff_id`` whose payload is ``payload_bytes`` of one tiny entry
    repeated (about 3 KB stored for 64 MiB)."""
    head = json.dumps({"format": 1, "diff_id": diff_id, "block_size": block_size, "packs": [], "blocks": []},
                      separators=(",", ":")).encode()[:-1] + b',"entries":[{"p":"","t":"dir","m":493},'  # fmt: skip
    return sealed(b"BSLIDX01", 1, _repeated(head, b'{"p":"a","t":"dir","m":0}', payload_bytes, b"]}"))


def store_index_bomb(store: FileStoreWriter, payload_bytes: int, *, files: int = 3, size: int = 4096) -> str:
    """Put an index bomb and a chain record naming it (a bottom layer of ``files`` entries and
    ``size`` bytes, as a store writer can claim) in ``store``; its ChainID."""
    diff_id = "sha256:" + hashlib.sha256(b"index bomb %d" % payload_bytes).hexdigest()
    data = index_bomb(diff_id, payload_bytes)
    name = hashlib.sha256(data).hexdigest()
    store.put(index_object(name), data)
    chain = chain_id("", diff_id)
    record = ChainRecord(chain_id=chain, parent="", diff_id=diff_id, digest=diff_id, media_type="application/vnd.oci.image.layer.v1.tar",
                         size=size, index=name, block_size=64 << 10, files=files, bytes=size)  # fmt: skip
    store.put(chain_object(chain), record.encode())
    return chain
