"""The storage backends against real servers: local files, nginx, a Python HTTP
server with injected faults, a WebHDFS namenode/datanode pair and moto's S3.

Every backend is checked against the same local tree: listings, byte-exact range
reads at random offsets and at the end-of-file edges, NotFound/NotADirectory,
refusal of paths that try to leave the root, file versions (a listing and a stat
agree; a file rewritten since refuses reads of the old version) and messages
that never show credentials.  Backend-specific tests cover symlink escapes, a 200
answer to a Range request, dropped connections, servers that announce huge
bodies, malformed listings, WebHDFS redirects and unreachable servers.
"""

from __future__ import annotations

import email.utils
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bootseer.fetch.source import (
    Changed,
    Entry,
    NotADirectory,
    NotFound,
    PermanentError,
    RangeSource,
    SourceError,
    TransientError,
)
from bootseer.fetch.sources import open_source, source_class
from bootseer.fetch.sources.hdfs import HdfsSource, hdfs_error
from bootseer.fetch.sources.http import HttpSource, index_links, parse_json_index
from bootseer.fetch.sources.local import LocalSource
from bootseer.fetch.sources.s3 import S3Source
from bootseer.fetch.sources.webhdfs import WebHdfsSource, remote_error
from tests.support.waiting import wait_until
from tests.support.http import Faults, content_etag
from tests.support.webhdfs import WebHdfsServer

pytestmark = pytest.mark.timeout(120)

SPARSE_SIZE = 5 * 2**30 + 12345  # over 4 GiB: offsets past 32 bits
ODD_NAME = "odd name %+&;#.txt"  # needs quoting in URLs


def closed_port() -> int:
    """A 127.0.0.1 port with nothing listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A checkpoint-like tree: nested dirs, empty file, empty dir, big sparse file."""
    root = tmp_path / "tree"
    rng = random.Random(1234)
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "emptydir").mkdir()
    (root / "a.bin").write_bytes(rng.randbytes(2**20 + 123))
    (root / "empty").write_bytes(b"")
    (root / "nested" / "b.bin").write_bytes(rng.randbytes(70000))
    (root / "nested" / "deeper" / "c.txt").write_bytes(b"hello, checkpoint\n")
    (root / ODD_NAME).write_bytes(b"odd")
    with open(root / "sparse.bin", "wb") as sparse:
        sparse.truncate(SPARSE_SIZE)
        for offset in (0, 2**32 - 100, SPARSE_SIZE - 4096):
            sparse.seek(offset)
            sparse.write(rng.randbytes(4096))
    return root


@dataclass
class Backend:
    name: str
    source: RangeSource
    root: Path  #: the local tree the source serves
    absent: set[str] = field(default_factory=set)  #: local paths the source cannot hold
    server: object = None

    def expected_listing(self, path: str) -> list[tuple[str, bool, int]]:
        directory = self.root / path
        rows = []
        for child in sorted(directory.iterdir(), key=lambda p: p.name):
            relative = child.relative_to(self.root).as_posix()
            if relative not in self.absent:
                rows.append((child.name, child.is_dir(), 0 if child.is_dir() else child.stat().st_size))
        return rows

    def expected_bytes(self, path: str, offset: int, length: int) -> bytes:
        with open(self.root / path, "rb") as file:
            return os.pread(file.fileno(), length, offset)


BACKENDS = ["local", "nginx-json", "nginx-html", "python-http", "webhdfs", "s3"]


@pytest.fixture(params=BACKENDS)
def backend(request, tree: Path) -> Backend:
    kind = request.param
    if kind == "local":
        made = Backend(kind, open_source(str(tree)), tree)
    elif kind.startswith("nginx"):
        server = request.getfixturevalue("nginx_factory")(tree, autoindex_format=kind.split("-")[1])
        made = Backend(kind, open_source(server.url), tree, server=server)
    elif kind == "python-http":
        server = request.getfixturevalue("range_http_factory")(tree)
        made = Backend(kind, open_source(server.url), tree, server=server)
    elif kind == "webhdfs":
        server = request.getfixturevalue("webhdfs_factory")(tree)
        made = Backend(kind, open_source(server.url, user="tester"), tree, server=server)
    else:
        bucket = request.getfixturevalue("s3_bucket")
        # moto keeps objects in memory: no 5 GiB file; S3 has no empty directories
        # except through a marker object.
        (tree / "sparse.bin").unlink()
        bucket.upload_tree(tree, prefix="ckpt")
        bucket.put("ckpt/emptydir/", b"")
        made = Backend(kind, open_source(bucket.url("ckpt"), **bucket.options), tree, server=bucket)
    yield made
    made.source.close()


# -- every backend ---------------------------------------------------------------------


def listing(entries: list[Entry]) -> list[tuple[str, bool, int]]:
    return [(entry.name, entry.is_dir, entry.size) for entry in entries]


def test_stat_and_listdir_match_the_tree(backend: Backend) -> None:
    source = backend.source
    root = source.stat("")
    assert root.is_dir and root.name == ""
    for directory in ("", "nested", "nested/deeper", "emptydir"):
        assert listing(source.listdir(directory)) == backend.expected_listing(directory)
    assert source.stat("nested").is_dir
    entry = source.stat("a.bin")
    assert (entry.name, entry.is_dir, entry.size) == ("a.bin", False, 2**20 + 123)
    assert entry.mtime == pytest.approx((backend.root / "a.bin").stat().st_mtime, abs=2) or entry.mtime == 0.0
    assert source.stat("empty").size == 0
    assert source.stat(ODD_NAME).size == 3
    assert source.stat("nested/deeper/c.txt").size == len(b"hello, checkpoint\n")


