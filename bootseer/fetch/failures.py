"""The engine's failure memory: keys that failed for good lately keep failing at once.

A read the kernel makes right after a failed one (it follows a failed read-ahead
with a single-page read of the same range) would otherwise start a fresh retry
clock and fail only after a second ``retry_timeout``.  The
:class:`~bootseer.fetch.engine.Engine` remembers each stripe or extent that
failed for good here, by key, for :attr:`FailureMemory.seconds`, and a new hold
of a remembered key gets the failed stripe (and its error) back at once.

Every entry lives for the same time, so entries expire oldest first; the memory
holds at most the keys that failed within the last :attr:`FailureMemory.seconds`.
All methods run in the trio thread (they read :func:`trio.current_time`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import trio

from bootseer.fetch.stripes import Stripe

FAILURE_MEMORY_S = 10.0  #: the longest a failed stripe keeps failing at once


class FailureMemory:
    """Failed stripes by key, each for :attr:`seconds` after it failed."""

    def __init__(self, retry_timeout: float | None) -> None:
        #: seconds a stripe or extent that failed for good keeps failing at once, without
        #: a new attempt: long enough for the kernel's retry of a failed read, short
        #: enough that a source that comes back serves again soon
        #: (min(retry_timeout, 10 s); 10 s when there is no retry timeout)
        self.seconds = min(retry_timeout or FAILURE_MEMORY_S, FAILURE_MEMORY_S)
        self._failures: OrderedDict[Hashable, tuple[float, Stripe]] = OrderedDict()  # key: (until, stripe)

    def remember(self, stripe: Stripe) -> None:
        """Make holds of ``stripe``'s key fail at once for :attr:`seconds` (nothing if that is 0)."""
        if self.seconds <= 0:
            return
        now = trio.current_time()
        while self._failures and next(iter(self._failures.values()))[0] <= now:
            self._failures.popitem(last=False)  # oldest first: all expire after the same time
        self._failures[stripe.key] = (now + self.seconds, stripe)
        self._failures.move_to_end(stripe.key)

    def recent(self, key: Hashable) -> Stripe | None:
        """The FAILED stripe of ``key`` if it failed less than :attr:`seconds` ago, else None."""
        remembered = self._failures.get(key)
        if remembered is None:
            return None
        if remembered[0] <= trio.current_time():
            del self._failures[key]
            return None
        return remembered[1]
