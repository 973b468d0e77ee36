"""Benchmark of lazy image layers: time to a container's first useful output, overlayfs vs BootSeer.

One command (as root): ``.venv/bin/python -m bench.lazy_bench``.  It

1. builds (once, cached under ``--cache-dir``) a 1.2 GB, four-layer image: Debian
   bookworm minbase, python3 + pip, the CPU build of torch, and an app whose command
   imports torch, runs one training step and prints a marker line (``image_build.py``);
2. makes a private network namespace behind a veth pair shaped with ``tbf`` to
   ``--rate`` (1 Gbit/s) both ways (``tests/support/netns.py``) and runs in it the registry
   (``docker-registry``) and nginx serving the converted store, so that a pull and the
   lazy reads cross the same link; the image is pushed there with skopeo and converted
   with ``bootseer convert`` (once, cached);
3. measures, ``--reps`` times each, on a fresh containerd root and a fresh snapshotter
   root with empty caches, after ``echo 3 > /proc/sys/vm/drop_caches``:

   * ``overlayfs cold``: ``ctr images pull`` + ``ctr run`` on containerd's overlayfs;
   * ``bootseer cold``: ``bootseer rpull`` + ``ctr run --snapshotter bootseer``, the
     daemon started with ``--store`` the nginx in the namespace;
   * ``overlayfs local`` / ``bootseer local``: ``ctr run`` again on the same roots, the
     image pulled and the blocks the first run read in the node cache, the page cache
     dropped: the cost of FUSE when nothing crosses the link;
   * ``overlayfs warm`` / ``bootseer warm``: a third start on the same node, the page
     cache not dropped (a job restarted on its node);
   * ``bootseer complete`` (issue 36, ``fanotify`` only): the same node left idle until its layer
     server's background fill has completed every served blob (its ``status``, polled: each blob
     whole and unmarked; at most ``--complete-timeout`` s, the wait and the bytes the fill wrote
     recorded), then a fourth start as the local one (page cache dropped): its reads should ask
     userspace nothing;

   each BootSeer scenario once per node data path of ``--data-paths`` (``erofs,tree``:
   the layer server's EROFS mounts over FUSE blob files, or its per-file FUSE tree;
   ``fanotify``: EROFS mounts over local sparse blobs filled on fanotify pre-access
   events, issue 25; ``--data-path`` is passed to the daemon and the layer server when
   they take it), against the same overlayfs baselines; per start, the userspace
   requests its reads made (FUSE requests by operation and fanotify events by outcome:
   the layer server's Prometheus counters, before and after), the layer server's CPU
   seconds (its ``process_cpu_seconds_total``, before and after) and, on ``fanotify``,
   its event holder's (``/proc/PID/stat``), the blobs complete after the start (its
   ``status``), and the page cache's growth (file pages in ``/proc/meminfo``, after
   minus before);

   each from the start of the pull (or run) to the marker line on the container's
   stdout, with the bytes that crossed the link (the host end's interface counters)
   and, for the lazy runs, the layer server's own figures from its ``status`` (bytes
   fetched from the store, blocks, the node cache's growth: the raw bytes of the blocks
   the start-up touched);
   ``--modes hot`` (issue 7): one recording boot on a fresh node publishes the image's
   hot list (``--publish-store``, the directory behind a second nginx serving a copy of
   the store; the job seals it with the marker) and its frames are decompressed and hashed on one core
   (``bench/hot_set_cost.py``, the best of 3 passes: issue 36's yardstick of the layer server's CPU), then
   ``hot cold`` runs the bootseer cold start on fresh nodes that prefetch it at rpull, with the prefetch's
   timing and figures;
   ``--containerds 1.6,2.1`` runs every containerd start (overlay, lazy and hot ones) on each
   of those containerds in turn within each repetition (each a value of ``BOOTSEER_CONTAINERD``,
   which alone picks the containerd otherwise; the hot list is recorded once, on the first),
   and the report puts them side by side, each against overlayfs on the same containerd;
   ``--modes fuse`` adds the layer server alone under a chroot (no containerd), with
   its Prometheus figures (FUSE requests, read latency, range requests), beside the
   same chroot on plain overlayfs; ``--profile`` samples the layer server with py-spy;
4. writes a Markdown table with medians, ratios to overlayfs in the same run and the
   targets, one check line each per data path (lazy warm <= 1.15x overlayfs warm; lazy
   cold <= 0.45x overlayfs cold; bytes fetched <= 2x bytes read; lazy local <= 1.15x
   overlayfs local; lazy complete <= 1.05x overlayfs local with 0 userspace requests (issue 36);
   the layer server's CPU over hot cold <= 2x decompressing and hashing its hot set on one core
   (issue 36); hot cold <= 1.25x its floor and <= 0.25x overlayfs cold; FUSE
   requests per start <= 1/10 of the tree path's; page-cache growth <= 2x overlayfs's for
   the same start; on ``fanotify``, issue 25's: lazy local <= 1.15x overlayfs local, hot cold
   <= 1.3x its floor, 0 userspace requests for the bytes of a complete blob) to ``--output``
   (bench/results/lazy.md).

Everything it starts (namespace, veth pair, registry, nginx, containerd, daemons, the
layer server, mounts) is torn down at the end, on failure and on Ctrl-C / SIGTERM.

This module runs the starts and measures them; the scenarios, their runs and the targets are
:mod:`bench.lazy_scenarios`, the Markdown page and its checks :mod:`bench.lazy_report`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from bench import image_build
from bench.common import (
    BenchError, bootseer_argv, drop_caches, fmt, log, run_checked, run_until_marker,
)
from bench.hot_set_cost import REPEATS as HOT_SET_REPEATS, HotSetCost, measure_published
from bench.lazy_report import report
from bench.lazy_scenarios import (
    COMPLETE_TIMEOUT, DATA_PATHS, IMAGE_SOURCES, KINDS, MB, PER_DATA_PATH, SCENARIOS, TREE_PATH, BlobsWait, Run,
    Scenario, base_name, completes, named, run_fanotify_events, run_fuse_requests, run_userspace_events,
    split_variant, variant,
)
from bench.node import (
    chroot_start, convert_store, hot_store_copy, layer_server_node, lower_dir, overlay_root, published_hot_list,
    recording_finished,
)
from bench.nodestats import cpu_seconds, file_pages
from bootseer.units import parse_size
from bench.nodestats import scrape_metrics as _scrape
from tests.support import netns
from tests.support.containerd import BUILTIN_OVERLAY, SNAPSHOTTER_NAME, ContainerdInstall, containerd_install
from tests.support.nginx import Nginx
from tests.support.oci import chain_ids
from tests.support.processes import HarnessError, ManagedProcess, pids_mentioning
from tests.support.stack import Snapshotter, Stack, snapshotter_binary
from tests.support.waiting import WaitFailed, free_port, wait_for_component, wait_until

BENCH_DIR = Path(__file__).resolve().parent


REGISTRY_PORT = 5000
STORE_PORT = 8080
#: nginx serving the copy of the store that the hot-list scenario records into and reads from.
HOT_STORE_PORT = 8081
#: The ports of the stores of the second image source (node-built images: a store converted with --no-image).
BUILT_STORE_PORT, BUILT_HOT_STORE_PORT = 8082, 8083
IMAGE_NAME = "bench/torch-train"
#: containerd namespace of every node (and with it the runc root /run/containerd/runc/NAMESPACE).
NAMESPACE = f"bench-{os.getpid()}"


def data_path_support() -> dict[str, bool]:
    """Whether the installed ``bootseer-snapshotter`` and ``bootseer layer-server`` take ``--data-path``
    (asked once, from their ``--help``)."""
    found = {}
    for what, argv in (("snapshotter", [snapshotter_binary(), "--help"]),
                       ("layer-server", bootseer_argv("layer-server", "--help"))):
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        found[what] = "--data-path" in done.stdout
    return found


# --------------------------------------------------------------------------- helpers


def _pids_under(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (this run's private directory): the ones it started."""
    return pids_mentioning(str(path))


