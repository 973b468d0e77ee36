"""``bootseer ckpt mount`` end to end: the real command, a real FUSE mount, real backends.

Every backend that can run here serves the same tree (local directory, nginx over
HTTP, moto's S3, WebHDFS on tests/support/webhdfs.py's server) and the mount is
checked against the files on disk: listing, stat, byte-exact random and sequential
reads, many readers at once.  Faults and lifecycle (a source outage, SIGTERM,
external umount, bad options) run against the local and HTTP backends.
"""

from __future__ import annotations

import errno
import filecmp
import hashlib
import mmap
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from bootseer.fetch.digests import SUFFIX as DIGESTS_SUFFIX
from bootseer.fetch.digests import DigestList
from bootseer.fetch.sources.local import LocalSource
from tests.support.digests import corrupt_in_place
from tests.support.http import NginxServer, RangeHTTPServer, SilentRangeHandler, range_gets

from tests.support.waiting import free_port
from tests.support.memory import peak_rss_under_readers, rss_bound
from tests.support.mounts import MountProcess, mount_entry, wait_unmounted
from tests.support.s3 import REGION, MotoS3, S3Bucket
from tests.support.webhdfs import WebHdfsServer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

BOOTSEER = [sys.executable, "-m", "bootseer.cli"]
MiB = 1 << 20
STRIPE = "1M"  # small stripes, so that even small files span several
SHARDS = 200


# -- the tree every backend serves ----------------------------------------------------


def _content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def make_tree(root: Path) -> None:
    """A checkpoint-shaped tree: shards, a config, an empty file, nesting, a wide directory."""
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "shards").mkdir()
    (root / "model-00001-of-00002.safetensors").write_bytes(_content(1, 5 * MiB + 123))
    (root / "model-00002-of-00002.safetensors").write_bytes(_content(2, 3 * MiB))
    (root / "config.json").write_text('{"hidden_size": 4096}\n')
    (root / "empty").write_bytes(b"")
    (root / "sub" / "deep" / "optimizer.pt").write_bytes(_content(3, MiB + 7))
    (root / "name with spaces.bin").write_bytes(_content(4, 1000))
    for index in range(SHARDS):
        (root / "shards" / f"shard-{index:04d}").write_bytes(b"%d\n" % index)


def source_files(root: Path) -> dict[str, Path]:
    return {path.relative_to(root).as_posix(): path for path in sorted(root.rglob("*")) if path.is_file()}


def mounted_tree(mnt: Path) -> tuple[set[str], set[str]]:
    files, dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(mnt):
        base = Path(dirpath).relative_to(mnt)
        dirs.update((base / name).as_posix() for name in dirnames)
        files.update((base / name).as_posix() for name in filenames)
    return files, dirs


@dataclass
class Backend:
    name: str
    url: str
    root: Path  #: the same files on local disk, to compare against
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    mtime_tolerance: float | None = 0.001  #: None: the source keeps no file mtimes we can predict


def start_mount(
    backend: Backend, mountpoint: Path, logdir: Path, *extra: str, source_url: str | None = None
) -> MountProcess:
    argv = [*BOOTSEER, "ckpt", "mount", source_url or backend.url, str(mountpoint), "--stripe-size", STRIPE,
            *backend.args, *extra]  # fmt: skip
    env = {**os.environ, **backend.env}
    return MountProcess(argv, mountpoint, logdir, "mounted ", env=env)


@pytest.fixture(scope="module")
def source_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("source")
    make_tree(root)
    return root


@pytest.fixture(scope="module", params=["local", "http", "s3", "webhdfs"])
def backend(request: pytest.FixtureRequest, source_root: Path) -> Iterator[Backend]:
    kind = request.param
    if kind == "local":
        yield Backend("local", str(source_root), source_root)
    elif kind == "http":
        with NginxServer(source_root, autoindex_format="json") as server:
            # HTTP carries mtimes at one-second resolution (Last-Modified).
            yield Backend("http", server.url, source_root, mtime_tolerance=1.0)
    elif kind == "s3":
        s3: MotoS3 = request.getfixturevalue("moto_s3")
        bucket = S3Bucket(s3, f"bootseer-ckpt-{os.getpid()}")
        client = s3.client()
        client.create_bucket(Bucket=bucket.name)
        bucket.upload_tree(source_root, prefix="ckpt")
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_CONFIG_FILE": "/dev/null",
               "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}  # fmt: skip
        try:
            # S3 keeps the upload time, not the file's mtime.
            args = ["--s3-endpoint-url", s3.endpoint_url, "--s3-region", REGION]
            yield Backend("s3", bucket.url("ckpt"), source_root, args, env, mtime_tolerance=None)
        finally:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
                for item in page.get("Contents", []):
                    client.delete_object(Bucket=bucket.name, Key=item["Key"])
            client.delete_bucket(Bucket=bucket.name)
    else:
        with WebHdfsServer(source_root) as server:
            yield Backend("webhdfs", server.url, source_root, ["--webhdfs-user", "test"])


