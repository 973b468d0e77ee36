"""Remote snapshots: the snapshot logic of lazily served layers, on real mounts.

The layers come from :class:`tests.support.snapshots.DirectoryLayers`, a real
:class:`~bootseer.snapshotter.backend.LayerBackend` that serves each "converted" layer
as a read-only bind mount (the FUSE layer server has its own tests; here what is
tested is what the snapshotter does with a backend: Prepare with
``containerd.io/snapshot.ref``, the two phases and a crash between them, fallbacks,
Remove/Cleanup/restore).  :class:`~bootseer.snapshotter.layer_backend.LayerServerBackend`'s
store lookup is tested against real ``file://`` and ``http://`` stores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import prometheus_client
import pytest

from bootseer.blockstore.server.client import LayerServerClient, LayerServerError, ServerSettings

from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.format import ChainRecord, chain_object
from bootseer.images.chains import LABEL_LAYERS_ABOVE, chain_id
from bootseer.fetch.engine import EngineConfig
from bootseer.snapshotter.errors import AlreadyExists, FailedPrecondition, LayerUnavailable, NotFound
from bootseer.snapshotter.layer_backend import LayerServerBackend
from bootseer.snapshotter.snapshots import REF_LABEL, Snapshotter
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2 as api
from bootseer.snapshotter.types import Kind, Mount, Usage
from tests.support.daemon import scrape, started_record
from tests.support.processes import wait_process_gone
from tests.support.waiting import free_port
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File
from tests.support.snapshots import DirectoryLayers, is_mountpoint, mounted, read_tree, snapshot_dirs
from tests.support.layers import Layer as TarLayer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

DIFF_A = "sha256:" + "a" * 64
DIFF_B = "sha256:" + "b" * 64
CHAIN_A = chain_id("", DIFF_A)
CHAIN_B = chain_id(CHAIN_A, DIFF_B)
GC_ROOT = {"containerd.io/gc.root": "test"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def layers(tmp_path: Path):
    backend = DirectoryLayers(tmp_path / "store", tmp_path / "mnt")
    backend.convert(CHAIN_A, "", {"a": "base", "etc/conf": "from A"}, diff_id=DIFF_A)
    backend.convert(CHAIN_B, CHAIN_A, {"b": "second", "etc/conf": "from B"}, diff_id=DIFF_B)
    yield backend
    backend.close()


@pytest.fixture
def sn(root: Path, layers: DirectoryLayers):
    snapshotter = Snapshotter(root, layers)
    yield snapshotter
    snapshotter.close()


def unpack_labels(chain: str) -> dict[str, str]:
    """What containerd 1.6's unpacker passes to Prepare (unpacker.go), plus the CRI hints."""
    return {REF_LABEL: chain, "containerd.io/snapshot/cri.image-ref": "example.com/app:1", **GC_ROOT}


