"""The layer server for real: converted layers in a store, ``bootseer layer-server`` started by
``ensure_server``, the FUSE view and an overlayfs stack over it compared with ``tar -x``.

Each test gets a fresh node root and its own server process (started the way the
snapshotter starts it) and leaves no process or mount behind.  The layers are
:func:`tests.support.oci.rich_layers` (an entry of every kind), converted into a
``file://`` (or, where requests are counted or the store must stop answering,
``http://``) store by :func:`tests.support.layer_store.build_store`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import os
import shutil
import signal
import stat
import subprocess
import sys
import dataclasses
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from bootseer.blockstore.server.client import (
    InvalidRequest,
    LayerNotConverted,
    LayerNotMounted,
    LayerServerClient,
    ServerPaths,
    ServerSettings,
    ServerStartError,
    ServerUnavailable,
    StoreUnavailable,
    ensure_server,
)
from bootseer.blockstore.objects.format import pack_object
from bootseer.blockstore.node.readahead import READAHEAD_INITIAL
from tests.support.http import RangeHTTPServer
from tests.support.processes import wait_process_gone
from tests.support.waiting import free_port, wait_until
from tests.support.layer_store import BuiltLayer, build_store, stored_image
from tests.support.layer_servers import stop_layer_servers
from tests.support.layers import BigFile, Layer
from bootseer.blockstore.node.cache_writer import CACHE_WRITE_QUEUE_BYTES
from tests.support.memory import MiB, peak_rss_under_readers, rss_bound
from tests.support.trees import apply_layers, as_whiteouts, disk_tree, extract_with_tar
from tests.support.oci import NON_UTF8_NAME, rich_layers
from tests.support.mounts import force_unmount, mount_entry

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

BLOCK_SIZE = 64 << 10
REPO = Path(__file__).resolve().parents[2]
OPAQUE = "trusted.overlay.opaque"


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path_factory.mktemp("store")
    layout = tmp_path_factory.mktemp("layout")
    return store, build_store(store, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE, layout=layout)


@pytest.fixture(scope="module")
def extracted(built: tuple[Path, list[BuiltLayer]], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("extracted")
    dirs = []
    for number, layer in enumerate(built[1]):
        extract_with_tar(layer.blob, base / str(number))
        dirs.append(base / str(number))
    return dirs


class Node:
    """One node's layer server, started and stopped as the snapshotter would."""

    def __init__(self, root: Path, settings: ServerSettings) -> None:
        self.root = root
        self.paths = ServerPaths(root)
        self.settings = settings
        self.overlays: list[Path] = []

    def ensure(self) -> LayerServerClient:
        return ensure_server(self.root, self.settings)

    @property
    def client(self) -> LayerServerClient:
        return LayerServerClient(self.paths.socket)

    def pid(self) -> int:
        return int(self.client.status()["pid"])

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> None:
        pid = self.pid()
        os.kill(pid, signum)
        wait_process_gone(pid, timeout)

    def log(self) -> str:
        return self.paths.log.read_text(errors="replace") if self.paths.log.exists() else ""

    def cleanup(self) -> None:
        """Unmount the overlays, then stop every server of this root (by its --root, so one
        still starting is found too) and unmount its FUSE mount."""
        for overlay in self.overlays:
            force_unmount(overlay)
        stop_layer_servers(self.root)






@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Any]:
    nodes: list[Node] = []

    def make(store_url: str, **settings: Any) -> Node:
        settings.setdefault("retry_timeout", 5)
        settings.setdefault("log_level", "debug")
        node = Node(tmp_path / f"root{len(nodes)}", ServerSettings(store=store_url, **settings))
        nodes.append(node)
        return node

    try:
        yield make
    finally:
        for node in nodes:
            node.cleanup()


@pytest.fixture
def node(built: tuple[Path, list[BuiltLayer]], node_factory: Any) -> Node:
    return node_factory(f"file://{built[0]}")


def mount_overlay(node: Node, lowers: list[str], target: Path) -> None:
    target.mkdir()
    node.overlays.append(target)
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", "lowerdir=" + ":".join(lowers), str(target)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip


# -- the FUSE view against tar -x ------------------------------------------------------------------


DATA_PATHS = ["fanotify", "erofs", "loop", "tree"]  #: every forced data path (blockstore.datapath.choice)


