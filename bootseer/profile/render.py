"""What people look at: the phase table, the HTML timeline (inline SVG) and the Chrome trace.

* :func:`table` -- phases with start offset, duration, share of the start, bytes;
* :func:`chrome_trace` -- Chrome's trace event format (``{"traceEvents": [...]}``), which
  Perfetto and chrome://tracing open: one process per node, one thread row per phase;
* :func:`html_page` -- a self-contained page (no script, no external resource): the table,
  and an SVG timeline with a row per phase (its interval as a band, its events on it) and the
  bytes fetched over time underneath; several traces (``compare``) share one time scale.
"""

from __future__ import annotations

import html
from typing import Any, Sequence

from bootseer.profile.events import PHASES, Event
from bootseer.profile.trace import Trace, counter_unit, phases, start_window, totals

COLOURS = {"image": "#4e79a7", "container": "#f28e2b", "dependencies": "#59a14f", "checkpoint": "#e15759",
           "import": "#b07aa1", "first_step": "#edc948", "": "#9c9c9c"}
SERIES_COLOURS = ["#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2"]
LABELS = {"image": "image", "container": "container start", "dependencies": "dependencies",
          "checkpoint": "checkpoint", "import": "import", "first_step": "first step"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def table_rows(trace: Trace) -> tuple[list[dict[str, Any]], float]:
    """One row per phase (name, offset_s, duration_s, share, bytes) and the start's total seconds."""
    found = phases(trace)
    first, last = start_window(trace, found)
    total = max(last - first, 1e-9)
    rows = [{"phase": p.name, "offset_s": p.start - first, "duration_s": p.duration, "share": p.duration / total,
             "bytes": p.bytes, "events": p.events} for p in found]
    return rows, last - first


def table(trace: Trace) -> str:
    rows, total = table_rows(trace)
    lines = [f"start-up profile: node {trace.node or '-'} job {trace.job or '-'}: {total:.3f} s "
             f"({len(trace.events)} events)",
             f"{'phase':<16} {'at s':>8} {'took s':>8} {'share':>6} {'bytes':>11}"]
    for row in rows:
        lines.append(f"{LABELS.get(row['phase'], row['phase']):<16} {row['offset_s']:8.3f} {row['duration_s']:8.3f} "
                     f"{row['share'] * 100:5.1f}% {human_bytes(row['bytes']):>11}")
    accounted = _union([(r["offset_s"], r["offset_s"] + r["duration_s"]) for r in rows])
    lines.append(f"{'(in no phase)':<16} {'':>8} {max(0.0, total - accounted):8.3f} "
                 f"{max(0.0, total - accounted) / max(total, 1e-9) * 100:5.1f}%")
    for name, grown in sorted(totals(trace).items()):
        lines.append(f"  {name}: {human_bytes(grown)} fetched")
    for name, grown in sorted(totals(trace, "ms").items()):
        lines.append(f"  {name}: {grown / 1000:.3f} CPU s")
    return "\n".join(lines)


def _union(intervals: list[tuple[float, float]]) -> float:
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        covered += b - max(a, end)
        end = b
    return covered


def compare_table(a: Trace, b: Trace, names: tuple[str, str] = ("A", "B")) -> str:
    rows_a, total_a = table_rows(a)
    rows_b, total_b = table_rows(b)
    by_a = {r["phase"]: r for r in rows_a}
    by_b = {r["phase"]: r for r in rows_b}
    lines = [f"{'phase':<16} {names[0]:>10} {names[1]:>10} {'change':>9}"]
    for phase in PHASES:
        if phase not in by_a and phase not in by_b:
            continue
        da = by_a.get(phase, {}).get("duration_s")
        db = by_b.get(phase, {}).get("duration_s")
        change = f"{(db / da):8.2f}x" if da and db is not None and da > 0 else "        -"
        lines.append(f"{LABELS[phase]:<16} {_seconds(da):>10} {_seconds(db):>10} {change}")
    ratio = f"{total_b / total_a:8.2f}x" if total_a > 0 else "        -"
    lines.append(f"{'total':<16} {_seconds(total_a):>10} {_seconds(total_b):>10} {ratio}")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


# --------------------------------------------------------------------------- Chrome trace


def _row(e: Event) -> str:
    if e.name.startswith("mark."):
        return "marks"
    if e.kind == "counter":
        return counter_unit(e.name)
    return e.phase or e.name.split(".")[0]


def chrome_trace(traces: Sequence[Trace]) -> dict[str, Any]:
    """Chrome's trace event format: ``ts``/``dur`` in µs from the earliest event of all traces."""
    starts = [e.start for t in traces for e in t.events]
    origin = min(starts) if starts else 0.0
    out: list[dict[str, Any]] = []
    for pid, trace in enumerate(traces, 1):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"{trace.node} {trace.job}".strip()}})
        rows: dict[str, int] = {}
        for e in trace.events:
            row = _row(e)
            if row not in rows:
                rows[row] = len(rows) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rows[row], "args": {"name": row}})
            ts = round((e.start - origin) * 1e6, 3)
            args = {**e.attrs, **({"bytes": e.bytes} if e.bytes else {}), **({"pid": e.pid} if e.pid else {})}
            base = {"name": e.name, "cat": e.phase or "other", "pid": pid, "tid": rows[row], "ts": ts, "args": args}
            if e.kind == "span":
                out.append({**base, "ph": "X", "dur": round(e.duration * 1e6, 3)})
            elif e.kind == "counter":
                out.append({**base, "ph": "C", "args": {counter_unit(e.name): e.value}})
            else:
                out.append({**base, "ph": "i", "s": "t"})
        for p in phases(trace):
            out.append({"name": f"phase {p.name}", "cat": "phase", "ph": "X", "pid": pid, "tid": 0,
                        "ts": round((p.start - origin) * 1e6, 3), "dur": round(p.duration * 1e6, 3),
                        "args": {"bytes": p.bytes, "events": p.events}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"producer": "bootseer profile"}}