def fallbacks(reason: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value("bootseer_snapshotter_remote_fallbacks_total", {"reason": reason}) or 0.0


def rows(root: Path) -> list[tuple]:
    with sqlite3.connect(root / "metadata.db") as db:
        return db.execute("SELECT key, kind, backing, state, remote_ref FROM snapshots ORDER BY id").fetchall()


def prepare_remote(sn: Snapshotter, key: str, parent: str, chain: str) -> None:
    with pytest.raises(AlreadyExists, match="served lazily"):
        sn.prepare(key, parent, unpack_labels(chain))


# -- Prepare of a converted layer ------------------------------------------------------------


def test_converted_layers_are_committed_remote_and_answer_already_exists(
    sn: Snapshotter, layers: DirectoryLayers, tmp_path: Path
):
    prepare_remote(sn, f"extract-1 {CHAIN_A}", "", CHAIN_A)
    prepare_remote(sn, f"extract-2 {CHAIN_B}", CHAIN_A, CHAIN_B)

    # What the unpacker does next: Stat(chainID) finds the layer, the extract key is gone.
    info = sn.stat(CHAIN_B)
    assert (info.kind, info.parent) == (Kind.COMMITTED, CHAIN_A)
    assert info.labels == unpack_labels(CHAIN_B)
    with pytest.raises(NotFound):
        sn.stat(f"extract-2 {CHAIN_B}")
    assert [i.name for i in sn.list(["kind==committed"])] == sorted([CHAIN_A, CHAIN_B])
    assert [i.name for i in sn.list([f'labels."{REF_LABEL}"=={CHAIN_B}'])] == [CHAIN_B]
    assert sn.usage(CHAIN_A) == Usage(size=0, inodes=2)  # no bytes under the root; the index's entries
    assert [call for call in layers.calls if call[0] == "mount"] == [("mount", CHAIN_A), ("mount", CHAIN_B)]

    # A container on top reads both lazy layers through overlayfs and writes its own upper.
    mounts = sn.prepare("container", CHAIN_B, GC_ROOT)
    (mount,) = mounts
    assert f"lowerdir={layers.lower_dir(CHAIN_B)}:{layers.lower_dir(CHAIN_A)}" in mount.options
    with mounted(mounts, tmp_path / "rootfs") as rootfs:
        assert read_tree(rootfs) == {"a": "base", "b": "second", "etc": "/", "etc/conf": "from B"}
        (rootfs / "new").write_text("written by the container")
    sn.commit("container-layer", "container")
    assert sn.stat("container-layer").parent == CHAIN_B

    # A view of one remote layer is a read-only bind mount of its lower dir.
    (view,) = sn.view("view", CHAIN_A)
    assert (view.type, view.source, view.options) == ("bind", str(layers.lower_dir(CHAIN_A)), ("ro", "rbind"))
    assert all(state == "ready" for *_, state, _ in rows(sn.root))


def test_a_prepare_naming_the_layers_above_has_the_backend_load_those_not_held_first(
    sn: Snapshotter, layers: DirectoryLayers
):
    chain_c = chain_id(CHAIN_B, "sha256:" + "c" * 64)
    prepare_remote(sn, "extract-1", "", CHAIN_A)
    layers.calls.clear()
    # CHAIN_A is held already; a malformed ChainID is the caller's word, and dropped.
    labels = {**unpack_labels(CHAIN_B), LABEL_LAYERS_ABOVE: f"{CHAIN_A},{chain_c},not-a-chain"}
    with pytest.raises(AlreadyExists, match="served lazily"):
        sn.prepare("extract-2", CHAIN_A, labels)
    # Once this layer is mounted (its own load never waits behind theirs).
    assert layers.calls == [("lookup", CHAIN_B), ("mount", CHAIN_B), ("warm", chain_c)]


def test_a_backend_whose_load_ahead_fails_unexpectedly_still_serves_the_layer_lazily(
    sn: Snapshotter, layers: DirectoryLayers, monkeypatch: pytest.MonkeyPatch
):
    def broken(chain_ids) -> None:
        raise RuntimeError("a bug in the backend's warm")

    monkeypatch.setattr(layers, "warm", broken)
    chain_c = chain_id(CHAIN_A, "sha256:" + "c" * 64)
    prepare_remote(sn, "extract-1", "", CHAIN_A)  # and no label: no warm asked
    with pytest.raises(AlreadyExists, match="served lazily"):
        sn.prepare("extract-2", CHAIN_A, {**unpack_labels(CHAIN_B), LABEL_LAYERS_ABOVE: chain_c})
    assert sn.stat(CHAIN_B).kind is Kind.COMMITTED


def test_prepare_of_an_existing_chain_answers_already_exists_without_a_mount(sn: Snapshotter, layers: DirectoryLayers):
    prepare_remote(sn, "extract-1", "", CHAIN_A)
    layers.calls.clear()
    with pytest.raises(AlreadyExists):
        sn.prepare("extract-again", "", unpack_labels(CHAIN_A))
    assert layers.calls == []
    with pytest.raises(NotFound):
        sn.stat("extract-again")


def test_the_mount_runs_outside_the_metadata_transaction(sn: Snapshotter, layers: DirectoryLayers):
    # A slow store: while the layer is being mounted, every other call goes on.
    layers.mount_gate = threading.Event()
    outcome: list[BaseException] = []

    def remote_prepare() -> None:
        try:
            sn.prepare("extract-1", "", unpack_labels(CHAIN_A))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=remote_prepare)
    worker.start()
    try:
        assert layers.mounting.wait(30)
        sn.prepare("other", "")  # a write transaction
        assert sn.stat("extract-1").kind is Kind.ACTIVE  # phase one is visible, as an active snapshot
        assert [i.name for i in sn.list()] == ["extract-1", "other"]
        assert rows(sn.root)[0][3] == "mounting"
    finally:
        layers.mount_gate.set()
        worker.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], AlreadyExists), outcome
    assert sn.stat(CHAIN_A).kind is Kind.COMMITTED