@pytest.fixture(scope="module")
def ckpt(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Backend, Path, MountProcess]]:
    """``backend`` mounted for the whole module."""
    workdir = tmp_path_factory.mktemp(f"mount-{backend.name}")
    mountpoint = workdir / "mnt"
    mountpoint.mkdir()
    mount = start_mount(backend, mountpoint, workdir)
    try:
        mount.wait_ready()
        yield backend, mountpoint, mount
    finally:
        mount.cleanup()


# -- every backend -------------------------------------------------------------------------


def test_mount_reports_ready_and_shows_in_the_mount_table(ckpt) -> None:
    backend, mnt, mount = ckpt
    assert f"at {mnt}" in mount.stdout
    entry = mount_entry(mnt)
    assert entry is not None and entry.fstype == "fuse.bootseer-ckpt" and "ro" in entry.options


def test_listing_and_stat_match_the_source(ckpt) -> None:
    backend, mnt, _mount = ckpt
    expected = source_files(backend.root)
    files, dirs = mounted_tree(mnt)
    assert files == set(expected)
    assert {"sub", "sub/deep", "shards"} <= dirs
    for relative, path in expected.items():
        info = os.stat(mnt / relative)
        assert stat.S_ISREG(info.st_mode)
        assert info.st_mode & 0o777 == 0o444
        assert info.st_size == path.stat().st_size, relative
        if backend.mtime_tolerance is not None:
            assert abs(info.st_mtime - path.stat().st_mtime) <= backend.mtime_tolerance, relative
    assert stat.S_ISDIR(os.stat(mnt / "sub" / "deep").st_mode)
    assert sorted(os.listdir(mnt / "shards")) == [f"shard-{i:04d}" for i in range(SHARDS)]


def test_random_reads_are_byte_exact(ckpt) -> None:
    backend, mnt, _mount = ckpt
    rng = random.Random(backend.name)
    for relative in ("model-00001-of-00002.safetensors", "sub/deep/optimizer.pt", "name with spaces.bin"):
        data = (backend.root / relative).read_bytes()
        fd = os.open(mnt / relative, os.O_RDONLY)
        try:
            for _ in range(60):
                offset = rng.randrange(0, len(data) + 100)
                size = rng.choice([1, 511, 4096, 100_000, MiB + 3, 3 * MiB])
                assert os.pread(fd, size, offset) == data[offset : offset + size], (relative, offset, size)
        finally:
            os.close(fd)


def test_sequential_reads_compare_equal(ckpt) -> None:
    backend, mnt, _mount = ckpt
    for relative, path in source_files(backend.root).items():
        if relative.startswith("shards/"):
            continue
        subprocess.run(["cmp", str(path), str(mnt / relative)], check=True, timeout=120)
    assert (mnt / "config.json").read_text() == '{"hidden_size": 4096}\n'
    assert (mnt / "empty").read_bytes() == b""
    assert (mnt / "shards" / "shard-0123").read_bytes() == b"123\n"


def test_concurrent_readers(ckpt) -> None:
    backend, mnt, _mount = ckpt
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "sub/deep/optimizer.pt"]
    contents = {name: (backend.root / name).read_bytes() for name in names}

    def read_ranges(seed: int) -> None:
        rng = random.Random(seed)
        name = names[seed % len(names)]
        data = contents[name]
        with open(mnt / name, "rb", buffering=0) as file:
            for _ in range(25):
                offset = rng.randrange(len(data))
                file.seek(offset)
                assert file.read(65536) == data[offset : offset + 65536]

    processes = [subprocess.Popen(["cmp", str(backend.root / name), str(mnt / name)]) for name in names * 2]
    try:
        with ThreadPoolExecutor(12) as pool:
            for future in [pool.submit(read_ranges, seed) for seed in range(12)]:
                future.result(timeout=120)
        assert [process.wait(120) for process in processes] == [0] * len(processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_many_files_open_at_once(ckpt) -> None:
    _backend, mnt, _mount = ckpt
    files = [open(mnt / "shards" / f"shard-{index:04d}", "rb") for index in range(SHARDS)]
    try:
        # Read in reverse order of opening, so every handle is still open and live.
        for index, file in reversed(list(enumerate(files))):
            assert file.read() == b"%d\n" % index
    finally:
        for file in files:
            file.close()


def test_missing_names_and_writes(ckpt) -> None:
    _backend, mnt, _mount = ckpt
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "model-00003-of-00002.safetensors")
    with pytest.raises(FileNotFoundError):
        (mnt / "sub" / "nothing" / "here").read_bytes()
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "config.json")
    for attempt in (
        lambda: open(mnt / "config.json", "r+b"),
        lambda: open(mnt / "new-file", "wb"),
        lambda: os.mkdir(mnt / "new-dir"),
        lambda: os.unlink(mnt / "config.json"),
        lambda: os.rename(mnt / "config.json", mnt / "moved.json"),
    ):
        with pytest.raises(OSError) as excinfo:
            attempt()
        assert excinfo.value.errno == errno.EROFS


