"""The start-up profiler without containerd: events and the spool, marks, the snapshotter's hooks on a
real snapshotter, samplers on trio's autojump clock, phases, the table, the Chrome trace, the HTML
timeline in headless Chromium, publishing to a store and merging nodes, the CLI, containerd's
event envelopes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import trio
import trio.testing

from bootseer.profile import events, hooks
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.profile.cluster import fetch_job, job_report, job_table, percentile, publish
from bootseer.profile.events import Event, EventError, Spool, read_marks, read_spool
from bootseer.profile.render import chrome_trace, compare_table, html_page, table
from bootseer.profile.screenshot import png_size
from bootseer.profile.trace import Trace, TraceError, collect, phases, start_window
from tests.support.chromium import render, require_chromium

REPO = Path(__file__).resolve().parents[2]
BOOTSEER = [sys.executable, "-m", "bootseer.cli"]


@pytest.fixture
def spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Profiling on for this process, into a fresh spool; off again (and the environment restored) after."""
    directory = tmp_path / "spool"
    monkeypatch.setenv(events.ENV_PROFILE, "")
    monkeypatch.setenv(events.ENV_NODE, "node-a")
    monkeypatch.setenv(events.ENV_JOB, "")
    hooks._awaiting_first_read.clear()
    events.enable(directory)
    try:
        yield directory
    finally:
        events.disable()
        hooks._awaiting_first_read.clear()


# --------------------------------------------------------------------------- events, spool


def test_off_costs_no_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events.disable()

    def no_io(*args, **kwargs):
        raise AssertionError("I/O while profiling is off")

    monkeypatch.setattr(os, "write", no_io)
    monkeypatch.setattr(os, "open", no_io)
    events.emit("x.y", phase="image", a=1)
    events.counter("x.bytes", 5)
    with events.span("x.span") as extra:
        extra["bytes"] = 3
    assert events.traced("x.f")(lambda v: v + 1)(1) == 2
    hooks.container_prepared("ns/1/c", "sha256:p", {}, tmp_path)
    hooks.layer_read(None, "l")
    monkeypatch.undo()
    assert not any(tmp_path.iterdir())
    assert trio.run(hooks.sample_counter, "x", lambda: 1) is None  # returns at once


def test_events_round_trip_through_the_spool(spool: Path) -> None:
    events.emit("image.pull", "span", start=10.0, end=12.5, phase="image", bytes=100, image="r")
    events.counter("layers.bytes", 42, phase="image")
    events.emit("mark.first_step", start=20.0, mark="first_step")
    found, problems = read_spool(spool)
    assert problems == []
    assert [e.name for e in found] == ["image.pull", "mark.first_step", "layers.bytes"]
    pull = found[0]
    assert (pull.kind, pull.start, pull.end, pull.bytes, pull.node, pull.pid, pull.attrs) == (
        "span", 10.0, 12.5, 100, "node-a", os.getpid(), {"image": "r"})
    assert found[2].value == 42
    assert Event.from_json(json.loads(json.dumps(pull.to_json()))) == pull


def test_spool_file_is_rotated_and_the_spool_pruned(tmp_path: Path) -> None:
    writer = Spool(tmp_path, file_limit=2000)
    for i in range(100):
        writer.write(Event(name="e", kind="instant", start=float(i), attrs={"i": i}))
    writer.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"events-{os.getpid()}.1.jsonl", f"events-{os.getpid()}.jsonl"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    kept, _ = read_spool(tmp_path)
    assert kept[-1].attrs == {"i": 99} and len(kept) < 100  # the oldest generation is gone, the newest kept
    # Opening a spool prunes it to its limit, oldest files first.
    old = tmp_path / "events-1.jsonl"
    old.write_bytes(b"x" * 5000)
    os.utime(old, (1, 1))
    Spool(tmp_path, spool_limit=4500)
    assert not old.exists() and (tmp_path / f"events-{os.getpid()}.jsonl").exists()


def test_damaged_spool_lines_are_reported_not_fatal(tmp_path: Path) -> None:
    good = Event(name="a", kind="instant", start=1.0).to_json()
    (tmp_path / "events-7.jsonl").write_text(
        json.dumps(good) + "\n" + '{"v": 1, "name": "b", "kind": "span", "start": 2}\n' + '{"v": 1, "na')
    found, problems = read_spool(tmp_path)
    assert [e.name for e in found] == ["a"]
    assert len(problems) == 2 and "needs an end" in problems[0]