def on_data_path(node_factory: Any, built: Any, data_path: str) -> tuple[Node, LayerServerClient]:
    """A node forced to ``data_path``, started; its lower dirs are EROFS mounts unless it is ``tree``."""
    node = node_factory(f"file://{built[0]}", data_path=data_path)
    client = node.ensure()
    assert client.status()["data_path"] == {"path": data_path, "reason": "forced"}
    return node, client


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_each_layer_equals_its_tar_extraction(node_factory: Any, built: Any, extracted: list[Path], data_path: str) -> None:
    node, client = on_data_path(node_factory, built, data_path)
    lower = client.mount(built[1][0].chain_id).lower_dir
    entry = mount_entry(Path(lower))
    assert (entry is not None and entry.fstype == "erofs") == (data_path != "tree"), lower
    for layer, reference in zip(built[1], extracted):
        fuse_view = disk_tree(Path(client.mount(layer.chain_id).lower_dir), overlay=False)
        expected = disk_tree(reference, overlay=True)
        assert as_whiteouts(fuse_view) == as_whiteouts(expected), layer.chain_id
        assert len(fuse_view) == len(layer.index.entries) - 1
    # What the layers hold, named: so the comparison above cannot pass on empty trees.
    base = Path(client.check(built[1][0].chain_id).lower_dir)
    assert os.lstat(base / "dev/null").st_rdev == os.makedev(1, 3)
    assert stat.S_ISBLK(os.lstat(base / "dev/sda").st_mode)
    assert stat.S_ISFIFO(os.lstat(base / "run/fifo").st_mode)
    big, link = os.lstat(base / "srv/big.bin"), os.lstat(base / "srv/big.link")
    assert big.st_ino == link.st_ino and big.st_nlink == 2
    assert os.lstat(base / "etc/hosts").st_nlink == 2 and os.lstat(base / "etc/empty").st_nlink == 1
    assert os.lstat(base / "srv").st_nlink == 2 and os.lstat(base).st_nlink == 2 + sum(
        stat.S_ISDIR(os.lstat(base / name).st_mode) for name in os.listdir(base))
    assert os.getxattr(base / "srv/xattr.bin", "user.bin") == b"\x00\xff\xfe"
    assert os.readlink(base / "srv/abs") == "/etc/hosts"
    assert (base / NON_UTF8_NAME).read_bytes() == b"non-utf8\n"
    assert os.stat(base / "srv/sparse.img").st_size == 5 * BLOCK_SIZE
    middle = Path(client.check(built[1][1].chain_id).lower_dir)
    whiteout = os.lstat(middle / "etc/secret")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(middle / "opaque-me", OPAQUE) == b"y"
    with pytest.raises(OSError) as excinfo:
        os.getxattr(middle / "app", OPAQUE)
    assert excinfo.value.errno == errno.ENODATA


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_an_overlay_stack_equals_the_applied_layers(
    node_factory: Any, built: Any, extracted: list[Path], tmp_path: Path, data_path: str
) -> None:
    node, client = on_data_path(node_factory, built, data_path)
    lowers = [client.mount(layer.chain_id).lower_dir for layer in built[1]]
    merged = tmp_path / "merged"
    mount_overlay(node, list(reversed(lowers)), merged)
    expected = apply_layers([disk_tree(d, overlay=True) for d in extracted])
    assert disk_tree(merged, overlay=False) == expected
    # The whiteouts hide, the opaque directory hides, the last entry wins.
    assert not (merged / "etc/secret").exists() and not (merged / "gone-dir").exists()
    assert os.listdir(merged / "opaque-me") == ["new.txt"]
    assert (merged / "replace-me").read_bytes() == b"fourth and last\n"
    assert (merged / "etc/hosts").read_bytes() == b"127.0.0.1 localhost\n"
    # A container's non-root user reads through it (allow_other), within the file modes
    # (default_permissions).
    # (Run from inside the overlay: the test's own temp directories are root's, 0700.)
    as_user = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    read = subprocess.run([*as_user, "cat", "srv/mtime-ns", "etc/hosts"], cwd=merged, capture_output=True, timeout=30)
    assert read.returncode == 0 and read.stdout == b"ns\n127.0.0.1 localhost\n", read.stderr
    denied = subprocess.run([*as_user, "cat", "replace-me"], cwd=merged, capture_output=True, timeout=30)
    assert denied.returncode != 0 and b"Permission denied" in denied.stderr  # 0600 root
    entry = mount_entry(node.paths.mountpoint)
    assert entry is not None and entry.fstype == "fuse.bootseer-layers"
    assert {"ro", "nosuid", "nodev", "allow_other"} <= set(entry.options)


@pytest.mark.parametrize("data_path", ["erofs", "tree"])
def test_what_a_running_overlay_sees_when_the_server_dies(node_factory: Any, built: Any, tmp_path: Path, data_path: str) -> None:
    node = node_factory(f"file://{built[0]}", data_path=data_path)
    client = node.ensure()
    lowers = [client.mount(layer.chain_id).lower_dir for layer in built[1]]
    merged = tmp_path / "merged"
    mount_overlay(node, list(reversed(lowers)), merged)
    assert (merged / "etc/hosts").read_bytes() == b"127.0.0.1 localhost\n"
    node.stop(signal.SIGTERM)  # exits 0 although an overlay stacks on its mount
    # What was never read is gone with the server (docs/lazy-layers.md says so)...
    with pytest.raises(OSError) as excinfo:
        (merged / "srv/big.bin").read_bytes()
    assert excinfo.value.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO)
    # ...and a new container, on a new overlay over the restarted server, works.
    client = node.ensure()
    again = tmp_path / "again"
    mount_overlay(node, list(reversed([client.check(layer.chain_id).lower_dir for layer in built[1]])), again)
    assert (again / "srv/big.bin").read_bytes() == rich_big_bin()


