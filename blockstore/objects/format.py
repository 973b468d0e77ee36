"""The block store's objects: layer indexes, chain records, and where each lives in a store.

This module is the one definition of the format described in ``docs/FORMAT.md``; the
converter writes with it and every reader (the FUSE layer server, the snapshotter,
hot lists) decodes with it.  Decoding never trusts the store: an object that is
truncated, tampered with or inconsistent raises :class:`FormatError`, and a decoded
:class:`LayerIndex` has been checked entry by entry (paths, parents, block
references, sizes), so code that serves it can index into it without re-checking.

A layer index describes one layer's file tree in the form overlayfs expects of a
lower directory: a whiteout is a character device 0/0, an opaque directory has the
``trusted.overlay.opaque`` xattr set to ``y``.  A regular file's contents are a list
of blocks (``block_size`` raw bytes each, the last one shorter), each stored zstd
compressed in a pack object and named by the SHA-256 of its raw bytes; an all-zero
block (a sparse region) is stored nowhere.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import functools
import hashlib
import json
import re
import stat
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import zstandard

from bootseer.images.chains import chain_id
from bootseer.blockstore.objects.jsonstream import ArrayRule, read_document
from bootseer.blockstore.objects.signing import Signed, SigningKey, sign_document, signatures_of

FORMAT_VERSION = 1
DEFAULT_BLOCK_SIZE = 1 << 20
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 64 << 20

INDEX_MAGIC = b"BSLIDX01"
IMAGE_MAGIC = b"BSLIMG01"
DEDUP_MAGIC = b"BSDEDUP1"
_SEALED_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, payload SHA-256
MAX_CHAIN_RECORD_BYTES = 1 << 20  #: a chain record larger than this is refused unread (it is a few hundred bytes)
MAX_INDEX_BYTES = 1 << 30  #: a decompressed index larger than this is refused, whatever its record says

#: What an index may hold beyond what its chain record says the layer has (:func:`index_limits`):
#: a fixed allowance for the document's own fields, an average per entry (a path, a link target,
#: numbers, xattrs) and one per block (its row, its pack's name, the file's reference to it).
INDEX_FIXED_BYTES = 64 << 10
INDEX_ENTRY_BYTES = 16 << 10
INDEX_BLOCK_BYTES = 256
#: The longest one entry of an index may be in JSON: a PATH_MAX path and link target in
#: ``\uXXXX`` escapes and xattrs at their caps (a few 64 KiB values, base64).
MAX_ENTRY_JSON_BYTES = 1 << 20

#: Bounds an index entry must keep (Linux's NAME_MAX, XATTR_NAME_MAX, XATTR_SIZE_MAX, PATH_MAX).
MAX_NAME_BYTES = 255
MAX_XATTR_NAME_BYTES = 255
MAX_XATTR_VALUE_BYTES = 64 << 10
MAX_TARGET_BYTES = 4096

#: overlayfs's own xattrs (a root mount, without ``userxattr``, reads them on every lower layer).
OVERLAY_XATTR_PREFIX = "trusted.overlay."
#: The one of them a layer carries: ``y`` on a directory, what a ``.wh..wh..opq`` marker means.
OPAQUE_XATTR = "trusted.overlay.opaque"

#: :attr:`Block.pack` of an all-zero block, which no pack holds.
ZERO_PACK = -1

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{64}")


class FormatError(ValueError):
    """A store object is malformed, truncated, tampered with or of an unknown version."""


# -- names and digests ----------------------------------------------------------------


def check_digest(value: Any, what: str) -> str:
    """``value`` if it is a ``sha256:<64 hex>`` digest, else FormatError naming ``what``."""
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise FormatError(f"{what} is not a sha256 digest: {value!r}")
    return value


def _hex_of(digest: str) -> str:
    return check_digest(digest, "digest")[len("sha256:") :]


@dataclass(frozen=True)
class BlockPlace:
    """A block as a peer asks for it: its digest and where its compressed bytes lie in the store."""

    digest: str  #: SHA-256 of the raw bytes, 64 lowercase hex digits
    pack: str  #: the pack's name, as the layer index names it
    offset: int  #: of the compressed bytes in the pack
    clen: int  #: compressed length
    rlen: int  #: raw length: exactly what the answer's body must hold

    def check(self) -> BlockPlace:
        """Itself, or ValueError naming the bad field (a peer's request is hostile until checked)."""
        if len(self.digest) != 64 or self.digest.strip("0123456789abcdef"):
            raise ValueError("digest is not 64 lowercase hex digits")
        if len(self.pack) != 64 or self.pack.strip("0123456789abcdef"):
            raise ValueError("pack is not a pack name")
        if not 0 <= self.offset < 1 << 48:
            raise ValueError("offset out of range")
        if not 0 < self.rlen <= MAX_BLOCK_SIZE:
            raise ValueError(f"rlen is not in 1..{MAX_BLOCK_SIZE} (the format's largest block)")
        # The store bytes an owner may fetch for this request: never more than the block can take.
        if not 0 < self.clen <= max_stored_length(self.rlen):
            raise ValueError(f"clen is not in 1..{max_stored_length(self.rlen)} (the most a block of rlen bytes takes)")
        return self


def chain_object(chain: str) -> str:
    """Store path of the :class:`ChainRecord` of ``chain`` (a ChainID)."""
    return f"v{FORMAT_VERSION}/chains/{_hex_of(chain)}.json"


def index_object(sha256_hex: str) -> str:
    """Store path of a layer index, named by the SHA-256 of its encoded bytes."""
    if not _HEX.fullmatch(sha256_hex):
        raise FormatError(f"index name is not 64 hex digits: {sha256_hex!r}")
    return f"v{FORMAT_VERSION}/indexes/{sha256_hex}"


def image_object(sha256_hex: str) -> str:
    """Store path of a layer's image table (:class:`LayerImage`), named by the SHA-256 of its encoded bytes."""
    if not _HEX.fullmatch(sha256_hex):
        raise FormatError(f"image name is not 64 hex digits: {sha256_hex!r}")
    return f"v{FORMAT_VERSION}/images/{sha256_hex}"


def block_table_object(sha256_hex: str) -> str:
    """Store path of a layer's binary block table (:mod:`.block_table`), named by the SHA-256 of its encoded bytes."""
    if not _HEX.fullmatch(sha256_hex):
        raise FormatError(f"block table name is not 64 hex digits: {sha256_hex!r}")
    return f"v{FORMAT_VERSION}/blocktables/{sha256_hex}"


def pack_object(sha256_hex: str) -> str:
    """Store path of a pack of compressed blocks, named by the SHA-256 of its bytes."""
    if not _HEX.fullmatch(sha256_hex):
        raise FormatError(f"pack name is not 64 hex digits: {sha256_hex!r}")
    return f"v{FORMAT_VERSION}/packs/{sha256_hex}"


def dedup_object(sha256_hex: str) -> str:
    """Store path of a segment of the dedup table, named by the SHA-256 of its bytes."""
    if not _HEX.fullmatch(sha256_hex):
        raise FormatError(f"dedup segment name is not 64 hex digits: {sha256_hex!r}")
    return f"v{FORMAT_VERSION}/dedup/{sha256_hex}"


#: Where dedup segments live (what a converter lists to load the table).
DEDUP_PREFIX = f"v{FORMAT_VERSION}/dedup"


# -- the layer index -----------------------------------------------------------------


class EntryType(enum.Enum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    CHAR = "char"  #: a character device; 0/0 is an overlayfs whiteout
    BLOCK = "block"
    FIFO = "fifo"


_TYPE_BITS = {
    EntryType.FILE: stat.S_IFREG,
    EntryType.DIR: stat.S_IFDIR,
    EntryType.SYMLINK: stat.S_IFLNK,
    EntryType.CHAR: stat.S_IFCHR,
    EntryType.BLOCK: stat.S_IFBLK,
    EntryType.FIFO: stat.S_IFIFO,
}


@dataclass(frozen=True)
class Block:
    """One block of file contents: where its compressed bytes lie and what they must hash to."""

    digest: str  #: SHA-256 (64 hex digits) of the raw, uncompressed bytes
    pack: int  #: index into :attr:`LayerIndex.packs`; :data:`ZERO_PACK` for an all-zero block
    offset: int  #: byte offset of the compressed block in its pack
    clen: int  #: compressed length (0 for a zero block)
    rlen: int  #: raw length

    @property
    def is_zero(self) -> bool:
        return self.pack == ZERO_PACK


def max_stored_length(rlen: int) -> int:
    """The most compressed bytes a block of ``rlen`` raw bytes can take (zstd's worst case, with room to spare).

    zstd stores incompressible data in raw blocks (3 bytes of header per 128 KiB) after a
    frame header of at most 18 bytes, so a frame of ``rlen`` bytes never reaches this: a
    ``clen`` above it cannot be that block, and is refused unread (a converter's dedup
    places, a peer's request).
    """
    return rlen + (rlen >> 7) + 4096


class StoredBytes(Protocol):
    """What checking a stored block needs: :class:`Block` and :class:`StoredBlock` both have it."""

    @property
    def digest(self) -> str: ...
    @property
    def clen(self) -> int: ...
    @property
    def rlen(self) -> int: ...


class BlockSink(Protocol):
    """Where verified blocks go as a reader fetches them, instead of the node cache: a data path's own store of
    them (a local blob on ``fanotify``: ``blockstore.datapath.local_blobs.BlobFill``), their one copy on the node.

    The block fetcher (``blockstore.node.fetcher.BlockFetcher.blocks``) calls :meth:`put` in the worker thread
    that decoded and verified a batch, in the same call (one thread hop for decode, hash and write).  What it
    raises (OSError: a full disk) fails the fetch.
    """

    def put(self, blocks: Sequence[tuple[str, bytes]]) -> None:
        """Keep these verified blocks (digest, raw bytes).  Blocking; any worker thread."""
        ...


def decode_block(block: StoredBytes, data: bytes | memoryview) -> bytes | None:
    """The raw bytes of ``block`` from its stored (compressed) bytes ``data``, or None if they are not that block.

    The one check of a block's bytes, for every reader and the converter: ``data`` is
    ``clen`` bytes, decompresses to exactly ``rlen`` (never more is decompressed or
    allocated: a frame header may claim any size, so a claimed size above ``rlen`` is
    refused unread, and a frame that claims none is cut off past ``rlen``) and hashes to
    ``digest``.  Each thread reuses one decompressor (making one per block costs more
    than decoding a small block).
    """
    if len(data) != block.clen:
        return None
    decompressor = getattr(_decoders, "zstd", None)
    if decompressor is None:
        decompressor = _decoders.zstd = zstandard.ZstdDecompressor()
    try:
        claimed = zstandard.frame_content_size(data)  # -1: the frame does not say
        if claimed > block.rlen:
            return None
        raw = decompressor.decompress(data, max_output_size=block.rlen)
    except zstandard.ZstdError:
        return None
    if len(raw) != block.rlen or hashlib.sha256(raw).hexdigest() != block.digest:
        return None
    return raw


#: Each thread's zstd decompressor (:func:`decode_block`).
_decoders = threading.local()


@dataclass(frozen=True)
class Entry:
    """One entry of a layer's tree, in overlayfs's lower-directory form."""

    path: str  #: relative, ``/``-separated, no ``.``/``..``; ``""`` is the layer root; non-UTF-8 bytes as surrogates
    type: EntryType
    mode: int  #: permission bits (``0o7777``), without the type
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0  #: file size; the target's length in bytes for a symlink; 0 otherwise
    target: str = ""  #: symlink target, as stored (never resolved by BootSeer)
    rdev: tuple[int, int] = (0, 0)  #: (major, minor) of a device
    xattrs: dict[str, bytes] = field(default_factory=dict)
    blocks: tuple[int, ...] = ()  #: indexes into :attr:`LayerIndex.blocks`, in file order
    link: int | None = None  #: for a hard link: the index of the earlier FILE entry it shares an inode with

    @property
    def st_mode(self) -> int:
        return _TYPE_BITS[self.type] | self.mode

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]

    @property
    def parent(self) -> str:
        return self.path.rpartition("/")[0]


@dataclass
class LayerIndex:
    """A whole layer: its tree, its blocks and the packs that hold them."""

    diff_id: str  #: the digest of the uncompressed layer tar
    block_size: int
    entries: list[Entry]  #: the root first, every directory before its children
    blocks: list[Block]
    packs: list[str]  #: pack object SHA-256s (see :func:`pack_object`)

    @property
    def blob_size(self) -> int:
        """The size of the layer's blob: block ``n`` of :attr:`blocks` at ``n * block_size``, each padded to it.

        The blob's geometry is defined here alone (:meth:`blob_offset`, :meth:`blob_blocks`): the EROFS
        image's chunk indexes, the blob's FUSE reads and the page-cache warming all use it.
        """
        return len(self.blocks) * self.block_size

    def blob_offset(self, block_number: int) -> int:
        """Where block ``block_number`` of :attr:`blocks` starts in the blob."""
        return block_number * self.block_size

    def blob_blocks(self, offset: int, length: int) -> range:
        """The block numbers whose slots a blob read of ``length`` bytes at ``offset`` touches (clipped to the blob).

        Bytes of a slot past its block's ``rlen`` read as zeros; no file reads them (EROFS stops at ``i_size``).
        """
        return blob_range(offset, length, self.block_size, len(self.blocks))

    @functools.cached_property
    def entry_count(self) -> int:
        """Entries of the tree (:class:`~.block_table.LayerBlocks`)."""
        return len(self.entries)

    @functools.cached_property
    def file_bytes(self) -> int:
        """Raw bytes of the regular files, each inode once (what ``df`` of the FUSE tree shows)."""
        return sum(e.size for e in self.entries if e.type is EntryType.FILE and e.link is None)

    @functools.cached_property
    def small_files(self) -> int:
        """Regular files (not hard links) of one block that fits a block (:class:`~.block_table.LayerBlocks`)."""
        return sum(1 for e in self.entries if e.type is EntryType.FILE and e.link is None and len(e.blocks) == 1
                   and 0 < e.size <= self.block_size)  # fmt: skip

    def encode(self) -> bytes:
        """The index as a store object: header + zstd-compressed JSON."""
        document = {
            "format": FORMAT_VERSION,
            "diff_id": self.diff_id,
            "block_size": self.block_size,
            "packs": self.packs,
            # Blocks as arrays: [digest, pack, offset, clen, rlen].
            "blocks": [[b.digest, b.pack, b.offset, b.clen, b.rlen] for b in self.blocks],
            "entries": [_entry_to_json(e) for e in self.entries],
        }
        # ensure_ascii keeps lone surrogates (non-UTF-8 names) as \udcXX escapes.
        payload = json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        return encode_sealed(INDEX_MAGIC, FORMAT_VERSION, payload)

    @classmethod
    def decode(cls, data: bytes, *, expected_sha256: str | None = None, record: ChainRecord | None = None) -> LayerIndex:
        """Parse and check an encoded index; FormatError for anything wrong.

        ``expected_sha256`` (the name it was stored under, from a :class:`ChainRecord`)
        is checked against the whole object first.  ``record``, the chain record that
        names the index, bounds it (:func:`index_limits`): its decompressed size and how
        many entries, blocks and packs it has, refused while it is being decompressed
        and parsed, never after building it.  Without a record only
        :data:`MAX_INDEX_BYTES` bounds it.  The whole decode is CPU work proportional to
        the index: callers that serve FUSE run it in a worker thread.
        """
        if record is not None and expected_sha256 is None:
            expected_sha256 = record.index
        limits = index_limits(record)
        if len(data) > sealed_size_bound(limits.payload_bytes):
            raise FormatError(f"layer index is {len(data)} bytes, more than {limits.because} can take")
        if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise FormatError(f"layer index does not match its digest {expected_sha256}: tampered with or truncated")
        pieces = open_sealed(data, INDEX_MAGIC, FORMAT_VERSION, limits.payload_bytes, "layer index", because=limits.because)
        rules = {
            "packs": ArrayRule(limits.blocks, str, limits.because),
            "blocks": ArrayRule(limits.blocks, _block_from_json, limits.because),
            "entries": ArrayRule(limits.entries, _entry_from_json, limits.because),
        }
        try:
            document = read_document(pieces, "layer index", rules, max_value_chars=MAX_ENTRY_JSON_BYTES, error_type=FormatError)
            index = cls(
                diff_id=check_digest(document["diff_id"], "diff_id"),
                block_size=int(document["block_size"]),
                packs=_list_of(document["packs"]),
                blocks=_list_of(document["blocks"]),
                entries=_list_of(document["entries"]),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"layer index is malformed: {exc!r}") from None
        if document.get("format") != FORMAT_VERSION:
            raise FormatError(f"layer index document format {document.get('format')!r} is not {FORMAT_VERSION}")
        index.validate()
        return index

    def validate(self) -> None:
        """FormatError unless every entry, block and reference is consistent."""
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise FormatError(f"block size {self.block_size} is outside {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}")
        for pack in self.packs:
            if not _HEX.fullmatch(pack):
                raise FormatError(f"pack name is not 64 hex digits: {pack!r}")
        for number, block in enumerate(self.blocks):
            if not _HEX.fullmatch(block.digest):
                raise FormatError(f"block {number}: digest is not 64 hex digits")
            if not 0 < block.rlen <= self.block_size:
                raise FormatError(f"block {number}: raw length {block.rlen} is not in 1..{self.block_size}")
            if block.pack == ZERO_PACK:
                if block.clen or block.offset:
                    raise FormatError(f"block {number}: a zero block has no stored bytes")
            elif not 0 <= block.pack < len(self.packs) or block.offset < 0 or not 0 < block.clen <= 2 * self.block_size:
                raise FormatError(f"block {number}: bad pack reference ({block.pack}, {block.offset}, {block.clen})")
        seen: dict[str, EntryType] = {}
        for number, entry in enumerate(self.entries):
            what = f"entry {number} ({entry.path!r})"
            if number == 0:
                if entry.path != "" or entry.type is not EntryType.DIR:
                    raise FormatError("the first entry must be the root directory")
            else:
                check_relative_path(entry.path, what)
                if seen.get(entry.parent) is not EntryType.DIR:
                    raise FormatError(f"{what}: its parent is not a directory listed before it")
                if entry.path in seen:
                    raise FormatError(f"{what}: listed twice")
            seen[entry.path] = entry.type
            if entry.mode & ~0o7777 or entry.uid < 0 or entry.gid < 0 or entry.size < 0:
                raise FormatError(f"{what}: bad mode, owner or size")
            if number and len(fs_name_bytes(entry.name, what)) > MAX_NAME_BYTES:
                raise FormatError(f"{what}: a name longer than {MAX_NAME_BYTES} bytes")
            if entry.rdev[0] < 0 or entry.rdev[1] < 0 or (entry.rdev != (0, 0) and entry.type not in (EntryType.CHAR, EntryType.BLOCK)):
                raise FormatError(f"{what}: device number {entry.rdev} on a {entry.type.value}")
            for name, value in entry.xattrs.items():
                if not name or "\0" in name or len(fs_name_bytes(name, f"{what}: xattr name")) > MAX_XATTR_NAME_BYTES or len(value) > MAX_XATTR_VALUE_BYTES:
                    raise FormatError(f"{what}: xattr {name[:40]!r} has a bad name or a value over {MAX_XATTR_VALUE_BYTES} bytes")
                if not overlay_xattr_allowed(name, value, entry.type is EntryType.DIR):
                    raise FormatError(f"{what}: xattr {name[:40]!r} is overlayfs metadata no layer may carry "
                                      f"(only {OPAQUE_XATTR}=y on a directory)")  # fmt: skip
            if entry.target and (entry.type is not EntryType.SYMLINK or "\0" in entry.target or entry.size > MAX_TARGET_BYTES):
                raise FormatError(f"{what}: a link target on a {entry.type.value}, with a NUL byte or over {MAX_TARGET_BYTES} bytes")
            if entry.link is not None:
                if not (0 < entry.link < number and self.entries[entry.link].type is EntryType.FILE
                        and self.entries[entry.link].link is None and entry.type is EntryType.FILE):  # fmt: skip
                    raise FormatError(f"{what}: hard link to entry {entry.link}, which is not an earlier file")
                if entry.blocks:
                    raise FormatError(f"{what}: a hard link has no blocks of its own")
                continue
            if entry.type is EntryType.FILE:
                if any(not 0 <= b < len(self.blocks) for b in entry.blocks):
                    raise FormatError(f"{what}: block reference out of range")
                expected = -(-entry.size // self.block_size)
                if len(entry.blocks) != expected:
                    raise FormatError(f"{what}: {len(entry.blocks)} blocks for {entry.size} bytes")
                for position, b in enumerate(entry.blocks):
                    want = min(self.block_size, entry.size - position * self.block_size)
                    if self.blocks[b].rlen != want:
                        raise FormatError(f"{what}: block {position} holds {self.blocks[b].rlen} bytes, not {want}")
            elif entry.blocks:
                raise FormatError(f"{what}: only regular files have blocks")
            if entry.type is EntryType.SYMLINK and (not entry.target or entry.size != len(fs_name_bytes(entry.target, f"{what}: link target"))):
                raise FormatError(f"{what}: symlink without a target, or a size that is not the target's")

    def file_blocks(self, entry: Entry) -> Sequence[Block]:
        """The blocks of a FILE entry (of its link target for a hard link), in order."""
        if entry.link is not None:
            entry = self.entries[entry.link]
        return [self.blocks[b] for b in entry.blocks]


def blob_range(offset: int, length: int, block_size: int, blocks: int) -> range:
    """The block numbers whose slots a read of ``length`` bytes at ``offset`` of a blob of ``blocks`` blocks of
    ``block_size`` touches, clipped to the blob: the one definition (:meth:`LayerIndex.blob_blocks`)."""
    if offset < 0 or length < 0:
        raise ValueError(f"bad blob range {offset}+{length}")
    first = offset // block_size
    if not length:
        return range(first, first)
    end = min(blocks, -(-(offset + length) // block_size))
    return range(first, max(first, end))


# -- sealed objects: header + zstd payload ----------------------------------------------------


def encode_sealed(magic: bytes, version: int, payload: bytes) -> bytes:
    """A sealed store object: a 52-byte header (``magic``, ``version``, length and SHA-256
    of what follows) and ``payload`` zstd-compressed (level 10).

    The one writer of the layer index's and the hot list's bytes (docs/FORMAT.md):
    every reader checks them with :func:`decode_sealed`.
    """
    if len(magic) != 8:
        raise ValueError(f"a sealed object's magic is 8 bytes, not {magic!r}")
    compressed = zstandard.ZstdCompressor(level=10).compress(payload)
    return _SEALED_HEADER.pack(magic, version, len(compressed), hashlib.sha256(compressed).digest()) + compressed


def decode_sealed(
    data: bytes,
    magic: bytes,
    version: int,
    max_payload: int,
    what: str,
    error_type: type[FormatError] = FormatError,
) -> bytes:
    """The payload of a sealed object made by :func:`encode_sealed`, checked; ``error_type``
    (a FormatError) naming ``what`` for anything wrong.

    Checked in this order: the header is all there, the magic, the version, the
    payload's length and SHA-256 (so a truncated or tampered object is refused before
    it is decompressed), then decompression within ``max_payload`` bytes (a zstd bomb
    is refused in bounded memory).
    """
    return b"".join(open_sealed(data, magic, version, max_payload, what, error_type))


def open_sealed(
    data: bytes,
    magic: bytes,
    version: int,
    max_payload: int,
    what: str,
    error_type: type[FormatError] = FormatError,
    *,
    because: str = "",
) -> Iterator[bytes]:
    """The payload of a sealed object as it is decompressed, piece by piece: what
    :func:`decode_sealed` joins, for a reader that parses as it goes
    (:func:`bootseer.blockstore.objects.jsonstream.read_document`).

    The header, length and checksum are checked before this returns; the size bound
    while the pieces are read (``because`` says where ``max_payload`` comes from, for
    the error).
    """
    if len(data) < _SEALED_HEADER.size:
        raise error_type(f"{what} is truncated ({len(data)} bytes)")
    found_magic, found_version, length, checksum = _SEALED_HEADER.unpack_from(data)
    if found_magic != magic:
        raise error_type(f"not a BootSeer {what} (bad magic)")
    if found_version != version:
        raise error_type(f"{what} format version {found_version} is not supported (this BootSeer reads {version})")
    compressed = data[_SEALED_HEADER.size :]
    if len(compressed) != length or hashlib.sha256(compressed).digest() != checksum:
        raise error_type(f"{what} payload fails its checksum: tampered with or truncated")
    return _decompress_bounded(compressed, max_payload, what, error_type, because=because)


#: How much a bounded decompression yields at a time.
DECOMPRESS_PIECE_BYTES = 256 << 10


def _decompress_bounded(
    compressed: bytes, limit: int, what: str, error_type: type[FormatError] = FormatError, *, because: str = ""
) -> Iterator[bytes]:
    """The zstd ``compressed`` bytes decompressed, piece by piece; ``error_type`` as soon
    as more than ``limit`` bytes come out (a zstd bomb), before the piece past it is kept.

    Read in pieces: asking a stream reader for ``limit`` bytes at once would allocate them.
    """
    total = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(compressed, read_across_frames=True)
        while piece := reader.read(DECOMPRESS_PIECE_BYTES):
            total += len(piece)
            if total > limit:
                raise error_type(f"{what} is larger than {limit} bytes uncompressed{f' ({because})' if because else ''}")
            yield piece
    except zstandard.ZstdError as exc:
        raise error_type(f"{what} payload is not valid zstd: {exc}") from None


def sealed_size_bound(max_payload: int) -> int:
    """The most bytes a sealed object of at most ``max_payload`` payload bytes can take in a
    store: its header and zstd's worst case (incompressible data grows by under 1/128),
    so a reader can refuse a larger object from its size alone, before reading it."""
    return _SEALED_HEADER.size + max_payload + max_payload // 128 + (4 << 10)


# -- the layer's EROFS image, as the converter built it ----------------------------------------

#: The largest EROFS image a layer may have: its metadata and its small files' data.
MAX_IMAGE_BYTES = 1 << 30
#: A layer image table's JSON is a few rows; this bounds it whatever it claims.
MAX_IMAGE_TABLE_BYTES = 1 << 20
#: The most file data one image holds inline (the converter keeps to it: the smallest files first).
MAX_IMAGE_INLINE_BYTES = 256 << 20
#: What an entry can take in its EROFS image besides its xattrs and its small file's data: the inode,
#: its dirent and name, a symlink's target block, and the padding that keeps an inode or an inline
#: tail within one 4 KiB block.
IMAGE_ENTRY_BYTES = 9 << 10


def image_size_bound(record: ChainRecord) -> int:
    """The most bytes the EROFS image of ``record``'s layer can take: its index's payload bound (which
    holds every name, target and xattr, and more), :data:`IMAGE_ENTRY_BYTES` an entry, a chunk index
    a block and the inline data, never more than :data:`MAX_IMAGE_BYTES`.  A node holds an image's
    table to it before it fetches one block, as it holds an index to :func:`index_limits`."""
    files = max(record.files, 0)
    inline = min(max(record.bytes, 0), MAX_IMAGE_INLINE_BYTES)
    bound = index_limits(record).payload_bytes + files * IMAGE_ENTRY_BYTES + 8 * max_blocks(record) + inline
    return min(MAX_IMAGE_BYTES, bound)


@dataclass(frozen=True)
class LayerImage:
    """A layer's EROFS image as the converter stored it: the image cut into blocks, kept in packs.

    Stored at :func:`image_object` (sealed, like the index) and named by a chain record's
    ``image`` field, so the record's signature covers it, and through it every block's
    SHA-256 and the whole image's (:attr:`sha256`).  Its blocks are fetched, verified
    and shared between peers as a layer's blocks are (it has the ``diff_id``,
    ``packs`` and ``blocks`` a fetcher asks of a layer).  ``inline_max`` says which
    regular files hold their data in the image (those of at most that many bytes) and
    ``writer`` the image writer's version (docs/FORMAT.md, "Converter-built images").
    """

    diff_id: str
    index: str  #: SHA-256 hex of the layer index the image was made from (the chain record's ``index``)
    sha256: str  #: SHA-256 hex of the whole raw image
    size: int  #: the raw image's bytes
    block_size: int
    inline_max: int
    writer: int
    blocks: list[Block]
    packs: list[str]
    #: the layer's blob size (:attr:`LayerIndex.blob_size`): what the image's chunks may address, known
    #: before the index is decoded (a node checks the image meanwhile, then that the index agrees)
    blob_size: int = 0

    def encode(self) -> bytes:
        document = {
            "format": FORMAT_VERSION, "diff_id": self.diff_id, "index": self.index, "sha256": self.sha256,
            "size": self.size, "block_size": self.block_size, "inline_max": self.inline_max, "writer": self.writer,
            "blob_size": self.blob_size,
            "packs": self.packs, "blocks": [[b.digest, b.pack, b.offset, b.clen, b.rlen] for b in self.blocks],
        }  # fmt: skip
        payload = json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        return encode_sealed(IMAGE_MAGIC, FORMAT_VERSION, payload)

    @classmethod
    def decode(cls, data: bytes, *, record: ChainRecord) -> LayerImage:
        """Parse and check the image table ``record`` names; FormatError for anything wrong.

        The object must hash to ``record.image``, be made from ``record.index`` and the
        layer's diff_id, and its blocks must cut exactly ``size`` bytes, of at most
        :data:`MAX_IMAGE_BYTES`, into ``block_size`` pieces in order.
        """
        if not record.image:
            raise FormatError(f"chain record {record.chain_id[:19]} names no image")
        if len(data) > sealed_size_bound(MAX_IMAGE_TABLE_BYTES):
            raise FormatError(f"image table is {len(data)} bytes, more than one can take")
        if hashlib.sha256(data).hexdigest() != record.image:
            raise FormatError(f"image table does not match its digest {record.image}: tampered with or truncated")
        payload = decode_sealed(data, IMAGE_MAGIC, FORMAT_VERSION, MAX_IMAGE_TABLE_BYTES, "image table")
        try:
            document = json.loads(payload)
            if not isinstance(document, dict) or document.get("format") != FORMAT_VERSION:
                raise FormatError("image table is not a format-1 JSON object")
            packs = _list_of(document["packs"])
            image = cls(
                diff_id=check_digest(document["diff_id"], "diff_id"),
                index=str(document["index"]),
                sha256=str(document["sha256"]),
                size=int(document["size"]),
                block_size=int(document["block_size"]),
                inline_max=int(document["inline_max"]),
                writer=int(document["writer"]),
                blocks=[_block_from_json(row) for row in _list_of(document["blocks"])],
                packs=[str(p) for p in packs],
                blob_size=int(document["blob_size"]),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"image table is malformed: {exc!r}") from None
        image._check(record)
        return image

    def _check(self, record: ChainRecord) -> None:
        if self.index != record.index or self.diff_id != record.diff_id:
            raise FormatError("image table is of another layer (its index or diff_id is not the chain record's)")
        if not _HEX.fullmatch(self.sha256):
            raise FormatError("image table's sha256 is not 64 hex digits")
        if not 0 < self.size <= image_size_bound(record) or self.size % 4096:
            raise FormatError(f"image size {self.size} is not a whole number of 4 KiB blocks up to "
                              f"{image_size_bound(record)} (what a layer of {record.files} entries can take)")
        if self.block_size != record.block_size or not 0 <= self.inline_max <= self.block_size:
            raise FormatError("image table's block size is not the layer's, or its inline_max is out of range")
        if self.blob_size < 0 or self.blob_size % self.block_size or self.blob_size // self.block_size > max_blocks(record):
            raise FormatError(f"image table's blob size {self.blob_size} is not one the layer's blocks can make")
        if len(self.blocks) != -(-self.size // self.block_size):
            raise FormatError(f"image of {self.size} bytes in {len(self.blocks)} blocks of {self.block_size}")
        for pack in self.packs:
            if not _HEX.fullmatch(pack):
                raise FormatError("image table names a pack that is not 64 hex digits")
        for number, block in enumerate(self.blocks):
            want = min(self.block_size, self.size - number * self.block_size)
            if block.rlen != want:
                raise FormatError(f"image block {number} holds {block.rlen} bytes, not {want}")
            if not _HEX.fullmatch(block.digest):
                raise FormatError(f"image block {number}'s digest is not 64 hex digits")
            if block.is_zero:
                continue
            if not 0 <= block.pack < len(self.packs) or block.offset < 0 or not 0 < block.clen <= max_stored_length(block.rlen):
                raise FormatError(f"image block {number} has a bad place")


@dataclass(frozen=True)
class IndexLimits:
    """What a layer index may hold, from the chain record that names it (:func:`index_limits`)."""

    payload_bytes: int  #: decompressed JSON
    entries: int
    blocks: int  #: rows of ``blocks`` (and, at most as many, ``packs``)
    because: str  #: where the limits come from, for errors


def max_blocks(record: ChainRecord) -> int:
    """The most blocks a layer's index can list, from its record: every regular file's
    bytes at ``block_size``, plus one partial last block per entry."""
    return -(-max(record.bytes, 0) // max(record.block_size, MIN_BLOCK_SIZE)) + max(record.files, 0)


def index_limits(record: ChainRecord | None) -> IndexLimits:
    """The bounds of the index ``record`` names: its ``files`` entries, :func:`max_blocks`
    blocks, and a payload of :data:`INDEX_FIXED_BYTES` plus :data:`INDEX_ENTRY_BYTES` an
    entry and :data:`INDEX_BLOCK_BYTES` a block, never more than :data:`MAX_INDEX_BYTES`.
    Without a record: :data:`MAX_INDEX_BYTES` alone."""
    if record is None:
        return IndexLimits(MAX_INDEX_BYTES, MAX_INDEX_BYTES, MAX_INDEX_BYTES, "")
    blocks = max_blocks(record)
    files = max(record.files, 0)
    payload = min(MAX_INDEX_BYTES, INDEX_FIXED_BYTES + files * INDEX_ENTRY_BYTES + blocks * INDEX_BLOCK_BYTES)
    because = f"chain record {record.chain_id[:19]}: {files} files, {record.bytes} bytes"
    return IndexLimits(payload, files, blocks, because)


def overlay_xattr_allowed(name: str, value: bytes, is_dir: bool) -> bool:
    """Whether a layer's entry may carry the xattr ``name`` = ``value``: the one rule the converter
    keeps xattrs by and an index is checked against (docs/FORMAT.md).

    Of ``trusted.overlay.*`` only :data:`OPAQUE_XATTR` = ``y`` on a directory: overlayfs acts on
    the others of a lower layer (``redirect``, ``metacopy``, ``origin``, ``whiteout``, opaque ``x``,
    escaped ``overlay.*``, ...), and what points elsewhere or hides entries must not come from an
    image.  Every other xattr, ``user.overlay.*`` included, is the layer's own data (the node's
    overlayfs is mounted without ``userxattr``, so those are plain xattrs to it).
    """
    return not name.startswith(OVERLAY_XATTR_PREFIX) or (name == OPAQUE_XATTR and value == b"y" and is_dir)


def fs_name_bytes(text: str, what: str) -> bytes:
    """The bytes ``text`` (a name, path or link target of an index) stands for; FormatError naming ``what``
    unless ``text`` is what those bytes decode to (UTF-8, other bytes as ``\\udcXX`` escapes, as the
    converter reads a tar).  A lone surrogate such as ``\\ud800`` has no bytes, and ``\\udcc3\\udca9``
    would be a second spelling of ``é``: both are refused."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise FormatError(f"{what}: {text[exc.start : exc.end]!r} at {exc.start} stands for no bytes") from None
    if raw.decode("utf-8", "surrogateescape") != text:
        raise FormatError(f"{what}: escapes bytes that are valid UTF-8 (not the converter's spelling of them)")
    return raw


def check_relative_path(path: str, what: str) -> None:
    """FormatError unless ``path`` is a clean relative path (no ``/`` start, ``.``, ``..`` or empty part)."""
    if not path or path.startswith("/") or "\0" in path:
        raise FormatError(f"{what}: path is empty, absolute or has a NUL byte")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise FormatError(f"{what}: path has a {part!r} component")


def _entry_to_json(entry: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"p": entry.path, "t": entry.type.value, "m": entry.mode}
    if entry.uid:
        out["u"] = entry.uid
    if entry.gid:
        out["g"] = entry.gid
    if entry.mtime_ns:
        out["mt"] = entry.mtime_ns
    if entry.size:
        out["s"] = entry.size
    if entry.target:
        out["l"] = entry.target
    if entry.rdev != (0, 0):
        out["d"] = list(entry.rdev)
    if entry.xattrs:
        out["x"] = {k: base64.b64encode(v).decode("ascii") for k, v in sorted(entry.xattrs.items())}
    if entry.blocks:
        out["b"] = list(entry.blocks)
    if entry.link is not None:
        out["h"] = entry.link
    return out


def _list_of(value: Any) -> list[Any]:
    """An array :func:`read_document` read (a list); FormatError for another value in its place."""
    if not isinstance(value, list):
        raise FormatError(f"layer index: an array is a {type(value).__name__}")
    return value


def _block_from_json(row: Any) -> Block:
    digest, pack, offset, clen, rlen = row
    return Block(str(digest), int(pack), int(offset), int(clen), int(rlen))


def _entry_from_json(item: dict[str, Any]) -> Entry:
    if not isinstance(item, dict):
        raise FormatError(f"index entry is not an object: {item!r}")
    rdev = item.get("d", (0, 0))
    return Entry(
        path=str(item["p"]),
        type=EntryType(item["t"]),
        mode=int(item["m"]),
        uid=int(item.get("u", 0)),
        gid=int(item.get("g", 0)),
        mtime_ns=int(item.get("mt", 0)),
        size=int(item.get("s", 0)),
        target=str(item.get("l", "")),
        rdev=(int(rdev[0]), int(rdev[1])),
        xattrs={str(k): base64.b64decode(v, validate=True) for k, v in item.get("x", {}).items()},
        blocks=tuple(int(b) for b in item.get("b", ())),
        link=None if item.get("h") is None else int(item["h"]),
    )


# -- the chain record ------------------------------------------------------------------


@dataclass(frozen=True)
class ChainRecord:
    """What finds a converted layer from what containerd gives a snapshotter: its ChainID.

    Stored at :func:`chain_object` as JSON.  ``chain_id`` must equal
    ``chain_id(parent, diff_id)``, which :meth:`decode` checks, so a record cannot
    claim a layer of another chain.
    """

    chain_id: str
    parent: str  #: the ChainID below ("" for a bottom layer)
    diff_id: str  #: digest of the uncompressed layer tar
    digest: str  #: digest of the layer blob in the registry (compressed)
    media_type: str
    size: int  #: the layer blob's size in bytes
    index: str  #: SHA-256 hex of the encoded :class:`LayerIndex` (its name, see :func:`index_object`)
    block_size: int
    files: int = 0  #: entries in the index
    bytes: int = 0  #: raw bytes of the layer's regular files
    converted_at: str = ""  #: ISO 8601 time of conversion
    converter: str = ""  #: ``bootseer <version>``
    #: SHA-256 hex of the layer's :class:`LayerImage` table ("" for a conversion without one: the node builds it)
    image: str = ""
    #: SHA-256 hex of the layer's binary block table (:mod:`.block_table`; "" for a conversion without one)
    block_table: str = ""
    #: the converters' signatures (docs/trust.md): ``{"key": id, "sig": base64}`` entries
    signatures: tuple[dict[str, str], ...] = field(default=(), compare=False)
    #: what a trust policy checks: the stored document's signed message (set by :meth:`decode`)
    signed: Signed | None = field(default=None, compare=False, repr=False)

    def _document(self) -> dict[str, Any]:
        document = {"format": FORMAT_VERSION, **self.__dict__}
        del document["signed"]
        if not self.image:  # as conversions without images wrote it: their signatures still check
            del document["image"]
        if not self.block_table:  # as conversions before block tables wrote it: their signatures still check
            del document["block_table"]
        if not self.signatures:
            del document["signatures"]
        else:
            document["signatures"] = list(self.signatures)
        return document

    def encode(self) -> bytes:
        return (json.dumps(self._document(), indent=1, sort_keys=True) + "\n").encode()

    def sign(self, key: SigningKey) -> ChainRecord:
        """This record with ``key``'s signature added (one signature covers the layer: docs/trust.md)."""
        document = sign_document(self._document(), "chain", key)
        return dataclasses.replace(self, signatures=tuple(document["signatures"]), signed=None)

    def signature_check(self) -> Signed:
        """The signed message and signatures a :class:`~blockstore.objects.signing.TrustPolicy` checks."""
        return self.signed if self.signed is not None else Signed.of("chain", self._document())

    @classmethod
    def decode(cls, data: bytes, *, expected_chain_id: str | None = None) -> ChainRecord:
        try:
            document = json.loads(data)
            if not isinstance(document, dict):
                raise FormatError("chain record is not a JSON object")
            if document.get("format") != FORMAT_VERSION:
                raise FormatError(f"chain record format {document.get('format')!r} is not {FORMAT_VERSION}")
            record = cls(
                chain_id=check_digest(document["chain_id"], "chain_id"),
                parent=document["parent"] and check_digest(document["parent"], "parent"),
                diff_id=check_digest(document["diff_id"], "diff_id"),
                digest=check_digest(document["digest"], "digest"),
                media_type=str(document["media_type"]),
                size=int(document["size"]),
                index=str(document["index"]),
                block_size=int(document["block_size"]),
                files=int(document.get("files", 0)),
                bytes=int(document.get("bytes", 0)),
                converted_at=str(document.get("converted_at", "")),
                converter=str(document.get("converter", "")),
                image=str(document.get("image", "")),
                block_table=str(document.get("block_table", "")),
                signatures=tuple(signatures_of(document)),
                signed=Signed.of("chain", document),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"chain record is malformed: {exc!r}") from None
        if not _HEX.fullmatch(record.index):
            raise FormatError(f"chain record names an index that is not 64 hex digits: {record.index!r}")
        if record.image and not _HEX.fullmatch(record.image):
            raise FormatError(f"chain record names an image that is not 64 hex digits: {record.image!r}")
        if record.block_table and not _HEX.fullmatch(record.block_table):
            raise FormatError(f"chain record names a block table that is not 64 hex digits: {record.block_table!r}")
        if chain_id(record.parent, record.diff_id) != record.chain_id:
            raise FormatError(f"chain record {record.chain_id}: not the ChainID of its parent and diff_id")
        if expected_chain_id is not None and record.chain_id != expected_chain_id:
            raise FormatError(f"chain record for {record.chain_id} stored under {expected_chain_id}")
        return record


# -- the dedup table ---------------------------------------------------------------------


@dataclass(frozen=True)
class StoredBlock:
    """Where a block's compressed bytes already lie in the store (one row of the dedup table)."""

    digest: str  #: SHA-256 hex of the raw bytes
    pack: str  #: SHA-256 hex of the pack holding it
    offset: int
    clen: int
    rlen: int


@dataclass
class DedupSegment:
    """One converter run's additions to the store-wide dedup table.

    The table is the union of every segment under :data:`DEDUP_PREFIX`; a segment is
    immutable and named by the SHA-256 of its encoded bytes, so writers never contend
    for one object.  Only converters read it: a reader of a layer needs the index
    alone.  ``packs`` gives each pack's size, so a converter can check that a pack it
    is about to reference is still there whole.
    """

    packs: dict[str, int]  #: pack SHA-256 hex -> size in bytes
    blocks: list[StoredBlock]

    def encode(self) -> bytes:
        document = {
            "format": FORMAT_VERSION,
            "packs": dict(sorted(self.packs.items())),
            "blocks": [[b.digest, b.pack, b.offset, b.clen, b.rlen] for b in self.blocks],
        }
        payload = json.dumps(document, separators=(",", ":")).encode("ascii")
        return DEDUP_MAGIC + zstandard.ZstdCompressor(level=10).compress(payload)

    @classmethod
    def decode(cls, data: bytes, *, expected_sha256: str | None = None) -> DedupSegment:
        """Parse and check a segment; FormatError for anything wrong."""
        if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise FormatError(f"dedup segment does not match its name {expected_sha256}: tampered with or truncated")
        if not data.startswith(DEDUP_MAGIC):
            raise FormatError("not a BootSeer dedup segment (bad magic)")
        payload = b"".join(_decompress_bounded(data[len(DEDUP_MAGIC) :], MAX_INDEX_BYTES, "dedup segment"))
        try:
            document = json.loads(payload)
            if document.get("format") != FORMAT_VERSION:
                raise FormatError(f"dedup segment format {document.get('format')!r} is not {FORMAT_VERSION}")
            packs = {str(k): int(v) for k, v in document["packs"].items()}
            blocks = [StoredBlock(str(d), str(p), int(o), int(c), int(r)) for d, p, o, c, r in document["blocks"]]
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"dedup segment is malformed: {exc!r}") from None
        for name, size in packs.items():
            if not _HEX.fullmatch(name) or size <= 0:
                raise FormatError(f"dedup segment: bad pack {name!r} of {size} bytes")
        for block in blocks:
            if not _HEX.fullmatch(block.digest) or block.pack not in packs:
                raise FormatError(f"dedup segment: block {block.digest!r} names no listed pack")
            if block.offset < 0 or block.clen <= 0 or block.rlen <= 0 or block.offset + block.clen > packs[block.pack]:
                raise FormatError(f"dedup segment: block {block.digest} lies outside its pack")
        return cls(packs=packs, blocks=blocks)