def test_random_range_reads_are_byte_exact(backend: Backend) -> None:
    source = backend.source
    rng = random.Random(99)
    files = ["a.bin", "nested/b.bin", "nested/deeper/c.txt", ODD_NAME]
    if "sparse.bin" in os.listdir(backend.root):
        files.append("sparse.bin")
    connection = source.connect()
    try:
        for path in files:
            size = source.stat(path).size
            cases = [(0, 1), (0, size), (size - 1, 1), (size - 1, 10), (size, 5), (size + 100, 5), (0, size + 10)]
            cases = [(o, n) for o, n in cases if n <= 1 << 20]
            for _ in range(15):
                offset = rng.randrange(size)
                cases.append((offset, rng.randrange(1, 256 * 1024)))
            if path == "sparse.bin":
                cases += [(2**32 - 200, 4096), (SPARSE_SIZE - 5000, 10000), (2**31, 4096)]
            for offset, length in cases:
                got = connection.read_range(path, offset, length)
                assert got == backend.expected_bytes(path, offset, length), (path, offset, length)
    finally:
        connection.close()


def test_empty_file_and_zero_length_reads(backend: Backend) -> None:
    connection = backend.source.connect()
    try:
        assert connection.read_range("empty", 0, 100) == b""
        assert connection.read_range("a.bin", 10, 0) == b""
        with pytest.raises(ValueError):
            connection.read_range("a.bin", -1, 10)
    finally:
        connection.close()


def test_missing_paths_and_files_as_directories(backend: Backend) -> None:
    source = backend.source
    with pytest.raises(NotFound):
        source.stat("no-such-file")
    with pytest.raises(NotFound):
        source.stat("nested/no-such-file")
    with pytest.raises(NotFound):
        source.listdir("no-such-dir")
    with pytest.raises(NotADirectory):
        source.listdir("a.bin")
    connection = source.connect()
    try:
        with pytest.raises(NotFound):
            connection.read_range("no-such-file", 0, 10)
    finally:
        connection.close()


@pytest.mark.parametrize("path", ["../outside", "nested/../../outside", "/etc/passwd", "nested//b.bin", "./a.bin", "a.bin/", "a\0b"])
def test_paths_that_leave_the_root_are_refused(backend: Backend, path: str) -> None:
    source = backend.source
    with pytest.raises(PermanentError, match="refused"):
        source.stat(path)
    with pytest.raises(PermanentError, match="refused"):
        source.listdir(path)
    connection = source.connect()
    try:
        with pytest.raises(PermanentError, match="refused"):
            connection.read_range(path, 0, 10)
    finally:
        connection.close()


def test_source_rooted_at_one_file(backend: Backend) -> None:
    url = backend.source.url.rstrip("/") + "/nested/b.bin"
    options = {"s3": getattr(backend.server, "options", {}), "webhdfs": {"user": "tester"}}.get(backend.name, {})
    source = open_source(url, **options)
    try:
        entry = source.stat("")
        assert (entry.is_dir, entry.size) == (False, 70000)
        connection = source.connect()
        assert connection.read_range("", 69990, 100) == backend.expected_bytes("nested/b.bin", 69990, 100)
        connection.close()
    finally:
        source.close()


def test_stripes_read_over_many_connections_assemble_the_file(backend: Backend) -> None:
    import concurrent.futures

    source = backend.source
    size = source.stat("a.bin").size
    stripes = [(offset, min(65536, size - offset)) for offset in range(0, size, 65536)]
    connections = [source.connect() for _ in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(connections[index % 4].read_range, "a.bin", offset, length)
                for index, (offset, length) in enumerate(stripes)
            ]
            assembled = b"".join(future.result(timeout=60) for future in futures)
    finally:
        for connection in connections:
            connection.close()
    assert assembled == (backend.root / "a.bin").read_bytes()


def test_many_connections_read_in_parallel(range_http_factory, tree: Path) -> None:
    """Four connections of one source, each reading in its own thread: the server holds every GET of the
    file until four are waiting at once, so the test passes only if the reads are in flight together (a
    source that serialised its connections would leave one waiting, and the wait below would time out)."""
    import concurrent.futures

    server = range_http_factory(tree)
    source = open_source(server.url)
    size = source.stat("a.bin").size
    release = server.faults.hold({"/a.bin"})
    connections = [source.connect() for _ in range(4)]
    quarter = size // 4
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(connection.read_range, "a.bin", index * quarter, quarter)
                       for index, connection in enumerate(connections)]  # fmt: skip
            try:
                wait_until("four reads held at the server at once", lambda: server.faults.waiting == 4, 30)
            finally:
                release.set()
            pieces = [future.result(timeout=60) for future in futures]
    finally:
        for connection in connections:
            connection.close()
        source.close()
    assert b"".join(pieces) == (tree / "a.bin").read_bytes()[: 4 * quarter]


def files_of(entries: list[Entry], directory: str) -> dict[str, Entry]:
    return {(f"{directory}/{e.name}" if directory else e.name): e for e in entries if not e.is_dir}


def test_listing_and_stat_give_the_same_version(backend: Backend) -> None:
    source = backend.source
    for directory in ("", "nested", "nested/deeper"):
        for entry in source.listdir(directory):
            path = f"{directory}/{entry.name}" if directory else entry.name
            if entry.is_dir:
                assert entry.version == ""
                continue
            assert entry.version, path
            assert source.stat(path).version == entry.version, path
    # Other files and sizes are other versions.
    versions = {entry.version for entry in files_of(source.listdir(""), "").values()}
    assert len(versions) == len(files_of(source.listdir(""), ""))


