"""Hot lists end to end with every real part: registry, ``bootseer convert``, ``bootseer-snapshotter
--store`` and its layer server, a private containerd, ``bootseer rpull``, ``ctr run``.

Node 1 boots the image for the first time: the layer server records the container's first touches
(attributed through its cgroup, ctr's ``/<namespace>/<id>``), the job seals the recording by creating
``/.bootseer-seal`` inside the container, and the hot list lands in the store.  Node 2 is a fresh
node (its own registry, containerd, snapshotter root and an empty block cache) over a copy of the
same store: ``bootseer rpull`` mounts the layers, prefetch starts before any container exists, and
the same job then finds its blocks already fetched (hits, no misses).  A profile
(``ctr run --snapshotter-label bootseer.io/profile=NAME``) is recorded beside the default list.
"""

from __future__ import annotations

import hashlib

import shutil
from typing import Any

import pytest

from integration import harness
from integration.harness import (
    BOOTSEER, bootseer_convert as convert, bootseer_rpull as rpull, hotlist_show as show, hotlist_status, layer_server,
    lazy_layers, part_data, part_path,
)
from tests.support.oci import chain_ids
from tests.support.processes import run
from tests.support.waiting import wait_for_component

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The job's start-up reads two of the parts, then says it is done starting (the marker).
JOB = f"cat /bin/busybox {part_path(1)} {part_path(3)} > /dev/null; touch /.bootseer-seal"


def part_digests(parts: list[int]) -> set[str]:
    """Block digests of the parts files (each one block at convert's default 1 MiB block size)."""
    return {hashlib.sha256(part_data(i)).hexdigest() for i in parts}


@pytest.mark.parametrize("data_path", ["auto", "tree"])
def test_record_on_first_boot_then_prefetch_on_a_fresh_node(stacks: Any, data_path: str) -> None:
    first = stacks(daemon_args=["--data-path", data_path])
    image, ref = first.build_and_push(name="bootseer/hot", layers=lazy_layers())
    convert(first, ref)
    chain = chain_ids(image.diff_ids)
    top = chain[-1]
    rpull(first, ref)
    harness.assert_served_on(first, data_path)
    # It keeps running until its recording is published: sealed by the marker, not by its removal.
    first.start_container(ref, "rec-1", "sh", "-c", JOB + "; exec sleep 100000")
    finished = wait_for_component("the recording to be published", lambda: [
        f for f in hotlist_status(first)["finished"] if f["kind"] == "recording"])
    first.remove_container("rec-1")
    assert finished[0]["outcome"] == "published" and finished[0]["sealed_by"] == "marker", finished
    [listed] = show(first, ref)
    assert listed["image"] == top and listed["container"] == "rec-1"
    assert listed["blocks"] > 2 and {layer["chain_id"] for layer in listed["layers"]} == set(chain)
    hot_digests = {b["digest"] for b in show(first, top, "--blocks")[0]["block_list"]}
    assert part_digests([1, 3]) <= hot_digests
    assert not part_digests([0, 2, 4, 5, 6, 7]) & hot_digests  # never read: not hot

    # A profile is recorded beside the default list, which stays as it was.
    assert first.containerd.ctr_out(
        "run", "--rm", "--fifo-dir", str(first.fifo_dir), "--snapshotter", first.snapshotter_name,
        "--snapshotter-label", "containerd.io/snapshot/bootseer.profile=eval", ref, "rec-eval", "sh", "-c",
        f"cat {part_path(5)} > /dev/null; touch /.bootseer-seal; echo done").strip() == "done"
    wait_for_component("the eval recording", lambda: [f for f in hotlist_status(first)["finished"]
                                            if f["kind"] == "recording" and f["profile"] == "eval"])
    [evaluation] = show(first, ref, "--profile", "eval")
    assert evaluation["profile"] == "eval" and evaluation["container"] == "rec-eval"
    assert show(first, ref)[0]["container"] == "rec-1"

    # `bootseer hotlist seal` ends a running container's recording.
    first.containerd.ctr("run", "-d", "--fifo-dir", str(first.fifo_dir), "--snapshotter", first.snapshotter_name,
                         "--snapshotter-label", "containerd.io/snapshot/bootseer.profile=sealed", ref, "rec-sealed",
                         "sh", "-c", f"cat {part_path(6)} > /dev/null; sleep 120", timeout=60)
    wait_for_component("the sealed-profile recording to see its read", lambda: [
        r for r in hotlist_status(first)["recordings"] if r["container"] == "rec-sealed" and r["blocks"] >= 1])
    sealed = run([BOOTSEER, "hotlist", "seal", "--root", str(first.daemon.root), "rec-sealed"], timeout=60)
    assert "sealed the recording of rec-sealed" in sealed.stdout.decode()
    [by_seal] = show(first, ref, "--profile", "sealed")
    assert by_seal["sealed_by"] == "seal" and by_seal["container"] == "rec-sealed"
    assert part_digests([6]) <= {b["digest"] for b in show(first, ref, "--profile", "sealed", "--blocks")[0]["block_list"]}
    first.remove_container("rec-sealed")

    # A fresh node over the same store: prefetch runs as soon as rpull has mounted the layers.
    second = stacks(daemon_args=["--data-path", data_path])
    shutil.rmtree(second.store_dir, ignore_errors=True)
    shutil.copytree(first.store_dir, second.store_dir)
    _image2, ref2 = second.build_and_push(name="bootseer/hot", layers=lazy_layers())
    rpull(second, ref2)
    harness.assert_served_on(second, data_path)
    prefetch = wait_for_component("the prefetch to finish, page cache included", lambda: [
        p for p in hotlist_status(second)["prefetches"] if p["image"] == top and p["finished"] and p["warm_finished"]])[0]
    assert prefetch["fetched_blocks"] + prefetch["cached_blocks"] == listed["blocks"]
    assert prefetch["warmed_bytes"] >= 2 * harness.PART_SIZE  # parts 1 and 3 (and busybox) are in the page cache
    fetched_before = sum(s["bytes_fetched"] for s in layer_server(second).status()["stores"].values())
    # The bytes the kernel got from the store notifications are the files' bytes.
    sums = second.run_container(ref2, "job-2", "sh", "-c", f"sha256sum {part_path(1)} {part_path(3)}; {JOB}; echo done")
    assert [line.split()[0] for line in sums.splitlines()[:2]] == [hashlib.sha256(part_data(i)).hexdigest() for i in (1, 3)]
    assert sums.strip().endswith("done")
    summary = wait_for_component("the prefetched container's summary", lambda: [
        f for f in hotlist_status(second)["finished"] if f["kind"] == "prefetch"])[0]
    # The same job reads what its first boot read: from the page cache, so (almost) no read reaches FUSE.
    assert summary["misses"] <= 1 and summary["hits"] + summary["waited"] + summary["misses"] <= 2, summary
    fetched_after = sum(s["bytes_fetched"] for s in layer_server(second).status()["stores"].values())
    assert fetched_after - fetched_before < prefetch["fetched_bytes"] // 4 + (1 << 20)
