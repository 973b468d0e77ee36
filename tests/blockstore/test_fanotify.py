"""The ``fanotify`` data path for real: local blobs filled on the kernel's pre-access events, and a layer
server killed under reading containers without a zero or wrong byte reaching them.

Each test starts a real ``bootseer layer-server`` forced to ``fanotify`` (as the snapshotter
does: tests/blockstore/test_layer_server.py's ``Node``) over layers converted by the real
converter, mounts real EROFS images over real sparse blobs on this machine's ext4, and reads
them through the kernel, in reader processes (a read waiting on a killed server must not
hang the test process).  What is checked is what the kernel, the blob on disk, the event
holder and the server's metrics show.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.fanotify import unsupported
from tests.blockstore.test_layer_server import node_factory  # noqa: F401,F811 (fixture)
from tests.support.layer_servers import EVENT_HOLDER, layer_server_processes, stop_event_holders
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import BigFile, File, Layer
from tests.support.mounts import mount_entry
from tests.support.waiting import free_port, wait_until

BLOCK_SIZE = 64 << 10
FILES = 8  #: big files of the layer, each read by one reader at a time
FILE_SIZE = 1 << 20

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
    pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
]


def _layer() -> Layer:
    entries: list[Any] = [BigFile(f"data/file{n}.bin", FILE_SIZE, seed=n + 1) for n in range(FILES)]
    entries += [File(f"small/s{n}.txt", f"small file {n}\n".encode() * (n + 1)) for n in range(20)]
    return Layer(tuple(entries))


def _expected() -> dict[str, str]:
    return _layer().file_digests()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuiltLayer]:
    store = tmp_path_factory.mktemp("store")
    built = build_store(store, [_layer()], block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))
    return store, built[0]


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def events(port: int) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r'bootseer_fanotify_events_total\{outcome="(\w+)"\} ([0-9.]+)', metrics(port))}


READER = r"""
import hashlib, json, os, sys
root, paths = sys.argv[1], sys.argv[2:]
out = {}
for path in paths:
    digest = hashlib.sha256()
    with open(os.path.join(root, path), "rb", buffering=0) as f:
        while chunk := f.read(48 * 1024):
            digest.update(chunk)
    out[path] = digest.hexdigest()
