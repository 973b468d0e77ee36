"""What every benchmark script shares: its error, its log line, a cold page cache, the commands it runs.

* :class:`BenchError`: a step of a benchmark failed; the message says which and why.
* :func:`log`: one timestamped progress line on stdout.
* :func:`drop_caches`: a cold node (dirty pages written back, page cache, dentries and inodes dropped).
* :func:`bootseer_argv`, :func:`run_checked`, :func:`run_until_marker`: the ``bootseer`` command of this
  interpreter, a command run to completion with its output logged, a container start timed to its marker.
* :func:`machine`, :func:`code_version`: what a report says was measured, and on what.

Benchmarks are run from the checkout's root as modules (``python -m bench.lazy_bench``); no script
imports another.
"""

from __future__ import annotations

import contextlib
import os
import platform
import selectors
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.support.containerd import ContainerdInstall

REPO_ROOT = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and why."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def drop_caches() -> None:
    """Write dirty pages back, then drop the page cache, dentries and inodes (a cold node)."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def bootseer_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "bootseer.cli", *args]


def run_checked(argv: list[str], what: str, timeout: float, log_path: Path | None = None) -> str:
    """Run a command; its output goes to ``log_path``; a failure raises with the output's tail."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{what}: timed out after {timeout:.0f} s: {shlex.join(argv)}") from e
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}\n[exit {done.returncode}]\n")
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-1500:]
        raise BenchError(f"{what}: exit status {done.returncode}: {shlex.join(argv)}\n{tail}")
    return done.stdout


def run_until_marker(argv: list[str], marker: str, timeout: float, log_path: Path) -> tuple[float, str]:
    """Start ``argv``; seconds until a line containing ``marker`` appears on its stdout, and that line.

    The process is then waited for (it exits after printing) and must exit 0.
    """
    start = time.perf_counter()
    with open(log_path, "a") as out_log:
        out_log.write(f"$ {shlex.join(argv)}\n")
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        found: tuple[float, str] | None = None
        buffered = b""
        deadline = start + timeout
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(process.stdout, selectors.EVENT_READ)
                while True:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise BenchError(f"no {marker!r} within {timeout:.0f} s: {shlex.join(argv)}")
                    if not selector.select(left):
                        continue
                    chunk = os.read(process.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    buffered += chunk
                    out_log.write(chunk.decode(errors="replace"))
                    if found is None:
                        for line in buffered.decode(errors="replace").splitlines():
                            if marker in line:
                                found = (time.perf_counter() - start, line.strip())
                                break
            status = process.wait(timeout=max(1.0, deadline - time.perf_counter()))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        out_log.write(f"[exit {process.returncode}]\n")
    tail = buffered.decode(errors="replace").strip()[-1500:]
    if status != 0:
        raise BenchError(f"exit status {status}: {shlex.join(argv)}\n{tail}")
    if found is None:
        raise BenchError(f"the container exited without printing {marker!r}:\n{tail}")
    return found


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A figure for a report's table cell or a log line: ``value`` in ``spec``, or a dash when there is none."""
    return "—" if value is None else format(value, spec)


def machine(containerd: ContainerdInstall | None = None) -> str:
    """The machine measured: cores and CPU model, memory, kernel, ``containerd`` (if the benchmark runs one), Python."""
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} × {cpu}, {memory:.0f} GiB RAM, Linux {platform.release()}, "
            f"{containerd.describe() + ', ' if containerd else ''}Python {platform.python_version()}")


def code_version() -> str:
    """The commit measured, and the files changed on top of it (the tree is shared while work goes on)."""
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no", "--",
                              "bootseer", "blockstore", "snapshotter"], capture_output=True, text=True).stdout.split()
    dirty = [name for name in changed if "/" in name]
    return f"`{head[:90]}`" + (f" plus uncommitted changes to {', '.join(dirty)}" if dirty else "")
