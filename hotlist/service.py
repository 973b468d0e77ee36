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
every FUSE open and read of a served layer's files (:meth:`opened`, :meth:`read`)
and every read of its blob (:meth:`blob_read`).  A file read is attributed at its
open, through the opener's pid and cgroup (:mod:`bootseer.hotlist.attribution`); a
blob read, which has no open of its own, at the read, through the reader's pid and
cgroup (0 when unknown: see :class:`~bootseer.blockstore.datapath.tree.LayerBlobOpenFile`).
Both record first touches in the order reads arrive and classify them for prefetches
alike.  A blob read of a block that a page-cache warmer is reading through the
layer's EROFS mount at that moment (:class:`~bootseer.hotlist.warm.WarmReads`) is the
warmer's, and left out of both.  A read of a recording image's
layer whose opener is not any recording container (another container sharing the
layer, a host process) is left out of the trace.  One whose opener cannot be
identified (pid 0, process gone: rare, as the opener is blocked in ``open`` while
we look) is recorded to the image's recording if exactly one recording covers that
layer, and counted as unattributed otherwise (the count is in the hot list).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import prometheus_client
import trio

from bootseer.blockstore.objects.format import Entry, FormatError, LayerIndex
from bootseer.blockstore.datapath.choice import EROFS_PATHS
from bootseer.blockstore.datapath.tree import LayerTree
from bootseer.blockstore.objects.signing import Untrusted
from bootseer.blockstore.server.extension import LayerHost
from bootseer.blockstore.server.ops import ControlOps
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.source import SourceError
from bootseer.fetch.sources import redact_url
from bootseer.fuse.operations import OPENER_PID
from bootseer.hotlist.attribution import cgroup_paths, container_id, container_of
from bootseer.hotlist.format import (
    HotList,
    HotListError,
    HotListUntrusted,
    hotlist_object,
    read_hot_list_object,
    profile_of_labels,
    resolve,
)
from bootseer.hotlist.prefetch import UNREAD_BYTES, Prefetch, PrefetchLimits, cache_checker, sample_prefetch
from bootseer.hotlist.recorder import Recording, RecordingLimits, run_recording
from bootseer.hotlist.warm import ErofsTarget, PageCacheWarmer, TreeTarget, WarmReads, WarmTarget
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks

log = get_logger(__name__)

RECORDINGS = prometheus_client.Counter(
    "bootseer_hotlist_recordings",
    "Hot-list recordings ended, by outcome (published, lost_race: another node published first, empty, failed, discarded)",
    ["outcome"],
)
RECORDED_BLOCKS = prometheus_client.Counter("bootseer_hotlist_recorded_blocks", "First touches recorded")
UNATTRIBUTED = prometheus_client.Counter(
    "bootseer_hotlist_unattributed_reads",
    "Reads of a recorded layer whose opener could not be identified while several recordings cover it (left out)",
)
IGNORED = prometheus_client.Counter(
    "bootseer_hotlist_ignored", "Hot lists found but not used, by reason (invalid, untrusted, mismatch, store_error)", ["reason"]
)
PREFETCHES = prometheus_client.Gauge("bootseer_hotlist_prefetches", "Hot-list prefetches running")

#: Seconds a prefetch's end waits for the page-cache residency check (one mincore per warmed file).
SETTLE_TIMEOUT = 30.0


@dataclass(frozen=True)
class HotListConfig:
    """The layer server's hot-list settings (``bootseer layer-server --hotlist-*`` and ``--publish-store``)."""

    enabled: bool = True
    publish_store: str | None = None  #: where hot lists are written; None: the layers' store
    recording: RecordingLimits = field(default_factory=RecordingLimits)
    prefetch: PrefetchLimits = field(default_factory=PrefetchLimits)


