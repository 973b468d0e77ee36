"""Loading an image's layers ahead of their mounts: what a pull asks next, fetched while it asks this.

containerd's unpacker (and ``bootseer rpull``) prepares an image's layers one after another,
lowest first, and each remote layer's mount waits for its chain record, index and EROFS image
from the store, decoded and checked: most of a lazy pull.  ``bootseer rpull`` names, on each
layer's Prepare, the ChainIDs of the layers above it
(:data:`~bootseer.images.chains.LABEL_LAYERS_ABOVE`); the snapshotter passes them to the layer
server (the control operation ``warm``) once that layer is mounted, and :class:`LayerWarmer` loads them now, at most
``concurrency`` at once, by the mount's own load (the server passes its
:meth:`LayerLoader.load <bootseer.blockstore.server.layer_loader.LayerLoader.load>`: chain record trusted,
index verified, image checked and kept), and holds each result until the layer's mount takes it,
for at most ``keep`` seconds.  A result no mount took (expired, or dropped as the server stops)
is handed to ``discard`` (the loader's
:meth:`~bootseer.blockstore.server.layer_loader.LayerLoader.discard`), which removes what the load
kept on disk (its EROFS image), so a warm never taken leaves nothing behind.

A warm never changes what a mount does, only how long it waits:
- nothing loaded ahead is served before a mount takes it, and a mount takes only a load of its
  own store;
- a mount that finds its layer loading waits for that load; one that finds the load failed
  loads again itself (and fails, if it does, with its own error and context);
- a load that raises anything is counted and logged, never the server's failure, and frees its
  slot at once (a warm naming ChainIDs the store lacks never holds slots a real layer could use).
At most ``max_entries`` loads are held or running; a warm beyond that is ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import trio

from bootseer.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

#: Loads running at once beside the mounts' own (each fetches, decodes and checks one layer; the decodes
#: share the server's decode threads and the checks its one checker process, so more would only queue).
WARM_CONCURRENCY = 2
#: Seconds a load's result waits for its mount before it is dropped.
WARM_KEEP = 120.0
#: Loads held or running at most.
WARM_MAX_ENTRIES = 64


@dataclasses.dataclass(frozen=True)
class WarmStatistics:
    """What :meth:`LayerWarmer.statistics` reports (the ``status`` answer's ``warm``)."""

    requested: int  #: ChainIDs a warm asked for that were not loaded, loading or served already
    loaded: int  #: loads that finished
    failed: int  #: loads that failed (their mount loads again; their slot was freed at once)
    taken: int  #: loads a mount took
    expired: int  #: loads dropped with no mount taking them
    ignored: int  #: ChainIDs not loaded: the table of loads was full
    held: int  #: loads running or waiting for their mount now


class _Load(Generic[T]):
    __slots__ = ("store", "done", "result", "cancel")

    def __init__(self, store: str) -> None:
        self.store = store
        self.done = trio.Event()
        self.result: T | None = None
        self.cancel = trio.CancelScope()


class LayerWarmer(Generic[T]):
    """Loads layers ahead of their mounts with ``load(chain_id, store)`` in tasks of ``nursery``."""

    def __init__(self, nursery: trio.Nursery, load: Callable[[str, str], Awaitable[T]], *,
                 discard: Callable[[T], None] | None = None, concurrency: int = WARM_CONCURRENCY,
                 keep: float = WARM_KEEP, max_entries: int = WARM_MAX_ENTRIES) -> None:  # fmt: skip
        """``discard`` is called with each result no mount took, once it is dropped (at its expiry, or when the
        load's task is cancelled: the server stops); it must not block, and what it raises is logged."""
        self._nursery = nursery
        self._load = load
        self._discard = discard
        self._limit = trio.Semaphore(concurrency)
        self._keep = keep
        self._max = max_entries
        self._loads: dict[str, _Load[T]] = {}
        self._counts = dict.fromkeys(("requested", "loaded", "failed", "taken", "expired", "ignored"), 0)

    def warm(self, chain_ids: Sequence[str], store: str, served: Callable[[str], bool]) -> int:
        """Start loading each of ``chain_ids`` from ``store`` that is not ``served`` or known here; how many started."""
        started = 0
        for chain_id in chain_ids:
            if chain_id in self._loads or served(chain_id):
                continue
            if len(self._loads) >= self._max:
                self._counts["ignored"] += 1
                continue
            self._loads[chain_id] = entry = _Load[T](store)
            self._counts["requested"] += 1
            self._nursery.start_soon(self._run, chain_id, entry)
            started += 1
        return started

    async def take(self, chain_id: str, store: str) -> T | None:
        """The result of ``chain_id``'s load from ``store`` (waited for if it is running), now the caller's;
        None if there is none, it failed, or it was of another store (which then stays)."""
        entry = self._loads.get(chain_id)
        if entry is None or entry.store != store:
            return None
        await entry.done.wait()
        if self._loads.get(chain_id) is entry:
            del self._loads[chain_id]
            entry.cancel.cancel()  # its wait to expire
        if entry.result is not None:
            self._counts["taken"] += 1
        return entry.result

    def holds(self, chain_id: str) -> bool:
        """Whether a load of ``chain_id`` is running or waiting for its mount now."""
        return chain_id in self._loads

    def statistics(self) -> WarmStatistics:
        return WarmStatistics(**self._counts, held=len(self._loads))

    async def _run(self, chain_id: str, entry: _Load[T]) -> None:
        try:
            with entry.cancel:
                async with self._limit:
                    try:
                        entry.result = await self._load(chain_id, entry.store)
                        self._counts["loaded"] += 1
                    except Exception as exc:  # the mount loads again and says what is wrong
                        self._counts["failed"] += 1
                        log.info("loading a layer ahead of its mount failed; its mount will load it", chain_id=chain_id,
                                 error=str(exc) or type(exc).__name__)  # fmt: skip
                        if self._loads.get(chain_id) is entry:
                            del self._loads[chain_id]  # its slot, free at once (a mount waiting on it gets None)
                entry.done.set()
                if entry.result is not None:
                    await trio.sleep(self._keep)
                    if self._loads.get(chain_id) is entry:
                        self._counts["expired"] += 1
        finally:
            entry.done.set()
            if self._loads.get(chain_id) is entry:  # not taken: expired, or dropped (the server stops)
                del self._loads[chain_id]
                if entry.result is not None and self._discard is not None:
                    try:
                        self._discard(entry.result)
                    except Exception as exc:  # what the load kept stays on disk: logged, never the server's failure
                        log.warning("cannot discard a layer loaded ahead that no mount took", chain_id=chain_id,
                                    error=str(exc) or type(exc).__name__)  # fmt: skip


__all__ = ["LayerWarmer", "WarmStatistics", "WARM_CONCURRENCY", "WARM_KEEP", "WARM_MAX_ENTRIES"]
