"""The crash-safe metadata of snapshots: which keys exist, their kind, parent, labels.

This is containerd's ``snapshots/storage`` (bolt.go) on sqlite: the same records, the
same rules and the same error kinds, so that containerd and its conformance suite
cannot tell the difference.  Every snapshotter operation runs in exactly one
transaction (:meth:`MetaStore.read` or :meth:`MetaStore.write`); the database runs in
WAL mode with ``synchronous=FULL``, so a committed operation survives a crash and an
interrupted one leaves no trace.

Each snapshot has an ``id`` that never changes (committing renames the key, the id
stays) and names its directory on disk; ids come from an AUTOINCREMENT sequence, so a
deleted snapshot's id is never handed out again once committed.  ``backing`` says what
serves a snapshot's contents: a plain directory (``"dir"``) or a layer served lazily
by the layer server (``"remote"``: ``remote_ref`` is its ChainID, ``remote_dir`` the
lower directory the server gave).  ``state`` is ``"ready"`` except while a remote
layer is being mounted (``"mounting"``): the mount runs between two transactions,
never inside one, and a row left ``"mounting"`` by a crash is undone at restore.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

from .errors import AlreadyExists, CorruptMetadata, FailedPrecondition, InvalidArgument, NotFound, SchemaTooNew
from .types import Info, Kind, Usage

#: Bumped whenever the tables change; :class:`MetaStore` migrates older databases.
SCHEMA_VERSION = 2

#: containerd's ``labels.Validate`` limit: a label's key and value together, in bytes.
MAX_LABEL_SIZE = 4096

BACKING_DIR = "dir"
BACKING_REMOTE = "remote"

STATE_READY = "ready"
STATE_MOUNTING = "mounting"

_SCHEMA = """
CREATE TABLE snapshots (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    key        TEXT    NOT NULL UNIQUE,
    kind       INTEGER NOT NULL CHECK (kind IN (1, 2, 3)),
    parent_id  INTEGER REFERENCES snapshots (id) ON DELETE RESTRICT,
    backing    TEXT    NOT NULL DEFAULT 'dir',
    created_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    size       INTEGER NOT NULL DEFAULT 0,
    inodes     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX snapshots_by_parent ON snapshots (parent_id);
CREATE TABLE labels (
    snapshot_id INTEGER NOT NULL REFERENCES snapshots (id) ON DELETE CASCADE,
    key         TEXT    NOT NULL,
    value       TEXT    NOT NULL,
    PRIMARY KEY (snapshot_id, key)
) WITHOUT ROWID;
"""

#: The steps from each version to the next (version 1 is :data:`_SCHEMA`).
_MIGRATIONS: dict[int, str] = {
    # Remote snapshots: the two-phase mount's state, the ChainID and its lower dir.
    2: """
ALTER TABLE snapshots ADD COLUMN state TEXT NOT NULL DEFAULT 'ready' CHECK (state IN ('ready', 'mounting'));
ALTER TABLE snapshots ADD COLUMN remote_ref TEXT NOT NULL DEFAULT '';
ALTER TABLE snapshots ADD COLUMN remote_dir TEXT NOT NULL DEFAULT '';
CREATE INDEX snapshots_by_remote_ref ON snapshots (remote_ref) WHERE remote_ref != '';
""",
}


@dataclass(frozen=True)
class Layer:
    """A snapshot as the on-disk logic sees it: where it lives and what serves it."""

    id: str
    backing: str
    remote_ref: str = ""  #: the ChainID, for a remote layer
    remote_dir: str = ""  #: the layer server's lower dir, for a remote layer


@dataclass(frozen=True)
class Snapshot:
    """An active or view snapshot with its parent chain, closest parent first."""

    id: str
    kind: Kind
    backing: str
    parents: tuple[Layer, ...]


@dataclass(frozen=True)
class Record:
    """One stored snapshot, for recovery scans."""

    id: str
    key: str
    kind: Kind
    backing: str
    state: str = STATE_READY
    remote_ref: str = ""
    remote_dir: str = ""

    @property
    def layer(self) -> Layer:
        return Layer(self.id, self.backing, self.remote_ref, self.remote_dir)


def validate_labels(labels: dict[str, str] | None) -> None:
    """containerd's ``labels.Validate`` for every label: key+value at most 4096 bytes."""
    for key, value in (labels or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgument(f"label {key!r}: keys and values must be strings")
        if len(key.encode()) + len(value.encode()) > MAX_LABEL_SIZE:
            raise InvalidArgument(
                f"label key and value greater than maximum size ({MAX_LABEL_SIZE} bytes), key: {key[:10]}"
            )


def _now_ns() -> int:
    # Rounded up to whole microseconds: ``datetime`` holds no more, and rounding up
    # keeps "updated" at or after the moment the caller asked.
    return -(-time.time_ns() // 1000) * 1000


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _datetime(ns: int) -> datetime:
    return _EPOCH + timedelta(microseconds=ns // 1000)


class MetaStore:
    """The metadata database at ``path``; transactions are serialized across threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # One connection used under one lock: transactions are short (the slow work,
        # walking a layer for its disk usage, happens outside them), and a single
        # writer is what sqlite allows anyway.
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            with self.write() as tx:
                tx.migrate()
            # A database damaged past its header reads fine until a page is touched.
            problem = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if problem != "ok":
                raise sqlite3.DatabaseError(problem)
        except sqlite3.DatabaseError as exc:
            self.close()
            raise CorruptMetadata(
                f"metadata database {str(self.path)!r} cannot be read ({exc}): it is damaged or not a "
                "bootseer-snapshotter database; restore it from a backup or move it aside to start empty"
            ) from None
        except BaseException:
            self.close()
            raise

    @contextmanager
    def read(self) -> Iterator[Transaction]:
        """A consistent read-only view; nothing it does is kept."""
        with self._transaction("BEGIN") as tx:
            yield tx

    @contextmanager
    def write(self) -> Iterator[Transaction]:
        """A write transaction: committed when the block ends, rolled back if it raises.

        The caller changes the on-disk directories inside the block, so that a failed
        commit can still be undone on disk (the commit itself raises out of the block).
        """
        with self._transaction("BEGIN IMMEDIATE") as tx:
            yield tx

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[Transaction]:
        with self._lock:
            if self._db is None:
                raise FailedPrecondition(f"metadata store {self.path} is closed")
            db = self._db
            db.execute(begin)
            try:
                yield Transaction(db)
                db.execute("ROLLBACK" if begin == "BEGIN" else "COMMIT")
            except BaseException:
                if db.in_transaction:  # a failed COMMIT can leave it open
                    db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        """Close the database; closing twice is fine."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class Transaction:
    """The operations of bolt.go, inside one open transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def migrate(self) -> None:
        self._db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = self._db.execute("SELECT max(version) FROM schema_version").fetchone()
        version = row[0] or 0
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"metadata database schema version {version} is newer than this snapshotter supports "
                f"({SCHEMA_VERSION}): it was written by a newer bootseer; upgrade bootseer to use this root"
            )
        steps = {1: _SCHEMA, **_MIGRATIONS}
        for step in range(version + 1, SCHEMA_VERSION + 1):
            # Statement by statement: executescript() would commit the open transaction.
            for statement in steps[step].split(";"):
                if statement.strip():
                    self._db.execute(statement)
        if version < SCHEMA_VERSION:
            self._db.execute("DELETE FROM schema_version")
            self._db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))

    # -- reads -------------------------------------------------------------------

    def get_info(self, key: str) -> tuple[str, Info, Usage]:
        """The id, info and stored usage of the snapshot ``key`` (any kind)."""
        row = self._db.execute(
            "SELECT s.id, s.kind, coalesce(p.key, ''), s.created_ns, s.updated_ns, s.size, s.inodes "
            "FROM snapshots s LEFT JOIN snapshots p ON p.id = s.parent_id WHERE s.key = ?",
            (key,),
        ).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        id_, kind, parent, created, updated, size, inodes = row
        info = Info(
            name=key,
            parent=parent,
            kind=Kind(kind),
            labels=self._labels(id_),
            created=_datetime(created),
            updated=_datetime(updated),
        )
        return str(id_), info, Usage(size=size, inodes=inodes)

    def get_snapshot(self, key: str) -> Snapshot:
        """The active or view snapshot ``key`` with its parent chain."""
        row = self._db.execute("SELECT id, kind, backing, parent_id FROM snapshots WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        id_, kind, backing, parent_id = row
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise FailedPrecondition(f"requested snapshot {key!r} not active or view")
        return Snapshot(str(id_), Kind(kind), backing, self._chain(parent_id))

    def all_info(self) -> list[Info]:
        """Every snapshot's info, ordered by key.

        Filtering is the caller's, after the transaction: matching a filter must never
        hold the one lock every RPC waits on.
        """
        labels: dict[int, dict[str, str]] = {}
        for snapshot_id, key, value in self._db.execute("SELECT snapshot_id, key, value FROM labels"):
            labels.setdefault(snapshot_id, {})[key] = value
        return [
            Info(
                name=key,
                parent=parent,
                kind=Kind(kind),
                labels=labels.get(id_, {}),
                created=_datetime(created),
                updated=_datetime(updated),
            )
            for id_, key, kind, parent, created, updated in self._db.execute(
                "SELECT s.id, s.key, s.kind, coalesce(p.key, ''), s.created_ns, s.updated_ns "
                "FROM snapshots s LEFT JOIN snapshots p ON p.id = s.parent_id ORDER BY s.key"
            )
        ]

    def id_map(self) -> dict[str, str]:
        """Every snapshot id mapped to its key."""
        return {str(id_): key for id_, key in self._db.execute("SELECT id, key FROM snapshots")}

    def records(self) -> list[Record]:
        return [
            Record(str(id_), key, Kind(kind), backing, state, remote_ref, remote_dir)
            for id_, key, kind, backing, state, remote_ref, remote_dir in self._db.execute(
                "SELECT id, key, kind, backing, state, remote_ref, remote_dir FROM snapshots ORDER BY id"
            )
        ]

    def remote_users(self, chain_id: str) -> list[str]:
        """The keys of every snapshot (any state) served by, or mounting, the remote layer ``chain_id``."""
        return [key for (key,) in self._db.execute("SELECT key FROM snapshots WHERE remote_ref = ?", (chain_id,))]

    # -- writes ------------------------------------------------------------------

    def create_snapshot(
        self,
        kind: Kind,
        key: str,
        parent: str,
        labels: dict[str, str] | None,
        backing: str = BACKING_DIR,
        remote_ref: str = "",
    ) -> Snapshot:
        """Record a new active or view snapshot ``key`` on top of the committed ``parent``.

        With ``remote_ref`` the snapshot is the first phase of a remote one: recorded
        ``"mounting"`` until :meth:`commit_active` (with ``remote_dir``) or
        :meth:`abandon_remote` ends the second phase.
        """
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise InvalidArgument(
                f"snapshot type {kind.name} invalid; only snapshots of type Active or View can be created"
            )
        if not key:
            raise InvalidArgument("snapshot key must not be empty")
        validate_labels(labels)
        parent_id = None
        if parent:
            row = self._db.execute("SELECT id, kind FROM snapshots WHERE key = ?", (parent,)).fetchone()
            if row is None:
                raise NotFound(f"missing parent {parent!r}")
            if row[1] != Kind.COMMITTED:
                raise InvalidArgument(f"parent {parent!r} is not committed snapshot")
            parent_id = row[0]
        if self._db.execute("SELECT 1 FROM snapshots WHERE key = ?", (key,)).fetchone():
            raise AlreadyExists(f"snapshot {key!r} already exists")
        now = _now_ns()
        state = STATE_MOUNTING if remote_ref else STATE_READY
        cursor = self._db.execute(
            "INSERT INTO snapshots (key, kind, parent_id, backing, created_ns, updated_ns, state, remote_ref) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key, int(kind), parent_id, backing, now, now, state, remote_ref),
        )
        id_ = cursor.lastrowid
        self._write_labels(id_, labels)
        return Snapshot(str(id_), kind, backing, self._chain(parent_id))

    def commit_active(
        self,
        key: str,
        name: str,
        usage: Usage,
        labels: dict[str, str] | None,
        expected_id: str | None = None,
        remote_dir: str | None = None,
    ) -> str:
        """Turn the active snapshot ``key`` into the committed ``name``; returns its id.

        The labels replace the active snapshot's (they are not inherited).  With
        ``expected_id``, fail unless ``key`` is still the snapshot whose usage the
        caller measured.  ``remote_dir`` ends a remote snapshot's mount: the committed
        snapshot is ``"ready"``, served from that lower directory.
        """
        if not name:
            raise InvalidArgument("committed snapshot name must not be empty")
        validate_labels(labels)
        if self._db.execute("SELECT 1 FROM snapshots WHERE key = ?", (name,)).fetchone():
            raise AlreadyExists(f"committed snapshot {name!r} already exists")
        row = self._db.execute("SELECT id, kind FROM snapshots WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"failed to get active snapshot {key!r}")
        id_, kind = row
        if kind != Kind.ACTIVE:
            raise FailedPrecondition(f"snapshot {key!r} is not active")
        if expected_id is not None and str(id_) != expected_id:
            raise FailedPrecondition(f"snapshot {key!r} was removed and recreated while being committed")
        now = _now_ns()
        self._db.execute(
            "UPDATE snapshots SET key = ?, kind = ?, created_ns = ?, updated_ns = ?, size = ?, inodes = ? "
            "WHERE id = ?",
            (name, int(Kind.COMMITTED), now, now, usage.size, usage.inodes, id_),
        )
        if remote_dir is not None:
            self._db.execute(
                "UPDATE snapshots SET backing = ?, state = ?, remote_dir = ? WHERE id = ?",
                (BACKING_REMOTE, STATE_READY, remote_dir, id_),
            )
        self._write_labels(id_, labels)
        return str(id_)

    def abandon_remote(self, key: str, expected_id: str) -> None:
        """End a ``"mounting"`` snapshot's second phase without the layer: it becomes a plain active snapshot."""
        self._db.execute(
            "UPDATE snapshots SET state = ?, remote_ref = '', remote_dir = '' WHERE key = ? AND id = ? AND state = ?",
            (STATE_READY, key, expected_id, STATE_MOUNTING),
        )

    def set_remote_dir(self, id_: str, remote_dir: str) -> None:
        """Record where the layer server serves a remote snapshot now (restore re-mounts)."""
        self._db.execute("UPDATE snapshots SET remote_dir = ? WHERE id = ?", (remote_dir, id_))

    def remove(self, key: str) -> tuple[str, Kind, str]:
        """Forget the snapshot ``key``; returns its id, kind and ChainID if remote (else "")."""
        row = self._db.execute("SELECT id, kind, remote_ref FROM snapshots WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        id_, kind, remote_ref = row
        if self._db.execute("SELECT 1 FROM snapshots WHERE parent_id = ? LIMIT 1", (id_,)).fetchone():
            raise FailedPrecondition(f"cannot remove snapshot {key!r} with child")
        self._db.execute("DELETE FROM snapshots WHERE id = ?", (id_,))
        return str(id_), Kind(kind), remote_ref

    def update_info(self, info: Info, fieldpaths: list[str] | None) -> Info:
        """Change the mutable fields (labels) of ``info.name``, as containerd's UpdateInfo.

        No field paths replace all labels; ``labels`` does too; ``labels.<key>`` sets or
        (given an empty or missing value) deletes one label; any other path is an error.
        """
        row = self._db.execute("SELECT id FROM snapshots WHERE key = ?", (info.name,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {info.name!r} does not exist")
        id_ = row[0]
        _, current, _ = self.get_info(info.name)
        wanted = dict(info.labels or {})
        if fieldpaths:
            labels = dict(current.labels)
            for path in fieldpaths:
                if path.startswith("labels."):
                    label = path[len("labels.") :]
                    labels[label] = wanted.get(label, "")
                elif path == "labels":
                    labels = dict(wanted)
                else:
                    raise InvalidArgument(f"cannot update {path!r} field on snapshot {info.name!r}")
        else:
            labels = wanted
        validate_labels(labels)
        now = _now_ns()
        self._db.execute("UPDATE snapshots SET updated_ns = ? WHERE id = ?", (now, id_))
        self._write_labels(id_, labels)
        _, updated, _ = self.get_info(info.name)
        return updated

    # -- helpers -----------------------------------------------------------------

    def _labels(self, snapshot_id: int) -> dict[str, str]:
        return dict(self._db.execute("SELECT key, value FROM labels WHERE snapshot_id = ?", (snapshot_id,)))

    def _write_labels(self, snapshot_id: int, labels: dict[str, str] | None) -> None:
        # An empty value deletes the label, as containerd's boltutil.WriteLabels does.
        self._db.execute("DELETE FROM labels WHERE snapshot_id = ?", (snapshot_id,))
        self._db.executemany(
            "INSERT INTO labels (snapshot_id, key, value) VALUES (?, ?, ?)",
            [(snapshot_id, k, v) for k, v in (labels or {}).items() if v != ""],
        )

    def _chain(self, parent_id: int | None) -> tuple[Layer, ...]:
        """The layers from ``parent_id`` down to the base, closest first."""
        if parent_id is None:
            return ()
        rows = self._db.execute(
            "WITH RECURSIVE chain (id, backing, remote_ref, remote_dir, parent_id, depth) AS ("
            " SELECT id, backing, remote_ref, remote_dir, parent_id, 0 FROM snapshots WHERE id = ?"
            " UNION ALL"
            " SELECT s.id, s.backing, s.remote_ref, s.remote_dir, s.parent_id, chain.depth + 1"
            " FROM snapshots s JOIN chain ON s.id = chain.parent_id"
            ") SELECT id, backing, remote_ref, remote_dir FROM chain ORDER BY depth",
            (parent_id,),
        ).fetchall()
        return tuple(Layer(str(id_), backing, ref, directory) for id_, backing, ref, directory in rows)

