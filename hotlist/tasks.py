"""The hot-list service's background tasks: run in the layer server's nursery, never its end.

A prefetch, a recording or a lookup that fails is logged and over; the server, its FUSE
mount and every other task go on.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio

from bootseer.log import get_logger

log = get_logger(__name__)


def spawn_guarded(nursery: trio.Nursery, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run ``function(*args)`` in ``nursery``; an exception is logged, never raised into the nursery."""

    async def guarded() -> None:
        try:
            await function(*args)
        except Exception:
            log.error("hot-list task failed", task=getattr(function, "__name__", repr(function)), exc_info=True)

    nursery.start_soon(guarded)


__all__ = ["spawn_guarded"]
