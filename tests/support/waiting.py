"""Waiting for something a test stands on (a counter, a file, a state), with a deadline that fails loudly.

A test that must wait for another thread or process to reach a point polls for the
event itself, never sleeps a guessed time: :func:`wait_until` returns as soon as
``check()`` is true, and fails the test naming what never happened when the deadline
passes (a deadline is a hang detector, never a speed assertion).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0  #: long enough for a loaded CI machine; only a hang reaches it


def wait_until(what: str, check: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.01) -> T:
    """Poll ``check()`` until it returns a true value, and return that value.

    Raises AssertionError ``"timed out after Ns waiting for WHAT"`` once ``timeout``
    seconds pass without it.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
