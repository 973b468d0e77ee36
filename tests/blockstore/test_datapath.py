"""The node's data path for real: which one a layer server picks and why, and the EROFS mounts it keeps.

Each test starts ``bootseer layer-server`` the way the snapshotter does (``ensure_server``,
tests/blockstore/test_layer_server.py's ``Node``) over the converted :func:`tests.support.oci.rich_layers`,
and checks what the kernel shows: ``/proc/self/mountinfo``, the files through the lower
dirs, the server's log line and metrics.  A node without EROFS is shown with the
server's ``--kernel-filesystems`` seam (EROFS is built into this kernel and cannot be
unloaded); a kernel that refuses a file-backed mount, with a root on a real tmpfs (no
``read_folio``: ENOTBLK).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from bootseer.blockstore.server.client import ServerStartError
from bootseer.blockstore.datapath.choice import DataPathProbe, DataPathUnavailable
from tests.support.waiting import free_port
from tests.support.mounts import mount_entry
from tests.blockstore.test_layer_server import built, extracted, node_factory, rich_big_bin  # noqa: F401 (fixtures)
from tests.support.trees import disk_tree

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

NO_EROFS = "nodev\tsysfs\nnodev\tproc\nnodev\toverlay\n\text4\nfuseblk\nnodev\tfuse\n"


def chosen(log: str) -> str:
    """The data path of the start-up log line (the last one, after a restart)."""
    found = re.findall(r'data path chosen.*data_path=(\w+)', log)
    assert found, log
    return found[-1]


def erofs_mounts(under: Path) -> list[str]:
    """EROFS mountpoints below ``under``, from /proc/self/mountinfo (field 5 is the mountpoint)."""
    prefix = str(under.resolve()) + "/"
    with open("/proc/self/mountinfo") as mountinfo:
        rows = [line.split(" - ") for line in mountinfo]
    return [head.split()[4] for head, tail in rows if tail.split()[0] == "erofs" and head.split()[4].startswith(prefix)]


def read_all(lower: Path) -> dict[str, bytes]:
    """Every regular file's bytes under ``lower`` (and a stat of every entry on the way)."""
    out = {}
    for directory, dirs, files in os.walk(lower):
        for name in dirs + files:
            path = Path(directory, name)
            info = os.lstat(path)
            if path.is_file() and not path.is_symlink() and info.st_mode & 0o444:
                out[str(path.relative_to(lower))] = path.read_bytes()
    return out


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs (set up before, so torn down after, the node that lives on it)."""
    target = tmp_path / "tmpfs"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(target)], check=True, timeout=30)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False, timeout=30)


# -- choosing ------------------------------------------------------------------------------------


def test_auto_picks_fanotify_here_with_its_log_line(built: Any, node_factory: Any) -> None:
    node = node_factory(f"file://{built[0]}", data_path="auto")
    client = node.ensure()
    assert client.status()["data_path"] == {
        "path": "fanotify", "reason": "fanotify pre-content events and a file-backed EROFS mount work"}
    assert chosen(node.log()) == "fanotify"
    lower = client.mount(built[1][0].chain_id).lower_dir
    assert erofs_mounts(node.root) == [lower] and (Path(lower) / "etc/hosts").read_bytes() == b"127.0.0.1 localhost\n"
    # The device is the local blob, read buffered: its fills are in its page cache, read from there.
    assert "directio" not in mount_entry(lower).options
    assert not list(node.paths.layers.glob(".data-path-probe-*"))  # the probes leave nothing behind
    assert not list((node.root / "cache" / "blobs").glob(".*probe*"))
    # The mount's own read-ahead is the FUSE tree's 1 MiB, as on erofs.
    [bdi] = re.findall(r"read-ahead set.*path=/sys/class/bdi/(erofs-\d+)/read_ahead_kb", node.log())
    assert Path(f"/sys/class/bdi/{bdi}/read_ahead_kb").read_text().strip() == "1024"
    client.unmount(built[1][0].chain_id)
    assert not Path(f"/sys/class/bdi/{bdi}").exists()
    # The last layer of an index closes its blob cleanly and keeps it for a later mount (blob, fill map and clean-close
    # record, within --cache-size: blockstore.datapath.blob_store); nothing else is left (the probes' files are gone).
    index = built[1][0].record.index
    assert sorted(path.name for path in (node.root / "cache" / "blobs").iterdir()) == sorted(
        ["server.lock", f"{index}.blob", f"{index}.filled", f"{index}.closed"])


def test_a_cache_on_tmpfs_makes_auto_pick_erofs_naming_why_not_fanotify(tmpfs: Path, built: Any, node_factory: Any) -> None:
    node = node_factory(f"file://{built[0]}", data_path="auto", cache_dir=str(tmpfs / "cache"))
    client = node.ensure()
    status = client.status()["data_path"]
    assert status["path"] == "erofs" and "refuses pre-access marks" in status["reason"], status
    lower = client.mount(built[1][0].chain_id).lower_dir
    assert "directio" in mount_entry(lower).options  # the blob is the FUSE one, read with direct I/O
    assert (Path(lower) / "srv/big.bin").read_bytes() == rich_big_bin()


def test_a_forced_fanotify_the_cache_cannot_carry_stops_start_up_with_one_line(tmpfs: Path, built: Any, node_factory: Any) -> None:
    node = node_factory(f"file://{built[0]}", data_path="fanotify", cache_dir=str(tmpfs / "cache"), start_timeout=60)
    with pytest.raises(ServerStartError, match="(?s)exited with status 2.*data path fanotify: the filesystem of .* refuses"):
        node.ensure()


def test_a_root_on_tmpfs_falls_back_to_loop_with_its_log_line(tmpfs: Path, built: Any, node_factory: Any) -> None:
    node = node_factory(f"file://{built[0]}", data_path="auto")
    node.root = tmpfs / "root"  # the image cache, ROOT/layers/erofs, on tmpfs: ENOTBLK
    node.paths = type(node.paths)(node.root)
    client = node.ensure()
    status = client.status()["data_path"]
    assert status["path"] == "loop" and "ENOTBLK" in status["reason"]
    assert chosen(node.log()) == "loop"
    lower = Path(client.mount(built[1][0].chain_id).lower_dir)
    assert mount_entry(lower).source.startswith("/dev/loop")
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin()
    # The blob's loop device reads the FUSE blob with direct I/O (no second page cache, no read-ahead
    # into the next block); the image's reads its file buffered.
    blob = str(node.paths.blob(int(Path(lower).name)))
    loops = {}
    for device in Path("/sys/block").glob("loop*"):
        backing = device / "loop" / "backing_file"
        if backing.exists():
            loops[backing.read_text().strip()] = (device / "loop" / "dio").read_text().strip()
    assert loops[blob] == "1", loops
    # The mount's read-ahead is that of its image's loop device, raised to the tree's 1 MiB.
    device = os.stat(lower).st_dev
    assert f"path=/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb" in node.log()
    assert Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb").read_text().strip() == "1024"


def test_a_forced_erofs_the_kernel_refuses_stops_start_up_with_one_line(tmpfs: Path, built: Any, node_factory: Any) -> None:
    node = node_factory(f"file://{built[0]}", data_path="erofs", start_timeout=60)
    node.root = tmpfs / "root"
    node.paths = type(node.paths)(node.root)
    with pytest.raises(ServerStartError, match="(?s)exited with status 2.*refuses a file-backed EROFS mount"):
        node.ensure()


def test_no_erofs_in_the_kernel_falls_back_to_the_tree_with_its_log_line(built: Any, node_factory: Any, tmp_path: Path) -> None:
    listing = tmp_path / "filesystems"
    listing.write_text(NO_EROFS)
    node = node_factory(f"file://{built[0]}", data_path="auto", extra_args=("--kernel-filesystems", str(listing)))
    client = node.ensure()
    status = client.status()["data_path"]
    assert status["path"] == "tree" and "no EROFS" in status["reason"]
    assert chosen(node.log()) == "tree"
    lower = client.mount(built[1][0].chain_id).lower_dir
    assert lower == node.paths.lower_dir(1, "tree") and erofs_mounts(node.root) == []
    assert (Path(lower) / "srv/big.bin").read_bytes() == rich_big_bin()
    # Forced EROFS on that kernel is refused, with the reason.
    with pytest.raises(DataPathUnavailable, match="no EROFS"):
        DataPathProbe(node.paths.layers, str(listing)).choose("loop")


# -- mounting, unmounting, restarting -----------------------------------------------------------------


def test_unmount_leaves_no_mount_and_no_image(built: Any, node_factory: Any) -> None:
    node = node_factory(f"file://{built[0]}", data_path="erofs")
    client = node.ensure()
    first, second = (client.mount(layer.chain_id) for layer in built[1][:2])
    images = sorted(os.listdir(node.paths.erofs_images))
    assert len(images) == 2 and erofs_mounts(node.root) == [first.lower_dir, second.lower_dir]
    held = os.open(Path(first.lower_dir) / "etc/hosts", os.O_RDONLY)  # busy: detached lazily
    try:
        client.unmount(built[1][0].chain_id)
        assert erofs_mounts(node.root) == [second.lower_dir]
        assert os.pread(held, 64, 0) == b"127.0.0.1 localhost\n"  # its user still reads
    finally:
        os.close(held)
    assert "EROFS mount is busy; detaching it lazily" in node.log()
    assert len(os.listdir(node.paths.erofs_images)) == 1
    client.unmount(built[1][1].chain_id)
    assert erofs_mounts(node.root) == [] and os.listdir(node.paths.erofs_images) == []


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_restarted_server_mounts_its_layers_again_at_the_same_lower_dirs(built: Any, node_factory: Any, signum: int) -> None:
    node = node_factory(f"file://{built[0]}", data_path="erofs")
    client = node.ensure()
    lowers = {layer.chain_id: client.mount(layer.chain_id).lower_dir for layer in built[1]}
    before = {chain: read_all(Path(lower)) for chain, lower in lowers.items()}
    assert before[built[1][0].chain_id]["srv/big.bin"] == rich_big_bin()
    rows = {row["chain_id"]: row["data_path"] for row in __import__("json").loads(node.paths.table.read_text())["layers"]}
    assert set(rows.values()) == {"erofs"}

    node.stop(signum)
    if signum == signal.SIGTERM:
        assert erofs_mounts(node.root) == []  # detached before the FUSE mount went
        assert "detached EROFS mount" in node.log()
    else:
        assert sorted(erofs_mounts(node.root)) == sorted(lowers.values())  # stale: their device is gone

    client = node.ensure()
    assert sorted(erofs_mounts(node.root)) == sorted(lowers.values())  # one mount each, not one on another
    for chain, lower in lowers.items():
        assert client.check(chain).lower_dir == lower
        assert read_all(Path(lower)) == before[chain]
    assert {x["chain_id"]: x["data_path"] for x in client.status()["layers"]} == rows
    assert ("unmounting a stale EROFS mount" in node.log()) == (signum == signal.SIGKILL)


def test_an_overlay_over_erofs_lowers_equals_the_tree_paths(built: Any, extracted: Any, node_factory: Any, tmp_path: Path) -> None:
    """The same stack, read through the erofs path and the tree path, is the same tree."""
    trees = {}
    for data_path in ("erofs", "tree"):
        node = node_factory(f"file://{built[0]}", data_path=data_path)
        client = node.ensure()
        lowers = [client.mount(layer.chain_id).lower_dir for layer in built[1]][::-1]
        merged = tmp_path / f"merged-{data_path}"
        merged.mkdir()
        node.overlays.append(merged)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", "lowerdir=" + ":".join(lowers), str(merged)],
                       check=True, timeout=30)  # fmt: skip
        trees[data_path] = (disk_tree(merged, overlay=False), read_all(merged))
    assert trees["erofs"] == trees["tree"]


# -- what FUSE sees ---------------------------------------------------------------------------------


def _requests(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.findall(r'bootseer_fuse_requests_total\{fs="bootseer-layers",op="(\w+)"\} ([0-9.e+]+)', text)
    return {op: float(count) for op, count in found}


def _gauge(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {path: float(v) for path, v in re.findall(r'bootseer_layer_server_data_path\{path="(\w+)"\} ([0-9.]+)', text)}


@pytest.mark.parametrize("data_path", ["erofs", "tree"])
def test_a_full_read_on_erofs_makes_no_per_file_fuse_requests(built: Any, node_factory: Any, data_path: str) -> None:
    port = free_port()
    node = node_factory(f"file://{built[0]}", data_path=data_path, metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    assert _gauge(port) == {"fanotify": 0.0, "erofs": float(data_path == "erofs"), "loop": 0.0, "tree": float(data_path == "tree")}
    lower = Path(client.mount(built[1][0].chain_id).lower_dir)
    before = _requests(port)
    files = read_all(lower)
    assert files["srv/big.bin"] == rich_big_bin()
    made = {op: count - before.get(op, 0) for op, count in _requests(port).items() if count > before.get(op, 0)}
    per_file = {op: made.get(op, 0) for op in ("lookup", "getattr", "open", "opendir", "readdir", "getxattr")}
    assert made.get("read", 0) > 0  # the data still comes through FUSE: block reads of the blob
    if data_path == "erofs":
        assert per_file == dict.fromkeys(per_file, 0), made
    else:
        assert per_file["open"] >= len(files) and per_file["readdir"] > 0, made  # names come by readdirplus here


# -- the image cache and the settings -----------------------------------------------------------------


def test_a_cached_image_of_the_wrong_size_is_built_again(built: Any, tmp_path: Path) -> None:
    import trio

    from bootseer.paths import ServerPaths
    from bootseer.blockstore.datapath.choice import ErofsLayers
    from bootseer.blockstore.objects.erofs_image import build_image

    layer = built[1][0]
    erofs = ErofsLayers(ServerPaths(tmp_path), "erofs", trio.CapacityLimiter(1))
    erofs.prepare()
    name = layer.record.index
    path = erofs.ensure_image(layer.index, name)
    assert path.read_bytes() == build_image(layer.index)
    path.write_bytes(path.read_bytes()[:4096])  # a torn copy
    assert erofs.ensure_image(layer.index, name).read_bytes() == build_image(layer.index)
    erofs.remove_image(name)
    assert not path.exists() and os.listdir(erofs.images) == []


def test_the_data_path_setting_reaches_the_layer_server_and_a_bad_one_is_refused() -> None:
    from bootseer.blockstore.server.client import ServerSettings
    from bootseer.snapshotter import config

    assert config.resolve({}, {}).data_path == "auto"  # fanotify, else EROFS where the kernel has it, else the tree
    assert config.resolve({"fuse.data_path": "loop"}, {"fuse.data_path": "tree"}).data_path == "tree"  # the flag wins
    from bootseer.snapshotter.daemon import build_parser

    assert build_parser().parse_args(["--data-path", "erofs"]).data_path == "erofs"
    with pytest.raises(config.ConfigError, match="key 'fuse.data_path' in the config file: must be one of auto, fanotify, erofs, loop, tree"):
        config.resolve({"fuse.data_path": "fast"}, {})
    assert ServerSettings(data_path="erofs").document()["data-path"] == "erofs"
    assert "data-path" not in ServerSettings().document()
