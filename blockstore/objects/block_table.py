"""A layer's block table: what a node needs of a converter-built layer to serve its blob, in binary.

A node that mounts the converter's EROFS image of a layer (the ``erofs``, ``loop`` and ``fanotify``
data paths) has the tree in the image; what it needs of the layer besides is its blob: per block
the digest, the pack, the offset and stored length in it and the raw length (the blob offset is
the block's number times the block size, :meth:`LayerBlockTable.blob_offset`).  The JSON index
holds that and the file list, and decoding the file list is most of its cost (the benchmark's
torch layer: 23,452 entries, 0.33 s).  So the converter also stores this table
(``v1/blocktables/<sha256 hex>``, named by the chain record's ``block_table``, so the record's
signature covers it) and such a node fetches and decodes it instead of the index.  The JSON
index stays, for the per-file tree data path, older stores and tools.

Design: a sealed object (:func:`~.format.encode_sealed`: magic, version, length and SHA-256 of
the zstd payload), whose payload is a fixed header, the pack names (32 raw bytes each) and the
blocks as fixed-size columns (digests, then pack numbers, offsets, stored and raw lengths, each
a little-endian array).  Columns decode with :mod:`array` at C speed and are checked with
``min``/``max`` over whole columns; only the stored-length bound and the zero-block rule are a
Python loop, over integers.  A :class:`~.format.Block` is made when a block is first asked for
(:class:`BlockRows`), so a decode of 50,000 blocks takes 11-12 ms of CPU (docs/FORMAT.md).  Every count is bounded by what the chain record says the layer has
(:func:`~.format.max_blocks`, its ``files``), before anything is decompressed past it.

:class:`LayerBlocks` is the typed seam: what the blob data paths take of a layer, which both a
decoded :class:`~.format.LayerIndex` and a :class:`LayerBlockTable` are.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, overload

from bootseer.blockstore.objects.format import (
    FORMAT_VERSION,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    ZERO_PACK,
    Block,
    ChainRecord,
    FormatError,
    LayerIndex,
    blob_range,
    decode_sealed,
    encode_sealed,
    max_blocks,
    max_stored_length,
    sealed_size_bound,
)

TABLE_MAGIC = b"BSLBLK01"
#: The payload's header: diff_id (32 raw bytes), the JSON index's SHA-256 (32), block_size, packs,
#: blocks, small files (u32 each), entries, file bytes (u64 each).
_HEADER = struct.Struct("<32s32sIIIIQQ")
#: Bytes a block takes in the payload: digest 32, pack i32, offset u64, stored length u32, raw length u32.
ROW_BYTES = 32 + 4 + 8 + 4 + 4
PACK_BYTES = 32
#: Offsets within a pack stop here (a peer's request is held to it too: ``BlockPlace.check``).
MAX_OFFSET = 1 << 48


def block_table_bound(record: ChainRecord) -> int:
    """The largest payload the block table of ``record``'s layer can have: its header, and a pack name and a
    block's row for each of the :func:`~.format.max_blocks` blocks the layer can have."""
    return _HEADER.size + max_blocks(record) * (ROW_BYTES + PACK_BYTES)


class LayerBlocks(Protocol):
    """What the blob data paths (``fanotify``'s local blobs, the FUSE blob of ``erofs``, hot lists' blob
    accounting, the block fetcher) take of a layer: its blocks, their packs and the blob's geometry, and
    three counts of its tree.  A :class:`~.format.LayerIndex` and a :class:`LayerBlockTable` both are one."""

    @property
    def diff_id(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def packs(self) -> Sequence[str]: ...
    @property
    def blocks(self) -> Sequence[Block]: ...
    @property
    def blob_size(self) -> int: ...
    def blob_offset(self, block_number: int) -> int: ...
    def blob_blocks(self, offset: int, length: int) -> range: ...
    @property
    def entry_count(self) -> int:
        """Entries of the layer's tree (the most inodes its EROFS image may have)."""
        ...

    @property
    def file_bytes(self) -> int:
        """Raw bytes of the layer's regular files, each inode once."""
        ...

    @property
    def small_files(self) -> int:
        """Regular files (not hard links) of one block that fits a block: an upper bound of the blob
        blocks no file of a converter's image addresses (their data may be inline in the image)."""
        ...


class BlockRows(Sequence[Block]):
    """The blocks of a table as a sequence of :class:`~.format.Block`, each made when first asked for."""

    def __init__(self, digests: bytes, packs: array[int], offsets: array[int], clens: array[int], rlens: array[int]) -> None:
        self._digests = digests
        self._packs, self._offsets, self._clens, self._rlens = packs, offsets, clens, rlens
        self._made: list[Block | None] = [None] * len(rlens)

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, number: int) -> Block: ...
    @overload
    def __getitem__(self, number: slice) -> list[Block]: ...
    def __getitem__(self, number: int | slice) -> Block | list[Block]:
        if isinstance(number, slice):
            return [self[n] for n in range(*number.indices(len(self)))]
        made = self._made[number]
        if made is None:
            if number < 0:
                number += len(self._made)
            at = number * 32
            made = self._made[number] = Block(self._digests[at : at + 32].hex(), self._packs[number],
                                              self._offsets[number], self._clens[number], self._rlens[number])  # fmt: skip
        return made


