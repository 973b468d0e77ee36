"""Benchmark of peer-assisted block sharing (issue 16): a job start on N nodes at once, with and without peers.

One command (as root): ``.venv/bin/python -m bench.peers_bench``.  It

1. builds (once, cached) the lazy-layers benchmark's image (``bench/image_build.py``: Debian, python3,
   CPU torch, a training step) and converts it (``bench.node.convert_store``), into
   ``--cache-dir`` (``/var/tmp/bootseer-bench``, shared with ``lazy_bench.py``);
2. records the image's hot list once, into a copy of the store of its own (``store-peers``;
   ``lazy_bench.py`` clears the hot lists of ``store`` and ``store-hot``): one layer server alone on
   the host mounts the layers, an overlay over them gets ``hotlist.prepared`` with ``readers: any``
   (as ``bootseer deps run`` does: there is no container), and the job (``python3 /app/train.py``
   in a chroot of the overlay) runs to its seal marker; the list is published to the store;
3. makes the nodes (``tests/support/peernodes.py``): ``--nodes`` (8) network namespaces, each behind
   its own ``--rate`` (1 Gbit/s) tbf link, and a store namespace whose nginx serves ``store-peers``
   behind one shared ``--store-rate`` (1 Gbit/s) link, all on one bridge; each node runs its own
   ``bootseer layer-server`` (own root and cache) in its namespace;
4. times, ``--reps`` times, each on fresh roots and empty caches after ``drop_caches``:

   * ``alone``: node 0 alone, peers off: the baseline;
   * ``no-peers``: every node at once, peers off;
   * ``peers``: every node at once with ``--peer-listen``, ``--peers`` (every node), a token file and
     ``--peer-deadline`` (when the layer server has the options: else reported as not run);
   * ``peers-kill``: as ``peers``, and the last node's server is SIGKILLed once its prefetch has
     fetched ``--kill-at`` (half) of the hot set;

   a node's start is: mount the image's layers through its control socket, bottom first (what rpull
   does; the top's mount starts the hot-list prefetch); wait until the prefetch has every hot block
   in the node cache (*hot set*); then replay the recorded read order: every hot block, in the hot
   list's order, read through the node's mount from the file that holds it, and its bytes checked
   against the block's SHA-256 (every byte verified); all nodes start at the same instant;
   measured: per node the time to its hot set and to the end of the replay, its layer server's CPU
   seconds and its metrics (store bytes, peer bytes, fallbacks); at the store, the bytes its link sent
   (veth counters) and the response bodies nginx logged;
5. writes ``--output`` (bench/results/peers.md): the table (store egress, time to every node's hot
   set, slowest node, min/median/max), the targets (store egress with peers <= 1.2x one node's
   alone; slowest with peers <= 1.5x one node alone; a killed peer delays no node by more than the
   fallback deadline), and a model fitted to the measurements that extrapolates store egress and
   start time to 1,000 nodes with and without peers, with what limits it.

Everything it starts (namespaces, veth pairs, nginx, layer servers, mounts) is torn down at the end,
on failure and on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import hot_set_cost, image_build
from bench.common import BenchError, bootseer_argv, code_version, drop_caches, fmt, log, machine
from bench.node import (
    chroot_start, convert_store, hot_store_copy, layer_server_node, overlay_root, published_hot_list, read_hot_list,
    recording_finished,
)
from tests.support.oci import chain_ids
from tests.support.peernodes import PeerCluster, PeerNode, leftovers, peer_args, write_token

BENCH_DIR = Path(__file__).resolve().parent

MB = 1_000_000
#: The issue's targets.
TARGET_EGRESS_RATIO = 1.2
TARGET_SLOWEST_RATIO = 1.5
#: Issue 26's: bytes a node receives from peers against its share of the hot set as the store stores it,
#: a node's CPU with peers against without, and a layer server's CPU for the hot set against the cost of
#: decompressing and verifying its blocks on one core.
TARGET_PEER_BYTES_RATIO = 1.1
TARGET_PEER_CPU_RATIO = 1.15
TARGET_DECODE_CPU_RATIO = 2.0
#: The stages of bootseer/cpu.py, as the layer server's metrics name them.
CPU_STAGES = ("fetch", "decode", "cache_read", "cache_write", "blob_fill", "page_cache_warm", "gc")
#: Extrapolated to this many nodes.
MODEL_NODES = 1000
SCENARIOS = {
    "alone": "node 0 alone, peers off (the baseline)",
    "no-peers": "every node at once, peers off",
    "peers": "every node at once, peers on",
    "peers-kill": "every node at once, peers on; the last node's server SIGKILLed mid-prefetch",
}
RECORD_KEY = "peers-bench-record"


# --------------------------------------------------------------------------- the image, its store and hot list


@dataclasses.dataclass(frozen=True)
class ReplayBlock:
    """One hot block as the start reads it: a range of a file of a layer."""

    layer: int  #: position of the layer in the image, bottom first
    path: str
    offset: int
    size: int
    digest: str  #: SHA-256 of the raw block: of exactly these bytes of the file


@dataclasses.dataclass
class Image:
    chains: list[str]  #: ChainIDs bottom first
    hot: dict[str, Any]  #: the hot list's summary (``bootseer hotlist show``)
    replay: list[ReplayBlock]
    hot_clen: int  #: compressed bytes of the hot blocks (what a store sends for them, and a peer holding the frames)
    hot_rlen: int  #: raw bytes (what the replay reads)


def peers_store_copy(cache: Path) -> Path:
    """``store-peers``: a hard-linked copy of the converted store whose hot list this benchmark keeps."""
    store, copy = cache / "store", cache / "store-peers"
    marker = copy / "copied-from"
    source = (store.parent / "store.converted").read_text()
    if copy.is_dir() and marker.exists() and marker.read_text() == source:
        return copy
    hot_store_copy(store, copy)  # cp -al, its hot lists cleared, hotlists/ writable
    marker.write_text(source)
    return copy


def record_hot_list(image: image_build.Image, store: Path, work: Path, timeout: float) -> dict[str, Any]:
    """The image's first boot on a layer server alone, recorded and published into ``store`` (see the module
    docstring); the list's summary.  Cached: a store holding the list is used as it is."""
    from bootseer.blockstore.server.client import LayerServerClient

    found = read_hot_list(store, image)
    if found is not None:
        return found
    chains = chain_ids([layer.diff_id for layer in image.layers])
    base = work / "record"
    log_path = work / "logs" / "record.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"recording the hot list: a layer server alone on file://{store}, the job in a chroot")
    with layer_server_node(base, f"file://{store}") as (socket_path, _metrics):
        client = LayerServerClient(socket_path)
        lowers = [client.mount(chain).lower_dir for chain in chains][::-1]
        with overlay_root(lowers, base, "rec") as root:
            answer = client.call({"op": "hotlist.prepared", "key": RECORD_KEY, "parent": chains[-1],
                                  "upper": str(base / "rec.up"), "readers": "any", "labels": {}})
            if answer.get("action") != "record":
                raise BenchError(f"hotlist.prepared did not start a recording: {answer}")
            seconds, _line = chroot_start(root, timeout, log_path)
            log(f"  the job printed its first output after {seconds:.1f} s")
            summary = recording_finished(socket_path)
    return published_hot_list(summary, store, image)


