"""Pull and run a multi-layer image through a real containerd with the snapshotter as proxy plugin.

What a user of ``ctr``/CRI sees: the unpacked layers are committed snapshots named by
ChainID, a container's root is the union of every layer (whiteouts and opaque
directories applied), writes land in the container's own snapshot only, and
``ctr snapshots ls/info/usage`` report what is there.
"""

from __future__ import annotations

import hashlib

import pytest

from integration import harness
from integration.harness import (
    APP_FILE, APP_FILE_DATA, BLOB_FILE, BLOB_SIZE, DELETED_FILE, OPAQUE_DIR, OPAQUE_NEW, PATCH_FILE,
    PATCH_FILE_DATA, blob_data,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

#: A shell script checking the container's view; each line of output is "what: value".
VIEW_SCRIPT = f"""
echo "hello: $(/app/run.sh)"
echo "layer1: $(cat {APP_FILE})"
echo "layer2: $(cat {PATCH_FILE})"
echo "opaque: $(ls -A {OPAQUE_DIR} | tr '\\n' ' ')"
if [ -e {DELETED_FILE} ]; then echo "deleted: present"; else echo "deleted: absent"; fi
echo "blob: $(sha256sum {BLOB_FILE} | cut -d' ' -f1)"
echo "busybox: $(ls /bin/busybox)"
echo "new file" > /app/written-in-container && echo "write: $(cat /app/written-in-container)"
rm {APP_FILE} && echo "remove: $([ -e {APP_FILE} ] && echo present || echo gone)"
"""


def parse_report(output: str) -> dict[str, str]:
    report = {}
    for line in output.splitlines():
        what, sep, value = line.partition(": ")
        if sep:
            report[what] = value.strip()
    return report


def test_pull_commits_one_snapshot_per_layer_named_by_chain_id(stack: harness.Stack, pulled):
    image, ref = pulled
    assert ref in stack.containerd.ctr_out("images", "ls", "-q").split()

    chain = harness.chain_ids(image.diff_ids)
    snapshots = {row["key"]: row for row in stack.containerd.snapshots()}
    assert set(snapshots) == set(chain)
    for depth, key in enumerate(chain):
        assert snapshots[key]["kind"] == "Committed"
        assert snapshots[key]["parent"] == (chain[depth - 1] if depth else "")


def test_snapshot_info_and_usage(stack: harness.Stack, pulled):
    image, _ = pulled
    chain = harness.chain_ids(image.diff_ids)
    for depth, key in enumerate(chain):
        info = stack.containerd.snapshot_info(key)
        assert info["Name"] == key
        assert info["Kind"] == "Committed"
        assert info.get("Parent", "") == (chain[depth - 1] if depth else "")

    # Usage counts what each layer holds, not the layers below (as containerd's overlayfs does).
    for key, layer in zip(chain, harness.demo_layers()):
        assert stack.containerd.snapshot_usage(key).inodes == harness.expected_inodes(layer), key
    assert stack.containerd.snapshot_usage(chain[1]).approx_bytes >= BLOB_SIZE * 0.95  # ctr rounds


def test_run_sees_the_union_of_all_layers(stack: harness.Stack, pulled):
    _, ref = pulled
    report = parse_report(stack.run_container(ref, "view", "sh", "-c", VIEW_SCRIPT))
    assert report == {
        "hello": "hello from bootseer",
        "layer1": APP_FILE_DATA.decode().strip(),
        "layer2": PATCH_FILE_DATA.decode().strip(),
        "opaque": " ".join(OPAQUE_NEW),
        "deleted": "absent",
        "blob": hashlib.sha256(blob_data()).hexdigest(),
        "busybox": "/bin/busybox",
        "write": "new file",
        "remove": "gone",
    }


def test_container_writes_stay_in_the_container(stack: harness.Stack, pulled):
    image, ref = pulled
    stack.run_container(ref, "writer", "sh", "-c", f"echo scribble > {PATCH_FILE}; rm {APP_FILE}; touch /app/extra")
    # A second container from the same image starts from the committed layers, untouched.
    out = stack.run_container(ref, "reader", "sh", "-c", f"cat {PATCH_FILE} {APP_FILE}; ls /app")
    assert out.splitlines() == [
        PATCH_FILE_DATA.decode().strip(), APP_FILE_DATA.decode().strip(), "config", "layer1.txt", "layer2.txt",
        "run.sh",
    ]
    # `run --rm` removed both containers' active snapshots: only the layers remain.
    assert {row["key"] for row in stack.containerd.snapshots()} == set(harness.chain_ids(image.diff_ids))


def test_running_container_has_an_active_snapshot_whose_usage_grows(stack: harness.Stack, pulled):
    image, ref = pulled
    stack.start_container(ref, "long", "sleep", "100000")
    top = harness.chain_ids(image.diff_ids)[-1]
    active = {row["key"]: row for row in stack.containerd.snapshots()}["long"]
    assert active == {"key": "long", "parent": top, "kind": "Active"}
    assert stack.containerd.snapshot_info("long")["Kind"] == "Active"

    before = stack.containerd.snapshot_usage("long")
    stack.exec("long", "dd", "if=/dev/zero", "of=/fill", "bs=1M", "count=2")
    after = stack.containerd.snapshot_usage("long")
    assert after.inodes == before.inodes + 1
    assert after.approx_bytes >= before.approx_bytes + 2 * 1024 * 1024 * 0.95
    stack.remove_container("long")
    assert "long" not in {row["key"] for row in stack.containerd.snapshots()}