def test_on_fanotify_a_running_overlay_waits_for_the_next_server_and_reads_right(node_factory: Any, built: Any,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """The data path ``auto`` picks here: the mounts and the event holder outlive the server, so a read of
    what was never read waits for the next server (killable) instead of failing, and gets the right bytes."""
    node = node_factory(f"file://{built[0]}", data_path="fanotify")
    client = node.ensure()
    lowers = [client.mount(layer.chain_id).lower_dir for layer in built[1]]
    merged = tmp_path / "merged"
    mount_overlay(node, list(reversed(lowers)), merged)
    assert (merged / "etc/hosts").read_bytes() == b"127.0.0.1 localhost\n"
    node.stop(signal.SIGTERM)  # exits 0; the overlay's lowers stay mounted
    reader = subprocess.Popen([sys.executable, "-c", "import hashlib, sys; "
                               "print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())",
                               str(merged / "srv/big.bin")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until("the read waits on the fanotify group", lambda: "fanotify" in Path(f"/proc/{reader.pid}/stack").read_text())
        node.ensure()
        out, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0 and out.strip() == hashlib.sha256(rich_big_bin()).hexdigest()


# -- fetching only what is read --------------------------------------------------------------------


def _pack_requests(server: RangeHTTPServer, pack: str) -> list[tuple[int, int]]:
    ranges = []
    for method, target, headers in server.requests:
        if method == "GET" and target.endswith(pack):
            first, _, last = headers.get("Range", headers.get("range", "bytes=0-")).removeprefix("bytes=").partition("-")
            ranges.append((int(first), int(last) if last else -1))
    return ranges


def test_metadata_fetches_no_block_and_a_read_fetches_its_blocks(built: Any, node_factory: Any) -> None:
    store, layers = built
    with RangeHTTPServer(store) as http:
        # No fill groups (on fanotify): what a read fetches is its own blocks and its read-ahead, as counted here.
        node = node_factory(http.url, fill_group=0, extra_args=("--stripe-size", str(BLOCK_SIZE)))
        client = node.ensure()
        base = Path(client.mount(layers[0].chain_id).lower_dir)
        index = layers[0].index
        entry = next(e for e in index.entries if e.path == "srv/big.bin")
        block = index.blocks[entry.blocks[2]]
        pack = pack_object(index.packs[block.pack])
        # The mount fetched the layer's EROFS image (its own packs) and no file block.
        image_packs = {pack_object(name) for name in stored_image(store, layers[0].record)[0].packs}
        at_mount = [target for _method, target, _headers in http.requests if "/packs/" in target]
        assert all(any(target.endswith(name) for name in image_packs) for target in at_mount)
        metadata_only(base)
        assert [target for _method, target, _headers in http.requests if "/packs/" in target] == at_mount
        with open(base / "srv/big.bin", "rb", buffering=0) as file:
            file.seek(2 * BLOCK_SIZE + 100)
            data = file.read(10)
        expected = rich_big_bin()[2 * BLOCK_SIZE + 100 : 2 * BLOCK_SIZE + 110]
        assert data == expected
        ranges = _pack_requests(http, pack)
        assert ranges, "the read fetched nothing"
        fetched = sum(last - first + 1 for first, last in ranges)
        pack_size = (store / pack).stat().st_size
        covered = set()
        for first, last in ranges:
            covered.update(range(first, last + 1))
        assert covered.issuperset(range(block.offset, block.offset + block.clen))
        # The block's neighbourhood, not the layer: a stripe either side at most, and
        # the read-ahead beyond it (blockstore/node/readahead.py: the first window of a miss).
        assert fetched <= block.clen + 2 * BLOCK_SIZE + READAHEAD_INITIAL < pack_size, (fetched, pack_size)
        # Opened and read again: the kernel's page cache (keep_cache) answers; nothing
        # is fetched twice (the kernel may read ahead into blocks not fetched yet).
        with open(base / "srv/big.bin", "rb", buffering=0) as file:
            file.seek(2 * BLOCK_SIZE + 100)
            assert file.read(10) == expected
        for first, last in _pack_requests(http, pack)[len(ranges) :]:
            assert covered.isdisjoint(range(first, last + 1))
        stats = only(client.status()["stores"])
        assert stats["blocks"]["blocks_fetched"] >= 1 and stats["blocks"]["blocks_cached"] == 0

        # A restarted server (a new mount: no page cache) finds the block in the node cache (on fanotify,
        # in the layer's local blob, which it takes over).
        requests_before = len(_pack_requests(http, pack))
        node.stop(signal.SIGTERM)
        client = node.ensure()
        with open(base / "srv/big.bin", "rb", buffering=0) as file:
            file.seek(2 * BLOCK_SIZE + 100)
            assert file.read(10) == expected
        status = client.status()
        if status["data_path"]["path"] == "fanotify":  # auto, here: the layer's local blob on disk has it
            assert only(status["stores"])["blocks"]["blocks_fetched"] == 0
        else:
            assert only(status["stores"])["blocks"]["blocks_cached"] >= 1
            assert status["cache"]["hits"] >= 1
        for first, last in _pack_requests(http, pack)[requests_before:]:
            assert covered.isdisjoint(range(first, last + 1))  # nothing already fetched is fetched again


def metadata_only(root: Path) -> None:
    """stat, readdir, readlink and every xattr of every entry: metadata only."""
    for directory, dirnames, filenames in os.walk(os.fsencode(root)):
        for name in dirnames + filenames:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                os.readlink(path)
            else:
                for attr in os.listxattr(path, follow_symlinks=False):
                    os.getxattr(path, attr, follow_symlinks=False)


def rich_big_bin() -> bytes:
    layer = rich_layers(BLOCK_SIZE)[0]
    return next(e.data for e in layer.entries if getattr(e, "path", "") == "srv/big.bin")  # type: ignore[attr-defined]


# -- the control API --------------------------------------------------------------------------------


def test_control_api(node: Node, built: Any) -> None:
    client = node.ensure()
    assert stat.S_IMODE(os.stat(node.paths.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(node.paths.layers).st_mode) == 0o700
    layers = built[1]
    first = client.mount(layers[0].chain_id)
    # The default data path, auto: EROFS on this kernel (the node's root is on the root filesystem, not tmpfs).
    assert first.slot == 1 and first.lower_dir == node.paths.lower_dir(1, "erofs")
    assert client.mount(layers[0].chain_id) == first == client.check(layers[0].chain_id)  # idempotent
    second = client.mount(layers[1].chain_id)
    assert second.slot == 2 and second.lower_dir == node.paths.lower_dir(2, "erofs")
    assert sorted(os.listdir(node.paths.mountpoint)) == ["1", "2", "blobs"]  # and the blob of each layer in blobs/
    vfs = os.statvfs(node.paths.mountpoint)
    assert vfs.f_flag & os.ST_RDONLY and vfs.f_bfree == 0
    assert vfs.f_files == len(layers[0].index.entries) + len(layers[1].index.entries)
    assert vfs.f_blocks * vfs.f_frsize > len(rich_big_bin())
    status = client.status()
    assert status["health"]["fuse"] == "serving"
    assert [(x["chain_id"], x["slot"]) for x in status["layers"]] == [(layers[0].chain_id, 1), (layers[1].chain_id, 2)]
    assert json.loads(node.paths.table.read_text())["layers"][1]["slot"] == 2

    with pytest.raises(LayerNotConverted, match="not converted"):
        client.mount("sha256:" + "0" * 64)
    with pytest.raises(InvalidRequest, match="chain_id"):
        client.mount("latest")
    with pytest.raises(InvalidRequest, match="unknown operation"):
        client.call({"op": "format-disk"})
    with pytest.raises(LayerNotMounted):
        client.check(layers[2].chain_id)

    client.unmount(layers[0].chain_id)
    with pytest.raises(LayerNotMounted):
        client.unmount(layers[0].chain_id)
    assert sorted(os.listdir(node.paths.mountpoint)) == ["2", "blobs"] and os.listdir(node.paths.mountpoint / "blobs") == ["2"]
    with pytest.raises(FileNotFoundError):
        os.stat(node.paths.mountpoint / "1")
    with pytest.raises(FileNotFoundError):
        os.stat(node.paths.mountpoint / "blobs" / "1")
    third = client.mount(layers[2].chain_id)
    assert third.slot == 1  # the lowest free slot
    assert (Path(third.lower_dir) / "replace-me").read_bytes() == b"fourth and last\n"


def test_the_metrics_and_status_say_what_was_served_and_the_cpu_each_stage_spent(built: Any, node_factory: Any) -> None:
    port = free_port()
    node = node_factory(f"file://{built[0]}", metrics_address=f"127.0.0.1:{port}", fill_group=0)  # the blob stays partial
    client = node.ensure()
    lower = Path(client.mount(built[1][0].chain_id).lower_dir)
    assert (lower / "etc/hosts").read_bytes() == b"127.0.0.1 localhost\n"  # inline in the layer's EROFS image
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin()  # read through the blob: events filled (auto here)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert "bootseer_layer_server_up 1.0" in text
    assert "bootseer_layer_server_layers 1.0" in text
    assert 'bootseer_layer_server_requests_total{op="mount",outcome="ok"} 1.0' in text
    assert 'bootseer_layer_server_data_path{path="fanotify"} 1.0' in text
    filled = re.search(r'bootseer_fanotify_events_total\{outcome="filled"\} ([0-9.]+)', text)
    assert filled and float(filled.group(1)) >= 1, text
    assert 'bootseer_local_blobs{state="partial"} 1.0' in text
    assert 'bootseer_fuse_requests_total{fs="bootseer-layers",op="read"}' not in text  # no FUSE on the data path
    # CPU per stage (issue 26): the big file's blocks were fetched, decoded and written into the blob.
    spent = {stage: float(seconds) for stage, seconds in
             re.findall(r'^bootseer_stage_cpu_seconds_total\{stage="(\w+)"\} (\S+)$', text, re.M)}  # fmt: skip
    assert set(spent) == {"fetch", "decode", "cache_read", "cache_write", "blob_fill", "page_cache_warm", "gc"}, text
    assert spent["fetch"] > 0 and spent["decode"] > 0 and spent["blob_fill"] > 0, spent
    status = client.status()["cpu_seconds"]
    assert status["decode"] >= spent["decode"] - 1e-6 and status["decode"] > 0  # rounded to the microsecond
    assert status["process"] >= sum(status[stage] for stage in spent) and status["outside_stages"] >= 0, status


# -- starting, dying, restarting --------------------------------------------------------------------


def _inodes(lower: Path) -> dict[str, int]:
    return {p: os.lstat(lower / p).st_ino for p in ("", "srv", "srv/big.bin", "srv/big.link", "etc/hosts", "dev/null")}


@pytest.mark.parametrize("data_path", ["fanotify", "erofs", "tree"])
def test_restart_after_sigterm_and_sigkill_restores_slots_and_inodes(node_factory: Any, built: Any, data_path: str) -> None:
    node, client = on_data_path(node_factory, built, data_path)
    layers = built[1]
    slots = {layer.chain_id: client.mount(layer.chain_id).slot for layer in layers}
    base = Path(client.check(layers[0].chain_id).lower_dir)
    inodes = _inodes(base)
    assert inodes["srv/big.bin"] == inodes["srv/big.link"]

    node.stop(signal.SIGTERM)
    assert mount_entry(node.paths.mountpoint) is None  # a clean stop unmounts
    assert not node.paths.socket.exists()
    with pytest.raises(ServerUnavailable, match="does not exist|not running"):
        client.status()

    client = node.ensure()
    assert {x["chain_id"]: x["slot"] for x in client.status()["layers"]} == slots
    assert _inodes(base) == inodes
    assert (base / "srv/big.bin").read_bytes() == rich_big_bin()

    node.stop(signal.SIGKILL)  # leaves a dead mount behind
    if data_path == "tree":
        with pytest.raises(OSError) as excinfo:
            os.listdir(base / "srv")
        assert excinfo.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    else:  # the kernel still answers the names from the image; the blob's device is the dead session
        assert mount_entry(base).fstype == "erofs" and "big.bin" in os.listdir(base / "srv")
    with pytest.raises(ServerUnavailable, match="not running"):
        client.mount(layers[0].chain_id)

    client = node.ensure()  # cleans up the dead mount, restores the table
    assert {x["chain_id"]: x["slot"] for x in client.status()["layers"]} == slots
    assert _inodes(base) == inodes
    assert (base / "srv/big.bin").read_bytes() == rich_big_bin()
    assert "unmounting a dead FUSE mount" in node.log()
    assert ("unmounting a stale EROFS mount" in node.log()) == (data_path == "erofs")

    wait_process_gone(client.shutdown(), 30)  # the control API's stop: as SIGTERM
    assert mount_entry(node.paths.mountpoint) is None
    assert "layer server stopped" in node.log()
    assert {x["chain_id"]: x["slot"] for x in node.ensure().status()["layers"]} == slots


def test_two_callers_at_once_start_one_server(node: Node) -> None:
    clients: list[LayerServerClient] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            clients.append(node.ensure())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(clients) == 4
    assert len({client.status()["pid"] for client in clients}) == 1
    assert node.log().count("layer server ready on") == 1


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    settings = ServerSettings(store="file:///nowhere", extra_args=("--cache-size", "lots"), start_timeout=60)
    with pytest.raises(ServerStartError, match="(?s)exited with status 2.*invalid size 'lots'"):
        ensure_server(tmp_path / "root", settings)


def test_a_second_server_on_one_root_is_refused(node: Node) -> None:
    node.ensure()
    settings_file = node.root.parent / "second.json"
    settings_file.write_text(json.dumps(node.settings.document()))
    result = subprocess.run(node.settings.argv(node.root, str(settings_file)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "already serves" in result.stderr
    assert node.client.status()["health"]["fuse"] == "serving"


# -- a store that stops answering --------------------------------------------------------------------

_STORE_PROGRAM = """
import sys, time
from tests.support.http import RangeHTTPServer
server = RangeHTTPServer({root!r}).start()
print(server.port, flush=True)
while True:
    time.sleep(3600)
"""


def test_a_store_that_stops_answering_gives_eio_in_bounded_time_then_recovers(built: Any, node_factory: Any) -> None:
    store, layers = built
    program = _STORE_PROGRAM.format(root=str(store))  # run from the checkout's root: tests.support imports
    http = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        port = int(http.stdout.readline())  # type: ignore[union-attr]
        node = node_factory(f"http://127.0.0.1:{port}/", retry_timeout=3,
                            extra_args=("--stripe-size", str(BLOCK_SIZE)))  # fmt: skip
        client = node.ensure()
        base = Path(client.mount(layers[0].chain_id).lower_dir)
        http.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
        started = time.monotonic()
        with pytest.raises(OSError) as excinfo:
            (base / "srv/shared.bin").read_bytes()
        assert excinfo.value.errno == errno.EIO
        assert time.monotonic() - started < 120  # bounded: the retry timeout, not forever
        # Everything else stays healthy: metadata, the control API.
        assert os.lstat(base / "srv/big.link").st_nlink == 2
        assert client.status()["health"]["fuse"] == "serving"
        http.send_signal(signal.SIGCONT)
        # Recovery: reads succeed again (a read that joined the failing fetch may still
        # share its EIO; a later one fetches anew).
        deadline = time.monotonic() + 60
        while True:
            try:
                data = (base / "srv/shared.bin").read_bytes()
                break
            except OSError as exc:
                assert exc.errno == errno.EIO and time.monotonic() < deadline, exc
                time.sleep(0.5)
        assert data == _shared_blocks()
    finally:
        http.send_signal(signal.SIGCONT)
        http.kill()
        http.wait()


def _shared_blocks() -> bytes:
    from tests.support.oci import SHARED_BLOCKS

    return SHARED_BLOCKS


def only(stores: dict[str, Any]) -> dict[str, Any]:
    """The statistics of the one store a test's server reads."""
    assert len(stores) == 1, stores
    return next(iter(stores.values()))


def test_a_damaged_table_is_refused_clearly(node: Node) -> None:
    node.paths.layers.mkdir(parents=True)
    node.paths.table.write_text("{not json")
    with pytest.raises(ServerStartError, match="(?s)exited with status 2.*table.json is not valid JSON.*move it away"):
        node.ensure()


def test_a_tampered_block_is_never_served(built: Any, node_factory: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(built[0], store)
    index = built[1][0].index
    entry = next(e for e in index.entries if e.path == "srv/big.bin")
    block = index.blocks[entry.blocks[1]]
    pack = store / pack_object(index.packs[block.pack])
    data = bytearray(pack.read_bytes())
    data[block.offset + block.clen // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    client = node_factory(f"file://{store}").ensure()
    base = Path(client.mount(built[1][0].chain_id).lower_dir)
    with open(base / "srv/big.bin", "rb", buffering=0) as file:
        assert file.read(100) == rich_big_bin()[:100]  # block 0 is intact
        file.seek(BLOCK_SIZE + 10)
        with pytest.raises(OSError) as excinfo:
            file.read(100)
        assert excinfo.value.errno == errno.EIO
    assert only(client.status()["stores"])["blocks"]["corrupt"] >= 1
    assert client.status()["health"]["fuse"] == "serving"


def test_concurrent_mounts_of_one_layer_share_a_slot(node: Node, built: Any) -> None:
    client = node.ensure()
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(client.mount(built[1][0].chain_id))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 6 and len(set(results)) == 1
    assert [x["slot"] for x in client.status()["layers"]] == [1]


def test_a_layer_that_cannot_be_restored_keeps_its_slot(built: Any, node_factory: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(built[0], store)
    node = node_factory(f"file://{store}", retry_timeout=1)
    client = node.ensure()
    first, second = (client.mount(layer.chain_id) for layer in built[1][:2])
    client.unmount(first.chain_id)  # slot 1 free, slot 2 held
    wait_process_gone(client.shutdown(), 30)
    # Neither the local copy of the index nor the store is there at the restart.
    for copy in node.paths.indexes.iterdir():
        copy.unlink()
    store.rename(tmp_path / "store-away")
    client = node.ensure()
    [row] = client.status()["layers"]
    assert row["slot"] == 2 and not row["served"] and "store" in row["error"]
    with pytest.raises(StoreUnavailable):
        client.check(second.chain_id)
    (tmp_path / "store-away").rename(store)
    assert client.mount(built[1][2].chain_id).slot == 1  # slot 2 stays reserved
    assert client.mount(second.chain_id) == second  # the retry restores it in its slot
    assert (Path(second.lower_dir) / "opaque-me/new.txt").read_bytes() == b"new\n"


def test_the_local_index_copy_is_the_stores_object_byte_for_byte(built: Any, node_factory: Any, tmp_path: Path) -> None:
    """The copy under ROOT/layers/indexes is the bytes fetched and verified, not a re-encoding
    (which another zstd, level or writer would make different), and a restart checks it
    against the SHA-256 the chain record names: a copy with other bytes is fetched again."""
    import hashlib

    import zstandard

    from bootseer.blockstore.objects.format import INDEX_MAGIC, LayerIndex, chain_object, index_object

    store = tmp_path / "store"
    shutil.copytree(built[0], store)
    layer = built[1][0]
    # The store's index as another writer encoded it: the same index, other bytes (zstd level 3).
    original = (store / index_object(layer.record.index)).read_bytes()
    payload = zstandard.ZstdDecompressor().decompress(original[52:])
    compressed = zstandard.ZstdCompressor(level=3).compress(payload)
    other = original[:12] + len(compressed).to_bytes(8, "little") + hashlib.sha256(compressed).digest() + compressed
    assert other[:8] == INDEX_MAGIC and other != original and LayerIndex.decode(other) == layer.index
    name = hashlib.sha256(other).hexdigest()
    (store / index_object(name)).write_bytes(other)
    (store / chain_object(layer.chain_id)).write_bytes(dataclasses.replace(layer.record, index=name, image="").encode())

    node = node_factory(f"file://{store}")
    client = node.ensure()
    client.mount(layer.chain_id)
    copy = node.paths.indexes / name
    assert copy.read_bytes() == other  # not layer.index.encode(), which is `original`

    wait_process_gone(client.shutdown(), 30)
    copy.write_bytes(original)  # a valid index, but not the object the chain record names
    client = node.ensure()
    [row] = client.status()["layers"]
    assert row["served"], row
    assert "local index copy is damaged; fetching it again" in node.log()
    assert copy.read_bytes() == other
    assert (Path(client.check(layer.chain_id).lower_dir) / "srv/big.bin").read_bytes() == rich_big_bin()


MEMORY_LIMIT = 64 * MiB
SHARDS, SHARD_SIZE = 8, 32 * MiB


@pytest.fixture(scope="module")
def shards_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuiltLayer]:
    """One layer of 8 incompressible 32 MiB files in 1 MiB blocks (the converter's default), without an
    EROFS image (the test counts the files' blocks fetched)."""
    store = tmp_path_factory.mktemp("shards-store")
    files = tuple(BigFile(f"data/shard-{n}", SHARD_SIZE, seed=n) for n in range(SHARDS))
    [layer] = build_store(store, [Layer(files)], block_size=1 << 20, layout=tmp_path_factory.mktemp("shards-layout"),
                          inline_max=None)
    return store, layer


@pytest.mark.parametrize("kind", ["file", "http"])
def test_resident_memory_follows_the_memory_limit_under_concurrent_readers(
    shards_store: tuple[Path, BuiltLayer], node_factory: Any, nginx_factory: Any, kind: str
) -> None:
    """A real ``bootseer layer-server --memory-limit 64M --stripe-size 8M``: 8 readers read
    8 files of 32 MiB at once through its FUSE mount (every block fetched from the store,
    verified and cached); its VmRSS stays within the limit's tolerance above idle
    (tests.support.memory, as for ``bootseer ckpt mount``).  Measured here: 122-124 MiB above
    idle (bound 128 MiB); 176 MiB (file) and 206 MiB (http) without the fixed mmap threshold
    (``bootseer.fetch.malloc.return_large_blocks``)."""
    store, layer = shards_store
    url = f"file://{store}" if kind == "file" else nginx_factory(store).url
    node = node_factory(url, memory_limit=MEMORY_LIMIT, extra_args=("--stripe-size", "8M"))
    client = node.ensure()
    lower = Path(client.mount(layer.chain_id).lower_dir)
    paths = [lower / f"data/shard-{n}" for n in range(SHARDS)]
    idle, peak = peak_rss_under_readers(node.pid(), paths, SHARD_SIZE)
    above = peak - idle
    # The stripes follow --memory-limit; verified blocks waiting for the node cache's writer come on top,
    # up to their own fixed bound (the writer drops each entry's pages after writing it back: slower).
    assert above <= rss_bound(MEMORY_LIMIT) + CACHE_WRITE_QUEUE_BYTES, (
        f"RSS rose {above / MiB:.0f} MiB above idle ({idle / MiB:.0f} MiB) with --memory-limit 64M"
    )
    [row] = client.status()["stores"].values()
    assert row["blocks"]["blocks_fetched"] == SHARDS * SHARD_SIZE >> 20  # the bytes came from the store


def test_chain_locks_do_not_outlive_their_requests(built: Any, tmp_path: Path) -> None:
    """Each ChainID a request names gets a lock while it is being mounted or unmounted; the
    table of them must not keep one for every ChainID ever asked for (unbounded growth)."""
    import trio

    from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig

    store = f"file://{built[0]}"
    layer = built[1][0].chain_id
    unknown = [f"sha256:{n:064x}" for n in range(50)]

    async def main() -> dict[str, Any]:
        async with trio.open_nursery() as nursery:
            config = LayerServerConfig(root=tmp_path / "root", store=store, cache_dir=tmp_path / "cache")
            config.paths.indexes.mkdir(parents=True)
            server = LayerServer(config, nursery)

            async def mount_unknown(chain_id: str) -> None:
                with pytest.raises(LayerNotConverted):
                    await server.mount(chain_id)

            async with trio.open_nursery() as requests:
                for chain_id in unknown + unknown[:10]:  # some asked for twice at once
                    requests.start_soon(mount_unknown, chain_id)
                for _ in range(3):
                    requests.start_soon(server.mount, layer)
            assert [row["chain_id"] for row in (await server.status())["layers"]] == [layer]
            await server.unmount(layer)
            left = len(server._chain_locks)
            nursery.cancel_scope.cancel()
        return left

    assert trio.run(main) == 0


def test_a_store_that_takes_the_request_and_never_answers_fails_the_mount_in_its_bound(tmp_path: Path) -> None:
    """The engine fails a store that errors within its retry timeout; one that holds the
    request open is bounded by the mount's ``load_timeout``, which answers StoreUnavailable
    before the client's own timeout (so the daemon falls back for the right reason)."""
    import socket

    import trio
    import trio.testing

    from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig
    from bootseer.fetch.engine import EngineConfig

    held: list[socket.socket] = []
    reached = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)

    def accept() -> None:
        try:
            while True:
                held.append(listener.accept()[0])  # and never answer
                reached.set()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    store = f"http://127.0.0.1:{listener.getsockname()[1]}/store/"

    clock = trio.testing.MockClock()  # stands still until the store holds a request, then jumps

    async def jump_once_the_store_is_reached() -> None:
        assert await trio.to_thread.run_sync(reached.wait, 60), "the mount never reached the store"
        clock.jump(120)

    async def main() -> str:
        async with trio.open_nursery() as nursery:
            config = LayerServerConfig(
                root=tmp_path / "root", store=store, cache_dir=tmp_path / "cache",
                engine=EngineConfig(retry_timeout=3600), load_timeout=120,
            )  # fmt: skip
            config.paths.indexes.mkdir(parents=True)
            server = LayerServer(config, nursery)
            started = trio.current_time()
            nursery.start_soon(jump_once_the_store_is_reached)
            with pytest.raises(StoreUnavailable, match="in 120s") as raised:
                await server.mount("sha256:" + "a" * 64)
            assert trio.current_time() - started == pytest.approx(120)
            assert server.layers == {}
            nursery.cancel_scope.cancel()
        return str(raised.value)

    try:
        trio.run(main, clock=clock)
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_statistics_count_the_table_and_what_is_served_and_status_shows_them(built: Any, tmp_path: Path) -> None:
    """``LayerServer.statistics()`` is the server's own figures: a mount adds a row that is served, an
    unmount takes it away; no FUSE session in this test, so the mount is not serving."""
    import trio

    from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig, LayerServerStatistics

    store = f"file://{built[0]}"
    layer = built[1][0].chain_id

    async def main() -> tuple[LayerServerStatistics, LayerServerStatistics, LayerServerStatistics, dict[str, Any]]:
        async with trio.open_nursery() as nursery:
            config = LayerServerConfig(root=tmp_path / "root", store=store, cache_dir=tmp_path / "cache")
            config.paths.indexes.mkdir(parents=True)
            server = LayerServer(config, nursery)
            before = server.statistics()
            await server.mount(layer)
            mounted = server.statistics()
            status = await server.status()
            await server.unmount(layer)
            after = server.statistics()
            nursery.cancel_scope.cancel()
        return before, mounted, after, status

    before, mounted, after, status = trio.run(main)
    assert (before.layers, before.served) == (0, 0)
    assert (mounted.layers, mounted.served, mounted.serving, mounted.open_files) == (1, 1, False, 0)
    assert (after.layers, after.served) == (0, 0)
    assert status["health"] == {"fuse": "down", "open_files": 0} and status["uptime_s"] >= mounted.uptime_s
