"""Lazy image layers end to end, with every real part: registry, ``bootseer convert`` into a local
store, ``bootseer-snapshotter --store`` (and the layer server it starts), a private containerd,
``bootseer rpull`` and ``ctr run``.

* the pull is lazy: every converted layer comes back ALREADY_EXISTS from Prepare, no layer blob
  reaches containerd's content store, and the container sees the image's exact contents;
* only what the container touches is fetched from the store (the layer server's ``status``);
* a running container keeps reading files it never read before while ``bootseer-snapshotter`` is
  stopped (SIGTERM and SIGKILL) and after it is back;
* an image that was never converted falls back to download-and-unpack, visibly (a log line and a
  metric), and still runs;
* ``ctr images rm`` + containerd's GC removes the lazy snapshots and the daemon's state for them;
* ``ctr images pull --snapshotter bootseer`` is lazy on containerd 2.x (its transfer service) and downloads on
  1.6 and 1.7, and ``ctr run`` sees the image either way.
"""

from __future__ import annotations

import hashlib
import re
import signal
import urllib.request
from typing import Iterator

import pytest

from integration import harness
from integration.harness import (
    PART_SIZE, PARTS, bootseer_convert as convert, bootseer_rpull as rpull, layer_server, lazy_layers, part_data,
    part_path,
)
from bootseer.blockstore.objects.format import ChainRecord, LayerImage, chain_object, image_object
from bootseer.blockstore.objects.store import FileStoreWriter
from tests.support.containerd import containerd_version
from tests.support.layers import File, Layer, Whiteout
from tests.support.oci import (
    APP_FILE, APP_FILE_DATA, BLOB_FILE, BLOB_SIZE, DELETED_FILE, OPAQUE_DIR, PATCH_FILE, PATCH_FILE_DATA, BuiltImage,
    blob_data, busybox_layer, chain_ids, demo_layers,
)
from tests.support.stack import Stack
from tests.support.waiting import wait_for_component

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

@pytest.fixture(params=["auto", "tree"])
def lazy(runnable, request) -> Iterator[Stack]:
    """A started stack with a local store; its layer server on the node's default data path (EROFS where the
    kernel has it) or forced to the per-file FUSE tree: each test runs on both.  No fill groups (on ``fanotify``):
    the tests count the blocks each read fetches exactly."""
    with harness.running(Stack(store=True, daemon_args=["--data-path", request.param, "--fill-group", "0"])) as s:
        yield s


def blocks(stack: Stack) -> tuple[int, int]:
    """(blocks, compressed bytes) the layer server has fetched from its stores since it started.

    Chain records and indexes (read at mount) are not blocks: they are not counted here.
    """
    status = layer_server(stack).status()
    stats = [store.get("blocks", {}) for store in status["stores"].values()]
    return sum(s.get("blocks_fetched", 0) for s in stats), sum(s.get("bytes_fetched", 0) for s in stats)


def image_blocks(stack: Stack, chains: list[str]) -> tuple[int, int]:
    """(blocks, compressed bytes) of the EROFS images of the layers ``chains`` in the stack's store: what a
    mount on an EROFS data path fetches (nothing on the tree path, which mounts no image)."""
    if layer_server(stack).status()["data_path"]["path"] == "tree":
        return 0, 0
    writer = FileStoreWriter(stack.store_dir)
    count = size = 0
    for chain in chains:
        record = ChainRecord.decode(writer.get(chain_object(chain)), expected_chain_id=chain)
        table = LayerImage.decode(writer.get(image_object(record.image)), record=record)
        stored = [block for block in table.blocks if not block.is_zero]
        count, size = count + len(stored), size + sum(block.clen for block in stored)
    return count, size


#: Bytes besides blocks a container start may have the layer server fetch (a chain record is ~700).
METADATA_SLACK = 4096


