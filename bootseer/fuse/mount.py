"""Mounting, serving and unmounting one FUSE session under trio.

:class:`FuseSession` is the process's one session (pyfuse3 keeps it in module
globals, so a process serves at most one mount at a time; a second is refused).
:func:`serve` owns its life: it mounts, hands the session to the caller through
``task_status.started(session)``, answers requests until the mount ends and closes
the session on the way out, unmounting unless the program chose to leave the mount
in place (:meth:`FuseSession.close` with ``unmount=False``).  A mount ends when
someone unmounts it (``umount``, ``fusermount3 -u``: pyfuse3's main loop sees the
device close and returns), when the program calls :meth:`FuseSession.terminate`
(in-flight requests finish) or :meth:`FuseSession.abort`, or when the caller cancels.

Signals are each program's business; :func:`end_on_signals` is the usual policy
(SIGTERM or SIGINT ends the mount after in-flight requests, within a grace period
that a second signal cuts short).  :func:`unmount_dead` clears a mount left behind
by a killed server, whose mountpoint answers ENOTCONN.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
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
        try:
            os.statvfs(mountpoint)  # reaches a FUSE server, where stat may come from a cache
        except OSError as exc:
            if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
                raise MountError(
                    f"mountpoint {mountpoint} is a dead FUSE mount (transport endpoint is not connected); "
                    f"unmount it first: fusermount3 -u {mountpoint}"
                ) from None
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


class FuseSession:
    """The process's FUSE session over ``ops``, mounted on ``mountpoint``.

    Call from the trio thread only.  :func:`serve` drives it; programs use
    :meth:`terminate` and :meth:`abort` to end it and :attr:`ended` to wait for it.
    """

    def __init__(self, ops: ReadOnlyOperations, mountpoint: str, options: Iterable[str]) -> None:
        self.ops = ops
        self.mountpoint = mountpoint
        self.options = set(options)
        #: Unmount when the session closes (:func:`serve` passes this to :meth:`close`).
        self.unmount_on_close = True
        self.ended = trio.Event()  #: set once the main loop has returned (or never ran)
        self._serving = trio.CancelScope()
        self._state = "new"

    def mount(self) -> None:
        """Check the mountpoint and mount; :class:`MountError` if it cannot be done."""
        global _serving
        if _serving:
            raise RuntimeError("this process already serves a FUSE mount (pyfuse3 allows one per process)")
        check_mountpoint(self.mountpoint)
        try:
            pyfuse3.init(self.ops, self.mountpoint, self.options)
        except RuntimeError as exc:
            raise MountError(f"cannot mount on {self.mountpoint}: {exc} (see libfuse's message above)") from None
        _serving = True
        self._state = "mounted"

    async def run(self) -> None:
        """Answer requests until the mount ends, :meth:`terminate` or :meth:`abort`."""
        if self._state != "mounted":
            raise RuntimeError(f"FUSE session on {self.mountpoint} is {self._state}, not mounted")
        self._state = "serving"
        try:
            with self._serving:
                await pyfuse3.main()
        finally:
            self.ended.set()

    def terminate(self) -> None:
        """End the main loop once the requests in flight are answered."""
        if self._state == "serving" and not self.ended.is_set():
            pyfuse3.terminate()

    def abort(self) -> None:
        """End the main loop now, cancelling the requests in flight."""
        self._serving.cancel()

    def close(self, *, unmount: bool = True) -> None:
        """Release the session; unmount unless ``unmount`` is False (then the mount stays
        until the process exits, and after that answers ENOTCONN until someone unmounts it)."""
        global _serving
        if self._state in ("new", "closed"):
            return
        self._state = "closed"
        self.ended.set()
        try:
            # Unmounts unless already unmounted (libfuse checks the device first).
            pyfuse3.close(unmount=unmount)
        finally:
            self.ops.close_all()
            _serving = False
        log.info("unmounted" if unmount else "session closed, mount left in place", mountpoint=self.mountpoint)


async def serve(
    ops: ReadOnlyOperations,
    mountpoint: str,
    *,
    options: Iterable[str],
    task_status: trio.TaskStatus[FuseSession] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mount ``ops`` on ``mountpoint`` and serve it until the mount ends.

    ``task_status.started(session)`` is called once the mount is visible, so
    ``session = await nursery.start(serve, ...)`` returns when clients can use it,
    with the :class:`FuseSession` to end it by.  Raises :class:`MountError` when the
    mount cannot be made.  Returns normally after an unmount or :meth:`~FuseSession.terminate`;
    the session is always closed when this returns (unmounted unless
    :attr:`~FuseSession.unmount_on_close` was turned off).  Where ``ops.read_ahead_kb``
    is set, the mount's read-ahead is raised to it before ``started`` (:func:`set_read_ahead`).
    """
    session = FuseSession(ops, mountpoint, options)
    session.mount()
    try:
        if ops.read_ahead_kb is None:
            task_status.started(session)
            await session.run()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            # The kernel caps the read-ahead at what the session's INIT reply allows
            # (libfuse echoes the kernel's own 128 KiB), so raise it once INIT has been
            # answered: a stat of the root is only answered after it.
            try:
                # Abandoned on cancel: run() is cancelled too, so nobody would answer the stat.
                device = (await trio.to_thread.run_sync(os.stat, mountpoint, abandon_on_cancel=True)).st_dev
            except OSError as exc:  # unmounted already: run() returns on its own
                log.warning("cannot stat the new mount", mountpoint=mountpoint, error=str(exc))
            else:
                set_read_ahead(device, ops.read_ahead_kb)
            task_status.started(session)
    finally:
        session.close(unmount=session.unmount_on_close)