@dataclass
class LayerBlockTable:
    """A layer's block table: its blocks and packs, its blob's geometry and three counts of its tree."""

    diff_id: str
    index: str  #: SHA-256 hex of the layer's JSON index (the chain record's ``index``): what it was cut from
    block_size: int
    packs: list[str]
    blocks: Sequence[Block]
    entry_count: int  #: entries of the layer's tree (the chain record's ``files``)
    file_bytes: int  #: raw bytes of its regular files, each inode once
    small_files: int  #: regular files of one block that fits a block (:class:`LayerBlocks`)

    @classmethod
    def of_index(cls, index: LayerIndex, index_name: str) -> LayerBlockTable:
        """The table of ``index`` (stored as ``index_name``): what the converter stores beside it."""
        return cls(index.diff_id, index_name, index.block_size, list(index.packs), list(index.blocks),
                   index.entry_count, index.file_bytes, index.small_files)  # fmt: skip

    @property
    def blob_size(self) -> int:
        """The layer's blob size: as :attr:`LayerIndex.blob_size`, ``len(blocks) * block_size``."""
        return len(self.blocks) * self.block_size

    def blob_offset(self, block_number: int) -> int:
        """Where block ``block_number`` starts in the blob (:meth:`LayerIndex.blob_offset`)."""
        return block_number * self.block_size

    def blob_blocks(self, offset: int, length: int) -> range:
        """The block numbers a blob read touches (:meth:`LayerIndex.blob_blocks`, the one definition)."""
        return blob_range(offset, length, self.block_size, len(self.blocks))

    def encode(self) -> bytes:
        """The table as a store object (sealed: header + zstd payload; docs/FORMAT.md)."""
        rows = self.blocks
        header = _HEADER.pack(bytes.fromhex(self.diff_id.removeprefix("sha256:")), bytes.fromhex(self.index),
                              self.block_size, len(self.packs), len(rows), self.small_files, self.entry_count,
                              self.file_bytes)  # fmt: skip
        columns = [
            b"".join(bytes.fromhex(pack) for pack in self.packs),
            b"".join(bytes.fromhex(block.digest) for block in rows),
            _little(array("i", [block.pack for block in rows])),
            _little(array("Q", [block.offset for block in rows])),
            _little(array("I", [block.clen for block in rows])),
            _little(array("I", [block.rlen for block in rows])),
        ]
        return encode_sealed(TABLE_MAGIC, FORMAT_VERSION, header + b"".join(columns))

    @classmethod
    def decode(cls, data: bytes, *, record: ChainRecord) -> LayerBlockTable:
        """Parse and check the block table ``record`` names; FormatError, naming the table and the record, for
        anything wrong.

        The object must be no larger than the record's layer can take (checked from its size, unread), hash to
        ``record.block_table``, be sealed, decompress within that bound, state counts within the record's (blocks at
        most :func:`~.format.max_blocks`, entries exactly the record's ``files``, small files at most the entries),
        be exactly as long as those counts say, be of the record's index, diff_id and block size, and every
        block's place be one a block of its raw length can have (a pack it lists, or none for a zero block).
        """
        what = f"block table of chain record {record.chain_id[:19]}"
        if not record.block_table:
            raise FormatError(f"chain record {record.chain_id[:19]} names no block table")
        most_blocks = max_blocks(record)
        bound = block_table_bound(record)
        if len(data) > sealed_size_bound(bound):
            raise FormatError(f"{what} is {len(data)} bytes, more than {most_blocks} blocks can take")
        if hashlib.sha256(data).hexdigest() != record.block_table:
            raise FormatError(f"{what} does not match its digest {record.block_table}: tampered with or truncated")
        payload = decode_sealed(data, TABLE_MAGIC, FORMAT_VERSION, bound, what)
        if len(payload) < _HEADER.size:
            raise FormatError(f"{what} is truncated: {len(payload)} bytes, no header")
        diff_id, index, block_size, packs, blocks, small, entries, file_bytes = _HEADER.unpack_from(payload)
        if f"sha256:{diff_id.hex()}" != record.diff_id or index.hex() != record.index:
            raise FormatError(f"{what} is of another layer (its index or diff_id is not the record's)")
        if block_size != record.block_size or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise FormatError(f"{what}: block size {block_size} is not the record's {record.block_size}")
        if blocks > most_blocks or packs > blocks:
            raise FormatError(f"{what} claims {blocks} blocks in {packs} packs: the record's layer has at most "
                              f"{most_blocks} blocks ({record.files} files, {record.bytes} bytes)")  # fmt: skip
        # (file_bytes, what df shows, is any u64: a layer's blocks may be named many times, dedup within the layer.)
        # Small files may outnumber the blocks (files of the same bytes share a block): they are bounded by the entries.
        if entries != record.files or small > entries:
            raise FormatError(f"{what} claims {entries} entries and {small} small files: the record says "
                              f"{record.files} entries")  # fmt: skip
        if len(payload) != _HEADER.size + packs * PACK_BYTES + blocks * ROW_BYTES:
            raise FormatError(f"{what} is {len(payload)} bytes, not what {packs} packs and {blocks} blocks take")
        view = memoryview(payload)
        at = _HEADER.size
        pack_names = [view[at + n * PACK_BYTES : at + (n + 1) * PACK_BYTES].hex() for n in range(packs)]
        at += packs * PACK_BYTES
        digests = bytes(view[at : at + blocks * 32])
        at += blocks * 32
        columns = []
        for code, size in (("i", 4), ("Q", 8), ("I", 4), ("I", 4)):
            column = array(code)
            if column.itemsize != size:  # the platform's C types: every Linux BootSeer runs on has these sizes
                raise FormatError(f"{what}: this platform's {code!r} array is not {size} bytes")
            column.frombytes(view[at : at + blocks * size])
            if sys.byteorder != "little":
                column.byteswap()
            columns.append(column)
            at += blocks * size
        pack_of, offsets, clens, rlens = columns
        _check_blocks(what, block_size, packs, pack_of, offsets, clens, rlens)
        return cls(record.diff_id, record.index, block_size, pack_names, BlockRows(digests, pack_of, offsets, clens, rlens),
                   entries, file_bytes, small)  # fmt: skip


