"""Mount an EROFS image with its blob: file-backed by mount(2), or over loop devices where the kernel refuses that.

A file-backed EROFS mount (Linux 6.12+, ``CONFIG_EROFS_FS_BACKED_BY_FILE``) takes the
image file itself as the source and the blob file as ``-o device=``; mount(8) would set
up a loop device behind our back, so :func:`mount_erofs` calls mount(2) itself.  When
the backing filesystem cannot serve it (tmpfs, overlayfs: no ``read_folio``) or the
kernel predates file-backed mounts, the kernel answers ENOTBLK; then the image and the
blob each get a read-only loop device (``LOOP_CTL_GET_FREE`` + ``LOOP_CONFIGURE``, with
autoclear, so unmounting frees them) and the mount is made from those.

EROFS reads a layer's blob with **direct I/O**: ``-o directio`` on a file-backed mount,
``LO_FLAGS_DIRECT_IO`` on the blob's loop device.  Read buffered, the blob would be a
second page cache of every byte (beside the EROFS files' own), and its read-ahead
would run past the chunk EROFS asked for into the next block of the blob, which
belongs to another file: fetched from the store, and recorded in a hot list, though
nothing read it (each read spilled up to the FUSE read-ahead window into its
neighbour).  Direct, the blob is read exactly where the EROFS file's pages
map, and those pages are the one copy.  A kernel whose EROFS has no ``directio`` option
refuses it (EINVAL): the mount is then made buffered, with a warning.
The image itself (the metadata) is read through its own page cache either way.

Given ``read_ahead_kb``, the mount's own read-ahead (how much of a file EROFS asks the
blob for at once, on a read in order or a page fault of a mapped library) is raised to
it, as the FUSE tree's is: at the kernel's 128 KiB a sequential read or a mapping of a
large library takes several times the blob reads it takes at 1 MiB.  A file-backed mount's read-ahead lives in a backing device of its own
(``/sys/class/bdi/erofs-N``), which nothing maps to the mount: the one that appears
during the mount is taken (mounts of this process are made one at a time for it; when
another process mounted EROFS meanwhile and two appear, the read-ahead is left as it
is).  A loop mount's is its image's loop device's (``MAJOR:MINOR`` of the mount).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from bootseer.log import get_logger

log = get_logger(__name__)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
#: What a layer's lower directory is mounted with (as the FUSE layer mount is).
DEFAULT_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV

LOOP_CONTROL = "/dev/loop-control"
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
#: struct loop_config: fd, block_size, struct loop_info64 (232 bytes), 8 reserved u64s.
_LOOP_INFO64 = struct.Struct("<QQQQQIIII64s64s32sQQ")
_LOOP_CONFIG = struct.Struct(f"<II{_LOOP_INFO64.size}s64x")
_LOOP_ATTEMPTS = 8  #: a free device another process takes first (EBUSY) is retried this often

BDI_DIR = "/sys/class/bdi"
_mounting = threading.Lock()  #: one mount at a time, so the backing device that appears is the mount's

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class ErofsMountError(OSError):
    """The image could not be mounted (the message names the image and the kernel's reason)."""


@dataclass(frozen=True)
class ErofsMount:
    mountpoint: Path
    mode: str  #: ``file`` (file-backed) or ``loop``
    loop_devices: tuple[str, ...] = ()  #: image's, then blob's (``loop`` mode); freed on unmount
    direct: bool = True  #: the blob is read with direct I/O (see the module docstring)


def _mount(source: str, target: str, data: str, flags: int) -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target), b"erofs", flags, os.fsencode(data) if data else None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), source)


def mount_erofs(image: str | os.PathLike[str], mountpoint: str | os.PathLike[str], *, device: str | os.PathLike[str] | None = None,
                flags: int = DEFAULT_FLAGS, loop: bool = False, read_ahead_kb: int | None = None,
                direct: bool = True) -> ErofsMount:  # fmt: skip
    """Mount ``image`` (with blob ``device``, if the image has one) read-only on ``mountpoint``.

    File-backed first; on ENOTBLK, over loop devices (``loop``: over loop devices only,
    as a node forced to ``data_path = loop`` wants).  ErofsMountError otherwise, or
    when the loop fallback fails too (nothing is left mounted or attached then).
    With ``read_ahead_kb``, the mount's read-ahead is set to it (see the module
    docstring; where sysfs refuses, a warning and the kernel's default).  ``direct=False``: the blob is
    read buffered (the ``fanotify`` data path: its fills land in the blob's page cache, read from there).
    """
    from bootseer.fuse.mount import set_read_ahead

    with _mounting:
        before = _erofs_bdis() if read_ahead_kb else set()
        mounted = _mount_erofs(image, mountpoint, device, flags, loop, direct)
        if not read_ahead_kb:
            return mounted
        if mounted.mode == "loop":
            set_read_ahead(os.stat(mounted.mountpoint).st_dev, read_ahead_kb)
            return mounted
        appeared = _erofs_bdis() - before
    if len(appeared) == 1:
        set_read_ahead(appeared.pop(), read_ahead_kb)
    else:
        log.info("cannot tell this EROFS mount's backing device (another mount was made meanwhile); "
                 "its read-ahead stays the kernel's", mountpoint=str(mounted.mountpoint), candidates=sorted(appeared))  # fmt: skip
    return mounted


