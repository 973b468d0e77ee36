"""Benchmark of lazy image layers: time to a container's first useful output, overlayfs vs BootSeer.

One command (as root): ``.venv/bin/python bench/lazy_bench.py``.  It

1. builds (once, cached under ``--cache-dir``) a 1.2 GB, four-layer image: Debian
   bookworm minbase, python3 + pip, the CPU build of torch, and an app whose command
   imports torch, runs one training step and prints a marker line (``image_build.py``);
2. makes a private network namespace behind a veth pair shaped with ``tbf`` to
   ``--rate`` (1 Gbit/s) both ways (``netns.py``) and runs in it the registry
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

   each from the start of the pull (or run) to the marker line on the container's
   stdout, with the bytes that crossed the link (the host end's interface counters)
   and, for the lazy runs, the layer server's own figures (bytes fetched from the store,
   blocks, bytes returned to FUSE reads);
4. writes a Markdown table with medians, ratios to overlayfs in the same run and the
   targets (lazy cold <= 0.45x overlayfs cold; bytes fetched <= 2x bytes read; lazy local
   <= 1.15x overlayfs local) to ``--output`` (bench/results/lazy.md).

Everything it starts (namespace, veth pair, registry, nginx, containerd, daemons, the
layer server, mounts) is torn down at the end, on failure and on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import selectors
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(REPO_ROOT))

import image_build  # noqa: E402
import netns  # noqa: E402
from nginx import Nginx  # noqa: E402

from integration import harness  # noqa: E402

MB = 1_000_000
REGISTRY_PORT = 5000
STORE_PORT = 8080
IMAGE_NAME = "bench/torch-train"
#: containerd namespace of every node (and with it the runc root /run/containerd/runc/NAMESPACE).
NAMESPACE = f"bench-{os.getpid()}"

#: The issue's targets.
TARGET_COLD_RATIO = 0.45
TARGET_FETCH_OVER_READ = 2.0
TARGET_LOCAL_RATIO = 1.15

SCENARIOS = {
    "overlay-cold": "overlayfs: `ctr images pull` + `ctr run`, cold",
    "lazy-cold": "bootseer: `bootseer rpull` + `ctr run --snapshotter bootseer`, cold",
    "overlay-local": "overlayfs: `ctr run`, image already pulled",
    "lazy-local": "bootseer: `ctr run`, blocks in the node cache",
}


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and why."""


@dataclasses.dataclass
class Run:
    """One timed start of the container."""

    seconds: float  #: start of the pull (or run) to the marker line
    pull_seconds: float  #: the pull alone (0 for local runs)
    link_bytes: int  #: bytes from the namespace to the host while it ran
    output: str  #: the marker line
    server: dict[str, float] = dataclasses.field(default_factory=dict)  #: layer server figures (lazy)


@dataclasses.dataclass
class Scenario:
    name: str
    runs: list[Run] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)

    def median(self, pick: Callable[[Run], float]) -> float | None:
        return statistics.median(pick(r) for r in self.runs) if self.runs else None


# --------------------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def drop_caches() -> None:
    """Write dirty pages back, then drop the page cache, dentries and inodes (a cold node)."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def bootseer_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "bootseer.cli", *args]


def run_checked(argv: list[str], what: str, timeout: float, log_path: Path | None = None) -> str:
    """Run a command; its output goes to ``log_path``; a failure raises with the output's tail."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{what}: timed out after {timeout:.0f} s: {shlex.join(argv)}") from e
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}\n[exit {done.returncode}]\n")
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-1500:]
        raise BenchError(f"{what}: exit status {done.returncode}: {shlex.join(argv)}\n{tail}")
    return done.stdout


