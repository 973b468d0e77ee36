"""CPU seconds per stage (bootseer.cpu): each stage counts its thread's own CPU, a nested one apart."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from bootseer import cpu


def _burn(seconds: float) -> None:
    """Spend about ``seconds`` of this thread's CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        hashlib.sha256(bytes(4096)).digest()


def test_a_stage_inside_another_counts_its_own_cpu_and_the_outer_one_the_rest() -> None:
    before = cpu.statistics().stages
    with cpu.stage("page_cache_warm"):
        _burn(0.05)
        with cpu.stage("blob_fill"):
            _burn(0.1)
    after = cpu.statistics().stages
    warm = after["page_cache_warm"] - before["page_cache_warm"]
    fill = after["blob_fill"] - before["blob_fill"]
    assert 0.1 <= fill < 0.15 and 0.05 <= warm < 0.1, (warm, fill)


def test_a_stage_counts_its_threads_cpu_not_the_wall_clock_nor_other_threads() -> None:
    before = cpu.statistics().stages["decode"]
    worker = threading.Thread(target=_burn, args=(0.2,))
    with cpu.stage("decode"):
        worker.start()
        worker.join()  # waiting costs this thread no CPU
        time.sleep(0.05)
    assert cpu.statistics().stages["decode"] - before < 0.05
    assert cpu.statistics().process >= 0.2


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(KeyError):
        with cpu.stage("no such stage"):
            pass


def test_the_garbage_collectors_cpu_is_its_own_stage_and_not_the_stage_it_interrupted() -> None:
    import gc

    cpu.count_gc()
    cpu.count_gc()  # once: a second call adds no second callback
    assert sum(1 for callback in gc.callbacks if callback is cpu._on_gc) == 1
    junk = [[object() for _ in range(10)] for _ in range(100_000)]  # many objects for a full collection to walk
    before = cpu.statistics().stages
    with cpu.stage("decode"):
        started = time.thread_time()
        gc.collect()
        spent = time.thread_time() - started
    after = cpu.statistics().stages
    collected = after["gc"] - before["gc"]
    assert collected >= 0.8 * spent > 0 and after["decode"] - before["decode"] <= 0.2 * spent + 0.001, (collected, spent)
    del junk