print(json.dumps(out))
"""


def start_reader(lower: str, paths: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", READER, lower, *paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_all(lower: str, paths: list[str]) -> dict[str, str]:
    reader = start_reader(lower, paths)
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    return json.loads(out)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def blob_of(node: Any, built: BuiltLayer) -> Path:
    return node.root / "cache" / "blobs" / f"{built.record.index}.blob"


def test_a_layer_reads_back_byte_for_byte_from_a_blob_filled_on_events_then_unmarked(converted: Any, node_factory: Any) -> None:
    store, built = converted
    port = free_port()
    node = node_factory(f"file://{store}", data_path="fanotify", metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    assert client.status()["data_path"] == {"path": "fanotify", "reason": "forced"}
    lower = client.mount(built.chain_id).lower_dir
    entry = mount_entry(Path(lower))
    assert entry is not None and entry.fstype == "erofs"
    blob = blob_of(node, built)
    assert os.stat(blob).st_size == built.index.blob_size
    assert os.stat(blob).st_blocks == 0  # sparse: nothing on disk before a read
    expected = _expected()
    half = [f"data/file{n}.bin" for n in range(FILES // 2)]  # the small files' data is in the image
    assert read_all(lower, half) == {path: expected[path] for path in half}
    counted = events(port)
    assert counted["filled"] > 0 and counted["denied"] == 0 and counted["unknown"] == 0
    stats = client.status()["fanotify"]
    assert stats["blobs"] == 1 and stats["complete"] == 0 and 0 < stats["missing_blocks"] < len(built.index.blocks)
    # Read again with the page cache dropped: every block is on disk, so the event holder answers each
    # event itself (from the fill map), and the server sees none.
    drop_caches()
    assert read_all(lower, half) == {path: expected[path] for path in half}
    again = wait_until("the holder's count reaches the server", lambda: (s := client.status()["fanotify"])["answered_by_holder"] and s)
    assert again["answered"] == stats["answered"] and again["missing_blocks"] == stats["missing_blocks"]
    assert events(port)["present"] >= again["answered_by_holder"] > 0
    # The rest: every block of the layer is then on disk, and the blob loses its mark.
    assert read_all(lower, sorted(expected)) == expected
    wait_until("the blob is complete", lambda: client.status()["fanotify"]["complete"] == 1)
    assert client.status()["fanotify"]["missing_blocks"] == 0
    # With the page cache dropped, every byte comes from the local disk with no event at all.
    before = events(port)
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected
    assert events(port) == before


def test_a_block_that_fails_verification_is_eio_and_never_written(tmp_path: Path, node_factory: Any) -> None:
    store = tmp_path / "store"
    built = build_store(store, [_layer()], block_size=BLOCK_SIZE, layout=tmp_path / "layout")[0]
    port = free_port()
    node = node_factory(f"file://{store}", data_path="fanotify", metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    missing = client.status()["fanotify"]["missing_blocks"]
    # Flip a byte in every pack: every block read from the store from now on fails its SHA-256.
    for pack in (store / "v1" / "packs").rglob("*"):
        if pack.is_file():
            data = bytearray(pack.read_bytes())
            for at in range(0, len(data), 4096):
                data[at] ^= 0xFF
            pack.write_bytes(bytes(data))
    reader = start_reader(lower, ["data/file3.bin"])
    _out, err = reader.communicate(timeout=120)
    assert reader.returncode != 0 and "Input/output error" in err
    assert events(port)["denied"] > 0
    blob = blob_of(node, built)
    # Nothing was written: the blob's range of that file holds no data on disk (a hole, SEEK_DATA finds none).
    with open(blob, "rb") as opened:
        with pytest.raises(OSError):
            os.lseek(opened.fileno(), 0, os.SEEK_DATA)
    assert client.status()["fanotify"]["missing_blocks"] == missing > 0  # none written


def mount_id(path: str) -> int:
    """The kernel's id of the mount on ``path`` (a new mount gets a new one)."""
    with open("/proc/self/mountinfo") as mounts:
        ids = [int(line.split()[0]) for line in mounts if line.split()[4] == os.path.realpath(path)]
    assert ids, f"{path} is not mounted"
    return ids[-1]


def _holders(node: Any) -> list[int]:
    return sorted(layer_server_processes(node.root, EVENT_HOLDER))


def test_sigkill_under_four_readers_twice_loses_no_read_and_serves_no_wrong_byte(
    converted: Any, node_factory: Any, range_http_factory: Any
) -> None:
    store, built = converted
    server = range_http_factory(store)
    node = node_factory(server.url, data_path="fanotify")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    mounted = mount_id(lower)
    holders = _holders(node)
    assert len(holders) == 2  # the active holder and its standby
    # From now on the store holds every pack GET: the readers' blocks are in flight when the server dies.
    packs = {"/" + str(p.relative_to(store)) for p in (store / "v1" / "packs").rglob("*") if p.is_file()}
    release = server.faults.hold(packs)
    expected = _expected()
    big = sorted(path for path in expected if path.startswith("data/"))
    readers = [start_reader(lower, big[n::4]) for n in range(4)]
    try:
        wait_until("the server's fetches are held", lambda: server.faults.waiting >= 1)
        wait_until("events wait on the server", lambda: client.status()["fanotify"]["pending"] >= 1)
        for restart in range(2):
            pid = node.pid()
            held = server.faults.waiting
            os.kill(pid, signal.SIGKILL)
            wait_until("the server is gone", lambda: pid not in layer_server_processes(node.root))
            assert all(reader.poll() is None for reader in readers), "a read ended while its server was dead"
            client = node.ensure()  # the next server: it takes the group, the mount and the pending events over
            assert node.pid() != pid
            if restart == 0:  # its own fetches of the same blocks are held in turn: kill it too
                wait_until("the new server's fetches are held", lambda: server.faults.waiting > held)
        assert _holders(node) == holders
        assert mount_id(lower) == mounted  # the EROFS mount outlived both servers
        release.set()
        results = {}
        for reader in readers:
            out, err = reader.communicate(timeout=120)
            assert reader.returncode == 0, err
            results.update(json.loads(out))
    finally:
        release.set()
        for reader in readers:
            if reader.poll() is None:
                reader.kill()
    assert results == {path: expected[path] for path in big}
    assert "took over the EROFS mount" in node.log()


