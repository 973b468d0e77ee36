"""The BootSeer demo (``ctr_examples/demo.sh``): a real containerd pulling and running through BootSeer.

Step by step, with timings, all in one temp dir and on 127.0.0.1 only: start a local
registry, ``bootseer-snapshotter`` and a private containerd that knows it as the
``bootseer`` proxy snapshotter; build a three-layer OCI image (busybox, files, a
whiteout and an opaque directory) and push it; pull it and run it with
``ctr run --snapshotter bootseer``; kill the daemon under a running container and
bring it back.  Everything is torn down on exit, Ctrl-C or failure (the logs of every
process are printed on failure).  Needs root.

    python -m integration.demo [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import time
from typing import Iterator

from integration import harness

STEP_WIDTH = 64


@contextlib.contextmanager
def step(title: str) -> Iterator[None]:
    """Print ``title``, run the block, print how long it took (or that it failed)."""
    print(f"==> {title}", flush=True)
    start = time.monotonic()
    try:
        yield
    except BaseException:
        print(f"    FAILED after {time.monotonic() - start:.2f}s", flush=True)
        raise
    print(f"    done in {time.monotonic() - start:.2f}s", flush=True)


def show(text: str) -> None:
    for line in text.rstrip().splitlines():
        print(f"    | {line}")


def _sigterm_to_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def demo(keep: bool) -> None:
    if keep:
        os.environ["BOOTSEER_KEEP_TMP"] = "1"
    stack = harness.Stack()
    try:
        with step(f"start registry, bootseer-snapshotter and containerd under {stack.base}"):
            stack.start()
            show(f"registry          http://{stack.registry.address}")
            show(f"snapshotter       {stack.daemon.socket} (root {stack.daemon.root})")
            show(f"containerd        {stack.containerd.address} (namespace {stack.namespace})")
            show("containerd config:")
            show(stack.containerd.config_text())
            show(stack.containerd.ctr_out("plugins", "ls", "id==bootseer"))

        with step("build a 3-layer OCI image in Python (busybox, app files, whiteout + opaque dir)"):
            image = harness.build_oci_layout(stack.base / "images" / "demo", harness.demo_layers(), tag="v1")
            for digest, diff_id, layer in zip(image.layer_digests, image.diff_ids, harness.demo_layers()):
                blob = image.layout / "blobs" / "sha256" / digest.removeprefix("sha256:")
                show(f"{digest[:19]}  {blob.stat().st_size:>9} B gz  {len(layer.entries):>4} entries  {layer.comment}")

        with step("push it to the local registry with skopeo"):
            ref = stack.registry.push(image, "bootseer/demo")
            show(ref)

        with step("ctr images pull --plain-http --snapshotter bootseer"):
            stack.pull(ref)
            show(stack.containerd.ctr_out("snapshots", "--snapshotter", "bootseer", "ls"))

        with step("ctr run --rm --snapshotter bootseer: what the container sees"):
            script = (f"/app/run.sh; echo; echo '$ ls /app {harness.OPAQUE_DIR}'; ls /app {harness.OPAQUE_DIR}; "
                      f"echo; echo '$ cat {harness.DELETED_FILE}  (deleted by layer 2)'; "
                      f"cat {harness.DELETED_FILE} 2>&1; echo; echo '$ sha256sum {harness.BLOB_FILE}'; "
                      f"sha256sum {harness.BLOB_FILE}")
            show(stack.run_container(ref, "demo-run", "sh", "-c", script))
            show(f"(expected blob sha256 {hashlib.sha256(harness.blob_data()).hexdigest()})")

        with step("start a long-running container, then SIGKILL the snapshotter under it"):
            stack.start_container(ref, "demo-long", "sh", "-c", "echo alive > /state; exec sleep 100000")
            stack.daemon.stop(signal.SIGKILL)
            show("daemon down; the container still reads its layers:")
            show(stack.exec("demo-long", "sh", "-c", f"cat /state {harness.APP_FILE}"))

        with step("restart bootseer-snapshotter; containerd reconnects, every snapshot is still there"):
            stack.daemon.start()
            stack.wait_for_snapshotter()
            show(stack.containerd.ctr_out("snapshots", "--snapshotter", "bootseer", "ls"))

        with step("remove container and image; containerd's GC removes the snapshots"):
            stack.remove_container("demo-long")
            stack.containerd.ctr("images", "rm", "--sync", ref)
            harness.wait_until("snapshots to go", lambda: not stack.containerd.snapshots(), 60)
            show(f"snapshots left: {len(stack.containerd.snapshots())}, "
                 f"directories under {stack.daemon.root}/snapshots: {len(stack.daemon.snapshot_dirs())}")
    except BaseException:
        with step("tear down"):
            stack.close()
        print("\n==> logs of every process\n" + stack.logs(), file=sys.stderr)
        raise
    with step("tear down (tasks, containerd, snapshotter, registry, mounts, temp dir)"):
        stack.close()
    if stack.teardown_errors:
        raise harness.HarnessError(f"teardown: {stack.teardown_errors}")
    print("==> demo finished" + (f"; files kept in {stack.base}" if keep else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs) for a look")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("demo: needs root (containerd, runc, overlay mounts)", file=sys.stderr)
        return 2
    why = harness.snapshotter_available()
    if why:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        demo(args.keep)
    except KeyboardInterrupt:
        print("demo: interrupted; everything was cleaned up", file=sys.stderr)
        return 130
    except harness.HarnessError as e:
        print(f"demo: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
