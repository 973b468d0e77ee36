"""BlockFetcher, LayerReader and the node block cache over real stores.

Stores are built with ``blockstore/objects/format.py`` (:func:`tests.support.packed_layers.pack_layer`,
a tiny packer: zstd blocks in packs, deduplicated, zero blocks stored nowhere) and served from a directory
(``LocalSource``, wrapped in ``FaultySource`` to count and fail reads) or over HTTP
(``tests/support/http.py``'s range server, which counts requests).  Trio runs on
the autojump clock, so retry timeouts pass at once where a source hangs or fails.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import prometheus_client
import pytest
import trio
import trio.testing

from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.objects.format import Entry, EntryType, LayerIndex, pack_object
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.layer_reader import LayerReader
from bootseer.blockstore.node.metrics import layer_label
from bootseer.fetch.engine import open_engine
from bootseer.fetch.stripes import FetchError, Priority
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.sources.http import HttpSource
from bootseer.fetch.sources.local import LocalSource
from tests.support.autojump import FAULT_AUTOJUMP, TIMEOUT, run
from tests.support.packed_layers import BLOCK, KiB, engine_config, entry, pack_layer, sha


@pytest.fixture
def files() -> dict[str, bytes]:
    rng = random.Random(5)
    sparse = bytearray(20 * BLOCK + 77)
    sparse[3 * BLOCK : 4 * BLOCK] = rng.randbytes(BLOCK)
    sparse[-50:] = rng.randbytes(50)
    block = rng.randbytes(BLOCK)
    return {
        "big.bin": rng.randbytes(60 * BLOCK + 123),
        "text.txt": b"".join(b"line %d of some text that compresses\n" % n for n in range(5000)),
        "sparse.bin": bytes(sparse),
        "same.bin": block * 6 + block[:100],  # one stored block, six times over
        "tiny": b"0123456789",
        "empty": b"",
    }


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def source(store: Path) -> FaultySource:
    source = FaultySource(LocalSource(str(store)))
    yield source
    source.close()


def sample(name: str, **labels) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


# -- reads ---------------------------------------------------------------------------------------


def test_random_reads_are_byte_exact_across_block_boundaries(tmp_path, store, source, files):
    index = pack_layer(store, files, links={"hardlink": "big.bin"})
    rng = random.Random(11)

    async def main():
        async with open_engine(source, engine_config()) as engine:
            fetcher = BlockFetcher(engine, BlockCache(str(tmp_path / "cache"), 64 << 20), source_label="test-store")
            layer = LayerReader(index, fetcher, "sha256:" + "c" * 64)
            for path in [*files, "hardlink"]:
                data = files["big.bin" if path == "hardlink" else path]
                assert await layer.read(entry(index, path), 0, len(data) + 10) == data
                for _ in range(60):
                    offset = rng.choice([0, rng.randrange(len(data) + 2 * BLOCK), rng.randrange(4) * BLOCK - 1])
                    offset = max(offset, 0)
                    size = rng.choice([0, 1, BLOCK, BLOCK + 1, rng.randrange(1, 5 * BLOCK), 128 * KiB])
                    assert await layer.read(entry(index, path), offset, size) == data[offset : offset + size]
            with pytest.raises(ValueError, match="not a regular file"):
                await layer.read(index.entries[0], 0, 10)
            with pytest.raises(ValueError, match="invalid read"):
                await layer.read(entry(index, "tiny"), -1, 10)
            with pytest.raises(ValueError, match="has no block"):
                await fetcher.blocks(index, [len(index.blocks)])
            # Every stored block was fetched once: later reads came from the cache.
            stored = {b.digest for b in index.blocks if not b.is_zero}
            assert fetcher.statistics().blocks_fetched == len(stored)
            assert fetcher.statistics().corrupt == 0

    run(main)


def test_only_the_touched_blocks_are_fetched_neighbours_in_one_request(tmp_path, store, files, range_http_factory):
    index = pack_layer(store, files)
    server = range_http_factory(store)
    big = entry(index, "big.bin")
    fetched_before = sample("bootseer_blocks_total", layer=layer_label(index), source="http-store", outcome="fetched")

    async def main():
        source = HttpSource(server.url)
        try:
            async with open_engine(source, engine_config()) as engine:
                fetcher = BlockFetcher(engine, BlockCache(str(tmp_path / "cache"), 64 << 20), source_label="http-store")
                layer = LayerReader(index, fetcher, readahead_max=0)
                # Bytes 10 KiB .. 22 KiB touch blocks 2..5 of big.bin: four blocks, one range request.
                data = await layer.read(big, 10 * KiB, 12 * KiB)
                assert data == files["big.bin"][10 * KiB : 22 * KiB]
                assert fetcher.statistics().blocks_fetched == 4
                assert engine.statistics().extent_requests == 1 and engine.statistics().coalesced_requests == 1
                # The sparse file's zero blocks cost nothing; its one stored block is fetched.
                sparse = files["sparse.bin"]
                assert await layer.read(entry(index, "sparse.bin"), 0, len(sparse)) == sparse
                assert fetcher.statistics().zero_blocks >= 18 and fetcher.statistics().blocks_fetched == 4 + 2
                assert await layer.read(entry(index, "sparse.bin"), 10 * BLOCK, 5 * BLOCK) == bytes(5 * BLOCK)
                # Read again: the fetcher's memory answers, the store is not asked.
                requests = len(server.requests)
                assert await layer.read(big, 10 * KiB, 12 * KiB) == data
                assert len(server.requests) == requests and fetcher.statistics().blocks_from_memory == 4
        finally:
            source.close()

    run(main)
    ranges = [headers.get("Range") for method, _, headers in server.requests if method == "GET"]
    blocks = [index.blocks[ref] for ref in entry(index, "big.bin").blocks[2:6]]
    first, last = blocks[0].offset, blocks[-1].offset + blocks[-1].clen - 1
    assert ranges[0] == f"bytes={first}-{last}"
    assert len(ranges) == 2  # big.bin's blocks, then the sparse file's two stored blocks (neighbours in their pack)
    assert sum(b.clen for b in blocks) == last - first + 1  # exactly those blocks, nothing more
    after = sample("bootseer_blocks_total", layer=layer_label(index), source="http-store", outcome="fetched")
    assert after - fetched_before == 6


def test_a_prefetch_list_yields_to_a_read(store, source, files):
    index = pack_layer(store, files)
    big, text = entry(index, "big.bin"), entry(index, "text.txt")

    async def main():
        async with open_engine(source, engine_config(streams=1, coalesce_gap=0)) as engine:
            fetcher = BlockFetcher(engine, None)
            # No read-ahead: a layer's first read learns the pack order in a worker
            # thread first, and a task in a thread does not count as blocked below.
            layer = LayerReader(index, fetcher, readahead_max=0)
            source.pause()
            async with trio.open_nursery() as nursery:
                # Every other block of big.bin: 30 requests (nothing coalesces across the holes).
                nursery.start_soon(fetcher.blocks, index, big.blocks[::2], Priority.PREFETCH)
                await trio.testing.wait_all_tasks_blocked()

                async def read():
                    assert await layer.read(text, 0, 100) == files["text.txt"][:100]
                    done.append(len(source.reads))

                done: list[int] = []
                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            # The read's block went out second, right after the prefetch request in flight,
            # and the read was done long before the list.
            first_text = index.blocks[text.blocks[0]]
            assert (source.reads[1].path, source.reads[1].offset) == (pack_object(index.packs[first_text.pack]), 0)
            assert done[0] <= 3 and len(source.reads) == 31 + 1

    run(main)


def test_a_block_read_in_pieces_is_got_once_and_concurrent_reads_share_it(tmp_path, store, source, files):
    index = pack_layer(store, files)
    big = entry(index, "big.bin")
    data = files["big.bin"]

    async def main():
        async with open_engine(source, engine_config()) as engine:
            cache = BlockCache(str(tmp_path / "cache"), 64 << 20)
            fetcher = BlockFetcher(engine, cache)
            layer = LayerReader(index, fetcher, readahead_max=0)
            # A block read in quarters, as the kernel reads a big block: fetched, decoded
            # and hashed once, then served from memory (the node cache is not asked again).
            for piece in range(4):
                offset = 5 * BLOCK + piece * BLOCK // 4
                assert await layer.read(big, offset, BLOCK // 4) == data[offset : offset + BLOCK // 4]
            assert (fetcher.statistics().blocks_fetched, fetcher.statistics().blocks_from_memory) == (1, 3)
            assert cache.stats().hits == 0
            # Eight reads of one cold block at once: one fetch, one decode, seven waiters.
            source.pause()
            results = []
            async with trio.open_nursery() as nursery:
                for number in range(8):

                    async def read(offset=9 * BLOCK + number * 100):
                        results.append(await layer.read(big, offset, 100) == data[offset : offset + 100])

                    nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert results == [True] * 8
            assert fetcher.statistics().blocks_fetched == 2 and fetcher.statistics().blocks_joined == 7
            assert len(source.reads) == 2
            # The one getting it is cancelled: a waiter gets it itself.
            source.pause()
            async with trio.open_nursery() as nursery:
                first = trio.CancelScope()

                async def cancelled():
                    with first:
                        await layer.read(big, 11 * BLOCK, 10)

                async def waiter():
                    results.append(await layer.read(big, 11 * BLOCK, 10) == data[11 * BLOCK : 11 * BLOCK + 10])

                nursery.start_soon(cancelled)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                first.cancel()
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert results[-1] is True and fetcher.statistics().blocks_fetched == 3
            with pytest.raises(ValueError, match="memory_bytes"):
                BlockFetcher(engine, None, memory_bytes=-1)

    run(main)


# -- read-ahead ------------------------------------------------------------------------------------


@pytest.fixture
def package() -> dict[str, bytes]:
    """Twenty small files, one block each, as a Python package's modules: ten land in each pack, in order."""
    rng = random.Random(9)
    return {f"mod{number:02}.pyc": rng.randbytes(3 * KiB + number) for number in range(20)}


