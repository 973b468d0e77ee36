"""The local backend: a directory or file on a local disk, NFS or Lustre mount.

Range reads are ``os.pread`` calls on file descriptors that each
:class:`LocalConnection` opens and keeps for itself, so parallel streams never
share an fd offset or a lock, and a broken connection (an NFS handle gone stale)
is thrown away with all its fds.

The source never exposes a file outside its root: every path is resolved with
its symlinks and refused (PermanentError) if it lands outside, and an opened fd
is checked again through ``/proc/self/fd`` so that swapping a directory for a
symlink between the check and the open gains nothing.  Symlinks that stay inside
the root are followed.  Only regular files and directories are served.

A file is pinned to the identity (device, inode, size, mtime) that :meth:`stat`
last reported for it.  A read that finds the file changed since then raises
PermanentError rather than mixing bytes of two versions into one file.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mode
import threading
from collections import OrderedDict
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from bootseer.fetch.source import Entry, NotADirectory, NotFound, PermanentError, SourceError, TransientError
from bootseer.fetch.sources import check_range, split_path
from bootseer.log import get_logger

log = get_logger(__name__)

# errno values a retry cannot fix; anything else (EIO, ESTALE, ETIMEDOUT, EMFILE...)
# may clear on a new connection, so it is transient.
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG, errno.EISDIR, errno.EINVAL}


class FileIdentity(NamedTuple):
    """What makes two opens of a path the same version of the same file."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def os_error(url: str, path: str, exc: OSError) -> SourceError:
    """Map an OSError on ``path`` to the contract's error classes."""
    message = f"{url}: {path or '.'}: {exc.strerror or exc}"
    if exc.errno == errno.ENOENT:
        return NotFound(message)
    if exc.errno == errno.ENOTDIR:
        return NotADirectory(message)
    if exc.errno in _PERMANENT_ERRNOS:
        return PermanentError(message)
    return TransientError(message)


def _path_from_url(url: str) -> str:
    if "://" not in url:
        return os.path.abspath(url)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URL {url!r} names host {parts.netloc!r}; only local paths are supported")
    if parts.query or parts.fragment:
        raise ValueError(f"file URL {url!r} must not have a query or fragment")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"file URL {url!r} must carry an absolute path")
    return path


class LocalSource:
    """A tree of files under a local path (``/path`` or ``file:///path``)."""

    default_streams = 8

    def __init__(self, url: str, *, max_open_files: int = 64) -> None:
        if max_open_files < 1:
            raise ValueError(f"max_open_files must be at least 1, not {max_open_files}")
        self.url = url
        self.root = os.path.realpath(_path_from_url(url))
        self.max_open_files = max_open_files
        self._pins: dict[str, FileIdentity] = {}

    def __repr__(self) -> str:
        return f"LocalSource({self.url!r})"

    # -- path resolution -------------------------------------------------------

    def contains(self, real: str) -> bool:
        """Whether a resolved path lies at or below the root."""
        return real == self.root or real.startswith(self.root.rstrip("/") + "/")

    def resolve(self, path: str) -> str:
        """The real path that ``path`` names, refusing paths that leave the root."""
        parts = split_path(path)
        real = os.path.realpath(os.path.join(self.root, *parts))
        if not self.contains(real):
            raise PermanentError(f"{self.url}: {path}: refused, resolves to {real!r} outside the source root")
        return real

    def stat_result(self, path: str) -> os.stat_result:
        real = self.resolve(path)
        try:
            st = os.stat(real)
        except OSError as exc:
            raise os_error(self.url, path, exc) from None
        if not (stat_mode.S_ISREG(st.st_mode) or stat_mode.S_ISDIR(st.st_mode)):
            raise PermanentError(f"{self.url}: {path}: refused, not a regular file or directory")
        return st

    def pin(self, path: str) -> FileIdentity | None:
        """The identity :meth:`stat` last reported for ``path``, if any."""
        return self._pins.get(path)

    # -- RangeSource ----------------------------------------------------------

    def stat(self, path: str) -> Entry:
        st = self.stat_result(path)
        name = path.rsplit("/", 1)[-1]
        if stat_mode.S_ISDIR(st.st_mode):
            return Entry(name=name, size=0, is_dir=True, mtime=st.st_mtime)
        self._pins[path] = FileIdentity.of(st)
        return Entry(name=name, size=st.st_size, is_dir=False, mtime=st.st_mtime)

    def listdir(self, path: str) -> list[Entry]:
        st = self.stat_result(path)
        if not stat_mode.S_ISDIR(st.st_mode):
            raise NotADirectory(f"{self.url}: {path or '.'}: not a directory")
        try:
            names = sorted(os.listdir(self.resolve(path)))
        except OSError as exc:
            raise os_error(self.url, path, exc) from None
        entries = []
        for name in names:
            child = f"{path}/{name}" if path else name
            try:
                entries.append(self.stat(child))
            except NotFound:
                continue  # removed since the listing, or a dangling symlink
            except PermanentError as exc:
                # A symlink out of the root, a socket or a FIFO: hidden, not fatal to
                # the whole directory.
                log.warning("skipping entry the source refuses", url=self.url, path=child, error=str(exc))
        return entries

    def connect(self) -> LocalConnection:
        return LocalConnection(self)

    def close(self) -> None:
        self._pins.clear()


