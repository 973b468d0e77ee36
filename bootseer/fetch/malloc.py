"""Make freed stripe buffers leave the process: glibc malloc tuning for long-running fetchers.

A stripe is one large ``bytes`` object (8 MiB by default), allocated by a worker
thread and freed, often by another thread, once readers have copied from it.
glibc serves a large allocation with its own ``mmap`` and gives it back to the
system on ``free``, but only below its *dynamic* mmap threshold: the first large
block freed raises that threshold to its size (up to 32 MiB), and from then on
stripes come from the per-thread malloc arenas, where freed blocks stay resident
to be reused by the arena that owns them.  With tens of worker threads (each may
get an arena), a mount with ``--memory-limit 64M`` held several times that in
RSS above idle under 8 concurrent readers (issue 10).

:func:`return_large_blocks` fixes the threshold (which also turns off its dynamic
adjustment), so every block of at least :data:`LARGE_BLOCK` bytes is mapped on
its own and unmapped when freed: resident memory follows the engine's own count
of held stripe bytes.  It changes the whole process's malloc, so it is called by
programs (``bootseer ckpt mount``), never on import of a library module.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from bootseer.log import get_logger

log = get_logger(__name__)

LARGE_BLOCK = 1 << 20  #: blocks this big or bigger are mapped on their own and unmapped when freed
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, threshold)``; whether it took effect (False off glibc).

    A block below the threshold still comes from an arena; the stripe buffers (at
    least a MiB with any sensible ``--stripe-size``) do not.  Each such allocation
    costs an mmap and its page faults: a few hundred microseconds per 8 MiB stripe,
    nothing next to fetching it.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        log.debug("mallopt not available; malloc left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    if not done:
        log.warning("mallopt(M_MMAP_THRESHOLD) refused; freed stripe buffers may stay resident", threshold=threshold)
    return done
