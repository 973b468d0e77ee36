"""The metadata store on its own: bolt.go's rules on a real sqlite file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from bootseer.snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from bootseer.snapshotter.metastore import SCHEMA_VERSION, Layer, MetaStore
from bootseer.snapshotter.types import Info, Kind, Usage


@pytest.fixture
def ms(tmp_path: Path):
    store = MetaStore(tmp_path / "metadata.db")
    yield store
    store.close()


def build_chain(ms: MetaStore, depth: int) -> list[str]:
    """Committed c0 <- c1 <- ... ; returns their ids."""
    ids, parent = [], ""
    for i in range(depth):
        with ms.write() as tx:
            tx.create_snapshot(Kind.ACTIVE, f"a{i}", parent, None)
            ids.append(tx.commit_active(f"a{i}", f"c{i}", Usage(10 * i, i), {"n": str(i)}))
        parent = f"c{i}"
    return ids


def test_database_settings_and_schema_version(ms: MetaStore, tmp_path: Path):
    db = sqlite3.connect(tmp_path / "metadata.db")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        db.close()
    assert ms._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert ms._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_newer_schema_is_refused(tmp_path: Path):
    MetaStore(tmp_path / "metadata.db").close()
    with sqlite3.connect(tmp_path / "metadata.db") as db:
        db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.close()
    with pytest.raises(FailedPrecondition, match="newer"):
        MetaStore(tmp_path / "metadata.db")


def test_parent_chain_closest_first_and_commit_keeps_the_id(ms: MetaStore):
    ids = build_chain(ms, 4)
    assert ids == ["1", "2", "3", "4"]
    with ms.write() as tx:
        snapshot = tx.create_snapshot(Kind.VIEW, "v", "c3", {"a": "b"})
    assert snapshot.kind is Kind.VIEW and snapshot.id == "5"
    assert snapshot.parents == tuple(Layer(i, "dir") for i in reversed(ids))
    with ms.read() as tx:
        assert tx.get_snapshot("v") == snapshot
        id_, info, usage = tx.get_info("c2")
    assert (id_, info.parent, info.kind, info.labels, usage) == ("3", "c1", Kind.COMMITTED, {"n": "2"}, Usage(20, 2))


def test_a_failed_block_leaves_no_trace(ms: MetaStore):
    with pytest.raises(RuntimeError):
        with ms.write() as tx:
            tx.create_snapshot(Kind.ACTIVE, "a", "", {"x": "y"})
            raise RuntimeError("disk trouble")
    with ms.read() as tx:
        assert tx.all_info() == []
        with pytest.raises(NotFound):
            tx.get_info("a")


def test_ids_are_never_reused(tmp_path: Path):
    """Not after a remove, and not after the store is closed and opened again (a new process): an id is the
    name of a snapshot's directory, and a reused one could meet a directory a crash left behind."""
    store = MetaStore(tmp_path / "metadata.db")
    with store.write() as tx:
        tx.create_snapshot(Kind.ACTIVE, "a", "", None)
        last = tx.create_snapshot(Kind.ACTIVE, "b", "", None).id
        tx.remove("b")  # the newest: an id taken as "the largest one in use, plus one" would come back
    with store.write() as tx:
        again = tx.create_snapshot(Kind.ACTIVE, "c", "", None).id
        tx.remove("c")
    store.close()
    reopened = MetaStore(tmp_path / "metadata.db")
    try:
        with reopened.write() as tx:
            after = tx.create_snapshot(Kind.ACTIVE, "d", "", None).id
    finally:
        reopened.close()
    assert len({last, again, after}) == 3
    assert int(after) > int(again) > int(last)


