"""A container (or whoever writes a prefix) must never reach the host through bootseer, which runs as root.

Real directories, real symlinks swapped in with ``renameat2(RENAME_EXCHANGE)``, real
captures into a real ``file://`` store, a real snapshotter's marks and markers, the
hot-list recorder's seal marker: a root-only "host secret" next to the tree must never
be read, uploaded, written to or listed.  Each case runs with ``openat2`` and with the
component walk used where the kernel has none.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import zstandard

from bootseer import confined
from bootseer.blockstore.objects.store import open_store_writer
from bootseer.depsnap.capture import CaptureError, publish_capture, scan, upper_change
from tests.profile.test_profile import spool  # noqa: F401 - the fixture: profiling on, into a fresh spool

FILES = 64
SIZE = 4096
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(a: Path, b: Path) -> None:
    """Swap two names atomically (each always exists), as a hostile container does."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a))


@pytest.fixture(params=["openat2", "component-walk"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways :mod:`bootseer.confined` resolves a path: openat2, and the walk for kernels without it."""
    monkeypatch.setattr(confined, "use_openat2", request.param == "openat2")
    return str(request.param)


@pytest.fixture
def secret(tmp_path: Path) -> bytes:
    """A root-only host file of the size of the tree's files (random: no block of it is a tree's block)."""
    data = os.urandom(SIZE)
    path = tmp_path / "host" / "secret"
    path.parent.mkdir()
    path.write_bytes(data)
    os.chmod(path, 0o600)
    os.chmod(path.parent, 0o700)
    return data


def store_holds(store: Path, secret: bytes) -> list[str]:
    """The store objects whose bytes, raw or zstd-decompressed (packs are frames of blocks), contain ``secret``."""
    found = []
    for path in store.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        try:
            plain = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
        except zstandard.ZstdError:
            plain = b""
        if secret in data or secret in plain:
            found.append(str(path.relative_to(store)))
    return found


def container_tree(tmp_path: Path, secret: bytes) -> tuple[Path, Path]:
    """An upper directory of FILES regular files of the secret's size, and a stash of symlinks to the secret."""
    upper, stash = tmp_path / "upper", tmp_path / "stash"
    (upper / "pkg").mkdir(parents=True)
    stash.mkdir()
    for n in range(FILES):
        (upper / "pkg" / f"m{n}.py").write_bytes(os.urandom(SIZE))
        os.symlink(tmp_path / "host" / "secret", stash / f"m{n}.py")
    return upper, stash


def capture(upper: Path, store: Path, tree: dict | None = None) -> None:
    tree = scan(upper) if tree is None else tree
    with open_store_writer(str(store)) as writer:
        publish_capture(writer, key="d" * 64, root=upper, tree=tree, change=upper_change(tree), mode="container",
                        parent="sha256:" + "a" * 64, overlay_upper=True)  # fmt: skip


def test_files_swapped_for_symlinks_between_scan_and_read_upload_nothing(tmp_path: Path, secret: bytes,
                                                                         resolution: str) -> None:  # fmt: skip
    """The swap exactly between the scan and the read: the capture is refused before anything is put."""
    upper, stash = container_tree(tmp_path, secret)
    tree = scan(upper)
    for n in range(FILES):
        exchange(upper / "pkg" / f"m{n}.py", stash / f"m{n}.py")
    store = tmp_path / "store"
    with pytest.raises(CaptureError) as refused:
        capture(upper, store, tree)
    assert store_holds(store, secret) == []
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))  # refused before any put
    assert "not the file the scan saw (now a symlink" in str(refused.value)


