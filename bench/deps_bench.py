"""Dependency snapshots against installing: time from the start of the step until the imports have returned.

    .venv/bin/python bench/deps_bench.py [--reps 3] [--workdir /var/tmp/deps-bench] [--wheels DIR]

Needs root (drops the page cache, mounts overlayfs and FUSE).  The requirement set: the CPU build of
torch 2.13.0 (it lies in /opt/wheels), numpy, requests, pyyaml, tqdm, click, rich, packaging and their
dependencies, from a local wheel directory (``pip download`` once into ``WORKDIR/wheels``; no index is
used while measuring).  Every mode installs into (or restores) the same ``--target`` directory and then
runs ``python -c "import torch, numpy, requests, yaml, rich"`` with it on ``PYTHONPATH``; the page cache
is dropped before every run; medians of ``--reps``.

| mode | what is timed |
|---|---|
| local | the imports alone, from a tree pip installed (with bytecode): the floor |
| pip-cold | ``pip install --no-cache-dir --target DIR -r req.txt``, then the imports |
| uv-cold | ``uv pip install --target DIR -r req.txt`` with an empty cache, then the imports (uv's default: no bytecode) |
| uv-warm | the same with the cache of an earlier run (hard links from it) |
| bootseer-hit | ``bootseer deps run --prefix DIR --store STORE --root NEW -- pip install ...`` on a fresh node root (empty block cache, no layer server yet) with the snapshot in a local directory store, then the imports through overlayfs over the FUSE layer server |

Writes ``bench/results/deps.md``.  Not done here (the issue's full setup): the 1 Gbit/s shaped link in
front of the store, transformers in the set, the hot-list prefetch of the first import's blocks.
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

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent
REQUIREMENTS = ["torch==2.13.0", "numpy", "requests", "pyyaml", "tqdm", "click", "rich", "packaging"]
IMPORTS = "import torch, numpy, requests, yaml, rich"


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
    parser.add_argument("--modes", default="local,pip-cold,uv-cold,uv-warm,bootseer-hit")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "deps.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("deps_bench: run as root (drop_caches, overlayfs, FUSE)")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    wheels = args.wheels or work / "wheels"
    if not any(wheels.glob("torch-2.13.0*.whl")):
        print(f"downloading the wheel set into {wheels} (once)", flush=True)
        subprocess.run([PYTHON, "-m", "pip", "download", "-q", "-d", str(wheels), *REQUIREMENTS], check=True)
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
        subprocess.run([PYTHON, "-c", f"from pathlib import Path; from bootseer.blockstore.control import *; "
                        f"LayerServerClient(ServerPaths(Path('{root}')).socket).shutdown()"], capture_output=True)  # fmt: skip
        time.sleep(1)
        remove(root)

    # The snapshot, captured once (timed: what a first run costs on top of its install).
    for path in (target, store, node):
        remove(path)
    capture_s = sh([*deps, "run", "--prefix", str(target), "--store", str(store), "--root", str(node), "--", *pip])
    installed_bytes = int(subprocess.run(["du", "-sb", str(target)], capture_output=True, text=True).stdout.split()[0])
    release(node)

    results: dict[str, list[float]] = {}
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
            elif mode == "bootseer-hit":
                remove(target)
                fresh = work / f"node-{rep}"
                remove(fresh)
                drop_caches()
                seconds = sh([*deps, "run", "--prefix", str(target), "--store", str(store), "--root", str(fresh),
                              "--", *pip]) + imports(target)  # fmt: skip
                release(fresh)
            else:
                raise SystemExit(f"unknown mode {mode}")
            results.setdefault(mode, []).append(seconds)
            print(f"rep {rep + 1} {mode}: {seconds:.2f} s", flush=True)
    remove(target)

    median = {m: statistics.median(v) for m, v in results.items()}
    lines = [
        "# Dependency snapshots: benchmark results", "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}",
        f"- Command: `python bench/deps_bench.py --reps {args.reps}`",
        f"- Set: {', '.join(REQUIREMENTS)} and their dependencies ({len(list(wheels.glob('*.whl')))} wheels, "
        f"{sum(p.stat().st_size for p in wheels.glob('*.whl')) / 2**20:.0f} MiB), installed "
        f"{installed_bytes / 2**20:.0f} MiB; timed until `{IMPORTS}` returned; page cache dropped before each run",
        "- Store: a local directory (no shaped link); bootseer-hit on a fresh node root each run (empty block cache, "
        "the layer server started by the run)",
        f"- First run with capture (pip install + capture + publish): {capture_s:.1f} s", "",
        "| mode | runs (s) | median s | × bootseer-hit | × local |", "|---|---|---|---|---|",
    ]  # fmt: skip
    hit = median.get("bootseer-hit")
    local = median.get("local")
    for mode in modes:
        if mode not in median:
            continue
        runs = ", ".join(f"{s:.2f}" for s in results[mode])
        lines.append(f"| {mode} | {runs} | {median[mode]:.2f} | {median[mode] / hit:.2f} | {median[mode] / local:.2f} |"
                     if hit and local else f"| {mode} | {runs} | {median[mode]:.2f} | | |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
