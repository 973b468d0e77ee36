"""Running a trio test on a mock clock that jumps when every task waits, bounded in virtual time.

:func:`run` uses trio's autojump clock: once every task has waited ``autojump`` real
seconds, the clock jumps to the next deadline.  With ``hold_for_threads``, the test's
own task drives the clock instead (trio's public ``MockClock.jump`` and
``wait_all_tasks_blocked``, same rule) and never jumps it while a
``trio.to_thread.run_sync`` call is in flight: a task waiting on a worker thread (a
store read, an index decode) is waiting for work that will finish, not for time, so a
busy machine cannot make a timer fire "early" in virtual time.  Only tests whose
threads always finish may ask for that (local files, not a hung server: there only
the clock's jump ends the wait).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator

import trio
import trio.testing

TIMEOUT = 600  #: virtual seconds any one test may take: a hang fails instead of blocking the run
FAULT_AUTOJUMP = 0.3  #: real seconds of idleness before the clock jumps, for tests that wait out backoffs


class _ThreadCalls:
    """``trio.to_thread.run_sync`` calls whose result has not come back to trio yet."""

    def __init__(self) -> None:
        self.count = 0
        self.none_left: trio.Event | None = None

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Count every ``trio.to_thread.run_sync`` call made in the block (the real function runs)."""
        real = trio.to_thread.run_sync

        async def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            try:
                return await real(*args, **kwargs)
            finally:
                self.count -= 1
                if self.count == 0 and self.none_left is not None:
                    self.none_left.set()

        trio.to_thread.run_sync = counting  # type: ignore[assignment]
        try:
            yield
        finally:
            trio.to_thread.run_sync = real  # type: ignore[assignment]

    async def finished(self) -> None:
        """Return once no call is in flight."""
        while self.count:
            self.none_left = trio.Event()
            await self.none_left.wait()


def run(async_fn: Callable[..., Awaitable[Any]], *args: Any, autojump: float = 1.0, hold_for_threads: bool = False) -> Any:
    """Run ``async_fn(*args)`` on the mock clock; fail it after :data:`TIMEOUT` virtual seconds.

    The clock jumps to the next deadline once every task has waited ``autojump``
    real seconds (and, with ``hold_for_threads``, no worker thread is running).  Where
    only a hang should move it, the default is long enough that a read in a worker
    thread of a busy machine is never taken for one; tests of retries and timeouts,
    which sleep through many backoffs, take :data:`FAULT_AUTOJUMP`.
    """
    clock = trio.testing.MockClock()
    threads = _ThreadCalls()

    async def drive_clock() -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked(autojump)
            if hold_for_threads and threads.count:
                await threads.finished()
                continue  # the thread's result woke a task: wait for all to be idle again
            jump = trio.lowlevel.current_statistics().seconds_to_next_deadline
            if 0 < jump < math.inf:
                clock.jump(jump)

    async def bounded() -> Any:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive_clock)
            with trio.fail_after(TIMEOUT):
                result = await async_fn(*args)
            nursery.cancel_scope.cancel()
        return result

    if not hold_for_threads:  # trio's own autojump, as every test had it before
        async def bounded_only() -> Any:
            with trio.fail_after(TIMEOUT):
                return await async_fn(*args)

        return trio.run(bounded_only, clock=trio.testing.MockClock(autojump_threshold=autojump))
    with threads.counted():
        return trio.run(bounded, clock=clock)
