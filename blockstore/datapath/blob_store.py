"""The blob directory's budget: local blobs kept after their layers go, and evicted whole, least recently used first.

On the ``fanotify`` path a layer's blob (``CACHE/blobs/<index>.blob``, its fill map
``<index>.filled`` and the record of its last clean close ``<index>.closed``: :mod:`.local_blobs`,
:mod:`.blob_check`) is the node's copy of that layer's blocks.  It outlives the mount: the last
unmount of an index closes its blob cleanly and keeps it, and a later mount of the same index (a
second pull of the image, a layer shared by the next image) opens it again with its fill map, so
the blocks on disk are not fetched again.  :class:`BlobStore` bounds what the kept blobs take:

* **One budget, ``--cache-size``** (``LayerServerConfig.cache_size``, the snapshotter's
  ``[cache] size``), for the node cache and the blobs together.  What a blob takes is what it holds
  on disk (``st_blocks``: a blob is sparse) plus its fill map and record.
* **What gives way, in order**: blobs no mounted layer uses (*kept* blobs), whole, least recently
  used first (the latest change of any of their three files: a fill, a clean close); then the node
  cache's entries (its own LRU: it is bounded by the budget less the blobs in use, ``others`` of
  :class:`~bootseer.fetch.file_cache.VerifiedFileCache`).  A blob a mounted layer uses is never
  evicted: when the blobs in use alone exceed the budget, one warning says so and the kept blobs
  and the node cache are all that go.
* **When**: every :data:`CHECK_SECONDS` while the server runs, and at each close of a blob (an
  unmount); a check that finds blobs and node cache over the budget evicts down to
  :data:`LOW_WATER` of it, as the node cache does.  Each eviction is one log line and counted
  (``bootseer_local_blob_evictions_total``, ``bootseer_local_blob_evicted_bytes_total``;
  :meth:`BlobStore.statistics`).
* **A kill at any point**: an eviction unlinks the record first (a blob without it is verified in
  full when opened again), then the fill map, then the blob.  A blob left without its map is no
  blob (nothing says which of its blocks are there), and a map without its blob no map: the next
  server's :meth:`BlobStore.sweep` removes either, with any record or temp file of a record left
  alone.  So a kill leaves the blob whole, half gone (removed at the next start) or gone.
* **An eviction never races an open**: :meth:`FanotifyBlobs.open
  <bootseer.blockstore.datapath.local_blobs.FanotifyBlobs.open>` holds the index's lock
  (:meth:`BlobStore.hold`) while it makes its blob, and an eviction takes the same lock and then
  checks that no layer uses the blob (``in_use``).

The snapshotter's ``Remove`` of a snapshot (containerd's GC of an image's snapshots) is an unmount:
it frees the snapshot's mount and slot at once, as containerd expects, while the bytes stay as the
node cache's do, a cache within the budget (stargz-snapshotter's cache outlives its snapshots too).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
import trio

from bootseer.locks import TrioKeyedLocks
from bootseer.log import get_logger

log = get_logger(__name__)

#: Seconds between two checks of the budget while the server runs (a check is a few ``stat`` calls a blob).
CHECK_SECONDS = 2.0
#: A check over the budget evicts down to this fraction of it (as the node cache does).
LOW_WATER = 0.9
#: A blob's files: the blob, its fill map, the record of its last clean close (unlinked in reverse order).
SUFFIXES = (".blob", ".filled", ".closed")
_NAME = re.compile(r"[0-9a-f]{64}")
#: A clean-close record being written (:func:`bootseer.atomic.write_atomically`'s temp name for ``<index>.closed``).
_RECORD_TEMP = re.compile(r"\.([0-9a-f]{64})\.closed\..*\.tmp")

EVICTIONS = prometheus_client.Counter(
    "bootseer_local_blob_evictions", "Local blobs no mounted layer used, evicted whole to keep blobs and node cache within --cache-size"
)
EVICTED_BYTES = prometheus_client.Counter(
    "bootseer_local_blob_evicted_bytes", "Bytes on disk of the local blobs evicted (their blocks, fill maps and records)"
)
BLOB_BYTES = prometheus_client.Gauge(
    "bootseer_local_blob_bytes", "Bytes on disk of local blobs as the last check found them, by state: in_use (a mounted "
    "layer's: never evicted) or kept (no layer's: evicted first)", ["state"],
)  # fmt: skip
for _state in ("in_use", "kept"):
    BLOB_BYTES.labels(_state)


@dataclass(frozen=True)
class BlobOnDisk:
    """One blob's files as a scan found them."""

    name: str  #: the layer index's name (64 hex digits)
    bytes: int  #: what they take on disk: the blob's allocated blocks, the map's and record's sizes
    last_use: float  #: the latest ``st_mtime`` of the three (a fill, a note in the map, a clean close)


