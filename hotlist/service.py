"""Hot lists inside the layer server: record first boots, prefetch later ones, account for every read.

One :class:`HotListService` lives in the layer server as its extension
(:class:`~bootseer.blockstore.server.extension.ServerExtension`: the ``bootseer layer-server``
main plugs it in; the server never imports this package) and sees the server only as a
:class:`~bootseer.blockstore.server.extension.LayerHost`.  It is told three things:

* ``layer_mounted(chain_id)`` (the server mounted a layer: rpull or containerd's
  unpacker prepared it): if the store holds a default-profile hot list keyed by that
  ChainID, the layer is an image's top, all the image's layers are served, and
  prefetch starts now, before any container exists.
* control op ``hotlist.prepared`` (from the snapshotter, when a container's writable
  snapshot is prepared on top of a served layer): the container joins its image's
  prefetch if one runs for its profile; otherwise recording starts at once (so reads
  from t=0 are seen) while the store is asked for the hot list (image top ChainID,
  ``bootseer.io/profile`` label): a valid list turns the recording into a prefetch,
  none lets it run, an invalid one is logged and ignored (nothing is recorded: the
  name is taken until ``bootseer hotlist clear``).
  With ``"readers": "any"`` (``bootseer deps run`` restoring a bare-metal prefix, which
  has no container), the "container" is the prefix's name and every reader of the
  layer counts as its (only while no container's recording claims the read), and
  the marker is looked for in the prefix's upper directory.
* control op ``hotlist.removed`` (the container's snapshot, or the prefix, is gone):
  its recording seals; a prefetch whose containers are all gone stops, with a
  summary line.

And, as the layers' read observer (:class:`~bootseer.blockstore.datapath.tree.ReadObserver`),
every FUSE open and read of a served layer's files (:meth:`opened`, :meth:`read`) and every
read of its blob (:meth:`blob_read`): attributed to a recording and classified for the
prefetches as :mod:`bootseer.hotlist.accounting` says.

The parts are modules of their own, which this one wires: the store lookup
(:mod:`~bootseer.hotlist.lookup`), the prefetches' lifecycle (:mod:`~bootseer.hotlist.prefetching`),
a recording's end (:mod:`~bootseer.hotlist.publishing`), the read accounting
(:mod:`~bootseer.hotlist.accounting`) and the ``hotlist.*`` control operations
(:mod:`~bootseer.hotlist.control`).  What it holds is read through :meth:`HotListService.statistics`.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import trio

from bootseer.blockstore.datapath.tree import LayerTree
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import Entry
from bootseer.blockstore.server.extension import LayerHost
from bootseer.blockstore.server.ops import ControlOps
from bootseer.fetch.sources import redact_url
from bootseer.hotlist import control
from bootseer.hotlist.accounting import OpenTag, ReadAccounting
from bootseer.hotlist.attribution import container_id
from bootseer.hotlist.format import HotListError, profile_of_labels
from bootseer.hotlist.lookup import HotListLookup
from bootseer.hotlist.prefetch import Prefetch, PrefetchLimits
from bootseer.hotlist.prefetching import Prefetches, log_fields
from bootseer.hotlist.publishing import discard, publish
from bootseer.hotlist.recorder import Recording, RecordingLimits, run_recording
from bootseer.hotlist.tasks import spawn_guarded
from bootseer.hotlist.warm import WarmReads, WarmTarget
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks

log = get_logger(__name__)

#: Summaries of ended recordings and prefetches a service keeps (the newest).
FINISHED_KEPT = 32


@dataclass(frozen=True)
class HotListConfig:
    """The layer server's hot-list settings (``bootseer layer-server --hotlist-*`` and ``--publish-store``)."""

    enabled: bool = True
    publish_store: str | None = None  #: where hot lists are written; None: the layers' store
    recording: RecordingLimits = field(default_factory=RecordingLimits)
    prefetch: PrefetchLimits = field(default_factory=PrefetchLimits)


@dataclass(frozen=True)
class RecordingStatistics:
    """A running recording, as :meth:`HotListService.statistics` reports it."""

    container: str  #: the container (or bare-metal prefix) recorded
    readers: str  #: ``container`` (its reads only) or ``any`` (every reader's: a prefix)
    image: str
    profile: str
    blocks: int  #: first touches so far
    running_s: float
    sealed_by: str  #: what sealed it ("" while it runs)


@dataclass(frozen=True)
class PrefetchStatistics:
    """A running prefetch, as :meth:`HotListService.statistics` reports it."""

    image: str
    profile: str
    containers: tuple[str, ...]  #: the containers it serves, sorted
    counts: dict[str, Any]  #: its :class:`~bootseer.hotlist.prefetch.PrefetchStats`, as of the call


@dataclass(frozen=True)
class HotListStatistics:
    """What :meth:`HotListService.statistics` returns."""

    enabled: bool
    publish_store: str  #: where hot lists are published, redacted ("": the layers' store)
    recordings: tuple[RecordingStatistics, ...]
    prefetches: tuple[PrefetchStatistics, ...]
    finished: tuple[dict[str, Any], ...]  #: summaries of the last ended recordings and prefetches, oldest first