def rewrite_same_size(backend: Backend, path: str) -> bytes:
    """Give ``path`` new content of the same size at the source; returns it."""
    old = (backend.root / path).read_bytes()
    new = bytes(255 - byte for byte in old)
    if backend.name == "s3":
        backend.server.put(f"ckpt/{path}", new)
    else:
        (backend.root / path).write_bytes(new)  # in place: same inode
        # HTTP dates and WebHDFS keep coarser times than a rewrite takes.
        later = (backend.root / path).stat().st_mtime + 10
        os.utime(backend.root / path, (later, later))
    return new


def test_same_size_rewrite_after_listing_is_refused(backend: Backend) -> None:
    source = backend.source
    listed = files_of(source.listdir("nested"), "nested")["nested/b.bin"]
    connection = source.connect()
    try:
        expected = (backend.root / "nested" / "b.bin").read_bytes()
        assert connection.read_range("nested/b.bin", 100, 1000, listed.version) == expected[100:1100]
        new = rewrite_same_size(backend, "nested/b.bin")
        with pytest.raises(Changed, match="changed"):
            connection.read_range("nested/b.bin", 100, 1000, listed.version)
        with pytest.raises(Changed):
            source.connect().read_range("nested/b.bin", 0, 10, listed.version)
        # A new listing names the new version, and reads of it succeed.
        relisted = files_of(source.listdir("nested"), "nested")["nested/b.bin"]
        assert relisted.version != listed.version and relisted.size == listed.size
        assert connection.read_range("nested/b.bin", 100, 1000, relisted.version) == new[100:1100]
        # Reading to and past the end of the version is exact, not an error.
        size = relisted.size
        assert connection.read_range("nested/b.bin", size - 10, 100, relisted.version) == new[-10:]
        assert connection.read_range("nested/b.bin", size, 10, relisted.version) == b""
    finally:
        connection.close()


@pytest.mark.parametrize("kind", ["local", "webhdfs"])
def test_a_rewrite_that_keeps_time_and_size_is_refused(tree: Path, webhdfs_factory, kind: str) -> None:
    """Local: a rewrite in place whose mtime is set back (cp -p, rsync -t) still changes the
    ctime.  WebHDFS: a file created again with the same time and length has a new fileId."""
    path = tree / "nested" / "b.bin"
    old = path.read_bytes()
    stamp = path.stat().st_mtime_ns
    source = open_source(str(tree)) if kind == "local" else open_source(webhdfs_factory(tree).url)
    entry = source.stat("nested/b.bin")
    connection = source.connect()
    assert connection.read_range("nested/b.bin", 0, 10, entry.version) == old[:10]
    new = bytes(255 - byte for byte in old)
    if kind == "local":
        with open(path, "r+b") as file:  # in place: the same inode
            file.write(new)
    else:
        (tree / "b.tmp").write_bytes(new)
        os.replace(tree / "b.tmp", path)  # a new file (a new inode: the test namenode's fileId)
    os.utime(path, ns=(stamp, stamp))
    with pytest.raises(Changed, match="changed"):
        source.connect().read_range("nested/b.bin", 0, 10, entry.version)
    assert source.stat("nested/b.bin").version != entry.version


def test_a_version_from_elsewhere_is_refused(backend: Backend) -> None:
    connection = backend.source.connect()
    try:
        with pytest.raises(Changed):
            connection.read_range("a.bin", 0, 10, "lm:1:2" if backend.name == "s3" else '"not-a-version"')
    finally:
        connection.close()


# -- open_source --------------------------------------------------------------------------


def test_open_source_picks_backends_and_checks_options(tmp_path: Path) -> None:
    assert isinstance(open_source(str(tmp_path)), LocalSource)
    assert isinstance(open_source(f"file://{tmp_path}"), LocalSource)
    assert isinstance(open_source("http://127.0.0.1:1/x/"), HttpSource)
    assert isinstance(open_source("webhdfs://127.0.0.1:1/x"), WebHdfsSource)
    assert source_class("s3://bucket/x") is S3Source
    assert source_class("hdfs://nn:8020/x") is HdfsSource
    for cls in (LocalSource, HttpSource, S3Source, HdfsSource, WebHdfsSource):
        assert cls.default_streams >= 1
    with pytest.raises(ValueError, match="gs.*s3://"):
        open_source("gs://bucket/x")
    with pytest.raises(ValueError, match="unknown option.*bogus.*accepted: max_open_files"):
        open_source(str(tmp_path), bogus=1)
    with pytest.raises(ValueError, match="unknown option"):
        open_source("http://127.0.0.1:1/", user="x")
    with pytest.raises(ValueError, match="host"):
        open_source("file://otherhost/x")
    with pytest.raises(ValueError, match="no host"):
        open_source("http:///x")
    with pytest.raises(ValueError, match="together"):
        open_source("s3://bucket/x", access_key_id="only-half")
    with pytest.raises(ValueError, match="empty"):
        open_source("")


# -- local ----------------------------------------------------------------------------------


def test_local_symlinks_inside_are_followed_and_escapes_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    (tmp_path / "secret").write_bytes(b"secret")
    (tmp_path / "secretdir").mkdir()
    (root / "real").write_bytes(b"inside")
    (root / "inner-link").symlink_to("real")
    (root / "dir" / "up-link").symlink_to("../real")
    (root / "escape").symlink_to(tmp_path / "secret")
    (root / "dir" / "escape-rel").symlink_to("../../secret")
    (root / "escape-dir").symlink_to(tmp_path / "secretdir")
    (root / "dangling").symlink_to("nowhere")
    os.mkfifo(root / "fifo")
    source = LocalSource(str(root))
    connection = source.connect()
    try:
        assert connection.read_range("inner-link", 0, 100) == b"inside"
        assert connection.read_range("dir/up-link", 0, 100) == b"inside"
        assert source.stat("inner-link").size == 6
        for path in ("escape", "dir/escape-rel", "escape-dir"):
            with pytest.raises(PermanentError, match="outside the source root"):
                source.stat(path)
            with pytest.raises(PermanentError, match="outside the source root"):
                connection.read_range(path, 0, 10)
        with pytest.raises(PermanentError, match="outside the source root"):
            source.listdir("escape-dir")
        with pytest.raises(NotFound):
            source.stat("dangling")
        with pytest.raises(PermanentError, match="not a regular file"):
            source.stat("fifo")
        with pytest.raises(PermanentError, match="not a regular file"):
            connection.read_range("fifo", 0, 10)  # must not block on the FIFO
        # Refused and broken entries are hidden from listings.
        assert [entry.name for entry in source.listdir("")] == ["dir", "inner-link", "real"]
        assert [entry.name for entry in source.listdir("dir")] == ["up-link"]
    finally:
        connection.close()


