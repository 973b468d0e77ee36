"""Convert an image into a block store: ``bootseer convert REF --store URL``.

For each layer of the image, bottom up, :func:`convert_image`:

1. skips the layer if its chain record is in the store and verifies (record, index,
   packs present, and every block the index references read back and checked, unless
   ``verify_existing`` is off): a second run uploads nothing, and a layer that cannot
   serve one of its blocks is converted again (repaired) rather than skipped;
2. streams the layer blob (verified against its digest by :mod:`bootseer.images.registry`)
   through :func:`blockstore.convert.tarlayer.read_layer`, which refuses hostile tars, and
   checks the diffID it computed against the config's;
3. cuts file contents into blocks; a block already in the store (the store-wide
   dedup table, whose place is read and checked first: :class:`BlockVerifier`) or
   earlier in this layer is referenced where it is, an all-zero block (a sparse hole)
   is stored nowhere, and every other block is zstd-compressed into this layer's pack,
   spooled to a local temp file (files in tar order, a file's blocks adjacent, so a
   run of neighbours is one range request) and named by its SHA-256 when complete;
4. uploads, in this order, the packs, the layer's dedup segment, the index, and last
   the chain record (what makes the layer visible: an interrupted conversion is never
   used), reading each back to check it: sizes of packs, hashes of the index and
   the chain record.

Memory is bounded by the block size, one record per entry and per block reference,
the dedup table (one row per block in the store), the verdicts of the places checked
and :data:`VERIFY_BATCH_BYTES` of blocks waiting to be checked, never by a layer's
size; a layer's size itself is bounded (:class:`~blockstore.convert.tarlayer.TarLimits`).
Progress goes to stderr (a live line on a terminal, plain lines otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
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
from typing import BinaryIO, Callable, Sequence, TextIO

import zstandard

from bootseer.blockstore.objects.block_table import LayerBlockTable
from bootseer.blockstore.objects.format import (
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
    LayerImage,
    LayerIndex,
    StoredBlock,
    block_table_object,
    chain_object,
    decode_block,
    dedup_object,
    image_object,
    index_object,
    max_stored_length,
    pack_object,
)
from bootseer.blockstore.objects.signing import SigningKey
from bootseer.blockstore.objects.store import StoreWriter
from bootseer.blockstore.convert.layer_image import DEFAULT_INLINE_MAX, BuiltImage, ImageBuildError, build_layer_image
from bootseer.blockstore.convert.tarlayer import LayerError, ParsedLayer, TarLimits, read_layer
from bootseer.blockstore.objects.erofs_image import WRITER_VERSION
from bootseer import __version__
from bootseer.images.chains import chain_ids
from bootseer.images.registry import ImageSource, layer_compression
from bootseer.log import get_logger

log = get_logger(__name__)

#: A pack is closed and a new one started past this many bytes (objects stay a manageable size).
MAX_PACK_BYTES = 512 << 20
#: zstd level of blocks: fast enough to keep up with a registry, most of level 19's ratio on code and text.
BLOCK_ZSTD_LEVEL = 3
#: Raw bytes of blocks found in the dedup table that wait (in memory) to have their places read and checked in one batch.
VERIFY_BATCH_BYTES = 64 << 20


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


@functools.lru_cache(maxsize=4)
def _zeros(length: int) -> bytes:
    return bytes(length)


@functools.lru_cache(maxsize=64)
def _zero_digest(length: int) -> str:
    return _hex(_zeros(length))


# -- the dedup table ----------------------------------------------------------------------


#: A range of blocks to check at least this large is decompressed and hashed on threads.
_PARALLEL_CHECK_BYTES = 4 << 20



class BlockVerifier:
    """Whether blocks in the store are what they claim: the bytes at each place are that block.

    A dedup segment is anyone's word (whoever can write to the store can add one), and
    so is a layer index once its packs may have been changed, so the converter reads
    what it references: the ``clen`` bytes at ``offset`` of the pack must decompress to
    ``rlen`` bytes (never more are decompressed) with the block's SHA-256
    (:func:`blockstore.objects.format.decode_block`, the readers' own check).  Reads are
    batched: the places asked about at once are grouped by pack and neighbours closer
    than ``max_gap`` bytes are one range read of at most ``max_read`` bytes.  Each
    place is read once; its verdict is kept for the rest of the run (a few hundred bytes
    per block).
    """

    def __init__(self, writer: StoreWriter, *, max_gap: int = 1 << 20, max_read: int = 64 << 20) -> None:
        self.writer = writer
        self.max_gap = max_gap
        self.max_read = max_read
        self.reads = 0  #: range reads made
        self.read_bytes = 0  #: bytes they returned
        self.checked = 0  #: places checked
        self._verdicts: dict[StoredBlock, bool] = {}

    def verdict(self, block: StoredBlock) -> bool | None:
        """True if ``block``'s place was read and holds it, False if it does not, None if not checked yet."""
        return self._verdicts.get(block)

    def bad(self, blocks: Sequence[StoredBlock]) -> list[StoredBlock]:
        """Those of ``blocks`` whose places do not hold them (each once), reading the places not checked yet."""
        self._read([block for block in dict.fromkeys(blocks) if block not in self._verdicts], None)
        return [block for block in dict.fromkeys(blocks) if not self._verdicts[block]]

    def raw(self, blocks: Sequence[StoredBlock]) -> dict[StoredBlock, bytes]:
        """The raw bytes of those of ``blocks`` whose places hold them (read even if checked before)."""
        out: dict[StoredBlock, bytes] = {}
        self._read(list(dict.fromkeys(blocks)), out)
        return out

    def _read(self, blocks: list[StoredBlock], keep: dict[StoredBlock, bytes] | None) -> None:
        """Read and judge ``blocks`` in runs (see the class); the raw bytes of good ones into ``keep``."""
        by_pack: dict[str, list[StoredBlock]] = {}
        for block in blocks:
            if block.clen > max_stored_length(block.rlen):
                self._verdicts[block] = False  # no block compresses that badly: not worth reading
                continue
            by_pack.setdefault(block.pack, []).append(block)
        for pack, group in by_pack.items():
            group.sort(key=lambda block: block.offset)
            run: list[StoredBlock] = []
            for block in group:
                if run and (block.offset - (run[-1].offset + run[-1].clen) > self.max_gap
                            or block.offset + block.clen - run[0].offset > self.max_read):  # fmt: skip
                    self._check(pack, run, keep)
                    run = []
                run.append(block)
            if run:
                self._check(pack, run, keep)

    def _check(self, pack: str, run: list[StoredBlock], keep: dict[StoredBlock, bytes] | None) -> None:
        """Read the range of ``pack`` that ``run`` (sorted by offset) lies in and judge each block.

        Decompressing and hashing run on threads (zstd and hashlib release the GIL)
        when the range is large enough to be worth it.
        """
        start = run[0].offset
        end = max(block.offset + block.clen for block in run)
        data = memoryview(self.writer.get_range(pack_object(pack), start, end - start) or b"")
        self.reads += 1
        self.read_bytes += len(data)
        pieces = [data[block.offset - start : block.offset - start + block.clen] for block in run]
        workers = default_workers()
        if workers > 1 and len(run) > 1 and len(data) >= _PARALLEL_CHECK_BYTES:
            with ThreadPoolExecutor(workers, thread_name_prefix="bootseer-verify") as pool:
                raws = list(pool.map(decode_block, run, pieces))  # type: ignore[arg-type]
        else:
            raws = [decode_block(block, piece) for block, piece in zip(run, pieces)]
        for block, raw in zip(run, raws):
            self._verdicts[block] = raw is not None
            if raw is not None and keep is not None:
                keep[block] = raw
        self.checked += len(run)


class DedupTable:
    """Every block already in the store, by digest: the union of the store's dedup segments.

    Segments are verified against their names; one that is not is skipped with a
    warning (its blocks are then stored again, never trusted).  Before a block is
    referenced, its pack is checked once to exist with the size the segment gives,
    and the block's place is read and checked (:meth:`verify`): a segment that names
    a place not holding its block (a mistake, or a store writer's poison) is logged
    with its name and that place forgotten; the next place another segment gives for
    the block (up to :data:`MAX_PLACES` in all) is tried, else the block is stored anew.
    """

    #: Places kept per block: the first, and a few others in case it fails (more only cost reads).
    MAX_PLACES = 4

    def __init__(self, writer: StoreWriter, verifier: BlockVerifier | None = None) -> None:
        self.writer = writer
        self.verifier = verifier if verifier is not None else BlockVerifier(writer)
        self.blocks: dict[str, tuple[StoredBlock, str]] = {}  #: digest -> (its place, the segment naming it)
        self._others: dict[str, list[tuple[StoredBlock, str]]] = {}  # digest -> further places, for blocks with several
        self.pack_sizes: dict[str, int] = {}
        self._pack_ok: dict[str, bool] = {}

    @classmethod
    def load(cls, writer: StoreWriter, verifier: BlockVerifier | None = None) -> DedupTable:
        table = cls(writer, verifier)
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
            table.add(segment, name)
        return table

    def add(self, segment: DedupSegment, name: str = "") -> None:
        """Take the places ``segment`` (named ``name``) gives; a block's first place stays first."""
        self.pack_sizes.update(segment.packs)
        for block in segment.blocks:
            if self.verifier.verdict(block) is False:
                continue  # a place already found not to hold this block
            known = self.blocks.get(block.digest)
            if known is None:
                self.blocks[block.digest] = (block, name)
            elif known[0] != block:
                others = self._others.setdefault(block.digest, [])
                if len(others) < self.MAX_PLACES - 1 and all(other != block for other, _ in others):
                    others.append((block, name))

    def lookup(self, digest: str) -> StoredBlock | None:
        """Where the block ``digest`` is said to be (its pack present, whole); not yet read: see :meth:`verify`."""
        while True:
            known = self.blocks.get(digest)
            if known is None:
                return None
            block = known[0]
            ok = self._pack_ok.get(block.pack)
            if ok is None:
                ok = self.writer.size(pack_object(block.pack)) == self.pack_sizes.get(block.pack)
                if not ok:
                    log.warning("dedup table names a pack that is missing or of the wrong size; storing its blocks again",
                                store=self.writer.display_url, pack=block.pack)  # fmt: skip
                self._pack_ok[block.pack] = ok
            if ok and self.verifier.verdict(block) is not False:
                return block
            self._forget(digest)

    def verify(self, blocks: Sequence[StoredBlock]) -> set[StoredBlock]:
        """Those of ``blocks`` (found by :meth:`lookup`) whose places do not hold them, logged and forgotten.

        :meth:`lookup` then gives the block's next place, if a segment gave another.
        """
        bad = self.verifier.bad(blocks)
        for block in bad:
            known = self.blocks.get(block.digest)
            mine = known is not None and known[0] == block
            log.warning("dedup segment names a place that does not hold its block; not referencing it",
                        store=self.writer.display_url, segment=known[1] if mine else "", block=block.digest,
                        pack=block.pack, offset=block.offset, clen=block.clen)  # fmt: skip
            if mine:
                self._forget(block.digest)
        return set(bad)

    def _forget(self, digest: str) -> None:
        """Drop the first place of ``digest``; the next one, if any, takes its turn."""
        others = self._others.get(digest)
        if others:
            self.blocks[digest] = others.pop(0)
            if not others:
                del self._others[digest]
        else:
            self.blocks.pop(digest, None)


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
    """The :class:`~blockstore.convert.tarlayer.BlockSink` of one layer: dedup, compress, spool into packs.

    Digests and dedup decisions are made in the caller's thread, in order; only
    compression runs on ``workers`` threads (zstd releases the GIL), and compressed
    blocks are written to the pack in the order they were added, so a file's blocks
    stay adjacent.  At most ``2 * workers`` blocks are in flight.  A block the dedup
    table has is referenced where it is only once its place has been read and checked
    (:meth:`DedupTable.verify`); such blocks wait, raw bytes kept, until
    ``verify_batch_bytes`` of them (or :meth:`finish`) make one batch of reads, and
    those that fail are stored in this layer's pack like new ones.  Use it as a context
    manager (or call :meth:`close`) so the threads end even when the layer fails.
    """

    def __init__(self, block_size: int, table: DedupTable, spool_dir: Path, *, max_pack_bytes: int = MAX_PACK_BYTES,
                 on_block: Callable[[], None] | None = None, workers: int | None = None,
                 verify_batch_bytes: int = VERIFY_BATCH_BYTES) -> None:  # fmt: skip
        self.block_size = block_size
        self.table = table
        self.verify_batch_bytes = verify_batch_bytes
        self._unverified: list[tuple[int, StoredBlock, bytes]] = []  # (block number, its place, raw bytes)
        self._unverified_bytes = 0
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
        if data == _zeros(len(data)):  # a memcmp, much cheaper than hashing: zero blocks are stored nowhere
            return self.add_zeros(len(data), 1)
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
        # A placeholder until the block is placed: referenced where it is, or written to
        # this layer's pack (nothing reads blocks before finish()).
        number = self._append(digest, Block(digest, ZERO_PACK, 0, 0, len(data)))
        found = self.table.lookup(digest)
        if found is not None and found.rlen == len(data):
            if self.table.verifier.verdict(found):
                self._reference(number, found)
            else:  # read and checked in a batch (see _settle), the raw bytes kept until then
                self._unverified.append((number, found, data))
                self._unverified_bytes += len(data)
                if self._unverified_bytes >= self.verify_batch_bytes:
                    self._settle()
            return number
        self._store(number, data)
        return number

    def _reference(self, number: int, found: StoredBlock) -> None:
        """Make block ``number`` the verified block ``found`` of another pack."""
        self.stats.in_store += 1
        self.blocks[number] = Block(found.digest, self._pack_slot(found.pack), found.offset, found.clen, found.rlen)

    def _store(self, number: int, data: bytes) -> None:
        """Compress block ``number`` (``data``) into this layer's pack."""
        self.stats.stored += 1
        self.stats.stored_raw += len(data)
        self._inflight.append((number, self._pool.submit(self._compress, data) if self._pool else self._compress(data)))
        self._drain(keep=2 * self._workers)

    def _settle(self) -> None:
        """Check the places of the blocks waiting to be referenced (a batch of reads); a block whose place
        fails is tried at the next place the table has for it, else stored anew."""
        pending, self._unverified, self._unverified_bytes = self._unverified, [], 0
        while pending:
            bad = self.table.verify([found for _, found, _ in pending])
            retry = []
            for number, found, data in pending:
                if found not in bad:
                    self._reference(number, found)
                    continue
                other = self.table.lookup(found.digest)
                if other is not None and other.rlen == len(data):
                    retry.append((number, other, data))
                else:
                    self._store(number, data)
            pending = retry

    def add_zeros(self, length: int, count: int) -> int:
        """``count`` all-zero blocks of ``length`` bytes (a hole, or a block of zeros): one block, stored nowhere."""
        stats = self.stats
        stats.blocks += count
        stats.raw_bytes += length * count
        if self.on_block is not None:
            self.on_block()
        digest = _zero_digest(length)
        number = self._numbers.get(digest)
        if number is not None:
            stats.in_layer += count
            return number
        stats.zero += 1
        stats.in_layer += count - 1
        return self._append(digest, Block(digest, ZERO_PACK, 0, 0, length))

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
        """Place the blocks waiting for verification, write what is in flight and close the pack (after the last block)."""
        self._settle()
        self._drain(keep=0)
        if self._file is not None:
            self._close_pack()
        self._number_packs_in_block_order()

    def _number_packs_in_block_order(self) -> None:
        """Number :attr:`packs` by their first block, so the index does not depend on timing.

        A pack gets its slot when it is first needed: this layer's own when the first
        compressed block is written, another layer's when a reference to it is verified;
        which comes first depends on the compression threads, and the same layer would
        otherwise give indexes that differ (and so two digests) from one run to the next.
        """
        order: dict[int, int] = {}
        for block in self.blocks:
            if block.pack != ZERO_PACK and block.pack not in order:
                order[block.pack] = len(order)
        if len(order) != len(self.packs):
            raise ConversionError(f"{len(self.packs) - len(order)} pack(s) of the layer hold none of its blocks")
        if all(old == new for old, new in order.items()):
            return
        self.blocks = [b if b.pack == ZERO_PACK else Block(b.digest, order[b.pack], b.offset, b.clen, b.rlen)
                       for b in self.blocks]  # fmt: skip
        packs = [""] * len(self.packs)
        for old, new in order.items():
            packs[new] = self.packs[old]
        self.packs = packs
        self._slots = {name: slot for slot, name in enumerate(packs)}

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
    image: BuiltImage | None = None  #: the layer's EROFS image, when this run built one
    image_note: str = ""  #: why a layer already converted kept its record as it was (no image added)


@dataclass
class ImageResult:
    reference: str
    layers: list[LayerResult]
    seconds: float
    puts: int
    uploaded_bytes: int
    checked_blocks: int = 0  #: blocks already in the store read back and checked (dedup references, existing layers)
    checked_bytes: int = 0  #: bytes read to check them

    @property
    def stats(self) -> BlockStats:
        total = BlockStats()
        for layer in self.layers:
            total += layer.stats
        return total

    def summary(self) -> str:
        s = self.stats
        converted = sum(not layer.skipped for layer in self.layers)
        added = sum(layer.skipped and layer.image is not None for layer in self.layers)
        return (f"{self.reference}: {len(self.layers)} layers ({converted} converted, "
                f"{len(self.layers) - converted} already in the store"
                f"{f', {added} of them given their EROFS image' if added else ''}); {s.blocks} blocks "
                f"({_mib(s.raw_bytes)}), {s.stored} stored ({_mib(s.stored_compressed)} compressed), "
                f"{s.zero} zero, {s.in_store + s.in_layer} deduplicated, dedup ratio {s.dedup_ratio:.0%}; "
                f"{self.checked_blocks} blocks in the store checked ({_mib(self.checked_bytes)} read); "
                f"{self.puts} objects uploaded ({_mib(self.uploaded_bytes)}) in {self.seconds:.1f}s")  # fmt: skip


#: Blocks of an existing layer's index checked per batch (bounds what one batch holds in memory).
_VERIFY_INDEX_BATCH = 16384


def verify_layer(writer: StoreWriter, chain: str, *, blocks: BlockVerifier | None = None) -> ChainRecord | None:
    """The chain record of ``chain`` if it, its index and every pack it names are in the store, else None.

    With ``blocks``, also every block the index references must be at its place
    (read and checked, :class:`BlockVerifier`): a layer that references a block it
    cannot serve (a poisoned dedup segment, a damaged pack) is not converted.
    """
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
        # The table is the index's blocks, encoded: the one the index makes, or it is missing or wrong.
        if record.block_table and writer.get(block_table_object(record.block_table)) != \
                LayerBlockTable.of_index(index, record.index).encode():
            raise FormatError(f"block table {record.block_table} is missing or is not its index's")
        if blocks is not None:
            stored = [block for block in index.blocks if not block.is_zero]
            for start in range(0, len(stored), _VERIFY_INDEX_BATCH):
                places = [StoredBlock(b.digest, index.packs[b.pack], b.offset, b.clen, b.rlen)
                          for b in stored[start : start + _VERIFY_INDEX_BATCH]]  # fmt: skip
                bad = blocks.bad(places)
                if bad:
                    raise FormatError(f"block sha256:{bad[0].digest} is not at offset {bad[0].offset} of pack "
                                      f"{bad[0].pack} ({len(bad)} such blocks in the first {start + len(places)})")  # fmt: skip
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


def _upload_new(writer: StoreWriter, table: DedupTable, packs: PackWriter) -> None:
    """Upload ``packs``' spooled packs, then its dedup segment (and add it to ``table``)."""
    for pack in packs.spooled:
        _upload_pack(writer, pack)
    segment = packs.segment()
    if segment is not None:
        data = segment.encode()
        _put_verified(writer, dedup_object(_hex(data)), data)
        table.add(segment)


def publish_image(writer: StoreWriter, table: DedupTable, index: LayerIndex, index_name: str, *, spool: Path,
                  inline_max: int = DEFAULT_INLINE_MAX) -> tuple[str, BuiltImage]:  # fmt: skip
    """Build the EROFS image of ``index`` (stored as ``index_name``, its packs in the store) and store it.

    The image (:mod:`~bootseer.blockstore.convert.layer_image`) is cut into blocks of
    the index's block size, deduplicated and compressed as file contents are, into
    packs of its own, with their dedup segment; then its :class:`LayerImage` table, read
    back and checked.  Returns the table's name (what the chain record's ``image`` says) and
    the image.  Blocks already in the store are never uploaded again, so publishing the same
    image twice uploads only what is missing.  ConversionError when it cannot be built.
    """
    block_size = index.block_size
    inline_max = min(inline_max, block_size)  # a file inline is one block of the layer
    verifier = table.verifier
    try:
        built = build_layer_image(index, spool / "image.erofs", packs=index.packs, inline_max=inline_max,
                                  read_blocks=verifier.raw)  # fmt: skip
    except ImageBuildError as exc:
        raise ConversionError(f"its EROFS image: {exc}") from None
    numbers: list[int] = []
    with PackWriter(block_size, table, spool) as packs, open(built.path, "rb") as image:
        while piece := image.read(block_size):
            numbers.append(packs.add(piece))
        packs.finish()
    _upload_new(writer, table, packs)
    stored = LayerImage(diff_id=index.diff_id, index=index_name, sha256=built.sha256, size=built.size,
                        block_size=block_size, inline_max=inline_max, writer=WRITER_VERSION,
                        blocks=[packs.blocks[number] for number in numbers], packs=list(packs.packs),
                        blob_size=index.blob_size)  # fmt: skip
    data = stored.encode()
    name = _hex(data)
    _put_verified(writer, image_object(name), data)
    built.path.unlink()
    return name, built


def publish_block_table(writer: StoreWriter, index: LayerIndex, index_name: str) -> str:
    """Store the binary block table of ``index`` (stored as ``index_name``: :mod:`~.objects.block_table`), read back
    and checked; its name (what the chain record's ``block_table`` says)."""
    data = LayerBlockTable.of_index(index, index_name).encode()
    name = _hex(data)
    _put_verified(writer, block_table_object(name), data)
    return name


def _verify_image(writer: StoreWriter, record: ChainRecord, blocks: BlockVerifier | None) -> str:
    """Why the image ``record`` names cannot serve (its table missing or wrong, a pack or block missing), or ""."""
    try:
        data = writer.get(image_object(record.image))
        if data is None:
            return f"its image table {record.image} is missing"
        image = LayerImage.decode(data, record=record)
        for pack in image.packs:
            if not writer.exists(pack_object(pack)):
                return f"pack {pack} of its image is missing"
        if blocks is not None:
            bad = blocks.bad([StoredBlock(b.digest, image.packs[b.pack], b.offset, b.clen, b.rlen)
                              for b in image.blocks if not b.is_zero])  # fmt: skip
            if bad:
                return f"block sha256:{bad[0].digest} of its image is not at its place"
    except FormatError as exc:
        return str(exc)
    return ""


def add_image(writer: StoreWriter, table: DedupTable, record: ChainRecord, *, spool_dir: str | None = None,
              inline_max: int = DEFAULT_INLINE_MAX, sign_key: SigningKey | None = None) -> tuple[ChainRecord, BuiltImage]:  # fmt: skip
    """Give the converted layer of ``record`` (checked by :func:`verify_layer`) its EROFS image and block table
    and rewrite its record naming them (signed with ``sign_key``), uploading no block of the layer again."""
    index = LayerIndex.decode(writer.get(index_object(record.index)) or b"", record=record)
    with tempfile.TemporaryDirectory(prefix="bootseer-convert-", dir=spool_dir) as spool:
        name, built = publish_image(writer, table, index, record.index, spool=Path(spool), inline_max=inline_max)
    blocks = record.block_table or publish_block_table(writer, index, record.index)
    updated = dataclasses.replace(record, image=name, block_table=blocks, signatures=(), signed=None)
    if sign_key is not None:
        updated = updated.sign(sign_key)
    _put_record(writer, updated)
    return updated, built


def add_block_table(writer: StoreWriter, record: ChainRecord, *, sign_key: SigningKey | None = None) -> ChainRecord:
    """Give the converted layer of ``record`` (checked by :func:`verify_layer`), converted before block tables, its
    block table and rewrite its record naming it (signed with ``sign_key``)."""
    index = LayerIndex.decode(writer.get(index_object(record.index)) or b"", record=record)
    updated = dataclasses.replace(record, block_table=publish_block_table(writer, index, record.index), signatures=(),
                                  signed=None)  # fmt: skip
    if sign_key is not None:
        updated = updated.sign(sign_key)
    _put_record(writer, updated)
    return updated


def _put_record(writer: StoreWriter, record: ChainRecord) -> None:
    """Write ``record`` (what makes a layer visible, so always last) and read it back to check it."""
    chain = record.chain_id
    writer.put(chain_object(chain), record.encode())
    back = writer.get(chain_object(chain))
    try:
        stored = ChainRecord.decode(back, expected_chain_id=chain) if back is not None else None
        same = stored == record and stored is not None and stored.signatures == record.signatures
    except FormatError:
        same = False
    if not same:
        raise ConversionError(f"{writer.display_url}: chain record {chain} reads back different from what was written")


def convert_layer(
    writer: StoreWriter,
    table: DedupTable,
    blob: BinaryIO,  # the layer blob, verified against its digest by its reader (bootseer.images.registry.VerifiedBlob)
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
    sign_key: SigningKey | None = None,
    inline_max: int | None = DEFAULT_INLINE_MAX,
) -> LayerResult:
    """Convert one layer blob and publish it (packs, dedup segment, index, its EROFS image, chain record last).

    With ``sign_key`` the chain record carries its signature: it names the index, the
    image and the block table by SHA-256, which name every block, so the one signature vouches
    for the whole layer.  ``inline_max`` None publishes no image (a node then builds one from the
    index) and no block table (what a node that mounts the image reads instead of the index).
    """
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
            _upload_new(writer, table, packs)
            index_data = index.encode()
            index_name = _hex(index_data)
            _put_verified(writer, index_object(index_name), index_data)
            # The block table serves the nodes that mount the image (they need no file list): with the image only.
            table_name = publish_block_table(writer, index, index_name) if inline_max is not None else ""
            image_name, built = "", None
            if inline_max is not None:
                try:
                    image_name, built = publish_image(writer, table, index, index_name, spool=Path(spool),
                                                      inline_max=inline_max)  # fmt: skip
                except ConversionError as exc:
                    raise ConversionError(f"{label} ({digest}): {exc}") from None
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
                image=image_name,
                block_table=table_name,
            )
            if sign_key is not None:
                record = record.sign(sign_key)
            _put_record(writer, record)  # last: this is what makes the layer visible
        except ConversionError as exc:
            raise ConversionError(f"{label} ({digest}): {exc}") from None
    return LayerResult(chain_id=chain, digest=digest, skipped=False, stats=packs.stats, files=len(index.entries),
                       uploaded_bytes=writer.put_bytes - puts_before, image=built)  # fmt: skip


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
    verify_existing: bool = True,
    sign_key: SigningKey | None = None,
    inline_max: int | None = DEFAULT_INLINE_MAX,
) -> ImageResult:
    """Convert every layer of ``image`` into ``writer``'s store, bottom up; idempotent.

    A layer already converted is skipped if its record, index and packs are there
    and (``verify_existing``, the default) every block its index references reads
    back as that block; else it is converted again and its record rewritten (a
    repair: blocks that do not verify are stored anew).

    Raises ConversionError naming the layer for a refused or inconsistent layer,
    StoreError when the store fails, and :mod:`bootseer.images.registry` errors when the image
    cannot be read.  Layers converted before the failure stay published (each one
    is complete and verified); the failed one is not.

    With ``sign_key``, a layer already in the store is skipped only if ``sign_key``
    signed its record: any other is converted again from its blob, since a signature
    vouches for what this converter made from the tar, never for an index it only found.

    Every layer gets its EROFS image (:func:`publish_image`; ``inline_max`` None: none).  A
    layer already converted without one (an older conversion), or whose image does not
    verify, gets it added and its record rewritten, uploading none of its blocks again;
    unless its record is signed and no ``sign_key`` is given (rewriting it would drop the
    signature): that is reported, and the record left as it is.
    """
    check_block_size(block_size)
    verifier = BlockVerifier(writer)
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
        existing = verify_layer(writer, chain, blocks=verifier if verify_existing else None)
        signed = sign_key is None or (existing is not None and existing.signature_check().signer([sign_key.public]))
        if existing is not None and existing.block_size == block_size and signed:
            result = LayerResult(chain_id=chain, digest=descriptor.digest, skipped=True, files=existing.files)
            missing = "" if inline_max is None else (
                "it has none" if not existing.image else _verify_image(writer, existing, verifier if verify_existing else None))
            if missing and existing.signatures and sign_key is None:
                result.image_note = f"no image added ({missing}): its record is signed and no signing key was given"
            elif missing:
                if table is None:
                    table = DedupTable.load(writer, verifier)
                before = writer.put_bytes
                try:
                    _record, result.image = add_image(writer, table, existing, spool_dir=spool_dir,
                                                      inline_max=inline_max, sign_key=sign_key)  # fmt: skip
                except (ConversionError, FormatError) as exc:
                    raise ConversionError(f"{label} ({descriptor.digest}): {exc}") from None
                result.uploaded_bytes = writer.put_bytes - before
            elif inline_max is not None and not existing.block_table and not (existing.signatures and sign_key is None):
                add_block_table(writer, existing, sign_key=sign_key)  # an image from before block tables
            if progress is not None:
                if result.image is not None:
                    progress.line(f"{label}: already in the store; its EROFS image added ({_mib(result.image.size)}, "
                                  f"{result.image.inline_files} small files inline), uploaded {_mib(result.uploaded_bytes)}")  # fmt: skip
                else:
                    progress.line(f"{label}: already in the store{'; ' + result.image_note if result.image_note else ''}")
            results.append(result)
            continue
        if table is None:
            table = DedupTable.load(writer, verifier)
        compression = layer_compression(descriptor.media_type) or "none"
        with image.open_blob(descriptor) as blob:
            result = convert_layer(
                writer, table, blob,
                chain=chain, parent=chains[number - 1] if number else "", diff_id=diff_id,
                digest=descriptor.digest, media_type=descriptor.media_type, size=descriptor.size,
                block_size=block_size, compression=compression, spool_dir=spool_dir, limits=limits,
                progress=progress, label=label, sign_key=sign_key, inline_max=inline_max,
            )  # fmt: skip
        if progress is not None:
            s = result.stats
            made = "" if result.image is None else (f", EROFS image {_mib(result.image.size)} "
                                                     f"({result.image.inline_files} small files inline)")  # fmt: skip
            progress.line(f"{label}: {result.files} entries, {s.blocks} blocks ({_mib(s.raw_bytes)}), "
                          f"{s.stored} stored, dedup {s.dedup_ratio:.0%}{made}, uploaded {_mib(result.uploaded_bytes)}")  # fmt: skip
        results.append(result)
    return ImageResult(reference=resolved.reference, layers=results, seconds=time.monotonic() - started,
                       puts=writer.puts - puts_before, uploaded_bytes=writer.put_bytes - bytes_before,
                       checked_blocks=verifier.checked, checked_bytes=verifier.read_bytes)  # fmt: skip


__all__ = [
    "FORMAT_VERSION", "ConversionError", "DedupTable", "ImageResult", "LayerResult", "PackWriter", "Progress",
    "add_block_table", "add_image", "convert_image", "convert_layer", "publish_image", "verify_layer",
]
