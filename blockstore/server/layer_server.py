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
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import prometheus_client
import pyfuse3
import trio

from bootseer import cpu
from bootseer.blockstore.node.block_cache import DEFAULT_CACHE_SIZE
from bootseer.blockstore.server.client import (
    MOUNT_TIMEOUT,
    InvalidRequest,
    LayerCorrupt,
    LayerNotConverted,
    LayerNotMounted,
    LayerServerError,
    LayerUntrusted,
    ServerPaths,
    StoreUnavailable,
)
from bootseer.blockstore.server.control_socket import serve_control
from bootseer.blockstore.server.index_copies import IndexCopies
from bootseer.blockstore.server.extension import ExtensionFactory, ServerExtension
from bootseer.blockstore.server.ops import ControlOps
from bootseer.blockstore.datapath.choice import (
    EROFS_PATHS,
    FILESYSTEMS,
    IMAGES,
    DataPathChoice,
    DataPathProbe,
    ErofsLayers,
    announce,
    store_image_check,
)
from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.datapath.event_holder import HOLE_WAIT
from bootseer.blockstore.datapath.image_checker import ImageCheck
from bootseer.blockstore.datapath.local_blobs import FanotifyBlobs, LocalBlob
from bootseer.blockstore.datapath.erofs_check import ImageRefused
from bootseer.blockstore.objects.erofs_image import ErofsError
from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, ChainRecord, FormatError, LayerImage, LayerIndex, check_digest
from bootseer.blockstore.server.layer_table import Layer, LayerTable, load_table, save_table, store_id
from bootseer.blockstore.datapath.tree import LayersRoot, LayerTree
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.limits import peer_memory_share
from bootseer.blockstore.peers.service import PeerService
from bootseer.blockstore.peers.config import PeerConfig
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.peers import PeerAllowance, PeerPayload
from bootseer.blockstore.objects.signing import SigningKey, TrustPolicy, Untrusted
from bootseer.blockstore.server.store_registry import StoreRegistry
from bootseer.blockstore.server.warming import WARM_MAX_ENTRIES, LayerWarmer
from bootseer.fetch.engine import Engine, EngineConfig
from bootseer.fetch.stripes import FetchError, Priority
from bootseer.fetch.source import SourceError
from bootseer.fetch.sources import redact_url
from bootseer.fuse import FuseSession, ReadOnlyOperations, end_on_signals, mount_options, serve, unmount_dead
from bootseer.locks import TrioKeyedLocks
from bootseer.log import get_logger
from bootseer.profile import events as profile_events
from bootseer.profile import hooks as profile_hooks

if TYPE_CHECKING:
    from bootseer.blockstore.objects.store import StoreReader

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


@dataclass(frozen=True)
class FetchedImage:
    """A layer's EROFS image from the store, kept: its table, the file (every block verified, the whole
    hashed to the table's SHA-256 and, ``checked``, accepted by the bounded check) and whether it was checked."""

    table: LayerImage
    path: Path
    checked: bool


class ServerAlreadyRunning(Exception):
    """Another layer server holds this root's lock."""


@dataclass(frozen=True)
class LayerServerConfig:
    """Everything ``bootseer layer-server`` is started with."""

    root: Path
    store: str | None = None  #: default store URL of a mount that names none
    cache_dir: Path | None = None  #: default ``ROOT/cache``
    cache_size: int = DEFAULT_CACHE_SIZE  #: bytes the block cache may hold
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


@dataclass(frozen=True)
class LayerServerStatistics:
    """What :meth:`LayerServer.statistics` reports: the server's own state (its stores' and peers' are theirs)."""

    uptime_s: float  #: seconds since the server was built
    serving: bool  #: whether its FUSE mount is being served
    open_files: int  #: files of served layers open through FUSE now
    layers: int  #: rows of the table of mounted layers (a layer whose restore failed included)
    served: int  #: layers whose tree is served


