"""Recording one container's first boot: the first touch of every block, in order, until it seals.

A :class:`Recording` belongs to one container (its writable snapshot's key) of one
image (top ChainID) and profile, or to one bare-metal prefix restored from a
dependency snapshot (``any_reader``: no container to attribute reads to, so every
reader of its layer is the job's).  The layer server's read hook calls :meth:`touch`
for every FUSE read the container makes of the image's layers; each block seen for
the first time is appended with its time since the container's writable snapshot
was prepared.  :func:`run_recording` waits for the first of:

* ``seal``: an explicit :meth:`Recording.seal` (``bootseer hotlist seal CONTAINER``);
* ``removed``: the container's snapshot was removed (the snapshotter says so);
* ``marker``: the job created the marker file (default ``/.bootseer-seal``, a regular
  file) inside the container, which the layer server sees in the snapshot's upper
  directory (looked up beneath a descriptor of it: a symlink is no marker);
* ``quiet``: no new block for ``quiet`` seconds since the last new one (the clock
  starts at the first block: a container prepared long before it starts is not
  sealed empty by it);
* ``window``: ``window`` seconds since the snapshot was prepared.

Times are trio's clock, so tests run the timers on trio's autojump clock.
"""

from __future__ import annotations

import math
import socket
import stat
import time
from dataclasses import dataclass
from typing import Sequence

import trio

from bootseer import __version__, confined
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.hotlist.format import HotBlock, HotList

#: Why a recording ended (the hot list's ``sealed_by``).
SEAL_REASONS = ("seal", "removed", "marker", "quiet", "window")


@dataclass(frozen=True)
class RecordingLimits:
    """When recording ends by itself."""

    quiet: float = 10.0  #: seconds without a new block (after the first) that end it
    window: float = 120.0  #: seconds after the prepare that end it at the latest
    marker: str = ".bootseer-seal"  #: file name, at the container's root, that ends it
    marker_poll: float = 0.5  #: how often the upper directory is checked for the marker

    def __post_init__(self) -> None:
        if not (self.quiet > 0 and self.window > 0 and self.marker_poll > 0):
            raise ValueError("hot-list quiet period, window and marker poll must be positive seconds")
        if not self.marker or "/" in self.marker or self.marker in (".", ".."):
            raise ValueError(f"the seal marker must be a plain file name, not {self.marker!r}")


class Recording:
    """The first touches of one container's boot (see the module docstring)."""

    def __init__(
        self,
        *,
        container: str,
        image: str,
        profile: str,
        layers: Sequence[str],
        started: float,
        upper: str | None = None,
        marker: str = RecordingLimits.marker,
        any_reader: bool = False,
        publish_to: str | None = None,
    ) -> None:
        self.container = container
        self.image = image
        self.profile = profile
        self.layers = list(layers)  #: the image's ChainIDs, bottom first
        self._layer_set = set(self.layers)
        self.started = started  #: trio time the writable snapshot was prepared
        self.started_wall = time.time()
        self.upper = upper  #: the snapshot's upper directory (where the marker appears)
        self.marker = marker
        #: every reader of the image's layers is this recording's (a bare-metal prefix: no container's cgroup)
        self.any_reader = any_reader
        self.publish_to = publish_to  #: the store the list goes to (fixed at the start: the layer may go first)
        self.blocks: list[HotBlock] = []
        self._seen: set[tuple[str, str]] = set()
        self.last_new: float | None = None
        self.unattributed = 0
        self.sealed = trio.Event()
        self.sealed_by = ""
        self.sealed_at: float | None = None
        self.done = trio.Event()  #: set once the list is published (or dropped)
        self.outcome = ""  #: published, lost_race, empty, failed, discarded

    def __repr__(self) -> str:
        return f"<Recording {self.container} of {self.image[:19]} profile={self.profile!r} blocks={len(self.blocks)}>"

    def covers(self, layer: str) -> bool:
        return layer in self._layer_set

    def touch(self, layer: str, index: LayerBlocks, refs: Sequence[int], now: float) -> int:
        """Record the first touch of each block ``refs`` of ``layer`` at trio time ``now``; how many were new.

        Zero blocks are not recorded (nothing to fetch).  Ignored once sealed.
        """
        if self.sealed.is_set() or layer not in self._layer_set:
            return 0
        new = 0
        at = max(0.0, now - self.started)
        for ref in refs:
            block = index.blocks[ref]
            if block.is_zero or (layer, block.digest) in self._seen:
                continue
            self._seen.add((layer, block.digest))
            self.blocks.append(HotBlock(layer, block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen, at))
            new += 1
        if new:
            self.last_new = now
        return new

    def seal(self, reason: str, now: float | None = None) -> bool:
        """End recording for ``reason`` (one of :data:`SEAL_REASONS`); False if it had ended already."""
        if reason not in SEAL_REASONS:
            raise ValueError(f"unknown seal reason {reason!r}")
        if self.sealed.is_set():
            return False
        self.sealed_by = reason
        self.sealed_at = trio.current_time() if now is None else now
        self.sealed.set()
        return True

    def marker_present(self) -> bool:
        """Whether the job made the seal marker: a regular file named :attr:`RecordingLimits.marker` in the upper
        directory, looked up beneath a descriptor of it (a symlink there is no marker, and is never followed)."""
        if self.upper is None:
            return False
        try:
            with confined.opened_dir(self.upper) as fd:
                return confined.exists_beneath(fd, self.marker, stat.S_IFREG)
        except OSError:
            return False

    def hot_list(self) -> HotList:
        """The recorded list (call once sealed)."""
        duration = (self.sealed_at if self.sealed_at is not None else trio.current_time()) - self.started
        return HotList(
            image=self.image,
            profile=self.profile,
            layers=self.layers,
            blocks=list(self.blocks),
            recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_wall)),
            node=socket.gethostname(),
            container=self.container,
            sealed_by=self.sealed_by,
            duration=max(0.0, duration),
            unattributed=self.unattributed,
            recorder=f"bootseer {__version__}",
        )


async def run_recording(recording: Recording, limits: RecordingLimits) -> str:
    """Wait until ``recording`` seals (explicitly, by marker, quiet period or window); the reason."""
    while not recording.sealed.is_set():
        now = trio.current_time()
        if now >= recording.started + limits.window:
            recording.seal("window", now)
            break
        if recording.last_new is not None and now >= recording.last_new + limits.quiet:
            recording.seal("quiet", now)
            break
        if recording.marker_present():
            recording.seal("marker", now)
            break
        wake = min(
            recording.started + limits.window,
            # Before the first block, look again every quiet period: a touch sets no event.
            (recording.last_new if recording.last_new is not None else now) + limits.quiet,
            now + limits.marker_poll if recording.upper is not None else math.inf,
        )
        with trio.move_on_at(wake):
            await recording.sealed.wait()
    return recording.sealed_by
