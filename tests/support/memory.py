"""A process's resident memory while readers read through it: what ``--memory-limit`` tests measure.

:func:`peak_rss_under_readers` reads files whole from threads (one per file, 1 MiB
unbuffered reads, as a loader does) and samples the serving process's ``VmRSS`` from
``/proc`` until every reader is done; :func:`rss_bound` is what RSS may rise above idle
under a stripe limit.  Used by the checkpoint mount's and the layer server's tests.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

MiB = 1 << 20

#: What RSS may rise above idle beyond --memory-limit's stripes: up to half the limit
#: again for a second copy of stripes in flight (an HTTP body read into a buffer, then
#: into bytes; the copy of a stripe a reader is cut from), plus a fixed 32 MiB for the
#: FUSE side (pyfuse3's request buffers and each reply, up to 1 MiB per read in flight),
#: thread stacks touched by 16+ workers and Python's own heap growth.
RSS_LIMIT_FACTOR = 1.5
RSS_ALLOWANCE = 32 * MiB
SAMPLE_INTERVAL_S = 0.01  #: how often VmRSS is sampled (a sampling rate, not a wait for anything)


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def rss_bound(limit: int) -> int:
    """Bytes RSS may rise above idle with ``--memory-limit limit``."""
    return int(limit * RSS_LIMIT_FACTOR) + RSS_ALLOWANCE


def peak_rss_under_readers(pid: int, paths: list[Path], size: int) -> tuple[int, int]:
    """(idle RSS, peak RSS) of ``pid`` while one thread per path reads it whole; each must be ``size`` bytes.

    Raises the first reader's error (after all have ended).
    """
    idle = rss(pid)
    errors: list[BaseException] = []

    def read_all(path: Path) -> None:
        try:
            with open(path, "rb", buffering=0) as file:
                total = 0
                while piece := file.read(MiB):
                    total += len(piece)
            assert total == size, f"{path}: read {total} bytes, not {size}"
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=read_all, args=(path,)) for path in paths]
    for thread in threads:
        thread.start()
    peak = idle
    while any(thread.is_alive() for thread in threads):
        peak = max(peak, rss(pid))
        time.sleep(SAMPLE_INTERVAL_S)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return idle, peak


__all__ = ["MiB", "RSS_ALLOWANCE", "RSS_LIMIT_FACTOR", "peak_rss_under_readers", "rss", "rss_bound"]