def pack_files(index: LayerIndex, pack: int) -> list[Entry]:
    """The files of ``index`` whose (first) block lies in ``pack``, in pack order."""
    files = [e for e in index.entries if e.type is EntryType.FILE and e.blocks]
    return sorted((e for e in files if index.blocks[e.blocks[0]].pack == pack), key=lambda e: index.blocks[e.blocks[0]].offset)


def test_a_miss_reads_ahead_the_next_files_of_its_pack_in_the_same_request(tmp_path, store, package, range_http_factory):
    index = pack_layer(store, package)
    server = range_http_factory(store)
    modules = pack_files(index, 0)
    blocks = [index.blocks[e.blocks[0]] for e in modules]
    label = layer_label(index)
    queued_before = sample("bootseer_block_readahead_bytes_total", layer=label, source="http-store", outcome="queued")
    read_before = sample("bootseer_block_readahead_bytes_total", layer=label, source="http-store", outcome="read")

    async def main():
        source = HttpSource(server.url)
        try:
            async with open_engine(source, engine_config()) as engine:
                fetcher = BlockFetcher(engine, BlockCache(str(tmp_path / "cache"), 64 << 20), source_label="http-store")
                layer = LayerReader(index, fetcher)
                window = layer.readahead_window
                # The first module misses: the nine after it in the pack come in the same request.
                assert await layer.read(modules[0], 0, 100) == package[modules[0].path][:100]
                assert engine.statistics().extent_requests == 1 and engine.statistics().coalesced_requests == 1
                assert fetcher.statistics().blocks_fetched == 1
                assert (fetcher.statistics().readahead_blocks, fetcher.statistics().readahead_bytes) == (9, sum(b.clen for b in blocks[1:]))
                assert fetcher.statistics().readahead_read == 0
                # Nothing read ahead is verified or cached before it is read.
                await fetcher.flush()
                assert not any(fetcher.cache.contains(b.digest) for b in blocks[1:])
                # Six of them are read: no request, each verified and cached as it is read.
                for module in modules[1:7]:
                    assert await layer.read(module, 0, module.size) == package[module.path]
                assert engine.statistics().extent_requests == 1
                assert (fetcher.statistics().blocks_fetched, fetcher.statistics().readahead_read) == (7, 6)
                assert fetcher.statistics().readahead_read_bytes == sum(b.clen for b in blocks[1:7])
                await fetcher.flush()  # the node cache is written behind the reads
                assert all(fetcher.cache.contains(b.digest) for b in blocks[:7])
                assert layer.readahead_window > window  # reads keep landing on blocks read ahead: the window grows
                # Three were read ahead and never read; they are counted.
                unread = fetcher.statistics().readahead_bytes - fetcher.statistics().readahead_read_bytes
                assert unread == sum(b.clen for b in blocks[7:])
                # A file of the other pack misses and reads its own pack ahead; nothing is fetched twice.
                other = pack_files(index, 1)
                for module in [*other, *modules]:
                    assert await layer.read(module, 0, module.size) == package[module.path]
                assert engine.statistics().extent_requests == 2
                assert engine.statistics().bytes_fetched == sum((store / pack_object(name)).stat().st_size for name in index.packs)
                return unread
        finally:
            source.close()

    unread = run(main)
    ranges = [headers.get("Range") for method, _, headers in server.requests if method == "GET"]
    assert ranges == [f"bytes=0-{blocks[-1].offset + blocks[-1].clen - 1}", f"bytes=0-{(store / pack_object(index.packs[1])).stat().st_size - 1}"]
    queued = sample("bootseer_block_readahead_bytes_total", layer=label, source="http-store", outcome="queued") - queued_before
    read = sample("bootseer_block_readahead_bytes_total", layer=label, source="http-store", outcome="read") - read_before
    assert queued == sum(index.blocks[ref].clen for ref in range(len(index.blocks))) - blocks[0].clen - index.blocks[pack_files(index, 1)[0].blocks[0]].clen
    assert read == queued and unread > 0  # by the end every block read ahead was read


