"""Measure what the profiler costs: ``python -m bootseer.profile.overhead [--events N] [--dir DIR]``.

Prints the per-call cost of an emitting call with profiling off (the module-global test), and with
it on: events per second and microseconds per event into a spool (one thread, then four threads at
once), and the spool's bytes per event. A measurement, not a target: numbers depend on the disk
and the machine (docs/profile.md lists the ones measured where BootSeer is developed).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from bootseer.profile import events


def _per_call(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def measure(n: int, directory: Path) -> dict[str, float]:
    events.disable()
    off_emit = _per_call(lambda: events.emit("image.layer", "span", start=1.0, end=2.0, phase="image", layer="x"), n)
    traced = events.traced("x")(lambda: None)
    off_traced = _per_call(traced, n) - _per_call(lambda: None, n)
    spool = events.enable(directory)
    try:
        on_emit = _per_call(lambda: events.emit("image.layer", "span", start=1.0, end=2.0, phase="image",
                                                layer="sha256:" + "a" * 64, state="lazy"), n)
        size = sum(p.stat().st_size for p in directory.glob("events-*.jsonl"))
        threads = [threading.Thread(target=lambda: [events.emit("t", i=i) for i in range(n // 4)]) for _ in range(4)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        four = time.perf_counter() - start
    finally:
        events.disable()
        del spool
    return {"off_emit_ns": off_emit * 1e9, "off_traced_ns": off_traced * 1e9, "on_emit_us": on_emit * 1e6,
            "on_events_per_s": 1 / on_emit, "four_threads_events_per_s": (n // 4 * 4) / four,
            "bytes_per_event": size / n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--dir", help="spool directory (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bootseer-profile-") as scratch:
        results = measure(args.events, Path(args.dir or scratch))
    print(f"off: emit {results['off_emit_ns']:.0f} ns/call, traced wrapper +{results['off_traced_ns']:.0f} ns/call")
    print(f"on:  {results['on_emit_us']:.1f} us/event ({results['on_events_per_s']:.0f} events/s, one thread), "
          f"{results['four_threads_events_per_s']:.0f} events/s from four threads, "
          f"{results['bytes_per_event']:.0f} bytes/event")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
