"""Digest lists: their format, ``write_digests``, and reads verified against them, over real local files and moto's S3.

A wrong byte is made two ways: storage itself holding it (the file changed in place after its list was
written, and the list re-stamped with the file's new version, so that only the digests can tell) and a
source that answers one range wrong (:class:`~bootseer.fetch.faults.FaultySource`'s ``garble``).
"""

from __future__ import annotations

import errno
import hashlib
import random
import re
import struct
from pathlib import Path

import pytest

import bootseer.fetch
from bootseer.fetch import Client, EngineConfig
from bootseer.fetch.digests import (
    MAX_LIST_BYTES, SUFFIX, DigestList, DigestListError, build, load, sibling_url,
)  # fmt: skip
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.source import NotFound, PermanentError
from bootseer.fetch.sources.local import LocalSource
from bootseer.fetch.stripes import FetchError
from tests.support.digests import corrupt_in_place

CHUNK = 64 * 1024  # the smallest chunk a list may have
STRIPE = 2 * CHUNK
CONFIG = EngineConfig(stripe_size=STRIPE, streams=4, memory_limit=32 * STRIPE, readahead_max=8 * STRIPE)


def _content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _chunk_digests(data: bytes, chunk: int = CHUNK) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(data[at:at + chunk]).digest() for at in range(0, len(data), chunk))


def _statistics(client: Client):
    return client._call_sync(client.engine.statistics)


@pytest.fixture
def data(tmp_path: Path) -> bytes:
    content = _content(1, 20 * CHUNK + 123)
    (tmp_path / "model.pt").write_bytes(content)
    return content


# -- the format ------------------------------------------------------------------------------


def test_a_list_round_trips_through_its_encoding() -> None:
    data = _content(2, 3 * CHUNK + 5)
    digests = DigestList(len(data), '"etag-1"', CHUNK, _chunk_digests(data))
    encoded = digests.encode()
    assert len(encoded) == 8 + 2 + 1 + 1 + 8 + 2 + len('"etag-1"') + 8 + 4 * 32  # compact: nothing else
    decoded = DigestList.decode(encoded)
    assert decoded == digests and hash(decoded) == hash(digests)
    assert (decoded.size, decoded.version, decoded.chunk_size, decoded.digests) == (
        len(data), '"etag-1"', CHUNK, _chunk_digests(data)
    )
    assert DigestList.decode(DigestList(0, "", CHUNK, ()).encode()).digests == ()  # an empty file: no chunks


def _malformed() -> list[tuple[bytes, str]]:
    good = DigestList(3 * CHUNK, "v", CHUNK, _chunk_digests(_content(3, 3 * CHUNK))).encode()
    head = struct.Struct(">8sHBBQH")
    magic, fmt, log2, reserved, size, vlen = head.unpack_from(good)
    rest = good[head.size:]

    def with_head(**changes) -> bytes:
        fields = dict(magic=magic, fmt=fmt, log2=log2, reserved=reserved, size=size, vlen=vlen) | changes
        return head.pack(*fields.values()) + rest

    return [
        (b"", "truncated"),
        (good[:20], "truncated"),
        (b"NOTALIST" + good[8:], "bad magic"),
        (with_head(fmt=2), "format 2"),
        (with_head(reserved=1), "reserved byte"),
        (with_head(log2=15), "chunk size 2**15 is out of bounds"),
        (with_head(log2=27), "chunk size 2**27 is out of bounds"),
        (with_head(size=4 * CHUNK), "3 chunks for 262144 bytes"),  # the count no longer fits the size
        (with_head(vlen=2000), "version of 2000 bytes"),
        (good + b"\0", "want exactly"),
        (good[:-1], "want exactly"),
        (good[:head.size] + b"\xff" + good[head.size + 1:], "not UTF-8"),
    ]


