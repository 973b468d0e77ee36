"""What a small store object costs a layer server: peak RSS and the FUSE stall for other layers.

One command (as root): ``.venv/bin/python -m bench.object_bombs [--output bench/results/object_bombs.md]``.
For each case it starts a real ``bootseer layer-server`` on a fresh root over a
``file://`` store holding a three-layer image (``tests.support.oci.rich_layers``) and an
unrelated one-layer image, serves the unrelated layer, and then, while a reader thread
reads 4 KiB of the unrelated layer's file through the FUSE mount over and over (the
page cache dropped for the file before each read, so each read is a FUSE request),
makes the server decode the case's object:

* ``hotlist-bomb``: a 5.8 KB hot list of the image, 64 MiB of one tiny row (issue 14, 3);
* ``hotlist-1e6``: a well-formed hot list of 10^6 distinct rows (11 MB stored) for the
  same image, which has a few dozen blocks;
* ``index-bomb``: a 3 KB layer index, 32 MiB of one tiny entry, named by a chain record
  claiming 3 files and 4 KiB (issue 14, 4); ``index-bomb-64m``: the same at 64 MiB (5.8 KB).

The hot lists are decoded when the image's top layer is mounted (the server looks its
hot list up then); the case ends when the server's log says the list was ignored.  The
index is decoded by the ``mount`` of its layer, which must fail.  Reported per case:
the object's stored size, the layer server's peak RSS growth (``VmHWM`` after minus
``VmRSS`` before, from ``/proc/PID/status``), the decode's wall time, the longest any
one read of the unrelated layer took while it ran (the stall) and the median read, and
the error the server gave.  Run it once on the code before a change and once after
(``--label``) to compare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent

from bootseer.blockstore.server.client import LayerServerClient, ServerSettings, ensure_server
from bootseer.blockstore.objects.format import ChainRecord, chain_object, index_object
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.hotlist.format import hotlist_object
from tests.support.bombs import hotlist_bomb, store_index_bomb, valid_hotlist
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import build_store
from tests.support.layers import File, Layer
from tests.support.oci import blob_data, rich_layers

BLOCK_SIZE = 64 << 10
UNRELATED_PATH = "data/unrelated.bin"


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


class Reader(threading.Thread):
    """Reads 4 KiB of a file through FUSE in a loop, timing each read (page cache dropped first)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.samples: list[tuple[float, float]] = []  #: (start, seconds)
        self.stop = threading.Event()

    def run(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            offset = 0
            while not self.stop.is_set():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                start = time.monotonic()
                os.pread(fd, 4096, offset)
                self.samples.append((start, time.monotonic() - start))
                offset = (offset + 4096) % max(size - 4096, 4096)
        finally:
            os.close(fd)


def _wait_for_log(log: Path, text: str, after: int, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text(errors="replace")[after:].splitlines():
                if text in line:
                    return line
        time.sleep(0.02)
    raise RuntimeError(f"no {text!r} in {log} after {timeout}s")


def run_case(name: str, store: Path, work: Path, image: list[Any], unrelated: Any,
             prepare: Callable[[FileStoreWriter], tuple[Any, int]]) -> dict[str, Any]:  # fmt: skip
    root = work / f"root-{name}"
    client: LayerServerClient = ensure_server(root, ServerSettings(store=f"file://{store}", retry_timeout=5))
    try:
        pid = int(client.status()["pid"])
        lower = Path(client.mount(unrelated.chain_id).lower_dir)
        (lower / UNRELATED_PATH).read_bytes()  # its blocks in the node cache: later reads wait on nothing but the server
        target, object_bytes = prepare(FileStoreWriter(store))
        if name.startswith("hotlist"):
            for layer in image[:-1]:
                client.mount(layer.chain_id)
        log = root / "layers" / "server.log"
        log_at = len(log.read_text(errors="replace")) if log.exists() else 0
        reader = Reader(lower / UNRELATED_PATH)
        reader.start()
        time.sleep(0.5)  # a baseline of reads before the decode starts (the bench times; tests do not)
        rss_before = _status_kib(pid, "VmRSS")
        started = time.monotonic()
        if name.startswith("hotlist"):
            client.mount(image[-1].chain_id)
            error = _wait_for_log(log, "hot list ignored", log_at)
            error = error.split("error=", 1)[-1]
        else:
            try:
                client.mount(target)
                error = "(mounted!)"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - started
        time.sleep(0.2)
        reader.stop.set()
        reader.join()
        hwm = _status_kib(pid, "VmHWM")
        during = [seconds for start, seconds in reader.samples if started <= start <= started + elapsed] or [0.0]
        overlapping = [seconds for start, seconds in reader.samples if start < started + elapsed and start + seconds > started]
        return {
            "case": name,
            "object_bytes": object_bytes,
            "rss_before_mib": rss_before / 1024,
            "hwm_after_mib": hwm / 1024,
            "growth_mib": (hwm - rss_before) / 1024,
            "decode_s": elapsed,
            "stall_s": max(overlapping or [0.0]),
            "median_read_ms": statistics.median(during) * 1000,
            "reads_during": len(during),
            "error": error[-150:],
        }
    finally:
        stop_layer_servers(root)


def decode_legit_list(rows: int) -> dict[str, Any]:
    """A well-formed list of ``rows`` rows decoded in this process, bounded by an image of
    that many blocks (legitimate: what a node decodes for an image that large), while a
    thread measures how late its 1 ms sleeps wake (how long the decode holds the GIL);
    then again under tracemalloc for the decode's peak allocation."""
    import inspect
    import tracemalloc

    from bootseer.hotlist.format import HotList

    layers = ["sha256:" + "1" * 64, "sha256:" + "2" * 64]
    data = valid_hotlist(layers[-1], layers, rows)
    bounded = {"max_blocks": rows} if "max_blocks" in inspect.signature(HotList.decode).parameters else {}
    lateness: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            start = time.monotonic()
            time.sleep(0.001)
            lateness.append(time.monotonic() - start - 0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    started = time.monotonic()
    decoded = HotList.decode(data, **bounded)
    elapsed = time.monotonic() - started
    done.set()
    ticker.join()
    del decoded
    tracemalloc.start()
    HotList.decode(data, **bounded)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"case": f"decode-{rows:.0e}-legit (in process)", "object_bytes": len(data), "decode_s": elapsed,
            "stall_s": max(lateness or [0.0]), "peak_mib": peak / (1 << 20)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--output", type=Path, help="append the table to this Markdown file")
    parser.add_argument("--label", default="", help="what code was measured (e.g. 'before (f793715)')")
    parser.add_argument("--cases", default="hotlist-bomb,hotlist-1e6,index-bomb,index-bomb-64m,decode-legit")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("object_bombs: needs root (FUSE)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="object-bombs-", dir="/var/tmp"))
    try:
        base = work / "store"
        image = build_store(base, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE, layout=work / "image")
        unrelated = build_store(base, [Layer((File(UNRELATED_PATH, blob_data(4 << 20)),))], block_size=BLOCK_SIZE,
                                layout=work / "unrelated")[0]  # fmt: skip
        top, layers = image[-1].chain_id, [layer.chain_id for layer in image]

        def put_hot_list(data: bytes) -> Callable[[FileStoreWriter], tuple[None, int]]:
            return lambda store: (store.put(hotlist_object(top), data), len(data))

        def put_index_bomb(payload: int) -> Callable[[FileStoreWriter], tuple[str, int]]:
            def put(store: FileStoreWriter) -> tuple[str, int]:
                chain = store_index_bomb(store, payload)
                record = ChainRecord.decode(store.get(chain_object(chain)) or b"")
                return chain, store.size(index_object(record.index)) or 0

            return put

        preparations: dict[str, Callable[[], Callable[[FileStoreWriter], tuple[Any, int]]]] = {
            "hotlist-bomb": lambda: put_hot_list(hotlist_bomb(top, layers)),
            "hotlist-1e6": lambda: put_hot_list(valid_hotlist(top, layers, 10**6)),
            "index-bomb": lambda: put_index_bomb(32 << 20),
            "index-bomb-64m": lambda: put_index_bomb(64 << 20),
        }
        rows = []
        legit: dict[str, Any] = {}
        for name in args.cases.split(","):
            if name == "decode-legit":
                legit = decode_legit_list(10**6)
                print(legit, flush=True)
                continue
            store = work / f"store-{name}"
            shutil.copytree(base, store)
            row = run_case(name, store, work, image, unrelated, preparations[name]())
            rows.append(row)
            print(row, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"### {args.label or commit} ({commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores)",
        "",
        "| case | stored | RSS before | peak after | growth | decode | longest read of another layer | median read | refused with |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['object_bytes']:,} B | {row['rss_before_mib']:.0f} MiB | {row['hwm_after_mib']:.0f} MiB "
            f"| +{row['growth_mib']:.0f} MiB | {row['decode_s']:.2f} s | {row['stall_s'] * 1000:.0f} ms "
            f"| {row['median_read_ms']:.2f} ms | {row['error'].replace('|', '/')} |"
        )
    if "decode-legit" in args.cases.split(","):
        lines += [
            "",
            "| case | stored | decode | longest a 1 ms sleep of another thread overslept | peak allocation (tracemalloc) |",
            "|---|---:|---:|---:|---:|",
            f"| {legit['case']} | {legit['object_bytes']:,} B | {legit['decode_s']:.2f} s | {legit['stall_s'] * 1000:.0f} ms | {legit['peak_mib']:.0f} MiB |",
        ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output:
        with open(args.output, "a") as out:
            out.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
