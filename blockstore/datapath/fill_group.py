"""Fill groups: the runs of a local blob one pre-access event fills at once (the ``fanotify`` path).

A pre-content mark turns off the kernel's read-ahead on the marked file, so EROFS reads a blob
with holes in small ranges, and each range that reaches a hole would wait for a fill of its
own (one round trip to the store, one decode, one write, one after another).  Instead an
event fills the missing blocks of the whole *group* its range touches: adjacent blocks of the
blob up to :data:`FILL_GROUP` raw bytes (a block larger than that is a group of its own), in
one batch (one range request, one worker-thread call that decodes, hashes and writes).  The
groups are fixed by the index alone, never by the reads, so that the events of reads of one
group coalesce on one fill (:class:`~.local_blobs.FanotifyBlobs`).  The blocks a fill writes
beyond its read's are noted written ahead (``AHEAD`` in the fill map), so that their first
reads still reach the hot-list recorder (:mod:`.event_holder`).

The size is the layer server's ``[datapath] fill_group`` (``--fill-group``); 0 fills only the
blocks a read touches.  No trio here: the daemon's settings import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

#: Default of ``[datapath] fill_group``: raw bytes of a fill group at most.
FILL_GROUP = 1 << 20
#: ``[datapath] fill_group`` at most (a group is one batch held in memory while it is written).
FILL_GROUP_MAX = 64 << 20


class _Sized(Protocol):
    @property
    def rlen(self) -> int: ...


def check_fill_group(size: int) -> int:
    """``size`` if it is a fill group's size (0 .. :data:`FILL_GROUP_MAX` bytes), else ValueError."""
    if not 0 <= size <= FILL_GROUP_MAX:
        raise ValueError(f"fill_group must be 0 .. {FILL_GROUP_MAX >> 20} MiB of raw bytes, not {size}")
    return size


def group_starts(blocks: Sequence[_Sized], limit: int) -> list[int]:
    """The first block of each fill group of a blob of ``blocks``: adjacent blocks, a new group once the raw bytes
    would pass ``limit`` (0: every block a group of its own)."""
    starts: list[int] = []
    total = limit + 1
    for ref, block in enumerate(blocks):
        if total + block.rlen > limit:
            starts.append(ref)
            total = 0
        total += block.rlen
    return starts or [0]


__all__ = ["FILL_GROUP", "FILL_GROUP_MAX", "check_fill_group", "group_starts"]
