"""The snapshotter's side of hot lists: tell the layer server when a container's snapshot comes and goes.

:class:`~bootseer.snapshotter.snapshots.Snapshotter` calls :func:`container_prepared`
after it prepares an ordinary active snapshot (a container's writable layer: ctr and
CRI name it by the container ID) and :func:`container_removed` after it removes one.
Each sends one control request to the layer server under the backend's root
(``hotlist.prepared`` with the key, the parent ChainID, the labels and the upper
directory, where the job's seal marker appears; ``hotlist.removed``).  The server
answers at once and does its store look-ups in the background, so a Prepare waits
at most a socket round trip.  These never fail the snapshot operation: a server that
is down or too slow is logged at debug level (no hot list is then recorded or
prefetched for that container, and reads are served as always).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bootseer.log import get_logger

log = get_logger(__name__)

#: A Prepare waits at most this long for the layer server's answer.
NOTIFY_TIMEOUT = 2.0


def _client(snapshotter: Any) -> Any | None:
    root = getattr(getattr(snapshotter, "backend", None), "root", None)
    if root is None:
        return None
    from bootseer.blockstore.control import LayerServerClient, ServerPaths

    return LayerServerClient(ServerPaths(Path(root)).socket, timeout=NOTIFY_TIMEOUT)


def _send(snapshotter: Any, request: dict[str, Any]) -> dict[str, Any] | None:
    client = _client(snapshotter)
    if client is None:
        return None
    from bootseer.blockstore.control import InvalidRequest, LayerServerError

    try:
        return client.call(request)
    except InvalidRequest as exc:  # a bad profile label, say: the user wants to know
        log.warning("hot-list notice refused", op=request["op"], key=request.get("key"), error=str(exc))
    except LayerServerError as exc:
        log.debug("hot-list notice not delivered", op=request["op"], key=request.get("key"), error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a notice must never fail a snapshot operation
        log.warning("hot-list notice failed", op=request["op"], key=request.get("key"), error=str(exc))
    return None


def container_prepared(snapshotter: Any, key: str, parent: str, labels: dict[str, str] | None, upper: str) -> None:
    """An active snapshot ``key`` was prepared on ``parent`` (possibly a container's rootfs)."""
    if not parent:
        return
    answer = _send(snapshotter, {"op": "hotlist.prepared", "key": key, "parent": parent,
                                 "labels": dict(labels or {}), "upper": upper})  # fmt: skip
    if answer is not None and answer.get("action") not in (None, "none", "disabled"):
        log.info("hot list for container", key=key, parent=parent, action=answer.get("action"))


def container_removed(snapshotter: Any, key: str) -> None:
    """The active snapshot ``key`` was removed."""
    _send(snapshotter, {"op": "hotlist.removed", "key": key})