@pytest.mark.parametrize("encoded, message", _malformed())
def test_malformed_lists_are_refused_naming_what_is_wrong(encoded: bytes, message: str) -> None:
    with pytest.raises(DigestListError, match=re.escape(message)):
        DigestList.decode(encoded, where="ckpt/model.pt.bootseer-digests")


def test_a_count_that_claims_more_chunks_than_the_list_holds_allocates_nothing() -> None:
    # A huge size and count with no digests behind them: refused by arithmetic, before any list is built.
    huge = DigestList(CHUNK, "", CHUNK, (b"\0" * 32,)).encode()
    head = struct.Struct(">8sHBBQH")
    fields = list(head.unpack_from(huge))
    fields[4] = (1 << 62)  # the file size
    count = (1 << 62) // CHUNK
    forged = head.pack(*fields) + struct.pack(">Q", count) + b"\0" * 32
    with pytest.raises(DigestListError, match="want exactly"):
        DigestList.decode(forged)


def test_oversized_lists_are_refused_before_they_are_read(tmp_path: Path) -> None:
    with pytest.raises(DigestListError, match="more than a digest list may hold"):
        DigestList.decode(b"\0" * (MAX_LIST_BYTES + 1))
    big = tmp_path / ("model.pt" + SUFFIX)
    with open(big, "wb") as file:
        file.truncate(MAX_LIST_BYTES + 1)  # sparse: stat says it is too large, nothing is read
    source = FaultySource(LocalSource(str(tmp_path)))
    with pytest.raises(DigestListError, match="more than a digest list may hold"):
        load(source, big.name)
    assert source.reads == []