# --------------------------------------------------------------------------- servers


class NetnsRegistry:
    """``docker-registry`` inside the link's namespace, its storage kept in the cache across runs."""

    def __init__(self, link: netns.ShapedLink, storage: Path, work: Path) -> None:
        self.link, self.storage, self.work = link, storage, work
        self.address = f"{link.server_ip}:{REGISTRY_PORT}"
        self.process: ManagedProcess | None = None

    def __enter__(self) -> "NetnsRegistry":
        self.storage.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        config = self.work / "registry.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            f"http:\n  addr: {self.address}\n"
        )
        self.process = ManagedProcess(
            "docker-registry", [*self.link.launcher(), "docker-registry", "serve", str(config)],
            self.work / "registry.log")
        self.process.start()
        try:
            wait_for_component(f"the registry on {self.address}", self._answers, 30, alive=self.process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _answers(self) -> bool:
        import urllib.request

        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2) as resp:
                return resp.status == 200
        return False

    def push(self, image: image_build.Image) -> str:
        ref = f"{self.address}/{IMAGE_NAME}:{image.tag}"
        run_checked(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", image.oci_ref, f"docker://{ref}"],
                    "skopeo copy (push)", timeout=600, log_path=self.work / "push.log")
        return ref

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop()


# --------------------------------------------------------------------------- the stores of the image sources


def source_store(image: image_build.Image, cache_dir: Path, source: str, inline_max: int | None,
                 log_path: Path) -> tuple[Path, dict[str, float | None]]:
    """The converted store a node of image source ``source`` reads, made once and cached under ``cache_dir``;
    and the seconds each conversion it took (None: cached).

    ``converter``: the benchmark's store (``CACHE/store``, :func:`bench.node.convert_store`), converted again
    by this version so that each layer's chain record names its EROFS image and its block table (a rerun adds
    them to a store converted before they existed); with ``inline_max`` (``--inline-max``) a store of its own,
    ``CACHE/store-inline-N``, converted with that bound.  ``node``: ``CACHE/store-built``, converted with
    ``--no-image``, whose records name no image, so the node builds each from the index.
    """
    if source == "node":
        store = cache_dir / "store-built"
        return store, {"convert --no-image": convert_store(image, store, log_path, marker=cache_dir / "store-built.converted",
                                                           flags=["--no-image"])}
    if inline_max is not None:
        store = cache_dir / f"store-inline-{inline_max}"
        return store, {f"convert --inline-max {inline_max}": convert_store(
            image, store, log_path, marker=cache_dir / f"store-inline-{inline_max}.converted",
            flags=["--inline-max", str(inline_max)])}
    store = cache_dir / "store"
    first = convert_store(image, store, log_path)
    images = convert_store(image, store, log_path, marker=cache_dir / "store.images")
    return store, {"convert": first, "convert again (adds images)": images,
                   "convert again (adds block tables)": convert_store(image, store, log_path,
                                                                      marker=cache_dir / "store.tables")}


def layer_image_bytes(store: Path, image: image_build.Image) -> list[dict[str, Any]]:
    """Per layer of the image in ``store``: its index's stored bytes and, when its chain record names an EROFS
    image, the image's raw bytes and its blocks' stored (compressed) bytes (``v1/images/<name>``)."""
    from bootseer.blockstore.objects.format import ChainRecord, LayerImage, chain_object, image_object, index_object

    rows = []
    for layer, chain in zip(image.layers, chain_ids([layer.diff_id for layer in image.layers])):
        record = ChainRecord.decode((store / chain_object(chain)).read_bytes(), expected_chain_id=chain)
        row: dict[str, Any] = {"layer": layer.name, "files": record.files,
                               "index_bytes": (store / index_object(record.index)).stat().st_size}
        if record.image:
            table = LayerImage.decode((store / image_object(record.image)).read_bytes(), record=record)
            row.update(image_bytes=table.size, image_stored=sum(block.clen for block in table.blocks),
                       inline_max=table.inline_max)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- one node


#: The lazy nodes' ``[datapath]`` settings other than their defaults (``--background-fill``, ``--fill-group``).
DATAPATH: dict[str, str] = {}


@contextlib.contextmanager
def fresh_node(base: Path, lazy: bool, store_url: str | None, timeout: float,
               publish_store: Path | None = None, data_path: str | None = None,
               containerd: ContainerdInstall | None = None) -> Iterator[Stack]:
    """A fresh containerd (``containerd``: which; default the one ``BOOTSEER_CONTAINERD`` chooses) and, for
    ``lazy``, bootseer-snapshotter with ``--store``, under ``base``.

    ``publish_store``: the directory behind the read-only ``store_url``, given to the daemon
    as ``--publish-store`` (its layer server publishes the hot lists it records there).
    ``data_path``: given to the daemon as ``--data-path`` (None: not passed).
    """
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    stack = Stack(base, namespace=NAMESPACE, with_registry=False,
                          snapshotter=SNAPSHOTTER_NAME if lazy else BUILTIN_OVERLAY,
                          snapshotter_log_level="info", containerd=containerd)
    if lazy:
        # The daemon's layer server serves its metrics too, so lazy runs show FUSE requests.
        metrics = f"127.0.0.1:{free_port()}"
        settings = []
        if DATAPATH:
            (base / "snapshotter.toml").write_text("[datapath]\n" + "".join(f"{k} = {v}\n" for k, v in DATAPATH.items()))
            settings = ["--config", str(base / "snapshotter.toml")]
        stack.daemon = Snapshotter(base / "snap", log_level="info", extra_args=[*settings,
            "--store", store_url, "--layer-server-metrics-address", metrics,
            *(["--publish-store", str(publish_store)] if publish_store is not None else []),
            *(["--data-path", data_path] if data_path is not None else [])])
        stack.layer_server_metrics_url = f"http://{metrics}/metrics"  # type: ignore[attr-defined]
    try:
        stack.start()
        yield stack
    finally:
        stack.close()
        # The layer server outlives the daemon by design; it and its FUSE mount are ours to end.
        for pid in _pids_under(base):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(HarnessError):
            wait_for_component("this node's processes to exit", lambda: not _pids_under(base), 15)
        for pid in _pids_under(base):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            stack._unmount_all()
        for error in stack.teardown_errors:
            log(f"  teardown: {error}")
        keep_logs = base.parent / "logs" / base.name
        keep_logs.mkdir(parents=True, exist_ok=True)
        for path in base.rglob("*.log"):
            with contextlib.suppress(OSError):
                shutil.copy(path, keep_logs / path.name)
        shutil.rmtree(base, ignore_errors=True)


def control_socket(stack: Stack) -> Path:
    """The layer server's control socket of a node whose daemon has ``--root ROOT``."""
    return stack.daemon.root / "layers" / "control.sock"


def lazy_node_figures(stack: Stack) -> dict[str, float]:
    """The layer server's ``status`` figures and its Prometheus metrics, on a lazy node, and the CPU time of
    the node's event holder (``holder.cpu_seconds``) when the ``fanotify`` path runs one."""
    return {**layer_server_figures(control_socket(stack)),
            **scrape_metrics(getattr(stack, "layer_server_metrics_url", None)),
            **event_holder_figures(stack.daemon.root)}


def event_holder_figures(root: Path) -> dict[str, float]:
    """CPU seconds of the event holder of the layer server of ``root`` (``bootseer.blockstore.datapath.event_holder
    --root ROOT``: the process that reads the fanotify group and hands each event to the server); none without one."""
    seconds = [cpu_seconds(pid) for pid in pids_mentioning(f"event_holder --root {root} ")]
    found = [value for value in seconds if value is not None]
    return {"holder.cpu_seconds": sum(found)} if found else {}