def test_read_ahead_beyond_what_rides_with_a_read_goes_in_a_request_of_its_own(store, source, package):
    index = pack_layer(store, package)
    modules = pack_files(index, 0)
    blocks = [index.blocks[e.blocks[0]] for e in modules]

    async def main():
        # Two neighbours' worth may ride with the read; the other seven follow in one READAHEAD request.
        async with open_engine(source, engine_config(readahead_join=blocks[1].clen + blocks[2].clen)) as engine:
            fetcher = BlockFetcher(engine, None)
            layer = LayerReader(index, fetcher)
            assert await layer.read(modules[0], 0, 10) == package[modules[0].path][:10]
            await trio.testing.wait_all_tasks_blocked()
            for module in modules:
                assert await layer.read(module, 0, module.size) == package[module.path]
            assert fetcher.statistics().readahead_read == 9 and fetcher.statistics().blocks_fetched == 10

    run(main)
    assert sorted((r.offset, r.length) for r in source.reads) == [
        (0, blocks[3].offset),
        (blocks[3].offset, blocks[-1].offset + blocks[-1].clen - blocks[3].offset),
    ]


def test_a_tampered_read_ahead_block_is_never_served_or_cached(tmp_path, store, package):
    index = pack_layer(store, package)
    modules = pack_files(index, 0)
    victim_file = modules[4]
    victim = index.blocks[victim_file.blocks[0]]
    pack = pack_object(index.packs[victim.pack])

    class Tampering(FaultySource):
        """Flips one byte of the victim block in the first answer that carries it (a bad proxy)."""

        def connect(self):
            connection = super().connect()
            read = connection.read_range

            def read_range(path, offset, length, version=""):
                data = read(path, offset, length, version)
                at = victim.offset + 7 - offset
                if path == pack and 0 <= at < len(data) and not tampered:
                    tampered.append(offset)
                    data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
                return data

            connection.read_range = read_range
            return connection

    tampered: list[int] = []
    source = Tampering(LocalSource(str(store)))

    async def main():
        async with open_engine(source, engine_config()) as engine:
            cache = BlockCache(str(tmp_path / "cache"), 64 << 20)
            fetcher = BlockFetcher(engine, cache)
            layer = LayerReader(index, fetcher)
            assert await layer.read(modules[0], 0, 10) == package[modules[0].path][:10]
            assert tampered == [0] and fetcher.statistics().readahead_blocks == 9 and fetcher.statistics().corrupt == 0
            await fetcher.flush()
            assert not cache.contains(victim.digest)
            # The read of the victim finds the bad copy, drops it and fetches the block alone: right bytes.
            assert await layer.read(victim_file, 0, victim_file.size) == package[victim_file.path]
            assert fetcher.statistics().corrupt == 1 and fetcher.statistics().failed == 0 and engine.statistics().discards == 1
            await fetcher.flush()
            assert cache.get(victim.digest) == package[victim_file.path]
            assert [(r.offset, r.length) for r in source.reads][-1] == (victim.offset, victim.clen)

    run(main)
    source.close()


