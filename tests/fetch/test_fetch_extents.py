"""Engine.fetch_extents: caller-named ranges that share, coalesce, yield to demand and fail like stripes.

Real sources throughout: a local directory (wrapped in the fault-injecting
``FaultySource``, which records every range read) and, where requests are counted
at the server, ``tests/support/http.py``'s range server.  Trio runs on the
autojump clock: retry timeouts of minutes take a moment, and a hung source is
given up on as soon as everything else waits for it.
"""

from __future__ import annotations

import errno
import random
from collections import Counter
from pathlib import Path

import prometheus_client
import pytest
import trio
import trio.testing

from bootseer.fetch.engine import EngineConfig, open_engine
from bootseer.fetch.stripes import Extent, FetchError, Priority
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.sources.http import HttpSource
from bootseer.fetch.sources.local import LocalSource
from tests.support.autojump import FAULT_AUTOJUMP, TIMEOUT, run

KiB = 1024
STRIPE = 64 * KiB
EXTENT = 4 * KiB



def config(**fields) -> EngineConfig:
    fields.setdefault("stripe_size", STRIPE)
    fields.setdefault("streams", 4)
    fields.setdefault("memory_limit", 64 * STRIPE)
    fields.setdefault("coalesce_gap", 2 * KiB)
    return EngineConfig(**fields)


@pytest.fixture
def packs(tmp_path: Path) -> dict[str, bytes]:
    """Two "pack" objects of random bytes."""
    contents = {}
    for seed, name in enumerate(("p1", "p2")):
        contents[name] = random.Random(seed).randbytes(16 * STRIPE + 123)
        (tmp_path / name).write_bytes(contents[name])
    return contents


@pytest.fixture
def source(tmp_path: Path) -> FaultySource:
    source = FaultySource(LocalSource(str(tmp_path)))
    yield source
    source.close()


def extent(name: str, offset: int, length: int = EXTENT, version: str = "") -> Extent:
    return Extent((name, offset, length), name, offset, length, version)


def sample(name: str, **labels) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


# -- coalescing ---------------------------------------------------------------------------


def test_adjacent_extents_are_fetched_with_one_request_counted_at_the_server(tmp_path, range_http_factory, packs):
    server = range_http_factory(tmp_path)
    wanted = [extent("p1", 1000 + n * EXTENT) for n in range(12)]
    before = sample("bootseer_fetch_extent_requests_total", kind="coalesced")

    async def main():
        source = HttpSource(server.url)
        try:
            async with open_engine(source, config()) as engine:
                got = await engine.fetch_extents(wanted)
                assert got == [packs["p1"][e.offset : e.offset + e.length] for e in wanted]
                assert engine.statistics().extent_requests == 1 and engine.statistics().coalesced_requests == 1
                assert engine.statistics().extents_fetched == 12 and engine.statistics().bytes_fetched == 12 * EXTENT
        finally:
            source.close()

    run(main)
    gets = [(path, headers.get("Range")) for method, path, headers in server.requests if method == "GET"]
    assert gets == [("/p1", f"bytes=1000-{1000 + 12 * EXTENT - 1}")]
    assert sample("bootseer_fetch_extent_requests_total", kind="coalesced") - before == 1


