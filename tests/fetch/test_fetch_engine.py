"""The fetch engine against real files through the local backend, with recorded and injected faults."""

from __future__ import annotations

import errno
import os
import random
from collections import Counter
from pathlib import Path

import prometheus_client
import pytest
import trio
import trio.testing

from bootseer.fetch.engine import Engine, EngineConfig, open_engine
from bootseer.fetch.stripes import Extent, FetchError, Priority
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.source import TransientError
from bootseer.fetch.sources.local import LocalSource
from tests.support.waiting import wait_until_async

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
STRIPE = 64 * KiB
TIMEOUT = 30  # seconds any one test may take; a hang fails instead of blocking the run


def run(async_fn, *args, timeout: float = TIMEOUT):
    async def bounded():
        with trio.fail_after(timeout):
            return await async_fn(*args)

    return trio.run(bounded)


def write_random(path: Path, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    """A few files of awkward sizes (not multiples of the stripe size) under tmp_path."""
    sizes = {"a.bin": 20 * STRIPE + 123, "b.bin": 7 * STRIPE, "c.bin": 3 * STRIPE + 1, "empty.bin": 0}
    return {name: write_random(tmp_path / name, size, seed) for seed, (name, size) in enumerate(sizes.items())}


@pytest.fixture
def source(tmp_path: Path) -> FaultySource:
    source = FaultySource(LocalSource(str(tmp_path)))
    yield source
    source.close()


def config(**fields) -> EngineConfig:
    fields.setdefault("stripe_size", STRIPE)
    fields.setdefault("streams", 4)
    fields.setdefault("memory_limit", 64 * STRIPE)
    fields.setdefault("readahead_max", 8 * STRIPE)
    return EngineConfig(**fields)


async def scan(engine: Engine, path: str, size: int, chunk: int) -> bytes:
    reader = engine.open(path, size)
    pieces, offset = [], 0
    while True:
        piece = await reader.read(offset, chunk)
        if not piece:
            break
        assert len(piece) == min(chunk, size - offset)
        pieces.append(piece)
        offset += len(piece)
    reader.close()
    return b"".join(pieces)


# -- correctness -------------------------------------------------------------------------


def test_random_reads_are_byte_exact(source, files):
    data = files["a.bin"]
    rng = random.Random(42)

    async def main():
        async with open_engine(source, config(memory_limit=8 * STRIPE)) as engine:
            reader = engine.open("a.bin", len(data))
            for _ in range(300):
                offset = rng.randrange(0, len(data) + STRIPE)
                size = rng.choice([0, 1, rng.randrange(1, 2 * STRIPE), rng.randrange(1, 6 * STRIPE)])
                assert await reader.read(offset, size) == data[offset : offset + size], (offset, size)
            assert engine.statistics().peak_held_bytes <= 8 * STRIPE

    run(main)


@pytest.mark.parametrize("chunk", [1000, STRIPE - 1, STRIPE, STRIPE + 1, 3 * STRIPE + 7, 64 * STRIPE])
def test_sequential_scan_crosses_stripe_boundaries_and_fetches_each_stripe_once(source, files, chunk):
    async def main():
        async with open_engine(source, config()) as engine:
            for name, data in files.items():
                assert await scan(engine, name, len(data), chunk) == data
            fetched = Counter((r.path, r.offset) for r in source.reads)
            assert set(fetched.values()) <= {1}
            assert engine.statistics().bytes_fetched == sum(len(d) for d in files.values())

    run(main)


def test_eof_edges(source, files):
    data = files["b.bin"]  # exactly 7 stripes
    size = len(data)

    async def main():
        async with open_engine(source, config()) as engine:
            reader = engine.open("b.bin", size)
            assert await reader.read(size - 1, 10) == data[-1:]
            assert await reader.read(size, 10) == b""
            assert await reader.read(size + 5 * STRIPE, 10) == b""
            assert await reader.read(0, 0) == b""
            assert await reader.read(0, size + 1000) == data
            assert await reader.read(STRIPE - 1, 2) == data[STRIPE - 1 : STRIPE + 1]
            buffer = bytearray(3 * STRIPE)
            assert await reader.read_into(size - STRIPE, buffer) == STRIPE
            assert buffer[:STRIPE] == data[-STRIPE:]
            empty = engine.open("empty.bin", 0)
            assert await empty.read(0, 100) == b""
            with pytest.raises(ValueError):
                await reader.read(-1, 10)
            reader.close()
            with pytest.raises(ValueError):
                await reader.read(0, 10)
            # A reader past EOF touched nothing beyond the file.
            assert all(r.offset < size for r in source.reads)

    run(main)


def test_concurrent_readers_of_one_file_share_fetches(source, files):
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config(streams=3)) as engine:
            results = {}

            async def read_all(number):
                results[number] = await scan(engine, "a.bin", len(data), STRIPE // 3 + number)

            source.pause()  # let every reader queue its stripes before any fetch ends
            async with trio.open_nursery() as nursery:
                for number in range(8):
                    nursery.start_soon(read_all, number)
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert all(result == data for result in results.values())
            assert Counter(r.offset for r in source.reads) == Counter(range(0, len(data), STRIPE))

    run(main)


def test_many_files_read_concurrently(tmp_path, source):
    (tmp_path / "dir").mkdir()
    contents = {f"dir/f{n}.bin": write_random(tmp_path / f"dir/f{n}.bin", 3 * STRIPE + n * 999, n) for n in range(24)}

    async def main():
        async with open_engine(source, config(memory_limit=16 * STRIPE, max_windows=4)) as engine:

            async def check(name, data, seed):
                rng = random.Random(seed)
                if seed % 2:
                    assert await scan(engine, name, len(data), 10_000 + seed) == data
                else:
                    reader = engine.open(name, len(data))
                    for _ in range(20):
                        offset, size = rng.randrange(len(data)), rng.randrange(1, 2 * STRIPE)
                        assert await reader.read(offset, size) == data[offset : offset + size]
                    reader.close()

            async with trio.open_nursery() as nursery:
                for seed, (name, data) in enumerate(contents.items()):
                    nursery.start_soon(check, name, data, seed)
            assert engine.statistics().peak_held_bytes <= 16 * STRIPE

    run(main)


# -- read-ahead, random access, memory ------------------------------------------------


def test_readahead_window_grows_while_sequential_and_resets_on_random_access(source, files):
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config(readahead_max=8 * STRIPE)) as engine:
            reader = engine.open("a.bin", len(data))
            windows = []
            for offset in range(0, 6 * STRIPE, STRIPE // 2):
                assert await reader.read(offset, STRIPE // 2) == data[offset : offset + STRIPE // 2]
                windows.append(reader.window)
            # Two reads per stripe: the window doubles on entering each new stripe, up to 8.
            assert windows == [2, 2, 4, 4, 8, 8, 8, 8, 8, 8, 8, 8]
            # The window's stripes are fetched without being asked for.
            await wait_until_async("stripes 6..13 to be asked for",
                                   lambda: {r.offset for r in source.reads} >= {i * STRIPE for i in range(6, 14)})
            far = 18 * STRIPE + 5
            assert await reader.read(far, 10) == data[far : far + 10]
            assert reader.window == 0
            assert await reader.read(far + 10, 10) == data[far + 10 : far + 20]
            assert reader.window == 2

    run(main)


def test_random_access_to_a_huge_sparse_file_fetches_only_what_it_touches(tmp_path, source):
    size = 64 * GiB
    stripe = 1 * MiB
    path = tmp_path / "sparse.bin"
    marks = {10 * GiB + 3: b"ten", 40 * GiB - 2: b"forty", size - 7: b"the end"}
    with open(path, "wb") as file:
        file.truncate(size)
        for offset, mark in marks.items():
            file.seek(offset)
            file.write(mark)

    async def main():
        cfg = config(stripe_size=stripe, memory_limit=64 * stripe, readahead_max=256 * MiB)
        async with open_engine(source, cfg) as engine:
            entry = await engine.stat("sparse.bin")
            assert entry.size == size
            reader = engine.open("sparse.bin", size)
            for offset, mark in marks.items():
                assert await reader.read(offset, len(mark) + 100) == mark + bytes(min(100, size - offset - len(mark)))
            assert await reader.read(20 * GiB, 10) == bytes(10)
            # Four random reads, one of them across a stripe boundary: five stripes.
            assert engine.statistics().bytes_fetched == 5 * stripe
            assert source.bytes_read() == 5 * stripe
            assert reader.window == 0

    run(main)


def test_memory_bound_holds_under_big_sequential_scans(tmp_path, source):
    limit = 6 * STRIPE
    contents = {f"big{n}.bin": write_random(tmp_path / f"big{n}.bin", 40 * STRIPE + n, n) for n in range(3)}

    async def main():
        cfg = config(streams=4, memory_limit=limit, readahead_max=32 * STRIPE)
        async with open_engine(source, cfg) as engine:
            async with trio.open_nursery() as nursery:
                for name, data in contents.items():

                    async def check(name=name, data=data):
                        assert await scan(engine, name, len(data), 16 * KiB) == data

                    nursery.start_soon(check)
            # One read far larger than the memory limit, as read_bytes does.
            data = contents["big0.bin"]
            reader = engine.open("big0.bin", len(data))
            assert await reader.read(0, len(data)) == data
            assert 0 < engine.statistics().peak_held_bytes <= limit
            # Stripes a sequential reader passed were dropped: only what readers still hold remains.
            assert engine.statistics().held_bytes <= limit

    run(main)


def test_max_windows_takes_the_least_recently_used_window(source, files):
    async def main():
        async with open_engine(source, config(max_windows=2)) as engine:
            readers = [engine.open(name, len(files[name])) for name in ("a.bin", "b.bin", "c.bin")]
            for reader in readers:
                await reader.read(0, 100)
            assert [r.window for r in readers] == [0, 2, 2]
            await readers[0].read(100, 100)
            assert [r.window for r in readers] == [2, 0, 2]

    run(main)


def test_reordered_and_overlapping_reads_near_the_position_stay_sequential(source, files):
    """Concurrent FUSE requests and an mmap's read-around arrive out of order, overlap
    and step back a little: none of that is random access."""
    data = files["a.bin"]
    chunk = STRIPE // 4

    async def main():
        async with open_engine(source, config(readahead_max=8 * STRIPE)) as engine:
            reader = engine.open("a.bin", len(data))
            windows = []
            for group in range(0, len(data), 4 * chunk):
                # A re-read of the bytes just behind, then four requests in flight at
                # once, started in a scrambled order.
                offsets = [max(0, group - chunk // 2)] + [group + k * chunk for k in (1, 0, 3, 2)]
                async with trio.open_nursery() as nursery:
                    for offset in offsets:

                        async def check(offset=offset):
                            assert await reader.read(offset, chunk) == data[offset : offset + chunk]

                        nursery.start_soon(check)
                        await trio.testing.wait_all_tasks_blocked()  # so they arrive in this order
                windows.append(reader.window)
            assert 0 not in windows
            assert max(windows) == 8
            fetched = Counter(r.offset for r in source.reads)
            assert set(fetched.values()) == {1}  # nothing dropped and fetched again
            assert engine.statistics().bytes_fetched == len(data)

    run(main)


def test_a_copy_that_touches_each_tensors_end_first_stays_sequential(source, files):
    """``memcpy`` out of an mmapped safetensors file touches each tensor's last page
    first, then copies from its start: a jump ahead and back for every tensor."""
    data = files["a.bin"]
    page = 4 * KiB
    # Tensor boundaries: small ones, ones across stripes, one longer than the window.
    bounds = [0, 5000, STRIPE // 3, STRIPE + 7, 3 * STRIPE - 11, 3 * STRIPE + 20, 5 * STRIPE + 1, 15 * STRIPE + 3]
    bounds.append(len(data))

    async def main():
        async with open_engine(source, config(readahead_max=8 * STRIPE)) as engine:
            reader = engine.open("a.bin", len(data))
            windows = []
            for start, end in zip(bounds, bounds[1:]):
                tail = max(start, (end - 1) // page * page)
                assert await reader.read(tail, page) == data[tail : tail + page]
                for offset in range(start, end, page):
                    assert await reader.read(offset, page) == data[offset : offset + page]
                windows.append(reader.window)
            # The window grew and was never lost, not even for the tensor longer than it.
            assert windows == [2, 2, 4, 8, 8, 8, 8, 8]
            fetched = Counter(r.offset for r in source.reads)
            assert set(fetched.values()) == {1}
            assert engine.statistics().bytes_fetched == len(data)

    run(main)


def test_a_one_off_read_elsewhere_pauses_the_window_and_the_stream_takes_it_back(source, files):
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config(readahead_max=8 * STRIPE)) as engine:
            reader = engine.open("a.bin", len(data))
            for offset in range(0, 4 * STRIPE, STRIPE // 2):
                await reader.read(offset, STRIPE // 2)
            assert reader.window == 8
            assert await reader.read(19 * STRIPE, 10) == data[19 * STRIPE : 19 * STRIPE + 10]
            assert reader.window == 0  # random access holds no window
            assert await reader.read(4 * STRIPE, 10) == data[4 * STRIPE : 4 * STRIPE + 10]
            assert reader.window == 8  # the stream went on: its window is back, not restarted
            # A far read that the next read continues starts a new stream there.
            assert await reader.read(STRIPE + 5, 10) == data[STRIPE + 5 : STRIPE + 15]
            assert reader.window == 0
            assert await reader.read(STRIPE + 15, 10) == data[STRIPE + 15 : STRIPE + 25]
            assert reader.window == 2

    run(main)


# -- priorities ----------------------------------------------------------------------------


def test_demand_overtakes_queued_readahead_and_prefetch(source, files):
    async def main():
        async with open_engine(source, config(streams=1)) as engine:
            source.pause()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.prefetch, "a.bin", len(files["a.bin"]), 0, 6 * STRIPE)
                await trio.testing.wait_all_tasks_blocked()  # the one stream is stuck on a.bin's stripe 0
                reader = engine.open("b.bin", len(files["b.bin"]))
                nursery.start_soon(reader.read, 0, 100)  # demand b0, read-ahead b1, b2
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            order = [(r.path, r.offset // STRIPE) for r in source.reads]
            assert order[:4] == [("a.bin", 0), ("b.bin", 0), ("b.bin", 1), ("b.bin", 2)]
            assert order[4:] == [("a.bin", n) for n in range(1, 6)]

    run(main)


def test_prefetched_stripes_serve_later_reads(source, files):
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config()) as engine:
            await engine.prefetch("a.bin", len(data), 3 * STRIPE + 10, 2 * STRIPE, Priority.PREFETCH)
            assert source.bytes_read() == 3 * STRIPE
            reader = engine.open("a.bin", len(data))
            assert await reader.read(4 * STRIPE, STRIPE) == data[4 * STRIPE : 5 * STRIPE]
            assert source.bytes_read() == 3 * STRIPE  # nothing new fetched

    run(main)


# -- faults ----------------------------------------------------------------------------------


def test_transient_failures_are_retried_on_new_connections(source, files):
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config(streams=2)) as engine:
            source.fail(times=3)
            source.fail(times=2, short=True)
            assert await scan(engine, "a.bin", len(data), 50_000) == data
            outcomes = source.outcomes()
            assert outcomes["error"] == 3 and outcomes["short"] == 2
            assert "broken" not in outcomes  # a failed connection is never used again
            failed = {r.connection for r in source.reads if r.outcome != "ok"}
            assert failed <= source.closed
            assert engine.statistics().retries == 5 and engine.statistics().failures == 0

    run(main)


def test_unexpected_exceptions_from_a_backend_are_retried(source, files):
    data = files["c.bin"]

    async def main():
        async with open_engine(source, config()) as engine:
            source.fail(times=1, error=lambda: RuntimeError("backend bug"))
            source.fail(times=1, error=lambda: ConnectionResetError(errno.ECONNRESET, "reset"))
            assert await scan(engine, "c.bin", len(data), STRIPE) == data
            assert engine.statistics().retries == 2

    run(main)


def test_a_source_that_stays_down_gives_eio_and_other_files_are_served(source, files):
    async def main():
        async with open_engine(source, config(retry_timeout=1.0)) as engine:
            source.fail(path="a.bin")  # forever
            source.fail(path="b.bin", short=True)  # forever, short reads
            broken = [engine.open(name, len(files[name])) for name in ("a.bin", "b.bin")]
            good = engine.open("c.bin", len(files["c.bin"]))
            errors = []

            async def read_broken(reader):
                with pytest.raises(FetchError) as caught:
                    await reader.read(STRIPE - 10, 100)
                errors.append(caught.value)

            async with trio.open_nursery() as nursery:
                for reader in broken:
                    nursery.start_soon(read_broken, reader)
                await wait_until_async("both broken reads to retry", lambda: engine.statistics().retries >= 2)  # both broken reads are retrying now
                assert await good.read(0, len(files["c.bin"])) == files["c.bin"]
            assert len(errors) == 2
            assert all(error.errno == errno.EIO and "still failing" in str(error) for error in errors)
            assert engine.statistics().failures >= 2
            # The source comes back: the same reads succeed once the failure is forgotten.
            source.heal()
            await trio.sleep(engine.failure_memory)
            data = files["a.bin"]
            assert await broken[0].read(STRIPE - 10, 100) == data[STRIPE - 10 : STRIPE + 90]

    run(main)


def test_a_range_that_just_failed_fails_again_at_once_for_a_while(source, files):
    """The kernel follows a failed read-ahead read with a one-page read of the same range:
    that read, and any other of the stripe or extent, fails at once for ``failure_memory``
    seconds instead of waiting out a fresh retry_timeout; then the source is asked again."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config(retry_timeout=60.0)) as engine:
            assert engine.failure_memory == 10.0  # min(retry_timeout, 10 s)
            source.pause()  # a source that accepts and never answers
            try:
                reader = engine.open("a.bin", len(data))
                started = trio.current_time()
                with pytest.raises(FetchError):
                    await reader.read(0, 128 * KiB)  # two stripes, read ahead too
                assert 60.0 <= trio.current_time() - started < 61.0
                connections = len(source.opened)

                async def fails_at_once(read) -> None:
                    before = trio.current_time()
                    with pytest.raises(FetchError, match="still failing"):
                        await read()
                    assert trio.current_time() == before  # virtual time: not a moment spent waiting

                await fails_at_once(lambda: reader.read(0, 4096))  # the kernel's one-page retry
                await fails_at_once(lambda: engine.open("a.bin", len(data)).read(STRIPE + 5, 10))  # another handle
                await fails_at_once(lambda: engine.prefetch("a.bin", len(data), 0, STRIPE))
                assert len(source.opened) == connections  # nothing new was asked of the source
                extent = Extent(key="x", path="a.bin", offset=100, length=10)
                with pytest.raises(FetchError):  # an extent is not a stripe: its own first failure
                    await engine.fetch_extents([extent])
                await fails_at_once(lambda: engine.fetch_extents([extent]))
                await trio.sleep(engine.failure_memory)
                clock.autojump_threshold = 1.0  # real reads in threads from here: no jumping past them
                source.resume()
                assert await reader.read(0, 4096) == data[:4096]  # asked again, and served
                assert await engine.fetch_extents([extent]) == [data[100:110]]
            finally:
                source.resume()

    trio.run(main, clock=clock)


def test_stripes_belong_to_one_version_of_a_file(tmp_path, source):
    """A file rewritten in place at the same size: readers of the new version get only
    new bytes (no stripe of the old one in memory serves them), readers of the old
    one get old bytes or EIO at once, never a mix and never a retry."""
    path = tmp_path / "v.bin"
    path.write_bytes(b"A" * 3 * STRIPE)

    async def main():
        async with open_engine(source, config(retry_timeout=3600)) as engine:
            v1 = await engine.stat("v.bin")
            old = engine.open("v.bin", v1.size, v1.mtime, v1.version)
            assert await old.read(STRIPE + 5, 10) == b"A" * 10
            before = path.stat()
            with open(path, "r+b") as rewrite:
                rewrite.write(b"B" * 3 * STRIPE)
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))  # a coarse clock may not move
            v2 = await engine.stat("v.bin")
            assert v2.size == v1.size and v2.version != v1.version
            [listed] = [entry for entry in await engine.listdir("") if entry.name == "v.bin"]
            assert listed.version == v2.version
            new = engine.open("v.bin", v2.size, v2.mtime, v2.version)
            assert await new.read(0, v2.size) == b"B" * 3 * STRIPE
            with pytest.raises(FetchError, match="changed") as caught:
                await old.read(0, v1.size)
            assert caught.value.errno == errno.EIO
            assert engine.statistics().retries == 0 and engine.statistics().failures >= 1

    run(main)


def test_missing_files_and_changed_sizes_fail_at_once(tmp_path, source, files):
    async def main():
        # retry_timeout is far beyond the test's own timeout: these must not be retried.
        async with open_engine(source, config(retry_timeout=3600)) as engine:
            with pytest.raises(FetchError, match="missing.bin"):
                await engine.open("missing.bin", 100).read(0, 10)
            # Opened with a size the file does not have: a short read, then a stat, then EIO.
            size = len(files["c.bin"])
            with pytest.raises(FetchError, match="now .* bytes"):
                await engine.open("c.bin", size + STRIPE).read(size - 10, 100)
            assert engine.statistics().retries == 0

    run(main, timeout=10)


def test_stat_and_listdir_are_retried(source, files):
    async def main():
        async with open_engine(source, config()) as engine:
            source.fail_stat(times=2)
            entry = await engine.stat("a.bin")
            assert entry.size == len(files["a.bin"]) and not entry.is_dir
            source.fail_stat(times=1, error=lambda: OSError(errno.ETIMEDOUT, "timed out"))
            names = sorted(e.name for e in await engine.listdir(""))
            assert names == sorted(files)
            from bootseer.fetch.source import NotFound

            with pytest.raises(NotFound):
                await engine.stat("nope")

    run(main)


def test_cancelling_one_read_leaves_a_shared_fetch_to_the_others(source, files):
    data = files["a.bin"]

    async def main():
        async with open_engine(source, config()) as engine:
            source.pause()
            first, second = engine.open("a.bin", len(data)), engine.open("a.bin", len(data))
            got = []
            cancelled = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_into_list, first, cancelled)

                async def keep():
                    got.append(await second.read(100, 1000))

                nursery.start_soon(keep)
                await trio.testing.wait_all_tasks_blocked()
                cancelled.cancel()
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert got == [data[100:1100]]
            assert Counter(r.offset for r in source.reads)[0] == 1
            first.close()
            second.close()

    async def read_into_list(reader, scope):
        with scope:
            await reader.read(100, 1000)

    run(main)


def test_stopping_the_engine_fails_pending_reads(source, files):
    async def main():
        engine = Engine(source, config(streams=1))
        outcome = []
        async with trio.open_nursery() as nursery:
            engine_scope = trio.CancelScope()

            async def serve(task_status=trio.TASK_STATUS_IGNORED):
                with engine_scope:
                    await engine.run(task_status=task_status)

            await nursery.start(serve)
            source.pause()

            async def read(name):
                try:
                    await engine.open(name, len(files[name])).read(0, 10)
                except FetchError as exc:
                    outcome.append((name, exc))

            # The one stream is stuck in a.bin's read (paused: a source that never
            # answers); b.bin waits in the queue.  Stopping abandons the stuck read
            # rather than wait for it (it would wait for faults.PAUSE_LIMIT_SECONDS).
            nursery.start_soon(read, "a.bin")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read, "b.bin")
            await trio.testing.wait_all_tasks_blocked()
            try:
                with trio.fail_after(10):
                    engine_scope.cancel()
                    await wait_until_async("both reads to end", lambda: len(outcome) == 2)
            finally:
                source.resume()
        assert sorted(name for name, _ in outcome) == ["a.bin", "b.bin"]
        assert all("stopped" in str(error) for _, error in outcome)
        assert engine.statistics().held_bytes == 0
        # The abandoned read's connection was closed from another thread.
        await wait_until_async("every opened stream to be closed", lambda: source.closed == set(source.opened))
        with pytest.raises(FetchError):
            engine.open("a.bin", 10)

    run(main)


# -- configuration and metrics ----------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"stripe_size": 0},
        {"streams": 0},
        {"memory_limit": STRIPE - 1},
        {"retry_timeout": -1.0},
        {"readahead_max": -1},
        {"cache_dir": "/tmp/x", "cache_size": 10},
    ],
)
def test_bad_configuration_is_refused(fields):
    with pytest.raises(ValueError, match="invalid fetch engine configuration"):
        config(**fields)


def test_streams_default_to_the_source(source):
    assert Engine(source, EngineConfig()).streams == LocalSource.default_streams
    assert Engine(source, EngineConfig(streams=3)).streams == 3


def test_prometheus_metrics_count_bytes_stripes_and_retries(source, files):
    registry = prometheus_client.REGISTRY

    def sample(name, **labels):
        return registry.get_sample_value(name, labels) or 0.0

    before = (sample("bootseer_fetch_bytes_total"), sample("bootseer_fetch_stripes_total", outcome="fetched"),
              sample("bootseer_fetch_retries_total"))  # fmt: skip

    async def main():
        async with open_engine(source, config()) as engine:
            source.fail(times=1, error=lambda: TransientError("once"))
            assert await scan(engine, "b.bin", len(files["b.bin"]), STRIPE) == files["b.bin"]
            assert sample("bootseer_fetch_in_flight_stripes") == 0

    run(main)
    assert sample("bootseer_fetch_bytes_total") - before[0] == len(files["b.bin"])
    assert sample("bootseer_fetch_stripes_total", outcome="fetched") - before[1] == 7
    assert sample("bootseer_fetch_retries_total") - before[2] == 1


def test_fetch_error_is_an_eio_oserror():
    error = FetchError("x: stripe 3 failed")
    assert isinstance(error, OSError) and error.errno == errno.EIO and "stripe 3" in str(error)
    assert os.strerror(error.errno) in ("Input/output error",)


@pytest.mark.parametrize("seed", range(8))
def test_mixed_workload_under_tight_memory_with_faults_and_cancellations(tmp_path, source, seed):
    """Reads, prefetches, cancelled reads and injected faults at once, with room for one to nine stripes.

    Whatever happens, nothing hangs, memory stays bounded, and every byte returned is right.
    """
    stripe = 16 * KiB
    rng = random.Random(seed)
    contents = {f"f{n}": write_random(tmp_path / f"f{n}", rng.randrange(0, 40 * stripe), seed * 100 + n) for n in range(8)}
    cfg = EngineConfig(stripe_size=stripe, streams=rng.choice([1, 2, 5]), memory_limit=rng.choice([1, 2, 4, 9]) * stripe,
                       readahead_max=rng.choice([0, 4, 32]) * stripe, max_windows=rng.choice([0, 1, 3, 64]),
                       retry_timeout=0.3)  # fmt: skip

    async def client(engine, number):
        rng = random.Random(seed * 1000 + number)
        for _ in range(25):
            name = rng.choice(sorted(contents))
            data = contents[name]
            reader = engine.open(name, len(data))
            position = rng.randrange(len(data) + 1)
            try:
                for _ in range(rng.randrange(1, 8)):
                    size = rng.randrange(1, 10 * stripe)
                    # Some reads are cancelled almost at once, some prefetch instead.
                    with trio.move_on_after(rng.choice([0.001, TIMEOUT, TIMEOUT])):
                        if rng.random() < 0.2:
                            await engine.prefetch(name, len(data), position, size, Priority(rng.randrange(3)))
                            continue
                        piece = await reader.read(position, size)
                        assert piece == data[position : position + size]
                        position = position + len(piece) if rng.random() < 0.7 else rng.randrange(len(data) + 1)
            except FetchError:
                pass  # a stripe failed for retry_timeout under the injected faults: allowed, wrong bytes are not
            finally:
                reader.close()
            assert engine.statistics().peak_held_bytes <= cfg.memory_limit

    async def main():
        async with open_engine(source, cfg) as engine:
            async with trio.open_nursery() as nursery:
                for number in range(8):
                    nursery.start_soon(client, engine, number)
                for _ in range(20):
                    if rng.random() < 0.5:
                        source.fail(times=rng.randrange(1, 4), short=rng.random() < 0.5)
                    await trio.sleep(0.01)
            source.heal()
            # A stripe that failed for good keeps failing for a while (min(retry_timeout, 10 s)):
            # let the last ones be forgotten before checking that everything reads right.
            await trio.sleep(engine.failure_memory)
            for name, data in contents.items():
                assert await engine.open(name, len(data)).read(0, len(data)) == data
            assert engine.statistics().peak_held_bytes <= cfg.memory_limit

    run(main)


class CorruptionReports(FaultySource):
    """A real source that records the corruption reports :meth:`Engine.corrupt` gives it."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.reports: list[tuple[str, int, int, str]] = []

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        self.reports.append((path, offset, length, version))
        super().corrupt(path, offset, length, version)


def test_corrupt_tells_the_source_and_refetches_only_the_stripes_it_names(tmp_path, files) -> None:
    """Bytes a caller found corrupt: the source hears of it (a store proxy sets itself aside there), and the
    buffered stripes the range touches are dropped, so the next read fetches those again and no others."""
    source = CorruptionReports(LocalSource(str(tmp_path)))
    data = files["b.bin"]

    async def main():
        async with open_engine(source, config()) as engine:
            await engine.prefetch("b.bin", len(data), 0, len(data))  # every stripe fetched and buffered
            before = Counter(r.offset for r in source.reads)
            engine.corrupt("b.bin", STRIPE + 10, STRIPE, "")  # touches stripes 1 and 2
            assert source.reports == [("b.bin", STRIPE + 10, STRIPE, "")]
            assert engine.statistics().discards == 2
            assert await engine.open("b.bin", len(data)).read(0, len(data)) == data
            again = Counter(r.offset for r in source.reads) - before
            assert sorted(again) == [STRIPE, 2 * STRIPE]

    try:
        run(main)
    finally:
        source.close()