def test_local_root_behind_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_bytes(b"abc")
    (tmp_path / "link").symlink_to("data")
    source = open_source(str(tmp_path / "link"))
    assert source.connect().read_range("f", 1, 5) == b"bc"


def test_local_file_changed_since_stat_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"version one")
    source = LocalSource(str(tmp_path))
    connection = source.connect()
    first = source.stat("f").version
    assert connection.read_range("f", 0, 7, first) == b"version"
    path.write_bytes(b"version two, longer")  # same inode, new size and mtime
    with pytest.raises(Changed, match="changed"):
        connection.read_range("f", 0, 7, first)
    (tmp_path / "g").write_bytes(b"replacement")
    os.replace(tmp_path / "g", path)  # a new inode under the same name
    with pytest.raises(Changed, match="changed"):
        source.connect().read_range("f", 0, 7, first)
    # The new version reads, on the connection that held an fd of the old inode too.
    assert connection.read_range("f", 0, 11, source.stat("f").version) == b"replacement"


def test_local_connection_bounds_open_files(tmp_path: Path) -> None:
    for index in range(10):
        (tmp_path / f"f{index}").write_bytes(bytes([index]) * 10)
    source = LocalSource(str(tmp_path), max_open_files=3)
    connection = source.connect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        for index in range(10):
            assert connection.read_range(f"f{index}", 5, 1) == bytes([index])
    assert len(os.listdir("/proc/self/fd")) <= before + 3
    connection.close()
    assert len(os.listdir("/proc/self/fd")) <= before
    with pytest.raises(TransientError, match="closed"):
        connection.read_range("f0", 0, 1)


# -- HTTP -----------------------------------------------------------------------------------


