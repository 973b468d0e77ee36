"""pyfuse3 request handlers for a read-only tree of :mod:`bootseer.fuse.nodes`.

:class:`ReadOnlyOperations` turns kernel requests into node calls and node results
into replies.  Every handler maps failures to an errno: :class:`OSError` keeps its
own, anything else is logged and answered with EIO.  That mapping matters beyond
politeness: pyfuse3 lets any other exception escape its main loop, which would take
the whole mount down over one bad read.  Requests that would modify the tree are
answered with EROFS (the ``ro`` mount option makes the kernel refuse most of them
before they get here).

Extended attributes come from :meth:`Node.xattrs` (a missing one is ENODATA, which
is what overlayfs expects when it asks a lower directory for
``trusted.overlay.opaque`` and finds none).  A lookup of a missing name in an
:attr:`~bootseer.fuse.nodes.Directory.immutable` directory is answered with a
negative entry the kernel keeps for ``negative_timeout`` seconds.

A start-up sends tens of thousands of requests, each a round trip through pyfuse3's
loop (most of its cost outside these handlers), so the cheapest
request is one the kernel stops sending: ``flush`` is answered ENOSYS once and never
comes again.  The rest are answered with as little as possible on top: labelled
metric children looked up once, expected errors neither logged nor formatted unless
debug logging is on.
"""

from __future__ import annotations

import contextvars
import errno
import functools
import logging
import os
import time
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import prometheus_client
import pyfuse3

from bootseer.fuse.inodes import InodeTable
from bootseer.fuse.nodes import Attributes, Directory, File, Node, OpenFile, Symlink
from bootseer.log import get_logger

log = get_logger(__name__)

REQUESTS = prometheus_client.Counter(
    "bootseer_fuse_requests_total", "FUSE requests handled, by filesystem and operation", ["fs", "op"]
)
ERRORS = prometheus_client.Counter(
    "bootseer_fuse_errors_total", "FUSE requests answered with an error, by errno name", ["fs", "op", "errno"]
)
READ_BYTES = prometheus_client.Counter("bootseer_fuse_read_bytes_total", "Bytes returned to FUSE reads", ["fs"])
READ_SECONDS = prometheus_client.Histogram(
    "bootseer_fuse_read_seconds",
    "Time to answer one FUSE read",
    ["fs"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
)
OPEN_FILES = prometheus_client.Gauge("bootseer_fuse_open_files", "Files open through FUSE", ["fs"])

# Errors that are part of normal use and not worth more than a debug line.
_EXPECTED_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EROFS, errno.EINVAL, errno.ENODATA}

#: The pid of the process whose ``open`` is being answered, set before ``File.open()`` runs.
#: pyfuse3 (3.5) gives ``read`` no request context (its ``fuse_read`` never asks libfuse for
#: it), so no read can learn its own caller: hot-list recording attributes a layer file's reads
#: to its opener, and a layer blob's to the opener unless that is the layer server itself
#: (``blockstore.datapath.tree.LayerBlobOpenFile``).
OPENER_PID: contextvars.ContextVar[int] = contextvars.ContextVar("bootseer_fuse_opener_pid", default=0)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


# OSError subclasses raised without an errno (``FileNotFoundError(path)``) still mean one.
_ERRNO_OF_TYPE: list[tuple[type[OSError], int]] = [
    (FileNotFoundError, errno.ENOENT),
    (NotADirectoryError, errno.ENOTDIR),
    (IsADirectoryError, errno.EISDIR),
    (PermissionError, errno.EACCES),
    (FileExistsError, errno.EEXIST),
    (TimeoutError, errno.ETIMEDOUT),
]


def errno_of(exc: BaseException) -> int:
    """The errno a failed request answers with: an OSError's own, EIO otherwise."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, OSError):
        if exc.errno:
            return exc.errno
        for kind, code in _ERRNO_OF_TYPE:
            if isinstance(exc, kind):
                return code
    return errno.EIO


def _loggable(args: tuple[Any, ...]) -> str:
    """Request arguments for a log line, without pyfuse3's opaque context objects."""
    shown = [a for a in args if not isinstance(a, (pyfuse3.RequestContext, pyfuse3.ReaddirToken))]
    return " ".join(os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in shown)


