"""When a failing call to a remote is tried again, how long it waits first, and when it gives up.

One policy for everything that reads from a remote: the fetch engine's stripes and its
``stat``/``listdir`` calls (:class:`~bootseer.fetch.engine.Engine`), and the registry client of
``bootseer convert`` and ``bootseer rpull`` (:mod:`bootseer.images.registry`).  The policy is
arithmetic and a decision, no loop: the engine retries in trio (stripes go back to its queue, a
metadata call sleeps in its task), the registry client in its own thread; both ask the policy.

* **Retryable or not** (:func:`is_permanent`): an answer that will not change on a second try
  (:class:`~bootseer.fetch.source.NotFound`, :class:`~bootseer.fetch.source.NotADirectory`,
  :class:`~bootseer.fetch.source.PermanentError`) is not retried; everything else (a network
  failure, a timeout, a 5xx or 429 answer, a :class:`~bootseer.fetch.source.TransientError`) is.
* **The deadline** (:meth:`RetryPolicy.deadline`): ``timeout`` seconds after the first attempt
  began, however the attempts are doing; a ``timeout`` of 0 means one attempt.  ``max_attempts``,
  if set, bounds the attempts too (the registry client's few quick retries).
* **The wait** (:meth:`RetryPolicy.delay`): exponential backoff with jitter, ``first_delay``
  doubling up to ``max_delay`` and each drawn from its upper half (about 50 ms, 100 ms, ... up to
  2 s by default), never past the deadline (:meth:`RetryPolicy.wait`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bootseer.fetch.source import NotADirectory, NotFound, PermanentError


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` is an answer a second attempt would get again (not retried)."""
    return isinstance(exc, (NotFound, NotADirectory, PermanentError))


@dataclass(frozen=True)
class RetryPolicy:
    """How long, how often and how far apart a failing call is tried (times in seconds, any clock)."""

    timeout: float = 60.0  #: give up this long after the first attempt began; 0: one attempt only
    max_attempts: int | None = None  #: give up after this many attempts too (None: only the timeout bounds them)
    first_delay: float = 0.05  #: the wait after the first failure (upper bound; jittered down to half)
    max_delay: float = 2.0  #: the longest wait between two attempts

    def __post_init__(self) -> None:
        if not self.timeout >= 0:
            raise ValueError(f"retry timeout must not be negative, not {self.timeout}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        if not 0 < self.first_delay <= self.max_delay:
            raise ValueError(f"want 0 < first_delay <= max_delay, not {self.first_delay} and {self.max_delay}")

    def deadline(self, first_attempt: float) -> float:
        """When a call first tried at ``first_attempt`` fails, however its attempts are doing
        (infinite for a ``timeout`` of 0: one attempt, bounded only by the remote's own timeouts)."""
        return first_attempt + self.timeout if self.timeout > 0 else float("inf")

    def gives_up(self, exc: BaseException, attempts: int, first_attempt: float, now: float) -> bool:
        """Whether a call that has just failed with ``exc`` (its ``attempts``-th attempt, the first at
        ``first_attempt``; ``now`` on the same clock) fails for good rather than being tried again."""
        return (is_permanent(exc) or self.timeout == 0 or now >= self.deadline(first_attempt)
                or (self.max_attempts is not None and attempts >= self.max_attempts))

    def delay(self, attempts: int) -> float:
        """The backoff after the ``attempts``-th failure: ``first_delay * 2**(attempts-1)`` capped at
        ``max_delay``, drawn from its upper half (jitter, so that callers that failed together spread)."""
        return min(self.first_delay * 2 ** (attempts - 1), self.max_delay) * random.uniform(0.5, 1.0)

    def wait(self, attempts: int, first_attempt: float, now: float) -> float:
        """:meth:`delay`, never past the deadline: how long to wait before the next attempt."""
        return max(0.0, min(self.delay(attempts), self.deadline(first_attempt) - now))