@pytest.mark.parametrize("record, message", [
    ({"v": 2, "name": "a", "kind": "instant", "start": 1}, "version"),
    ({"v": 1, "kind": "instant", "start": 1}, "no name"),
    ({"v": 1, "name": "a", "kind": "blip", "start": 1}, "kind must be"),
    ({"v": 1, "name": "a", "kind": "instant"}, "no start"),
    ({"v": 1, "name": "a", "kind": "instant", "start": "soon"}, "'start' must be"),
    ({"v": 1, "name": "a", "kind": "span", "start": 2, "end": 1}, "needs an end"),
    ({"v": 1, "name": "a", "kind": "instant", "start": 1, "phase": "lunch"}, "unknown phase"),
    ({"v": 1, "name": "a", "kind": "instant", "start": 1, "pid": True}, "'pid' must be"),
    ([], "JSON object"),
])
def test_bad_event_records_are_refused_clearly(record, message: str) -> None:
    with pytest.raises(EventError, match=message):
        Event.from_json(record)


def test_span_and_traced_record_duration_bytes_and_errors(spool: Path) -> None:
    with events.span("deps.run", phase="dependencies", key="k") as extra:
        time.sleep(0.01)
        extra["bytes"] = 7
    with pytest.raises(KeyError):
        with events.span("deps.capture", phase="dependencies"):
            raise KeyError("x")
    traced = events.traced("checkpoint.read", phase="checkpoint", attrs=lambda data: {"bytes": len(data)})(
        lambda: b"12345")
    assert traced() == b"12345"
    found = {e.name: e for e in read_spool(spool)[0]}
    assert found["deps.run"].duration >= 0.01 and found["deps.run"].bytes == 7 and found["deps.run"].attrs == {"key": "k"}
    assert found["deps.capture"].attrs == {"error": "KeyError"}
    assert found["checkpoint.read"].bytes == 5 and found["checkpoint.read"].phase == "checkpoint"


def test_use_root_needs_profile_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events.disable()
    monkeypatch.setattr(events, "_wants_root", False)
    events.use_root(tmp_path)
    assert not events.enabled() and not (tmp_path / "profile").exists()
    monkeypatch.setenv(events.ENV_PROFILE, "1")
    monkeypatch.setattr(events, "_wants_root", True)
    try:
        events.use_root(tmp_path)
        assert events.enabled() and events.spool().directory == tmp_path / "profile"
        assert os.environ[events.ENV_PROFILE] == str(tmp_path / "profile")  # children inherit the path
    finally:
        events.disable()


# --------------------------------------------------------------------------- marks


def test_marks_python_and_shell_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events.disable()
    monkeypatch.setenv(events.ENV_MARKS, str(tmp_path))
    before = time.time()
    assert events.mark("imports_done", rank=3)
    assert events.mark("imports_done")
    (tmp_path / "first_step").touch()  # the shell form
    os.utime(tmp_path / "first_step", (before + 5, before + 5))
    (tmp_path / "not a mark").write_text("x")
    os.symlink("/etc/passwd", tmp_path / "evil")
    found = read_marks(tmp_path)
    assert [(m[0], m[3]) for m in found] == [("imports_done", {"rank": 3}), ("imports_done", {}),
                                             ("first_step", {})]
    assert found[0][1] >= before and found[0][2] == os.getpid() and found[2][1] == before + 5
    with pytest.raises(ValueError, match="mark name"):
        events.mark("../etc/passwd")
    monkeypatch.setenv(events.ENV_MARKS, str(tmp_path / "absent"))
    assert events.mark("first_step") is False  # nowhere to record: nothing happens


def test_mark_with_profiling_on_is_an_event(spool: Path) -> None:
    assert events.mark("first_step", step=1)
    (found,), _ = read_spool(spool)
    assert found.name == "mark.first_step" and found.attrs == {"mark": "first_step", "step": 1}


