"""The blob view of a layer: ``blobs/<slot>`` in the layer server's mount, and ``LayerReader.read_blob``.

A layer's blob is every block of its index end to end, block ``i`` at offset
``i * block_size``, each padded with zeros to ``block_size`` (the extra device an
EROFS image of the layer names its chunks in).  What it should hold is computed here
from the layer's tar alone (chunks of ``block_size`` in tar order, each distinct
chunk once: the converter's numbering), never through the code under test.  The FUSE
tests run the real layer server (``ensure_server``) over layers converted by the real
converter (:func:`tests.support.oci.rich_layers`: a sparse file gives zero blocks);
the reader tests run on trio's autojump clock over the same store.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio

from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.server.client import LayerServerClient, ServerSettings, ensure_server
from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.format import Entry, LayerIndex, pack_object
from bootseer.blockstore.datapath.tree import BLOBS, LayerBlobOpenFile, LayerTree, blob_inode_number
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.layer_reader import LayerReader
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.fetch.engine import open_engine
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.sources.local import LocalSource
from bootseer.fuse.operations import OPENER_PID
from bootseer.hotlist.format import HotList, hotlist_object
from tests.support.autojump import FAULT_AUTOJUMP, run
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.mounts import MountProcess
from tests.support.oci import rich_layers
from tests.support.packed_layers import engine_config
from tests.support.processes import wait_process_gone

BLOCK_SIZE = 16 << 10
needs_fuse = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
pytestmark = [pytest.mark.timeout(300)]


def expected_blob(tar_path: Path, block_size: int) -> bytes:
    """The blob of the layer in ``tar_path``, from the tar alone: each distinct ``block_size`` chunk of the
    regular files' data, in tar order, padded with zeros."""
    chunks: list[bytes] = []
    seen: set[str] = set()
    with tarfile.open(tar_path) as tar:
        for member in tar:
            if not member.isreg():  # hard links, directories, devices: no data of their own
                continue
            stream = tar.extractfile(member)
            assert stream is not None
            data = stream.read()  # a sparse member reads with its holes as zeros
            for offset in range(0, len(data), block_size):
                chunk = data[offset : offset + block_size]
                digest = hashlib.sha256(chunk).hexdigest()
                if digest not in seen:
                    seen.add(digest)
                    chunks.append(chunk + bytes(block_size - len(chunk)))
    return b"".join(chunks)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path_factory.mktemp("store")
    layout = tmp_path_factory.mktemp("layout")
    return store, build_store(store, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE, layout=layout)


@pytest.fixture(scope="module")
def blobs(built: tuple[Path, list[BuiltLayer]]) -> list[bytes]:
    return [expected_blob(layer.blob, BLOCK_SIZE) for layer in built[1]]


class _Servers:
    """Real layer servers, each on a fresh node root, for a store URL; stopped (and their mounts gone) after."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[tuple[Path, ServerSettings]] = []

    def __call__(self, store_url: str, **settings: Any) -> LayerServerClient:
        settings.setdefault("retry_timeout", 5)
        settings.setdefault("log_level", "debug")
        root = self.base / f"root{len(self.started)}"
        self.started.append((root, ServerSettings(store=store_url, **settings)))
        return ensure_server(*self.started[-1])

    def restart(self) -> LayerServerClient:
        """Start the last server's root again, as the snapshotter does after a crash (the table restores the slots)."""
        return ensure_server(*self.started[-1])

    def stop_all(self) -> None:
        for root, _settings in self.started:
            stop_layer_servers(root)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Servers]:
    servers = _Servers(tmp_path)
    try:
        yield servers
    finally:
        servers.stop_all()




def blob_path(client: LayerServerClient, chain_id: str) -> Path:
    mounted = client.mount(chain_id)
    return ServerPaths(Path(client.status()["root"])).blob(mounted.slot)


# -- the FUSE file -----------------------------------------------------------------------------


