"""Where the other parts of BootSeer call the profiler: one call per hook, free when profiling is off.

* the snapshotter: :func:`container_prepared` after a container's writable snapshot is made
  (its upper directory gets ``.bootseer/``, the container's marks directory, seen in the
  container as ``/.bootseer``), :func:`container_removed` before its directory is deleted
  (the marks are read into the spool first: ``ctr run --rm`` removes a snapshot the moment
  the task exits);
* the layer server: :func:`armed_first_read` when a container's snapshot is announced and
  :func:`layer_read` on each FUSE read (the container's first read is one event), and
  :func:`sample_counter` for the engines' bytes fetched, sampled every
  :data:`SAMPLE_INTERVAL` seconds (never per fetch);
* the checkpoint mount: :func:`sample_counter` for its engine's bytes;
* anything else: :func:`bootseer.profile.span`, :func:`~bootseer.profile.traced`,
  :func:`~bootseer.profile.emit`.

Each returns at once when the process has no spool (a test of one module global).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from bootseer import confined
from bootseer.profile import events
from bootseer.profile.events import use_root  # noqa: F401 - daemons call hooks.use_root(ROOT)

if TYPE_CHECKING:
    import trio

#: How often counters (bytes fetched) are sampled; a sample is written only when the value moved.
SAMPLE_INTERVAL = 0.1
_METADATA_KEY = re.compile(r"[^/]+/\d+/(.+)")
#: Containers announced to the layer server whose first read is still to come: id -> time announced.
_awaiting_first_read: dict[str, float] = {}


def container_name(key: str) -> str:
    """The container ID in a namespaced snapshot key (``<namespace>/<n>/<ID>``), else the key."""
    match = _METADATA_KEY.fullmatch(key)
    return match.group(1) if match else key


#: The label containerd's unpacker and rpull put on a layer's extraction snapshot (never a container's).
REF_LABEL = "containerd.io/snapshot.ref"


def container_prepared(key: str, parent: str, labels: dict[str, str] | None, upper: str | os.PathLike[str]) -> None:
    """An ordinary active snapshot ``key`` was prepared with upper directory ``upper``.

    A layer's extraction snapshot (labelled with :data:`REF_LABEL`) is not a container's: it
    gets no marks directory (that would end up in the layer) and no event.
    """
    if not events.enabled() or not parent or REF_LABEL in (labels or {}):
        return
    try:
        # Sticky and world-writable, as /tmp: a job running as any uid can leave marks. Made beneath a
        # descriptor of the upper directory, set through its own: a symlink in its place is never followed.
        with confined.opened_dir(upper) as upper_fd:
            marks = confined.make_dirs(upper_fd, events.CONTAINER_MARKS_DIR.lstrip("/"), 0o1777)
            try:
                os.fchmod(marks, 0o1777)
            finally:
                os.close(marks)
    except OSError:
        pass
    events.emit("container.prepare", phase="container", container=container_name(key), parent=parent,
                upper=str(upper))


def container_removed(key: str, snapshot_dir: str | os.PathLike[str] | None) -> None:
    """Read the marks the container left in its upper directory into the spool before it is deleted."""
    if not events.enabled() or snapshot_dir is None:
        return
    harvest_marks(Path(snapshot_dir) / "fs" / events.CONTAINER_MARKS_DIR.lstrip("/"), container_name(key))
    events.emit("container.removed", container=container_name(key))


def harvest_marks(directory: str | os.PathLike[str], container: str = "") -> int:
    """Write the marks found in ``directory`` into the spool as ``mark.NAME`` events; how many."""
    found = events.read_marks(directory)
    for name, when, pid, attrs in found:
        events.emit(f"mark.{name}", start=when, mark=name, container=container, mark_pid=pid, **attrs)
    return len(found)


def armed_first_read(key: str) -> None:
    """The layer server was told of container ``key``: its first read of a layer is an event."""
    if not events.enabled():
        return
    _awaiting_first_read[container_name(key)] = time.time()


def layer_read(container: str | None, layer: str) -> None:
    """A FUSE read of ``layer``, by ``container`` when the hot-list attribution knows it."""
    if not events.enabled() or not _awaiting_first_read:
        return
    if container is None or container not in _awaiting_first_read:
        # Unattributed: the container announced first is the likeliest reader.
        container = min(_awaiting_first_read, key=_awaiting_first_read.__getitem__)
    announced = _awaiting_first_read.pop(container)
    events.emit("container.first_read", phase="container", container=container, layer=layer,
                after_prepare_s=round(time.time() - announced, 6))


async def sample_counter(name: str, read: Callable[[], int], *, phase: str = "", interval: float = SAMPLE_INTERVAL,
                         until: trio.Event | None = None, **attrs: Any) -> None:
    """Sample ``read()`` (a cumulative byte count) every ``interval`` s, writing a counter when it moved.

    Runs until cancelled (in the caller's nursery) or until the trio.Event ``until`` is set (a
    FUSE session's ``ended``: the mount's nursery must not wait on us); returns at once when
    profiling is off. A final sample is written at the end, so the last bytes are never lost.
    """
    if not events.enabled():
        return
    import trio

    last = -1
    try:
        while until is None or not until.is_set():
            value = read()
            if value != last:
                events.counter(name, value, phase=phase, **attrs)
                last = value
            if until is None:
                await trio.sleep(interval)
            else:
                with trio.move_on_after(interval):
                    await until.wait()
    finally:
        try:
            value = read()
        except Exception:  # noqa: BLE001 - the thing sampled may be gone at shutdown
            value = last
        if value != last:
            events.counter(name, value, phase=phase, **attrs)


def pull_attrs(result: Any) -> dict[str, Any]:
    """The attributes of ``image.pull`` from rpull's PullResult."""
    return {"image": result.name, "chain_id": result.chain_id, "snapshotter": result.snapshotter,
            "layers": len(result.layers), "lazy": result.count("lazy"), "downloaded": result.count("downloaded"),
            "bytes": result.fetched_bytes}


def layer_attrs(result: Any) -> dict[str, Any]:
    """The attributes of ``image.layer`` from rpull's LayerResult: lazy, downloaded or already unpacked."""
    return {"layer": result.digest, "chain_id": result.chain_id, "state": result.state, "bytes": result.fetched_bytes}


def hotlist_sealed(summary: dict[str, Any]) -> None:
    """A hot-list recording ended (the layer server's summary of it)."""
    if not events.enabled():
        return
    events.emit("hotlist.sealed", **{("recording_kind" if k == "kind" else k): v for k, v in summary.items()})


def deps_run_attrs(outcome: Any) -> dict[str, Any]:
    """``deps.run`` (``bootseer deps run``): hit and restored, or missed and installed (and captured)."""
    action = outcome.action
    capture = outcome.capture
    return {"key": outcome.key, "action": action, "hit": action in ("hit", "present"),
            "restore": action == "hit", "install": action in ("captured", "installed"), "status": outcome.status,
            "bytes": getattr(capture, "bytes", 0) or 0}


def deps_container(event: str, key: str, deps: str, **attrs: Any) -> None:
    """A container's dependency snapshot, at its Prepare: ``hit`` (a layer stacked) or ``miss`` (to capture)."""
    if not events.enabled():
        return
    events.emit(f"deps.{event}", phase="dependencies", container=container_name(key), key=deps, **attrs)
