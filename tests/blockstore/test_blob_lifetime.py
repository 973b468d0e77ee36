"""A layer's local blob outlives its mount and its server, is hashed again after a reboot, and is evicted within --cache-size.

Issue 36, part 1 (one copy of each byte on the node): on the ``fanotify`` path the blob is the
node's copy of a layer's blocks.  These tests run a real ``bootseer layer-server`` forced to
``fanotify`` over the converted layer of tests/blockstore/test_fanotify.py, read through the
kernel's EROFS mount in reader processes, and look at the blob directory on disk, the server's
``status`` and its Prometheus metrics:

* an unmount keeps the blob (with its fill map and clean-close record), a server restart sweeps
  what a killed eviction left, and the next mount of the index reads the kept blocks with no fetch;
* a fill map whose header names another boot (a reboot, made by rewriting its boot id) is trusted
  only block by block: each claimed block is hashed, and one corrupted on disk is fetched again;
* a mounted layer's blob is never evicted, even over the budget; once unmounted it is.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.fanotify import unsupported
from tests.blockstore.test_blob_recheck import _block_of, _checks, _flip
from tests.blockstore.test_fanotify import _expected, blob_of, converted, drop_caches, metrics, read_all  # noqa: F401
from tests.blockstore.test_layer_server import node_factory  # noqa: F401 (fixture)
from tests.support.waiting import free_port, wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
    pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
]

HALF = ["data/file0.bin", "data/file2.bin", "data/file5.bin", "data/file7.bin"]  #: the blocks a first start reads


def _files(blob: Path) -> dict[str, bool]:
    return {suffix: blob.with_suffix(suffix).exists() for suffix in (".blob", ".filled", ".closed")}


def _blocks_got(status: dict[str, Any]) -> int:
    """Blocks every store's fetcher got from anywhere but its memory (node cache, peers, store)."""
    return sum(store["blocks"]["blocks_cached"] + store["blocks"]["blocks_fetched"] + store["blocks"]["blocks_from_peers"]
               for store in status["stores"].values())  # fmt: skip


def _filled_half(converted: Any, node_factory: Any, **settings: Any) -> tuple[Any, Any, Path, int]:
    """A fanotify node whose layer was mounted, had ``HALF`` read through it (and no more: no fill groups), and was
    unmounted: its blob kept, with holes."""
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify", fill_group=0, **settings)
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, HALF) == {path: expected[path] for path in HALF}
    missing = client.status()["fanotify"]["missing_blocks"]
    assert 0 < missing < len(built.index.blocks)
    client.unmount(built.chain_id)
    blob = blob_of(node, built)
    assert _files(blob) == {".blob": True, ".filled": True, ".closed": True}  # kept, closed cleanly
    status = client.status()["fanotify"]
    assert status["blobs"] == 0 and status["store"]["kept"] == 1 and status["store"]["evictions"] == 0
    return node, client, blob, missing


def test_an_unmounted_layers_blob_is_kept_and_after_a_restart_the_next_mount_reads_its_blocks_with_no_fetch(
    converted: Any, node_factory: Any
) -> None:
    _store, built = converted
    node, client, blob, missing = _filled_half(converted, node_factory)
    # What a kill in the middle of an eviction leaves (the map unlinked, not yet the blob), and a map with no blob.
    orphan, lone_map = blob.parent / f"{'a' * 64}.blob", blob.parent / f"{'b' * 64}.filled"
    orphan.write_bytes(b"blocks nothing says are there")
    lone_map.write_bytes(b"a map of nothing")
    node.stop(signal.SIGTERM)
    drop_caches()
    client = node.ensure()
    assert not orphan.exists() and not lone_map.exists()  # swept at start
    lower = client.mount(built.chain_id).lower_dir
    status = client.status()
    assert status["fanotify"]["missing_blocks"] == missing  # the kept fill map, not a new empty blob
    got = _blocks_got(status)
    expected = _expected()
    assert read_all(lower, HALF) == {path: expected[path] for path in HALF}  # page cache dropped: from the blob on disk
    after = client.status()
    assert _blocks_got(after) == got and after["fanotify"]["missing_blocks"] == missing
    assert read_all(lower, sorted(expected)) == expected  # the rest is filled as before


def test_after_a_reboot_every_block_the_kept_fill_map_claims_is_hashed_and_a_corrupt_one_fetched_again(
    converted: Any, node_factory: Any
) -> None:
    _store, built = converted
    node, client, blob, missing = _filled_half(converted, node_factory)
    node.stop(signal.SIGTERM)
    fill_map = blob.with_suffix(".filled")
    header = fill_map.read_bytes()[: -len(built.index.blocks)]
    this_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().encode()
    assert this_boot in header
    other_boot = str(uuid.uuid4()).encode()
    with open(fill_map, "r+b") as opened:  # as if written before a reboot
        opened.seek(header.index(this_boot))
        opened.write(other_boot)
    _flip(blob, built.index.blob_offset(_block_of(built, "data/file2.bin", 3)) + 1000)
    drop_caches()
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    assert client.status()["fanotify"]["missing_blocks"] == missing + 1  # the corrupt block, and only it
    check = _checks(node)[-1]
    assert check["other_boot"] == "True" and check["verified"] == "True"
    assert check["corrupt"] == "1" and check["dropped"] == "1" and int(check["hashed"]) > 1
    expected = _expected()
    assert read_all(lower, sorted(expected)) == expected
    assert this_boot in fill_map.read_bytes()[: len(header)]  # checked: the map is this boot's now


def test_a_mounted_blob_is_never_evicted_over_the_cache_size_and_once_unmounted_it_is_and_counted(
    converted: Any, node_factory: Any
) -> None:
    store, built = converted
    port = free_port()
    node = node_factory(f"file://{store}", data_path="fanotify", cache_size=4 << 20, metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, sorted(expected)) == expected  # 8 MiB of blocks in a blob, over a 4 MiB budget
    blob = blob_of(node, built)
    over = wait_until("a check finds the blob in use over the budget",
                      lambda: (s := client.status()["fanotify"]["store"])["over_budget"] and s)  # fmt: skip
    assert over["evictions"] == 0 and over["in_use_bytes"] > 4 << 20 and _files(blob)[".blob"]
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected
    client.unmount(built.chain_id)
    assert _files(blob) == {".blob": False, ".filled": False, ".closed": False}
    store_status = client.status()["fanotify"]["store"]
    assert store_status["evictions"] == 1 and store_status["kept"] == 0 and store_status["evicted_bytes"] > 4 << 20
    assert re.search(r"^bootseer_local_blob_evictions_total 1\.0$", metrics(port), re.MULTILINE)
    assert "evicted a local blob no mounted layer uses" in node.log()
    lower = client.mount(built.chain_id).lower_dir  # a new blob, filled again
    assert read_all(lower, HALF) == {path: expected[path] for path in HALF}
