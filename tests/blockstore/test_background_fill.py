"""Blobs that complete (issue 36, part 5): the rest of each local blob is filled once the link is idle, so a
later read raises no event at all; off, nothing is filled; and the fill gives the link back at once to
anything else that fetches.

The first two run a real ``bootseer layer-server`` on ``fanotify`` over a layer converted by the real
converter (tests/blockstore/test_fanotify.py's ``converted``), EROFS over a real sparse blob, reads in
reader processes; the last runs :class:`BackgroundFill`'s schedule on trio's mock clock.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

import pytest
import trio
import trio.testing

from bootseer.blockstore.datapath.background_fill import BackgroundFill
from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.datapath.fanotify import unsupported
from tests.blockstore.test_fanotify import _expected, converted, drop_caches, read_all  # noqa: F401
from tests.blockstore.test_layer_server import node_factory  # noqa: F401,F811 (fixture)
from tests.support.waiting import wait_until

def needs_fanotify(test: Any) -> Any:
    """A test of a real layer server on ``fanotify``: root, FUSE, and a kernel and disk that take the marks."""
    for mark in (
        pytest.mark.timeout(300),
        pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
        pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
    ):
        test = mark(test)
    return test


def _events(status: dict[str, Any]) -> int:
    fan = status["fanotify"]
    return int(fan["answered"]) + int(fan["answered_by_holder"])


@needs_fanotify
def test_once_the_link_is_idle_the_rest_of_each_blob_is_filled_and_later_reads_raise_no_event(
    converted: Any, node_factory: Any
) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify",
                        background_fill=BackgroundFillConfig(rate=256 << 20, idle=0.5))  # fmt: skip
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, ["small/s1.txt"]) == {"small/s1.txt": expected["small/s1.txt"]}
    status = wait_until("the blob is complete", lambda: (s := client.status())["fanotify"]["complete"] == 1 and s)
    fill = status["fanotify"]["background_fill"]
    assert fill["blocks"] > 0 and fill["failed"] == 0, fill
    assert status["fanotify"]["missing_blocks"] == 0
    before = _events(status)
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected  # every byte, from the disk alone
    assert _events(client.status()) == before  # not one event: the blob is no longer marked


@needs_fanotify
def test_with_the_background_fill_off_a_blob_keeps_its_holes(converted: Any, node_factory: Any) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify",
                        background_fill=BackgroundFillConfig(enabled=False, idle=0.2))  # fmt: skip
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    assert read_all(lower, ["small/s1.txt"])
    # A negative: nothing may happen.  Ten times the idle time the fill would wait.
    deadline = time.monotonic() + 2.0
    wait_until("two seconds pass", lambda: time.monotonic() >= deadline)
    status = client.status()["fanotify"]
    assert status["complete"] == 0 and status["missing_blocks"] > 0
    assert status["background_fill"]["enabled"] is False and status["background_fill"]["batches"] == 0


class _Blob:
    """A blob of ``blocks`` one-byte blocks, all missing (what the schedule asks of one: no disk)."""

    def __init__(self, blocks: int) -> None:
        self.filled = bytearray(blocks)

    @property
    def complete(self) -> bool:
        return 0 not in self.filled

    def next_missing(self, limit: int) -> list[int]:
        start = self.filled.find(0)
        return [] if start < 0 else list(range(start, min(len(self.filled), start + limit)))

    def stored_bytes(self, refs: Sequence[int]) -> int:
        return len(refs)


def test_the_fill_waits_for_an_idle_link_keeps_its_rate_and_yields_to_any_other_fetch() -> None:
    async def main() -> None:
        blob = _Blob(40)
        fetched = [0]
        batches: list[tuple[float, list[int]]] = []
        other_fetch_at = 6.0

        async def fill(target: _Blob, refs: list[int]) -> int:
            batches.append((trio.current_time(), refs))
            for ref in refs:
                target.filled[ref] = 1
            return len(refs)

        config = BackgroundFillConfig(rate=10, idle=2.0, batch=10)
        background = BackgroundFill(config, lambda: [blob], fill, lambda: fetched[0])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(background.run)
            fetched[0] += 1  # a start fetching: not idle yet
            await trio.sleep(1.0)
            fetched[0] += 1
            await trio.sleep(other_fetch_at - 1.0)
            fetched[0] += 1  # another fetch while the fill rests between batches: it yields
            await trio.sleep(30)
            nursery.cancel_scope.cancel()
        times = [at for at, _refs in batches]
        assert times[0] >= 1.0 + config.idle  # not before the link was idle for the idle time
        assert all(later - earlier >= 1.0 for earlier, later in zip(times, times[1:]))  # 10 bytes at 10 bytes/s
        assert background.statistics().yielded == 1  # the fetch at t=6 stopped it ...
        assert any(at >= other_fetch_at + config.idle for at in times)  # ... until the link was idle again
        assert blob.complete and background.statistics().blocks == 40 and background.statistics().batches == 4

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
