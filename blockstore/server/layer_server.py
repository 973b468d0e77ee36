"""The layer server: one long-lived process per node serving converted layers over FUSE.

``bootseer layer-server --root ROOT`` (see :mod:`snapshotter.layer_daemon`) runs
:func:`run_server`: one trio run, one nursery holding

* the FUSE session on ``ROOT/layers/mnt`` (:mod:`blockstore.datapath.tree`: the root lists
  one directory per mounted layer, named by its slot, each an overlayfs lower dir);
* one fetch :class:`~bootseer.fetch.engine.Engine` per store URL, opened when a layer
  of that store is first mounted, and one block fetcher per engine over the one
  node-local block cache that every layer shares;
* the control API on ``ROOT/layers/control.sock`` (JSON lines, served by
  :mod:`blockstore.server.control_socket`; the callers' end is :mod:`blockstore.server.client`):
  ``mount``, ``warm`` (load layers ahead of their mounts: :mod:`.warming`), ``check``, ``unmount``, ``status``;
* one :class:`~bootseer.blockstore.server.layer_loader.LayerLoader`, the load path of a layer (chain
  record and trust, index or block table, EROFS image) that the mounts, the restores and the warms share;
* on the ``erofs`` and ``loop`` data paths (:mod:`blockstore.datapath.choice`, chosen at
  start), one EROFS mount per layer at ``ROOT/layers/lower/<slot>`` over its FUSE blob
  ``ROOT/layers/mnt/blobs/<slot>``: that mount is the layer's lower dir, and FUSE
  serves only block reads.

The table of mounted layers (``ROOT/layers/table.json``, written to a temp name and
renamed, so it is always a whole table) and a local copy of each mounted layer's
index (``ROOT/layers/indexes/``, :mod:`blockstore.server.index_copies`) let a
restarted server put every layer back in its slot, with the same inode numbers, before it answers anyone, and without the store.
A mount changes the disk first (index copy, then the table) and the served tree
last, so a crash at any point leaves a table that names only layers that can be
restored.

One server per root: it holds ``ROOT/layers/server.lock`` for its life.  At start
it lazily unmounts a dead FUSE mount left on the mountpoint by a killed server.
A restart lazily unmounts the EROFS mounts a killed server left
(their blob device was its dead session) and mounts each layer again, same slot, same
lower dir, once its new FUSE mount is up and before the control socket answers.
SIGTERM or SIGINT detaches the EROFS mounts, then unmounts FUSE and exits; an external ``umount`` of the mountpoint ends
the server too (its layers stay in the table for the next start).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import os
import re
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import prometheus_client
import pyfuse3
import trio

from bootseer import cpu
from bootseer.blockstore.node.block_cache import DEFAULT_CACHE_SIZE
from bootseer.blockstore.server.client import (
    MOUNT_TIMEOUT,
    InvalidRequest,
    LayerNotMounted,
    LayerServerError,
    ServerPaths,
    StoreUnavailable,
)
from bootseer.blockstore.server.control_socket import serve_control
from bootseer.blockstore.server.index_copies import IndexCopies
from bootseer.blockstore.server.layer_loader import FetchedImage, LayerLoader, LoadedLayer
from bootseer.blockstore.server.extension import ExtensionFactory, ServerExtension
from bootseer.blockstore.server.ops import ControlOps
from bootseer.blockstore.datapath.choice import (
    EROFS_PATHS,
    FILESYSTEMS,
    DataPathChoice,
    DataPathProbe,
    ErofsLayers,
    announce,
)
from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.datapath.event_holder import HOLE_WAIT
from bootseer.blockstore.datapath.fill_group import FILL_GROUP
from bootseer.blockstore.datapath.image_checker import ImageCheck
from bootseer.blockstore.datapath.local_blobs import FanotifyBlobs, LocalBlob
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, MAX_CHAIN_RECORD_BYTES, FormatError, LayerIndex, check_digest
from bootseer.blockstore.server.layer_table import Layer, LayerTable, load_table, save_table, store_id
from bootseer.blockstore.datapath.tree import LayersRoot, LayerTree
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.limits import peer_memory_share
from bootseer.blockstore.peers.service import PeerService
from bootseer.blockstore.peers.config import PeerConfig
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.peers import PeerAllowance, PeerPayload
from bootseer.blockstore.objects.signing import SigningKey, TrustPolicy
from bootseer.blockstore.server.store_registry import StoreRegistry
from bootseer.blockstore.server.warming import WARM_MAX_ENTRIES, LayerWarmer
from bootseer.fetch.engine import Engine, EngineConfig
from bootseer.fetch.stripes import Priority
from bootseer.fetch.sources import redact_url
from bootseer.fuse import FuseSession, ReadOnlyOperations, end_on_signals, mount_options, serve, unmount_dead
from bootseer.locks import TrioKeyedLocks
from bootseer.log import get_logger
from bootseer.profile import events as profile_events
from bootseer.profile import hooks as profile_hooks

log = get_logger(__name__)

SUBTYPE = "bootseer-layers"
#: How long the kernel may trust names, attributes and missing names under a layer:
#: the layers are immutable, and the root's entries are invalidated when they change.
CACHE_TIMEOUT = 3600.0

UP = prometheus_client.Gauge("bootseer_layer_server_up", "1 while the layer server's FUSE mount is served")
LAYERS = prometheus_client.Gauge("bootseer_layer_server_layers", "Layers the layer server serves")
RESTORED = prometheus_client.Counter(
    "bootseer_layer_server_restored_total", "Layers put back at start-up, by outcome", ["outcome"]
)


class ServerAlreadyRunning(Exception):
    """Another layer server holds this root's lock."""


