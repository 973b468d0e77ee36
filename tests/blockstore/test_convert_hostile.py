"""``bootseer convert`` against what a hostile tar or a hostile store writer can do (issue 14, items 5 and 6).

* Sparse bombs: a tiny tar claiming a huge sparse file is refused at once with the
  limit named (``--max-layer-size``); holes cost O(runs) in every sparse flavour the
  converter reads (GNU old, PAX 0.0/0.1/1.0); a large sparse file within the limit
  converts and reads back, through the real block reader, as the tar says.
* Dedup poisoning: a dedup segment naming another block's place is checked before it
  is referenced (the block is stored anew, the segment named in a warning), so the
  layer serves the right bytes; a store already holding a layer that references a
  block it cannot serve is repaired by converting again; an honest re-conversion
  checks the blocks it trusts in a few coalesced range reads.

Conversions run through the real converter into real file stores; reads go through
:class:`blockstore.node.layer_reader.LayerReader` over the store's fetch engine, as a node reads.
"""

from __future__ import annotations

import hashlib
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from bootseer.blockstore.convert.converter import ConversionError, DedupTable, PackWriter, convert_image, verify_layer
from bootseer.blockstore.objects.format import (
    Block,
    ChainRecord,
    DedupSegment,
    LayerIndex,
    StoredBlock,
    chain_object,
    dedup_object,
    index_object,
    pack_object,
)
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.layer_reader import LayerReader
from bootseer.blockstore.objects.store import FileStoreWriter, open_store
from bootseer.blockstore.convert.tarlayer import LayerError, TarLimits, read_layer
from bootseer.fetch.engine import EngineConfig
from bootseer.fetch.stripes import FetchError
from bootseer.images.registry import open_image
from tests.support import layers as L
from tests.support.autojump import FAULT_AUTOJUMP, run
from tests.support.oci import blob_data, build_oci_layout, chain_ids

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
BLOCK = MiB
#: A hang guard for conversions run as a subprocess: far beyond what any of them needs, never a speed claim.
HANG_GUARD = 600


def convert(ref: str, store: Path, **kwargs):
    writer = FileStoreWriter(store)
    with open_image(ref) as image:
        return convert_image(image, writer, **kwargs)


def convert_cli(ref: str, store: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "bootseer.cli", "convert", ref, "--store", str(store), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_GUARD)


def load_index(store: Path, chain: str) -> tuple[ChainRecord, LayerIndex]:
    writer = FileStoreWriter(store)
    record = verify_layer(writer, chain)
    assert record is not None, f"chain {chain} is not in the store"
    return record, LayerIndex.decode(writer.get(index_object(record.index)), expected_sha256=record.index)


def read_through_reader(store: Path, chain: str, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """``(offset, size)`` ranges of file ``path`` of layer ``chain``, read as a node reads them (LayerReader)."""

    async def main() -> list[bytes]:
        async with open_store(str(store), EngineConfig(retry_timeout=2.0)) as reader:
            record = await reader.chain(chain)
            assert record is not None
            index = await reader.index(record)
            entry = next(e for e in index.entries if e.path == path)
            layer = LayerReader(index, BlockFetcher(reader.engine, None), chain)
            return [await layer.read(entry, offset, size) for offset, size in ranges]

    return run(main, autojump=FAULT_AUTOJUMP)


# -- sparse bombs -------------------------------------------------------------------------------


def test_a_tiny_tar_claiming_a_1_tib_sparse_file_is_refused_naming_the_limit(tmp_path):
    """The issue's bomb: a PAX 1.0 sparse file of 1 TiB in a few KB of gzip; f793715 ran at 100% CPU for ever."""
    bomb = L.pax_sparse("srv/bomb.img", TiB, [(0, b"x" * 4096), (TiB - 4096, b"y" * 4096)])
    image = build_oci_layout(tmp_path / "img", [L.Layer((L.File("ok", b"fine"), bomb))], compression="gzip")
    assert image.layer_sizes[0] < 10_000
    store = tmp_path / "store"
    done = convert_cli(image.ref, store)
    assert done.returncode == 1, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("bootseer convert:")]
    assert len(error) == 1, done.stderr
    assert "entry 'srv/bomb.img'" in error[0] and f"claims {TiB} bytes" in error[0]
    assert f"layer limit of {64 * GiB} bytes (--max-layer-size)" in error[0]
    assert not (store / "v1" / "chains").exists()


