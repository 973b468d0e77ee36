"""Dependency snapshots against installing: time from the start of the step until the imports have returned.

    .venv/bin/python bench/deps_bench.py [--reps 3] [--workdir /var/tmp/deps-bench] [--wheels DIR]

Needs root (drops the page cache, mounts overlayfs and FUSE).  The requirement set: the CPU build of
torch 2.13.0, numpy, transformers and a dozen pure-Python packages with their dependencies, from a local
wheel directory (``pip download`` once into ``WORKDIR/wheels``; no index is used while measuring).  Every
mode installs into (or restores) the same ``--target`` directory and then runs
``python -c "import torch, numpy, transformers"`` with it on ``PYTHONPATH``; the page cache is dropped
before every run; medians of ``--reps``.  The snapshot is captured once into ``WORKDIR/store``, which
nginx serves from inside a network namespace behind a veth pair shaped to ``--rate`` (``netns.py``,
``nginx.py``: the lazy-layers benchmark's link), so a hit on a fresh node reads every block across it.

| mode | what is timed |
|---|---|
| local | the imports alone, from a tree pip installed (with bytecode): the floor |
| pip-cold | ``pip install --no-cache-dir --target DIR -r req.txt``, then the imports |
| uv-cold | ``uv pip install --target DIR -r req.txt`` with an empty cache, then the imports (uv's default: no bytecode) |
| uv-warm | the same with the cache of an earlier run (hard links from it) |
| bootseer-hit | ``bootseer deps run --prefix DIR --store http://NS:8080/ --root NEW -- pip install ...`` on a fresh node root (empty block cache, no layer server yet), then the imports through overlayfs over the FUSE layer server; the store holds no hot list, so every block is read on demand; the restore alone (``deps run``) is reported too |
| bootseer-hot | the same against a copy of the store (``WORKDIR/store-hot``, hard links, served on port 8081) that holds the deps layer's hot list, recorded once before the runs by a first hit on a fresh node (its imports, then ``deps release``, which seals and publishes the list with ``--publish-store``): the restore starts the prefetch |

Writes ``bench/results/deps.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
from nginx import Nginx  # noqa: E402

from bootseer.blockstore.control import LayerServerClient, LayerServerError, ServerPaths  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent
REQUIREMENTS = ["torch==2.13.0", "numpy", "transformers", "requests", "pyyaml", "tqdm", "click", "rich", "packaging",
                "jinja2", "filelock", "fsspec", "attrs", "python-dateutil", "six", "tabulate", "typing-extensions"]
IMPORTS = "import torch, numpy, transformers"
STORE_PORT = 8080
HOT_STORE_PORT = 8081


def env() -> dict[str, str]:
    return {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "PIP_CONFIG_FILE": os.devnull, "UV_NO_CONFIG": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "LANG": "C.UTF-8"}  # fmt: skip


def sh(argv: list[str], **extra: str) -> float:
    started = time.monotonic()
    done = subprocess.run(argv, env={**env(), **extra}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:6]}... failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.monotonic() - started


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def imports(target: Path) -> float:
    return sh([PYTHON, "-c", IMPORTS], PYTHONPATH=str(target))


def remove(path: Path) -> None:
    if path.exists():
        subprocess.run(["rm", "-rf", str(path)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/deps-bench"))
    parser.add_argument("--wheels", type=Path, help="a wheel directory holding the set (default WORKDIR/wheels, downloaded once)")
    parser.add_argument("--modes", default="local,pip-cold,uv-cold,uv-warm,bootseer-hit,bootseer-hot")
    parser.add_argument("--rate", default="1gbit", help="the store link's rate (tc syntax)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "deps.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("deps_bench: run as root (drop_caches, overlayfs, FUSE)")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    wheels = args.wheels or work / "wheels"
    if not any(wheels.glob("transformers-*.whl")):
        print(f"downloading the wheel set into {wheels} (once)", flush=True)
        subprocess.run([PYTHON, "-m", "pip", "download", "-q", "-d", str(wheels), "-f", str(wheels), *REQUIREMENTS],
                       check=True)  # fmt: skip
    (work / "req.txt").write_text("\n".join(REQUIREMENTS) + "\n")
    target = work / "env"
    store, node = work / "store", work / "node"
    pip = [PYTHON, "-m", "pip", "install", "-q", "--no-cache-dir", "--no-index", "-f", str(wheels), "--target",
           str(target), "-r", str(work / "req.txt")]  # fmt: skip
    uv = [str(BIN / "uv"), "pip", "install", "-q", "--python", PYTHON, "--no-index", "-f", str(wheels), "--target",
          str(target), "-r", str(work / "req.txt")]  # fmt: skip
    deps = [PYTHON, "-m", "bootseer.cli", "deps"]

    def release(root: Path) -> None:
        subprocess.run([*deps, "release", str(target), "--root", str(root)], env=env(), capture_output=True)
        client = LayerServerClient(ServerPaths(root).socket)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a recording the release sealed is published before the server goes
            try:
                if not client.call({"op": "hotlist.status"})["recordings"]:
                    break
            except LayerServerError:
                break
            time.sleep(0.2)
        try:
            client.shutdown()
        except LayerServerError:
            pass
        time.sleep(1)
        remove(root)

    # The snapshot, captured once (timed: what a first run costs on top of its install).
    for path in (target, store, node):
        remove(path)
    capture_s = sh([*deps, "run", "--prefix", str(target), "--store", str(store), "--root", str(node), "--", *pip])
    installed_bytes = int(subprocess.run(["du", "-sb", str(target)], capture_output=True, text=True).stdout.split()[0])
    release(node)

    for path in (work, store):
        path.chmod(0o755)  # nginx's worker (www-data) must reach the store
    subprocess.run(["chmod", "-R", "a+rX", str(store)], check=True)
    hot_store = work / "store-hot"  # the store and, once recorded, the deps layer's hot list
    remove(hot_store)
    subprocess.run(["cp", "-al", str(store), str(hot_store)], check=True)
    (hot_store / "v1" / "hotlists").mkdir(exist_ok=True)
    load_before = os.getloadavg()
    with netns.ShapedLink(args.rate) as link, \
            Nginx(store, work / "nginx", STORE_PORT, host=link.server_ip, launcher=link.launcher()) as nginx, \
            Nginx(hot_store, work / "nginx-hot", HOT_STORE_PORT, host=link.server_ip, launcher=link.launcher()) as hot:
        recorded = {}
        if "bootseer-hot" in args.modes.split(","):
            recorded = record_hot_list(work, target, hot.url, hot_store, pip, deps, release)
        results, restores, link_bytes, prefetches = measure(args, work, target, {"bootseer-hit": nginx.url,
                                                            "bootseer-hot": hot.url}, link, pip, uv, deps, release)  # fmt: skip
    load_after = os.getloadavg()
    return report(args, wheels, installed_bytes, capture_s, results, restores, link_bytes, load_before, load_after,
                  recorded, prefetches)  # fmt: skip


def record_hot_list(work: Path, target: Path, store_url: str, hot_store: Path, pip: list[str], deps: list[str],
                    release) -> dict:  # fmt: skip
    """The first hit on a fresh node, which records the deps layer's hot list into ``hot_store``; its summary."""
    node = work / "node-record"
    remove(target)
    remove(node)
    drop_caches()
    sh([*deps, "run", "--prefix", str(target), "--store", store_url, "--publish-store", str(hot_store), "--root",
        str(node), "--", *pip])  # fmt: skip
    seconds = imports(target)
    client = LayerServerClient(ServerPaths(node).socket)
    subprocess.run([*deps, "release", str(target), "--root", str(node)], env=env(), capture_output=True, check=True)
    summary: dict = {}
    deadline = time.monotonic() + 60
    while not summary and time.monotonic() < deadline:
        done = [s for s in client.call({"op": "hotlist.status"})["finished"] if s.get("kind") == "recording"]
        summary = done[-1] if done else {}
        time.sleep(0.2)
    release(node)
    if summary.get("outcome") != "published":
        raise SystemExit(f"the recording hit did not publish a hot list: {summary}")
    subprocess.run(["chmod", "-R", "a+rX", str(hot_store / "v1" / "hotlists")], check=True)
    print(f"hot list recorded: {summary['blocks']} blocks, {summary['bytes'] / 2**20:.0f} MiB, sealed by "
          f"{summary['sealed_by']} (the recording hit's imports took {seconds:.2f} s)", flush=True)
    return {**summary, "imports_s": seconds}