def test_a_demand_read_overtakes_read_ahead_and_a_read_of_a_block_read_ahead_waits_for_it(store, source, package):
    index = pack_layer(store, package)
    first, other = pack_files(index, 0), pack_files(index, 1)

    async def main():
        # One stream and nothing riding with reads: read-ahead is a request of its own, queued behind.
        async with open_engine(source, engine_config(streams=1, readahead_join=0)) as engine:
            fetcher = BlockFetcher(engine, None)
            layer = LayerReader(index, fetcher)
            source.pause()
            done: list[str] = []

            async def read(module: Entry) -> None:
                assert await layer.read(module, 0, module.size) == package[module.path]
                done.append(module.path)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, first[0])  # in flight; pack 0's read-ahead queued behind it
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(read, other[0])  # a demand read: goes before that read-ahead
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(read, first[5])  # read ahead and queued: raised to DEMAND, not fetched again
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert fetcher.statistics().readahead_read == 1
            assert engine.statistics().extents_raised == 1
            # Pack 0's read-ahead is queued behind the reads and nobody waits for it: closing the
            # engine now could drop it before its worker took it (the test raced: 3 reads, not 4).
            with trio.fail_after(TIMEOUT):
                while len(source.reads) < 4:
                    await trio.sleep(0.01)

    run(main)
    packs = [pack_object(name) for name in index.packs]
    assert [(r.path, r.offset) for r in source.reads[:3]] == [
        (packs[0], 0),  # the first read
        (packs[1], 0),  # the other pack's read, ahead of the first one's read-ahead
        (packs[0], index.blocks[first[5].blocks[0]].offset),  # the read of a block queued as read-ahead, next
    ]
    # Then pack 0's read-ahead, in one request (bridging the block the read took out of it).
    start, last = index.blocks[first[1].blocks[0]], index.blocks[first[-1].blocks[0]]
    assert (source.reads[3].path, source.reads[3].offset, source.reads[3].length) == (
        packs[0], start.offset, last.offset + last.clen - start.offset
    )


