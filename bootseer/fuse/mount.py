"""Mounting, serving and unmounting one FUSE session under trio.

:func:`serve` owns the whole life of a mount: it checks the mountpoint, mounts,
answers requests until the mount ends and always unmounts on the way out.  A mount
ends when someone unmounts it (``umount``, ``fusermount3 -u``: pyfuse3's main loop
sees the device close and returns), on SIGTERM or SIGINT (in-flight requests get
``shutdown_grace`` seconds to finish, a second signal cuts that short), or when the
caller cancels.

pyfuse3 keeps its session in module globals, so a process serves at most one mount
at a time; :func:`serve` refuses a second.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from typing import AsyncIterator, Iterable

import pyfuse3
import trio

from bootseer.fuse.operations import ReadOnlyOperations
from bootseer.log import get_logger

log = get_logger(__name__)

FUSE_DEVICE = "/dev/fuse"
FUSE_CONF = "/etc/fuse.conf"

_serving = False


class MountError(Exception):
    """The filesystem cannot be mounted; the message says why and what to do."""


def check_mountpoint(mountpoint: str) -> None:
    """Raise :class:`MountError` unless a FUSE filesystem can be mounted on ``mountpoint``."""
    try:
        os.stat(mountpoint)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(
                f"mountpoint {mountpoint} is a dead FUSE mount (transport endpoint is not connected); "
                f"unmount it first: fusermount3 -u {mountpoint}"
            ) from None
        raise MountError(f"mountpoint {mountpoint}: {exc.strerror}") from None
    if not os.path.isdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is already a mount point; unmount it or choose another")
    if not os.path.exists(FUSE_DEVICE):
        raise MountError(f"{FUSE_DEVICE} is missing: load the fuse module (modprobe fuse) or pass the device in")
    if os.geteuid() != 0:
        if shutil.which("fusermount3") is None:
            raise MountError("not running as root and fusermount3 is not installed (install the fuse3 package)")
    elif not os.access(FUSE_DEVICE, os.R_OK | os.W_OK):
        raise MountError(f"{FUSE_DEVICE} is not readable and writable by this process")


def allow_other_permitted() -> bool:
    """Whether ``allow_other`` will be accepted: always for root, else per /etc/fuse.conf."""
    if os.geteuid() == 0:
        return True
    try:
        with open(FUSE_CONF) as conf:
            return any(line.strip() == "user_allow_other" for line in conf)
    except OSError:
        return False


def _option_value(text: str) -> str:
    # libfuse splits options on commas (a backslash escapes one) and pyfuse3 passes
    # them as ASCII.
    ascii_text = text.encode("ascii", "replace").decode("ascii")
    return ascii_text.replace("\\", "\\\\").replace(",", "\\,")


def mount_options(*, fsname: str, subtype: str, allow_other: bool = False) -> set[str]:
    """Options for a read-only mount that ``mount`` lists as ``fsname on ... type fuse.subtype``.

    Only the user who mounts may read the mount unless ``allow_other``: what it serves
    was fetched with that user's credentials (root's, often), so opening it to every
    local user is the caller's explicit choice.  Raises :class:`MountError` if
    ``allow_other`` is asked for and not permitted (see :func:`allow_other_permitted`).
    """
    if allow_other and not allow_other_permitted():
        raise MountError("allow_other needs root or 'user_allow_other' in /etc/fuse.conf")
    options = {
        "ro",
        "nosuid",
        "nodev",
        "default_permissions",
        f"fsname={_option_value(fsname)}",
        f"subtype={_option_value(subtype)}",
    }
    if allow_other:
        options.add("allow_other")
    return options


async def _end_on_signal(
    signals: AsyncIterator[int], mountpoint: str, serving: trio.CancelScope, grace: float
) -> None:
    async for signum in signals:
        log.info("unmounting", mountpoint=mountpoint, signal=signal.Signals(signum).name)
        pyfuse3.terminate()
        break
    # Requests in flight finish unless that takes longer than the grace period or a
    # second signal arrives.
    with trio.move_on_after(grace):
        async for signum in signals:
            log.warning("unmounting now", mountpoint=mountpoint, signal=signal.Signals(signum).name)
            break
    serving.cancel()


async def serve(
    ops: ReadOnlyOperations,
    mountpoint: str,
    *,
    options: Iterable[str],
    shutdown_grace: float = 10.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mount ``ops`` on ``mountpoint`` and serve it until the mount ends.

    ``task_status.started()`` is called once the mount is visible, so
    ``await nursery.start(serve, ...)`` returns when clients can use it.  Raises
    :class:`MountError` when the mount cannot be made.  Returns normally after an
    unmount or a signal; the mountpoint is always unmounted when this returns.
    """
    global _serving
    if _serving:
        raise RuntimeError("this process already serves a FUSE mount (pyfuse3 allows one per process)")
    check_mountpoint(mountpoint)
    _serving = True
    try:
        # Opened before mounting, so a signal at any moment from here on unmounts cleanly.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            try:
                pyfuse3.init(ops, mountpoint, set(options))
            except RuntimeError as exc:
                raise MountError(f"cannot mount on {mountpoint}: {exc} (see libfuse's message above)") from None
            try:
                async with trio.open_nursery() as nursery:
                    serving = trio.CancelScope()
                    nursery.start_soon(_end_on_signal, signals, mountpoint, serving, shutdown_grace)
                    task_status.started()
                    with serving:
                        await pyfuse3.main()
                    nursery.cancel_scope.cancel()
            finally:
                # Unmounts unless already unmounted (libfuse checks the device first).
                pyfuse3.close(unmount=True)
                ops.close_all()
                log.info("unmounted", mountpoint=mountpoint)
    finally:
        _serving = False


__all__ = ["MountError", "allow_other_permitted", "check_mountpoint", "mount_options", "serve"]