def _erofs_bdis() -> set[str]:
    try:
        return {name for name in os.listdir(BDI_DIR) if name.startswith("erofs-")}
    except OSError:
        return set()


def _mount_erofs(image: str | os.PathLike[str], mountpoint: str | os.PathLike[str], device: str | os.PathLike[str] | None,
                 flags: int, loop: bool, direct: bool = True) -> ErofsMount:  # fmt: skip
    image, target = os.fspath(image), os.fspath(mountpoint)
    blob = os.fspath(device) if device is not None else None
    if "," in (blob or "") or "\0" in (blob or ""):
        raise ErofsMountError(errno.EINVAL, f"blob path {blob!r} cannot be passed as a mount option")
    if not loop:
        try:
            if blob and not direct:
                _mount(image, target, f"device={blob}", flags)
                return ErofsMount(Path(target), "file", direct=False)
            try:
                _mount(image, target, f"device={blob},directio" if blob else "", flags)
                return ErofsMount(Path(target), "file")
            except OSError as exc:
                if exc.errno != errno.EINVAL or not blob:
                    raise
            _mount(image, target, f"device={blob}", flags)
            log.warning("this kernel's EROFS has no directio: the blob is read buffered (a second page cache, "
                        "read-ahead into neighbouring blocks)", image=image)  # fmt: skip
            return ErofsMount(Path(target), "file", direct=False)
        except OSError as exc:
            if exc.errno != errno.ENOTBLK:
                raise ErofsMountError(exc.errno, f"cannot mount EROFS image {image} on {target}: {exc.strerror}") from None
    held: list[int] = []  # the loop devices' descriptors: their last close detaches them (autoclear)
    try:
        image_loop = _attach_loop(image, held)
        blob_loop = _attach_loop(blob, held, direct=True) if blob else None
        try:
            _mount(image_loop, target, f"device={blob_loop}" if blob_loop else "", flags)
        except OSError as exc:
            raise ErofsMountError(exc.errno, f"cannot mount EROFS image {image} over {image_loop} on {target}: {exc.strerror}") from None
        return ErofsMount(Path(target), "loop", (image_loop,) + ((blob_loop,) if blob_loop else ()))
    finally:
        for fd in held:
            os.close(fd)


def _attach_loop(path: str, held: list[int], *, direct: bool = False) -> str:
    """A read-only, autoclear loop device over ``path`` (``direct``: reading it with direct I/O, where the
    backing file allows it; the kernel quietly reads buffered otherwise); its descriptor is appended to ``held``."""
    try:
        backing = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ErofsMountError(exc.errno, f"cannot open {path} for a loop device: {exc.strerror}") from None
    try:
        # (The name is what losetup -l shows; LOOP_CONFIGURE exists since 5.8, before every EROFS with chunks.)
        name_field = os.fsencode(path)[-63:]
        loop_flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR | (LO_FLAGS_DIRECT_IO if direct else 0)
        info = _LOOP_INFO64.pack(0, 0, 0, 0, 0, 0, 0, 0, loop_flags, name_field, b"", b"", 0, 0)
        config = _LOOP_CONFIG.pack(backing, 0, info)
        for _ in range(_LOOP_ATTEMPTS):
            try:
                control = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise ErofsMountError(exc.errno, f"no loop devices for EROFS image {path}: {LOOP_CONTROL}: {exc.strerror}") from None
            try:
                number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            except OSError as exc:
                raise ErofsMountError(exc.errno, f"no free loop device for {path}: {exc.strerror}") from None
            finally:
                os.close(control)
            name = f"/dev/loop{number}"
            loop = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(loop, LOOP_CONFIGURE, config)
            except OSError as exc:
                os.close(loop)
                if exc.errno == errno.EBUSY:  # taken between GET_FREE and CONFIGURE: ask again
                    continue
                raise ErofsMountError(exc.errno, f"cannot attach {path} to {name}: {exc.strerror}") from None
            held.append(loop)
            return name
        raise ErofsMountError(errno.EBUSY, f"no loop device stayed free for {path} in {_LOOP_ATTEMPTS} attempts")
    finally:
        os.close(backing)


def unmount_erofs(mountpoint: str | os.PathLike[str], *, lazy: bool = False) -> None:
    """Unmount an EROFS mount (its loop devices, if any, detach themselves)."""
    if _libc.umount2(os.fsencode(os.fspath(mountpoint)), 2 if lazy else 0) != 0:  # MNT_DETACH
        code = ctypes.get_errno()
        raise OSError(code, f"cannot unmount {os.fspath(mountpoint)}: {os.strerror(code)}")