# -- corruption ------------------------------------------------------------------------------------


class CorruptingSource(FaultySource):
    """A real source whose next ``times`` range reads come back with one byte flipped (a bad disk or proxy)."""

    def __init__(self, inner, times: int) -> None:
        super().__init__(inner)
        self.times = times
        self._flips = threading.Lock()

    def connect(self):
        connection = super().connect()
        read = connection.read_range

        def read_range(path, offset, length, version=""):
            data = read(path, offset, length, version)
            with self._flips:
                if self.times and data:
                    self.times -= 1
                    data = bytes([data[0] ^ 0x40]) + data[1:]
            return data

        connection.read_range = read_range
        return connection


def test_a_block_corrupt_in_transit_is_refetched_once_and_served_right(tmp_path, store, files):
    index = pack_layer(store, files)
    source = CorruptingSource(LocalSource(str(store)), times=1)

    async def main():
        async with open_engine(source, engine_config()) as engine:
            cache = BlockCache(str(tmp_path / "cache"), 64 << 20)
            fetcher = BlockFetcher(engine, cache)
            data = await LayerReader(index, fetcher).read(entry(index, "tiny"), 0, 10)
            assert data == files["tiny"]
            assert fetcher.statistics().corrupt == 1 and fetcher.statistics().failed == 0
            assert len([r for r in source.reads if r.outcome == "ok"]) == 2
            assert engine.statistics().discards == 1

    run(main)
    source.close()