def test_mark_api_is_dependency_free() -> None:
    # A job imports it without trio, grpc or BootSeer's other parts.
    code = ("import sys; import bootseer.profile as p; "
            "bad = [m for m in ('trio', 'grpc', 'bootseer.blockstore', 'bootseer.fetch') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, events.ENV_PROFILE: ""}).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- the snapshotter's hooks


def test_snapshotter_gives_containers_a_marks_dir_and_keeps_their_marks(spool: Path, tmp_path: Path) -> None:
    from bootseer.snapshotter.snapshots import Snapshotter

    snap = Snapshotter(tmp_path / "root")
    try:
        snap.prepare("ns/1/base-extract", "")
        snap.commit("base", "ns/1/base-extract")
        # A layer's extraction snapshot (the unpacker's ref label) gets nothing: it would end up in the layer.
        snap.prepare("ns/2/extract", "base", {"containerd.io/snapshot.ref": "sha256:" + "1" * 64})
        snap.prepare("ns/3/job-1", "base")
        uppers = sorted((tmp_path / "root" / "snapshots").glob("*/fs"))
        marks_dirs = [u / ".bootseer" for u in uppers if (u / ".bootseer").exists()]
        assert len(marks_dirs) == 1
        assert marks_dirs[0].stat().st_mode & 0o7777 == 0o1777
        prepared = [e for e in read_spool(spool)[0] if e.name == "container.prepare"]
        assert [(e.attrs["container"], e.phase) for e in prepared] == [("job-1", "container")]
        # The job leaves marks (shell and Python forms); collect sees them while the container lives...
        (marks_dirs[0] / "first_step").touch()
        live = collect(spool, since=0)
        assert [e.name for e in live.events if e.name.startswith("mark.")] == ["mark.first_step"]
        # ... and after its snapshot is removed (ctr run --rm), from the spool.
        snap.remove("ns/3/job-1")
        assert not marks_dirs[0].exists()
        spooled = [e for e in read_spool(spool)[0] if e.name == "mark.first_step"]
        assert len(spooled) == 1 and spooled[0].attrs["container"] == "job-1"
        assert [e.name for e in collect(spool, since=0).events if e.name.startswith("mark.")] == ["mark.first_step"]
    finally:
        snap.close()


def test_first_read_of_an_announced_container(spool: Path) -> None:
    hooks.layer_read(None, "sha256:a")  # nobody announced: no event
    hooks.armed_first_read("ns/5/job-1")
    hooks.armed_first_read("ns/6/job-2")
    hooks.layer_read("job-2", "sha256:b")
    hooks.layer_read(None, "sha256:c")  # unattributed: the one still waiting
    hooks.layer_read(None, "sha256:d")  # both had theirs
    reads = [e for e in read_spool(spool)[0] if e.name == "container.first_read"]
    assert [(e.attrs["container"], e.attrs["layer"]) for e in reads] == [("job-2", "sha256:b"), ("job-1", "sha256:c")]


def test_counter_sampler_on_the_autojump_clock(spool: Path) -> None:
    value = [0]

    async def main() -> None:
        ended = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: hooks.sample_counter("checkpoint.bytes", lambda: value[0], phase="checkpoint",
                                                            until=ended, source="s3://b/ckpt"))
            for step in (0, 100, 100, 250):
                value[0] = step
                await trio.sleep(1.0)
            value[0] = 300  # changed just before the end: the final sample keeps it
            ended.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    samples = [e for e in read_spool(spool)[0] if e.name == "checkpoint.bytes"]
    assert [e.value for e in samples] == [0, 100, 250, 300]
    assert all(e.kind == "counter" and e.phase == "checkpoint" and e.attrs == {"source": "s3://b/ckpt"} for e in samples)


def test_prefetch_sampler_start_progress_end(spool: Path) -> None:
    from bootseer.hotlist.prefetch import PrefetchStats, sample_prefetch

    class FakePrefetch:  # the three attributes sample_prefetch reads, as hotlist.prefetch.Prefetch has them
        image, profile = "sha256:top", ""

        def __init__(self) -> None:
            self.stats = PrefetchStats(planned_blocks=3, planned_bytes=300)
            self.ended = trio.Event()

    prefetch = FakePrefetch()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_prefetch, prefetch)
            for fetched in (100, 200, 300):
                await trio.sleep(0.5)
                prefetch.stats.fetched_bytes = fetched
                prefetch.stats.fetched_blocks += 1
            await trio.sleep(0.5)
            prefetch.stats.finished = True
            prefetch.ended.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    found = read_spool(spool)[0]
    # (Wall-clock times: the autojump clock moves trio's time only, so the order of equal times is not checked.)
    assert sorted(e.name for e in found if e.kind != "counter") == ["prefetch", "prefetch.start"]
    assert [e.value for e in found if e.name == "prefetch.bytes"][:4] == [0, 100, 200, 300]
    span = next(e for e in found if e.name == "prefetch")
    assert span.bytes == 300 and span.attrs["background"] and span.attrs["finished"] and span.attrs["blocks"] == 3