# -- large sparse files -------------------------------------------------------------------------

SPARSE_SIZE = 40 * (1 << 30) + 12345
SPARSE_MARKS = [0, 5 * (1 << 30) + 17, 33 * (1 << 30) - 3, SPARSE_SIZE - 4096]


@pytest.fixture(scope="module")
def sparse_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sparse")
    with open(root / "huge.bin", "wb") as file:
        file.truncate(SPARSE_SIZE)
        for offset in SPARSE_MARKS:
            file.seek(offset)
            file.write(hashlib.sha256(b"%d" % offset).digest() * 128)  # 4 KiB marks
    return root


@pytest.mark.parametrize("kind", ["local", "http"])
def test_far_offsets_of_a_huge_sparse_file(kind: str, sparse_root: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    server = NginxServer(sparse_root).start() if kind == "http" else None
    try:
        backend = Backend(kind, server.url if server else str(sparse_root), sparse_root)
        mount = start_mount(backend, mountpoint, tmp_path)
        try:
            mount.wait_ready()
            path = mountpoint / "huge.bin"
            assert os.stat(path).st_size == SPARSE_SIZE
            fd = os.open(path, os.O_RDONLY)
            source_fd = os.open(sparse_root / "huge.bin", os.O_RDONLY)
            try:
                for offset in [*SPARSE_MARKS, *(mark + 4000 for mark in SPARSE_MARKS), 20 * (1 << 30)]:
                    expected = os.pread(source_fd, 8192, offset)
                    assert os.pread(fd, 8192, offset) == expected, offset
                assert os.pread(fd, 100, SPARSE_SIZE - 10) == os.pread(source_fd, 100, SPARSE_SIZE - 10)
                assert os.pread(fd, 100, SPARSE_SIZE + 10) == b""
            finally:
                os.close(fd)
                os.close(source_fd)
        finally:
            mount.cleanup()
    finally:
        if server is not None:
            server.stop()


# -- lifecycle -----------------------------------------------------------------------------------


@pytest.fixture
def local_mount(source_root: Path, tmp_path: Path) -> Iterator[MountProcess]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = start_mount(Backend("local", str(source_root), source_root), mountpoint, tmp_path)
    try:
        mount.wait_ready()
        yield mount
    finally:
        mount.cleanup()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(local_mount: MountProcess, signum: int) -> None:
    assert (local_mount.mountpoint / "config.json").read_bytes()
    local_mount.signal(signum)
    assert local_mount.wait() == 0
    wait_unmounted(local_mount.mountpoint)


def test_external_umount_ends_the_process(local_mount: MountProcess) -> None:
    with open(local_mount.mountpoint / "model-00002-of-00002.safetensors", "rb") as file:
        assert file.read(100)
    subprocess.run(["umount", str(local_mount.mountpoint)], check=True, timeout=30)
    assert local_mount.wait() == 0
    assert mount_entry(local_mount.mountpoint) is None


def _eventually(check, timeout: float = 20.0) -> None:
    """Poll ``check`` until it returns true (changes at the source show after the listing TTL)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the change never showed through the mount"
        time.sleep(0.1)


def test_changes_at_the_source_show_after_the_listing_ttl(tmp_path: Path) -> None:
    root = tmp_path / "source"
    root.mkdir()
    v1, v2 = _content(10, 3 * MiB), _content(11, 2 * MiB + 5)
    (root / "latest.pt").write_bytes(v1)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = start_mount(Backend("local", str(root), root), mountpoint, tmp_path, "--listing-ttl", "0.5")
    try:
        mount.wait_ready()
        assert (mountpoint / "latest.pt").read_bytes() == v1
        fd = os.open(mountpoint / "latest.pt", os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == v1[:4096]
            # A checkpoint written next to the old one, then swapped in by rename.
            (root / "new.pt").write_bytes(v2)
            _eventually(lambda: "new.pt" in os.listdir(mountpoint))
            os.rename(root / "new.pt", root / "latest.pt")
            _eventually(lambda: os.stat(mountpoint / "latest.pt").st_size == len(v2))
            assert (mountpoint / "latest.pt").read_bytes() == v2
            # The handle opened on the old version never mixes in bytes of the new one.
            try:
                assert os.pread(fd, 4096, 2 * MiB + 100) == v1[2 * MiB + 100 : 2 * MiB + 4196]
            except OSError as exc:
                assert exc.errno == errno.EIO
        finally:
            os.close(fd)
        (root / "latest.pt").unlink()
        _eventually(lambda: not (mountpoint / "latest.pt").exists())
    finally:
        mount.cleanup()


def test_a_single_file_source_is_mounted_as_a_directory_holding_it(source_root: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    source = source_root / "sub" / "deep" / "optimizer.pt"
    mount = start_mount(Backend("local", str(source), source_root), mountpoint, tmp_path)
    try:
        mount.wait_ready()
        assert os.listdir(mountpoint) == ["optimizer.pt"]
        assert filecmp.cmp(source, mountpoint / "optimizer.pt", shallow=False)
    finally:
        mount.cleanup()


def test_metrics_endpoint(source_root: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    port = free_port()
    backend = Backend("local", str(source_root), source_root)
    mount = start_mount(backend, mountpoint, tmp_path, "--metrics-address", f"127.0.0.1:{port}")
    try:
        mount.wait_ready()
        assert (mountpoint / "config.json").read_bytes()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'bootseer_fuse_requests_total{fs="bootseer-ckpt",op="read"}' in body
        assert "bootseer_fetch_" in body  # the engine's metrics, on the same endpoint
    finally:
        mount.cleanup()


def _metric(body: str, name: str) -> float:
    """A sample's value in a Prometheus text exposition (0 when absent)."""
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_mmap_reads_fetch_each_stripe_once_and_load_exact_tensors(tmp_path: Path) -> None:
    """safetensors' default loader and ``torch.load(mmap=True)`` read by page faults:
    the kernel's read-around and ``memcpy`` touching each tensor's end first must not
    make the engine fetch a stripe twice (or download at one connection's speed)."""
    np = pytest.importorskip("numpy")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    root = tmp_path / "source"
    root.mkdir()
    rng = np.random.default_rng(7)
    hidden, ffn, vocab = 512, 1376, 2000
    shapes = {"model.embed_tokens.weight": ((vocab, hidden), "float16")}
    for layer in range(3):
        for name, shape in (("q_proj", (hidden, hidden)), ("k_proj", (hidden, hidden)), ("o_proj", (hidden, hidden)),
                            ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
            shapes[f"model.layers.{layer}.{name}.weight"] = (shape, "float16")
        shapes[f"model.layers.{layer}.input_layernorm.weight"] = ((hidden,), "float32")
    shapes["lm_head.weight"] = ((vocab, hidden), "float16")
    tensors = {
        name: np.frombuffer(rng.bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype=dtype).reshape(shape)
        for name, (shape, dtype) in shapes.items()
    }
    safetensors_numpy.save_file(tensors, str(root / "model.safetensors"))
    raw = _content(9, 6 * MiB + 5)
    (root / "raw.bin").write_bytes(raw)
    sizes = [(root / "model.safetensors").stat().st_size, len(raw)]
    stripes = sum(-(-size // MiB) for size in sizes)

    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    port = free_port()
    backend = Backend("local", str(root), root)
    mount = start_mount(backend, mountpoint, tmp_path, "--metrics-address", f"127.0.0.1:{port}")
    try:
        mount.wait_ready()
        loaded = safetensors_numpy.load_file(str(mountpoint / "model.safetensors"))  # mmap, its default
        assert sorted(loaded) == sorted(tensors)
        for name, array in tensors.items():
            assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
            assert loaded[name].tobytes() == array.tobytes(), name
        with open(mountpoint / "raw.bin", "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as mapping:
            assert b"".join(mapping[offset : offset + MiB] for offset in range(0, len(raw), MiB)) == raw
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert _metric(body, 'bootseer_fetch_stripes_total{outcome="failed"}') == 0
        assert _metric(body, 'bootseer_fetch_stripes_total{outcome="fetched"}') == stripes
        assert _metric(body, "bootseer_fetch_bytes_total") == sum(sizes)
    finally:
        mount.cleanup()


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [("4096", 4096), ("8M", 8 * MiB), ("16MiB", 16 * MiB), ("1G", 1 << 30), ("1.5g", 3 << 29), ("512k", 512 << 10),
     ("8MB", 8_000_000), ("2 GiB", 2 << 30), ("0", 0)],
)  # fmt: skip
def test_sizes(text: str, size: int) -> None:
    from bootseer.ckptmount.cli import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "8X", "-1", "1.5", "8i", "8iB", "0.3K", "1e9"])
def test_bad_sizes(text: str) -> None:
    import argparse

    from bootseer.ckptmount.cli import parse_size

    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*BOOTSEER, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--stripe-size", "8X"], "invalid size"),
        (["--streams", "0"], "must be at least 1"),
        (["--retry-timeout", "-1"], "positive number of seconds"),
        (["--memory-limit", "1M", "--stripe-size", "8M"], "must hold at least one stripe"),
        (["--s3-region", "us-east-1"], "--s3-region does not apply to local sources"),
        (["--http-header", "no colon"], "invalid header"),
        (["--metrics-address", "nowhere"], "HOST:PORT"),
    ],
)
def test_bad_options_exit_2(options: list[str], message: str, source_root: Path, tmp_path: Path) -> None:
    result = _run(["ckpt", "mount", str(source_root), str(tmp_path), *options])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert mount_entry(tmp_path) is None


