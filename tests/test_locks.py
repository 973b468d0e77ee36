"""bootseer.locks: a lock per key, excluding its holders, dropped when nobody holds or waits for it."""

from __future__ import annotations

import threading

import trio

from bootseer.locks import KeyedLocks, TrioKeyedLocks
from tests.support import autojump
from tests.support.waiting import wait_until

WAIT_S = 30.0  #: a hang detector: each wait returns as soon as the state it waits for is there


def test_thread_locks_exclude_per_key_are_reentrant_and_go_when_unused() -> None:
    locks = KeyedLocks()
    inside: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    guard = threading.Lock()
    start = threading.Barrier(16)

    def work(key: str) -> None:
        start.wait()
        for _ in range(50):
            with locks.hold(key), locks.hold(key):  # the same thread again: reentrant
                with guard:
                    inside[key] += 1
                    most[key] = max(most[key], inside[key])
                with guard:
                    inside[key] -= 1

    threads = [threading.Thread(target=work, args=("ab"[n % 2],)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == {"a": 1, "b": 1}
    assert len(locks) == 0


def test_a_thread_lock_waited_for_stays_until_its_last_waiter_is_done() -> None:
    """The holder leaves while a waiter waits: the key's lock stays (the waiter was counted
    before it waited), so a caller that comes while the waiter holds it waits on that same
    lock, and the key goes only when the last of them is done.

    Each step waits for the state it needs (the waiter counted while the holder still holds
    the key, so it can only be waiting), never for a guessed time.
    """
    locks = KeyedLocks()
    holder_in, holder_go, waiter_in, waiter_go = (threading.Event() for _ in range(4))
    order: list[str] = []

    def holder() -> None:
        with locks.hold("k"):
            order.append("holder")
            holder_in.set()
            holder_go.wait()

    def waiter() -> None:
        with locks.hold("k"):
            order.append("waiter")
            waiter_in.set()
            waiter_go.wait()

    def late() -> None:
        with locks.hold("k"):
            order.append("late")

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holder_in.wait(WAIT_S)
    threads.append(threading.Thread(target=waiter))
    threads[1].start()
    wait_until("the waiter to be counted on the held key", lambda: locks.users("k") == 2, WAIT_S)
    assert order == ["holder"] and len(locks) == 1  # the holder holds "k": the waiter is waiting for it

    holder_go.set()
    assert waiter_in.wait(WAIT_S)
    assert len(locks) == 1 and locks.users("k") == 1  # the holder left; the waiter's lock stayed

    threads.append(threading.Thread(target=late))
    threads[2].start()
    wait_until("the late caller to be counted on the waiter's lock", lambda: locks.users("k") == 2, WAIT_S)
    assert order == ["holder", "waiter"]  # excluded by the lock the waiter holds
    waiter_go.set()
    for thread in threads:
        thread.join()
    assert order == ["holder", "waiter", "late"] and len(locks) == 0 and locks.users("k") == 0


def test_trio_locks_exclude_and_a_cancelled_waiter_leaves_nothing() -> None:
    async def main() -> None:
        locks = TrioKeyedLocks()
        order: list[str] = []

        async def hold(name: str, key: str, seconds: float) -> None:
            async with locks.hold(key):
                order.append(f"{name} in")
                if name == "second":  # first left while second waited: its lock stayed, counted once
                    assert len(locks) == 1 and locks.users(key) == 1
                await trio.sleep(seconds)
                order.append(f"{name} out")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold, "first", "k", 10)
            await trio.sleep(1)
            nursery.start_soon(hold, "second", "k", 1)
            nursery.start_soon(hold, "other", "j", 1)
            with trio.move_on_after(2):  # gives up waiting for "k"
                await hold("cancelled", "k", 1)
            assert len(locks) == 1  # "k": first holds it, second waits for it; "j" is done and gone
            assert locks.users("k") == 2  # the cancelled waiter is no longer counted
        assert order == ["first in", "other in", "other out", "first out", "second in", "second out"]
        assert len(locks) == 0

    autojump.run(main, autojump=0)  # tasks only, no threads: the clock may jump as soon as all wait

