"""Converted layers as FUSE nodes: one directory per layer over its :class:`LayerIndex`, and one blob file.

The layer server (:mod:`blockstore.server.layer_server`) mounts one FUSE filesystem whose root,
:class:`LayersRoot`, lists one directory per mounted layer, named by its slot number;
each of those is a :class:`LayerTree`'s root and is an overlayfs lower directory as
it stands (whiteouts are character devices 0/0, opaque directories carry
``trusted.overlay.opaque``, exactly as the index records them).

Beside them the root holds ``blobs/``, one file per mounted layer named by its slot
(:class:`LayerBlobFile`): the layer's blob, every block of the index end to end,
block ``i`` at offset ``i * block_size`` padded with zeros, zero blocks as holes
(``blockstore.node.layer_reader.LayerReader.read_blob``).  It is the extra device an EROFS
image of the layer names its files' chunks in (``mount -t erofs -o device=...``), so
the kernel answers the tree and this filesystem only block data.  Root-only
(0400 in a 0500 directory), read-only, cached across opens; its inode number is
:func:`blob_inode_number` of the slot, stable across restarts.

Every read of either view is shown to the tree's :class:`ReadObserver` (the hot
lists) before it is served: a file read with what its open was tagged with, a blob
read with the reader's pid, looked up at read time (a blob is opened once, by
whoever mounts EROFS on it, for every reader).

Everything but file contents comes from the index, which is in memory: ``stat``,
``readdir``, ``readlink``, ``getxattr`` and ``listxattr`` never fetch a block.  A
read goes to the layer's reader (``blockstore.node.layer_reader.LayerReader``: verified blocks
through the node cache and the fetch engine), which fetches only the blocks the read
covers.

A layer never changes while it is mounted, so its nodes say so: directories are
immutable (missing names are cached negatively), open files keep the page cache
across opens, and inode numbers are derived from the slot and the entry's number in
the index (:func:`inode_number`), so a restarted server that restores the same slots
answers with the same numbers.  A hard link is another name of its target's node:
the same inode number, and ``st_nlink`` counts every name.  The root's listing is the
only thing that changes (layers come and go); the server invalidates a slot's
directory entry in the kernel when it unmounts a layer.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, Hashable, Mapping, Protocol, Sequence, TypeVar

from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import BlockSink, Entry, EntryType, FormatError, LayerIndex
from bootseer.fuse import Attributes, Directory, File, Node, OpenFile, Special, Symlink
from bootseer.fuse.inodes import ROOT_INODE
from bootseer.fuse.operations import OPENER_PID

#: Entries of one layer are numbered below this; a slot's inode numbers are
#: ``slot << SLOT_SHIFT | (entry number + 1)``, so slot 1's root is ``2**32 + 1`` and
#: no layer inode is near the root's (1).
SLOT_SHIFT = 32
MAX_ENTRIES = (1 << SLOT_SHIFT) - 1
MAX_SLOT = (1 << (63 - SLOT_SHIFT)) - 1

_LAYERS_ROOT_MODE = stat.S_IFDIR | 0o555
_BLOBS_MODE = stat.S_IFDIR | 0o500
_BLOB_MODE = stat.S_IFREG | 0o400

#: The name of the root's directory of blobs (never a slot's: those are digits).
BLOBS = "blobs"
#: The inode number of ``blobs/``: slot 0's last number, which no layer has (slots
#: start at 1) and the key-numbered nodes counting up from the root's never reach.
BLOBS_INODE = (1 << SLOT_SHIFT) - 1


def inode_number(slot: int, entry_number: int) -> int:
    """The inode number of entry ``entry_number`` of the layer in ``slot`` (slots start at 1)."""
    if not 1 <= slot <= MAX_SLOT:
        raise ValueError(f"slot {slot} is outside 1..{MAX_SLOT}")
    if not 0 <= entry_number < MAX_ENTRIES:
        raise ValueError(f"entry number {entry_number} is outside 0..{MAX_ENTRIES - 1}")
    return (slot << SLOT_SHIFT) | (entry_number + 1)


def blob_inode_number(slot: int) -> int:
    """The inode number of the blob of the layer in ``slot``: the slot's number no entry has (low bits 0)."""
    inode_number(slot, 0)  # checks the slot
    return slot << SLOT_SHIFT


