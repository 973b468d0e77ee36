"""``bootseer profile``: collect, report, compare, run, containerd, mark.

Exit status: 0 done, 1 nothing to report (an empty spool, no traces for a job), 2 bad input
(a missing or damaged trace, a bad option). ``run`` exits with its command's status.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bootseer.profile import events
from bootseer.profile.trace import Trace, TraceError, collect
from bootseer.paths import DEFAULT_ROOT



def _spool_dir(args: argparse.Namespace) -> Path:
    if getattr(args, "spool", None):
        return Path(args.spool)
    if getattr(args, "root", None):
        return Path(args.root) / "profile"
    setting = os.environ.get(events.ENV_PROFILE, "")
    return Path(setting) if setting.startswith("/") else Path(DEFAULT_ROOT) / "profile"


def _add_spool(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", help=f"the snapshotter's root; the spool is ROOT/profile (default {DEFAULT_ROOT})")
    parser.add_argument("--spool", help="the spool directory (default: $BOOTSEER_PROFILE if a path, else ROOT/profile)")


def _fail(message: str, status: int = 2) -> int:
    print(f"bootseer profile: {message}", file=sys.stderr)
    return status


def _png_unavailable(args: argparse.Namespace) -> str | None:
    """Why ``--png`` cannot be done (no Chromium), before any work; None when it can (or was not asked)."""
    from bootseer.profile.screenshot import find_chromium

    if getattr(args, "png", None) and find_chromium() is None:
        return "--png needs headless Chromium: chromium is not installed (apt-get install chromium)"
    return None


def _write_outputs(args: argparse.Namespace, traces: list[Trace], titles: list[str] | None = None,
                   extra: str = "") -> int:
    """Write the ``--html``, ``--png`` and ``--chrome`` outputs asked for; 0, or 2 if the PNG failed."""
    from bootseer.profile.render import chrome_trace, html_page

    page = html_page(traces, titles, extra) if getattr(args, "html", None) or getattr(args, "png", None) else ""
    if getattr(args, "html", None):
        Path(args.html).write_text(page)
        print(f"timeline: {args.html}")
    if getattr(args, "chrome", None):
        Path(args.chrome).write_text(json.dumps(chrome_trace(traces)))
        print(f"chrome trace: {args.chrome} (open in https://ui.perfetto.dev or chrome://tracing)")
    if getattr(args, "png", None):
        from bootseer.profile.screenshot import ScreenshotError, screenshot

        with tempfile.TemporaryDirectory(prefix="bootseer-png-") as directory:
            source = Path(args.html) if args.html else Path(directory) / "timeline.html"
            if not args.html:
                source.write_text(page)
            try:
                width, height = screenshot(source, Path(args.png))
            except ScreenshotError as exc:
                return _fail(str(exc))
        print(f"picture: {args.png} ({width}x{height})")
    return 0


def collect_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.objects.store import open_store_writer
    from bootseer.profile.cluster import publish
    from bootseer.profile.render import table

    try:
        trace = collect(_spool_dir(args), job=args.job or "", since=args.since, until=args.until, node=args.node or "")
    except TraceError as exc:
        return _fail(str(exc))
    if not trace.events:
        return _fail(f"no events in {_spool_dir(args)} for that job and window", 1)
    output = Path(args.output or f"profile-{trace.node}-{trace.job or 'start'}.json")
    trace.save(output)
    print(f"trace: {output} ({len(trace.events)} events)")
    if args.publish:
        try:
            with open_store_writer(args.publish) as store:
                name = publish(trace, store, args.job)
        except (ValueError, OSError) as exc:
            return _fail(f"cannot publish to the store: {exc}")
        print(f"published: {name}")
    print(table(trace))
    return _write_outputs(args, [trace])


def report_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.objects.store import open_store_writer
    from bootseer.profile.cluster import fetch_job, job_report, job_table
    from bootseer.profile.render import table

    if problem := _png_unavailable(args):
        return _fail(problem)
    try:
        if args.job_id:
            if not args.store:
                return _fail("report --job needs --store URL (where the nodes published their traces)")
            with open_store_writer(args.store) as store:
                traces = fetch_job(store, args.job_id)
            merged = job_report(traces, args.job_id)
            text = job_table(merged)
            print(text)
            if args.json:
                print(json.dumps(merged.to_json(), indent=2))
            order = {s["node"]: i for i, s in enumerate(merged.stragglers)}
            traces.sort(key=lambda t: (order.get(t.node, len(order)), t.node))
            return _write_outputs(args, traces, extra=f"<pre>{_escape(text)}</pre>")
        if not args.trace:
            return _fail("report needs a TRACE file, or --job ID --store URL")
        traces = [Trace.load(args.trace)]
    except TraceError as exc:
        return _fail(str(exc), 1 if "no traces" in str(exc) else 2)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    print(table(traces[0]))
    if args.json:
        from bootseer.profile.render import table_rows

        rows, total = table_rows(traces[0])
        print(json.dumps({"node": traces[0].node, "job": traces[0].job, "total_s": total, "phases": rows}, indent=2))
    return _write_outputs(args, traces)


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def compare_command(args: argparse.Namespace) -> int:
    from bootseer.profile.render import compare_table

    if problem := _png_unavailable(args):
        return _fail(problem)
    try:
        a, b = Trace.load(args.before), Trace.load(args.after)
    except TraceError as exc:
        return _fail(str(exc))
    names = tuple(args.names.split(",", 1)) if args.names else ("before", "after")
    if len(names) != 2:
        return _fail("--names takes two names: BEFORE,AFTER")
    text = compare_table(a, b, names)  # type: ignore[arg-type]
    print(text)
    return _write_outputs(args, [a, b], [f"{names[0]}: {a.node}", f"{names[1]}: {b.node}"],
                          f"<pre>{_escape(text)}</pre>")


def run_command(args: argparse.Namespace) -> int:
    """Run CMD with profiling on: its Python marks go to the spool, its shell marks to $BOOTSEER_MARKS."""
    from bootseer.profile.hooks import harvest_marks
    from bootseer.profile.render import table

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        return _fail("run needs a command: bootseer profile run -- CMD ARGS...")
    spool = _spool_dir(args)
    job = args.job or os.environ.get(events.ENV_JOB, "") or f"run-{int(time.time())}"
    os.environ[events.ENV_JOB] = job
    events.enable(spool)
    marks = Path(tempfile.mkdtemp(prefix="bootseer-marks-"))
    env = dict(os.environ, **{events.ENV_PROFILE: str(spool.absolute()), events.ENV_MARKS: str(marks),
                              events.ENV_JOB: job})
    started = time.time()
    try:
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            return _fail(f"cannot run {command[0]}: {exc.strerror or exc}", 127)
        events.emit("job.started", start=started, command=command[0], child_pid=child.pid)
        # The child gets the terminal's signals itself; we only wait for it.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            status = child.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
        events.emit("job.run", "span", start=started, end=time.time(), command=command[0], exit_status=status)
        harvest_marks(marks)
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    trace = collect(spool, job=job, since=started - 0.001)
    output = Path(args.output or f"profile-{trace.node}-{job}.json")
    trace.save(output)
    print(f"trace: {output}", file=sys.stderr)
    print(table(trace), file=sys.stderr)
    return status if status >= 0 else 128 - status


def containerd_command(args: argparse.Namespace) -> int:
    from bootseer.profile.containerd import ContainerdEventsError, watch

    events.enable(_spool_dir(args))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    written, connected = 0, False
    while not stop.is_set():
        ready = threading.Event()
        threading.Thread(target=lambda r=ready: (r.wait(), stop.is_set() or print(
            f"watching containerd at {args.address}", flush=True)), daemon=True).start()
        try:
            written += watch(args.address, args.namespace or "", ready=ready, stop=stop)
        except ContainerdEventsError as exc:
            if not (connected or ready.is_set()):
                return _fail(str(exc), 1)  # never reached it: a wrong socket, say
            # containerd restarted: its events until it is back are lost (it keeps no history).
            print(f"bootseer profile: {exc}; reconnecting", file=sys.stderr, flush=True)
        connected = connected or ready.is_set()
        stop.wait(1.0)
    print(f"{written} containerd events written", flush=True)
    return 0


def mark_command(args: argparse.Namespace) -> int:
    try:
        recorded = events.mark(args.name)
    except ValueError as exc:
        return _fail(str(exc))
    return 0 if recorded else _fail("nowhere to record the mark: not under bootseer profile run, not in a "
                                    "profiled container, no $BOOTSEER_PROFILE", 1)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Unix time in seconds (or -SECONDS: that long ago), not {text!r}")
    return time.time() + value if value < 0 else value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="start-up profiler: where a job's start went",
                                   description="Collect, report and compare start-up profiles (docs/profile.md).")
    commands = parser.add_subparsers(dest="profile_command", metavar="SUBCOMMAND", required=True)

    p = commands.add_parser("collect", help="collect a start's events from the node's spool into one trace")
    _add_spool(p)
    p.add_argument("--job", help="the job (events tagged with another job are left out)")
    p.add_argument("--node", help="the node's name in the trace (default: the events' host name)")
    p.add_argument("--since", type=_float, help="window start, Unix seconds or -SECONDS (default: the last image pull)")
    p.add_argument("--until", type=_float, help="window end, Unix seconds or -SECONDS")
    p.add_argument("-o", "--output", help="trace file (default profile-NODE-JOB.json)")
    p.add_argument("--publish", metavar="STORE", help="also put the trace into the store under the job")
    p.add_argument("--html", help="also write the timeline page here (as report --html)")
    p.add_argument("--chrome", help="also write a Chrome trace event file here (as report --chrome)")
    p.set_defaults(func=collect_command)

    p = commands.add_parser("report", help="phase table, HTML timeline and Chrome trace of a trace or a job")
    p.add_argument("trace", nargs="?", help="a trace file from collect or run")
    p.add_argument("--job", dest="job_id", help="merge every node's trace of this job from --store")
    p.add_argument("--store", help="the store the nodes published to")
    p.add_argument("--html", help="write the timeline page here")
    p.add_argument("--png", help="write a picture of the timeline page here (headless Chromium)")
    p.add_argument("--chrome", help="write a Chrome trace event file here (Perfetto, chrome://tracing)")
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    p.set_defaults(func=report_command)

    p = commands.add_parser("compare", help="two starts side by side (before and after BootSeer)")
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--names", help="BEFORE,AFTER labels (default before,after)")
    p.add_argument("--html", help="write both timelines, on one time scale, here")
    p.add_argument("--png", help="write a picture of that page here (headless Chromium)")
    p.add_argument("--chrome", help="write both as one Chrome trace here")
    p.set_defaults(func=compare_command)

    p = commands.add_parser("run", help="run a command outside containers with profiling on")
    _add_spool(p)
    p.add_argument("--job", help="job ID (default $BOOTSEER_JOB, else run-<time>)")
    p.add_argument("-o", "--output", help="trace file (default profile-NODE-JOB.json)")
    p.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=run_command)

    p = commands.add_parser("containerd", help="write containerd's pull, container and task events to the spool")
    _add_spool(p)
    p.add_argument("--address", default="/run/containerd/containerd.sock", help="containerd's socket")
    p.add_argument("--namespace", help="only this namespace's events (default: all)")
    p.set_defaults(func=containerd_command)

    p = commands.add_parser("mark", help="record a mark now (the shell form of bootseer.profile.mark)")
    p.add_argument("name")
    p.set_defaults(func=mark_command)
