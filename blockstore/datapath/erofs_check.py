"""A bounded check of a layer's EROFS image before the kernel mounts it: what our writer writes, or nothing.

An EROFS image is parsed by the kernel, so an image from the store is hostile input to
the kernel: a converter or a store that lies could hand a node an image whose loops,
overlapping metadata, oversized names or out-of-range addresses reach code in the
kernel that was written for images of ``mkfs.erofs``.  A node mounts a converter-built
image whose chain record no trusted converter signed only once :func:`check_image`
accepted it against the layer's verified index (its blob size and chunk size, at most
as many inodes as entries); docs/FORMAT.md, "Checking an image before the kernel sees
it".

**Strict.**  The check accepts exactly what
:func:`bootseer.blockstore.objects.erofs_image.write_image` can produce, node-built or
converter-built (small regular files with their data in the image, laid out as
directories and symlinks are: whole blocks at ``raw_blkaddr``, and a tail inline after
the inode when it fits in the inode's block), and refuses every other image, valid EROFS
or not: compact inodes, shared xattrs, compression, a second device, a socket, a
superblock field the writer leaves zero that is not.  An image the writer cannot write
was not made by our converter, and the less of EROFS an image may use, the less of the
kernel's EROFS code it reaches.

**Bounded.**  One pass over the tree from the root, with an explicit stack (no
recursion): every directory is read once (one reached twice is a loop or a directory
hard link: refused), every inode parsed once (hard links reuse it), and every byte of
the image belongs to at most one thing (the superblock, one inode's record -- inode,
xattrs, chunk indexes or inline tail -- or one inode's data blocks), which a bitmap of
32-byte slots enforces.  So the work is linear in the image's size whatever it claims,
and every read is range-checked before it is made: a malformed image raises
:class:`ImageRefused` and never another exception.  Parsing is ``struct`` over a
memoryview, a few calls per inode and per directory entry (no loop over bytes).

:func:`read_tree` is the same walk, yielding each path of the tree as a
:class:`TreeEntry` (tests compare it with the index the image was written from).
"""

from __future__ import annotations

import gc
import os
import stat
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from bootseer.blockstore.objects.erofs_image import (
    BLOB_DEVICE_ID,
    BLOCK_BITS,
    BLOCK_SIZE,
    CHUNK_FORMAT_INDEXES,
    CHUNK_INDEX_SIZE,
    DEVT_SLOTOFF,
    FEATURE_INCOMPAT_CHUNKED_FILE,
    FEATURE_INCOMPAT_DEVICE_TABLE,
    FIRST_INODE,
    INODE_EXTENDED,
    INODE_SIZE,
    LAYOUT_CHUNK_BASED,
    LAYOUT_FLAT_INLINE,
    LAYOUT_FLAT_PLAIN,
    MAX_ID,
    MAX_SYMLINK_BYTES,
    NULL_ADDR,
    SLOT_SIZE,
    SUPER_MAGIC,
    SUPER_OFFSET,
)
from bootseer.blockstore.objects.format import MAX_NAME_BYTES, MAX_XATTR_NAME_BYTES, EntryType, overlay_xattr_allowed

__all__ = [
    "ImageRefused", "ImageSummary", "TreeEntry", "blob_blocks", "check_image", "read_tree"]

_SUPER = struct.Struct("<IIIBBHQQIIII16s16sIHHHBBIQ24s")  # struct erofs_super_block, 128 bytes
_DEVICE_SLOT = struct.Struct("<64sII56s")  # struct erofs_deviceslot: tag, blocks, mapped_blkaddr
_INODE = struct.Struct("<HHHHQIIIIqII16s")  # struct erofs_inode_extended, 64 bytes
_XATTR_HEADER = struct.Struct("<IB7s")  # name filter, shared count, reserved
_XATTR_ENTRY = struct.Struct("<BBH")  # name length, name index, value size
_DIRENT = struct.Struct("<QHBB")  # nid, name offset, file type, reserved
_NAMEOFF = struct.Struct("<H")