def test_small_gaps_are_bridged_large_ones_split_and_requests_stay_under_the_stripe_size(source, packs):
    gap = 2 * KiB  # the config's coalesce_gap
    data = packs["p1"]

    async def main():
        async with open_engine(source, config(streams=1)) as engine:
            # Three extents a gap of exactly coalesce_gap apart: one request, gaps dropped.
            near = [extent("p1", n * (EXTENT + gap)) for n in range(3)]
            # Then one a byte further than that: a request of its own.
            far = extent("p1", 3 * (EXTENT + gap) + 1)
            got = await engine.fetch_extents([*near, far])
            assert got == [data[e.offset : e.offset + e.length] for e in [*near, far]]
            assert [(r.offset, r.length) for r in source.reads] == [(0, 3 * EXTENT + 2 * gap), (far.offset, EXTENT)]
            assert engine.statistics().gap_bytes == 2 * gap
            assert engine.statistics().bytes_fetched == 4 * EXTENT + 2 * gap
            # 40 adjacent extents of 4 KiB: 160 KiB in requests of at most one stripe (64 KiB).
            source.reads.clear()
            run_of = [extent("p2", n * EXTENT) for n in range(40)]
            got = await engine.fetch_extents(run_of)
            assert b"".join(got) == packs["p2"][: 40 * EXTENT]
            assert [(r.offset, r.length) for r in source.reads] == [(0, STRIPE), (STRIPE, STRIPE), (2 * STRIPE, 32 * KiB)]
            # Extents of two objects never share a request, nor do extents out of order
            # once sorted: a request is one range of one object.
            source.reads.clear()
            mixed = [extent("p1", 10 * STRIPE + EXTENT), extent("p2", 10 * STRIPE), extent("p1", 10 * STRIPE)]
            got = await engine.fetch_extents(mixed)
            assert got == [packs[e.path][e.offset : e.offset + e.length] for e in mixed]
            assert sorted((r.path, r.offset, r.length) for r in source.reads) == [
                ("p1", 10 * STRIPE, 2 * EXTENT), ("p2", 10 * STRIPE, EXTENT)]  # fmt: skip

    run(main)


# -- sharing -----------------------------------------------------------------------------


def test_equal_keys_share_one_fetch_and_one_buffer(source, packs):
    data = packs["p1"]
    a, b = extent("p1", 0), extent("p1", 5 * STRIPE)

    async def main():
        async with open_engine(source, config()) as engine:
            results = []
            source.pause()  # every caller queues before any fetch ends
            async with trio.open_nursery() as nursery:
                for _ in range(5):

                    async def fetch():
                        results.append(await engine.fetch_extents([a, b, a], Priority.DEMAND))

                    nursery.start_soon(fetch)
                nursery.start_soon(engine.fetch_extents, [b], Priority.PREFETCH)
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            expected = [data[: EXTENT], data[5 * STRIPE : 5 * STRIPE + EXTENT], data[: EXTENT]]
            assert results == [expected] * 5
            assert Counter(r.offset for r in source.reads) == {0: 1, 5 * STRIPE: 1}
            # Buffered now: served again without a fetch.
            assert await engine.fetch_extents([b]) == [expected[1]]
            assert len(source.reads) == 2
            # A key that names other bytes is a caller's bug, refused before anything is fetched.
            with pytest.raises(ValueError, match="names two places"):
                await engine.fetch_extents([Extent(a.key, "p1", 1, EXTENT)])
            with pytest.raises(ValueError, match="names two places"):
                await engine.fetch_extents([Extent("k", "p1", 0, 10), Extent("k", "p1", 0, 11)])
            assert await engine.fetch_extents([]) == []
            assert await engine.fetch_extents([Extent("empty", "p1", 7, 0)]) == [b""]
            assert len(source.reads) == 2

    run(main)


def test_bad_extents_are_refused():
    with pytest.raises(ValueError, match="offset=-1"):
        Extent("k", "p", -1, 10)
    with pytest.raises(ValueError, match="length=-5"):
        Extent("k", "p", 0, -5)
    with pytest.raises(TypeError):
        Extent(["unhashable"], "p", 0, 10)
    with pytest.raises(ValueError, match="coalesce_gap"):
        config(coalesce_gap=-1)


# -- priorities ------------------------------------------------------------------------------


def test_a_demand_read_of_a_cold_extent_overtakes_a_long_prefetch_list(source, packs):
    # 64 prefetch extents that never coalesce (each gap is wider than coalesce_gap).
    prefetch = [extent("p1", n * 3 * EXTENT) for n in range(64)]
    cold = extent("p2", 7 * STRIPE)

    async def main():
        async with open_engine(source, config(streams=1)) as engine:
            done = {}
            source.pause()  # the one stream stalls on the first prefetch extent
            async with trio.open_nursery() as nursery:

                async def prefetch_all():
                    await engine.fetch_extents(prefetch, Priority.PREFETCH)
                    done["prefetch"] = len(source.reads)

                async def read_cold():
                    [data] = await engine.fetch_extents([cold])
                    assert data == packs["p2"][cold.offset : cold.offset + EXTENT]
                    done["demand"] = len(source.reads)

                nursery.start_soon(prefetch_all)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(read_cold)
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            # Served second: right after the one request that was already in flight.
            assert done["demand"] == 2 and done["prefetch"] == 65
            assert (source.reads[1].path, source.reads[1].offset) == ("p2", 7 * STRIPE)

    run(main)


