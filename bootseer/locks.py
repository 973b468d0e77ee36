"""Locks by key (a ChainID, a path) that exist only while someone holds or waits for them.

A server that takes one lock per key its callers name (the layer server per ChainID a
request names, the snapshotter per ChainID a Prepare names) must not keep a lock for
every key ever named: the table would grow for the process's whole life.  Both kinds
here count the callers of each key (holders and waiters, counted before they wait)
and drop the key's lock when the last one leaves, so a lock is never dropped while
anyone still wants it, and one made afresh later excludes nobody.

* :class:`KeyedLocks`: for threads (``threading.RLock``: a thread may take a key it
  holds again, as nested snapshot operations do).
* :class:`TrioKeyedLocks`: for tasks of one trio run (``trio.Lock``; no guard needed,
  trio switches tasks only at checkpoints).
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Generic, Hashable, Iterator, TypeVar

import trio

LockT = TypeVar("LockT")


class _Entry(Generic[LockT]):
    """A key's lock and how many callers hold it or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self, lock: LockT) -> None:
        self.lock = lock
        self.users = 0


class KeyedLocks:
    """A reentrant lock per key, for threads; ``with locks.hold(key):``."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[Hashable, _Entry[threading.RLock]] = {}

    def __len__(self) -> int:
        """Keys with a lock now (held or waited for)."""
        return len(self._entries)

    def users(self, key: Hashable) -> int:
        """Callers holding or waiting for ``key``'s lock now (0: it has none)."""
        with self._guard:
            entry = self._entries.get(key)
            return entry.users if entry is not None else 0

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Hold ``key``'s lock for the block (waiting for it if another thread holds it)."""
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(threading.RLock())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]


class TrioKeyedLocks:
    """A lock per key, for the tasks of one trio run; ``async with locks.hold(key):``."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entry[trio.Lock]] = {}

    def __len__(self) -> int:
        """Keys with a lock now (held or waited for)."""
        return len(self._entries)

    def users(self, key: Hashable) -> int:
        """Tasks holding or waiting for ``key``'s lock now (0: it has none)."""
        entry = self._entries.get(key)
        return entry.users if entry is not None else 0

    @asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        """Hold ``key``'s lock for the block; a cancelled wait leaves the count right."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(trio.Lock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]


__all__ = ["KeyedLocks", "TrioKeyedLocks"]
