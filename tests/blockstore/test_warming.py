"""Layers loaded ahead of their mounts (``blockstore.server.warming``): what a warm saves, and what it never changes.

The layer server's ``warm`` operation against a real server over an HTTP store that logs its
requests; :class:`LayerWarmer`'s bounds (concurrency, expiry, stores, slots freed by failures, what
is discarded) in trio with a mock clock; and what an expired warm leaves on disk, with a real server's
loads (real store, real EROFS images, real checker process) in trio with a mock clock run at real speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio
import trio.testing

from bootseer.blockstore.objects.format import chain_object
from bootseer.blockstore.server.client import InvalidRequest, LayerNotConverted, ServerSettings, ensure_server
from bootseer.blockstore.server.warming import WARM_KEEP, WARM_MAX_ENTRIES, LayerWarmer
from bootseer.paths import ServerPaths
from tests.support.http import RangeHTTPServer
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import rich_layers
from tests.support.waiting import wait_until, wait_until_async

BLOCK_SIZE = 64 << 10


# -- LayerWarmer ---------------------------------------------------------------------------------


def test_loads_run_a_few_at_a_time_and_a_mount_takes_only_its_own_stores() -> None:
    running, most = 0, 0

    async def load(chain_id: str, store: str) -> str:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await trio.sleep(1)
        running -= 1
        return f"{chain_id}@{store}"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            warmer = LayerWarmer(nursery, load, concurrency=2, keep=60)
            assert warmer.warm(["a", "b", "c", "served"], "s1", served=lambda chain: chain == "served") == 3
            assert warmer.warm(["a"], "s1", served=lambda chain: False) == 0  # loading already
            assert await warmer.take("a", "other-store") is None  # not of this store: it stays
            assert await warmer.take("c", "s1") == "c@s1"  # waited for: the third load ran after one of two
            assert most == 2
            assert await warmer.take("a", "s1") == "a@s1"
            assert await warmer.take("a", "s1") is None  # taken once
            stats = warmer.statistics()
            assert (stats.requested, stats.loaded, stats.taken, stats.held) == (3, 3, 2, 1)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_failed_load_is_counted_and_a_load_no_mount_takes_expires() -> None:
    async def load(chain_id: str, store: str) -> str:
        if chain_id == "bad":
            raise RuntimeError("the store lied")
        return chain_id

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            warmer = LayerWarmer(nursery, load, keep=10, max_entries=2)
            assert warmer.warm(["bad", "unused", "over"], "s", served=lambda chain: False) == 2
            assert await warmer.take("bad", "s") is None  # the mount loads it itself
            await trio.sleep(11)
            stats = warmer.statistics()
            assert (stats.failed, stats.loaded, stats.expired, stats.ignored, stats.held) == (1, 1, 1, 1, 0)
            assert await warmer.take("unused", "s") is None
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_failed_load_frees_its_slot_at_once_and_a_result_no_mount_takes_is_discarded() -> None:
    discarded: list[str] = []

    async def load(chain_id: str, store: str) -> str:
        await trio.sleep(0.1)
        if chain_id.startswith("missing"):
            raise LayerNotConverted(f"{chain_id} is not converted")
        return chain_id

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            warmer = LayerWarmer(nursery, load, discard=discarded.append, keep=10, max_entries=2)
            assert warmer.warm(["missing-1", "missing-2"], "s", served=lambda chain: False) == 2
            await wait_until_async("both loads failed", lambda: warmer.statistics().failed == 2)
            assert warmer.statistics().held == 0  # their slots are free at once, not after `keep`
            assert warmer.warm(["real", "unused"], "s", served=lambda chain: False) == 2
            assert await warmer.take("real", "s") == "real"
            await trio.sleep(11)  # "unused" expires; the taken "real" is the mount's, never discarded
            stats = warmer.statistics()
            assert (stats.loaded, stats.taken, stats.expired, stats.held, stats.ignored) == (2, 1, 1, 0, 0)
            assert discarded == ["unused"]
            assert warmer.warm(["dropped"], "s", served=lambda chain: False) == 1
            await wait_until_async("the load finished", lambda: warmer.statistics().loaded == 3)
            nursery.cancel_scope.cancel()  # the server stops: what it holds is dropped, and discarded
        assert discarded == ["unused", "dropped"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- the layer server's warm ------------------------------------------------------------------------


pytestmark_server = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path_factory.mktemp("store")
    return store, build_store(store, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE,
                              layout=tmp_path_factory.mktemp("layout"))  # fmt: skip


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "root"
    stop_layer_servers(tmp_path / "root")


def _chain_requests(http: RangeHTTPServer, layers: list[BuiltLayer]) -> list[str]:
    names = {chain_object(layer.chain_id) for layer in layers}
    return [target for method, target, _ in http.requests if any(target.endswith(name) for name in names)]


@pytestmark_server
def test_layers_warmed_ahead_mount_without_asking_the_store_for_them_again(built: Any, root: Path) -> None:
    store, layers = built
    with RangeHTTPServer(store) as http:
        client = ensure_server(root, ServerSettings(store=http.url, retry_timeout=5))
        above = [layer.chain_id for layer in layers[1:]]
        assert client.warm(above) == len(above)
        assert client.warm(above) == 0  # loading or loaded already
        wait_until("the layers above loaded", lambda: client.status()["warm"]["loaded"] == len(above))
        asked = len(_chain_requests(http, layers[1:]))
        assert asked >= len(above)  # each chain record read (a size, then its bytes)
        lowers = [client.mount(layer.chain_id).lower_dir for layer in layers]
        assert len(_chain_requests(http, layers[1:])) == asked  # the mounts took what the warm loaded
        warm = client.status()["warm"]
        assert (warm["taken"], warm["failed"], warm["held"]) == (len(above), 0, 0)
        assert client.warm(above) == 0  # served now
    assert (Path(lowers[-1]) / "replace-me").read_bytes() == b"fourth and last\n"


@pytestmark_server
def test_a_mount_adds_the_image_phase_its_image_once_not_again_in_its_span(built: Any, root: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The image's blocks are fetched through the store's engine (``layers.bytes``); its ``layer.image``
    span says the image's size apart, so the profiler's image phase does not count it twice."""
    from bootseer.profile.events import ENV_PROFILE, read_spool

    store, layers = built
    monkeypatch.setenv(ENV_PROFILE, "1")  # the server's spool: ROOT/profile
    client = ensure_server(root, ServerSettings(store=f"file://{store}", retry_timeout=5, data_path="erofs"))
    client.mount(layers[0].chain_id)
    spans = lambda: [e for e in read_spool(root / "profile")[0] if e.name == "layer.image"]  # noqa: E731
    (image,) = wait_until("the layer.image span is spooled", spans)
    assert image.attrs["source"] == "store" and image.attrs["image_bytes"] > 0
    assert image.bytes == 0


