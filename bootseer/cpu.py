"""CPU seconds per stage of the block pipeline: where a layer server's CPU goes, counted as it is spent.

A start's bytes pass through stages (the store's reads, decompressing and verifying,
the node cache, the page cache, a local blob's fill), each a blocking section of code
that runs in one thread, a worker thread or trio's.  :func:`stage` wraps such a section
and adds the CPU time its thread spent in it (:func:`time.thread_time`: the thread's
own CPU, user and system, not the wall clock and not other threads') to its stage.
Only sections that never yield to trio are wrapped: across an ``await`` a thread's
CPU time would include every other task's.  A stage entered inside another (a page-cache
warm that writes a local blob) counts its own time, and the outer one the rest: no
second of CPU is counted twice.  What no stage covers (trio's own work:
FUSE replies, the peers' wire, scheduling; the garbage collector) is the process's
CPU time less the stages' sum: :func:`statistics` gives both.

The counts are the process's, like its Prometheus metrics
(``bootseer_stage_cpu_seconds_total{stage}``); the layer server's profiler samples
them into its timeline (``cpu.<stage>`` counters, in milliseconds).
"""

from __future__ import annotations

import contextlib
import gc
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client.core import CounterMetricFamily

#: The stages, in the order bytes pass them.
STAGES = (
    "fetch",  #: reading the store's bytes off its connections (HTTP, S3, local files)
    "decode",  #: decompressing and verifying blocks, the store's and the peers'
    "cache_read",  #: reading (and verifying) blocks from the node cache
    "cache_write",  #: writing verified blocks into the node cache
    "blob_fill",  #: writing verified blocks into a local blob (the fanotify data path)
    "page_cache_warm",  #: putting prefetched blocks into the page cache
    "gc",  #: the garbage collector (with :func:`count_gc`), wherever it ran
)

_seconds = dict.fromkeys(STAGES, 0.0)
_lock = threading.Lock()
_inner = threading.local()  # .spent: CPU seconds of the stages entered inside the current one, in this thread


def _enter() -> tuple[float | None, float]:
    """Open a stage in this thread: what to give :func:`_leave`."""
    outer_inner = getattr(_inner, "spent", None)
    _inner.spent = 0.0
    return outer_inner, time.thread_time()


def _leave(name: str, opened: tuple[float | None, float]) -> None:
    """Close the stage ``opened`` by :func:`_enter`: its CPU, less its inner stages', to ``name``."""
    outer_inner, started = opened
    total = time.thread_time() - started
    spent = max(0.0, total - (_inner.spent or 0.0))
    _inner.spent = None if outer_inner is None else outer_inner + total
    with _lock:
        _seconds[name] += spent


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the CPU time this thread spends in the block to stage ``name`` (KeyError for another name).

    The block must not ``await``: another task's work would be counted."""
    if name not in _seconds:
        raise KeyError(f"no CPU stage {name!r} (the stages: {', '.join(STAGES)})")
    opened = _enter()
    try:
        yield
    finally:
        _leave(name, opened)


_collecting = threading.local()  # .opened: the collection under way in this thread


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _collecting.opened = _enter()
    elif (opened := getattr(_collecting, "opened", None)) is not None:
        _collecting.opened = None
        _leave("gc", opened)


def count_gc() -> None:
    """Count the garbage collector's CPU as the ``gc`` stage from now on, in whatever thread it runs
    (it interrupts the code that allocated: that code's stage is counted without it).  Once per process."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


@dataclass(frozen=True)
class CpuStatistics:
    """CPU seconds per stage since the process started, and the process's own CPU seconds in all."""

    stages: dict[str, float]
    process: float

    @property
    def outside_stages(self) -> float:
        """The process's CPU seconds no stage counted (trio's own work, the wire, FUSE replies, GC)."""
        return max(0.0, self.process - sum(self.stages.values()))


def statistics() -> CpuStatistics:
    """A copy of the counts now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with _lock:
        stages = dict(_seconds)
    return CpuStatistics(stages, usage.ru_utime + usage.ru_stime)


class _StageCollector:
    """``bootseer_stage_cpu_seconds_total{stage}``, read from the counts at each scrape: a stage's
    exit (and a garbage collection's, many a second) adds to one float, not to a metric."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "bootseer_stage_cpu_seconds",
            "CPU seconds the process spent in each stage of the block pipeline (its threads' own CPU time)",
            labels=["stage"],
        )
        with _lock:
            counted = list(_seconds.items())
        for name, seconds in counted:
            family.add_metric([name], seconds)
        yield family


STAGE_CPU = _StageCollector()
prometheus_client.REGISTRY.register(STAGE_CPU)

__all__ = ["STAGES", "STAGE_CPU", "CpuStatistics", "count_gc", "stage", "statistics"]