@dataclass(frozen=True)
class BlobStoreStatistics:
    """What :meth:`BlobStore.statistics` reports (as of its last check)."""

    budget: int  #: ``--cache-size``: blobs and node cache together
    in_use_bytes: int  #: blobs a mounted layer uses
    kept_bytes: int  #: blobs no layer uses (evicted first)
    kept: int  #: how many blobs no layer uses
    evictions: int  #: blobs evicted by this server
    evicted_bytes: int
    over_budget: bool  #: blobs in use and node cache exceed the budget with no kept blob left to evict


class BlobStore:
    """The blob directory of one layer server and its budget (see the module docstring).

    ``in_use``: the names of the blobs a layer uses now (open, or kept by the event holder for a
    layer whose restore is retried); ``cache_bytes``: what the node cache takes on disk now."""

    def __init__(self, directory: Path, budget: int, *, in_use: Callable[[], Collection[str]],
                 cache_bytes: Callable[[], int] = lambda: 0) -> None:  # fmt: skip
        if budget < 1:
            raise ValueError(f"the cache size must be positive, not {budget}")
        self.directory = directory
        self.budget = budget
        self._in_use = in_use
        self._cache_bytes = cache_bytes
        self._locks = TrioKeyedLocks()
        self._checking = trio.Lock()
        self._in_use_bytes = 0
        self._kept_bytes = 0
        self._kept = 0
        self._evictions = 0
        self._evicted_bytes = 0
        self._over_budget = False

    # -- what the node cache and the blobs' owner ask -----------------------------------------

    def in_use_bytes(self) -> int:
        """Bytes of the blobs in use, as of the last check: what the node cache leaves them (any thread)."""
        return self._in_use_bytes

    @asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """Hold blob ``name`` against eviction for the block (an open: its blob is in use once the block ends)."""
        async with self._locks.hold(name):
            yield

    def statistics(self) -> BlobStoreStatistics:
        return BlobStoreStatistics(self.budget, self._in_use_bytes, self._kept_bytes, self._kept, self._evictions,
                                   self._evicted_bytes, self._over_budget)  # fmt: skip

    # -- the directory --------------------------------------------------------------------------

    def sweep(self) -> list[str]:
        """At start, before any blob is opened: remove what an eviction, a removal or a crash left half done (a blob
        without its fill map, a map without its blob, a record of neither, a record's temp file); the names
        whose blob or map was removed.  Blocking."""
        names: dict[str, set[str]] = {}
        removed: set[str] = set()
        for entry in os.scandir(self.directory):
            if _RECORD_TEMP.fullmatch(entry.name):  # a record's write cut short
                _unlink(Path(entry.path))
                continue
            stem, dot, suffix = entry.name.partition(".")
            if dot and _NAME.fullmatch(stem) and "." + suffix in SUFFIXES:
                names.setdefault(stem, set()).add("." + suffix)
        for name, suffixes in sorted(names.items()):
            if {".blob", ".filled"} <= suffixes:
                continue
            log.warning("removing what is left of a local blob (its blob or its fill map is gone: an eviction or a "
                        "removal was cut short)", index=name, files=sorted(suffixes))  # fmt: skip
            self._remove(name)
            removed.add(name)
        return sorted(removed)

    def scan(self) -> list[BlobOnDisk]:
        """Every blob on disk (its blob and map both there), with what it takes and when it was last used.  Blocking."""
        found = []
        for entry in os.scandir(self.directory):
            stem, dot, suffix = entry.name.partition(".")
            if suffix != "blob" or not dot or not _NAME.fullmatch(stem):
                continue
            size, last = 0, 0.0
            whole = True
            for ending in SUFFIXES:
                try:
                    stat = os.stat(self.directory / f"{stem}{ending}")
                except FileNotFoundError:
                    whole = whole and ending == ".closed"
                    continue
                size += stat.st_blocks * 512 if ending == ".blob" else stat.st_size
                last = max(last, stat.st_mtime)
            if whole:
                found.append(BlobOnDisk(stem, size, last))
        return found

    def _remove(self, name: str) -> None:
        """Unlink blob ``name``'s files: the record, the map, then the blob (a kill between leaves what
        :meth:`sweep` removes).  Blocking."""
        for suffix in reversed(SUFFIXES):
            _unlink(self.directory / f"{name}{suffix}")

    async def remove(self, name: str) -> None:
        """Remove blob ``name``'s files (a blob that must not be opened again: see ``forget_unclaimed``)."""
        async with self._locks.hold(name):
            await trio.to_thread.run_sync(self._remove, name)

    # -- the budget -----------------------------------------------------------------------------

    async def check(self) -> int:
        """Scan the blobs; while they and the node cache exceed the budget, evict kept blobs, least recently used
        first, down to :data:`LOW_WATER` of it; how many were evicted."""
        async with self._checking:
            found = await trio.to_thread.run_sync(self.scan)
            used = set(self._in_use())
            in_use = sum(blob.bytes for blob in found if blob.name in used)
            kept = sorted((blob for blob in found if blob.name not in used), key=lambda blob: blob.last_use)
            kept_bytes = sum(blob.bytes for blob in kept)
            self._set(in_use, kept_bytes, len(kept))
            cache = self._cache_bytes()
            total = in_use + kept_bytes + cache
            evicted = 0
            if total > self.budget:
                target = int(self.budget * LOW_WATER)
                for blob in kept:
                    if total <= target:
                        break
                    async with self._locks.hold(blob.name):
                        if blob.name in self._in_use():  # opened meanwhile: in use now
                            continue
                        try:
                            await trio.to_thread.run_sync(self._remove, blob.name)
                        except OSError as exc:
                            log.warning("cannot evict a local blob", index=blob.name, error=str(exc))
                            continue
                    evicted += 1
                    total -= blob.bytes
                    kept_bytes -= blob.bytes
                    self._evictions += 1
                    self._evicted_bytes += blob.bytes
                    EVICTIONS.inc()
                    EVICTED_BYTES.inc(blob.bytes)
                    log.info("evicted a local blob no mounted layer uses (least recently used first)", index=blob.name,
                             bytes=blob.bytes, idle_s=round(time.time() - blob.last_use, 1), budget=self.budget,
                             in_use=in_use, node_cache=cache)  # fmt: skip
                self._set(in_use, kept_bytes, len(kept) - evicted)
            over = total > self.budget
            if over and not self._over_budget:
                log.warning("the local blobs that mounted layers use and the node cache exceed --cache-size, with no "
                            "kept blob left to evict (a mounted layer's blob is never evicted)",
                            budget=self.budget, in_use=in_use, node_cache=cache)  # fmt: skip
            self._over_budget = over
            return evicted

    def _set(self, in_use: int, kept_bytes: int, kept: int) -> None:
        self._in_use_bytes, self._kept_bytes, self._kept = in_use, kept_bytes, kept
        BLOB_BYTES.labels("in_use").set(in_use)
        BLOB_BYTES.labels("kept").set(kept_bytes)

    async def run(self, ready: trio.Event) -> None:
        """Check the budget every :data:`CHECK_SECONDS` once ``ready`` (the layers restored: what is in use is known)."""
        await ready.wait()
        while True:
            try:
                await self.check()
            except OSError as exc:  # the directory unreadable for a while: the next check tries again
                log.warning("cannot check the local blobs' budget", directory=str(self.directory), error=str(exc))
            await trio.sleep(CHECK_SECONDS)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


__all__ = ["BLOB_BYTES", "EVICTED_BYTES", "EVICTIONS", "BlobOnDisk", "BlobStore", "BlobStoreStatistics", "CHECK_SECONDS",
           "LOW_WATER", "SUFFIXES"]  # fmt: skip