def test_a_layer_limit_counts_every_file_and_the_block_references(tmp_path):
    """Two files under the limit each, over it together; and the cap on block references at small blocks."""
    two = L.Layer((L.pax_sparse("a", 40 * GiB, [(0, b"a")]), L.pax_sparse("b", 40 * GiB, [(0, b"b")])))
    image = build_oci_layout(tmp_path / "two", [two], compression="zstd")
    with pytest.raises(ConversionError, match=r"entry 'b': claims 42949672960 bytes .*takes the layer's files to 85899345920"):
        convert(image.ref, tmp_path / "store")
    many = L.Layer((L.pax_sparse("small-blocks", 32 * GiB, [(0, b"c")]),))
    image = build_oci_layout(tmp_path / "many", [many], compression="zstd")
    with pytest.raises(ConversionError, match=r"entry 'small-blocks': .*8388608 blocks of 4096 bytes, over the limit of 4194304"):
        convert(image.ref, tmp_path / "store", block_size=4096)


def test_an_uncompressed_tar_larger_than_the_limit_is_refused(tmp_path):
    """A zstd blob of a few KB standing for gigabytes of tar (zeros after the end marker) is not hashed to the end."""
    tar = L.layer_tar(L.Layer((L.File("x", b"x"),)))
    compressor = zstandard.ZstdCompressor(level=3).compressobj()
    blob = compressor.compress(tar)
    for _ in range(32):
        blob += compressor.compress(bytes(16 * MiB))  # 512 MiB of padding in all
    blob += compressor.flush()
    assert len(blob) < 100_000

    class Sink:
        def add(self, data: bytes) -> int:
            return 0

        def add_zeros(self, length: int, count: int) -> int:
            return 0

    with pytest.raises(LayerError, match=r"uncompressed tar is larger than the layer limit of 67108864 bytes"):
        read_layer(io.BytesIO(blob), Sink(), block_size=BLOCK, limits=TarLimits(max_layer_bytes=64 * MiB))


