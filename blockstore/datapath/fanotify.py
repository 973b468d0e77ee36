"""The kernel's fanotify pre-content interface (Linux 6.14+), as the ``fanotify`` data path uses it.

A *pre-content* group (``FAN_CLASS_PRE_CONTENT``) that marks a file for ``FAN_PRE_ACCESS``
is asked, before any read of a byte range of that file, to make the range's content
present: the reader blocks until the group answers the event allow (the bytes are read
from the file) or deny with an errno (the read fails with it).  The event carries the
range (an info record of type 6: offset, count), the reader's pid, and a file descriptor
of the file opened for the listener without notification, so that what it writes through
that descriptor raises no event of its own.  This module is the ctypes face of it:

* :func:`init_group`, :func:`mark`, :func:`unmark`: the group and its inode marks;
* :func:`parse_events`: the events one ``read(2)`` of the group returned;
* :func:`answer`: the response to one event (:data:`ALLOW`, or :func:`deny` with an errno);
* :func:`unsupported`: why a directory's filesystem cannot carry marks (``None``: it can).

Facts this module relies on, checked on Linux 6.18 (docs/fanotify.md says more):

* Whether an open file raises pre-content events is decided when it is *opened*: a file
  opened while its inode had no pre-content mark raises none, ever.  A writer opened before
  the mark is therefore a descriptor whose writes never wait for the group.
* The response names the event by the descriptor number the *reading* process got; any
  descriptor of the group may write it.  An event read by a process that died unanswered
  stays pending until the group closes; a group that closes allows every pending and later
  read, and a hole then reads as zeros.  Hence :mod:`.event_holder`: the one reader.
* ext4 takes the mark; tmpfs, overlayfs and EROFS refuse it (EOPNOTSUPP). Other filesystems are
  not checked here: :func:`unsupported` asks the kernel.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

FAN_CLOEXEC = 0x01
FAN_NONBLOCK = 0x02
FAN_CLASS_PRE_CONTENT = 0x08
FAN_UNLIMITED_QUEUE = 0x10
FAN_MARK_ADD = 0x01
FAN_MARK_REMOVE = 0x02
FAN_PRE_ACCESS = 0x00100000
FAN_EVENT_INFO_TYPE_RANGE = 6
FAN_NOFD = -1
ALLOW = 0x01
_DENY = 0x02
#: The errnos a deny may carry (the kernel refuses any other): what a failed fill answers.
DENY_ERRNOS = frozenset({errno.EPERM, errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETXTBSY, errno.ENOSPC, errno.EDQUOT})
AT_FDCWD = -100

#: struct fanotify_event_metadata: event_len, vers, reserved, metadata_len, mask, fd, pid.
_METADATA = struct.Struct("<IBBHQii")
_INFO_HEADER = struct.Struct("<BBH")
_RANGE = struct.Struct("<QQ")  #: after the header and 4 bytes of padding
_RESPONSE = struct.Struct("<iI")
METADATA_VERSION = 3
#: What one read of the group is given: many events at once (each is 24 + 24 bytes).
READ_SIZE = 64 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = (ctypes.c_uint, ctypes.c_uint)
_libc.fanotify_mark.argtypes = (ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p)


class FanotifyError(OSError):
    """A fanotify call failed (the message names the call and the kernel's reason)."""


@dataclass(frozen=True)
class Event:
    """One pre-access event: ``fd`` (in the reading process; -1 for a queue overflow), the reader's
    ``pid`` and the byte range ``offset`` .. ``offset + count`` the read wants."""

    fd: int
    pid: int
    offset: int
    count: int
    mask: int = FAN_PRE_ACCESS


def init_group() -> int:
    """A new pre-content group's descriptor (close-on-exec, unlimited queue); FanotifyError if the kernel has none."""
    fd = _libc.fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE, os.O_RDONLY | os.O_LARGEFILE)
    if fd < 0:
        code = ctypes.get_errno()
        raise FanotifyError(code, f"fanotify_init(FAN_CLASS_PRE_CONTENT): {os.strerror(code)}")
    return fd


