"""A node without containerd: the converted store, a layer server alone, the image's job in a chroot.

What the benchmarks that measure the layer server by itself (``bench.lazy_bench``'s FUSE scenarios,
``bench.peers_bench``) stand on: :func:`convert_store` (``bootseer convert`` of the benchmark image, once),
:func:`hot_store_copy`, :func:`stored_hot_list` and :func:`read_hot_list` (a store to record hot lists into,
and what it holds), :func:`layer_server_node` (``bootseer layer-server`` on a fresh root), :func:`overlay_root` and
:func:`chroot_start` (the image's layers under an overlay, its command run in a chroot and timed).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from bench import image_build
from bench.common import BenchError, bootseer_argv, log, run_checked, run_until_marker
from tests.support.oci import chain_ids
from tests.support.processes import HarnessError, ManagedProcess, mounts_under
from tests.support.waiting import free_port, wait_for_component

if TYPE_CHECKING:
    from bootseer.hotlist.format import HotList


def convert_store(image: image_build.Image, store: Path, log_path: Path, *, marker: Path | None = None,
                  flags: Sequence[str] = ()) -> float | None:
    """``bootseer convert IMAGE --store STORE FLAGS`` unless ``marker`` (default ``STORE/../store.converted``)
    says it was done for this image; the seconds it took (None: cached).  A rerun on a store converted by
    an older version adds what the newer one publishes (images) without uploading any block again."""
    marker = marker if marker is not None else store.parent / "store.converted"
    if marker.exists() and marker.read_text().strip() == image.manifest_digest and store.is_dir():
        return None
    store.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    log(f"bootseer convert {image.oci_ref} --store {store} {' '.join(flags)}")
    start = time.perf_counter()
    run_checked(bootseer_argv("convert", image.oci_ref, "--store", str(store), *flags), "bootseer convert",
                timeout=3600, log_path=log_path)
    seconds = time.perf_counter() - start
    # nginx's worker runs unprivileged: the store must be world-readable.
    subprocess.run(["chmod", "-R", "a+rX", str(store)], check=True)
    marker.write_text(image.manifest_digest + "\n")
    return seconds


def hot_store_copy(store: Path, hot_store: Path) -> None:
    """``hot_store``: a fresh copy of the converted ``store`` without hot lists (hard links: instant).

    The hot-list scenario records into and reads from this copy, so the plain lazy runs
    read a store that never holds a hot list.  Publishing only ever creates new files
    (temp + link(2)), so no file shared with ``store`` is written to.
    """
    shutil.rmtree(hot_store, ignore_errors=True)
    run_checked(["cp", "-al", str(store), str(hot_store)], "copy of the store", timeout=300)
    shutil.rmtree(hot_store / "v1" / "hotlists", ignore_errors=True)
    (hot_store / "v1" / "hotlists").mkdir()
    hot_store.chmod(0o755)
    # The layer server publishes as root with a private umask; nginx's worker must read the list.
    (hot_store / "v1" / "hotlists").chmod(0o777)


def stored_hot_list(store: Path, image: str, profile: str = "") -> HotList | None:
    """The hot list of ``image`` (its top ChainID) and ``profile`` in the store directory ``store``, decoded and
    checked (:meth:`HotList.decode`: a list stored under another image's or profile's name raises); None: none."""
    from bootseer.hotlist.format import HotList, hotlist_object

    path = store / hotlist_object(image, profile)
    if not path.is_file():
        return None
    return HotList.decode(path.read_bytes(), expected_image=image, expected_profile=profile)


def read_hot_list(hot_store: Path, image: image_build.Image) -> dict[str, Any] | None:
    """``bootseer hotlist show``'s summary of the image's default hot list in ``hot_store`` (None: none)."""
    from bootseer.hotlist.format import summary

    hot = stored_hot_list(hot_store, chain_ids([layer.diff_id for layer in image.layers])[-1])
    return None if hot is None else summary(hot)


def recording_finished(socket_path: Path, timeout: float = 150) -> dict[str, Any]:
    """Wait for the layer server on ``socket_path`` to finish its recording (sealed, then published or not);
    the layer server's summary of it (``outcome``, ``sealed_by``, ...)."""
    from bootseer.blockstore.server.client import LayerServerClient

    client = LayerServerClient(socket_path)
    summary: dict[str, Any] = {}

    def finished() -> bool:
        done = [s for s in client.call({"op": "hotlist.status"}).get("finished", []) if s.get("kind") == "recording"]
        summary.update(done[-1] if done else {})
        return bool(done)

    wait_for_component("the recording to seal and publish", finished, timeout)
    return summary


