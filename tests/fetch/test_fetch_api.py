"""The synchronous Python API: Client, file objects, read_bytes, over real local files."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import struct
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import bootseer.fetch
from bootseer.fetch import Client, EngineConfig
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.source import NotFound
from bootseer.fetch.sources.local import LocalSource
from tests.support.http import RangeHTTPServer, SilentRangeHandler, range_gets

STRIPE = 64 * 1024
SMALL = EngineConfig(stripe_size=STRIPE, streams=4, memory_limit=16 * STRIPE, readahead_max=8 * STRIPE)


@pytest.fixture
def data(tmp_path: Path) -> bytes:
    content = random.Random(3).randbytes(40 * STRIPE + 17)
    (tmp_path / "blob.bin").write_bytes(content)
    return content


@pytest.fixture
def client(tmp_path: Path):
    with Client(str(tmp_path), SMALL) as client:
        yield client


def test_read_bytes_returns_the_whole_file_as_bytes(tmp_path, data):
    got = bootseer.fetch.read_bytes(str(tmp_path / "blob.bin"), config=SMALL)
    assert type(got) is bytes and got == data
    (tmp_path / "empty").write_bytes(b"")
    assert bootseer.fetch.read_bytes(f"file://{tmp_path}/empty") == b""
    # The memory bound holds for a file 2.5 times its size.
    with Client(str(tmp_path), SMALL) as client:
        assert client.read_bytes("blob.bin") == data
        assert client._call_sync(lambda: client.engine.statistics().peak_held_bytes) <= SMALL.memory_limit


def test_file_object_reads_seeks_and_reads_into(tmp_path, data):
    with bootseer.fetch.open(str(tmp_path / "blob.bin"), config=SMALL) as file:
        assert isinstance(file, io.BufferedIOBase)
        assert file.readable() and file.seekable() and not file.writable()
        assert file.read(10) == data[:10] and file.tell() == 10
        assert file.read1(5) == data[10:15]
        assert file.peek(3)[:3] == data[15:18] and file.tell() == 15
        assert file.seek(-100, io.SEEK_END) == len(data) - 100
        assert file.read() == data[-100:] and file.read(5) == b""
        file.seek(STRIPE - 3)
        assert file.seek(6, io.SEEK_CUR) == STRIPE + 3
        buffer = bytearray(3 * STRIPE)
        assert file.readinto(buffer) == len(buffer) and buffer == data[STRIPE + 3 : 4 * STRIPE + 3]
        floats = np.empty(1000, dtype=np.float64)  # a typed buffer, as torch's reader passes
        file.seek(8)
        assert file.readinto(floats) == 8000 and floats.tobytes() == data[8:8008]
        file.seek(len(data) + 10)
        assert file.read(10) == b"" and file.readinto(bytearray(4)) == 0
        with pytest.raises(OSError):
            file.seek(-1)
        client = file._client
    assert file.closed and client._closed and not client._thread.is_alive()
    with pytest.raises(ValueError):
        file.read(1)


def test_random_reads_through_the_file_object_are_exact(tmp_path, data):
    rng = random.Random(11)
    with bootseer.fetch.open(str(tmp_path / "blob.bin"), config=SMALL) as file:
        for _ in range(300):
            offset = rng.randrange(len(data) + 10)
            size = rng.choice([1, 7, 1000, rng.randrange(1, 5 * STRIPE)])
            file.seek(offset)
            assert file.read(size) == data[offset : offset + size]


def test_zip_and_pickle_readers_work_on_it(tmp_path):
    """torch.load reads a zip archive through seek/read/readinto; older checkpoints are pickles."""
    arrays = {f"layer{n}": np.random.default_rng(n).standard_normal(30_000 + n) for n in range(6)}
    with zipfile.ZipFile(tmp_path / "ckpt.zip", "w") as archive:
        for name, array in arrays.items():
            archive.writestr(f"ckpt/data/{name}", array.tobytes())
    (tmp_path / "state.pkl").write_bytes(pickle.dumps({"arrays": arrays, "step": 1234, "text": "x" * 100_000}))

    with bootseer.fetch.open(str(tmp_path / "ckpt.zip"), config=SMALL) as file, zipfile.ZipFile(file) as archive:
        for name, array in arrays.items():
            with archive.open(f"ckpt/data/{name}") as member:
                assert np.array_equal(np.frombuffer(member.read(), dtype=np.float64), array)
    with bootseer.fetch.open(str(tmp_path / "state.pkl"), config=SMALL) as file:
        state = pickle.load(file)
    assert state["step"] == 1234 and len(state["text"]) == 100_000
    assert all(np.array_equal(state["arrays"][name], array) for name, array in arrays.items())


def test_a_safetensors_file_parses_from_read_bytes(tmp_path):
    """The safetensors layout: an 8-byte header length, a JSON header, then raw tensor bytes."""
    tensors = {"w": np.arange(100_000, dtype=np.float32), "b": np.ones(33, dtype=np.float32)}
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        blobs.append(array.tobytes())
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))

    raw = bootseer.fetch.read_bytes(str(tmp_path / "model.safetensors"), config=SMALL)
    assert type(raw) is bytes  # safetensors.torch.load accepts bytes only
    (length,) = struct.unpack("<Q", raw[:8])
    parsed = json.loads(raw[8 : 8 + length])
    for name, array in tensors.items():
        start, end = parsed[name]["data_offsets"]
        assert np.array_equal(np.frombuffer(raw[8 + length + start : 8 + length + end], dtype=np.float32), array)


def test_client_stat_listdir_and_errors(client, tmp_path, data):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x").write_bytes(b"xyz")
    entry = client.stat("blob.bin")
    assert entry.size == len(data) and not entry.is_dir
    assert sorted(e.name for e in client.listdir("")) == ["blob.bin", "sub"]
    assert [e.name for e in client.listdir("sub")] == ["x"]
    assert client.open("sub/x").read() == b"xyz"
    with pytest.raises(NotFound):
        client.open("missing")
    with pytest.raises(IsADirectoryError):
        client.open("sub")
    with pytest.raises(IsADirectoryError):
        client.read_bytes("sub")


def test_many_threads_share_one_client(client, tmp_path, data):
    others = {f"f{n}": random.Random(n).randbytes(3 * STRIPE + n) for n in range(6)}
    for name, content in others.items():
        (tmp_path / name).write_bytes(content)
    failures = []

    def work(name, content):
        try:
            assert client.read_bytes(name) == content
            with client.open("blob.bin") as file:
                file.seek(len(name) * 1000)
                assert file.read(2 * STRIPE) == data[len(name) * 1000 : len(name) * 1000 + 2 * STRIPE]
        except BaseException as exc:  # reported below, from the test's own thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=item) for item in others.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures and not any(thread.is_alive() for thread in threads)


def test_fetch_errors_reach_the_caller_as_eio(tmp_path, data):
    source = FaultySource(LocalSource(str(tmp_path)))
    config = EngineConfig(stripe_size=STRIPE, streams=2, memory_limit=8 * STRIPE, retry_timeout=0.5)
    with Client(source, config) as client:
        file = client.open("blob.bin")
        source.fail(path="blob.bin")
        with pytest.raises(FetchError) as caught:
            client.read_bytes("blob.bin")
        assert caught.value.errno == errno.EIO
        with pytest.raises(OSError):
            file.read(100)
        source.heal()
        time.sleep(config.retry_timeout)  # a failed stripe fails at once for min(retry_timeout, 10 s)
        assert file.read(100) == data[:100]
    source.close()


def test_client_misuse_is_refused_clearly(tmp_path, data):
    with pytest.raises(ValueError, match="unknown option"):
        Client(str(tmp_path), bogus=1)
    with pytest.raises(ValueError, match="need a URL"):
        Client(LocalSource(str(tmp_path)), max_open_files=3)
    with pytest.raises(ValueError, match="unsupported source URL"):
        bootseer.fetch.read_bytes("gopher://host/x")
    client = Client(str(tmp_path), SMALL)
    client.close()
    client.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        client.read_bytes("blob.bin")


# -- over HTTP -----------------------------------------------------------------------------


def test_open_and_read_bytes_over_http_from_nginx(tmp_path, data, nginx_factory):
    server = nginx_factory(tmp_path)
    url = server.url + "blob.bin"
    assert bootseer.fetch.read_bytes(url, config=SMALL) == data
    with bootseer.fetch.open(url, config=SMALL) as file:
        file.seek(STRIPE - 5)
        assert file.read(3 * STRIPE) == data[STRIPE - 5 : 4 * STRIPE - 5]
    with Client(server.url, SMALL) as client:
        assert "blob.bin" in [entry.name for entry in client.listdir("")]
        assert client.read_bytes("blob.bin") == data


def test_dropped_connections_and_server_errors_are_retried_over_http(tmp_path, data, range_http_factory):
    server = range_http_factory(tmp_path)
    with Client(server.url, SMALL) as client:
        server.faults.drop(times=3, after_bytes=1000)  # cut off mid-body
        server.faults.status(503, times=2)
        assert client.read_bytes("blob.bin") == data
        stats = client._call_sync(lambda: client.engine.statistics())
        assert stats.retries >= 1 and stats.failures == 0


# -- versions: a file rewritten at the source ----------------------------------------------


def test_a_file_rewritten_at_the_same_size_is_never_read_mixed(tmp_path):
    """The review's reproducer: a stripe of the old version in memory must not serve a
    whole-file read that a new stat started; and a handle of the old version gets its
    old bytes or EIO, never some of each."""
    MiB = 1 << 20
    path = tmp_path / "f"
    path.write_bytes(b"A" * 3 * MiB)
    config = EngineConfig(stripe_size=MiB, streams=2, memory_limit=8 * MiB, retry_timeout=3600)
    with Client(str(tmp_path), config) as client:
        old_file = client.open("f")
        old_file.seek(MiB + MiB // 2)
        assert old_file.read(10) == b"A" * 10  # stripe 1 of the old version is in memory now
        before = path.stat()
        with open(path, "r+b") as rewrite:  # in place: the same inode and size
            rewrite.write(b"B" * 3 * MiB)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))  # a coarse clock may not move
        assert client.read_bytes("f") == b"B" * 3 * MiB
        with client.open("f") as new_file:
            assert new_file.read() == b"B" * 3 * MiB
        old_file.seek(0)
        try:
            whole = old_file.read()
        except OSError as exc:
            assert exc.errno == errno.EIO and "changed" in str(exc)
        else:
            assert whole == b"A" * 3 * MiB
        stats = client._call_sync(lambda: client.engine.statistics())
        assert stats.retries == 0  # a changed file is never retried
        old_file.close()


# -- a source that accepts and never answers ---------------------------------------------



@pytest.fixture
def silent_server(tmp_path: Path, data):
    server = RangeHTTPServer(tmp_path, SilentRangeHandler)
    server.release = threading.Event()
    server.start()
    yield server
    server.release.set()
    server.stop()




def test_a_silent_source_fails_a_read_after_the_retry_timeout_not_the_read_timeout(silent_server, data):
    retry_timeout = 2.0
    config = EngineConfig(stripe_size=STRIPE, streams=2, memory_limit=8 * STRIPE, retry_timeout=retry_timeout)
    with Client(silent_server.url, config, read_timeout=60) as client:
        started = time.monotonic()
        with pytest.raises(FetchError) as caught:
            client.read_bytes("blob.bin")
        elapsed = time.monotonic() - started
        assert caught.value.errno == errno.EIO and "no answer" in str(caught.value)
        # Behaviour, not speed: EIO comes from the retry clock, long before the 60 s read timeout.
        assert elapsed < retry_timeout + 10
        assert range_gets(silent_server) >= 1


def test_closing_a_client_does_not_wait_for_a_hung_read(silent_server, data):
    config = EngineConfig(stripe_size=STRIPE, streams=2, memory_limit=8 * STRIPE, retry_timeout=60)
    client = Client(silent_server.url, config, read_timeout=60)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            client.read_bytes("blob.bin")
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        deadline = time.monotonic() + 20
        while range_gets(silent_server) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert range_gets(silent_server) >= 1, "the read never reached the server"
        closer = threading.Thread(target=client.close, daemon=True)
        started = time.monotonic()
        closer.start()
        closer.join(timeout=20)
        assert not closer.is_alive(), "Client.close() waited on the hung read"
        assert time.monotonic() - started < 20
        reader.join(timeout=10)
        assert not reader.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], FetchError) and "stopped" in str(outcome[0])
    finally:
        silent_server.release.set()
        client.close()