class BlockReader(Protocol):
    """What reads a layer's file contents and blob (``blockstore.node.layer_reader.LayerReader``)."""

    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of ``entry`` from ``offset``; fewer only at its end.
        Raises OSError (EIO) when the blocks cannot be fetched or fail verification."""
        ...

    async def read_blob(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the layer's blob from ``offset``; fewer only at its end.
        Raises OSError (EIO) as :meth:`read` does."""
        ...

    async def blob_blocks(self, refs: Sequence[int], sink: BlockSink | None = None) -> list[bytes]:
        """Blocks ``refs`` (ascending) as stored, verified, read as a blob read is (read-ahead included): what
        a fill on the ``fanotify`` path writes into the layer's local blob (those fetched go to ``sink`` as they
        are verified, and not to the node cache).  Raises OSError (EIO) as :meth:`read`."""
        ...

    async def background_blocks(self, refs: Sequence[int], sink: BlockSink | None = None) -> list[bytes]:
        """Blocks ``refs`` as :meth:`blob_blocks`, at prefetch priority and without read-ahead (a background fill)."""
        ...

    @property
    def store(self) -> Hashable:
        """What stands for the layer's store: equal for every layer of one store (a failing store's key)."""
        ...

    @property
    def store_label(self) -> str:
        """The store's name for logs and metrics (credentials redacted)."""
        ...

    @property
    def failure_memory(self) -> float:
        """Seconds the store's fetches keep failing at once what failed for good."""
        ...


Tag = TypeVar("Tag")


class ReadObserver(Protocol[Tag]):
    """What sees every read of a served layer before it is served (``bootseer.hotlist.service.HotListService``).

    ``Tag`` is whatever :meth:`opened` says about a file's opener, handed back with
    each read through that open.  No method may raise or wait: a read is answered
    right after.
    """

    def opened(self, tree: LayerTree) -> Tag:
        """A file of ``tree`` is being opened (the opener's pid is ``OPENER_PID``)."""
        ...

    def read(self, tree: LayerTree, entry: Entry, offset: int, size: int, tag: Tag) -> None:
        """``size`` bytes at ``offset`` of regular file ``entry`` (within its size) are being read."""
        ...

    def blob_read(self, layer: str, index: LayerBlocks, refs: Sequence[int], pid: int) -> None:
        """Blocks ``refs`` (numbers in ``index.blocks``, ascending) of ``layer``'s blob are being read
        by process ``pid`` (0: unknown)."""
        ...

    def watches(self, layer: str) -> bool:
        """Whether the first reads of ``layer``'s blocks matter now (a recording takes them): the ``fanotify`` path
        then keeps a blob marked while it has blocks written ahead and not yet read, so that their reads are seen."""
        ...


class LayerTree:
    """One mounted layer: its blocks (its index, or its block table), the lookup tables built from its
    entries, and its reader.

    Built once when the layer is mounted (O(entries)); raises :class:`FormatError`
    for an index this filesystem cannot number (more than :data:`MAX_ENTRIES`).
    A layer served from its block table (``index`` a
    :class:`~bootseer.blockstore.objects.block_table.LayerBlockTable`: its EROFS image holds the tree) has
    no entries here: its slot's directory is an empty root, and only its blob is served.
    """

    def __init__(self, slot: int, index: LayerBlocks, reader: BlockReader, *, name: str = "") -> None:
        if index.entry_count > MAX_ENTRIES:
            raise FormatError(f"layer index has {index.entry_count} entries; at most {MAX_ENTRIES} can be served")
        inode_number(slot, 0)  # checks the slot
        self.slot = slot
        self.index = index
        #: the tree's entries (the root first): the index's, or an empty root for a layer served from its block table
        self.entries: Sequence[Entry] = index.entries if isinstance(index, LayerIndex) else (Entry("", EntryType.DIR, 0o555),)
        self.reader = reader
        self.name = name or str(slot)  #: what logs call the layer (its ChainID)
        #: sees every open and read (hot lists: bootseer.hotlist.service); the tag type is the observer's own
        self.observer: ReadObserver[Any] | None = None
        #: raw bytes of the layer's regular files (each inode once), for statfs
        self.index_bytes = index.file_bytes
        number_of_path: dict[str, int] = {}
        self.children: dict[int, dict[str, int]] = {}
        self.nlink: dict[int, int] = {}
        for number, entry in enumerate(self.entries):
            number_of_path[entry.path] = number
            if entry.type is EntryType.DIR:
                self.children[number] = {}
                self.nlink[number] = 2
            if number == 0:
                continue
            parent = number_of_path[entry.parent]
            self.children[parent][entry.name] = number
            if entry.type is EntryType.DIR:
                self.nlink[parent] += 1  # the child's ".."
            else:
                target = entry.link if entry.link is not None else number
                self.nlink[target] = self.nlink.get(target, 0) + 1

    def node(self, number: int) -> Node:
        """The node entry ``number`` shows (its target's, for a hard link)."""
        entry = self.entries[number]
        if entry.link is not None:
            number = entry.link
            entry = self.entries[number]
        if entry.type is EntryType.DIR:
            return LayerDirectory(self, number)
        if entry.type is EntryType.FILE:
            return LayerFile(self, number)
        if entry.type is EntryType.SYMLINK:
            return LayerSymlink(self, number)
        return LayerSpecial(self, number)

    def root(self) -> LayerDirectory:
        return LayerDirectory(self, 0)

    def attributes(self, number: int) -> Attributes:
        entry = self.entries[number]
        return Attributes(
            entry.st_mode,
            size=entry.size,
            mtime_ns=entry.mtime_ns,
            nlink=self.nlink.get(number, 1),
            uid=entry.uid,
            gid=entry.gid,
            rdev=os.makedev(*entry.rdev) if entry.type in (EntryType.CHAR, EntryType.BLOCK) else 0,
        )


