"""The EROFS data paths under a real containerd: ``bootseer-snapshotter --data-path erofs`` and ``fanotify``.

The image is pulled lazily (``bootseer rpull``) and run; every layer is an EROFS mount
under the layer server's ``ROOT/layers/lower/`` over its FUSE blob (``erofs``) or its local
blob filled on fanotify events (``fanotify``, which keeps the mounts across a killed server).  Containers still run
with the right contents after the daemon restarts and after the layer server is killed
(it comes back at the same lower dirs); containerd's GC removes the snapshots and leaves
no EROFS mount and no image behind.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest

from integration.harness import (
    bootseer_convert as convert, bootseer_rpull as rpull, layer_server, lazy_layers, part_data, part_path,
)
from tests.support.layer_servers import active_event_holder
from tests.support.oci import APP_FILE, APP_FILE_DATA, BLOB_FILE, PATCH_FILE, PATCH_FILE_DATA, blob_data
from tests.support.stack import Stack
from tests.support.waiting import wait_for_component

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SCRIPT = f"cat {APP_FILE} {PATCH_FILE}; sha256sum {BLOB_FILE} {part_path(3)} | cut -d' ' -f1"


def expected() -> list[str]:
    return [APP_FILE_DATA.decode().strip(), PATCH_FILE_DATA.decode().strip(),
            hashlib.sha256(blob_data()).hexdigest(), hashlib.sha256(part_data(3)).hexdigest()]  # fmt: skip


def erofs_mounts(under: Path) -> list[str]:
    prefix = str(under) + "/"
    with open("/proc/self/mountinfo") as mountinfo:
        rows = [line.split(" - ") for line in mountinfo]
    return sorted(head.split()[4] for head, tail in rows if tail.split()[0] == "erofs" and head.split()[4].startswith(prefix))


@pytest.fixture(params=["erofs", "fanotify"])
def on_erofs(stacks, request) -> tuple[Stack, str]:
    """A started stack with a local store whose layer server serves every layer on an EROFS path; the path."""
    return stacks(daemon_args=["--data-path", request.param]), request.param


def test_a_container_on_erofs_runs_through_restarts_and_gc_leaves_no_erofs_mount(on_erofs: tuple[Stack, str]) -> None:
    stack, path = on_erofs
    image, ref = stack.build_and_push(name="bootseer/erofs", layers=lazy_layers())
    convert(stack, ref)
    out = rpull(stack, ref)
    layers = len(image.diff_ids)
    assert f"{layers} layers on bootseer: {layers} lazy, 0 downloaded" in out, out

    status = layer_server(stack).status()
    lowers = sorted(row["lower_dir"] for row in status["layers"])
    root = stack.daemon.root
    assert status["data_path"]["path"] == path and {row["data_path"] for row in status["layers"]} == {path}
    assert erofs_mounts(root) == lowers and all(lower.startswith(str(root / "layers/lower/")) for lower in lowers)
    assert stack.run_container(ref, "first", "sh", "-c", SCRIPT).splitlines() == expected()

    stack.restart_daemon(signal.SIGKILL)
    assert stack.run_container(ref, "after-daemon", "sh", "-c", SCRIPT).splitlines() == expected()

    pid = int(layer_server(stack).status()["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for_component("the layer server to die", lambda: not Path(f"/proc/{pid}/cmdline").exists()
                       or Path(f"/proc/{pid}/cmdline").read_bytes() == b"", 30)  # fmt: skip
    # The daemon's start finds the server gone and starts it; it mounts its layers again (erofs: the
    # stale mounts' device was the dead session; fanotify: it takes the mounts over from the event
    # holder) at the same lower dirs, before it answers.
    stack.restart_daemon(signal.SIGTERM)
    assert stack.run_container(ref, "after-server", "sh", "-c", SCRIPT).splitlines() == expected()
    status = layer_server(stack).status()
    assert int(status["pid"]) != pid
    assert sorted(row["lower_dir"] for row in status["layers"]) == lowers == erofs_mounts(root)

    stack.containerd.ctr("images", "rm", "--sync", ref)
    wait_for_component("containerd to drop every snapshot", lambda: not stack.containerd.snapshots(), 60)
    wait_for_component("the layer server to unmount every layer", lambda: not layer_server(stack).status()["layers"], 60)
    assert erofs_mounts(root) == []
    assert os.listdir(root / "layers/erofs") == []
    if path == "fanotify":
        assert "took over the EROFS mount" in (root / "layers/server.log").read_text(errors="replace")
        # The last layer of an index closes its blob and keeps it, with its fill map and clean-close record (the
        # node's copy of its blocks, within --cache-size: blockstore/datapath/blob_store.py); none is open.
        kept = {name.split(".")[0] for name in os.listdir(root / "cache/blobs") if name != "server.lock"}
        assert kept and sorted(os.listdir(root / "cache/blobs")) == sorted(
            ["server.lock"] + [f"{name}{suffix}" for name in kept for suffix in (".blob", ".filled", ".closed")])
        assert layer_server(stack).status()["fanotify"]["blobs"] == 0


def _blocked_on_fanotify(needle: str) -> int:
    """How many processes whose command line holds ``needle`` wait in the kernel on a fanotify answer."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle.encode() in (entry / "cmdline").read_bytes() and "fanotify" in (entry / "stack").read_text():
                count += 1
        except OSError:
            continue
    return count