def layer_server_figures(socket_path: Path) -> dict[str, float]:
    """What the layer server says it fetched, served and cached (``status`` on its control socket)."""
    from bootseer.blockstore.server.client import LayerServerClient

    try:
        status = LayerServerClient(socket_path).status()
    except Exception as e:  # noqa: BLE001 - a missing figure must not lose the timing
        log(f"  layer server status on {socket_path}: {e}")
        return {}
    figures: dict[str, float] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            figures[prefix] = figures.get(prefix, 0) + value
        elif isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else key, inner)

    for store in status.get("stores", {}).values():
        add("store", store)
    add("cache", status.get("cache", {}))
    add("fanotify", status.get("fanotify", {}))  # the fanotify path's blobs (levels) and events answered
    figures["layers"] = len(status.get("layers", []))
    return figures


def scrape_metrics(url: str | None) -> dict[str, float]:
    """The layer server's figures from its Prometheus page (:func:`nodestats.scrape_metrics`)."""
    return _scrape(url, log=log)


#: Figures that are levels, not counters: reported as they are after the run, not as a difference.
LEVELS = {"cache.max_bytes", "layers", "store.in_flight", "fanotify.blobs", "fanotify.complete",
          "fanotify.missing_blocks", "fanotify.pending", "fanotify.local_blobs.complete",
          "fanotify.local_blobs.partial"}


def diff_figures(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What the run added to each counter of ``after`` since ``before``."""
    return {key: value if key in LEVELS else value - before.get(key, 0) for key, value in after.items()}


@contextlib.contextmanager
def profiled(socket_path: Path, out: Path | None) -> Iterator[None]:
    """Sample the layer server with py-spy (``--gil``: Python code holding the GIL) while the body runs.

    The raw samples (``py-spy record --format raw``) go to ``out``; nothing happens when
    ``out`` is None, and a missing py-spy or layer server only costs the profile.
    """
    spy = None
    if out is not None:
        from bootseer.blockstore.server.client import LayerServerClient

        try:
            pid = LayerServerClient(socket_path).status()["pid"]
            spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
                                    "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--gil",
                                    "--nonblocking", "--threads", "-o", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except Exception as e:  # noqa: BLE001 - a profile must never cost the measurement
            log(f"  no profile: {e}")
    try:
        yield
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


def ctr_argv(stack: Stack, *args: str) -> list[str]:
    """The node's own ``ctr`` (from its containerd's directory) against it."""
    return stack.containerd.ctr_argv(*args)


def run_argv(stack: Stack, ref: str, name: str, options: tuple[str, ...] = ()) -> list[str]:
    return ctr_argv(stack, "run", "--rm", "--fifo-dir", str(stack.fifo_dir), "--snapshotter",
                    stack.snapshotter_name, *options, ref, name)


def pull_argv(stack: Stack, ref: str, lazy: bool) -> list[str]:
    """``bootseer rpull`` onto the node's snapshotter (lazy), else ``ctr images pull`` onto overlayfs."""
    if lazy:
        return bootseer_argv("rpull", "--address", str(stack.containerd.address), "--namespace", NAMESPACE,
                             "--plain-http", ref)
    return ctr_argv(stack, "images", "pull", "--plain-http", "--snapshotter", "overlayfs", ref)


