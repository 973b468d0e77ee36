"""The layer server's control operations, by name: the server registers its own, extensions theirs.

A control request is one JSON object with an ``op``; :meth:`ControlOps.dispatch` finds
its handler and returns the handler's answer (a JSON object), and :meth:`ControlOps.answer`
frames it as the socket sends it (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``),
counted by operation and outcome.  The server registers ``mount``, ``check``, ``unmount``,
``status`` and ``shutdown``; an extension registers a family of operations under a prefix
(the hot-list service: ``hotlist.*``), so adding one touches neither the server's table nor
the socket code.  Handlers raise :class:`~bootseer.blockstore.server.client.InvalidRequest`
(or another ``LayerServerError``) for a request they refuse.

The table answers one operation itself: ``batch``, whose ``requests`` (at most
:data:`MAX_BATCH`, none a batch) are answered one after another, each on its own (a failed
one fails alone), as ``answers`` in the same order.  It is how a container's Prepare says
everything it has for the server in one round trip: a dependency layer's mount and the
hot-list notice that follows it (:mod:`bootseer.snapshotter.observers`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import prometheus_client

from bootseer.blockstore.server.client import InvalidRequest, LayerServerError
from bootseer.log import get_logger

log = get_logger(__name__)

#: Every control request answered (each of a batch's too, and the batch itself).
REQUESTS = prometheus_client.Counter(
    "bootseer_layer_server_requests_total", "Control requests answered, by operation and outcome", ["op", "outcome"]
)
#: Requests one ``batch`` carries at most.
MAX_BATCH = 8

#: Answers one request (the whole JSON object) of an operation registered by name.
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
#: Answers one request of a family: given the operation's full name and the request.
FamilyHandler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlOps:
    """The table of control operations (see the module docstring)."""

    def __init__(self) -> None:
        self._ops: dict[str, Handler] = {"batch": self._batch}
        self._families: dict[str, FamilyHandler] = {}

    def register(self, name: str, handler: Handler) -> None:
        """Answer operation ``name`` with ``handler``; ValueError if something answers it already."""
        if name in self._ops or any(name.startswith(prefix) for prefix in self._families):
            raise ValueError(f"control operation {name!r} is registered already")
        self._ops[name] = handler

    def register_family(self, prefix: str, handler: FamilyHandler) -> None:
        """Answer every operation whose name starts with ``prefix`` (``"hotlist."``) with ``handler``."""
        if not prefix or any(name.startswith(prefix) for name in self._ops) or any(
            prefix.startswith(other) or other.startswith(prefix) for other in self._families
        ):
            raise ValueError(f"control operations {prefix!r}* overlap registered ones")
        self._families[prefix] = handler

    def names(self) -> list[str]:
        """What is registered: each operation's name, each family as ``prefix*``."""
        return list(self._ops) + [f"{prefix}*" for prefix in self._families]

    async def dispatch(self, request: Any) -> dict[str, Any]:
        """The answer to ``request`` (InvalidRequest for one that is not an object or names no operation)."""
        if not isinstance(request, dict):
            raise InvalidRequest("a request is a JSON object")
        op = request.get("op")
        if isinstance(op, str):
            handler = self._ops.get(op)
            if handler is not None:
                return await handler(request)
            for prefix, family in self._families.items():
                if op.startswith(prefix):
                    return await family(op, request)
        raise InvalidRequest(f"unknown operation {op!r} ({', '.join(self.names())})")

    async def answer(self, request: Any) -> dict[str, Any]:
        """``request`` answered as the socket sends it: ``{"ok": true, ...}`` with the handler's fields, or
        :func:`failure`'s answer, counted by operation and outcome."""
        op = str(request.get("op", "?")) if isinstance(request, dict) else "?"
        try:
            fields = await self.dispatch(request)
        except Exception as exc:
            return failure(op, exc)
        REQUESTS.labels(op, "ok").inc()
        return {"ok": True, **fields}

    async def _batch(self, request: dict[str, Any]) -> dict[str, Any]:
        requests = request.get("requests")
        if not isinstance(requests, list) or not 0 < len(requests) <= MAX_BATCH:
            raise InvalidRequest(f"a batch's requests are a list of 1 to {MAX_BATCH} requests")
        if any(isinstance(inner, dict) and inner.get("op") == "batch" for inner in requests):
            raise InvalidRequest("a batch does not carry a batch")
        return {"answers": [await self.answer(inner) for inner in requests]}


def failure(op: str, exc: Exception) -> dict[str, Any]:
    """The answer to a request of ``op`` that failed with ``exc``, counted and logged: ``{"ok": false, "error":
    {"kind", "message"}}``, the kind a ``LayerServerError``'s, else ``internal`` (logged with its traceback)."""
    if isinstance(exc, LayerServerError):
        REQUESTS.labels(op, exc.kind).inc()
        log.warning("control request failed", op=op, kind=exc.kind, error=str(exc))
        return {"ok": False, "error": {"kind": exc.kind, "message": str(exc)}}
    REQUESTS.labels(op, "internal").inc()
    log.error("control request failed", op=op, exc_info=exc)
    return {"ok": False, "error": {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"}}


__all__ = ["MAX_BATCH", "ControlOps", "FamilyHandler", "Handler", "failure"]