def run_until_marker(argv: list[str], marker: str, timeout: float, log_path: Path) -> tuple[float, str]:
    """Start ``argv``; seconds until a line containing ``marker`` appears on its stdout, and that line.

    The process is then waited for (it exits after printing) and must exit 0.
    """
    start = time.perf_counter()
    with open(log_path, "a") as out_log:
        out_log.write(f"$ {shlex.join(argv)}\n")
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        found: tuple[float, str] | None = None
        buffered = b""
        deadline = start + timeout
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(process.stdout, selectors.EVENT_READ)
                while True:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise BenchError(f"no {marker!r} within {timeout:.0f} s: {shlex.join(argv)}")
                    if not selector.select(left):
                        continue
                    chunk = os.read(process.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    buffered += chunk
                    out_log.write(chunk.decode(errors="replace"))
                    if found is None:
                        for line in buffered.decode(errors="replace").splitlines():
                            if marker in line:
                                found = (time.perf_counter() - start, line.strip())
                                break
            status = process.wait(timeout=max(1.0, deadline - time.perf_counter()))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        out_log.write(f"[exit {process.returncode}]\n")
    tail = buffered.decode(errors="replace").strip()[-1500:]
    if status != 0:
        raise BenchError(f"exit status {status}: {shlex.join(argv)}\n{tail}")
    if found is None:
        raise BenchError(f"the container exited without printing {marker!r}:\n{tail}")
    return found


def _pids_under(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (this run's private directory): the ones it started."""
    return harness._pids_mentioning(str(path))


# --------------------------------------------------------------------------- servers


class NetnsRegistry:
    """``docker-registry`` inside the link's namespace, its storage kept in the cache across runs."""

    def __init__(self, link: netns.ShapedLink, storage: Path, work: Path) -> None:
        self.link, self.storage, self.work = link, storage, work
        self.address = f"{link.server_ip}:{REGISTRY_PORT}"
        self.process: harness.ManagedProcess | None = None

    def __enter__(self) -> "NetnsRegistry":
        self.storage.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        config = self.work / "registry.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            f"http:\n  addr: {self.address}\n"
        )
        self.process = harness.ManagedProcess(
            "docker-registry", [*self.link.launcher(), "docker-registry", "serve", str(config)],
            self.work / "registry.log")
        self.process.start()
        try:
            harness.wait_until(f"the registry on {self.address}", self._answers, 30, alive=self.process)
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


def convert_store(image: image_build.Image, store: Path, log_path: Path) -> float | None:
    """``bootseer convert`` the image into ``store`` unless already done; the seconds it took (None: cached)."""
    marker = store.parent / "store.converted"
    if marker.exists() and marker.read_text().strip() == image.manifest_digest and store.is_dir():
        return None
    store.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    log(f"bootseer convert {image.oci_ref} --store {store}")
    start = time.perf_counter()
    run_checked(bootseer_argv("convert", image.oci_ref, "--store", str(store)), "bootseer convert",
                timeout=3600, log_path=log_path)
    seconds = time.perf_counter() - start
    # nginx's worker runs unprivileged: the store must be world-readable.
    subprocess.run(["chmod", "-R", "a+rX", str(store)], check=True)
    marker.write_text(image.manifest_digest + "\n")
    return seconds


# --------------------------------------------------------------------------- one node


@contextlib.contextmanager
def fresh_node(base: Path, lazy: bool, store_url: str | None, timeout: float) -> Iterator[harness.Stack]:
    """A fresh containerd (and, for ``lazy``, bootseer-snapshotter with ``--store``) under ``base``."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    stack = harness.Stack(base, namespace=NAMESPACE, with_registry=False,
                          snapshotter=harness.SNAPSHOTTER_NAME if lazy else harness.BUILTIN_OVERLAY,
                          snapshotter_log_level="info")
    if lazy:
        stack.daemon = harness.Snapshotter(base / "snap", log_level="info", extra_args=["--store", store_url])
    try:
        stack.start()
        yield stack
    finally:
        stack.close()
        # The layer server outlives the daemon by design; it and its FUSE mount are ours to end.
        for pid in _pids_under(base):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(harness.HarnessError):
            harness.wait_until("this node's processes to exit", lambda: not _pids_under(base), 15)
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


def layer_server_figures(stack: harness.Stack) -> dict[str, float]:
    """What the layer server says it fetched, served and cached (``status`` on its control socket)."""
    from bootseer.blockstore.control import LayerServerClient

    socket_path = stack.daemon.root / "layers" / "control.sock"
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
    figures["layers"] = len(status.get("layers", []))
    return figures


def diff_figures(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0) for key, value in after.items()}


def ctr_argv(stack: harness.Stack, *args: str) -> list[str]:
    return ["ctr", "-a", str(stack.containerd.address), "-n", NAMESPACE, *args]


def run_argv(stack: harness.Stack, ref: str, name: str) -> list[str]:
    return ctr_argv(stack, "run", "--rm", "--fifo-dir", str(stack.fifo_dir), "--snapshotter",
                    stack.snapshotter_name, ref, name)


def timed_start(stack: harness.Stack, link: netns.ShapedLink, ref: str, name: str, pull: list[str] | None,
                timeout: float, log_path: Path, lazy: bool) -> Run:
    """Drop caches, then (pull and) run the container; time to its marker line."""
    before = layer_server_figures(stack) if lazy and not pull else {}
    drop_caches()
    counters = link.counters()
    start = time.perf_counter()
    pull_seconds = 0.0
    if pull:
        run_checked(pull, "pull", timeout=timeout, log_path=log_path)
        pull_seconds = time.perf_counter() - start
    seconds, line = run_until_marker(run_argv(stack, ref, name), image_build.FIRST_OUTPUT_MARKER, timeout, log_path)
    total = pull_seconds + seconds
    fetched = (link.counters() - counters).received
    server = diff_figures(layer_server_figures(stack), before) if lazy else {}
    return Run(seconds=total, pull_seconds=pull_seconds, link_bytes=fetched, output=line, server=server)


def measure_node(kind: str, rep: int, work: Path, link: netns.ShapedLink, ref: str, store_url: str | None,
                 scenarios: dict[str, Scenario], timeout: float) -> None:
    """One fresh node: a cold start, then a local start, of ``kind`` (overlay or lazy)."""
    lazy = kind == "lazy"
    cold, local = scenarios[f"{kind}-cold"], scenarios[f"{kind}-local"]
    log_path = work / "logs" / f"{kind}{rep}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with fresh_node(work / f"{kind[0]}{rep}", lazy, store_url, timeout) as stack:
            if lazy:
                pull = bootseer_argv("rpull", "--address", str(stack.containerd.address), "--namespace", NAMESPACE,
                                     "--plain-http", ref)
            else:
                pull = ctr_argv(stack, "images", "pull", "--plain-http", "--snapshotter", "overlayfs", ref)
            for scenario, pull_argv in ((cold, pull), (local, None)):
                try:
                    run = timed_start(stack, link, ref, f"{scenario.name}-{rep}", pull_argv, timeout, log_path, lazy)
                except BenchError as e:
                    scenario.errors.append(f"run {rep}: {e}")
                    log(f"  {scenario.name:14} run {rep}: FAILED: {e}")
                    if pull_argv is not None:
                        local.errors.append(f"run {rep}: not run (the cold start failed)")
                        break
                    continue
                scenario.runs.append(run)
                extra = "".join(f", {k}={v / MB:.1f} MB" for k, v in run.server.items()
                                if k.endswith("bytes") or k.endswith("bytes_fetched"))
                log(f"  {scenario.name:14} run {rep}: {run.seconds:6.2f} s (pull {run.pull_seconds:5.2f} s), "
                    f"link {run.link_bytes / MB:7.1f} MB{extra}")
    except (BenchError, harness.HarnessError) as e:
        for scenario in (cold, local):
            scenario.errors.append(f"run {rep}: node did not start: {e}")
        log(f"  {kind} node {rep}: FAILED: {e}")


# --------------------------------------------------------------------------- report


def _machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    ctrd = subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout.split()
    return (f"{os.cpu_count()} × {cpu}, {memory:.0f} GiB RAM, Linux {platform.release()}, "
            f"containerd {ctrd[2] if len(ctrd) > 2 else '?'}, Python {platform.python_version()}")


def _f(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def _read_bytes(run: Run) -> float | None:
    """Bytes the start-up read: the raw bytes of the distinct blocks it touched.

    On a cold node the block cache starts empty and holds raw (decompressed) blocks, so
    its growth over the run is exactly that; the layer server's ``status`` reports it.
    """
    return run.server.get("cache.bytes")


def _fetched_bytes(run: Run) -> float | None:
    """Bytes that crossed the link for the lazy start: registry (manifest, config) and store reads."""
    return float(run.link_bytes)


def report(args: argparse.Namespace, image: image_build.Image, scenarios: dict[str, Scenario],
           context: dict[str, Any]) -> str:
    seconds = {name: s.median(lambda r: r.seconds) for name, s in scenarios.items()}
    lines = [
        "# Lazy image layers: benchmark results",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {_machine()}",
        f"- Command: `{shlex.join(['python', 'bench/lazy_bench.py', *sys.argv[1:]])}`",
        f"- Image: {len(image.layers)} layers, {image.unpacked_bytes / MB:.0f} MB unpacked, "
        f"{image.compressed_bytes / MB:.0f} MB gzip: "
        + ", ".join(f"{layer.name} {layer.tar_size / MB:.0f} MB" for layer in image.layers)
        + f"; command `python3 /app/train.py` (import torch, one SGD step, prints `{image_build.FIRST_OUTPUT_MARKER}`)",
        f"- Link: veth pair into a private network namespace holding the registry and the store's nginx, "
        f"tbf {args.rate} each way (measured {_f(context.get('link_rate'), '.1f')} MB/s with one HTTP GET)",
        f"- Each run on a fresh containerd root and snapshotter root (empty caches), page cache dropped "
        f"before every timed start; {args.reps} repetitions; wall time {context['wall'] / 60:.1f} min",
        "",
        "## Time to the first useful output",
        "",
        "| scenario | what is timed | runs (s) | median (s) | pull (s) | × overlayfs | link bytes (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, scenario in scenarios.items():
        baseline = seconds["overlay-local" if name.endswith("local") else "overlay-cold"]
        ratio = seconds[name] / baseline if seconds[name] and baseline else None
        runs = ", ".join(f"{r.seconds:.2f}" for r in scenario.runs) or "—"
        lines.append(
            f"| {name} | {SCENARIOS[name]} | {runs} | {_f(seconds[name])} | "
            f"{_f(scenario.median(lambda r: r.pull_seconds))} | {_f(ratio)} | "
            f"{_f(scenario.median(lambda r: r.link_bytes / MB), '.1f')} |")
    lazy = scenarios["lazy-cold"]
    read = lazy.median(lambda r: _read_bytes(r) or 0.0) if any(_read_bytes(r) for r in lazy.runs) else None
    fetched = lazy.median(lambda r: _fetched_bytes(r) or 0.0) if lazy.runs else None
    def median_of(key: str) -> float | None:
        values = [r.server[key] for r in lazy.runs if key in r.server]
        return statistics.median(values) if values else None

    lines += ["", "## Bytes (lazy cold start, medians)", "",
              "| figure | MB |", "|---|---|",
              f"| crossed the link (registry + store; host end's interface counters) | {_f(fetched and fetched / MB, '.1f')} |",
              f"| fetched from the store (layer server: range requests, gaps included) "
              f"| {_f(median_of('store.bytes_fetched') and median_of('store.bytes_fetched') / MB, '.1f')} |",
              f"| of which blocks the reads needed (compressed) "
              f"| {_f(median_of('store.blocks.bytes_fetched') and median_of('store.blocks.bytes_fetched') / MB, '.1f')} |",
              f"| read by the start-up: raw bytes of the {_f(median_of('store.blocks.blocks_fetched'), '.0f')} "
              f"distinct blocks it touched (node cache growth) | {_f(read and read / MB, '.1f')} |",
              f"| whole image, gzip (what overlayfs pulls) | {image.compressed_bytes / MB:.1f} |",
              f"| whole image, unpacked | {image.unpacked_bytes / MB:.1f} |"]
    if lazy.runs:
        keys = sorted({k for r in lazy.runs for k in r.server})
        if keys:
            lines += ["", "Layer server figures per lazy cold run (deltas over the run):", "",
                      "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(lazy.runs))) + " |",
                      "|---|" + "---|" * len(lazy.runs)]
            for key in keys:
                lines.append(f"| {key} | " + " | ".join(f"{r.server.get(key, 0):.0f}" for r in lazy.runs) + " |")

    def check(label: str, value: float | None, target: float, unit: str = "×") -> str:
        if value is None:
            return f"| {label} | ≤ {target:g}{unit} | — | not measured |"
        return f"| {label} | ≤ {target:g}{unit} | {value:.2f}{unit} | {'met' if value <= target else 'MISSED'} |"

    cold_ratio = seconds["lazy-cold"] / seconds["overlay-cold"] if seconds["lazy-cold"] and seconds["overlay-cold"] else None
    local_ratio = (seconds["lazy-local"] / seconds["overlay-local"]
                   if seconds["lazy-local"] and seconds["overlay-local"] else None)
    fetch_ratio = fetched / read if read and fetched else None
    lines += ["", "## Targets", "", "| target | wanted | measured | |", "|---|---|---|---|",
              check("lazy cold start / overlayfs cold start", cold_ratio, TARGET_COLD_RATIO),
              check("bytes fetched / bytes read (lazy cold)", fetch_ratio, TARGET_FETCH_OVER_READ),
              check("lazy local start / overlayfs local start", local_ratio, TARGET_LOCAL_RATIO)]
    if context.get("convert_seconds") is not None:
        lines += ["", f"`bootseer convert` of the image took {context['convert_seconds']:.1f} s (once; cached after)."]
    errors = [f"- {name}: {e}" for name, s in scenarios.items() for e in s.errors]
    if errors:
        lines += ["", "## Failures", "", *errors]
    if context.get("notes"):
        lines += ["", "## Notes", "", *[f"- {n}" for n in context["notes"]]]
    return "\n".join(lines) + "\n"


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
    scenarios = {name: Scenario(name) for name in SCENARIOS}
    context: dict[str, Any] = {"notes": []}
    kinds = [k for k in ("overlay", "lazy") if k in args.modes]
    with contextlib.ExitStack() as servers:
        link = servers.enter_context(netns.ShapedLink(args.rate))
        log(f"link {link.client_ip} -> {link.server_ip} (namespace {link.name}), tbf {args.rate}")
        registry = servers.enter_context(NetnsRegistry(link, args.cache_dir / "registry", work / "registry"))
        ref = registry.push(image)
        context["link_rate"] = measure_link(link, registry, image)
        log(f"pushed {ref}; one GET across the link: {context['link_rate']:.1f} MB/s")
        store_url = None
        if "lazy" in kinds:
            try:
                context["convert_seconds"] = convert_store(image, args.cache_dir / "store", work / "convert.log")
                nginx = servers.enter_context(Nginx(args.cache_dir / "store", work / "nginx", STORE_PORT,
                                                    host=link.server_ip, launcher=link.launcher()))
                store_url = nginx.url
            except (BenchError, RuntimeError) as e:
                kinds.remove("lazy")
                for name in ("lazy-cold", "lazy-local"):
                    scenarios[name].errors.append(f"store not ready: {e}")
                log(f"lazy path not measured: {e}")
        for rep in range(1, args.reps + 1):
            for kind in kinds:
                measure_node(kind, rep, work, link, ref, store_url, scenarios, args.timeout)
        context["tc"] = link.describe()
    context["wall"] = time.monotonic() - started
    return image, scenarios, context


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="cold runs per scenario (3)")
    parser.add_argument("--rate", default="1gbit", help="the link's rate each way, in tc's syntax (1gbit)")
    parser.add_argument("--cache-dir", type=Path, default=image_build.DEFAULT_CACHE_DIR,
                        help=f"image, registry storage and store, kept across runs ({image_build.DEFAULT_CACHE_DIR})")
    parser.add_argument("--modes", default="overlay,lazy", help="overlay, lazy or both (overlay,lazy)")
    parser.add_argument("--jobs", type=int, default=2, help="gzip threads when building the image (2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one pull or run may take (600)")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "results" / "lazy.md",
                        help="Markdown results (bench/results/lazy.md)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - {"overlay", "lazy"}:
        parser.error("--modes takes overlay, lazy or overlay,lazy")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    args.cache_dir = args.cache_dir.resolve()
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("error: the benchmark needs root (network namespace, tc, containerd, mounts)")
    missing = [tool for tool in ("containerd", "ctr", "runc", "docker-registry", "skopeo", "nginx", "ip", "tc",
                                 "debootstrap", "pigz") if not shutil.which(tool)]
    if missing:
        sys.exit(f"error: missing {', '.join(missing)} (run ctr_examples/install-deps.sh)")
    # SIGTERM and SIGHUP unwind like Ctrl-C, so every context manager tears its part down.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        image, scenarios, context = run_benchmark(args)
    except (image_build.BuildError, BenchError, harness.HarnessError, netns.NetnsError) as e:
        sys.exit(f"error: {e}")
    text = report(args, image, scenarios, context)
    print("\n" + text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    log(f"written to {args.output}")
    return 1 if any(s.errors for s in scenarios.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