def _check_blocks(what: str, block_size: int, packs: int, pack_of: array[int], offsets: array[int],
                  clens: array[int], rlens: array[int]) -> None:  # fmt: skip
    """FormatError unless every block's raw length is 1..``block_size`` and its place is a stored block's of that
    length (a listed pack, an offset below 2**48, a stored length up to :func:`~.format.max_stored_length`) or
    a zero block's (no pack, offset and stored length 0)."""
    if not rlens:
        return
    if min(rlens) < 1 or max(rlens) > block_size:
        raise FormatError(f"{what}: a block's raw length is not in 1..{block_size}")
    if min(pack_of) < ZERO_PACK or max(pack_of) >= packs:
        raise FormatError(f"{what}: a block names a pack it does not list")
    if max(offsets) >= MAX_OFFSET:
        raise FormatError(f"{what}: a block's offset is past 2**48")
    for number, (pack, offset, clen, rlen) in enumerate(zip(pack_of, offsets, clens, rlens)):
        if pack == ZERO_PACK:
            if clen or offset:
                raise FormatError(f"{what}: block {number} is a zero block with stored bytes")
        elif not 0 < clen <= rlen + (rlen >> 7) + 4096:  # max_stored_length, inlined: this loop is the decode's cost
            raise FormatError(f"{what}: block {number} stores {clen} bytes, more than {max_stored_length(rlen)} "
                              f"(the most a block of {rlen} bytes takes) or none")  # fmt: skip


def _little(column: array[int]) -> bytes:
    """``column``'s bytes, little endian."""
    if sys.byteorder != "little":
        column.byteswap()
    return column.tobytes()


__all__ = ["block_table_bound", "LayerBlockTable", "LayerBlocks", "BlockRows", "ROW_BYTES", "TABLE_MAGIC"]
