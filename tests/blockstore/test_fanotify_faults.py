"""The ``fanotify`` data path under faults (issue 35): a full cache disk, a failing store, two servers on one cache.

Each test starts real ``bootseer layer-server`` processes forced to ``fanotify`` (as
tests/blockstore/test_fanotify.py does) over a layer converted by the real converter, and
reads it through the kernel in reader processes (a read waiting on a dead server must not
hang the test process).  The faults are real too: a 64 MiB ext4 filesystem on a loop device
filled up to its last block, an HTTP store answering every range request 500, a second
server given the first one's ``--cache-dir``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.fanotify import unsupported
from bootseer.blockstore.server.client import ServerStartError
from tests.blockstore.test_fanotify import BLOCK_SIZE, _expected, _layer, events, read_all, start_reader
from tests.blockstore.test_layer_server import node_factory  # noqa: F401,F811 (fixture)
from tests.support.layer_servers import EVENT_HOLDER, layer_server_processes
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.mounts import mount_entry
from tests.support.waiting import free_port, wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
    pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
]

#: Seconds a failing fetch is retried before EIO, on the servers of the failing-store test.
RETRY_TIMEOUT = 3.0
#: What a reader may take, at most, in the whole read (process start and exit included) before its
#: EIO, as a multiple of the retry timeout: one timeout and a margin for a loaded 2-core machine.
FAILING_READ_BOUND = 1.8
READ_TIMEOUT = 60.0  #: a reader that has not ended by then hangs (a hang detector, not a speed bound)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuiltLayer]:
    store = tmp_path_factory.mktemp("store")
    built = build_store(store, [_layer()], block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))
    return store, built[0]


def finish(reader: subprocess.Popen[str]) -> tuple[int, str, str]:
    """The reader's exit status, stdout and stderr; it is killed (and the test fails) if it hangs."""
    try:
        out, err = reader.communicate(timeout=READ_TIMEOUT)
    except subprocess.TimeoutExpired:
        reader.kill()
        reader.communicate()
        pytest.fail(f"a read still hangs after {READ_TIMEOUT:g}s")
    return reader.returncode, out, err


# -- a full cache filesystem --------------------------------------------------------------------


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 filesystem (4 KiB blocks, none reserved for root) on a loop device, mounted; unmounted
    at teardown (ask for it before ``node_factory``: its servers, mounts and holders go first)."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 (e2fsprogs)")
    image = tmp_path / "cache.ext4"
    with open(image, "wb") as made:
        made.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", str(image)], check=True, capture_output=True, timeout=60)
    mountpoint = tmp_path / "cache"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "ext4", "-o", "loop", str(image), str(mountpoint)], capture_output=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image on a loop device here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=60)