class _OpenFile(NamedTuple):
    fd: int
    identity: FileIdentity


class LocalConnection:
    """A set of fds of one stream, opened on first use and kept (LRU-bounded)."""

    def __init__(self, source: LocalSource) -> None:
        self.source = source
        self._files: OrderedDict[str, _OpenFile] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def _open(self, path: str) -> _OpenFile:
        source = self.source
        real = source.resolve(path)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang us
        try:
            fd = os.open(real, flags)
        except OSError as exc:
            raise os_error(source.url, path, exc) from None
        try:
            st = os.fstat(fd)
            if not stat_mode.S_ISREG(st.st_mode):
                raise PermanentError(f"{source.url}: {path}: refused, not a regular file")
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                opened = real  # no /proc: the realpath check above is all we have
            if not source.contains(opened):
                raise PermanentError(f"{source.url}: {path}: refused, opened {opened!r} outside the source root")
        except BaseException:
            os.close(fd)
            raise
        return _OpenFile(fd, FileIdentity.of(st))

    def _file(self, path: str) -> _OpenFile:
        """The open file for ``path``, reopened if :meth:`LocalSource.stat` saw a new version."""
        pinned = self.source.pin(path)
        cached = self._files.get(path)
        if cached is not None and (pinned is None or cached.identity == pinned):
            self._files.move_to_end(path)
            return cached
        if cached is not None:
            self._forget(path)
        opened = self._open(path)
        self._files[path] = opened
        while len(self._files) > self.source.max_open_files:
            self._forget(next(iter(self._files)))
        return opened

    def _forget(self, path: str) -> None:
        os.close(self._files.pop(path).fd)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        with self._lock:
            if self._closed:
                raise TransientError(f"{self.source.url}: {path}: connection is closed")
            opened = self._file(path)
            try:
                now = FileIdentity.of(os.fstat(opened.fd))
                pinned = self.source.pin(path) or opened.identity
                if now != pinned:
                    self._forget(path)
                    raise PermanentError(
                        f"{self.source.url}: {path}: file changed since it was stat'ed "
                        f"(size {pinned.size} -> {now.size}); refusing to mix versions"
                    )
                chunks = []
                while length > 0:
                    chunk = os.pread(opened.fd, length, offset)
                    if not chunk:
                        break  # end of file
                    chunks.append(chunk)
                    offset += len(chunk)
                    length -= len(chunk)
            except OSError as exc:
                self._forget(path)
                raise os_error(self.source.url, path, exc) from None
        return b"".join(chunks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._files:
                self._forget(next(iter(self._files)))
