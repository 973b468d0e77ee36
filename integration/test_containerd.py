"""Pull and run a multi-layer image through a real containerd with the snapshotter as proxy plugin.

What a user of ``ctr``/CRI sees: the unpacked layers are committed snapshots named by
ChainID, a container's root is the union of every layer (whiteouts and opaque
directories applied), writes land in the container's own snapshot only, and
``ctr snapshots ls/info/usage`` report what is there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.containerd import CONTAINERD_SETTING, containerd_install, containerd_unavailable
from tests.support.oci import (
    APP_FILE, APP_FILE_DATA, BLOB_FILE, BLOB_SIZE, DELETED_FILE, OPAQUE_DIR, OPAQUE_NEW, PATCH_FILE, PATCH_FILE_DATA,
    blob_data, chain_ids, demo_layers, expected_inodes,
)
from tests.support.processes import HarnessError
from tests.support.stack import Stack

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


def test_pull_commits_one_snapshot_per_layer_named_by_chain_id(stack: Stack, pulled):
    image, ref = pulled
    assert ref in stack.containerd.ctr_out("images", "ls", "-q").split()

    chain = chain_ids(image.diff_ids)
    snapshots = {row["key"]: row for row in stack.containerd.snapshots()}
    assert set(snapshots) == set(chain)
    for depth, key in enumerate(chain):
        assert snapshots[key]["kind"] == "Committed"
        assert snapshots[key]["parent"] == (chain[depth - 1] if depth else "")


def test_snapshot_info_and_usage(stack: Stack, pulled):
    image, _ = pulled
    chain = chain_ids(image.diff_ids)
    for depth, key in enumerate(chain):
        info = stack.containerd.snapshot_info(key)
        assert info["Name"] == key
        assert info["Kind"] == "Committed"
        assert info.get("Parent", "") == (chain[depth - 1] if depth else "")

    # Usage counts what each layer holds, not the layers below (as containerd's overlayfs does).
    for key, layer in zip(chain, demo_layers()):
        assert stack.containerd.snapshot_usage(key).inodes == expected_inodes(layer), key
    assert stack.containerd.snapshot_usage(chain[1]).approx_bytes >= BLOB_SIZE * 0.95  # ctr rounds


def test_run_sees_the_union_of_all_layers(stack: Stack, pulled):
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


def test_container_writes_stay_in_the_container(stack: Stack, pulled):
    image, ref = pulled
    stack.run_container(ref, "writer", "sh", "-c", f"echo scribble > {PATCH_FILE}; rm {APP_FILE}; touch /app/extra")
    # A second container from the same image starts from the committed layers, untouched.
    out = stack.run_container(ref, "reader", "sh", "-c", f"cat {PATCH_FILE} {APP_FILE}; ls /app")
    assert out.splitlines() == [
        PATCH_FILE_DATA.decode().strip(), APP_FILE_DATA.decode().strip(), "config", "layer1.txt", "layer2.txt",
        "run.sh",
    ]
    # `run --rm` removed both containers' active snapshots: only the layers remain.
    assert {row["key"] for row in stack.containerd.snapshots()} == set(chain_ids(image.diff_ids))


def test_running_container_has_an_active_snapshot_whose_usage_grows(stack: Stack, pulled):
    image, ref = pulled
    stack.start_container(ref, "long", "sleep", "100000")
    top = chain_ids(image.diff_ids)[-1]
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


def test_the_containerd_setting_refuses_what_it_cannot_run_in_one_line(monkeypatch, tmp_path: Path):
    """``BOOTSEER_CONTAINERD`` takes a series or an absolute directory; anything else is one clear line."""
    for value, says in (("2.0", "give one of ['1.6', '1.7', '2.1'] or an absolute directory"),
                        ("usr/bin", "give one of"),
                        (str(tmp_path), f"containerd, ctr, containerd-shim-runc-v2 missing in {tmp_path}")):
        monkeypatch.setenv(CONTAINERD_SETTING, value)
        with pytest.raises(HarnessError) as failure:
            containerd_install()
        assert says in str(failure.value) and "\n" not in str(failure.value), str(failure.value)
        assert containerd_unavailable() == str(failure.value)


def test_a_directory_setting_runs_that_directorys_binaries(monkeypatch):
    """A directory is taken as it is: its containerd's own version decides the series and the config dialect."""
    monkeypatch.delenv(CONTAINERD_SETTING, raising=False)
    chosen = containerd_unavailable() or containerd_install()
    if isinstance(chosen, str):
        pytest.skip(chosen)
    monkeypatch.setenv(CONTAINERD_SETTING, str(chosen.bin_dir))
    install = containerd_install()
    assert (install.bin_dir, install.version, install.config_version) == (
        chosen.bin_dir, chosen.version, chosen.config_version)
    assert install.ctr == str(chosen.bin_dir / "ctr")
    assert install.env({"PATH": "/usr/bin"})["PATH"] == f"{chosen.bin_dir}:/usr/bin"
