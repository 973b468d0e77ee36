"""The ``hotlist.*`` control operations of the layer server: requests checked, then answered by the service.

``hotlist.prepared`` (``key``, ``parent``, ``labels``, ``upper``, ``readers``),
``hotlist.removed`` (``key``), ``hotlist.seal`` (``container``) and ``hotlist.status``.
A request with a missing or mistyped field, or an unknown operation, is an
:class:`~bootseer.blockstore.server.client.InvalidRequest` naming the field; so is a
:class:`~bootseer.hotlist.format.HotListError` the service raises for a request.
"""

from __future__ import annotations

from typing import Any, Protocol

from bootseer.blockstore.server.client import InvalidRequest
from bootseer.hotlist.format import HotListError

OPERATIONS = ("hotlist.prepared", "hotlist.removed", "hotlist.seal", "hotlist.status")


class HotListOps(Protocol):
    """What the control operations ask of the hot-list service."""

    async def container_prepared(self, key: str, parent: str, labels: dict[str, str], upper: str | None,
                                 any_reader: bool = False) -> dict[str, Any]: ...  # fmt: skip

    async def container_removed(self, key: str) -> dict[str, Any]: ...

    async def seal(self, key: str) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...


async def dispatch(service: HotListOps, op: str, request: dict[str, Any]) -> dict[str, Any]:
    """Answer the ``hotlist.*`` control request ``request`` (operation ``op``) through ``service``."""

    def text(name: str, required: bool = True) -> str:
        value = request.get(name, "")
        if not isinstance(value, str) or (required and not value):
            raise InvalidRequest(f"{op}: {name} must be a non-empty string")
        return value

    try:
        if op == "hotlist.prepared":
            labels = request.get("labels") or {}
            if not isinstance(labels, dict):
                raise InvalidRequest(f"{op}: labels must be an object")
            upper = request.get("upper")
            readers = request.get("readers", "container")
            if readers not in ("container", "any"):
                raise InvalidRequest(f"{op}: readers must be \"container\" or \"any\"")
            return await service.container_prepared(text("key"), text("parent", False), labels,
                                                    upper if isinstance(upper, str) else None,
                                                    any_reader=readers == "any")  # fmt: skip
        if op == "hotlist.removed":
            return await service.container_removed(text("key"))
        if op == "hotlist.seal":
            return await service.seal(text("container"))
        if op == "hotlist.status":
            return service.status()
    except HotListError as exc:
        raise InvalidRequest(str(exc)) from None
    raise InvalidRequest(f"unknown operation {op!r} ({', '.join(OPERATIONS)})")


__all__ = ["OPERATIONS", "HotListOps", "dispatch"]