def test_a_demand_read_waits_on_an_in_flight_prefetch_and_raises_a_queued_one(source, packs):
    data = packs["p1"]
    in_flight, queued = extent("p1", 0), [extent("p1", n * STRIPE) for n in range(2, 6)]

    async def main():
        async with open_engine(source, config(streams=1)) as engine:
            source.pause()
            got = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.fetch_extents, [in_flight], Priority.PREFETCH)
                await trio.testing.wait_all_tasks_blocked()  # the stream is stuck on it
                nursery.start_soon(engine.fetch_extents, queued, Priority.PREFETCH)
                await trio.testing.wait_all_tasks_blocked()

                async def demand(name, wanted):
                    got[name] = await engine.fetch_extents(wanted)

                nursery.start_soon(demand, "in flight", [in_flight])
                nursery.start_soon(demand, "queued", [queued[-1]])
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert got["in flight"] == [data[:EXTENT]]
            assert got["queued"] == [data[5 * STRIPE : 5 * STRIPE + EXTENT]]
            # Fetched once each; the last queued prefetch went first once a read wanted it.
            assert [r.offset // STRIPE for r in source.reads] == [0, 5, 2, 3, 4]
            assert engine.statistics().extents_joined_in_flight == 1 and engine.statistics().extents_raised == 1

    run(main)


# -- faults -----------------------------------------------------------------------------------


def test_transient_failures_are_retried_on_new_connections(source, packs):
    wanted = [extent("p1", n * EXTENT) for n in range(8)]

    async def main():
        async with open_engine(source, config(streams=2)) as engine:
            source.fail(times=2)
            source.fail(times=1, short=True)  # a cut-off answer: retried, not failed
            got = await engine.fetch_extents(wanted)
            assert got == [packs["p1"][e.offset : e.offset + e.length] for e in wanted]
            assert engine.statistics().retries >= 3 and engine.statistics().failures == 0
            failed = {r.connection for r in source.reads if r.outcome != "ok"}
            assert failed and failed <= source.closed
            assert "broken" not in source.outcomes()

    run(main, autojump=FAULT_AUTOJUMP)


def test_a_failing_or_hung_source_gives_eio_after_retry_timeout_then_recovers(source, packs):
    retry_timeout = 8.0
    wanted = [extent("p1", 0), extent("p1", EXTENT)]

    async def main():
        async with open_engine(source, config(retry_timeout=retry_timeout)) as engine:
            source.fail(path="p1")  # forever
            start = trio.current_time()
            with pytest.raises(FetchError, match="still failing") as caught:
                await engine.fetch_extents(wanted)
            assert caught.value.errno == errno.EIO
            assert retry_timeout <= trio.current_time() - start < retry_timeout + 5
            # Meanwhile other objects are served.
            assert await engine.fetch_extents([extent("p2", 0)]) == [packs["p2"][:EXTENT]]
            source.heal()
            await trio.sleep(retry_timeout)  # the engine fails a range that just failed at once, for a while
            assert await engine.fetch_extents(wanted) == [packs["p1"][:EXTENT], packs["p1"][EXTENT : 2 * EXTENT]]

            # A source that accepts and never answers: abandoned at the deadline.
            source.pause()
            start = trio.current_time()
            try:
                with pytest.raises(FetchError, match="no answer"):
                    await engine.fetch_extents([extent("p1", 9 * STRIPE)])
                assert retry_timeout <= trio.current_time() - start < retry_timeout + 5
            finally:
                source.resume()
            await trio.sleep(retry_timeout)
            assert await engine.fetch_extents([extent("p1", 9 * STRIPE)]) == [packs["p1"][9 * STRIPE : 9 * STRIPE + EXTENT]]
            assert engine.statistics().held_bytes <= engine.config.memory_limit

    run(main, autojump=FAULT_AUTOJUMP)


def test_missing_truncated_and_changed_objects_fail_at_once(tmp_path, source, packs):
    async def main():
        # retry_timeout far beyond the test's own: none of these may be retried.
        async with open_engine(source, config(retry_timeout=10 * TIMEOUT)) as engine:
            with pytest.raises(FetchError, match="missing"):
                await engine.fetch_extents([extent("missing", 0)])
            size = len(packs["p1"])
            # Partly beyond the end (a truncated pack); its neighbour in the same request is served.
            inside, beyond = extent("p1", size - 2 * EXTENT), extent("p1", size - EXTENT, 2 * EXTENT)
            with pytest.raises(FetchError, match="only .* bytes long"):
                await engine.fetch_extents([inside, beyond])
            assert await engine.fetch_extents([inside]) == [packs["p1"][size - 2 * EXTENT : size - EXTENT]]
            # Pinned to a version: a rewritten object is Changed, never mixed.
            entry = await engine.stat("p2")
            (tmp_path / "p2").write_bytes(b"x" * len(packs["p2"]))
            with pytest.raises(FetchError, match="changed"):
                await engine.fetch_extents([extent("p2", 0, version=entry.version)])
            assert engine.statistics().retries == 0

    run(main)


def test_discard_drops_a_buffered_extent_and_the_next_fetch_refetches_it(source, packs):
    wanted = extent("p1", 3 * STRIPE)

    async def main():
        async with open_engine(source, config()) as engine:
            [first] = await engine.fetch_extents([wanted])
            assert await engine.fetch_extents([wanted]) == [first]
            assert len(source.reads) == 1
            engine.discard(wanted.key)
            engine.discard("never fetched")  # unknown keys are ignored
            assert await engine.fetch_extents([wanted]) == [first]
            assert len(source.reads) == 2 and engine.statistics().discards == 1
            assert engine.statistics().held_bytes == EXTENT  # the old buffer is gone, the new one loose

    run(main)


# -- memory -------------------------------------------------------------------------------------


def test_memory_stays_bounded_for_lists_far_larger_than_the_limit(source, packs):
    limit = 4 * STRIPE
    rng = random.Random(3)
    # 600 extents, 2.3 MiB in all, in random order with repeats, over both packs.
    wanted = [extent(rng.choice(["p1", "p2"]), rng.randrange(0, 16 * STRIPE - 8 * KiB), rng.randrange(1, 8 * KiB))
              for _ in range(600)]  # fmt: skip

    async def main():
        async with open_engine(source, config(memory_limit=limit, streams=3)) as engine:
            async with trio.open_nursery() as nursery:
                for number, priority in enumerate([Priority.PREFETCH, Priority.DEMAND, Priority.DEMAND]):

                    async def fetch(part=wanted[number::3], priority=priority):
                        got = await engine.fetch_extents(part, priority)
                        assert got == [packs[e.path][e.offset : e.offset + e.length] for e in part]

                    nursery.start_soon(fetch)
            assert 0 < engine.statistics().peak_held_bytes <= limit
            assert engine.statistics().held_bytes <= limit

    run(main)


def test_a_cancelled_fetch_leaves_nothing_queued_or_reserved(source, packs):
    async def main():
        async with open_engine(source, config(streams=1)) as engine:
            source.pause()
            with trio.move_on_after(5):
                await engine.fetch_extents([extent("p1", n * 3 * EXTENT) for n in range(20)], Priority.PREFETCH)
            source.resume()
            # The one fetch in flight lands, as a loose buffer; nothing else of the list
            # is fetched: the next request is the next read's.
            assert await engine.fetch_extents([extent("p2", 0)]) == [packs["p2"][:EXTENT]]
            assert [(r.path, r.offset) for r in source.reads] == [("p1", 0), ("p2", 0)]
            assert engine.statistics().held_bytes == 2 * EXTENT

    run(main)
