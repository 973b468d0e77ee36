"""Layer-server processes and FUSE mounts that tests leave, found and stopped (test teardown).

A layer server runs in a session of its own and outlives whatever started it, so
teardown finds it by its ``--root`` in ``/proc``, not by a pid someone recorded: that
also finds one a killed daemon was still starting, which has not yet written its pid
to ``ROOT/layers/server.lock``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.mounts import force_unmount

STOP_TIMEOUT_S = 30.0


def layer_server_processes(under: Path, program: bytes = b"layer-server") -> dict[int, Path]:
    """pid -> ``--root`` of every live ``layer-server`` process (or other ``program``) whose root lies in ``under``."""
    under = under.resolve()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if program not in argv or b"--root" not in argv or state == "Z":
            continue
        position = argv.index(b"--root") + 1
        root = Path(os.fsdecode(argv[position])) if position < len(argv) else None
        if root is not None and (root.resolve() == under or under in root.resolve().parents):
            found[int(entry.name)] = root
    return found


def fuse_mounts(under: Path) -> list[str]:
    """Mountpoints of FUSE and EROFS mounts in ``under``, EROFS first, as they read blobs on FUSE
    (``/proc/self/mounts`` escapes spaces as ``\\040``)."""
    prefix = str(under.resolve())
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1:3] for line in mounts]
    ours = [(p, fstype) for p, fstype in points if p == prefix or p.startswith(prefix + "/")]
    return ([_unescape(p) for p, fstype in ours if fstype == "erofs"]
            + [_unescape(p) for p, fstype in ours if fstype.startswith("fuse")])  # fmt: skip


#: What names the event holder of a root (the ``fanotify`` data path's; it outlives its layer servers).
EVENT_HOLDER = b"bootseer.blockstore.datapath.event_holder"


def stop_layer_servers(under: Path) -> list[int]:
    """Stop every layer server of a root in ``under``, then unmount the EROFS and FUSE mounts there, then
    stop the roots' event holders (their group's marks go with them); the layer servers' pids stopped."""
    pids = layer_server_processes(under)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while set(layer_server_processes(under)) & set(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not set(layer_server_processes(under)) & set(pids):
            break
    for mountpoint in fuse_mounts(under):
        force_unmount(mountpoint)
    stop_event_holders(under)
    return sorted(pids)


def active_event_holder(root: Path) -> int:
    """The pid of ``root``'s active event holder: the one whose child is the other (its standby), or the only one."""
    found = sorted(layer_server_processes(root, EVENT_HOLDER))
    if len(found) == 1:
        return found[0]
    assert len(found) == 2, f"event holders of {root}: {found}"
    first, second = found
    return first if _parent(second) == first else second


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0


def stop_event_holders(under: Path) -> list[int]:
    """Kill the event holders of roots in ``under`` all at once (each active holder and its standby: stopped
    first, so that none sees the other die and starts a new one), until none is left; their pids."""
    killed: list[int] = []
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (holders := layer_server_processes(under, EVENT_HOLDER)) and time.monotonic() < deadline:
        for signum in (signal.SIGSTOP, signal.SIGKILL):
            for pid in holders:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        killed += [pid for pid in holders if pid not in killed]
        while set(layer_server_processes(under, EVENT_HOLDER)) & set(holders) and time.monotonic() < deadline:
            time.sleep(0.05)
    return killed


def _unescape(field: str) -> str:
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field