class BoundedSink:
    """A block sink that keeps what it is given and fails once it is handed more than ``max_bytes`` (holes included)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.blocks: list[tuple[int, bytes | None]] = []  # (length, data or None for zeros)
        self.bytes_given = 0

    def add(self, data: bytes) -> int:
        self.bytes_given += len(data)
        assert self.bytes_given <= self.max_bytes, f"the sink was handed {self.bytes_given} bytes: holes are being read"
        self.blocks.append((len(data), data))
        return len(self.blocks) - 1

    def add_zeros(self, length: int, count: int) -> int:
        self.blocks.append((length, None))
        return len(self.blocks) - 1

    def contents(self, refs: tuple[int, ...], offset: int, size: int) -> bytes:
        out = bytearray()
        position = 0
        for ref in refs:
            length, data = self.blocks[ref]
            if position + length > offset and position < offset + size:
                out += data if data is not None else bytes(length)
            position += length
            if position >= offset + size:
                break
        first = offset - (offset // BLOCK) * BLOCK
        return bytes(out[first : first + size])


#: A 7 GiB file (the old GNU header's size field holds less than 8 GiB): data at its start, across a block
#: boundary in the middle, and near its end, with holes of thousands of blocks between.
SIZE = 7 * GiB - 12345
RUNS = ((100, b"head" * 300), (3 * GiB - 700, blob_data(1500)), (SIZE - 5000, b"tail" * 1000))


@pytest.mark.parametrize("flavour", ["gnu", "0.0", "0.1", "1.0"])
def test_holes_cost_runs_not_size_in_every_sparse_flavour(flavour):
    """Only blocks that hold data reach the sink: hole blocks come as zero blocks, never as bytes to hash."""
    if flavour == "gnu":
        entry: L.Entry = L.Sparse("s.img", SIZE, RUNS)
    else:
        entry = L.pax_sparse("s.img", SIZE, list(RUNS), version=flavour)
    sink = BoundedSink(max_bytes=4 * BLOCK)  # the data lies in 4 blocks
    parsed = read_layer(io.BytesIO(L.layer_tar(L.Layer((entry,), add_parents=False))), sink, block_size=BLOCK)
    (file,) = [e for e in parsed.entries if e.path == "s.img"]
    assert file.size == SIZE and len(file.blocks) == -(-SIZE // BLOCK)
    assert sum(1 for ref in file.blocks if sink.blocks[ref][1] is not None) == 4
    for offset, data in RUNS:
        around = max(0, offset - 10)
        got = sink.contents(file.blocks, around, len(data) + 20)
        assert got == bytes(offset - around) + data + bytes(len(got) - len(data) - (offset - around))
    assert parsed.file_bytes == SIZE


def test_a_sparse_map_holding_more_data_than_the_member_stores_is_refused():
    """Reading such runs would read the next header as file data."""
    member = L.pax_sparse("s", 10 * MiB, [(0, b"a" * 600)])
    liar = L.RawBytes(member.data.replace(b"\n600\n", b"\n900000\n", 1), path="s")
    sink = BoundedSink(max_bytes=BLOCK)
    with pytest.raises(LayerError, match=r"entry 's': sparse map holds 900000 bytes of data, but the tar stores only 1024"):
        read_layer(io.BytesIO(L.layer_tar(L.Layer((liar, L.File("next", b"n")), add_parents=False))), sink,
                   block_size=BLOCK)  # fmt: skip


def test_an_8_gib_sparse_file_at_the_limit_converts_and_reads_back_through_the_reader(tmp_path):
    """``--max-layer-size 8G`` admits exactly 8 GiB of files; the layer serves the runs' bytes and zeros between."""
    runs = [(0, b"first block"), (3 * GiB + BLOCK - 5, blob_data(4096)), (8 * GiB - 3 * BLOCK - 8, b"end" * 3000)]
    layer = L.Layer((L.pax_sparse("data/disk.img", 8 * GiB, runs),))
    image = build_oci_layout(tmp_path / "img", [layer], compression="gzip")
    store = tmp_path / "store"
    done = convert_cli(image.ref, store, "--max-layer-size", "8G")
    assert done.returncode == 0, done.stderr
    chain = chain_ids(image.diff_ids)[0]
    _, index = load_index(store, chain)
    (disk,) = [e for e in index.entries if e.path == "data/disk.img"]
    assert disk.size == 8 * GiB and len(disk.blocks) == 8 * GiB // BLOCK
    assert sum(1 for ref in disk.blocks if not index.blocks[ref].is_zero) == 5  # the second and third runs span two blocks each
    ranges = [(max(0, offset - 100), len(data) + 200) for offset, data in runs] + [(5 * GiB, 2 * BLOCK), (8 * GiB - 10, 100)]
    got = read_through_reader(store, chain, "data/disk.img", ranges)
    for (offset, data), (start, _), read in zip(runs, ranges, got):
        assert read == bytes(offset - start) + data + bytes(len(read) - len(data) - (offset - start))
    assert got[-2] == bytes(2 * BLOCK) and got[-1] == bytes(10)
    over = convert_cli(image.ref, tmp_path / "other", "--max-layer-size", f"{8 * GiB - 1}")
    assert over.returncode == 1 and "entry 'data/disk.img'" in over.stderr and "--max-layer-size" in over.stderr


# -- dedup poisoning --------------------------------------------------------------------------


P_DATA, Q_DATA, X_DATA = blob_data(BLOCK), blob_data(2 * BLOCK)[BLOCK:], bytes(reversed(blob_data(BLOCK)))


def _poisoned_images(tmp_path: Path):
    """Image A (blocks P, Q) and image B (X, then B's own tail); X is in neither A nor the store."""
    a = build_oci_layout(tmp_path / "a", [L.Layer((L.File("a.bin", P_DATA + Q_DATA),))])
    b = build_oci_layout(tmp_path / "b", [L.Layer((L.File("b.bin", X_DATA + b"tail of b"),))])
    return a, b


def _place_of(store: Path, chain: str, data: bytes) -> StoredBlock:
    _, index = load_index(store, chain)
    digest = hashlib.sha256(data).hexdigest()
    block = next(b for b in index.blocks if b.digest == digest)
    return StoredBlock(digest, index.packs[block.pack], block.offset, block.clen, block.rlen)


def _put_segment(store: Path, segment: DedupSegment) -> str:
    data = segment.encode()
    name = dedup_object(hashlib.sha256(data).hexdigest())
    FileStoreWriter(store).put(name, data)
    return name


