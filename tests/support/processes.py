"""Child processes as the integration tests, the demo and the benchmarks run them.

* :class:`ManagedProcess`: one long-running child in its own process group, logging to a file
  (appended across restarts), stopped by signal with a SIGKILL after a bound (and SIGABRT first
  for a Python program, so its log shows where it hung).
* :func:`run`: one command to completion; :class:`HarnessError` with its output if it fails.
* What a teardown looks for: :func:`mounts_under` a directory, :func:`pids_mentioning` a path,
  :func:`is_zombie` (PID 1 here may reap late), :func:`process_gone` and :func:`wait_process_gone`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from tests.support.waiting import wait_until


class HarnessError(RuntimeError):
    """A component did not start, stop or answer as expected; the message says which and why."""


class ManagedProcess:
    """One child process in its own process group, logging to a file (appended across restarts)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, python: bool = False):
        """``python``: the process is a Python program; it gets faulthandler, and SIGABRT
        before SIGKILL when it does not stop, so its log shows where it hung."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.abort_for_stacks = python
        self.env = dict(os.environ, PYTHONFAULTHANDLER="1") if python else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.running:
            raise HarnessError(f"{self.name} is already running")
        with open(self.log_path, "ab") as log:
            log.write(f"===== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=self.env, start_new_session=True,
                )
            except OSError as e:
                raise HarnessError(f"cannot start {self.name} ({self.argv[0]}): {e}") from e

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send_signal(self, sig: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        """Send ``sig`` to the process group, wait, SIGKILL after ``timeout``; return the exit status.

        Raises :class:`HarnessError` if ``sig`` did not end it in time (it is killed anyway).
        """
        if self.proc is None:
            return None
        if not self.running:
            return self.proc.returncode
        self.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if self.abort_for_stacks:
                # faulthandler (PYTHONFAULTHANDLER=1) writes every thread's stack to the log on SIGABRT.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(3)
            self.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            raise HarnessError(f"{self.name} did not exit within {timeout:.0f}s of signal {sig}; killed"
                               + (" (stacks in its log)" if self.abort_for_stacks else ""))
        finally:
            with open(self.log_path, "ab") as log:
                log.write(f"===== {time.strftime('%H:%M:%S')} stopped: status {self.proc.returncode}\n".encode())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def run(argv: Sequence[str], *, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; on failure raise :class:`HarnessError` with its output."""
    try:
        done = subprocess.run(list(argv), capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"timed out after {timeout}s: {' '.join(argv)}\n{command_output(e.stdout, e.stderr)}") from e
    if check and done.returncode != 0:
        raise HarnessError(
            f"exit status {done.returncode}: {' '.join(argv)}\n{command_output(done.stdout, done.stderr)}"
        )
    return done


def command_output(stdout: bytes | None, stderr: bytes | None) -> str:
    parts = []
    for label, data in (("stdout", stdout), ("stderr", stderr)):
        if data:
            parts.append(f"--- {label}:\n{data.decode(errors='replace').rstrip()}")
    return "\n".join(parts)


def mounts_under(base: Path) -> list[str]:
    """Mount points at or below ``base``, deepest first (octal escapes of mountinfo decoded)."""
    points = []
    prefix = str(base).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def pids_mentioning(needle: str) -> list[int]:
    """Processes whose command line contains ``needle`` (our unique temp path): the shims we caused."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: there is no such process, or it is a zombie (PID 1 here may reap
    late) whose threads have all exited (a leader shows Z while its other threads are still exiting, and
    their descriptors, a control socket say, stay open until the last one has)."""
    try:
        with open(f"/proc/{pid}/stat") as proc:
            zombie = proc.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_process_gone(pid: int, timeout: float = 30.0) -> None:
    """Until :func:`process_gone` (``pid``); :class:`~tests.support.waiting.WaitFailed` after ``timeout`` s."""
    wait_until(f"process {pid} to exit", lambda: process_gone(pid), timeout, interval=0.05)
