"""Stores behind one interface: writers (file, S3 on moto, HDFS URL handling) and the engine-backed reader.

The reader is exercised over a local directory, nginx in front of that directory
(read-only http://, as a CDN or Dragonfly peer would serve it) and moto's S3; tampered,
misplaced and missing objects give FormatError or None, a store that fails FetchError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import functools

import trio
import trio.testing

from bootseer.blockstore.convert.converter import convert_image
from bootseer.blockstore.objects.format import ChainRecord, FormatError, LayerIndex, chain_object, index_object
from bootseer.blockstore.objects.store import (
    FileStoreWriter,
    HdfsStoreWriter,
    ReadOnlyStore,
    S3StoreWriter,
    StoreError,
    StoreReader,
    open_store,
    open_store_writer,
)
from bootseer.fetch.engine import EngineConfig, open_engine
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.sources import open_source
from bootseer.images.registry import open_image
from tests.support.mounts import force_unmount
from tests.support.s3 import ACCESS_KEY, REGION, SECRET_KEY
from tests.support import layers as L
from tests.support.oci import SHARED_BLOCKS, build_oci_layout, chain_ids

QUICK = EngineConfig(retry_timeout=2.0)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    base = L.Layer((L.File("etc/hosts", b"127.0.0.1 localhost\n"), L.Symlink("abs", "/etc/hosts"), L.File("big", SHARED_BLOCKS),
                    L.BigFile("large.bin", 12 << 20, seed=3)))  # a pack over boto3's 8 MiB multipart threshold
    top = L.Layer((L.Whiteout("etc/hosts"), L.File("app/again", SHARED_BLOCKS + b"!")))
    return build_oci_layout(tmp_path_factory.mktemp("img") / "layout", [base, top])


def convert_into(writer, image) -> list:
    with open_image(image.ref) as source:
        return convert_image(source, writer).layers


async def read_all(url: str, chains: list[str], **options) -> list:
    """(record, index) of each chain through a StoreReader on a fresh engine."""
    out = []
    async with open_store(url, QUICK, **options) as store:
        for chain in chains:
            record = await store.chain(chain)
            out.append((record, await store.index(record)))
    return out


# -- the file store -----------------------------------------------------------------------------


def test_file_writer_puts_atomically_and_lists(tmp_path):
    writer = FileStoreWriter(tmp_path / "store")
    assert writer.get("v1/chains/x.json") is None and writer.size("v1/chains/x.json") is None
    writer.put("v1/chains/x.json", b"one")
    writer.put("v1/chains/x.json", b"two")  # replaced whole
    source = tmp_path / "pack"
    source.write_bytes(b"p" * 10_000)
    writer.put("v1/packs/p", source)
    assert writer.get("v1/chains/x.json") == b"two" and writer.size("v1/packs/p") == 10_000
    assert writer.list("v1/chains") == ["v1/chains/x.json"] and writer.list("v1/nothing") == []
    assert sorted(os.listdir(tmp_path / "store" / "v1" / "chains")) == ["x.json"]  # no temp file left
    assert (writer.puts, writer.put_bytes) == (3, 10_006)
    for bad in ("../escape", "/abs", "a//b", ""):
        with pytest.raises(ValueError):
            writer.put(bad, b"x")
    assert not (tmp_path / "escape").exists()


def race_put_if_absent(open_writer, name: str, writers: int = 16) -> list[bool]:
    """``writers`` threads, each with its own writer, call ``put_if_absent(name, <its own bytes>)`` at once."""
    results = [False] * writers
    barrier = threading.Barrier(writers)

    def publish(n: int) -> None:
        with open_writer() as writer:
            barrier.wait()
            results[n] = writer.put_if_absent(name, f"writer {n}".encode() * 1000)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_file_put_if_absent_first_writer_wins_a_race(tmp_path):
    name = "v1/hotlists/" + "a" * 64 + "/default"
    results = race_put_if_absent(lambda: FileStoreWriter(tmp_path / "store"), name)
    assert sum(results) == 1
    writer = FileStoreWriter(tmp_path / "store")
    assert writer.get(name) == f"writer {results.index(True)}".encode() * 1000  # the winner's bytes, whole
    assert os.listdir(writer.path(name).parent) == ["default"]  # no temp file left by any writer
    assert not writer.put_if_absent(name, b"late") and writer.get(name).startswith(b"writer ")
    assert (writer.puts, writer.put_bytes) == (0, 0)  # a lost race stores nothing
    assert writer.put_if_absent("v1/other", b"x") and (writer.puts, writer.put_bytes) == (1, 1)
    assert writer.remove(name) and not writer.remove(name) and not writer.exists(name)
    with pytest.raises(ValueError):
        writer.put_if_absent("../escape", b"x")
    (tmp_path / "store" / "v1" / "file").write_bytes(b"a file where a directory must be")
    with pytest.raises(StoreError, match="write v1/file/x"):
        writer.put_if_absent("v1/file/x", b"data")


def store_tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``, dot-named temp files included: path -> "dir", or the file's sha256."""
    tree = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        tree[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return tree


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 256 KiB tmpfs: a put of more than that fails half-way with ENOSPC, as a full store disk does."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mountpoint)], check=True, capture_output=True)
    try:
        yield mountpoint
    finally:
        force_unmount(mountpoint)


#: Each way a file-store put fails: (what is broken, the put that fails, the error it names).
FILE_WRITER_FAILURES = {
    # The object's directory cannot be made: no temp file was ever created.
    "parent is a file": ("v1/packs/p", "bytes", "put", "write v1/packs/p"),
    # The temp file is written whole, then the rename onto the name fails (a directory is there).
    "target is a directory": ("v1/chains/dir.json", "bytes", "put", "write v1/chains/dir.json"),
    # The source of a file put cannot be read: the temp file was opened first.
    "source unreadable": ("v1/packs/q", "directory", "put", "write v1/packs/q"),
    # The disk fills half-way through the temp file (bytes, a file copied, first-writer-wins).
    "disk full, bytes": ("v1/packs/big", "bytes", "put", "write v1/packs/big: No space left"),
    "disk full, file": ("v1/packs/big", "file", "put", "write v1/packs/big: No space left"),
    "disk full, put_if_absent": ("v1/hotlists/big", "bytes", "put_if_absent", "write v1/hotlists/big: No space left"),
}


@pytest.mark.parametrize("failure", FILE_WRITER_FAILURES)
def test_file_writer_failure_leaves_nothing(tmp_path, tiny_filesystem, failure):
    """A put that fails raises a StoreError naming the object and leaves the store's tree as
    it was: no object, no temp file, the objects already there unchanged."""
    name, data_kind, method, message = FILE_WRITER_FAILURES[failure]
    root = tiny_filesystem / "store" if failure.startswith("disk full") else tmp_path / "store"
    writer = FileStoreWriter(root)
    writer.put("v1/chains/old.json", b"an object already there")
    if failure == "parent is a file":
        (root / "v1" / "packs").write_bytes(b"a file where a directory must be")
    else:  # the object's directory is there already: what a failure must not leave is a file
        (root / name).parent.mkdir(parents=True, exist_ok=True)
    if failure == "target is a directory":
        (root / "v1" / "chains" / "dir.json" / "inside").mkdir(parents=True)
    if data_kind == "bytes":
        data = os.urandom(1 << 20)
    elif data_kind == "file":  # on another filesystem than the store: copied, not linked
        data = tmp_path / "spooled-pack"
        data.write_bytes(os.urandom(1 << 20))
    else:
        data = tmp_path / "a-directory"
        data.mkdir()
    before = store_tree(root)
    with pytest.raises(StoreError, match=message):
        getattr(writer, method)(name, data)
    assert store_tree(root) == before
    assert writer.get("v1/chains/old.json") == b"an object already there"
    assert (writer.puts, writer.put_bytes) == (1, 23)  # the failed put counts nothing


@pytest.mark.parametrize(
    "url, error, message",
    [
        ("", ValueError, "empty"),
        ("ftp://host/store", ValueError, "unsupported store URL"),
        ("file://otherhost/store", ValueError, "file:///absolute/path"),
        ("http://cdn.example/store", ReadOnlyStore, "read-only"),
        ("https://user:secret@cdn.example/store", ReadOnlyStore, "read-only"),
        ("s3://", ValueError, "s3://bucket"),
        ("s3://bucket/a/../b", Exception, "'..'"),
        ("hdfs://", ValueError, "hdfs://namenode"),
        ("hdfs://nn:notaport/x", ValueError, "bad port"),
        ("hdfs://nn/a/../b", Exception, "'..'"),
    ],
)
def test_writer_urls(url, error, message):
    with pytest.raises(error) as caught:
        open_store_writer(url)
    assert message in str(caught.value)
    assert "secret" not in str(caught.value)


def test_file_urls_and_paths(tmp_path):
    assert isinstance(open_store_writer(str(tmp_path / "a")), FileStoreWriter)
    writer = open_store_writer(f"file://{tmp_path}/b%20c")
    assert isinstance(writer, FileStoreWriter) and writer.root == tmp_path / "b c"


def test_hdfs_writer_against_a_namenode_that_is_not_there():
    """No HDFS server can run here: the real client fails cleanly on a closed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    writer = open_store_writer(f"hdfs://127.0.0.1:{port}/store", max_failovers=0)
    assert isinstance(writer, HdfsStoreWriter)
    assert writer.source.hdfs_path("v1/packs/x") == "/store/v1/packs/x"
    with pytest.raises(StoreError, match=f"stat: hdfs://127.0.0.1:{port}/store/v1/chains/c"):
        writer.size("v1/chains/c")
    with pytest.raises(StoreError, match="write"):
        writer.put("v1/chains/c", b"x")


# -- the reader over a local store -----------------------------------------------------------


@pytest.fixture
def local_store(image, tmp_path):
    store = tmp_path / "store"
    convert_into(FileStoreWriter(store), image)
    return store


def test_reader_reads_what_was_converted(image, local_store):
    chains = chain_ids(image.diff_ids)
    results = trio.run(read_all, str(local_store), chains)
    for number, (record, index) in enumerate(results):
        assert record.chain_id == chains[number] and record.parent == (chains[number - 1] if number else "")
        assert index.diff_id == image.diff_ids[number]
    assert any(e.path == "abs" and e.target == "/etc/hosts" for e in results[0][1].entries)


def test_reader_missing_chain_is_none(local_store):
    async def main():
        async with open_store(str(local_store), QUICK) as store:
            return await store.chain("sha256:" + "0" * 64)

    assert trio.run(main) is None


def _tamper(path: Path, change) -> None:
    path.write_bytes(change(path.read_bytes()))


@pytest.mark.parametrize(
    "case",
    ["record-field", "record-elsewhere", "record-garbage", "index-byte", "index-missing", "index-other-layer", "record-huge"],
)
def test_reader_refuses_tampered_objects(case, image, local_store):
    chains = chain_ids(image.diff_ids)
    record_path = local_store / chain_object(chains[1])
    record = ChainRecord.decode(record_path.read_bytes())
    index_path = local_store / index_object(record.index)
    if case == "record-field":
        _tamper(record_path, lambda d: d.replace(record.diff_id.encode(), ("sha256:" + "1" * 64).encode()))
    elif case == "record-elsewhere":  # a valid record of another layer stored under this chain
        record_path.write_bytes((local_store / chain_object(chains[0])).read_bytes())
    elif case == "record-garbage":
        record_path.write_bytes(b"{not json")
    elif case == "index-byte":
        _tamper(index_path, lambda d: d[:-10] + bytes([d[-10] ^ 1]) + d[-9:])
    elif case == "index-missing":
        index_path.unlink()
    elif case == "index-other-layer":  # the record names the other layer's (valid) index
        other = ChainRecord.decode((local_store / chain_object(chains[0])).read_bytes())
        document = json.loads(record_path.read_bytes())
        document["index"] = other.index
        record_path.write_text(json.dumps(document))
    elif case == "record-huge":
        record_path.write_bytes(b" " * (2 << 20))

    async def main():
        async with open_store(str(local_store), QUICK) as store:
            found = await store.chain(chains[1])
            await store.index(found)

    with pytest.raises(FormatError):
        trio.run(main)


def test_reader_store_failure_is_fetch_error(tmp_path):
    """A store that does not answer: FetchError after the engine's retry timeout (autojump clock)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with open_store(f"http://127.0.0.1:{port}/store/", EngineConfig(retry_timeout=1.0)) as store:
            await store.chain("sha256:" + "2" * 64)

    with pytest.raises(FetchError):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- http(s): nginx in front of the store directory ----------------------------------------------


def test_reader_over_nginx(image, local_store, nginx_factory):
    server = nginx_factory(local_store)
    chains = chain_ids(image.diff_ids)
    over_http = trio.run(read_all, server.url, chains)
    local = trio.run(read_all, str(local_store), chains)
    assert over_http == local

    async def missing():
        async with open_store(server.url, QUICK) as store:
            return await store.chain("sha256:" + "3" * 64)

    assert trio.run(missing) is None


# -- S3 (moto) ---------------------------------------------------------------------------------


def test_s3_convert_read_and_idempotency(image, s3_bucket, local_store):
    url = s3_bucket.url("stores/main")
    writer = open_store_writer(url, **s3_bucket.options)
    assert isinstance(writer, S3StoreWriter)
    first = convert_into(writer, image)
    assert writer.puts > 0 and not any(layer.skipped for layer in first)
    keys = sorted(item["Key"] for item in s3_bucket.s3.client().list_objects_v2(Bucket=s3_bucket.name)["Contents"])
    local_keys = sorted("stores/main/" + str(p.relative_to(local_store)) for p in local_store.rglob("*") if p.is_file())
    assert keys == local_keys  # the same objects, under the prefix
    again = open_store_writer(url, **s3_bucket.options)
    assert all(layer.skipped for layer in convert_into(again, image)) and again.puts == 0
    chains = chain_ids(image.diff_ids)
    from_s3 = trio.run(functools.partial(read_all, url, chains, **s3_bucket.options))
    local = trio.run(read_all, str(local_store), chains)
    assert [index for _, index in from_s3] == [index for _, index in local]
    assert [dataclasses.replace(r, converted_at="") for r, _ in from_s3] == [dataclasses.replace(r, converted_at="") for r, _ in local]


def test_s3_endpoint_and_credentials_from_the_environment(image, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    writer = open_store_writer(s3_bucket.url("env"))
    writer.put("v1/chains/probe.json", b"{}")
    assert writer.get("v1/chains/probe.json") == b"{}" and writer.list("v1/chains") == ["v1/chains/probe.json"]
    assert writer.get("v1/chains/none.json") is None and writer.size("v1/none") is None


def test_s3_put_if_absent_first_writer_wins_a_race(s3_bucket):
    """``If-None-Match: *`` on moto's S3: of 8 writers at once, exactly one stores its object."""
    name = "v1/deps/" + "b" * 64 + ".json"
    results = race_put_if_absent(lambda: open_store_writer(s3_bucket.url("race"), **s3_bucket.options), name, writers=8)
    assert sum(results) == 1
    with open_store_writer(s3_bucket.url("race"), **s3_bucket.options) as writer:
        assert writer.get(name) == f"writer {results.index(True)}".encode() * 1000
        assert not writer.put_if_absent(name, b"late")
        assert writer.remove(name) and not writer.remove(name) and writer.put_if_absent(name, b"again")
        assert writer.get(name) == b"again"


def test_s3_put_if_absent_without_conditional_writes_checks_then_puts(s3_bucket):
    """A server that answers a conditional PUT with 501 NotImplemented (older S3-compatible
    stores) gets a HEAD, then a plain PUT: a name that exists still wins.  The 501 is
    answered at the HTTP boundary (botocore's before-send hook) for requests with
    If-None-Match; everything else reaches moto."""
    from botocore.awsrequest import AWSResponse

    class Body:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def stream(self, **_):
            yield self.data

    conditional_puts = []

    def not_implemented(request, **_):
        if "If-None-Match" in request.headers:
            conditional_puts.append(request.url)
            body = b"<Error><Code>NotImplemented</Code><Message>conditional writes</Message></Error>"
            return AWSResponse(request.url, 501, {"Content-Type": "application/xml"}, Body(body))
        return None

    with open_store_writer(s3_bucket.url("old"), **s3_bucket.options) as writer:
        writer.client.meta.events.register("before-send.s3.PutObject", not_implemented)
        assert writer.put_if_absent("v1/x", b"first")
        assert not writer.put_if_absent("v1/x", b"second")
        assert writer.get("v1/x") == b"first" and len(conditional_puts) == 2
        assert (writer.puts, writer.put_bytes) == (1, 5)


def test_s3_errors_name_the_object_but_never_the_secret(s3_bucket):
    options = dict(s3_bucket.options, secret_access_key="secret-value-never-shown")
    missing = open_store_writer("s3://no-such-bucket-here/x", **options)
    for call in (lambda: missing.put("v1/chains/c.json", b"x"), lambda: missing.get("v1/chains/c.json"),
                 lambda: missing.list("v1/dedup")):  # fmt: skip
        with pytest.raises(StoreError) as caught:
            call()
        assert "s3://no-such-bucket-here/x/v1/" in str(caught.value)
        assert "secret-value-never-shown" not in str(caught.value) and ACCESS_KEY not in str(caught.value)


def test_store_reader_over_an_engine_you_made(local_store, image):
    """StoreReader takes any running Engine rooted at the store (the layer server passes its own)."""

    async def main():
        source = open_source(str(local_store))
        async with open_engine(source, QUICK) as engine:
            reader = StoreReader(engine)
            return await reader.chain(chain_ids(image.diff_ids)[0])

    assert trio.run(main).diff_id == image.diff_ids[0]


def test_index_and_bytes_gives_the_stores_object_as_it_is(local_store, image):
    """What a node keeps as its local copy: the index object's own bytes, named by their SHA-256."""

    async def main():
        async with open_store(str(local_store), QUICK) as store:
            record = await store.chain(chain_ids(image.diff_ids)[0])
            return record, await store.index_and_bytes(record), await store.index(record)

    record, (index, data), again = trio.run(main)
    assert data == (local_store / index_object(record.index)).read_bytes()
    assert hashlib.sha256(data).hexdigest() == record.index and index == again == LayerIndex.decode(data)


def test_index_is_decoded_in_a_worker_thread_under_the_given_limiter(local_store, image, monkeypatch):
    """A large index takes seconds to decode: that must not stall the trio thread (the
    layer server's FUSE requests for every layer), so it runs in a worker thread and
    holds a token of the limiter the caller passes."""
    limiter = trio.CapacityLimiter(1)
    seen: list[tuple[int, int]] = []
    real_decode = LayerIndex.decode.__func__

    def recording_decode(cls, data, **kwargs):
        tokens = trio.from_thread.run_sync(lambda: limiter.borrowed_tokens)  # fails on the trio thread itself
        seen.append((threading.get_ident(), tokens))
        return real_decode(cls, data, **kwargs)

    monkeypatch.setattr(LayerIndex, "decode", classmethod(recording_decode))

    async def main():
        source = open_source(str(local_store))
        async with open_engine(source, QUICK) as engine:
            reader = StoreReader(engine, threads=limiter)
            record = await reader.chain(chain_ids(image.diff_ids)[0])
            return threading.get_ident(), await reader.index(record)

    trio_thread, index = trio.run(main)
    assert index.diff_id == image.diff_ids[0]
    assert len(seen) == 1
    decoder_thread, tokens = seen[0]
    assert decoder_thread != trio_thread
    assert tokens == 1


class LocalHdfsClient:
    """hdfs-native's ``Client`` calls the writer makes, over a local directory (no HDFS can run here).

    Same semantics where the writer depends on them: ``get_file_info``/``read`` of a
    missing path raise FileNotFoundError, ``create`` fails if the path exists,
    ``rename(overwrite=True)`` replaces atomically, ``rename(overwrite=False)`` fails
    if the target exists, ``list_status`` yields statuses with
    ``path``/``isdir``/``length``.  ``fail_writes`` makes every write fail half-way.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fail_writes = False

    def _local(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def get_file_info(self, path: str):
        st = self._local(path).stat()  # FileNotFoundError as hdfs-native raises it
        return type("FileStatus", (), {"path": path, "isdir": self._local(path).is_dir(), "length": st.st_size})()

    def mkdirs(self, path: str, permission: int = 0o755, create_parent: bool = False) -> None:
        self._local(path).mkdir(parents=create_parent, exist_ok=True)

    def create(self, path: str):
        client, handle = self, open(self._local(path), "xb")

        class Writer:
            def write(self, data: bytes) -> int:
                if client.fail_writes:
                    handle.write(data[: len(data) // 2])
                    raise RuntimeError("DataStreamer: pipeline to datanode failed")
                return handle.write(data)

            def close(self) -> None:
                handle.close()

        return Writer()

    def rename(self, src: str, dst: str, overwrite: bool = False) -> None:
        if overwrite:
            os.replace(self._local(src), self._local(dst))
        else:  # the namenode refuses a rename onto an existing name
            try:
                os.link(self._local(src), self._local(dst))
            except FileExistsError:
                raise RuntimeError(f"FileAlreadyExistsException: {dst}") from None
            os.unlink(self._local(src))

    def delete(self, path: str, recursive: bool = False) -> bool:
        self._local(path).unlink()
        return True

    def read(self, path: str):
        data = self._local(path).read_bytes()
        return type("FileReader", (), {"read": lambda self: data, "size": lambda self: len(data),
                                       "read_range": lambda self, offset, length: data[offset : offset + length],
                                       "close": lambda self: None})()  # fmt: skip

    def list_status(self, path: str, recursive: bool = False):
        for child in sorted(self._local(path).iterdir()):
            yield type("FileStatus", (), {"path": f"{path}/{child.name}", "isdir": child.is_dir(), "length": 0})()


def test_hdfs_writer_puts_through_a_temp_name(tmp_path):
    writer = open_store_writer("hdfs://namenode:8020/stores/main", max_failovers=0)
    writer.client = client = LocalHdfsClient(tmp_path)
    assert writer.get("v1/chains/c.json") is None and writer.size("v1/chains/c.json") is None
    writer.put("v1/chains/c.json", b"record")
    source = tmp_path / "pack"
    source.write_bytes(b"p" * 20_000)
    writer.put("v1/packs/p", source)
    assert writer.get("v1/chains/c.json") == b"record" and writer.size("v1/packs/p") == 20_000
    assert writer.list("v1/chains") == ["v1/chains/c.json"] and writer.list("v1/none") == []
    assert sorted(os.listdir(tmp_path / "stores" / "main" / "v1" / "chains")) == ["c.json"]
    client.fail_writes = True
    with pytest.raises(StoreError, match="write: hdfs://namenode:8020/stores/main/v1/chains/c.json: .*pipeline"):
        writer.put("v1/chains/c.json", b"other record")
    assert writer.get("v1/chains/c.json") == b"record"  # the old object, whole
    assert sorted(os.listdir(tmp_path / "stores" / "main" / "v1" / "chains")) == ["c.json"]  # the temp file is gone


def test_hdfs_put_if_absent_renames_without_overwrite(tmp_path):
    writer = open_store_writer("hdfs://namenode:8020/stores/main", max_failovers=0)
    writer.client = client = LocalHdfsClient(tmp_path)
    directory = tmp_path / "stores" / "main" / "v1" / "hotlists"
    assert writer.put_if_absent("v1/hotlists/default", b"first")
    assert not writer.put_if_absent("v1/hotlists/default", b"second")
    assert writer.get("v1/hotlists/default") == b"first"
    assert os.listdir(directory) == ["default"]  # the loser's temp file is gone
    assert (writer.puts, writer.put_bytes) == (1, 5)
    client.fail_writes = True
    with pytest.raises(StoreError, match="write: hdfs://namenode:8020/stores/main/v1/hotlists/other: .*pipeline"):
        writer.put_if_absent("v1/hotlists/other", b"data")
    assert os.listdir(directory) == ["default"]
    assert writer.remove("v1/hotlists/default") and not writer.remove("v1/hotlists/default")


def test_writers_read_byte_ranges(tmp_path, s3_bucket):
    """``get_range`` (what the converter checks blocks of other packs with) on the file, S3 and HDFS writers."""
    data = bytes(range(256)) * 40
    hdfs = open_store_writer("hdfs://namenode:8020/stores/main", max_failovers=0)
    hdfs.client = LocalHdfsClient(tmp_path / "hdfs")
    for writer in (FileStoreWriter(tmp_path / "store"), open_store_writer(s3_bucket.url("ranges"), **s3_bucket.options), hdfs):
        writer.put("v1/packs/p", data)
        assert writer.get_range("v1/packs/p", 1000, 300) == data[1000:1300]
        assert writer.get_range("v1/packs/p", len(data) - 10, 300) == data[-10:]  # fewer where the object ends
        assert writer.get_range("v1/packs/p", len(data) + 5, 10) == b""
        assert writer.get_range("v1/packs/p", 0, 0) == b""
        assert writer.get_range("v1/packs/none", 0, 10) is None
        with pytest.raises(ValueError):
            writer.get_range("v1/packs/p", -1, 10)
        writer.close()
