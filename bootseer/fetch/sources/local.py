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

A file's :attr:`~bootseer.fetch.source.Entry.version` is ``inode:mtime_ns:ctime_ns:size``,
the same from :meth:`LocalSource.stat` and :meth:`LocalSource.listdir`.  A read
given a version checks it against ``fstat`` of the fd it reads from and raises
:class:`~bootseer.fetch.source.Changed` if the file is another one now: bytes of
two versions are never mixed into one file.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mode
import threading
from collections import OrderedDict
from urllib.parse import unquote, urlsplit

from bootseer.atomic import write_atomically
from bootseer.fetch.source import Changed, Entry, NotADirectory, NotFound, PermanentError, SourceError, TransientError
from bootseer.fetch.sources import check_range, redact_url, split_path
from bootseer.log import get_logger

log = get_logger(__name__)

# errno values a retry cannot fix; anything else (EIO, ESTALE, ETIMEDOUT, EMFILE...)
# may clear on a new connection, so it is transient.
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG, errno.EISDIR, errno.EINVAL}


def file_version(st: os.stat_result) -> str:
    """The :attr:`Entry.version` of a regular file: its inode, mtime and ctime in ns, and size.

    A rewrite in place changes the mtime, a replacement (rename over) the inode; the
    ctime catches a rewrite in place whose mtime was set back (``utime``, ``cp -p``,
    ``rsync -t``): no caller can set it.  The source root lies on one filesystem, so
    the device adds nothing.
    """
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_size}"


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
        raise ValueError(f"file URL {redact_url(url)!r} names host {parts.netloc!r}; only local paths are supported")
    if parts.query or parts.fragment:
        raise ValueError(f"file URL {redact_url(url)!r} must not have a query or fragment")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"file URL {redact_url(url)!r} must carry an absolute path")
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
        self.display_url = redact_url(url)

    def __repr__(self) -> str:
        return f"LocalSource({self.display_url!r})"

    # -- path resolution -------------------------------------------------------

    def contains(self, real: str) -> bool:
        """Whether a resolved path lies at or below the root."""
        return real == self.root or real.startswith(self.root.rstrip("/") + "/")

    def resolve(self, path: str) -> str:
        """The real path that ``path`` names, refusing paths that leave the root."""
        parts = split_path(path)
        real = os.path.realpath(os.path.join(self.root, *parts))
        if not self.contains(real):
            raise PermanentError(f"{self.display_url}: {path}: refused, resolves to {real!r} outside the source root")
        return real

    def stat_result(self, path: str) -> os.stat_result:
        real = self.resolve(path)
        try:
            st = os.stat(real)
        except OSError as exc:
            raise os_error(self.display_url, path, exc) from None
        if not (stat_mode.S_ISREG(st.st_mode) or stat_mode.S_ISDIR(st.st_mode)):
            raise PermanentError(f"{self.display_url}: {path}: refused, not a regular file or directory")
        return st

    # -- RangeSource ----------------------------------------------------------

    def stat(self, path: str) -> Entry:
        st = self.stat_result(path)
        name = path.rsplit("/", 1)[-1]
        if stat_mode.S_ISDIR(st.st_mode):
            return Entry(name=name, size=0, is_dir=True, mtime=st.st_mtime)
        return Entry(name=name, size=st.st_size, is_dir=False, mtime=st.st_mtime, version=file_version(st))

    def listdir(self, path: str) -> list[Entry]:
        st = self.stat_result(path)
        if not stat_mode.S_ISDIR(st.st_mode):
            raise NotADirectory(f"{self.display_url}: {path or '.'}: not a directory")
        try:
            names = sorted(os.listdir(self.resolve(path)))
        except OSError as exc:
            raise os_error(self.display_url, path, exc) from None
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
                log.warning("skipping entry the source refuses", url=self.display_url, path=child, error=str(exc))
        return entries

    def put(self, path: str, data: bytes) -> None:
        """Replace the file at ``path`` with ``data`` atomically (:mod:`bootseer.atomic`); its directory must exist."""
        write_atomically(self.resolve(path), data)

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        """Nothing to learn: this source reads every range from one place (see RangeSource.corrupt)."""

    def connect(self) -> LocalConnection:
        return LocalConnection(self)

    def close(self) -> None:
        pass


class LocalConnection:
    """A set of fds of one stream, opened on first use and kept (LRU-bounded)."""

    def __init__(self, source: LocalSource) -> None:
        self.source = source
        self._files: OrderedDict[str, int] = OrderedDict()  # path -> fd
        self._lock = threading.Lock()
        self._closed = False

    def _open(self, path: str) -> int:
        source = self.source
        real = source.resolve(path)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang us
        try:
            fd = os.open(real, flags)
        except OSError as exc:
            raise os_error(source.display_url, path, exc) from None
        try:
            st = os.fstat(fd)
            if not stat_mode.S_ISREG(st.st_mode):
                raise PermanentError(f"{source.display_url}: {path}: refused, not a regular file")
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                opened = real  # no /proc: the realpath check above is all we have
            if not source.contains(opened):
                raise PermanentError(
                    f"{source.display_url}: {path}: refused, opened {opened!r} outside the source root"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _file(self, path: str, version: str) -> int:
        """The fd for ``path``: the cached one, or a new open where the cached one is
        not of ``version`` (the path may name a new file now).  Without a version,
        the cached fd serves only while the path still names its file."""
        fd = self._files.get(path)
        if fd is not None:
            wanted = version or file_version(self.source.stat_result(path))
            if file_version(os.fstat(fd)) == wanted:
                self._files.move_to_end(path)
                return fd
            self._forget(path)
        fd = self._open(path)
        self._files[path] = fd
        while len(self._files) > self.source.max_open_files:
            self._forget(next(iter(self._files)))
        return fd

    def _check(self, fd: int, path: str, version: str) -> None:
        """Changed (and the fd dropped) if ``fd`` is not of ``version`` (if one is given)."""
        if not version:
            return
        found = file_version(os.fstat(fd))
        if found != version:
            self._forget(path)
            raise Changed(
                f"{self.source.display_url}: {path}: file changed (version {version} -> {found}); "
                "refusing to mix versions"
            )

    def _forget(self, path: str) -> None:
        os.close(self._files.pop(path))

    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        check_range(offset, length)
        shown = self.source.display_url
        with self._lock:
            if self._closed:
                raise TransientError(f"{shown}: {path}: connection is closed")
            try:
                fd = self._file(path, version)
                # Checked on the fd itself, before and after reading: whatever the
                # path names meanwhile, these are bytes of that inode, and a write
                # into it while we read changes its mtime.
                self._check(fd, path, version)
                chunks = []
                while length > 0:
                    chunk = os.pread(fd, length, offset)
                    if not chunk:
                        break  # end of file
                    chunks.append(chunk)
                    offset += len(chunk)
                    length -= len(chunk)
                self._check(fd, path, version)
            except OSError as exc:
                if path in self._files:
                    self._forget(path)
                raise os_error(shown, path, exc) from None
        return b"".join(chunks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._files:
                self._forget(next(iter(self._files)))