def test_a_poisoned_dedup_segment_is_checked_and_the_block_stored_anew(tmp_path, caplog):
    """A segment saying X lies where P lies: B's conversion reads that place, stores X itself and serves it."""
    a, b = _poisoned_images(tmp_path)
    store = tmp_path / "store"
    convert(a.ref, store)
    p = _place_of(store, chain_ids(a.diff_ids)[0], P_DATA)
    x_digest = hashlib.sha256(X_DATA).hexdigest()
    poison = _put_segment(store, DedupSegment(packs={p.pack: (store / pack_object(p.pack)).stat().st_size},
                                              blocks=[StoredBlock(x_digest, p.pack, p.offset, p.clen, BLOCK)]))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="bootseer.blockstore.convert.converter"):
        result = convert(b.ref, store)
    stats = result.layers[0].stats
    assert (stats.in_store, stats.stored) == (0, 2)  # X stored anew (and B's tail)
    chain = chain_ids(b.diff_ids)[0]
    _, index = load_index(store, chain)
    x_block = next(blk for blk in index.blocks if blk.digest == x_digest)
    assert index.packs[x_block.pack] != p.pack
    (read,) = read_through_reader(store, chain, "b.bin", [(0, BLOCK + 100)])
    assert read == X_DATA + b"tail of b"
    warned = [r for r in caplog.records if "does not hold its block" in r.getMessage()]
    assert len(warned) == 1 and warned[0].fields["segment"] == poison and warned[0].fields["block"] == x_digest
    # The table now knows X's true place: a third image with X references it, read once more and checked.
    c = build_oci_layout(tmp_path / "c", [L.Layer((L.File("c.bin", X_DATA),))])
    again = convert(c.ref, store)
    assert (again.layers[0].stats.in_store, again.layers[0].stats.stored) == (1, 0)


def _poison_layer(store: Path, chain: str, victim: StoredBlock, digest: str) -> str:
    """Rewrite ``chain``'s index as a converter trusting a poisoned segment wrote it: block ``digest`` at ``victim``'s place."""
    writer = FileStoreWriter(store)
    record, index = load_index(store, chain)
    packs = list(index.packs)
    if victim.pack not in packs:
        packs.append(victim.pack)
    blocks = [Block(blk.digest, packs.index(victim.pack), victim.offset, victim.clen, blk.rlen) if blk.digest == digest
              else blk for blk in index.blocks]  # fmt: skip
    poisoned = LayerIndex(diff_id=index.diff_id, block_size=index.block_size, entries=index.entries, blocks=blocks, packs=packs)
    data = poisoned.encode()
    name = hashlib.sha256(data).hexdigest()
    writer.put(index_object(name), data)
    fields = {**record.__dict__, "index": name}
    writer.put(chain_object(chain), ChainRecord(**fields).encode())
    return name


def test_converting_again_repairs_a_layer_whose_blocks_do_not_verify(tmp_path):
    """A store already holding B with X pointing at P's place (EIO for ever): converting B again repairs it."""
    a, b = _poisoned_images(tmp_path)
    store = tmp_path / "store"
    convert(a.ref, store)
    convert(b.ref, store)
    chain = chain_ids(b.diff_ids)[0]
    poisoned = _poison_layer(store, chain, _place_of(store, chain_ids(a.diff_ids)[0], P_DATA),
                             hashlib.sha256(X_DATA).hexdigest())  # fmt: skip
    with pytest.raises(FetchError):
        read_through_reader(store, chain, "b.bin", [(0, 100)])
    result = convert(b.ref, store)
    assert not result.layers[0].skipped
    record, _ = load_index(store, chain)
    assert record.index != poisoned
    (read,) = read_through_reader(store, chain, "b.bin", [(0, BLOCK + 100)])
    assert read == X_DATA + b"tail of b"
    assert convert(b.ref, store).layers[0].skipped  # repaired: the next run finds every block in place


def test_an_existing_layer_is_trusted_without_reading_its_blocks_only_when_asked(tmp_path):
    """``--no-verify-existing``: the old quick check (record, index, packs present) and nothing read.

    (Without images: a poisoned index no longer matches the image the record names, which a
    rerun repairs by adding one, reading the small files' blocks: tested with the images.)"""
    a, b = _poisoned_images(tmp_path)
    store = tmp_path / "store"
    convert(a.ref, store, inline_max=None)
    convert(b.ref, store, inline_max=None)
    chain = chain_ids(b.diff_ids)[0]
    _poison_layer(store, chain, _place_of(store, chain_ids(a.diff_ids)[0], P_DATA), hashlib.sha256(X_DATA).hexdigest())
    quick = convert(b.ref, store, verify_existing=False, inline_max=None)
    assert quick.layers[0].skipped and quick.checked_blocks == 0
    flagged = convert_cli(b.ref, store, "--no-verify-existing", "--no-image")
    assert flagged.returncode == 0 and "(0 converted, 1 already in the store)" in flagged.stdout
    done = convert_cli(b.ref, store, "--no-image")
    assert done.returncode == 0 and "(1 converted, 0 already in the store)" in done.stdout