@pytestmark_server
def test_a_warm_that_fails_leaves_the_mount_its_own_error_and_a_bad_request_is_refused(built: Any, root: Path) -> None:
    store, _ = built
    client = ensure_server(root, ServerSettings(store=f"file://{store}", retry_timeout=5))
    missing = "sha256:" + "0" * 64
    assert client.warm([missing]) == 1
    wait_until("the warm failed", lambda: client.status()["warm"]["failed"] == 1)
    with pytest.raises(LayerNotConverted, match="not converted"):
        client.mount(missing)
    with pytest.raises(InvalidRequest, match="chain_id"):
        client.warm(["latest"])
    with pytest.raises(InvalidRequest, match="chain_ids"):
        client.call({"op": "warm", "chain_ids": "sha256:" + "0" * 64})
    with pytest.raises(InvalidRequest, match="chain_ids"):
        client.warm([missing] * 65)
    assert ServerPaths(root).socket.exists()


@pytestmark_server
def test_a_warm_from_a_store_url_with_a_credential_never_shows_it(built: Any, root: Path) -> None:
    store, _ = built
    client = ensure_server(root, ServerSettings(store=f"file://{store}", retry_timeout=1))
    secret = "s3cr3t-t0ken"
    assert client.warm(["sha256:" + "1" * 64], store=f"http://user:{secret}@127.0.0.1:9/store") == 1
    wait_until("the warm failed", lambda: client.status()["warm"]["failed"] == 1, timeout=60)
    log = ServerPaths(root).log.read_text(errors="replace")
    assert "loading a layer ahead of its mount failed" in log
    assert secret not in log and secret not in json.dumps(client.status())


