"""The blob directory's budget and the blocks peers are served from on the ``fanotify`` path, over real files.

:class:`~bootseer.blockstore.datapath.blob_store.BlobStore` runs over real sparse files in a
temporary directory (what it sees is what ``stat`` and ``scandir`` say): kept blobs are evicted
least recently used first and whole, a blob in use never, and what a kill leaves of an eviction
is swept at the next start.  The peer seam runs a real
:class:`~bootseer.blockstore.node.fetcher.BlockFetcher` over a real engine and a ``file://`` store
(every read of the store recorded), with a real
:class:`~bootseer.blockstore.datapath.local_blobs.LocalBlob` on ``/var/tmp`` (ext4) behind
:class:`~bootseer.blockstore.datapath.blob_blocks.FilledBlocks`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from bootseer.blockstore.datapath.blob_store import BlobStore, LOW_WATER
from tests.blockstore.test_blob_recheck import _flip
from tests.blockstore.test_fanotify import converted  # noqa: F401 (fixture)

MiB = 1 << 20


def _blob(directory: Path, name: str, size: int, last_use: float, *, record: bool = True) -> None:
    """A kept blob's files: ``size`` bytes of data in the blob, a map, a record, all last changed at ``last_use``."""
    (directory / f"{name}.blob").write_bytes(os.urandom(size))
    (directory / f"{name}.filled").write_bytes(b"map")
    if record:
        (directory / f"{name}.closed").write_bytes(b"{}")
    for suffix in (".blob", ".filled", ".closed"):
        if (directory / f"{name}{suffix}").exists():
            os.utime(directory / f"{name}{suffix}", (last_use, last_use))


def _names(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def test_kept_blobs_are_evicted_whole_least_recently_used_first_and_a_blob_in_use_never(tmp_path: Path) -> None:
    old, newer, used = "a" * 64, "b" * 64, "c" * 64
    _blob(tmp_path, old, MiB, 1_000)
    _blob(tmp_path, newer, MiB, 2_000)
    _blob(tmp_path, used, MiB, 500)  # the oldest, but a mounted layer's
    (tmp_path / "server.lock").write_text("1\n/root\n")
    cache = [0]
    store = BlobStore(tmp_path, int(2.5 * MiB), in_use=lambda: {used}, cache_bytes=lambda: cache[0])

    async def main() -> None:
        assert await store.check() == 1  # 3 MiB over 2.5: down to LOW_WATER by the least recently used kept blob
        assert _names(tmp_path) == sorted([f"{newer}.blob", f"{newer}.closed", f"{newer}.filled", f"{used}.blob",
                                           f"{used}.filled", f"{used}.closed", "server.lock"])  # fmt: skip
        stats = store.statistics()
        assert stats.evictions == 1 and stats.kept == 1 and not stats.over_budget
        assert stats.in_use_bytes >= MiB and stats.in_use_bytes == store.in_use_bytes()
        assert stats.in_use_bytes + stats.kept_bytes <= 2.5 * MiB * LOW_WATER
        cache[0] = 2 * MiB  # the node cache grows: the kept blob goes, the one in use stays however far over
        assert await store.check() == 1
        assert await store.check() == 0
        assert _names(tmp_path) == sorted([f"{used}.blob", f"{used}.filled", f"{used}.closed", "server.lock"])
        stats = store.statistics()
        assert stats.evictions == 2 and stats.kept == 0 and stats.over_budget and stats.evicted_bytes >= 2 * MiB

    trio.run(main)


def test_what_a_kill_leaves_of_an_eviction_is_swept_at_the_next_start_and_nothing_else(tmp_path: Path) -> None:
    whole, no_map, no_blob, lone_record, unrecorded = ("1" * 64, "2" * 64, "3" * 64, "4" * 64, "5" * 64)
    _blob(tmp_path, whole, 4096, 1_000)
    _blob(tmp_path, unrecorded, 4096, 1_000, record=False)  # a crash before a clean close: kept (verified when opened)
    _blob(tmp_path, no_map, 4096, 1_000)
    (tmp_path / f"{no_map}.filled").unlink()
    (tmp_path / f"{no_map}.closed").unlink()  # the order of an eviction: record, map, then the blob
    _blob(tmp_path, no_blob, 4096, 1_000)
    (tmp_path / f"{no_blob}.blob").unlink()
    (tmp_path / f"{lone_record}.closed").write_bytes(b"{}")
    (tmp_path / f".{whole}.closed.x1y2.tmp").write_bytes(b"{")  # a record's write cut short
    others = ["server.lock", ".data-path-probe-blob-7", "notes.blob"]  # not blobs of an index: not the sweep's
    for name in others:
        (tmp_path / name).write_bytes(b"")
    store = BlobStore(tmp_path, MiB, in_use=set)
    assert store.sweep() == sorted([no_map, no_blob, lone_record])
    assert _names(tmp_path) == sorted([f"{whole}.blob", f"{whole}.filled", f"{whole}.closed", f"{unrecorded}.blob",
                                       f"{unrecorded}.filled", *others])  # fmt: skip
    assert sorted(blob.name for blob in store.scan()) == [whole, unrecorded]


def test_the_node_cache_leaves_the_blobs_in_use_their_share_of_the_cache_size(tmp_path: Path) -> None:
    import hashlib

    from bootseer.blockstore.node.block_cache import BlockCache

    blobs_in_use = [0]
    cache = BlockCache(str(tmp_path / "cache"), 8 * MiB, others=lambda: blobs_in_use[0])
    blocks = [os.urandom(256 << 10) for _ in range(16)]  # 4 MiB: within 8 MiB alone
    for block in blocks:
        cache.put(hashlib.sha256(block).hexdigest(), block)
    assert all(cache.contains(hashlib.sha256(block).hexdigest()) for block in blocks)
    blobs_in_use[0] = 6 * MiB  # the blobs in use grew: the cache's entries give way down to what they leave
    extra = os.urandom(256 << 10)
    cache.put(hashlib.sha256(extra).hexdigest(), extra)
    stats = cache.stats()
    assert stats.evictions > 0 and stats.bytes <= 2 * MiB
    assert cache.contains(hashlib.sha256(extra).hexdigest())  # least recently used out first: the newest stays


# -- peers served from the blobs ----------------------------------------------------------------------


@pytest.fixture
def var_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="blob-store-") as directory:
        yield Path(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a fanotify group)")
