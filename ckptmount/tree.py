"""The checkpoint source's tree as FUSE nodes, read through the fetch engine.

Directory listings come from the engine and are kept for ``listing_ttl`` seconds,
and a file's ``stat`` is its entry in its directory's listing, so ``ls -l`` on a
directory of shards costs one listing at the source, not one request per file.
Concurrent requests for the same listing share one fetch.  If the source fails
while a listing is being refreshed, the previous listing is served for another TTL
(a checkpoint does not change under a job that reads it) and the failure is logged.

Every open file gets its own engine :class:`Reader`, so the engine detects
sequential reads per open file and grows that file's read-ahead on its own.

A file node's key holds its version (the source's content validator from the
listing), size and mtime: a file replaced or rewritten at the source, even at the
same size and mtime, becomes a new inode, and the kernel never mixes its cached
pages with the old version's.  Its reader is pinned to that version too, so a read
that reaches the source after a change fails with EIO instead of mixing versions.
Such a read also tells the tree (:meth:`CheckpointTree.version_gone`): the listing
of its directory expires, so the next lookup sees the new version, and the mount's
``on_version_gone`` hook drops the kernel's cached pages and name of the old one.

Each open looks for the file's digest list beside it (``NAME.bootseer-digests``, read from the
source itself: :meth:`Engine.find_digests <bootseer.fetch.engine.Engine.find_digests>`); with one
that matches the file's size and version, the reader verifies every stripe it serves against it,
and a chunk that fails twice is EIO, never served.  The list of a single-file mount's file lies
beside the source URL, at ``digest_source``.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence
from urllib.parse import unquote, urlsplit

import trio

from bootseer.fetch.source import Changed, Entry, NotADirectory, NotFound, SourceError
from bootseer.fuse import Attributes, Directory, File, Node, OpenFile, StaticDirectory
from bootseer.log import get_logger

if TYPE_CHECKING:
    from bootseer.fetch.digests import DigestList
    from bootseer.fetch.engine import Engine
    from bootseer.fetch.source import RangeSource
    from bootseer.fetch.reader import Reader

log = get_logger(__name__)

# Listings kept beyond this many are pruned of expired ones.
_MAX_LISTINGS = 4096


@contextmanager
def source_errors(what: str) -> Iterator[None]:
    """Turn a backend's :class:`SourceError` into the OSError the kernel should see."""
    try:
        yield
    except NotFound as exc:
        raise FileNotFoundError(errno.ENOENT, str(exc), what) from exc
    except NotADirectory as exc:
        raise NotADirectoryError(errno.ENOTDIR, str(exc), what) from exc
    except SourceError as exc:
        raise OSError(errno.EIO, str(exc), what) from exc


def caused_by_change(exc: BaseException) -> bool:
    """Whether ``exc`` (a FetchError, say) comes of a file that changed at the source."""
    seen: BaseException | None = exc
    for _depth in range(16):  # a cause chain is short; never loop on a cycle
        if seen is None:
            return False
        if isinstance(seen, Changed):
            return True
        seen = seen.__cause__
    return False


def mtime_ns(entry: Entry) -> int:
    return int(round(entry.mtime * 1e9))


