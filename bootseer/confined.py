"""Confined file access beneath a directory an adversary controls (a container's writable layer, a prefix).

Whoever runs in a container (or installs into a prefix) can put a symlink, a device or
a FIFO under any name there, and swap one for another at any moment
(``renameat2(RENAME_EXCHANGE)`` keeps every name present).  Root must therefore never
resolve a path inside such a directory: everything here works from a **directory file
descriptor** held on it and

* opens a relative path beneath it with Linux ``openat2(2)`` and ``RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`` (no symlink followed
  anywhere, no ``..`` out, no other filesystem); where the kernel has no ``openat2``
  (ENOSYS, before 5.6; or EPERM from a seccomp filter older than it) it walks component
  by component with ``O_NOFOLLOW|O_DIRECTORY``, each on the same filesystem;
* scans a tree by directory descriptors (:func:`walk`: ``fstatat`` without following,
  each directory entered checked to be the one the scan saw);
* opens a file for reading only after ``fstat`` of an ``O_PATH`` descriptor says it is
  the regular file the scan saw (device, inode, size): a symlink, a device or another
  file in its place is :class:`NotAsScanned`, and nothing was read (:func:`open_as_scanned`);
* writes a small file atomically (temp name made ``O_CREAT|O_EXCL|O_NOFOLLOW``, then
  ``renameat``, which replaces a symlink in the way rather than following it), making
  its directory first if missing; a symlink where a directory belongs is an error
  (ELOOP/ENOTDIR), never followed (:func:`write_file`, :func:`make_dirs`).

Paths given to these functions are relative, ``/``-separated, without ``.``, ``..`` or
empty components (a ValueError otherwise: they are ours, not the adversary's).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from bootseer.log import get_logger

log = get_logger(__name__)

_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV
_SYS_OPENAT2 = 437  # the same number on every architecture (the generic syscall table, Linux 5.6)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
#: False once the kernel said ENOSYS (or a test asks for the component walk).
use_openat2 = True


class NotAsScanned(OSError):
    """An entry is no longer what the scan saw (another type, device, inode or size): refuse, read nothing."""


def _components(relpath: str) -> list[str]:
    if relpath in ("", "."):
        return []
    parts = relpath.split("/")
    if relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a plain relative path: {relpath!r}")
    return parts


def _openat2(dir_fd: int, relpath: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags=flags | os.O_CLOEXEC, mode=mode if flags & os.O_CREAT else 0, resolve=_RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(relpath), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))  # fmt: skip
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), relpath)
    return int(fd)


def _walk_open(dir_fd: int, parts: list[str], flags: int, mode: int) -> int:
    """The fallback: each directory opened ``O_NOFOLLOW|O_DIRECTORY`` from the last, on the same filesystem."""
    device = os.fstat(dir_fd).st_dev
    current = dir_fd
    try:
        for part in parts[:-1]:
            child = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            if current != dir_fd:
                os.close(current)
            current = child
            if os.fstat(current).st_dev != device:
                raise OSError(errno.EXDEV, "another filesystem is mounted in the path", part)
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
        if os.fstat(fd).st_dev != device:
            os.close(fd)
            raise OSError(errno.EXDEV, "another filesystem is mounted in the path", parts[-1])
        return fd
    finally:
        if current != dir_fd:
            os.close(current)


def _filtered(dir_fd: int) -> bool:
    """Whether openat2 itself is refused (EPERM for the directory itself: a seccomp filter that predates it)."""
    try:
        os.close(_openat2(dir_fd, ".", os.O_PATH | os.O_DIRECTORY, 0))
    except OSError as exc:
        return exc.errno == errno.EPERM
    return False


def open_beneath(dir_fd: int, relpath: str, flags: int, mode: int = 0o644) -> int:
    """Open ``relpath`` beneath ``dir_fd`` following no symlink (ELOOP), leaving neither it nor its filesystem.

    ``""`` opens the directory itself again.  With ``O_PATH|O_NOFOLLOW`` a symlink as the
    last component gives a descriptor of the link itself (fstat says so).
    """
    global use_openat2
    parts = _components(relpath)
    if not parts:
        return os.open(".", flags | os.O_CLOEXEC, dir_fd=dir_fd)
    if use_openat2:
        try:
            return _openat2(dir_fd, relpath, flags, mode)
        except OSError as exc:
            if exc.errno != errno.ENOSYS and not (exc.errno == errno.EPERM and _filtered(dir_fd)):
                raise
            use_openat2 = False
            log.info("the kernel has no openat2: confined opens walk the path component by component")
    return _walk_open(dir_fd, parts, flags, mode)


def open_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor of the directory ``path`` (ours: a snapshot's upper dir, a prefix); its last component
    must not be a symlink (ELOOP/ENOTDIR)."""
    return os.open(path, _DIR_FLAGS)


