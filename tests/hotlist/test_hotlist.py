"""Hot lists: the object, first-writer-wins publishing, recording timers, attribution, and record/prefetch
through the real layer server objects (layer trees and their read hook, BlockFetcher, the fetch
engine over a converted ``file://`` store, the node block cache).

The service tests run a :class:`~bootseer.blockstore.server.layer_server.LayerServer` in-process without its
FUSE session: mounts load real chain records and indexes from the store, and reads go through the
same :class:`~bootseer.blockstore.datapath.tree.LayerOpenFile` the FUSE mount serves, with the opener's pid
set as the FUSE ``open`` handler sets it.  Attribution reads real ``cgroup`` files under a
``/proc``-shaped directory the test writes (the test process cannot be moved into containers' cgroups).
Timers run on trio's autojump clock.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import threading
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import trio

from bootseer.blockstore.objects.format import LayerIndex, pack_object
from bootseer.blockstore.datapath.tree import LayerFile
from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.fuse.operations import OPENER_PID
from bootseer.hotlist import attribution
from bootseer.hotlist.format import (
    PROFILE_LABEL,
    HotBlock,
    HotList,
    HotListError,
    hotlist_object,
    profile_of_object,
)
from bootseer.hotlist.prefetch import PrefetchLimits
from bootseer.hotlist.recorder import Recording, RecordingLimits, run_recording
from bootseer.hotlist.service import HotListConfig, HotListService
from tests.support import autojump
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.sealed import same_sealed_object
from tests.support.waiting import wait_until_async

BLOCK_SIZE = 64 << 10
IMAGE = "sha256:" + "ab" * 32
LOWER = "sha256:" + "cd" * 32


def _block(n: int, layer: str = IMAGE, at: float = 0.0) -> HotBlock:
    digest = hashlib.sha256(str(n).encode()).hexdigest()
    return HotBlock(layer, digest, "ee" * 32, n * 100, 50, 64, at)


def _list(**fields: Any) -> HotList:
    values: dict[str, Any] = dict(image=IMAGE, profile="", layers=[LOWER, IMAGE],
                                  blocks=[_block(1, LOWER, 0.1), _block(2, IMAGE, 0.2)], node="n1", container="c1")
    values.update(fields)
    return HotList(**values)


# -- the object -------------------------------------------------------------------------------


def test_round_trip_and_paths() -> None:
    hot = _list(profile="train", sealed_by="quiet", duration=3.5)
    back = HotList.decode(hot.encode(), expected_image=IMAGE, expected_profile="train")
    assert back == hot
    assert hotlist_object(IMAGE) == f"v1/hotlists/{'ab' * 32}/default"
    assert hotlist_object(IMAGE, "train") == f"v1/hotlists/{'ab' * 32}/profile.train"
    assert profile_of_object(hotlist_object(IMAGE, "train")) == "train"
    assert profile_of_object(hotlist_object(IMAGE)) == ""
    assert back.per_layer() == {LOWER: (1, 50), IMAGE: (1, 50)}
    with pytest.raises(HotListError, match="profile name"):
        hotlist_object(IMAGE, "../x")


#: ``STORED_LIST.encode()`` as the code before the sealed-object helper wrote it (zstd 1.5.7).
STORED_BYTES = base64.b64decode(
    "QlNIT1RMMDEBAAAAPwEAAAAAAACxHoUmedqr2w/4bwgZ5lHypqOQQcZFsUCgYpdzztiJpyi1L/1grQGtCQDmFUAfYEnrsyAiqsqP"
    "c9OhZIuBZo8gkOntyfZKx0IiAIBDAzkANAA2AA4d545hmDqYSl3EU9gftE5ITWh6Q6xUwF9oJTWXpGFUEvdgQmqyXiqZNlDkyi9o"
    "hCSVV8ZGgM8lQ6/4kzJ9Ph0DeSojNLG7SOkm3WVdTYZYMg6DuZv0vA1Bzs6Y7kftbSAjudPJuUd7MOUIfwtLag7srt2FsABvgOEA"
    "ZdYkgb/D1x6mJoxJh/Xh9q+U6tO+iOPUFDvc2IbwnvXEEHawgSR39j8NuQc+LAD8V8T32K70jwuWwBh7WaSmw1m5vCQ2XHhqxk8W"
    "CrlygRH4K/2KlivhL0nH5bXU5MVfEgBHBCB5KIgmwuI0sAgRKBgCdUkX4kStEKOYgUIAxOWGrDU2MyheLvE0aF0hOC7JOQE="
)


def test_a_list_stored_before_the_sealed_object_helper_reads_the_same_and_is_written_the_same() -> None:
    stored = _list(profile="train", sealed_by="quiet", duration=3.5, recorded_at="2026-12-01T19:00:00Z",
                   recorder="bootseer 0.1.0")  # fmt: skip
    assert HotList.decode(STORED_BYTES, expected_image=IMAGE, expected_profile="train") == stored
    assert same_sealed_object(stored.encode(), STORED_BYTES, (1, 5, 7))


def test_corrupt_truncated_foreign_and_inconsistent_lists_are_refused() -> None:
    data = hot_data = _list().encode()
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    for bad, message in [
        (bytes(flipped), "checksum"),
        (data[:-7], "checksum"),
        (data[:20], "truncated"),
        (b"BSLIDX01" + data[8:], "magic"),
        (data[:8] + (2).to_bytes(4, "little") + data[12:], "version"),
    ]:
        with pytest.raises(HotListError, match=message):
            HotList.decode(bad)
    other = "sha256:" + "99" * 32
    with pytest.raises(HotListError, match="foreign"):
        HotList.decode(hot_data, expected_image=other)
    with pytest.raises(HotListError, match="profile"):
        HotList.decode(hot_data, expected_image=IMAGE, expected_profile="train")
    with pytest.raises(HotListError, match="not a layer of the image"):
        _list(blocks=[_block(1, other)]).encode()
    with pytest.raises(HotListError, match="time order"):
        _list(blocks=[_block(1, at=2.0), _block(2, at=1.0)]).encode()
    with pytest.raises(HotListError, match="twice"):
        _list(blocks=[_block(1), _block(1)]).encode()
    with pytest.raises(HotListError, match="end with"):
        _list(layers=[IMAGE, LOWER]).encode()


# -- publishing -----------------------------------------------------------------------------------


def test_first_writer_wins_on_a_directory_store(tmp_path: Path) -> None:
    name = hotlist_object(IMAGE)
    lists = [_list(node=f"node{n}").encode() for n in range(16)]
    results: list[bool] = [False] * len(lists)
    barrier = threading.Barrier(len(lists))

    def publish(n: int) -> None:
        writer = FileStoreWriter(tmp_path / "store")
        barrier.wait()
        results[n] = writer.put_if_absent(name, lists[n])

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(len(lists))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(results) == 1
    stored = FileStoreWriter(tmp_path / "store").get(name)
    assert stored == lists[results.index(True)]
    assert HotList.decode(stored).node == f"node{results.index(True)}"
    # No temp file is left beside it, and a later writer changes nothing.
    assert [p.name for p in (tmp_path / "store").joinpath(*name.split("/")[:-1]).iterdir()] == ["default"]
    assert not FileStoreWriter(tmp_path / "store").put_if_absent(name, _list(node="late").encode())
    assert FileStoreWriter(tmp_path / "store").remove(name)
    assert not FileStoreWriter(tmp_path / "store").remove(name)


def test_first_writer_wins_on_s3(s3_bucket: Any) -> None:
    from bootseer.blockstore.objects.store import open_store_writer

    name = hotlist_object(IMAGE, "p")
    with open_store_writer(s3_bucket.url("store"), **s3_bucket.options) as writer:
        assert writer.put_if_absent(name, _list(profile="p", node="first").encode())
        assert not writer.put_if_absent(name, _list(profile="p", node="second").encode())
        assert HotList.decode(writer.get(name)).node == "first"
        assert writer.remove(name)
        assert not writer.exists(name)


# -- recording timers (autojump clock) ----------------------------------------------------------------


class _Index:
    """Enough of a LayerIndex for Recording.touch: blocks and packs."""

    def __init__(self, count: int) -> None:
        from bootseer.blockstore.objects.format import Block

        self.packs = ["ee" * 32]
        self.blocks = [Block(hashlib.sha256(bytes([n])).hexdigest(), 0, n * 10, 10, 100) for n in range(count)]


def _recording(upper: str | None = None) -> Recording:
    return Recording(container="c1", image=IMAGE, profile="", layers=[IMAGE], started=trio.current_time(), upper=upper)


def _autojump(fn: Any) -> Any:
    return autojump.run(fn, autojump=0, hold_for_threads=True)


def test_recording_seals_after_the_quiet_period_counted_from_the_first_block() -> None:
    async def main() -> None:
        recording = _recording()
        index = _Index(8)
        async with trio.open_nursery() as nursery:
            result: list[str] = []

            async def run() -> None:
                result.append(await run_recording(recording, RecordingLimits(quiet=10, window=120)))

            nursery.start_soon(run)
            await trio.sleep(30)  # nothing read yet: no quiet seal before the first block
            assert not recording.sealed.is_set()
            assert recording.touch(IMAGE, index, [0, 1, 1], trio.current_time()) == 2
            await trio.sleep(9)
            assert recording.touch(IMAGE, index, [1, 2], trio.current_time()) == 1  # 1 again is not new
            await trio.sleep(9.5)
            assert not recording.sealed.is_set()
            await trio.sleep(1)
        assert result == ["quiet"]
        assert [b.at for b in recording.blocks] == [30.0, 30.0, 39.0]
        assert recording.sealed_at == pytest.approx(49.0)

    _autojump(main)


def test_recording_seals_at_the_window_and_by_marker_and_explicitly(tmp_path: Path) -> None:
    async def window() -> None:
        recording = _recording()
        index = _Index(200)
        async with trio.open_nursery() as nursery:
            async def keep_reading() -> None:
                for n in range(200):
                    recording.touch(IMAGE, index, [n], trio.current_time())
                    await trio.sleep(1)

            nursery.start_soon(keep_reading)
            assert await run_recording(recording, RecordingLimits(quiet=10, window=120)) == "window"
            nursery.cancel_scope.cancel()
        assert trio.current_time() == pytest.approx(120)
        assert recording.touch(IMAGE, index, [199], trio.current_time()) == 0  # sealed: nothing more

    async def marker() -> None:
        recording = _recording(str(tmp_path))
        async with trio.open_nursery() as nursery:
            async def job() -> None:
                await trio.sleep(5)
                (tmp_path / ".bootseer-seal").touch()

            nursery.start_soon(job)
            assert await run_recording(recording, RecordingLimits()) == "marker"
        assert 5 <= trio.current_time() <= 5.5

    async def explicit() -> None:
        recording = _recording()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: trio.sleep(3))
            async def seal_later() -> None:
                await trio.sleep(3)
                assert recording.seal("seal")
                assert not recording.seal("removed")

            nursery.start_soon(seal_later)
            assert await run_recording(recording, RecordingLimits()) == "seal"

    _autojump(window)
    _autojump(marker)
    _autojump(explicit)


# -- attribution ----------------------------------------------------------------------------------


def test_cgroup_attribution(tmp_path: Path) -> None:
    cases = {
        11: "0::/default/job-1\n",  # ctr, cgroup v2
        12: "12:pids:/k8s.io/job-2\n4:memory:/k8s.io/job-2\n0::/\n",  # ctr, v1
        13: "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-job-3.scope/init\n",  # CRI systemd, nested
        14: "0::/user.slice/session-1.scope\n",  # a host process
    }
    for pid, text in cases.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    known = ["job-1", "job-2", "job-3"]
    found = {pid: attribution.container_of(attribution.cgroup_paths(pid, str(tmp_path)) or [], known) for pid in cases}
    assert found == {11: "job-1", 12: "job-2", 13: "job-3", 14: None}
    assert attribution.cgroup_paths(99, str(tmp_path)) is None
    assert attribution.cgroup_paths(0, str(tmp_path)) is None
    assert attribution.container_of(["/default/job-10"], ["job-1"]) is None  # whole components only
    assert attribution.container_id("ns-1/17/job-1") == "job-1" and attribution.container_id("job-1") == "job-1"


# -- record and prefetch through the layer server's objects --------------------------------------------


def _layers(seed: int = 1) -> list[Any]:
    import random

    rng = random.Random(seed)

    def blob(size: int) -> bytes:
        return rng.randbytes(size)

    base = (File("bin/tool", blob(5 * BLOCK_SIZE)), File("lib/libbig.so", blob(12 * BLOCK_SIZE)))
    app = (File("app/main.py", blob(3 * BLOCK_SIZE + 100)), File("app/data.bin", blob(20 * BLOCK_SIZE)),
           File("app/cold.bin", blob(8 * BLOCK_SIZE)))  # fmt: skip
    return [Layer(base), Layer(app)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    directory = tmp_path_factory.mktemp("store")
    layout = tmp_path_factory.mktemp("layout")
    built = build_store(directory, _layers(), block_size=BLOCK_SIZE, layout=layout)
    _LAYOUT_REFS[directory] = f"oci:{layout}:latest"
    return directory, built


_LAYOUT_REFS: dict[Path, str] = {}


class Proc:
    """A /proc-shaped directory: pid -> cgroup file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.next_pid = 1000

    def process(self, cgroup: str) -> int:
        self.next_pid += 1
        (self.root / str(self.next_pid)).mkdir(parents=True)
        (self.root / str(self.next_pid) / "cgroup").write_text(f"0::{cgroup}\n")
        return self.next_pid


