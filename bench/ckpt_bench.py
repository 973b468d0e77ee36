"""Benchmark of the striped checkpoint mount against one plain HTTP stream.

A multi-GB random checkpoint and a safetensors checkpoint are served by nginx on
127.0.0.1, with every connection capped at ``--conn-rate`` and all of them together
at ``--aggregate-rate`` (kernel shaping in a private network namespace, see
``netcap.py`` for why not nginx's ``limit_rate``).  Measured, each ``--reps`` times:

* ``http-stream``: one plain sequential GET (the first ``--baseline-seconds`` worth);
* ``mount``: ``bootseer ckpt mount``, then a sequential read of the whole file (a
  fresh mount per repetition, so no page cache serves it);
* ``mmap-walk``: the same file mmapped and copied out in order (page-fault reads,
  as ``safetensors`` and ``torch.load(mmap=True)`` read);
* ``api-read-bytes`` and ``api-open-read``: the Python API, whole file;
* ``st-mount``, ``st-api``, ``st-plain``: loading the safetensors checkpoint from
  the mount, through ``read_bytes``, and by one-stream download then load.

Every read is checked against the digest taken when the data was written.  Results
(each run, medians, ratios to the aggregate cap and to the single stream measured in
the same run) go to stdout and to ``--output`` as Markdown.  Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from bootseer.units import parse_size

from bench import netcap
from bench.common import fmt, machine
from bench.readers import tensors_digest
from tests.support.nginx import Nginx

BENCH_DIR = Path(__file__).resolve().parent
READERS = BENCH_DIR / "readers.py"
MB = 1_000_000  # rates are in decimal megabytes per second, as tc and curl count them
MiB = 1 << 20
GiB = 1 << 30
DATA_NAME = "ckpt.bin"
ST_NAME = "model.safetensors"
SERVER_PORT = 8080  # the namespace is private: nothing else listens there


@dataclass
class Method:
    name: str
    description: str
    runs: list[dict[str, Any]] = field(default_factory=list)  #: {"bytes", "seconds", "digest"} per repetition
    errors: list[str] = field(default_factory=list)
    verified: bool = False  #: every run's digest matched

    def median_seconds(self) -> float | None:
        return statistics.median(r["seconds"] for r in self.runs) if self.runs else None

    def median_rate(self) -> float | None:
        """Median throughput in bytes per second."""
        return statistics.median(r["bytes"] / r["seconds"] for r in self.runs) if self.runs else None


# ---------------------------------------------------------------------------
# Data


def _write_random(path: Path, size: int, seed: int) -> str:
    """Write ``size`` random bytes (incompressible, not sparse); returns their digest."""
    import numpy as np
    import xxhash

    rng = np.random.default_rng(seed)
    digest = xxhash.xxh3_128()
    with open(path, "wb") as file:
        left = size
        while left:
            block = rng.bytes(min(left, 64 * MiB))
            file.write(block)
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _model_shapes(target: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Tensors of a decoder-only transformer (LLaMA-like layout) of about ``target`` bytes."""
    hidden, ffn, vocab = (2048, 5504, 32000) if target >= 512 * MiB else (512, 1376, 8000)
    shapes: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "float16")]
    layer = [
        ("self_attn.q_proj.weight", (hidden, hidden), "float16"),
        ("self_attn.k_proj.weight", (hidden, hidden), "float16"),
        ("self_attn.v_proj.weight", (hidden, hidden), "float16"),
        ("self_attn.o_proj.weight", (hidden, hidden), "float16"),
        ("mlp.gate_proj.weight", (ffn, hidden), "float16"),
        ("mlp.up_proj.weight", (ffn, hidden), "float16"),
        ("mlp.down_proj.weight", (hidden, ffn), "float16"),
        ("input_layernorm.weight", (hidden,), "float32"),
        ("post_attention_layernorm.weight", (hidden,), "float32"),
        ("self_attn.rotary_emb.inv_freq", (hidden // 32,), "float32"),
    ]
    per_layer = sum(_nbytes(s, d) for _, s, d in layer)
    fixed = 2 * vocab * hidden * 2 + hidden * 4
    for index in range(max(1, (target - fixed) // per_layer)):
        shapes += [(f"model.layers.{index}.{name}", shape, dtype) for name, shape, dtype in layer]
    shapes += [("model.norm.weight", (hidden,), "float32"), ("lm_head.weight", (vocab, hidden), "float16")]
    shapes.append(("optimizer.step", (1,), "int64"))
    return shapes


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    import numpy as np

    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def _write_safetensors(path: Path, target: int, seed: int) -> tuple[str, int, int]:
    """Write a random checkpoint of about ``target`` bytes; returns (digest, tensors, bytes)."""
    import numpy as np
    import safetensors.numpy

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape, dtype in _model_shapes(target):
        # Random bits, not random numbers: as incompressible as real weights, and
        # the equality check is on bits (NaN patterns included).
        tensors[name] = np.frombuffer(rng.bytes(_nbytes(shape, dtype)), dtype=dtype).reshape(shape)
    safetensors.numpy.save_file(tensors, str(path))
    return tensors_digest(tensors), len(tensors), sum(a.nbytes for a in tensors.values())


def prepare_data(www: Path, size: int, st_size: int) -> dict[str, Any]:
    """Create (or reuse, when a kept work dir already holds them) the two checkpoints."""
    manifest_path = www.parent / "manifest.json"
    wanted = {"size": size, "st_target": st_size, "seed": 20240611}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if {k: manifest.get(k) for k in wanted} == wanted and (www / DATA_NAME).stat().st_size == size:
            print(f"reusing the data in {www}", flush=True)
            return manifest
    www.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"writing {size / GiB:.2f} GiB of random data and a {st_size / GiB:.2f} GiB safetensors checkpoint...",
          flush=True)
    digest = _write_random(www / DATA_NAME, size, wanted["seed"])
    st_digest, st_tensors, st_bytes = _write_safetensors(www / ST_NAME, st_size, wanted["seed"] + 1)
    for path in www.iterdir():
        path.chmod(0o644)  # nginx's unprivileged worker reads them (safetensors writes 0600)
    manifest = {**wanted, "digest": digest, "st_digest": st_digest, "st_tensors": st_tensors,
                "st_tensor_bytes": st_bytes, "st_file_size": (www / ST_NAME).stat().st_size}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    print(f"  done in {time.monotonic() - start:.1f} s", flush=True)
    return manifest


def prefix_digest(path: Path, length: int) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        left = length
        while left:
            block = file.read(min(left, 16 * MiB))
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Running readers and mounts


def run_reader(*args: str, timeout: float) -> dict[str, Any]:
    """Run ``readers.py ARGS`` in a fresh process; its JSON result."""
    result = subprocess.run([sys.executable, str(READERS), *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"readers.py {args[0]} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def striped_mount(url: str, mountpoint: Path, log_path: Path, options: list[str]) -> Iterator[float]:
    """``bootseer ckpt mount URL MOUNTPOINT``; yields the seconds it took to be ready."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bootseer.cli", "ckpt", "mount", url, str(mountpoint), *options]
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if process.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {process.returncode}" if process.returncode is not None else "not ready in 30 s"
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"bootseer ckpt mount {why}: " + " | ".join(tail))
            time.sleep(0.01)
        yield time.perf_counter() - start
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the mount's clean unmount
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


# ---------------------------------------------------------------------------
# The benchmark


def measure(method: Method, reps: int, once: Any, expected: str) -> None:
    """Run ``once()`` ``reps`` times into ``method``; a failure is recorded, not raised."""
    for rep in range(reps):
        try:
            run = once()
        except Exception as exc:  # noqa: BLE001 - a broken method must not hide the others' numbers
            method.errors.append(f"run {rep + 1}: {exc}")
            print(f"  {method.name:15} run {rep + 1}: FAILED: {exc}", flush=True)
            continue
        run["ok"] = run["digest"] == expected
        method.runs.append(run)
        extra = "" if run["ok"] else "  DIGEST MISMATCH"
        print(f"  {method.name:15} run {rep + 1}: {run['bytes'] / MiB:9.1f} MiB in {run['seconds']:7.2f} s"
              f" = {run['bytes'] / run['seconds'] / MB:7.1f} MB/s{extra}", flush=True)
    method.verified = bool(method.runs) and all(r["ok"] for r in method.runs)


def run_benchmark(args: argparse.Namespace, work: Path) -> tuple[dict[str, Method], dict[str, Any]]:
    www = work / "www"
    manifest = prepare_data(www, args.size, args.st_size)
    data_path, st_path = www / DATA_NAME, www / ST_NAME
    netcap.apply_caps(args.conn_rate * MB, args.aggregate_rate * MB, SERVER_PORT)
    engine_args = ["--streams", str(args.streams), "--stripe-size", str(args.stripe_size),
                   "--readahead-max", str(args.readahead_max)]
    mount_options = [*engine_args, *args.mount_option]
    baseline_bytes = min(args.size, int(args.baseline_seconds * args.conn_rate * MB))
    baseline_digest = prefix_digest(data_path, baseline_bytes)
    # Generous timeouts: a run at a tenth of the per-connection cap still finishes.
    slow = lambda nbytes: 60 + 10 * nbytes / (args.conn_rate * MB)  # noqa: E731

    methods = {m.name: m for m in [
        Method("http-stream", f"one plain GET, first {baseline_bytes / MiB:.0f} MiB (http.client)"),
        Method("mount", "bootseer ckpt mount + sequential read (1 MiB reads)"),
        Method("mmap-walk", "bootseer ckpt mount + mmap of the file, copied out in order (1 MiB at a time)"),
        Method("api-read-bytes", "bootseer.fetch.read_bytes(url)"),
        Method("api-open-read", "bootseer.fetch.open(url).read(1 MiB) loop"),
        Method("st-plain", "one-stream download, then safetensors.numpy.load"),
        Method("st-mount", "safetensors.numpy.load_file from the mount (mmap, its default)"),
        Method("st-mount-pread", "safetensors.numpy.load_file(backend='pread') from the mount"),
        Method("st-mount-read", "one read() of the file in the mount, then safetensors.numpy.load"),
        Method("st-api", "safetensors.numpy.load(bootseer.fetch.read_bytes(url))"),
    ] if m.name in args.methods}
    mount_ready: list[float] = []

    with Nginx(www, work / "nginx", SERVER_PORT) as server:
        data_url, st_url = server.url + DATA_NAME, server.url + ST_NAME

        def mounted_read(path_in_mount: str, reader: str, *options: str) -> dict[str, Any]:
            mountpoint = work / "mnt"
            with striped_mount(server.url, mountpoint, work / "mount.log", mount_options) as ready:
                mount_ready.append(ready)
                return run_reader(reader, str(mountpoint / path_in_mount), *options, timeout=slow(args.size))

        plan = {
            "http-stream": (lambda: run_reader("http-stream", data_url, "--limit", str(baseline_bytes),
                                               timeout=slow(baseline_bytes)), baseline_digest),
            "mount": (lambda: mounted_read(DATA_NAME, "file-read"), manifest["digest"]),
            "mmap-walk": (lambda: mounted_read(DATA_NAME, "mmap-walk"), manifest["digest"]),
            "api-read-bytes": (lambda: run_reader("api-read-bytes", data_url, *engine_args,
                                                  timeout=slow(args.size)), manifest["digest"]),
            "api-open-read": (lambda: run_reader("api-open-read", data_url, *engine_args,
                                                 timeout=slow(args.size)), manifest["digest"]),
            "st-plain": (lambda: run_reader("st-load-plain", st_url, timeout=slow(args.st_size) * 1.5),
                         manifest["st_digest"]),
            "st-mount": (lambda: mounted_read(ST_NAME, "st-load-file"), manifest["st_digest"]),
            "st-mount-pread": (lambda: mounted_read(ST_NAME, "st-load-file", "--backend", "pread"),
                               manifest["st_digest"]),
            "st-mount-read": (lambda: mounted_read(ST_NAME, "st-read-load"), manifest["st_digest"]),
            "st-api": (lambda: run_reader("st-load-api", st_url, *engine_args, timeout=slow(args.st_size)),
                       manifest["st_digest"]),
        }
        print(f"caps: {args.conn_rate:g} MB/s per connection, {args.aggregate_rate:g} MB/s in all; "
              f"{args.reps} repetitions", flush=True)
        for name, method in methods.items():
            once, expected = plan[name]
            measure(method, args.plain_reps if name == "st-plain" else args.reps, once, expected)
    context = {"manifest": manifest, "baseline_bytes": baseline_bytes, "mount_ready": mount_ready,
               "tc": netcap.describe_caps()}
    return methods, context


# ---------------------------------------------------------------------------
# Report


def _machine() -> str:
    """The machine measured (:func:`bench.common.machine`) and the nginx that served the checkpoints."""
    nginx = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip().replace("nginx version: ", "")
    return f"{machine()}, {nginx}"


def report(args: argparse.Namespace, methods: dict[str, Method], context: dict[str, Any], wall: float) -> str:
    cap = args.aggregate_rate * MB
    single = methods["http-stream"].median_rate() if "http-stream" in methods else None
    manifest = context["manifest"]
    lines = [
        "# Striped checkpoint mount: benchmark results",
        "",
        f"- Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- Machine: {_machine()}",
        f"- Command: `{shlex.join(['python', '-m', 'bench.ckpt_bench', *sys.argv[1:]])}`",
        f"- Server: nginx (sendfile, Range, keep-alive) on 127.0.0.1 in a private network namespace; "
        f"**{args.conn_rate:g} MB/s per connection, {args.aggregate_rate:g} MB/s aggregate** "
        f"(kernel HTB on the namespace's loopback; 1 MB = 10⁶ bytes)",
        f"- Engine: {args.streams} streams, {args.stripe_size / MiB:g} MiB stripes, "
        f"{args.readahead_max / MiB:g} MiB read-ahead max" + (f"; mount options {' '.join(args.mount_option)}"
                                                            if args.mount_option else ""),
        f"- Data: {DATA_NAME} {args.size / GiB:.2f} GiB random; {ST_NAME} {manifest['st_file_size'] / GiB:.2f} GiB, "
        f"{manifest['st_tensors']} tensors (float16/float32/int64, LLaMA-like layout)",
        f"- Repetitions: {args.reps} (st-plain: {args.plain_reps}); every run's bytes checked against the digest "
        f"taken when the data was written; total wall time {wall / 60:.1f} min",
        "",
        "## Throughput (whole file, sequential)",
        "",
        "| method | what | runs (MB/s) | median MB/s | × aggregate cap | × one stream | bytes verified |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("http-stream", "mount", "mmap-walk", "api-read-bytes", "api-open-read"):
        if name not in methods:
            continue
        m = methods[name]
        rate = m.median_rate()
        runs = ", ".join(f"{r['bytes'] / r['seconds'] / MB:.1f}" for r in m.runs) or "—"
        lines.append(
            f"| {name} | {m.description} | {runs} | {fmt(rate and rate / MB, '.1f')} | "
            f"{fmt(rate and rate / cap, '.2f')} | {fmt(rate and single and rate / single, '.1f')} | "
            f"{'yes' if m.verified else 'NO'} |"
        )
    lines += [
        "",
        "## Loading a safetensors checkpoint",
        "",
        "| method | what | runs (s) | median s | effective MB/s | speed-up vs st-plain | tensors equal |",
        "|---|---|---|---|---|---|---|",
    ]
    plain = methods["st-plain"].median_seconds() if "st-plain" in methods else None
    for name in ("st-plain", "st-mount", "st-mount-pread", "st-mount-read", "st-api"):
        if name not in methods:
            continue
        m = methods[name]
        seconds = m.median_seconds()
        runs = ", ".join(f"{r['seconds']:.2f}" for r in m.runs) or "—"
        lines.append(
            f"| {name} | {m.description} | {runs} | {fmt(seconds, '.2f')} | "
            f"{fmt(seconds and manifest['st_file_size'] / seconds / MB, '.1f')} | "
            f"{fmt(seconds and plain and plain / seconds, '.1f')} | {'yes' if m.verified else 'NO'} |"
        )
    if context["mount_ready"]:
        lines += ["", f"Mount start-up (process start to mounted), median of all {len(context['mount_ready'])} mounts: "
                      f"{statistics.median(context['mount_ready']):.2f} s (not included in the times above)."]
    errors = [f"- {name}: {e}" for name, m in methods.items() for e in m.errors]
    if errors:
        lines += ["", "## Failures", "", *errors]
    lines += ["", "## Closing note (medians)", "", closing_note(args, methods, context)]
    return "\n".join(lines) + "\n"


def closing_note(args: argparse.Namespace, methods: dict[str, Method], context: dict[str, Any]) -> str:
    cap = args.aggregate_rate * MB
    parts = []
    single = methods.get("http-stream") and methods["http-stream"].median_rate()
    if single:
        parts.append(f"one plain stream reads {single / MB:.1f} MB/s ({single / cap:.2f} of the {args.aggregate_rate:g} "
                     f"MB/s aggregate cap)")
    for name, label in (("mount", "the striped mount"), ("mmap-walk", "an mmap walk through the mount"),
                        ("api-read-bytes", "read_bytes"),
                        ("api-open-read", "open().read()")):
        rate = methods.get(name) and methods[name].median_rate()
        if rate:
            vs = f", {rate / single:.1f}× one stream" if single else ""
            parts.append(f"{label} {rate / MB:.1f} MB/s ({rate / cap:.2f} of the cap{vs})")
    plain = methods.get("st-plain") and methods["st-plain"].median_seconds()
    for name, label in (("st-plain", "plain download+load"), ("st-mount", "load_file from the mount"),
                        ("st-mount-pread", "load_file(backend='pread') from the mount"),
                        ("st-mount-read", "read from the mount + load"),
                        ("st-api", "load via read_bytes")):
        seconds = methods.get(name) and methods[name].median_seconds()
        if seconds:
            vs = f" ({plain / seconds:.1f}× faster)" if plain and name != "st-plain" else ""
            parts.append(f"safetensors {label} {seconds:.2f} s{vs}")
    mmap, pread = (methods.get(n) and methods[n].median_seconds() for n in ("st-mount", "st-mount-pread"))
    if mmap and pread:
        parts.append(f"through the mount, safetensors' default mmap loading takes {mmap / pread:.1f}× as long as "
                     f"its pread loading")
    bad = [name for name, m in methods.items() if m.runs and not m.verified]
    verdict = "All bytes verified." if not bad else f"DIGEST MISMATCH in: {', '.join(bad)}."
    return "; ".join(parts) + ". " + verdict


# ---------------------------------------------------------------------------
# Command line


ALL_METHODS = ("http-stream", "mount", "mmap-walk", "api-read-bytes", "api-open-read",
               "st-plain", "st-mount", "st-mount-pread", "st-mount-read", "st-api")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Sizes: 2G, 512M, 64K (powers of 1024). Rates: decimal MB/s. Needs root (network namespace + tc).",
    )
    parser.add_argument("--size", type=parse_size, default=2 * GiB, help="random checkpoint size (2G)")
    parser.add_argument("--st-size", type=parse_size, default=1 * GiB, help="safetensors checkpoint size (1G)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per method (3)")
    parser.add_argument("--plain-reps", type=int, help="repetitions of st-plain, the slow one (--reps)")
    parser.add_argument("--conn-rate", type=float, default=12.0, help="cap per connection, MB/s (12)")
    parser.add_argument("--streams", type=int, default=16, help="engine streams (16)")
    parser.add_argument("--aggregate-rate", type=float, help="server's aggregate cap, MB/s (conn-rate × streams)")
    parser.add_argument("--stripe-size", type=parse_size, default=8 * MiB, help="engine stripe size (8M)")
    parser.add_argument("--readahead-max", type=parse_size, default=256 * MiB, help="engine read-ahead max (256M)")
    parser.add_argument("--mount-option", action="append", default=[], metavar="OPT",
                        help="extra option for bootseer ckpt mount (repeatable, e.g. --mount-option=--memory-limit=2G)")
    parser.add_argument("--baseline-seconds", type=float, default=5.0,
                        help="read this many seconds' worth (at the cap) in the one-stream baseline (5)")
    parser.add_argument("--methods", default=",".join(ALL_METHODS),
                        help=f"comma-separated subset of {','.join(ALL_METHODS)}")
    parser.add_argument("--workdir", type=Path, help="where the data lives (default: a new dir under /var/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (its data is reused next time)")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "results" / "ckpt.md",
                        help="Markdown results file (bench/results/ckpt.md)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test of the harness: 256 MiB data, 64 MiB safetensors, 1 repetition, "
                             "output to $TMPDIR/bootseer-ckpt-quick.md")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        defaults = {"size": 2 * GiB, "st_size": 1 * GiB, "reps": 3, "baseline_seconds": 5.0}
        quick = {"size": 256 * MiB, "st_size": 64 * MiB, "reps": 1, "baseline_seconds": 2.0}
        for key, value in quick.items():
            if getattr(args, key) == defaults[key]:  # an explicit option wins
                setattr(args, key, value)
        if args.output == parser.get_default("output"):
            args.output = Path(tempfile.gettempdir()) / "bootseer-ckpt-quick.md"  # a smoke test is no result
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(ALL_METHODS)
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if args.aggregate_rate is None:
        args.aggregate_rate = args.conn_rate * args.streams
    if args.plain_reps is None:
        args.plain_reps = args.reps
    for name in ("reps", "plain_reps", "streams"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.conn_rate <= 0 or args.aggregate_rate < args.conn_rate:
        parser.error("rates must be positive, the aggregate at least one connection's")
    if args.size < args.stripe_size or args.st_size < 16 * MiB:
        parser.error("--size must hold a stripe and --st-size be at least 16M")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before re-exec, so --help and bad options need no root
    if not netcap.in_private_netns():
        netcap.reexec_in_private_netns()
    if not shutil.which("nginx"):
        sys.exit("error: nginx not found (apt-get install nginx-light)")
    created = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="bootseer-bench-", dir="/var/tmp")) if created else args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)  # nginx's worker runs as an unprivileged user and must reach www/
    start = time.monotonic()
    try:
        methods, context = run_benchmark(args, work)
        text = report(args, methods, context, time.monotonic() - start)
        print("\n" + text)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"written to {args.output}")
        failed = any(m.errors or not m.verified for m in methods.values())
        return 1 if failed else 0
    finally:
        mountpoint = work / "mnt"
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        if args.keep:
            print(f"kept {work}")
        elif created:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for name in ("www", "nginx", "mnt", "manifest.json", "mount.log"):
                path = work / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
