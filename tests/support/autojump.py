"""Running a trio test on trio's autojump clock, bounded in virtual time."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio
import trio.testing

TIMEOUT = 600  #: virtual seconds any one test may take: a hang fails instead of blocking the run
FAULT_AUTOJUMP = 0.3  #: real seconds of idleness before the clock jumps, for tests that wait out backoffs


def run(async_fn: Callable[..., Awaitable[Any]], *args: Any, autojump: float = 1.0) -> Any:
    """Run ``async_fn(*args)`` on the autojump clock; fail it after :data:`TIMEOUT` virtual seconds.

    The clock jumps to the next deadline once every task has waited ``autojump``
    real seconds.  Where only a hang should move it, the default is long enough
    that a read in a worker thread of a busy machine is never taken for one; tests
    of retries and timeouts, which sleep through many backoffs, take
    :data:`FAULT_AUTOJUMP`.
    """

    async def bounded() -> Any:
        with trio.fail_after(TIMEOUT):
            return await async_fn(*args)

    return trio.run(bounded, clock=trio.testing.MockClock(autojump_threshold=autojump))
