"""The BootSeer demo (``ctr_examples/demo.sh``): a real containerd starting an image lazily through BootSeer.

Step by step, with timings, all in one temp dir and on 127.0.0.1 only: start a local
registry, ``bootseer-snapshotter --store`` (it starts the layer server) and a private
containerd that knows it as the ``bootseer`` proxy snapshotter; build a four-layer OCI
image (busybox, files, a whiteout and an opaque directory, eight 1 MiB files) and push it;
``bootseer convert`` it into the store; ``bootseer rpull`` it (every layer lazy, no layer
blob downloaded); ``ctr run`` it and show how little was fetched; SIGKILL the daemon under
a running container that then reads a file it never read before; bring the daemon back;
remove everything and let containerd's GC collect the lazy snapshots.  Everything is torn
down on exit, Ctrl-C or failure (the logs of every process are printed on failure).
Needs root.

    python -m integration.demo [--keep] [--profile-dir DIR]

The start's profile (``profile.json``, the HTML timeline ``profile.html``) is written to
``--profile-dir`` (default ``bootseer-demo-profile`` in the current directory), outside the
temp dir, so it is still there to open after the tear-down.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

from integration import harness
from tests.support.oci import APP_FILE, DELETED_FILE, OPAQUE_DIR, PATCH_FILE
from tests.support.processes import HarnessError, run
from tests.support.stack import Stack, snapshotter_available
from tests.support.waiting import wait_for_component

BOOTSEER = harness.BOOTSEER


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


def bootseer(*args: str) -> str:
    return run([BOOTSEER, *args], timeout=300).stdout.decode()


def fetched(stack: Stack) -> int:
    """Compressed bytes of the blocks the layer server fetched from the store so far."""
    status = harness.layer_server(stack).status()
    return sum(store.get("blocks", {}).get("bytes_fetched", 0) for store in status["stores"].values())


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _sigterm_to_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def demo(keep: bool, profile_dir: Path) -> None:
    if keep:
        os.environ["BOOTSEER_KEEP_TMP"] = "1"
    os.environ["BOOTSEER_PROFILE"] = "1"  # the start-up profiler: the daemon's spool is ROOT/profile (docs/profile.md)
    stack = Stack(store=True)
    os.environ["BOOTSEER_PROFILE"] = str(stack.daemon.root / "profile")  # and rpull's, convert's: the same spool
    try:
        with step(f"start registry, bootseer-snapshotter --store and containerd under {stack.base}"):
            stack.start()
            show(f"registry          http://{stack.registry.address}")
            show(f"store             {stack.store_url}")
            show(f"snapshotter       {stack.daemon.socket} (root {stack.daemon.root}, metrics {stack.metrics_address})")
            show(f"containerd        {stack.containerd.address} (namespace {stack.namespace})")
            show(stack.containerd.ctr_out("plugins", "ls", "id==bootseer"))

        layers = harness.lazy_layers()
        with step("build a 4-layer OCI image and push it to the local registry"):
            image, ref = stack.build_and_push(name="bootseer/demo", layers=layers)
            for digest, layer in zip(image.layer_digests, layers):
                show(f"{digest[:19]}  {len(layer.entries):>4} entries  {layer.comment}")
            show(ref)

        with step(f"bootseer convert --plain-http --store {stack.store_url} {ref}"):
            show(bootseer("convert", "--plain-http", "--store", stack.store_url, ref))

        with step("bootseer rpull --snapshotter bootseer: every layer is a remote snapshot, no blob downloaded"):
            show(bootseer("rpull", "--address", str(stack.containerd.address), "--namespace", stack.namespace,
                          "--plain-http", ref))
            show(stack.containerd.ctr_out("snapshots", "--snapshotter", "bootseer", "ls"))

        with step("ctr run --rm --snapshotter bootseer: the container reads a few files"):
            script = (f"/app/run.sh; cat {PATCH_FILE}; echo '$ ls {OPAQUE_DIR}'; ls {OPAQUE_DIR}; "
                      f"echo '$ cat {DELETED_FILE}  (deleted by layer 2)'; cat {DELETED_FILE} 2>&1; "
                      f"echo '$ sha256sum {harness.part_path(0)}'; sha256sum {harness.part_path(0)}; touch /.bootseer/first_step")
            show(stack.run_container(ref, "demo-run", "sh", "-c", script))
            profiled_until = time.time()
            # The daemon reads the container's marks (first_step) when containerd removes its snapshot, which
            # containerd's garbage collector does after `run --rm` returns, on its next pass: the daemon is
            # killed below, so run a pass now and wait until the removal reached it.
            stack.containerd.collect_garbage()
            wait_for_component("containerd to remove demo-run's snapshot from the daemon", lambda: not any(
                key.endswith("/demo-run") for key in harness.snapshotter_view(stack)), 60)
            store = sum(p.stat().st_size for p in stack.store_dir.rglob("*") if p.is_file())
            show(f"fetched from the store: {mib(fetched(stack))} of {mib(store)} it holds")

        with step("start a long-running container, SIGKILL the snapshotter, read a never-read file"):
            stack.start_container(ref, "demo-long", "sh", "-c", "echo alive > /state; exec sleep 100000")
            wait_for_component("the container to start", lambda: stack.exec(
                "demo-long", "sh", "-c", "cat /state 2>/dev/null; true").strip() == "alive", 30)
            stack.daemon.stop(signal.SIGKILL)
            before = fetched(stack)
            show("daemon down; the layer server still serves the container:")
            show(stack.exec("demo-long", "sha256sum", harness.part_path(5)))
            show(f"(expected {hashlib.sha256(harness.part_data(5)).hexdigest()}; "
                 f"fetched {mib(fetched(stack) - before)} meanwhile)")

        with step("restart bootseer-snapshotter; containerd reconnects, the lazy snapshots are all there"):
            stack.daemon.start()
            stack.wait_for_snapshotter()
            show(stack.containerd.ctr_out("snapshots", "--snapshotter", "bootseer", "ls"))
            show(stack.exec("demo-long", "cat", "/state", APP_FILE))

        with step("remove container and image; containerd's GC removes the lazy snapshots"):
            stack.remove_container("demo-long")
            stack.containerd.ctr("images", "rm", "--sync", ref)
            wait_for_component("snapshots to go", lambda: not stack.containerd.snapshots(), 60)
            wait_for_component("the daemon's snapshot directories to go", lambda: not stack.daemon.snapshot_dirs(), 60)
            show(f"snapshots left: {len(stack.containerd.snapshots())}, "
                 f"directories under {stack.daemon.root}/snapshots: {len(stack.daemon.snapshot_dirs())}")

        with step("bootseer profile collect: where the start (rpull to the container's first step) went"):
            show(bootseer("profile", "collect", "--spool", os.environ["BOOTSEER_PROFILE"], "--until", str(profiled_until),
                          "-o", str(profile_dir / "profile.json"), "--html", str(profile_dir / "profile.html")))
    except BaseException:
        with step("tear down"):
            stack.close()
        print("\n==> logs of every process\n" + stack.logs(), file=sys.stderr)
        raise
    with step("tear down (tasks, containerd, snapshotter, layer server, registry, mounts, temp dir)"):
        stack.close()
    if stack.teardown_errors:
        raise HarnessError(f"teardown: {stack.teardown_errors}")
    print(f"==> the start's profile: {profile_dir / 'profile.html'} (timeline), {profile_dir / 'profile.json'} (trace)")
    print("==> demo finished" + (f"; files kept in {stack.base}" if keep else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs, store) for a look")
    parser.add_argument("--profile-dir", type=Path, default=Path("bootseer-demo-profile"),
                        help="where the start's profile (trace and HTML timeline) is kept (default: %(default)s)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("demo: needs root (containerd, runc, overlay and FUSE mounts)", file=sys.stderr)
        return 2
    why = snapshotter_available()
    if why:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        profile_dir = args.profile_dir.absolute()
        profile_dir.mkdir(parents=True, exist_ok=True)
        demo(args.keep, profile_dir)
    except KeyboardInterrupt:
        print("demo: interrupted; everything was cleaned up", file=sys.stderr)
        return 130
    except HarnessError as e:
        print(f"demo: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
