"""Read accounting: every open and read of a served layer, attributed to a recording and classified for prefetches.

The hot-list service is the layers' read observer
(:class:`~bootseer.blockstore.datapath.tree.ReadObserver`); what it does with each open and
read is here.  A file read is attributed at its open, through the opener's pid and cgroup
(:mod:`bootseer.hotlist.attribution`); a blob read, which has no open of its own, at the read.
Both record first touches in the order reads arrive and classify them for prefetches alike.
A blob read of a block a page-cache warmer is reading at that moment (:class:`WarmReads`) is
the warmer's, and left out.  A reader that is no recording container is left out of the
trace; one that cannot be identified is recorded to the one recording covering the layer, or
counted as unattributed when several do.  Accounting never fails a read: its errors are logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import prometheus_client
import trio

from bootseer.blockstore.datapath.tree import LayerTree
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import Entry
from bootseer.fuse.operations import OPENER_PID
from bootseer.hotlist.attribution import cgroup_paths, container_of
from bootseer.hotlist.prefetch import Prefetch
from bootseer.hotlist.recorder import Recording
from bootseer.hotlist.warm import WarmReads
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks

log = get_logger(__name__)

UNATTRIBUTED = prometheus_client.Counter(
    "bootseer_hotlist_unattributed_reads",
    "Reads of a recorded layer whose opener could not be identified while several recordings cover it (left out)",
)


@dataclass(frozen=True)
class OpenTag:
    """Who opened a file of a served layer (what :meth:`ReadAccounting.opened` hands the open file)."""

    pid: int
    container: str | None  #: a recording or prefetched container, by key
    identified: bool  #: whether the caller's cgroup could be read at all


class ReadAccounting:
    """Accounts reads to ``recordings`` (by container) and ``prefetches`` (by image and profile), both live views."""

    def __init__(self, recordings: Mapping[str, Recording], prefetches: Mapping[tuple[str, str], Prefetch],
                 warm_reads: WarmReads) -> None:  # fmt: skip
        self.recordings = recordings
        self.prefetches = prefetches
        self.warm_reads = warm_reads
        self.proc = "/proc"  #: where callers' cgroups are read (tests point it elsewhere)

    def opened(self, tree: LayerTree) -> OpenTag | None:
        """Who opened a file of ``tree``'s layer; None when nothing records or prefetches that layer."""
        try:
            return self.reader(tree.name, OPENER_PID.get())
        except Exception:  # accounting must never fail an open
            log.error("hot-list open hook failed", layer=tree.name, exc_info=True)
            return None

    def read(self, tree: LayerTree, entry: Entry, offset: int, size: int, tag: OpenTag | None) -> None:
        """Account for a read of ``size`` bytes at ``offset`` of ``entry`` in ``tree``'s layer."""
        profile_hooks.layer_read(tag.container if tag is not None else None, tree.name)  # profiler: first read
        if tag is None:
            return
        try:
            index = tree.index
            target = tree.entries[entry.link] if entry.link is not None else entry
            end = min(offset + size, target.size)
            if end <= offset:
                return
            first, last = offset // index.block_size, (end - 1) // index.block_size
            self.account(tree.name, index, target.blocks[first : last + 1], tag)
        except Exception:  # accounting must never fail a read
            log.error("hot-list read hook failed", layer=tree.name, exc_info=True)

    def watches(self, layer: str) -> bool:
        """Whether a recording not sealed yet covers ``layer`` (its first reads go into a hot list)."""
        return any(recording.covers(layer) and not recording.sealed.is_set() for recording in self.recordings.values())

    def blob_read(self, layer: str, index: LayerBlocks, refs: Sequence[int], pid: int) -> None:
        """Account for a read of blocks ``refs`` of ``layer``'s blob by process ``pid`` (0: unknown).

        A blob has no open per reader, so the reader is looked up now, as
        :meth:`opened` does for a file: its cgroup names the recording it belongs to.
        """
        try:
            if not pid:  # the server's own open (EROFS's): maybe a page-cache warmer's read, not a job's
                refs = self.warm_reads.others(layer, refs)
                if not refs:
                    return
            tag = self.reader(layer, pid)
            profile_hooks.layer_read(tag.container if tag is not None else None, layer)  # profiler: first read
            if tag is not None:
                self.account(layer, index, refs, tag)
        except Exception:  # accounting must never fail a read
            log.error("hot-list blob read hook failed", layer=layer, exc_info=True)

    def reader(self, layer: str, pid: int) -> OpenTag | None:
        """Who process ``pid`` reads ``layer`` for; None when nothing records or prefetches that layer."""
        recording = [r for r in self.recordings.values() if r.covers(layer) and not r.sealed.is_set()]
        if not recording and not any(layer in p.layers for p in self.prefetches.values()):
            return None
        if not recording:
            return OpenTag(pid, None, True)  # prefetch accounting only: who reads does not matter
        # A bare-metal prefix's recording takes what no container's recording claims.
        any_reader = next((r.container for r in recording if r.any_reader), None)
        paths = cgroup_paths(pid, self.proc)
        if paths is None:
            return OpenTag(pid, any_reader, any_reader is not None)
        claimed = container_of(paths, [r.container for r in recording if not r.any_reader])
        return OpenTag(pid, claimed or any_reader, True)

    def account(self, layer: str, index: LayerBlocks, refs: Sequence[int], tag: OpenTag) -> None:
        """Record blocks ``refs`` of ``layer`` to the reader's recording (first touches, in order), classify them
        for the prefetches of the layer."""
        now = trio.current_time()
        if self.recordings:
            recording = self.recordings.get(tag.container) if tag.container else None
            if recording is None and not tag.identified:
                covering = [r for r in self.recordings.values() if r.covers(layer) and not r.sealed.is_set()]
                if len(covering) == 1:
                    recording = covering[0]
                else:
                    for other in covering:
                        other.unattributed += 1
                    UNATTRIBUTED.inc()
            if recording is not None:
                recording.touch(layer, index, refs, now)
        for prefetch in self.prefetches.values():
            if layer in prefetch.indexes:
                for ref in refs:
                    block = index.blocks[ref]
                    if not block.is_zero:
                        prefetch.classify(block.digest, now)


__all__ = ["UNATTRIBUTED", "OpenTag", "ReadAccounting"]