def _child_path(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _valid_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


@dataclass
class _Listing:
    expires: float
    entries: dict[str, Entry]


class CheckpointTree:
    """Stat and listings of the source through ``engine``, cached for ``listing_ttl`` seconds."""

    def __init__(self, engine: Engine, *, listing_ttl: float, digest_source: RangeSource | None = None) -> None:
        self.engine = engine
        self.listing_ttl = listing_ttl
        #: where the digest list of the source's root lies when the root is one file (None: not looked up)
        self.digest_source = digest_source
        self._listings: dict[str, _Listing] = {}
        self._fetching: dict[str, trio.Event] = {}
        # Files belong to whoever mounted them (the source's owners mean nothing here).
        self.uid, self.gid = os.getuid(), os.getgid()
        #: called with a file node whose version is gone at the source (the mount drops
        #: the kernel's cached pages and dentry of it); None: nothing beyond the listing
        self.on_version_gone: Callable[[CheckpointFile], None] | None = None

    def version_gone(self, node: CheckpointFile) -> None:
        """A read of ``node`` found its version gone at the source: expire its directory's
        listing, so the next lookup gets the new version (a new inode), and tell the mount."""
        parent = node.path.rpartition("/")[0]
        listing = self._listings.get(parent)
        if listing is not None and listing.entries.get(node.path.rpartition("/")[2]) is node.entry:
            del self._listings[parent]  # only if it still lists the gone version
        log.warning("file changed at the source; its cached pages are dropped", path=node.path or ".")
        if self.on_version_gone is not None:
            self.on_version_gone(node)

    async def listing(self, path: str) -> dict[str, Entry]:
        """The entries of directory ``path`` by name."""
        while True:
            cached = self._listings.get(path)
            if cached is not None and cached.expires > trio.current_time():
                return cached.entries
            fetching = self._fetching.get(path)
            if fetching is None:
                break
            await fetching.wait()  # then use its result, or fetch again if it failed
        done = self._fetching[path] = trio.Event()
        try:
            with source_errors(path or "."):
                listed = await self.engine.listdir(path)
        except OSError as exc:
            if cached is None or exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise
            log.warning("listing failed, serving the previous one", path=path or ".", error=str(exc))
            # For another TTL: during an outage every refresh waits out the retry timeout.
            self._remember(path, cached.entries)
            return cached.entries
        finally:
            del self._fetching[path]
            done.set()
        entries = {entry.name: entry for entry in listed if _valid_name(entry.name)}
        self._remember(path, entries)
        return entries

    def _remember(self, path: str, entries: dict[str, Entry]) -> None:
        now = trio.current_time()
        if len(self._listings) >= _MAX_LISTINGS:
            for stale in [p for p, listing in self._listings.items() if listing.expires <= now]:
                del self._listings[stale]
        self._listings[path] = _Listing(now + self.listing_ttl, entries)

    async def digests(self, path: str, entry: Entry) -> DigestList | None:
        """The digest list to verify reads of ``path`` (``entry``) against, or None (see the module)."""
        if path:
            return await self.engine.find_digests(path, entry)
        if self.digest_source is None:
            return None
        return await self.engine.find_digests(path, entry, source=self.digest_source, list_path="")

    def node(self, path: str, entry: Entry) -> Node:
        if entry.is_dir:
            return CheckpointDirectory(self, path, entry)
        return CheckpointFile(self, path, entry)

    async def root(self, url: str) -> Directory:
        """The mount's root: the source's root directory, or a directory holding the
        one file the source URL names."""
        with source_errors("."):
            entry = await self.engine.stat("")
        if entry.is_dir:
            return CheckpointDirectory(self, "", entry)
        name = file_name_of(url)
        return StaticDirectory(("root", name), {name: CheckpointFile(self, "", entry)}, mtime_ns=mtime_ns(entry))


def file_name_of(url: str) -> str:
    """The last path component of a source URL (what a single-file mount shows)."""
    path = urlsplit(url).path if "://" in url else url
    name = unquote(path.rstrip("/").rsplit("/", 1)[-1])
    return name if _valid_name(name) else "data"


class CheckpointDirectory(Directory):
    def __init__(self, tree: CheckpointTree, path: str, entry: Entry) -> None:
        self.key = ("dir", path)
        self.tree = tree
        self.path = path
        self._attributes = Attributes(
            stat.S_IFDIR | 0o555, nlink=2, mtime_ns=mtime_ns(entry), uid=tree.uid, gid=tree.gid
        )

    def attributes(self) -> Attributes:
        return self._attributes

    async def lookup(self, name: str) -> Node:
        entry = (await self.tree.listing(self.path)).get(name)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", _child_path(self.path, name))
        return self.tree.node(_child_path(self.path, name), entry)

    async def entries(self) -> Sequence[tuple[str, Node]]:
        listing = await self.tree.listing(self.path)
        return [(name, self.tree.node(_child_path(self.path, name), listing[name])) for name in sorted(listing)]


class CheckpointFile(File):
    def __init__(self, tree: CheckpointTree, path: str, entry: Entry) -> None:
        self.key = ("file", path, entry.size, mtime_ns(entry), entry.version)
        self.tree = tree
        self.entry = entry
        self.engine = tree.engine
        self.path = path
        self.size = entry.size
        self.mtime = entry.mtime
        self.version = entry.version
        self._attributes = Attributes(
            stat.S_IFREG | 0o444, size=entry.size, mtime_ns=mtime_ns(entry), uid=tree.uid, gid=tree.gid
        )

    def attributes(self) -> Attributes:
        return self._attributes

    async def open(self) -> OpenFile:
        digests = await self.tree.digests(self.path, self.entry)
        with source_errors(self.path):
            reader = self.engine.open(self.path, self.size, self.mtime, self.version, digests)
        return CheckpointOpenFile(reader, self.path, self.size, self)


class CheckpointOpenFile(OpenFile):
    # The inode's key pins the version and the reader reads only that version (the
    # source refuses reads of another), so cached pages of this inode stay right
    # across opens; a new version is a new inode with a page cache of its own.
    keep_cache = True

    def __init__(self, reader: Reader, path: str, size: int, node: CheckpointFile | None = None) -> None:
        self.reader = reader
        self.path = path
        self.size = size
        self.node = node

    async def read(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        try:
            with source_errors(self.path):
                data = await self.reader.read(offset, size)
        except OSError as exc:
            if self.node is not None and caused_by_change(exc):
                self.node.tree.version_gone(self.node)
            raise
        if len(data) != size:
            # The file is shorter than its listing said: it changed at the source.
            # Failing is the only answer that serves no wrong byte.
            raise OSError(errno.EIO, f"short read: {len(data)} of {size} bytes at {offset}", self.path)
        return data

    def close(self) -> None:
        self.reader.close()