def read_ahead_path(device: int | str) -> str:
    """The sysfs file holding the read-ahead of the filesystem on ``device`` (its
    backing device info: ``/sys/class/bdi/MAJOR:MINOR/read_ahead_kb``), or of the
    backing device info named ``device`` (a file-backed EROFS mount's ``erofs-N``)."""
    name = device if isinstance(device, str) else f"{os.major(device)}:{os.minor(device)}"
    return f"/sys/class/bdi/{name}/read_ahead_kb"


def set_read_ahead(device: int | str, kilobytes: int) -> bool:
    """Set the read-ahead of the mount on ``device`` (see :func:`read_ahead_path`) to
    ``kilobytes``; False (and a warning) where sysfs refuses it, as it does outside the
    initial user namespace: the mount works as before, with the kernel's default read-ahead.

    A larger read-ahead means fewer, larger FUSE reads of a file read in order, and
    larger read-around on a page fault of a mapped file (shared libraries); each
    FUSE read is at most the session's ``max_pages`` (1 MiB with libfuse 3).
    """
    path = read_ahead_path(device)
    try:
        with open(path, "w") as control:
            control.write(f"{kilobytes}\n")
    except OSError as exc:
        log.warning("cannot set the mount's read-ahead; keeping the kernel's", path=path, error=str(exc))
        return False
    log.info("read-ahead set", path=path, read_ahead_kb=kilobytes)
    return True


async def end_on_signals(session: FuseSession, signals: AsyncIterator[int], *, grace: float = 10.0) -> None:
    """End ``session`` on the first of ``signals``; return once its serving has ended.

    Requests in flight get ``grace`` seconds to finish, unless a second signal comes
    first; then the main loop is cancelled.  Open the signal receiver before mounting
    (``with trio.open_signal_receiver(...) as signals``), so that a signal at any
    moment after the mount unmounts cleanly.
    """

    async def watch() -> None:
        async for signum in signals:
            log.info("unmounting", mountpoint=session.mountpoint, signal=signal.Signals(signum).name)
            session.terminate()
            break
        with trio.move_on_after(grace):
            async for signum in signals:
                log.warning("unmounting now", mountpoint=session.mountpoint, signal=signal.Signals(signum).name)
                break
        session.abort()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await session.ended.wait()
        nursery.cancel_scope.cancel()


def unmount_dead(mountpoint: str) -> bool:
    """Lazily unmount ``mountpoint`` if it is a dead FUSE mount (its server is gone:
    ENOTCONN); True if it was one.  A live mount or a plain directory is left alone."""
    try:
        # statfs always reaches the FUSE server (stat may be answered from the kernel's
        # attribute cache), so a dead connection shows here.
        os.statvfs(mountpoint)
        return False
    except OSError as exc:
        if exc.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            return False
    log.warning("unmounting a dead FUSE mount left by a server that is gone", mountpoint=mountpoint)
    command = ["umount", "-l", mountpoint] if os.geteuid() == 0 else ["fusermount3", "-u", "-z", mountpoint]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise MountError(f"cannot unmount the dead mount on {mountpoint}: {result.stderr.strip()}")
    return True


__all__ = [
    "FuseSession",
    "MountError",
    "allow_other_permitted",
    "check_mountpoint",
    "end_on_signals",
    "mount_options",
    "read_ahead_path",
    "serve",
    "set_read_ahead",
    "unmount_dead",
]