def test_a_peer_is_served_a_block_from_a_blob_with_no_store_read_and_a_corrupt_one_from_the_store(
    converted: Any, var_tmp: Path
) -> None:
    from bootseer.blockstore.datapath import fanotify
    from bootseer.blockstore.datapath.blob_blocks import FilledBlocks
    from bootseer.blockstore.datapath.local_blobs import FILLED, LocalBlob
    from bootseer.blockstore.node.fetcher import BlockFetcher
    from bootseer.blockstore.objects.format import BlockPlace
    from bootseer.fetch.engine import open_engine
    from bootseer.fetch.faults import FaultySource
    from bootseer.fetch.sources.local import LocalSource
    from bootseer.fetch.stripes import Priority
    from tests.support.packed_layers import engine_config
    from tests.support.trees import read_block

    if fanotify.unsupported(var_tmp) is not None:
        pytest.skip("no fanotify pre-content marks here")
    store, built = converted
    index, name = built.index, built.record.index
    data = [ref for ref, block in enumerate(index.blocks) if not block.is_zero]
    good, corrupt, absent = data[0], data[1], data[2]
    group = fanotify.init_group()
    try:
        LocalBlob(var_tmp, name, index, None, group).close(remove=False)  # an empty blob and a map of this boot
        fill_map = var_tmp / f"{name}.filled"
        start = fill_map.stat().st_size - len(index.blocks)
        with open(var_tmp / f"{name}.blob", "r+b") as blob_file, open(fill_map, "r+b") as map_file:
            for ref in (good, corrupt):  # on disk, and noted: as a fill leaves them
                blob_file.seek(index.blob_offset(ref))
                blob_file.write(read_block(store, index, ref))
                map_file.seek(start + ref)
                map_file.write(bytes([FILLED]))
        blob = LocalBlob(var_tmp, name, index, None, group)
        assert blob.check is not None and blob.check.dropped == [] and blob.missing([good, corrupt, absent]) == [absent]
        blocks = FilledBlocks()
        blocks.add(blob)
        _flip(blob.path, index.blob_offset(corrupt) + 10)  # after the check: a disk that turns a byte
        source = FaultySource(LocalSource(str(store)))

        def place(ref: int) -> BlockPlace:
            block = index.blocks[ref]
            return BlockPlace(block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen)

        async def main() -> None:
            async with open_engine(source, engine_config()) as engine:
                fetcher = BlockFetcher(engine, None, local=blocks)
                assert await fetcher.block_for_peer(place(good), Priority.DEMAND) == read_block(store, index, good)
                assert source.reads == []  # from the blob: the store was never asked
                assert await fetcher.block_for_peer(place(corrupt), Priority.DEMAND) == read_block(store, index, corrupt)
                assert await fetcher.block_for_peer(place(absent), Priority.DEMAND) == read_block(store, index, absent)
                assert len(source.reads) == 2  # the corrupt and the absent block: from the store

        trio.run(main)
        stats = blocks.statistics()
        assert (stats.served, stats.corrupt, stats.absent) == (1, 1, 1)
        blob.close(remove=True)
        assert blocks.read(index.blocks[good].digest, index.blocks[good].rlen) is None  # closed: never read
        blocks.remove(blob)
        source.close()
    finally:
        os.close(group)
