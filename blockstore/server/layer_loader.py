"""Loading a layer: what a mount, a restore and a warm get from the store before the layer is served.

:class:`LayerLoader` owns the load path of :class:`~bootseer.blockstore.server.layer_server.LayerServer`,
one object that the mount, the restore and the warm (:mod:`.warming`) all go through:

* the chain record (read from the store, or as the caller read it), decoded and trusted
  (:meth:`LayerLoader.check_trust`, docs/trust.md) before anything else of the layer is fetched;
* the layer's JSON index, verified, or for a layer served from its converter-built image its
  binary block table (:meth:`LayerLoader.from_table`), with the bytes as stored (the node's copy);
* on the EROFS data paths, the layer's image: the converter's, fetched block by block (each
  block verified), hashed to its table's SHA-256 and checked in the checker process unless a
  trusted converter signed the record, and kept; or the one this node keeps, verified and
  checked again; or, for a conversion without one, built here from the index.  An image that
  addresses another blob size than the index's is refused (LayerCorrupt).

It holds no reference to the server: its constructor takes the parts it uses (the trust policy,
the store registry, the EROFS layers, the index copies, the decode threads) and two questions
it asks of its owner: which records the table of mounted layers holds (``mounted``) and whether a
mount or a warm holds a ChainID now (``held``).  With them it remembers the chain record of each
load until no mount or warm holds it, so that a load no mount took (:meth:`LayerLoader.discard`)
removes its image only when no served layer and no other held load uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from bootseer.blockstore.datapath.choice import IMAGES, ErofsLayers, store_image_check
from bootseer.blockstore.datapath.erofs_check import ImageRefused
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.erofs_image import ErofsError
from bootseer.blockstore.objects.format import ChainRecord, FormatError, LayerImage, LayerIndex
from bootseer.blockstore.objects.signing import TrustPolicy, Untrusted
from bootseer.blockstore.server.client import (
    LayerCorrupt,
    LayerNotConverted,
    LayerServerError,
    LayerUntrusted,
    StoreUnavailable,
)
from bootseer.blockstore.server.index_copies import IndexCopies
from bootseer.blockstore.server.store_registry import StoreRegistry
from bootseer.fetch.source import SourceError
from bootseer.fetch.sources import redact_url
from bootseer.fetch.stripes import FetchError, Priority
from bootseer.log import get_logger
from bootseer.profile import events as profile_events

if TYPE_CHECKING:
    from bootseer.blockstore.objects.store import StoreReader

log = get_logger(__name__)


@dataclass(frozen=True)
class FetchedImage:
    """A layer's EROFS image from the store, kept: its table, the file (every block verified, the whole
    hashed to the table's SHA-256 and, ``checked``, accepted by the bounded check) and whether it was checked."""

    table: LayerImage
    path: Path
    checked: bool


@dataclass(frozen=True)
class LoadedLayer:
    """What a mount loads before it takes the table's lock (:meth:`LayerLoader.load`)."""

    record: ChainRecord  #: the chain record, trusted
    #: the layer's index, verified; or its block table, for a layer served from its converter-built image
    #: (:meth:`LayerLoader.from_table`)
    index: LayerBlocks
    data: bytes  #: the index (or block table) as stored (the node's copy, for restarts)
    image: Path | None  #: the EROFS image, checked or built (None on the tree path)


