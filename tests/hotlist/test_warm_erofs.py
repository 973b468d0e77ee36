"""Hot lists on the EROFS data path: which target a layer is warmed through, and the EROFS warmer's reads.

A layer whose tree EROFS answers has its hot blocks warmed by reading them through its EROFS
mount (``hotlist.warm.ErofsTarget``): here against a directory holding the layer's files, with
the reads and what :class:`~bootseer.hotlist.warm.WarmReads` announced during each one observed.
The same path through real EROFS mounts, with real containerd, is ``integration/test_hotlist.py``
(run on both data paths).
"""

from __future__ import annotations

import os
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest
import trio

from bootseer.blockstore.server.layer_server import LayerServerConfig
from bootseer.hotlist.format import HotBlock
from bootseer.hotlist.service import HotListService
from bootseer.hotlist.warm import PageCacheWarmer
from tests.support import autojump
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer

BLOCK_SIZE = 16 << 10
pytestmark = [pytest.mark.timeout(300)]


def _layers() -> list[Layer]:
    rng = random.Random(15)
    shared = rng.randbytes(BLOCK_SIZE)
    bottom = Layer((
        File("lib/big.so", rng.randbytes(9 * BLOCK_SIZE)),
        File("lib/tail.bin", rng.randbytes(2 * BLOCK_SIZE + 1000)),  # a short last block: a partial page
        File("lib/one.txt", shared), File("lib/same.txt", shared),  # one block in two files
        File("lib/small.txt", b"small file\n" * 30),
    ))  # fmt: skip
    top = Layer((
        File("app/main.py", rng.randbytes(3 * BLOCK_SIZE + 7)),
        File("app/data.bin", rng.randbytes(6 * BLOCK_SIZE)),
        File("app/cold.bin", rng.randbytes(4 * BLOCK_SIZE)),
    ))  # fmt: skip
    return [bottom, top]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path_factory.mktemp("store")
    return store, build_store(store, _layers(), block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))


def _hot_block(layer: BuiltLayer, ref: int, at: float) -> HotBlock:
    block = layer.index.blocks[ref]
    return HotBlock(layer.chain_id, block.digest, layer.index.packs[block.pack], block.offset, block.clen, block.rlen, at)


# -- warming through the EROFS mount ----------------------------------------------------------


def test_the_erofs_warmer_reads_each_block_of_each_file_holding_it_beneath_the_mount_and_stores_nothing(
    built: Any, tmp_path: Path
) -> None:
    """An EROFS target: each hot block's range of every file that holds it is read through the layer's mount
    (here a directory holding the layer's files), announced in WarmReads while it is read; nothing is stored
    with a notification, and a symlink where a file's directory was is not followed."""
    from bootseer.hotlist.format import ResolvedBlock
    from bootseer.hotlist.warm import ErofsTarget, WarmReads

    _store, layers = built
    layer = layers[0]
    index = layer.index
    mount = tmp_path / "lower"
    with tarfile.open(layer.blob) as tar:
        tar.extractall(mount, filter="data")
    by_path = {e.path: e for e in index.entries}
    shared_ref = by_path["lib/one.txt"].blocks[0]
    tail_ref = by_path["lib/tail.bin"].blocks[-1]
    refs = [tail_ref, shared_ref, by_path["lib/big.so"].blocks[4]]
    plan = [ResolvedBlock(layer=layer.chain_id, ref=ref, hot=_hot_block(layer, ref, 0.0)) for ref in refs]
    reads = WarmReads()
    seen: list[tuple[str, int, list[int]]] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        # What the hot-list service would leave out of its accounting, asked during the read.
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), offset, [r for r in refs if not reads.others(layer.chain_id, [r])]))
        return real_preadv(fd, buffers, offset)

    def no_store(*args: Any) -> None:
        raise AssertionError("an EROFS target stores nothing")

    warmer = PageCacheWarmer({layer.chain_id: index}, {layer.chain_id: ErofsTarget(str(mount))},
                             {b.hot.digest for b in plan}, store=no_store, reads=reads)  # fmt: skip
    assert not warmer.wants_bytes(layer.chain_id)
    os.preadv, saved = preadv, os.preadv
    try:
        done = warmer.warm(layer.chain_id, plan, None)
    finally:
        os.preadv = saved
    assert done == 1000 + 2 * BLOCK_SIZE + BLOCK_SIZE  # the tail's 1000 bytes, the shared block twice, one of big.so
    assert seen == [
        (str(mount / "lib/tail.bin"), 2 * BLOCK_SIZE, [tail_ref]),
        (str(mount / "lib/one.txt"), 0, [shared_ref]),
        (str(mount / "lib/same.txt"), 0, [shared_ref]),
        (str(mount / "lib/big.so"), 4 * BLOCK_SIZE, [refs[2]]),
    ]
    assert reads.others(layer.chain_id, refs) == refs  # nothing announced once the reads are done
    assert {digest for _layer, digest in warmer.stored} == {b.hot.digest for b in plan}

    # The tree is the store's word: a symlink on the way to a file is refused, not followed.
    (mount / "elsewhere").mkdir()
    (mount / "elsewhere" / "one.txt").write_bytes(b"x" * BLOCK_SIZE)
    os.rename(mount / "lib", mount / "lib.real")
    os.symlink("elsewhere", mount / "lib")
    again = PageCacheWarmer({layer.chain_id: index}, {layer.chain_id: ErofsTarget(str(mount))},
                            {plan[1].hot.digest}, store=no_store, reads=reads)  # fmt: skip
    assert again.warm(layer.chain_id, [plan[1]], None) == 0 and again.skipped == 2


