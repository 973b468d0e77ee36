"""The clients' side of hot lists: tell the layer server when a container's snapshot (or a prefix) comes and goes.

The snapshotter's :class:`~bootseer.snapshotter.observers.HotListObserver` sends
:func:`prepared_request` after it prepares an ordinary active snapshot (a container's writable layer: ctr and
CRI name it by the container ID), with the Prepare's other requests in one round trip, and
:func:`container_removed` after it removes one.  They tell the layer server under the backend's root
(``hotlist.prepared`` with the key, the parent ChainID, the labels and the upper
directory, where the job's seal marker appears; ``hotlist.removed``).  The server
answers at once and does its store look-ups in the background, so a Prepare waits
at most a socket round trip.  These never fail the snapshot operation: a server that
is down or too slow is logged (no hot list is then recorded or
prefetched for that container, and reads are served as always).

``bootseer deps run`` calls :func:`prefix_restored` after it restores a bare-metal
prefix from a dependency snapshot, and ``bootseer deps release`` :func:`prefix_released`:
the same two requests, naming the prefix instead of a container (``readers: any``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bootseer.log import get_logger

log = get_logger(__name__)

#: A Prepare waits at most this long for the layer server's answer.
NOTIFY_TIMEOUT = 2.0


def _send(root: str | os.PathLike[str], request: dict[str, Any]) -> dict[str, Any] | None:
    """Send ``request`` to the layer server of node root ``root``; its answer or None."""
    from bootseer.blockstore.server.client import InvalidRequest, LayerServerClient, LayerServerError
    from bootseer.paths import ServerPaths

    client = LayerServerClient(ServerPaths(Path(root)).socket, timeout=NOTIFY_TIMEOUT)
    try:
        return client.call(request)
    except InvalidRequest as exc:  # a bad profile label, say: the user wants to know
        log.warning("hot-list notice refused", op=request["op"], key=request.get("key"), error=str(exc))
    except LayerServerError as exc:
        log.debug("hot-list notice not delivered", op=request["op"], key=request.get("key"), error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a notice must never fail a snapshot operation
        log.warning("hot-list notice failed", op=request["op"], key=request.get("key"), error=str(exc))
    return None


def prepared_request(key: str, parent: str, labels: dict[str, str] | None, upper: str) -> dict[str, Any]:
    """The ``hotlist.prepared`` notice: the active snapshot ``key`` (possibly a container's rootfs) was prepared on
    ``parent``, with its writable directory ``upper``.  The snapshotter's
    :class:`~bootseer.snapshotter.observers.HotListObserver` sends it with the Prepare's other requests."""
    return {"op": "hotlist.prepared", "key": key, "parent": parent, "labels": dict(labels or {}), "upper": upper}


def prepared_answered(key: str, parent: str, answer: dict[str, Any]) -> None:
    """Log what the layer server chose for the container ``key`` if it chose something (``record``, ``prefetch``)."""
    if answer.get("action") not in (None, "none", "disabled"):
        log.info("hot list for container", key=key, parent=parent, action=answer.get("action"))


def container_removed(root: str | os.PathLike[str], key: str) -> None:
    """The active snapshot ``key`` was removed on the node ``root``."""
    _send(root, {"op": "hotlist.removed", "key": key})


def prefix_name(prefix_id: str) -> str:
    """The name a restored prefix's recording goes by (``bootseer hotlist status``, ``seal``)."""
    return f"deps-prefix-{prefix_id}"


def prefix_restored(root: str | os.PathLike[str], prefix_id: str, chain_id: str, upper: str, labels: dict[str, str] | None = None) -> str:
    """A bare-metal prefix was restored from the deps layer ``chain_id``: record or prefetch its first reads.

    What the layer server chose (``record``, ``prefetch``, ``none``...) or ``unknown`` if it did not answer.
    """
    answer = _send(root, {"op": "hotlist.prepared", "key": prefix_name(prefix_id), "parent": chain_id,
                          "labels": dict(labels or {}), "upper": upper, "readers": "any"})  # fmt: skip
    return str(answer.get("action")) if answer is not None else "unknown"


def prefix_released(root: str | os.PathLike[str], prefix_id: str) -> None:
    """The restored prefix is released: its recording seals (and publishes), its prefetch ends."""
    _send(root, {"op": "hotlist.removed", "key": prefix_name(prefix_id)})