def measure(args: argparse.Namespace, work: Path, target: Path, store_urls: dict[str, str], link: netns.ShapedLink,
            pip: list[str], uv: list[str], deps: list[str], release) -> tuple:  # fmt: skip
    """Every mode ``--reps`` times; the seconds per mode, the hits' restore times and bytes across the link
    (per hit mode), and the hot runs' prefetch figures."""
    results: dict[str, list[float]] = {}
    restores: dict[str, list[float]] = {}
    link_bytes: dict[str, list[int]] = {}
    prefetches: list[dict] = []
    modes = args.modes.split(",")
    for rep in range(args.reps):
        for mode in modes:
            if mode == "local":
                if not (target / "torch").exists() or os.path.ismount(target):
                    remove(target)
                    sh(pip)
                drop_caches()
                seconds = imports(target)
            elif mode == "pip-cold":
                remove(target)
                drop_caches()
                seconds = sh(pip) + imports(target)
            elif mode in ("uv-cold", "uv-warm"):
                cache = work / "uv-cache"
                if mode == "uv-cold":
                    remove(cache)
                elif not cache.exists():
                    remove(target)
                    sh(uv, UV_CACHE_DIR=str(cache))  # warm it
                remove(target)
                drop_caches()
                seconds = sh(uv, UV_CACHE_DIR=str(cache)) + imports(target)
            elif mode in ("bootseer-hit", "bootseer-hot"):
                remove(target)
                fresh = work / f"node-{rep}"
                remove(fresh)
                drop_caches()
                before = link.counters()
                restore_s = sh([*deps, "run", "--prefix", str(target), "--store", store_urls[mode], "--root",
                                str(fresh), "--", *pip])  # fmt: skip
                if not os.path.ismount(target):
                    raise SystemExit(f"bootseer deps run did not restore {target} from {store_urls[mode]} (a miss?)")
                seconds = restore_s + imports(target)
                link_bytes.setdefault(mode, []).append((link.counters() - before).received)
                restores.setdefault(mode, []).append(restore_s)
                if mode == "bootseer-hot":
                    status = LayerServerClient(ServerPaths(fresh).socket).call({"op": "hotlist.status"})
                    prefetches.extend(status["prefetches"][:1])
                release(fresh)
            else:
                raise SystemExit(f"unknown mode {mode}")
            results.setdefault(mode, []).append(seconds)
            print(f"rep {rep + 1} {mode}: {seconds:.2f} s", flush=True)
    remove(target)
    return results, restores, link_bytes, prefetches


