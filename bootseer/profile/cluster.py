"""Many nodes: each node's trace published under the job in the store; a job's traces merged.

A node publishes its trace as ``v1/profiles/<job>/<node>.json`` into a :class:`TraceStore`
(the command hands it the block store's writer, ``open_store_writer``: a directory, S3 or
HDFS; each put is atomic, so a reader sees a node's whole trace or none; a node that
publishes again replaces its own).  This module knows no store: it is handed one. :func:`job_report` merges a job's traces: per phase, the median, p90 and maximum
across nodes; the job's start is gated by its slowest node (a training job's first step
waits for every rank), so the *stragglers* are the nodes whose start ended latest, each with
the phase that put it most behind the median node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from bootseer.profile.events import PHASES
from bootseer.profile.trace import Trace, TraceError, phases, start_window

PREFIX = "v1/profiles"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: A node is a straggler when its start took this much longer than the median node's (and the
#: slowest node always is: it gated the job).
STRAGGLER_FACTOR = 1.2


def _checked(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"a {kind} name for the store is 1-128 of A-Z a-z 0-9 . _ - , not {name!r}")
    return name


def object_name(job: str, node: str) -> str:
    return f"{PREFIX}/{_checked('job', job)}/{_checked('node', node)}.json"


class TraceStore(Protocol):
    """Where a job's traces are shared: the block store's writer (``open_store_writer``) serves."""

    def put(self, name: str, data: bytes) -> None: ...

    def get(self, name: str) -> bytes | None: ...

    def list(self, prefix: str) -> Iterable[str]: ...


def publish(trace: Trace, store: TraceStore, job: str | None = None) -> str:
    """Put ``trace`` into ``store`` under its job; returns the object's name."""
    job = job or trace.job
    if not job:
        raise ValueError("publishing needs a job ID (--job, or BOOTSEER_JOB when the events were written)")
    name = object_name(job, trace.node)
    store.put(name, trace.dumps().encode())
    return name


def fetch_job(store: TraceStore, job: str) -> list[Trace]:
    """Every node's trace of ``job`` in ``store`` (TraceError if there is none, or one is damaged)."""
    import json

    prefix = f"{PREFIX}/{_checked('job', job)}/"
    traces = []
    for full in store.list(prefix.rstrip("/")):
        if not full.endswith(".json"):
            continue
        data = store.get(full)
        if data is None:
            continue
        try:
            traces.append(Trace.from_json(json.loads(data), full))
        except ValueError as exc:
            raise TraceError(f"{full}: {exc}") from None
    if not traces:
        raise TraceError(f"no traces of job {job!r} in the store (each node runs bootseer profile collect --publish)")
    return traces


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class NodeStart:
    node: str
    total: float  #: seconds from the node's first event to its first step (or last phase)
    end: float  #: Unix time the node's start ended
    phases: dict[str, float]  #: phase -> seconds


@dataclass(frozen=True)
class JobReport:
    job: str
    nodes: list[NodeStart]
    percentiles: dict[str, dict[str, float]]  #: phase (and "total") -> p50, p90, max
    stragglers: list[dict[str, Any]]  #: node, total, behind_s, phase (most behind the median), phase_behind_s
    gated_by: str  #: the node whose start ended last

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "gated_by": self.gated_by, "percentiles": self.percentiles,
                "stragglers": self.stragglers,
                "nodes": [{"node": n.node, "total_s": n.total, "phases": n.phases} for n in self.nodes]}


def job_report(traces: Sequence[Trace], job: str = "") -> JobReport:
    if not traces:
        raise TraceError("no traces to merge")
    nodes = []
    for trace in traces:
        found = phases(trace)
        first, end = start_window(trace, found)
        nodes.append(NodeStart(trace.node, end - first, end, {p.name: p.duration for p in found}))
    table: dict[str, dict[str, float]] = {}
    for phase in [*PHASES, "total"]:
        values = [n.total if phase == "total" else n.phases[phase] for n in nodes
                  if phase == "total" or phase in n.phases]
        if values:
            table[phase] = {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9), "max": max(values),
                            "nodes": len(values)}
    median_total = table["total"]["p50"]
    slowest = max(nodes, key=lambda n: n.total)
    stragglers = []
    for n in sorted(nodes, key=lambda n: -n.total):
        if n is not slowest and n.total <= median_total * STRAGGLER_FACTOR:
            continue
        behind = {p: d - table[p]["p50"] for p, d in n.phases.items() if p in table}
        worst = max(behind, key=behind.__getitem__) if behind else ""
        stragglers.append({"node": n.node, "total_s": n.total, "behind_s": n.total - median_total,
                           "phase": worst, "phase_behind_s": behind.get(worst, 0.0)})
    return JobReport(job or traces[0].job, nodes, table, stragglers, slowest.node)


def job_table(report: JobReport) -> str:
    lines = [f"job {report.job or '-'}: {len(report.nodes)} nodes; start gated by {report.gated_by}",
             f"{'phase':<16} {'p50 s':>8} {'p90 s':>8} {'max s':>8} {'nodes':>6}"]
    for phase, row in report.percentiles.items():
        lines.append(f"{phase:<16} {row['p50']:8.3f} {row['p90']:8.3f} {row['max']:8.3f} {int(row['nodes']):6d}")
    lines.append("stragglers:")
    for s in report.stragglers:
        lines.append(f"  {s['node']}: {s['total_s']:.3f} s, {s['behind_s']:+.3f} s behind the median; "
                     f"most behind in {s['phase'] or '-'} ({s['phase_behind_s']:+.3f} s)")
    return "\n".join(lines)