class NodeUnderTest:
    """One node's layer server objects (no FUSE session) over the shared store."""

    def __init__(self, root: Path, store_url: str, nursery: trio.Nursery, proc: Proc, **hotlist: Any) -> None:
        config = LayerServerConfig(root=root, store=store_url)
        config.paths.indexes.mkdir(parents=True, exist_ok=True)
        self.server = LayerServer(config, nursery, extension=lambda host: HotListService(host, HotListConfig(**hotlist)))
        self.server.extension.proc = str(proc.root)
        self.proc = proc

    async def pull(self, built: list[BuiltLayer]) -> None:
        for layer in built:
            await self.server.mount(layer.chain_id)

    async def read(self, layer: BuiltLayer, path: str, pid: int, offset: int = 0, size: int | None = None) -> bytes:
        tree = self.server.layers[layer.chain_id].tree
        number = next(n for n, e in enumerate(tree.index.entries) if e.path == path)
        node = tree.node(number)
        assert isinstance(node, LayerFile)
        OPENER_PID.set(pid)  # as the FUSE open handler does
        opened = await node.open()
        return await opened.read(offset, node.entry.size if size is None else size)

    @property
    def hotlist(self) -> Any:
        return self.server.extension


def _expected(built: list[BuiltLayer], layer: int, path: str) -> bytes:
    import tarfile

    with tarfile.open(built[layer].blob) as tar:
        member = tar.extractfile(path)
        assert member is not None
        return member.read()