class PrefetchWatch:
    """Polls the layer server's ``hotlist.status`` while a start runs, to tell where its time goes.

    Records when a prefetch first shows (``start_s``) and when it has fetched its whole list
    (``end_s``), both in seconds after the watch began (just before the pull), and the
    prefetch's own figures (planned and fetched bytes, hits, waited, misses, lead time) as
    its summary gives them once its container is gone.  Polling at ``period`` bounds the
    times' resolution; the layer server answers a status in well under a millisecond.
    """

    def __init__(self, socket_path: Path, period: float = 0.2) -> None:
        import threading

        from bootseer.blockstore.server.client import LayerServerClient

        self.client = LayerServerClient(socket_path, timeout=5)
        self.period = period
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.last: dict[str, Any] = {}
        self._begun = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="prefetch-watch", daemon=True)

    def __enter__(self) -> "PrefetchWatch":
        self._begun = time.perf_counter()
        self._thread.start()
        return self

    def _look(self) -> bool:
        """One status; True once the prefetch's summary (its container gone) is there."""
        try:
            status = self.client.call({"op": "hotlist.status"})
        except Exception:  # noqa: BLE001 - the layer server starts with the first mount of the pull
            return False
        now = time.perf_counter() - self._begun
        for prefetch in status.get("prefetches", []):
            if self.start_s is None:
                self.start_s = now
            self.last = prefetch
            if prefetch.get("finished") and self.end_s is None:
                self.end_s = now
        done = [s for s in status.get("finished", []) if s.get("kind") == "prefetch"]
        if done:
            self.last = done[-1]
            if self.start_s is None:
                self.start_s = now
            if self.end_s is None and self.last.get("finished"):
                self.end_s = now
        return bool(done)

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            self._look()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + 10  # the summary comes when the removed container's notice arrives
        while not self._look() and time.monotonic() < deadline:
            time.sleep(0.2)

    def figures(self) -> dict[str, float]:
        figures = {key: float(value) for key, value in self.last.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.start_s is not None:
            figures["start_s"] = self.start_s
        if self.end_s is not None:
            figures["end_s"] = self.end_s
        return figures


#: Seconds between two looks at the layer server's ``status`` while lazy-complete waits for its blobs.
BLOBS_POLL_S = 0.5


def wait_blobs_complete(socket_path: Path, timeout: float) -> BlobsWait:
    """Leave the node idle until every local blob its layer server serves is complete and unmarked (its ``status``:
    ``fanotify.complete == fanotify.blobs``, ``fanotify.held_marked == 0``; polled every :data:`BLOBS_POLL_S` s, at
    most ``timeout`` s): what the background fill did meanwhile.  A timeout is said in the answer, not raised."""
    from bootseer.blockstore.server.client import LayerServerClient

    client = LayerServerClient(socket_path, timeout=5)
    start = time.perf_counter()
    seen: dict[str, Any] = {}
    filled_at: list[float] = []

    def look() -> dict[str, Any]:
        try:
            return client.status().get("fanotify") or {}
        except Exception as e:  # noqa: BLE001 - a status missed is looked at again
            log(f"  layer server status on {socket_path}: {e}")
            return {}

    def whole() -> bool:
        fanotify = look()
        if not fanotify:
            return False
        seen.update(fanotify)
        blobs, complete = fanotify.get("blobs", 0), fanotify.get("complete", -1)
        if blobs and complete == blobs and not filled_at:
            filled_at.append(time.perf_counter() - start)
        return bool(blobs) and complete == blobs and fanotify.get("held_marked", 0) == 0

    first = look()
    try:
        wait_until("every served blob to be complete and unmarked", whole, timeout, interval=BLOBS_POLL_S)
        done = True
    except WaitFailed:
        done = False
    waited = time.perf_counter() - start
    fill, before = seen.get("background_fill", {}), first.get("background_fill", {})

    def added(key: str) -> int:
        return int(fill.get(key, 0) - before.get(key, 0))

    return BlobsWait(seconds=waited, complete=done, filled_seconds=filled_at[0] if filled_at else None,
                     blobs=int(seen.get("blobs", 0)), complete_blobs=int(seen.get("complete", 0)),
                     held_marked=int(seen.get("held_marked", 0)), missing_blocks=int(seen.get("missing_blocks", 0)),
                     fill_bytes=added("stored_bytes"), fill_blocks=added("blocks"), fill_batches=added("batches"),
                     fill_yielded=added("yielded"), fill_failed=added("failed"))


def blobs_wait_summary(wait: BlobsWait) -> str:
    """A log line's (and a failure's) account of a :class:`BlobsWait`."""
    return (f"{'blobs complete' if wait.complete else 'blobs NOT complete'} after {wait.seconds:.1f} s "
            f"(whole at {fmt(wait.filled_seconds, '.1f')} s): {wait.complete_blobs} of {wait.blobs} complete, "
            f"{wait.held_marked} held marked, {wait.missing_blocks} blocks missing; the background fill wrote "
            f"{wait.fill_bytes / MB:.1f} MB stored ({wait.fill_blocks} blocks, {wait.fill_batches} batches, "
            f"yielded {wait.fill_yielded}, failed {wait.fill_failed})")


def timed_start(stack: Stack, link: netns.ShapedLink, ref: str, name: str, pull: list[str] | None,
                timeout: float, log_path: Path, lazy: bool, profile: Path | None = None,
                watch_prefetch: bool = False, marks: Path | None = None, drop: bool = True) -> Run:
    """Drop caches (unless not ``drop``), then (pull and) run the container; time to its marker line,
    and the page cache's growth from just before the start to the container's exit.

    ``watch_prefetch``: follow the hot-list prefetch with a :class:`PrefetchWatch`.
    ``marks``: a host directory for the start-up profiler's marks of a container the snapshotter
    does not see (containerd's overlayfs): ``image.start`` / ``image.end`` are marked there around
    the pull, and it is bind-mounted at the container's ``/.bootseer`` for the job's own marks.
    """
    options: tuple[str, ...] = ()
    if marks is not None:
        options = ("--mount", f"type=bind,src={marks},dst={image_build.MARKS_DIR},options=rbind:rw")
    before = lazy_node_figures(stack) if lazy and not pull else {}
    if drop:
        drop_caches()
    pages = file_pages()
    counters = link.counters()
    watch = PrefetchWatch(control_socket(stack)) if watch_prefetch else None
    with profiled(control_socket(stack) if lazy else Path(), profile if lazy else None), \
            (watch if watch is not None else contextlib.nullcontext()):
        start = time.perf_counter()
        pull_seconds = 0.0
        summary = ""
        if pull:
            if marks is not None:
                (marks / "image.start").touch()
            output = run_checked(pull, "pull", timeout=timeout, log_path=log_path).strip().splitlines()
            pull_seconds = time.perf_counter() - start
            if marks is not None:
                (marks / "image.end").touch()
            summary = output[-1].strip() if output else ""
        seconds, line = run_until_marker(run_argv(stack, ref, name, options), image_build.FIRST_OUTPUT_MARKER,
                                         timeout, log_path)
    total = pull_seconds + seconds
    page_cache = file_pages() - pages
    fetched = (link.counters() - counters).received
    server = diff_figures(lazy_node_figures(stack), before) if lazy else {}
    return Run(seconds=total, pull_seconds=pull_seconds, link_bytes=fetched, output=line, server=server,
               pull_summary=summary, prefetch=watch.figures() if watch is not None else {},
               page_cache_bytes=page_cache)


def userspace_summary(run: Run) -> str:
    """A log line's userspace figures of a lazy run: FUSE requests, fanotify events by outcome, CPU seconds."""
    events = run_fanotify_events(run)
    return (f", FUSE requests {sum(run_fuse_requests(run).values()):.0f}"
            + (f", fanotify events {sum(events.values()):.0f} ("
               + ", ".join(f"{outcome} {count:.0f}" for outcome, count in sorted(events.items())) + ")"
               if events else "")
            + f", userspace {run_userspace_events(run):.0f}"
            + f", layer-server CPU {fmt(run.server.get('server.cpu_seconds'))} s"
            + (f" + holder {run.server['holder.cpu_seconds']:.2f} s" if "holder.cpu_seconds" in run.server else ""))


def _flag(name: str | None) -> str | None:
    """The ``--data-path`` of a scenario's variant (``erofs+built`` -> ``erofs``: the image source is the store's)."""
    return split_variant(name)[0] if name is not None else None


def measure_node(kind: str, rep: int, work: Path, link: netns.ShapedLink, ref: str, store_url: str | None,
                 scenarios: dict[str, Scenario], timeout: float, profile_dir: Path | None,
                 data_path: str | None = None, pass_data_path: bool = False,
                 containerd: ContainerdInstall | None = None, complete_timeout: float | None = None) -> None:
    """One fresh node: a cold start, a local start (page cache dropped), then a warm one (not dropped), of
    ``kind`` (overlay or lazy); a lazy node on ``data_path`` (passed as ``--data-path`` if ``pass_data_path``);
    its containerd ``containerd``.  On a lazy node whose data path :func:`completes` its blobs, with
    ``complete_timeout`` (None: not run), a fourth start, lazy-complete: the node left idle until its blobs are
    complete (:func:`wait_blobs_complete`, at most ``complete_timeout`` s), then started as the local one."""
    lazy = kind == "lazy"
    cold, local, warm, *more = (scenarios[named(name, data_path)] for name in KINDS[kind])
    if not (lazy and complete_timeout is not None and completes(data_path)):
        more = []
    label = kind + (f"-{data_path}" if lazy and data_path else "") + (f"-{containerd.series}" if containerd else "")
    log_path = work / "logs" / f"{label}{rep}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # Short directory names: containerd's and the layer server's sockets live below it (108-byte limit).
        with fresh_node(work / f"{kind[0]}{data_path or ''}{rep}{containerd.series if containerd else ''}", lazy, store_url, timeout,
                        data_path=_flag(data_path) if lazy and pass_data_path else None, containerd=containerd) as stack:
            pull = pull_argv(stack, ref, lazy)
            # (scenario, its pull, page cache dropped, the node left idle first until its blobs are complete)
            starts = [(cold, pull, True, False), (local, None, True, False), (warm, None, False, False),
                      *((complete, None, True, True) for complete in more)]
            for scenario, pulling, drop, idle in starts:
                wait = None
                if idle and complete_timeout is not None:  # lazy-complete
                    wait = wait_blobs_complete(control_socket(stack), complete_timeout)
                    log(f"  {scenario.name:14} run {rep}: {blobs_wait_summary(wait)}")
                    if not wait.complete:
                        scenario.errors.append(f"run {rep}: not run: {blobs_wait_summary(wait)} (--complete-timeout "
                                               f"{complete_timeout:g} s)")
                        continue
                try:
                    profile = profile_dir / f"{scenario.name}-{rep}.txt" if profile_dir else None
                    run = timed_start(stack, link, ref, f"{base_name(scenario.name)}-{rep}", pulling, timeout,
                                      log_path, lazy, profile, drop=drop)
                except BenchError as e:
                    scenario.errors.append(f"run {rep}: {e}")
                    log(f"  {scenario.name:14} run {rep}: FAILED: {e}")
                    if pulling is not None:
                        for later in (local, warm, *more):
                            later.errors.append(f"run {rep}: not run (the cold start failed)")
                        break
                    continue
                run.blobs_wait = wait
                scenario.runs.append(run)
                extra = "".join(f", {k}={v / MB:.1f} MB" for k, v in run.server.items()
                                if k.endswith("bytes") or k.endswith("bytes_fetched"))
                log(f"  {scenario.name:14} run {rep}: {run.seconds:6.2f} s (pull {run.pull_seconds:5.2f} s), "
                    f"link {run.link_bytes / MB:7.1f} MB, page cache +{run.page_cache_bytes / MB:.0f} MB"
                    + (userspace_summary(run) if lazy else "") + extra)
    except (BenchError, HarnessError) as e:
        for scenario in (cold, local, warm, *more):
            scenario.errors.append(f"run {rep}: node did not start: {e}")
        log(f"  {label} node {rep}: FAILED: {e}")


# --------------------------------------------------------------------------- hot lists (issue 7)


def record_hot_list(work: Path, ref: str, hot_url: str, hot_store: Path, image: image_build.Image,
                    timeout: float, data_path: str | None = None,
                    containerd: ContainerdInstall | None = None, label: str = "record") -> dict[str, Any]:
    """The image's first boot on a fresh node, which records its hot list into ``hot_store``.

    The node reads the store through nginx (``hot_url``, read-only) and publishes to the
    directory behind it (``--publish-store``); the job seals the recording itself by creating
    the marker after its first output.  Returns the list's summary, with the recording's
    ``sealed_by``/``outcome`` from the layer server and the boot's time.  ``data_path``: the
    daemon's ``--data-path`` (None: not passed); ``label``: the node's directory and log.
    """
    log_path = work / "logs" / f"{label}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with fresh_node(work / label, True, hot_url, timeout, publish_store=hot_store, data_path=data_path,
                    containerd=containerd) as stack:
        drop_caches()
        start = time.perf_counter()
        run_checked(pull_argv(stack, ref, True), "rpull (recording boot)", timeout=timeout, log_path=log_path)
        seconds, _ = run_until_marker(run_argv(stack, ref, "record-1"), image_build.FIRST_OUTPUT_MARKER, timeout,
                                      log_path)
        boot = time.perf_counter() - start
        found = recording_finished(control_socket(stack))
    hot = published_hot_list(found, hot_store, image)
    return {**hot, "outcome": found["outcome"], "boot_seconds": boot}


