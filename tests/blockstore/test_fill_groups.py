"""Fill groups on the ``fanotify`` path, for real: an event for a hole fills the missing blocks of its whole group
in one batch, straight into the blob (not the node cache), and the hot-list recorder still sees every block a
start reads first, and none that a group wrote ahead and nobody read.

A real ``bootseer layer-server`` forced to ``fanotify`` over a layer the real converter made (64 KiB blocks, eight
1 MiB files), real EROFS over the real sparse blob, reads in reader processes (in a cgroup of their own where the
recording must attribute them).  What is checked is what the server's metrics and status, the fill map on disk
and the published hot list show.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.event_holder import AHEAD, MAP_HEADER
from bootseer.blockstore.datapath.fanotify import unsupported
from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.hotlist.format import HotList, hotlist_object
from tests.blockstore.test_fanotify import FILES, _expected, blob_of, converted, drop_caches, events, read_all  # noqa: F401
from tests.blockstore.test_blob import _cgroup_base
from tests.blockstore.test_layer_server import node_factory  # noqa: F401 (fixture)
from tests.support.waiting import free_port, wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
    pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
]

FILLED = 1
OFF = BackgroundFillConfig(enabled=False)  #: no background fill: the blob keeps what the reads left


def _file_blocks(built: Any, path: str) -> list[int]:
    return list(next(entry for entry in built.index.entries if entry.path == path).blocks)


def _map(node: Any, built: Any) -> bytes:
    """The blob's fill map on disk, a byte per block."""
    return Path(str(blob_of(node, built))[: -len(".blob")] + ".filled").read_bytes()[MAP_HEADER.size :]


def _read_one_file(converted: Any, node_factory: Any, fill_group: int) -> tuple[Any, Any, int, dict[str, float]]:
    """A fresh node with ``fill_group``: one 1 MiB file read through it, page cache cold; (node, client, metrics
    port, event counts).  Nothing the read fetched went into the node cache (the blob is their one copy)."""
    store, built = converted
    port = free_port()
    node = node_factory(f"file://{store}", data_path="fanotify", metrics_address=f"127.0.0.1:{port}",
                        fill_group=fill_group, background_fill=OFF)  # fmt: skip
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    cached = client.status()["cache"]["bytes"]  # the EROFS image's blocks
    drop_caches()
    assert read_all(lower, [READ]) == {READ: _expected()[READ]}
    assert client.status()["cache"]["bytes"] == cached
    counted = events(port)
    assert counted["denied"] == 0 and counted["unknown"] == 0
    return node, client, port, counted


READ = "data/file3.bin"  #: blocks 48-63 of the test layer; with 2 MiB groups, its group is files 2 and 3
NEIGHBOUR = "data/file2.bin"


def test_an_event_for_a_hole_fills_its_group_in_one_batch_and_the_reads_that_follow_never_wait_on_the_server(
    converted: Any, node_factory: Any
) -> None:
    """One 1 MiB file read from its start: with no fill groups a fill for every range the kernel asks; with 2 MiB
    groups one fill (its group), the rest of the reads answered by the event holder from the fill map.  The blocks
    the reads reached are noted filled, the group's others written ahead; the bytes are right either way.  The
    neighbour the group wrote ahead then reads right with no fill, and its first reads are told to the server,
    which notes them filled."""
    _store, built = converted
    _node, lone_client, _port, alone = _read_one_file(converted, node_factory, 0)
    node, client, port, grouped = _read_one_file(converted, node_factory, 2 << 20)
    fills = client.status()["fanotify"]["fills"]
    assert fills == 1 < lone_client.status()["fanotify"]["fills"], (grouped, alone)
    # A read the kernel made while the group's other blocks were still being written waited on that one fill.
    assert grouped["filled"] <= 3 and grouped["filled"] < alone["filled"], (grouped, alone)
    blocks, neighbour = _file_blocks(built, READ), _file_blocks(built, NEIGHBOUR)
    state = _map(node, built)
    assert all(state[ref] == FILLED for ref in blocks)
    assert [ref for ref, byte in enumerate(state) if byte == AHEAD] == neighbour
    told = client.status()["fanotify"]["first_reads"]  # READ's own blocks past its first range were written ahead too
    assert 0 < told < len(blocks)
    drop_caches()
    assert read_all(client.check(built.chain_id).lower_dir, [NEIGHBOUR]) == {NEIGHBOUR: _expected()[NEIGHBOUR]}
    assert events(port)["filled"] == grouped["filled"]  # on disk: the holder answered every read of it
    wait_until("the first reads are noted", lambda: all(_map(node, built)[ref] == FILLED for ref in neighbour))
    assert client.status()["fanotify"]["first_reads"] == told + len(neighbour)