def test_bad_mountpoints_exit_2(source_root: Path, tmp_path: Path) -> None:
    result = _run(["ckpt", "mount", str(source_root), str(tmp_path / "missing")])
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = _run(["ckpt", "mount", str(source_root), str(source_root / "config.json")])
    assert result.returncode == 2 and "is not a directory" in result.stderr
    result = _run(["ckpt", "mount", "ftp://example/x", str(tmp_path)])
    assert result.returncode == 2 and "unsupported source URL" in result.stderr


def test_unreachable_sources_exit_1(tmp_path: Path) -> None:
    result = _run(["ckpt", "mount", str(tmp_path / "no-such-dir"), str(tmp_path)])
    assert result.returncode == 1 and "cannot read the source" in result.stderr
    port = free_port()  # nothing listens there
    result = _run(["ckpt", "mount", f"http://127.0.0.1:{port}/ckpt/", str(tmp_path), "--retry-timeout", "1"])
    assert result.returncode == 1 and "cannot read the source" in result.stderr
    assert mount_entry(tmp_path) is None


# -- a source that goes away -----------------------------------------------------------------------


class CuttableLink:
    """A TCP proxy on 127.0.0.1 whose link can be cut and restored, like a network outage.

    While cut, open connections are reset and new ones refused; restoring listens on
    the same port again.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        for thread in self._threads:
            thread.join(5)
        self._threads = []

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._connections.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def test_a_source_outage_fails_reads_with_eio_and_the_mount_recovers(source_root: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    name = "model-00001-of-00002.safetensors"
    data = (source_root / name).read_bytes()
    other = (source_root / "sub" / "deep" / "optimizer.pt").read_bytes()
    # The Python server: its redirects are relative, so they survive the proxy's port.
    with RangeHTTPServer(source_root) as server:
        link = CuttableLink(server.port)
        link.restore()
        try:
            backend = Backend("http", link.url, source_root)
            mount = start_mount(backend, mountpoint, tmp_path, "--retry-timeout", "2", "--readahead-max", "0")
            try:
                mount.wait_ready()
                fd = os.open(mountpoint / name, os.O_RDONLY)
                try:
                    # A random read away from the start: it fetches its own stripe only.
                    assert os.pread(fd, 4096, 3 * MiB) == data[3 * MiB : 3 * MiB + 4096]
                    link.cut()
                    with pytest.raises(OSError) as excinfo:
                        os.pread(fd, 4096, 5 * MiB)
                    assert excinfo.value.errno == errno.EIO
                    # The mount is up: names and what was already read are still served.
                    assert mount.process.poll() is None and mount_entry(mountpoint) is not None
                    assert name in os.listdir(mountpoint)
                    assert os.pread(fd, 4096, 3 * MiB) == data[3 * MiB : 3 * MiB + 4096]
                    link.restore()
                    time.sleep(2)  # a stripe that failed fails at once for min(--retry-timeout, 10 s)
                    assert os.pread(fd, 4096, 5 * MiB) == data[5 * MiB : 5 * MiB + 4096]
                    assert (mountpoint / "sub" / "deep" / "optimizer.pt").read_bytes() == other
                finally:
                    os.close(fd)
                mount.signal(signal.SIGTERM)
                assert mount.wait() == 0
                assert "EIO" in mount.stderr or "Input/output error" in mount.stderr or "failed" in mount.stderr
            finally:
                mount.cleanup()
        finally:
            link.cut()


# -- versions, hung reads, secrets, permissions (review findings) ---------------------------------


def test_a_same_size_rewrite_at_the_source_gives_new_bytes_or_eio_never_a_mix(tmp_path: Path) -> None:
    """A file replaced by one of the same size and the same mtime (only its version, the
    inode here, tells them apart): after the listing TTL reads give the new bytes; an old
    handle gives old bytes or EIO; no read ever returns some of each."""
    root = tmp_path / "source"
    root.mkdir()
    size = 3 * MiB
    old, new = b"A" * size, b"B" * size
    (root / "f").write_bytes(old)
    stamp_ns = (root / "f").stat().st_mtime_ns
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = start_mount(Backend("local", str(root), root), mountpoint, tmp_path, "--listing-ttl", "0.5")

    def whole_read() -> bytes | None:
        """The file as one open reads it, or None for EIO."""
        try:
            with open(mountpoint / "f", "rb", buffering=0) as file:
                data = file.read()
        except OSError as exc:
            assert exc.errno == errno.EIO, exc
            return None
        assert data in (old, new), f"a read mixed versions: {data.count(b'A')} A and {data.count(b'B')} B"
        return data

    try:
        mount.wait_ready()
        fd = os.open(mountpoint / "f", os.O_RDONLY)
        try:
            assert os.pread(fd, 10, MiB + MiB // 2) == b"A" * 10  # a stripe of the old version in memory
            (root / "f.tmp").write_bytes(new)
            os.utime(root / "f.tmp", ns=(stamp_ns, stamp_ns))
            os.replace(root / "f.tmp", root / "f")
            _eventually(lambda: whole_read() == new)
            try:
                assert os.pread(fd, size, 0) == old
            except OSError as exc:
                assert exc.errno == errno.EIO
        finally:
            os.close(fd)
    finally:
        mount.cleanup()


def _cached_bytes(path: Path, size: int) -> dict[int, bytes]:
    """The pages of ``path`` that are in the kernel's page cache, by index, as they are there.

    mincore(2) of a mapping says which are; only those are read, from the mapping, so
    nothing is fetched."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor
        return {index: mapping[index * page : (index + 1) * page] for index in range(pages) if vector[index] & 1}


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError as exc:
        assert exc.errno == errno.EIO, exc
        return None