@contextlib.contextmanager
def opened_dir(path: str | os.PathLike[str]) -> Iterator[int]:
    """:func:`open_dir` as a context manager."""
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def open_dir_beneath(dir_fd: int, relpath: str) -> int:
    """A descriptor (``O_PATH``) of the directory ``relpath`` beneath ``dir_fd``; ELOOP/ENOTDIR if it is not one."""
    return open_beneath(dir_fd, relpath, os.O_PATH | os.O_DIRECTORY)


def lstat_beneath(dir_fd: int, relpath: str) -> os.stat_result:
    """What ``lstat`` says of ``relpath`` beneath ``dir_fd`` (its parents resolved confined, the entry not followed)."""
    parent, _, name = relpath.rpartition("/")
    if not name:
        return os.fstat(dir_fd)
    _components(relpath)
    parent_fd = open_dir_beneath(dir_fd, parent) if parent else dir_fd
    try:
        return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    finally:
        if parent_fd != dir_fd:
            os.close(parent_fd)


def exists_beneath(dir_fd: int, relpath: str, kind: int | None = None) -> bool:
    """Whether ``relpath`` is beneath ``dir_fd`` (of ``stat.S_IFMT`` ``kind`` if given); a symlink in a parent: False."""
    try:
        st = lstat_beneath(dir_fd, relpath)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV):
            return False
        raise
    return kind is None or stat.S_IFMT(st.st_mode) == kind


def xattrs_beneath(dir_fd: int, relpath: str) -> dict[str, bytes]:
    """The extended attributes of the entry ``relpath`` (itself, never what a symlink names); {} if it has none.

    Through ``/proc/self/fd/<parent>/<name>`` with ``l*xattr``: the parent is the directory
    the descriptor holds, the name one component not followed.
    """
    parent, _, name = relpath.rpartition("/")
    parent_fd = open_dir_beneath(dir_fd, parent) if parent else dir_fd
    try:
        path = f"/proc/self/fd/{parent_fd}/{name}" if name else f"/proc/self/fd/{parent_fd}"
        try:
            names = os.listxattr(path, follow_symlinks=not name)
        except OSError:
            return {}
        out = {}
        for attr in names:
            try:
                out[attr] = os.getxattr(path, attr, follow_symlinks=not name)
            except OSError:
                continue
        return out
    finally:
        if parent_fd != dir_fd:
            os.close(parent_fd)


@dataclass(frozen=True)
class Seen:
    """What a scan saw of a regular file: what the file opened later must still be."""

    dev: int
    ino: int
    size: int


def open_as_scanned(dir_fd: int, relpath: str, seen: Seen) -> int:
    """A read-only descriptor of the regular file ``relpath`` beneath ``dir_fd``, which must be ``seen``.

    It is first opened ``O_PATH`` (no open of a device or FIFO happens) and ``fstat``-ed;
    only the regular file the scan saw is then reopened for reading, through its own
    descriptor.  :class:`NotAsScanned` otherwise (nothing read).
    """
    handle = open_beneath(dir_fd, relpath, os.O_PATH | os.O_NOFOLLOW)
    try:
        st = os.fstat(handle)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino, st.st_size) != (seen.dev, seen.ino, seen.size):
            raise NotAsScanned(errno.ESTALE, f"not the file the scan saw ({_describe(st)})", relpath)
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(handle)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (seen.dev, seen.ino):  # cannot happen: the descriptor named that inode
        os.close(fd)
        raise NotAsScanned(errno.ESTALE, "not the file the scan saw", relpath)
    return fd