# --------------------------------------------------------------------------- phases and pictures


def demo_trace(node: str = "node-a", *, t0: float = 1000.0, checkpoint_s: float = 2.0, job: str = "job-1") -> Trace:
    """A start through every phase, as the components write it."""
    E = Event
    ev = [
        E("image.pull", "span", t0, t0 + 1.5, phase="image", bytes=2048, attrs={"lazy": 2}),
        E("image.layer", "span", t0 + 0.1, t0 + 0.6, phase="image", attrs={"state": "lazy"}),
        E("image.layer", "span", t0 + 0.6, t0 + 1.4, phase="image", bytes=2048, attrs={"state": "downloaded"}),
        E("prefetch", "span", t0 + 1.0, t0 + 6.0, phase="image", bytes=5000, attrs={"background": True}),
        E("layers.bytes", "counter", t0 + 1.0, phase="image", value=0),
        E("layers.bytes", "counter", t0 + 3.0, phase="image", value=4000),
        E("container.prepare", "instant", t0 + 1.6, phase="container", attrs={"container": "job"}),
        E("task.create", "instant", t0 + 1.8, phase="container", attrs={"container": "job"}),
        E("task.start", "instant", t0 + 2.0, phase="container", attrs={"container": "job"}),
        E("container.first_read", "instant", t0 + 2.1, phase="container"),
        E("deps.hit", "instant", t0 + 1.6, phase="dependencies"),
        E("deps.run", "span", t0 + 2.1, t0 + 3.0, phase="dependencies", attrs={"action": "hit"}),
        E("checkpoint.bytes", "counter", t0 + 3.0, phase="checkpoint", value=0),
        E("checkpoint.bytes", "counter", t0 + 3.1, phase="checkpoint", value=1 << 20),
        E("checkpoint.bytes", "counter", t0 + 3.0 + checkpoint_s, phase="checkpoint", value=8 << 20),
        E("mark.import.end", "instant", t0 + 4.0 + checkpoint_s, attrs={"mark": "import.end"}),
        E("mark.first_step", "instant", t0 + 5.0 + checkpoint_s, attrs={"mark": "first_step"}),
        E("task.exit", "instant", t0 + 9.0 + checkpoint_s, attrs={"exit_status": 0}),
    ]
    for e in ev:
        object.__setattr__(e, "node", node)
    return Trace(node=node, job=job, events=sorted(ev, key=lambda e: e.start))


def test_prefetch_bytes_are_not_counted_twice_in_the_image_phase() -> None:
    """The prefetch's bytes are fetched by the layer server's engines: ``layers.bytes`` already holds them."""
    trace = demo_trace()
    t0 = 1000.0
    extra = [Event("prefetch.bytes", "counter", t0 + 1.0, phase="image", value=0),
             Event("prefetch.bytes", "counter", t0 + 2.0, phase="image", value=3000)]
    both = Trace(node=trace.node, job=trace.job, events=sorted(trace.events + extra, key=lambda e: e.start))
    image = next(p for p in phases(both) if p.name == "image")
    assert image.bytes == 2048 + 2048 + 4000  # spans and layers.bytes; the prefetch's 3000 are inside the 4000
    alone = Trace(node=trace.node, job=trace.job,
                  events=[e for e in both.events if e.name != "layers.bytes"])  # without the layer server's series
    assert next(p for p in phases(alone) if p.name == "image").bytes == 2048 + 2048 + 3000


def test_cpu_and_event_counters_are_shown_in_their_units_never_as_a_phases_bytes() -> None:
    """The layer server samples its CPU per stage (``cpu.<stage>``, ms) and the kernel's pre-access events
    (``layers.fanotify_events``) in the image phase: the table totals them in their units, Chrome's
    trace names the unit, and the image phase's bytes are the bytes alone."""
    trace = demo_trace()
    t0 = 1000.0
    extra = [Event("cpu.decode", "counter", t0 + 1.0, phase="image", value=0),
             Event("cpu.decode", "counter", t0 + 2.0, phase="image", value=1250),
             Event("layers.fanotify_events", "counter", t0 + 1.0, phase="image", value=0),
             Event("layers.fanotify_events", "counter", t0 + 2.0, phase="image", value=40)]
    both = Trace(node=trace.node, job=trace.job, events=sorted(trace.events + extra, key=lambda e: e.start))
    assert next(p for p in phases(both) if p.name == "image").bytes == 2048 + 2048 + 4000
    text = table(both)
    assert "cpu.decode: 1.250 CPU s" in text
    assert not [line for line in text.splitlines() if line.endswith("fetched") and ("cpu." in line or "fanotify" in line)]
    counters = {e["name"]: e["args"] for e in chrome_trace([both])["traceEvents"] if e["ph"] == "C"}
    assert counters["cpu.decode"] == {"ms": 1250} and counters["layers.fanotify_events"] == {"events": 40}