def test_a_same_date_rewrite_over_http_gives_eio_or_new_bytes_never_a_mix(tmp_path: Path) -> None:
    """A server that keeps Last-Modified and the length while the content and its strong ETag
    change (issue 10.1): a 1 MiB read of small stripes is EIO or one content, never a mix,
    and the page cache keeps no bytes of another content; the next open gets the new one."""
    from tests.support.http import content_etag

    root = tmp_path / "source"
    root.mkdir()
    size = MiB
    old, new = b"A" * size, b"B" * size
    (root / "f").write_bytes(old)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with RangeHTTPServer(root) as server:
        server.faults.rewrite_between_requests("/f", [old])
        # A long listing TTL: only the failed read may make the new version visible early.
        mount = start_mount(Backend("http", server.url, root), mountpoint, tmp_path, "--stripe-size", "64K",
                            "--listing-ttl", "600", "--retry-timeout", "2")  # fmt: skip
        try:
            mount.wait_ready()
            with open(mountpoint / "f", "rb", buffering=0) as file:
                assert os.pread(file.fileno(), 256 * 1024, 0) == old[: 256 * 1024]  # cached pages of A
                # Every request now answers another content than the last, same date and size.
                server.faults.rewrite_between_requests("/f", [new, old] * 200)
                # One 1 MiB read, continued where the kernel ends it short (it returns what
                # it got when a later page fails): one version's bytes up to an EIO, or all of it.
                data = b""
                while len(data) < size:
                    try:
                        piece = os.pread(file.fileno(), size - len(data), len(data))
                    except OSError as exc:
                        assert exc.errno == errno.EIO, exc
                        break
                    assert piece
                    data += piece
                assert data in (old[: len(data)], new[: len(data)]), (
                    f"a read mixed versions: {data.count(b'A')} A, {data.count(b'B')} B"
                )
                cached = _cached_bytes(mountpoint / "f", size)
                letters = {letter for page in cached.values() for letter in set(page)}
                assert len(letters) <= 1, f"the page cache mixes versions: {sorted(cached)}"
            server.faults.rewrite_between_requests("/f", [new])
            # The failed read expired the listing: the new version comes well before the TTL.
            _eventually(lambda: _read_or_none(mountpoint / "f") == new, timeout=20)
            assert any(headers.get("If-Range") == content_etag(new) for _, _, headers in server.requests)
        finally:
            mount.cleanup()


