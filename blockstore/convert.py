"""Convert an image into a block store: ``bootseer convert REF --store URL``.

For each layer of the image, bottom up, :func:`convert_image`:

1. skips the layer if its chain record is in the store and verifies (record, index,
   packs present): a second run uploads nothing;
2. streams the layer blob (verified against its digest by :mod:`bootseer.images`)
   through :func:`blockstore.tarlayer.read_layer`, which refuses hostile tars, and
   checks the diffID it computed against the config's;
3. cuts file contents into blocks; a block already in the store (the store-wide
   dedup table) or earlier in this layer is referenced where it is, an all-zero block
   is stored nowhere, and every other block is zstd-compressed into this layer's pack,
   spooled to a local temp file (files in tar order, a file's blocks adjacent, so a
   run of neighbours is one range request) and named by its SHA-256 when complete;
4. uploads, in this order, the packs, the layer's dedup segment, the index, and last
   the chain record (what makes the layer visible: an interrupted conversion is never
   used), reading each back to check it: sizes of packs, hashes of the index and
   the chain record.

Memory is bounded by the block size, one record per entry and the dedup table (one
row per block in the store), never by a layer's size.  Progress goes to stderr
(a live line on a terminal, plain lines otherwise).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, TextIO

import zstandard

from bootseer.blockstore.format import (
    DEDUP_PREFIX,
    DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    ZERO_PACK,
    Block,
    ChainRecord,
    DedupSegment,
    FormatError,
    LayerIndex,
    StoredBlock,
    chain_ids,
    chain_object,
    dedup_object,
    index_object,
    pack_object,
)
from bootseer.blockstore.store import StoreWriter
from bootseer.blockstore.tarlayer import LayerError, ParsedLayer, TarLimits, read_layer
from bootseer import __version__
from bootseer.images import ImageSource, layer_compression
from bootseer.log import get_logger

log = get_logger(__name__)

#: A pack is closed and a new one started past this many bytes (objects stay a manageable size).
MAX_PACK_BYTES = 512 << 20
#: zstd level of blocks: fast enough to keep up with a registry, most of level 19's ratio on code and text.
BLOCK_ZSTD_LEVEL = 3


class ConversionError(Exception):
    """A conversion failed; the message says which layer and why.  Nothing of that layer was published."""


def default_workers() -> int:
    """Compression threads by default: the CPUs this process may use, at most 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the dedup table ----------------------------------------------------------------------


class DedupTable:
    """Every block already in the store, by digest: the union of the store's dedup segments.

    Segments are verified against their names; one that is not is skipped with a
    warning (its blocks are then stored again, never trusted).  Before a block is
    referenced, its pack is checked once to exist with the size the segment gives.
    """

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.blocks: dict[str, StoredBlock] = {}
        self.pack_sizes: dict[str, int] = {}
        self._pack_ok: dict[str, bool] = {}

    @classmethod
    def load(cls, writer: StoreWriter) -> DedupTable:
        table = cls(writer)
        for name in writer.list(DEDUP_PREFIX):
            expected = name.rpartition("/")[2]
            data = writer.get(name)
            if data is None:
                continue
            try:
                segment = DedupSegment.decode(data, expected_sha256=expected)
            except FormatError as exc:
                log.warning("skipping a dedup segment that fails verification", store=writer.display_url,
                            segment=name, error=str(exc))  # fmt: skip
                continue
            table.add(segment)
        return table

    def add(self, segment: DedupSegment) -> None:
        self.pack_sizes.update(segment.packs)
        for block in segment.blocks:
            self.blocks.setdefault(block.digest, block)

    def lookup(self, digest: str) -> StoredBlock | None:
        block = self.blocks.get(digest)
        if block is None:
            return None
        ok = self._pack_ok.get(block.pack)
        if ok is None:
            ok = self.writer.size(pack_object(block.pack)) == self.pack_sizes.get(block.pack)
            if not ok:
                log.warning("dedup table names a pack that is missing or of the wrong size; storing its blocks again",
                            store=self.writer.display_url, pack=block.pack)  # fmt: skip
            self._pack_ok[block.pack] = ok
        return block if ok else None


# -- packs ------------------------------------------------------------------------------------


@dataclass
class SpooledPack:
    path: Path
    sha256: str
    size: int