def _describe(st: os.stat_result) -> str:
    kind = {stat.S_IFLNK: "a symlink", stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory"}.get(
        stat.S_IFMT(st.st_mode), "a special file")
    return f"now {kind}, inode {st.st_ino}, {st.st_size} bytes"


def walk(dir_fd: int, *, exclude: Iterable[str] = (),
         on_entry: Callable[[str, os.stat_result, int], None]) -> None:  # fmt: skip
    """Every entry beneath ``dir_fd``, by directory descriptors: ``on_entry(relpath, lstat, parent_fd)``.

    ``parent_fd`` holds the entry's directory while the call runs (for ``readlink``,
    ``fstatat`` by name).  ``exclude``: relative paths neither reported nor entered.
    Directories of another filesystem are reported but not entered (left out of the
    scan by a caller that wants); a directory swapped between its ``lstat`` and its
    opening is :class:`NotAsScanned`.
    """
    excluded = set(exclude)
    top = os.fstat(dir_fd)
    pending: list[tuple[str, int]] = [("", os.dup(dir_fd))]
    try:
        while pending:
            rel, fd = pending.pop()
            try:
                with os.scandir(fd) as entries:
                    names = [entry.name for entry in entries]
                for name in names:
                    path = f"{rel}/{name}" if rel else name
                    if path in excluded:
                        continue
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # gone since the readdir: the rescan that follows a capture sees it too
                    on_entry(path, st, fd)
                    if not stat.S_ISDIR(st.st_mode) or st.st_dev != top.st_dev:
                        continue
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    now = os.fstat(child)
                    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                        os.close(child)
                        raise NotAsScanned(errno.ESTALE, "a directory was replaced while it was scanned", path)
                    pending.append((path, child))
            finally:
                os.close(fd)
    finally:
        for _, fd in pending:
            os.close(fd)


def make_dirs(dir_fd: int, relpath: str, mode: int = 0o755) -> int:
    """A descriptor of the directory ``relpath`` beneath ``dir_fd``, made (with its parents) where missing.

    A symlink, or anything else but a directory, where one belongs is an error
    (ELOOP/ENOTDIR/EEXIST), never followed.  A directory made here gets ``mode``
    exactly (set through its descriptor, past the umask).
    """
    current = os.dup(dir_fd)
    try:
        for part in _components(relpath):
            made = False
            try:
                os.mkdir(part, mode, dir_fd=current)
                made = True
            except FileExistsError:
                pass
            child = os.open(part, _DIR_FLAGS, dir_fd=current)
            os.close(current)
            current = child
            if made:
                os.fchmod(current, mode)
        return os.dup(current)
    finally:
        os.close(current)


def write_file(dir_fd: int, relpath: str, data: bytes, *, mode: int = 0o644, dir_mode: int = 0o755) -> None:
    """Write ``data`` as the file ``relpath`` beneath ``dir_fd``, whole or not at all.

    Its directory is made where missing (:func:`make_dirs`); a temp name is created
    ``O_CREAT|O_EXCL|O_NOFOLLOW``, written, given ``mode``, and renamed over the name
    (a symlink there is replaced, not followed; a directory there is an error).
    """
    parent, _, name = relpath.rpartition("/")
    if not name:
        raise ValueError(f"not a file path: {relpath!r}")
    _components(relpath)
    directory = make_dirs(dir_fd, parent, dir_mode)
    temp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        try:
            os.rename(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def read_small(dir_fd: int, relpath: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``relpath`` beneath ``dir_fd``; None if it is missing or not
    a regular file (a symlink, a FIFO, a device: never opened for reading)."""
    try:
        handle = open_beneath(dir_fd, relpath, os.O_PATH | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV):
            return None
        raise
    try:
        st = os.fstat(handle)
        if not stat.S_ISREG(st.st_mode):
            return None
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(handle)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


__all__ = ["NotAsScanned", "Seen", "exists_beneath", "lstat_beneath", "make_dirs", "open_as_scanned", "open_beneath",
           "open_dir", "open_dir_beneath", "opened_dir", "read_small", "walk", "write_file", "xattrs_beneath"]