def test_concurrent_prepares_of_one_chain_commit_it_once(sn: Snapshotter, layers: DirectoryLayers):
    results: list[BaseException | None] = []

    def prepare(key: str) -> None:
        try:
            sn.prepare(key, "", unpack_labels(CHAIN_A))
            results.append(None)
        except BaseException as exc:
            results.append(exc)

    workers = [threading.Thread(target=prepare, args=(f"extract-{i}",)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert len(results) == 4 and all(isinstance(r, AlreadyExists) for r in results), results
    assert [i.name for i in sn.list()] == [CHAIN_A]
    assert [call for call in layers.calls if call[0] == "mount"] == [("mount", CHAIN_A)]


# -- fallbacks ----------------------------------------------------------------------------------


def test_unconverted_layer_is_downloaded_as_usual(sn: Snapshotter, layers: DirectoryLayers, tmp_path: Path):
    other = "sha256:" + "c" * 64
    before = fallbacks("not_converted")
    mounts = sn.prepare("extract-1", "", unpack_labels(other))
    assert fallbacks("not_converted") == before + 1
    with mounted(mounts, tmp_path / "unpack") as target:  # what the unpacker does: apply the tar here
        (target / "f").write_text("unpacked")
    sn.commit(other, "extract-1")
    assert sn.stat(other).kind is Kind.COMMITTED
    assert ("mount", other) not in layers.calls
    assert rows(sn.root) == [(other, int(Kind.COMMITTED), "dir", "ready", "")]


def test_parent_mismatch_falls_back(sn: Snapshotter, layers: DirectoryLayers):
    sn.prepare("tmp", "")
    sn.commit("another-base", "tmp")
    before = fallbacks("parent_mismatch")
    mounts = sn.prepare("extract-2", "another-base", unpack_labels(CHAIN_B))  # B sits on A, not here
    assert fallbacks("parent_mismatch") == before + 1
    assert mounts[0].type == "overlay"
    assert sn.stat("extract-2").kind is Kind.ACTIVE
    assert not any(call[0] == "mount" for call in layers.calls)


def test_store_down_falls_back_and_recovers(sn: Snapshotter, layers: DirectoryLayers):
    layers.down = True
    before = fallbacks("store_error")
    sn.prepare("extract-1", "", unpack_labels(CHAIN_A))
    assert fallbacks("store_error") == before + 1
    assert sn.stat("extract-1").kind is Kind.ACTIVE
    layers.down = False
    prepare_remote(sn, "extract-again", "", CHAIN_A)


def test_failed_mount_leaves_an_ordinary_active_snapshot(sn: Snapshotter, layers: DirectoryLayers, tmp_path: Path):
    broken = chain_id("", "sha256:" + "d" * 64)
    layers.convert(broken, "", {"x": "y"})
    for entry in (layers.store / broken.split(":")[-1] / "fs").iterdir():
        entry.unlink()
    (layers.store / broken.split(":")[-1] / "fs").rmdir()  # the record is there, the layer is not
    mounts = sn.prepare("extract-1", "", unpack_labels(broken))
    with mounted(mounts, tmp_path / "unpack") as target:
        (target / "x").write_text("downloaded instead")
    assert rows(sn.root) == [("extract-1", int(Kind.ACTIVE), "dir", "ready", "")]
    sn.commit(broken, "extract-1")
    assert sn.stat(broken).kind is Kind.COMMITTED


def test_unexpected_backend_error_falls_back_too(sn: Snapshotter, layers: DirectoryLayers):
    layers.lower_dir(CHAIN_A).write_text("in the way")  # the backend's mkdir of its mount point fails
    before = fallbacks("mount_failed")
    (mount,) = sn.prepare("extract-1", "", unpack_labels(CHAIN_A))
    assert mount.type == "bind"
    assert fallbacks("mount_failed") == before + 1
    assert rows(sn.root) == [("extract-1", int(Kind.ACTIVE), "dir", "ready", "")]


def test_without_a_backend_the_label_changes_nothing(root: Path):
    sn = Snapshotter(root)
    try:
        (mount,) = sn.prepare("extract-1", "", unpack_labels(CHAIN_A))
        assert mount.type == "bind"
        assert sn.stat("extract-1").kind is Kind.ACTIVE
    finally:
        sn.close()


# -- Remove, Cleanup, restore ---------------------------------------------------------------------


def test_remove_unmounts_the_layer_once_unused(sn: Snapshotter, layers: DirectoryLayers):
    prepare_remote(sn, "extract-1", "", CHAIN_A)
    sn.prepare("container", CHAIN_A)
    with pytest.raises(FailedPrecondition, match="child"):
        sn.remove(CHAIN_A)
    sn.remove("container")
    assert is_mountpoint(layers.lower_dir(CHAIN_A))
    sn.remove(CHAIN_A)
    assert not is_mountpoint(layers.lower_dir(CHAIN_A))
    assert rows(sn.root) == []
    assert snapshot_dirs(sn.root) == set()


def test_cleanup_unmounts_layers_no_snapshot_uses(sn: Snapshotter, layers: DirectoryLayers):
    prepare_remote(sn, "extract-1", "", CHAIN_A)
    prepare_remote(sn, "extract-2", CHAIN_A, CHAIN_B)
    layers.down = True  # the unmount at Remove fails: the layer stays served, Cleanup retries
    sn.remove(CHAIN_B)
    layers.down = False
    assert is_mountpoint(layers.lower_dir(CHAIN_B))
    sn.cleanup()
    assert not is_mountpoint(layers.lower_dir(CHAIN_B))
    assert is_mountpoint(layers.lower_dir(CHAIN_A))  # in use
    assert sn.stat(CHAIN_A).kind is Kind.COMMITTED


def test_restore_mounts_every_remote_snapshot_again(root: Path, layers: DirectoryLayers, tmp_path: Path):
    sn = Snapshotter(root, layers)
    prepare_remote(sn, "extract-1", "", CHAIN_A)
    prepare_remote(sn, "extract-2", CHAIN_A, CHAIN_B)
    sn.prepare("container", CHAIN_B)
    sn.close()
    layers.close()  # the layer server restarted and serves nothing yet

    sn = Snapshotter(root, layers)
    try:
        assert sn.restore() == []
        assert is_mountpoint(layers.lower_dir(CHAIN_A)) and is_mountpoint(layers.lower_dir(CHAIN_B))
        with mounted(sn.mounts("container"), tmp_path / "rootfs") as rootfs:
            assert (rootfs / "a").read_text() == "base"
    finally:
        sn.close()

    # Started without a store, the daemon says what it cannot serve, and keeps the metadata.
    sn = Snapshotter(root)
    try:
        problems = sn.restore()
        assert len(problems) == 2 and all("no store is configured" in p for p in problems)
        assert sn.stat(CHAIN_B).kind is Kind.COMMITTED
        with pytest.raises(FailedPrecondition, match="no store is configured"):
            sn.mounts("container")
    finally:
        sn.close()


CRASH_AT_MOUNT = """
import sys
from pathlib import Path
from bootseer.snapshotter.snapshots import Snapshotter, REF_LABEL
from tests.support.snapshots import DirectoryLayers
layers = DirectoryLayers(Path(sys.argv[2]), Path(sys.argv[3]))
layers.crash_on_mount = True
Snapshotter(Path(sys.argv[1]), layers).prepare("extract-1", "", {REF_LABEL: sys.argv[4]})
"""


def test_killed_at_the_mount_step_then_restore_forgets_the_half_made_snapshot(root: Path, layers: DirectoryLayers):
    child = subprocess.run(
        [sys.executable, "-c", CRASH_AT_MOUNT, str(root), str(layers.store), str(layers.mnt),
         CHAIN_A],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],  # tests.support imports
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    # Between the phases: the row says "mounting", the layer is mounted, nothing is committed.
    assert rows(root) == [("extract-1", int(Kind.ACTIVE), "dir", "mounting", CHAIN_A)]
    assert is_mountpoint(layers.lower_dir(CHAIN_A))

    sn = Snapshotter(root, layers)
    try:
        assert sn.restore() == []
        assert rows(root) == []
        assert not is_mountpoint(layers.lower_dir(CHAIN_A))  # nothing uses it any more
        sn.cleanup()
        assert snapshot_dirs(root) == set()
        # containerd retries the unpack with a new key: now it goes through.
        prepare_remote(sn, "extract-2", "", CHAIN_A)
        assert sn.stat(CHAIN_A).kind is Kind.COMMITTED
    finally:
        sn.close()


# -- the daemon's backend: chain records read from a real store ----------------------------------


def write_chain_record(store: Path, chain: str, parent: str, diff_id: str, tamper: bool = False) -> None:
    record = ChainRecord(
        chain_id=chain, parent=parent, diff_id=diff_id, digest="sha256:" + "e" * 64,
        media_type="application/vnd.oci.image.layer.v1.tar+gzip", size=123, index="f" * 64, block_size=1 << 20,
        files=7,
    )  # fmt: skip
    data = record.encode()
    if tamper:
        data = data.replace(diff_id.encode(), ("sha256:" + "0" * 64).encode())
    path = store / chain_object(chain)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def backend_for(url: str, tmp_path: Path) -> LayerServerBackend:
    return LayerServerBackend(tmp_path / "node", url, ServerSettings(store=url), EngineConfig(retry_timeout=2))


def test_layer_server_backend_looks_chain_records_up_in_the_store(tmp_path: Path):
    store = tmp_path / "store"
    write_chain_record(store, CHAIN_A, "", DIFF_A)
    write_chain_record(store, CHAIN_B, CHAIN_A, DIFF_B, tamper=True)
    backend = backend_for(f"file://{store}", tmp_path)

    layer = backend.lookup(CHAIN_A)
    assert layer is not None
    assert (layer.chain_id, layer.parent, layer.diff_id, layer.size, layer.files) == (CHAIN_A, "", DIFF_A, 123, 7)
    assert backend.lookup(chain_id(CHAIN_A, "sha256:" + "9" * 64)) is None  # not converted
    with pytest.raises(LayerUnavailable) as raised:
        backend.lookup(CHAIN_B)  # the record claims another chain: never served
    assert raised.value.reason == "corrupt"


def test_layer_server_backend_store_that_does_not_answer_is_a_store_error(tmp_path: Path):
    backend = backend_for(f"http://127.0.0.1:{free_port()}/store", tmp_path)  # nobody listens
    with pytest.raises(LayerUnavailable) as raised:
        backend.lookup(CHAIN_A)
    assert raised.value.reason == "store_error"


def test_a_server_too_slow_to_answer_is_asked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A layer server that takes the call but does not answer in time is running: the backend
    neither starts another nor asks again (which would double the gRPC call's wait)."""
    backend = LayerServerBackend(tmp_path / "node", "file:///store", ServerSettings(), call_timeout=0.5)
    starts: list[int] = []
    monkeypatch.setattr(backend, "start", lambda: starts.append(1))
    paths = ServerPaths(tmp_path / "node")
    paths.layers.mkdir(parents=True)
    accepted: list[socket.socket] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(paths.socket))
        listener.listen(8)
        listener.settimeout(5)

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    accepted.append(listener.accept()[0])  # and never answer

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        with pytest.raises(LayerUnavailable) as raised:
            backend.check(CHAIN_A)
        assert raised.value.reason == "server_unavailable"
        assert "did not answer" in str(raised.value)
        assert backend.ensure_running() is False  # the watch leaves a slow server be
        assert (len(accepted), starts) == (2, [])
    thread.join(10)
    for conn in accepted:
        conn.close()


# -- through the daemon, with the real layer server ------------------------------------------------
# The layer servers these daemons start outlive them; snapshotter_factory's teardown stops
# them and unmounts their FUSE mounts, pass or fail (tests/conftest.py: layer_server_reaper).




BIG = "".join(f"line {n} of a file of several blocks\n" for n in range(10_000)).encode()


@pytest.fixture
def converted(tmp_path: Path) -> list[BuiltLayer]:
    layers = [
        TarLayer((File("a", b"base layer\n"), File("etc/conf", b"from A\n"), File("big", BIG))),
        TarLayer((File("b", b"second layer\n"), File("etc/conf", b"from B\n"))),
    ]
    return build_store(tmp_path / "store", layers, block_size=64 << 10, layout=tmp_path / "layout")


def test_daemon_serves_converted_layers_lazily_and_across_restarts(
    tmp_path: Path, snapshotter_factory, converted: list[BuiltLayer]
):
    store = f"file://{tmp_path / 'store'}"
    root = tmp_path / "root"
    base, top = converted[0].chain_id, converted[1].chain_id
    daemon = snapshotter_factory("--store", store, "--metrics-address", "127.0.0.1:0", root=root)
    stub = daemon.stub
    for key, parent, chain in (("extract-1", "", base), ("extract-2", base, top)):
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prepare(api.PrepareSnapshotRequest(key=key, parent=parent, labels=unpack_labels(chain)))
        assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS, raised.value.details()
        info = stub.Stat(api.StatSnapshotRequest(key=chain)).info
        assert (info.kind, info.parent) == (api.COMMITTED, parent)

    # An image that was not converted is downloaded as always: ordinary mounts.
    other = "sha256:" + "c" * 64
    (plain,) = stub.Prepare(api.PrepareSnapshotRequest(key="extract-x", labels=unpack_labels(other))).mounts
    assert plain.type == "bind"
    metrics = started_record(daemon)["metrics_address"]
    samples = scrape(metrics)
    assert samples[("bootseer_snapshotter_remote_fallbacks_total", (("reason", "not_converted"),))] == 1
    assert samples[("bootseer_snapshotter_remote_snapshots_total", ())] == 2

    container = stub.Prepare(api.PrepareSnapshotRequest(key="container", parent=top)).mounts
    expected = {"a": "base layer\n", "b": "second layer\n", "big": BIG.decode(), "etc": "/", "etc/conf": "from B\n"}
    with mounted(to_mounts(container), tmp_path / "rootfs") as rootfs:
        assert read_tree(rootfs) == expected
    server_pid = LayerServerClient(ServerPaths(root).socket).status()["pid"]
    # Started with the node's [fetch] memory_limit (1G by default), which its RSS follows.
    assert LayerServerClient(ServerPaths(root).socket).status()["settings"]["memory-limit"] == 1 << 30

    # The daemon restarts; the layer server outlives it and is found again.
    assert daemon.stop() == 0
    daemon = snapshotter_factory("--store", store, root=root)
    assert LayerServerClient(ServerPaths(root).socket).status()["pid"] == server_pid
    again = daemon.stub.Mounts(api.MountsRequest(key="container")).mounts
    assert list(again) == list(container)
    with mounted(to_mounts(again), tmp_path / "rootfs") as rootfs:
        assert (rootfs / "etc/conf").read_text() == "from B\n"

    # Remove the container and the layers: the layer server stops serving them.
    daemon.stub.Remove(api.RemoveSnapshotRequest(key="container"))
    daemon.stub.Remove(api.RemoveSnapshotRequest(key=top))
    served = [layer["chain_id"] for layer in LayerServerClient(ServerPaths(root).socket).status()["layers"]]
    assert served == [base]
    assert daemon.stop() == 0


def to_mounts(mounts) -> list[Mount]:
    return [Mount(type=m.type, source=m.source, options=tuple(m.options)) for m in mounts]


def test_daemon_starts_a_killed_layer_server_again(tmp_path: Path, snapshotter_factory, converted: list[BuiltLayer]):
    store = f"file://{tmp_path / 'store'}"
    root = tmp_path / "root"
    base = converted[0].chain_id
    daemon = snapshotter_factory("--store", store, root=root)
    with pytest.raises(grpc.RpcError) as raised:
        daemon.stub.Prepare(api.PrepareSnapshotRequest(key="extract-1", labels=unpack_labels(base)))
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    client = LayerServerClient(ServerPaths(root).socket)
    first_pid = client.status()["pid"]
    os.kill(first_pid, signal.SIGKILL)
    wait_process_gone(first_pid, 30)

    # The daemon's watch notices and starts a server that restores the same layers.  The
    # new server answers before the daemon's watch logs that it started it: wait for both.
    deadline = time.monotonic() + 60
    while True:
        try:
            status = client.status()
            restarted = any(r["msg"] == "layer server started again" for r in daemon.log_records())
            if status["pid"] != first_pid and status["layers"] and restarted:
                break
        except LayerServerError:
            pass
        assert time.monotonic() < deadline, (daemon.log, ServerPaths(root).log.read_text(errors="replace"))
        time.sleep(0.2)
    container = daemon.stub.Prepare(api.PrepareSnapshotRequest(key="container", parent=base)).mounts
    with mounted(to_mounts(container), tmp_path / "rootfs") as rootfs:
        assert (rootfs / "a").read_text() == "base layer\n"
        assert (rootfs / "big").read_bytes() == BIG