#: i_mode's type -> (the format's type, the dirent file type the writer gives it).  No sockets:
#: an index has none, so the writer never writes one.
_TYPES = {
    stat.S_IFREG: (EntryType.FILE, 1),
    stat.S_IFDIR: (EntryType.DIR, 2),
    stat.S_IFCHR: (EntryType.CHAR, 3),
    stat.S_IFBLK: (EntryType.BLOCK, 4),
    stat.S_IFIFO: (EntryType.FIFO, 5),
    stat.S_IFLNK: (EntryType.SYMLINK, 7),
}
_DIR_TYPE = 2
_DIRENT_TYPES = frozenset(kind[1] for kind in _TYPES.values())
_FILE, _DIR, _SYMLINK, _CHAR, _BLOCK, _FIFO = (EntryType.FILE, EntryType.DIR, EntryType.SYMLINK, EntryType.CHAR, EntryType.BLOCK,
                                               EntryType.FIFO)  # fmt: skip
_LAYOUTS = frozenset((LAYOUT_FLAT_PLAIN, LAYOUT_FLAT_INLINE, LAYOUT_CHUNK_BASED))
#: EROFS_XATTR_INDEX_* the writer uses -> (the name prefix, whether the prefix is the whole name).
_XATTR_PREFIXES = {1: (b"user.", False), 2: (b"system.posix_acl_access", True), 3: (b"system.posix_acl_default", True),
                   4: (b"trusted.", False), 6: (b"security.", False)}  # fmt: skip
_SLOTS_PER_BLOCK = BLOCK_SIZE // SLOT_SIZE
_ZERO16 = bytes(16)
_OWNED = b"\x01" * 512  #: marks for a record of up to 16 KiB (most are 2 to 4 slots)
_HOLE = (0, NULL_ADDR)  #: a chunk index's (advise | device id << 16, blkaddr) for a hole
_MAPPED = BLOB_DEVICE_ID << 16  #: ... and its first word for a chunk of the blob (advise 0)


class ImageRefused(ValueError):
    """An image this node will not hand the kernel; the message says what is wrong and where (nid, path)."""


@dataclass(frozen=True)
class ImageSummary:
    """What an accepted image holds."""

    inodes: int  #: distinct inodes (a hard link's names share one)
    directories: int
    files: int  #: regular-file inodes
    inline_bytes: int  #: bytes of regular files whose data is in the image itself
    chunks: int  #: chunk indexes of chunk-based files, holes included


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """One path of an accepted image's tree, with its inode's fields (the names of one inode share them)."""

    path: str  #: "" for the root, else "a/b"; names decoded with :func:`os.fsdecode`
    type: EntryType
    mode: int  #: permission bits, setuid, setgid and sticky included (``0o7777``)
    uid: int
    gid: int
    mtime_ns: int
    size: int
    nlink: int
    xattrs: dict[str, bytes] = field(default_factory=dict)  #: full names ("trusted.overlay.opaque")
    rdev: tuple[int, int] = (0, 0)  #: (major, minor) of a device
    target: str = ""  #: a symlink's target
    chunks: tuple[int | None, ...] = ()  #: a chunk-based file's blob addresses in 4 KiB blocks, None for a hole
    data: bytes | None = None  #: a regular file's bytes when the image holds them (b"" for an empty file); None if chunk-based


def check_image(image: bytes | memoryview, *, blob_size: int, chunk_size: int, max_inodes: int) -> ImageSummary:
    """Check ``image`` as :mod:`this module <bootseer.blockstore.datapath.erofs_check>` says; its summary, or ImageRefused.

    ``blob_size`` and ``chunk_size`` are the layer's (its verified index's ``blob_size`` and
    ``block_size``): every chunk must lie in the blob, aligned to a chunk.  ``max_inodes``
    bounds the tree (the index's entry count).  Arguments that no layer has (a chunk size
    that is not a power of two of at least 4 KiB, a negative size) raise ValueError: the
    caller's mistake, not the image's.  Linear in the image's size: about 5 µs per inode (bench/erofs_check_speed.py).
    """
    walk = _Walk(image, blob_size, chunk_size, max_inodes)
    collecting = gc.isenabled()
    gc.disable()  # a walk makes an object per inode: collections in its middle would scan them all, again and again
    try:
        for _ in walk.walk(entries=False):
            pass
    finally:
        if collecting:
            gc.enable()
    return walk.summary()


def blob_blocks(head: bytes | memoryview) -> int:
    """The blob's size in 4 KiB blocks as the device table of an image that :func:`check_image` accepted
    says it (``head``: at least the image's first 2 KiB).  :func:`check_image` held it to the blob size
    it was given; a mount holds it to the blob it serves."""
    _tag, device_blocks, _mapped, _reserved = _DEVICE_SLOT.unpack_from(head, DEVT_SLOTOFF * _DEVICE_SLOT.size)
    return int(device_blocks)