class _LayerNode:
    """What every node of a layer shares: identity, attributes and xattrs from its entry."""

    def __init__(self, tree: LayerTree, number: int) -> None:
        self.tree = tree
        self.number = number
        self.entry = tree.entries[number]
        self.key = ("layer", tree.slot, number)
        self.inode = inode_number(tree.slot, number)

    def attributes(self) -> Attributes:
        return self.tree.attributes(self.number)

    def xattrs(self) -> Mapping[str, bytes]:
        return self.entry.xattrs


class LayerDirectory(_LayerNode, Directory):
    immutable = True

    async def lookup(self, name: str) -> Node:
        number = self.tree.children[self.number].get(name)
        if number is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", name)
        return self.tree.node(number)

    async def entries(self) -> Sequence[tuple[str, Node]]:
        return [(name, self.tree.node(number)) for name, number in self.tree.children[self.number].items()]


class LayerOpenFile(OpenFile):
    # The layer is immutable and the inode number is the entry's: cached pages stay right.
    keep_cache = True

    def __init__(self, tree: LayerTree, entry: Entry) -> None:
        self.tree = tree
        self.entry = entry
        self.tag = tree.observer.opened(tree) if tree.observer is not None else None

    async def read(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.entry.size - offset))
        if size == 0:
            return b""
        if self.tree.observer is not None:
            self.tree.observer.read(self.tree, self.entry, offset, size, self.tag)
        data = await self.tree.reader.read(self.entry, offset, size)
        if len(data) != size:
            # The reader verifies every block, so this is a bug, not bad data; refuse it.
            raise OSError(errno.EIO, f"layer {self.tree.name}: short read of {self.entry.path!r}: {len(data)} of {size}")
        return data


class LayerFile(_LayerNode, File):
    async def open(self) -> OpenFile:
        return LayerOpenFile(self.tree, self.entry)


class LayerSymlink(_LayerNode, Symlink):
    async def readlink(self) -> str:
        return self.entry.target


class LayerSpecial(_LayerNode, Special):
    """A device node, FIFO or whiteout (a character device 0/0)."""