@dataclass(frozen=True)
class LayerServerConfig:
    """Everything ``bootseer layer-server`` is started with."""

    root: Path
    store: str | None = None  #: default store URL of a mount that names none
    cache_dir: Path | None = None  #: default ``ROOT/cache``
    #: bytes the node cache and, on ``fanotify``, the local blobs may hold together (blockstore.datapath.blob_store)
    cache_size: int = DEFAULT_CACHE_SIZE
    engine: EngineConfig = field(default_factory=EngineConfig)
    source_options: dict[str, Any] = field(default_factory=dict)  #: passed to open_source for every store
    shutdown_grace: float = 10.0
    #: a mount that has not got its chain record and index by then fails (StoreUnavailable),
    #: answered before the client's own MOUNT_TIMEOUT, so it gets the reason, not a timeout
    load_timeout: float = MOUNT_TIMEOUT - 30
    trust: TrustPolicy = field(default_factory=TrustPolicy)  #: the keys whose objects are served (docs/trust.md)
    sign_key: SigningKey | None = None  #: the node's key: signs the hot lists this server publishes
    data_path: str = "auto"  #: auto, fanotify, erofs, loop or tree (blockstore.datapath.choice)
    #: ``fanotify``: seconds a read of a hole waits with no server before the event holder denies it EIO
    hole_wait: float = HOLE_WAIT
    #: ``fanotify``: raw bytes of the fill group an event fills at once (blockstore.datapath.fill_group)
    fill_group: int = FILL_GROUP
    #: Worker threads that decompress, hash and write fetched blocks, for every store together (0: one per CPU
    #: this process may run on, :func:`usable_cpus`); fewer leave a job its cores
    decode_threads: int = 0
    #: ``fanotify``: the rest of each blob filled while the link is idle (blockstore.datapath.background_fill)
    background_fill: BackgroundFillConfig = field(default_factory=BackgroundFillConfig)
    peers: PeerConfig = field(default_factory=PeerConfig)  #: block sharing with other nodes (docs/peers.md); off by default
    filesystems: str = FILESYSTEMS  #: the kernel's filesystem list the data-path probe reads (a test seam)
    #: The options this server was started with that differ from their defaults, URLs redacted (what its
    #: ``status`` answer shows: a long-lived server keeps them until it is restarted).
    started_with: dict[str, Any] = field(default_factory=dict)

    @property
    def paths(self) -> ServerPaths:
        return ServerPaths(self.root)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a cpuset or ``taskset`` narrows it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LayerServerStatistics:
    """What :meth:`LayerServer.statistics` reports: the server's own state (its stores' and peers' are theirs)."""

    uptime_s: float  #: seconds since the server was built
    serving: bool  #: whether its FUSE mount is being served
    open_files: int  #: files of served layers open through FUSE now
    layers: int  #: rows of the table of mounted layers (a layer whose restore failed included)
    served: int  #: layers whose tree is served
    decode_threads: int  #: worker threads that decompress, hash and write fetched blocks


# -- the server ---------------------------------------------------------------------------------