def test_phases_in_order_with_their_durations_and_bytes() -> None:
    trace = demo_trace()
    found = phases(trace)
    assert [p.name for p in found] == ["image", "container", "dependencies", "checkpoint", "import", "first_step"]
    by = {p.name: p for p in found}
    t0 = 1000.0
    assert (by["image"].start, by["image"].end) == (t0, t0 + 1.5)  # the prefetch is background
    assert by["image"].bytes == 2048 + 2048 + 4000  # spans' bytes and the layers counter's growth
    assert (by["container"].start, by["container"].end) == (t0 + 1.6, t0 + 2.0)  # prepare to task start
    assert (by["dependencies"].start, by["dependencies"].end) == (t0 + 1.6, t0 + 3.0)
    assert (by["checkpoint"].start, by["checkpoint"].end, by["checkpoint"].bytes) == (t0 + 3.0, t0 + 5.0, 8 << 20)
    assert (by["import"].start, by["import"].end) == (t0 + 5.0, t0 + 6.0)  # only an end: starts after checkpoint
    assert (by["first_step"].start, by["first_step"].end) == (t0 + 6.0, t0 + 7.0)
    assert start_window(trace, found) == (t0, t0 + 7.0)
    text = table(trace)
    assert "7.000 s" in text.splitlines()[0]
    for label in ("image", "container start", "dependencies", "checkpoint", "import", "first step"):
        assert any(line.startswith(label) for line in text.splitlines()), label
    assert "28.6%" in text  # the checkpoint's 2 s of 7


def test_trace_files_round_trip_and_refuse_damage(tmp_path: Path) -> None:
    trace = demo_trace()
    trace.save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert back.events == trace.events and (back.node, back.job) == ("node-a", "job-1")
    (tmp_path / "bad.json").write_text('{"version": 1, "node": "n", "job": "j", "events": [{"v": 1}]}')
    with pytest.raises(TraceError, match="bad.json.*no name"):
        Trace.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="not a BootSeer trace"):
        Trace.load(tmp_path / "other.json")
    with pytest.raises(TraceError, match="no such trace"):
        Trace.load(tmp_path / "absent.json")


def test_collect_selects_the_job_and_the_last_start(spool: Path) -> None:
    events.emit("image.pull", "span", start=10, end=11, phase="image")  # an earlier start
    events.emit("image.pull", "span", start=100, end=101, phase="image")
    events.emit("task.start", start=102, phase="container")
    events.emit("mark.first_step", start=103, job="other-job", mark="first_step")
    events.emit("mark.first_step", start=104, job="job-1", mark="first_step")
    trace = collect(spool, job="job-1")
    assert [(e.name, e.start) for e in trace.events] == [("image.pull", 100), ("task.start", 102),
                                                         ("mark.first_step", 104)]
    assert trace.node == "node-a"
    assert len(collect(spool, job="job-1", since=0).events) == 4
    with pytest.raises(TraceError, match="no such spool"):
        collect(spool / "absent")


def test_chrome_trace_is_valid_json_with_the_expected_events() -> None:
    data = json.loads(json.dumps(chrome_trace([demo_trace()])))
    evs = data["traceEvents"]
    spans = {e["name"]: e for e in evs if e["ph"] == "X"}
    assert spans["image.pull"]["ts"] == 0 and spans["image.pull"]["dur"] == 1.5e6 and spans["image.pull"]["cat"] == "image"
    assert {f"phase {p}" for p in ("image", "container", "dependencies", "checkpoint", "import", "first_step")} <= set(spans)
    assert [e["args"]["bytes"] for e in evs if e["ph"] == "C" and e["name"] == "checkpoint.bytes"] == [0, 1 << 20, 8 << 20]
    marks = [e for e in evs if e["ph"] == "i" and e["name"] == "mark.first_step"]
    assert marks[0]["ts"] == 7e6 and marks[0]["s"] == "t"
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"image", "container", "marks", "bytes"} <= names
    for e in evs:
        assert {"name", "ph", "pid", "tid"} <= set(e) and (e["ph"] == "M" or isinstance(e["ts"], float | int))