class LayerBlobOpenFile(OpenFile):
    """The layer's blob, open: reads map to block numbers, each shown to the observer, then read."""

    # The layer is immutable and the inode number is the slot's blob's: cached pages stay right.
    keep_cache = True

    def __init__(self, tree: LayerTree) -> None:
        self.tree = tree
        # pyfuse3 (3.5) gives a read no request context, so the pid of the process a
        # read is for is not known here.  A process that opens the blob and reads it
        # reads through its own open, so its pid stands for every read of it; the
        # handle the layer server opens itself (mounting EROFS on the blob) serves
        # every reader of the image: unknown (0).  FUSE names the opening *thread*
        # (a mount made from a worker thread shows that thread's id, not the
        # server's pid), so any thread of this process is the server.
        opener = OPENER_PID.get()
        self.reader_pid = 0 if _of_this_process(opener) else opener

    async def read(self, offset: int, size: int) -> bytes:
        tree = self.tree
        size = max(0, min(size, tree.index.blob_size - offset))
        if size == 0:
            return b""
        if tree.observer is not None:
            block_size = tree.index.block_size
            refs = range(offset // block_size, (offset + size - 1) // block_size + 1)
            tree.observer.blob_read(tree.name, tree.index, refs, self.reader_pid)
        data = await tree.reader.read_blob(offset, size)
        if len(data) != size:
            # The reader pads and verifies every block, so this is a bug, not bad data; refuse it.
            raise OSError(errno.EIO, f"layer {tree.name}: short read of its blob: {len(data)} of {size} at {offset}")
        return data


def _of_this_process(pid: int) -> bool:
    """Whether ``pid`` (a FUSE request's: the calling *thread*'s id) is a thread of this process:
    the server mounts EROFS on a blob from a worker thread, whose id is not ``os.getpid()``."""
    return pid == os.getpid() or (pid > 0 and os.path.exists(f"/proc/self/task/{pid}"))


class LayerBlobFile(File):
    """``blobs/<slot>``: the blob of the layer in a slot, the extra device of its EROFS image."""

    def __init__(self, tree: LayerTree) -> None:
        self.tree = tree
        self.key = ("layer-blob", tree.slot)
        self.inode = blob_inode_number(tree.slot)

    def attributes(self) -> Attributes:
        return Attributes(_BLOB_MODE, size=self.tree.index.blob_size, uid=0, gid=0)

    async def open(self) -> OpenFile:
        return LayerBlobOpenFile(self.tree)


class LayerBlobs(Directory):
    """``blobs/``: a file per mounted layer, named by its slot, as the root lists the slots' directories."""

    key = ("layer-blobs",)
    inode = BLOBS_INODE

    def __init__(self, root: LayersRoot) -> None:
        self.root = root

    def attributes(self) -> Attributes:
        return Attributes(_BLOBS_MODE, nlink=2, uid=0, gid=0)

    async def lookup(self, name: str) -> Node:
        return LayerBlobFile(_layer_in(self.root.layers, name))

    async def entries(self) -> Sequence[tuple[str, Node]]:
        layers = self.root.layers
        return [(str(slot), LayerBlobFile(layers[slot])) for slot in sorted(layers)]


def _layer_in(layers: Mapping[int, LayerTree], name: str) -> LayerTree:
    """The layer in the slot ``name`` names (decimal, no leading zero); FileNotFoundError if none."""
    tree = layers.get(int(name)) if name.isdigit() and name == str(int(name)) else None
    if tree is None:
        raise FileNotFoundError(errno.ENOENT, "no layer in this slot", name)
    return tree


class LayersRoot(Directory):
    """The mount's root: a directory per mounted layer, named by its slot, and ``blobs/``.

    Its listing changes as layers are mounted and unmounted; everything under a
    slot does not.  Only root may enter (0555 here, and ``ROOT/layers`` is 0700).
    """

    key = ("layers-root",)
    #: Layer files never change and start-ups read large parts of large ones (shared
    #: libraries, by page faults): read ahead 1 MiB, the largest single FUSE read,
    #: rather than the kernel's 128 KiB, for fewer requests.
    read_ahead_kb = 1024

    def __init__(self) -> None:
        self.layers: dict[int, LayerTree] = {}
        self.blobs = LayerBlobs(self)

    def attributes(self) -> Attributes:
        return Attributes(_LAYERS_ROOT_MODE, nlink=3 + len(self.layers))

    async def lookup(self, name: str) -> Node:
        if name == BLOBS:
            return self.blobs
        return _layer_in(self.layers, name).root()

    async def entries(self) -> Sequence[tuple[str, Node]]:
        return [(BLOBS, self.blobs), *((str(slot), self.layers[slot].root()) for slot in sorted(self.layers))]

    @staticmethod
    def slot_inodes(slot: int) -> tuple[int, ...]:
        """The inode numbers through which the kernel can hold on to a slot's layer: a slot whose
        numbers are still referenced must not serve another layer (its cached pages would show)."""
        return inode_number(slot, 0), blob_inode_number(slot)

    @staticmethod
    def slot_names(slot: int) -> tuple[tuple[int, bytes], ...]:
        """(parent inode, name) of every directory entry that names a slot's layer, to invalidate."""
        return (ROOT_INODE, str(slot).encode()), (BLOBS_INODE, str(slot).encode())


__all__ = [
    "BLOBS",
    "BLOBS_INODE",
    "BlockReader",
    "LayerBlobFile",
    "LayerBlobOpenFile",
    "LayerBlobs",
    "LayerDirectory",
    "LayerFile",
    "LayerSpecial",
    "LayerSymlink",
    "LayerTree",
    "LayersRoot",
    "MAX_SLOT",
    "ReadObserver",
    "SLOT_SHIFT",
    "blob_inode_number",
    "inode_number",
]
