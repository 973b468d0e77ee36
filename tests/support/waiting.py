"""Waiting for something a test stands on (a counter, a file, a state), with a deadline that fails loudly.

A test that must wait for another thread or process to reach a point polls for the
event itself, never sleeps a guessed time: :func:`wait_until` (:func:`wait_until_async` in trio)
returns as soon as
``check()`` is true, and fails the test naming what never happened when the deadline
passes (a deadline is a hang detector, never a speed assertion).
"""

from __future__ import annotations

import functools
import socket
import time
from typing import Callable, Protocol, TypeVar

import trio

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0  #: long enough for a loaded CI machine; only a hang reaches it


class WaitFailed(AssertionError):
    """What was waited for never happened (or the process it depended on exited first)."""


class Process(Protocol):
    """A process a wait depends on (``alive=``): the wait fails at once when it exits."""

    name: str

    @property
    def running(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...


def wait_until(what: str, check: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.01,
               alive: Process | None = None) -> T:
    """Poll ``check()`` until it returns a true value, and return that value.

    Raises :class:`WaitFailed` ``"timed out after Ns waiting for WHAT"`` once ``timeout``
    seconds pass without it, or at once if the process ``alive`` exits meanwhile.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if alive is not None and not alive.running:
            raise WaitFailed(f"{alive.name} exited (status {alive.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise WaitFailed(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)



async def wait_until_async(what: str, check: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S,
                           interval: float = 0.005) -> T:
    """:func:`wait_until` inside trio: poll ``check()`` between ``trio.sleep(interval)``, so the tasks it
    waits on run (and a mock clock jumps); :class:`WaitFailed` once ``timeout`` seconds (trio's clock) pass."""
    with trio.move_on_after(timeout):
        while True:
            result = check()
            if result:
                return result
            await trio.sleep(interval)
    raise WaitFailed(f"timed out after {timeout:g}s waiting for {what}")

#: How often a check that runs a command or asks a daemon (``ctr``, a status call) is polled.
COMPONENT_POLL_S = 0.1
#: :func:`wait_until` for such checks: the integration tests' and the benchmarks' waits on components.
wait_for_component = functools.partial(wait_until, interval=COMPONENT_POLL_S)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