def test_a_block_corrupt_in_the_store_fails_with_eio_and_is_never_served_or_cached(tmp_path, store, source, files):
    index = pack_layer(store, files)
    big = entry(index, "big.bin")
    victim = index.blocks[big.blocks[7]]
    pack = store / pack_object(index.packs[victim.pack])
    good = pack.read_bytes()
    bad = bytearray(good)
    bad[victim.offset + victim.clen // 2] ^= 0x01
    pack.write_bytes(bytes(bad))
    failed_before = sample("bootseer_block_corrupt_total", layer=layer_label(index), source="s", outcome="failed")

    async def main():
        async with open_engine(source, engine_config(retry_timeout=10 * TIMEOUT)) as engine:
            cache = BlockCache(str(tmp_path / "cache"), 64 << 20)
            fetcher = BlockFetcher(engine, cache, source_label="s")
            layer = LayerReader(index, fetcher, readahead_max=0)
            with pytest.raises(FetchError, match="fails verification twice") as caught:
                await layer.read(big, 6 * BLOCK, 3 * BLOCK)  # blocks 6, 7, 8
            assert caught.value.errno == errno.EIO
            # Fetched twice (one request for the three blocks, then the bad one alone), never retried more.
            ranges = [(r.offset, r.length) for r in source.reads]
            assert ranges[-1] == (victim.offset, victim.clen) and len(ranges) == 2
            assert fetcher.statistics().corrupt == 1 and fetcher.statistics().failed == 1
            # Its good neighbours were cached; the bad block was not.
            await fetcher.flush()
            assert cache.get(victim.digest) is None
            assert cache.get(index.blocks[big.blocks[6]].digest) is not None
            assert not os.path.exists(cache.path_of(victim.digest))
            # Reads that do not touch it go on; one that does fails again, without serving it.
            assert await layer.read(big, 0, BLOCK) == files["big.bin"][:BLOCK]
            with pytest.raises(FetchError):
                await layer.read(big, 7 * BLOCK + 5, 1)
            # The store is repaired: the next read asks it again and succeeds.
            pack.write_bytes(good)
            assert await layer.read(big, 7 * BLOCK, BLOCK) == files["big.bin"][7 * BLOCK : 8 * BLOCK]

    run(main)
    after = sample("bootseer_block_corrupt_total", layer=layer_label(index), source="s", outcome="failed")
    assert after - failed_before == 2


# -- the node cache ---------------------------------------------------------------------------------


def test_the_cache_serves_a_second_fetcher_after_a_restart_and_drops_a_corrupt_entry(tmp_path, store, source, files):
    index = pack_layer(store, files)
    cache_dir = str(tmp_path / "cache")
    text = entry(index, "text.txt")

    async def read_all(expect_fetched: int) -> BlockFetcher:
        async with open_engine(source, engine_config()) as engine:
            fetcher = BlockFetcher(engine, BlockCache(cache_dir, 64 << 20))
            assert await LayerReader(index, fetcher, readahead_max=0).read(text, 0, text.size) == files["text.txt"]
            assert fetcher.statistics().blocks_fetched == expect_fetched
            await fetcher.flush()
            return fetcher

    stored = len({index.blocks[ref].digest for ref in text.blocks})
    first = run(read_all, stored)
    assert first.statistics().blocks_cached == 0
    reads = len(source.reads)
    second = run(read_all, 0)  # a new engine, fetcher and cache object: a restarted server
    assert second.statistics().blocks_cached == stored and len(source.reads) == reads
    # Damage one entry on disk: it is deleted and its block fetched again, never served.
    victim = index.blocks[text.blocks[3]]
    path = Path(BlockCache(cache_dir, 64 << 20).path_of(victim.digest))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    third = run(read_all, 1)
    assert third.statistics().blocks_cached == stored - 1
    assert [(r.offset, r.length) for r in source.reads[reads:]] == [(victim.offset, victim.clen)]


def test_a_read_the_node_cache_serves_takes_the_next_blocks_too_so_the_reads_after_it_are_memory_hits(
    tmp_path, store, source, files
):
    """Issue 26: on a restarted node (blocks in the node cache, none in memory) a sequential read cost a
    worker-thread hop and a disk read per block; a read the cache serves now reads its read-ahead
    candidates from the cache in the same call, into memory.  A damaged entry among them is not taken
    (the cache verifies each), and its block comes from the store when read."""
    index = pack_layer(store, files)
    cache_dir = str(tmp_path / "cache")
    big = entry(index, "big.bin")
    stored = len({index.blocks[ref].digest for ref in big.blocks})

    async def read_block_by_block(fetcher: BlockFetcher) -> bytes:
        layer = LayerReader(index, fetcher)
        pieces = [await layer.read(big, offset, BLOCK) for offset in range(0, big.size, BLOCK)]
        await fetcher.flush()
        return b"".join(pieces)

    async def cold() -> None:
        async with open_engine(source, engine_config()) as engine:
            assert await read_block_by_block(BlockFetcher(engine, BlockCache(cache_dir, 64 << 20))) == files["big.bin"]

    async def restarted() -> BlockFetcher:
        async with open_engine(source, engine_config()) as engine:
            fetcher = BlockFetcher(engine, BlockCache(cache_dir, 64 << 20))
            assert await read_block_by_block(fetcher) == files["big.bin"]
            return fetcher

    run(cold)
    victim = index.blocks[big.blocks[20]]
    path = Path(BlockCache(cache_dir, 64 << 20).path_of(victim.digest))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    reads = len(source.reads)
    stats = run(restarted).statistics()
    assert stats.cache_ahead_blocks >= stored // 2 and stats.blocks_from_memory >= stored // 2, stats
    assert stats.blocks_cached + stats.blocks_fetched <= stored // 4, stats  # reads that went to the cache or store
    # The damaged block alone came from the store (its request may carry read-ahead of what follows it).
    assert stats.blocks_fetched == 1 and (victim.offset, victim.clen) in [(r.offset, r.length) for r in source.reads[reads:]]


def test_the_node_cache_is_written_behind_the_read_and_a_block_on_its_way_is_served(tmp_path, store, source, files):
    index = pack_layer(store, files)
    tiny = entry(index, "tiny")
    digest = index.blocks[tiny.blocks[0]].digest
    disk = threading.Event()

    class SlowDisk(BlockCache):
        def put(self, key, payload):
            assert disk.wait(60), "the disk was never let go"
            super().put(key, payload)

    async def main():
        async with open_engine(source, engine_config()) as engine:
            cache = SlowDisk(str(tmp_path / "cache"), 64 << 20)
            fetcher = BlockFetcher(engine, cache, memory_bytes=0)  # nothing kept in memory but what is being written
            layer = LayerReader(index, fetcher, readahead_max=0)
            # The read returns while its block's write is stuck.
            assert await layer.read(tiny, 0, 10) == files["tiny"]
            assert not cache.contains(digest)
            # Read again meanwhile: served from the write queue, not fetched again nor looked up.
            assert await layer.read(tiny, 2, 3) == files["tiny"][2:5]
            assert (fetcher.statistics().blocks_fetched, fetcher.statistics().blocks_from_memory, fetcher.statistics().blocks_cached) == (1, 1, 0)
            disk.set()
            await fetcher.flush()
            assert cache.get(digest) == files["tiny"]
            assert len(source.reads) == 1

    try:
        run(main)
    finally:
        disk.set()


def test_an_entry_that_passes_its_checksum_but_not_its_digest_is_refused(tmp_path):
    cache = BlockCache(str(tmp_path), 1 << 20)
    good, other = b"a" * 100, b"b" * 100
    cache.put(sha(other), good)  # a caller's bug (or a hand-made entry): named for bytes it does not hold
    assert cache.get(sha(other)) is None
    assert not os.path.exists(cache.path_of(sha(other)))
    assert cache.stats().corrupt == 1
    cache.put(sha(good), good)
    assert cache.get(sha(good)) == good
    with pytest.raises(ValueError, match="SHA-256"):
        cache.get("../../etc/passwd")
    with pytest.raises(ValueError, match="SHA-256"):
        cache.put("ABC", good)


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(tmp_path, store, source, files):
    index = pack_layer(store, files)
    big = entry(index, "big.bin")
    limit = 12 * (BLOCK + 48)  # a dozen blocks and their headers
    evictions_before = sample("bootseer_fetch_cache_evictions_total", cache="blocks")

    async def main():
        async with open_engine(source, engine_config()) as engine:
            cache = BlockCache(str(tmp_path / "cache"), limit)
            fetcher = BlockFetcher(engine, cache, memory_bytes=0)  # every read asks the node cache
            layer = LayerReader(index, fetcher)
            for number in range(40):
                assert await layer.read(big, number * BLOCK, BLOCK) == files["big.bin"][number * BLOCK : (number + 1) * BLOCK]
                await fetcher.flush()
                on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
                assert on_disk <= limit
            assert cache.stats().evictions > 0
            # The latest blocks are still there; the first ones were evicted and are fetched again.
            fetched = fetcher.statistics().blocks_fetched
            assert await layer.read(big, 39 * BLOCK, BLOCK) == files["big.bin"][39 * BLOCK : 40 * BLOCK]
            assert fetcher.statistics().blocks_fetched == fetched
            assert await layer.read(big, 0, BLOCK) == files["big.bin"][:BLOCK]
            assert fetcher.statistics().blocks_fetched == fetched + 1

    run(main)
    assert sample("bootseer_fetch_cache_evictions_total", cache="blocks") > evictions_before


# -- a store that goes away ------------------------------------------------------------------------


def test_a_store_that_stops_answering_gives_eio_after_retry_timeout_then_recovers(tmp_path, store, source, files):
    index = pack_layer(store, files)
    retry_timeout = 8.0

    async def main():
        async with open_engine(source, engine_config(retry_timeout=retry_timeout)) as engine:
            fetcher = BlockFetcher(engine, BlockCache(str(tmp_path / "cache"), 64 << 20))
            layer = LayerReader(index, fetcher, readahead_max=0)
            big = entry(index, "big.bin")
            assert await layer.read(big, 0, BLOCK) == files["big.bin"][:BLOCK]  # cached now
            # Each outage reads blocks not fetched before.
            for outage, path, offset in [("hang", "text.txt", 0), ("errors", "big.bin", 20 * BLOCK)]:
                if outage == "hang":
                    source.pause()  # accepts and never answers
                else:
                    source.fail()  # every read fails, forever
                wanted = entry(index, path)
                start = trio.current_time()
                with pytest.raises(FetchError) as caught:
                    await layer.read(wanted, offset, 2 * BLOCK)
                assert caught.value.errno == errno.EIO
                assert retry_timeout <= trio.current_time() - start < retry_timeout + 5
                # Cached blocks are still served while the store is down.
                assert await layer.read(big, 0, 100) == files["big.bin"][:100]
                source.resume()
                source.heal()
                await trio.sleep(retry_timeout)  # the engine fails a range that just failed at once, for a while
                assert await layer.read(wanted, offset, 2 * BLOCK) == files[path][offset : offset + 2 * BLOCK]

    run(main, autojump=FAULT_AUTOJUMP)