def published_hot_list(recording: dict[str, Any], hot_store: Path, image: image_build.Image) -> dict[str, Any]:
    """The summary of the hot list a finished ``recording`` (:func:`recording_finished`) published into
    ``hot_store``, made readable to nginx's worker; :class:`BenchError` if it published none."""
    if recording.get("outcome") != "published":
        raise BenchError(f"the recording did not publish a hot list: {recording}")
    hot = read_hot_list(hot_store, image)
    if hot is None:
        raise BenchError(f"the layer server says it published, but {hot_store} holds no hot list for the image")
    subprocess.run(["chmod", "-R", "a+rX", str(hot_store / "v1" / "hotlists")], check=True)
    return hot


@contextlib.contextmanager
def overlay_root(lowers: list[str], base: Path, name: str) -> Iterator[Path]:
    """An overlay of ``lowers`` (topmost first) with a fresh upper dir and /proc, for a chroot."""
    upper, work, merged = base / f"{name}.up", base / f"{name}.work", base / f"{name}.root"
    for path in (upper, work, merged):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    options = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    run_checked(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], "overlay mount", timeout=60)
    try:
        run_checked(["mount", "-t", "proc", "proc", str(merged / "proc")], "proc mount", timeout=60)
        try:
            yield merged
        finally:
            subprocess.run(["umount", str(merged / "proc")], capture_output=True)
    finally:
        if subprocess.run(["umount", str(merged)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(merged)], capture_output=True)


def chroot_start(root: Path, timeout: float, log_path: Path) -> tuple[float, str]:
    """Run the image's command in a chroot of ``root``; seconds to its marker line."""
    argv = ["chroot", str(root), "/usr/bin/env", "-i", f"PATH={image_build.CHROOT_PATH}", "LANG=C.UTF-8",
            "python3", "/app/train.py"]
    return run_until_marker(argv, image_build.FIRST_OUTPUT_MARKER, timeout, log_path)


@contextlib.contextmanager
def layer_server_node(base: Path, store_url: str, data_path: str | None = None) -> Iterator[tuple[Path, str]]:
    """``bootseer layer-server --root BASE/root --store URL`` on a fresh root (``--data-path`` if given);
    yields its control socket and its metrics URL."""
    from bootseer.blockstore.server.client import LayerServerClient

    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    root = base / "root"
    metrics = f"127.0.0.1:{free_port()}"
    server = ManagedProcess("layer-server", bootseer_argv("layer-server", "--root", str(root), "--store",
                                                                  store_url, "--metrics-address", metrics,
                                                                  *(["--data-path", data_path] if data_path else [])),
                                    base / "layer-server.log", python=True)
    socket_path = root / "layers" / "control.sock"

    def answers() -> bool:
        with contextlib.suppress(Exception):
            LayerServerClient(socket_path).status()
            return True
        return False

    server.start()
    try:
        wait_for_component("the layer server to answer", answers, 60, alive=server)
        yield socket_path, f"http://{metrics}/metrics"
    finally:
        with contextlib.suppress(HarnessError):
            server.stop()
        with contextlib.suppress(Exception):
            for point in mounts_under(base):
                subprocess.run(["umount", "-l", point], capture_output=True)
        keep_logs = base.parent / "logs"
        keep_logs.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copy(base / "layer-server.log", keep_logs / f"{base.name}-layer-server.log")
        shutil.rmtree(base, ignore_errors=True)


def lower_dir(mounted: Any) -> str:
    """The lower dir from ``LayerServerClient.mount``'s answer (a MountedLayer, or its path)."""
    return mounted if isinstance(mounted, str) else mounted.lower_dir
