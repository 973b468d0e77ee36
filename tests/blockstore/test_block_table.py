"""The binary block table (blockstore/objects/block_table.py): a round trip keeps every block and the blob's
geometry, and every malformed or hostile table is refused with a FormatError naming it, bounded by its chain
record before it is decompressed past what the record's layer can have."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time

import pytest

from bootseer.blockstore.objects.block_table import ROW_BYTES, TABLE_MAGIC, LayerBlockTable
from bootseer.blockstore.objects.format import (
    Block, ChainRecord, Entry, EntryType, FormatError, LayerIndex, encode_sealed, max_blocks, open_sealed,
)  # fmt: skip
from bootseer.images.chains import chain_id

BLOCK = 64 << 10
DIFF_ID = "sha256:" + "d1" * 32
INDEX = "1f" * 32
HEADER = struct.Struct("<32s32sIIIIQQ")


def digest(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def layer(blocks: int = 6) -> LayerIndex:
    """An index of a root, one small file, one of ``blocks - 2`` blocks (a zero one among them) and a hard link."""
    rows = [Block(digest(0), 0, 0, 100, 3000)]
    rows += [Block(digest(n), -1, 0, 0, BLOCK) if n == 2 else Block(digest(n), n % 2, n * 5000, 4000, BLOCK)
             for n in range(1, blocks - 1)]  # fmt: skip
    rows.append(Block(digest(blocks), 1, 0, 70, 10))
    entries = [
        Entry("", EntryType.DIR, 0o755),
        Entry("small", EntryType.FILE, 0o644, size=3000, blocks=(0,)),
        Entry("big", EntryType.FILE, 0o644, size=(blocks - 2) * BLOCK + 10, blocks=tuple(range(1, blocks))),
        Entry("link", EntryType.FILE, 0o644, link=1),
    ]
    index = LayerIndex(DIFF_ID, BLOCK, entries, rows, ["a0" * 32, "b0" * 32])
    index.validate()
    return index


def record_of(data: bytes, index: LayerIndex) -> ChainRecord:
    """The chain record naming ``data`` as the block table of ``index``'s layer (files and bytes the index's)."""
    return ChainRecord(chain_id=chain_id("", DIFF_ID), parent="", diff_id=DIFF_ID, digest="sha256:" + "e2" * 32,
                       media_type="application/vnd.oci.image.layer.v1.tar", size=1, index=INDEX, block_size=BLOCK,
                       files=len(index.entries), bytes=index.file_bytes, block_table=hashlib.sha256(data).hexdigest())  # fmt: skip


def payload_of(index: LayerIndex) -> bytearray:
    data = LayerBlockTable.of_index(index, INDEX).encode()
    return bytearray(b"".join(open_sealed(data, TABLE_MAGIC, 1, 1 << 30, "test")))


def decode(payload: bytes, index: LayerIndex, **record: int) -> LayerBlockTable:
    data = encode_sealed(TABLE_MAGIC, 1, bytes(payload))
    return LayerBlockTable.decode(data, record=dataclasses.replace(record_of(data, index), **record))


def with_header(of: LayerIndex, **fields: int | bytes) -> bytearray:
    payload = payload_of(of)
    names = ["diff_id", "index", "block_size", "packs", "blocks", "small", "entries", "file_bytes"]
    values = dict(zip(names, HEADER.unpack_from(payload)))
    values.update(fields)
    HEADER.pack_into(payload, 0, *(values[name] for name in names))
    return payload


def with_column(index: LayerIndex, column: str, number: int, value: int) -> bytearray:
    """The payload of ``index``'s table with block ``number``'s ``column`` (pack, offset, clen, rlen) set to ``value``."""
    payload = payload_of(index)
    blocks = len(index.blocks)
    at = HEADER.size + 32 * len(index.packs) + 32 * blocks
    for name, code, size in (("pack", "<i", 4), ("offset", "<Q", 8), ("clen", "<I", 4), ("rlen", "<I", 4)):
        if name == column:
            struct.pack_into(code, payload, at + number * size, value)
            return payload
        at += blocks * size
    raise AssertionError(column)


def test_a_round_trip_keeps_every_block_pack_count_and_the_blobs_geometry():
    index = layer()
    data = LayerBlockTable.of_index(index, INDEX).encode()
    table = LayerBlockTable.decode(data, record=record_of(data, index))
    assert list(table.blocks) == index.blocks and table.blocks[-1] == index.blocks[-1]
    assert table.blocks[1:3] == index.blocks[1:3]
    assert (table.packs, table.block_size, table.diff_id, table.index) == (index.packs, BLOCK, DIFF_ID, INDEX)
    assert (table.entry_count, table.file_bytes, table.small_files) == (4, index.file_bytes, 1)
    assert table.blob_size == index.blob_size and table.blob_offset(3) == index.blob_offset(3)
    assert table.blob_blocks(BLOCK - 1, 2) == index.blob_blocks(BLOCK - 1, 2) == range(0, 2)
    assert table.blob_blocks(10 * BLOCK, 5) == index.blob_blocks(10 * BLOCK, 5)
    assert len(data) < 52 + ROW_BYTES * len(index.blocks) + 32 * len(index.packs) + 200


def test_small_files_that_share_one_block_outnumber_the_blocks_and_still_decode():
    """Files of the same bytes share a block (dedup within the layer): a table may count more small files than it
    has blocks (a deps capture's identical ``__init__.py`` files did), bounded by the entries alone."""
    rows = [Block(digest(0), 0, 0, 100, 3000)]
    entries = [Entry("", EntryType.DIR, 0o755)] + [
        Entry(f"init{n}.py", EntryType.FILE, 0o644, size=3000, blocks=(0,)) for n in range(3)]
    index = LayerIndex(DIFF_ID, BLOCK, entries, rows, ["a0" * 32])
    index.validate()
    data = LayerBlockTable.of_index(index, INDEX).encode()
    table = LayerBlockTable.decode(data, record=record_of(data, index))
    assert (table.small_files, len(table.blocks), table.entry_count) == (3, 1, 4)


def test_fifty_thousand_blocks_decode_in_milliseconds():
    rows = [Block(hashlib.sha256(n.to_bytes(4, "little")).hexdigest(), n % 3, n * 4000, 3900, BLOCK) for n in range(50_000)]
    index = LayerIndex(DIFF_ID, BLOCK, [Entry("", EntryType.DIR, 0o755), Entry("f", EntryType.FILE, 0o644,
                       size=50_000 * BLOCK, blocks=tuple(range(50_000)))], rows, ["a0" * 32, "b0" * 32, "c0" * 32])  # fmt: skip
    data = LayerBlockTable.of_index(index, INDEX).encode()
    record = record_of(data, index)
    started = time.process_time()
    table = LayerBlockTable.decode(data, record=record)
    spent = time.process_time() - started
    assert spent < 0.25, f"{spent:.3f} CPU s"  # 11-12 ms measured here; a JSON index of these blocks alone: 0.16 s
    assert table.blocks[49_999] == rows[49_999] and len(table.blocks) == 50_000


def test_the_object_is_checked_against_its_record_before_it_is_opened():
    index = layer()
    data = LayerBlockTable.of_index(index, INDEX).encode()
    record = record_of(data, index)
    with pytest.raises(FormatError, match="names no block table"):
        LayerBlockTable.decode(data, record=dataclasses.replace(record, block_table=""))
    with pytest.raises(FormatError, match="does not match its digest"):
        LayerBlockTable.decode(data[:-1] + bytes([data[-1] ^ 1]), record=record)
    with pytest.raises(FormatError, match="more than .* blocks can take"):  # from its size alone, unhashed
        LayerBlockTable.decode(data + bytes(1 << 20), record=record)
    wrong_magic = b"BSLIDX01" + data[8:]
    with pytest.raises(FormatError, match="bad magic"):
        LayerBlockTable.decode(wrong_magic, record=record_of(wrong_magic, index))
    later = encode_sealed(TABLE_MAGIC, 2, b"x")
    with pytest.raises(FormatError, match="version 2"):
        LayerBlockTable.decode(later, record=record_of(later, index))


def test_a_zstd_bomb_is_refused_at_the_records_bound():
    index = layer()
    with pytest.raises(FormatError, match="larger than"):
        decode(bytes(64 << 20), index)  # 64 MiB of zeros compress to a few KB


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda i: payload_of(i)[:50], "truncated"),
        (lambda i: payload_of(i)[:-1], "not what .* take"),
        (lambda i: payload_of(i) + b"\0", "not what .* take"),
        (lambda i: with_header(i, diff_id=b"\1" * 32), "another layer"),
        (lambda i: with_header(i, index=b"\1" * 32), "another layer"),
        (lambda i: with_header(i, block_size=BLOCK * 2), "block size"),
        (lambda i: with_header(i, blocks=10_000), "at most .* blocks"),
        (lambda i: with_header(i, packs=7), "blocks in 7 packs"),
        (lambda i: with_header(i, entries=5), "claims 5 entries"),
        (lambda i: with_header(i, small=5), "small files"),
        (lambda i: with_column(i, "rlen", 3, 0), "raw length"),
        (lambda i: with_column(i, "rlen", 3, BLOCK + 1), "raw length"),
        (lambda i: with_column(i, "pack", 1, 2), "pack it does not list"),
        (lambda i: with_column(i, "pack", 1, -2), "pack it does not list"),
        (lambda i: with_column(i, "offset", 1, 1 << 48), "past 2\\*\\*48"),
        (lambda i: with_column(i, "clen", 2, 5), "zero block with stored bytes"),
        (lambda i: with_column(i, "offset", 2, 5), "zero block with stored bytes"),
        (lambda i: with_column(i, "clen", 1, 0), "stores 0 bytes"),
        (lambda i: with_column(i, "clen", 1, BLOCK + (BLOCK >> 7) + 4097), "more than"),
    ],
)
def test_every_malformed_table_is_refused_naming_it(change, error):
    index = layer()
    with pytest.raises(FormatError, match=error) as refused:
        decode(change(index), index)
    assert "block table of chain record sha256:" in str(refused.value)


def test_a_record_bounds_the_blocks_whatever_the_table_says():
    """A record of a tiny layer cannot name a table of many blocks: refused from the object's size, or its header."""
    index = layer(blocks=200)
    small = dataclasses.replace(index, entries=index.entries[:2], blocks=index.blocks[:1])
    data = LayerBlockTable.of_index(index, INDEX).encode()
    record = dataclasses.replace(record_of(data, small), bytes=3000)
    assert max_blocks(record) < 200
    with pytest.raises(FormatError, match="more than .* blocks can take|at most"):
        LayerBlockTable.decode(data, record=dataclasses.replace(record, files=4))


def test_a_chain_record_names_its_table_only_when_it_has_one_and_only_as_64_hex_digits():
    index = layer()
    data = LayerBlockTable.of_index(index, INDEX).encode()
    record = record_of(data, index)
    assert ChainRecord.decode(record.encode()).block_table == record.block_table
    older = dataclasses.replace(record, block_table="")
    assert b"block_table" not in older.encode()  # as records before block tables were written: their signatures check
    assert ChainRecord.decode(older.encode()).block_table == ""
    with pytest.raises(FormatError, match="block table that is not 64 hex digits"):
        ChainRecord.decode(dataclasses.replace(record, block_table="../x").encode())