def _mark(group: int, flags: int, target: int | str | os.PathLike[str]) -> None:
    if isinstance(target, int):
        result = _libc.fanotify_mark(group, flags, FAN_PRE_ACCESS, target, None)
    else:
        result = _libc.fanotify_mark(group, flags, FAN_PRE_ACCESS, AT_FDCWD, os.fsencode(target))
    if result < 0:
        code = ctypes.get_errno()
        raise FanotifyError(code, f"fanotify_mark({target}): {os.strerror(code)}")


def mark(group: int, target: int | str | os.PathLike[str]) -> None:
    """Mark the inode of ``target`` (an open descriptor, or a path) for pre-access events of ``group``."""
    _mark(group, FAN_MARK_ADD, target)


def unmark(group: int, target: int | str | os.PathLike[str]) -> None:
    """Remove ``group``'s mark of ``target``'s inode (ENOENT: it had none)."""
    _mark(group, FAN_MARK_REMOVE, target)


def parse_events(buffer: bytes) -> list[Event]:
    """The events of one read of the group, in order (an event without a range record has count 0)."""
    events = []
    offset = 0
    while offset + _METADATA.size <= len(buffer):
        length, version, _, metadata_len, mask, fd, pid = _METADATA.unpack_from(buffer, offset)
        if version != METADATA_VERSION or length < _METADATA.size or offset + length > len(buffer):
            raise FanotifyError(errno.EPROTO, f"fanotify event metadata version {version}, length {length}: not understood")
        start, count, info = 0, 0, offset + metadata_len
        while info + _INFO_HEADER.size <= offset + length:
            info_type, _, info_len = _INFO_HEADER.unpack_from(buffer, info)
            if info_len < _INFO_HEADER.size:
                break
            if info_type == FAN_EVENT_INFO_TYPE_RANGE and info_len >= 8 + _RANGE.size:
                start, count = _RANGE.unpack_from(buffer, info + 8)
            info += info_len
        events.append(Event(fd, pid, start, count, mask))
        offset += length
    return events


def deny(code: int) -> int:
    """The response that fails the read with errno ``code`` (one of :data:`DENY_ERRNOS`)."""
    if code not in DENY_ERRNOS:
        raise ValueError(f"fanotify cannot deny with {errno.errorcode.get(code, code)}")
    return _DENY | (code << 24)


def answer(group: int, event_fd: int, response: int) -> bool:
    """Answer the event the reading process got as ``event_fd``; False if no such event is pending
    (answered already: by a server before a restart)."""
    try:
        os.write(group, _RESPONSE.pack(event_fd, response))
    except FileNotFoundError:
        return False
    return True


def unsupported(directory: Path) -> str | None:
    """Why files in ``directory`` cannot be marked for pre-access events (no such group in this kernel,
    or a filesystem that refuses the mark), or None: they can."""
    try:
        group = init_group()
    except FanotifyError as exc:
        return f"the kernel has no fanotify pre-content events ({exc.strerror}: Linux 6.14+ with CONFIG_FANOTIFY_ACCESS_PERMISSIONS)"
    probe = directory / f".fanotify-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        try:
            mark(group, probe)
        except FanotifyError as exc:
            return f"the filesystem of {directory} refuses pre-access marks ({exc.strerror}: tmpfs and overlayfs do)"
        return None
    except OSError as exc:
        return f"cannot probe {directory}: {exc}"
    finally:
        os.close(group)
        probe.unlink(missing_ok=True)


__all__ = [
    "ALLOW",
    "DENY_ERRNOS",
    "Event",
    "FanotifyError",
    "READ_SIZE",
    "answer",
    "deny",
    "init_group",
    "mark",
    "parse_events",
    "unmark",
    "unsupported",
]
