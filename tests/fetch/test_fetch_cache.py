"""The verified on-disk stripe cache, alone, shared by processes, and under the engine."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import prometheus_client
import pytest
import trio

from bootseer.fetch.file_cache import StripeCache, VerifiedFileCache
from bootseer.fetch.engine import EngineConfig, open_engine
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.sources.local import LocalSource

STRIPE = 64 * 1024
HEADER = 48  # bytes before the payload in an entry file


def key(index: int, mtime: float = 1.0) -> str:
    return StripeCache.key("file:///data", "ckpt/model.bin", 10 * STRIPE, "", mtime, index, STRIPE)


def payload(index: int) -> bytes:
    return random.Random(index).randbytes(STRIPE)


def test_round_trip_and_miss(tmp_path):
    cache = StripeCache(str(tmp_path / "cache"), 10 * STRIPE)
    assert cache.get(key(0)) is None
    cache.put(key(0), payload(0))
    assert cache.get(key(0)) == payload(0)
    assert cache.get(key(1)) is None
    # A fresh instance (another process, a restart) finds the entry.
    assert StripeCache(str(tmp_path / "cache"), 10 * STRIPE).get(key(0)) == payload(0)


def test_keys_separate_every_part_of_a_stripes_identity():
    base = ("file:///data", "a", 100, "etag:1", 1.5, 0, STRIPE)
    keys = {StripeCache.key(*base)}
    # Every part but the mtime, which a version makes redundant.
    for position, other in [(0, "file:///other"), (1, "b"), (2, 101), (3, "etag:2"), (5, 1), (6, 2 * STRIPE)]:
        changed = list(base)
        changed[position] = other
        keys.add(StripeCache.key(*changed))
    assert len(keys) == 7
    assert StripeCache.key(*base[:4], 2.5, *base[5:]) == StripeCache.key(*base)
    # Without a version the mtime keys the entry, and never collides with a version.
    unversioned = ("file:///data", "a", 100, "", 1.5, 0, STRIPE)
    assert StripeCache.key(*unversioned) != StripeCache.key(*unversioned[:4], 1.6, *unversioned[5:])
    assert StripeCache.key(*unversioned) not in keys
    assert StripeCache.key(*unversioned) != StripeCache.key("file:///data", "a", 100, "1.5", 1.5, 0, STRIPE)


@pytest.mark.parametrize(
    "damage",
    ["flip a payload byte", "truncate the payload", "truncate the header", "append garbage", "swap in another entry",
     "bad length field"],
)  # fmt: skip
def test_a_damaged_entry_is_discarded_never_served(tmp_path, damage):
    cache = StripeCache(str(tmp_path), 10 * STRIPE)
    cache.put(key(0), payload(0))
    cache.put(key(1), payload(1))
    entry = Path(cache.path_of(key(0)))
    raw = bytearray(entry.read_bytes())
    if damage == "flip a payload byte":
        raw[HEADER + 1234] ^= 0x01
    elif damage == "truncate the payload":
        raw = raw[:-1]
    elif damage == "truncate the header":
        raw = raw[:20]
    elif damage == "append garbage":
        raw += b"x"
    elif damage == "swap in another entry":
        raw = bytearray(Path(cache.path_of(key(1))).read_bytes())
    elif damage == "bad length field":
        raw[8:16] = (1 << 60).to_bytes(8, "little")
    entry.write_bytes(bytes(raw))
    assert cache.get(key(0)) is None
    assert not entry.exists()  # deleted, so the next fetch stores a good one
    assert cache.get(key(1)) == payload(1)


def test_least_recently_used_entries_are_evicted(tmp_path):
    entry_size = HEADER + STRIPE
    cache = StripeCache(str(tmp_path), 4 * entry_size)
    for index in range(4):
        cache.put(key(index), payload(index))
        past = time.time() - 100 + index  # distinct recency without sleeping
        os.utime(cache.path_of(key(index)), (past, past))
    assert cache.get(key(0)) == payload(0)  # now the most recently used
    cache.put(key(4), payload(4))
    present = [index for index in range(5) if os.path.exists(cache.path_of(key(index)))]
    assert 0 in present and 4 in present and 1 not in present
    total = sum(os.path.getsize(cache.path_of(key(i))) for i in present)
    assert total <= 4 * entry_size


def test_dead_writers_temporary_files_are_cleaned(tmp_path):
    cache = StripeCache(str(tmp_path), 10 * STRIPE)
    cache.put(key(0), payload(0))
    subdir = Path(cache.path_of(key(0))).parent
    stale, fresh = subdir / ".tmp-dead.1.1", subdir / ".tmp-live.2.2"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    StripeCache(str(tmp_path), 10 * STRIPE)  # a scan, as at start-up
    assert not stale.exists() and fresh.exists()


def test_processes_sharing_a_cache_never_see_a_bad_entry(tmp_path):
    """Writers, readers and evictions race in four processes; every hit must be exact."""
    script = textwrap.dedent(
        f"""
        import random, sys
        from bootseer.fetch.file_cache import StripeCache
        cache = StripeCache({str(tmp_path)!r}, 6 * ({HEADER} + {STRIPE}))
        seed = int(sys.argv[1])
        rng = random.Random(seed)
        payloads = [random.Random(i).randbytes({STRIPE}) for i in range(12)]
        keys = [StripeCache.key("file:///data", "f", 1, "v1", 1.0, i, {STRIPE}) for i in range(12)]
        hits = 0
        for _ in range(400):
            i = rng.randrange(12)
            got = cache.get(keys[i])
            if got is None:
                cache.put(keys[i], payloads[i])
            elif got != payloads[i]:
                sys.exit(f"wrong bytes for entry {{i}}")
            else:
                hits += 1
        print(hits)
        """
    )
    workers = [
        subprocess.Popen([sys.executable, "-c", script, str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for seed in range(4)
    ]
    try:
        results = [worker.communicate(timeout=120) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    for worker, (out, err) in zip(workers, results):
        assert worker.returncode == 0, err.decode()
        assert int(out) > 0
    assert b"corrupt" not in b"".join(err for _, err in results)


# -- under the engine ----------------------------------------------------------------------


def read_all(source, config: EngineConfig, path: str, size: int) -> tuple[bytes, object]:
    async def main():
        with trio.fail_after(30):
            async with open_engine(source, config) as engine:
                entry = await engine.stat(path)
                reader = engine.open(path, entry.size, entry.mtime, entry.version)
                data = await reader.read(0, size)
                return data, engine.statistics()

    return trio.run(main)


def test_engine_fills_the_cache_then_reads_from_it_and_refetches_a_corrupt_stripe(tmp_path):
    root, cache_dir = tmp_path / "data", tmp_path / "cache"
    root.mkdir()
    data = random.Random(7).randbytes(10 * STRIPE + 99)
    (root / "model.bin").write_bytes(data)
    source = FaultySource(LocalSource(str(root)))
    config = EngineConfig(stripe_size=STRIPE, streams=4, memory_limit=32 * STRIPE, cache_dir=str(cache_dir))

    got, stats = read_all(source, config, "model.bin", len(data))
    assert got == data and stats.stripes_fetched == 11 and stats.cache_hits == 0
    entries = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert len(entries) == 11

    # A new engine (a restart) reads everything from the cache.
    fetched_before = source.bytes_read()
    got, stats = read_all(source, config, "model.bin", len(data))
    assert got == data and stats.cache_hits == 11 and source.bytes_read() == fetched_before

    # A corrupted entry is discarded and its stripe fetched again; nothing wrong is served.
    victim = max(entries, key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[HEADER + 10] ^= 0xFF
    victim.write_bytes(bytes(raw))
    got, stats = read_all(source, config, "model.bin", len(data))
    assert got == data and stats.cache_hits == 10 and stats.stripes_fetched == 1
    assert source.bytes_read() == fetched_before + STRIPE


def test_a_rewritten_file_is_not_served_from_the_cache(tmp_path):
    root, cache_dir = tmp_path / "data", tmp_path / "cache"
    root.mkdir()
    path = root / "model.bin"
    old = random.Random(1).randbytes(3 * STRIPE)
    path.write_bytes(old)
    config = EngineConfig(stripe_size=STRIPE, streams=2, memory_limit=8 * STRIPE, cache_dir=str(cache_dir))
    source = LocalSource(str(root))
    assert read_all(source, config, "model.bin", len(old))[0] == old
    new = random.Random(2).randbytes(3 * STRIPE)  # same size, new bytes and mtime
    path.write_bytes(new)
    stamp = path.stat().st_mtime + 5
    os.utime(path, (stamp, stamp))
    got, stats = read_all(LocalSource(str(root)), config, "model.bin", len(new))
    assert got == new and stats.cache_hits == 0


def test_a_same_size_same_second_rewrite_is_not_served_from_the_cache(tmp_path):
    """The version (inode, mtime in ns and size for local files) keys the cache, not the
    mtime: a file replaced by one of the same size and the very same mtime is a miss."""
    root, cache_dir = tmp_path / "data", tmp_path / "cache"
    root.mkdir()
    path = root / "model.bin"
    old = random.Random(1).randbytes(3 * STRIPE)
    path.write_bytes(old)
    stamp = int(path.stat().st_mtime)
    os.utime(path, ns=(stamp * 10**9, stamp * 10**9))
    config = EngineConfig(stripe_size=STRIPE, streams=2, memory_limit=8 * STRIPE, cache_dir=str(cache_dir))
    assert read_all(LocalSource(str(root)), config, "model.bin", len(old))[0] == old
    new = random.Random(2).randbytes(3 * STRIPE)
    path.with_name("model.tmp").write_bytes(new)
    os.replace(path.with_name("model.tmp"), path)  # a new inode, the way checkpoints are written
    os.utime(path, ns=(stamp * 10**9, stamp * 10**9))  # the same mtime, to the nanosecond
    entry = LocalSource(str(root)).stat("model.bin")
    assert entry.mtime == stamp and entry.size == len(old) and entry.version
    got, stats = read_all(LocalSource(str(root)), config, "model.bin", len(new))
    assert got == new and stats.cache_hits == 0


# -- the shared verified cache: keys, checks of its own, metrics --------------------------------------


def test_keys_are_checked_because_they_become_file_names(tmp_path):
    cache = StripeCache(str(tmp_path / "cache"), 10 * STRIPE)
    for bad in ["../../etc/passwd", "ABCDEF0123456789", "0123", "x" * 32, "", "a" * 129, None]:
        with pytest.raises(ValueError, match="hex digits"):
            cache.get(bad)
        with pytest.raises(ValueError, match="hex digits"):
            cache.put(bad, b"data")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


class _EvenOnly(VerifiedFileCache):
    """A cache with a check of its own: payloads of even length only."""

    MAGIC = b"TESTEVEN"
    kind = "test-even"

    def verify(self, key: str, payload: bytes) -> str | None:
        return None if len(payload) % 2 == 0 else "odd length"


def test_a_subclass_check_discards_an_entry_and_every_event_is_counted_under_its_label(tmp_path):
    registry = prometheus_client.REGISTRY

    def sample(name: str) -> float:
        return registry.get_sample_value(name, {"cache": "test-even"}) or 0.0

    names = ["hits", "misses", "corrupt", "evictions"]
    before = {name: sample(f"bootseer_fetch_cache_{name}_total") for name in names}
    cache = _EvenOnly(str(tmp_path), 4 * (HEADER + 100))
    good, odd = "a" * 32, "b" * 32
    cache.put(good, bytes(100))
    cache.put(odd, bytes(99))
    assert cache.contains(odd) and not cache.contains("c" * 32)  # present, not verified
    assert cache.get(good) == bytes(100)
    assert cache.get(odd) is None  # passes the checksum, fails the subclass: deleted
    assert not os.path.exists(cache.path_of(odd)) and not cache.contains(odd)
    assert cache.get("c" * 32) is None
    for n in range(8):  # more than fits: the oldest go
        cache.put(f"{n:032x}", bytes(100))
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (1, 1, 1) and stats.evictions > 0
    assert stats.bytes <= cache.max_bytes == stats.max_bytes
    after = {name: sample(f"bootseer_fetch_cache_{name}_total") for name in names}
    assert {name: after[name] - before[name] for name in names} == {
        "hits": 1, "misses": 1, "corrupt": 1, "evictions": stats.evictions}  # fmt: skip
    # Entries of another kind of cache in the same directory are never taken for its own.
    stripes = StripeCache(str(tmp_path), 4 * (HEADER + 100))
    survivor = next(f"{n:032x}" for n in range(8) if os.path.exists(cache.path_of(f"{n:032x}")))
    assert stripes.get(survivor) is None