# --------------------------------------------------------------------------- HTML + SVG


def _timeline_row(e: Event) -> str:
    """The timeline row an event is drawn on: its phase's (a mark: the phase it opens or closes), else other."""
    if e.name.startswith("mark."):
        name = str(e.attrs.get("mark", e.name[5:]))
        base = name.rpartition(".")[0]
        return name if name == "first_step" else base if base in PHASES else "other"
    return e.phase if e.phase in PHASES else "other"


WIDTH, LEFT, RIGHT, ROW, CHART = 1100, 170, 20, 26, 120


def _svg_timeline(trace: Trace, origin: float, scale_s: float, title: str) -> str:
    found = phases(trace)
    x = lambda t: LEFT + (t - origin) / scale_s * (WIDTH - LEFT - RIGHT)  # noqa: E731
    rows = list(PHASES) + ["other"]
    height = 30 + ROW * len(rows) + 30 + CHART + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'font-family="sans-serif" font-size="12" role="img" aria-label="{html.escape(title)}">',
             f'<text x="4" y="16" font-weight="bold">{html.escape(title)}</text>']
    by_phase = {p.name: p for p in found}
    top = 26
    for i, row in enumerate(rows):
        y = top + i * ROW
        parts.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{ROW - 4}" fill="#f4f4f4"/>')
        phase = by_phase.get(row)
        label = LABELS.get(row, row)
        if phase is not None:
            label += f" {phase.duration:.2f} s"
            parts.append(f'<rect class="phase" data-phase="{row}" x="{x(phase.start):.1f}" y="{y}" '
                         f'width="{max(1.5, x(phase.end) - x(phase.start)):.1f}" height="{ROW - 4}" '
                         f'fill="{COLOURS[row]}" fill-opacity="0.35"><title>{html.escape(LABELS[row])}: '
                         f'{phase.duration:.3f} s</title></rect>')
        parts.append(f'<text x="4" y="{y + ROW - 10}">{html.escape(label)}</text>')
        for e in trace.events:
            if e.kind == "counter" or _timeline_row(e) != row or not origin <= e.start <= origin + scale_s:
                continue  # counters are drawn below; what happened after the start is not on its timeline
            colour = COLOURS.get(e.phase, COLOURS[""])
            tip = html.escape(f"{e.name} {e.duration:.3f} s {e.attrs}")
            if e.kind == "span":
                # Background work (prefetch) is drawn thin and faint: it gates nothing.
                thin = 8 if e.attrs.get("background") else 0
                end = min(e.end or e.start, origin + scale_s)  # a span that outlived the start is cut at its end
                parts.append(f'<rect x="{x(e.start):.1f}" y="{y + 4 + thin}" width="{max(1.0, x(end) - x(e.start)):.1f}" '
                             f'height="{ROW - 12 - thin}" fill="{colour}" fill-opacity="{0.45 if thin else 1}">'
                             f'<title>{tip}</title></rect>')
            else:
                parts.append(f'<line x1="{x(e.start):.1f}" x2="{x(e.start):.1f}" y1="{y}" y2="{y + ROW - 4}" '
                             f'stroke="{colour if not e.name.startswith("mark.") else "#000"}" stroke-width="2">'
                             f'<title>{tip}</title></line>')
    # Bytes over time: each counter series, cumulative.
    base = top + ROW * len(rows) + 30
    parts.append(f'<text x="4" y="{base - 8}" font-weight="bold">bytes fetched over time</text>')
    parts.append(f'<rect x="{LEFT}" y="{base}" width="{WIDTH - LEFT - RIGHT}" height="{CHART}" fill="none" stroke="#ccc"/>')
    series: dict[str, list[tuple[float, float]]] = {}
    for e in trace.events:
        if e.kind == "counter" and counter_unit(e.name) == "bytes":
            series.setdefault(e.name, []).append((e.start, float(e.value or 0)))
    grew = {name: points for name, points in series.items() if max(v for _, v in points) > points[0][1]}
    for i, (name, points) in enumerate(sorted(grew.items())):
        low = points[0][1]
        high = max(v for _, v in points) - low or 1.0
        # A step line: samples are written when the value moved, so it held its value until the next one.
        y = lambda v: base + CHART - (v - low) / high * CHART  # noqa: E731
        steps = [(max(points[0][0], origin), points[0][1])]
        for (t, v) in points[1:]:
            if t > origin + scale_s:
                break
            steps += [(max(t, origin), steps[-1][1]), (max(t, origin), v)]
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in steps)
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        parts.append(f'<polyline class="bytes" points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.append(f'<text x="4" y="{base + 14 + 14 * i}" fill="{colour}">{html.escape(name)} '
                     f'{html.escape(human_bytes(high if high != 1.0 or len(points) > 1 else 0))}</text>')
    for k in range(6):  # time axis; the last label ends at the axis's end, inside the picture
        t = origin + scale_s * k / 5
        anchor = (f'x="{x(t):.1f}" text-anchor="end"' if k == 5 else f'x="{x(t) - 10:.1f}"')
        parts.append(f'<text {anchor} y="{base + CHART + 16}">{scale_s * k / 5:.1f}s</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _html_table(trace: Trace) -> str:
    rows, total = table_rows(trace)
    body = "".join(f"<tr><td>{html.escape(LABELS.get(r['phase'], r['phase']))}</td><td>{r['offset_s']:.3f}</td>"
                   f"<td>{r['duration_s']:.3f}</td><td>{r['share'] * 100:.1f}%</td>"
                   f"<td>{html.escape(human_bytes(r['bytes']))}</td></tr>" for r in rows)
    return (f"<table><tr><th>phase</th><th>at (s)</th><th>took (s)</th><th>share</th><th>bytes</th></tr>{body}"
            f"<tr><th>total</th><td></td><td>{total:.3f}</td><td></td><td></td></tr></table>")


def html_page(traces: Sequence[Trace], titles: Sequence[str] | None = None, extra: str = "") -> str:
    """A self-contained page: a table and a timeline per trace, all on one time scale."""
    titles = list(titles or [f"node {t.node or '-'} job {t.job or '-'}" for t in traces])
    windows = [start_window(t) for t in traces]
    scale = max([b - a for a, b in windows] + [1e-3]) * 1.02
    sections = []
    for trace, title, (first, _) in zip(traces, titles, windows):
        sections.append(f"<section><h2>{html.escape(title)}</h2>{_html_table(trace)}"
                        f"{_svg_timeline(trace, first, scale, title)}</section>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>BootSeer start-up profile</title>"
            "<style>body{font-family:sans-serif;margin:16px}table{border-collapse:collapse;margin:8px 0}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child{text-align:left}</style>"
            f"</head><body><h1>BootSeer start-up profile</h1>{extra}{''.join(sections)}</body></html>\n")