def fill_up(directory: Path) -> Path:
    """Write a file in ``directory`` until its filesystem has no block left to give (less than 4 KiB free,
    delayed allocation's reservations settled by fsync); the file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as file:
        for chunk in (b"\xa5" * (1 << 20), b"\xa5" * 4096):
            while True:
                try:
                    file.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        while True:  # an fsync may hand back blocks reserved for metadata: take them too
            os.fsync(file.fileno())
            try:
                file.write(b"\xa5" * 4096)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    space = os.statvfs(directory)
    assert space.f_bavail * space.f_frsize < 4096, "the filesystem still has a block free"
    return filler


def test_a_fill_that_cannot_write_its_blocks_fails_the_read_the_server_stays_up_and_reads_work_once_space_is_back(
    small_ext4: Path, converted: Any, node_factory: Any
) -> None:
    """ENOSPC on the cache filesystem during a fill: the read fails (it hung, its server dead) with an errno the
    kernel takes (EIO through EROFS, or ENOSPC), counted as ``write_failed`` and logged; the same server answers
    on, and no block is noted as on disk; once the space is back the same read returns the right bytes."""
    store, built = converted
    port = free_port()
    node = node_factory(f"file://{store}", data_path="fanotify", cache_dir=str(small_ext4), metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    pid = node.pid()
    lower = client.mount(built.chain_id).lower_dir
    blob = small_ext4 / "blobs" / f"{built.record.index}.blob"
    assert blob.is_file() and mount_entry(Path(lower)) is not None
    missing = client.status()["fanotify"]["missing_blocks"]
    filler = fill_up(small_ext4)
    path = "data/file3.bin"
    returncode, _out, err = finish(start_reader(lower, [path]))
    assert returncode != 0 and ("Input/output error" in err or "No space left on device" in err), err
    assert node.pid() == pid  # the same server, still answering
    assert events(port).get("write_failed", 0) >= 1
    assert "No space left on device" in node.log()
    assert client.status()["fanotify"]["missing_blocks"] == missing  # nothing noted as on disk
    filler.unlink()
    assert read_all(lower, [path]) == {path: _expected()[path]}
    assert node.pid() == pid


def test_the_prefetch_skips_hot_blocks_it_cannot_write_into_a_blob_on_a_full_filesystem(small_ext4: Path, converted: Any) -> None:
    """The hot-list warmer's blob target (``BlobTarget``) on a full disk: ``warm`` writes nothing, counts the blocks
    as skipped and raises nothing (a batch that raised would end the whole prefetch), and the blocks stay missing;
    once space is back the same batch is written."""
    from bootseer.blockstore.datapath import fanotify
    from bootseer.blockstore.datapath.local_blobs import LocalBlob
    from bootseer.hotlist.format import HotBlock, ResolvedBlock
    from bootseer.hotlist.warm import BlobTarget, PageCacheWarmer
    from tests.support.trees import read_block

    store, built = converted
    index = built.index
    group = fanotify.init_group()
    try:
        blob = LocalBlob(small_ext4, built.record.index, index, None, group)
        blob.mark()
        refs = [ref for ref in range(len(index.blocks)) if not blob.filled[ref]][:4]
        resolved = [ResolvedBlock("layer", ref, HotBlock("layer", index.blocks[ref].digest, "", 0, 0, 0, 0.0)) for ref in refs]
        data = [read_block(store, index, ref) for ref in refs]
        warmer = PageCacheWarmer({"layer": index}, {"layer": BlobTarget(blob)}, set())
        missing = blob.missing_count
        filler = fill_up(small_ext4)
        assert warmer.warm("layer", resolved, data) == 0
        assert warmer.skipped == len(refs) and blob.missing_count == missing and blob.missing(refs) == refs
        filler.unlink()
        assert warmer.warm("layer", resolved, data) == sum(map(len, data))
        assert blob.missing_count == missing - len(refs) and not blob.missing(refs)
        blob.close(remove=True)
    finally:
        os.close(group)


# -- a failing store ------------------------------------------------------------------------------


def test_a_read_of_many_missing_blocks_from_a_failing_store_fails_within_one_retry_timeout_then_reads_once_it_is_back(
    converted: Any, node_factory: Any, range_http_factory: Any
) -> None:
    """A store answering every range request 500: a 1 MiB read (16 blocks, none on disk) fails with EIO in one
    ``retry_timeout`` (the first fill waits it out; the read's later events are denied at once, counted as
    ``store_failing``), not one timeout per block; once the store answers again a read gets the right bytes."""
    store, built = converted
    server = range_http_factory(store)
    port = free_port()
    node = node_factory(server.url, data_path="fanotify", retry_timeout=RETRY_TIMEOUT, metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    server.faults.range_answer = 500
    path = "data/file5.bin"
    started = time.monotonic()
    returncode, _out, err = finish(start_reader(lower, [path]))
    took = time.monotonic() - started
    assert returncode != 0 and "Input/output error" in err, err
    assert took < FAILING_READ_BOUND * RETRY_TIMEOUT, f"the read failed after {took:.1f}s (retry timeout {RETRY_TIMEOUT:g}s)"
    counted = events(port)
    assert counted["denied"] >= 1 and counted["store_failing"] >= 1  # one fill failed; the read's next events at once
    server.faults.range_answer = None
    expected = {path: _expected()[path]}

    def reads_right() -> bool:
        code, out, _err = finish(start_reader(lower, [path]))
        return code == 0 and out.strip() != "" and json.loads(out) == expected

    wait_until("a read succeeds once the store answers again", reads_right, interval=0.2)


# -- two servers on one cache directory -----------------------------------------------------------


def test_a_second_server_on_the_same_cache_directory_is_refused_at_start_naming_the_first_which_still_serves(
    converted: Any, node_factory: Any, tmp_path: Path
) -> None:
    """Two roots given one ``--cache-dir`` would share its blobs and fill maps (and hang readers in two groups):
    the second server exits at start (status 2) with one line naming the first one's pid and root, starts no
    event holder, and the first one's reads go on."""
    store, built = converted
    cache = tmp_path / "shared-cache"
    first = node_factory(f"file://{store}", data_path="fanotify", cache_dir=str(cache))
    client = first.ensure()
    lower = client.mount(built.chain_id).lower_dir
    second = node_factory(f"file://{store}", data_path="fanotify", cache_dir=str(cache))
    with pytest.raises(ServerStartError) as refused:
        second.ensure()
    assert refused.value.exit_status == 2
    reason = refused.value.reason
    assert f"pid {first.pid()}" in reason and str(first.root) in reason and str(cache / "blobs") in reason, reason
    assert not layer_server_processes(second.root)
    assert not layer_server_processes(second.root, EVENT_HOLDER)
    path = "data/file6.bin"
    assert read_all(lower, [path]) == {path: _expected()[path]}