def test_http_200_answer_to_a_range_request_is_refused(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    source = open_source(server.url)
    connection = source.connect()
    server.faults.ignore_range()
    with pytest.raises(PermanentError, match="ignored the Range"):
        connection.read_range("a.bin", 100, 10)
    # The connection is usable again, and the next answer is a proper 206.
    assert connection.read_range("a.bin", 100, 10) == (tree / "a.bin").read_bytes()[100:110]


@pytest.mark.parametrize("honour_if_range", [True, False])
def test_http_version_is_the_strong_etag_when_the_date_stays_the_same(
    tmp_path: Path, range_http_factory, honour_if_range: bool
) -> None:
    """A server that keeps Last-Modified and the length while the content and its strong
    ETag change: the version is the ETag, sent as If-Range and checked on every answer."""
    (tmp_path / "f").write_bytes(b"A" * 1000)
    server = range_http_factory(tmp_path)
    old, new = b"A" * 1000, b"B" * 1000
    server.faults.rewrite_between_requests("/f", [old, new], honour_if_range=honour_if_range)
    source = open_source(server.url)
    entry = source.stat("f")  # HEAD: the first content
    assert entry.version == f"etag:1000:{content_etag(old)}"
    connection = source.connect()
    with pytest.raises(Changed, match="changed"):
        connection.read_range("f", 0, 100, entry.version)  # the second content
    assert server.requests[-1][2]["If-Range"] == content_etag(old)
    relisted = source.stat("f")
    assert relisted.version == f"etag:1000:{content_etag(new)}" and relisted.size == entry.size
    assert connection.read_range("f", 0, 100, relisted.version) == new[:100]


@pytest.mark.parametrize("honour_if_range", [True, False])
def test_http_a_date_only_version_is_pinned_to_the_first_etag_read(
    tmp_path: Path, range_http_factory, honour_if_range: bool
) -> None:
    """A JSON listing gives only a date: the first answer's strong ETag pins the version, so
    a later answer with another content (same date, same size) is refused, on any stream."""
    (tmp_path / "f").write_bytes(b"A" * 1000)
    mtime = email.utils.formatdate((tmp_path / "f").stat().st_mtime, usegmt=True)
    server = range_http_factory(tmp_path)
    server.faults.index = ("application/json", b'[{"name": "f", "type": "file", "size": 1000, "mtime": "%s"}]'
                           % mtime.encode())  # fmt: skip
    server.faults.rewrite_between_requests("/f", [b"A" * 1000, b"B" * 1000], honour_if_range=honour_if_range)
    source = open_source(server.url)
    (entry,) = source.listdir("")
    assert entry.version.startswith("lm:")
    first, second = source.connect(), source.connect()
    assert first.read_range("f", 0, 10, entry.version) == b"A" * 10  # pins A's ETag
    assert server.requests[-1][2]["If-Range"] == mtime
    for connection in (second, first):  # B from now on: same date, same size, other bytes
        with pytest.raises(Changed, match="changed"):
            connection.read_range("f", 0, 1000, entry.version)
        assert server.requests[-1][2]["If-Range"] == content_etag(b"A" * 1000)


def test_http_etags_that_are_weak_or_say_only_the_date_leave_the_date_as_version() -> None:
    from bootseer.fetch.sources.http import http_version

    date = "Mon, 30 Nov 2026 07:40:31 GMT"
    assert http_version(7, date, 'W/"abc"') == "lm:1796024431:7"
    assert http_version(7, date, '"6b0d286f-7"') == "lm:1796024431:7"  # nginx's: the date and size
    assert http_version(7, date, '"sha-abc"') == 'etag:7:"sha-abc"'
    assert http_version(7, None, '"sha-abc"') == 'etag:7:"sha-abc"'
    assert http_version(7, None, "unquoted") == "size:7"
    assert http_version(7, None, None) == "size:7"


def test_http_dropped_connection_is_transient(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    source = open_source(server.url)
    connection = source.connect()
    server.faults.drop(times=1, after_bytes=5000)
    with pytest.raises(TransientError, match="connection lost"):
        connection.read_range("a.bin", 0, 100000)
    fresh = source.connect()
    assert fresh.read_range("a.bin", 0, 100000) == (tree / "a.bin").read_bytes()[:100000]


def test_http_server_errors_are_transient(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    connection = open_source(server.url).connect()
    server.faults.status(503)
    with pytest.raises(TransientError, match="503"):
        connection.read_range("a.bin", 0, 10)
    server.faults.status(403)
    with pytest.raises(PermanentError, match="403"):
        connection.read_range("a.bin", 0, 10)
    assert connection.read_range("a.bin", 0, 10) == (tree / "a.bin").read_bytes()[:10]


def test_http_file_changed_since_stat_is_refused(tree: Path, nginx_factory) -> None:
    server = nginx_factory(tree)
    source = open_source(server.url)
    connection = source.connect()
    first = source.stat("nested/deeper/c.txt").version
    path = tree / "nested" / "deeper" / "c.txt"
    path.write_bytes(b"rewritten checkpoint!\n")
    os.utime(path, (time.time() + 10, time.time() + 10))
    with pytest.raises(Changed, match="changed"):
        connection.read_range("nested/deeper/c.txt", 0, 5, first)
    second = source.stat("nested/deeper/c.txt").version
    assert source.connect().read_range("nested/deeper/c.txt", 0, 9, second) == b"rewritten"


def test_http_unreachable_server_is_transient() -> None:
    source = open_source(f"http://127.0.0.1:{closed_port()}/ckpt/", connect_timeout=2)
    with pytest.raises(TransientError):
        source.stat("")
    with pytest.raises(TransientError):
        source.connect().read_range("a", 0, 1)


def test_http_rate_limited_nginx_serves_exact_bytes(tree: Path, nginx_factory) -> None:
    server = nginx_factory(tree, limit_rate="2m")
    connection = open_source(server.url).connect()
    assert connection.read_range("a.bin", 1000, 300000) == (tree / "a.bin").read_bytes()[1000:301000]


def test_http_single_file_url_and_directory_without_slash(tree: Path, nginx_factory) -> None:
    server = nginx_factory(tree)
    directory = open_source(server.url + "nested")  # nginx redirects to nested/
    assert directory.stat("").is_dir
    assert [entry.name for entry in directory.listdir("")] == ["b.bin", "deeper"]
    with pytest.raises(NotADirectory):
        open_source(server.url + "a.bin").listdir("")


def test_http_close_from_another_thread_ends_a_read_stuck_on_a_silent_server(tree: Path) -> None:
    # A server that takes the request and never answers: the engine gives up on the
    # read and closes its connection, and that must free the reading thread at once,
    # not after the read timeout.
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    requested = threading.Event()

    def take_the_request() -> None:
        conn = listener.accept()[0]
        accepted.append(conn)
        received = b""
        while b"\r\n\r\n" not in received and (chunk := conn.recv(4096)):
            received += chunk
        requested.set()  # the whole request is here: the reader now waits for an answer that never comes

    acceptor = threading.Thread(target=take_the_request, daemon=True)
    acceptor.start()
    port = listener.getsockname()[1]
    source = open_source(f"http://127.0.0.1:{port}/ckpt/", read_timeout=120)
    connection = source.connect()
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(connection.read_range("a.bin", 0, 100))
        except BaseException as exc:  # what the read ends with is the point
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert requested.wait(30), "the read never sent its request"
        assert reader.is_alive()
        connection.close()
        reader.join(10)
        assert not reader.is_alive(), "close() left the read blocked until the read timeout"
        assert outcome and isinstance(outcome[0], SourceError)
    finally:
        for conn in accepted:
            conn.close()
        listener.close()


def test_http_directory_redirect_naming_another_origin(tree: Path, range_http_factory) -> None:
    # Behind a proxy the server names its own address in the redirect; the slash is
    # what marks a directory, and the listing still goes to the URL we were given.
    server = range_http_factory(tree)
    server.faults.redirect_origin = f"http://127.0.0.1:{closed_port()}"
    directory = open_source(server.url + "nested")
    assert directory.stat("").is_dir
    assert [entry.name for entry in directory.listdir("")] == ["b.bin", "deeper"]


def test_html_index_links_keep_only_direct_children() -> None:
    page = """<html><body>
      <a href="../">Parent</a> <a href="?C=N;O=D">Name</a> <a href="/elsewhere/x">abs</a>
      <a href="http://other.example/dir/y">other host</a> <a href="sub/">sub/</a>
      <a href="file%20one.bin">file one</a> <a href="http://h:1/dir/two">two</a>
      <a href="sub/inner">nested</a> <a href="#top">top</a>
    </body></html>"""
    assert index_links(page, "http://h:1/dir/") == [("file one.bin", False), ("sub", True), ("two", False)]


# -- WebHDFS ----------------------------------------------------------------------------------


def test_webhdfs_follows_the_redirect_to_the_datanode(tree: Path, webhdfs_factory) -> None:
    server: WebHdfsServer = webhdfs_factory(tree)
    source = open_source(server.url + "nested", user="alice")
    connection = source.connect()
    assert connection.read_range("b.bin", 10, 20) == (tree / "nested" / "b.bin").read_bytes()[10:30]
    assert any("op=OPEN" in target and "user.name=alice" in target for target in server.namenode.requests)
    assert any("offset=10" in target and "length=20" in target for target in server.datanode.requests)


def test_webhdfs_faults_are_transient(tree: Path, webhdfs_factory) -> None:
    server: WebHdfsServer = webhdfs_factory(tree)
    source = open_source(server.url)
    connection = source.connect()
    server.datanode_faults.drop(times=1, after_bytes=1000)
    with pytest.raises(TransientError):
        connection.read_range("a.bin", 0, 200000)
    server.namenode_faults.status(503)
    with pytest.raises(TransientError, match="StandbyException"):
        connection.read_range("a.bin", 0, 200000)
    server.datanode_faults.status(500)
    with pytest.raises(TransientError):
        source.connect().read_range("a.bin", 0, 200000)
    assert source.connect().read_range("a.bin", 0, 200000) == (tree / "a.bin").read_bytes()[:200000]


def test_webhdfs_remote_exceptions_are_mapped() -> None:
    def body(exception: str) -> bytes:
        return b'{"RemoteException": {"exception": "%s", "message": "m"}}' % exception.encode()

    assert isinstance(remote_error("u", 404, "", body("FileNotFoundException")), NotFound)
    assert isinstance(remote_error("u", 403, "", body("AccessControlException")), PermanentError)
    assert isinstance(remote_error("u", 403, "", body("StandbyException")), TransientError)
    assert isinstance(remote_error("u", 500, "", body("IOException")), TransientError)
    assert isinstance(remote_error("u", 502, "", b"<html>bad gateway</html>"), TransientError)
    assert isinstance(remote_error("u", 401, "", b""), PermanentError)


def test_webhdfs_unreachable_namenode_is_transient() -> None:
    source = open_source(f"webhdfs://127.0.0.1:{closed_port()}/ckpt", connect_timeout=2)
    with pytest.raises(TransientError):
        source.stat("")


# -- S3 -----------------------------------------------------------------------------------------


def test_s3_missing_bucket_and_unreachable_endpoint(s3_bucket) -> None:
    with pytest.raises(NotFound):
        open_source("s3://no-such-bucket-bootseer/x", **s3_bucket.options).stat("")
    options = {**s3_bucket.options, "endpoint_url": f"http://127.0.0.1:{closed_port()}"}
    source = open_source(s3_bucket.url("ckpt"), **options)
    with pytest.raises(TransientError):
        source.connect().read_range("a", 0, 1)


def test_s3_object_changed_since_stat_is_refused(s3_bucket) -> None:
    s3_bucket.put("ckpt/shard", b"version one")
    source = open_source(s3_bucket.url("ckpt"), **s3_bucket.options)
    connection = source.connect()
    first = source.stat("shard").version
    assert connection.read_range("shard", 0, 7, first) == b"version"
    s3_bucket.put("ckpt/shard", b"version two")  # same size, new ETag
    with pytest.raises(Changed, match="changed"):
        connection.read_range("shard", 0, 7, first)
    assert connection.read_range("shard", 8, 3, source.stat("shard").version) == b"two"


def test_s3_object_wins_over_prefix_and_markers_are_hidden(s3_bucket) -> None:
    s3_bucket.put("ckpt/x", b"file")
    s3_bucket.put("ckpt/x/y", b"child")
    s3_bucket.put("ckpt/d/", b"")
    s3_bucket.put("ckpt/d/z", b"zz")
    source = open_source(s3_bucket.url("ckpt"), **s3_bucket.options)
    assert source.stat("x").size == 4 and not source.stat("x").is_dir
    assert listing(source.listdir("")) == [("d", True, 0), ("x", False, 4)]
    assert listing(source.listdir("d")) == [("z", False, 2)]
    assert source.stat("d").is_dir


# -- HDFS ---------------------------------------------------------------------------------------


def test_hdfs_urls_are_parsed_and_checked() -> None:
    source = HdfsSource("hdfs://127.0.0.1:8020/user/ckpt/")
    assert source.namenode_url == "hdfs://127.0.0.1:8020"
    assert source.hdfs_path("") == "/user/ckpt"
    assert source.hdfs_path("a/b") == "/user/ckpt/a/b"
    assert HdfsSource("hdfs://nn:8020").hdfs_path("x") == "/x"
    assert HdfsSource("hdfs://nn:8020/dir%20with%20space").hdfs_path("") == "/dir with space"
    with pytest.raises(ValueError):
        HdfsSource("hdfs:///no-host")
    with pytest.raises(ValueError):
        HdfsSource("hdfs://nn:notaport/x")
    with pytest.raises(PermanentError):
        HdfsSource("hdfs://nn:8020/a/../b")
    with pytest.raises(PermanentError, match="refused"):
        source.hdfs_path("../etc")


def test_hdfs_unreachable_namenode_is_transient() -> None:
    # max_failovers=0: hdfs-native's own failover loop would otherwise sleep and retry
    # for minutes (the test's timeout catches a regression).
    source = open_source(f"hdfs://127.0.0.1:{closed_port()}/ckpt", max_failovers=0)
    with pytest.raises(TransientError, match="refused"):
        source.stat("")
    with pytest.raises(TransientError):
        source.listdir("")
    connection = source.connect()
    with pytest.raises(TransientError):
        connection.read_range("shard", 0, 10)
    connection.close()


def test_hdfs_errors_are_mapped() -> None:
    assert isinstance(hdfs_error("u", FileNotFoundError("gone")), NotFound)
    assert isinstance(hdfs_error("u", RuntimeError("RPCError(java.io.FileNotFoundException, x)")), NotFound)
    assert isinstance(hdfs_error("u", PermissionError("denied")), PermanentError)
    assert isinstance(
        hdfs_error("u", RuntimeError("RPCError(org.apache.hadoop.security.AccessControlException, x)")), PermanentError
    )
    assert isinstance(hdfs_error("u", OSError("Connection refused (os error 111)")), TransientError)
    assert isinstance(hdfs_error("u", RuntimeError("ChecksumError")), TransientError)


def test_http_headers_option_and_url_credentials_are_sent(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    url = server.url.replace("http://", "http://alice:s%40cret@")
    source = open_source(url, headers={"X-Token": "t0ken"})
    source.stat("a.bin")
    source.connect().read_range("a.bin", 0, 1)
    assert {method for method, _, _ in server.requests} == {"HEAD", "GET"}
    for _, _, headers in server.requests:
        assert headers["X-Token"] == "t0ken"
        assert headers["Authorization"] == "Basic YWxpY2U6c0BjcmV0"  # alice:s@cret


def test_http_keepalive_closed_by_server_is_reopened(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    connection = open_source(server.url).connect()
    # The server closes the keep-alive connection after this answer (as nginx does
    # after its keepalive_timeout); the next read must not fail because of it.
    server.faults.hang_up()
    assert connection.read_range("a.bin", 0, 10) == (tree / "a.bin").read_bytes()[:10]
    assert connection.read_range("a.bin", 10, 10) == (tree / "a.bin").read_bytes()[10:20]


def test_s3_listing_follows_pagination(s3_bucket) -> None:
    import concurrent.futures

    client = s3_bucket.s3.client()
    names = [f"f{index:05d}" for index in range(1005)]  # S3 pages hold 1000 keys
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda name: client.put_object(Bucket=s3_bucket.name, Key=f"many/{name}", Body=b"x"), names))
    source = open_source(s3_bucket.url("many"), **s3_bucket.options)
    assert [entry.name for entry in source.listdir("")] == names


# -- bounded reads ------------------------------------------------------------------------------


def assert_refused_unread(faults: Faults, read) -> None:
    """``read()`` fails, and the server could send only what socket buffers hold."""
    faults.huge_length()
    with pytest.raises((PermanentError, TransientError), match="Content-Length|exceeds"):
        read()
    assert faults.huge_done.wait(30)
    assert faults.huge_sent < 64 << 20 < faults.HUGE_OFFERED


def test_http_huge_content_length_is_refused_before_the_body(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    source = open_source(server.url)
    version = source.stat("a.bin").version
    assert_refused_unread(server.faults, lambda: source.connect().read_range("a.bin", 0, 100))
    assert_refused_unread(server.faults, lambda: source.connect().read_range("a.bin", 0, 100, version))
    assert source.connect().read_range("a.bin", 0, 100, version) == (tree / "a.bin").read_bytes()[:100]


def test_webhdfs_huge_datanode_body_is_refused_before_the_body(tree: Path, webhdfs_factory) -> None:
    server: WebHdfsServer = webhdfs_factory(tree)
    source = open_source(server.url)
    version = source.stat("a.bin").version
    assert_refused_unread(server.datanode_faults, lambda: source.connect().read_range("a.bin", 0, 100, version))
    assert source.connect().read_range("a.bin", 0, 100, version) == (tree / "a.bin").read_bytes()[:100]


# -- credentials never shown ---------------------------------------------------------------------


def messages_of(*calls) -> list[str]:
    """The messages of the SourceErrors the calls raise (each must raise one)."""
    messages = []
    for call in calls:
        with pytest.raises(SourceError) as caught:
            call()
        messages.append(str(caught.value))
    return messages


def test_http_messages_and_repr_hide_credentials_and_query(tree: Path, range_http_factory) -> None:
    server = range_http_factory(tree)
    url = server.url.replace("http://", "http://alice:pa55word@") + "?token=SECRET"
    source = open_source(url)
    assert source.display_url == server.url
    connection = source.connect()
    version = source.stat("a.bin").version

    def rewritten_read() -> bytes:
        os.utime(tree / "a.bin", (time.time() + 20, time.time() + 20))
        return connection.read_range("a.bin", 0, 10, version)

    server.faults.redirect_origin = "http://127.0.0.1:1/other?token=SECRET"
    messages = messages_of(
        lambda: source.stat("missing"),
        lambda: (server.faults.status(503), connection.read_range("a.bin", 0, 10)),
        lambda: (server.faults.ignore_range(), connection.read_range("a.bin", 0, 10)),
        lambda: (server.faults.huge_length(), source.connect().read_range("a.bin", 0, 10)),
        rewritten_read,
        lambda: open_source(url.replace(str(server.port), str(closed_port()))).stat("a.bin"),
        lambda: source.stat("nested"),  # redirected elsewhere, with the token in the Location
    )
    assert server.faults.huge_done.wait(30)
    assert "SECRET" in server.requests[0][1]  # the token is sent, only never shown
    for text in [*messages, repr(source)]:
        assert "pa55word" not in text and "SECRET" not in text, text
        assert "127.0.0.1" in text, text


def test_webhdfs_messages_hide_the_token(tree: Path, webhdfs_factory) -> None:
    server: WebHdfsServer = webhdfs_factory(tree)
    url = server.url.replace("webhdfs://", "webhdfs://alice:pa55word@")
    source = open_source(url, delegation_token="SECRET")
    assert source.display_url == server.url and "pa55word" not in repr(source)
    connection = source.connect()
    messages = messages_of(
        lambda: source.stat("missing"),
        lambda: (server.namenode_faults.status(503), connection.read_range("a.bin", 0, 10)),
        lambda: (server.datanode_faults.status(500), connection.read_range("a.bin", 0, 10)),
        lambda: (server.datanode_faults.drop(after_bytes=10), connection.read_range("a.bin", 0, 100000)),
    )
    assert any("delegation=SECRET" in target for target in server.datanode.requests)
    for text in messages:
        assert "pa55word" not in text and "SECRET" not in text, text


def test_display_urls_of_other_backends(tmp_path: Path, s3_bucket) -> None:
    assert open_source(str(tmp_path)).display_url == str(tmp_path)
    assert open_source(s3_bucket.url("ckpt"), **s3_bucket.options).display_url == s3_bucket.url("ckpt")
    hdfs = HdfsSource("hdfs://alice@127.0.0.1:8020/user/ckpt")
    assert hdfs.display_url == "hdfs://127.0.0.1:8020/user/ckpt"
    assert hdfs.where("a") == "hdfs://127.0.0.1:8020/user/ckpt/a" and "alice" not in repr(hdfs)


# -- WebHDFS redirects -------------------------------------------------------------------------


def test_webhdfs_headers_go_to_the_namenode_only(tree: Path, webhdfs_factory) -> None:
    server: WebHdfsServer = webhdfs_factory(tree)
    source = open_source(server.url, headers={"Authorization": "Bearer t0ken", "X-Extra": "1"})
    assert source.connect().read_range("a.bin", 0, 10) == (tree / "a.bin").read_bytes()[:10]
    assert server.namenode.headers_seen and server.datanode.headers_seen
    assert all(headers.get("Authorization") == "Bearer t0ken" for headers in server.namenode.headers_seen)
    for headers in server.datanode.headers_seen:  # another port: another origin
        assert "Authorization" not in headers and "X-Extra" not in headers


def test_swebhdfs_refuses_a_redirect_to_plain_http(tree: Path, webhdfs_factory) -> None:
    server: WebHdfsServer = webhdfs_factory(tree, tls=True)
    source = open_source(server.url, verify=False, delegation_token="SECRET")
    assert source.stat("a.bin").size == 2**20 + 123  # TLS to the namenode works
    with pytest.raises(PermanentError, match="refused.*TLS to plain") as caught:
        source.connect().read_range("a.bin", 0, 10)
    assert "SECRET" not in str(caught.value)
    assert server.datanode.requests == []  # nothing, token included, went out in the clear


# -- malformed listings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "patch",
    [{"length": "12x"}, {"length": -1}, {"modificationTime": "yesterday"}, {"pathSuffix": "bad\ud800x"},
     {"pathSuffix": None}],
)  # fmt: skip
def test_webhdfs_listing_skips_a_malformed_entry_and_lists_the_rest(
    tree: Path, webhdfs_factory, patch: dict, caplog: pytest.LogCaptureFixture
) -> None:
    server: WebHdfsServer = webhdfs_factory(tree)
    server.namenode.status_patch = patch
    server.namenode.status_patch_names = {"b.bin"}
    assert [entry.name for entry in open_source(server.url).listdir("nested")] == ["deeper"]
    assert "skipping malformed LISTSTATUS entry" in caplog.text


@pytest.mark.parametrize(
    "bad",
    [b'"size": "huge"', b'"size": -5', b'"size": 1.5', b'"size": true', b'"size": null', b'"size": 3, "x": 0'],
)
def test_json_index_skips_an_entry_with_a_bad_size_and_lists_the_rest(
    tree: Path, range_http_factory, bad: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    server = range_http_factory(tree)
    if bad.endswith(b'"x": 0'):
        bad = b'"x": 0'  # no size at all
    page = b'[{"name": "ok", "type": "file", "size": 3}, {"name": "bad", "type": "file", %s}]' % bad
    server.faults.index = ("application/json", page)
    assert [(entry.name, entry.size) for entry in open_source(server.url).listdir("")] == [("ok", 3)]
    assert "bad size" in caplog.text


@pytest.mark.parametrize("name", ["bad\\ud800x", "\\udc80", "\\udfff\\ud800", "a/b", "..", ""])
def test_json_index_skips_a_name_that_is_not_valid_unicode(
    tree: Path, range_http_factory, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = range_http_factory(tree)
    page = b'[{"name": "%s", "type": "file", "size": 9}, {"name": "ok", "type": "file", "size": 3}]' % name.encode()
    server.faults.index = ("application/json", page)
    assert [entry.name for entry in open_source(server.url).listdir("")] == ["ok"]
    assert "skipping malformed directory index item" in caplog.text


def test_html_index_skips_a_link_the_server_refuses(
    tree: Path, range_http_factory, caplog: pytest.LogCaptureFixture
) -> None:
    server = range_http_factory(tree)
    page = b'<a href="a.bin">a.bin</a> <a href="nested/">nested/</a> <a href="gone">gone</a> <a href="x%ED%A0%80">x</a>'
    server.faults.index = ("text/html", page)
    server.faults.refused["/a.bin"] = 403  # HEAD and GET of it: PermanentError
    server.faults.refused["/gone"] = 404
    assert [entry.name for entry in open_source(server.url).listdir("")] == ["nested"]
    assert "skipping directory index link the server refuses" in caplog.text
    del server.faults.refused["/a.bin"]
    assert [entry.name for entry in open_source(server.url).listdir("")] == ["a.bin", "nested"]


    mtime = "Mon, 30 Nov 2026 07:40:31 GMT"
    good = b'[{"name": "a", "type": "file", "size": 7, "mtime": "%s"}]' % mtime.encode()
    assert parse_json_index(good, "u")[0].version == "lm:1796024431:7"