LATER = "data/file7.bin"  #: read by a later recording only

_READ_IN_CGROUP = """
import hashlib, os, sys
procs, lower, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(procs, "w") as file:
    file.write(str(os.getpid()))
for path in paths:
    with open(os.path.join(lower, path), "rb", buffering=0) as f:
        while f.read(48 * 1024):
            pass
"""


@pytest.mark.parametrize("fill_group", [0, 4 << 20])
def test_a_recording_on_fanotify_has_every_block_its_job_read_and_none_a_fill_group_wrote_ahead_unread(
    converted: Any, node_factory: Any, tmp_path: Path, fill_group: int
) -> None:
    """The hot list of a first boot on ``fanotify`` is the same with fill groups as without: every block of the
    files the job read, and no block of the files it did not (which the groups wrote ahead all the same)."""
    base = _cgroup_base()
    if base is None:
        pytest.skip("no cgroup v2 hierarchy to put a reader in")
    source, built = converted
    store = tmp_path / "store"
    subprocess.run(["cp", "-a", f"{source}/.", str(store)], check=True)  # its own copy: a hot list is published there
    node = node_factory(f"file://{store}", data_path="fanotify", fill_group=fill_group, background_fill=OFF,
                        hotlist_quiet=600, hotlist_window=600)  # fmt: skip
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    container = "fill-" + uuid.uuid4().hex[:12]
    cgroup = base / container
    try:
        cgroup.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup to put a reader in: {exc}")
    read = ["data/file2.bin", "data/file0.bin", "data/file5.bin"]
    try:
        answer = client.call({"op": "hotlist.prepared", "key": f"default/7/{container}", "parent": built.chain_id})
        assert answer["action"] == "record"
        subprocess.run([sys.executable, "-c", _READ_IN_CGROUP, str(cgroup / "cgroup.procs"), lower, *read],
                       check=True, timeout=120)  # fmt: skip
        wanted = {built.index.blocks[ref].digest for path in read for ref in _file_blocks(built, path)}
        wait_until("the first reads reach the recording", lambda: _recorded_blocks(client, container) >= len(wanted))
        if fill_group:  # two groups filled the whole blob: it stays marked while the recording watches it
            assert client.status()["fanotify"]["held_marked"] == 1
        answer = client.call({"op": "hotlist.seal", "container": container})
        assert answer["sealed"] and answer["outcome"] == "published", answer
        # A recording that starts soon after (another profile's) still sees the first reads of blocks a group wrote
        # ahead: the whole blob keeps its mark a while after the last recording (WATCH_HOLD), past the next looks.
        rounds = client.status()["fanotify"]["settle_rounds"]
        wait_until("two looks at the blobs after the seal", lambda: client.status()["fanotify"]["settle_rounds"] >= rounds + 2)
        assert client.status()["fanotify"]["held_marked"] == (1 if fill_group else 0)
        later = "fill-" + uuid.uuid4().hex[:12]
        (base / later).mkdir()
        try:
            answer = client.call({"op": "hotlist.prepared", "key": f"default/8/{later}", "parent": built.chain_id,
                                  "labels": {"containerd.io/snapshot/bootseer.profile": "later"}})  # fmt: skip
            assert answer["action"] == "record", answer
            subprocess.run([sys.executable, "-c", _READ_IN_CGROUP, str(base / later / "cgroup.procs"), lower, LATER],
                           check=True, timeout=120)  # fmt: skip
            wait_until("the later recording sees the first reads", lambda: _recorded_blocks(client, later) >= 16)
        finally:
            (base / later).rmdir()
    finally:
        cgroup.rmdir()
    hot = HotList.decode(FileStoreWriter(store).get(hotlist_object(built.chain_id)), expected_image=built.chain_id,
                         expected_profile="")  # fmt: skip
    assert {block.digest for block in hot.blocks} == wanted
    unread = {built.index.blocks[ref].digest for n in range(FILES) if f"data/file{n}.bin" not in read
              for ref in _file_blocks(built, f"data/file{n}.bin")}  # fmt: skip
    assert not unread & {block.digest for block in hot.blocks}
    if fill_group:  # the groups did write unread files' blocks ahead: the recorder had to tell them apart
        assert AHEAD in _map(node, built)


def _recorded_blocks(client: Any, container: str) -> int:
    """The blocks the running recording of ``container`` holds so far (its status)."""
    for recording in client.call({"op": "hotlist.status"})["recordings"]:
        if container in recording["container"]:
            return int(recording["blocks"])
    return 0
