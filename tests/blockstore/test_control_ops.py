"""The layer server's table of control operations (``blockstore/server/ops.py``): names, families, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from bootseer.blockstore.server.client import InvalidRequest
from bootseer.blockstore.server.ops import ControlOps


def test_an_operation_is_answered_by_its_handler_and_a_family_by_its_prefix() -> None:
    control = ControlOps()
    seen: list[Any] = []

    async def status(request: dict[str, Any]) -> dict[str, Any]:
        seen.append(("status", request))
        return {"status": "fine"}

    async def hotlist(op: str, request: dict[str, Any]) -> dict[str, Any]:
        seen.append((op, request))
        return {"op": op}

    control.register("status", status)
    control.register_family("hotlist.", hotlist)
    assert trio.run(control.dispatch, {"op": "status"}) == {"status": "fine"}
    assert trio.run(control.dispatch, {"op": "hotlist.seal", "container": "c"}) == {"op": "hotlist.seal"}
    assert seen == [("status", {"op": "status"}), ("hotlist.seal", {"op": "hotlist.seal", "container": "c"})]
    assert control.names() == ["status", "hotlist.*"]


@pytest.mark.parametrize("request_", [["op", "status"], {"op": "format-disk"}, {"op": 7}, {}])
def test_a_request_that_names_no_registered_operation_is_refused_with_what_is_registered(request_: Any) -> None:
    control = ControlOps()

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("not this one")

    control.register("status", answer)
    control.register_family("hotlist.", lambda op, request: answer(request))
    message = "a request is a JSON object" if not isinstance(request_, dict) else r"unknown operation .* \(status, hotlist\.\*\)"
    with pytest.raises(InvalidRequest, match=message):
        trio.run(control.dispatch, request_)


def test_names_cannot_be_registered_twice_or_overlap_a_family() -> None:
    control = ControlOps()

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def family(op: str, request: dict[str, Any]) -> dict[str, Any]:
        return {}

    control.register("mount", answer)
    control.register_family("hotlist.", family)
    for register in (lambda: control.register("mount", answer), lambda: control.register("hotlist.seal", answer),
                     lambda: control.register_family("hotlist.x", family), lambda: control.register_family("hot", family),
                     lambda: control.register_family("mo", family), lambda: control.register_family("", family)):  # fmt: skip
        with pytest.raises(ValueError):
            register()