def run_nodes(store: tuple[Path, list[BuiltLayer]], tmp_path: Path, test: Any, **hotlist: Any) -> None:
    directory, built = store

    async def main() -> None:
        proc = Proc(tmp_path / "proc")
        async with trio.open_nursery() as nursery:
            def node(name: str, **more: Any) -> NodeUnderTest:
                return NodeUnderTest(tmp_path / name, str(directory), nursery, proc, **{**hotlist, **more})

            await test(node, built, proc)
            nursery.cancel_scope.cancel()

    # The store is a local directory read in worker threads: the clock holds still while one
    # runs, so a virtual sleep lets every store read started before it finish first.
    autojump.run(main, autojump=0.05, hold_for_threads=True)


@pytest.fixture
def clean_store(store: tuple[Path, list[BuiltLayer]]) -> Any:
    directory, built = store
    yield store
    writer = FileStoreWriter(directory)
    for name in writer.list(f"v1/hotlists/{built[-1].chain_id[7:]}"):
        writer.remove(name)


def test_first_boot_records_and_a_fresh_node_prefetches_before_the_reads(clean_store: Any, tmp_path: Path) -> None:
    directory, built = clean_store
    top = built[-1].chain_id

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        first = node("node1")
        await first.pull(built)
        job, neighbour = proc.process("/default/job-1"), proc.process("/default/other")
        answer = await first.hotlist.container_prepared("job-1", top, {}, None)
        assert answer == {"action": "record"}
        await trio.sleep(0.2)  # the store says there is no list yet
        assert _expected(built, 1, "app/main.py") == await first.read(built[1], "app/main.py", job)
        await trio.sleep(1)
        await first.read(built[0], "lib/libbig.so", job, 0, 4 * BLOCK_SIZE)
        await first.read(built[1], "app/cold.bin", neighbour)  # another container: not in the trace
        await first.read(built[1], "app/data.bin", job, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE)
        recording = first.hotlist.recordings["job-1"]
        assert (await first.hotlist.seal("job-1"))["sealed"]
        await recording.done.wait()  # (the autojump clock may pass seal's own wait while the store is written)
        assert recording.outcome == "published"
        stored = FileStoreWriter(directory).get(hotlist_object(top))
        hot = HotList.decode(stored, expected_image=top, expected_profile="")
        assert [b.layer for b in hot.blocks] == [built[1].chain_id] * 4 + [built[0].chain_id] * 4 + [built[1].chain_id] * 3
        cold = {built[1].index.blocks[r].digest for e in built[1].index.entries if e.path == "app/cold.bin" for r in e.blocks}
        assert not cold & {b.digest for b in hot.blocks}
        assert hot.blocks[0].at >= 0.2 and hot.blocks[4].at - hot.blocks[3].at >= 1.0
        assert hot.container == "job-1" and hot.sealed_by == "seal" and hot.layers == [b.chain_id for b in built]

        # A fresh node: new root, empty cache, same store.  Prefetch starts when the top layer is mounted.
        second = node("node2")
        await second.pull(built)
        await trio.sleep(0.5)
        prefetch = second.hotlist.prefetches[(top, "")]
        await prefetch.ended.wait()
        assert prefetch.stats.fetched_blocks == len(hot.blocks)
        job2 = proc.process("/default/job-2")
        assert (await second.hotlist.container_prepared("job-2", top, {}, None)) == {"action": "prefetch"}
        assert _expected(built, 1, "app/main.py") == await second.read(built[1], "app/main.py", job2)
        await second.read(built[0], "lib/libbig.so", job2, 0, 4 * BLOCK_SIZE)
        await second.read(built[1], "app/data.bin", job2, 2 * BLOCK_SIZE, 4 * BLOCK_SIZE)  # one block more than recorded
        stats = prefetch.stats
        assert (stats.hits, stats.waited, stats.misses) == (len(hot.blocks), 0, 1)
        fetcher = second.server.stores.opened_fetcher(str(directory))
        assert fetcher.statistics().blocks_fetched == len(hot.blocks) + 1  # every hot block once, by prefetch
        await second.hotlist.container_removed("job-2")
        assert (top, "") not in second.hotlist.prefetches
        summary = second.hotlist.finished[-1]
        assert summary["kind"] == "prefetch" and summary["hit_rate"] == pytest.approx(11 / 12, abs=1e-3)
        assert summary["unread_bytes"] == 0

    run_nodes(clean_store, tmp_path, test)