def test_html_timeline_renders_in_headless_chromium(tmp_path: Path) -> None:
    page = tmp_path / "profile.html"
    page.write_text(html_page([demo_trace()]))
    text = page.read_text()
    assert "<script" not in text and "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    dom, png = render(page, tmp_path)
    for label in ("image 1.50 s", "container start 0.40 s", "dependencies 1.40 s", "checkpoint 2.00 s",
                  "import 1.00 s", "first step 1.00 s", "bytes fetched over time"):
        assert label in dom, label
    assert dom.count('class="phase"') == 6 and dom.count('class="bytes"') == 2
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a picture, not a blank page
    keep = os.environ.get("BOOTSEER_PROFILE_ARTIFACTS")
    if keep:
        shutil.copy(png, Path(keep) / "unit-timeline.png")


# --------------------------------------------------------------------------- many nodes


def test_percentiles() -> None:
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert percentile([5], 0.9) == 5
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9) == pytest.approx(9.1)


def test_nodes_publish_and_the_merge_finds_the_straggler(tmp_path: Path) -> None:
    store = FileStoreWriter(tmp_path / "store")
    for i in range(5):
        slow = i == 3
        publish(demo_trace(f"node-{i}", t0=1000.0 + i * 0.01, checkpoint_s=9.0 if slow else 2.0 + i * 0.05), store)
    assert sorted(p.name for p in (tmp_path / "store" / "v1" / "profiles" / "job-1").iterdir()) == [
        f"node-{i}.json" for i in range(5)]
    traces = fetch_job(store, "job-1")
    merged = job_report(traces, "job-1")
    assert merged.gated_by == "node-3"
    assert [s["node"] for s in merged.stragglers] == ["node-3"]
    assert merged.stragglers[0]["phase"] == "checkpoint"
    assert merged.stragglers[0]["phase_behind_s"] == pytest.approx(9.0 - 2.1)
    assert merged.percentiles["checkpoint"]["max"] == pytest.approx(9.0)
    assert merged.percentiles["checkpoint"]["p50"] == pytest.approx(2.1)
    assert merged.percentiles["image"]["p50"] == pytest.approx(1.5)
    text = job_table(merged)
    assert "start gated by node-3" in text and "node-3:" in text and "checkpoint" in text
    with pytest.raises(TraceError, match="no traces of job"):
        fetch_job(store, "job-2")
    with pytest.raises(ValueError, match="job name"):
        publish(demo_trace(job="../x"), store)


def test_compare_two_starts() -> None:
    before = demo_trace(checkpoint_s=8.0)
    after = demo_trace(checkpoint_s=1.0)
    text = compare_table(before, after, ("overlayfs", "bootseer"))
    line = next(line for line in text.splitlines() if line.startswith("checkpoint"))
    assert "8.000 s" in line and "1.000 s" in line and "0.12x" in line
    assert text.splitlines()[-1].split()[1:3] == ["13.000", "s"]


# --------------------------------------------------------------------------- command line


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    return subprocess.run([*BOOTSEER, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**base, **(env or {})})


def test_profile_run_collects_marks_of_python_and_shell(tmp_path: Path) -> None:
    script = ('sleep 0.2; touch "$BOOTSEER_MARKS/import.end"; '
              f'{sys.executable} -c "import bootseer.profile as p; p.mark(\'first_step\', step=1)"; exit 3')
    done = run_cli("profile", "run", "--spool", str(tmp_path / "spool"), "--job", "j1", "-o", str(tmp_path / "t.json"),
                   "--", "sh", "-c", script, env={"BOOTSEER_NODE": "n1"})
    assert done.returncode == 3, done.stderr  # the command's status
    trace = Trace.load(tmp_path / "t.json")
    assert (trace.node, trace.job) == ("n1", "j1")
    names = [e.name for e in trace.events]
    assert names.index("job.started") < names.index("mark.import.end") < names.index("mark.first_step")
    assert [p.name for p in phases(trace)] == ["import", "first_step"]
    assert next(e for e in trace.events if e.name == "mark.first_step").attrs["step"] == 1
    assert "first step" in done.stderr