@dataclass
class _Container:
    key: str
    image: str
    profile: str
    prepared: float
    upper: str | None


class HotListService:
    """See the module docstring.  ``server`` is the layer server that registers the service (:class:`LayerHost`)."""

    def __init__(self, server: LayerHost, config: HotListConfig | None = None) -> None:
        self.server = server
        self.config = config or HotListConfig()
        self.recordings: dict[str, Recording] = {}  #: container ID -> its recording
        self.containers: dict[str, _Container] = {}  #: container ID -> what it was prepared on
        #: summaries of ended recordings and prefetches (the last FINISHED_KEPT)
        self.finished: collections.deque[dict[str, Any]] = collections.deque(maxlen=FINISHED_KEPT)
        self.warm_reads = WarmReads()  #: blocks page-cache warmers are reading through EROFS (not a job's reads)
        self.lookup = HotListLookup(server)
        self.prefetching = Prefetches(server, self.lookup, self.config.prefetch, self.config.recording.window,
                                      self.warm_reads, self.finished)  # fmt: skip
        self.reads = ReadAccounting(self.recordings, self.prefetching.running, self.warm_reads)

    @property
    def prefetches(self) -> dict[tuple[str, str], Prefetch]:
        """The running prefetches, by (image, profile)."""
        return self.prefetching.running

    @property
    def proc(self) -> str:
        """Where callers' cgroups are read (tests point it elsewhere)."""
        return self.reads.proc

    @proc.setter
    def proc(self, value: str) -> None:
        self.reads.proc = value

    def image_layers(self, top: str) -> list[str] | None:
        """The served chain ending in ``top``, bottom first; None if any of it is not served."""
        return self.lookup.image_layers(top)

    def warm_target(self, chain_id: str) -> WarmTarget:
        """Where the kernel caches ``chain_id``'s blocks (:meth:`Prefetches.warm_target`)."""
        return self.prefetching.warm_target(chain_id)

    def _spawn(self, function: Any, *args: Any) -> None:
        spawn_guarded(self.server.nursery, function, *args)

    # -- triggers --------------------------------------------------------------------------

    def layer_mounted(self, chain_id: str) -> None:
        """A layer was mounted: start the default-profile prefetch if it is an image's top with a hot list."""
        if self.config.enabled:
            self._spawn(self._prefetch_if_listed, chain_id)

    async def _prefetch_if_listed(self, image: str) -> None:
        if (image, "") in self.prefetches or self.image_layers(image) is None:
            return
        try:
            hot = await self.lookup.find(image, "")
        except HotListError:
            return  # logged
        if hot is not None and (image, "") not in self.prefetches:
            await self.prefetching.start(hot)

    # -- containers ---------------------------------------------------------------------------

    async def container_prepared(self, key: str, parent: str, labels: dict[str, str], upper: str | None,
                                 any_reader: bool = False) -> dict[str, Any]:  # fmt: skip
        """A container's writable snapshot ``key`` was prepared on ``parent``: prefetch or record.

        ``key`` is the snapshot key as the snapshotter got it; the container is named by
        the ID in it (:func:`~bootseer.hotlist.attribution.container_id`).  ``any_reader``:
        there is no container (a bare-metal prefix): a recording takes every reader's reads.
        """
        key = container_id(key)
        profile_hooks.armed_first_read(key)  # start-up profiler: this container's first read is an event
        if not self.config.enabled:
            return {"action": "disabled"}
        layers = self.image_layers(parent) if parent else None
        if layers is None:
            return {"action": "none", "reason": "the parent is not a lazily served image"}
        profile = profile_of_labels(labels)
        now = trio.current_time()
        if key in self.containers:
            return {"action": "known"}
        container = _Container(key, parent, profile, now, upper)
        self.containers[key] = container
        prefetch = self.prefetches.get((parent, profile))
        if prefetch is not None:
            self.prefetching.attach(prefetch, key)
            return {"action": "prefetch"}
        for (image, other), running in list(self.prefetches.items()):
            if image == parent and other != profile and not running.containers:
                # The early default-profile guess is not this workload: it would only compete with its reads.
                log.info("stopping the default hot-list prefetch: the container runs another profile", image=image, profile=profile)
                await self.prefetching.end(running)
        if any(r.image == parent and r.profile == profile for r in self.recordings.values()):
            return {"action": "none", "reason": "another container of this image is being recorded"}
        recording = Recording(container=key, image=parent, profile=profile, layers=layers, started=now, upper=upper,
                              marker=self.config.recording.marker, any_reader=any_reader,
                              publish_to=self.config.publish_store or self.server.layers[parent].store)  # fmt: skip
        self.recordings[key] = recording
        self._spawn(self._decide, recording)
        return {"action": "record"}

    async def _decide(self, recording: Recording) -> None:
        """Look the hot list up while recording runs: a list means prefetch, none means record to the end."""
        try:
            hot = await self.lookup.find(recording.image, recording.profile)
        except HotListError:
            discard(self.recordings, recording, "the stored hot list is invalid")
            return
        if hot is not None:
            discard(self.recordings, recording, "a hot list exists")
            prefetch = self.prefetches.get((hot.image, hot.profile)) or await self.prefetching.start(hot)
            if prefetch is not None and recording.container in self.containers:
                self.prefetching.attach(prefetch, recording.container)
            return
        log.info("recording the image's first boot", container=recording.container, image=recording.image,
                 profile=recording.profile, layers=len(recording.layers))  # fmt: skip
        await run_recording(recording, self.config.recording)
        await publish(self.recordings, recording, self.server.sign_key, self.finished)

    async def container_removed(self, key: str) -> dict[str, Any]:
        key = container_id(key)
        container = self.containers.pop(key, None)
        recording = self.recordings.get(key)
        if recording is not None:
            recording.seal("removed")
        for prefetch in list(self.prefetches.values()):
            if key in prefetch.containers:
                prefetch.containers.discard(key)
                if not prefetch.containers:
                    await self.prefetching.end(prefetch)  # first: the line then says what the page cache served
                log.info("prefetched container gone", container=key, image=prefetch.image, profile=prefetch.profile,
                         **log_fields(prefetch))  # fmt: skip
        return {"known": container is not None}

    async def seal(self, key: str, wait: float = 8.0) -> dict[str, Any]:
        recording = self.recordings.get(key)
        if recording is None:
            return {"sealed": False, "reason": f"container {key!r} is not being recorded on this node"}
        recording.seal("seal")
        with trio.move_on_after(wait):
            await recording.done.wait()
        return {"sealed": True, "outcome": recording.outcome or "publishing", "blocks": len(recording.blocks)}

    def statistics(self) -> HotListStatistics:
        """The service's recordings, prefetches and last summaries, as of now."""
        now = trio.current_time()
        return HotListStatistics(
            enabled=self.config.enabled,
            publish_store=redact_url(self.config.publish_store or ""),
            recordings=tuple(
                RecordingStatistics(container=r.container, readers="any" if r.any_reader else "container", image=r.image,
                                    profile=r.profile, blocks=len(r.blocks), running_s=round(now - r.started, 3),
                                    sealed_by=r.sealed_by)
                for r in self.recordings.values()
            ),
            prefetches=tuple(
                PrefetchStatistics(image=p.image, profile=p.profile, containers=tuple(sorted(p.containers)),
                                   counts=p.stats.as_dict())
                for p in self.prefetches.values()
            ),
            finished=tuple(self.finished),
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        """The ``hotlist.status`` answer: :meth:`statistics` as JSON."""
        stats = self.statistics()
        return {
            "enabled": stats.enabled,
            "recordings": [dataclasses.asdict(recording) for recording in stats.recordings],
            "prefetches": [{"image": p.image, "profile": p.profile, "containers": list(p.containers), **p.counts}
                           for p in stats.prefetches],
            "finished": list(stats.finished),
        }  # fmt: skip

    def status_fields(self) -> dict[str, Any]:
        """The server's status answer names where hot lists are published (redacted)."""
        return {"publish_store": self.statistics().publish_store}

    def register_ops(self, control_ops: ControlOps) -> None:
        """Answer the layer server's ``hotlist.*`` control operations (:meth:`dispatch`)."""
        control_ops.register_family("hotlist.", self.dispatch)

    async def dispatch(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a ``hotlist.*`` control request (:func:`bootseer.hotlist.control.dispatch`)."""
        return await control.dispatch(self, op, request)

    # -- the read observer (blockstore.datapath.tree.ReadObserver: every open and read of a served layer) --

    def opened(self, tree: LayerTree) -> OpenTag | None:
        """Who opened a file of ``tree``'s layer (:meth:`ReadAccounting.opened`)."""
        return self.reads.opened(tree)

    def read(self, tree: LayerTree, entry: Entry, offset: int, size: int, tag: OpenTag | None) -> None:
        """Account for a read of ``entry`` in ``tree``'s layer (:meth:`ReadAccounting.read`)."""
        self.reads.read(tree, entry, offset, size, tag)

    def blob_read(self, layer: str, index: LayerBlocks, refs: Sequence[int], pid: int) -> None:
        """Account for a read of blocks of ``layer``'s blob (:meth:`ReadAccounting.blob_read`)."""
        self.reads.blob_read(layer, index, refs, pid)

    def watches(self, layer: str) -> bool:
        """Whether a recording takes ``layer``'s first reads now (:meth:`ReadAccounting.watches`)."""
        return self.reads.watches(layer)


__all__ = ["HotListConfig", "HotListService", "HotListStatistics", "OpenTag", "PrefetchStatistics", "RecordingStatistics"]