@pytest.mark.parametrize("chunk_size", [0, 1000, CHUNK // 2, 3 * CHUNK, 1 << 27])
def test_chunk_sizes_must_be_bounded_powers_of_two(chunk_size: int) -> None:
    with pytest.raises(DigestListError, match="power of two"):
        DigestList(0, "", chunk_size, ())


def test_sibling_urls_add_the_suffix_to_the_path_only() -> None:
    assert sibling_url("/ckpt/model.pt") == "/ckpt/model.pt" + SUFFIX
    assert sibling_url("s3://bucket/ckpt/model.pt") == "s3://bucket/ckpt/model.pt" + SUFFIX
    assert sibling_url("https://host/ckpt/model.pt?X-Amz-Signature=abc") is None  # a signed URL names one object
    assert sibling_url("https://host/ckpt/") is None


# -- writing lists ---------------------------------------------------------------------------------


def test_write_digests_writes_a_list_beside_the_file_that_round_trips(tmp_path: Path, data: bytes) -> None:
    written = bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    stored = DigestList.decode((tmp_path / ("model.pt" + SUFFIX)).read_bytes())
    assert stored == written
    assert stored.size == len(data) and stored.chunk_size == CHUNK
    assert stored.version == LocalSource(str(tmp_path)).stat("model.pt").version
    assert stored.digests == _chunk_digests(data)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # written atomically


def test_write_digests_refuses_sources_it_cannot_write_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot write to HttpSource"):
        bootseer.fetch.write_digests("http://127.0.0.1:9/ckpt/model.pt")
    with pytest.raises(ValueError, match="no name beside it"):
        bootseer.fetch.write_digests("http://127.0.0.1:9/ckpt/model.pt?token=1")
    with pytest.raises(NotFound):
        bootseer.fetch.write_digests(str(tmp_path / "missing.pt"))
    assert not (tmp_path / ("missing.pt" + SUFFIX)).exists()


def test_build_fails_on_a_file_that_ends_early() -> None:
    source = iter([b"x" * 10])

    def read_into(view: memoryview) -> int:
        piece = next(source, b"")
        view[:len(piece)] = piece
        return len(piece)

    with pytest.raises(OSError, match="ended at 10 bytes"):
        build(read_into, 100, "", CHUNK)


# -- verified reads --------------------------------------------------------------------------------


def test_reads_with_a_list_are_verified_and_counted(tmp_path: Path, data: bytes) -> None:
    bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    with Client(str(tmp_path), CONFIG) as client:
        assert client.read_bytes("model.pt") == data
        with client.open("model.pt") as file:
            file.seek(7 * CHUNK + 3)
            assert file.read(5000) == data[7 * CHUNK + 3 : 7 * CHUNK + 5003]
        stats = _statistics(client)
    assert stats.digest_lists_used == 2 and stats.digest_lists_ignored == 0
    assert stats.chunks_verified >= 21 and stats.chunks_failed == 0
    # The URL of one file finds the list beside it too.
    assert bootseer.fetch.read_bytes(str(tmp_path / "model.pt"), config=CONFIG) == data


def test_a_wrong_byte_in_storage_fails_the_read_with_eio_never_wrong_bytes(tmp_path: Path, data: bytes) -> None:
    bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    bad = 9 * CHUNK + 100  # in stripe 4
    corrupt_in_place(tmp_path / "model.pt", bad)
    with Client(str(tmp_path), CONFIG) as client:
        with pytest.raises(FetchError, match="does not match the file's digest list") as caught:
            client.read_bytes("model.pt")
        assert caught.value.errno == errno.EIO
        with client.open("model.pt") as file:
            file.seek(bad - 10)
            with pytest.raises(OSError) as caught:
                file.read(20)
            assert caught.value.errno == errno.EIO
            file.seek(0)  # stripes the wrong byte is not in are served, verified
            assert file.read(4 * STRIPE) == data[: 4 * STRIPE]
        stats = _statistics(client)
    # Fetched again once, on a fresh connection, then failed: two answers, both refused.
    assert stats.chunks_failed == 2 and stats.failures == 1
    with pytest.raises(OSError) as caught:
        bootseer.fetch.read_bytes(str(tmp_path / "model.pt"), config=CONFIG)
    assert caught.value.errno == errno.EIO


def test_a_list_of_another_version_is_ignored_and_the_new_file_reads_right(tmp_path: Path, data: bytes) -> None:
    bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    new = _content(9, len(data))  # rewritten at the same size: a new version
    (tmp_path / "model.pt").write_bytes(new)
    with Client(str(tmp_path), CONFIG) as client:
        assert client.read_bytes("model.pt") == new
        stats = _statistics(client)
    assert stats.digest_lists_ignored == 1 and stats.digest_lists_used == 0 and stats.chunks_verified == 0


def test_malformed_and_unusable_lists_are_ignored_and_the_file_reads(tmp_path: Path, data: bytes) -> None:
    listed = tmp_path / ("model.pt" + SUFFIX)
    listed.write_bytes(b"BSDIGEST garbage")
    with Client(str(tmp_path), CONFIG) as client:
        assert client.read_bytes("model.pt") == data
        assert _statistics(client).digest_lists_ignored == 1
    # A chunk larger than the stripe cannot be verified stripe by stripe: not used, said so.
    bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=4 * CHUNK, config=CONFIG)
    with Client(str(tmp_path), CONFIG) as client:
        assert client.read_bytes("model.pt") == data
        assert _statistics(client).digest_lists_ignored == 1
    with Client(str(tmp_path), CONFIG) as client:
        entry = client.stat("model.pt")
        with pytest.raises(ValueError, match="does not divide the stripe size"):
            client._call_sync(client.engine.open, "model.pt", entry.size, entry.mtime, entry.version,
                              DigestList.decode(listed.read_bytes()))  # fmt: skip


def test_a_source_that_answers_a_range_wrong_once_is_asked_again_and_served_right(tmp_path: Path, data: bytes) -> None:
    bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    source = FaultySource(LocalSource(str(tmp_path)))
    with Client(source, CONFIG) as client:
        source.fail(path="model.pt", times=1, garble=True)
        assert client.read_bytes("model.pt") == data
        stats = _statistics(client)
    garbled = [read for read in source.reads if read.outcome == "garbled"]
    assert len(garbled) == 1
    again = [read for read in source.reads if read.path == "model.pt" and read.offset == garbled[0].offset
             and read.outcome == "ok"]  # fmt: skip
    assert len(again) == 1 and again[0].connection != garbled[0].connection  # on another connection
    assert garbled[0].connection in source.closed
    assert stats.chunks_failed == 1 and stats.retries == 1 and stats.failures == 0
    source.close()


def test_a_source_that_keeps_answering_wrong_fails_after_one_more_try(tmp_path: Path, data: bytes) -> None:
    bootseer.fetch.write_digests(str(tmp_path / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    source = FaultySource(LocalSource(str(tmp_path)))
    with Client(source, CONFIG) as client:
        with client.open("model.pt") as file:
            source.fail(path="model.pt", garble=True)
            with pytest.raises(OSError) as caught:
                file.read(100)
            assert caught.value.errno == errno.EIO
        stats = _statistics(client)
    first = [read for read in source.reads if read.path == "model.pt" and read.offset == 0]
    assert [read.outcome for read in first] == ["garbled", "garbled"]  # two answers, no third
    assert first[0].connection != first[1].connection
    assert stats.failures >= 1
    source.close()


def test_a_wrong_stripe_in_the_disk_cache_is_dropped_and_fetched_from_the_source(tmp_path: Path, data: bytes) -> None:
    root = tmp_path / "src"
    root.mkdir()
    (root / "model.pt").write_bytes(data)
    cache = EngineConfig(**{**CONFIG.__dict__, "cache_dir": str(tmp_path / "cache"), "cache_size": 64 * STRIPE})
    source = FaultySource(LocalSource(str(root)))
    with Client(source, cache, digests=False) as client:  # fills the cache with one wrong stripe
        source.fail(path="model.pt", times=1, garble=True)
        unverified = client.read_bytes("model.pt")
    (garbled,) = [read for read in source.reads if read.outcome == "garbled"]
    assert unverified[garbled.offset] != data[garbled.offset]  # served and cached, without a list
    bootseer.fetch.write_digests(str(root / "model.pt"), chunk_size=CHUNK, config=CONFIG)
    with Client(source, cache) as client:
        assert client.read_bytes("model.pt") == data
        stats = _statistics(client)
    assert stats.chunks_failed == 1 and stats.cache_hits == len(range(0, len(data), STRIPE)) - 1
    assert stats.failures == 0 and stats.stripes_fetched == 1
    source.close()


# -- S3 ------------------------------------------------------------------------------------------


def test_lists_are_written_to_s3_beside_the_object_and_verify_its_reads(s3_bucket) -> None:
    data = _content(5, 5 * CHUNK + 1)
    s3_bucket.put("ckpt/model.pt", data)
    url = s3_bucket.url("ckpt/model.pt")
    written = bootseer.fetch.write_digests(url, chunk_size=CHUNK, config=CONFIG, **s3_bucket.options)
    assert written.version.startswith('"') and written.digests == _chunk_digests(data)  # the object's ETag
    stored = s3_bucket.s3.client().get_object(Bucket=s3_bucket.name, Key="ckpt/model.pt" + SUFFIX)["Body"].read()
    assert DigestList.decode(stored) == written
    with Client(s3_bucket.url("ckpt"), CONFIG, **s3_bucket.options) as client:
        assert client.read_bytes("model.pt") == data
        assert _statistics(client).digest_lists_used == 1
    # A new object under the name: a new ETag, the old list ignored, the new bytes read.
    s3_bucket.put("ckpt/model.pt", data[::-1])
    with Client(url, CONFIG, **s3_bucket.options) as client:
        assert client.read_bytes("") == data[::-1]
        assert _statistics(client).digest_lists_ignored == 1


def test_paths_that_leave_the_root_are_refused_for_writes_too(tmp_path: Path) -> None:
    with pytest.raises(PermanentError):
        LocalSource(str(tmp_path)).put("../outside" + SUFFIX, b"x")
    assert not (tmp_path.parent / ("outside" + SUFFIX)).exists()