def load_image(image: image_build.Image, store: Path, hot: dict[str, Any]) -> Image:
    """The hot list resolved against the layers' indexes (from ``store``): the replay's reads in its order."""
    from bootseer.blockstore.convert.converter import verify_layer
    from bootseer.blockstore.objects.format import EntryType, LayerIndex, index_object
    from bootseer.blockstore.objects.store import FileStoreWriter
    from bootseer.hotlist.format import HotList, hotlist_object, resolve

    chains = chain_ids([layer.diff_id for layer in image.layers])
    writer = FileStoreWriter(store)
    indexes = {}
    for chain in chains:
        record = verify_layer(writer, chain)
        if record is None:
            raise BenchError(f"{chain} is not converted in {store}")
        indexes[chain] = LayerIndex.decode(writer.get(index_object(record.index)), expected_sha256=record.index)
    listed = HotList.decode((store / hotlist_object(chains[-1])).read_bytes(), expected_image=chains[-1],
                            expected_profile="")
    places: dict[str, dict[int, tuple[str, int]]] = {}
    for chain, index in indexes.items():
        table = places.setdefault(chain, {})
        for entry in index.entries:
            if entry.type is EntryType.FILE and entry.link is None:
                for position, ref in enumerate(entry.blocks):
                    table.setdefault(ref, (entry.path, position * index.block_size))
    replay = []
    for block in resolve(listed, chains, indexes):
        path, offset = places[block.layer][block.ref]
        replay.append(ReplayBlock(chains.index(block.layer), path, offset, block.hot.rlen, block.hot.digest))
    return Image(chains, hot, replay, hot_clen=sum(b.hot.clen for b in resolve(listed, chains, indexes)),
                 hot_rlen=sum(b.size for b in replay))


def decode_cost(store: Path, image: Image) -> dict[str, float]:
    """CPU seconds on one core to decompress and verify the hot set's frames as the fetcher does
    (:mod:`bench.hot_set_cost`, the lazy-layers benchmark's measure): what the layer server's CPU for the hot set
    is held against."""
    cost = hot_set_cost.measure_published(store, image.chains[-1])
    return {"cpu_s": cost.cpu_seconds, "blocks": float(cost.blocks), "clen": float(cost.stored_bytes),
            "rlen": float(cost.raw_bytes)}


# --------------------------------------------------------------------------- one start on a set of nodes


@dataclasses.dataclass
class NodeRun:
    """One node's start."""

    node: int
    hot_s: float | None = None  #: from the job's start to every hot block in the node cache
    done_s: float | None = None  #: ... to the end of the replay
    verified_bytes: int = 0
    cpu_s: float = 0.0  #: the layer server's user + system CPU seconds over the start
    figures: dict[str, float] = dataclasses.field(default_factory=dict)
    prefetch: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""
    killed: bool = False


@dataclasses.dataclass
class Start:
    """One scenario's run: every node's start, the store's egress."""

    scenario: str
    nodes: list[NodeRun]
    store_egress: int  #: bytes the store's link sent
    store_bodies: int  #: response body bytes nginx logged
    killed_at_s: float | None = None
    machine_cpu_s: float = 0.0  #: busy CPU seconds of the whole machine over the start (every core, kernel included)

    def alive(self) -> list[NodeRun]:
        return [run for run in self.nodes if not run.killed]

    def times(self, pick: str = "done_s") -> list[float]:
        return [getattr(run, pick) for run in self.alive() if getattr(run, pick) is not None]

    def complete(self) -> bool:
        """Every node that was not killed got its hot set and replayed the start."""
        return bool(self.alive()) and all(run.done_s is not None for run in self.alive())

    def slowest(self, pick: str = "done_s") -> float | None:
        """The slowest node's time, if the start is :meth:`complete`."""
        return max(self.times(pick)) if self.complete() else None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Start":
        nodes = [NodeRun(**run) for run in data.pop("nodes")]
        return cls(nodes=nodes, **data)


