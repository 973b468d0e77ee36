"""bootseer.locks: a lock per key, excluding its holders, dropped when nobody holds or waits for it."""

from __future__ import annotations

import threading

import trio
import trio.testing

from bootseer.locks import KeyedLocks, TrioKeyedLocks


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
    locks = KeyedLocks()
    held, release, waiting = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def holder() -> None:
        with locks.hold("k"):
            held.set()
            release.wait()
            order.append("holder")

    def waiter() -> None:
        held.wait()
        waiting.set()
        with locks.hold("k"):
            order.append("waiter")

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for thread in threads:
        thread.start()
    waiting.wait()
    assert len(locks) == 1
    release.set()
    for thread in threads:
        thread.join()
    assert order == ["holder", "waiter"] and len(locks) == 0


def test_trio_locks_exclude_and_a_cancelled_waiter_leaves_nothing() -> None:
    async def main() -> None:
        locks = TrioKeyedLocks()
        order: list[str] = []

        async def hold(name: str, key: str, seconds: float) -> None:
            async with locks.hold(key):
                order.append(f"{name} in")
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
        assert order == ["first in", "other in", "other out", "first out", "second in", "second out"]
        assert len(locks) == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