def measure_hot_set(hot_store: Path, image: image_build.Image, notes: list[str]) -> HotSetCost | None:
    """Issue 36's yardstick of the layer server's CPU over a hot-list start: the frames of the image's hot list just
    published into ``hot_store`` decompressed and checked on one core (:func:`bench.hot_set_cost.measure_published`,
    the best of :data:`~bench.hot_set_cost.REPEATS` passes); None, with a note why, if it could not be measured."""
    top = chain_ids([layer.diff_id for layer in image.layers])[-1]
    try:
        cost = measure_published(hot_store, top, repeats=HOT_SET_REPEATS)
    except (BenchError, OSError) as e:
        notes.append(f"Decompress + SHA-256 of the hot set in {hot_store} not measured: {e}")
        log(f"  hot set on one core: not measured: {e}")
        return None
    log(f"  hot set on one core: {cost.blocks} blocks, {cost.stored_bytes / MB:.1f} MB stored, "
        f"{cost.raw_bytes / MB:.1f} MB raw: decompress + SHA-256 {cost.cpu_seconds:.3f} s CPU "
        f"({cost.wall_seconds:.3f} s wall), the best of {HOT_SET_REPEATS}")
    return cost


def measure_hot_node(rep: int, work: Path, link: netns.ShapedLink, ref: str, hot_url: str, hot_store: Path,
                     scenarios: dict[str, Scenario], timeout: float, profile_dir: Path | None,
                     data_path: str | None = None, pass_data_path: bool = False,
                     containerd: ContainerdInstall | None = None) -> None:
    """A fresh node (new roots, empty cache; its containerd ``containerd``) whose store holds the hot list:
    rpull prefetches, then the job."""
    scenario = scenarios[named("hot-cold", data_path)]
    label = "hot" + (f"-{data_path}" if data_path else "") + (f"-{containerd.series}" if containerd else "")
    log_path = work / "logs" / f"{label}{rep}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with fresh_node(work / f"h{data_path or ''}{rep}{containerd.series if containerd else ''}", True, hot_url, timeout, publish_store=hot_store,
                        data_path=_flag(data_path) if pass_data_path else None, containerd=containerd) as stack:
            pull = pull_argv(stack, ref, True)
            profile = profile_dir / f"{scenario.name}-{rep}.txt" if profile_dir else None
            run = timed_start(stack, link, ref, f"hot-cold-{rep}", pull, timeout, log_path, True, profile,
                              watch_prefetch=True)
    except (BenchError, HarnessError) as e:
        scenario.errors.append(f"run {rep}: {e}")
        log(f"  {scenario.name:14} run {rep}: FAILED: {e}")
        return
    scenario.runs.append(run)
    pf = run.prefetch
    log(f"  {scenario.name:14} run {rep}: {run.seconds:6.2f} s (pull {run.pull_seconds:5.2f} s), "
        f"page cache +{run.page_cache_bytes / MB:.0f} MB{userspace_summary(run)}, "
        f"link {run.link_bytes / MB:7.1f} MB; prefetch {fmt(pf.get('start_s'))}..{fmt(pf.get('end_s'))} s, "
        f"{pf.get('fetched_bytes', 0) / MB:.1f} MB, hits {pf.get('hits', 0):.0f}, waited {pf.get('waited', 0):.0f}, "
        f"misses {pf.get('misses', 0):.0f}")


# --------------------------------------------------------------------------- profiled starts (--timeline)


#: The profiled starts of ``--timeline``: (trace name, the scenario it repeats), overlayfs first.
TIMELINE_NAMES = ("overlayfs", "bootseer")


