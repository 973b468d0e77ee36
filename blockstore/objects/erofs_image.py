"""An EROFS metadata image of a layer, built from its index: the kernel serves the tree, a blob the data.

:func:`write_image` turns a verified :class:`~blockstore.objects.format.LayerIndex` into the
bytes of an EROFS filesystem (``docs/FORMAT.md``, "EROFS image of a layer") that holds
the layer's whole tree in overlayfs lower-directory form -- directories, symlinks,
devices, fifos, whiteouts, opaque directories, hard links, xattrs, owners, modes, ns
mtimes, sizes -- and no file contents: every regular file is a chunk-based inode whose
chunks (one per index block, ``chunk size == index.block_size``) live in one extra
device, the layer's **blob**.  The blob is the layer's distinct blocks, block number
``n`` of ``index.blocks`` at byte ``n * block_size`` (:func:`blob_size`,
:func:`blob_blocks`), so whoever serves the blob maps a read to blocks with one
division; all-zero blocks are holes and never read.

The image is a pure function of the index (same index, same bytes): no clock, no
random UUID, no host state.  It needs no root and no extraction, so a node builds it
from the index it already verified; the index stays the one source of truth.

The converter writes the same image with one difference (``bootseer convert``, docs/FORMAT.md,
"Converter-built images"): given ``inline`` (entry number -> the file's bytes), those regular
files hold their data in the image itself, laid out as directories and symlinks are (whole
image blocks, and a tail inline after the inode when it fits in the inode's block), so a read
of a small file is served from the image and never reaches the blob.  Without ``inline``
the bytes are exactly those of the node-built image.

Written with erofs-utils 1.5 (Debian 12's fsck.erofs/dump.erofs) and the kernel's
``fs/erofs/erofs_fs.h`` in mind: 4 KiB blocks, extended (64-byte) inodes only, inline
xattrs with the short name prefixes only, no shared xattrs, no compression.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Mapping

from bootseer.blockstore.objects.format import Entry, EntryType, LayerIndex

#: The image's block size (``blkszbits`` 12): what erofs-utils 1.5 reads and every page-size kernel mounts.
BLOCK_BITS = 12
BLOCK_SIZE = 1 << BLOCK_BITS

#: Bumped whenever the bytes this module writes for an index change, so a cache keyed by
#: :func:`image_cache_name` never serves an image of an older writer.
WRITER_VERSION = 1

SUPER_OFFSET = 1024
SUPER_MAGIC = 0xE0F5E1E2
FEATURE_INCOMPAT_CHUNKED_FILE = 0x4
FEATURE_INCOMPAT_DEVICE_TABLE = 0x8

LAYOUT_FLAT_PLAIN = 0
LAYOUT_FLAT_INLINE = 2
LAYOUT_CHUNK_BASED = 4
INODE_EXTENDED = 1  #: i_format version bit: the 64-byte inode
INODE_SIZE = 64
SLOT_SIZE = 32  #: nid = byte offset / 32 (``meta_blkaddr`` 0)
CHUNK_FORMAT_INDEXES = 0x20
CHUNK_FORMAT_BITS_MASK = 0x1F
CHUNK_INDEX_SIZE = 8
NULL_ADDR = 0xFFFFFFFF
BLOB_DEVICE_ID = 1

_SUPER = struct.Struct("<IIIBBHQQIIII16s16sIHHHBBIQ24s")  # struct erofs_super_block, 128 bytes
_DEVICE_SLOT = struct.Struct("<64sII56s")  # struct erofs_deviceslot, 128 bytes
_INODE = struct.Struct("<HHHHQIIIIqII16s")  # struct erofs_inode_extended, 64 bytes
_XATTR_HEADER = struct.Struct("<IB7x")  # struct erofs_xattr_ibody_header: name filter, shared count
_XATTR_ENTRY = struct.Struct("<BBH")  # name length, name index, value size
_CHUNK_INDEX = struct.Struct("<HHI")  # advise, device id, block address
_DIRENT = struct.Struct("<QHBB")  # nid, name offset, file type, reserved

#: The device table follows the 128-byte superblock (1024 + 128 = 9 slots of 128 bytes),
#: the first inode (the root) follows its one slot: byte 1280, nid 40, as mkfs.erofs places them.
DEVT_SLOTOFF = (SUPER_OFFSET + _SUPER.size) // _DEVICE_SLOT.size
FIRST_INODE = SUPER_OFFSET + _SUPER.size + _DEVICE_SLOT.size
MAX_ROOT_NID = 0xFFFF  #: ``root_nid`` is 16 bits wide

#: EROFS's short xattr name prefixes (``EROFS_XATTR_INDEX_*``); an exact name has an empty suffix.
_XATTR_PREFIXES = (("user.", 1, False), ("system.posix_acl_access", 2, True), ("system.posix_acl_default", 3, True),
                   ("trusted.", 4, False), ("security.", 6, False))  # fmt: skip
MAX_ID = (1 << 32) - 1  #: uid/gid: 32 bits, less (uid_t)-1, which the kernel shows as the overflow id
MAX_SYMLINK_BYTES = 4095  #: PATH_MAX less its NUL: the kernel cuts a longer target (the index allows 4096)
MAX_XATTR_VALUE = 0xFFFF  #: ``e_value_size`` is 16 bits wide
MAX_XATTR_ICOUNT = 0xFFFF

_FILE_TYPES = {EntryType.FILE: 1, EntryType.DIR: 2, EntryType.CHAR: 3, EntryType.BLOCK: 4, EntryType.FIFO: 5,
               EntryType.SYMLINK: 7}  # fmt: skip
_TYPE_BITS = {EntryType.FILE: stat.S_IFREG, EntryType.DIR: stat.S_IFDIR, EntryType.SYMLINK: stat.S_IFLNK,
              EntryType.CHAR: stat.S_IFCHR, EntryType.BLOCK: stat.S_IFBLK, EntryType.FIFO: stat.S_IFIFO}  # fmt: skip


class ErofsError(ValueError):
    """A layer index holds something an EROFS image cannot say (the message names the entry and why)."""


# -- the blob: the layer's blocks at block number * block size --------------------------------------


def chunk_bits(index: LayerIndex) -> int:
    """log2 of the index's block size, which is the images' chunk size; ErofsError unless a power of two.

    The converter only writes powers of two (``convert.check_block_size``); an index is
    allowed any size in 4 KiB..64 MiB, which EROFS cannot chunk by unless it is one.
    """
    size = index.block_size
    if size < BLOCK_SIZE or size & (size - 1):
        raise ErofsError(f"block size {size} is not a power of two of at least {BLOCK_SIZE}: EROFS chunks cannot map it")
    bits = size.bit_length() - 1
    if bits - BLOCK_BITS > CHUNK_FORMAT_BITS_MASK:
        raise ErofsError(f"block size {size} is larger than an EROFS chunk can be")
    return bits


def image_cache_name(index_sha256: str) -> str:
    """The file name a node caches the image of index ``index_sha256`` (64 hex) under: index name + writer version."""
    if len(index_sha256) != 64 or any(c not in "0123456789abcdef" for c in index_sha256):
        raise ValueError(f"index name is not 64 hex digits: {index_sha256!r}")
    return f"{index_sha256}.erofs-v{WRITER_VERSION}"


# -- encoding pieces -----------------------------------------------------------------------------


def _what(number: int, entry: Entry) -> str:
    return f"entry {number} ({entry.path!r})"


def encode_xattrs(xattrs: dict[str, bytes], what: str) -> tuple[bytes, int]:
    """The inline xattr body of an inode (header + entries sorted by name) and its ``i_xattr_icount``.

    ``(b"", 0)`` for no xattrs.  ErofsError for a name outside the namespaces EROFS has
    a short prefix for (``user.``, ``trusted.``, ``security.``, the two POSIX ACLs), an
    empty name after the prefix, or a value over 65535 bytes.
    """
    if not xattrs:
        return b"", 0
    body = bytearray(_XATTR_HEADER.pack(0, 0))  # no name filter (the feature bit is off), no shared xattrs
    names = sorted(xattrs, key=os.fsencode)
    for name, same in zip(names, names[1:]):
        if os.fsencode(name) == os.fsencode(same):
            raise ErofsError(f"{what}: xattrs {name[:60]!r} and {same[:60]!r} are one name in bytes")
    for name in names:
        value = xattrs[name]
        for prefix, name_index, exact in _XATTR_PREFIXES:
            if (name == prefix) if exact else name.startswith(prefix):
                suffix = os.fsencode(name[len(prefix) :])
                break
        else:
            raise ErofsError(f"{what}: xattr {name[:60]!r} is in a namespace EROFS cannot store (user., trusted., security. only)")
        if not exact and not suffix:
            raise ErofsError(f"{what}: xattr {name!r} has an empty name")
        if len(value) > MAX_XATTR_VALUE:
            raise ErofsError(f"{what}: xattr {name[:60]!r} has a {len(value)}-byte value (EROFS holds at most {MAX_XATTR_VALUE})")
        record = _XATTR_ENTRY.pack(len(suffix), name_index, len(value)) + suffix + value
        body += record + bytes(-len(record) % 4)
    icount = 1 + (len(body) - _XATTR_HEADER.size) // 4
    if icount > MAX_XATTR_ICOUNT:
        raise ErofsError(f"{what}: {len(body)} bytes of xattrs do not fit in an inode")
    return bytes(body), icount


def encode_rdev(major: int, minor: int, what: str) -> int:
    """The kernel's ``new_encode_dev`` of a device number (12-bit major, 20-bit minor)."""
    if major >= 1 << 12 or minor >= 1 << 20:
        raise ErofsError(f"{what}: device number {major}:{minor} does not fit in 32 bits")
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def directory_blocks(names: list[tuple[bytes, int, int]]) -> Iterator[bytes]:
    """A directory's content, block by block: ``names`` are ``(name, nid, file type)`` in byte order.

    Each block holds as many entries as fit (12-byte dirents, then their names); every
    block but the last is padded to :data:`BLOCK_SIZE`, the last ends at its last name.
    """
    block: list[tuple[bytes, int, int]] = []
    used = 0
    for item in names:
        if block and used + _DIRENT.size + len(item[0]) > BLOCK_SIZE:
            yield _directory_block(block, pad=True)
            block, used = [], 0
        block.append(item)
        used += _DIRENT.size + len(item[0])
    yield _directory_block(block, pad=False)