def report(args: argparse.Namespace, wheels: Path, installed_bytes: int, capture_s: float,
           results: dict[str, list[float]], restores: dict[str, list[float]], link_bytes: dict[str, list[int]],
           load_before: tuple[float, ...], load_after: tuple[float, ...], recorded: dict, prefetches: list[dict]) -> int:  # fmt: skip
    """Write the results file: runs, medians, ratios against each baseline of this run, the target checks."""
    modes = [m for m in args.modes.split(",") if m in results]
    median = {m: statistics.median(v) for m, v in results.items()}
    lines = [
        "# Dependency snapshots: benchmark results", "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}",
        f"- Command: `python bench/deps_bench.py --reps {args.reps} --modes {args.modes}`",
        f"- Set: {', '.join(REQUIREMENTS)} and their dependencies ({len(list(wheels.glob('*.whl')))} wheels, "
        f"{sum(p.stat().st_size for p in wheels.glob('*.whl')) / 2**20:.0f} MiB), installed "
        f"{installed_bytes / 2**20:.0f} MiB; timed until `{IMPORTS}` returned; page cache dropped before each run",
        f"- Store: `WORKDIR/store` served by nginx in a network namespace behind a veth pair shaped to {args.rate} "
        "(tbf both ways); bootseer-hit on a fresh node root each run (empty block cache, the layer server started "
        "by the run)",
        f"- Load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} (2 cores shared with "
        "other engineers' work)",
        f"- First run with capture (pip install + capture + publish, local store): {capture_s:.1f} s", "",
    ]  # fmt: skip
    baselines = [m for m in ("local", "pip-cold", "uv-cold", "uv-warm") if m in median]
    lines.append("| mode | runs (s) | median s | " + " | ".join(f"× {b}" for b in baselines) + " |")
    lines.append("|---|---|---|" + "---|" * len(baselines))
    for mode in modes:
        runs = ", ".join(f"{s:.2f}" for s in results[mode])
        ratios = " | ".join(f"{median[mode] / median[b]:.2f}" for b in baselines)
        lines.append(f"| {mode} | {runs} | {median[mode]:.2f} | {ratios} |")
    for mode, times in restores.items():
        lines += ["", f"{mode}: restore alone (`bootseer deps run` on a hit, fresh node: key, look-up across the link, "
                  f"layer server start, mounts): {', '.join(f'{s:.2f}' for s in times)} s, median "
                  f"{statistics.median(times):.2f} s. Bytes across the link per hit (restore + imports): "
                  f"{', '.join(f'{b / 2**20:.0f}' for b in link_bytes[mode])} MiB."]  # fmt: skip
    if recorded:
        lines += ["", f"Hot list: {recorded['blocks']} blocks, {recorded['bytes'] / 2**20:.0f} MiB, recorded by one "
                  f"first hit on a fresh node (sealed by {recorded['sealed_by']}: `bootseer deps release`; its "
                  f"imports took {recorded['imports_s']:.2f} s)."]  # fmt: skip
    for n, p in enumerate(prefetches, 1):
        lines.append(f"- bootseer-hot run {n}: prefetched {p['fetched_blocks']} blocks ({p['fetched_bytes'] / 2**20:.0f} "
                     f"MiB), hits {p['hits']}, waited {p['waited']}, misses {p['misses']}, median lead "
                     f"{p['lead_median_s']} s")  # fmt: skip
    for hit_mode in ("bootseer-hit", "bootseer-hot"):
        hit = median.get(hit_mode)
        if not hit:
            continue
        lines += ["", f"Targets ({hit_mode}):"]
        for base, want, text in (("pip-cold", 10.0, "≥10x faster than pip cold"),
                                 ("uv-warm", 1.7, "≥1.7x faster than uv warm")):  # fmt: skip
            if base in median:
                got = median[base] / hit
                lines.append(f"- {'PASS' if got >= want else 'FAIL'} hit {text}: {got:.2f}x")
        if "local" in median:
            got = hit / median["local"]
            lines.append(f"- {'PASS' if got <= 1.3 else 'FAIL'} hit ≤1.3x the local installed tree: {got:.2f}x")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