def test_report_compare_and_job_report_commands(tmp_path: Path) -> None:
    demo_trace().save(tmp_path / "a.json")
    demo_trace(checkpoint_s=1.0).save(tmp_path / "b.json")
    done = run_cli("profile", "report", str(tmp_path / "a.json"), "--html", str(tmp_path / "a.html"),
                   "--chrome", str(tmp_path / "a.trace.json"), "--json")
    assert done.returncode == 0, done.stderr
    assert "checkpoint" in done.stdout and (tmp_path / "a.html").exists()
    assert json.loads((tmp_path / "a.trace.json").read_text())["traceEvents"]
    done = run_cli("profile", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--names", "x,y",
                   "--html", str(tmp_path / "c.html"))
    assert done.returncode == 0 and "0.50x" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "c.html").read_text().count("<svg") == 2
    for i in range(3):
        publish(demo_trace(f"n{i}", checkpoint_s=2.0 + 5 * (i == 1)), FileStoreWriter(tmp_path / "store"))
    done = run_cli("profile", "report", "--job", "job-1", "--store", f"file://{tmp_path / 'store'}", "--html", str(tmp_path / "j.html"))
    assert done.returncode == 0 and "start gated by n1" in done.stdout, done.stdout + done.stderr
    assert run_cli("profile", "report", "--job", "nope", "--store", f"file://{tmp_path / 'store'}").returncode == 1
    bad = run_cli("profile", "report", str(tmp_path / "absent.json"))
    assert bad.returncode == 2 and "no such trace" in bad.stderr
    assert run_cli("profile", "report").returncode == 2
    empty = run_cli("profile", "collect", "--spool", str(tmp_path / "nothing"))
    assert empty.returncode == 2 and "no such spool" in empty.stderr


def test_report_and_compare_write_a_png_of_the_timeline(tmp_path: Path) -> None:
    """``--png``: headless Chromium's picture of the whole page (the window sized to it), with or without --html."""
    require_chromium()
    demo_trace().save(tmp_path / "a.json")
    demo_trace(checkpoint_s=1.0).save(tmp_path / "b.json")
    done = run_cli("profile", "report", str(tmp_path / "a.json"), "--png", str(tmp_path / "a.png"))
    assert done.returncode == 0, done.stderr
    done = run_cli("profile", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--names", "x,y",
                   "--html", str(tmp_path / "c.html"), "--png", str(tmp_path / "c.png"))
    assert done.returncode == 0, done.stderr
    assert f"picture: {tmp_path / 'c.png'}" in done.stdout and (tmp_path / "c.html").exists()
    one, two = (png_size((tmp_path / name).read_bytes()) for name in ("a.png", "c.png"))
    # The SVG timelines are 1100 px wide; two starts (two tables, two timelines) make a taller page than one.
    assert 1100 <= one[0] <= 1400 and 1100 <= two[0] <= 1400
    assert 500 <= one[1] < two[1] <= 4000
    assert (tmp_path / "c.png").stat().st_size > 20_000  # drawn, not blank
    assert not list(tmp_path.glob(".*partial*"))


def test_png_without_chromium_is_a_one_line_error(tmp_path: Path) -> None:
    demo_trace().save(tmp_path / "a.json")
    done = run_cli("profile", "report", str(tmp_path / "a.json"), "--png", str(tmp_path / "a.png"),
                   env={"PATH": str(tmp_path)})  # no chromium on this PATH
    assert done.returncode == 2 and not (tmp_path / "a.png").exists()
    assert done.stderr.strip().count("\n") == 0 and "chromium is not installed" in done.stderr
    assert done.stdout == ""  # refused before any work


# --------------------------------------------------------------------------- containerd's envelopes


def test_containerd_envelopes_become_events() -> None:
    from google.protobuf import any_pb2, timestamp_pb2

    from bootseer.profile.containerd import decode
    from bootseer.proto.containerd.events import task_pb2
    from bootseer.proto.containerd.services.events.v1 import events_pb2

    def envelope(topic: str, message) -> events_pb2.Envelope:
        packed = any_pb2.Any()
        packed.Pack(message)
        return events_pb2.Envelope(timestamp=timestamp_pb2.Timestamp(seconds=1700000000, nanos=500_000_000),
                                   namespace="ns", topic=topic, event=packed)

    assert decode(envelope("/tasks/start", task_pb2.TaskStart(container_id="job", pid=7))) == (
        "task.start", "container", 1700000000.5, {"namespace": "ns", "container": "job", "pid": 7})
    name, phase, _, attrs = decode(envelope("/tasks/exit", task_pb2.TaskExit(container_id="job", id="job", exit_status=2)))
    assert (name, phase, attrs["exit_status"], attrs["container"]) == ("task.exit", "", 2, "job")
    # As containerd sends them: a bare message name as the type URL.
    bare = envelope("/tasks/create", task_pb2.TaskCreate(container_id="job", pid=9))
    bare.event.type_url = "containerd.events.TaskCreate"
    assert decode(bare)[0] == "task.create" and decode(bare)[3]["pid"] == 9
    assert decode(envelope("/snapshot/prepare", task_pb2.TaskStart())) is None  # a topic not profiled
    assert decode(envelope("/tasks/start", task_pb2.TaskExit())) is None  # a type the topic does not carry