class LayerServer:
    """The layers, their stores and the control operations; runs inside :func:`run_server`."""

    def __init__(self, config: LayerServerConfig, nursery: trio.Nursery, data_path: DataPathChoice | None = None,
                 *, extension: ExtensionFactory | None = None) -> None:
        from bootseer.blockstore.node.block_cache import BlockCache

        self.config = config
        self.paths = config.paths
        self.nursery = nursery
        self.root = LayersRoot()
        self.data_path = data_path or DataPathChoice("tree", "default")
        erofs = self.data_path.path in EROFS_PATHS
        self.ops = ReadOnlyOperations(
            self.root,
            name=SUBTYPE,
            entry_timeout=CACHE_TIMEOUT,
            attr_timeout=CACHE_TIMEOUT,
            negative_timeout=CACHE_TIMEOUT,
            statfs=self._statfs,
            # (EROFS reads the blobs with direct I/O, which no read-ahead of this mount touches:
            # blockstore.datapath.erofs_mount.)
        )
        #: The served layers by ChainID, their slots and table.json.
        self.layers = LayerTable(self.paths.table)
        #: The local copies of the served layers' indexes (what a restart restores from).
        self.indexes = IndexCopies(self.paths.indexes)
        #: The local blobs the EROFS mounts read on the ``fanotify`` path, filled on the kernel's events (else None);
        #: they share ``--cache-size`` with the node cache, which leaves room for the blobs in use.
        self.blobs = FanotifyBlobs(self.paths, blob_directory(config), self._addressed, hole_wait=config.hole_wait,
                                   background=config.background_fill, fetched=lambda: self.stores.bytes_fetched(),
                                   budget=config.cache_size, cache_bytes=lambda: self.cache.stats().bytes,
                                   fill_group=config.fill_group) \
            if self.data_path.path == "fanotify" and erofs else None  # fmt: skip
        self.cache = BlockCache(str(config.cache_dir or config.root / "cache"), config.cache_size,
                                others=self.blobs.store.in_use_bytes if self.blobs is not None else None)  # fmt: skip
        # Cache I/O, decompression, hashing and blob writes, for every store's fetcher together: zstandard and
        # hashlib release the GIL, so these use as many cores as they are given.
        self._block_threads = trio.CapacityLimiter(config.decode_threads or usable_cpus())
        #: Decoding store objects (layer indexes, hot lists): in worker threads, never the
        #: trio thread that answers FUSE requests, and at most half the cores at once, so a
        #: large or hostile object leaves the block fetchers their threads.
        self.decode_threads = trio.CapacityLimiter(max(1, (os.cpu_count() or 2) // 2))
        #: The layers' EROFS mounts (None on the tree path, where the FUSE tree is the lower dir).
        self.erofs = ErofsLayers(self.paths, self.data_path.path, self.decode_threads) if erofs else None
        #: Block sharing with the peer group (None: off).
        self.peers = PeerService(config.peers, self._block_for_peer, self._block_threads,
                                 memory=peer_memory_share(config.engine),
                                 largest_block=self._largest_block) if config.peers.enabled else None  # fmt: skip
        #: One engine and block fetcher per store URL.
        self.stores = StoreRegistry(nursery, config.engine, config.source_options, self.cache, self._block_threads,
                                    peers=self.peers.client if self.peers else None,
                                    local=self.blobs.filled_blocks if self.blobs is not None else None,
                                    known=[config.store] if config.store else [])  # fmt: skip
        #: The load path of a layer (chain record, trust, index or block table, EROFS image), shared by
        #: the mounts, the restores and the warms.
        self.loader = LayerLoader(trust=config.trust, stores=self.stores, erofs=self.erofs, indexes=self.indexes,
                                  decode_threads=self.decode_threads, load_timeout=config.load_timeout,
                                  mounted=lambda: [layer.record for layer in self.layers.values()],
                                  held=self._held)  # fmt: skip
        #: Layers loaded ahead of their mounts (the ``warm`` operation), taken by :meth:`mount`; what no mount
        #: takes leaves nothing on disk (:meth:`LayerLoader.discard`).
        self.warmer: LayerWarmer[LoadedLayer] = LayerWarmer(nursery, self.loader.load, discard=self.loader.discard)
        # A mount and an unmount of one layer never interleave; requests name any ChainID
        # they like, so a lock lives only while it is held or waited for.
        self._chain_locks = TrioKeyedLocks()
        self.session: FuseSession | None = None
        self.started = time.time()
        #: What the runner plugged in (the hot-list service: records first boots, prefetches
        #: later ones), built now that the server it looks at exists; None: no extension.
        self.extension: ServerExtension | None = extension(self) if extension is not None else None
        #: The control socket's operations: the server's own, and the extension's (``hotlist.*``).
        self.control = ControlOps()
        self.control.register("status", lambda request: self.status())
        self.control.register("mount", self._mount_request)
        self.control.register("warm", self._warm_request)
        self.control.register("check", lambda request: self.check(_checked_chain_id(request)))
        self.control.register("unmount", lambda request: self.unmount(_checked_chain_id(request)))
        self.control.register("shutdown", lambda request: self.shutdown())
        if self.extension is not None:
            self.extension.register_ops(self.control)
        if self.peers is not None:
            self.control.register("peers.status", lambda request, peers=self.peers: peers.status())
        else:
            self.control.register("peers.status", lambda request: _peers_off())

    def _held(self, chain_id: str) -> bool:
        """Whether a mount (or an unmount) or a warm of ``chain_id`` holds it now: the loader's ``held``."""
        return bool(self._chain_locks.users(chain_id)) or self.warmer.holds(chain_id)

    def _statfs(self) -> pyfuse3.StatvfsData:
        """What ``df`` shows: the served layers' file bytes and entries, nothing free (read-only)."""
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = sum(tree.index_bytes for tree in self.root.layers.values()) // 4096
        data.f_files = sum(tree.index.entry_count for tree in self.root.layers.values())
        data.f_namemax = 255
        return data

    # -- stores ----------------------------------------------------------------------

    async def fetcher(self, store: str) -> tuple[Engine, BlockFetcher]:
        """The engine and block fetcher of ``store``, started on first use (:class:`StoreRegistry`)."""
        return await self.stores.fetcher(store)

    async def _block_for_peer(self, store: str, place: BlockPlace, priority: Priority, allowance: PeerAllowance,
                              compressed: bool) -> PeerPayload | None:  # fmt: skip
        """A block a peer asks for, from this node's store that the peers call ``store`` (None: no such store)."""
        fetcher = await self.stores.for_peer(store)
        if fetcher is None:
            return None
        return await fetcher.served_for_peer(place, priority, allowance, compressed=compressed)

    def _largest_block(self) -> int:
        """The largest block a peer may ask for: the block size of the layers served (the default's, before any)."""
        return max((tree.index.block_size for tree in self.root.layers.values()), default=DEFAULT_BLOCK_SIZE)


    async def _tree(self, layer: Layer, index: LayerBlocks) -> LayerTree:
        from bootseer.blockstore.node.layer_reader import LayerReader

        _engine, fetcher = await self.fetcher(layer.store)
        reader = LayerReader(index, fetcher, layer.chain_id)
        # O(entries): in a thread, so a large layer's mount does not stall the FUSE requests of others.
        build = functools.partial(LayerTree, layer.slot, index, reader, name=layer.chain_id)
        tree = await trio.to_thread.run_sync(build, limiter=self._block_threads)
        tree.observer = self.extension
        return tree

    @property
    def trust(self) -> TrustPolicy:
        """The node's trust policy (:class:`~bootseer.blockstore.server.extension.LayerHost`)."""
        return self.config.trust

    @property
    def sign_key(self) -> SigningKey | None:
        """The node's signing key (:class:`~bootseer.blockstore.server.extension.LayerHost`)."""
        return self.config.sign_key

    def _slot_referenced(self, slot: int) -> bool:
        """Whether the kernel still holds an inode of ``slot`` (a freed slot's files may be open)."""
        return any(self.ops.inodes.referenced(number) for number in LayersRoot.slot_inodes(slot))

    # -- restore --------------------------------------------------------------------------

    async def restore(self, saved: list[Layer]) -> None:
        """Put the saved layers back in their slots (before the mount answers anyone).

        A layer whose index cannot be had (no local copy, store down) keeps its slot and
        row, reported by ``status``/``check``; its next ``mount`` tries again.
        """
        for layer in saved:
            self.layers.restore(layer)
            if not layer.store:  # load_table said why
                RESTORED.labels("failed").inc()
                log.error("cannot restore layer", chain_id=layer.chain_id, slot=layer.slot, error=layer.error)
                continue
            table = self.loader.from_table(layer.record, layer.deps_index or None)
            load = functools.partial(self.indexes.load, layer.record, table=table)
            index = await trio.to_thread.run_sync(load, limiter=self.decode_threads)
            try:
                if index is None:
                    _record, index, data, _image = await self.loader.fetch_layer(layer.chain_id, layer.store)
                    table = not isinstance(index, LayerIndex)
                    await trio.to_thread.run_sync(functools.partial(self.indexes.save, layer.record, data, table=table))
                layer.tree = await self._tree(layer, index)
            except (LayerServerError, OSError, FormatError) as exc:
                layer.error = str(exc)
                RESTORED.labels("failed").inc()
                log.error("cannot restore layer", chain_id=layer.chain_id, slot=layer.slot, error=str(exc))
                continue
            self.root.layers[layer.slot] = layer.tree
            RESTORED.labels("restored").inc()
            log.info("restored layer", chain_id=layer.chain_id, slot=layer.slot, entries=index.entry_count, from_table=table)
        LAYERS.set(len(self.root.layers))

    async def mount_restored(self) -> None:
        """Serve every restored layer on this node's data path: on ``erofs``/``loop``, mount its EROFS
        image (once the FUSE mount serves the blobs) at the lower dir it had, before the control
        socket answers anyone.  A row saved with another data path is moved to this one (logged)."""
        changed = False
        for layer in self.layers.by_slot():
            if layer.tree is None:
                continue
            if self.erofs is not None:
                try:
                    image, source = await self.loader.layer_image(layer.record, layer.tree.index, layer.store)
                    device = await self._local_blob(layer, layer.tree, image)
                    # A kept image refused and fetched again is a new file: the mount of the old one goes.
                    blob = self.blobs.blob_of(layer.record.index) if self.blobs is not None else None
                    # A blob whose check dropped blocks of a whole blob: the old mount never asks for them again.
                    if blob is not None and blob.needs_remount:
                        log.warning("local blob lost blocks while no server held it: its EROFS mount is made again",
                                    chain_id=layer.chain_id, slot=layer.slot)  # fmt: skip
                    elif device is not None and self.erofs.mounted(layer.slot) and source != "store":
                        log.info("took over the EROFS mount of a server before this one (its blob's events wait for "
                                 "this one)", chain_id=layer.chain_id, slot=layer.slot)  # fmt: skip
                        continue
                    await self._mount_erofs(layer, image, device=device)
                except LayerServerError as exc:
                    layer.tree, layer.error = None, str(exc)
                    self._stop_serving(layer)
                    RESTORED.labels("failed").inc()
                    log.error("cannot restore layer", chain_id=layer.chain_id, slot=layer.slot, error=str(exc))
                    continue
                log.info("restored EROFS mount", chain_id=layer.chain_id, slot=layer.slot, lower_dir=self.lower_dir(layer.slot))
            if layer.data_path != self.data_path.path:
                log.warning("layer was served on another data path; its lower dir moves", chain_id=layer.chain_id,
                            slot=layer.slot, was=layer.data_path, now=self.data_path.path,
                            lower_dir=self.lower_dir(layer.slot))  # fmt: skip
                layer.data_path, changed = self.data_path.path, True
        if changed:
            async with self.layers.lock:
                await self.layers.save()
        LAYERS.set(len(self.root.layers))
        if self.blobs is not None:
            await self.blobs.forget_unclaimed({layer.record.index for layer in self.layers.values()})
            self.blobs.ready.set()  # the events waiting (a killed server's too) find their blobs now

    async def detach_erofs(self) -> None:
        """Lazily unmount every EROFS mount: before the FUSE mount their blobs are on goes.  On ``fanotify``
        the mounts stay (they read local blobs: the next server takes them over), and the event holder is
        released only if no blob has a hole left."""
        if self.erofs is not None:
            await self.erofs.detach_all(keep_mounts=self.blobs is not None)
        if self.blobs is not None:
            await self.blobs.release_if_whole()

    async def _local_blob(self, layer: Layer, tree: LayerTree, image: Path) -> Path | None:
        """On ``fanotify``, ``layer``'s local blob, made or taken over and marked (its path); else None."""
        if self.blobs is None:
            return None
        try:
            return await self.blobs.open(layer.record.index, tree, image)
        except OSError as exc:
            raise LayerServerError(f"{layer.chain_id} (slot {layer.slot}): cannot make its local blob: {exc}") from None

    def _addressed(self, image: Path, index: LayerBlocks) -> list[int]:
        """The blob blocks the files of ``image`` (``index``'s layer's) address, parsed in the checker's process."""
        assert self.erofs is not None
        return self.erofs.checker.addressed(image, ImageCheck(index.blob_size, index.block_size, index.entry_count))

    def local_blob(self, chain_id: str) -> LocalBlob | None:
        """The local blob of a served layer on ``fanotify`` (:class:`~bootseer.blockstore.server.extension.LayerHost`)."""
        layer = self.layers.get(chain_id)
        if self.blobs is None or layer is None:
            return None
        return self.blobs.blob_of(layer.record.index)

    async def layer_index(self, chain_id: str) -> LayerIndex:
        """The JSON index of served layer ``chain_id`` (:class:`~bootseer.blockstore.server.extension.LayerHost`):
        its tree's, or for a layer served from its block table, loaded now from its local copy, else from the
        store (verified against the layer's chain record, trusted when it was mounted) and kept as a copy."""
        layer = self.layers.get(chain_id)
        if layer is None or layer.tree is None:
            raise LayerNotMounted(f"{chain_id} is not served by this layer server")
        if isinstance(layer.tree.index, LayerIndex):
            return layer.tree.index
        return await self.loader.json_index(layer.record, layer.store)

    # -- control operations -----------------------------------------------------------------

    def lower_dir(self, slot: int) -> str:
        """Where the layer in ``slot`` is served to overlayfs on this node's data path."""
        return self.paths.lower_dir(slot, self.data_path.path)

    def _answer(self, layer: Layer) -> dict[str, Any]:
        return {"chain_id": layer.chain_id, "slot": layer.slot, "lower_dir": self.lower_dir(layer.slot)}

    async def _mount_erofs(self, layer: Layer, image: Path, *, phase: str = "image", device: Path | None = None) -> None:
        """Mount ``layer``'s EROFS ``image`` over its blob (served already, or the local ``device``);
        LayerServerError naming why not.  One ``layer.mount`` span of the start-up profiler's ``phase``."""
        assert self.erofs is not None
        try:
            with profile_events.span("layer.mount", phase=phase, chain_id=layer.chain_id):
                await self.erofs.mount(layer.slot, image, device)
        except OSError as exc:
            raise LayerServerError(f"{layer.chain_id} (slot {layer.slot}): cannot mount its EROFS image: {exc}") from None

    def _stop_serving(self, layer: Layer) -> None:
        """Take ``layer``'s tree and blob out of the FUSE mount (its slot's names out of the kernel's cache)."""
        self.root.layers.pop(layer.slot, None)
        # The slot's names (its directory, its blob) must go from the kernel's dentry cache
        # now (entries are trusted for CACHE_TIMEOUT); asynchronous, as a handler may hold the root.
        for parent, name in LayersRoot.slot_names(layer.slot):
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)

    async def mount(self, chain_id: str, store: str | None = None, deps_index: str | None = None,
                    record_data: bytes | None = None) -> dict[str, Any]:  # fmt: skip
        """Serve ``chain_id`` from ``store`` (idempotent; the control operation ``mount``); ``record_data``: its chain
        record as the caller read it from that store (:meth:`LayerLoader.fetch_layer`)."""
        store = store or self.config.store
        if not store:
            raise InvalidRequest("no store: the server has no --store and the request names none")
        async with self._chain_locks.hold(chain_id):
            layer = self.layers.get(chain_id)
            if layer is not None and layer.tree is not None:
                if layer.deps_index and deps_index != layer.deps_index:
                    # Served as a dependency layer on a deps record's word: as anything else it
                    # needs what any layer needs (else a writer key could stand in for a converter's).
                    self.loader.check_trust(layer.record, deps_index)
                return self._answer(layer)
            # A row whose restore failed keeps its slot and store; this is its retry.
            if layer is not None:
                if not layer.store and store_id(store) == layer.store_id:
                    layer.store, layer.shown_store = store, redact_url(store)  # the row's store, given again
                if not layer.store:
                    raise StoreUnavailable(f"{chain_id} (slot {layer.slot}) cannot be served: {layer.error}")
                store = layer.store
            loaded = await self.warmer.take(chain_id, store) if deps_index is None else None
            if loaded is None or (loaded.image is not None and not loaded.image.exists()):
                loaded = await self.loader.load(chain_id, store, deps_index, record_data)
            record, index, data, image = loaded.record, loaded.index, loaded.data, loaded.image
            phase = "image" if deps_index is None else ""
            async with self.layers.lock:
                if layer is None:
                    layer = Layer(chain_id, self.layers.free_slot(self._slot_referenced), store, record)
                layer.record = record
                layer.data_path = self.data_path.path
                trusted_by_signature = deps_index is None or not self.config.trust.enforced("chain")
                layer.deps_index = "" if trusted_by_signature else deps_index
                tree = await self._tree(layer, index)
                # Disk first (the index copy, then the table), the served tree last.
                save = functools.partial(self.indexes.save, record, data, table=not isinstance(index, LayerIndex))
                await trio.to_thread.run_sync(save)
                added = await self.layers.add(layer)
                layer.tree, layer.error = tree, ""
                self.root.layers[layer.slot] = tree
                if image is not None:  # the blob is served now: EROFS can take it as its device
                    try:
                        await self._mount_erofs(layer, image, phase=phase, device=await self._local_blob(layer, tree, image))
                    except LayerServerError as exc:
                        layer.tree, layer.error = None, str(exc)
                        self._stop_serving(layer)
                        if self.blobs is not None:
                            await self.blobs.close(record.index, tree, remove=False)
                        if added:
                            await self.layers.remove(chain_id)
                        raise
            LAYERS.set(len(self.root.layers))
            log.info("mounted layer", chain_id=chain_id, slot=layer.slot, entries=index.entry_count, store=redact_url(store),
                     from_table=not isinstance(index, LayerIndex),
                 data_path=layer.data_path, lower_dir=self.lower_dir(layer.slot))  # fmt: skip
            if self.extension is not None:
                self.extension.layer_mounted(chain_id)  # an image's top with a hot list: prefetch from now
            return self._answer(layer)

    async def _warm_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The control operation ``warm``: ``chain_ids`` (a list of ChainIDs), optionally ``store``: load
        those layers ahead of their mounts (:mod:`.warming`); answers at once with how many it started."""
        chain_ids = request.get("chain_ids")
        if not isinstance(chain_ids, list) or len(chain_ids) > WARM_MAX_ENTRIES:
            raise InvalidRequest(f"chain_ids must be a list of at most {WARM_MAX_ENTRIES} ChainIDs")
        checked = [_checked_chain_id({"chain_id": chain_id}) for chain_id in chain_ids]
        store = request.get("store") or self.config.store
        if not isinstance(store, str) or not store:
            raise InvalidRequest("no store: the server has no --store and the request names none")

        def served(chain_id: str) -> bool:
            layer = self.layers.get(chain_id)
            return layer is not None and (layer.tree is not None or layer.store != store)

        return {"warming": self.warmer.warm(checked, store, served)}

    async def _mount_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The control operation ``mount``: ``chain_id``, and optionally ``store`` and ``deps_index``."""
        store = request.get("store")
        if store is not None and not isinstance(store, str):
            raise InvalidRequest("store must be a URL string")
        deps_index = request.get("deps_index")
        if deps_index is not None and not (isinstance(deps_index, str) and re.fullmatch(r"[0-9a-f]{64}", deps_index)):
            raise InvalidRequest("deps_index must be 64 hex digits")
        record = request.get("record")
        if record is not None and not (isinstance(record, str) and len(record) <= MAX_CHAIN_RECORD_BYTES):
            raise InvalidRequest(f"record must be a chain record's JSON text of at most {MAX_CHAIN_RECORD_BYTES} bytes")
        data = None if record is None else record.encode("utf-8", "surrogateescape")
        return await self.mount(_checked_chain_id(request), store, deps_index, data)

    async def check(self, chain_id: str) -> dict[str, Any]:
        layer = self.layers.get(chain_id)
        if layer is None:
            raise LayerNotMounted(f"{chain_id} is not mounted by this layer server")
        if layer.tree is None:
            raise StoreUnavailable(f"{chain_id} (slot {layer.slot}) could not be restored: {layer.error}")
        if self.session is None or self.session.ended.is_set():
            raise LayerServerError("the layer server's FUSE mount is not being served")
        if self.erofs is not None and not os.path.ismount(self.lower_dir(layer.slot)):
            raise StoreUnavailable(f"{chain_id} (slot {layer.slot}): its EROFS mount {self.lower_dir(layer.slot)} is gone")
        return self._answer(layer)

    async def unmount(self, chain_id: str) -> dict[str, Any]:
        async with self._chain_locks.hold(chain_id), self.layers.lock:
            layer = await self.layers.remove(chain_id)
            if layer is None:
                raise LayerNotMounted(f"{chain_id} is not mounted by this layer server")
            lazily = False
            if self.erofs is not None:  # before the blob it reads goes (lazily if a container still has it)
                lazily = await self.erofs.unmount(layer.slot)
            tree = layer.tree
            self._stop_serving(layer)
            last = not any(other.record.index == layer.record.index for other in self.layers.values())
            if self.blobs is not None and tree is not None and not lazily:
                # A mount still in use (lazily detached) keeps its blob served until this server stops.  The last
                # layer of an index closes its blob and keeps it (the node's copy of its blocks, for the next
                # mount of the index), within --cache-size (blockstore.datapath.blob_store).
                await self.blobs.close(layer.record.index, tree)
            if last:
                self.indexes.remove(layer.record)
                if self.erofs is not None:
                    self.erofs.remove_image(layer.record.index, layer.record.image)
        LAYERS.set(len(self.root.layers))
        log.info("unmounted layer", chain_id=chain_id, slot=layer.slot)
        return {"chain_id": chain_id, "slot": layer.slot}

    async def shutdown(self) -> dict[str, Any]:
        """Stop as on SIGTERM: unmount once the requests in flight are answered (within the grace)."""
        if self.session is None:
            raise LayerServerError("the layer server is not serving yet")
        log.info("shutting down on request", mountpoint=str(self.paths.mountpoint))
        self.nursery.start_soon(self._shutdown, self.session)
        return {"pid": os.getpid()}

    async def _shutdown(self, session: FuseSession) -> None:
        await trio.sleep(0)  # the answer goes out first
        await self.detach_erofs()
        session.terminate()
        await trio.sleep(self.config.shutdown_grace)
        session.abort()

    def statistics(self) -> LayerServerStatistics:
        """The server's own figures now (what ``status`` shows of it)."""
        rows = list(self.layers.values())
        return LayerServerStatistics(
            uptime_s=round(time.time() - self.started, 3),
            serving=self.session is not None and not self.session.ended.is_set(),
            open_files=self.ops.open_files,
            layers=len(rows),
            served=sum(1 for layer in rows if layer.tree is not None),
            decode_threads=int(self._block_threads.total_tokens),
        )

    async def status(self) -> dict[str, Any]:
        own = self.statistics()
        return {
            "pid": os.getpid(),
            "root": str(self.config.root),
            "mountpoint": str(self.paths.mountpoint),
            "uptime_s": own.uptime_s,
            # Redacted: the whole URLs came on pipes, not argv (blockstore.server.client.ensure_server).
            "store": redact_url(self.config.store) if self.config.store else "",
            "settings": dict(self.config.started_with),
            "publish_store": "",
            **(self.extension.status_fields() if self.extension is not None else {}),
            "health": {"fuse": "serving" if own.serving else "down", "open_files": own.open_files},
            "decode_threads": own.decode_threads,
            "data_path": {"path": self.data_path.path, "reason": self.data_path.reason},
            "warm": dataclasses.asdict(self.warmer.statistics()),
            **({"fanotify": dataclasses.asdict(self.blobs.statistics())} if self.blobs is not None else {}),
            "layers": [
                {**self._answer(layer), "store": layer.shown_store, "index": layer.record.index,
                 "entries": layer.tree.index.entry_count if layer.tree else 0,
                 "served": layer.tree is not None, "error": layer.error, "data_path": layer.data_path}
                for layer in self.layers.by_slot()
            ],  # fmt: skip
            "stores": self.stores.status(),
            "cache": dataclasses.asdict(self.cache.stats()),
            "peers": await self.peers.status() if self.peers is not None else {"enabled": False},
            "cpu_seconds": _cpu_status(),
        }


def _cpu_status() -> dict[str, float]:
    """The status answer's CPU seconds: each stage's, what no stage counted, and the process's."""
    spent = cpu.statistics()
    return {**{name: round(seconds, 6) for name, seconds in spent.stages.items()},
            "outside_stages": round(spent.outside_stages, 6), "process": round(spent.process, 6)}  # fmt: skip


async def _sample_cpu() -> None:
    """The profiler's timeline: each stage's CPU milliseconds, and the process's (``cpu.<stage>``, ``cpu.process``)."""
    async with trio.open_nursery() as nursery:
        for name in cpu.STAGES:
            nursery.start_soon(functools.partial(
                profile_hooks.sample_counter, f"cpu.{name}",
                functools.partial(lambda name: int(cpu.statistics().stages[name] * 1000), name), phase="image"))  # fmt: skip
        nursery.start_soon(functools.partial(
            profile_hooks.sample_counter, "cpu.process", lambda: int(cpu.statistics().process * 1000), phase="image"))  # fmt: skip


# -- control requests ------------------------------------------------------------------------------


async def _peers_off() -> dict[str, Any]:
    return {"enabled": False}


def _checked_chain_id(request: dict[str, Any]) -> str:
    try:
        return check_digest(request.get("chain_id"), "chain_id")
    except FormatError as exc:
        raise InvalidRequest(str(exc)) from None


# -- the process -----------------------------------------------------------------------------


def _hold_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ServerAlreadyRunning(f"a layer server (pid {holder or '?'}) already serves {path.parent.parent}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def raise_fd_limit() -> int:
    """Raise this process's soft file descriptor limit to its hard one; the soft limit now in force.

    Connections from peers, the store's connections and the node cache's files all take
    descriptors: a soft limit of 1,024 is soon gone (docs/peers.md).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or soft == resource.RLIM_INFINITY:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a hard limit above the kernel's nr_open: keep what there is
        log.warning("cannot raise the file descriptor limit", soft=soft, hard=hard, error=str(exc))
        return soft
    log.info("file descriptor limit raised", soft=hard, was=soft)
    return hard


def blob_directory(config: LayerServerConfig) -> Path:
    """Where the ``fanotify`` data path keeps local blobs: ``blobs/`` in the node cache's directory."""
    return (config.cache_dir or config.root / "cache") / "blobs"


def prepare_root(paths: ServerPaths) -> None:
    """Create the server's directories (0700: only root may reach the mount) and clear
    a dead mount a killed server left; MountError if a live one is in the way."""
    unmount_dead(str(paths.mountpoint))  # first: on a dead mount even mkdir's stat fails (ENOTCONN)
    for directory in (paths.layers, paths.mountpoint, paths.indexes):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(paths.layers, 0o700)
    for stale in paths.indexes.glob(".*.tmp-*"):
        stale.unlink(missing_ok=True)


async def _detaching_first(server: LayerServer, signals: AsyncIterator[int]) -> AsyncIterator[int]:
    """``signals``, each passed on once the EROFS mounts are detached (they read blobs on the FUSE mount)."""
    async for signum in signals:
        await server.detach_erofs()
        yield signum


async def run_server(
    config: LayerServerConfig,
    *,
    on_ready: Callable[[LayerServer], Awaitable[None] | None] | None = None,
    extension: ExtensionFactory | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT or an external unmount; the mount is gone when this returns.

    Raises :class:`ServerAlreadyRunning`, :class:`~bootseer.fuse.MountError`, or
    ValueError for a damaged table.
    """
    paths = config.paths
    paths.layers.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_fd = _hold_lock(paths.server_lock)
    try:
        raise_fd_limit()
        cpu.count_gc()  # the garbage collector's CPU is a stage of its own (bootseer/cpu.py)
        prepare_root(paths)
        data_path = DataPathProbe(paths.layers, config.filesystems, blobs=blob_directory(config)).choose(config.data_path)
        announce(data_path)
        profile_hooks.use_root(config.root)  # BOOTSEER_PROFILE=1: the start-up profiler's spool is ROOT/profile
        saved = load_table(paths.table, [config.store or ""])
        if config.trust.enforced("chain") or config.trust.enforced("hotlist"):
            log.info("trust policy: serving only what these keys signed", **config.trust.describe())
        if not config.trust.enforced("chain"):
            log.warning("no converter keys: layers are served as the store holds them, forged ones included (docs/trust.md)")
        options = mount_options(fsname="bootseer-layers", subtype=SUBTYPE, allow_other=True)
        # Opened before mounting, so a signal at any moment after the mount unmounts cleanly.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                server = LayerServer(config, nursery, data_path, extension=extension)
                adopted = await server.blobs.start(nursery) if server.blobs is not None else False
                if server.erofs is not None:  # a killed server's mounts: detached (kept if the event holder kept their blobs)
                    await trio.to_thread.run_sync(functools.partial(server.erofs.prepare, keep_mounts=adopted))
                await server.restore(saved)
                if server.peers is not None:
                    await nursery.start(server.peers.run)
                server.session = await nursery.start(functools.partial(serve, server.ops, str(paths.mountpoint), options=options))
                UP.set(1)
                await server.mount_restored()  # before the control socket: nobody is told a lower dir that is not there
                nursery.start_soon(functools.partial(profile_hooks.sample_counter, "layers.bytes", server.stores.bytes_fetched, phase="image"))  # profiler: bytes over time
                nursery.start_soon(_sample_cpu)  # profiler: CPU per stage over time
                if server.blobs is not None:  # profiler: the kernel's pre-access events the server answered
                    blobs = server.blobs
                    nursery.start_soon(functools.partial(profile_hooks.sample_counter, "layers.fanotify_events", lambda: blobs.statistics().answered, phase="image"))
                if server.peers is not None:  # profiler: the bytes that came from peers instead of the store
                    peers = server.peers
                    nursery.start_soon(functools.partial(profile_hooks.sample_counter, "layers.peer_bytes", lambda: peers.statistics().received_bytes, phase="image"))
                try:
                    await nursery.start(serve_control, server.control, paths.socket)
                    log.info("layer server ready", root=str(config.root), mountpoint=str(paths.mountpoint),
                             layers=len(server.root.layers), socket=str(paths.socket))  # fmt: skip
                    if on_ready is not None:
                        result = on_ready(server)
                        if result is not None:
                            await result
                    await end_on_signals(server.session, _detaching_first(server, signals), grace=config.shutdown_grace)
                finally:
                    UP.set(0)
                nursery.cancel_scope.cancel()
    finally:
        os.close(lock_fd)


__all__ = [
    "CACHE_TIMEOUT",
    "FetchedImage",
    "Layer",
    "LayerServer",
    "LayerServerConfig",
    "LayerServerStatistics",
    "LoadedLayer",
    "ServerAlreadyRunning",
    "load_table",
    "prepare_root",
    "run_server",
    "save_table",
    "store_id",
]