def _read_one(converted: Any, node_factory: Any, path: str) -> tuple[Any, Any, str, dict[str, str]]:
    """A fanotify node with the layer mounted and ``path`` read through it: the node, its client, the lower dir,
    and every file's expected SHA-256."""
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, [path]) == {path: expected[path]}
    return node, client, lower, expected


def test_a_stopped_server_keeps_the_holder_while_a_blob_has_holes_and_releases_it_when_none_has(
    converted: Any, node_factory: Any
) -> None:
    node, client, lower, expected = _read_one(converted, node_factory, "small/s1.txt")
    node.stop(signal.SIGTERM)
    assert len(_holders(node)) == 2  # holes: the group (held by the holder and its standby) must outlive the server
    assert mount_entry(Path(lower)) is not None
    client = node.ensure()
    assert read_all(lower, sorted(expected)) == expected  # the rest, answered by the next server
    wait_until("the blob is complete", lambda: client.status()["fanotify"]["complete"] == 1)
    node.stop(signal.SIGTERM)
    wait_until("the holder is released", lambda: not _holders(node))
    assert read_all(lower, sorted(expected)) == expected  # a whole blob needs nobody


def test_with_its_holder_gone_too_a_restart_detaches_the_old_mounts_and_mounts_again(converted: Any, node_factory: Any) -> None:
    """The group died with the holder: the old mount's blob is no longer marked, so it is never used again."""
    node, client, lower, expected = _read_one(converted, node_factory, "data/file0.bin")
    pid = node.pid()
    os.kill(pid, signal.SIGKILL)
    wait_until("the server is gone", lambda: pid not in layer_server_processes(node.root))
    assert len(stop_event_holders(node.root)) == 2  # the active holder and its standby, at once: the group closes
    assert not _holders(node)
    client = node.ensure()
    # A new mount over a newly marked blob (the kernel may give it the old one's number again).
    assert "unmounting a stale EROFS mount" in node.log() and "took over the EROFS mount" not in node.log()
    assert mount_id(lower) > 0
    assert client.status()["fanotify"]["holder_adopted"] is False
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected


def test_events_parse_with_their_range_and_a_deny_carries_only_an_errno_the_kernel_takes() -> None:
    import errno
    import struct

    from bootseer.blockstore.datapath import fanotify

    def record(fd: int, pid: int, offset: int, count: int) -> bytes:
        info = struct.pack("<BBH", fanotify.FAN_EVENT_INFO_TYPE_RANGE, 0, 24) + b"\0" * 4 + struct.pack("<QQ", offset, count)
        return struct.pack("<IBBHQii", 24 + len(info), 3, 0, 24, fanotify.FAN_PRE_ACCESS, fd, pid) + info

    events = fanotify.parse_events(record(7, 100, 8192, 4096) + record(8, 101, 1 << 40, 262144))
    assert [(e.fd, e.pid, e.offset, e.count) for e in events] == [(7, 100, 8192, 4096), (8, 101, 1 << 40, 262144)]
    with pytest.raises(fanotify.FanotifyError, match="version 2"):
        fanotify.parse_events(record(7, 100, 0, 1)[:4] + b"\x02" + record(7, 100, 0, 1)[5:])
    assert fanotify.deny(errno.EIO) == 2 | (errno.EIO << 24)
    with pytest.raises(ValueError, match="ENOENT"):
        fanotify.deny(errno.ENOENT)