@dataclass
class BlockStats:
    blocks: int = 0  #: blocks of file contents, all kinds
    raw_bytes: int = 0  #: raw bytes of those blocks
    zero: int = 0  #: all-zero blocks (stored nowhere)
    in_store: int = 0  #: blocks found in the store's dedup table
    in_layer: int = 0  #: blocks equal to an earlier block of this layer
    stored: int = 0  #: blocks compressed into a new pack
    stored_raw: int = 0  #: raw bytes of the stored blocks
    stored_compressed: int = 0  #: compressed bytes written to packs

    @property
    def dedup_ratio(self) -> float:
        """Fraction of blocks not stored (zero, in the store, repeated in the layer)."""
        return 1.0 - self.stored / self.blocks if self.blocks else 0.0

    def __iadd__(self, other: BlockStats) -> BlockStats:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


class PackWriter:
    """The :class:`~blockstore.tarlayer.BlockSink` of one layer: dedup, compress, spool into packs.

    Digests and dedup decisions are made in the caller's thread, in order; only
    compression runs on ``workers`` threads (zstd releases the GIL), and compressed
    blocks are written to the pack in the order they were added, so a file's blocks
    stay adjacent.  At most ``2 * workers`` blocks are in flight.  Use it as a context
    manager (or call :meth:`close`) so the threads end even when the layer fails.
    """

    def __init__(self, block_size: int, table: DedupTable, spool_dir: Path, *, max_pack_bytes: int = MAX_PACK_BYTES,
                 on_block: Callable[[], None] | None = None, workers: int | None = None) -> None:  # fmt: skip
        self.block_size = block_size
        self.table = table
        self.spool_dir = spool_dir
        self.max_pack_bytes = max_pack_bytes
        self.on_block = on_block
        self.blocks: list[Block] = []
        self.packs: list[str] = []  #: pack names of :attr:`blocks`; "" for the one being written
        self.spooled: list[SpooledPack] = []
        self.new_blocks: list[StoredBlock] = []  #: this layer's additions to the dedup table
        self.stats = BlockStats()
        self._numbers: dict[str, int] = {}  # digest -> block number in this layer
        self._slots: dict[str, int] = {}  # pack name -> its number in :attr:`packs`
        self._workers = workers if workers is not None else default_workers()
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="bootseer-zstd") if self._workers > 1 else None
        self._local = threading.local()  # a compressor per thread: one must not be shared
        self._inflight: deque[tuple[int, Future[bytes] | bytes]] = deque()  # (block number, compressed), in order
        self._file = None  # the pack being written
        self._hash = hashlib.sha256()
        self._offset = 0
        self._slot = -1
        self._pending: list[int] = []  # blocks of the open pack (their pack name is filled in on close)

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the compression threads (what is in flight is dropped) and close the spool file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _compress(self, data: bytes) -> bytes:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=BLOCK_ZSTD_LEVEL)
        return compressor.compress(data)

    def add(self, data: bytes) -> int:
        stats = self.stats
        stats.blocks += 1
        stats.raw_bytes += len(data)
        if self.on_block is not None:
            self.on_block()
        digest = _hex(data)
        number = self._numbers.get(digest)
        if number is not None:
            stats.in_layer += 1
            return number
        if data.count(0) == len(data):
            stats.zero += 1
            return self._append(digest, Block(digest, ZERO_PACK, 0, 0, len(data)))
        found = self.table.lookup(digest)
        if found is not None and found.rlen == len(data):
            stats.in_store += 1
            return self._append(digest, Block(digest, self._pack_slot(found.pack), found.offset, found.clen, found.rlen))
        # A placeholder until the compressed bytes are written (nothing reads blocks before finish()).
        number = self._append(digest, Block(digest, ZERO_PACK, 0, 0, len(data)))
        stats.stored += 1
        stats.stored_raw += len(data)
        self._inflight.append((number, self._pool.submit(self._compress, data) if self._pool else self._compress(data)))
        self._drain(keep=2 * self._workers)
        return number

    def _drain(self, keep: int) -> None:
        """Write finished blocks in order; wait for the oldest while more than ``keep`` are in flight."""
        while self._inflight:
            number, result = self._inflight[0]
            if isinstance(result, Future):
                if len(self._inflight) <= keep and not result.done():
                    return
                result = result.result()
            self._inflight.popleft()
            self._write(number, result)

    def _write(self, number: int, compressed: bytes) -> None:
        if self._file is None:
            self._open_pack()
        assert self._file is not None
        self._file.write(compressed)
        self._hash.update(compressed)
        placeholder = self.blocks[number]
        self.blocks[number] = Block(placeholder.digest, self._slot, self._offset, len(compressed), placeholder.rlen)
        self._offset += len(compressed)
        self.stats.stored_compressed += len(compressed)
        self._pending.append(number)
        if self._offset >= self.max_pack_bytes:
            self._close_pack()

    def _append(self, digest: str, block: Block) -> int:
        self.blocks.append(block)
        number = len(self.blocks) - 1
        self._numbers[digest] = number
        return number

    def _pack_slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            self.packs.append(name)
            slot = self._slots[name] = len(self.packs) - 1
        return slot

    def _open_pack(self) -> None:
        fd, path = tempfile.mkstemp(dir=self.spool_dir, prefix="pack-")
        self._file = os.fdopen(fd, "wb")
        self._path = Path(path)
        self._hash = hashlib.sha256()
        self._offset = 0
        self.packs.append("")
        self._slot = len(self.packs) - 1

    def _close_pack(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        name = self._hash.hexdigest()
        existing = self._slots.get(name)
        if existing is not None:  # the same pack again (cannot happen with distinct blocks; be exact anyway)
            raise ConversionError(f"pack {name} written twice in one layer")
        self.packs[self._slot] = name
        self._slots[name] = self._slot
        self.spooled.append(SpooledPack(self._path, name, self._offset))
        for number in self._pending:
            b = self.blocks[number]
            self.new_blocks.append(StoredBlock(b.digest, name, b.offset, b.clen, b.rlen))
        self._pending = []

    def finish(self) -> None:
        """Write what is in flight and close the pack being written (after the last block)."""
        self._drain(keep=0)
        if self._file is not None:
            self._close_pack()

    def segment(self) -> DedupSegment | None:
        """This layer's additions to the dedup table (None if it stored no block)."""
        if not self.new_blocks:
            return None
        return DedupSegment(packs={p.sha256: p.size for p in self.spooled}, blocks=list(self.new_blocks))


# -- progress ---------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Progress:
    """Conversion progress on ``stream``: one live line on a terminal, plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, interval: float = 0.2) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.interval = interval
        self._last = 0.0
        self._label = ""
        self._stats: BlockStats | None = None
        self._blob: Callable[[], int] | None = None

    def line(self, text: str) -> None:
        if self.live:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def start_layer(self, label: str, stats: BlockStats, blob_read: Callable[[], int]) -> None:
        self._label, self._stats, self._blob = label, stats, blob_read
        if not self.live:
            self.line(f"{label}: converting")

    def tick(self) -> None:
        if not self.live or self._stats is None:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        s = self._stats
        blob = self._blob() if self._blob else 0
        self.stream.write(f"\r\033[K{self._label}: {_mib(blob)} read, {_mib(s.raw_bytes)} of files, "
                          f"{s.blocks} blocks, {s.stored} new, dedup {s.dedup_ratio:.0%}")  # fmt: skip
        self.stream.flush()


# -- conversion -------------------------------------------------------------------------------


@dataclass
class LayerResult:
    chain_id: str
    digest: str
    skipped: bool  #: already converted (the chain record verified)
    stats: BlockStats = field(default_factory=BlockStats)
    files: int = 0
    uploaded_bytes: int = 0


@dataclass
class ImageResult:
    reference: str
    layers: list[LayerResult]
    seconds: float
    puts: int
    uploaded_bytes: int

    @property
    def stats(self) -> BlockStats:
        total = BlockStats()
        for layer in self.layers:
            total += layer.stats
        return total

    def summary(self) -> str:
        s = self.stats
        converted = sum(not layer.skipped for layer in self.layers)
        return (f"{self.reference}: {len(self.layers)} layers ({converted} converted, "
                f"{len(self.layers) - converted} already in the store); {s.blocks} blocks "
                f"({_mib(s.raw_bytes)}), {s.stored} stored ({_mib(s.stored_compressed)} compressed), "
                f"{s.zero} zero, {s.in_store + s.in_layer} deduplicated, dedup ratio {s.dedup_ratio:.0%}; "
                f"{self.puts} objects uploaded ({_mib(self.uploaded_bytes)}) in {self.seconds:.1f}s")  # fmt: skip


def verify_layer(writer: StoreWriter, chain: str) -> ChainRecord | None:
    """The chain record of ``chain`` if it, its index and every pack it names are in the store, else None."""
    data = writer.get(chain_object(chain))
    if data is None:
        return None
    try:
        record = ChainRecord.decode(data, expected_chain_id=chain)
        index_data = writer.get(index_object(record.index))
        if index_data is None:
            raise FormatError(f"index {record.index} is missing")
        index = LayerIndex.decode(index_data, record=record)
        if index.diff_id != record.diff_id:
            raise FormatError(f"index {record.index} is of another layer")
        for pack in index.packs:
            if not writer.exists(pack_object(pack)):
                raise FormatError(f"pack {pack} is missing")
    except FormatError as exc:
        log.warning("converted layer fails verification; converting it again", store=writer.display_url,
                    chain_id=chain, error=str(exc))  # fmt: skip
        return None
    return record


def _put_verified(writer: StoreWriter, name: str, data: bytes) -> None:
    """Put ``data`` as ``name`` unless it is there already with those bytes; read it back to check."""
    if writer.get(name) != data:
        writer.put(name, data)
        if writer.get(name) != data:
            raise ConversionError(f"{writer.display_url}: {name} reads back different from what was written")


def _upload_pack(writer: StoreWriter, pack: SpooledPack) -> None:
    name = pack_object(pack.sha256)
    if writer.size(name) == pack.size:
        return  # content-addressed: the same name holds the same bytes
    writer.put(name, pack.path)
    size = writer.size(name)
    if size != pack.size:
        raise ConversionError(f"{writer.display_url}: pack {pack.sha256} reads back as {size} bytes, not {pack.size}")


def convert_layer(
    writer: StoreWriter,
    table: DedupTable,
    blob: BinaryIO,  # the layer blob, verified against its digest by its reader (bootseer.images.VerifiedBlob)
    *,
    chain: str,
    parent: str,
    diff_id: str,
    digest: str,
    media_type: str,
    size: int,
    block_size: int,
    compression: str | None = None,
    spool_dir: str | None = None,
    limits: TarLimits = TarLimits(),
    progress: Progress | None = None,
    label: str = "layer",
) -> LayerResult:
    """Convert one layer blob and publish it (packs, dedup segment, index, chain record last)."""
    puts_before = writer.put_bytes
    with contextlib.ExitStack() as stack:
        spool = stack.enter_context(tempfile.TemporaryDirectory(prefix="bootseer-convert-", dir=spool_dir))
        packs = stack.enter_context(PackWriter(block_size, table, Path(spool), on_block=progress.tick if progress else None))
        if progress is not None:
            progress.start_layer(label, packs.stats, lambda: getattr(blob, "bytes_read", 0))
        try:
            parsed: ParsedLayer = read_layer(blob, packs, block_size=block_size, limits=limits)
            while blob.read(1 << 20):  # the rest of the blob, so that its digest is checked
                pass
        except LayerError as exc:
            raise ConversionError(f"{label} ({digest}): refused: {exc}") from None
        if compression is not None and compression != parsed.compression:
            raise ConversionError(f"{label} ({digest}): media type {media_type} says {compression}, "
                                  f"but the blob is {parsed.compression}")  # fmt: skip
        if parsed.diff_id != diff_id:
            raise ConversionError(f"{label} ({digest}): uncompressed tar has digest {parsed.diff_id}, "
                                  f"but the image config says {diff_id}")  # fmt: skip
        packs.finish()
        index = LayerIndex(diff_id=diff_id, block_size=block_size, entries=parsed.entries,
                           blocks=packs.blocks, packs=packs.packs)  # fmt: skip
        try:
            index.validate()
        except FormatError as exc:  # a converter bug, never the input's fault
            raise ConversionError(f"{label} ({digest}): the index built is invalid: {exc}") from None
        try:
            for pack in packs.spooled:
                _upload_pack(writer, pack)
            segment = packs.segment()
            if segment is not None:
                data = segment.encode()
                _put_verified(writer, dedup_object(_hex(data)), data)
                table.add(segment)
            index_data = index.encode()
            index_name = _hex(index_data)
            _put_verified(writer, index_object(index_name), index_data)
            record = ChainRecord(
                chain_id=chain,
                parent=parent,
                diff_id=diff_id,
                digest=digest,
                media_type=media_type,
                size=size,
                index=index_name,
                block_size=block_size,
                files=len(index.entries),
                bytes=parsed.file_bytes,
                converted_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                converter=f"bootseer {__version__}",
            )
            writer.put(chain_object(chain), record.encode())  # last: this is what makes the layer visible
            back = writer.get(chain_object(chain))
            try:
                same = back is not None and ChainRecord.decode(back, expected_chain_id=chain) == record
            except FormatError:
                same = False
            if not same:
                raise ConversionError(f"{writer.display_url}: chain record {chain} reads back different from what was written")
        except ConversionError as exc:
            raise ConversionError(f"{label} ({digest}): {exc}") from None
    return LayerResult(chain_id=chain, digest=digest, skipped=False, stats=packs.stats,
                       files=len(index.entries), uploaded_bytes=writer.put_bytes - puts_before)  # fmt: skip


def check_block_size(block_size: int) -> int:
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, not {block_size}")
    return block_size


def convert_image(
    image: ImageSource,
    writer: StoreWriter,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    spool_dir: str | None = None,
    limits: TarLimits = TarLimits(),
    progress: Progress | None = None,
) -> ImageResult:
    """Convert every layer of ``image`` into ``writer``'s store, bottom up; idempotent.

    Raises ConversionError naming the layer for a refused or inconsistent layer,
    StoreError when the store fails, and :mod:`bootseer.images` errors when the image
    cannot be read.  Layers converted before the failure stay published (each one
    is complete and verified); the failed one is not.
    """
    check_block_size(block_size)
    started = time.monotonic()
    puts_before, bytes_before = writer.puts, writer.put_bytes
    resolved = image.resolve()
    layers = resolved.layers
    diff_ids = list(resolved.diff_ids)
    if len(diff_ids) != len(layers):
        raise ConversionError(f"{resolved.reference}: {len(layers)} layers but {len(diff_ids)} diff_ids in the config")
    chains = chain_ids(diff_ids)
    table: DedupTable | None = None
    results = []
    for number, (descriptor, diff_id, chain) in enumerate(zip(layers, diff_ids, chains)):
        label = f"layer {number + 1}/{len(layers)} {descriptor.digest[:19]}"
        existing = verify_layer(writer, chain)
        if existing is not None and existing.block_size == block_size:
            if progress is not None:
                progress.line(f"{label}: already in the store")
            results.append(LayerResult(chain_id=chain, digest=descriptor.digest, skipped=True, files=existing.files))
            continue
        if table is None:
            table = DedupTable.load(writer)
        compression = layer_compression(descriptor.media_type) or "none"
        with image.open_blob(descriptor) as blob:
            result = convert_layer(
                writer, table, blob,
                chain=chain, parent=chains[number - 1] if number else "", diff_id=diff_id,
                digest=descriptor.digest, media_type=descriptor.media_type, size=descriptor.size,
                block_size=block_size, compression=compression, spool_dir=spool_dir, limits=limits,
                progress=progress, label=label,
            )  # fmt: skip
        if progress is not None:
            s = result.stats
            progress.line(f"{label}: {result.files} entries, {s.blocks} blocks ({_mib(s.raw_bytes)}), "
                          f"{s.stored} stored, dedup {s.dedup_ratio:.0%}, uploaded {_mib(result.uploaded_bytes)}")  # fmt: skip
        results.append(result)
    return ImageResult(reference=resolved.reference, layers=results, seconds=time.monotonic() - started,
                       puts=writer.puts - puts_before, uploaded_bytes=writer.put_bytes - bytes_before)  # fmt: skip


__all__ = [
    "FORMAT_VERSION", "ConversionError", "DedupTable", "ImageResult", "LayerResult", "PackWriter", "Progress",
    "convert_image", "convert_layer", "verify_layer",
]