def test_a_directory_swapped_for_a_symlink_to_a_host_directory_uploads_nothing(tmp_path: Path, secret: bytes,
                                                                               resolution: str) -> None:  # fmt: skip
    """A symlink in an intermediate component (``pkg`` -> the host's directory holding the secret)."""
    upper, _ = container_tree(tmp_path, secret)
    tree = scan(upper)
    os.rename(upper / "pkg", tmp_path / "pkg-aside")
    os.symlink(tmp_path / "host", upper / "pkg")
    for n in range(FILES):
        (tmp_path / "host" / f"m{n}.py").write_bytes(secret)  # host files under the scanned names
    store = tmp_path / "store"
    with pytest.raises(CaptureError) as refused:
        capture(upper, store, tree)
    assert store_holds(store, secret) == []
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))
    assert "changed while it was captured" in str(refused.value)


FLIPPER = textwrap.dedent("""
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    upper, stash, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pairs = [(os.fsencode(f"{upper}/pkg/m{n}.py"), os.fsencode(f"{stash}/m{n}.py")) for n in range(count)]
    deadline = time.monotonic() + 120  # never outlives a broken test
    first = True
    while time.monotonic() < deadline:
        for a, b in pairs:
            if libc.renameat2(-100, a, -100, b, 2) != 0:
                sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
        if first:
            print("flipping", flush=True)
            first = False
""")