def test_warm_reads_are_announced_per_layer_and_block_while_any_warmer_reads_them() -> None:
    from bootseer.hotlist.warm import WarmReads

    reads = WarmReads()
    assert reads.others("a", [1, 2]) == [1, 2]
    with reads.reading("a", 1):
        with reads.reading("a", 1):  # two warmers (two prefetches of one layer) on one block
            assert reads.others("a", [0, 1, 2]) == [0, 2] and reads.others("b", [1]) == [1]
        assert reads.others("a", [1]) == []
    assert reads.others("a", [1]) == [1]


def test_each_layer_is_warmed_where_its_data_path_reads_it(built: Any, tmp_path: Path) -> None:
    """A layer row's ``data_path`` (the layer server's table) decides: its EROFS mount on erofs and loop, its
    FUSE files on tree."""
    from bootseer.blockstore.server.layer_server import LayerServer
    from bootseer.hotlist.warm import ErofsTarget, TreeTarget

    store, layers = built
    bottom, top = layers

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            config = LayerServerConfig(root=tmp_path / "root", store=str(store))
            config.paths.indexes.mkdir(parents=True)
            server = LayerServer(config, nursery, extension=HotListService)  # no data path given: tree
            for layer in layers:
                await server.mount(layer.chain_id)
            slots = {layer.chain_id: server.layers[layer.chain_id].slot for layer in layers}
            assert server.layers[bottom.chain_id].data_path == "tree"
            assert server.extension.warm_target(bottom.chain_id) == TreeTarget(
                slots[bottom.chain_id], server.paths.lower_dir(slots[bottom.chain_id], "tree"))  # fmt: skip
            for path in ("erofs", "loop"):
                server.layers[top.chain_id].data_path = path  # as a row served on that path says
                assert server.extension.warm_target(top.chain_id) == ErofsTarget(
                    server.paths.lower_dir(slots[top.chain_id], path))  # fmt: skip
            nursery.cancel_scope.cancel()

    autojump.run(main, autojump=0.05, hold_for_threads=True)


def test_cached_ranges_says_which_ranges_of_a_file_are_wholly_in_the_page_cache(tmp_path: Path) -> None:
    """mincore of the pages the ranges span: a range is cached only if every page of it is."""
    from bootseer.hotlist.warm import PAGE_SIZE, cached_ranges

    path = tmp_path / "file"
    path.write_bytes(os.urandom(16 * PAGE_SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages: fadvise drops them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: just the pages read
        assert os.pread(fd, 3 * PAGE_SIZE, 4 * PAGE_SIZE)  # pages 4..6 cached now
    finally:
        os.close(fd)
    ranges = [(4 * PAGE_SIZE, 3 * PAGE_SIZE), (5 * PAGE_SIZE + 10, 100), (3 * PAGE_SIZE, 2 * PAGE_SIZE),
              (12 * PAGE_SIZE, PAGE_SIZE), (6 * PAGE_SIZE, 0), (20 * PAGE_SIZE, PAGE_SIZE)]  # fmt: skip
    assert cached_ranges(str(path), ranges) == [True, True, False, False, False, False]