@dataclass(frozen=True)
class LoadedLayer:
    """What a mount loads before it takes the table's lock (:meth:`LayerServer._load`)."""

    record: ChainRecord  #: the chain record, trusted
    index: LayerIndex  #: the layer's index, verified
    data: bytes  #: the index as stored (the node's copy, for restarts)
    image: Path | None  #: the EROFS image, checked or built (None on the tree path)


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
        self.cache = BlockCache(str(config.cache_dir or config.root / "cache"), config.cache_size)
        # Cache I/O, decompression and hashing, for every store's fetcher together.
        self._block_threads = trio.CapacityLimiter(os.cpu_count() or 2)
        #: Decoding store objects (layer indexes, hot lists): in worker threads, never the
        #: trio thread that answers FUSE requests, and at most half the cores at once, so a
        #: large or hostile object leaves the block fetchers their threads.
        self.decode_threads = trio.CapacityLimiter(max(1, (os.cpu_count() or 2) // 2))
        #: The layers' EROFS mounts (None on the tree path, where the FUSE tree is the lower dir).
        self.erofs = ErofsLayers(self.paths, self.data_path.path, self.decode_threads) if erofs else None
        #: The local blobs the EROFS mounts read on the ``fanotify`` path, filled on the kernel's events (else None).
        self.blobs = FanotifyBlobs(self.paths, blob_directory(config), self._addressed, hole_wait=config.hole_wait,
                                   background=config.background_fill, fetched=lambda: self.stores.bytes_fetched()) \
            if self.data_path.path == "fanotify" and self.erofs is not None else None  # fmt: skip
        #: Block sharing with the peer group (None: off).
        self.peers = PeerService(config.peers, self._block_for_peer, self._block_threads,
                                 memory=peer_memory_share(config.engine),
                                 largest_block=self._largest_block) if config.peers.enabled else None  # fmt: skip
        #: One engine and block fetcher per store URL.
        self.stores = StoreRegistry(nursery, config.engine, config.source_options, self.cache, self._block_threads,
                                    peers=self.peers.client if self.peers else None,
                                    known=[config.store] if config.store else [])  # fmt: skip
        #: Layers loaded ahead of their mounts (the ``warm`` operation), taken by :meth:`mount`; what no mount
        #: takes leaves nothing on disk (:meth:`_discard_load`).
        self.warmer: LayerWarmer[LoadedLayer] = LayerWarmer(nursery, self._load, discard=self._discard_load)
        #: The chain record each load (:meth:`_load`) got, by ChainID, while a mount or a warm of it holds it:
        #: whose image a load no mount took must leave on disk (:meth:`_image_in_use`).
        self._loaded: dict[str, ChainRecord] = {}
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

    def _statfs(self) -> pyfuse3.StatvfsData:
        """What ``df`` shows: the served layers' file bytes and entries, nothing free (read-only)."""
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = sum(tree.index_bytes for tree in self.root.layers.values()) // 4096
        data.f_files = sum(len(tree.index.entries) for tree in self.root.layers.values())
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

    # -- loading a layer ------------------------------------------------------------------

    def _check_trust(self, record: ChainRecord, deps_index: str | None) -> None:
        """LayerUntrusted unless a trusted converter signed ``record``, or it is the dependency layer
        whose index ``deps_index`` the caller took from a deps record a trusted writer signed."""
        if deps_index is not None and deps_index == record.index:
            return  # the index's SHA-256 pins the layer as a signed chain record would
        try:
            self.config.trust.check("chain", record.signature_check(), f"the chain record of {record.chain_id}")
        except Untrusted as exc:
            raise LayerUntrusted(str(exc)) from None

    async def _fetch_layer(
        self, chain_id: str, store: str, deps_index: str | None = None, *, with_image: bool = False
    ) -> tuple[ChainRecord, LayerIndex, bytes, FetchedImage | None]:
        """The chain record and index of ``chain_id`` from ``store`` (verified, and trusted: see
        :meth:`_check_trust`), the index's bytes as stored, and with ``with_image`` the blocks of
        the layer's EROFS image when the record names one this node does not keep yet.

        The image's blocks are fetched once the record is trusted, then checked (in the checker
        process) while the index is fetched and decoded.
        """
        from bootseer.blockstore.objects.store import StoreReader

        engine, fetcher = await self.fetcher(store)
        reader = StoreReader(engine, threads=self.decode_threads)  # the index decodes off the trio thread
        try:
            record = await reader.chain(chain_id)
            if record is None:
                raise LayerNotConverted(f"{chain_id} is not converted in {engine.url} (no chain record)")
            self._check_trust(record, deps_index)  # before the index (or the image) is even fetched
        except FormatError as exc:
            raise LayerCorrupt(f"{chain_id} in {engine.url}: {exc}") from None
        except (FetchError, SourceError) as exc:
            raise StoreUnavailable(f"{chain_id}: the store {engine.url} failed: {exc}") from None
        wanted = with_image and self.erofs is not None and record.image != ""
        if wanted and self.erofs is not None and self.erofs.cached(self.erofs.store_image_path(record.image)):
            wanted = False
        got: dict[str, Any] = {}
        # The image's blocks first, alone: their fetch is many small steps on the trio thread, which a
        # decode holding the interpreter lock in a worker would slow to one step per switch interval.
        # Then the index's decode in the server and the image's check in the checker process, side by side.
        blocks = await self._fetch_image_blocks(record, reader, fetcher) if wanted else None

        async def index() -> None:
            try:
                got["index"] = await reader.index_and_bytes(record)
            except FormatError as exc:
                got["error"] = LayerCorrupt(f"{chain_id} in {engine.url}: {exc}")
            except (FetchError, SourceError) as exc:
                got["error"] = StoreUnavailable(f"{chain_id}: the store {engine.url} failed: {exc}")

        async def image(table: LayerImage, table_data: bytes, pieces: list[bytes]) -> None:
            try:
                got["image"] = await self._verify_image(record, table, table_data, pieces)
            except LayerServerError as exc:
                got["image_error"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(index)
            if blocks is not None:
                nursery.start_soon(image, *blocks)
        if "error" in got and "image" in got and not self._image_in_use(record, other_than=chain_id):
            assert self.erofs is not None  # the image kept for a layer whose index failed: nothing mounts it
            self.erofs.remove_image("", record.image)
        for failed in ("error", "image_error"):
            if failed in got:
                raise got[failed]
        index_and_data: tuple[LayerIndex, bytes] = got["index"]
        return record, index_and_data[0], index_and_data[1], got.get("image")

    async def _fetch_image(self, record: ChainRecord, reader: StoreReader, fetcher: BlockFetcher) -> FetchedImage:
        """``record``'s EROFS image, fetched (:meth:`_fetch_image_blocks`) and verified (:meth:`_verify_image`)."""
        table, table_data, pieces = await self._fetch_image_blocks(record, reader, fetcher)
        return await self._verify_image(record, table, table_data, pieces)

    async def _fetch_image_blocks(self, record: ChainRecord, reader: StoreReader,
                                  fetcher: BlockFetcher) -> tuple[LayerImage, bytes, list[bytes]]:  # fmt: skip
        """The table of ``record``'s EROFS image, the table's bytes as stored and the image's blocks, each verified
        as a layer's are (memory, node cache, peers, store).  LayerCorrupt if the table is refused,
        StoreUnavailable if the store fails."""
        try:
            table, table_data = await reader.image_and_bytes(record)
            return table, table_data, await fetcher.blocks(table, range(len(table.blocks)), Priority.DEMAND)
        except FormatError as exc:
            raise self._refused(record, str(exc)) from None
        except (FetchError, SourceError) as exc:
            raise StoreUnavailable(f"{record.chain_id}: the store {reader.engine.url} failed to give its EROFS image: {exc}") from None

    async def _verify_image(self, record: ChainRecord, table: LayerImage, table_data: bytes,
                            pieces: list[bytes]) -> FetchedImage:  # fmt: skip
        """The image of ``pieces`` kept once it hashes to its table's SHA-256 and, unless a trusted converter
        signed the record, the bounded check accepted it (in the checker process, against the table's blob
        size, the record's block size and entries: the index may still be decoding; :meth:`_get_image` then
        holds the index to that blob size), with ``table_data`` (the table as stored) beside it: what a later
        mount verifies the kept image against (:meth:`_kept_image`).  LayerCorrupt if it is refused."""
        assert self.erofs is not None
        check = None if self._signed_by_converter(record) else store_image_check(table, record)
        install = functools.partial(self.erofs.install_image, record.image, table.sha256, pieces, check, table=table_data)
        try:
            # Not under the decode limiter: this thread hashes and writes (no GIL) and waits for the checker
            # process, while the index may be decoding under it.
            path = await trio.to_thread.run_sync(install)
        except ImageRefused as exc:
            raise self._refused(record, str(exc)) from None
        except OSError as exc:  # the node's disk (full, read-only): not the image's fault
            raise LayerServerError(f"{record.chain_id}: cannot keep its EROFS image: {exc}") from None
        return FetchedImage(table, path, check is not None)

    def _refused(self, record: ChainRecord, why: str) -> LayerCorrupt:
        """The error of a store image that must not be mounted, counted and logged."""
        IMAGES.labels("refused").inc()
        log.warning("the store's EROFS image of the layer is refused; the layer is not served lazily",
                    chain_id=record.chain_id, image=record.image, error=why)  # fmt: skip
        return LayerCorrupt(f"{record.chain_id}: its EROFS image {record.image[:12]} is refused: {why}")

    def _signed_by_converter(self, record: ChainRecord) -> bool:
        """Whether a converter key this node trusts signed ``record`` (never without keys; a dependency
        layer served on its deps record's word is not: that record names its index, not its image)."""
        if not self.config.trust.enforced("chain"):
            return False
        try:
            self.config.trust.check("chain", record.signature_check(), f"the chain record of {record.chain_id}")
        except Untrusted:
            return False
        return True

    async def _layer_image(self, record: ChainRecord, index: LayerIndex, store: str,
                           fetched: FetchedImage | None = None, *, phase: str = "image") -> tuple[Path, str]:  # fmt: skip
        """:meth:`_get_image`, one ``layer.image`` span of the start-up profiler's ``phase`` (its source, and the
        image's size as ``image_bytes``: not the span's ``bytes``, which a phase adds up, since the blocks it
        was fetched in are in ``layers.bytes`` already, compressed)."""
        with profile_events.span("layer.image", phase=phase, chain_id=record.chain_id) as span:
            path, span["source"] = await self._get_image(record, index, store, fetched)
            span["image_bytes"] = path.stat().st_size if span["source"] == "store" else 0
            return path, span["source"]

    async def _get_image(self, record: ChainRecord, index: LayerIndex, store: str,
                         fetched: FetchedImage | None) -> tuple[Path, str]:  # fmt: skip
        """The EROFS image to mount for ``record``'s layer (verified ``index``), and where it came from:
        the converter's, or for a conversion without one, built here from the index (one log line,
        and the metric).

        The converter's (``fetched`` with the index by :meth:`_fetch_layer`; else the one this node
        keeps, verified and checked again (:meth:`_kept_image`); else, or if that one is refused,
        fetched now: :meth:`_fetch_image`, which hashes and checks it) is kept only if the blob size
        it was checked against is the index's.  LayerCorrupt (the snapshotter then downloads the
        layer) when it is refused.
        """
        from bootseer.blockstore.objects.store import StoreReader

        assert self.erofs is not None
        if not record.image:
            if not self.erofs.image_path(record.index).exists():
                log.info("layer has no converter-built EROFS image (an older conversion): building it from its index",
                         chain_id=record.chain_id, entries=len(index.entries))  # fmt: skip
            try:
                path = await trio.to_thread.run_sync(self.erofs.ensure_image, index, record.index, limiter=self.decode_threads)
            except ErofsError as exc:
                raise LayerCorrupt(f"{record.chain_id}: its index cannot be an EROFS image: {exc}") from None
            IMAGES.labels("built").inc()
            return path, "built"
        kept = await self._kept_image(record) if fetched is None else None
        if kept is not None:
            path, source = kept, "cached"
        else:
            if fetched is None:
                engine, fetcher = await self.fetcher(store)
                fetched = await self._fetch_image(record, StoreReader(engine, threads=self.decode_threads), fetcher)
            path, source = fetched.path, "store"
        # What the image's chunks may address (its check held them to its device table) is the blob served.
        blob_size = await trio.to_thread.run_sync(self.erofs.blob_size_of, path)
        if blob_size != index.blob_size:
            self.erofs.remove_image("", record.image)
            raise self._refused(record, f"it addresses a blob of {blob_size} bytes, the index's is {index.blob_size}")
        IMAGES.labels(source).inc()
        if fetched is None:
            return path, "cached"
        log.info("fetched the layer's EROFS image", chain_id=record.chain_id, image_bytes=fetched.table.size,
                 checked=fetched.checked)  # fmt: skip
        return path, "store"

    async def _kept_image(self, record: ChainRecord) -> Path | None:
        """The image of ``record``'s layer this node keeps, verified against the local copy of its table and
        checked (unless a trusted converter signed ``record``) again before it is mounted
        (:meth:`ErofsLayers.kept_image`); None if none is kept, or it is refused: then it is removed, logged
        and counted (``kept_refused``), and the caller fetches it from the store, verified and checked as a
        fresh one is."""
        assert self.erofs is not None
        verify = functools.partial(self.erofs.kept_image, record, check=not self._signed_by_converter(record))
        try:
            # Not under the decode limiter, as a fetched image's install: a hash (no GIL) and the checker's wait.
            return await trio.to_thread.run_sync(verify)
        except ImageRefused as exc:
            IMAGES.labels("kept_refused").inc()
            log.warning("the EROFS image kept on this node is refused: removed, fetched again from the store",
                        chain_id=record.chain_id, image=record.image, error=str(exc))  # fmt: skip
            return None

    def _image_in_use(self, record: ChainRecord, *, other_than: str = "") -> bool:
        """Whether a layer in the table, or a load a mount or a warm still holds (but ``other_than``'s), has
        ``record``'s index or image: what must stay on disk when a load no mount took is discarded."""
        self._forget_loads_done()
        users = [layer.record for layer in self.layers.values()]
        users += [record for chain_id, record in self._loaded.items() if chain_id != other_than]
        return any(other.index == record.index or (record.image and other.image == record.image) for other in users)

    def _forget_loads_done(self) -> None:
        """Drop from :attr:`_loaded` the loads no mount or warm holds any more (a mount done: its row, if any,
        is in the table; or failed), so that it never holds more than the loads in progress or held."""
        for chain_id in [c for c in self._loaded if not self._chain_locks.users(c) and not self.warmer.holds(c)]:
            del self._loaded[chain_id]

    def _discard_load(self, loaded: LoadedLayer) -> None:
        """The warmer's ``discard``: a load no mount took (expired, or dropped as the server stops) leaves nothing
        on disk; the EROFS image it kept (and its table copy) is removed, unless :meth:`_image_in_use`."""
        if self.erofs is None or loaded.image is None or self._image_in_use(loaded.record):
            return
        self.erofs.remove_image(loaded.record.index, loaded.record.image)
        log.info("removed the EROFS image of a layer loaded ahead that no mount took", chain_id=loaded.record.chain_id,
                 image=loaded.record.image or loaded.record.index)  # fmt: skip

    async def _tree(self, layer: Layer, index: LayerIndex) -> LayerTree:
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
            index = await trio.to_thread.run_sync(self.indexes.load, layer.record, limiter=self.decode_threads)
            try:
                if index is None:
                    _record, index, data, _image = await self._fetch_layer(layer.chain_id, layer.store)
                    await trio.to_thread.run_sync(self.indexes.save, layer.record, data)
                layer.tree = await self._tree(layer, index)
            except (LayerServerError, OSError, FormatError) as exc:
                layer.error = str(exc)
                RESTORED.labels("failed").inc()
                log.error("cannot restore layer", chain_id=layer.chain_id, slot=layer.slot, error=str(exc))
                continue
            self.root.layers[layer.slot] = layer.tree
            RESTORED.labels("restored").inc()
            log.info("restored layer", chain_id=layer.chain_id, slot=layer.slot, entries=len(index.entries))
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
                    image, source = await self._layer_image(layer.record, layer.tree.index, layer.store)
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

    def _addressed(self, image: Path, index: LayerIndex) -> list[int]:
        """The blob blocks the files of ``image`` (``index``'s layer's) address, parsed in the checker's process."""
        assert self.erofs is not None
        return self.erofs.checker.addressed(image, ImageCheck(index.blob_size, index.block_size, len(index.entries)))

    def local_blob(self, chain_id: str) -> LocalBlob | None:
        """The local blob of a served layer on ``fanotify`` (:class:`~bootseer.blockstore.server.extension.LayerHost`)."""
        layer = self.layers.get(chain_id)
        if self.blobs is None or layer is None:
            return None
        return self.blobs.blob_of(layer.record.index)

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

    async def mount(self, chain_id: str, store: str | None = None, deps_index: str | None = None) -> dict[str, Any]:
        store = store or self.config.store
        if not store:
            raise InvalidRequest("no store: the server has no --store and the request names none")
        async with self._chain_locks.hold(chain_id):
            layer = self.layers.get(chain_id)
            if layer is not None and layer.tree is not None:
                if layer.deps_index and deps_index != layer.deps_index:
                    # Served as a dependency layer on a deps record's word: as anything else it
                    # needs what any layer needs (else a writer key could stand in for a converter's).
                    self._check_trust(layer.record, deps_index)
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
                loaded = await self._load(chain_id, store, deps_index)
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
                await trio.to_thread.run_sync(self.indexes.save, record, data)
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
            log.info("mounted layer", chain_id=chain_id, slot=layer.slot, entries=len(index.entries), store=redact_url(store),
                 data_path=layer.data_path, lower_dir=self.lower_dir(layer.slot))  # fmt: skip
            if self.extension is not None:
                self.extension.layer_mounted(chain_id)  # an image's top with a hot list: prefetch from now
            return self._answer(layer)

    async def _load(self, chain_id: str, store: str, deps_index: str | None = None) -> LoadedLayer:
        """What a mount of ``chain_id`` from ``store`` needs before it takes the table's lock: the chain
        record (trusted), the index (verified) and its bytes, and on the EROFS paths the image, checked
        (or built) and kept, for any slot.  What a mount and a warm (:mod:`.warming`) both run."""
        # The engine fails a store that errors within retry_timeout; this bounds one that
        # trickles (a 1 GiB index at a few KiB/s), which the engine keeps reading.
        # In the profiler an image's layer is in the pull's phase; a dependency layer's mount, inside
        # the container's Prepare (whose phases the snapshotter marks), is a span of no phase.
        phase = "image" if deps_index is None else ""
        with trio.move_on_after(self.config.load_timeout) as loading, \
                profile_events.span("layer.index", phase=phase, chain_id=chain_id):
            record, index, data, fetched = await self._fetch_layer(chain_id, store, deps_index, with_image=True)
            self._forget_loads_done()
            self._loaded[chain_id] = record  # its image is this load's now (_image_in_use)
        if loading.cancelled_caught:
            raise StoreUnavailable(f"{chain_id}: the store {redact_url(store)} did not give its chain record, "
                                   f"index and EROFS image in {self.config.load_timeout:g}s")  # fmt: skip
        image = None
        if self.erofs is not None:
            image, _source = await self._layer_image(record, index, store, fetched, phase=phase)
        return LoadedLayer(record, index, data, image)

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
        return await self.mount(_checked_chain_id(request), store, deps_index)

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
                # A mount still in use (lazily detached) keeps its blob served until this server stops.
                await self.blobs.close(layer.record.index, tree, remove=last)
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
            "data_path": {"path": self.data_path.path, "reason": self.data_path.reason},
            "warm": dataclasses.asdict(self.warmer.statistics()),
            **({"fanotify": dataclasses.asdict(self.blobs.statistics())} if self.blobs is not None else {}),
            "layers": [
                {**self._answer(layer), "store": layer.shown_store, "index": layer.record.index,
                 "entries": len(layer.tree.index.entries) if layer.tree else 0,
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
    "Layer",
    "LayerServer",
    "LayerServerConfig",
    "LayerServerStatistics",
    "ServerAlreadyRunning",
    "load_table",
    "prepare_root",
    "run_server",
    "save_table",
    "store_id",
]
