"""The snapshot logic against real directories and real overlay/bind mounts (needs root)."""

from __future__ import annotations

import errno
import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.overlay import INDEX_PARAMETER
from bootseer.snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from bootseer.snapshotter.snapshots import Snapshotter
from bootseer.snapshotter.types import Info, Kind, Mount, Usage
from tests.support.snapshots import mounted, read_tree, snapshot_dirs, write_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

GC_ROOT = {"containerd.io/gc.root": "test"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def sn(root: Path):
    snapshotter = Snapshotter(root)
    yield snapshotter
    snapshotter.close()


def stored_ids(root: Path) -> dict[str, int]:
    """id -> kind, read straight from the metadata database."""
    with sqlite3.connect(root / "metadata.db") as db:
        return {str(id_): kind for id_, kind in db.execute("SELECT id, kind FROM snapshots")}


def assert_consistent(root: Path) -> None:
    """Every snapshot has its directories and every directory belongs to a snapshot."""
    ids = stored_ids(root)
    assert snapshot_dirs(root) == set(ids)
    for id_, kind in ids.items():
        assert (root / "snapshots" / id_ / "fs").is_dir()
        if kind != Kind.COMMITTED:  # a committed snapshot keeps the work dir of its active life
            assert (root / "snapshots" / id_ / "work").is_dir() == (kind == Kind.ACTIVE)


def option(mount: Mount, name: str) -> str:
    return next(o.split("=", 1)[1] for o in mount.options if o.startswith(name + "="))


def make_layer(sn: Snapshotter, name: str, parent: str, files: dict[str, str], work: Path) -> None:
    """Prepare, fill through the real mount, commit."""
    key = f"{name}-active"
    with mounted(sn.prepare(key, parent, GC_ROOT), work / key) as target:
        write_files(target, files)
    sn.commit(name, key, GC_ROOT)


# -- mounts and contents --------------------------------------------------------------------


def test_layers_whiteouts_and_opaque_dirs_through_real_mounts(sn: Snapshotter, root: Path, tmp_path: Path):
    make_layer(sn, "base", "", {"etc/hosts": "one", "keep": "k", "gone": "g", "opaque/old": "o"}, tmp_path)

    mounts = sn.prepare("top-active", "base", GC_ROOT)
    upper = Path(option(mounts[0], "upperdir"))
    with mounted(mounts, tmp_path / "top") as target:
        assert read_tree(target) == {"etc": "/", "etc/hosts": "one", "keep": "k", "gone": "g", "opaque": "/", "opaque/old": "o"}
        (target / "etc/hosts").write_text("two")
        (target / "gone").unlink()
        (target / "opaque/old").unlink()
        (target / "opaque").rmdir()
        (target / "opaque").mkdir()
        (target / "opaque/new").write_text("n")
        (target / "added").write_text("a")
    # overlayfs recorded the deletions in the upper dir; commit must take them as they are.
    whiteout = os.lstat(upper / "gone")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(upper / "opaque", "trusted.overlay.opaque") == b"y"
    sn.commit("top", "top-active", GC_ROOT)
    # root, etc, etc/hosts, gone (whiteout), opaque, opaque/new, added
    assert sn.usage("top").inodes == 7

    expected = {"etc": "/", "etc/hosts": "two", "keep": "k", "opaque": "/", "opaque/new": "n", "added": "a"}
    view = sn.view("top-view", "top")
    assert [m.type for m in view] == ["overlay"]
    with mounted(view, tmp_path / "view") as target:
        assert read_tree(target) == expected
        with pytest.raises(OSError) as raised:
            (target / "new").write_text("x")
        assert raised.value.errno == errno.EROFS

    with mounted(sn.prepare("next", "top"), tmp_path / "next") as target:
        assert read_tree(target) == expected


def test_mount_shapes_match_containerd_overlay(sn: Snapshotter, root: Path):
    index = ("index=off",) if os.path.exists(INDEX_PARAMETER) else ()
    snaps = root / "snapshots"
    assert sn.prepare("a") == [Mount("bind", f"{snaps}/1/fs", ("rw", "rbind"))]
    assert sn.view("v0") == [Mount("bind", f"{snaps}/2/fs", ("ro", "rbind"))]
    sn.commit("A", "a")
    sn.prepare("b", "A")
    sn.commit("B", "b")
    assert sn.view("v1", "A") == [Mount("bind", f"{snaps}/1/fs", ("ro", "rbind"))]
    assert sn.view("v2", "B") == [Mount("overlay", "overlay", index + (f"lowerdir={snaps}/3/fs:{snaps}/1/fs",))]
    active_mounts = sn.prepare("c", "B")
    assert active_mounts == [
        Mount(
            "overlay",
            "overlay",
            index + (f"workdir={snaps}/6/work", f"upperdir={snaps}/6/fs", f"lowerdir={snaps}/3/fs:{snaps}/1/fs"),
        )
    ]
    assert sn.mounts("c") == active_mounts
    assert sn.mounts("v2") == [Mount("overlay", "overlay", index + (f"lowerdir={snaps}/3/fs:{snaps}/1/fs",))]
    # A view has no work dir; an active snapshot has one.
    assert not (snaps / "5" / "work").exists() and (snaps / "6" / "work").is_dir()


def test_view_of_nothing_is_read_only_and_active_is_writable(sn: Snapshotter, tmp_path: Path):
    with mounted(sn.view("v"), tmp_path / "v") as target:
        with pytest.raises(OSError) as raised:
            (target / "x").write_text("x")
        assert raised.value.errno == errno.EROFS
    with mounted(sn.prepare("a"), tmp_path / "a") as target:
        (target / "x").write_text("x")
        assert os.stat(target).st_mode & 0o777 == 0o755


def test_new_layer_root_takes_owner_of_layer_below_and_modes_ignore_umask(sn: Snapshotter, root: Path, tmp_path: Path):
    old_umask = os.umask(0o077)
    try:
        mounts = sn.prepare("a")
        os.chown(mounts[0].source, 1, 1)
        sn.commit("A", "a")
        child = sn.prepare("b", "A")
    finally:
        os.umask(old_umask)
    upper = os.stat(option(child[0], "upperdir"))
    assert (upper.st_uid, upper.st_gid) == (1, 1)
    assert upper.st_mode & 0o777 == 0o755
    assert os.stat(option(child[0], "workdir")).st_mode & 0o777 == 0o711
    with mounted(child, tmp_path / "b") as target:
        assert os.stat(target).st_uid == 1


def test_128_layers(sn: Snapshotter, tmp_path: Path):
    parent = ""
    for i in range(128):
        mounts = sn.prepare(f"p{i}", parent)
        # Fill the layer's own directory: mounting 128 times is the conformance suite's job.
        upper = option(mounts[0], "upperdir") if parent else mounts[0].source
        Path(upper, "overwriteme").write_text(f"{i}")
        Path(upper, f"file-{i}").write_text("same")
        sn.commit(f"c{i}", f"p{i}")
        parent = f"c{i}"
    view = sn.view("full", parent)
    lowers = option(view[0], "lowerdir").split(":")
    assert len(lowers) == 128
    assert lowers[0].endswith("/snapshots/128/fs") and lowers[-1].endswith("/snapshots/1/fs")


# -- error kinds ------------------------------------------------------------------------


def test_create_errors(sn: Snapshotter, root: Path):
    sn.prepare("active")
    sn.prepare("to-commit")
    sn.commit("committed", "to-commit")
    sn.view("view", "committed")
    before = (sn.list(), snapshot_dirs(root))

    with pytest.raises(AlreadyExists):
        sn.prepare("active")
    with pytest.raises(AlreadyExists):
        sn.view("active", "committed")
    with pytest.raises(AlreadyExists):
        sn.prepare("committed")
    with pytest.raises(NotFound, match="missing parent"):
        sn.prepare("x", "no-such-parent")
    with pytest.raises(InvalidArgument, match="not committed"):
        sn.prepare("x", "active")
    with pytest.raises(InvalidArgument, match="not committed"):
        sn.view("x", "view")
    with pytest.raises(InvalidArgument, match="empty"):
        sn.prepare("")
    with pytest.raises(InvalidArgument, match="maximum size"):
        sn.prepare("x", labels={"k": "v" * 4096})

    # Nothing half-made is left behind, nothing existing is touched.
    assert (sn.list(), snapshot_dirs(root)) == before


def test_commit_errors_follow_overlay_order(sn: Snapshotter, root: Path):
    sn.prepare("a")
    sn.prepare("b")
    sn.commit("B", "b")
    sn.view("v", "B")
    before = (sn.list(), snapshot_dirs(root))

    with pytest.raises(NotFound):
        sn.commit("x", "missing")
    with pytest.raises(AlreadyExists):
        sn.commit("B", "a")
    with pytest.raises(AlreadyExists):
        sn.commit("v", "v")  # the name is taken before the kind is looked at, as in bolt.go
    with pytest.raises(FailedPrecondition, match="not active"):
        sn.commit("x", "v")
    with pytest.raises(FailedPrecondition, match="not active"):
        sn.commit("x", "B")
    with pytest.raises(InvalidArgument, match="maximum size"):
        sn.commit("x", "a", labels={"k" * 4000: "v" * 100})
    assert (sn.list(), snapshot_dirs(root)) == before
    sn.commit("x", "a")


def test_other_errors(sn: Snapshotter):
    sn.prepare("a")
    sn.commit("A", "a")
    sn.prepare("child", "A")
    for call in (sn.stat, sn.usage, sn.mounts, sn.remove):
        with pytest.raises(NotFound):
            call("missing")
    with pytest.raises(FailedPrecondition, match="not active or view"):
        sn.mounts("A")
    with pytest.raises(FailedPrecondition, match="remove"):
        sn.remove("A")
    with pytest.raises(NotFound):
        sn.update(Info("missing", "", Kind.ACTIVE, {"a": "b"}))
    with pytest.raises(InvalidArgument):
        sn.update(Info("A", "x", Kind.COMMITTED, {}), ["parent"])
    with pytest.raises(InvalidArgument):
        sn.list(["name=A"])
    assert sn.stat("A").kind is Kind.COMMITTED


def test_closed_snapshotter_refuses_work(root: Path):
    sn = Snapshotter(root)
    sn.close()
    sn.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        sn.stat("x")


def test_one_snapshotter_per_root(sn: Snapshotter, root: Path):
    with pytest.raises(FailedPrecondition, match=rf"in use by another snapshotter \(pid {os.getpid()}\)"):
        Snapshotter(root)


# -- metadata: stat, update, list -----------------------------------------------------------


def test_stat_and_update_like_the_conformance_suite(sn: Snapshotter):
    t1 = datetime.now(timezone.utc)
    sn.prepare("c1-a", "", GC_ROOT)
    sn.commit("c1", "c1-a", GC_ROOT)
    sn.prepare("c2-a", "c1", GC_ROOT)
    sn.commit("c2", "c2-a", GC_ROOT)
    sn.prepare("a1", "c2", GC_ROOT)
    sn.prepare("a2", "", GC_ROOT)
    sn.view("v1", "c2", GC_ROOT)
    sn.view("v2", "", GC_ROOT)
    t2 = datetime.now(timezone.utc)
    cases = {"c1": (Kind.COMMITTED, ""), "c2": (Kind.COMMITTED, "c1"), "a1": (Kind.ACTIVE, "c2"),
             "a2": (Kind.ACTIVE, ""), "v1": (Kind.VIEW, "c2"), "v2": (Kind.VIEW, "")}
    for name, (kind, parent) in cases.items():
        st = sn.stat(name)
        assert (st.name, st.kind, st.parent, st.labels) == (name, kind, parent, GC_ROOT)
        assert t1 <= st.created <= t2 and st.created == st.updated

        u1 = datetime.now(timezone.utc)
        wanted = {"l1": "v1", "l2": "v2", "l3": "v3", **GC_ROOT}
        st = sn.update(Info(name, "doesnotexist", Kind.UNKNOWN, wanted))
        u2 = datetime.now(timezone.utc)
        assert (st.name, st.kind, st.parent, st.labels) == (name, kind, parent, wanted)
        assert st.created == sn.stat(name).created and u1 <= st.updated <= u2

        st = sn.update(Info(name, "", kind, {"l1": "updated", "l4": "v4"}), ["labels.l1", "labels.l2"])
        assert st.labels == {"l1": "updated", "l3": "v3", **GC_ROOT}

        st = sn.update(Info(name, "", kind, {"l4": "v4", **GC_ROOT}), ["labels"])
        assert st.labels == {"l4": "v4", **GC_ROOT}
        assert sn.stat(name) == st

        with pytest.raises(InvalidArgument):
            sn.update(Info(name, "doesnotexist", kind, {}), ["parent"])
        with pytest.raises(InvalidArgument, match="maximum size"):
            sn.update(Info(name, "", kind, {"big": "x" * 5000}))
        assert sn.stat(name) == st


def test_commit_replaces_labels(sn: Snapshotter):
    sn.prepare("a", labels={"from-active": "1"})
    assert sn.stat("a").labels == {"from-active": "1"}
    sn.commit("A", "a", labels={"from-commit": "2", "empty": ""})
    assert sn.stat("A").labels == {"from-commit": "2"}


def test_list_with_filters_like_the_conformance_suite(sn: Snapshotter):
    root_label = {"containerd.io/gc.root": "check-walk"}
    sn.prepare("a-np", "", root_label)
    sn.prepare("p-tmp", "", root_label)
    sn.commit("p", "p-tmp", root_label)
    sn.prepare("a", "p", root_label)
    sn.view("v", "p", root_label)
    sn.prepare("p-wl-tmp", "", root_label)
    sn.commit("p-wl", "p-wl-tmp", {"l": "1", **root_label})
    sn.prepare("a-wl", "p-wl", {"l": "2", **root_label})
    sn.view("v-wl", "p-wl", {"l": "3", **root_label})
    sn.prepare("a-np-wl", "", {"l": "2", **root_label})
    sn.prepare("unlabelled")

    cases = [
        (['labels."containerd.io/gc.root"==check-walk'], ["a-np", "p", "a", "v", "p-wl", "a-wl", "v-wl", "a-np-wl"]),
        (['kind==active,labels."containerd.io/gc.root"==check-walk'], ["a-np", "a", "a-wl", "a-np-wl"]),
        (['kind==view,labels."containerd.io/gc.root"==check-walk'], ["v", "v-wl"]),
        (['kind==committed,labels."containerd.io/gc.root"==check-walk'], ["p", "p-wl"]),
        (["name==p", "name==a-np-wl"], ["p", "a-np-wl"]),
        (["name==a-wl,labels.l"], ["a-wl"]),
        (["parent==p"], ["a", "v"]),
        (['parent!="",labels."containerd.io/gc.root"==check-walk'], ["a", "v", "a-wl", "v-wl"]),
        (["labels.l"], ["p-wl", "a-wl", "v-wl", "a-np-wl"]),
        (["labels.l==2"], ["a-wl", "a-np-wl"]),
        (["name~=/^a-np/"], ["a-np", "a-np-wl"]),
        ([], ["a", "a-np", "a-np-wl", "a-wl", "p", "p-wl", "unlabelled", "v", "v-wl"]),
    ]
    for filters, expected in cases:
        assert [i.name for i in sn.list(filters)] == sorted(expected), filters
    assert sn.list(None) == sn.list([""])
    infos = {i.name: i for i in sn.list()}
    assert all(sn.stat(name) == info for name, info in infos.items())


def test_list_matches_filters_without_holding_the_metadata_lock(sn: Snapshotter, monkeypatch):
    from bootseer.snapshotter import snapshots

    sn.prepare("a", "", {"l": "1"})
    sn.prepare("b", "", {"l": "2"})
    seen_while_matching: list[str] = []
    real_adaptor = snapshots.snapshot_adaptor

    def adaptor_that_calls_stat(info):
        # Another thread's Stat must get through while a filter is being matched.
        worker = threading.Thread(target=lambda: seen_while_matching.append(sn.stat(info.name).name))
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "Stat blocked while List was matching a filter"
        return real_adaptor(info)

    monkeypatch.setattr(snapshots, "snapshot_adaptor", adaptor_that_calls_stat)
    assert [i.name for i in sn.list(["labels.l==2"])] == ["b"]
    assert seen_while_matching == ["a", "b"]


# -- usage --------------------------------------------------------------------------------


def du(path: str) -> Usage:
    """GNU du and find, as an independent measurement."""
    size = int(subprocess.run(["du", "-s", "-B1", path], check=True, capture_output=True, text=True).stdout.split()[0])
    inodes = subprocess.run(["find", path, "-printf", "%i\\n"], check=True, capture_output=True, text=True).stdout
    return Usage(size=size, inodes=len(set(inodes.split())))


def test_usage_active_walked_committed_stored(sn: Snapshotter, tmp_path: Path):
    fs = sn.prepare("a")[0].source
    assert sn.usage("a") == Usage(size=os.lstat(fs).st_blocks * 512, inodes=1)
    Path(fs, "big").write_bytes(os.urandom(100_000))
    os.link(Path(fs, "big"), Path(fs, "hardlink"))  # counted once
    os.symlink("big", Path(fs, "symlink"))
    Path(fs, "dir/sub").mkdir(parents=True)
    Path(fs, "dir/sub/small").write_text("x")
    os.mknod(Path(fs, "whiteout"), stat.S_IFCHR | 0o000, os.makedev(0, 0))
    measured = sn.usage("a")
    assert measured == du(fs)
    assert measured.inodes == 7  # root, big(+hardlink), symlink, dir, sub, small, whiteout
    assert measured.size >= 100_000

    sn.commit("A", "a")
    assert sn.usage("A") == measured
    Path(fs, "written-after-commit").write_bytes(os.urandom(50_000))
    assert sn.usage("A") == measured  # stored at commit time
    sn.view("v", "A")
    assert sn.usage("v") == Usage(0, 0)


# -- removal, cleanup, restart ------------------------------------------------------------


def test_remove_deletes_directories_and_keys_are_reusable(sn: Snapshotter, root: Path):
    sn.prepare("committed-a", "", GC_ROOT)
    sn.commit("committed-1", "committed-a", GC_ROOT)
    sn.prepare("reuse-1", "committed-1", GC_ROOT)
    sn.remove("reuse-1")
    sn.view("reuse-1", "committed-1", GC_ROOT)
    sn.remove("reuse-1")
    sn.prepare("reuse-1", "", GC_ROOT)
    sn.remove("committed-1")
    sn.commit("committed-1", "reuse-1", GC_ROOT)
    assert [i.name for i in sn.list()] == ["committed-1"]
    assert_consistent(root)


def test_cleanup_removes_only_unreferenced_directories(sn: Snapshotter, root: Path):
    sn.prepare("a")
    write_files(sn.mounts("a")[0].source, {"data": "kept"})
    snaps = root / "snapshots"
    for orphan in ("999", "new-abc123", "rm-77", "rm-1-deadbeef"):
        write_files(snaps / orphan, {"fs/junk": "junk"})
    (snaps / "stray-file").write_text("x")
    sn.cleanup()
    assert snapshot_dirs(root) == {"1"}
    assert Path(sn.mounts("a")[0].source, "data").read_text() == "kept"
    sn.cleanup()
    assert_consistent(root)


def test_reopen_keeps_everything(root: Path, tmp_path: Path):
    sn = Snapshotter(root)
    try:
        make_layer(sn, "base", "", {"f": "base"}, tmp_path)
        sn.prepare("active", "base", {"l": "1"})
        sn.view("view", "base")
        state = (sn.list(), sn.mounts("active"), sn.mounts("view"), sn.usage("base"))
    finally:
        sn.close()
    sn = Snapshotter(root)
    try:
        assert sn.restore() == []
        assert (sn.list(), sn.mounts("active"), sn.mounts("view"), sn.usage("base")) == state
        with mounted(sn.mounts("active"), tmp_path / "again") as target:
            assert read_tree(target) == {"f": "base"}
        sn.prepare("fresh")
        assert sn.mounts("fresh")[0].source.endswith("/snapshots/4/fs")  # ids are never reused
    finally:
        sn.close()
    assert_consistent(root)


def test_restore_reports_missing_directories(sn: Snapshotter, root: Path):
    sn.prepare("a")
    sn.commit("A", "a")
    sn.prepare("b", "A")
    os.rmdir(root / "snapshots/2/work")
    problems = sn.restore()
    assert len(problems) == 1 and "'b'" in problems[0] and "work" in problems[0]
    assert sn.restore() == problems  # idempotent


# -- concurrency and crashes --------------------------------------------------------------


def test_concurrent_calls_from_threads(sn: Snapshotter, root: Path):
    sn.prepare("base-a")
    sn.commit("base", "base-a")
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def worker(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            try:
                sn.prepare("contended", "base")
                outcomes.append("created")
            except AlreadyExists:
                outcomes.append("exists")
            for i in range(8):
                sn.prepare(f"t{n}-{i}", "base", {"worker": str(n)})
                sn.stat(f"t{n}-{i}")
                sn.usage(f"t{n}-{i}")
                sn.commit(f"c{n}-{i}", f"t{n}-{i}")
                sn.list([f"labels.worker=={n}", "kind==committed"])
                sn.view(f"v{n}-{i}", f"c{n}-{i}")
                sn.remove(f"v{n}-{i}")
                if i % 2:
                    sn.remove(f"c{n}-{i}")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert sorted(outcomes) == ["created"] + ["exists"] * 7
    assert len(sn.list(["kind==committed"])) == 1 + 8 * 4
    assert_consistent(root)


CRASH_CHILD = r"""
import os, signal, sys
from bootseer.snapshotter.snapshots import Snapshotter

root, operation = sys.argv[1], sys.argv[2]
sn = Snapshotter(root)
real_rename = os.rename

def rename_then_die(src, dst):
    # Die the hard way right after the directory moved, before the metadata commits.
    real_rename(src, dst)
    os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename_then_die
if operation == "prepare":
    sn.prepare("doomed", "base")
elif operation == "remove":
    sn.remove("victim")
"""


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def test_killed_between_rename_and_commit_of_prepare(root: Path, tmp_path: Path):
    sn = Snapshotter(root)
    make_layer(sn, "base", "", {"f": "base"}, tmp_path)
    sn.close()

    result = run_child(CRASH_CHILD, str(root), "prepare")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert snapshot_dirs(root) == {"1", "2"}  # the new directory made it, its metadata did not

    sn = Snapshotter(root)
    try:
        with pytest.raises(NotFound):
            sn.stat("doomed")
        write_files(root / "snapshots/2/fs", {"stale": "must not show up"})
        # The rolled-back id comes round again: the stale directory must not leak into it.
        mounts = sn.prepare("doomed", "base")
        assert os.listdir(option(mounts[0], "upperdir")) == []
        sn.cleanup()
        assert_consistent(root)
    finally:
        sn.close()


def test_killed_between_rename_and_commit_of_remove(root: Path, tmp_path: Path):
    sn = Snapshotter(root)
    make_layer(sn, "base", "", {"f": "base"}, tmp_path)
    write_files(option(sn.prepare("victim", "base")[0], "upperdir"), {"v": "data"})
    sn.close()

    result = run_child(CRASH_CHILD, str(root), "remove")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert snapshot_dirs(root) == {"1", "rm-2"}

    sn = Snapshotter(root)
    try:
        assert sn.stat("victim").kind is Kind.ACTIVE  # the removal never committed
        sn.cleanup()  # must not delete the directory of a live snapshot
        assert_consistent(root)
        with mounted(sn.mounts("victim"), tmp_path / "victim") as target:
            assert read_tree(target) == {"f": "base", "v": "data"}
        sn.remove("victim")
        assert_consistent(root)
    finally:
        sn.close()


def test_restore_recovers_an_interrupted_remove(sn: Snapshotter, root: Path):
    sn.prepare("a")
    os.rename(root / "snapshots/1", root / "snapshots/rm-1")
    assert sn.restore() == []
    assert_consistent(root)


CHURN_CHILD = r"""
import random, sys
from bootseer.snapshotter.errors import SnapshotError
from bootseer.snapshotter.snapshots import Snapshotter

sn = Snapshotter(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
n = 0
while True:
    n += 1
    try:
        keys = [i.name for i in sn.list()]
        committed = [i.name for i in sn.list(["kind==committed"])]
        active = [i.name for i in sn.list(["kind==active"])]
        choice = rng.random()
        if choice < 0.35 or not keys:
            mounts = sn.prepare(f"a{n}", rng.choice(committed) if committed and rng.random() < 0.7 else "")
            upper = mounts[0].source if mounts[0].type == "bind" else mounts[0].options[-2].split("=", 1)[1]
            open(f"{upper}/file{n}", "w").write("x" * rng.randrange(10000))
        elif choice < 0.6 and active:
            sn.commit(f"c{n}", rng.choice(active))
        elif choice < 0.7 and committed:
            sn.view(f"v{n}", rng.choice(committed))
        else:
            sn.remove(rng.choice(keys))
    except SnapshotError:
        pass  # e.g. removing a parent: expected refusals
"""


def test_kill_9_at_random_points_then_cleanup_is_consistent(root: Path):
    rng = random.Random(20240601)
    for round_ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", CHURN_CHILD, str(root), str(round_)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            threading.Event().wait(rng.uniform(0.2, 1.0))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL  # it was still churning

        sn = Snapshotter(root)
        try:
            sn.restore()
            sn.cleanup()
            assert_consistent(root)
            for info in sn.list(["kind!=committed"]):
                sn.mounts(info.name)  # every parent chain resolves
        finally:
            sn.close()
    assert stored_ids(root)  # the churn did build something


def test_chain_locks_do_not_outlive_their_prepares(tmp_path: Path) -> None:
    """Each ChainID a Prepare names (containerd.io/snapshot.ref) is locked while its layer is
    looked up, mounted or released; the snapshotter must not keep a lock for every ChainID
    it was ever asked about (every layer of every image pulled in the daemon's life)."""
    from bootseer.images.chains import chain_id
    from bootseer.snapshotter.snapshots import REF_LABEL
    from tests.support.snapshots import DirectoryLayers

    converted = chain_id("", "sha256:" + "a" * 64)
    layers = DirectoryLayers(tmp_path / "store", tmp_path / "mnt")
    layers.convert(converted, "", {"a": "base"})
    sn = Snapshotter(tmp_path / "root", layers)
    try:
        unknown = [f"sha256:{n:064x}" for n in range(40)]
        chains = unknown + unknown[:10] + [converted] * 3  # some asked for twice at once

        def prepare(n: int, chain: str) -> None:
            try:
                sn.prepare(f"extract-{n}", "", {REF_LABEL: chain})  # not converted: an ordinary snapshot
            except AlreadyExists:
                pass  # the converted layer: a remote snapshot committed under its ChainID

        threads = [threading.Thread(target=prepare, args=(n, chain)) for n, chain in enumerate(chains)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sn.stat(converted).kind is Kind.COMMITTED
        assert len([info for info in sn.list() if info.kind is Kind.ACTIVE]) == len(unknown) + 10
        assert len(sn._chain_locks) == 0
        sn.remove(converted)  # releases the layer, under its lock
        assert not os.path.ismount(layers.lower_dir(converted))
        assert len(sn._chain_locks) == 0
    finally:
        sn.close()
        layers.close()


def test_a_prepares_requests_for_the_layer_server_go_in_one_round_trip_and_one_an_answer_changed_goes_again(
    tmp_path: Path,
) -> None:
    """The observers' requests of a container's Prepare go to the backend together, once every observer has seen
    the container (a dependency layer's mount, then the hot-list notice naming the layer the reads start at);
    when an answer changes what a later request says (the mount failed: the reads start at the image again),
    that request is sent once more, on its own, and its observer is given both answers."""
    from bootseer.snapshotter.backend import ControlRequest
    from bootseer.snapshotter.errors import LayerUnavailable
    from bootseer.snapshotter.observers import PreparedContainer, ServerRequest
    from tests.support.snapshots import DirectoryLayers

    class Counted(DirectoryLayers):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.round_trips: list[list[dict[str, Any]]] = []

        def send(self, requests: Any) -> Any:
            self.round_trips.append([request.fields for request in requests])
            return super().send(requests)

    class Stacking:  # a dependency layer's observer, whose layer is not in the store
        def container_prepared(self, container: PreparedContainer) -> None:
            container.reads_start_at = "sha256:deps"

            def answered(answer: Any) -> None:
                assert isinstance(answer, LayerUnavailable) and answer.reason == "not_converted"
                container.reads_start_at = container.parent

            mount = ControlRequest({"op": "mount", "chain_id": "sha256:deps"}, 300.0)
            container.requests.append(ServerRequest(lambda: mount, answered))

        def snapshot_removed(self, *args: Any) -> None: ...
        def lowers(self, upper: str) -> list[str]: return []
        def holds_layer(self, chain_id: str) -> bool: return False

    class Noticing:  # the hot lists' observer
        def __init__(self) -> None:
            self.answers: list[Any] = []

        def container_prepared(self, container: PreparedContainer) -> None:
            container.requests.append(ServerRequest(
                lambda: ControlRequest({"op": "notice", "key": container.key, "parent": container.reads_start_at}, 2.0),
                self.answers.append))

        def snapshot_removed(self, *args: Any) -> None: ...
        def lowers(self, upper: str) -> list[str]: return []
        def holds_layer(self, chain_id: str) -> bool: return False

    layers = Counted(tmp_path / "store", tmp_path / "mnt")
    sn = Snapshotter(tmp_path / "root", layers)
    noticing = Noticing()
    sn.observe(Stacking())
    sn.observe(noticing)
    try:
        sn.prepare("image-extract", "")
        sn.commit("image", "image-extract")
        layers.round_trips.clear()
        sn.prepare("container", "image")
        assert layers.round_trips == [
            [{"op": "mount", "chain_id": "sha256:deps"}, {"op": "notice", "key": "container", "parent": "sha256:deps"}],
            [{"op": "notice", "key": "container", "parent": "image"}],
        ]
        assert noticing.answers[-2:] == [{}, {}]
    finally:
        sn.close()
        layers.close()
