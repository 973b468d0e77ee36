"""The tree a read-only filesystem serves: nodes, their attributes and open files.

A filesystem built on :mod:`bootseer.fuse` describes its tree with these classes and
leaves inode numbers, handles, errno replies and the kernel protocol to
:class:`~bootseer.fuse.operations.ReadOnlyOperations`.  Nodes are cheap, short-lived
views: a directory may build fresh child nodes for every listing.  What ties the
views of one file together is :attr:`Node.key`: equal keys get the same inode
number, so a key must change whenever the content may have changed (the kernel
keeps its page cache per inode).  A node may also carry its own inode number
(:attr:`Node.inode`), derived from what it shows, so that a restarted server gives
the same numbers as the one before it; hard links are two names of one such node.

Methods raise :class:`OSError` with the errno the caller should see
(:class:`FileNotFoundError` for a missing name); any other exception becomes EIO.
"""

from __future__ import annotations

import abc
import errno
import stat
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence


@dataclass(frozen=True)
class Attributes:
    """What ``stat`` reports for a node (atime and ctime follow mtime)."""

    mode: int  #: full ``st_mode``, file type bits included
    size: int = 0
    mtime_ns: int = 0
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0  #: device number (``os.makedev``) of a character or block device


class Node(abc.ABC):
    """One file, directory, symlink or special file of the tree."""

    #: Identity of what the node shows; equal keys share an inode number.
    key: Hashable
    #: The node's own inode number, if it has one (it must not be the root's, 1, and
    #: must be the same for equal keys); None: numbered in the order nodes are first
    #: seen.  A filesystem that numbers some nodes itself keeps its numbers far from
    #: the small allocated ones (above 2**32, say).
    inode: int | None = None

    @abc.abstractmethod
    def attributes(self) -> Attributes: ...

    def xattrs(self) -> Mapping[str, bytes]:
        """The node's extended attributes by name (none by default)."""
        return {}


class Special(Node):
    """A device node, FIFO or socket: attributes only (``rdev`` names a device)."""

    def __init__(self, key: Hashable, attributes: Attributes) -> None:
        self.key = key
        self._attributes = attributes

    def attributes(self) -> Attributes:
        return self._attributes


class Directory(Node):
    #: Whether the set of children never changes while the node's key stays the same:
    #: then the kernel may cache a failed lookup (a negative entry) as long as it keeps
    #: a positive one, and a missing name costs one request, not one per access.
    immutable: bool = False
    #: For a filesystem's root only: the read-ahead (KiB) its mount should have, for a
    #: tree of large files that never change (None: the kernel's default, 128 KiB).
    #: See :func:`bootseer.fuse.mount.set_read_ahead`.
    read_ahead_kb: int | None = None

    @abc.abstractmethod
    async def lookup(self, name: str) -> Node:
        """The child called ``name``; :class:`FileNotFoundError` if there is none."""

    @abc.abstractmethod
    async def entries(self) -> Sequence[tuple[str, Node]]:
        """All children, in a stable order (``.`` and ``..`` are added by the caller)."""


class OpenFile(abc.ABC):
    """A file opened by the kernel; one per ``open()``, so per-handle state (such as
    sequential-read detection) belongs here."""

    #: Let the kernel keep this file's page cache across opens: only for content
    #: that cannot change while its node's key stays the same.
    keep_cache: bool = False
    #: Bypass the page cache entirely (for content whose size is not known).
    direct_io: bool = False

    @abc.abstractmethod
    async def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset``; fewer only at the end of the file."""

    def close(self) -> None:
        """Release what the handle holds; called once, when the kernel releases it."""


class File(Node):
    @abc.abstractmethod
    async def open(self) -> OpenFile: ...


class Symlink(Node):
    @abc.abstractmethod
    async def readlink(self) -> str: ...


# Simple in-memory nodes: a tree known up front (tests, small synthetic trees, the
# directory skeleton of an image layer whose table of contents is already loaded).

_DIR_MODE = stat.S_IFDIR | 0o555
_LINK_MODE = stat.S_IFLNK | 0o777


class BytesOpenFile(OpenFile):
    keep_cache = True

    def __init__(self, data: bytes) -> None:
        self._data = data

    async def read(self, offset: int, size: int) -> bytes:
        return self._data[offset : offset + size]


class BytesFile(File):
    """A regular file whose whole content is held in memory."""

    def __init__(self, key: Hashable, data: bytes, *, mode: int = 0o444, mtime_ns: int = 0) -> None:
        self.key = key
        self.data = data
        self._attributes = Attributes(stat.S_IFREG | mode, size=len(data), mtime_ns=mtime_ns)

    def attributes(self) -> Attributes:
        return self._attributes

    async def open(self) -> OpenFile:
        return BytesOpenFile(self.data)


class StaticSymlink(Symlink):
    def __init__(self, key: Hashable, target: str, *, mtime_ns: int = 0) -> None:
        self.key = key
        self.target = target
        self._attributes = Attributes(_LINK_MODE, size=len(target.encode()), mtime_ns=mtime_ns)

    def attributes(self) -> Attributes:
        return self._attributes

    async def readlink(self) -> str:
        return self.target


class StaticDirectory(Directory):
    """A directory whose children are given up front (names in insertion order)."""

    def __init__(self, key: Hashable, children: Mapping[str, Node] | None = None, *, mtime_ns: int = 0) -> None:
        self.key = key
        self.children: dict[str, Node] = dict(children or {})
        self._attributes = Attributes(_DIR_MODE, nlink=2, mtime_ns=mtime_ns)

    def attributes(self) -> Attributes:
        return self._attributes

    async def lookup(self, name: str) -> Node:
        try:
            return self.children[name]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", name) from None

    async def entries(self) -> Sequence[tuple[str, Node]]:
        return list(self.children.items())