def _handler(op: str) -> Callable[[Handler], Handler]:
    """Count the request and turn whatever it raises into a :class:`pyfuse3.FUSEError`.

    Every request of a start-up passes through here (tens of thousands of them), so
    the success path costs one counter increment on a cached labelled child, and an
    expected error (ENOENT, ENODATA: overlayfs probes lower layers for its xattrs on
    every directory) costs one more and no log formatting unless debug is on.
    """

    def decorate(method: Handler) -> Handler:
        @functools.wraps(method)
        async def wrapper(self: ReadOnlyOperations, *args: Any) -> Any:
            self._count(op)
            try:
                return await method(self, *args)
            except Exception as exc:  # trio.Cancelled is a BaseException and passes
                code = errno_of(exc)
                self._count_error(op, code)
                if not isinstance(exc, (OSError, pyfuse3.FUSEError)):
                    log.error("request failed", fs=self.name, op=op, args=_loggable(args), exc_info=exc)
                elif code in _EXPECTED_ERRNOS:
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("request failed", fs=self.name, op=op, args=_loggable(args), error=str(exc))
                else:
                    log.warning("request failed", fs=self.name, op=op, args=_loggable(args), error=str(exc))
                if isinstance(exc, pyfuse3.FUSEError):
                    raise
                raise pyfuse3.FUSEError(code) from None

        return wrapper  # type: ignore[return-value]

    return decorate


def _read_only(op: str) -> Callable[..., Awaitable[Any]]:
    async def refuse(self: ReadOnlyOperations, *args: Any) -> Any:
        raise OSError(errno.EROFS, f"{op}: read-only filesystem")

    refuse.__name__ = op
    return _handler(op)(refuse)