@pytest.fixture
def flipper(tmp_path: Path, secret: bytes) -> Iterator[Path]:
    """A process flipping every file of the container's tree between itself and a symlink to the secret."""
    upper, stash = container_tree(tmp_path, secret)
    child = subprocess.Popen([sys.executable, "-c", FLIPPER, str(upper), str(stash), str(FILES)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "flipping\n"
        yield upper
    finally:
        child.kill()
        child.wait()


def test_a_container_flipping_files_and_symlinks_during_real_captures_never_gets_host_bytes_stored(
        tmp_path: Path, secret: bytes, flipper: Path) -> None:  # fmt: skip
    """The attack as tried: 64 names flipping (RENAME_EXCHANGE) through five captures; no round stores a
    byte of the secret (each capture is refused, or publishes the container's own files and links)."""
    store = tmp_path / "store"
    for round_ in range(5):
        try:
            capture(flipper, store)
        except CaptureError:
            pass
        assert store_holds(store, secret) == [], f"round {round_}"


# -- markers and marks in /.bootseer -----------------------------------------------------------


def marks_dir_to_host(upper: Path, tmp_path: Path) -> Path:
    """``/.bootseer`` of the container made a symlink to a host directory (holding a valid-looking mark)."""
    host = tmp_path / "host-dir"
    host.mkdir()
    (host / "first_step").write_text(json.dumps({"t": 1.0, "pid": 1, "attrs": {"stolen": "host data"}}) + "\n")
    (host / "deps-done").write_text("")
    if (upper / ".bootseer").exists():
        (upper / ".bootseer").rmdir()
    os.symlink(host, upper / ".bootseer")
    return host


def test_the_capture_marker_is_not_written_through_a_symlinked_marks_dir(tmp_path: Path, resolution: str) -> None:
    """``/.bootseer`` -> a host directory: the deps-captured marker lands nowhere outside the upper dir,
    and a deps-done there is no marker."""
    from bootseer.snapshotter import deps_hooks as containerd

    upper = tmp_path / "snap" / "fs"
    (upper / "pkg").mkdir(parents=True)
    (upper / "pkg" / "mod.py").write_text("x = 1\n")
    host = marks_dir_to_host(upper, tmp_path)
    before = sorted(os.listdir(host))
    context = containerd.DepsContext(store_url=str(tmp_path / "store"), publish_store=str(tmp_path / "store"))
    watch = containerd._Watch(context, "ns/1/job", "e" * 64, "sha256:" + "a" * 64, str(upper), {})
    assert containerd.capture_container(watch) == "published"
    assert sorted(os.listdir(host)) == before
    assert (upper / ".bootseer").is_symlink()
    containerd._neither(str(upper), "test")  # logs that it cannot write the marker
    with pytest.raises(OSError):
        containerd._marker(str(upper), containerd.HIT_MARKER, "k")
    assert sorted(os.listdir(host)) == before
    assert not containerd._done_marker_present(str(upper))  # the watcher's test: a deps-done there is no marker


def test_marks_are_not_read_through_a_symlinked_marks_dir(spool: Path, tmp_path: Path, resolution: str) -> None:
    """``bootseer profile collect`` (live marks) and the harvest at removal read nothing from a host directory
    that ``/.bootseer`` names."""
    from bootseer.profile.events import read_spool
    from bootseer.profile.trace import collect
    from bootseer.snapshotter.snapshots import Snapshotter

    snap = Snapshotter(tmp_path / "root")
    try:
        snap.prepare("ns/1/base-extract", "")
        snap.commit("base", "ns/1/base-extract")
        snap.prepare("ns/3/job-1", "base")
        (upper,) = [u for u in (tmp_path / "root" / "snapshots").glob("*/fs") if (u / ".bootseer").exists()]
        marks_dir_to_host(upper, tmp_path)
        assert [e.name for e in collect(spool, since=0).events if e.name.startswith("mark.")] == []
        snap.remove("ns/3/job-1")
        spooled = [e for e in read_spool(spool)[0] if e.name.startswith("mark.")]
        assert spooled == []
        assert (tmp_path / "host-dir" / "first_step").exists()  # the removal deleted the link, not the target
    finally:
        snap.close()


def test_marks_that_are_symlinks_or_fifos_are_not_read(tmp_path: Path, resolution: str) -> None:
    from bootseer.profile.events import read_marks

    marks = tmp_path / "marks"
    marks.mkdir()
    (marks / "first_step").write_text("")
    os.symlink("/etc/hostname", marks / "linked")
    os.mkfifo(marks / "piped")
    assert [name for name, *_ in read_marks(marks)] == ["first_step"]


# -- the hot-list seal marker --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["container upper", "restored prefix upper"])
def test_a_seal_marker_that_is_a_symlink_does_not_seal(tmp_path: Path, where: str, resolution: str) -> None:
    """``/.bootseer-seal`` (a container's, or ``PREFIX/.bootseer-seal`` in a restored prefix's upper) counts
    only as a regular file: a symlink (to a host file, or dangling) is no marker and is never followed."""
    from bootseer.hotlist.recorder import Recording

    upper = tmp_path / ("snap/fs" if where == "container upper" else "deps/mounts/0123/upper")
    upper.mkdir(parents=True)
    recording = Recording(container="c", image="sha256:" + "b" * 64, profile="", layers=[], started=0.0,
                          upper=str(upper), any_reader=where != "container upper")  # fmt: skip
    assert not recording.marker_present()
    os.symlink(tmp_path / "host-file", upper / ".bootseer-seal")
    (tmp_path / "host-file").write_text("")
    assert not recording.marker_present()
    os.unlink(upper / ".bootseer-seal")
    (upper / ".bootseer-seal").write_text("")
    assert recording.marker_present()


# -- the module itself ---------------------------------------------------------------------------


def test_confined_writes_replace_a_symlink_and_refuse_one_as_a_directory(tmp_path: Path, resolution: str) -> None:
    root, host = tmp_path / "root", tmp_path / "host"
    root.mkdir()
    host.mkdir()
    (host / "target").write_text("host")
    os.symlink(host / "target", root / "name")
    with confined.opened_dir(root) as fd:
        confined.write_file(fd, "name", b"ours")  # the link in the way is replaced, not followed
        assert (root / "name").read_bytes() == b"ours" and not (root / "name").is_symlink()
        os.symlink(host, root / "dir")
        with pytest.raises(OSError):
            confined.write_file(fd, "dir/file", b"x")
        with pytest.raises(OSError):
            confined.open_beneath(fd, "dir/target", os.O_RDONLY)
        with pytest.raises(ValueError):
            confined.open_beneath(fd, "../host/target", os.O_RDONLY)
    assert (host / "target").read_text() == "host" and sorted(os.listdir(host)) == ["target"]