def test_a_ctr_pull_start_is_found_by_its_layer_prepares(spool: Path) -> None:
    # No rpull: containerd's unpacker prepared the layers (the snapshotter's spans) and created the image.
    for start in (10.0, 11.0):  # an earlier pull
        events.emit("image.layer_prepare", "span", start=start, end=start + 0.5, phase="image", state="lazy")
    for start in (500.0, 501.0, 502.0):
        events.emit("image.layer_prepare", "span", start=start, end=start + 0.5, phase="image", state="lazy")
    events.emit("image.created", start=503.0, phase="image", image="r")
    events.emit("task.start", start=504.0, phase="container")
    trace = collect(spool)
    assert trace.events[0].start == 500.0
    image = next(p for p in phases(trace) if p.name == "image")
    assert (image.start, image.end) == (500.0, 503.0)


def test_layer_prepares_through_the_snapshotter_are_lazy_or_downloaded(spool: Path) -> None:
    from bootseer.snapshotter.errors import AlreadyExists
    from bootseer.snapshotter.snapshots import profiled_remote_prepare

    class Backend:  # the decorator only sees the method's outcome: a lazy layer raises ALREADY_EXISTS
        pass

    calls = []

    @profiled_remote_prepare
    def prepare(self, key, parent, labels, chain_id):
        calls.append(chain_id)
        if chain_id == "sha256:lazy":
            raise AlreadyExists("served lazily")
        return ["mount"]

    with pytest.raises(AlreadyExists):
        prepare(Backend(), "k1", "", {}, "sha256:lazy")
    assert prepare(Backend(), "k2", "", {}, "sha256:plain") == ["mount"]
    spans = [e for e in read_spool(spool)[0] if e.name == "image.layer_prepare"]
    assert [(e.attrs["chain_id"], e.attrs["state"], e.phase) for e in spans] == [
        ("sha256:lazy", "lazy", "image"), ("sha256:plain", "downloaded", "image")]


def test_profile_1_puts_the_spool_under_the_snapshotter_root(tmp_path: Path) -> None:
    # As the daemon runs with Environment=BOOTSEER_PROFILE=1: a process of its own, the real Snapshotter.
    code = ("import sys, os; from bootseer.snapshotter.snapshots import Snapshotter; s = Snapshotter(sys.argv[1]); "
            "s.prepare('ns/1/l', ''); s.commit('base', 'ns/1/l'); s.prepare('ns/2/job', 'base'); s.close(); "
            "print(os.environ.get('BOOTSEER_PROFILE', ''))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "root")], capture_output=True, text=True,
                          timeout=60, env={**base, "BOOTSEER_PROFILE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "root" / "profile")  # exported for the layer server it starts
    found, _ = read_spool(tmp_path / "root" / "profile")
    assert [e.attrs.get("container") for e in found if e.name == "container.prepare"] == ["job"]
    # Off (unset): no spool at all.
    off = subprocess.run([sys.executable, "-c", code, str(tmp_path / "root2")], capture_output=True, text=True,
                         timeout=60, env=base)
    assert off.returncode == 0 and off.stdout.strip() == "", off.stderr
    assert not (tmp_path / "root2" / "profile").exists()


def test_marks_read_from_a_container_are_bounded(tmp_path: Path) -> None:
    for i in range(events.MAX_MARKS + 50):
        (tmp_path / f"m{i:05d}").touch()
    assert len(read_marks(tmp_path)) == events.MAX_MARKS
    os.mkfifo(tmp_path / "a-fifo")  # a FIFO is not read (it would block the snapshotter)
    assert "a-fifo" not in {m[0] for m in read_marks(tmp_path)}