def test_the_prefetch_writes_hot_blocks_into_the_blob_and_the_last_one_unmarks_it(converted: Any, tmp_path: Path) -> None:
    """The hot-list warmer's target on this path (``BlobTarget``): each block at its blob offset, in the fill
    map, and the blob unmarked once every block a file addresses is there (reads then raise no event)."""
    from bootseer.blockstore.datapath import fanotify
    from bootseer.blockstore.datapath.local_blobs import LocalBlob
    from bootseer.blockstore.objects.erofs_image import build_image
    from bootseer.hotlist.format import HotBlock, ResolvedBlock
    from bootseer.hotlist.warm import BlobTarget, PageCacheWarmer
    from tests.support.trees import read_block

    store, built = converted
    index = built.index
    image = tmp_path / "image"
    image.write_bytes(build_image(index))  # no inline data: every file's blocks are addressed
    group = fanotify.init_group()
    try:
        blob = LocalBlob(tmp_path, built.record.index, index, None, group)
        blob.mark()
        from bootseer.blockstore.datapath.image_checker import addressed_file

        assert not blob.note_unread(addressed_file(str(image), index.blob_size, index.block_size, len(index.entries)))
        assert blob.marked and blob.missing_count == len(index.blocks) - blob.filled.count(2) > 0
        warmer = PageCacheWarmer({"layer": index}, {"layer": BlobTarget(blob)}, set())
        assert warmer.wants_bytes("layer")
        order = sorted(range(len(index.blocks)), key=lambda ref: -ref)  # the hot list's order: any
        resolved = [ResolvedBlock("layer", ref, HotBlock("layer", index.blocks[ref].digest, "", 0, 0, 0, 0.0)) for ref in order]
        half = len(resolved) // 2
        data = [read_block(store, index, block.ref) for block in resolved]
        assert warmer.warm("layer", resolved[:half], data[:half]) == sum(map(len, data[:half]))
        assert blob.marked and blob.missing_count > 0  # (not read here: nothing answers this group's events)
        # The prefetch's end asks the page cache what it still holds (mincore of a mapping): through the
        # blob's writer, since a mapping of the marked blob raises an event for the whole mapped range.
        import threading

        answer: list[set[tuple[str, str]]] = []
        asking = threading.Thread(target=lambda: answer.append(warmer.resident()), daemon=True)
        asking.start()
        asking.join(timeout=30)
        if asking.is_alive():  # it waits on an event nobody answers: closing the group lets it go
            os.close(group)
            group = fanotify.init_group()
            pytest.fail("resident() raised a pre-access event on the marked blob")
        assert answer == [{("layer", block.hot.digest) for block in resolved[:half]}]
        warmer.warm("layer", resolved[half:], data[half:])
        assert blob.complete and not blob.marked
        with open(blob.path, "rb") as written:  # unmarked: an ordinary read, no one answers events any more
            for block, payload in zip(resolved, data):
                written.seek(index.blob_offset(block.ref))
                assert written.read(len(payload)) == payload
        on_disk = (tmp_path / f"{built.record.index}.filled").read_bytes()[-len(index.blocks):]
        assert set(on_disk) <= {1, 2} and on_disk.count(1) == len(index.blocks) - blob.filled.count(2)
        blob.close(remove=True)
        assert not blob.path.exists()
    finally:
        os.close(group)


def test_a_layer_with_all_zero_blocks_becomes_whole_and_unmarked_once_its_data_is_read(tmp_path: Path, node_factory: Any) -> None:
    """All-zero blocks are holes in the image, never read through it: they never keep a blob marked."""
    store = tmp_path / "store"
    data = os.urandom(3 * BLOCK_SIZE)
    layer = Layer((File("data/zeros.bin", bytes(4 * BLOCK_SIZE)), File("data/random.bin", data)))
    built = build_store(store, [layer], block_size=BLOCK_SIZE, layout=tmp_path / "layout")[0]
    assert any(block.is_zero for block in built.index.blocks)
    node = node_factory(f"file://{store}", data_path="fanotify")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    assert client.status()["fanotify"]["missing_blocks"] == 3  # the random file's; none of the zeros
    digests = read_all(lower, ["data/zeros.bin", "data/random.bin"])
    assert digests == {"data/zeros.bin": hashlib.sha256(bytes(4 * BLOCK_SIZE)).hexdigest(),
                       "data/random.bin": hashlib.sha256(data).hexdigest()}  # fmt: skip
    wait_until("the blob is whole and unmarked", lambda: client.status()["fanotify"]["complete"] == 1)