class ReadOnlyOperations(pyfuse3.Operations):
    """Serve the tree under ``root`` read-only.

    ``name`` labels logs and metrics.  ``entry_timeout`` and ``attr_timeout`` are how
    long the kernel may trust a name lookup and a node's attributes without asking
    again; they bound how late a change at the source is seen.  ``negative_timeout``
    is how long it may trust that a name is missing from an immutable directory (0:
    never cached).  ``statfs`` supplies what ``df`` shows (all zero by default: the
    size of a remote tree is unknown).
    """

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        root: Directory,
        *,
        name: str,
        entry_timeout: float = 1.0,
        attr_timeout: float = 1.0,
        negative_timeout: float = 0.0,
        block_size: int = 1 << 20,
        statfs: Callable[[], pyfuse3.StatvfsData] | None = None,
        read_ahead_kb: int | None = None,
    ) -> None:
        super().__init__()
        if read_ahead_kb is not None and read_ahead_kb <= 0:
            raise ValueError(f"read_ahead_kb must be positive, not {read_ahead_kb}")
        self.name = name
        #: The mount's read-ahead in KiB (default: the root's
        #: :attr:`~bootseer.fuse.nodes.Directory.read_ahead_kb`), set by
        #: :func:`~bootseer.fuse.mount.serve` once the kernel has the session
        #: (None: the kernel's default, 128 KiB).
        self.read_ahead_kb = read_ahead_kb if read_ahead_kb is not None else root.read_ahead_kb
        self.inodes = InodeTable(root)
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.negative_timeout = negative_timeout
        self.block_size = block_size
        self._statfs = statfs
        self._files: dict[int, OpenFile] = {}
        self._listings: dict[int, tuple[int, Sequence[tuple[str, Node]]]] = {}
        self._next_handle = 1
        # Labelled children, looked up once: labels() takes a lock and builds a key.
        self._requests: dict[str, prometheus_client.Counter] = {}
        self._errors: dict[tuple[str, int], prometheus_client.Counter] = {}
        self._read_seconds = READ_SECONDS.labels(name)
        self._read_bytes = READ_BYTES.labels(name)
        self._open_files = OPEN_FILES.labels(name)

    def _count(self, op: str) -> None:
        counter = self._requests.get(op)
        if counter is None:
            counter = self._requests[op] = REQUESTS.labels(self.name, op)
        counter.inc()

    def _count_error(self, op: str, code: int) -> None:
        counter = self._errors.get((op, code))
        if counter is None:
            counter = self._errors[op, code] = ERRORS.labels(self.name, op, errno.errorcode.get(code, str(code)))
        counter.inc()

    # -- attributes and names -------------------------------------------------

    def _entry(self, number: int, attributes: Attributes) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = number
        entry.generation = 0
        entry.entry_timeout = self.entry_timeout
        entry.attr_timeout = self.attr_timeout
        entry.st_mode = attributes.mode
        entry.st_nlink = attributes.nlink
        entry.st_uid = attributes.uid
        entry.st_gid = attributes.gid
        entry.st_rdev = attributes.rdev
        entry.st_size = attributes.size
        entry.st_blksize = self.block_size
        entry.st_blocks = (attributes.size + 511) // 512
        entry.st_atime_ns = entry.st_ctime_ns = entry.st_mtime_ns = attributes.mtime_ns
        return entry

    def _directory(self, number: int) -> Directory:
        node = self.inodes.node(number)
        if not isinstance(node, Directory):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        return node

    @_handler("lookup")
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        text = os.fsdecode(name)
        if text in (".", ".."):
            number = parent_inode if text == "." else self.inodes.parent(parent_inode)
            node, parent = self.inodes.node(number), self.inodes.parent(number)
        else:
            directory = self._directory(parent_inode)
            try:
                node, parent = await directory.lookup(text), parent_inode
            except FileNotFoundError:
                if not (directory.immutable and self.negative_timeout > 0):
                    raise
                # Inode 0 is a negative entry: the kernel remembers the name is missing.
                missing = pyfuse3.EntryAttributes()
                missing.st_ino = 0
                missing.entry_timeout = self.negative_timeout
                return missing
        return self._entry(self.inodes.reference(node, parent), node.attributes())

    @_handler("forget")
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for number, count in inode_list:
            log.debug("forget", inode=number, count=count)
            self.inodes.forget(number, count)

    @_handler("getattr")
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(inode, self.inodes.node(inode).attributes())

    @_handler("readlink")
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.inodes.node(inode)
        if not isinstance(node, Symlink):
            raise OSError(errno.EINVAL, "not a symlink")
        return os.fsencode(await node.readlink())

    @_handler("access")
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        self.inodes.node(inode)
        if mode & os.W_OK:
            raise OSError(errno.EROFS, "read-only filesystem")
        return True

    @_handler("statfs")
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        if self._statfs is not None:
            return self._statfs()
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = self.block_size
        data.f_namemax = 255
        return data

    @_handler("getxattr")
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # Most answers are "none": overlayfs asks every lower directory it looks up
        # for trusted.overlay.opaque and .redirect.  The kernel caches no xattr
        # answer, and refusing getxattr altogether (ENOSYS) would stop it for the
        # whole mount, opaque directories included; so answer that cheaply.
        xattrs = self.inodes.node(inode).xattrs()
        value = xattrs.get(os.fsdecode(name)) if xattrs else None
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @_handler("listxattr")
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return [os.fsencode(name) for name in self.inodes.node(inode).xattrs()]

    # -- directories ------------------------------------------------------------

    def _new_handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    @_handler("opendir")
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        directory = self._directory(inode)
        # A snapshot per handle: offsets handed to the kernel stay valid across the
        # several readdir calls a large directory needs, even if the tree changes.
        # The kernel ignores the attributes of "." and "..", so the directory's own do.
        listing = [(".", directory), ("..", directory), *await directory.entries()]
        handle = self._new_handle()
        self._listings[handle] = (inode, listing)
        return handle

    @_handler("readdir")
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        inode, listing = self._listings[fh]
        for index in range(start_id, len(listing)):
            name, node = listing[index]
            if index == 0:
                number = inode
            elif index == 1:
                number = self.inodes.parent(inode)
            else:
                number = self.inodes.number(node)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(number, node.attributes()), index + 1):
                return
            # pyfuse3 answers with readdirplus: the kernel takes a reference to every
            # entry it is given, except "." and "..".
            if index > 1:
                self.inodes.reference(node, inode)

    @_handler("releasedir")
    async def releasedir(self, fh: int) -> None:
        self._listings.pop(fh, None)

    # -- files --------------------------------------------------------------------

    @_handler("open")
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise OSError(errno.EROFS, "read-only filesystem")
        node = self.inodes.node(inode)
        if isinstance(node, Directory):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        if not isinstance(node, File):
            raise OSError(errno.EINVAL, "not a regular file")
        OPENER_PID.set(ctx.pid)
        opened = await node.open()
        handle = self._new_handle()
        self._files[handle] = opened
        self._open_files.inc()
        return pyfuse3.FileInfo(fh=handle, keep_cache=opened.keep_cache, direct_io=opened.direct_io)

    @_handler("read")
    async def read(self, fh: int, off: int, size: int) -> bytes:
        started = time.monotonic()
        data = await self._files[fh].read(off, size)
        self._read_seconds.observe(time.monotonic() - started)
        self._read_bytes.inc(len(data))
        return data

    async def flush(self, fh: int) -> None:
        """Answer ENOSYS: nothing is ever written, so a flush (sent on every close())
        has nothing to do, and on ENOSYS the kernel stops sending it for the rest of
        the session (``fc->no_flush``), one request fewer per open.  Counted as a
        request, not as an error: it is the one flush a mount ever sees."""
        self._count("flush")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_handler("release")
    async def release(self, fh: int) -> None:
        opened = self._files.pop(fh, None)
        if opened is not None:
            self._open_files.dec()
            opened.close()

    @property
    def open_files(self) -> int:
        """Files open through the mount now."""
        return len(self._files)

    def close_all(self) -> None:
        """Close every handle still open (the session is over; no release will come)."""
        while self._files:
            _handle, opened = self._files.popitem()
            self._open_files.dec()
            opened.close()
        self._listings.clear()

    # -- everything that would write ------------------------------------------------

    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    write = _read_only("write")
    create = _read_only("create")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")
