"""The lazy-layers benchmark's report: its runs as Markdown, medians against overlayfs, and the target checks.

:func:`report` turns the :class:`~bench.lazy_scenarios.Scenario` runs that :mod:`bench.lazy_bench` measured
into the page it writes to ``--output``: the machine and image, one table of medians and ratios to the
baseline measured in the same run, the sections of the modes that ran (hot lists, data paths with their
userspace requests and CPU seconds, the wait for the blobs to complete before lazy-complete, containerds),
and one check line per target of :mod:`bench.lazy_scenarios`.  It measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import image_build
from bench.common import code_version, fmt, machine
from bench.hot_set_cost import REPEATS as HOT_SET_REPEATS, HotSetCost
from bench.lazy_scenarios import (
    BASELINES, FANOTIFY_PATH, KINDS, MB, SCENARIOS, SIGKILL_TEST, SOURCE_SUFFIX, TARGET_COLD_FUSE_REQUESTS,
    TARGET_26_COLD_RATIO, TARGET_26_FALLBACK_LOCAL, TARGET_26_HOT_OVER_FLOOR, TARGET_26_HOT_SPEEDUP,
    TARGET_36_COMPLETE_EVENTS, TARGET_36_COMPLETE_LOCAL, TARGET_36_HOT_SET_CPU,
    TARGET_COLD_RATIO, TARGET_COMPLETE_BLOB_REQUESTS, TARGET_FANOTIFY_HOT_OVER_FLOOR, TARGET_FETCH_OVER_READ,
    TARGET_FUSE_REQUESTS_RATIO, TARGET_HOT_OVER_FLOOR, TARGET_HOT_SPEEDUP, TARGET_LINK_OVER_BUILT,
    TARGET_LOCAL_RATIO, TARGET_PAGE_CACHE_RATIO, TARGET_PULL_SECONDS, TREE_PATH, Run, Scenario, base_name, completes,
    named, run_fanotify_events, run_fuse_requests, run_userspace_events, split_variant, variant,
)
from tests.support.containerd import ContainerdInstall


def summarize_profile(path: Path, top: int = 12) -> list[str]:
    """The frames holding the GIL most often in a py-spy raw profile, as Markdown rows."""
    if not path.exists():
        return []
    total = 0
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")[1:]  # the first element names the thread
        total += int(count)
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + int(count)
        for frame in set(frames):
            if ("bootseer/" in frame or "blockstore/" in frame or "pyfuse3" in frame) and "cli.py" not in frame:
                inclusive[frame] = inclusive.get(frame, 0) + int(count)
    if not total:
        return []
    rows = [f"{total} samples at 200 Hz ({total / 200:.1f} s of the GIL held by the layer server)", "",
            "| frame (self) | share |", "|---|---|"]
    rows += [f"| `{frame}` | {count / total:.0%} |" for frame, count in
             sorted(own.items(), key=lambda item: -item[1])[:top]]
    rows += ["", "| frame (inclusive, BootSeer and pyfuse3) | share |", "|---|---|"]
    rows += [f"| `{frame}` | {count / total:.0%} |" for frame, count in
             sorted(inclusive.items(), key=lambda item: -item[1])[:top]]
    return rows


def _read_bytes(run: Run) -> float | None:
    """Bytes the start-up read: the raw bytes of the distinct blocks it touched.

    On a cold node the block cache starts empty and holds raw (decompressed) blocks, so
    its growth over the run is exactly that; the layer server's ``status`` reports it.  Not on
    ``fanotify`` (None): a fill writes its blocks into the layer's blob, not the node cache
    (issue 36), and the blob holds a fill group's unread blocks too.
    """
    if "fanotify.fills" in run.server:
        return None
    return run.server.get("cache.bytes")


def _fetched_bytes(run: Run) -> float | None:
    """Bytes that crossed the link for the lazy start: registry (manifest, config) and store reads."""
    return float(run.link_bytes)


def hot_list(context: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """The summary of the hot list the ``hot-cold`` starts of ``data_path`` (a variant: ``erofs+built``)
    prefetched: each image source records its own."""
    return context.get("hots", {}).get(data_path) or context.get("hot")


def hot_floor(seconds: dict[str, float | None], context: dict[str, Any], data_path: str) -> float | None:
    """The floor of a prefetched start (issue 15's): the hot list's bytes over the measured link rate, plus
    overlayfs's warm start (overlay-warm's median: a start that reads nothing from disk or the link); where
    that did not run, the all-local lazy start on ``data_path`` (lazy-local's median, issue 7's floor)."""
    hot, rate = hot_list(context, data_path), context.get("link_rate")
    warm = seconds.get("overlay-warm") or seconds.get(named("lazy-local", data_path))
    if not hot or not rate or not warm:
        return None
    return hot["bytes"] / MB / rate + warm


def _floor_base(seconds: dict[str, float | None], data_path: str) -> str:
    return "overlay-warm" if seconds.get("overlay-warm") else named("lazy-local", data_path)


def hot_section(scenarios: dict[str, Scenario], seconds: dict[str, float | None], context: dict[str, Any],
                data_path: str) -> list[str]:
    """The report's hot-list section of one data path: the list, the floor, the distance, the prefetch per run."""
    hot = hot_list(context, data_path)
    name = named("hot-cold", data_path)
    scenario = scenarios.get(name)
    if scenario is None or (not hot and not scenario.runs):
        return []
    lines = ["", f"## Hot list: record on a first boot, prefetch on a fresh node (issue 7), data path {data_path}", ""]
    if hot:
        lines.append(f"Recorded by one first boot on a fresh node (data path {hot.get('data_path', '?')}; store "
                     f"through nginx, `--publish-store` the directory behind it; {hot['boot_seconds']:.1f} s to the "
                     f"first output): {hot['blocks']} blocks, {hot['bytes'] / MB:.1f} MB stored "
                     f"({hot['raw_bytes'] / MB:.1f} MB raw), first touches over {hot['span_s']:.1f} s, sealed by "
                     f"`{hot['sealed_by']}`, {hot['outcome']}.")
    floor = hot_floor(seconds, context, data_path)
    link_s = hot["bytes"] / MB / context["link_rate"] if hot and context.get("link_rate") else None
    lazy_cold, hot_cold = seconds.get(named("lazy-cold", data_path)), seconds.get(name)
    lines += ["", "| figure | s |", "|---|---|",
              f"| (a) overlay-cold, median | {fmt(seconds.get('overlay-cold'))} |",
              f"| (b) lazy-cold (no hot list), median | {fmt(lazy_cold)} |",
              f"| (c) hot-cold, median | {fmt(hot_cold)} |",
              f"| hot bytes over the link rate ({fmt(hot and hot['bytes'] / MB, '.1f')} MB at "
              f"{fmt(context.get('link_rate'), '.1f')} MB/s) | {fmt(link_s)} |",
              f"| {_floor_base(seconds, data_path)}, median | {fmt(seconds.get(_floor_base(seconds, data_path)))} |",
              f"| floor of (c) | {fmt(floor)} |",
              f"| (c) − floor | {fmt(hot_cold - floor if hot_cold and floor else None)} |",
              f"| (c) / floor | {fmt(hot_cold / floor if hot_cold and floor else None)}× |"]
    cost: HotSetCost | None = hot.get("hot_set_cost") if hot else None
    server_cpu = _median_server(scenario, "server.cpu_seconds")
    ratio = server_cpu / cost.cpu_seconds if server_cpu is not None and cost is not None and cost.cpu_seconds else None
    lines += [f"| decompress + SHA-256 of the hot set's frames, one core (CPU s) | "
              f"{fmt(cost.cpu_seconds if cost is not None else None, '.3f')} |",
              f"| layer-server CPU of hot-cold, median (s; its `process_cpu_seconds_total` over the whole cold start) "
              f"| {fmt(server_cpu)} |",
              f"| layer-server CPU of hot-cold (median) / that (the server's CPU includes its own start-up and the "
              f"pull, not the hot set's work alone) | {fmt(ratio)}× |"]
    if cost is not None:
        lines += ["", f"The hot set's frames (`bench/hot_set_cost.py`): the {cost.blocks} blocks of the list, "
                  f"{cost.stored_bytes / MB:.1f} MB stored, {cost.raw_bytes / MB:.1f} MB raw, read from the store's "
                  f"packs into memory first, then each decompressed and its SHA-256 checked on one thread, as the "
                  f"block fetcher does; the least CPU of {HOT_SET_REPEATS} passes, whose wall was "
                  f"{cost.wall_seconds:.3f} s."]
    elif hot:
        lines += ["", "The hot set's frames were not decompressed and hashed (see Notes)."]
    if scenario.runs:
        rows = [("pull (s, from the start)", "pull", ".2f"), ("prefetch seen (s after the pull started)", "start_s", ".2f"),
                ("prefetch done (s after the pull started)", "end_s", ".2f"),
                ("first output (s)", "seconds", ".2f"), ("planned (MB)", "planned_bytes", "mb"),
                ("prefetched (MB)", "fetched_bytes", "mb"), ("prefetched blocks", "fetched_blocks", ".0f"),
                ("put into the page cache (MB, raw)", "warmed_bytes", "mb"),
                ("reads reaching FUSE: hits (prefetched before the read)", "hits", ".0f"),
                ("reads: waited on an in-flight prefetch", "waited", ".0f"),
                ("reads: misses (fetched on demand)", "misses", ".0f"),
                ("reads: in the node cache before", "cached_reads", ".0f"),
                ("hit rate", "hit_rate", ".3f"), ("lead, median (s)", "lead_median_s", ".2f"),
                ("prefetched, never read through FUSE (MB)", "unread_bytes", "mb"), ("link bytes (MB)", "link", "mb"),
                ("fetched from the store (MB)", "store", "mb"),
                ("layer-server CPU over the start (s; its start-up and the pull included)", "cpu", ".2f")]
        lines += ["", "Prefetch per hot-cold run (the layer server's `hotlist.status`, polled every 0.2 s; its "
                  "summary when the container was gone). The prefetch also puts the blocks into the kernel's page "
                  "cache, so reads it served never reach FUSE and are not counted as hits (docs/hotlist.md):", "",
                  "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(scenario.runs))) + " |",
                  "|---|" + "---|" * len(scenario.runs)]
        for label, key, spec in rows:
            cells = []
            for r in scenario.runs:
                value = {"pull": r.pull_seconds, "seconds": r.seconds, "link": r.link_bytes,
                         "store": r.server.get("store.bytes_fetched"),
                         "cpu": r.server.get("server.cpu_seconds")}.get(key, r.prefetch.get(key))
                cells.append("—" if value is None else format(value / MB, ".1f") if spec == "mb" else format(value, spec))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def containerd_section(scenarios: dict[str, Scenario], context: dict[str, Any]) -> list[str]:
    """The same starts on each containerd of ``--containerds``, side by side: median seconds, and the ratio to
    the overlayfs cold start on the same containerd (the hot list recorded once, on the first)."""
    others: list[tuple[ContainerdInstall, dict[str, Scenario]]] = context.get("other_containerds") or []
    if not others:
        return []
    columns = [(context["containerds"][0], scenarios), *others]
    heads = [".".join(map(str, install.version[:3])) for install, _ in columns]
    lines = ["", "## containerd versions side by side (`--containerds`)", "",
             "Each repetition ran every start on each containerd in turn, on fresh nodes; medians in s, and × "
             "the overlayfs cold start on the same containerd. The fuse scenarios run no containerd (first only).",
             "", "| scenario | " + " | ".join(f"containerd {h} (s) | × overlay-cold" for h in heads) + " |",
             "|---|" + "---|---|" * len(columns)]
    for name in scenarios:
        if base_name(name) in KINDS["fuse"] or not any(by_name.get(name) and by_name[name].runs for _, by_name in columns):
            continue
        cells = []
        for _, by_name in columns:
            median = by_name[name].median(lambda r: r.seconds) if name in by_name else None
            baseline = by_name["overlay-cold"].median(lambda r: r.seconds) if "overlay-cold" in by_name else None
            cells += [fmt(median), fmt(median / baseline if median and baseline else None)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    errors = [f"- containerd {install.series}, {name}: {e}" for install, by_name in others
              for name, s in by_name.items() for e in s.errors]
    return lines + (["", *errors] if errors else [])


def _median_requests(scenario: Scenario) -> dict[str, float]:
    """Median FUSE requests per start of ``scenario``, by operation, and in all (``total``)."""
    per_run = [run_fuse_requests(r) for r in scenario.runs if any(k.startswith("fuse.requests.") for k in r.server)]
    if not per_run:
        return {}
    ops = sorted({op for requests in per_run for op in requests})
    medians = {op: statistics.median(requests.get(op, 0.0) for requests in per_run) for op in ops}
    medians["total"] = statistics.median(sum(requests.values()) for requests in per_run)
    return medians


#: The overlayfs start a BootSeer start's page-cache growth is held against (the same start).
PAGE_CACHE_BASELINES = {"lazy-cold": "overlay-cold", "lazy-local": "overlay-local", "lazy-warm": "overlay-warm",
                        "lazy-complete": "overlay-local", "hot-cold": "overlay-cold", "fuse-cold": "overlay-cold",
                        "fuse-local": "plain-local"}
#: A growth below this is noise (a warm start reads nothing new): no ratio is taken against it.
PAGE_CACHE_NOISE = 16 * MB


def data_path_section(scenarios: dict[str, Scenario], paths: list[str]) -> list[str]:
    """Per data path: each BootSeer start's FUSE requests by operation and its page-cache growth, beside
    overlayfs's growth for the same start."""
    rows = []
    for base in ("lazy-cold", "lazy-local", "lazy-warm", "lazy-complete", "hot-cold", "fuse-cold", "fuse-local"):
        for path in paths:
            scenario = scenarios.get(named(base, path))
            if scenario is None or not scenario.runs:
                continue
            requests = _median_requests(scenario)
            ops = ", ".join(f"{op} {count:.0f}" for op, count in sorted(requests.items(), key=lambda item: -item[1])
                            if op != "total") or "—"
            growth = scenario.median(lambda r: r.page_cache_bytes)
            against = scenarios.get(PAGE_CACHE_BASELINES[base])
            other = against.median(lambda r: r.page_cache_bytes) if against is not None else None
            ratio = growth / other if growth is not None and other and other > PAGE_CACHE_NOISE else None
            rows.append(f"| {base} | {path} | {fmt(scenario.median(lambda r: r.seconds))} | "
                        f"{fmt(requests.get('total'), '.0f')} | {ops} | {fmt(growth and growth / MB, '.0f')} | "
                        f"{PAGE_CACHE_BASELINES[base]} {fmt(other and other / MB, '.0f')} | {fmt(ratio)} |")
    if not rows:
        return []
    return ["", "## Per data path: FUSE requests and page-cache growth per start (medians)", "",
            "FUSE requests: the layer server's `bootseer_fuse_requests_total` (every filesystem it serves, by `op`), "
            "scraped from its Prometheus endpoint before and after each start. Page cache: file pages "
            "(`Active(file) + Inactive(file)` in /proc/meminfo, machine-wide) after the container exited minus just "
            "before the start (after the drop, for the cold and local starts); other work on the machine adds its "
            f"own, so figures under {PAGE_CACHE_NOISE / MB:.0f} MB are not compared.", "",
            "| start | data path | s | FUSE requests | by op | page cache + (MB) | overlayfs, same start (MB) | × |",
            "|---|---|---|---|---|---|---|---|", *rows]


def _median_userspace(scenario: Scenario) -> float | None:
    """Median userspace requests per start of a BootSeer ``scenario`` (FUSE requests + fanotify events); None
    for the overlayfs ones (no layer server figures)."""
    runs = [r for r in scenario.runs if r.server]
    return statistics.median(run_userspace_events(r) for r in runs) if runs else None


def _median_server(scenario: Scenario, key: str) -> float | None:
    """Median of the layer server figure ``key`` over the runs of ``scenario`` that have it."""
    values = [r.server[key] for r in scenario.runs if key in r.server]
    return statistics.median(values) if values else None


def userspace_section(scenarios: dict[str, Scenario], paths: list[str]) -> list[str]:
    """Issue 25: per BootSeer start and data path, the requests its reads made of userspace (FUSE requests,
    fanotify events by outcome), the CPU seconds of the layer server (and of the fanotify path's event holder),
    and the local blobs complete after the start."""
    rows = []
    for base in ("lazy-cold", "lazy-local", "lazy-warm", "lazy-complete", "hot-cold"):
        for path in paths:
            scenario = scenarios.get(named(base, path))
            if scenario is None or not scenario.runs:
                continue
            per_run = [run_fanotify_events(r) for r in scenario.runs]
            outcomes = sorted({outcome for events in per_run for outcome in events})
            by_outcome = ", ".join(f"{outcome} {statistics.median(e.get(outcome, 0.0) for e in per_run):.0f}"
                                   for outcome in outcomes) or "—"
            by_holder = _median_server(scenario, "fanotify.answered_by_holder")
            if by_holder is not None:
                by_outcome += f" (the holder answered {by_holder:.0f})"
            events = statistics.median(sum(e.values()) for e in per_run)
            blobs = _median_server(scenario, "fanotify.blobs")
            complete = _median_server(scenario, "fanotify.complete")
            rows.append(
                f"| {base} | {path} | {fmt(scenario.median(lambda r: r.seconds))} | "
                f"{fmt(_median_requests(scenario).get('total', 0.0), '.0f')} | "
                f"{fmt(events, '.0f') if blobs is not None else '—'} | {by_outcome} | "
                f"{fmt(_median_userspace(scenario), '.0f')} | "
                f"{fmt(_median_server(scenario, 'fanotify.fill_seconds'))} | "
                f"{fmt(_median_server(scenario, 'server.cpu_seconds'))} | "
                f"{fmt(_median_server(scenario, 'holder.cpu_seconds'))} | "
                + (f"{complete:.0f} of {blobs:.0f} ({_median_server(scenario, 'fanotify.missing_blocks'):.0f} "
                   f"blocks missing)" if blobs is not None and complete is not None else "—") + " |")
    if not rows:
        return []
    return ["", "## Userspace requests and CPU per start (issue 25; medians)", "",
            "Userspace requests: what the start's reads asked of the layer server, FUSE requests "
            "(`bootseer_fuse_requests_total`, every filesystem it serves) plus fanotify pre-access events "
            "(`bootseer_fanotify_events_total` by `outcome`: present = every block already on disk, filled = "
            "blocks fetched and written first, denied / unknown = EIO), both scraped from its Prometheus page "
            "before and after the start; of the events, those the event holder answered itself from the fill map "
            "(its status's `answered_by_holder`, where it has one) never reached the server. Fill: the summed seconds of the filled events "
            "(`bootseer_fanotify_fill_seconds_sum`). CPU: the layer server's `process_cpu_seconds_total` over "
            "the start (a cold start's includes the server's own start-up: it starts with the pull) and, on "
            "fanotify, the event holder's (the process that reads the group and passes each event on; "
            "`/proc/PID/stat` utime + stime). Blobs: the layer server's `status` (`fanotify`) after the start.", "",
            "| start | data path | s | FUSE requests | fanotify events | by outcome | userspace requests | "
            "fill (s) | layer-server CPU (s) | holder CPU (s) | blobs complete after |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def complete_blob_check(scenarios: dict[str, Scenario], path: str) -> str:
    """Issue 25's third target on ``path``: 0 userspace requests for bytes on the node once their blob is
    complete.  The events are not per blob, so it is measured only where every blob was complete after the cold
    start (then the local start, page cache dropped, must ask userspace nothing); otherwise the line says why it
    does not apply."""
    label = f"[{path}] userspace requests of a start once every blob is complete (lazy-local after lazy-cold)"
    wanted = f"= {TARGET_COMPLETE_BLOB_REQUESTS}"
    cold, local = scenarios.get(named("lazy-cold", path)), scenarios.get(named("lazy-local", path))
    if cold is None or not cold.runs:
        return f"| {label} | {wanted} | — | not measured |"
    pairs = [(r.server.get("fanotify.complete"), r.server.get("fanotify.blobs"), r.server.get("fanotify.missing_blocks"))
             for r in cold.runs]
    if any(blobs is None for _, blobs, _ in pairs):
        return f"| {label} | {wanted} | — | not measured (no `fanotify` section in the layer server's status) |"
    seen = "; ".join(f"run {i + 1}: {complete:.0f} of {blobs:.0f} complete, {missing:.0f} blocks missing"
                     for i, (complete, blobs, missing) in enumerate(pairs))
    if all(complete == blobs for complete, blobs, _ in pairs):
        value = _median_userspace(local) if local is not None else None
        if value is None:
            return f"| {label} | {wanted} | — | not measured ({seen}) |"
        return (f"| {label} | {wanted} | {value:.0f} | "
                f"{'met' if value <= TARGET_COMPLETE_BLOB_REQUESTS else 'MISSED'} ({seen}) |")
    return (f"| {label} | {wanted} | after the cold start: {seen} | does not apply: a start reads only part of "
            f"each layer, so the blobs it reads stay partial (marked) and their present blocks still raise "
            f"events (`present`); the events are not counted per blob, so a complete one's cannot be told apart |")


def blobs_wait_section(scenarios: dict[str, Scenario], paths: list[str]) -> list[str]:
    """Issue 36: per run of lazy-complete, the wait before it (the node idle until its layer server's background
    fill had completed every served blob, :class:`~bench.lazy_scenarios.BlobsWait`), what the fill wrote meanwhile,
    and the start that followed."""
    lines = []
    for path in paths:
        scenario = scenarios.get(named("lazy-complete", path))
        runs = [r for r in scenario.runs if r.blobs_wait is not None] if scenario is not None else []
        if not runs:
            continue
        waits = [r.blobs_wait for r in runs if r.blobs_wait is not None]
        rows = [("waited (s): from the end of lazy-warm to every blob whole and unmarked",
                 [f"{w.seconds:.1f}" for w in waits]),
                ("every served blob complete at (s; its mark may stay while a recording holds it)",
                 [fmt(w.filled_seconds, ".1f") for w in waits]),
                ("blobs complete, of served", [f"{w.complete_blobs} of {w.blobs}" for w in waits]),
                ("complete blobs still marked at the end", [str(w.held_marked) for w in waits]),
                ("blocks missing at the end", [str(w.missing_blocks) for w in waits]),
                ("background fill wrote during the wait (MB stored)", [f"{w.fill_bytes / MB:.1f}" for w in waits]),
                ("its blocks / batches", [f"{w.fill_blocks} / {w.fill_batches}" for w in waits]),
                ("times it yielded / batches failed", [f"{w.fill_yielded} / {w.fill_failed}" for w in waits]),
                ("then the start: first output (s)", [f"{r.seconds:.2f}" for r in runs]),
                ("its fanotify events (by outcome)",
                 [f"{sum(run_fanotify_events(r).values()):.0f}" + (" (" + ", ".join(
                     f"{outcome} {count:.0f}" for outcome, count in sorted(run_fanotify_events(r).items())) + ")"
                     if run_fanotify_events(r) else "") for r in runs]),
                ("its FUSE requests", [f"{sum(run_fuse_requests(r).values()):.0f}" for r in runs]),
                ("background fill during the start (MB stored)",
                 [f"{r.server.get('fanotify.background_fill.stored_bytes', 0) / MB:.1f}" for r in runs])]
        lines += ["", f"Data path {path}:", "",
                  "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
                  "|---|" + "---|" * len(runs), *(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows)]
    if not lines:
        return []
    return ["", "## Blobs that complete: the wait before lazy-complete (issue 36)", "",
            "After lazy-warm the node was left idle, its layer server's `status` polled every 0.5 s, until every "
            "served local blob was complete (`fanotify.complete` = `fanotify.blobs`: the background fill had "
            "written the rest of each) and unmarked (`fanotify.held_marked` = 0: a whole blob with blocks written "
            "ahead keeps its mark for 60 s after the last recording of its layer); then the page cache was dropped "
            "and the container started as in lazy-local. What the background fill wrote is its `status` "
            "(`fanotify.background_fill`) at the end of the wait less at its start.", *lines]


def complete_start_check(scenarios: dict[str, Scenario], seconds: dict[str, float | None], path: str) -> str:
    """Issue 36's target on ``path``, judged from lazy-complete: the second start with the page cache dropped, once
    the blobs are complete, within :data:`TARGET_36_COMPLETE_LOCAL` of overlayfs's local start (medians), and
    making :data:`TARGET_36_COMPLETE_EVENTS` userspace requests (every run)."""
    label = (f"[{path}] second start with the page cache dropped once the blobs are complete (lazy-complete) / "
             "overlayfs local start, and its userspace requests (fanotify events + FUSE requests, each run)")
    wanted = f"≤ {TARGET_36_COMPLETE_LOCAL:g}×, {TARGET_36_COMPLETE_EVENTS} requests"
    scenario = scenarios.get(named("lazy-complete", path))
    if scenario is None or not scenario.runs:
        why = "see Failures" if scenario is not None and scenario.errors else "lazy-complete not run"
        return f"| {label} | {wanted} | — | not measured ({why}) |"
    mine, overlay = seconds.get(named("lazy-complete", path)), seconds.get("overlay-local")
    ratio = mine / overlay if mine and overlay else None
    # A run whose metrics scrape failed has no fanotify counters at all: its requests are unknown, not 0.
    requests = [run_userspace_events(r) if any(k.startswith("fanotify.events.") for k in r.server) else None
                for r in scenario.runs]
    shown = f"{fmt(ratio)}×; " + ", ".join(fmt(n, ".0f") for n in requests)
    waits = [r.blobs_wait.seconds for r in scenario.runs if r.blobs_wait is not None]
    if waits:
        shown += f" (after {', '.join(f'{w:.0f}' for w in waits)} s idle)"
    if scenario.errors:
        shown += f"; {len(scenario.errors)} run(s) not measured: see Failures"
    if ratio is None or any(n is None for n in requests):
        return f"| {label} | {wanted} | {shown} | not measured |"
    missed = (["time"] if ratio > TARGET_36_COMPLETE_LOCAL else []) + (
        ["userspace requests"] if any(n is not None and n > TARGET_36_COMPLETE_EVENTS for n in requests) else [])
    return f"| {label} | {wanted} | {shown} | {'met' if not missed else 'MISSED (' + ' and '.join(missed) + ')'} |"


def hot_set_cpu_check(scenarios: dict[str, Scenario], context: dict[str, Any], path: str) -> str:
    """Issue 36's target of the layer server's CPU on ``path``, judged from hot-cold: the median of its CPU seconds
    over the start against decompressing and hashing the frames of the hot list it prefetched on one core
    (:class:`~bench.hot_set_cost.HotSetCost`, measured in this run), at most :data:`TARGET_36_HOT_SET_CPU` times."""
    label = (f"[{path}] layer-server CPU of a hot-list start (hot-cold, median) / decompress + SHA-256 of its hot set "
             "on one core")
    wanted = f"≤ {TARGET_36_HOT_SET_CPU:g}×"
    scenario = scenarios.get(named("hot-cold", path))
    if scenario is None or not scenario.runs:
        why = "see Failures" if scenario is not None and scenario.errors else "hot-cold not run"
        return f"| {label} | {wanted} | — | not measured ({why}) |"
    hot = hot_list(context, path)
    cost: HotSetCost | None = hot.get("hot_set_cost") if hot else None
    server = _median_server(scenario, "server.cpu_seconds")
    if cost is None or not cost.cpu_seconds:
        return f"| {label} | {wanted} | — | not measured (the hot set's decode: see Notes) |"
    if server is None:
        return f"| {label} | {wanted} | — | not measured (no `server.cpu_seconds` in the runs) |"
    ratio = server / cost.cpu_seconds
    return (f"| {label} | {wanted} | {ratio:.2f}× ({server:.2f} s / {cost.cpu_seconds:.3f} s) | "
            f"{'met' if ratio <= TARGET_36_HOT_SET_CPU else 'MISSED'} |")


def issue36_targets(scenarios: dict[str, Scenario], seconds: dict[str, float | None], context: dict[str, Any],
                    paths: list[str]) -> list[str]:
    """Issue 36's targets of this benchmark: blobs that complete, one line per variant among ``paths`` whose data
    path completes its blobs (fanotify), judged from lazy-complete; and the layer server's CPU for the hot set, one
    line per variant that ran hot-cold."""
    def ran(path: str, kind: str) -> bool:
        return any(s.runs or s.errors for s in (scenarios.get(named(base, path)) for base in KINDS[kind]) if s)

    lines = [complete_start_check(scenarios, seconds, path) for path in paths if completes(path) and ran(path, "lazy")]
    lines += [hot_set_cpu_check(scenarios, context, path) for path in paths if ran(path, "hot")]
    if not lines:
        return []
    return ["", "## Targets of issue 36", "",
            "Blobs that complete: judged from lazy-complete, the ratio of medians of this run and the userspace "
            "requests of every run (0 each); lazy-complete runs on the fanotify path only: no other path has local "
            "blobs that a background fill completes. The layer server's CPU for the hot set: judged from hot-cold, "
            "the median of the layer server's `process_cpu_seconds_total` over the start against the frames of the "
            "hot list it prefetched, decompressed and hashed on one core in this run (`bench/hot_set_cost.py`). The "
            "server's CPU over a cold start includes its own start-up and the pull, and all else it did for the "
            "start (layer images and block tables, the reads' misses and events), not the hot set's blocks alone; "
            "the event holder's CPU is not in it.", "",
            "| target | wanted | measured | |", "|---|---|---|---|", *lines]


def fanotify_targets(scenarios: dict[str, Scenario], seconds: dict[str, float | None], context: dict[str, Any],
                     paths: list[str]) -> list[str]:
    """Issue 25's four target lines for each fanotify variant among ``paths``: the local start (page cache
    dropped) against overlayfs's, the hot-list start against its floor, userspace requests of complete blobs,
    and the SIGKILL test (cited: a CI test, not run here)."""
    lines = []
    for path in paths:
        if split_variant(path)[0] != FANOTIFY_PATH:
            continue
        local, overlay = seconds.get(named("lazy-local", path)), seconds.get("overlay-local")
        hot, floor = seconds.get(named("hot-cold", path)), hot_floor(seconds, context, path)
        lines += [
            _check(f"[{path}] second start, page cache dropped (lazy-local) / overlayfs local start",
                   local / overlay if local and overlay else None, TARGET_LOCAL_RATIO),
            _check(f"[{path}] hot-list start (hot-cold) / its floor (hot bytes over the link + "
                   f"{_floor_base(seconds, path)})", hot / floor if hot and floor else None,
                   TARGET_FANOTIFY_HOT_OVER_FLOOR),
            complete_blob_check(scenarios, path),
            f"| [{path}] layer-server SIGKILL under 4 reading containers: wrong or zero bytes | = 0 | "
            f"not run here: CI's `{SIGKILL_TEST}` | cited |",
        ]
    if not lines:
        return []
    return ["", "## Targets of issue 25 (fanotify data path)", "",
            "Ratios of medians of this run; the hot-list floor as above (hot bytes over the measured link rate + "
            "overlayfs's warm start).", "", "| target | wanted | measured | |", "|---|---|---|---|", *lines]


def issue26_targets(seconds: dict[str, float | None], context: dict[str, Any], paths: list[str]) -> list[str]:
    """Issue 26's target lines of this benchmark, per data path among ``paths``: the hot-list start against
    overlayfs's cold start and against its floor, the lazy cold start against overlayfs's, and (on the FUSE
    fallbacks) the second start with the page cache dropped against overlayfs's local start.  The layer
    server's CPU and the peers' are the peers benchmark's; the dependency hit, the deps benchmark's."""
    lines = []
    for path in paths:
        data_path = split_variant(path)[0]
        hot, floor, overlay = seconds.get(named("hot-cold", path)), hot_floor(seconds, context, path), seconds.get("overlay-cold")
        lazy, local = seconds.get(named("lazy-cold", path)), seconds.get(named("lazy-local", path))
        lines += [
            _check(f"[{path}] hot-list start (hot-cold) / overlayfs cold start", hot / overlay if hot and overlay else None,
                   1 / TARGET_26_HOT_SPEEDUP, f"≤ {1 / TARGET_26_HOT_SPEEDUP:.3g}× (≥ {TARGET_26_HOT_SPEEDUP:g}× faster)"),
            _check(f"[{path}] hot-list start / its floor", hot / floor if hot and floor else None, TARGET_26_HOT_OVER_FLOOR),
            _check(f"[{path}] lazy cold start / overlayfs cold start", lazy / overlay if lazy and overlay else None,
                   TARGET_26_COLD_RATIO),
        ]
        if data_path != FANOTIFY_PATH:
            base = seconds.get("overlay-local")
            lines.append(_check(f"[{path}] second start, page cache dropped (lazy-local, a FUSE fallback) / overlayfs "
                                "local start", local / base if local and base else None, TARGET_26_FALLBACK_LOCAL))
    if not lines:
        return []
    return ["", "## Targets of issue 26", "",
            "Ratios of medians of this run; the hot-list floor as above.", "", "| target | wanted | measured | |",
            "|---|---|---|---|", *lines]


#: The BootSeer starts compared between image sources.
SOURCE_STARTS = ("lazy-cold", "lazy-local", "lazy-warm", "hot-cold")


def built_twin(path: str) -> str | None:
    """The node-built variant of a converter-image ``path`` (``erofs`` -> ``erofs+built``); None for the others."""
    data_path, source = split_variant(path)
    twin = variant(data_path, "node")
    return twin if source == "converter" and twin != path else None


def image_source_section(scenarios: dict[str, Scenario], context: dict[str, Any], paths: list[str]) -> list[str]:
    """Issue 24: per start and image source, the pull alone, FUSE requests by operation and the bytes over the
    link before the first output (medians, beside the node-built start's); then each source's image bytes per
    layer beside the layer index."""
    if len(context.get("image_sources") or []) < 2 and not context.get("image_bytes"):
        return []
    rows = []
    for base in SOURCE_STARTS:
        for path in paths:
            scenario = scenarios.get(named(base, path))
            if scenario is None or not scenario.runs:
                continue
            data_path, source = split_variant(path)
            requests = _median_requests(scenario)
            ops = ", ".join(f"{op} {count:.0f}" for op, count in sorted(requests.items(), key=lambda item: -item[1])
                            if op != "total") or "—"
            link = scenario.median(lambda r: r.link_bytes)
            twin = scenarios.get(named(base, built_twin(path) or ""))
            theirs = twin.median(lambda r: r.link_bytes) if twin is not None and twin.runs else None
            pull = scenario.median(lambda r: r.pull_seconds)
            their_pull = twin.median(lambda r: r.pull_seconds) if twin is not None and twin.runs else None
            rows.append(f"| {base} | {data_path} | {source} | {fmt(pull) if pull else '—'} | "
                        f"{fmt(pull / their_pull if pull and their_pull else None)} | "
                        f"{fmt(scenario.median(lambda r: r.seconds))} | {fmt(requests.get('total'), '.0f')} | {ops} | "
                        f"{fmt(link / MB, '.1f')} | {fmt(link / theirs if link is not None and theirs else None)} |")
    lines = ["", "## Image sources: converter-built against node-built images (issue 24)", "",
             "Each BootSeer start once per image source on fresh nodes, against the same overlayfs baselines: "
             f"`converter` (`name@PATH`: the store's images, published by `bootseer convert`) and `node` "
             f"(`name@PATH{SOURCE_SUFFIX['node']}`: a store converted with `--no-image`, so the node builds each "
             "image from the layer index). Medians. `pull`: `bootseer rpull` until every snapshot is ready (the local "
             "and warm starts pull nothing); link bytes: what crossed the link from the start of the pull to the "
             "first output (registry and store); × built: against the node-built start's.", "",
             "| start | data path | image source | pull (s) | pull × built | first output (s) | FUSE requests "
             "| by op | link bytes (MB) | link × built |", "|---|---|---|---|---|---|---|---|---|---|", *rows]
    for source, layers in (context.get("image_bytes") or {}).items():
        lines += ["", f"Image bytes per layer, source `{source}` (the chain records of its store: the index object's "
                  "bytes; the image table `v1/images/<name>`: `size`, the raw image, and the sum of its blocks' "
                  "`clen`, what the store holds and a node fetches):", "",
                  "| layer | files | index (KB) | image raw (KB) | image stored (KB) | stored / index | inline max |",
                  "|---|---|---|---|---|---|---|"]
        for row in layers:
            image, stored = row.get("image_bytes"), row.get("image_stored")
            lines.append(f"| {row['layer']} | {row['files']} | {row['index_bytes'] / 1000:.0f} | "
                         f"{fmt(image and image / 1000, '.0f') if image is not None else 'none (built on the node)'} | "
                         f"{fmt(stored / 1000, '.0f') if stored is not None else '—'} | "
                         f"{fmt(stored / row['index_bytes']) if stored is not None and row['index_bytes'] else '—'} | "
                         f"{row.get('inline_max', '—')} |")
        total = sum(row.get("image_stored", 0) for row in layers)
        if total:
            lines.append(f"| all | {sum(row['files'] for row in layers)} | "
                         f"{sum(row['index_bytes'] for row in layers) / 1000:.0f} | "
                         f"{sum(row.get('image_bytes', 0) for row in layers) / 1000:.0f} | {total / 1000:.0f} | | |")
    return lines


def source_checks(scenarios: dict[str, Scenario], paths: list[str]) -> list[str]:
    """Issue 24's target lines per converter-image data path: the pull on a fresh node, FUSE requests per cold
    start, and the bytes over the link before the first output against the node-built start's."""
    lines = []
    for path in paths:
        twin = built_twin(path)
        if twin is None:
            continue
        for base in ("lazy-cold", "hot-cold"):
            mine, theirs = scenarios.get(named(base, path)), scenarios.get(named(base, twin))
            if mine is None or not (mine.runs or mine.errors):
                continue
            pull = mine.median(lambda r: r.pull_seconds)
            requests = _median_requests(mine).get("total")
            their_pull = theirs.median(lambda r: r.pull_seconds) if theirs is not None else None
            link = mine.median(lambda r: r.link_bytes)
            their_link = theirs.median(lambda r: r.link_bytes) if theirs is not None else None
            lines += [
                _check(f"[{path}] pull on a fresh node ({base})", pull, TARGET_PULL_SECONDS,
                       f"≤ {TARGET_PULL_SECONDS:g} s", "s"),
                f"| [{path}] pull ({base}) / the node-built pull ({twin}) | (reported) | "
                f"{fmt(pull / their_pull if pull and their_pull else None)}× | |",
                _check(f"[{path}] FUSE requests per cold start ({base})", requests, TARGET_COLD_FUSE_REQUESTS,
                       f"≤ {TARGET_COLD_FUSE_REQUESTS:,}", ""),
                _check(f"[{path}] link bytes before the first output ({base}) / the node-built start's",
                       link / their_link if link is not None and their_link else None, TARGET_LINK_OVER_BUILT),
            ]
    return lines


def _check(label: str, value: float | None, target: float, wanted: str | None = None, unit: str = "×") -> str:
    """One target line: ``| label | wanted | measured | met or MISSED |``."""
    wanted = wanted or f"≤ {target:g}×"
    if value is None:
        return f"| {label} | {wanted} | — | not measured |"
    shown = f"{value:.0f}" if unit == "" else f"{value:.2f} {unit}" if unit == "s" else f"{value:.2f}{unit}"
    return f"| {label} | {wanted} | {shown} | {'met' if value <= target else 'MISSED'} |"


def target_checks(scenarios: dict[str, Scenario], seconds: dict[str, float | None], context: dict[str, Any],
                  paths: list[str]) -> list[str]:
    """One check line per target and data path: ``TARGET [path] wanted measured met|MISSED``."""
    lines = []

    def ratio(top: str, bottom: str) -> float | None:
        a, b = seconds.get(top), seconds.get(bottom)
        return a / b if a and b else None

    check = _check

    def growth(name: str) -> float | None:
        scenario = scenarios.get(name)
        return scenario.median(lambda r: r.page_cache_bytes) if scenario is not None else None

    def asked(name: str) -> bool:
        """Whether scenario ``name`` was run (or tried): a target of one not asked for gets no line."""
        scenario = scenarios.get(name)
        return scenario is not None and bool(scenario.runs or scenario.errors)

    tree = TREE_PATH if TREE_PATH in paths else None
    for path in paths:
        at = f"[{path}]"
        lines.append(check(f"{at} all-local start (lazy-warm) / overlayfs warm start",
                           ratio(named("lazy-warm", path), "overlay-warm"), TARGET_LOCAL_RATIO))
        lines.append(check(f"{at} all-local start, page cache dropped (lazy-local) / overlayfs local start",
                           ratio(named("lazy-local", path), "overlay-local"), TARGET_LOCAL_RATIO))
        lines.append(check(f"{at} lazy cold start / overlayfs cold start",
                           ratio(named("lazy-cold", path), "overlay-cold"), TARGET_COLD_RATIO))
        lazy = scenarios.get(named("lazy-cold", path))
        if lazy is not None and lazy.runs:
            read = lazy.median(lambda r: _read_bytes(r) or 0.0) if any(_read_bytes(r) for r in lazy.runs) else None
            fetched = lazy.median(lambda r: _fetched_bytes(r) or 0.0)
            lines.append(check(f"{at} bytes fetched / bytes read (lazy-cold)", fetched / read if read else None,
                               TARGET_FETCH_OVER_READ))
        hot = seconds.get(named("hot-cold", path))
        floor = hot_floor(seconds, context, path)
        if asked(named("hot-cold", path)):
            lines.append(check(f"{at} hot-list start on a fresh node / overlayfs cold start",
                               ratio(named("hot-cold", path), "overlay-cold"), 1 / TARGET_HOT_SPEEDUP,
                               f"≤ {1 / TARGET_HOT_SPEEDUP:g}× (≥ {TARGET_HOT_SPEEDUP:g}× faster)"))
            lines.append(check(f"{at} hot-list start / its floor (hot bytes over the link + "
                               f"{_floor_base(seconds, path)})", hot / floor if hot and floor else None,
                               TARGET_HOT_OVER_FLOOR))
        if tree is not None and path != tree:
            for base in ("lazy-cold", "lazy-local", "lazy-warm", "hot-cold"):
                mine = _median_requests(scenarios.get(named(base, path), Scenario(""))).get("total")
                theirs = _median_requests(scenarios.get(named(base, tree), Scenario(""))).get("total")
                if mine is None and theirs is None:
                    continue
                value = mine / theirs if mine is not None and theirs else None
                lines.append(check(f"{at} FUSE requests per start ({base}) / the tree path's", value,
                                   TARGET_FUSE_REQUESTS_RATIO, f"≤ {TARGET_FUSE_REQUESTS_RATIO:g}× (1/10)"))
        for base in ("lazy-cold", "lazy-local", "hot-cold"):
            mine, theirs = growth(named(base, path)), growth(PAGE_CACHE_BASELINES[base])
            if not asked(named(base, path)):
                continue
            value = mine / theirs if mine is not None and theirs and theirs > PAGE_CACHE_NOISE else None
            lines.append(check(f"{at} page-cache growth ({base}) / overlayfs's ({PAGE_CACHE_BASELINES[base]})",
                               value, TARGET_PAGE_CACHE_RATIO))
        if seconds.get(named("fuse-local", path)) and seconds.get("plain-local"):
            lines.append(check(f"{at} (layer server alone) fuse-local / plain-local",
                               ratio(named("fuse-local", path), "plain-local"), TARGET_LOCAL_RATIO))
    return lines + source_checks(scenarios, paths)


def report(args: argparse.Namespace, image: image_build.Image, scenarios: dict[str, Scenario],
           context: dict[str, Any]) -> str:
    seconds = {name: s.median(lambda r: r.seconds) for name, s in scenarios.items()}
    paths: list[str] = context.get("data_paths") or [TREE_PATH]
    support = context.get("data_path_flag", {})
    lines = [
        "# Lazy image layers: benchmark results",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {machine(context['containerds'][0])}",
        f"- Command: `{shlex.join(['python', '-m', 'bench.lazy_bench', *sys.argv[1:]])}`",
        f"- Code: {code_version()}",
        f"- Data paths x image sources: {', '.join(paths)} (each BootSeer scenario once per data path and image "
        f"source, `name@path` with the converter's images, `name@path{SOURCE_SUFFIX['node']}` with node-built ones; "
        f"`--data-path` passed to the snapshotter: {'yes' if support.get('snapshotter') else 'no, it takes none'})",
        f"- Image: {len(image.layers)} layers, {image.unpacked_bytes / MB:.0f} MB unpacked, "
        f"{image.compressed_bytes / MB:.0f} MB gzip: "
        + ", ".join(f"{layer.name} {layer.tar_size / MB:.0f} MB" for layer in image.layers)
        + f"; command `python3 /app/train.py` (import torch, one SGD step, prints `{image_build.FIRST_OUTPUT_MARKER}`)",
        f"- The lazy nodes' background fill ([datapath] background_fill): {getattr(args, 'background_fill', 'on')}; "
        f"fill group ([datapath] fill_group): {getattr(args, 'fill_group', None) or 'the default'}",
        f"- Link: veth pair into a private network namespace holding the registry and the store's nginx, "
        f"tbf {args.rate} each way (measured {fmt(context.get('link_rate'), '.1f')} MB/s with one HTTP GET)",
        f"- Each node fresh (new containerd root and snapshotter root, empty caches); the page cache dropped "
        f"before every cold and local start, not before a warm one; {args.reps} repetitions; wall time "
        f"{context['wall'] / 60:.1f} min",
        f"- Load average (5 min) of the machine, which other work shares: {context['load'][0]:.1f} at the start, "
        f"{context['load'][1]:.1f} at the end, on {os.cpu_count()} cores",
        "",
        "## Time to the first useful output",
        "",
        "| scenario | what is timed | runs (s) | median (s) | pull (s) | × baseline | link bytes (MB) "
        "| page cache + (MB) | FUSE requests | userspace requests | layer-server CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, scenario in scenarios.items():
        if not scenario.runs and not scenario.errors:
            continue  # not asked for
        baseline = seconds[BASELINES[base_name(name)]]
        ratio = seconds[name] / baseline if seconds[name] and baseline else None
        runs = ", ".join(f"{r.seconds:.2f}" for r in scenario.runs) or "—"
        requests = _median_requests(scenario).get("total")
        lines.append(
            f"| {name} | {SCENARIOS[base_name(name)]} | {runs} | {fmt(seconds[name])} | "
            f"{fmt(scenario.median(lambda r: r.pull_seconds))} | {fmt(ratio)} | "
            f"{fmt(scenario.median(lambda r: r.link_bytes / MB), '.1f')} | "
            f"{fmt(scenario.median(lambda r: r.page_cache_bytes / MB), '.0f')} | {fmt(requests, '.0f')} | "
            f"{fmt(_median_userspace(scenario), '.0f')} | {fmt(_median_server(scenario, 'server.cpu_seconds'))} |")
    lines += ["", "Baselines (medians of the same run): "
              + "; ".join(f"{base} against {BASELINES[base]}" for base in SCENARIOS
                          if base != BASELINES[base] and any(base_name(name) == base and (s.runs or s.errors)
                                                             for name, s in scenarios.items()))
              + ". `pull` is the pull alone (for the fuse scenarios: the layer mounts)."]
    # The bytes of a lazy start: through containerd if it ran, else through the layer server alone.
    first = paths[0]
    lazy = scenarios[named("lazy-cold", first)]
    if not lazy.runs and scenarios[named("fuse-cold", first)].runs:
        lazy = scenarios[named("fuse-cold", first)]
    read = lazy.median(lambda r: _read_bytes(r) or 0.0) if any(_read_bytes(r) for r in lazy.runs) else None
    fetched = lazy.median(lambda r: _fetched_bytes(r) or 0.0) if lazy.runs else None

    def median_of(key: str) -> float | None:
        values = [r.server[key] for r in lazy.runs if key in r.server]
        return statistics.median(values) if values else None

    lines += ["", f"## Bytes ({lazy.name}, medians)", "",
              "| figure | MB |", "|---|---|",
              f"| crossed the link (registry + store; host end's interface counters) | {fmt(fetched and fetched / MB, '.1f')} |",
              f"| fetched from the store (layer server: range requests, gaps included) "
              f"| {fmt(median_of('store.bytes_fetched') and median_of('store.bytes_fetched') / MB, '.1f')} |",
              f"| of which blocks the reads needed (compressed) "
              f"| {fmt(median_of('store.blocks.bytes_fetched') and median_of('store.blocks.bytes_fetched') / MB, '.1f')} |",
              f"| read by the start-up: raw bytes of the {fmt(median_of('store.blocks.blocks_fetched'), '.0f')} "
              f"distinct blocks it touched (node cache growth; — on fanotify, whose fills go to the blobs) "
              f"| {fmt(read and read / MB, '.1f')} |",
              f"| whole image, gzip (what overlayfs pulls) | {image.compressed_bytes / MB:.1f} |",
              f"| whole image, unpacked | {image.unpacked_bytes / MB:.1f} |"]
    lines += containerd_section(scenarios, context)
    lines += data_path_section(scenarios, paths)
    lines += userspace_section(scenarios, paths)
    lines += blobs_wait_section(scenarios, paths)
    lines += image_source_section(scenarios, context, paths)
    for path in paths:
        lines += hot_section(scenarios, seconds, context, path)
    for scenario in scenarios.values():
        keys = sorted({k for r in scenario.runs for k in r.server})
        if keys:
            lines += ["", f"Layer server figures per {scenario.name} run (counters: what the run added):", "",
                      "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(scenario.runs))) + " |",
                      "|---|" + "---|" * len(scenario.runs)]
            for key in keys:
                spec = ".2f" if key.endswith("seconds") else ".0f"
                lines.append(f"| {key} | " + " | ".join(format(r.server.get(key, 0), spec) for r in scenario.runs)
                             + " |")
    checks = target_checks(scenarios, seconds, context, paths)
    lines += ["", "## Targets", "", "Each a ratio of medians of this run, per data path.", "",
              "| target | wanted | measured | |", "|---|---|---|---|", *checks]
    lines += fanotify_targets(scenarios, seconds, context, paths)
    lines += issue36_targets(scenarios, seconds, context, paths)
    lines += issue26_targets(seconds, context, paths)
    summaries = sorted({r.pull_summary for name, s in scenarios.items() if base_name(name) == "lazy-cold"
                        for r in s.runs if r.pull_summary})
    if summaries:
        lines += ["", "`bootseer rpull` said: " + "; ".join(f"`{text}`" for text in summaries)]
    outputs = sorted({r.output for s in scenarios.values() for r in s.runs})
    if outputs:
        lines += ["", "The job's first useful output: " + "; ".join(f"`{text}`" for text in outputs)]
    converts = context.get("convert_seconds")
    if isinstance(converts, dict):
        done = [f"`{what}` {value:.1f} s" for what, value in converts.items() if value is not None]
        if done:
            lines += ["", "Conversions this run made (cached after): " + "; ".join(done) + "."]
    elif converts is not None:
        lines += ["", f"`bootseer convert` of the image took {converts:.1f} s (once; cached after)."]
    if context.get("profile_dir"):
        for name in (named(base, path) for path in paths for base in ("lazy-cold", "hot-cold", "lazy-local", "lazy-warm",
                                                                      "lazy-complete", "fuse-cold", "fuse-local")):
            rows = summarize_profile(context["profile_dir"] / f"{name}-1.txt")
            if rows:
                lines += ["", f"## Where the layer server's time goes: {name}, run 1 (py-spy --gil)", "", *rows]
    timeline = context.get("timeline")
    if timeline:
        starts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in timeline["scenarios"].items())
        lines += ["", "## Where a start goes (`--timeline`, profiled, not in the medians above)", "",
                  f"One more cold start of each on a fresh node with the start-up profiler on ({starts} to the first "
                  f"output; the snapshotter's default data path); `bootseer profile compare` of the two traces (files "
                  f"in `{timeline['dir']}`: {', '.join(timeline['files'])}):", "", "```", timeline["table"], "```"]
    errors = [f"- {name}: {e}" for name, s in scenarios.items() for e in s.errors]
    if errors:
        lines += ["", "## Failures", "", *errors]
    if context.get("notes"):
        lines += ["", "## Notes", "", *[f"- {n}" for n in context["notes"]]]
    return "\n".join(lines) + "\n"
