"""A start's trace on one node: collected from the spool, saved as JSON, broken into phases.

:func:`collect` reads a node's spool (and the marks of containers still running) into a
:class:`Trace` for one job and time window. :func:`phases` breaks a trace into the start-up
phases of :data:`~bootseer.profile.events.PHASES`, each an interval with its events and bytes:

=============== ==========================================================================
image           spans of phase ``image`` (``image.pull`` by rpull, its ``image.layer`` spans)
container       ``container.prepare`` (the snapshotter) to containerd's ``task.start``;
                ``container.first_read`` and ``task.create`` fall inside
dependencies    spans and instants of phase ``dependencies`` (depsnap), or marks
checkpoint      spans of phase ``checkpoint`` and the time a ``checkpoint.bytes`` counter grew
import          marks only (the job knows when its imports are done)
first_step      from the end of the phases before it to the ``first_step`` mark
=============== ==========================================================================

A job can open or close any phase with marks ``PHASE.start`` / ``PHASE.end`` (for example
``touch /.bootseer/import.end``); ``first_step`` ends the start. A phase with only an end
starts where the latest phase before it ended. Background work (hot-list prefetch, spans with
``background`` set) is drawn but counts in no phase.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from bootseer.atomic import write_atomically
from bootseer.profile.events import PHASES, Event, EventError, read_marks, read_spool
from bootseer.profile.hooks import SAMPLE_INTERVAL

TRACE_VERSION = 1
#: The mark that ends a start.
FIRST_STEP = "first_step"
#: Marks other parts define that close a phase: depsnap's ``/.bootseer/deps-done`` (the job's install succeeded).
MARK_ALIASES = {"deps-done": "dependencies.end"}
#: Counters whose bytes another series of the trace already holds: drawn, never added to a phase twice
#: (the hot-list prefetch's bytes are fetched by the layer server's engines, so ``layers.bytes`` has them).
COUNTED_IN = {"prefetch.bytes": "layers.bytes"}
#: Counter series that count something other than bytes, by name prefix or name, and their unit:
#: never added to a phase's bytes nor drawn or totalled as bytes.
UNITS = {"cpu.": "ms", "layers.fanotify_events": "events"}


def counter_unit(name: str) -> str:
    """What a counter series counts: ``bytes`` unless :data:`UNITS` says otherwise (``ms`` of CPU, ``events``)."""
    for prefix, unit in UNITS.items():
        if name.startswith(prefix):
            return unit
    return "bytes"


class TraceError(ValueError):
    """A trace file that cannot be used; the message says why."""


@dataclass
class Trace:
    """The events of one start of one job on one node."""

    node: str
    job: str
    events: list[Event]
    collected_at: float = field(default_factory=time.time)
    problems: list[str] = field(default_factory=list)  #: spool lines that were not events

    def to_json(self) -> dict[str, Any]:
        return {"version": TRACE_VERSION, "node": self.node, "job": self.job, "collected_at": self.collected_at,
                "problems": self.problems[:100], "events": [e.to_json() for e in self.events]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomically(path, self.dumps().encode())

    @classmethod
    def from_json(cls, data: Any, origin: str = "trace") -> "Trace":
        if not isinstance(data, dict) or data.get("version") != TRACE_VERSION:
            raise TraceError(f"{origin}: not a BootSeer trace (version {TRACE_VERSION})")
        try:
            events = [Event.from_json(e) for e in data.get("events", [])]
        except EventError as exc:
            raise TraceError(f"{origin}: {exc}") from None
        node, job = data.get("node"), data.get("job")
        if not isinstance(node, str) or not isinstance(job, str):
            raise TraceError(f"{origin}: node and job must be strings")
        events.sort(key=lambda e: e.start)
        return cls(node=node, job=job, events=events, collected_at=float(data.get("collected_at", 0.0)),
                   problems=list(data.get("problems", [])))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Trace":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise TraceError(f"{path}: no such trace") from None
        except (OSError, ValueError) as exc:
            raise TraceError(f"{path}: cannot read the trace: {exc}") from None
        return cls.from_json(data, str(path))


def _live_marks(events: list[Event]) -> list[Event]:
    """Marks of containers whose snapshots still exist (not yet harvested at removal)."""
    removed = {e.attrs.get("container") for e in events if e.name == "container.removed"}
    found = []
    for prepared in events:
        if prepared.name != "container.prepare" or prepared.attrs.get("container") in removed:
            continue
        container = prepared.attrs.get("container", "")
        directory = Path(str(prepared.attrs.get("upper", ""))) / ".bootseer"
        for name, when, pid, attrs in read_marks(directory):
            found.append(Event(name=f"mark.{name}", kind="instant", start=when, node=prepared.node,
                               pid=prepared.pid, attrs={"mark": name, "container": container, "mark_pid": pid,
                                                        **attrs}))
    return found


def collect(spool: str | os.PathLike[str], *, job: str = "", since: float | None = None,
            until: float | None = None, node: str = "") -> Trace:
    """The trace of one start from the spool ``spool``.

    Events tagged with another job are left out (the node's daemons tag none: theirs are
    kept). The window is ``since``..``until``; without ``since``, it starts at the last
    ``image.pull`` (a start begins with its image), or at the spool's first event.
    """
    if not Path(spool).is_dir():
        raise TraceError(f"{spool}: no such spool directory (is profiling on? BOOTSEER_PROFILE)")
    events, problems = read_spool(spool)
    events = events + _live_marks(events)
    seen: set[tuple[str, float, str]] = set()
    unique = []
    for e in sorted(events, key=lambda e: e.start):
        identity = (e.name, round(e.start, 6), str(e.attrs.get("container", "")))
        if e.name.startswith("mark.") and identity in seen:
            continue  # a live mark that was also harvested
        seen.add(identity)
        unique.append(e)
    events = [e for e in unique if not job or not e.job or e.job == job]
    if since is None:
        since = last_start(events)
    # A counter's last sample before the window is its baseline: without it, bytes fetched in the
    # window's first sampling interval would not show as growth.
    baselines: dict[str, Event] = {}
    for e in events:
        if e.kind == "counter" and e.start < since:
            baselines[e.name] = e
    events = list(baselines.values()) + [
        e for e in events if (e.end or e.start) >= since and (until is None or e.start <= until)]
    events.sort(key=lambda e: e.start)
    if not node:
        counts = Counter(e.node for e in events if e.node)
        node = counts.most_common(1)[0][0] if counts else os.environ.get("BOOTSEER_NODE", "") or os.uname().nodename
    return Trace(node=node, job=job, events=events, problems=problems)


#: Image events (layer Prepares of one pull) this close together belong to the same start.
PULL_GAP_S = 60.0


def last_start(events: list[Event]) -> float:
    """When the spool's last start began: its ``image.pull`` (rpull), else the first layer Prepare of the
    last pull containerd's unpacker made (``ctr pull``, CRI: image events with no gap of
    :data:`PULL_GAP_S`), else the first event."""
    pulls = [e.start for e in events if e.name == "image.pull"]
    if pulls:
        return max(pulls)
    image = sorted(e.start for e in events if e.phase == "image" and e.kind != "counter")
    if image:
        first = len(image) - 1
        while first > 0 and image[first] - image[first - 1] < PULL_GAP_S:
            first -= 1
        return image[first]
    return events[0].start if events else 0.0


# --------------------------------------------------------------------------- phases


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float
    bytes: int
    events: int

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


def _counter_window(samples: list[Event]) -> tuple[float, float, float, int] | None:
    """When a cumulative counter grew: (earliest it can have begun, the first sample that showed growth,
    the last growth, bytes)."""
    if len(samples) < 1:
        return None
    values = [(e.start, float(e.value or 0)) for e in samples]
    base = values[0][1]
    grew = [i for i in range(1, len(values)) if values[i][1] > values[i - 1][1]]
    if not grew:
        return None
    # Samples are written only when the value moved, so the one before the first growth may be much
    # older (the mount's first sample): the growth began at most one sampling interval before it showed.
    first = values[grew[0]][0]
    return max(values[grew[0] - 1][0], first - SAMPLE_INTERVAL), first, values[grew[-1]][0], int(values[-1][1] - base)


def _background(e: Event) -> bool:
    return bool(e.attrs.get("background"))


def phases(trace: Trace) -> list[Phase]:
    """The phases of the start that the trace has evidence of, in :data:`PHASES` order."""
    windows: dict[str, list[float]] = {}
    moved: dict[str, int] = {p: 0 for p in PHASES}
    counts: dict[str, int] = {p: 0 for p in PHASES}
    explicit_start: dict[str, float] = {}
    explicit_end: dict[str, float] = {}
    first_step: float | None = None

    def widen(phase: str, start: float, end: float) -> None:
        window = windows.setdefault(phase, [start, end])
        window[0], window[1] = min(window[0], start), max(window[1], end)

    counters: dict[tuple[str, str], list[Event]] = {}
    #: phase -> when its counter first showed growth: its start is known only to one sampling interval
    uncertain: dict[str, float] = {}
    for e in trace.events:
        if e.name.startswith("mark."):
            name = str(e.attrs.get("mark", e.name[5:]))
            name = MARK_ALIASES.get(name, name)
            if name == FIRST_STEP:
                first_step = e.start if first_step is None else min(first_step, e.start)
                continue
            base, _, edge = name.rpartition(".")
            if base in PHASES and edge in ("start", "end"):
                target = explicit_start if edge == "start" else explicit_end
                target[base] = min(target.get(base, e.start), e.start) if edge == "start" else max(
                    target.get(base, e.start), e.start)
                counts[base] += 1
            continue
        if e.kind == "counter":
            if e.phase and counter_unit(e.name) == "bytes":
                counters.setdefault((e.name, e.phase), []).append(e)
            continue
        if not e.phase or _background(e):
            continue
        counts[e.phase] += 1
        moved[e.phase] += e.bytes
        if e.name == "task.start":
            widen(e.phase, e.start, e.start)
            explicit_end["container"] = max(explicit_end.get("container", e.start), e.start)
            continue
        widen(e.phase, e.start, e.end if e.end is not None else e.start)

    series = {name for name, _ in counters}
    for (name, phase), samples in counters.items():
        window = _counter_window(samples)
        if window is None or COUNTED_IN.get(name) in series:
            continue
        start, seen, end, grown = window
        moved[phase] += grown
        if phase in ("checkpoint", "dependencies"):  # their bytes are their phase; image bytes go on all start long
            widen(phase, start, end)
            counts[phase] += 1
            uncertain[phase] = seen

    result: list[Phase] = []
    # A phase known only by its end starts where the latest phase before it ended, or with the trace.
    latest_end: float | None = None
    origin = min((e.start for e in trace.events), default=0.0)
    for name in PHASES:
        if name == FIRST_STEP:
            if first_step is None:
                continue
            start = latest_end if latest_end is not None else origin
            result.append(Phase(name, min(start, first_step), first_step, 0, 1))
            continue
        window = windows.get(name)
        start = explicit_start.get(name, window[0] if window else None)
        end = explicit_end.get(name, window[1] if window else None)
        if name == "container" and window and name in explicit_end:
            end = explicit_end[name]  # the task started: what follows is the job's own
        if start is None and end is None:
            continue
        if start is None:
            start = latest_end if latest_end is not None else origin
            start = min(start, end)  # type: ignore[type-var]
        elif name in uncertain and name not in explicit_start and latest_end is not None \
                and start < latest_end <= uncertain[name]:
            start = latest_end  # within the sampling interval: after what came before, not overlapping it
        if end is None:
            end = start
        result.append(Phase(name, start, max(start, end), moved[name], counts[name]))
        latest_end = max(latest_end or end, end)
    return result


def start_window(trace: Trace, found: list[Phase] | None = None) -> tuple[float, float]:
    """(first event, the start's end): the first_step mark, else the last phase's end, else the last event."""
    found = phases(trace) if found is None else found
    if not trace.events:
        return 0.0, 0.0
    # Counter samples do not start anything (the first may be a baseline from long before).
    starts = [e.start for e in trace.events if e.kind != "counter"] + [p.start for p in found]
    first = min(starts) if starts else trace.events[0].start
    step = [p for p in found if p.name == FIRST_STEP]
    if step:
        return first, step[0].end
    if found:
        return first, max(p.end for p in found)
    return first, max(e.end or e.start for e in trace.events)


def totals(trace: Trace, unit: str = "bytes") -> dict[str, int]:
    """What each counter series of ``unit`` grew by in the trace: bytes (``layers.bytes``,
    ``checkpoint.bytes``...), or ``ms`` of CPU (``cpu.decode``...), or ``events``."""
    series: dict[str, list[float]] = {}
    for e in trace.events:
        if e.kind == "counter" and counter_unit(e.name) == unit:
            series.setdefault(e.name, []).append(float(e.value or 0))
    return {name: int(max(values) - values[0]) for name, values in series.items()}


def load_traces(paths: Iterable[str | os.PathLike[str]]) -> list[Trace]:
    return [Trace.load(p) for p in paths]