def test_statistics_show_a_running_recording_then_its_summary_and_status_is_them_as_json(
    clean_store: Any, tmp_path: Path
) -> None:
    """``HotListService.statistics()`` is what ``hotlist.status`` and the server's status show:
    a recording while it runs (its blocks so far), then, sealed, its summary; the publish store redacted."""
    directory, built = clean_store
    top = built[-1].chain_id
    publish = f"file://user:secret@localhost{directory}"

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        n = node("node1", publish_store=publish)
        await n.pull(built)
        job = proc.process("/default/job")
        assert (await n.hotlist.container_prepared("job", top, {}, None)) == {"action": "record"}
        await trio.sleep(0.2)  # the store says there is no list yet
        await n.read(built[1], "app/main.py", job)
        stats = n.hotlist.statistics()
        assert stats.enabled and stats.publish_store == f"file://localhost{directory}" and stats.finished == ()
        [running] = stats.recordings
        assert (running.container, running.readers, running.image, running.sealed_by) == ("job", "container", top, "")
        assert running.blocks == len(n.hotlist.recordings["job"].blocks) > 0
        assert n.hotlist.status()["recordings"] == [dataclasses.asdict(running)]
        assert (await n.server.status())["publish_store"] == f"file://localhost{directory}"
        recording = n.hotlist.recordings["job"]
        await n.hotlist.seal("job")
        await recording.done.wait()
        stats = n.hotlist.statistics()
        assert stats.recordings == () and [s["container"] for s in stats.finished] == ["job"]
        assert n.hotlist.status()["finished"] == list(stats.finished)
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.enabled = False  # type: ignore[misc]

    run_nodes(clean_store, tmp_path, test)


def test_profiles_keep_separate_lists_and_two_first_boots_leave_one(clean_store: Any, tmp_path: Path) -> None:
    directory, built = clean_store
    top = built[-1].chain_id

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        a, b = node("a"), node("b")
        await a.pull(built)
        await b.pull(built)
        pa, pb = proc.process("/default/ja"), proc.process("/k8s.io/cri-containerd-jb.scope")
        assert (await a.hotlist.container_prepared("ja", top, {}, None))["action"] == "record"
        assert (await b.hotlist.container_prepared("jb", top, {}, None))["action"] == "record"
        await trio.sleep(0.2)
        await a.read(built[1], "app/main.py", pa)
        await b.read(built[0], "bin/tool", pb)
        recordings = [a.hotlist.recordings["ja"], b.hotlist.recordings["jb"]]
        for recording in recordings:  # both seal on the quiet period
            await recording.done.wait()
        assert [r.sealed_by for r in recordings] == ["quiet", "quiet"]
        outcomes = sorted(summary["outcome"] for n in (a, b) for summary in n.hotlist.finished)
        assert outcomes == ["lost_race", "published"]
        hot = HotList.decode(FileStoreWriter(directory).get(hotlist_object(top)))
        winner = a if a.hotlist.finished[0]["outcome"] == "published" else b
        assert hot.container == ("ja" if winner is a else "jb")

        # A profile has its own list: recording it leaves the default one alone.
        c = node("c")
        await c.pull(built)
        await trio.sleep(0.5)
        assert (top, "") in c.hotlist.prefetches  # the default list, started at the pull
        pc = proc.process("/default/jc")
        answer = await c.hotlist.container_prepared("jc", top, {PROFILE_LABEL: "eval"}, None)
        assert answer["action"] == "record"
        assert (top, "") not in c.hotlist.prefetches  # the default guess stops for another profile
        await trio.sleep(0.2)
        await c.read(built[1], "app/cold.bin", pc, 0, BLOCK_SIZE)
        recording = c.hotlist.recordings["jc"]
        await c.hotlist.container_removed("jc")
        await recording.done.wait()
        assert c.hotlist.finished[-1]["sealed_by"] == "removed"
        evaluation = HotList.decode(FileStoreWriter(directory).get(hotlist_object(top, "eval")), expected_profile="eval")
        assert len(evaluation.blocks) == 1
        assert HotList.decode(FileStoreWriter(directory).get(hotlist_object(top))) == hot

    run_nodes(clean_store, tmp_path, test, recording=RecordingLimits(quiet=10, window=120))


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "mismatch"])
def test_a_bad_hot_list_is_ignored(clean_store: Any, tmp_path: Path, damage: str) -> None:
    directory, built = clean_store
    top = built[-1].chain_id
    layers = [b.chain_id for b in built]
    index = built[1].index
    block = index.blocks[0]
    good = HotList(top, "", layers, [HotBlock(layers[1], block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen, 0.1)])
    data = good.encode()
    if damage == "corrupt":
        data = data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "foreign":
        data = HotList(layers[0], "", layers[:1], []).encode()
    else:  # right image, but a block its layer's index does not hold there
        data = HotList(top, "", layers, [HotBlock(layers[1], block.digest, index.packs[block.pack], block.offset + 1,
                                                  block.clen, block.rlen, 0.1)]).encode()  # fmt: skip
    FileStoreWriter(directory).put(hotlist_object(top), data)

    reason = "mismatch" if damage == "mismatch" else "invalid"

    def ignored() -> float:
        return prometheus_client.REGISTRY.get_sample_value("bootseer_hotlist_ignored_total", {"reason": reason}) or 0.0

    before = ignored()

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        n = node("n")
        await n.pull(built)
        await trio.sleep(0.5)  # the clock holds while the store is read: the pull's lookup is done
        assert ignored() == before + 1  # it found the list and refused it
        assert not n.hotlist.prefetches
        pid = proc.process("/default/j")
        await n.hotlist.container_prepared("j", top, {}, None)
        await trio.sleep(0.5)
        assert ignored() == before + 2  # the prepare's lookup refused it too
        assert not n.hotlist.prefetches and not n.hotlist.recordings  # neither used nor overwritten
        assert _expected(built, 1, "app/main.py") == await n.read(built[1], "app/main.py", pid)
        assert FileStoreWriter(directory).get(hotlist_object(top)) == data

    run_nodes(clean_store, tmp_path, test)


