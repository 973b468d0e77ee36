"""Real mounts in tests: the kernel's mount table, a child process serving a FUSE mount, cleanup.

:func:`mount_entry` reads ``/proc/self/mounts``; :class:`MountProcess` runs a program
that mounts and waits until it is ready, and its ``cleanup`` always leaves nothing
mounted and no process running; :func:`force_unmount` lazily unmounts whatever is on
a mountpoint (test teardown).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0


@dataclass
class MountEntry:
    source: str
    mountpoint: str
    fstype: str
    options: list[str]


def _unescape_mount_field(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as octal escapes.
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def mount_entry(mountpoint: str | os.PathLike) -> MountEntry | None:
    """The kernel's mount table entry for ``mountpoint`` (the topmost one), if mounted."""
    target = os.path.realpath(mountpoint)
    found = None
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            source, point, fstype, options, *_ = line.split()
            if _unescape_mount_field(point) == target:
                found = MountEntry(_unescape_mount_field(source), target, fstype, options.split(","))
    return found


def force_unmount(mountpoint: str | os.PathLike) -> None:
    """Lazily unmount ``mountpoint`` if anything is mounted there (test cleanup)."""
    while mount_entry(mountpoint) is not None:
        subprocess.run(["umount", "-l", os.fspath(mountpoint)], check=False, timeout=30)


class MountProcess:
    """A child process serving a FUSE mount, with its output in files.

    ``wait_ready`` blocks until ``ready_text`` is on stdout and the mount is in the
    kernel's table.  ``cleanup`` (run it in a ``finally`` or fixture teardown) stops
    the process and unmounts, whatever state either is in.
    """

    def __init__(
        self, argv: Sequence[str], mountpoint: Path, logdir: Path, ready_text: str, env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.mountpoint = mountpoint
        self.ready_text = ready_text
        self.stdout_path = logdir / f"mount-{os.getpid()}-{id(self)}.out"
        self.stderr_path = logdir / f"mount-{os.getpid()}-{id(self)}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                list(argv), stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd
            )

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_text in self.stdout and mount_entry(self.mountpoint) is not None:
                return
            if self.process.poll() is not None:
                raise AssertionError(f"mount process exited {self.process.returncode}:\n{self.stderr}")
            time.sleep(0.05)
        raise AssertionError(f"mount not ready after {timeout}s:\n{self.stderr}")

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"mount process still running after {timeout}s:\n{self.stderr}") from None

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        force_unmount(self.mountpoint)


def wait_unmounted(mountpoint: Path, timeout: float = STOP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while mount_entry(mountpoint) is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{mountpoint} still mounted after {timeout}s")
        time.sleep(0.05)