@pytest.mark.parametrize("killed", ["server", "server-and-holder"])
def test_four_containers_reading_while_the_layer_server_is_killed_get_every_byte_right(stacks, killed: str) -> None:
    """``auto`` (fanotify here): SIGKILL the layer server (and with it, at once, the event holder reading the
    group: its standby takes over), then four containers read never-read files; their reads wait, the
    daemon's restart brings a server back, and every byte they read is right (never a zero)."""
    import threading

    stack = stacks()
    image, ref = stack.build_and_push(name="bootseer/failover", layers=lazy_layers())
    convert(stack, ref)
    rpull(stack, ref)
    assert layer_server(stack).status()["data_path"]["path"] == "fanotify"
    names = [f"reader{n}" for n in range(4)]
    for name in names:
        stack.start_container(ref, name, "sleep", "600")
    status = layer_server(stack).status()
    pid = int(status["pid"])
    victims = [pid] + ([active_event_holder(Path(status["root"]))] if killed == "server-and-holder" else [])
    for signum in (signal.SIGSTOP, signal.SIGKILL):  # together: none sees another die first
        for victim in victims:
            os.kill(victim, signum)
    wait_for_component("the layer server to die", lambda: not Path(f"/proc/{pid}/cmdline").exists()
                       or Path(f"/proc/{pid}/cmdline").read_bytes() == b"", 30)  # fmt: skip
    out: dict[str, str] = {}
    errors: list[BaseException] = []

    def read(number: int, name: str) -> None:
        try:
            out[name] = stack.exec(name, "sha256sum", part_path(2 * number), part_path(2 * number + 1), timeout=180)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    readers = [threading.Thread(target=read, args=(n, name)) for n, name in enumerate(names)]
    for reader in readers:
        reader.start()
    wait_for_component("the four containers' reads to wait for a layer server",
                       lambda: _blocked_on_fanotify("/data/parts/part") >= 4, 60)  # fmt: skip
    stack.restart_daemon(signal.SIGTERM)  # its start finds the layer server gone and starts one
    for reader in readers:
        reader.join(timeout=240)
    assert not errors, errors
    for number, name in enumerate(names):
        sums = [line.split()[0] for line in out[name].splitlines()]
        assert sums == [hashlib.sha256(part_data(i)).hexdigest() for i in (2 * number, 2 * number + 1)], name
    for name in names:
        stack.remove_container(name)