def test_reads_overtake_a_long_prefetch_through_a_read_only_http_front(
    clean_store: Any, tmp_path: Path, range_http_factory: Any
) -> None:
    """The store behind a read-only HTTP front: the whole base layer is hot, prefetched in the
    default batches.  While the front holds every prefetch request of the base layer's packs
    (a prefetch as long as the test wants), a read of a cold block is served: it overtook the
    prefetch, by construction, not by a time it took.  A read of a hot block whose batch is in
    flight waits on that fetch: once the front answers, that block has been fetched once."""
    directory, built = clean_store
    top = built[-1].chain_id
    layers = [b.chain_id for b in built]
    index: LayerIndex = built[0].index
    hot_blocks = [HotBlock(layers[0], b.digest, index.packs[b.pack], b.offset, b.clen, b.rlen, 0.0)
                  for b in index.blocks if not b.is_zero]  # fmt: skip
    FileStoreWriter(directory).put(hotlist_object(top), HotList(top, "", layers, hot_blocks).encode())
    base_packs = {"/" + pack_object(name) for name in index.packs}
    assert not base_packs & {"/" + pack_object(name) for name in built[1].index.packs}  # cold.bin is elsewhere
    front = range_http_factory(directory)
    release = front.faults.hold(base_packs)

    async def main() -> None:
        proc = Proc(tmp_path / "proc")
        async with trio.open_nursery() as nursery:
            # One block per batch and as many batches as it may have in flight: the server's cap
            # (half the engine's streams) is what leaves the read a stream.
            n = NodeUnderTest(tmp_path / "n", front.url, nursery, proc,
                              prefetch=PrefetchLimits(concurrency=64, batch_bytes=BLOCK_SIZE))
            await n.pull(built)
            await wait_until_async("the prefetch to start", lambda: (top, "") in n.hotlist.prefetches)
            prefetch = n.hotlist.prefetches[(top, "")]
            await wait_until_async("a prefetch request held by the front", lambda: front.faults.waiting > 0)
            pid = proc.process("/default/j")
            assert (await n.hotlist.container_prepared("j", top, {}, None)) == {"action": "prefetch"}
            with trio.fail_after(60):
                data = await n.read(built[1], "app/cold.bin", pid, 0, BLOCK_SIZE)
            assert data == _expected(built, 1, "app/cold.bin")[:BLOCK_SIZE]
            # Served while no prefetch batch has come back: the read went ahead of all of them.
            assert prefetch.stats.fetched_blocks == 0 and not prefetch.ended.is_set()
            assert (prefetch.stats.misses, prefetch.stats.waited) == (1, 0)

            # A hot block whose batch is in flight (held at the front): the read waits on that fetch.
            digest = next(iter(prefetch.in_flight))
            entry, number = next((e, k) for e in index.entries for k, ref in enumerate(e.blocks)
                                 if index.blocks[ref].digest == digest)  # fmt: skip
            read: list[bytes] = []

            async def read_in_flight() -> None:
                read.append(await n.read(built[0], entry.path, pid, number * BLOCK_SIZE, BLOCK_SIZE))

            nursery.start_soon(read_in_flight)
            await wait_until_async("the read to wait on the in-flight block", lambda: prefetch.stats.waited == 1)
            assert not read
            release.set()
            with trio.fail_after(60):
                await prefetch.ended.wait()
            await wait_until_async("the waiting read to be served", lambda: read)
            assert read == [_expected(built, 0, entry.path)[number * BLOCK_SIZE:(number + 1) * BLOCK_SIZE]]
            assert (prefetch.stats.misses, prefetch.stats.waited) == (1, 1)
            assert prefetch.stats.fetched_blocks == len(hot_blocks)
            fetcher = n.server.stores.opened_fetcher(front.url)
            assert fetcher.statistics().blocks_fetched == len(hot_blocks) + 1  # the waited-on block was fetched once
            await n.hotlist.container_removed("j")
            nursery.cancel_scope.cancel()

    trio.run(main)  # the real clock: the front is a real server in threads


