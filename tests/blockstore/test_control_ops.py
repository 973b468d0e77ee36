"""The layer server's table of control operations (``blockstore/server/ops.py``): names, families, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from bootseer.blockstore.server.client import InvalidRequest, LayerNotMounted
from bootseer.blockstore.server.ops import MAX_BATCH, ControlOps


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
    assert control.names() == ["batch", "status", "hotlist.*"]


@pytest.mark.parametrize("request_", [["op", "status"], {"op": "format-disk"}, {"op": 7}, {}])
def test_a_request_that_names_no_registered_operation_is_refused_with_what_is_registered(request_: Any) -> None:
    control = ControlOps()

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("not this one")

    control.register("status", answer)
    control.register_family("hotlist.", lambda op, request: answer(request))
    message = "a request is a JSON object" if not isinstance(request_, dict) else r"unknown operation .* \(batch, status, hotlist\.\*\)"
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


def test_a_batch_answers_each_request_on_its_own_in_order() -> None:
    """One round trip, several requests: each answered as it would be alone, a failure (a refused request, an
    unknown operation, a handler's bug) failing only itself, and the requests after it still answered."""
    control = ControlOps()
    order: list[str] = []

    async def mount(request: dict[str, Any]) -> dict[str, Any]:
        order.append(request["chain_id"])
        if request["chain_id"] == "gone":
            raise LayerNotMounted("gone is not mounted")
        if request["chain_id"] == "bug":
            raise KeyError("slot")
        return {"lower_dir": f"/l/{request['chain_id']}"}

    control.register("mount", mount)
    requests = [{"op": "mount", "chain_id": "a"}, {"op": "mount", "chain_id": "gone"}, {"op": "nope"},
                {"op": "mount", "chain_id": "bug"}, "not an object", {"op": "mount", "chain_id": "b"}]
    answers = trio.run(control.dispatch, {"op": "batch", "requests": requests})["answers"]
    assert order == ["a", "gone", "bug", "b"]
    assert answers[0] == {"ok": True, "lower_dir": "/l/a"} and answers[5] == {"ok": True, "lower_dir": "/l/b"}
    assert answers[1] == {"ok": False, "error": {"kind": "not_mounted", "message": "gone is not mounted"}}
    assert answers[2]["error"]["kind"] == "invalid" and "unknown operation 'nope'" in answers[2]["error"]["message"]
    assert answers[3] == {"ok": False, "error": {"kind": "internal", "message": "KeyError: 'slot'"}}
    assert answers[4]["error"] == {"kind": "invalid", "message": "a request is a JSON object"}


@pytest.mark.parametrize("requests", [[], None, {"op": "status"}, [{"op": "status"}] * (MAX_BATCH + 1),
                                      [{"op": "status"}, {"op": "batch", "requests": [{"op": "status"}]}]])
def test_a_batch_that_is_empty_too_long_not_a_list_or_nested_is_refused_whole(requests: Any) -> None:
    control = ControlOps()
    asked: list[Any] = []

    async def status(request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        return {}

    control.register("status", status)
    with pytest.raises(InvalidRequest, match="batch"):
        trio.run(control.dispatch, {"op": "batch", "requests": requests})
    assert asked == []
