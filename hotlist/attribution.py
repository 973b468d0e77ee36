"""Which container a FUSE request comes from: the caller's pid, and ``/proc/PID/cgroup``.

A FUSE request carries the pid of the process that made it (pyfuse3's
``RequestContext.pid``, in the layer server's pid namespace, so a containerised
process shows its host pid).  The process is blocked in its ``open(2)`` while the
server answers, so its ``/proc/PID/cgroup`` can be read then.  containerd puts a
container's processes in a cgroup named after the container: ctr's default cgroup
path is ``/<namespace>/<container id>``, CRI's is ``.../cri-containerd-<id>.scope``
with the systemd driver or ``.../<id>`` with cgroupfs; both in cgroup v1 (every
hierarchy line) and v2 (the ``0::`` line).  A container is named by a path component
equal to its id, or ``cri-containerd-<id>.scope`` / ``docker-<id>.scope``; a nested
cgroup under the container's (systemd inside the container) still matches.

Recording attributes at ``open``: every read through that open file belongs to the
container that opened it (overlayfs opens the lower file in the opener's context,
and mmap faults of a mapped file read through the same open file).
"""

from __future__ import annotations

import re
from typing import Iterable


def cgroup_paths(pid: int, proc: str = "/proc") -> list[str] | None:
    """The cgroup paths of process ``pid`` (one per hierarchy), None if it cannot be read (gone, pid 0)."""
    if pid <= 0:
        return None
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as file:
            text = file.read(65536).decode("utf-8", "replace")
    except OSError:
        return None
    paths = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2]:
            paths.append(parts[2])
    return paths


def _names(container: str) -> set[str]:
    return {container, f"cri-containerd-{container}.scope", f"docker-{container}.scope"}


def container_of(paths: Iterable[str], containers: Iterable[str]) -> str | None:
    """The one of ``containers`` (ids) whose cgroup holds a process with cgroup ``paths``; None if none."""
    components = {part for path in paths for part in path.split("/") if part}
    for container in containers:
        if components & _names(container):
            return container
    return None


_METADATA_KEY = re.compile(r"[^/]+/[0-9]+/(.+)")


def container_id(key: str) -> str:
    """The container ID in a snapshot key as a proxy snapshotter sees it.

    containerd's metadata store hands proxy snapshotters ``<namespace>/<n>/<key>``, and
    ctr and CRI name a container's rootfs snapshot by the container ID, so the ID is the
    part after the second ``/``; a key without that prefix is taken as it is.
    """
    match = _METADATA_KEY.fullmatch(key)
    return match.group(1) if match else key
