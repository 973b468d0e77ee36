"""Blobs that complete: the rest of each local blob filled once a start no longer needs the link.

On the ``fanotify`` data path a lazy start fills only the blocks it reads (:mod:`.local_blobs`): after
it, most blobs still have holes, so they stay marked, every later start raises an event per range
read (a round trip to the event holder each), and the window in which a node-wide kill of the holders
would turn a hole into zeros never closes.  :class:`BackgroundFill` closes it: once the node has
been idle for ``idle`` seconds (no fetch crossed the link, no read and no hot-list prefetch, and no
blob was read: a start that reads only what is on the node needs the disk and the CPU, if not the
link), it fills the missing blocks of the served blobs, a batch of at most ``batch`` stored bytes at a time through
the one fill path the events use (:meth:`FanotifyBlobs.fill_in_background`: verified blocks, written
once, concurrent events for the same blocks wait for it instead of fetching them again), at most
``rate`` stored bytes a second, and goes back to waiting for idle as soon as anything else fetches or
a blob is read.
So it never competes with a start for the link, and its CPU is bounded by its rate.  The last block
of a blob completes it: its mark is removed, and the kernel reads it alone from then on.

Its blocks are not reads: the hot-list recorder never sees them.  A batch that fails (a store that
fails, a full disk) is logged and counted, and the fill rests for :data:`FAILURE_PAUSE` seconds.
It is the layer server's ``[datapath] background_fill`` (on by default), ``background_fill_rate``
and ``background_fill_idle``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import prometheus_client
import trio

from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.log import get_logger

log = get_logger(__name__)

#: Seconds a fill rests after a batch failed.
FAILURE_PAUSE = 30.0

FILLED_BYTES = prometheus_client.Counter(
    "bootseer_background_fill_bytes", "Stored bytes of blocks the background fill wrote into local blobs"
)
BATCHES = prometheus_client.Counter(
    "bootseer_background_fill_batches", "Batches of the background fill, by outcome: filled or failed", ["outcome"]
)
for _outcome in ("filled", "failed"):
    BATCHES.labels(_outcome)


class Fillable(Protocol):
    """What the fill asks of a local blob (:class:`~.local_blobs.LocalBlob`)."""

    @property
    def complete(self) -> bool: ...

    def next_missing(self, limit: int) -> list[int]: ...

    def stored_bytes(self, refs: Sequence[int]) -> int: ...


B = TypeVar("B", bound=Fillable)


@dataclass(frozen=True)
class BackgroundFillStatistics:
    """What :meth:`BackgroundFill.statistics` reports (the ``status`` answer's ``fanotify.background_fill``)."""

    enabled: bool
    running: bool  #: filling now (the link was idle), not waiting for it
    batches: int  #: batches written
    blocks: int  #: blocks written
    stored_bytes: int  #: their stored (compressed) bytes
    failed: int  #: batches that failed
    yielded: int  #: times it stopped because something else fetched


class BackgroundFill(Generic[B]):
    """Fills the served blobs' missing blocks while the node's fetches are idle (see the module docstring).

    ``blobs()`` lists the blobs served now; ``fill(blob, refs)`` fills those blocks of it (those an event is
    filling already are left to it) and returns how many it wrote; ``activity()`` is a counter that grows
    whenever the node fetches or a blob is read (what says whether the node is idle).
    """

    def __init__(self, config: BackgroundFillConfig, blobs: Callable[[], Iterable[B]],
                 fill: Callable[[B, list[int]], Awaitable[int]], activity: Callable[[], int]) -> None:  # fmt: skip
        self.config = config
        self._blobs, self._fill, self._fetched = blobs, fill, activity
        self._counts = dict.fromkeys(("batches", "blocks", "stored_bytes", "failed", "yielded"), 0)
        self._running = False

    def statistics(self) -> BackgroundFillStatistics:
        return BackgroundFillStatistics(enabled=self.config.enabled, running=self._running, **self._counts)

    async def run(self) -> None:
        """Fill for ever (a task of the server's nursery); returns at once if the fill is off."""
        if not self.config.enabled:
            return
        while True:
            await self._idle()
            self._running = True
            try:
                await self._fill_while_idle()
            finally:
                self._running = False

    async def _idle(self) -> None:
        """Return once no fetch has happened for ``idle`` seconds and some blob has a hole."""
        while True:
            seen = self._fetched()
            await trio.sleep(self.config.idle)
            if self._fetched() == seen and self._next() is not None:
                return

    def _next(self) -> tuple[B, list[int]] | None:
        for blob in self._blobs():
            if not blob.complete:
                refs = blob.next_missing(self.config.batch)
                if refs:
                    return blob, refs
        return None

    async def _fill_while_idle(self) -> None:
        while (work := self._next()) is not None:
            blob, refs = work
            stored = blob.stored_bytes(refs)
            try:
                written = await self._fill(blob, refs)
            except Exception as exc:  # a store that fails, a full disk: the events' own fills say it to readers
                self._counts["failed"] += 1
                BATCHES.labels("failed").inc()
                log.warning("a batch of the background fill failed; it rests", blocks=len(refs),
                            pause_s=FAILURE_PAUSE, error=str(exc) or type(exc).__name__)  # fmt: skip
                await trio.sleep(FAILURE_PAUSE)
                return
            self._counts["batches"] += 1
            self._counts["blocks"] += written
            self._counts["stored_bytes"] += stored
            BATCHES.labels("filled").inc()
            FILLED_BYTES.inc(stored)
            after = self._fetched()
            await trio.sleep(stored / self.config.rate)  # the rate bound, and room for anyone else's fetch
            if self._fetched() != after:  # someone else fetched meanwhile: a start needs the link again
                self._counts["yielded"] += 1
                return
        log.info("background fill: every served blob is complete", blocks=self._counts["blocks"])


__all__ = ["BackgroundFill", "BackgroundFillStatistics", "FAILURE_PAUSE", "Fillable"]