def _directory_block(items: list[tuple[bytes, int, int]], *, pad: bool) -> bytes:
    offset = _DIRENT.size * len(items)
    dirents, names = bytearray(), bytearray()
    for name, nid, file_type in items:
        dirents += _DIRENT.pack(nid, offset + len(names), file_type, 0)
        names += name
    data = bytes(dirents + names)
    return data + bytes(BLOCK_SIZE - len(data)) if pad else data


def _directory_size(names: list[bytes]) -> int:
    """The byte size of a directory of ``names`` (sorted, ``.`` and ``..`` included), as :func:`directory_blocks` lays it out."""
    return sum(len(block) for block in directory_blocks([(name, 0, 0) for name in names]))


# -- layout ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Inode:
    """Where one inode goes and what it holds (pass one); its bytes are made in pass two."""

    nid: int
    layout: int
    size: int  #: i_size
    xattrs: bytes
    icount: int
    nlink: int
    ino: int  #: i_ino, 1-based in image order
    chunks: int = 0  #: chunk indexes after the inode (CHUNK_BASED)
    tail: int = 0  #: bytes of data inline after the inode (FLAT_INLINE)
    raw_blkaddr: int = 0  #: first block of data in the image (FLAT_*)
    data_blocks: int = 0  #: whole blocks of data in the image (FLAT_*)

    @property
    def record_size(self) -> int:
        """Bytes from the inode's start to the end of what follows it inline."""
        end = INODE_SIZE + len(self.xattrs)
        if self.layout == LAYOUT_CHUNK_BASED:
            return -(-end // CHUNK_INDEX_SIZE) * CHUNK_INDEX_SIZE + CHUNK_INDEX_SIZE * self.chunks
        return end + self.tail


class _Layout:
    """Pass one: every inode's nid, layout and data blocks, every directory's sorted names."""

    def __init__(self, index: LayerIndex, inline: Mapping[int, bytes] | None = None) -> None:
        self.index = index
        self.inline = inline or {}
        self.bits = chunk_bits(index)
        if index.blob_size // BLOCK_SIZE > NULL_ADDR - 1:
            raise ErofsError(f"the blob of {len(index.blocks)} blocks of {index.block_size} bytes is past EROFS's 32-bit block addresses")
        entries = index.entries
        number_of: dict[str, int] = {}
        self.children: dict[int, list[tuple[bytes, int]]] = {}  #: directory -> (name, entry), sorted
        self.parents = [0] * len(entries)
        links = [0] * len(entries)  # names of each inode's entry
        subdirs = [0] * len(entries)
        for number, entry in enumerate(entries):
            number_of[entry.path] = number
            owner = entry.link if entry.link is not None else number
            links[owner] += 1
            if entry.type is EntryType.DIR:
                self.children[number] = []
            if number:
                parent = self.parents[number] = number_of[entry.parent]
                self.children[parent].append((os.fsencode(entry.name), number))
                if entry.type is EntryType.DIR:
                    subdirs[parent] += 1
        for directory, names in self.children.items():
            names.sort()
            for (name, _), (same, child) in zip(names, names[1:]):
                if name == same:  # e.g. "\udcc3\udca9" and "\xe9": two index paths, one name on disk
                    raise ErofsError(f"{_what(child, entries[child])}: its name's bytes are another entry's in the same directory")
        self.inodes: dict[int, _Inode] = {}
        position = FIRST_INODE
        for number, entry in enumerate(entries):
            if entry.link is not None:
                continue
            what = _what(number, entry)
            xattrs, icount = encode_xattrs(entry.xattrs, what)
            nlink = 2 + subdirs[number] if entry.type is EntryType.DIR else links[number]
            inode = _Inode(0, LAYOUT_FLAT_PLAIN, 0, xattrs, icount, nlink, len(self.inodes) + 1)
            self._check_fields(entry, what, nlink)
            if entry.type is EntryType.FILE and entry.size and number in self.inline:
                if len(self.inline[number]) != entry.size:
                    raise ErofsError(f"{what}: {len(self.inline[number])} bytes given for a file of {entry.size}")
                inode.size = entry.size  # data in the image, placed as a directory's (FLAT_*)
            elif entry.type is EntryType.FILE and entry.size:
                inode.layout, inode.size = LAYOUT_CHUNK_BASED, entry.size
                inode.chunks = len(entry.blocks)
            elif entry.type is EntryType.DIR:
                inode.size = _directory_size(sorted([b".", b".."] + [name for name, _ in self.children[number]]))
            elif entry.type is EntryType.SYMLINK:
                inode.size = len(os.fsencode(entry.target))
                if inode.size > MAX_SYMLINK_BYTES:
                    raise ErofsError(f"{what}: a {inode.size}-byte symlink target (Linux reads at most {MAX_SYMLINK_BYTES})")
            elif entry.type is EntryType.CHAR or entry.type is EntryType.BLOCK:
                encode_rdev(*entry.rdev, what)
            position = self._place(inode, position)
            self.inodes[number] = inode
        root = self.inodes[0]
        if root.nid > MAX_ROOT_NID:
            raise ErofsError(f"the root inode's nid {root.nid} does not fit in 16 bits")
        block = -(-position // BLOCK_SIZE)  # the data area follows the last inode
        for inode in self.inodes.values():
            if inode.layout == LAYOUT_CHUNK_BASED or not inode.size:
                continue
            if inode.layout == LAYOUT_FLAT_INLINE:
                inode.data_blocks = inode.size // BLOCK_SIZE
            else:
                inode.data_blocks = -(-inode.size // BLOCK_SIZE)
            inode.raw_blkaddr = block if inode.data_blocks else NULL_ADDR
            block += inode.data_blocks
        if block > NULL_ADDR - 1:
            raise ErofsError(f"the image would have {block} blocks, past EROFS's 32-bit block addresses")
        self.blocks = block

    @staticmethod
    def _check_fields(entry: Entry, what: str, nlink: int) -> None:
        if entry.uid >= MAX_ID or entry.gid >= MAX_ID:
            raise ErofsError(f"{what}: owner {entry.uid}:{entry.gid} is not below {MAX_ID} (32 bits, and -1 is no owner to Linux)")
        if not -(1 << 63) <= entry.mtime_ns // 1_000_000_000 < 1 << 63:
            raise ErofsError(f"{what}: mtime {entry.mtime_ns} ns does not fit in 64 bits of seconds")
        if nlink >= 1 << 32:
            raise ErofsError(f"{what}: {nlink} links do not fit in 32 bits")

    @staticmethod
    def _place(inode: _Inode, position: int) -> int:
        """Give ``inode`` a nid at or after ``position`` and return where the next one may start.

        The 64-byte inode never straddles a block (EROFS reads metadata a block at a
        time); inline data must lie in one block with nothing after it crossing, else
        the inode starts a fresh block, and if even that cannot hold it the data goes
        to whole blocks (FLAT_PLAIN).
        """
        if position % BLOCK_SIZE + INODE_SIZE > BLOCK_SIZE:
            position = -(-position // BLOCK_SIZE) * BLOCK_SIZE
        if inode.size and inode.layout != LAYOUT_CHUNK_BASED:
            tail = inode.size % BLOCK_SIZE
            head = INODE_SIZE + len(inode.xattrs)
            if tail:
                fits = lambda start: (start + head) % BLOCK_SIZE + tail <= BLOCK_SIZE  # noqa: E731
                if not fits(position):
                    position = -(-position // BLOCK_SIZE) * BLOCK_SIZE
                if fits(position):
                    inode.layout, inode.tail = LAYOUT_FLAT_INLINE, tail
        inode.nid = position // SLOT_SIZE
        end = position + inode.record_size
        return -(-end // SLOT_SIZE) * SLOT_SIZE


# -- writing --------------------------------------------------------------------------------------


def _uuid(index: LayerIndex) -> bytes:
    """A volume UUID that is a function of the layer (its diff_id and block size), with RFC 4122 v4 bits."""
    raw = bytearray(hashlib.sha256(f"bootseer-erofs {index.diff_id} {index.block_size}".encode()).digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return bytes(raw)


class _Writer:
    """Sequential output in 1 MiB writes (an image is many small pieces)."""

    FLUSH_BYTES = 1 << 20

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.position = 0
        self.buffer = bytearray()

    def write(self, data: bytes) -> None:
        self.buffer += data
        self.position += len(data)
        if len(self.buffer) >= self.FLUSH_BYTES:
            self.flush()

    def pad_to(self, position: int) -> None:
        if position > self.position:
            self.write(bytes(position - self.position))

    def flush(self) -> None:
        self.out.write(self.buffer)
        self.buffer = bytearray()


def write_image(index: LayerIndex, out: BinaryIO, *, inline: Mapping[int, bytes] | None = None) -> int:
    """Write the EROFS image of ``index`` to ``out`` (sequentially, no seeks) and return its size in bytes.

    ``inline`` maps entry numbers of non-empty regular files to their bytes: those files
    hold their data in the image (the converter's images); every other file is chunk-mapped
    onto the blob.  Whoever passes ``inline`` has checked the bytes against the index.

    ``index`` is one :meth:`LayerIndex.validate` accepted -- every index is: decoding
    and the converter check it -- so it is not checked again here (that would double
    the cost).  Anything EROFS cannot hold raises ErofsError before a byte is written.
    Memory is a few small records per entry besides the index itself, whatever the
    layer's data size.
    """
    layout = _Layout(index, inline)
    entries = index.entries
    writer = _Writer(out)
    superblock = _SUPER.pack(
        SUPER_MAGIC, 0, 0, BLOCK_BITS, 0, layout.inodes[0].nid, len(layout.inodes),
        0, 0, layout.blocks, 0, 0, _uuid(index), b"",
        FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE, 0, 1, DEVT_SLOTOFF, 0, 0, 0, 0, b"",
    )  # fmt: skip
    writer.pad_to(SUPER_OFFSET)
    writer.write(superblock)
    writer.write(_DEVICE_SLOT.pack(b"", index.blob_size // BLOCK_SIZE, 0, b""))
    for number, inode in layout.inodes.items():
        writer.pad_to(inode.nid * SLOT_SIZE)
        entry = entries[number]
        writer.write(_inode_bytes(layout, entry, inode))
        writer.write(inode.xattrs)
        if inode.layout == LAYOUT_CHUNK_BASED:
            writer.pad_to(-(-writer.position // CHUNK_INDEX_SIZE) * CHUNK_INDEX_SIZE)
            writer.write(_chunk_indexes(index, entry))
        elif inode.tail:
            writer.write(_data(layout, number)[-inode.tail :])
    for number, inode in layout.inodes.items():
        if inode.data_blocks:
            writer.pad_to(inode.raw_blkaddr * BLOCK_SIZE)
            writer.write(_data(layout, number)[: inode.data_blocks * BLOCK_SIZE])
    writer.pad_to(layout.blocks * BLOCK_SIZE)
    writer.flush()
    return writer.position


def image_size(index: LayerIndex) -> int:
    """The size in bytes of :func:`write_image`'s image of ``index``, without writing it (O(entries))."""
    return _Layout(index).blocks * BLOCK_SIZE


def build_image(index: LayerIndex, *, inline: Mapping[int, bytes] | None = None) -> bytes:
    """The EROFS image of ``index`` as bytes (see :func:`write_image`)."""
    out = io.BytesIO()
    write_image(index, out, inline=inline)
    return out.getvalue()


def _inode_bytes(layout: _Layout, entry: Entry, inode: _Inode) -> bytes:
    if inode.layout == LAYOUT_CHUNK_BASED:
        union = CHUNK_FORMAT_INDEXES | (layout.bits - BLOCK_BITS)
    elif entry.type in (EntryType.CHAR, EntryType.BLOCK):
        union = encode_rdev(*entry.rdev, "")
    elif entry.type is EntryType.FIFO:
        union = 0
    else:
        union = inode.raw_blkaddr
    seconds, nanoseconds = divmod(entry.mtime_ns, 1_000_000_000)
    return _INODE.pack(
        INODE_EXTENDED | inode.layout << 1, inode.icount, _TYPE_BITS[entry.type] | entry.mode, 0, inode.size,
        union, inode.ino & 0xFFFFFFFF, entry.uid, entry.gid, seconds, nanoseconds, inode.nlink, b"",
    )  # fmt: skip


def _chunk_indexes(index: LayerIndex, entry: Entry) -> bytes:
    """One chunk index per block of the file: the blob's block address, or a hole for a zero block."""
    per_block = index.block_size // BLOCK_SIZE
    out = bytearray()
    for number in entry.blocks:
        if index.blocks[number].is_zero:
            out += _CHUNK_INDEX.pack(0, 0, NULL_ADDR)
        else:
            out += _CHUNK_INDEX.pack(0, BLOB_DEVICE_ID, number * per_block)
    return bytes(out)


def _data(layout: _Layout, number: int) -> bytes:
    """The data of a directory (its dirents), symlink (its target) or inline file (its bytes) entry."""
    entry = layout.index.entries[number]
    if entry.type is EntryType.FILE:
        return layout.inline[number]
    if entry.type is EntryType.SYMLINK:
        return os.fsencode(entry.target)
    nids = layout.inodes
    parent = layout.parents[number]
    names = [(b".", nids[number].nid, _FILE_TYPES[EntryType.DIR]), (b"..", nids[parent].nid, _FILE_TYPES[EntryType.DIR])]
    for name, child in layout.children[number]:
        owner = layout.index.entries[child].link
        names.append((name, nids[child if owner is None else owner].nid, _FILE_TYPES[layout.index.entries[child].type]))
    names.sort()
    return b"".join(directory_blocks(names))