@contextlib.contextmanager
def profiling_on(spool: Path, node: str) -> Iterator[None]:
    """Every process started in the body profiles into ``spool`` as node ``node`` (they inherit the
    environment: containerd's children, the snapshotter daemon and its layer server, rpull)."""
    from bootseer.profile import events

    saved = {key: os.environ.get(key) for key in (events.ENV_PROFILE, events.ENV_NODE, events.ENV_JOB)}
    os.environ.update({events.ENV_PROFILE: str(spool), events.ENV_NODE: node})
    os.environ.pop(events.ENV_JOB, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def containerd_watcher(stack: Stack, spool: Path, log_path: Path) -> Iterator[None]:
    """``bootseer profile containerd`` on the node's containerd, writing its events to ``spool``,
    for the body (containerd keeps no history: it must be watching before the pull)."""
    watcher = ManagedProcess("profile containerd", bootseer_argv(
        "profile", "containerd", "--address", str(stack.containerd.address), "--namespace", NAMESPACE,
        "--spool", str(spool)), log_path, python=True)
    watcher.start()
    try:
        wait_for_component("the containerd watcher to connect",
                           lambda: "watching containerd" in log_path.read_text(errors="replace"), 30, alive=watcher)
        yield
    finally:
        with contextlib.suppress(HarnessError):
            watcher.stop()


def profiled_start(name: str, scenario: str, work: Path, link: netns.ShapedLink, ref: str, store_url: str | None,
                   hot_store: Path | None, out: Path, timeout: float,
                   containerd: ContainerdInstall | None = None) -> tuple[Run, Path]:
    """One cold start of ``scenario`` (overlay-cold, lazy-cold or hot-cold) on a fresh node with the
    start-up profiler on for every process of the node; its trace, collected, is ``out/NAME.json``."""
    from bootseer.profile import events, hooks

    lazy = scenario != "overlay-cold"
    base = work / f"t-{name}"
    spool, marks = work / f"timeline-{name}" / "spool", work / f"timeline-{name}" / "marks"
    for path in (spool, marks):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    marks.chmod(0o1777)  # as the snapshotter makes /.bootseer: a job of any uid may mark
    log_path = work / "logs" / f"timeline-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with profiling_on(spool, scenario):
        with fresh_node(base, lazy, store_url, timeout, publish_store=hot_store, containerd=containerd) as stack, \
                containerd_watcher(stack, spool, work / "logs" / f"timeline-{name}-watch.log"):
            since = time.time()
            run = timed_start(stack, link, ref, f"timeline-{name}", pull_argv(stack, ref, lazy), timeout, log_path,
                              lazy, marks=None if lazy else marks)
            time.sleep(1.0)  # containerd's task exit and delete reach the watcher
            until = time.time()
        if not lazy:  # the snapshotter reads its containers' marks itself; these came through the bind mount
            events.enable(spool)
            try:
                hooks.harvest_marks(marks, container=f"timeline-{name}")
            finally:
                events.disable()
    trace = out / f"{name}.json"
    collected = run_checked(bootseer_argv("profile", "collect", "--spool", str(spool), "--node", scenario,
                                          "--since", f"{since - 0.01:.6f}", "--until", f"{until:.6f}",
                                          "-o", str(trace)), f"profile collect ({name})", timeout=120,
                            log_path=log_path)
    log(f"  profiled {scenario} ({name}): {run.seconds:.2f} s; " + collected.splitlines()[0])
    return run, trace


def record_timeline(out: Path, work: Path, link: netns.ShapedLink, ref: str, store_url: str | None,
                    hot_url: str | None, hot_store: Path | None, kinds: list[str], timeout: float,
                    containerd: ContainerdInstall | None = None) -> dict[str, Any]:
    """``--timeline``: a profiled overlayfs cold start and a profiled BootSeer one (hot-list cold start when
    the hot mode ran, else lazy cold), each on a fresh node, then ``bootseer profile compare`` of the two
    into ``out`` (the traces, compare.html, compare.png, compare.trace.json, compare.txt)."""
    out.mkdir(parents=True, exist_ok=True)
    bootseer = ("hot-cold", hot_url, hot_store) if "hot" in kinds else ("lazy-cold", store_url, None)
    if bootseer[1] is None:
        raise BenchError("--timeline needs the store (modes lazy or hot)")
    log(f"timeline: profiled starts overlay-cold and {bootseer[0]} into {out}")
    runs: dict[str, Run] = {}
    traces: list[Path] = []
    for name, (scenario, url, publish) in zip(TIMELINE_NAMES, [("overlay-cold", None, None), bootseer]):
        run, trace = profiled_start(name, scenario, work, link, ref, url, publish, out, timeout, containerd)
        runs[scenario] = run
        traces.append(trace)
    text = run_checked(bootseer_argv("profile", "compare", *map(str, traces), "--names", ",".join(TIMELINE_NAMES),
                                     "--html", str(out / "compare.html"), "--png", str(out / "compare.png"),
                                     "--chrome", str(out / "compare.trace.json")),
                       "profile compare", timeout=300, log_path=work / "logs" / "timeline-compare.log")
    table = "\n".join(line for line in text.splitlines()
                      if not line.startswith(("timeline:", "picture:", "chrome trace:")))
    (out / "compare.txt").write_text(table + "\n")
    log("timeline:\n" + text)
    return {"dir": out, "table": table, "scenarios": {name: run.seconds for name, run in runs.items()},
            "files": sorted(p.name for p in out.iterdir())}


# --------------------------------------------------------------------------- the layer server alone


def measure_fuse_node(rep: int, work: Path, link: netns.ShapedLink, image: image_build.Image, store_url: str,
                      scenarios: dict[str, Scenario], timeout: float, profile_dir: Path | None,
                      cache_dir: Path, data_path: str | None = None, pass_data_path: bool = False,
                      plain_too: bool = True) -> None:
    """The layer server alone (no containerd, no snapshotter) on ``data_path``: cold, local, and (``plain_too``)
    plain overlayfs beside it."""
    from bootseer.blockstore.server.client import LayerServerClient

    label = "fuse" + (f"-{data_path}" if data_path else "")
    log_path = work / "logs" / f"{label}{rep}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    chains = chain_ids([layer.diff_id for layer in image.layers])
    cold, local, plain = (scenarios[named(name, data_path)] for name in KINDS["fuse"])
    base = work / f"f{data_path or ''}{rep}"
    try:
        with layer_server_node(base, store_url, _flag(data_path) if pass_data_path else None) as (socket_path, metrics_url):
            client = LayerServerClient(socket_path)
            lowers: list[str] = []
            for scenario in (cold, local):
                before = {**layer_server_figures(socket_path), **scrape_metrics(metrics_url)} if lowers else {}
                profile = profile_dir / f"{scenario.name}-{rep}.txt" if profile_dir else None
                drop_caches()
                pages = file_pages()
                counters = link.counters()
                try:
                    with profiled(socket_path, profile):
                        start = time.perf_counter()
                        if not lowers:  # what the snapshotter does when rpull prepares the layers
                            lowers = [lower_dir(client.mount(chain)) for chain in chains][::-1]
                        mounted = time.perf_counter() - start
                        with overlay_root(lowers, base, scenario.name) as root:
                            seconds, line = chroot_start(root, timeout, log_path)
                        total = time.perf_counter() - start
                except Exception as e:  # noqa: BLE001 - recorded, the other scenarios still run
                    scenario.errors.append(f"run {rep}: {e}")
                    log(f"  {scenario.name:14} run {rep}: FAILED: {e}")
                    break
                page_cache = file_pages() - pages
                fetched = (link.counters() - counters).received
                server = diff_figures({**layer_server_figures(socket_path), **scrape_metrics(metrics_url)}, before)
                scenario.runs.append(Run(seconds=total, pull_seconds=mounted, link_bytes=fetched, output=line,
                                         server=server, page_cache_bytes=page_cache))
                log(f"  {scenario.name:14} run {rep}: {total:6.2f} s (mounts {mounted:5.2f} s), "
                    f"link {fetched / MB:7.1f} MB")
    except (BenchError, HarnessError) as e:
        cold.errors.append(f"run {rep}: layer server did not start: {e}")
        log(f"  {label} node {rep}: FAILED: {e}")
    if not plain_too:
        return
    plain_lowers = [str(cache_dir / "layers" / layer.name) for layer in image.layers][::-1]
    drop_caches()
    pages = file_pages()
    try:
        start = time.perf_counter()
        with overlay_root(plain_lowers, work, f"plain{rep}") as root:
            seconds, line = chroot_start(root, timeout, log_path)
        total = time.perf_counter() - start
        page_cache = file_pages() - pages
    except BenchError as e:
        plain.errors.append(f"run {rep}: {e}")
        log(f"  plain-local    run {rep}: FAILED: {e}")
        return
    finally:
        for suffix in ("up", "work", "root"):
            shutil.rmtree(work / f"plain{rep}.{suffix}", ignore_errors=True)
    plain.runs.append(Run(seconds=total, pull_seconds=0.0, link_bytes=0, output=line, page_cache_bytes=page_cache))
    log(f"  plain-local    run {rep}: {total:6.2f} s")


# --------------------------------------------------------------------------- main


def measure_link(link: netns.ShapedLink, registry: NetnsRegistry, image: image_build.Image) -> float:
    """MB/s of one GET of the largest layer blob from the registry, across the link."""
    import urllib.request

    largest = max(image.layers, key=lambda layer: layer.size)
    url = f"http://{registry.address}/v2/{IMAGE_NAME}/blobs/{largest.digest}"
    start = time.perf_counter()
    size = 0
    with urllib.request.urlopen(url, timeout=120) as resp:
        while chunk := resp.read(1 << 20):
            size += len(chunk)
    return size / (time.perf_counter() - start) / MB


def run_benchmark(args: argparse.Namespace) -> tuple[image_build.Image, dict[str, Scenario], dict[str, Any]]:
    started = time.monotonic()
    load_before = os.getloadavg()[1]
    image = image_build.build_image(args.cache_dir, args.jobs)
    log(f"image {image.oci_ref}: {image.unpacked_bytes / MB:.0f} MB unpacked, {image.compressed_bytes / MB:.0f} MB gzip")
    runs = args.cache_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for old in runs.iterdir():  # logs of earlier benchmarks whose process is gone
        if old.name.isdigit() and not Path(f"/proc/{old.name}").exists():
            shutil.rmtree(old, ignore_errors=True)
    work = runs / str(os.getpid())
    work.mkdir()
    for path in (args.cache_dir, args.cache_dir / "runs", work):
        path.chmod(0o755)  # nginx's worker (www-data) must reach the store below the cache dir
    context: dict[str, Any] = {"notes": []}
    installs: list[ContainerdInstall] = [containerd_install(c) for c in args.containerds]
    context["containerds"] = installs
    log("containerd: " + "; ".join(install.describe() for install in installs))
    kinds = [k for k in KINDS if k in args.modes]
    support = data_path_support()
    context["data_path_flag"] = support
    paths: list[str] = list(args.data_paths)
    if not support["snapshotter"]:
        dropped = [path for path in paths if path != TREE_PATH]
        paths = [TREE_PATH]
        context["notes"].append(
            "The installed bootseer-snapshotter takes no `--data-path`: every BootSeer start ran on its only data "
            "path, the per-file FUSE tree, without the flag" + (f" ({', '.join(dropped)} not measured)." if dropped
                                                                else "."))
    elif not support["layer-server"] and "fuse" in kinds:
        context["notes"].append("`bootseer layer-server` takes no `--data-path`: the fuse scenarios ran on its default.")
    sources: list[str] = list(args.image_sources)
    # Each BootSeer scenario runs once per data path and image source: ``erofs`` (converter), ``erofs+built``.
    paths = list(dict.fromkeys(variant(path, source) for path in paths for source in sources))
    context["data_paths"], context["image_sources"] = paths, sources

    def source_of(path: str | None) -> str:
        """The image source whose store a variant reads (the tree path, which mounts no image: the first)."""
        found = split_variant(path)[1] if path is not None else sources[0]
        return found if found in sources else sources[0]
    log(f"data paths x image sources: {', '.join(paths)} (--data-path passed to the snapshotter: "
        f"{support['snapshotter']}, to the layer server: {support['layer-server']})")
    scenarios = {named(base, path): Scenario(named(base, path))
                 for base in SCENARIOS for path in (paths if base in PER_DATA_PATH else [None])}
    # The other containerds run the same starts into scenarios of their own (the fuse ones run no containerd).
    context["other_containerds"] = [(install, {name: Scenario(name) for name in scenarios if base_name(name) not in
                                               KINDS["fuse"]}) for install in installs[1:]]
    if args.profile:
        context["profile_dir"] = work / "profile"
        context["profile_dir"].mkdir()
    with contextlib.ExitStack() as servers:
        link = servers.enter_context(netns.ShapedLink(args.rate))
        log(f"link {link.client_ip} -> {link.server_ip} (namespace {link.name}), tbf {args.rate}")
        registry = servers.enter_context(NetnsRegistry(link, args.cache_dir / "registry", work / "registry"))
        ref = registry.push(image)
        context["link_rate"] = measure_link(link, registry, image)
        log(f"pushed {ref}; one GET across the link: {context['link_rate']:.1f} MB/s")
        # Per image source: the store, its nginx, and the copy the hot-list starts record into and read.
        store_urls: dict[str, str] = {}
        hot_urls: dict[str, str] = {}
        hot_stores = {"converter": args.cache_dir / "store-hot", "node": args.cache_dir / "store-hot-built"}
        ports = {"converter": (STORE_PORT, HOT_STORE_PORT), "node": (BUILT_STORE_PORT, BUILT_HOT_STORE_PORT)}
        context["convert_seconds"], context["image_bytes"] = {}, {}
        if "lazy" in kinds or "fuse" in kinds or "hot" in kinds:
            try:
                for source in sources:
                    store, seconds = source_store(image, args.cache_dir, source, args.inline_max,
                                                  work / f"convert-{source}.log")
                    context["convert_seconds"].update({f"{what} ({store.name})": value
                                                       for what, value in seconds.items()})
                    context["image_bytes"][source] = layer_image_bytes(store, image)
                    nginx = servers.enter_context(Nginx(store, work / f"nginx-{source}", ports[source][0],
                                                        host=link.server_ip, launcher=link.launcher()))
                    store_urls[source] = nginx.url
                    hotlists = store / "v1" / "hotlists"
                    if hotlists.is_dir():  # (b) is lazy *without* a hot list: one left by other work goes
                        shutil.rmtree(hotlists)
                        context["notes"].append(f"Removed the hot lists found in {hotlists} before the runs.")
                    if "hot" in kinds:
                        hot_store_copy(store, hot_stores[source])
                        hot_nginx = servers.enter_context(Nginx(hot_stores[source], work / f"nginx-hot-{source}",
                                                                ports[source][1], host=link.server_ip,
                                                                launcher=link.launcher()))
                        hot_urls[source] = hot_nginx.url
                context["notes"].append(
                    "The store of lazy-cold and fuse-cold holds no hot list and is read-only over HTTP (nothing is "
                    "published to it), so those starts are not prefetched; the layer server records each first "
                    "boot as it does by default and fails to publish it.")
            except (BenchError, RuntimeError) as e:
                for kind in ("lazy", "fuse", "hot"):
                    if kind in kinds:
                        kinds.remove(kind)
                        for name in KINDS[kind]:
                            for path in paths:
                                scenarios[named(name, path)].errors.append(f"store not ready: {e}")
                log(f"lazy path not measured: {e}")
        # One recording boot per image source, on its first data path, into that source's hot store.
        context["hots"] = {}
        for source in sources if "hot" in kinds else []:
            first = variant(split_variant(paths[0])[0], source)
            log(f"recording boot: fresh node, store {hot_urls[source]}, --publish-store {hot_stores[source]}")
            try:
                hot = record_hot_list(work, ref, hot_urls[source], hot_stores[source], image, args.timeout,
                                      data_path=split_variant(first)[0] if support["snapshotter"] else None,
                                      containerd=installs[0], label=f"record-{source}")
                hot["data_path"] = first
                for path in paths:
                    if source_of(path) == source:
                        context["hots"][path] = hot
                log(f"  hot list: {hot['blocks']} blocks, {hot['bytes'] / MB:.1f} MB "
                    f"(sealed by {hot['sealed_by']}; the boot took {hot['boot_seconds']:.1f} s)")
                hot["hot_set_cost"] = measure_hot_set(hot_stores[source], image, context["notes"])
            except (BenchError, HarnessError) as e:
                for path in paths:
                    if source_of(path) == source:
                        scenarios[named("hot-cold", path)].errors.append(f"no hot list recorded: {e}")
                log(f"  recording boot FAILED: {e}")
        pass_snapshotter, pass_server = support["snapshotter"], support["layer-server"]
        # lazy-complete (issue 36): on the fanotify variants, unless the background fill is off.
        complete_timeout = args.complete_timeout if args.background_fill == "on" else None
        if "lazy" in kinds:
            if complete_timeout is None:
                context["notes"].append("lazy-complete not run: `--background-fill off` (no blob completes).")
            elif [path for path in paths if not completes(path)]:
                context["notes"].append(
                    "lazy-complete not run on " + ", ".join(path for path in paths if not completes(path))
                    + ": only the fanotify path has local blobs that a background fill completes (lazy-local is "
                    "those paths' second start with the page cache dropped).")
        for rep in range(1, args.reps + 1):
            # Each repetition on every containerd in turn: load that drifts during the run hits them alike.
            for install, by_name in [(installs[0], scenarios), *context["other_containerds"]]:
                # Only the first containerd's starts are profiled (--profile): the report shows those.
                profile_dir = context.get("profile_dir") if install is installs[0] else None
                for kind in kinds:
                    for number, path in enumerate(paths if kind != "overlay" else [None]):
                        source = source_of(path)
                        if kind == "hot":
                            if path in context["hots"]:
                                measure_hot_node(rep, work, link, ref, hot_urls[source], hot_stores[source], by_name,
                                                 args.timeout, profile_dir, path, pass_snapshotter,
                                                 containerd=install)
                        elif kind == "fuse":
                            if install is installs[0]:  # the layer server alone: no containerd in it
                                measure_fuse_node(rep, work, link, image, store_urls[source], scenarios, args.timeout,
                                                  profile_dir, args.cache_dir, path, pass_server,
                                                  plain_too=number == 0)
                        else:
                            measure_node(kind, rep, work, link, ref, store_urls.get(source), by_name, args.timeout,
                                         profile_dir, path, pass_snapshotter, containerd=install,
                                         complete_timeout=complete_timeout)
        if args.timeline is not None:
            try:
                context["timeline"] = record_timeline(args.timeline, work, link, ref, store_urls.get(sources[0]),
                                                      hot_urls.get(sources[0]), hot_stores[sources[0]]
                                                      if sources[0] in hot_urls else None, kinds, args.timeout,
                                                      installs[0])
            except (BenchError, HarnessError) as e:
                context["notes"].append(f"--timeline: not recorded: {e}")
                log(f"timeline FAILED: {e}")
        context["tc"] = link.describe()
    context["wall"] = time.monotonic() - started
    context["load"] = (load_before, os.getloadavg()[1])
    return image, scenarios, context


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="cold runs per scenario (3)")
    parser.add_argument("--rate", default="1gbit", help="the link's rate each way, in tc's syntax (1gbit)")
    parser.add_argument("--cache-dir", type=Path, default=image_build.DEFAULT_CACHE_DIR,
                        help=f"image, registry storage and store, kept across runs ({image_build.DEFAULT_CACHE_DIR})")
    parser.add_argument("--modes", default="overlay,lazy,fuse,hot",
                        help="comma-separated: overlay, lazy, fuse (the layer server alone, no containerd, with "
                             "plain overlayfs chroot runs beside it), hot (a recording boot, then fresh nodes that "
                             "prefetch its hot list) (overlay,lazy,fuse,hot)")
    parser.add_argument("--data-paths", default="erofs,tree",
                        help="comma-separated node data paths each BootSeer scenario runs on, in the same run against "
                             f"the same baselines: {', '.join(DATA_PATHS)} (erofs,tree; only tree where the installed "
                             "snapshotter takes no --data-path)")
    parser.add_argument("--image-sources", default=",".join(IMAGE_SOURCES),
                        help="comma-separated sources of the nodes' EROFS images, each BootSeer scenario once per "
                             "source against the same baselines: converter (the store's, published by `bootseer "
                             "convert`; `name@erofs`), node (built by the node from the index: a store converted "
                             "with --no-image; `name@erofs+built`) (converter,node; the tree path has one)")
    parser.add_argument("--inline-max", type=parse_size, default=None, metavar="SIZE",
                        help="the converter store's `bootseer convert --inline-max` (default: the converter's "
                             "default, the benchmark's store; else a store of its own, CACHE/store-inline-N)")
    parser.add_argument("--jobs", type=int, default=2, help="gzip threads when building the image (2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one pull or run may take (600)")
    parser.add_argument("--profile", action="store_true",
                        help="sample the layer server with py-spy during the lazy runs; summary in the report, "
                             "raw samples under CACHE/runs/PID/profile/")
    parser.add_argument("--timeline", type=Path, metavar="DIR",
                        help="after the measured runs, one more overlayfs cold start and one more BootSeer cold start "
                             "(hot-list if mode hot ran, else lazy) on fresh nodes with the start-up profiler on; "
                             "their traces and `bootseer profile compare`'s table, HTML page, PNG and Chrome trace "
                             "go to DIR (off: the measured runs are never profiled)")
    parser.add_argument("--containerds", default="",
                        help="comma-separated containerds to measure the containerd starts on, side by side: each a "
                             "value of BOOTSEER_CONTAINERD (1.6, 1.7, 2.1 or a directory; the first is the main one, "
                             "the hot list is recorded on it) (default: BOOTSEER_CONTAINERD's choice alone)")
    parser.add_argument("--fill-group", type=parse_size, default=None, metavar="SIZE",
                        help="the lazy nodes' [datapath] fill_group (fanotify: raw bytes an event for a hole fills at "
                             "once; default: the daemon's)")
    parser.add_argument("--background-fill", choices=("on", "off"), default="on",
                        help="the lazy nodes' [datapath] background_fill (fanotify: the rest of each blob filled once "
                             "the link is idle) (on, the daemon's default); off: a config file turning it off")
    parser.add_argument("--complete-timeout", type=float, default=COMPLETE_TIMEOUT, metavar="S",
                        help="lazy-complete (fanotify): seconds the node is left idle at most for the background fill "
                             f"to complete every served blob before its start ({COMPLETE_TIMEOUT:g}); not complete "
                             "by then: the start is not run, and the report says so")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "results" / "lazy.md",
                        help="Markdown results (bench/results/lazy.md)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(KINDS):
        parser.error(f"--modes takes a comma-separated subset of {','.join(KINDS)}")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    args.data_paths = list(dict.fromkeys(p.strip() for p in args.data_paths.split(",") if p.strip()))
    if not args.data_paths or set(args.data_paths) - set(DATA_PATHS):
        parser.error(f"--data-paths takes a comma-separated subset of {','.join(DATA_PATHS)}")
    args.image_sources = list(dict.fromkeys(s.strip() for s in args.image_sources.split(",") if s.strip()))
    if not args.image_sources or set(args.image_sources) - set(IMAGE_SOURCES):
        parser.error(f"--image-sources takes a comma-separated subset of {','.join(IMAGE_SOURCES)}")
    args.containerds = list(dict.fromkeys(c.strip() for c in args.containerds.split(",") if c.strip())) or [None]
    args.cache_dir = args.cache_dir.resolve()
    if args.timeline is not None:
        if "overlay" not in args.modes or not {"lazy", "hot"} & set(args.modes):
            parser.error("--timeline compares overlayfs with BootSeer: --modes must hold overlay and lazy or hot")
        args.timeline = args.timeline.resolve()
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.background_fill == "off":
        DATAPATH["background_fill"] = "false"
    if args.fill_group is not None:
        DATAPATH["fill_group"] = str(args.fill_group)
    if os.geteuid() != 0:
        sys.exit("error: the benchmark needs root (network namespace, tc, containerd, mounts)")
    missing = [tool for tool in ("runc", "docker-registry", "skopeo", "nginx", "ip", "tc",
                                 "debootstrap", "pigz") if not shutil.which(tool)]
    if missing:
        sys.exit(f"error: missing {', '.join(missing)} (run ctr_examples/install-deps.sh)")
    for choice in args.containerds:  # each the way the tests choose theirs (containerd_install)
        try:
            containerd_install(choice)
        except HarnessError as e:
            sys.exit(f"error: {e}")
    # SIGTERM and SIGHUP unwind like Ctrl-C, so every context manager tears its part down.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        image, scenarios, context = run_benchmark(args)
    except (image_build.BuildError, BenchError, HarnessError, netns.NetnsError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:
        log(f"interrupted ({str(e) or 'Ctrl-C'}); everything it started is torn down")
        return 130
    text = report(args, image, scenarios, context)
    print("\n" + text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    log(f"written to {args.output}")
    others = [by_name for _, by_name in context.get("other_containerds", [])]
    return 1 if any(s.errors for by_name in (scenarios, *others) for s in by_name.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