def readahead(stack: Stack) -> tuple[int, int, int]:
    """(blocks read ahead, their compressed bytes, bytes everything fetched from the store: blocks, read-ahead, gaps),
    once no fetch is in flight (read-ahead may still be on its way when a container exits); a fetch
    still in flight after 30 s fails the test (the counts would not be final)."""
    def settled():
        stores = list(layer_server(stack).status()["stores"].values())
        return (stores,) if not any(s.get("in_flight", 0) for s in stores) else None

    [stores] = wait_for_component("the layer server's fetches in flight to end", settled, 30, interval=0.05)
    return (sum(s.get("blocks", {}).get("readahead_blocks", 0) for s in stores),
            sum(s.get("blocks", {}).get("readahead_bytes", 0) for s in stores),
            sum(s.get("bytes_fetched", 0) for s in stores))  # fmt: skip


def store_bytes(stack: Stack) -> int:
    return sum(p.stat().st_size for p in stack.store_dir.rglob("*") if p.is_file())


def metric_total(stack: Stack, pattern: str) -> float:
    """Sum of the daemon's Prometheus samples whose name and labels (``name{k="v"}``) match ``pattern``."""
    with urllib.request.urlopen(f"http://{stack.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and re.search(pattern, m.group(1) + (m.group(2) or "")) and not m.group(1).endswith("_created"):
            total += float(m.group(3))
    return total


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def converted(lazy: Stack) -> tuple[BuiltImage, str]:
    image, ref = lazy.build_and_push(name="bootseer/lazy", layers=lazy_layers())
    convert(lazy, ref)
    return image, ref


def test_rpull_is_lazy_and_ctr_run_sees_the_image(lazy: Stack, converted, request):
    image, ref = converted
    out = rpull(lazy, ref)
    assert f"{len(image.diff_ids)} layers on bootseer: {len(image.diff_ids)} lazy, 0 downloaded" in out, out
    harness.assert_served_on(lazy, request.node.callspec.params["lazy"])

    chain = chain_ids(image.diff_ids)
    snapshots = {row["key"]: row for row in lazy.containerd.snapshots()}
    assert set(snapshots) == set(chain)
    for depth, key in enumerate(chain):
        assert snapshots[key] == {"key": key, "parent": chain[depth - 1] if depth else "", "kind": "Committed"}
    # No layer blob was fetched into containerd: its content store holds the manifest and the config only.
    content = set(lazy.containerd.ctr_out("content", "ls", "-q").split())
    assert content == {image.manifest_digest, image.config_digest}
    # The first layer's Prepare named the layers above it: the layer server loaded them while it mounted
    # the first, and their mounts took those loads.
    warm = layer_server(lazy).status()["warm"]
    assert (warm["requested"], warm["taken"], warm["failed"]) == (len(chain) - 1, len(chain) - 1, 0), warm

    script = (f"cat {APP_FILE} {PATCH_FILE}; ls {OPAQUE_DIR}; [ -e {DELETED_FILE} ] && echo present; "
              f"sha256sum {BLOB_FILE} {part_path(0)}")
    lines = lazy.run_container(ref, "lazy-run", "sh", "-c", script).splitlines()
    assert lines[:3] == [APP_FILE_DATA.decode().strip(), PATCH_FILE_DATA.decode().strip(), "c.conf"]
    assert lines[3].split()[0] == sha(blob_data())
    assert lines[4].split()[0] == sha(part_data(0))


def test_only_touched_blocks_are_fetched(lazy: Stack, converted):
    image, ref = converted
    rpull(lazy, ref)
    # No block of a file is fetched before a container reads one: only the layers' EROFS images.
    assert blocks(lazy) == image_blocks(lazy, chain_ids(image.diff_ids))

    lazy.run_container(ref, "touch-one", "cat", APP_FILE)
    after_start, after_start_bytes = blocks(lazy)  # busybox itself and the small file
    assert after_start > 0

    ahead_blocks, ahead_bytes, from_store_at_start = readahead(lazy)
    lazy.run_container(ref, "read-one-part", "sh", "-c", f"cat {part_path(1)} > /dev/null")
    count, fetched = blocks(lazy)
    # One block of (incompressible) file data: exactly the block read.
    assert count == after_start + 1
    assert PART_SIZE * 0.95 <= fetched - after_start_bytes <= PART_SIZE * 1.05, fetched - after_start_bytes
    # And the one after it in the pack, read ahead (the next file of the tar: part 2), not read.
    now_blocks, now_bytes, from_store = readahead(lazy)
    assert now_blocks == ahead_blocks + 1
    assert PART_SIZE * 0.95 <= now_bytes - ahead_bytes <= PART_SIZE * 1.05, now_bytes - ahead_bytes
    # Those two blocks are all the store sent, each once (besides a chain record a container start may read).
    sent = from_store - from_store_at_start - (fetched - after_start_bytes) - (now_bytes - ahead_bytes)
    assert 0 <= sent <= METADATA_SLACK, sent

    # The other six parts were neither read nor read ahead: never fetched; of the 3 MiB blob, at
    # most what the start read ahead.
    untouched = (PARTS - 2) * PART_SIZE + BLOB_SIZE
    assert from_store <= store_bytes(lazy) - untouched * 0.95 + ahead_bytes

    # Blocks already fetched are served from the node's cache: reading them again fetches nothing.
    lazy.run_container(ref, "again", "sh", "-c", f"cat {part_path(1)} {APP_FILE} > /dev/null")
    assert blocks(lazy) == (count, fetched) and readahead(lazy)[:2] == (now_blocks, now_bytes)
    # Part 2, read ahead, is read from the engine's buffer: a block fetched (verified and cached now),
    # and the store sends only part 3, read ahead in turn.
    lazy.run_container(ref, "read-ahead-part", "sh", "-c", f"cat {part_path(2)} > /dev/null")
    assert blocks(lazy)[0] == count + 1
    last_blocks, last_bytes, last_from_store = readahead(lazy)
    assert last_blocks == now_blocks + 1
    assert 0 <= last_from_store - from_store - (last_bytes - now_bytes) <= 2 * METADATA_SLACK


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_running_container_reads_untouched_files_while_the_daemon_is_down(lazy: Stack, converted, sig):
    image, ref = converted
    rpull(lazy, ref)
    lazy.start_container(ref, "long", "sh", "-c", "echo started > /run-state; exec sleep 100000")
    wait_for_component("the container to start",
                       lambda: lazy.exec("long", "sh", "-c", "cat /run-state 2>/dev/null; true").strip() == "started", 30)
    before = {row["key"]: row for row in lazy.containerd.snapshots()}

    status = lazy.daemon.stop(sig)
    if sig == signal.SIGTERM:
        assert status == 0
    # Down: files never read before come from the layer server, which outlives the daemon.
    count, _ = blocks(lazy)
    out = lazy.exec("long", "sha256sum", part_path(2), part_path(3))
    assert [line.split()[0] for line in out.splitlines()] == [sha(part_data(2)), sha(part_data(3))]
    assert blocks(lazy)[0] == count + 2  # fetched while the daemon was down

    lazy.daemon.start()
    lazy.wait_for_snapshotter()
    assert lazy.task_status("long") == "RUNNING"
    assert lazy.exec("long", "sha256sum", part_path(4)).split()[0] == sha(part_data(4))
    assert {row["key"]: row for row in lazy.containerd.snapshots()} == before
    # The restarted daemon found its lazy snapshots: new containers start from them.
    assert lazy.run_container(ref, "after", "cat", PATCH_FILE).strip() == PATCH_FILE_DATA.decode().strip()
    assert "0 downloaded" in rpull(lazy, ref)


def test_unconverted_image_falls_back_visibly(lazy: Stack):
    other_layers = [busybox_layer(), Layer((File("/other.txt", b"not converted\n"),), "other")]
    image, ref = lazy.build_and_push(name="bootseer/plain", layers=other_layers)
    not_converted = r'fallbacks_total\{.*reason="not_converted"'
    fallbacks = metric_total(lazy, not_converted)
    out = rpull(lazy, ref)
    assert "0 lazy, 2 downloaded" in out, out
    assert metric_total(lazy, not_converted) == fallbacks + 2  # one per layer
    for chain_id in chain_ids(image.diff_ids):
        assert re.search(rf"not served lazily.*chain_id={chain_id}.*reason=not_converted",
                         lazy.daemon.process.log_text()), chain_id
    assert lazy.run_container(ref, "plain", "cat", "/other.txt").strip() == "not converted"
    assert set(lazy.containerd.ctr_out("content", "ls", "-q").split()) >= set(image.layer_digests)


def test_gc_removes_lazy_snapshots(lazy: Stack, converted):
    image, ref = converted
    rpull(lazy, ref)
    lazy.run_container(ref, "once", "cat", APP_FILE)
    chain = chain_ids(image.diff_ids)
    assert {row["key"] for row in lazy.containerd.snapshots()} == set(chain)

    lazy.containerd.ctr("images", "rm", "--sync", ref)
    wait_for_component("containerd to drop every snapshot", lambda: not lazy.containerd.snapshots(), 60)
    wait_for_component("the daemon's snapshot directories to go", lambda: not lazy.daemon.snapshot_dirs(), 60)
    wait_for_component("the layer server to unmount the layers",
                       lambda: not layer_server(lazy).status()["layers"], 60)
    assert lazy.containerd.ctr_out("content", "ls", "-q").split() == []
    # And the image can be pulled again, lazily.
    assert "0 downloaded" in rpull(lazy, ref)


def test_ctr_pull_is_lazy_through_the_transfer_service_of_2x_and_downloads_on_1x(lazy: Stack, converted):
    """``ctr images pull --snapshotter bootseer`` of a converted image: containerd 2.x's ctr pulls through its
    transfer service, whose unpacker offers each layer to the snapshotter before fetching it (lazy: only the
    manifest and the config reach the content store); 1.6's and 1.7's ctr fetch every blob first and unpack
    them with plain Prepares (no lazy layer).  Either way ``ctr run`` sees the image, and removing the image
    lets containerd's GC remove every snapshot (2.x: the GC references the transfer service's unpack set)."""
    image, ref = converted
    lazy.pull(ref)
    chain = chain_ids(image.diff_ids)
    assert {row["key"] for row in lazy.containerd.snapshots()} == set(chain)
    content = set(lazy.containerd.ctr_out("content", "ls", "-q").split())
    served = {row["chain_id"] for row in layer_server(lazy).status()["layers"]}
    if containerd_version() >= (2, 0):
        assert content == {image.manifest_digest, image.config_digest}
        assert served == set(chain)
    else:
        assert content == {image.manifest_digest, image.config_digest, *image.layer_digests}
        assert served == set()
    lines = lazy.run_container(ref, "ctr-pulled", "sh", "-c", f"cat {APP_FILE}; sha256sum {part_path(0)}").splitlines()
    assert lines[0] == APP_FILE_DATA.decode().strip() and lines[1].split()[0] == sha(part_data(0))

    lazy.containerd.ctr("images", "rm", "--sync", ref)
    wait_for_component("containerd to drop every snapshot", lambda: not lazy.containerd.snapshots(), 60)
    wait_for_component("the daemon's snapshot directories to go", lambda: not lazy.daemon.snapshot_dirs(), 60)
    assert lazy.containerd.ctr_out("content", "ls", "-q").split() == []


def test_a_layer_added_on_a_converted_base_is_downloaded_onto_lazy_layers(lazy: Stack):
    """The common case of an image built FROM a converted one: its base layers are lazy, its own
    layer is downloaded and unpacked on top of them (an overlay whose lower dirs are FUSE)."""
    base_layers = demo_layers()
    _, base_ref = lazy.build_and_push(name="bootseer/base", layers=base_layers)
    convert(lazy, base_ref)
    extra = Layer((File("/app/extra.txt", b"added on top\n"), Whiteout(APP_FILE)), "top")
    image, ref = lazy.build_and_push(name="bootseer/derived", layers=[*base_layers, extra])

    out = rpull(lazy, ref)
    assert f"{len(base_layers) + 1} layers on bootseer: {len(base_layers)} lazy, 1 downloaded" in out, out
    assert image.layer_digests[-1] in lazy.containerd.ctr_out("content", "ls", "-q").split()
    lines = lazy.run_container(ref, "derived", "sh", "-c",
                               f"cat /app/extra.txt {PATCH_FILE}; [ -e {APP_FILE} ] || echo whited-out").splitlines()
    assert lines == ["added on top", PATCH_FILE_DATA.decode().strip(), "whited-out"]
