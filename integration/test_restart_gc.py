"""The daemon's lifecycle under a real containerd: restarts and garbage collection.

* Restart: a running container keeps running and reading its files while the daemon
  is down (SIGTERM or SIGKILL) and after it is back; every snapshot is still listed
  and new containers start from the same layers.
* GC: once containers and image are gone and containerd has collected garbage, no
  snapshot is left, in containerd's view or on the daemon's disk.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import pytest

from tests.support.layers import File, Layer
from tests.support.oci import (
    APP_FILE, APP_FILE_DATA, BLOB_FILE, PATCH_FILE, PATCH_FILE_DATA, blob_data, busybox_layer, chain_ids,
)
from tests.support.stack import Snapshotter, Stack
from tests.support.waiting import wait_for_component

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

READ_SCRIPT = f"cat {APP_FILE} {PATCH_FILE} /run-state; sha256sum {BLOB_FILE} | cut -d' ' -f1"


def expected_reads(state: str) -> list[str]:
    return [APP_FILE_DATA.decode().strip(), PATCH_FILE_DATA.decode().strip(), state,
            hashlib.sha256(blob_data()).hexdigest()]


def snapshot_keys(stack: Stack) -> set[str]:
    return {row["key"] for row in stack.containerd.snapshots()}


@pytest.fixture
def daemon(stack: Stack) -> Snapshotter:
    if stack.daemon is None:
        pytest.skip("the daemon's lifecycle: only with the bootseer snapshotter")
    return stack.daemon


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_containers_survive_daemon_restart(stack: Stack, daemon: Snapshotter, pulled, sig):
    image, ref = pulled
    stack.start_container(ref, "long", "sh", "-c", "echo started > /run-state; exec sleep 100000")
    wait_for_component("the container to write /run-state",
                       lambda: stack.exec("long", "sh", "-c", "cat /run-state 2>/dev/null; true").strip() == "started", 30)
    before = {row["key"]: row for row in stack.containerd.snapshots()}
    assert set(before) == set(chain_ids(image.diff_ids)) | {"long"}

    status = daemon.stop(sig)
    if sig == signal.SIGTERM:
        assert status == 0, "SIGTERM must end the daemon cleanly"
    # Down: the container's root is a kernel mount and does not need the daemon.
    assert stack.task_status("long") == "RUNNING"
    assert stack.exec("long", "sh", "-c", READ_SCRIPT).split("\n")[:4] == expected_reads("started")
    stack.exec("long", "sh", "-c", "echo written-while-down > /run-state")

    daemon.start()
    stack.wait_for_snapshotter()
    assert stack.task_status("long") == "RUNNING"
    assert stack.exec("long", "sh", "-c", READ_SCRIPT).split("\n")[:4] == expected_reads("written-while-down")
    assert {row["key"]: row for row in stack.containerd.snapshots()} == before
    assert stack.containerd.snapshot_info("long")["Kind"] == "Active"

    # The restarted daemon serves new snapshots on top of the layers it had before.
    out = stack.run_container(ref, "after-restart", "sh", "-c", f"cat {APP_FILE}")
    assert out.strip() == APP_FILE_DATA.decode().strip()


def test_restart_twice_in_a_row_loses_nothing(stack: Stack, daemon: Snapshotter, pulled):
    image, ref = pulled
    before = stack.containerd.snapshots()
    stack.restart_daemon(signal.SIGKILL)
    assert stack.restart_daemon(signal.SIGTERM) == 0
    assert stack.containerd.snapshots() == before
    assert stack.run_container(ref, "again", "cat", PATCH_FILE).strip() == PATCH_FILE_DATA.decode().strip()


def _leftover_snapshot_dirs(stack: Stack) -> list[Path]:
    if stack.daemon is not None:
        return stack.daemon.snapshot_dirs()
    snaps = stack.containerd.root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots"
    return sorted(snaps.iterdir()) if snaps.is_dir() else []


def test_gc_removes_every_snapshot(stack: Stack, pulled):
    image, ref = pulled
    stack.run_container(ref, "once", "true")
    stack.start_container(ref, "long", "sleep", "100000")
    # containerd drops a removed snapshot from its metadata at once and from the
    # snapshotter on its next GC pass, so the "once" container's directory may linger a moment.
    wait_for_component("one directory per layer and one for the running container",
                       lambda: len(_leftover_snapshot_dirs(stack)) == len(image.diff_ids) + 1, 60)

    # The image still references its layers: removing the container drops only its snapshot.
    stack.remove_container("long")
    wait_for_component("the container's snapshot to go",
                       lambda: snapshot_keys(stack) == set(chain_ids(image.diff_ids)), 60)

    stack.containerd.ctr("images", "rm", "--sync", ref)
    # --sync waits for containerd's GC; the snapshotter's removals follow it.
    wait_for_component("containerd to drop every snapshot", lambda: not snapshot_keys(stack), 60)
    wait_for_component("the snapshot directories to go", lambda: not _leftover_snapshot_dirs(stack), 60)
    assert stack.containerd.ctr_out("content", "ls", "-q").split() == []


def test_gc_keeps_layers_another_image_still_uses(stack: Stack, pulled):
    image, ref = pulled
    other_layers = [busybox_layer(), Layer((File("/other.txt", b"other image\n"),), "other")]
    other, other_ref = stack.build_and_push(name="bootseer/other", layers=other_layers)
    stack.pull(other_ref)
    mine, theirs = set(chain_ids(image.diff_ids)), set(chain_ids(other.diff_ids))
    assert len(mine & theirs) == 1  # the busybox base, unpacked once
    assert snapshot_keys(stack) == mine | theirs

    stack.containerd.ctr("images", "rm", "--sync", ref)
    wait_for_component("the first image's own layers to go", lambda: snapshot_keys(stack) == theirs, 60)
    wait_for_component("their directories to go", lambda: len(_leftover_snapshot_dirs(stack)) == len(theirs), 60)
    out = stack.run_container(other_ref, "other", "sh", "-c", "cat /other.txt; ls /bin/busybox")
    assert out.splitlines() == ["other image", "/bin/busybox"]
