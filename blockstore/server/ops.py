"""The layer server's control operations, by name: the server registers its own, extensions theirs.

A control request is one JSON object with an ``op``; :meth:`ControlOps.dispatch` finds
its handler and returns the handler's answer (a JSON object).  The server registers
``mount``, ``check``, ``unmount``, ``status`` and ``shutdown``; an extension registers a
family of operations under a prefix (the hot-list service: ``hotlist.*``), so adding
one touches neither the server's table nor the socket code.  Handlers raise
:class:`~bootseer.blockstore.server.client.InvalidRequest` (or another ``LayerServerError``)
for a request they refuse.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from bootseer.blockstore.server.client import InvalidRequest

#: Answers one request (the whole JSON object) of an operation registered by name.
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
#: Answers one request of a family: given the operation's full name and the request.
FamilyHandler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlOps:
    """The table of control operations (see the module docstring)."""

    def __init__(self) -> None:
        self._ops: dict[str, Handler] = {}
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


__all__ = ["ControlOps", "FamilyHandler", "Handler"]