#: Node metrics worth a figure: the Prometheus sample, its labels, the figure's name.
NODE_METRICS = (
    ("bootseer_block_fetched_bytes_total", {}, "store_bytes"),
    ("bootseer_peer_bytes_total", {"direction": "received"}, "peer_received_bytes"),
    ("bootseer_peer_bytes_total", {"direction": "served"}, "peer_served_bytes"),
    ("bootseer_peer_fallbacks_total", {}, "peer_fallbacks"),
    ("bootseer_peer_requests_total", {"outcome": "ok"}, "peer_requests_ok"),
    *(("bootseer_stage_cpu_seconds_total", {"stage": stage}, f"cpu_{stage}_s") for stage in CPU_STAGES),
)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the machine since boot, all cores (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def node_figures(node: PeerNode) -> dict[str, float]:
    try:
        samples = node.metrics()
    except OSError as e:
        log(f"  {node.name}: metrics: {e}")
        return {}
    figures = {}
    for name, labels, figure in NODE_METRICS:
        wanted = set(labels.items())
        figures[figure] = sum(v for (sample, have), v in samples.items() if sample == name and wanted <= set(have))
    return figures


def peer_figures(node: PeerNode) -> dict[str, float]:
    """What ``peers.status`` counts that the metrics do not: blocks gone late, and errors."""
    try:
        status = node.peers_status()
    except Exception as e:  # noqa: BLE001 - a missing figure must not lose the timing
        log(f"  {node.name}: peers.status: {e}")
        return {}
    return {"peer_late": float(status.get("late", 0)), "peer_errors": float(status.get("errors", 0)),
            "peer_bad_blocks": float(status.get("bad_blocks", 0))}


def prefetch_state(node: PeerNode) -> dict[str, Any] | None:
    """The node's running (or last finished) prefetch, from ``hotlist.status``."""
    status = node.client.call({"op": "hotlist.status"}, timeout=5)
    running = status.get("prefetches", [])
    if running:
        return running[-1]
    done = [s for s in status.get("finished", []) if s.get("kind") == "prefetch"]
    return done[-1] if done else None


def replay(node: PeerNode, mounted: list[Any], image: Image, deadline: float) -> int:
    """Read every hot block in the recorded order through the node's mounts; check each against its digest.
    BenchError once ``deadline`` (``time.monotonic()``) passes."""
    verified = 0
    handles: dict[tuple[int, str], int] = {}
    try:
        for number, block in enumerate(image.replay):
            if time.monotonic() > deadline:
                raise BenchError(f"{node.name}: the replay read {number} of {len(image.replay)} blocks in time")
            key = (block.layer, block.path)
            if key not in handles:
                handles[key] = os.open(os.path.join(mounted[block.layer].lower_dir, block.path), os.O_RDONLY)
            data = os.pread(handles[key], block.size, block.offset)
            if len(data) != block.size or hashlib.sha256(data).hexdigest() != block.digest:
                raise BenchError(f"{node.name}: {block.path} at {block.offset}: {len(data)} bytes read, "
                                 f"not the block {block.digest[:12]} ({block.size} bytes)")
            verified += len(data)
    finally:
        for fd in handles.values():
            os.close(fd)
    return verified


def start_node(node: PeerNode, image: Image, run: NodeRun, clock: list[float], go: threading.Event,
               timeout: float) -> None:
    """One node's start (see the module docstring), timed from ``clock[0]``, set just before ``go`` is."""
    go.wait()
    begin = clock[0]
    try:
        mounted = node.mount_image(image.chains)
        deadline = time.monotonic() + timeout
        while True:
            state = prefetch_state(node)
            if state is not None and state.get("finished"):
                run.hot_s = time.perf_counter() - begin
                run.prefetch = state
                break
            if time.monotonic() > deadline:
                got = "none" if state is None else f"{state.get('fetched_blocks')} of {state.get('planned_blocks')} blocks"
                raise BenchError(f"{node.name}: no finished prefetch within {timeout:.0f} s (fetched {got})")
            time.sleep(0.02)
        run.verified_bytes = replay(node, mounted, image, deadline)
        run.done_s = time.perf_counter() - begin
    except Exception as e:  # noqa: BLE001 - one node's failure is reported, the others' starts go on
        run.error = f"{type(e).__name__}: {e}"


def killer(victim: PeerNode, run: NodeRun, start: "Start", clock: list[float], go: threading.Event, kill_at: float,
           planned: int, stop: threading.Event) -> None:
    """SIGKILL ``victim``'s server once its prefetch has fetched ``kill_at`` of ``planned`` bytes."""
    go.wait()
    begin = clock[0]
    while not stop.is_set():
        with contextlib.suppress(Exception):
            state = prefetch_state(victim)
            if state is not None and state.get("fetched_bytes", 0) >= kill_at * planned:
                run.cpu_s = cpu_seconds(victim.pid)
                victim.kill()
                start.killed_at_s = time.perf_counter() - begin
                run.killed = True
                return
        time.sleep(0.02)


def keep_log(node: PeerNode, logs: Path, label: str) -> None:
    """Move the node's server log to ``logs/LABEL-NODE.log`` (before its directory is wiped)."""
    if node.log_path.exists():
        logs.mkdir(parents=True, exist_ok=True)
        shutil.move(node.log_path, logs / f"{label}-{node.name}.log")


def fresh(node: PeerNode, extra_args: list[str]) -> None:
    """Stop the node's server and give it an empty root and cache, then start it with ``extra_args``."""
    node.stop()
    shutil.rmtree(node.base, ignore_errors=True)
    node.launch(extra_args)


def run_start(cluster: PeerCluster, scenario: str, count: int, peer_args: dict[int, list[str]] | None,
              image: Image, timeout: float, logs: Path, label: str, kill_at: float | None = None) -> Start:
    """``count`` nodes start the image at once (peers on when ``peer_args`` gives each node its flags);
    their servers' logs go to ``logs/LABEL-nodeN.log``."""
    nodes = cluster.nodes[:count]
    for node in cluster.nodes:
        node.stop()
    drop_caches()
    for node in nodes:
        fresh(node, (peer_args or {}).get(node.index, []))
    for node in nodes:
        node.wait_ready()
    runs = [NodeRun(node.index) for node in nodes]
    egress, bodies = cluster.store_egress(), cluster.store_body_bytes()
    cpu_before = [cpu_seconds(node.pid) for node in nodes]
    machine_before = machine_cpu_seconds()
    go, stop = threading.Event(), threading.Event()
    clock = [0.0]
    start = Start(scenario, runs, 0, 0)
    threads = [threading.Thread(target=start_node, args=(node, image, run, clock, go, timeout), daemon=True)
               for node, run in zip(nodes, runs)]
    if kill_at is not None:
        threads.append(threading.Thread(target=killer, args=(nodes[-1], runs[-1], start, clock, go, kill_at,
                                                             image.hot_clen, stop), daemon=True))
    for thread in threads:
        thread.start()
    clock[0] = time.perf_counter()  # every node's clock starts as all are let go
    go.set()
    for thread in threads[:len(nodes)]:
        thread.join(timeout + 60)
    stop.set()
    for thread in threads[len(nodes):]:
        thread.join(30)
    start.machine_cpu_s = machine_cpu_seconds() - machine_before
    start.store_egress = cluster.store_egress() - egress
    start.store_bodies = cluster.store_body_bytes() - bodies
    for node, run, before in zip(nodes, runs, cpu_before):
        if not run.killed:
            run.cpu_s = cpu_seconds(node.pid) - before
            run.figures = node_figures(node)
            if peer_args:
                run.figures.update(peer_figures(node))
    for node in nodes:
        node.stop()
        keep_log(node, logs, label)
    return start


def summarize(start: Start) -> str:
    done = start.times()
    errors = [f"{r.node}: {r.error}" for r in start.nodes if r.error and not r.killed]
    text = (f"{start.scenario:10} {len(start.nodes)} node(s): store egress {start.store_egress / MB:7.1f} MB, "
            f"hot set everywhere {fmt(max(start.times('hot_s'), default=None))} s, "
            f"slowest {fmt(max(done, default=None))} s, median {fmt(statistics.median(done) if done else None)} s, "
            f"CPU {sum(r.cpu_s for r in start.nodes):.1f} s")
    if start.killed_at_s is not None:
        text += f"; killed node {start.nodes[-1].node} at {start.killed_at_s:.2f} s"
    return text + ("".join(f"\n    FAILED {e}" for e in errors))


# --------------------------------------------------------------------------- peers


def peers_supported() -> bool:
    """Whether the installed ``bootseer layer-server`` has peer sharing (``--peer-listen``)."""
    done = subprocess.run(bootseer_argv("layer-server", "--help"), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    return "--peer-listen" in done.stdout


def peer_flags(cluster: PeerCluster, count: int, token_file: Path, deadline: float) -> dict[int, list[str]]:
    """Each of the first ``count`` nodes' peer options (:func:`~tests.support.peernodes.peer_args`: listen on
    its address, those nodes the members, the token file), with ``--peer-deadline``."""
    args = peer_args(token_file, "--peer-deadline", str(deadline), members=count)
    return {node.index: args(node, cluster) for node in cluster.nodes[:count]}


# --------------------------------------------------------------------------- the model


def fit_model(results: dict[str, list[Start]], image: Image, store_rate: float, node_rate: float) -> dict[str, Any]:
    """Fitted figures and the 1,000-node extrapolation (see the report's model section).

    A start takes a fixed part plus its bottleneck, the slowest of: the store's link (egress / its
    rate), the node's link (bytes from peers / its rate) and the CPU.  A layer server runs on
    about one core (its Python holds the GIL), so a node's CPU term is its server's CPU seconds; on
    this machine, where every node shares its cores, it is also at least the machine's busy CPU
    seconds over the start divided by its cores (nginx, the kernel's FUSE and EROFS work and the
    replay's hashing included).  The fixed part is fitted to the node starting alone.
    """
    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    cores = os.cpu_count() or 1
    alone = [s for s in results.get("alone", []) if s.complete()]
    model: dict[str, Any] = {"store_rate": store_rate, "node_rate": node_rate, "cores": cores, "rows": []}
    if not alone:
        return model
    e1 = med([s.store_egress for s in alone])
    t1 = med([s.slowest() for s in alone])
    cpu1 = med([s.nodes[0].cpu_s for s in alone])
    machine1 = med([s.machine_cpu_s for s in alone])
    model.update(e1=e1, t1=t1, cpu1=cpu1, machine1=machine1)
    model["t_fixed"] = max(0.0, t1 - max(e1 / store_rate, cpu1, machine1 / cores))
    for scenario in ("no-peers", "peers"):
        starts = [s for s in results.get(scenario, []) if s.complete()]
        if not starts:
            continue
        n = len(starts[0].nodes)
        egress = med([s.store_egress for s in starts])
        cpu = med([statistics.mean(r.cpu_s for r in s.alive()) for s in starts])
        machine = med([s.machine_cpu_s for s in starts])
        # What a node gets from peers: the frames of (N-1)/N of the hot set (measured below, in the report)
        ingress = image.hot_clen * (n - 1) / n if scenario == "peers" else 0.0
        terms = {"store link": egress / store_rate, "node link": ingress / node_rate,
                 "CPU": max(cpu, machine / cores)}
        model[scenario] = {"n": n, "egress": egress, "egress_over_e1": egress / e1, "cpu": cpu, "machine": machine,
                           "slowest": med([s.slowest() for s in starts]),
                           "predicted_here": model["t_fixed"] + max(terms.values()),
                           "limit_here": max(terms, key=lambda k: terms[k])}
    if "peers" not in model:
        # No complete start with peers to fit: the design's figures (egress E1, the alone node's CPU), marked so.
        model["peers_design"] = True
        model["peers"] = {"n": MODEL_NODES, "egress": e1, "cpu": cpu1, "fitted": False}
    for scenario in ("no-peers", "peers"):
        fitted = model.get(scenario)
        if not fitted:
            continue
        for n in sorted({1, fitted["n"], 100, MODEL_NODES}):
            if n == 1:  # one node is the node alone, peers or not
                model["rows"].append({"scenario": scenario, "n": 1, "egress": e1, "seconds": t1, "limit": "(measured)"})
                continue
            if scenario == "no-peers":
                egress, ingress = fitted["egress"] / fitted["n"] * n, 0.0
            else:
                # Each block crosses the store's link about once, whatever N: the measured excess over E1 stays.
                egress, ingress = (fitted["egress"] if n > 1 else e1), image.hot_clen * (n - 1) / n
            terms = {"store link": egress / store_rate, "node link": ingress / node_rate, "CPU": fitted["cpu"]}
            limit = max(terms, key=lambda k: terms[k])
            model["rows"].append({"scenario": scenario, "n": n, "egress": egress,
                                  "seconds": model["t_fixed"] + terms[limit], "limit": limit})
    return model


# --------------------------------------------------------------------------- report


def report(results: dict[str, list[Start]], image: Image, context: dict[str, Any], model: dict[str, Any]) -> str:
    settings = context["settings"]
    lines = [f"# Peer-assisted block sharing: a job start on {settings['nodes']} nodes (issues 16, 26)", "",
             f"Measured {context['when']} on {context['machine']}; load average {context['load']:.2f} before; "
             f"code {context['code']}; `{' '.join(context['argv'])}`, {context['minutes']:.1f} min.", "",
             f"Image: the lazy-layers benchmark's ({len(image.chains)} layers, torch CPU); its hot list (recorded once "
             f"by a layer server alone, the job in a chroot): {image.hot['blocks']} blocks, "
             f"{image.hot_clen / MB:.1f} MB compressed (what the store sends, and an owner holding the store's frames), "
             f"{image.hot_rlen / MB:.1f} MB raw (what the replay reads).",
             "",
             f"Nodes: network namespaces on one bridge, each behind its own tbf link of `{settings['rate']}`; the store "
             f"(nginx serving the converted store) in a namespace of its own behind one `{settings['store_rate']}` "
             f"link (one GET across it: {context.get('store_rate_mb', 0):.0f} MB/s). A node's start: mount the 4 "
             f"layers (the top's mount starts the hot-list prefetch), wait until every hot block is in the node cache "
             f"(*hot set*), then replay the recorded read order through the mount, every block's bytes checked "
             f"against its SHA-256; a node gets `--timeout` {settings['timeout']:.0f} s. All nodes start at once, on "
             f"fresh roots and empty caches, page cache dropped. Store egress: bytes the store's link sent (veth "
             f"counters; nginx's logged bodies beside). Medians of {settings['reps']} rep(s).", ""]
    for note in context["notes"]:
        lines += [f"*{note}*", ""]
    lines += ["| scenario | nodes | finished | store egress MB | x one node alone | hot set on every node s | "
              "slowest s | min / median / max s | CPU s per node | peer MB received per node | fallbacks |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    e1 = model.get("e1")
    for scenario in SCENARIOS:
        starts = results.get(scenario)
        if not starts:
            why = context["not_run"].get(scenario, "")
            lines.append(f"| {scenario} | — | not run{': ' + why if why else ''} | | | | | | | | |")
            continue
        egress = statistics.median(s.store_egress for s in starts)
        hot = [s.slowest("hot_s") for s in starts if s.complete()]
        slowest = [s.slowest() for s in starts if s.complete()]
        spread = [t for s in starts for t in s.times()]
        cpu = [r.cpu_s for s in starts for r in s.alive()]
        received = [r.figures.get("peer_received_bytes", 0) for s in starts for r in s.alive()]
        fallbacks = sum(r.figures.get("peer_fallbacks", 0) for s in starts for r in s.alive())
        finished = sum(len(s.times()) for s in starts)
        alive = sum(len(s.alive()) for s in starts)
        spread_text = (f"{min(spread):.2f} / {statistics.median(spread):.2f} / {max(spread):.2f}" if spread else "—")
        lines.append(f"| {scenario} | {len(starts[0].nodes)} | {finished}/{alive} | {egress / MB:.1f} | "
                     f"{fmt(egress / e1 if e1 else None)} | {fmt(statistics.median(hot) if hot else None)} | "
                     f"{fmt(statistics.median(slowest) if slowest else None)} | {spread_text} | "
                     f"{fmt(statistics.median(cpu) if cpu else None, '.1f')} | "
                     f"{fmt(statistics.median(received) / MB if received else None, '.1f')} | {fallbacks:.0f} |")
    lines += ["", "Scenarios: " + "; ".join(f"`{k}`: {v}" for k, v in SCENARIOS.items()) + ". *finished*: nodes "
              "(not killed) that had their hot set and replayed the start within the timeout; a start where one "
              "did not has no slowest node.", ""]
    lines += ["## Targets", ""] + checks(results, model, context, image) + [""]
    lines += stall_note(results) + peer_bytes_note(results, image)
    lines += cpu_section(results, context)
    lines += model_section(model, image, context)
    lines += ["", "## Every start", ""]
    for scenario in SCENARIOS:
        for number, start in enumerate(results.get(scenario, [])):
            lines.append(f"* `{scenario}` rep {number}: store egress {start.store_egress / MB:.1f} MB "
                         f"(nginx bodies {start.store_bodies / MB:.1f} MB), machine CPU {start.machine_cpu_s:.1f} s"
                         + (f", node {start.nodes[-1].node} killed at {start.killed_at_s:.2f} s"
                            if start.killed_at_s is not None else ""))
            for run in start.nodes:
                state = "killed" if run.killed else (f"FAILED: {run.error}" if run.error else "ok")
                figures = ", ".join(f"{k} {v / MB:.1f} MB" if k.endswith("bytes") else
                                    f"{k} {v:.2f}" if k.endswith("_s") else f"{k} {v:.0f}"
                                    for k, v in run.figures.items() if v or k == "peer_late")
                prefetch = run.prefetch or {}
                lines.append(f"  * node {run.node}: hot set {fmt(run.hot_s)} s, done {fmt(run.done_s)} s, "
                             f"{run.verified_bytes / MB:.1f} MB verified, CPU {run.cpu_s:.1f} s"
                             + (f", prefetch failed blocks {prefetch['failed_blocks']}"
                                if prefetch.get("failed_blocks") else "")
                             + (f", {figures}" if figures else "") + f"; {state}")
    return "\n".join(lines) + "\n"


def cpu_bound_note(model: dict[str, Any]) -> str:
    """Where the model puts the peers start on this machine and with a node's own cores (see model_section)."""
    fitted = model.get("peers")
    if not fitted or not fitted.get("fitted", True):
        return ""
    own = next((row["seconds"] for row in model["rows"] if row["scenario"] == "peers" and row["n"] == fitted["n"]), None)
    if own is None:
        return ""
    return (f"; here {fitted['n']} servers share {model['cores']} cores (bound by {fitted['limit_here']}: the model "
            f"gives {fitted['predicted_here']:.1f} s); with each node's own cores the model gives {own:.1f} s = "
            f"{own / model['t1']:.2f}x")


def peer_bytes_note(results: dict[str, list[Start]], image: Image) -> list[str]:
    """A note when the nodes got more bytes from peers than their share of the hot set as stored."""
    starts = [s for s in results.get("peers", []) if s.complete()]
    received = [r.figures.get("peer_received_bytes", 0) for s in starts for r in s.alive()]
    if not received:
        return []
    n = len(starts[0].nodes)
    share = image.hot_clen * (n - 1) / n
    got = statistics.median(received)
    if got <= TARGET_PEER_BYTES_RATIO * share:
        return []
    return [f"*With peers a node received {got / MB:.0f} MB (median) from its peers, {got / share:.2f}x its share of "
            f"the hot set as stored ((N−1)/N of {image.hot_clen / MB:.0f} MB compressed = {share / MB:.0f} MB): "
            f"blocks beyond the hot list (read-ahead) and blocks an owner held only raw (no frame in its memory) "
            f"cost the sender and the receiver CPU and link.*", ""]


def cpu_section(results: dict[str, list[Start]], context: dict[str, Any]) -> list[str]:
    """Where a node's layer server spent its CPU, per stage (bootseer/cpu.py), against decoding the hot set."""
    cost = context.get("decode_cost")
    lines = ["## Where the CPU goes", ""]
    if cost:
        lines += [f"Decompressing and verifying the hot set's {cost['blocks']:.0f} blocks ({cost['clen'] / MB:.1f} MB "
                  f"compressed, {cost['rlen'] / MB:.1f} MB raw) as the fetcher does, on one core of this machine in the "
                  f"benchmark's process: **{cost['cpu_s']:.2f} CPU s**. A node's layer server, median per node, its "
                  "CPU seconds per stage (`bootseer_stage_cpu_seconds_total`) and the rest of its process (trio's own "
                  "work: FUSE replies, the peers' wire, scheduling; the garbage collector):", ""]
    lines += ["| scenario | CPU s per node | x decode cost | " + " | ".join(CPU_STAGES) + " | outside stages |",
              "|---|---|---|" + "---|" * len(CPU_STAGES) + "---|"]
    for scenario in SCENARIOS:
        runs = [r for s in results.get(scenario, []) for r in s.alive() if r.done_s is not None]
        if not runs or not any(f"cpu_{stage}_s" in r.figures for r in runs for stage in CPU_STAGES):
            continue
        total = statistics.median(r.cpu_s for r in runs)
        stages = [statistics.median(r.figures.get(f"cpu_{stage}_s", 0.0) for r in runs) for stage in CPU_STAGES]
        outside = statistics.median(
            r.cpu_s - sum(r.figures.get(f"cpu_{stage}_s", 0.0) for stage in CPU_STAGES) for r in runs)
        ratio = f"{total / cost['cpu_s']:.2f}" if cost and cost["cpu_s"] > 0 else "—"
        lines.append(f"| {scenario} | {total:.2f} | {ratio} | " + " | ".join(f"{v:.2f}" for v in stages)
                     + f" | {outside:.2f} |")
    return lines + [""]


def stall_note(results: dict[str, list[Start]]) -> list[str]:
    """What the figures say of a start with peers in which no node finished (empty when one did)."""
    stalled = [s for name in ("peers", "peers-kill") for s in results.get(name, []) if not s.times()]
    runs = [r for s in stalled for r in s.alive() if "peer_late" in r.figures]
    if not runs:
        return []
    late = sum(r.figures["peer_late"] for r in runs)
    text = (f"With peers no node finished: each prefetch stopped early (how far each got: Every start, below), "
            f"and the nodes' peer requests went late {late:.0f} times in all (`peers.status` `late`): ")
    text += ("the hedge to the store (after `--peer-deadline` without an answer) never fired, so the nodes waited on "
             "their peers until a request's own limit; the layer servers' logs are in the run's `logs/`."
             if late == 0 else "the store was asked as well, and still the starts did not end in time.")
    return [f"*{text}*", ""]


def checks(results: dict[str, list[Start]], model: dict[str, Any], context: dict[str, Any], image: Image) -> list[str]:
    e1, t1 = model.get("e1"), model.get("t1")
    out = []
    timeout = context["settings"]["timeout"]

    def line(ok: bool | None, text: str) -> None:
        out.append(f"* {'PASS' if ok else 'FAIL' if ok is False else 'NOT MEASURED'}: {text}")

    def unfinished(starts: list[Start]) -> str:
        left = sum(len(s.alive()) - len(s.times()) for s in starts)
        return f"{left} of {sum(len(s.alive()) for s in starts)} nodes had no hot set or replay within {timeout:.0f} s"

    peers = results.get("peers")
    complete = [s for s in peers or [] if s.complete()]
    if not peers or not e1 or not t1:
        why = context["not_run"].get("peers", "no peers run, or no baseline")
        line(None, f"store egress with peers <= {TARGET_EGRESS_RATIO}x one node's alone: {why}")
        line(None, f"slowest node with peers <= {TARGET_SLOWEST_RATIO}x one node alone: {why}")
    elif not complete:
        egress = statistics.median(s.store_egress for s in peers)
        line(False, f"store egress with peers: {egress / MB:.1f} MB = {egress / e1:.2f}x one node's alone, but the "
                    f"start did not complete ({unfinished(peers)}), so the bytes it did not fetch are not in it")
        line(False, f"slowest node with peers <= {TARGET_SLOWEST_RATIO}x one node alone ({t1:.2f} s): "
                    f"{unfinished(peers)}")
    else:
        egress = statistics.median(s.store_egress for s in complete)
        line(egress <= TARGET_EGRESS_RATIO * e1,
             f"store egress with peers {egress / MB:.1f} MB = {egress / e1:.2f}x one node's alone "
             f"(target <= {TARGET_EGRESS_RATIO}x)")
        slowest = statistics.median(s.slowest() for s in complete)
        line(slowest <= TARGET_SLOWEST_RATIO * t1 and len(complete) == len(peers),
             f"slowest node with peers {slowest:.2f} s = {slowest / t1:.2f}x one node alone ({t1:.2f} s) "
             f"(target <= {TARGET_SLOWEST_RATIO}x)"
             + (f"; {len(peers) - len(complete)} rep(s) did not complete" if len(complete) < len(peers) else "")
             + cpu_bound_note(model))
    no_peers = [s for s in results.get("no-peers", []) if s.complete()]
    if no_peers and e1:
        egress = statistics.median(s.store_egress for s in no_peers)
        n = len(no_peers[0].nodes)
        out.append(f"* for comparison, without peers: store egress {egress / MB:.1f} MB = {egress / e1:.2f}x "
                   f"one node's alone (about {n}x expected); slowest "
                   f"{statistics.median(s.slowest() for s in no_peers):.2f} s = "
                   f"{statistics.median(s.slowest() for s in no_peers) / t1:.2f}x one node alone")
    if complete:
        n = len(complete[0].nodes)
        share = image.hot_clen * (n - 1) / n
        received = statistics.median(r.figures.get("peer_received_bytes", 0) for s in complete for r in s.alive())
        alone_blocks = [s.nodes[0].figures.get("store_bytes", 0) for s in results.get("alone", []) if s.complete()]
        fetched = statistics.median(alone_blocks) * (n - 1) / n if alone_blocks else 0.0
        if share and fetched:
            line(received <= TARGET_PEER_BYTES_RATIO * fetched,
                 f"bytes a node received from peers {received / MB:.1f} MB (median) = {received / fetched:.2f}x its "
                 f"compressed share of what a node alone fetches ((N−1)/N of the alone node's "
                 f"{statistics.median(alone_blocks) / MB:.1f} MB of blocks from the store = {fetched / MB:.1f} MB: "
                 f"the hot set and the blocks the kernel reads beyond it), {received / share:.2f}x its share of the "
                 f"hot set alone ({share / MB:.1f} MB) (target <= {TARGET_PEER_BYTES_RATIO}x)")
        if no_peers_complete := [s for s in results.get("no-peers", []) if s.complete()]:
            with_cpu = statistics.median(r.cpu_s for s in complete for r in s.alive())
            without = statistics.median(r.cpu_s for s in no_peers_complete for r in s.alive())
            line(with_cpu <= TARGET_PEER_CPU_RATIO * without,
                 f"a node's layer-server CPU with peers {with_cpu:.2f} s = {with_cpu / without:.2f}x without "
                 f"({without:.2f} s) (target <= {TARGET_PEER_CPU_RATIO}x)")
    cost = context.get("decode_cost")
    alone = [s for s in results.get("alone", []) if s.complete()]
    if cost and alone:
        cpu = statistics.median(s.nodes[0].cpu_s for s in alone)
        line(cpu <= TARGET_DECODE_CPU_RATIO * cost["cpu_s"],
             f"a layer server's CPU for the hot set (node alone) {cpu:.2f} s = {cpu / cost['cpu_s']:.2f}x decompressing "
             f"and verifying its blocks on one core ({cost['cpu_s']:.2f} s) (target <= {TARGET_DECODE_CPU_RATIO}x)")
    kill = results.get("peers-kill")
    deadline = context["settings"]["peer_deadline"]
    if kill and peers:
        delays = []
        for k, p in zip(kill, peers):
            for run in k.alive():
                base = next((r for r in p.nodes if r.node == run.node), None)
                if base is not None and base.done_s is not None and run.done_s is not None:
                    delays.append(run.done_s - base.done_s)
        worst = max(delays, default=None)
        if not all(s.complete() for s in kill + peers):
            line(False, f"a peer killed mid-run delays no node by more than the fallback deadline ({deadline} s): "
                        f"not measurable, the starts did not complete (peers-kill: {unfinished(kill)}; peers: "
                        f"{unfinished(peers)})"
                        + ("" if kill[0].killed_at_s is not None else "; the victim never reached --kill-at"))
        else:
            # Judged on the start (its slowest node): on a machine whose cores every node shares, which node
            # finishes when changes from run to run by more than a deadline, so one node against itself in
            # another run measures scheduling as much as the kill.
            delay = statistics.median(k.slowest() for k in kill) - statistics.median(p.slowest() for p in peers)
            delays = [k.slowest() - p.slowest() for k, p in zip(kill, peers)]
            spread = max(p.slowest() for p in peers) - min(p.slowest() for p in peers)
            # Every rep must keep within the deadline, give or take how much the runs without a kill vary.
            line(all(d <= deadline + spread for d in delays),
                 f"a peer killed mid-run delays the start (its slowest node) by {delay:+.2f} s (median) against the "
                 f"`peers` run, rep by rep {', '.join(f'{d:+.2f}' for d in delays)} s (target: within the fallback "
                 f"deadline {deadline} s plus the {spread:.2f} s the `peers` runs' own slowest nodes spread over); "
                 f"node by node against itself in the `peers` run the worst "
                 f"is {fmt(worst, '+.2f')} s, which on this machine's shared cores is mostly which node the "
                 f"scheduler served last")
    else:
        line(None, f"a killed peer delays no node by more than the fallback deadline ({deadline} s): "
                   f"{context['not_run'].get('peers-kill', 'not run')}")
    return out


def model_section(model: dict[str, Any], image: Image, context: dict[str, Any]) -> list[str]:
    lines = ["## Model: store egress and start time at 1,000 nodes", ""]
    if not model.get("rows"):
        return lines + ["Not fitted: the runs it needs did not complete.", ""]
    lines += [
        "A start is a fixed part plus its bottleneck, the slowest of three: the store's link (store egress / its "
        "rate), the node's own link (bytes the node receives from peers / its rate) and the CPU. A layer "
        "server runs on about one core (its Python holds the GIL; decompression threads add a little), so a "
        "node's CPU term is its server's CPU seconds for the start (fetch, decompress, verify, serve, FUSE); on "
        "this machine, where every node shares its "
        f"{model['cores']} cores, it is also at least the machine's busy CPU seconds over the start / "
        f"{model['cores']} (nginx, the kernel's FUSE and EROFS work, the replay's hashing, other work on the "
        "machine). Fitted to this run: one node's store egress "
        f"E1 = {model['e1'] / MB:.1f} MB, its start t1 = {model['t1']:.2f} s with {model['cpu1']:.1f} CPU s "
        f"(machine: {model['machine1']:.1f} s); the store's link {model['store_rate'] / MB:.0f} MB/s (measured) "
        f"and a node's {model['node_rate'] / MB:.0f} MB/s (configured); fixed part t1 − its bottleneck = "
        f"{model['t_fixed']:.2f} s. Without peers, egress grows as N x the measured egress per node; with peers "
        "it stays at the measured N-node figure (each block crosses the store's link about once; the excess "
        "over E1 is hedged fallbacks and owners' duplicate misses), and each node receives (N−1)/N of the hot "
        "set from peers, as the store's compressed frames.", "",
        "Against the measured points on this machine:", ""]
    for scenario in ("no-peers", "peers"):
        fitted = model.get(scenario)
        if fitted and fitted.get("fitted", True):
            lines.append(f"* `{scenario}`, {fitted['n']} nodes: measured slowest {fmt(fitted['slowest'])} s, "
                         f"model {fmt(fitted['predicted_here'])} s (bound by {fitted['limit_here']}); egress "
                         f"{fitted['egress'] / MB:.1f} MB ({fitted['egress_over_e1']:.2f}x E1); CPU per node "
                         f"{fitted['cpu']:.1f} s, machine {fitted['machine']:.1f} s")
    if model.get("peers_design"):
        lines += ["* `peers`: no start with peers completed, so nothing with peers is fitted: the rows *with* "
                  "below are the design's figures (store egress E1 whatever N, each node receiving (N−1)/N of the "
                  "hot set's frames, the alone node's CPU), not a measurement."]
    lines += ["", "Extrapolated, every node with its own cores (as on a real cluster):", "",
              "| peers | nodes | store egress | start (slowest node) s | limited by |", "|---|---|---|---|---|"]
    for row in model["rows"]:
        egress = row["egress"]
        shown = f"{egress / 1e9:.1f} GB" if egress >= 1e9 else f"{egress / MB:.0f} MB"
        label = "without" if row["scenario"] == "no-peers" else ("with (design)" if model.get("peers_design") else "with")
        lines.append(f"| {label} | {row['n']} | {shown} | "
                     f"{row['seconds']:.1f} | {row['limit']} |")
    lines += ["", "What limits it:", "",
              "* **Without peers, the store's link**: 1,000 nodes each pull the hot set across one store link, "
              "so the start grows linearly with N (E1 x N / store rate); the slowest node is the last served.",
              "* **With peers, the node's own link and the CPU**: every node receives almost the whole hot set "
              "from peers (the store's frames) and its owners send as much, so each node's link carries the "
              "compressed hot set once each way whatever N; the CPU of decompressing and verifying every block is "
              "per node and does not grow.",
              "* **Owner fan-out**: each block's owner serves it to N−1 peers, at most `--peer-max-uploads` at once "
              "and within `--peer-upload-rate`; at 1,000 nodes, 999 requests arrive for each block at about the "
              "same moment, so a peer waits its turn at the owner, and one that waits past `--peer-deadline` "
              "hedges to the store: the model's flat egress holds only while the owners keep up (a fan-out tree "
              "or more owners per block would be the next step). "
              + (f"Measured here with N = {model['peers']['n']} only." if not model.get("peers_design")
                 else "Not measured here: no start with peers completed."),
              "* **This machine**: all servers share its cores, so the measured N-node starts are CPU-bound here "
              "where a real cluster's would not be; the model takes the CPU term per node for the extrapolation."]
    return lines


# --------------------------------------------------------------------------- main


def measure_store_rate(cluster: PeerCluster, image_store: Path) -> float:
    """MB/s of one GET of the largest pack from the store, across the store's link and node 0's."""
    packs = sorted((image_store / "v1" / "packs").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    largest = packs[-1].relative_to(image_store)
    node = cluster.nodes[0]
    done = subprocess.run([*node.member.launcher(), "curl", "-s", "-o", "/dev/null", "-w", "%{size_download} %{time_total}",
                           cluster.store_url + str(largest)], capture_output=True, text=True, timeout=300)
    size, seconds = done.stdout.split()
    return float(size) / float(seconds) / MB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8, help="nodes that start at once (8)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each scenario (3)")
    parser.add_argument("--rate", default="1gbit", help="each node's link, tc syntax (1gbit)")
    parser.add_argument("--store-rate", default="1gbit", help="the store's one link, tc syntax (1gbit)")
    parser.add_argument("--peer-deadline", type=float, default=0.5, help="--peer-deadline of the layer servers (0.5)")
    parser.add_argument("--kill-at", type=float, default=0.5,
                        help="peers-kill: the share of the hot set the victim has fetched when it is killed (0.5)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"which to run ({','.join(SCENARIOS)})")
    parser.add_argument("--cache-dir", type=Path, default=image_build.DEFAULT_CACHE_DIR,
                        help=f"image, store and hot list cache, shared with lazy_bench.py ({image_build.DEFAULT_CACHE_DIR})")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one node's start may take (120)")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "results" / "peers.md")
    parser.add_argument("--report-from", type=Path, metavar="RESULTS_JSON",
                        help="write the report again from a run's results.json (nothing is measured)")
    args = parser.parse_args(argv)
    if args.report_from is not None:
        return write_report(*load_run(args.report_from), args.output)
    if os.geteuid() != 0:
        print("error: the benchmark needs root (network namespaces, tc, FUSE, drop_caches)", file=sys.stderr)
        return 2
    if args.nodes < 2:
        print("error: --nodes must be at least 2", file=sys.stderr)
        return 2
    try:
        rates = rate_bytes(args.rate), rate_bytes(args.store_rate)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario {unknown[0]!r} (one of {', '.join(SCENARIOS)})", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    load = os.getloadavg()[1]
    image_built = image_build.build_image(args.cache_dir)
    work = args.cache_dir / "runs-peers" / str(os.getpid())
    work.mkdir(parents=True)
    for path in (args.cache_dir, args.cache_dir / "runs-peers", work):
        path.chmod(0o755)
    convert_store(image_built, args.cache_dir / "store", work / "convert.log")
    store = peers_store_copy(args.cache_dir)
    hot = record_hot_list(image_built, store, work, args.timeout)
    image = load_image(image_built, store, hot)
    log(f"hot list: {hot['blocks']} blocks, {image.hot_clen / MB:.1f} MB compressed, {image.hot_rlen / MB:.1f} MB raw")
    cost = decode_cost(store, image)
    log(f"decompressing and verifying the hot set's {cost['blocks']:.0f} blocks on one core: {cost['cpu_s']:.2f} CPU s")
    settings = {key: getattr(args, key) for key in ("nodes", "reps", "rate", "store_rate", "peer_deadline",
                                                    "kill_at", "timeout")}
    context: dict[str, Any] = {"settings": settings, "notes": [], "not_run": {}, "load": load,
                               "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                               "argv": ["python", "-m", "bench.peers_bench", *(argv if argv is not None else sys.argv[1:])],
                               "machine": machine(), "code": code_version(),
                               "rates": rates, "decode_cost": cost}
    with_peers = peers_supported()
    if not with_peers:
        for scenario in ("peers", "peers-kill"):
            context["not_run"][scenario] = "the layer server has no `--peer-listen` (peer sharing not in this build)"
    token = write_token(work / "peer-token")
    results: dict[str, list[Start]] = {}
    cluster = PeerCluster(work / "c", store, args.nodes, node_rate=args.rate, store_rate=args.store_rate, start=False)
    try:
        with cluster:
            log(f"{args.nodes} nodes on {cluster.lan.subnet} (tbf {args.rate} each), store {cluster.store_url} "
                f"(tbf {args.store_rate})")
            context["store_rate_mb"] = measure_store_rate(cluster, store)
            log(f"one GET across the store's link: {context['store_rate_mb']:.0f} MB/s")
            flags = peer_flags(cluster, args.nodes, token, args.peer_deadline)
            plan = [("alone", 1, None, None), ("no-peers", args.nodes, None, None)]
            if with_peers:
                plan += [("peers", args.nodes, flags, None), ("peers-kill", args.nodes, flags, args.kill_at)]
            for rep in range(args.reps):
                for scenario, count, flags_of_start, kill_at in plan:
                    if scenario not in wanted:
                        continue
                    start = run_start(cluster, scenario, count, flags_of_start, image, args.timeout, work / "logs",
                                      f"{scenario}{rep}", kill_at)
                    results.setdefault(scenario, []).append(start)
                    log(f"rep {rep} " + summarize(start))
            for node in cluster.nodes:
                node.stop()
        left = leftovers(cluster)
        if left:
            context["notes"].append("Left behind after the run (a bug of the harness): " + ", ".join(left))
    finally:
        for node in cluster.nodes:  # a start that failed half-way
            with contextlib.suppress(OSError):
                keep_log(node, work / "logs", "last")
    context["minutes"] = (time.monotonic() - started) / 60
    save_run(work / "results.json", results, image, context)
    log(f"results in {work / 'results.json'}, logs in {work / 'logs'}")
    return write_report(results, image, context, args.output)


def write_report(results: dict[str, list[Start]], image: Image, context: dict[str, Any], output: Path) -> int:
    """Fit the model and write the report to ``output``."""
    node_rate, store_rate = context["rates"]
    model = fit_model(results, image, store_rate=min(context["store_rate_mb"] * MB, store_rate), node_rate=node_rate)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report(results, image, context, model))
    log(f"wrote {output}")
    return 0


def save_run(path: Path, results: dict[str, list[Start]], image: Image, context: dict[str, Any]) -> None:
    """A run's measurements as JSON (``--report-from`` writes the report again from them)."""
    data = {"context": context, "results": {k: [dataclasses.asdict(s) for s in v] for k, v in results.items()},
            "image": {"chains": image.chains, "hot": image.hot, "hot_clen": image.hot_clen,
                      "hot_rlen": image.hot_rlen}}  # not its frames: the decode cost is in the context
    path.write_text(json.dumps(data, indent=1, default=str))


def load_run(path: Path) -> tuple[dict[str, list[Start]], Image, dict[str, Any]]:
    data = json.loads(path.read_text())
    results = {k: [Start.from_json(s) for s in v] for k, v in data["results"].items()}
    return results, Image(replay=[], **data["image"]), data["context"]


def rate_bytes(rate: str) -> float:
    """Bytes/s of a tc rate (``1gbit``, ``500mbit``)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8
    raise ValueError(f"rate {rate!r}: expected a number and gbit, mbit or kbit")


if __name__ == "__main__":
    sys.exit(main())
