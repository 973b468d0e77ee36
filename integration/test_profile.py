"""The start-up profiler end to end, with every real part: registry, ``bootseer convert`` into a local
store, ``bootseer-snapshotter --store`` and its layer server, a private containerd watched through its
events API (``bootseer profile containerd``), ``bootseer rpull``, a dependency snapshot stacked by the
snapshotter, a checkpoint read through ``bootseer ckpt mount`` and marks the job leaves in
``/.bootseer`` with plain ``touch``.

One demo job's start goes through every phase (lazy image, container start, dependency restore,
checkpoint, import, first step); ``bootseer profile collect`` makes one trace of it, which has each
phase in order with plausible durations and the events of each component; ``report`` writes a Chrome
trace (valid JSON, the expected events) and an HTML timeline that headless Chromium renders with
every phase; the trace published to the store merges with simulated nodes' and the straggler is found.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from bootseer.images.chains import chain_ids
from bootseer.blockstore.objects.store import open_store_writer
from bootseer.depsnap.capture import publish_capture, scan, upper_change
from bootseer.snapshotter.deps_hooks import DEPS_LABEL, EXCLUDED
from bootseer.depsnap.key import compute_key, container_store_key
from bootseer.profile.cluster import fetch_job, job_report, publish
from bootseer.profile.events import read_spool
from bootseer.profile.trace import Trace, phases
from integration import harness
from integration.harness import PARTS, lazy_layers, part_path
from tests.support.chromium import render
from tests.support.containerd import SNAPSHOTTER_NAME
from tests.support.processes import run
from tests.support.stack import Stack
from tests.support.waiting import wait_for_component

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BOOTSEER = harness.BOOTSEER
JOB = "demo-job-1"
NODE = "it-node-0"
CKPT_SIZE = 16 << 20
INSTALL = ["sh", "-c", "install /opt/deps"]  # the job's install command: what its dependency key is of

# The demo job: dependencies (restored: the stacked layer's files), the checkpoint through the mount,
# "imports" (reading the image's files, lazily fetched), then the first step. Marks are plain touches.
SCRIPT = (
    "touch /.bootseer/dependencies.start; [ -e /.bootseer/deps-hit ] || { echo NO-DEPS-HIT; exit 9; }; "
    "cat /opt/deps/lib/* > /dev/null && sh /opt/deps/bin/tool; touch /.bootseer/dependencies.end; "
    "cat /ckpt/model.bin | wc -c; "
    "touch /.bootseer/import.start; "
    + "; ".join(f"cat {part_path(i)} > /dev/null" for i in range(PARTS))
    + "; sleep 0.2; touch /.bootseer/import.end; sleep 0.3; touch /.bootseer/first_step; echo STEP-1"
)


class Background:
    """A ``bootseer`` command in the background that prints a ready line; stopped with SIGTERM."""

    def __init__(self, argv: list[str], ready: str, log: Path, env: dict[str, str]) -> None:
        self.name = " ".join(argv[1:3])
        self.log = log
        self.file = open(log, "wb")
        self.process = subprocess.Popen(argv, stdout=self.file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        wait_for_component(f"{argv[1:3]} to be ready", lambda: ready in log.read_text(errors="replace"), 60,
                           interval=0.1, alive=self)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:  # for wait_for_component's liveness check
        return self.process.poll()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)
        finally:
            self.file.close()


@pytest.fixture
def base(runnable):
    # Short: unix socket paths must fit in 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="bs-prof-"))
    yield directory
    if not os.environ.get("BOOTSEER_KEEP_TMP"):
        shutil.rmtree(directory, ignore_errors=True)


def publish_deps(stack: Stack, source: Path, key: str, top: str) -> None:
    """A dependency snapshot made earlier (as a first boot's capture makes it), published to the stack's store."""
    (source / "opt" / "deps" / "bin").mkdir(parents=True)
    (source / "opt" / "deps" / "lib").mkdir()
    (source / "opt" / "deps" / "bin" / "tool").write_text("echo tool-ran\n")
    for i in range(4):
        (source / "opt" / "deps" / "lib" / f"lib{i}.so").write_bytes(bytes([i]) * (1 << 20))
    tree = scan(source, exclude=EXCLUDED)
    with open_store_writer(stack.store_url) as writer:
        # Under the name the snapshotter looks up for a container of the stack's namespace.
        result = publish_capture(writer, key=container_store_key(key, namespace=stack.namespace), root=source, tree=tree, change=upper_change(tree), mode="container",
                                 parent=top, overlay_upper=True, exclude=EXCLUDED, command=INSTALL,
                                 inputs={"test": "profile"})
    assert result.published


def test_demo_job_through_every_phase(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = base / "spool"
    # Every process of the node writes into one spool: the daemon and its layer server (they inherit the
    # environment), rpull, the checkpoint mount and the containerd watcher.
    monkeypatch.setenv("BOOTSEER_PROFILE", str(spool))
    monkeypatch.setenv("BOOTSEER_NODE", NODE)
    env = dict(os.environ, BOOTSEER_JOB=JOB)
    stack = Stack(base / "stack", store=True)
    background: list[Background] = []
    try:
        stack.start()
        image, ref = stack.build_and_push(name="bootseer/profiled", layers=lazy_layers())
        run([BOOTSEER, "convert", "--plain-http", "--store", stack.store_url, ref], timeout=300)
        top = chain_ids(image.diff_ids)[-1]
        key = compute_key(INSTALL, base_chain=top).key
        publish_deps(stack, base / "deps-src", key, top)
        ckpt_src, ckpt_mnt = base / "ckpt-src", base / "ckpt-mnt"
        ckpt_src.mkdir()
        ckpt_mnt.mkdir()
        (ckpt_src / "model.bin").write_bytes(os.urandom(CKPT_SIZE))

        background.append(Background([BOOTSEER, "profile", "containerd", "--address", str(stack.containerd.address),
                                      "--namespace", stack.namespace], "watching containerd", base / "watch.log", env))
        background.append(Background([BOOTSEER, "ckpt", "mount", str(ckpt_src), str(ckpt_mnt), "--allow-other"],
                                     "mounted", base / "ckpt.log", env))
        wait_for_component("the checkpoint mount's first sample in the spool",
                           lambda: any(e.name == "checkpoint.bytes" for e in read_spool(spool)[0]), 60)
        started = time.time()  # after that first sample: the checkpoint's bytes are all counted after it

        # The start: pull (lazy), run the job.
        pulled = subprocess.run([BOOTSEER, "rpull", "--address", str(stack.containerd.address), "--namespace",
                                 stack.namespace, "--plain-http", "--snapshotter", SNAPSHOTTER_NAME, ref],
                                capture_output=True, text=True, timeout=300, env=env)
        assert pulled.returncode == 0, pulled.stderr
        out = stack.containerd.ctr_out(
            "run", "--rm", "--fifo-dir", str(stack.fifo_dir), "--snapshotter", stack.snapshotter_name,
            "--snapshotter-label", f"{DEPS_LABEL}={key}",
            "--mount", f"type=bind,src={ckpt_mnt},dst=/ckpt,options=rbind:ro", ref, "profiled-1", "sh", "-c", SCRIPT,
            timeout=180)
        assert out.split() == ["tool-ran", str(CKPT_SIZE), "STEP-1"], out
        # containerd's last event of the job and the layer server's bytes reach the spool; the
        # checkpoint mount and the watcher write their final samples as they stop, below.
        wait_for_component("the job's task.exit and the layer server's bytes in the spool",
                           lambda: job_settled(read_spool(spool)[0], "profiled-1", started), 60)
        for process in reversed(background):
            assert process.stop() == 0, process.log.read_text()
        background.clear()

        trace_path, html, chrome = base / "trace.json", base / "profile.html", base / "profile.trace.json"
        collected = subprocess.run([BOOTSEER, "profile", "collect", "--spool", str(spool), "--job", JOB, "--since",
                                    str(started), "-o", str(trace_path), "--publish", stack.store_url],
                                   capture_output=True, text=True, timeout=120, env=env)
        assert collected.returncode == 0, collected.stderr
        print(collected.stdout)
        trace = Trace.load(trace_path)
        assert (trace.node, trace.job) == (NODE, JOB)
        check_trace(trace, image_layers=len(image.diff_ids))

        reported = subprocess.run([BOOTSEER, "profile", "report", str(trace_path), "--html", str(html),
                                   "--chrome", str(chrome)], capture_output=True, text=True, timeout=120)
        assert reported.returncode == 0, reported.stderr
        check_chrome_trace(json.loads(chrome.read_text()))
        check_html(html, base)
        check_merge(stack.store_url, trace)
        check_prefetch_of_a_later_start(stack, ref, key, spool, env)
    finally:
        for process in background:
            process.stop()
        stack.close()
        print(stack.logs())
        assert not stack.teardown_errors, f"teardown: {stack.teardown_errors}"


def job_settled(events: list, container: str, since: float) -> bool:
    """Whether containerd's exit of ``container``'s task and a non-zero ``layers.bytes`` sample are in ``events``."""
    exited = any(e.name == "task.exit" and e.start >= since and container in e.attrs.values() for e in events)
    return exited and any(e.name == "layers.bytes" and e.value > 0 for e in events)


def check_prefetch_of_a_later_start(stack: Stack, ref: str, key: str, spool: Path, env: dict[str, str]) -> None:
    """The first boot's hot list (sealed when its container went) is prefetched at the job's next start.

    The first boot ran on a stacked deps layer, so its list is keyed by the deps layer's ChainID
    (docs/depsnap.md, "Hot lists"), not the image's top: the image pulled again alone has no list,
    and the prefetch starts when the job's next container (same deps label) is prepared.
    """
    sealed = [e for e in read_spool(spool)[0] if e.name == "hotlist.sealed"]
    assert sealed and sealed[0].attrs["outcome"] == "published", sealed
    stack.containerd.ctr("images", "rm", "--sync", ref)
    wait_for_component("the image's snapshots to go", lambda: not stack.containerd.snapshots(), 60)
    again = time.time()
    pulled = subprocess.run([BOOTSEER, "rpull", "--address", str(stack.containerd.address), "--namespace",
                             stack.namespace, "--plain-http", "--snapshotter", SNAPSHOTTER_NAME, ref],
                            capture_output=True, text=True, timeout=300, env=env)
    assert pulled.returncode == 0, pulled.stderr
    # Left running until the prefetch has ended: a container removed earlier would cut it short.
    stack.containerd.ctr("run", "-d", "--fifo-dir", str(stack.fifo_dir), "--snapshotter", stack.snapshotter_name,
                         "--snapshotter-label", f"{DEPS_LABEL}={key}", ref, "profiled-2", "sleep", "600", timeout=180)

    def prefetch_ended() -> list:
        return [e for e in read_spool(spool)[0] if e.name == "prefetch" and e.start >= again]

    try:
        spans = wait_for_component("the prefetch to end", prefetch_ended, 60)
    finally:
        stack.remove_container("profiled-2")
    found = [e for e in read_spool(spool)[0] if e.start >= again]
    starts = [e for e in found if e.name == "prefetch.start"]
    assert starts and starts[0].attrs["planned_blocks"] == sealed[0].attrs["blocks"]
    assert spans[0].attrs["background"] and spans[0].attrs["finished"]
    assert spans[0].attrs["blocks"] + spans[0].attrs["cached_blocks"] == sealed[0].attrs["blocks"]
    assert any(e.name == "prefetch.bytes" for e in found)


def check_trace(trace: Trace, image_layers: int) -> None:
    names = [e.name for e in trace.events]
    by_name = {}
    for e in trace.events:
        by_name.setdefault(e.name, []).append(e)
    # Each component's events are there.
    pull = by_name["image.pull"][0]
    assert pull.attrs["lazy"] == image_layers and pull.attrs["downloaded"] == 0
    assert [e.attrs["state"] for e in by_name["image.layer"]] == ["lazy"] * image_layers
    for name in ("container.prepare", "container.create", "task.create", "task.start", "task.exit",
                 "container.first_read", "deps.hit", "mark.dependencies.start", "mark.import.end",
                 "mark.first_step", "layers.bytes", "checkpoint.bytes"):
        assert name in by_name, f"no {name} event in {sorted(set(names))}"
    assert by_name["deps.hit"][0].attrs["container"] == "profiled-1"
    assert by_name["task.exit"][0].attrs["exit_status"] == 0
    assert max(e.value for e in by_name["checkpoint.bytes"]) - min(e.value for e in by_name["checkpoint.bytes"]) >= CKPT_SIZE
    assert max(e.value for e in by_name["layers.bytes"]) > 0
    # Every phase, in order, with plausible durations.
    found = phases(trace)
    order = ["image", "container", "dependencies", "checkpoint", "import", "first_step"]
    assert [p.name for p in found] == order
    starts = [p.start for p in found]
    assert starts == sorted(starts), [(p.name, p.start - starts[0]) for p in found]
    for p in found:
        assert 0 < p.duration < 120, (p.name, p.duration)
    by_phase = {p.name: p for p in found}
    assert by_phase["first_step"].duration >= 0.3 - 0.05  # the job slept 0.3 s between import.end and first_step
    assert by_phase["import"].duration >= 0.2 - 0.05
    assert by_phase["checkpoint"].bytes >= CKPT_SIZE
    assert by_phase["container"].end == by_name["task.start"][0].start
    task_start = by_name["task.start"][0].start
    assert by_phase["image"].end <= by_name["container.prepare"][0].start <= task_start
    assert by_name["mark.first_step"][0].start - pull.start < 120


def check_chrome_trace(data: dict) -> None:
    evs = data["traceEvents"]
    spans = {e["name"] for e in evs if e["ph"] == "X"}
    assert {"image.pull", "image.layer", "phase image", "phase container", "phase dependencies", "phase checkpoint",
            "phase import", "phase first_step"} <= spans
    instants = {e["name"] for e in evs if e["ph"] == "i"}
    assert {"task.start", "task.create", "mark.first_step", "deps.hit"} <= instants
    assert {"checkpoint.bytes", "layers.bytes"} <= {e["name"] for e in evs if e["ph"] == "C"}
    assert all(e["ts"] >= 0 for e in evs if "ts" in e)


def check_html(page: Path, out: Path) -> None:
    dom, png = render(page, out)
    for label in ("image ", "container start ", "dependencies ", "checkpoint ", "import ", "first step ",
                  "bytes fetched over time", "checkpoint.bytes", "layers.bytes"):
        assert label in dom, label
    assert dom.count('class="phase"') == 6
    keep = os.environ.get("BOOTSEER_PROFILE_ARTIFACTS")
    if keep:
        shutil.copy(png, Path(keep) / "integration-timeline.png")
        shutil.copy(page, Path(keep) / "integration-profile.html")


def check_merge(store_url: str, trace: Trace) -> None:
    """The real node's trace (published by collect) and three simulated nodes': the slow one is the straggler.

    A simulated node is the real trace with everything from the end of its checkpoint on moved later
    (its checkpoint read that much longer).
    """
    from dataclasses import replace

    from bootseer.profile.events import Event

    checkpoint = next(p for p in phases(trace) if p.name == "checkpoint")
    baseline = min(e.value for e in trace.events if e.name == "checkpoint.bytes")
    delays = {"sim-1": 0.0, "sim-2": 0.05, "sim-3": 30.0}
    for node, delay in delays.items():
        moved = [replace(e, node=node, start=e.start + delay, end=None if e.end is None else e.end + delay)
                 if e.start >= checkpoint.end else replace(e, node=node) for e in trace.events]
        # Its first checkpoint bytes came on time (the read began where the real node's did).
        moved.append(Event("checkpoint.bytes", "counter", checkpoint.start + 0.01, phase="checkpoint", node=node,
                           value=baseline + 1))
        with open_store_writer(store_url) as store:
            publish(Trace(node=node, job=trace.job, events=sorted(moved, key=lambda e: e.start)), store)
    with open_store_writer(store_url) as store:
        traces = fetch_job(store, JOB)
    assert sorted(t.node for t in traces) == sorted([NODE, *delays])
    merged = job_report(traces, JOB)
    assert merged.gated_by == "sim-3"
    assert [s["node"] for s in merged.stragglers] == ["sim-3"]
    assert merged.stragglers[0]["phase"] == "checkpoint"
    assert merged.stragglers[0]["phase_behind_s"] == pytest.approx(30.0, abs=0.5)


def test_profile_run_takes_a_containers_marks_through_a_bind_mount(stack: Stack, pulled, tmp_path: Path) -> None:
    """Outside the snapshotter's marks dir (any snapshotter): ``bootseer profile run -- ctr run`` with
    ``$BOOTSEER_MARKS`` bind-mounted at ``/.bootseer``; the container's ``touch`` is the mark."""
    _, ref = pulled
    ctr = (f'{stack.containerd.install.ctr} -a {stack.containerd.address} -n {stack.namespace} run --rm --fifo-dir {stack.fifo_dir} '
           f'--snapshotter {stack.snapshotter_name} '
           f'--mount "type=bind,src=$BOOTSEER_MARKS,dst=/.bootseer,options=rbind:rw" {ref} marks-1 '
           f'sh -c "sleep 0.2; touch /.bootseer/import.end; sleep 0.2; touch /.bootseer/first_step"')
    base = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    done = subprocess.run([BOOTSEER, "profile", "run", "--spool", str(tmp_path / "spool"), "--job", "bind-1", "-o",
                           str(tmp_path / "t.json"), "--", "sh", "-c", ctr], capture_output=True, text=True,
                          timeout=180, env=base)
    assert done.returncode == 0, done.stderr
    trace = Trace.load(tmp_path / "t.json")
    by_name = {e.name: e for e in trace.events}
    run = by_name["job.run"]
    assert run.start < by_name["mark.import.end"].start < by_name["mark.first_step"].start <= run.end
    assert [p.name for p in phases(trace)] == ["import", "first_step"]
    assert 0.15 < next(p for p in phases(trace) if p.name == "first_step").duration < 60


def test_compare_a_start_on_overlayfs_with_one_on_bootseer(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before and after BootSeer, on one node: the same job pulled and run on containerd's overlayfs
    (``ctr images pull``) and on BootSeer (``bootseer rpull``, lazy), each under ``bootseer profile run``;
    ``bootseer profile compare`` puts the two traces side by side and draws both on one time scale."""
    spool = base / "spool"
    monkeypatch.setenv("BOOTSEER_PROFILE", str(spool))
    monkeypatch.setenv("BOOTSEER_NODE", NODE)
    stack = Stack(base / "stack", store=True)
    watcher = None
    try:
        stack.start()
        image, ref = stack.build_and_push(name="bootseer/compare", layers=lazy_layers())
        run([BOOTSEER, "convert", "--plain-http", "--store", stack.store_url, ref], timeout=300)
        env = dict(os.environ)
        watcher = Background([BOOTSEER, "profile", "containerd", "--address", str(stack.containerd.address),
                              "--namespace", stack.namespace], "watching containerd", base / "watch.log", env)
        ctr = f"{stack.containerd.install.ctr} -a {stack.containerd.address} -n {stack.namespace}"
        job = ("; ".join(f"cat {part_path(i)} > /dev/null" for i in range(PARTS))
               + "; touch /.bootseer/import.end; sleep 0.2; touch /.bootseer/first_step")
        pulls = {"overlayfs": f"{ctr} images pull --plain-http --snapshotter overlayfs {ref} > /dev/null",
                 "bootseer": f"{BOOTSEER} rpull --address {stack.containerd.address} --namespace {stack.namespace} "
                             f"--plain-http --snapshotter bootseer {ref} > /dev/null"}
        for name, pull in pulls.items():
            script = (f'touch "$BOOTSEER_MARKS/image.start"; {pull}; touch "$BOOTSEER_MARKS/image.end"; '
                      f'{ctr} run --rm --fifo-dir {stack.fifo_dir} --snapshotter {name} '
                      f'--mount "type=bind,src=$BOOTSEER_MARKS,dst=/.bootseer,options=rbind:rw" {ref} job-{name} '
                      f'sh -c "{job}"')
            done = subprocess.run([BOOTSEER, "profile", "run", "--job", f"cmp-{name}", "-o", str(base / f"{name}.json"),
                                   "--", "sh", "-c", script], capture_output=True, text=True, timeout=300, env=env)
            assert done.returncode == 0, done.stderr
        assert watcher.stop() == 0  # the traces are written: what the watcher still writes is not in them
        watcher = None
        before, after = Trace.load(base / "overlayfs.json"), Trace.load(base / "bootseer.json")
        for trace in (before, after):
            assert [p.name for p in phases(trace)] == ["image", "container", "import", "first_step"], trace.job
        lazy = [e for e in after.events if e.name == "image.layer"]
        assert lazy and all(e.attrs["state"] == "lazy" for e in lazy)
        assert not any(e.name == "image.layer" for e in before.events)  # ctr pull is containerd's own
        page = base / "compare.html"
        compared = subprocess.run([BOOTSEER, "profile", "compare", str(base / "overlayfs.json"),
                                   str(base / "bootseer.json"), "--names", "overlayfs,bootseer", "--html", str(page)],
                                  capture_output=True, text=True, timeout=120)
        assert compared.returncode == 0, compared.stderr
        print(compared.stdout)
        lines = compared.stdout.splitlines()
        assert lines[0].split()[:3] == ["phase", "overlayfs", "bootseer"]
        assert [line.split()[0] for line in lines[1:6]] == ["image", "container", "import", "first", "total"]
        dom, png = render(page, base)
        assert dom.count("<svg") == 2 and dom.count('class="phase"') == 8
        assert "overlayfs: " in dom and "bootseer: " in dom
        keep = os.environ.get("BOOTSEER_PROFILE_ARTIFACTS")
        if keep:
            shutil.copy(png, Path(keep) / "compare-timeline.png")
    finally:
        if watcher is not None:
            watcher.stop()
        stack.close()
        print(stack.logs())
        assert not stack.teardown_errors, f"teardown: {stack.teardown_errors}"
