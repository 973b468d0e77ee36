"""bootseer.fuse against the kernel: a small in-memory tree mounted for real.

pyfuse3 allows one FUSE session per process, so the filesystem runs in a child
process: this file doubles as that program (``python tests/fuse/test_fuse_plumbing.py
MOUNTPOINT``).  The helpers for running and always cleaning up a mount process
(:class:`MountProcess`, :func:`mount_entry`) live in :mod:`tests.support.mounts`.
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.mounts import (
    STOP_TIMEOUT_S,
    MountProcess,
    mount_entry,
    wait_unmounted,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

#: The checkout's root: the mount program is this module, run with ``python -m`` from there.
REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
MOUNT_PROGRAM = [PYTHON, "-m", "tests.fuse.test_fuse_plumbing"]

HELLO = b"hello world\n"
BIG = random.Random(1).randbytes(3 * 1024 * 1024 + 17)
MANY = 3000
FSNAME = "plumbing-test-source"
XATTRS = {"user.comment": b"hello", "trusted.overlay.opaque": b"y", "user.empty": b""}
OWN_INODE = (7 << 40) | 5
SUBTYPE = "bootseer-test"


# -- the filesystem under test (runs in the child process) ---------------------


def _serve_test_tree(mountpoint: str, grace: float, read_ahead_kb: int | None = None) -> int:
    import trio

    from bootseer.fuse import (
        Attributes,
        BytesFile,
        File,
        MountError,
        OpenFile,
        ReadOnlyOperations,
        Special,
        StaticDirectory,
        StaticSymlink,
        end_on_signals,
        mount_options,
        serve,
    )
    from bootseer.fuse.nodes import BytesOpenFile
    from bootseer.fuse.operations import REQUESTS
    from bootseer.log import setup_logging

    class Exploding(OpenFile):
        async def read(self, offset: int, size: int) -> bytes:
            raise RuntimeError("a bug in a read handler")

    class Hanging(OpenFile):
        async def read(self, offset: int, size: int) -> bytes:
            print("hanging read", flush=True)
            await trio.sleep_forever()
            raise AssertionError("unreachable")

    class Odd(File):
        def __init__(self, key: str, opened: type[OpenFile] | None, open_error: OSError | None = None) -> None:
            self.key = key
            self._opened = opened
            self._open_error = open_error

        def attributes(self):
            from bootseer.fuse import Attributes

            return Attributes(stat.S_IFREG | 0o444, size=1 << 20)

        async def open(self) -> OpenFile:
            if self._open_error is not None:
                raise self._open_error
            assert self._opened is not None
            return self._opened()

    class Tagged(BytesFile):
        """A file with extended attributes and an inode number of its own."""

        inode = OWN_INODE

        def xattrs(self):
            return XATTRS

    class RecordedOpenFile(OpenFile):
        keep_cache = True

        async def read(self, offset: int, size: int) -> bytes:
            print(f"read {offset} {size}", flush=True)
            return BIG[offset : offset + size]

    class Recorded(File):
        """BIG, printing every read the kernel sends (to see their sizes)."""

        key = "recorded.bin"

        def attributes(self):
            return Attributes(stat.S_IFREG | 0o444, size=len(BIG))

        async def open(self) -> OpenFile:
            return RecordedOpenFile()

    class CountsOpenFile(BytesOpenFile):
        keep_cache = False
        direct_io = True  # the size is not known up front

    class Counts(File):
        """The requests this mount has answered, by operation: ``op count`` lines."""

        key = "requests"

        def attributes(self):
            return Attributes(stat.S_IFREG | 0o444)

        async def open(self) -> OpenFile:
            counts = [
                f"{sample.labels['op']} {int(sample.value)}\n"
                for metric in REQUESTS.collect()
                for sample in metric.samples
                if sample.name.endswith("_total") and sample.labels["fs"] == "test"
            ]
            return CountsOpenFile("".join(counts).encode())

    class Frozen(StaticDirectory):
        immutable = True

        async def lookup(self, name: str):
            print(f"frozen lookup {name}", flush=True)
            return await super().lookup(name)

    mtime_ns = 1_600_000_000_123_456_789
    many = StaticDirectory("many", {f"f{i:05d}": BytesFile(f"many/{i}", b"%d\n" % i) for i in range(MANY)})
    deep = StaticDirectory("sub/deep", {"deep.txt": BytesFile("sub/deep/deep.txt", b"deep\n")})
    root = StaticDirectory(
        "",
        {
            "hello.txt": BytesFile("hello.txt", HELLO, mtime_ns=mtime_ns),
            "big.bin": BytesFile("big.bin", BIG),
            "link": StaticSymlink("link", "hello.txt"),
            "sub": StaticDirectory("sub", {"deep": deep}),
            "many": many,
            "exploding": Odd("exploding", Exploding),
            "hanging": Odd("hanging", Hanging),
            "forbidden": Odd("forbidden", None, PermissionError(errno.EACCES, "no")),
            "tagged": Tagged("tagged", HELLO),
            "null": Special("null", Attributes(stat.S_IFCHR | 0o666, rdev=os.makedev(1, 3))),
            "whiteout": Special("whiteout", Attributes(stat.S_IFCHR)),
            "frozen": Frozen("frozen", {"present": BytesFile("frozen/present", HELLO)}),
            "recorded.bin": Recorded(),
            "requests": Counts(),
        },
    )
    setup_logging("debug")
    ops = ReadOnlyOperations(
        root, name="test", entry_timeout=1, attr_timeout=1, negative_timeout=60, read_ahead_kb=read_ahead_kb
    )

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                options = mount_options(fsname=FSNAME, subtype=SUBTYPE)
                session = await nursery.start(lambda task_status: serve(ops, mountpoint, options=options, task_status=task_status))
                nursery.start_soon(lambda: end_on_signals(session, signals, grace=grace))
                print("ready", flush=True)

    status = 0
    try:
        trio.run(run)
    except* MountError as group:
        print(f"error: {group.exceptions[0]}", file=sys.stderr)
        status = 2
    return status


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--read-ahead-kb", type=int, default=None)
    args = parser.parse_args()
    return _serve_test_tree(args.mountpoint, args.grace, args.read_ahead_kb)


# -- tests -------------------------------------------------------------------------


def start_test_fs(mountpoint: Path, logdir: Path, *extra: str) -> MountProcess:
    return MountProcess([*MOUNT_PROGRAM, str(mountpoint), *extra], mountpoint, logdir,
                        "ready", cwd=REPO_ROOT)


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[MountProcess]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = start_test_fs(mountpoint, tmp_path, "--grace", "1")
    try:
        mount.wait_ready()
        yield mount
    finally:
        mount.cleanup()


def test_mount_table_shows_a_read_only_fuse_mount(fs: MountProcess) -> None:
    entry = mount_entry(fs.mountpoint)
    assert entry is not None
    assert entry.source == FSNAME
    assert entry.fstype == f"fuse.{SUBTYPE}"
    for option in ("ro", "nosuid", "nodev", "default_permissions"):
        assert option in entry.options
    assert "allow_other" not in entry.options  # off unless asked for
    vfs = os.statvfs(fs.mountpoint)
    assert vfs.f_flag & os.ST_RDONLY
    assert vfs.f_namemax == 255


def test_stat_lookup_and_symlink(fs: MountProcess) -> None:
    mnt = fs.mountpoint
    info = os.stat(mnt / "hello.txt")
    assert stat.S_ISREG(info.st_mode) and info.st_size == len(HELLO)
    assert info.st_mtime_ns == 1_600_000_000_123_456_789
    assert stat.S_ISDIR(os.stat(mnt / "sub" / "deep").st_mode)
    assert os.readlink(mnt / "link") == "hello.txt"
    assert (mnt / "link").read_bytes() == HELLO
    assert (mnt / "sub" / "deep" / "deep.txt").read_bytes() == b"deep\n"
    assert os.stat(mnt / "sub" / "deep" / ".." / "deep").st_ino == os.stat(mnt / "sub" / "deep").st_ino


def test_xattrs(fs: MountProcess) -> None:
    path = fs.mountpoint / "tagged"
    assert sorted(os.listxattr(path)) == sorted(XATTRS)
    for name, value in XATTRS.items():
        assert os.getxattr(path, name) == value
    with pytest.raises(OSError) as excinfo:
        os.getxattr(path, "user.missing")
    assert excinfo.value.errno == errno.ENODATA
    assert os.listxattr(fs.mountpoint / "hello.txt") == []
    with pytest.raises(OSError) as excinfo:
        os.getxattr(fs.mountpoint / "hello.txt", "trusted.overlay.opaque")
    assert excinfo.value.errno == errno.ENODATA


def test_device_nodes_and_own_inode_numbers(fs: MountProcess) -> None:
    null = os.lstat(fs.mountpoint / "null")
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)
    whiteout = os.lstat(fs.mountpoint / "whiteout")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.stat(fs.mountpoint / "tagged").st_ino == OWN_INODE
    with os.scandir(fs.mountpoint) as entries:
        assert {e.name: e.inode() for e in entries}["tagged"] == OWN_INODE
    # The mount is nodev: the device node is listed, never opened as a device.
    with pytest.raises(OSError):
        open(fs.mountpoint / "null", "rb").close()


def test_missing_names_in_immutable_directories_are_cached(fs: MountProcess) -> None:
    frozen = fs.mountpoint / "frozen"
    assert (frozen / "present").read_bytes() == HELLO
    for _ in range(3):
        with pytest.raises(FileNotFoundError):
            os.stat(frozen / "absent")
    assert fs.stdout.count("frozen lookup absent") == 1
    # Elsewhere a missing name is asked again every time (the tree may change).
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            os.stat(fs.mountpoint / "absent")


def test_files_opened_right_after_a_listing(fs: MountProcess) -> None:
    # readdirplus hands the kernel inodes without a lookup; opening them must work.
    assert "hello.txt" in os.listdir(fs.mountpoint)
    assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO
    assert (fs.mountpoint / "big.bin").read_bytes() == BIG
    assert os.listdir(fs.mountpoint / "sub" / "deep") == ["deep.txt"]
    assert (fs.mountpoint / "sub" / "deep" / "deep.txt").read_bytes() == b"deep\n"


def test_errors(fs: MountProcess) -> None:
    mnt = fs.mountpoint
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "missing")
    with pytest.raises(FileNotFoundError):
        (mnt / "sub" / "missing").read_bytes()
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "hello.txt")
    with pytest.raises(IsADirectoryError):
        (mnt / "sub").read_bytes()
    with pytest.raises(PermissionError):
        (mnt / "forbidden").read_bytes()
    with pytest.raises(OSError) as excinfo:
        os.readlink(mnt / "hello.txt")
    assert excinfo.value.errno == errno.EINVAL


@pytest.mark.parametrize(
    "attempt",
    [
        lambda mnt: open(mnt / "hello.txt", "r+b"),
        lambda mnt: open(mnt / "hello.txt", "ab"),
        lambda mnt: open(mnt / "new.txt", "wb"),
        lambda mnt: os.mkdir(mnt / "newdir"),
        lambda mnt: os.unlink(mnt / "hello.txt"),
        lambda mnt: os.rmdir(mnt / "sub"),
        lambda mnt: os.rename(mnt / "hello.txt", mnt / "renamed"),
        lambda mnt: os.chmod(mnt / "hello.txt", 0o777),
        lambda mnt: os.truncate(mnt / "hello.txt", 0),
        lambda mnt: os.symlink("x", mnt / "newlink"),
        lambda mnt: os.setxattr(mnt / "hello.txt", "user.k", b"v"),
    ],
)
def test_writes_are_refused_with_erofs(fs: MountProcess, attempt) -> None:
    with pytest.raises(OSError) as excinfo:
        attempt(fs.mountpoint)
    assert excinfo.value.errno == errno.EROFS
    assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO


def test_reads_are_byte_exact(fs: MountProcess) -> None:
    path = fs.mountpoint / "big.bin"
    assert path.read_bytes() == BIG
    rng = random.Random(7)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(200):
            offset = rng.randrange(0, len(BIG) + 10)
            size = rng.choice([1, 100, 4096, 65536, 300_000])
            assert os.pread(fd, size, offset) == BIG[offset : offset + size]
        assert os.pread(fd, 10, len(BIG) + 1000) == b""
    finally:
        os.close(fd)


def _requests(fs: MountProcess) -> dict[str, int]:
    """The requests the mount process has answered so far, by operation."""
    text = (fs.mountpoint / "requests").read_text()
    return {op: int(count) for op, count in (line.split() for line in text.splitlines())}


def test_flush_is_refused_once_and_the_kernel_stops_sending_it(fs: MountProcess) -> None:
    for _ in range(5):
        assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO  # close() succeeds
    first = _requests(fs)
    assert first["open"] >= 5
    # The first close() of the mount sent a flush, answered ENOSYS; none since.
    assert first["flush"] == 1
    for _ in range(5):
        assert (fs.mountpoint / "big.bin").read_bytes() == BIG
    second = _requests(fs)
    assert second["open"] >= first["open"] + 5
    assert second["flush"] == 1


def _read_sizes(mount: MountProcess) -> list[int]:
    return [int(line.split()[2]) for line in mount.stdout.splitlines() if line.startswith("read ")]


def test_a_raised_read_ahead_sends_fewer_larger_reads(tmp_path: Path) -> None:
    from bootseer.fuse.mount import read_ahead_path

    sizes: dict[int | None, list[int]] = {}
    read_ahead_kb: dict[int | None, int] = {}
    for asked in (None, 1024):
        mountpoint = tmp_path / f"mnt-{asked}"
        mountpoint.mkdir()
        extra = ["--read-ahead-kb", str(asked)] if asked else []
        mount = start_test_fs(mountpoint, tmp_path, "--grace", "1", *extra)
        try:
            mount.wait_ready()
            read_ahead_kb[asked] = int(Path(read_ahead_path(os.stat(mountpoint).st_dev)).read_text())
            # A program reading in order, 64 KiB at a time: the read-ahead sets the size
            # of what reaches the server.
            with open(mountpoint / "recorded.bin", "rb", buffering=0) as file:
                data = b"".join(iter(lambda: file.read(65536), b""))
            assert data == BIG
            sizes[asked] = _read_sizes(mount)
        finally:
            mount.cleanup()
    assert read_ahead_kb == {None: 128, 1024: 1024}
    assert max(sizes[None]) <= 128 * 1024 and len(sizes[None]) >= len(BIG) // (128 * 1024)
    assert max(sizes[1024]) == 1024 * 1024
    assert len(sizes[1024]) <= len(BIG) // (1024 * 1024) + 3
    assert sum(sizes[1024]) <= len(BIG) + 1024 * 1024  # nothing read twice


def test_large_directory_listing(fs: MountProcess) -> None:
    many = fs.mountpoint / "many"
    names = sorted(os.listdir(many))
    assert names == [f"f{i:05d}" for i in range(MANY)]
    # Inode numbers from readdir agree with those from stat.
    with os.scandir(many) as entries:
        sample = [entry for entry in entries if entry.name in ("f00000", "f01234", "f02999")]
    for entry in sample:
        assert entry.inode() == os.stat(entry.path).st_ino
        assert entry.is_file()
    assert (many / "f01234").read_bytes() == b"1234\n"
    # ls -a sees . and ..
    listed = subprocess.run(["ls", "-a", str(fs.mountpoint)], capture_output=True, text=True, check=True)
    assert listed.stdout.split()[:2] == [".", ".."]


def test_a_failing_handler_answers_eio_and_the_mount_stays_up(fs: MountProcess) -> None:
    with pytest.raises(OSError) as excinfo:
        (fs.mountpoint / "exploding").read_bytes()
    assert excinfo.value.errno == errno.EIO
    assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO
    assert fs.process.poll() is None


def test_concurrent_readers_while_one_read_hangs(fs: MountProcess) -> None:
    hanging = subprocess.Popen(
        ["cat", str(fs.mountpoint / "hanging")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while "hanging read" not in fs.stdout:
            assert time.monotonic() < deadline, "the hanging read never arrived"
            time.sleep(0.05)
        errors: list[BaseException] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            try:
                with open(fs.mountpoint / "big.bin", "rb", buffering=0) as file:
                    for _ in range(30):
                        offset = rng.randrange(len(BIG))
                        file.seek(offset)
                        assert file.read(8192) == BIG[offset : offset + 8192]
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors
        assert not any(thread.is_alive() for thread in threads)
        # SIGTERM while a read hangs: the grace period (1 s) runs out, the mount goes.
        fs.signal(signal.SIGTERM)
        assert fs.wait() == 0
        wait_unmounted(fs.mountpoint)
        assert hanging.wait(20) != 0
    finally:
        if hanging.poll() is None:
            hanging.kill()
            hanging.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_and_exits_zero(fs: MountProcess, signum: int) -> None:
    assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO
    fs.signal(signum)
    assert fs.wait() == 0
    wait_unmounted(fs.mountpoint)
    assert "unmounted" in fs.stderr


@pytest.mark.parametrize("command", [["umount"], ["fusermount3", "-u"]])
def test_external_unmount_ends_the_process(fs: MountProcess, command: list[str]) -> None:
    assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO
    subprocess.run([*command, str(fs.mountpoint)], check=True, timeout=30)
    assert fs.wait() == 0
    assert mount_entry(fs.mountpoint) is None


def test_unmount_with_open_file_when_signalled(fs: MountProcess) -> None:
    fd = os.open(fs.mountpoint / "big.bin", os.O_RDONLY)
    try:
        assert os.read(fd, 10) == BIG[:10]
        fs.signal(signal.SIGTERM)
        assert fs.wait() == 0
        wait_unmounted(fs.mountpoint)
    finally:
        try:
            os.close(fd)
        except OSError as exc:  # the server is gone: the kernel may fail the final flush
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)


def _run_to_exit(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def test_bad_mountpoints_are_refused_clearly(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = _run_to_exit([*MOUNT_PROGRAM, str(missing)], tmp_path)
    assert result.returncode == 2 and "does not exist" in result.stderr

    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = _run_to_exit([*MOUNT_PROGRAM, str(a_file)], tmp_path)
    assert result.returncode == 2 and "is not a directory" in result.stderr


def test_an_existing_mount_is_refused(fs: MountProcess, tmp_path: Path) -> None:
    result = _run_to_exit([*MOUNT_PROGRAM, str(fs.mountpoint)], tmp_path)
    assert result.returncode == 2 and "already a mount point" in result.stderr
    # The first mount is untouched.
    assert (fs.mountpoint / "hello.txt").read_bytes() == HELLO


def test_a_dead_mount_is_reported(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mount = start_test_fs(mountpoint, tmp_path)
    try:
        mount.wait_ready()
        mount.process.kill()  # no unmount: leaves a dead FUSE mount behind
        mount.process.wait(STOP_TIMEOUT_S)
        result = _run_to_exit([*MOUNT_PROGRAM, str(mountpoint)], tmp_path)
        assert result.returncode == 2
        assert "dead FUSE mount" in result.stderr or "already a mount point" in result.stderr
    finally:
        mount.cleanup()


if __name__ == "__main__":
    sys.exit(_main())