def test_errors_like_bolt(ms: MetaStore):
    build_chain(ms, 2)
    with ms.write() as tx:
        tx.create_snapshot(Kind.ACTIVE, "active", "c1", None)
        tx.create_snapshot(Kind.VIEW, "view", "c1", None)
    cases = [
        (lambda tx: tx.create_snapshot(Kind.COMMITTED, "x", "", None), InvalidArgument),
        (lambda tx: tx.create_snapshot(Kind.ACTIVE, "active", "", None), AlreadyExists),
        (lambda tx: tx.create_snapshot(Kind.ACTIVE, "x", "nope", None), NotFound),
        (lambda tx: tx.create_snapshot(Kind.ACTIVE, "x", "active", None), InvalidArgument),
        (lambda tx: tx.commit_active("missing", "x", Usage(0, 0), None), NotFound),
        (lambda tx: tx.commit_active("missing", "c0", Usage(0, 0), None), AlreadyExists),
        (lambda tx: tx.commit_active("view", "x", Usage(0, 0), None), FailedPrecondition),
        (lambda tx: tx.commit_active("active", "x", Usage(0, 0), None, expected_id="999"), FailedPrecondition),
        (lambda tx: tx.remove("missing"), NotFound),
        (lambda tx: tx.remove("c0"), FailedPrecondition),
        (lambda tx: tx.get_snapshot("c0"), FailedPrecondition),
        (lambda tx: tx.get_snapshot("missing"), NotFound),
        (lambda tx: tx.update_info(Info("missing", "", Kind.ACTIVE), None), NotFound),
        (lambda tx: tx.update_info(Info("c0", "", Kind.COMMITTED), ["kind"]), InvalidArgument),
        (lambda tx: tx.update_info(Info("c0", "", Kind.COMMITTED, {"k": "v" * 4096}), None), InvalidArgument),
    ]
    for call, error in cases:
        with pytest.raises(error):
            with ms.write() as tx:
                call(tx)
    with ms.read() as tx:
        assert [i.name for i in tx.all_info()] == ["active", "c0", "c1", "view"]


def test_labels_empty_values_delete_and_sizes_are_bytes(ms: MetaStore):
    with ms.write() as tx:
        tx.create_snapshot(Kind.ACTIVE, "a", "", {"keep": "1", "drop": ""})
        # 4096 bytes exactly is allowed; one multi-byte character more is not.
        tx.update_info(Info("a", "", Kind.ACTIVE, {"k": "v" * 4095}), ["labels.k"])
        with pytest.raises(InvalidArgument):
            tx.update_info(Info("a", "", Kind.ACTIVE, {"k": "v" * 4094 + "é"}), ["labels.k"])
        info = tx.update_info(Info("a", "", Kind.ACTIVE, {}), ["labels.keep"])
    assert info.labels == {"k": "v" * 4095}


def test_persists_across_reopen(tmp_path: Path):
    ms = MetaStore(tmp_path / "metadata.db")
    build_chain(ms, 3)
    with ms.read() as tx:
        before = tx.all_info()
    ms.close()
    ms.close()
    ms = MetaStore(tmp_path / "metadata.db")
    try:
        with ms.read() as tx:
            assert tx.all_info() == before
            assert tx.id_map() == {"1": "c0", "2": "c1", "3": "c2"}
    finally:
        ms.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        with ms.read():
            pass


def test_version_1_database_is_migrated_keeping_every_snapshot(tmp_path: Path):
    from bootseer.snapshotter import metastore

    path = tmp_path / "metadata.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in metastore._SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute("INSERT INTO schema_version (version) VALUES (1)")
    db.execute("INSERT INTO snapshots (key, kind, created_ns, updated_ns, size) VALUES ('old', 3, 1000, 1000, 42)")
    db.close()

    ms = MetaStore(path)
    try:
        with ms.read() as tx:
            (record,) = tx.records()
            assert (record.key, record.kind, record.backing, record.state, record.remote_ref) == (
                "old", Kind.COMMITTED, "dir", "ready", "",
            )  # fmt: skip
            assert tx.get_info("old")[2] == Usage(42, 0)
    finally:
        ms.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    db.close()