@dataclass(frozen=True)
class OpenTag:
    """Who opened a file of a served layer (what :meth:`HotListService.opened` hands the open file)."""

    pid: int
    container: str | None  #: a recording or prefetched container, by key
    identified: bool  #: whether the caller's cgroup could be read at all


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
        self.prefetches: dict[tuple[str, str], Prefetch] = {}  #: (image, profile) -> running prefetch
        self.containers: dict[str, _Container] = {}  #: container ID -> what it was prepared on
        self.finished: list[dict[str, Any]] = []  #: summaries of ended recordings and prefetches (last 32)
        self.proc = "/proc"  #: where callers' cgroups are read (tests point it elsewhere)
        self.warm_reads = WarmReads()  #: blocks page-cache warmers are reading through EROFS (not a job's reads)

    # -- the layers the server serves ------------------------------------------------------

    def image_layers(self, top: str) -> list[str] | None:
        """The served chain ending in ``top``, bottom first; None if any of it is not served."""
        chain: list[str] = []
        current = top
        while current:
            layer = self.server.layers.get(current)
            if layer is None or layer.tree is None or current in chain:
                return None
            chain.append(current)
            current = layer.record.parent
        return chain[::-1]

    async def _read_hot_list(self, image: str, profile: str) -> HotList | None:
        """The store's hot list for (image, profile): None if there is none; HotListError if it is bad."""
        from bootseer.blockstore.objects.store import StoreReader

        store = self.server.layers[image].store
        engine, _fetcher = await self.server.fetcher(store)
        # A first boot touches each block at most once: no more rows than the image's layers
        # hold blocks (all served, so their indexes are here; else the format's own bound).
        # A larger object than those rows can take is refused from its size, unread.
        layers = self.image_layers(image)
        max_blocks = None if layers is None else sum(len(self.server.layers[layer].tree.index.blocks) for layer in layers)
        data = await read_hot_list_object(StoreReader(engine), image, profile, max_blocks)
        if data is None:
            return None
        trust = self.server.trust

        def decode_and_check() -> HotList:
            hot = HotList.decode(data, expected_image=image, expected_profile=profile, max_blocks=max_blocks)
            try:
                trust.check("hotlist", hot.signed, f"the hot list of {image} (profile {profile!r})")
            except Untrusted as exc:
                raise HotListUntrusted(str(exc)) from None
            return hot

        # Decompressing, parsing and checking a signature is CPU work proportional to the list:
        # never on the FUSE loop.
        return await trio.to_thread.run_sync(decode_and_check, limiter=self.server.decode_threads)

    def _spawn(self, function: Any, *args: Any) -> None:
        """Run ``function(*args)`` in the server's nursery; an error is logged, never the server's end."""

        async def guarded() -> None:
            try:
                await function(*args)
            except Exception:
                log.error("hot-list task failed", task=function.__name__, exc_info=True)

        self.server.nursery.start_soon(guarded)

    # -- triggers --------------------------------------------------------------------------

    def layer_mounted(self, chain_id: str) -> None:
        """A layer was mounted: start the default-profile prefetch if it is an image's top with a hot list."""
        if self.config.enabled:
            self._spawn(self._prefetch_if_listed, chain_id)

    async def _prefetch_if_listed(self, image: str) -> None:
        if (image, "") in self.prefetches or self.image_layers(image) is None:
            return
        try:
            hot = await self._lookup(image, "")
        except HotListError:
            return  # logged
        if hot is not None and (image, "") not in self.prefetches:
            await self._start_prefetch(hot)

    async def _lookup(self, image: str, profile: str) -> HotList | None:
        """The hot list; None if absent or the store fails (logged); HotListError (logged) if it is invalid."""
        try:
            return await self._read_hot_list(image, profile)
        except HotListUntrusted as exc:
            IGNORED.labels("untrusted").inc()
            log.warning("hot list ignored: not signed by a trusted writer key; no prefetch", image=image,
                        profile=profile, error=str(exc))  # fmt: skip
            raise
        except HotListError as exc:
            IGNORED.labels("invalid").inc()
            log.warning("hot list ignored: invalid (bootseer hotlist clear removes it)", image=image, profile=profile, error=str(exc))
            raise
        except (FetchError, SourceError, FormatError, OSError) as exc:
            IGNORED.labels("store_error").inc()
            log.warning("cannot read the hot list; no prefetch", image=image, profile=profile, error=str(exc))
            return None

    async def _start_prefetch(self, hot: HotList) -> Prefetch | None:
        """Start prefetching ``hot`` (or return the prefetch of its image and profile already running)."""
        running = self.prefetches.get((hot.image, hot.profile))
        if running is not None:
            return running
        layers = self.image_layers(hot.image)
        if layers is None:
            return None
        indexes = {layer: self.server.layers[layer].tree.index for layer in layers}
        try:
            plan = resolve(hot, layers, indexes)
        except HotListError as exc:
            IGNORED.labels("mismatch").inc()
            log.warning("hot list ignored: it does not match the image's layers", image=hot.image, profile=hot.profile, error=str(exc))
            return None
        engines, fetchers = {}, {}
        for layer in layers:
            engines[layer], fetchers[layer] = await self.server.fetcher(self.server.layers[layer].store)
        running = self.prefetches.get((hot.image, hot.profile))
        if running is not None:  # started by another trigger while we waited for a fetcher
            return running
        # Never more batches in flight than half an engine's streams: a read always finds a free one.
        streams = min(engine.streams for engine in engines.values())
        limits = self.config.prefetch
        limits = dataclasses.replace(limits, concurrency=max(1, min(limits.concurrency, streams // 2)))
        warmer = None
        if limits.page_cache and self.server.session is not None:  # no FUSE session (tests): no page cache to fill
            targets = {layer: self.warm_target(layer) for layer in layers}
            digests = {block.hot.digest for block in plan}
            # One pass over every entry of the image's tree-served layers: not in the FUSE session's thread.
            warmer = await trio.to_thread.run_sync(functools.partial(PageCacheWarmer, indexes, targets, digests,
                                                                     reads=self.warm_reads))  # fmt: skip
        prefetch = Prefetch(
            image=hot.image, profile=hot.profile, plan=plan, indexes=indexes, fetchers=fetchers,
            cached=cache_checker(self.server.cache), limits=limits, warmer=warmer,
        )  # fmt: skip
        self.prefetches[(hot.image, hot.profile)] = prefetch
        PREFETCHES.set(len(self.prefetches))
        log.info("hot-list prefetch started", image=hot.image, profile=hot.profile, blocks=len(plan),
                 bytes=prefetch.stats.planned_bytes, recorded_on=hot.node, recorded_at=hot.recorded_at)  # fmt: skip
        self._spawn(self._run_prefetch, prefetch)
        self._spawn(sample_prefetch, prefetch)  # start-up profiler: start, progress, end
        return prefetch

    def warm_target(self, chain_id: str) -> WarmTarget:
        """Where the kernel caches ``chain_id``'s blocks: the files of its EROFS mount or of its FUSE tree.

        The layer's row in the server's table says how it is served (``Layer.data_path``).
        """
        layer = self.server.layers[chain_id]
        if layer.data_path in EROFS_PATHS:
            return ErofsTarget(self.server.paths.lower_dir(layer.slot, layer.data_path))
        return TreeTarget(layer.slot, self.server.paths.lower_dir(layer.slot, "tree"))

    async def _run_prefetch(self, prefetch: Prefetch) -> None:
        try:
            await prefetch.run()
            # What the fetch did only: its reads are counted when its last container goes (_end_prefetch, the
            # page cache's share included); here they would say 0 hits and every byte unread.
            log.info("hot-list prefetch done", image=prefetch.image, profile=prefetch.profile,
                     cancelled=prefetch.cancel_scope.cancelled_caught, **_log_stats(prefetch, reads=False))  # fmt: skip
        finally:
            # It stays in ``prefetches`` (for read accounting) until its containers are gone;
            # one started at pull that no container joins within the recording window ends then.
            if not prefetch.had_container:
                with trio.move_on_after(self.config.recording.window):
                    await prefetch.attached.wait()
            if not prefetch.containers:
                await self._end_prefetch(prefetch)

    async def _end_prefetch(self, prefetch: Prefetch) -> None:
        """Stop ``prefetch``, count what its warmed page cache served, and keep its summary."""
        prefetch.stop()
        if self.prefetches.get((prefetch.image, prefetch.profile)) is prefetch:
            del self.prefetches[(prefetch.image, prefetch.profile)]
            PREFETCHES.set(len(self.prefetches))
            # Asking the kernel is quick (mincore, nothing read); a shutdown does not lose the summary.
            with trio.CancelScope(shield=True), trio.move_on_after(SETTLE_TIMEOUT):
                try:
                    await prefetch.settle_page_cache()
                except OSError as exc:
                    log.warning("cannot tell what the page cache served", image=prefetch.image, error=str(exc))
            UNREAD_BYTES.inc(prefetch.unread_bytes())
            self._remember({"kind": "prefetch", "image": prefetch.image, "profile": prefetch.profile, **prefetch.stats.as_dict(),
                            "unread_bytes": prefetch.unread_bytes()})  # fmt: skip
        PREFETCHES.set(len(self.prefetches))

    def _remember(self, summary: dict[str, Any]) -> None:
        self.finished = (self.finished + [summary])[-32:]

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
            self._attach(prefetch, key)
            return {"action": "prefetch"}
        for (image, other), running in list(self.prefetches.items()):
            if image == parent and other != profile and not running.containers:
                # The early default-profile guess is not this workload: it would only compete with its reads.
                log.info("stopping the default hot-list prefetch: the container runs another profile", image=image, profile=profile)
                await self._end_prefetch(running)
        if any(r.image == parent and r.profile == profile for r in self.recordings.values()):
            return {"action": "none", "reason": "another container of this image is being recorded"}
        recording = Recording(container=key, image=parent, profile=profile, layers=layers, started=now, upper=upper,
                              marker=self.config.recording.marker, any_reader=any_reader,
                              publish_to=self.config.publish_store or self.server.layers[parent].store)  # fmt: skip
        self.recordings[key] = recording
        self._spawn(self._decide, recording)
        return {"action": "record"}

    def _attach(self, prefetch: Prefetch, key: str) -> None:
        prefetch.containers.add(key)
        prefetch.had_container = True
        prefetch.attached.set()

    async def _decide(self, recording: Recording) -> None:
        """Look the hot list up while recording runs: a list means prefetch, none means record to the end."""
        try:
            hot = await self._lookup(recording.image, recording.profile)
        except HotListError:
            self._discard(recording, "the stored hot list is invalid")
            return
        if hot is not None:
            self._discard(recording, "a hot list exists")
            prefetch = self.prefetches.get((hot.image, hot.profile)) or await self._start_prefetch(hot)
            if prefetch is not None and recording.container in self.containers:
                self._attach(prefetch, recording.container)
            return
        log.info("recording the image's first boot", container=recording.container, image=recording.image,
                 profile=recording.profile, layers=len(recording.layers))  # fmt: skip
        await run_recording(recording, self.config.recording)
        await self._publish(recording)

    def _discard(self, recording: Recording, why: str) -> None:
        if self.recordings.get(recording.container) is recording:
            del self.recordings[recording.container]
        recording.outcome = "discarded"
        recording.seal("seal")
        recording.done.set()
        log.debug("recording discarded", container=recording.container, why=why)

    async def _publish(self, recording: Recording) -> None:
        from bootseer.blockstore.objects.store import StoreError

        if self.recordings.get(recording.container) is recording:
            del self.recordings[recording.container]
        hot = recording.hot_list()
        outcome = "empty"
        error = ""
        if hot.blocks:
            url = recording.publish_to
            name = hotlist_object(hot.image, hot.profile)
            try:
                if not url:
                    raise StoreError("the image's layers have no store and no --publish-store is set")
                published = await trio.to_thread.run_sync(functools.partial(_publish_blocking, url, name, hot.encode(self.server.sign_key)))
                outcome = "published" if published else "lost_race"
            except (StoreError, ValueError, OSError) as exc:
                outcome, error = "failed", str(exc)
        recording.outcome = outcome
        RECORDINGS.labels(outcome).inc()
        RECORDED_BLOCKS.inc(len(hot.blocks))
        summary = {
            "kind": "recording", "container": recording.container, "image": hot.image, "profile": hot.profile,
            "sealed_by": hot.sealed_by, "blocks": len(hot.blocks), "bytes": hot.total_bytes, "span_s": round(hot.span, 3),
            "duration_s": round(hot.duration, 3), "unattributed": hot.unattributed, "outcome": outcome,
        }  # fmt: skip
        if error:
            summary["error"] = error
        self._remember(summary)
        level = log.error if outcome == "failed" else log.info
        level("hot-list recording sealed", **summary)
        profile_hooks.hotlist_sealed(summary)  # start-up profiler
        recording.done.set()

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
                    await self._end_prefetch(prefetch)  # first: the line then says what the page cache served
                log.info("prefetched container gone", container=key, image=prefetch.image, profile=prefetch.profile,
                         **_log_stats(prefetch))  # fmt: skip
        return {"known": container is not None}

    async def seal(self, key: str, wait: float = 8.0) -> dict[str, Any]:
        recording = self.recordings.get(key)
        if recording is None:
            return {"sealed": False, "reason": f"container {key!r} is not being recorded on this node"}
        recording.seal("seal")
        with trio.move_on_after(wait):
            await recording.done.wait()
        return {"sealed": True, "outcome": recording.outcome or "publishing", "blocks": len(recording.blocks)}

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "enabled": self.config.enabled,
            "recordings": [
                {"container": r.container, "readers": "any" if r.any_reader else "container", "image": r.image,
                 "profile": r.profile, "blocks": len(r.blocks),
                 "running_s": round(now - r.started, 3), "sealed_by": r.sealed_by}
                for r in self.recordings.values()
            ],
            "prefetches": [
                {"image": p.image, "profile": p.profile, "containers": sorted(p.containers), **p.stats.as_dict()}
                for p in self.prefetches.values()
            ],
            "finished": self.finished,
        }  # fmt: skip

    def status_fields(self) -> dict[str, Any]:
        """The server's status answer names where hot lists are published (redacted)."""
        return {"publish_store": redact_url(self.config.publish_store or "")}

    def register_ops(self, control: ControlOps) -> None:
        """Answer the layer server's ``hotlist.*`` control operations (:meth:`dispatch`)."""
        control.register_family("hotlist.", self.dispatch)

    async def dispatch(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a ``hotlist.*`` control request."""
        from bootseer.blockstore.server.client import InvalidRequest

        def text(name: str, required: bool = True) -> str:
            value = request.get(name, "")
            if not isinstance(value, str) or (required and not value):
                raise InvalidRequest(f"{op}: {name} must be a non-empty string")
            return value

        try:
            if op == "hotlist.prepared":
                labels = request.get("labels") or {}
                if not isinstance(labels, dict):
                    raise InvalidRequest(f"{op}: labels must be an object")
                upper = request.get("upper")
                readers = request.get("readers", "container")
                if readers not in ("container", "any"):
                    raise InvalidRequest(f"{op}: readers must be \"container\" or \"any\"")
                return await self.container_prepared(text("key"), text("parent", False), labels,
                                                      upper if isinstance(upper, str) else None,
                                                      any_reader=readers == "any")  # fmt: skip
            if op == "hotlist.removed":
                return await self.container_removed(text("key"))
            if op == "hotlist.seal":
                return await self.seal(text("container"))
            if op == "hotlist.status":
                return self.status()
        except HotListError as exc:
            raise InvalidRequest(str(exc)) from None
        raise InvalidRequest(f"unknown operation {op!r} (hotlist.prepared, hotlist.removed, hotlist.seal, hotlist.status)")

    # -- the read observer (blockstore.datapath.tree.ReadObserver: every open and read of a served layer) --

    def opened(self, tree: LayerTree) -> OpenTag | None:
        """Who opened a file of ``tree``'s layer; None when nothing records or prefetches that layer."""
        try:
            return self._reader(tree.name, OPENER_PID.get())
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
            target = index.entries[entry.link] if entry.link is not None else entry
            end = min(offset + size, target.size)
            if end <= offset:
                return
            first, last = offset // index.block_size, (end - 1) // index.block_size
            self._account(tree.name, index, target.blocks[first : last + 1], tag)
        except Exception:  # accounting must never fail a read
            log.error("hot-list read hook failed", layer=tree.name, exc_info=True)

    def blob_read(self, layer: str, index: LayerIndex, refs: Sequence[int], pid: int) -> None:
        """Account for a read of blocks ``refs`` of ``layer``'s blob by process ``pid`` (0: unknown).

        A blob has no open per reader, so the reader is looked up now, as
        :meth:`opened` does for a file: its cgroup names the recording it belongs to.
        """
        try:
            if not pid:  # the server's own open (EROFS's): maybe a page-cache warmer's read, not a job's
                refs = self.warm_reads.others(layer, refs)
                if not refs:
                    return
            tag = self._reader(layer, pid)
            profile_hooks.layer_read(tag.container if tag is not None else None, layer)  # profiler: first read
            if tag is not None:
                self._account(layer, index, refs, tag)
        except Exception:  # accounting must never fail a read
            log.error("hot-list blob read hook failed", layer=layer, exc_info=True)

    def _reader(self, layer: str, pid: int) -> OpenTag | None:
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

    def _account(self, layer: str, index: LayerIndex, refs: Sequence[int], tag: OpenTag) -> None:
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


def _publish_blocking(url: str, name: str, data: bytes) -> bool:
    from bootseer.blockstore.objects.store import open_store_writer

    with open_store_writer(url) as writer:
        return writer.put_if_absent(name, data)  # first writer wins


def _log_stats(prefetch: Prefetch, *, reads: bool = True) -> dict[str, Any]:
    """A prefetch's log fields: what it fetched and warmed, and with ``reads`` how the job's reads went."""
    stats = prefetch.stats.as_dict()
    fields = {
        "prefetched_blocks": stats["fetched_blocks"], "prefetched_bytes": stats["fetched_bytes"],
        "cached_blocks": stats["cached_blocks"], "failed_blocks": stats["failed_blocks"],
        "warmed_bytes": stats["warmed_bytes"],
    }  # fmt: skip
    if reads:
        fields.update({
            "hits": stats["hits"], "waited": stats["waited"], "misses": stats["misses"], "hit_rate": stats["hit_rate"],
            "lead_median_s": stats["lead_median_s"], "served_from_page_cache_blocks": stats["served_from_page_cache_blocks"],
            "unread_bytes": prefetch.unread_bytes(),
        })  # fmt: skip
    return fields


__all__ = ["HotListConfig", "HotListService", "OpenTag"]