# -- the command line -----------------------------------------------------------------------------


def _cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    from bootseer.cli import main

    status = main(["hotlist", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_show_clear_record_and_seal(clean_store: Any, capsys: Any, tmp_path: Path) -> None:
    directory, built = clean_store
    ref = _LAYOUT_REFS[directory]
    top = built[-1].chain_id
    layers = [b.chain_id for b in built]
    index = built[1].index
    blocks = [HotBlock(layers[1], b.digest, index.packs[b.pack], b.offset, b.clen, b.rlen, 0.5 + n)
              for n, b in enumerate(index.blocks[:3])]  # fmt: skip
    FileStoreWriter(directory).put(hotlist_object(top), HotList(top, "", layers, blocks, node="n7", container="job",
                                                                sealed_by="marker").encode())  # fmt: skip
    status, out, _ = _cli(capsys, "show", ref, "--store", str(directory))
    assert status == 0
    assert f"image      {top}" in out and "blocks     3" in out and "on n7 (container job" in out
    assert "span       0.5s .. 2.5s after prepare (2.0s)" in out
    assert f"layer {layers[1]}        3 blocks" in out and f"layer {layers[0]}        0 blocks" in out
    status, out, _ = _cli(capsys, "show", top, "--store", str(directory), "--json")
    [document] = __import__("json").loads(out)
    assert status == 0 and document["bytes"] == sum(b.clen for b in blocks) and document["sealed_by"] == "marker"

    assert _cli(capsys, "show", top, "--store", str(directory), "--profile", "eval")[0] == 1
    status, _, err = _cli(capsys, "show", top, "--store", str(directory), "--profile", "../x")
    assert status == 2 and "profile name" in err
    status, _, err = _cli(capsys, "show", "sha256:nothex", "--store", str(directory))
    assert status == 2 and "ChainID" in err

    FileStoreWriter(directory).put(hotlist_object(top, "bad"), b"BSHOTL01" + bytes(60))
    status, _, err = _cli(capsys, "show", top, "--store", str(directory), "--profile", "bad")
    assert status == 2 and "unusable" in err and "version 0" in err
    status, out, _ = _cli(capsys, "clear", top, "--store", str(directory), "--all")
    assert status == 0 and out.count("removed ") == 2
    assert _cli(capsys, "clear", top, "--store", str(directory))[0] == 1
    status, out, _ = _cli(capsys, "record", ref, "--store", str(directory))
    assert status == 0 and "records a new one" in out
    status, _, err = _cli(capsys, "clear", top, "--store", "http://127.0.0.1:9/")
    assert status == 2 and "read-only" in err

    status, _, err = _cli(capsys, "seal", "job", "--root", str(tmp_path))
    assert status == 2 and "no layer server" in err


def test_cold_remainder_is_fetched_after_the_hot_blocks_at_the_rate_given(clean_store: Any, tmp_path: Path) -> None:
    directory, built = clean_store
    top = built[-1].chain_id
    layers = [b.chain_id for b in built]
    index = built[1].index
    first = index.blocks[0]
    FileStoreWriter(directory).put(hotlist_object(top), HotList(top, "", layers, [
        HotBlock(layers[1], first.digest, index.packs[first.pack], first.offset, first.clen, first.rlen, 0.0)]).encode())
    stored = {b.digest: b.clen for layer in built for b in layer.index.blocks if not b.is_zero}
    rate = 1 << 20

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        n = node("n", prefetch=PrefetchLimits(cold_rate=rate, batch_bytes=256 << 10))
        await n.pull(built)
        while (top, "") not in n.hotlist.prefetches:
            await trio.sleep(0.01)
        prefetch = n.hotlist.prefetches[(top, "")]
        started = trio.current_time()
        await prefetch.ended.wait()
        elapsed = trio.current_time() - started
        assert prefetch.stats.fetched_blocks == 1
        assert prefetch.stats.cold_blocks == len(stored) - 1
        assert prefetch.stats.cold_bytes == sum(stored.values()) - first.clen
        assert elapsed >= (prefetch.stats.cold_bytes - (256 << 10)) / rate  # rate-limited (virtual clock)
        cache = n.server.cache
        assert all(cache.get(digest) is not None for digest in stored)

    run_nodes(clean_store, tmp_path, test)


def test_an_opener_without_a_cgroup_is_recorded_to_the_one_recording_and_counted(clean_store: Any, tmp_path: Path) -> None:
    directory, built = clean_store
    top = built[-1].chain_id

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        n = node("n")
        await n.pull(built)
        assert (await n.hotlist.container_prepared("ns/3/job", top, {}, None)) == {"action": "record"}
        await trio.sleep(0.2)
        recording = n.hotlist.recordings["job"]
        await n.read(built[1], "app/main.py", 0)  # pid 0: no cgroup to read
        await n.read(built[1], "app/cold.bin", proc.process("/default/someone-else"), 0, BLOCK_SIZE)
        assert len(recording.blocks) == 4 and recording.unattributed == 0
        # A second recording of another profile covers the same layers: an unknown opener is now ambiguous.
        assert (await n.hotlist.container_prepared("ns/4/job-b", top, {PROFILE_LABEL: "b"}, None))["action"] == "record"
        await trio.sleep(0.2)
        await n.read(built[0], "bin/tool", 999999)  # a pid with no /proc entry
        assert len(recording.blocks) == 4 and recording.unattributed == 1
        assert n.hotlist.recordings["job-b"].unattributed == 1
        for key in ("ns/3/job", "ns/4/job-b"):
            await n.hotlist.container_removed(key)
        await recording.done.wait()
        assert HotList.decode(FileStoreWriter(directory).get(hotlist_object(top))).unattributed == 1

    run_nodes(clean_store, tmp_path, test)


def test_a_blob_read_of_a_block_a_warmer_is_reading_is_left_out_of_the_recording(clean_store: Any, tmp_path: Path) -> None:
    """On EROFS every blob read names no reader (pid 0); one of a block that a page-cache warmer announced in
    WarmReads is the warmer's own and is not recorded, the rest of the same read is, and so is that block
    once no warmer reads it."""
    directory, built = clean_store
    top = built[-1].chain_id

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        n = node("n")
        await n.pull(built)
        assert (await n.hotlist.container_prepared("ns/5/job", top, {}, None)) == {"action": "record"}
        await trio.sleep(0.2)
        recording = n.hotlist.recordings["job"]
        layer = built[0]
        index = n.server.layers[layer.chain_id].tree.index
        stored = [number for number, block in enumerate(index.blocks) if not block.is_zero]
        warmed, other = stored[0], stored[1]
        with n.hotlist.warm_reads.reading(layer.chain_id, warmed):
            n.hotlist.blob_read(layer.chain_id, index, [warmed, other], 0)
            n.hotlist.blob_read(layer.chain_id, index, [warmed], 0)
        assert [block.digest for block in recording.blocks] == [index.blocks[other].digest]
        n.hotlist.blob_read(layer.chain_id, index, [warmed], 0)  # the warmer is done: a job's read
        assert [block.digest for block in recording.blocks] == [index.blocks[other].digest, index.blocks[warmed].digest]
        await n.hotlist.container_removed("ns/5/job")
        await recording.done.wait()

    run_nodes(clean_store, tmp_path, test)


def test_a_prefix_recording_takes_every_reader_a_container_does_not_claim(clean_store: Any, tmp_path: Path) -> None:
    """``readers: any`` (a bare-metal prefix): host processes' reads are its, a recorded container's stay the container's."""
    directory, built = clean_store
    top = built[-1].chain_id

    async def test(node: Any, built: list[BuiltLayer], proc: Proc) -> None:
        n = node("n")
        await n.pull(built)
        answer = await n.hotlist.dispatch("hotlist.prepared", {"key": "deps-prefix-1", "parent": top, "readers": "any"})
        assert answer == {"action": "record"}
        with pytest.raises(Exception, match="readers must be"):
            await n.hotlist.dispatch("hotlist.prepared", {"key": "x", "parent": top, "readers": "some"})
        await trio.sleep(0.2)
        prefix = n.hotlist.recordings["deps-prefix-1"]
        await n.read(built[1], "app/main.py", proc.process("/user.slice/session-3.scope"))  # a host shell
        await n.read(built[0], "bin/tool", 0, 0, BLOCK_SIZE)  # no cgroup to read: still the prefix's
        assert len(prefix.blocks) == 5 and prefix.unattributed == 0
        # A container recorded on another profile of the same layers keeps its own reads.
        assert (await n.hotlist.container_prepared("ns/4/job-b", top, {PROFILE_LABEL: "b"}, None))["action"] == "record"
        await trio.sleep(0.2)
        await n.read(built[1], "app/cold.bin", proc.process("/default/job-b"), 0, BLOCK_SIZE)
        assert len(prefix.blocks) == 5 and len(n.hotlist.recordings["job-b"].blocks) == 1
        # Removed, then its layers unmounted at once (deps release): the list is still published to the store.
        await n.hotlist.dispatch("hotlist.removed", {"key": "deps-prefix-1"})
        for layer in reversed(built):
            await n.server.unmount(layer.chain_id)
        await prefix.done.wait()
        assert prefix.outcome == "published"
        hot = HotList.decode(FileStoreWriter(directory).get(hotlist_object(top)), expected_image=top, expected_profile="")
        assert hot.container == "deps-prefix-1" and len(hot.blocks) == 5 and hot.sealed_by == "removed"
        await n.hotlist.container_removed("ns/4/job-b")

    run_nodes(clean_store, tmp_path, test)


def test_the_page_cache_warmer_places_each_block_in_every_file_that_holds_it(tmp_path: Path) -> None:
    """Blocks go to (inode, offset) of each file backing them (dedup: all of them), a file's last block cut short;
    files are looked up once; a kernel without store notifications turns warming off."""
    import errno
    import os
    import random

    from bootseer.blockstore.datapath.tree import inode_number
    from bootseer.hotlist.format import HotBlock, ResolvedBlock
    from bootseer.hotlist.warm import PageCacheWarmer, TreeTarget

    rng = random.Random(7)
    shared, tail = rng.randbytes(BLOCK_SIZE), rng.randbytes(BLOCK_SIZE + 100)
    layers = [Layer((File("a/one.bin", shared), File("b/two.bin", shared), File("c/tail.bin", tail)))]
    [built] = build_store(tmp_path / "store", layers, block_size=BLOCK_SIZE, layout=tmp_path / "layout")
    index, layer = built.index, built.chain_id
    mount = tmp_path / "mnt"
    for entry in index.entries:  # what the mount shows, for the warmer's lookups
        (mount / entry.path).parent.mkdir(parents=True, exist_ok=True)
        if entry.blocks:
            (mount / entry.path).write_bytes(b"")
    numbers = {e.path: n for n, e in enumerate(index.entries)}

    def resolved(path: str, position: int) -> tuple[ResolvedBlock, bytes]:
        ref = index.entries[numbers[path]].blocks[position]
        block = index.blocks[ref]
        data = (shared if path != "c/tail.bin" else tail)[position * BLOCK_SIZE : (position + 1) * BLOCK_SIZE]
        hot = HotBlock(layer, block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen, 0.0)
        return ResolvedBlock(layer=layer, ref=ref, hot=hot), data

    stored: list[tuple[int, int, bytes]] = []
    stats: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        stats.append(str(path))
        return real_stat(path, *args, **kwargs)

    plan = [resolved("a/one.bin", 0), resolved("c/tail.bin", 0), resolved("c/tail.bin", 1)]
    warmer = PageCacheWarmer({layer: index}, {layer: TreeTarget(3, str(mount))}, {b.hot.digest for b, _ in plan},
                             store=lambda inode, offset, data: stored.append((inode, offset, data)))  # fmt: skip
    os.stat = counting_stat  # type: ignore[assignment]
    try:
        done = warmer.warm(layer, [b for b, _ in plan], [d for _, d in plan])
    finally:
        os.stat = real_stat  # type: ignore[assignment]
    inode = {path: inode_number(3, n) for path, n in numbers.items()}
    assert stored == [(inode["a/one.bin"], 0, shared), (inode["b/two.bin"], 0, shared),
                      (inode["c/tail.bin"], 0, tail[:BLOCK_SIZE]), (inode["c/tail.bin"], BLOCK_SIZE, tail[BLOCK_SIZE:])]  # fmt: skip
    assert done == warmer.stored_bytes == 2 * BLOCK_SIZE + len(tail)
    assert sorted(stats) == sorted(str(mount / p) for p in ("a/one.bin", "b/two.bin", "c/tail.bin"))  # once each

    def no_store(inode: int, offset: int, data: bytes) -> None:
        raise OSError(errno.ENOSYS, "no store notifications")

    off = PageCacheWarmer({layer: index}, {layer: TreeTarget(3, str(mount))}, {b.hot.digest for b, _ in plan}, store=no_store)
    assert off.warm(layer, [b for b, _ in plan], [d for _, d in plan]) == 0 and not off.enabled and off.skipped == 1


def test_layer_server_hot_list_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from bootseer.hotlist.cli import add_layer_server_arguments, layer_server_hotlist_config

    # The publish store is an option (the daemon passes its [hotlist] publish_store), never the environment.
    monkeypatch.setenv("BOOTSEER_PUBLISH_STORE", "/from/the/environment")
    parser = argparse.ArgumentParser()
    add_layer_server_arguments(parser)
    config = layer_server_hotlist_config(parser.parse_args(["--hotlist-quiet", "3", "--prefetch-batch", "1M"]))
    assert config.recording.quiet == 3 and config.prefetch.batch_bytes == 1 << 20 and config.enabled
    assert config.publish_store is None and config.prefetch.page_cache
    assert not layer_server_hotlist_config(parser.parse_args(["--no-prefetch-page-cache"])).prefetch.page_cache
    with pytest.raises(ValueError, match="read-only"):
        layer_server_hotlist_config(parser.parse_args(["--publish-store", "http://127.0.0.1:9/"]))
    with pytest.raises(ValueError, match="positive"):
        layer_server_hotlist_config(parser.parse_args(["--hotlist-window", "0"]))
    with pytest.raises(ValueError, match="plain file name"):
        layer_server_hotlist_config(parser.parse_args(["--hotlist-marker", "../x"]))


def test_a_node_behind_a_read_only_front_publishes_to_the_publish_store(
    clean_store: Any, tmp_path: Path, nginx_factory: Any
) -> None:
    """Nodes read the store through nginx (http: read-only); the recording goes to --publish-store (the
    directory nginx serves), and the next node finds it through the http URL."""
    directory, built = clean_store
    top = built[-1].chain_id
    front = nginx_factory(directory)

    async def main() -> None:
        proc = Proc(tmp_path / "proc")
        async with trio.open_nursery() as nursery:
            first = NodeUnderTest(tmp_path / "a", front.url, nursery, proc, publish_store=str(directory))
            await first.pull(built)
            pid = proc.process("/default/j1")
            assert (await first.hotlist.container_prepared("j1", top, {}, None)) == {"action": "record"}
            recording = first.hotlist.recordings["j1"]  # recording from the prepare on, while the store is asked
            await first.read(built[1], "app/main.py", pid)
            await first.hotlist.container_removed("j1")
            await recording.done.wait()
            assert recording.outcome == "published" and len(recording.blocks) == 4
            second = NodeUnderTest(tmp_path / "b", front.url, nursery, proc)
            await second.pull(built)
            with trio.fail_after(30):
                while (top, "") not in second.hotlist.prefetches:
                    await trio.sleep(0.01)
            prefetch = second.hotlist.prefetches[(top, "")]
            await prefetch.ended.wait()
            assert prefetch.stats.fetched_blocks == 4
            # Without --publish-store, a node behind the front cannot publish: a clear error, nothing written.
            FileStoreWriter(directory).remove(hotlist_object(top))  # before the pull, whose lookup would find it
            third = NodeUnderTest(tmp_path / "c", front.url, nursery, proc)
            await third.pull(built)
            assert (await third.hotlist.container_prepared("j3", top, {}, None)) == {"action": "record"}
            recording = third.hotlist.recordings["j3"]
            await third.read(built[1], "app/main.py", proc.process("/default/j3"))
            await third.hotlist.container_removed("j3")
            await recording.done.wait()
            assert recording.outcome == "failed"
            assert "read-only" in third.hotlist.finished[-1]["error"]
            assert not FileStoreWriter(directory).exists(hotlist_object(top))
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_hit_rate_counts_what_the_warmed_page_cache_served() -> None:
    """A prefetched job whose every read the warmed page cache answered (no read reached the layer server) has a
    hit rate of 1, not None (issue 17: a working prefetch looked unused); FUSE hits and misses still count."""
    from bootseer.hotlist.prefetch import PrefetchStats

    warmed_only = PrefetchStats(planned_blocks=6, fetched_blocks=6, served_from_page_cache_blocks=6).as_dict()
    assert (warmed_only["hits"], warmed_only["misses"], warmed_only["hit_rate"]) == (0, 0, 1.0)
    mixed = PrefetchStats(hits=1, waited=1, misses=2, served_from_page_cache_blocks=4).as_dict()
    assert mixed["hit_rate"] == pytest.approx(6 / 8)
    assert PrefetchStats(misses=3).as_dict()["hit_rate"] == 0.0
    assert PrefetchStats().as_dict()["hit_rate"] is None  # nothing read at all: no rate