def test_sigterm_ends_the_mount_while_a_read_hangs_on_a_silent_source(source_root: Path, tmp_path: Path) -> None:
    server = RangeHTTPServer(source_root, SilentRangeHandler)
    server.release = threading.Event()
    server.start()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    # Far beyond how long the test waits: only abandoning the hung read ends the mount in time.
    mount = start_mount(Backend("http", server.url, source_root), mountpoint, tmp_path,
                        "--read-timeout", "120", "--retry-timeout", "120")  # fmt: skip
    reader = None
    try:
        mount.wait_ready()
        reader = subprocess.Popen(
            ["dd", f"if={mountpoint / 'config.json'}", "of=/dev/null", "bs=4k", "count=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while range_gets(server) == 0:
            assert time.monotonic() < deadline, "the read never reached the server"
            time.sleep(0.05)
        assert reader.poll() is None  # hanging
        mount.signal(signal.SIGTERM)
        # The shutdown grace for requests in flight (10 s) plus teardown; never the read timeout.
        assert mount.wait(timeout=45) == 0
        wait_unmounted(mountpoint)
        assert reader.wait(timeout=30) != 0  # its read failed rather than returning bytes
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait()
        mount.cleanup()
        server.release.set()
        server.stop()


def test_a_failing_read_fails_within_one_retry_timeout(source_root: Path, tmp_path: Path) -> None:
    """The kernel follows a failed read-ahead read with a one-page read of the same range;
    that one fails at once (the engine remembers the failed stripe), so a read blocks one
    --retry-timeout, not two, and the source sees one request for the stripe, not two."""
    server = RangeHTTPServer(source_root, SilentRangeHandler)
    server.release = threading.Event()
    server.start()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    retry_timeout = 3.0
    mount = start_mount(Backend("http", server.url, source_root), mountpoint, tmp_path,
                        "--retry-timeout", str(retry_timeout), "--readahead-max", "0")  # fmt: skip
    try:
        mount.wait_ready()
        fd = os.open(mountpoint / "model-00001-of-00002.safetensors", os.O_RDONLY)
        try:
            started = time.monotonic()
            with pytest.raises(OSError) as caught:
                os.pread(fd, 4096, 0)
            elapsed = time.monotonic() - started
        finally:
            os.close(fd)
        assert caught.value.errno == errno.EIO
        assert range_gets(server) == 1, f"{range_gets(server)} range requests; the read took {elapsed:.1f}s"
    finally:
        mount.cleanup()
        server.release.set()
        server.stop()


@pytest.mark.parametrize("kind", ["local", "http"])
def test_resident_memory_follows_the_memory_limit_under_concurrent_readers(tmp_path: Path, kind: str) -> None:
    """8 concurrent readers of large files with --memory-limit 64M: the mount's RSS stays
    within the limit's tolerance above idle (issue 10.4: it was about 270 MiB above over a
    local source, 170 MiB over HTTP)."""
    root = tmp_path / "source"
    root.mkdir()
    size, readers, limit = (128 if kind == "local" else 64) * MiB, 8, 64 * MiB
    for index in range(readers):
        with open(root / f"shard-{index}", "wb") as file:
            file.truncate(size)  # sparse: reading it costs no disk
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    server = NginxServer(root).start() if kind == "http" else None
    backend = Backend(kind, server.url if server is not None else str(root), root)
    mount = start_mount(backend, mountpoint, tmp_path, "--stripe-size", "8M", "--memory-limit", "64M")
    try:
        mount.wait_ready()
        assert len(os.listdir(mountpoint)) == readers
        paths = [mountpoint / f"shard-{index}" for index in range(readers)]
        idle, peak = peak_rss_under_readers(mount.process.pid, paths, size)
        above = peak - idle
        assert above <= rss_bound(limit), (
            f"RSS rose {above / MiB:.0f} MiB above idle ({idle / MiB:.0f} MiB) with --memory-limit 64M"
        )
    finally:
        mount.cleanup()
        if server is not None:
            server.stop()


def test_credentials_and_query_tokens_never_reach_messages_or_logs(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"http://alice:s3cr3t@127.0.0.1:{port}/ckpt/?X-Amz-Signature=TOKEN123"
    result = _run(["--log-level", "debug", "ckpt", "mount", url, str(tmp_path), "--retry-timeout", "1"])
    assert result.returncode == 1 and "cannot read the source" in result.stderr
    assert f"127.0.0.1:{port}/ckpt/" in result.stderr  # it still says which source
    for secret in ("s3cr3t", "TOKEN123"):
        assert secret not in result.stderr and secret not in result.stdout
    assert mount_entry(tmp_path) is None


def test_other_users_may_read_the_mount_only_with_allow_other(source_root: Path, tmp_path: Path) -> None:
    for extra, expected in (([], False), (["--allow-other"], True)):
        mountpoint = tmp_path / f"mnt{len(extra)}"
        mountpoint.mkdir()
        mount = start_mount(Backend("local", str(source_root), source_root), mountpoint, tmp_path, *extra)
        try:
            mount.wait_ready()
            entry = mount_entry(mountpoint)
            assert entry is not None and ("allow_other" in entry.options) is expected, entry.options
            with open("/proc/self/mountinfo") as mountinfo:
                line = next(line for line in mountinfo if f" {mountpoint} " in line)
            assert ("allow_other" in line) is expected, line
        finally:
            mount.cleanup()


# -- digest lists ------------------------------------------------------------------------------------

DIGEST_CHUNK = 256 * 1024  # divides the mount's 1M stripes


def _chunk_digests(data: bytes, chunk: int = DIGEST_CHUNK) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(data[at:at + chunk]).digest() for at in range(0, len(data), chunk))


def test_ckpt_digest_writes_lists_that_round_trip(tmp_path: Path) -> None:
    first, second = _content(30, 3 * MiB + 11), _content(31, 100)
    (tmp_path / "model.pt").write_bytes(first)
    (tmp_path / "optim.pt").write_bytes(second)
    result = _run(["ckpt", "digest", str(tmp_path / "model.pt"), f"file://{tmp_path}/optim.pt",
                   "--chunk-size", "256K"])  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2 and "13 chunks of 262144 bytes" in result.stdout
    for name, data in (("model.pt", first), ("optim.pt", second)):
        stored = DigestList.decode((tmp_path / (name + DIGESTS_SUFFIX)).read_bytes())
        assert stored.digests == _chunk_digests(data) and stored.size == len(data)
        assert stored.version == LocalSource(str(tmp_path)).stat(name).version


def test_ckpt_digest_refuses_bad_options_and_reports_files_it_cannot_do(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"x" * 1000)
    result = _run(["ckpt", "digest", str(tmp_path / "model.pt"), "--chunk-size", "3M"])
    assert result.returncode == 2 and "power of two" in result.stderr
    assert not (tmp_path / ("model.pt" + DIGESTS_SUFFIX)).exists()
    result = _run(["ckpt", "digest", str(tmp_path / "model.pt"), "--s3-region", "x"])
    assert result.returncode == 2 and "--s3-region does not apply to local sources" in result.stderr
    # A file it cannot read or a store it cannot write fails that file, not the others.
    result = _run(["ckpt", "digest", str(tmp_path / "missing.pt"), "http://127.0.0.1:9/model.pt",
                   str(tmp_path / "model.pt")])  # fmt: skip
    assert result.returncode == 1
    assert "missing.pt" in result.stderr and "cannot write to HttpSource" in result.stderr
    assert (tmp_path / ("model.pt" + DIGESTS_SUFFIX)).exists()


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_a_wrong_byte_in_storage_is_eio_through_the_mount_never_served(tmp_path: Path) -> None:
    root = tmp_path / "source"
    root.mkdir()
    data = _content(32, 4 * MiB + 5)
    (root / "model.pt").write_bytes(data)
    assert _run(["ckpt", "digest", str(root / "model.pt"), "--chunk-size", "256K"]).returncode == 0
    bad = 2 * MiB + 300 * 1024  # in stripe 2
    corrupt_in_place(root / "model.pt", bad)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    port = free_port()
    mount = start_mount(Backend("local", str(root), root), mountpoint, tmp_path, "--metrics-address", f"127.0.0.1:{port}")
    try:
        mount.wait_ready()
        fd = os.open(mountpoint / "model.pt", os.O_RDONLY)
        try:
            assert os.pread(fd, MiB, 0) == data[:MiB]  # verified stripes are served
            with pytest.raises(OSError) as caught:
                os.pread(fd, 4096, bad - 100)
            assert caught.value.errno == errno.EIO
            assert os.pread(fd, 4096, 3 * MiB) == data[3 * MiB : 3 * MiB + 4096]
        finally:
            os.close(fd)
        with pytest.raises(OSError) as caught:
            (mountpoint / "model.pt").read_bytes()
        assert caught.value.errno == errno.EIO
        body = _metrics(port)
        assert _metric(body, 'bootseer_fetch_chunks_total{outcome="failed"}') >= 2
        assert _metric(body, 'bootseer_fetch_chunks_total{outcome="verified"}') >= 8
        assert _metric(body, 'bootseer_fetch_digest_lists_total{outcome="used"}') >= 1
    finally:
        mount.cleanup()
    assert "does not match the file's digest list" in mount.stderr


def test_a_list_of_another_version_is_ignored_by_the_mount_and_the_new_file_reads(tmp_path: Path) -> None:
    root = tmp_path / "source"
    root.mkdir()
    old, new = _content(33, 2 * MiB + 1), _content(34, 2 * MiB + 1)
    (root / "model.pt").write_bytes(old)
    assert _run(["ckpt", "digest", str(root / "model.pt"), "--chunk-size", "256K"]).returncode == 0
    (root / "model.pt").write_bytes(new)  # saved again, the list not rewritten
    (root / "config.json").write_bytes(b"{}")
    (root / ("config.json" + DIGESTS_SUFFIX)).write_bytes(b"not a digest list")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    port = free_port()
    mount = start_mount(Backend("local", str(root), root), mountpoint, tmp_path, "--metrics-address", f"127.0.0.1:{port}")
    try:
        mount.wait_ready()
        assert (mountpoint / "model.pt").read_bytes() == new
        assert (mountpoint / "config.json").read_bytes() == b"{}"  # a malformed list stops nothing
        body = _metrics(port)
        assert _metric(body, 'bootseer_fetch_digest_lists_total{outcome="ignored"}') >= 2
        assert _metric(body, 'bootseer_fetch_digest_lists_total{outcome="used"}') == 0
    finally:
        mount.cleanup()
    assert "digest list not used" in mount.stderr


def test_a_single_file_mount_verifies_against_the_list_beside_its_url(tmp_path: Path) -> None:
    data = _content(35, 2 * MiB + 9)
    (tmp_path / "model.pt").write_bytes(data)
    assert _run(["ckpt", "digest", str(tmp_path / "model.pt"), "--chunk-size", "256K"]).returncode == 0
    corrupt_in_place(tmp_path / "model.pt", 10)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = start_mount(Backend("local", str(tmp_path / "model.pt"), tmp_path), mountpoint, tmp_path)
    try:
        mount.wait_ready()
        with pytest.raises(OSError) as caught:
            (mountpoint / "model.pt").read_bytes()
        assert caught.value.errno == errno.EIO
    finally:
        mount.cleanup()