class LayerLoader:
    """The load path of a layer server's layers: chain record, trust, index or block table, EROFS image."""

    def __init__(self, *, trust: TrustPolicy, stores: StoreRegistry, erofs: ErofsLayers | None, indexes: IndexCopies,
                 decode_threads: trio.CapacityLimiter, load_timeout: float,
                 mounted: Callable[[], Iterable[ChainRecord]], held: Callable[[str], bool]) -> None:  # fmt: skip
        """``erofs``: the layers' EROFS mounts (None on the tree path: no image is loaded); ``load_timeout``: the
        seconds a load may take to get its chain record, index and image; ``mounted``: the chain records of the
        table's layers now; ``held``: whether a mount or a warm of a ChainID holds it now."""
        self.trust = trust
        self.stores = stores
        self.erofs = erofs
        self.indexes = indexes
        self.decode_threads = decode_threads
        self.load_timeout = load_timeout
        self._mounted = mounted
        self._held = held
        #: The chain record each load (:meth:`load`) got, by ChainID, while a mount or a warm of it holds it:
        #: whose image a load no mount took must leave on disk (:meth:`_image_in_use`).
        self._loaded: dict[str, ChainRecord] = {}

    def remembered(self) -> list[str]:
        """The ChainIDs whose loads this loader remembers now (those a mount or a warm held at its last look)."""
        return list(self._loaded)

    async def json_index(self, record: ChainRecord, store: str) -> LayerIndex:
        """The JSON index of ``record``'s layer: from its local copy, else from ``store`` (verified against
        ``record``) and kept as a copy."""
        from bootseer.blockstore.objects.store import StoreReader

        found = await trio.to_thread.run_sync(self.indexes.load, record, limiter=self.decode_threads)
        if found is None:
            engine, _fetcher = await self.stores.fetcher(store)
            found, data = await StoreReader(engine, threads=self.decode_threads).index_and_bytes(record)
            await trio.to_thread.run_sync(self.indexes.save, record, data)
        assert isinstance(found, LayerIndex)  # IndexCopies.load without table=True decodes an index
        return found

    # -- the chain record, the index -------------------------------------------------------

    def check_trust(self, record: ChainRecord, deps_index: str | None) -> None:
        """LayerUntrusted unless a trusted converter signed ``record``, or it is the dependency layer
        whose index ``deps_index`` the caller took from a deps record a trusted writer signed."""
        if deps_index is not None and deps_index == record.index:
            return  # the index's SHA-256 pins the layer as a signed chain record would
        try:
            self.trust.check("chain", record.signature_check(), f"the chain record of {record.chain_id}")
        except Untrusted as exc:
            raise LayerUntrusted(str(exc)) from None

    def from_table(self, record: ChainRecord, deps_index: str | None = None) -> bool:
        """Whether ``record``'s layer is served from its block table instead of its JSON index: the record names
        both a block table and a converter-built EROFS image, and the data path mounts that image (``erofs``,
        ``loop``, ``fanotify``), whose tree is the layer's: what the node needs besides is its blocks.  Never for
        a dependency layer served on its deps record's word (``deps_index``) under a trust policy: that record
        pins the index, not the table."""
        pinned_by_index = deps_index is not None and self.trust.enforced("chain")
        return bool(record.block_table and record.image) and self.erofs is not None and not pinned_by_index

    async def fetch_layer(
        self, chain_id: str, store: str, deps_index: str | None = None, *, with_image: bool = False,
        record_data: bytes | None = None,
    ) -> tuple[ChainRecord, LayerBlocks, bytes, FetchedImage | None]:
        """The chain record and index of ``chain_id`` from ``store`` (verified, and trusted: see
        :meth:`check_trust`), the index's bytes as stored, and with ``with_image`` the blocks of
        the layer's EROFS image when the record names one this node does not keep yet.  For a layer
        :meth:`from_table`, its block table (and its bytes) in the index's place: the JSON index is
        never fetched.  ``record_data``: the chain record as the caller read it from ``store`` (a mount's
        ``record``): decoded and trust-checked here as the store's would be, and not read again.

        The image's blocks are fetched once the record is trusted, then checked (in the checker
        process) while the index is fetched and decoded.
        """
        from bootseer.blockstore.objects.store import StoreReader

        engine, fetcher = await self.stores.fetcher(store)
        reader = StoreReader(engine, threads=self.decode_threads)  # the index decodes off the trio thread
        try:
            record = ChainRecord.decode(record_data, expected_chain_id=chain_id) if record_data is not None \
                else await reader.chain(chain_id)  # fmt: skip
            if record is None:
                raise LayerNotConverted(f"{chain_id} is not converted in {engine.url} (no chain record)")
            self.check_trust(record, deps_index)  # before the index (or the image) is even fetched
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
                got["index"] = await (reader.block_table_and_bytes(record) if self.from_table(record, deps_index)
                                      else reader.index_and_bytes(record))  # fmt: skip
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
        index_and_data: tuple[LayerBlocks, bytes] = got["index"]
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
        if not self.trust.enforced("chain"):
            return False
        try:
            self.trust.check("chain", record.signature_check(), f"the chain record of {record.chain_id}")
        except Untrusted:
            return False
        return True

    async def layer_image(self, record: ChainRecord, index: LayerBlocks, store: str,
                           fetched: FetchedImage | None = None, *, phase: str = "image") -> tuple[Path, str]:  # fmt: skip
        """:meth:`_get_image`, one ``layer.image`` span of the start-up profiler's ``phase`` (its source, and the
        image's size as ``image_bytes``: not the span's ``bytes``, which a phase adds up, since the blocks it
        was fetched in are in ``layers.bytes`` already, compressed)."""
        with profile_events.span("layer.image", phase=phase, chain_id=record.chain_id) as span:
            path, span["source"] = await self._get_image(record, index, store, fetched)
            span["image_bytes"] = path.stat().st_size if span["source"] == "store" else 0
            return path, span["source"]

    async def _get_image(self, record: ChainRecord, index: LayerBlocks, store: str,
                         fetched: FetchedImage | None) -> tuple[Path, str]:  # fmt: skip
        """The EROFS image to mount for ``record``'s layer (verified ``index``), and where it came from:
        the converter's, or for a conversion without one, built here from the index (one log line,
        and the metric).

        The converter's (``fetched`` with the index by :meth:`fetch_layer`; else the one this node
        keeps, verified and checked again (:meth:`_kept_image`); else, or if that one is refused,
        fetched now: :meth:`_fetch_image`, which hashes and checks it) is kept only if the blob size
        it was checked against is the index's.  LayerCorrupt (the snapshotter then downloads the
        layer) when it is refused.
        """
        from bootseer.blockstore.objects.store import StoreReader

        assert self.erofs is not None
        if not record.image:
            assert isinstance(index, LayerIndex)  # a layer served from its block table has an image (from_table)
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
                engine, fetcher = await self.stores.fetcher(store)
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
        users = list(self._mounted())
        users += [record for chain_id, record in self._loaded.items() if chain_id != other_than]
        return any(other.index == record.index or (record.image and other.image == record.image) for other in users)

    def _forget_loads_done(self) -> None:
        """Drop from :attr:`_loaded` the loads no mount or warm holds any more (a mount done: its row, if any,
        is in the table; or failed), so that it never holds more than the loads in progress or held."""
        for chain_id in [c for c in self._loaded if not self._held(c)]:
            del self._loaded[chain_id]

    def discard(self, loaded: LoadedLayer) -> None:
        """The warmer's ``discard``: a load no mount took (expired, or dropped as the server stops) leaves nothing
        on disk; the EROFS image it kept (and its table copy) is removed, unless :meth:`_image_in_use`."""
        if self.erofs is None or loaded.image is None or self._image_in_use(loaded.record):
            return
        self.erofs.remove_image(loaded.record.index, loaded.record.image)
        log.info("removed the EROFS image of a layer loaded ahead that no mount took", chain_id=loaded.record.chain_id,
                 image=loaded.record.image or loaded.record.index)  # fmt: skip

    async def load(self, chain_id: str, store: str, deps_index: str | None = None,
                    record_data: bytes | None = None) -> LoadedLayer:  # fmt: skip
        """What a mount of ``chain_id`` from ``store`` needs before it takes the table's lock: the chain
        record (trusted), the index (verified) and its bytes, and on the EROFS paths the image, checked
        (or built) and kept, for any slot.  What a mount and a warm (:mod:`.warming`) both run."""
        # The engine fails a store that errors within retry_timeout; this bounds one that
        # trickles (a 1 GiB index at a few KiB/s), which the engine keeps reading.
        # In the profiler an image's layer is in the pull's phase; a dependency layer's mount, inside
        # the container's Prepare (whose phases the snapshotter marks), is a span of no phase.
        phase = "image" if deps_index is None else ""
        with trio.move_on_after(self.load_timeout) as loading, \
                profile_events.span("layer.index", phase=phase, chain_id=chain_id):
            record, index, data, fetched = await self.fetch_layer(chain_id, store, deps_index, with_image=True,
                                                                   record_data=record_data)  # fmt: skip
            self._forget_loads_done()
            self._loaded[chain_id] = record  # its image is this load's now (_image_in_use)
        if loading.cancelled_caught:
            raise StoreUnavailable(f"{chain_id}: the store {redact_url(store)} did not give its chain record, "
                                   f"index and EROFS image in {self.load_timeout:g}s")  # fmt: skip
        image = None
        if self.erofs is not None:
            image, _source = await self.layer_image(record, index, store, fetched, phase=phase)
        return LoadedLayer(record, index, data, image)

__all__ = ["FetchedImage", "LayerLoader", "LoadedLayer"]