@pytestmark_server
def test_a_warm_of_chain_ids_the_store_lacks_leaves_its_slots_to_the_next_warm(built: Any, root: Path) -> None:
    """One stale ``layers-above`` label (ChainIDs the store lacks) fills every slot for as long as the loads
    fail, never for the keep time after: the next warm's real layer is loaded."""
    store, layers = built
    client = ensure_server(root, ServerSettings(store=f"file://{store}", retry_timeout=5))
    missing = [f"sha256:{n:064x}" for n in range(WARM_MAX_ENTRIES)]
    assert client.warm(missing) == WARM_MAX_ENTRIES
    wait_until("the loads failed", lambda: client.status()["warm"]["failed"] == WARM_MAX_ENTRIES)
    assert client.status()["warm"]["held"] == 0
    assert client.warm([layers[0].chain_id]) == 1
    wait_until("the real layer loaded", lambda: client.status()["warm"]["loaded"] == 1)
    warm = client.status()["warm"]
    assert (warm["ignored"], warm["held"]) == (0, 1)
    assert (Path(client.mount(layers[0].chain_id).lower_dir) / "etc/hosts").exists()
    assert client.status()["warm"]["taken"] == 1


@pytest.fixture(scope="module")
def doubled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    """One layer twice, one on the other: two ChainIDs whose records name one index and one EROFS image."""
    store = tmp_path_factory.mktemp("doubled")
    layer = Layer(tuple(File(f"small/s{n}.txt", f"small file {n}\n".encode() * (n + 1)) for n in range(8)))
    layers = build_store(store, [layer, layer], block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))
    assert layers[0].record.image == layers[1].record.image != ""
    return store, layers


@pytestmark_server
def test_a_warm_no_mount_takes_leaves_nothing_on_disk_once_no_load_uses_its_image(doubled: Any, tmp_path: Path) -> None:
    """A real server's loads on the ``erofs`` data path (no FUSE mount: loads mount nothing), the keep time
    jumped over: the image a warm kept (and its table copy) goes when it expires, but not while another
    load held for its mount uses the same image."""
    from bootseer.blockstore.datapath.choice import DataPathChoice
    from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig

    store, (first, second) = doubled
    clock = trio.testing.MockClock(rate=1)  # real time for the loads; the keep time is jumped over
    paths = ServerPaths(tmp_path / "root")
    image = paths.erofs_images / f"{first.record.image}.erofs-store"
    table_copy = paths.indexes / f"{first.record.image}.image-table"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            config = LayerServerConfig(root=paths.root, store=f"file://{store}", cache_dir=tmp_path / "cache")
            config.paths.indexes.mkdir(parents=True)
            server = LayerServer(config, nursery, DataPathChoice("erofs", "forced"))
            assert server.erofs is not None
            await trio.to_thread.run_sync(server.erofs.prepare)
            try:
                warm = server.warmer.statistics
                assert (await server._warm_request({"chain_ids": [first.chain_id]}))["warming"] == 1
                await wait_until_async("the first load", lambda: warm().loaded == 1)
                assert image.is_file()
                clock.jump(WARM_KEEP / 2)
                assert (await server._warm_request({"chain_ids": [second.chain_id]}))["warming"] == 1
                await wait_until_async("the second load", lambda: warm().loaded == 2)
                clock.jump(WARM_KEEP / 2 + 1)
                await wait_until_async("the first load expired", lambda: warm().expired == 1)
                assert image.is_file()  # the second load, held, uses it
                clock.jump(WARM_KEEP / 2)
                await wait_until_async("the second load expired", lambda: warm().expired == 2)
                assert (warm().held, os.listdir(paths.erofs_images), table_copy.exists()) == (0, [], False)
                assert server.loader.remembered() == []  # the loader forgets loads no one holds
            finally:
                server.erofs.checker.close()
                nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