def read_tree(image: bytes | memoryview, *, blob_size: int, chunk_size: int, max_inodes: int) -> Iterator[TreeEntry]:
    """Every path of ``image``'s tree, checked as :func:`check_image` checks it; each directory before what it holds.

    The image is accepted only once the iterator is exhausted: a refusal (ImageRefused) may
    come after entries were yielded (a hard link count is checked at the end, for one).
    """
    walk = _Walk(image, blob_size, chunk_size, max_inodes)
    yield from walk.walk(entries=True)


def addressed_chunks(image: bytes | memoryview, *, blob_size: int, chunk_size: int, max_inodes: int) -> set[int]:
    """The blob's chunks (numbers of ``chunk_size`` bytes) that ``image``'s files address, checked as
    :func:`read_tree` checks: a chunk no file addresses is never read through the image (its file's
    data is inline, say)."""
    per_chunk = chunk_size // BLOCK_SIZE
    found: set[int] = set()
    for entry in read_tree(image, blob_size=blob_size, chunk_size=chunk_size, max_inodes=max_inodes):
        found.update(address // per_chunk for address in entry.chunks if address is not None)
    return found


class _Inode:
    """One parsed, checked inode; its data (directory entries, target, file bytes) is read on demand."""

    __slots__ = ("nid", "type", "dirent_type", "mode", "size", "layout", "union", "uid", "gid", "mtime_ns", "nlink",
                 "xattrs", "tail_at", "tail", "blocks", "chunks", "content", "path")  # fmt: skip

    nid: int
    type: EntryType
    dirent_type: int
    mode: int
    size: int
    layout: int
    union: int  #: i_u: raw_blkaddr, chunk format or rdev
    uid: int
    gid: int
    mtime_ns: int
    nlink: int
    xattrs: dict[str, bytes]
    tail_at: int  #: byte offset of the inline tail (FLAT_INLINE)
    tail: int  #: its length
    blocks: int  #: whole data blocks at raw_blkaddr (FLAT_*)
    chunks: tuple[int | None, ...]
    content: bytes | None  #: a symlink's target, an inline file's bytes, once read
    path: bytes  #: the first path it was reached by (for messages)


_DIRENT_TABLES: dict[int, struct.Struct] = {}
_CHUNK_TABLES: dict[int, struct.Struct] = {}


def _dirents(count: int) -> struct.Struct:
    """The struct of a block's ``count`` dirents (at most 341 of them: one per 12 bytes of 4 KiB)."""
    table = _DIRENT_TABLES.get(count)
    if table is None:
        table = _DIRENT_TABLES[count] = struct.Struct("<" + "QHBB" * count)
    return table


def _chunk_words(count: int) -> struct.Struct:
    """The struct of ``count`` chunk indexes as 32-bit words (cached for the common small counts)."""
    table = _CHUNK_TABLES.get(count)
    if table is None:
        table = struct.Struct(f"<{2 * count}I")
        if count <= 64:
            _CHUNK_TABLES[count] = table
    return table


def _show(path: bytes) -> str:
    text = os.fsdecode(path)
    return repr(text if len(text) <= 80 else text[:77] + "...")


class _Walk:
    """The superblock's checks (on creation) and the walk of the tree from the root."""

    def __init__(self, image: bytes | memoryview, blob_size: int, chunk_size: int, max_inodes: int) -> None:
        if chunk_size < BLOCK_SIZE or chunk_size & (chunk_size - 1) or chunk_size.bit_length() - 1 - BLOCK_BITS > 0x1F:
            raise ValueError(f"chunk size {chunk_size} is not a power of two of at least {BLOCK_SIZE}")
        if blob_size < 0 or max_inodes < 1:
            raise ValueError(f"blob size {blob_size} or max_inodes {max_inodes} is out of range")
        view = memoryview(image)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self.view = view
        self.length = length = len(view)
        self.blob_size = blob_size
        self.chunk_size = chunk_size
        self.chunk_blocks = chunk_size // BLOCK_SIZE
        self.chunk_format = CHUNK_FORMAT_INDEXES | (chunk_size.bit_length() - 1 - BLOCK_BITS)
        self.max_inodes = max_inodes
        if length < BLOCK_SIZE or length % BLOCK_SIZE:
            raise ImageRefused(f"the image is {length} bytes, not a whole number of {BLOCK_SIZE}-byte blocks (truncated?)")
        self.image_blocks = length // BLOCK_SIZE
        (magic, checksum, compat, blkszbits, extslots, self.root, self.inos, build_time, build_nsec, blocks, meta_blkaddr,
         xattr_blkaddr, _uuid, volume_name, incompat, compr, extra_devices, devt_slotoff, dirblkbits, prefix_count,
         prefix_start, packed_nid, reserved) = _SUPER.unpack_from(view, SUPER_OFFSET)  # fmt: skip
        if magic != SUPER_MAGIC:
            raise ImageRefused(f"superblock: magic {magic:#x} is not EROFS's {SUPER_MAGIC:#x}")
        if blkszbits != BLOCK_BITS:
            raise ImageRefused(f"superblock: block size 2^{blkszbits}, not {BLOCK_SIZE}")
        if compat or checksum:
            raise ImageRefused(f"superblock: compat features {compat:#x} (checksum {checksum:#x}); the writer sets none")
        if incompat != FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE:
            raise ImageRefused(f"superblock: incompat features {incompat:#x}, not the writer's chunked files + device table (0xc)")
        if extra_devices != 1 or devt_slotoff != DEVT_SLOTOFF:
            raise ImageRefused(f"superblock: {extra_devices} extra devices at slot {devt_slotoff}, not one (the blob) at {DEVT_SLOTOFF}")
        zeros = {"sb_extslots": extslots, "build_time": build_time | build_nsec, "meta_blkaddr": meta_blkaddr,
                 "xattr_blkaddr": xattr_blkaddr, "compression": compr, "dirblkbits": dirblkbits,
                 "xattr prefixes": prefix_count | prefix_start, "packed_nid": packed_nid,
                 "volume_name": volume_name != bytes(16), "reserved bytes": reserved != bytes(24)}  # fmt: skip
        for name, value in zeros.items():
            if value:
                raise ImageRefused(f"superblock: {name} is set; the writer leaves it zero")
        if blocks != self.image_blocks:
            raise ImageRefused(f"superblock: {blocks} blocks, but the image is {self.image_blocks} (truncated or padded)")
        tag, device_blocks, mapped_blkaddr, slot_reserved = _DEVICE_SLOT.unpack_from(view, devt_slotoff * _DEVICE_SLOT.size)
        if device_blocks != blob_size // BLOCK_SIZE:
            raise ImageRefused(f"device table: the blob is {device_blocks} blocks, but this layer's is {blob_size // BLOCK_SIZE}")
        if mapped_blkaddr or tag != bytes(64) or slot_reserved != bytes(56):
            raise ImageRefused("device table: the blob's slot has a tag, a mapped address or reserved bytes set")
        if not 1 <= self.inos <= max_inodes:
            raise ImageRefused(f"superblock: {self.inos} inodes, not 1..{max_inodes} (the layer's entries)")
        #: one byte per 32-byte slot of the image: 1 once something (superblock, an inode's record or data) owns it
        self.owned = bytearray(length // SLOT_SIZE)
        self.owned[: FIRST_INODE // SLOT_SIZE] = b"\x01" * (FIRST_INODE // SLOT_SIZE)
        self.inodes: dict[int, _Inode] = {}
        self.numbers = bytearray(self.inos + 1)  # 1 at each i_ino seen
        self.directories = self.files = self.inline_bytes = self.chunks = 0

    # -- refusals -------------------------------------------------------------------------------

    @staticmethod
    def refuse(nid: int, path: bytes, what: str) -> ImageRefused:
        return ImageRefused(f"nid {nid} ({_show(path)}): {what}")

    # -- inodes ---------------------------------------------------------------------------------

    def inode(self, nid: int, path: bytes) -> _Inode:
        """Inode ``nid`` (parsed and checked once; a hard link's names share the result)."""
        found = self.inodes.get(nid)
        if found is not None:
            return found
        at = nid * SLOT_SIZE
        if at < FIRST_INODE or at + INODE_SIZE > self.length:
            raise self.refuse(nid, path, f"out of range (inodes lie in bytes {FIRST_INODE}..{self.length} of the image)")
        if at % BLOCK_SIZE + INODE_SIZE > BLOCK_SIZE:
            raise self.refuse(nid, path, "the 64-byte inode straddles a 4 KiB block")
        if len(self.inodes) >= self.max_inodes:
            raise self.refuse(nid, path, f"more than {self.max_inodes} inodes (the layer's entries)")
        (i_format, icount, mode, reserved, size, union, ino, uid, gid, seconds, nanoseconds, nlink,
         reserved2) = _INODE.unpack_from(self.view, at)  # fmt: skip
        if not i_format & INODE_EXTENDED:
            raise self.refuse(nid, path, "a compact inode (the writer writes only the extended format)")
        layout = i_format >> 1
        if layout not in _LAYOUTS:
            raise self.refuse(nid, path, f"i_format {i_format:#x}: data layout {layout} (the writer uses 0, 2 and 4 only)")
        kind = _TYPES.get(mode & 0o170000)
        if kind is None:
            raise self.refuse(nid, path, f"mode {mode:#o}: a file type the writer never writes")
        if reserved or reserved2 != _ZERO16:
            raise self.refuse(nid, path, "reserved inode bytes are set")
        if uid >= MAX_ID or gid >= MAX_ID or nanoseconds >= 1_000_000_000 or not nlink:
            raise self.refuse(nid, path, f"owner {uid}:{gid}, mtime nanoseconds {nanoseconds} or nlink {nlink} out of range")
        numbers = self.numbers
        if not 1 <= ino <= self.inos or numbers[ino]:
            raise self.refuse(nid, path, f"i_ino {ino} is not a fresh number in 1..{self.inos}")
        numbers[ino] = 1
        node = _Inode()
        node.type, node.dirent_type = kind
        kind = node.type
        node.nid, node.mode, node.size, node.layout, node.union, node.path = nid, mode, size, layout, union, path
        node.uid, node.gid, node.mtime_ns, node.nlink = uid, gid, seconds * 1_000_000_000 + nanoseconds, nlink
        node.tail_at = node.tail = node.blocks = 0
        node.chunks = ()
        node.content = None
        end = at + INODE_SIZE
        if icount:
            end += _XATTR_HEADER.size + (icount - 1) * 4
            node.xattrs = self.xattrs(at + INODE_SIZE, end, nid, path, kind is _DIR)
        else:
            node.xattrs = {}
        if layout == LAYOUT_CHUNK_BASED:
            end = self.chunk_indexes(node, end, path)
        else:
            end = self.flat_data(node, end, path)
        owned = self.owned
        last = -(-end // SLOT_SIZE)
        if owned.find(1, nid, last) != -1:
            raise self.refuse(nid, path, "its record overlaps the superblock or another inode's record or data")
        owned[nid:last] = _OWNED[: last - nid] if last - nid <= len(_OWNED) else b"\x01" * (last - nid)
        if node.blocks:
            first, last = union * _SLOTS_PER_BLOCK, (union + node.blocks) * _SLOTS_PER_BLOCK
            if owned.find(1, first, last) != -1:
                raise self.refuse(nid, path, "its data overlaps the superblock or another inode's record or data")
            owned[first:last] = b"\x01" * (last - first)
        if kind is _SYMLINK:
            node.content = self.data(node)
            if b"\0" in node.content:
                raise self.refuse(nid, path, "a symlink target with a NUL byte")
        elif kind is _FILE:
            self.files += 1
            if layout != LAYOUT_CHUNK_BASED:
                self.inline_bytes += size
        self.inodes[nid] = node
        return node

    def xattrs(self, start: int, end: int, nid: int, path: bytes, is_dir: bool) -> dict[str, bytes]:
        """The inline xattrs in ``[start, end)``: the writer's header (no filter, no shared xattrs), then
        entries with the short prefixes only, sorted by name, filling the area exactly."""
        view = self.view
        if end > self.length:
            raise self.refuse(nid, path, f"its xattr area (to byte {end}) is past the end of the image")
        name_filter, shared, reserved = _XATTR_HEADER.unpack_from(view, start)
        if name_filter or shared or reserved != bytes(7):
            raise self.refuse(nid, path, f"xattr header with name filter {name_filter:#x} or {shared} shared xattrs")
        at = start + _XATTR_HEADER.size
        if at == end:
            raise self.refuse(nid, path, "an xattr area with no entries")
        out: dict[str, bytes] = {}
        last = b""
        while at < end:
            if at + _XATTR_ENTRY.size > end:
                raise self.refuse(nid, path, "an xattr entry runs past the inode's declared xattr size")
            name_length, name_index, value_size = _XATTR_ENTRY.unpack_from(view, at)
            name_at = at + _XATTR_ENTRY.size
            value_at = name_at + name_length
            after = value_at + value_size
            if after > end:
                raise self.refuse(nid, path, "an xattr entry runs past the inode's declared xattr size")
            prefix = _XATTR_PREFIXES.get(name_index)
            if prefix is None:
                raise self.refuse(nid, path, f"xattr name index {name_index} (the writer uses 1, 2, 3, 4 and 6)")
            suffix = bytes(view[name_at:value_at])
            if prefix[1] == bool(suffix) or b"\0" in suffix:
                raise self.refuse(nid, path, f"xattr name {(prefix[0] + suffix)[:60]!r} is empty, has a NUL or extends an exact name")
            name = prefix[0] + suffix
            if name <= last or len(name) > MAX_XATTR_NAME_BYTES:
                raise self.refuse(nid, path, f"xattr {name[:60]!r} is out of order, repeated or longer than {MAX_XATTR_NAME_BYTES} bytes")
            last = name
            text, value = os.fsdecode(name), bytes(view[value_at:after])
            if not overlay_xattr_allowed(text, value, is_dir):
                raise self.refuse(nid, path, f"xattr {text[:60]!r} is overlayfs metadata no layer may carry")
            out[text] = value
            at = after + (-after % 4)
        if at != end:
            raise self.refuse(nid, path, "the last xattr entry's padding runs past the declared xattr size")
        return out

    def chunk_indexes(self, node: _Inode, end: int, path: bytes) -> int:
        """Check a chunk-based file's indexes (after its xattrs, 8-byte aligned); the end of its record."""
        nid, size = node.nid, node.size
        if node.type is not _FILE or not size:
            raise self.refuse(nid, path, "chunk-based, but not a regular file with data")
        if node.union != self.chunk_format:
            raise self.refuse(nid, path, f"chunk format {node.union:#x}, not {self.chunk_format:#x} "
                                         f"(indexes of {self.chunk_size}-byte chunks)")  # fmt: skip
        count = -(-size // self.chunk_size)
        start = -(-end // CHUNK_INDEX_SIZE) * CHUNK_INDEX_SIZE
        end = start + count * CHUNK_INDEX_SIZE
        if end > self.length:
            raise self.refuse(nid, path, f"{count} chunk indexes for {size} bytes run past the end of the image")
        words = _chunk_words(count).unpack_from(self.view, start)
        last = self.blob_size - self.chunk_size
        per_chunk = self.chunk_blocks
        addresses = words[1::2]
        if words[0::2].count(_MAPPED) == count and max(addresses) * BLOCK_SIZE <= last and (
            per_chunk == 1 or not any(address % per_chunk for address in addresses)
        ):  # no holes, every chunk in the blob and aligned: the common case, checked without a loop in Python
            node.chunks = addresses
            self.chunks += count
            return end
        chunks: list[int | None] = []
        for position in range(count):
            first, address = words[2 * position], words[2 * position + 1]
            if first == _MAPPED:
                if address % per_chunk or address * BLOCK_SIZE > last:
                    raise self.refuse(nid, path, f"chunk {position} at blob block {address} is past the blob or not aligned to a chunk")
                chunks.append(address)
            elif first == _HOLE[0] and address == _HOLE[1]:
                chunks.append(None)
            else:
                raise self.refuse(nid, path, f"chunk {position}: device id {first >> 16}, advise {first & 0xFFFF}, address {address:#x} "
                                             "(the blob is device 1; a hole is device 0 at the null address)")  # fmt: skip
        node.chunks = tuple(chunks)
        self.chunks += count
        return end

    def flat_data(self, node: _Inode, end: int, path: bytes) -> int:
        """Check where a FLAT_PLAIN or FLAT_INLINE inode's data lies; the end of its record."""
        nid, size, layout, kind = node.nid, node.size, node.layout, node.type
        if kind is _CHAR or kind is _BLOCK or kind is _FIFO or not size:
            if kind is _DIR or kind is _SYMLINK:
                raise self.refuse(nid, path, f"an empty {kind.value}")
            if layout != LAYOUT_FLAT_PLAIN or size or (kind is not _CHAR and kind is not _BLOCK and node.union):
                raise self.refuse(nid, path, f"a {kind.value} of {size} bytes with layout {layout}, i_u {node.union:#x}")
            return end
        if kind is _SYMLINK and size > MAX_SYMLINK_BYTES:
            raise self.refuse(nid, path, f"a symlink target of {size} bytes (at most {MAX_SYMLINK_BYTES})")
        if layout == LAYOUT_FLAT_INLINE:
            node.tail = tail = size % BLOCK_SIZE
            node.blocks = size // BLOCK_SIZE
            if not tail:
                raise self.refuse(nid, path, "FLAT_INLINE with no tail (the writer lays a multiple of 4 KiB out FLAT_PLAIN)")
            if end % BLOCK_SIZE + tail > BLOCK_SIZE:  # the kernel's rule; after xattrs that cross a block, in the next one
                raise self.refuse(nid, path, f"its {tail}-byte inline tail at byte {end} crosses a 4 KiB block")
            node.tail_at = end
            end += tail
        else:
            node.blocks = -(-size // BLOCK_SIZE)
        if node.blocks:
            if node.union + node.blocks > self.image_blocks:
                raise self.refuse(nid, path, f"its {node.blocks} data blocks at block {node.union} are past the end of the image")
        elif node.union != NULL_ADDR:
            raise self.refuse(nid, path, f"raw_blkaddr {node.union:#x} with no data blocks (the writer writes the null address)")
        return end

    def data(self, node: _Inode) -> bytes:
        """The ``size`` bytes of a FLAT inode: its whole blocks, then its inline tail (checked in range)."""
        start = node.union * BLOCK_SIZE
        if node.tail:
            head = self.view[start : start + node.blocks * BLOCK_SIZE] if node.blocks else b""
            return bytes(head) + bytes(self.view[node.tail_at : node.tail_at + node.tail])
        return bytes(self.view[start : start + node.size])

    # -- directories ----------------------------------------------------------------------------

    def directory(self, node: _Inode, parent: int, path: bytes) -> list[tuple[bytes, int, int]]:
        """A directory's children ``(name, nid, dirent file type)`` in name order, ``.`` and ``..`` checked and left out.

        Each 4 KiB block is checked whole where it can be (its dirents in one unpack, its names'
        bytes for ``/`` and NUL in one search, their order in one sort); names are compared one
        by one only to say which is wrong.
        """
        nid = node.nid
        data = self.data(node)
        size = len(data)
        names: list[bytes] = []
        nids: list[int] = []
        types: list[int] = []
        for start in range(0, size, BLOCK_SIZE):
            block_end = min(start + BLOCK_SIZE, size)
            where = f"directory block at byte {start}"
            if block_end - start < _DIRENT.size:
                raise self.refuse(nid, path, f"{where} is too short for a dirent")
            (first,) = _NAMEOFF.unpack_from(data, start + 8)
            if not first or first % _DIRENT.size or start + first > block_end:
                raise self.refuse(nid, path, f"{where}: first name offset {first} is not a dirent count in the block")
            count = first // _DIRENT.size
            table = _dirents(count).unpack_from(data, start)
            offsets = table[1::4]
            if block_end < size:  # a padded block: its last name ends at the first NUL, zeros follow
                names_end = data.find(0, start + offsets[-1], block_end)
                if names_end == -1:
                    names_end = block_end
                elif data.count(0, names_end, block_end) != block_end - names_end:
                    raise self.refuse(nid, path, f"{where}: bytes after its last name are not zero padding")
            else:  # the directory's size ends at its last name
                names_end = block_end
                if data[names_end - 1] == 0:
                    raise self.refuse(nid, path, "the directory's size runs past its last name")
            ends = offsets[1:] + (names_end - start,)
            if offsets[0] != first or any(map(int.__gt__, offsets, ends)) or ends[-1] > block_end - start:
                raise self.refuse(nid, path, f"{where}: name offsets out of order or out of the block")
            block_names = [data[start + a : start + b] for a, b in zip(offsets, ends)]
            region = data[start + first : names_end]
            if b"\0" in region or b"/" in region or not all(block_names) or max(map(len, block_names)) > MAX_NAME_BYTES:
                for name in block_names:
                    if not name or len(name) > MAX_NAME_BYTES:
                        raise self.refuse(nid, path, f"a name of {len(name)} bytes (1..{MAX_NAME_BYTES}) in {where}")
                    if b"\0" in name:
                        raise self.refuse(nid, path, f"a name with a NUL byte: {name[:60]!r}")
                    if b"/" in name:
                        raise self.refuse(nid, path, f"a name with '/': {name[:60]!r}")
            kinds = table[2::4]
            if any(table[3::4]) or not _DIRENT_TYPES.issuperset(kinds):
                raise self.refuse(nid, path, f"{where}: a dirent with a file type the writer never writes or a reserved byte set")
            names += block_names
            nids += table[0::4]
            types += kinds
        if sorted(set(names)) != names:
            for before, after in zip(names, names[1:]):
                if not before < after:
                    raise self.refuse(nid, path, f"names not strictly sorted: {after[:60]!r} after {before[:60]!r}")
        children = list(zip(names, nids, types))
        for name, want in ((b".", nid), (b"..", parent)):
            if name not in names:
                raise self.refuse(nid, path, "a directory without '.' or '..'")
            _, child, file_type = children[names.index(name)]
            if file_type != _DIR_TYPE or child != want:
                raise self.refuse(nid, path, f"{name.decode()!r} is nid {child}, not {want}")
        return [child for child in children if child[0] != b"." and child[0] != b".."]

    # -- the walk -------------------------------------------------------------------------------

    def walk(self, *, entries: bool) -> Iterator[TreeEntry]:
        """Walk the tree from the root (an explicit stack); TreeEntry for each path if ``entries``."""
        root_nid = self.root
        root = self.inode(root_nid, b"")
        if root.type is not _DIR:
            raise self.refuse(root_nid, b"", "the root is not a directory")
        seen = {root_nid}
        named: list[int] = []  # the nid of every non-directory name found
        stack: list[tuple[_Inode, int, bytes]] = [(root, root_nid, b"")]
        inode, cached = self.inode, self.inodes.get
        while stack:
            node, parent, path = stack.pop()
            children = self.directory(node, parent, path)
            self.directories += 1
            if entries:
                yield self.entry(node, path)
            subdirectories = []
            for name, nid, file_type in children:
                child_path = path + b"/" + name if path else name
                child = cached(nid) or inode(nid, child_path)
                if child.dirent_type != file_type:
                    raise self.refuse(nid, child_path, f"its dirent says file type {file_type}, its mode {child.mode:#o}")
                if file_type == _DIR_TYPE:
                    if nid in seen:
                        raise self.refuse(nid, child_path, "a directory reached twice (a loop or a directory hard link)")
                    seen.add(nid)
                    subdirectories.append((child, node.nid, child_path))
                    continue
                named.append(nid)
                if entries:
                    yield self.entry(child, child_path)
            if node.nlink != 2 + len(subdirectories):
                raise self.refuse(node.nid, path, f"nlink {node.nlink}, but {len(subdirectories)} subdirectories")
            stack.extend(reversed(subdirectories))
        for nid, count in Counter(named).items():
            node = self.inodes[nid]
            if node.nlink != count:
                raise self.refuse(nid, node.path, f"nlink {node.nlink}, but {count} names")
        if len(self.inodes) != self.inos:
            raise ImageRefused(f"superblock: {self.inos} inodes, but the tree has {len(self.inodes)}")

    def entry(self, node: _Inode, path: bytes) -> TreeEntry:
        kind = node.type
        rdev, target, data = (0, 0), "", None
        if kind is _CHAR or kind is _BLOCK:
            rdev = ((node.union >> 8) & 0xFFF, (node.union & 0xFF) | ((node.union >> 12) & 0xFFF00))
        elif kind is _SYMLINK:
            target = os.fsdecode(node.content or b"")
        elif kind is _FILE and node.layout != LAYOUT_CHUNK_BASED:
            if node.content is None:
                node.content = self.data(node)  # once per inode, however many names it has
            data = node.content
        return TreeEntry(os.fsdecode(path), kind, node.mode & 0o7777, node.uid, node.gid, node.mtime_ns, node.size, node.nlink,
                         dict(node.xattrs), rdev, target, node.chunks, data)  # fmt: skip

    def summary(self) -> ImageSummary:
        return ImageSummary(len(self.inodes), self.directories, self.files, self.inline_bytes, self.chunks)