class CountingStore(FileStoreWriter):
    """A file store that counts the range reads the converter makes to check blocks."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.ranges: list[tuple[str, int, int]] = []

    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        self.ranges.append((name, offset, length))
        return super().get_range(name, offset, length)


def test_an_honest_reconversion_checks_its_blocks_in_coalesced_reads(tmp_path):
    """40 blocks in one pack: one range read checks them all, on a re-run and when another image shares them.

    (Layers without EROFS images: an image's blocks are one more pack, checked the same way.)"""
    small = 64 << 10
    data = b"".join(blob_data(small)[n:] + bytes(n) for n in range(1, 41))
    image = build_oci_layout(tmp_path / "img", [L.Layer((L.File("big.bin", data),))])
    store = tmp_path / "store"
    convert(image.ref, store, block_size=small, inline_max=None)
    (pack,) = (store / "v1" / "packs").iterdir()
    writer = CountingStore(store)
    with open_image(image.ref) as source:
        again = convert_image(source, writer, block_size=small, inline_max=None)
    assert again.layers[0].skipped and writer.puts == 0
    assert writer.ranges == [(pack_object(pack.name), 0, pack.stat().st_size)]
    assert again.checked_blocks == 40 and again.checked_bytes == pack.stat().st_size
    other = build_oci_layout(tmp_path / "other", [L.Layer((L.File("copy.bin", data + b"!"),))])
    writer = CountingStore(store)
    with open_image(other.ref) as source:
        shared = convert_image(source, writer, block_size=small, inline_max=None)
    assert shared.layers[0].stats.in_store == 40 and len(writer.ranges) == 1


def test_a_dedup_row_claiming_an_impossible_length_is_not_read(tmp_path):
    """A row whose compressed length no block of its size can have is refused without reading it."""
    a, b = _poisoned_images(tmp_path)
    store = tmp_path / "store"
    convert(a.ref, store)
    p = _place_of(store, chain_ids(a.diff_ids)[0], P_DATA)
    size = (store / pack_object(p.pack)).stat().st_size
    table = DedupTable(CountingStore(store))
    table.add(DedupSegment(packs={p.pack: size}, blocks=[StoredBlock("e" * 64, p.pack, 0, size, 100)]), "v1/dedup/x")
    block = table.lookup("e" * 64)
    assert block is not None and table.verify([block]) == {block}
    assert table.writer.ranges == [] and table.lookup("e" * 64) is None


def test_when_a_blocks_first_place_fails_the_next_place_a_segment_gives_is_used(tmp_path, caplog):
    """Two segments name X: the first (poison) at P's place, the second at X's true place; X is referenced there."""
    a, b = _poisoned_images(tmp_path)
    store = tmp_path / "store"
    convert(a.ref, store)
    convert(b.ref, store)
    p = _place_of(store, chain_ids(a.diff_ids)[0], P_DATA)
    x = _place_of(store, chain_ids(b.diff_ids)[0], X_DATA)
    sizes = {name: (store / pack_object(name)).stat().st_size for name in (p.pack, x.pack)}
    table = DedupTable(CountingStore(store))
    table.add(DedupSegment(packs=sizes, blocks=[StoredBlock(x.digest, p.pack, p.offset, p.clen, x.rlen)]), "v1/dedup/poison")
    table.add(DedupSegment(packs=sizes, blocks=[x]), "v1/dedup/honest")
    spool = tmp_path / "spool"
    spool.mkdir()
    with caplog.at_level(logging.WARNING, logger="bootseer.blockstore.convert.converter"):
        with PackWriter(BLOCK, table, spool, workers=1) as packs:
            number = packs.add(X_DATA)
            packs.finish()
    placed = packs.blocks[number]
    assert (packs.packs[placed.pack], placed.offset, placed.clen) == (x.pack, x.offset, x.clen)
    assert (packs.stats.in_store, packs.stats.stored) == (1, 0) and not packs.spooled
    assert [r.fields["segment"] for r in caplog.records if "does not hold its block" in r.getMessage()] == ["v1/dedup/poison"]
    assert len(table.writer.ranges) == 2  # one read per place tried
