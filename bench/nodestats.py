"""What a start cost a node besides time, shared by the benchmarks: page-cache growth, the layer server's metrics, CPU.

:func:`file_pages` is the page cache's file pages now (take it before and after a start);
:func:`scrape_metrics` reads a layer server's Prometheus page into flat figures
(``fuse.requests.lookup``: the FUSE requests by operation; ``fanotify.events.filled``: the
``fanotify`` data path's pre-access events by outcome; ``server.cpu_seconds``: the process's
CPU time), and :func:`fuse_requests` and :func:`fanotify_events` pick the userspace requests
out of the difference of two scrapes.  :func:`cpu_seconds` is a process's CPU time from
``/proc`` (for a process with no metrics page: the ``fanotify`` path's event holder).
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

#: Prometheus series of the layer server worth a figure, by the figure's name and the labels that key it.
FUSE_SERIES = {
    "bootseer_fuse_requests_total": ("fuse.requests", "op"),
    "bootseer_fuse_errors_total": ("fuse.errors", "op", "errno"),
    "bootseer_fuse_read_bytes_total": ("fuse.read_bytes",),
    "bootseer_fuse_read_seconds_sum": ("fuse.read_seconds",),
    "bootseer_layer_read_seconds_sum": ("layer.read_seconds",),
    "bootseer_layer_read_seconds_count": ("layer.reads",),
    "bootseer_fetch_extent_requests_total": ("fetch.range_requests", "kind"),
    "bootseer_fetch_extents_total": ("fetch.extents", "outcome"),
    "bootseer_fetch_gap_bytes_total": ("fetch.gap_bytes",),
    "bootseer_hotlist_prefetch_blocks_total": ("hotlist.prefetch_blocks", "outcome"),
    "bootseer_hotlist_prefetch_bytes_total": ("hotlist.prefetch_bytes", "pass"),
    "bootseer_hotlist_reads_total": ("hotlist.reads", "outcome"),
    "bootseer_hotlist_prefetch_unread_bytes_total": ("hotlist.prefetch_unread_bytes",),
    "bootseer_hotlist_recordings_total": ("hotlist.recordings", "outcome"),
    "bootseer_hotlist_ignored_total": ("hotlist.ignored", "reason"),
    # The fanotify data path (issue 25): userspace events by outcome, their fill time, the blobs by state.
    "bootseer_fanotify_events_total": ("fanotify.events", "outcome"),
    "bootseer_fanotify_fill_seconds_sum": ("fanotify.fill_seconds",),
    "bootseer_local_blobs": ("fanotify.local_blobs", "state"),
    # prometheus_client's process collector: the layer server's user + system CPU time.
    "process_cpu_seconds_total": ("server.cpu_seconds",),
}
_FUSE_REQUESTS = "fuse.requests."
_FANOTIFY_EVENTS = "fanotify.events."


def file_pages() -> int:
    """Bytes of file pages in the page cache, machine-wide: ``Active(file) + Inactive(file)`` of /proc/meminfo.

    Unlike ``Cached`` this leaves out tmpfs and shared memory (they sit on the anonymous
    lists), so a start's growth is what it read or wrote through files: the FUSE files
    and EROFS mounts, the node cache, containerd's content and snapshots, an installed
    tree.  Machine-wide: other work on the machine adds its own pages (hence the load
    average in the reports).  A memory cgroup of the node's processes (cgroup v2
    ``memory.stat`` ``file``) would leave those out; this machine mounts cgroup v1 and its
    memory hierarchy belongs to the session runner, so the benchmarks move no process.
    """
    total = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Active(file)", "Inactive(file)"):
            total += int(value.split()[0]) * 1024
    return total


def scrape_metrics(url: str | None, log=print) -> dict[str, float]:
    """The :data:`FUSE_SERIES` figures from a Prometheus ``/metrics`` page (empty when ``url`` is None or
    the page cannot be had: ``log`` says why), labels summed over those that key no figure (``fs``)."""
    if url is None:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    except OSError as e:
        log(f"  metrics {url}: {e}")
        return {}
    figures: dict[str, float] = {}
    for match in re.finditer(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", text, re.MULTILINE):
        name, labels, value = match.groups()
        if name not in FUSE_SERIES:
            continue
        label_map = dict(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        figure, *keys = FUSE_SERIES[name]
        key = ".".join([figure, *(label_map.get(k, "") for k in keys)])
        figures[key] = figures.get(key, 0.0) + float(value)
    return figures


def _keyed(figures: dict[str, float], prefix: str) -> dict[str, float]:
    """The figures named ``prefix`` + a label's value, by that value, none that are 0."""
    return {key[len(prefix):]: value for key, value in figures.items() if key.startswith(prefix) and value}


def fuse_requests(figures: dict[str, float]) -> dict[str, float]:
    """The FUSE requests by operation among ``figures`` (as :func:`scrape_metrics` names them), none that are 0."""
    return _keyed(figures, _FUSE_REQUESTS)


def fanotify_events(figures: dict[str, float]) -> dict[str, float]:
    """The ``fanotify`` path's pre-access events by outcome (present, filled, denied, unknown) among ``figures``,
    none that are 0: each one a userspace round trip, as a FUSE request is."""
    return _keyed(figures, _FANOTIFY_EVENTS)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat`` utime + stime); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