@needs_fuse
def test_the_blob_file_is_the_layers_blocks_end_to_end_padded(built: Any, blobs: list[bytes], server: Any) -> None:
    store, layers = built
    client = server(f"file://{store}")
    paths = [blob_path(client, layer.chain_id) for layer in layers]
    mountpoint = paths[0].parent.parent
    assert sorted(os.listdir(mountpoint / BLOBS)) == sorted(path.name for path in paths)
    assert BLOBS in os.listdir(mountpoint) and {path.name for path in paths} <= set(os.listdir(mountpoint))
    blobs_dir = os.stat(mountpoint / BLOBS)
    assert blobs_dir.st_mode & 0o7777 == 0o500 and blobs_dir.st_uid == 0
    rng = random.Random(3)
    for layer, path, expected in zip(layers, paths, blobs):
        assert len(expected) == len(layer.index.blocks) * BLOCK_SIZE  # the tar and the index agree
        info = os.stat(path)
        assert info.st_size == len(expected)
        assert oct(info.st_mode) == oct(0o100400) and (info.st_uid, info.st_gid) == (0, 0)
        assert info.st_ino == blob_inode_number(int(path.name))
        with open(path, "rb", buffering=0) as file:
            # Ranges across block boundaries first, on a cold page cache, then the whole file.
            for _ in range(20):
                offset = rng.choice([rng.randrange(len(expected)), rng.randrange(1, len(expected) // BLOCK_SIZE) * BLOCK_SIZE - 7])
                size = rng.choice([1, 4096, BLOCK_SIZE + 3, 3 * BLOCK_SIZE])
                assert os.pread(file.fileno(), size, offset) == expected[offset : offset + size]
            assert os.pread(file.fileno(), 10, len(expected)) == b""
        assert path.read_bytes() == expected
    with pytest.raises(OSError) as excinfo:
        os.open(paths[0], os.O_RDWR)
    assert excinfo.value.errno in (errno.EROFS, errno.EACCES)
    assert not os.path.exists(mountpoint / BLOBS / "99")


@needs_fuse
def test_a_blob_keeps_its_inode_number_and_bytes_across_a_server_restart(built: Any, blobs: list[bytes], server: Any) -> None:
    store, layers = built
    client = server(f"file://{store}")
    path = blob_path(client, layers[1].chain_id)
    before = os.stat(path)
    assert path.read_bytes() == blobs[1]
    pid = int(client.status()["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_process_gone(pid)
    with pytest.raises(OSError):  # the dead mount answers nothing until a server takes it over
        path.read_bytes()
    client = server.restart()
    assert blob_path(client, layers[1].chain_id) == path  # the restored table keeps the slot
    after = os.stat(path)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert path.read_bytes() == blobs[1]


@needs_fuse
def test_a_tampered_pack_block_is_eio_from_the_blob_never_wrong_bytes(
    built: Any, blobs: list[bytes], server: Any, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(built[0], store)
    layer = built[1][0]
    index = layer.index
    intact, number = [n for n, block in enumerate(index.blocks) if not block.is_zero][:2]
    block = index.blocks[number]
    pack = store / pack_object(index.packs[block.pack])
    data = bytearray(pack.read_bytes())
    data[block.offset + block.clen // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    client = server(f"file://{store}")
    path = blob_path(client, layer.chain_id)
    with open(path, "rb", buffering=0) as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # read just the pages asked for
        assert os.pread(file.fileno(), 4096, intact * BLOCK_SIZE) == blobs[0][intact * BLOCK_SIZE :][:4096]
        with pytest.raises(OSError) as excinfo:
            os.pread(file.fileno(), 4096, number * BLOCK_SIZE)
        assert excinfo.value.errno == errno.EIO
    stores = client.status()["stores"]
    assert sum(stats["blocks"]["corrupt"] for stats in stores.values()) >= 1
    assert client.status()["health"]["fuse"] == "serving"


@needs_fuse
def test_an_erofs_image_with_the_blob_file_as_its_device_serves_the_layer(built: Any, server: Any, tmp_path: Path) -> None:
    """The kernel reads files' chunks from ``blobs/<slot>``: the EROFS view equals the per-file FUSE view."""
    erofs = pytest.importorskip("bootseer.blockstore.objects.erofs_image", reason="the EROFS writer (branch h/erofs) is not merged here")
    erofs_mount = pytest.importorskip("bootseer.blockstore.datapath.erofs_mount", reason="EROFS mounting (branch h/erofs) is not merged here")
    from tests.support.trees import disk_tree

    store, layers = built
    client = server(f"file://{store}")
    for layer in layers:
        path = blob_path(client, layer.chain_id)
        image = tmp_path / f"{path.name}.erofs"
        image.write_bytes(erofs.build_image(layer.index))
        target = tmp_path / f"erofs-{path.name}"
        target.mkdir()
        erofs_mount.mount_erofs(image, target, device=path)
        try:
            served = disk_tree(target, overlay=False)
            assert served == disk_tree(Path(client.check(layer.chain_id).lower_dir), overlay=False), layer.chain_id
            assert any(meta.type == "file" and meta.size for meta in served.values())
        finally:
            erofs_mount.unmount_erofs(target)


# -- attribution at read time -----------------------------------------------------------------

_READER = """
import os, sys
procs, blob = sys.argv[1], sys.argv[2]
if procs != "-":
    with open(procs, "w") as file:
        file.write(str(os.getpid()))
fd = os.open(blob, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # the kernel reads what is asked, no more
for offset in sys.argv[3:]:
    assert len(os.pread(fd, 4096, int(offset))) == 4096
print(os.getpid())
"""


def _cgroup_base() -> Path | None:
    for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (base / "cgroup.procs").exists() and (base / "cgroup.controllers").exists():
            return base
    return None


@needs_fuse
def test_blob_reads_are_attributed_to_the_reading_process_and_recorded_in_first_touch_order(
    built: Any, server: Any, tmp_path: Path
) -> None:
    base = _cgroup_base()
    if base is None:
        pytest.skip("no cgroup v2 hierarchy to put a reader in")
    store = tmp_path / "store"
    shutil.copytree(built[0], store)
    layers = built[1]
    client = server(f"file://{store}", hotlist_quiet=600, hotlist_window=600)
    for layer in layers:
        client.mount(layer.chain_id)
    top = layers[-1].chain_id
    layer = layers[0]
    path = blob_path(client, layer.chain_id)
    stored = [n for n, block in enumerate(layer.index.blocks) if not block.is_zero]
    assert len(stored) >= 7
    container = "blobjob-" + uuid.uuid4().hex[:12]
    cgroup = base / container
    try:
        cgroup.mkdir()
    except OSError as exc:  # a container without cgroup delegation, say
        pytest.skip(f"cannot create a cgroup to put a reader in: {exc}")
    try:
        answer = client.call({"op": "hotlist.prepared", "key": f"default/7/{container}", "parent": top})
        assert answer["action"] == "record"

        def read_blocks(numbers: list[int], in_container: bool) -> int:
            procs = str(cgroup / "cgroup.procs") if in_container else "-"
            offsets = [str(number * BLOCK_SIZE) for number in numbers]
            done = subprocess.run([sys.executable, "-c", _READER, procs, str(path), *offsets],
                                  check=True, capture_output=True, text=True, timeout=60)  # fmt: skip
            return int(done.stdout)

        first = read_blocks([stored[5], stored[1], stored[3]], in_container=True)
        read_blocks([stored[2], stored[4]], in_container=False)  # a host process: not the container's
        second = read_blocks([stored[1], stored[6]], in_container=True)  # stored[1] again: touched already
        assert first != second
        answer = client.call({"op": "hotlist.seal", "container": container})
        assert answer["sealed"] and answer["outcome"] == "published", answer
    finally:
        cgroup.rmdir()
    hot = HotList.decode(FileStoreWriter(store).get(hotlist_object(top)), expected_image=top, expected_profile="")
    order = [stored[5], stored[1], stored[3], stored[6]]
    assert [block.digest for block in hot.blocks] == [layer.index.blocks[n].digest for n in order]
    assert {block.layer for block in hot.blocks} == {layer.chain_id}
    assert hot.container == container and hot.unattributed == 0


def _serve_blob(store: str, index_path: str, mountpoint: str) -> None:
    """The mount program: a LayersRoot serving one layer in slot 1, its observer printing every blob read."""
    from bootseer.blockstore.datapath.tree import LayersRoot
    from bootseer.fuse import ReadOnlyOperations, end_on_signals, mount_options, serve

    class Printing:
        def opened(self, tree: LayerTree) -> None:
            return None

        def read(self, tree: LayerTree, entry: Entry, offset: int, size: int, tag: None) -> None:
            print(f"read {entry.path}", flush=True)

        def blob_read(self, layer: str, index: LayerIndex, refs: Any, pid: int) -> None:
            print("blob_read", pid, *refs, flush=True)

    index = LayerIndex.decode(Path(index_path).read_bytes())
    root = LayersRoot()

    async def run() -> None:
        source = LocalSource(store)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with open_engine(source, engine_config()) as engine:
                tree = LayerTree(1, index, LayerReader(index, BlockFetcher(engine, None)), name="layer")
                tree.observer = Printing()
                root.layers[1] = tree
                ops = ReadOnlyOperations(root, name="blob-test")
                async with trio.open_nursery() as nursery:
                    options = mount_options(fsname="blob-test", subtype="blob-test", allow_other=True)
                    session = await nursery.start(lambda task_status: serve(ops, mountpoint, options=options, task_status=task_status))
                    nursery.start_soon(lambda: end_on_signals(session, signals, grace=5))
                    print("ready", flush=True)
        source.close()

    trio.run(run)


@needs_fuse
def test_the_observer_gets_the_pid_of_the_process_that_reads_the_blob(built: Any, tmp_path: Path) -> None:
    store, layers = built
    index = layers[0].index
    index_path = tmp_path / "index.json"
    index_path.write_bytes(index.encode())
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = MountProcess([sys.executable, "-m", "tests.blockstore.test_blob", str(store), str(index_path), str(mountpoint)],
                         mountpoint, tmp_path, "ready", cwd=Path(__file__).resolve().parents[2])
    try:
        mount.wait_ready()
        stored = [n for n, block in enumerate(index.blocks) if not block.is_zero]
        numbers = [stored[3], stored[0], stored[2]]
        done = subprocess.run([sys.executable, "-c", _READER, "-", str(mountpoint / BLOBS / "1"),
                               *(str(n * BLOCK_SIZE) for n in numbers)],
                              check=True, capture_output=True, text=True, timeout=60)  # fmt: skip
        reader = int(done.stdout)
        seen = [line.split()[1:] for line in mount.stdout.splitlines() if line.startswith("blob_read")]
        assert seen == [[str(reader), str(n)] for n in numbers]
    finally:
        mount.cleanup()


class _Observer:
    """The read-observer protocol, remembering what it was shown."""

    def __init__(self) -> None:
        self.blob_reads: list[tuple[str, list[int], int]] = []

    def opened(self, tree: LayerTree) -> None:
        return None

    def read(self, tree: LayerTree, entry: Entry, offset: int, size: int, tag: None) -> None:
        raise AssertionError("a blob read is not a file read")

    def blob_read(self, layer: str, index: LayerIndex, refs: Any, pid: int) -> None:
        self.blob_reads.append((layer, list(refs), pid))


class _Zeros:
    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        raise AssertionError("not a file read")

    async def read_blob(self, offset: int, size: int) -> bytes:
        return bytes(size)


def test_the_observer_gets_the_blocks_a_blob_read_covers_and_the_reader(built: Any) -> None:
    """A process that opens the blob reads through its own open: its pid stands for its reads.  The handle
    the layer server opens itself (mounting EROFS on the blob, for every reader) names no reader: 0."""
    index = built[1][0].index
    tree = LayerTree(4, index, _Zeros(), name="sha256:layer")
    observer = tree.observer = _Observer()

    async def main() -> None:
        for opener, expected in ((4242, 4242), (os.getpid(), 0)):
            OPENER_PID.set(opener)  # as the FUSE open handler sets it
            opened = LayerBlobOpenFile(tree)
            assert await opened.read(BLOCK_SIZE - 1, 2) == b"\0\0"  # straddles blocks 0 and 1
            assert await opened.read(tree.index.blob_size - 5, 100) == bytes(5)  # clipped at the end
            assert await opened.read(tree.index.blob_size, 100) == b""  # past it: nothing read, nothing shown
            last = len(index.blocks) - 1
            assert observer.blob_reads == [("sha256:layer", [0, 1], expected), ("sha256:layer", [last], expected)]
            observer.blob_reads.clear()

    trio.run(main)


def test_a_blob_opened_from_a_worker_thread_of_the_server_names_no_reader(built: Any) -> None:
    """The server mounts EROFS on a blob from a worker thread: the FUSE open's pid is that thread's id,
    not ``os.getpid()``; its reads are still the server's own handle's (0), not a stranger's."""
    import threading

    index = built[1][0].index
    tree = LayerTree(4, index, _Zeros(), name="sha256:layer")
    observer = tree.observer = _Observer()
    ready, done, ids = threading.Event(), threading.Event(), []

    def worker() -> None:
        ids.append(threading.get_native_id())
        ready.set()
        done.wait(60)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        ready.wait(60)
        assert ids[0] != os.getpid()

        async def main() -> None:
            OPENER_PID.set(ids[0])  # as the FUSE open handler sets it for mount(2) in that thread
            assert await LayerBlobOpenFile(tree).read(0, 2) == b"\0\0"

        trio.run(main)
    finally:
        done.set()
        thread.join()
    assert observer.blob_reads == [("sha256:layer", [0], 0)]


# -- the reader --------------------------------------------------------------------------------


def test_random_blob_ranges_across_block_boundaries_are_byte_exact(built: Any, blobs: list[bytes], tmp_path: Path) -> None:
    store, layers = built
    rng = random.Random(7)
    source = FaultySource(LocalSource(str(store)))

    async def main() -> None:
        async with open_engine(source, engine_config()) as engine:
            for readahead_max in (0, 2 << 20):
                fetcher = BlockFetcher(engine, BlockCache(str(tmp_path / f"cache{readahead_max}"), 64 << 20))
                for layer, expected in zip(layers, blobs):
                    reader = LayerReader(layer.index, fetcher, layer.chain_id, readahead_max=readahead_max)
                    assert layer.index.blob_size == len(expected)
                    for _ in range(80):
                        offset = rng.choice([0, rng.randrange(len(expected) + BLOCK_SIZE),
                                             rng.randrange(1, len(expected) // BLOCK_SIZE + 1) * BLOCK_SIZE - 1])  # fmt: skip
                        size = rng.choice([0, 1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, rng.randrange(1, 4 * BLOCK_SIZE), 128 << 10])
                        assert await reader.read_blob(offset, size) == expected[offset : offset + size]
                    assert await reader.read_blob(0, len(expected) + 1) == expected
                    with pytest.raises(ValueError, match="invalid read"):
                        await reader.read_blob(-1, 10)
            assert fetcher.statistics().corrupt == 0

    try:
        run(main)
    finally:
        source.close()


def test_zero_blocks_read_as_zeros_and_fetch_nothing(built: Any, blobs: list[bytes], tmp_path: Path) -> None:
    store, layers = built
    index = layers[0].index
    zero = [n for n, block in enumerate(index.blocks) if block.is_zero]
    assert zero  # the sparse file's holes
    source = FaultySource(LocalSource(str(store)))

    async def main() -> None:
        async with open_engine(source, engine_config()) as engine:
            fetcher = BlockFetcher(engine, None)
            reader = LayerReader(index, fetcher, layers[0].chain_id)
            for number in zero:
                assert await reader.read_blob(number * BLOCK_SIZE, BLOCK_SIZE) == bytes(BLOCK_SIZE)
            assert fetcher.statistics().blocks_fetched == 0 and source.bytes_read() == 0
            assert fetcher.statistics().zero_blocks == len(zero)

    try:
        run(main)
    finally:
        source.close()


def test_a_blob_read_that_misses_reads_the_next_blocks_ahead(built: Any, blobs: list[bytes]) -> None:
    """The blob's read-ahead is the file reads': the pack's next blocks ride with the miss, and a read that
    lands on them fetches nothing of its own."""
    store, layers = built
    index = layers[0].index
    source = FaultySource(LocalSource(str(store)))

    async def main() -> None:
        async with open_engine(source, engine_config()) as engine:
            fetcher = BlockFetcher(engine, None)
            reader = LayerReader(index, fetcher, layers[0].chain_id)
            assert await reader.read_blob(0, BLOCK_SIZE) == blobs[0][:BLOCK_SIZE]
            assert fetcher.statistics().readahead_blocks > 0
            assert await reader.read_blob(BLOCK_SIZE, BLOCK_SIZE) == blobs[0][BLOCK_SIZE : 2 * BLOCK_SIZE]
            assert fetcher.statistics().readahead_read >= 1

    try:
        run(main)
    finally:
        source.close()


def test_a_store_that_fails_is_eio_from_the_blob_within_the_retry_timeout(built: Any, blobs: list[bytes]) -> None:
    store, layers = built
    index = layers[0].index
    stored = [n for n, block in enumerate(index.blocks) if not block.is_zero]
    retry_timeout = 8.0
    source = FaultySource(LocalSource(str(store)))

    async def main() -> None:
        async with open_engine(source, engine_config(retry_timeout=retry_timeout)) as engine:
            fetcher = BlockFetcher(engine, None)
            reader = LayerReader(index, fetcher, layers[0].chain_id, readahead_max=0)
            for outage, number in (("hang", stored[0]), ("errors", stored[1])):
                if outage == "hang":
                    source.pause()  # accepts and never answers
                else:
                    source.fail()  # every read fails, forever
                start = trio.current_time()
                with pytest.raises(FetchError) as caught:
                    await reader.read_blob(number * BLOCK_SIZE, 100)
                assert caught.value.errno == errno.EIO
                assert retry_timeout <= trio.current_time() - start < retry_timeout + 5
                source.resume()
                source.heal()
                await trio.sleep(retry_timeout)  # the engine fails a range that just failed at once, for a while
                expected = blobs[0][number * BLOCK_SIZE :][:100]
                assert await reader.read_blob(number * BLOCK_SIZE, 100) == expected

    try:
        run(main, autojump=FAULT_AUTOJUMP)
    finally:
        source.close()


if __name__ == "__main__":
    _serve_blob(*sys.argv[1:4])
