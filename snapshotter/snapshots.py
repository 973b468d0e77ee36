"""The snapshot logic: containerd's overlay snapshotter, metadata and directories changed together.

Layout under ``root``::

    metadata.db              the metadata (:mod:`.metastore`)
    lock                     flock'ed while a Snapshotter has the root open (holds its pid)
    snapshots/               one directory per snapshot
    snapshots/<id>/fs        a snapshot's contents (overlay upperdir, or the bind source)
    snapshots/<id>/work      overlay workdir (active snapshots only)
    snapshots/new-*          a snapshot being created (renamed to <id> inside its transaction)
    snapshots/rm-<id>        a snapshot being removed (renamed aside inside its transaction)

Every operation is one metadata transaction, and the directories change inside it the
way ``overlay.go`` does: a new snapshot is built under a temporary name and renamed into
place before the metadata commits; a removed one is renamed aside before the metadata
commits and deleted after.  If the commit fails both are undone; if the process dies in
between, the directory names say what happened, and :meth:`Snapshotter.cleanup` (or
:meth:`Snapshotter.restore`) puts things right: a directory no snapshot refers to is
deleted, a ``rm-<id>`` whose snapshot still exists is moved back.

Where a snapshot's contents are served from goes through :meth:`Snapshotter.lower_dir`,
keyed by the snapshot's ``backing`` (today always a plain directory), so that a layer
served lazily from a FUSE mount only has to answer that question differently.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

from bootseer.log import get_logger

from .errors import FailedPrecondition, NotFound, RootLocked
from .filters import parse_all as parse_filters
from .filters import snapshot_adaptor
from .metastore import BACKING_DIR, Layer, MetaStore, Snapshot
from .mounts import snapshot_mounts, supports_index_off
from .types import Info, Kind, Mount, Usage

log = get_logger(__name__)

_NEW_PREFIX = "new-"
_REMOVED_PREFIX = "rm-"


class Snapshotter:
    """Thread-safe: the gRPC server calls it from many threads."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._snapshots_dir = self.root / "snapshots"
        self._snapshots_dir.mkdir(mode=0o700, exist_ok=True)
        db_path = self.root / "metadata.db"
        # One snapshotter per root, as bolt's exclusive file lock ensures for containerd.
        # The lock is a file of its own: an fd of metadata.db opened and closed beside
        # sqlite's own would drop sqlite's POSIX locks.  It holds the holder's pid, for
        # the message a second one gets.
        self._lock_fd: int | None = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._lock_fd)
            raise RootLocked(f"snapshotter root {self.root} is in use by another snapshotter (pid {holder})") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        try:
            self._ms = MetaStore(db_path)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._index_off = supports_index_off()

    # -- containerd's Snapshotter interface -------------------------------------

    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        """Create the active (writable) snapshot ``key`` on top of the committed ``parent``."""
        return self._create(Kind.ACTIVE, key, parent, labels)

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        """Create the read-only view ``key`` of the committed ``parent``."""
        return self._create(Kind.VIEW, key, parent, labels)

    def mounts(self, key: str) -> list[Mount]:
        """The mounts of the active or view snapshot ``key`` again."""
        with self._ms.read() as tx:
            snapshot = tx.get_snapshot(key)
        return self._mounts(snapshot)

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        """Turn the active snapshot ``key`` into the committed, read-only snapshot ``name``.

        The labels given replace the active snapshot's.  The disk usage is measured once
        here (the snapshot must be unmounted by now) and stored with it.
        """
        with self._ms.read() as tx:
            id_, info, _ = tx.get_info(key)
        # Walking the layer may take a while: do it outside the transaction, and have
        # the commit check that ``key`` still is the snapshot measured.
        usage = self._measure(key, id_) if info.kind is Kind.ACTIVE else Usage(0, 0)
        with self._ms.write() as tx:
            tx.commit_active(key, name, usage, labels, expected_id=id_)
        log.debug("snapshot committed", key=key, name=name, id=id_, size=usage.size, inodes=usage.inodes)

    def remove(self, key: str) -> None:
        """Remove the snapshot ``key`` (it must have no children) and its directory."""
        aside: Path | None = None
        try:
            with self._ms.write() as tx:
                id_, kind = tx.remove(key)
                aside = self._set_aside(id_)
        except BaseException:
            if aside is not None:
                # The metadata still has the snapshot: its directory goes back too.
                os.rename(aside, self._snapshot_dir(id_))
            raise
        log.debug("snapshot removed", key=key, id=id_, kind=kind.name.lower())
        if aside is not None:
            _remove_tree(aside)

    def stat(self, key: str) -> Info:
        with self._ms.read() as tx:
            return tx.get_info(key)[1]

    def update(self, info: Info, fieldpaths: list[str] | None = None) -> Info:
        """Change the labels of ``info.name``: all of them, or those named ``labels.<key>``."""
        with self._ms.write() as tx:
            return tx.update_info(info, fieldpaths)

    def list(self, filters: list[str] | None = None) -> list[Info]:
        """The snapshots that match any of ``filters`` (containerd filter syntax)."""
        match = parse_filters(filters)
        with self._ms.read() as tx:
            infos = tx.all_info()
        # Outside the transaction: the metadata lock serves every other call meanwhile.
        return [info for info in infos if match.match(snapshot_adaptor(info))]

    def usage(self, key: str) -> Usage:
        """Disk usage: walked now for an active snapshot, as stored at commit otherwise."""
        with self._ms.read() as tx:
            id_, info, usage = tx.get_info(key)
        if info.kind is Kind.ACTIVE:
            return self._measure(key, id_)
        return usage

    def cleanup(self) -> None:
        """Delete the directories that no snapshot refers to (left by crashes or failed deletes)."""
        garbage = []
        with self._ms.write() as tx:
            ids = tx.id_map()
            self._recover_interrupted_removals(ids)
            for entry in os.listdir(self._snapshots_dir):
                if entry in ids:
                    continue
                # Renamed while the transaction holds off new snapshots, so a later
                # snapshot given the same id cannot be deleted by mistake.
                trash = self._snapshots_dir / f"{_REMOVED_PREFIX}{entry}-{uuid.uuid4().hex[:8]}"
                os.rename(self._snapshots_dir / entry, trash)
                garbage.append(trash)
            _fsync_dir(self._snapshots_dir)
        for path in garbage:
            log.info("removing unreferenced snapshot directory", path=str(path))
            _remove_tree(path)

    def restore(self) -> list[str]:
        """Re-establish what a restart needs, once at daemon start; safe to call again.

        Today snapshots are plain directories: this finishes interrupted removals the
        metadata never saw (moving their directory back) and checks that every
        snapshot's directories exist.  Returns the problems found (each also logged).
        """
        problems = []
        with self._ms.write() as tx:
            self._recover_interrupted_removals(tx.id_map())
            records = tx.records()
        for record in records:
            needed = [self.lower_dir(Layer(record.id, record.backing))]
            if record.kind is Kind.ACTIVE:
                needed.append(str(self._work_path(record.id)))
            for path in needed:
                if not os.path.isdir(path):
                    problem = f"snapshot {record.key!r} ({record.kind.name.lower()}, id {record.id}): {path} is missing"
                    log.error("snapshot directory missing", key=record.key, id=record.id, path=path)
                    problems.append(problem)
        log.info("snapshots restored", snapshots=len(records), problems=len(problems))
        return problems

    def close(self) -> None:
        """Close the metadata and release the root; closing twice is fine."""
        self._ms.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- where things live ---------------------------------------------------------

    def lower_dir(self, layer: Layer) -> str:
        """The directory that serves ``layer``'s contents to the layers above it."""
        if layer.backing == BACKING_DIR:
            return str(self._upper_path(layer.id))
        raise FailedPrecondition(f"snapshot id {layer.id} has unknown backing {layer.backing!r}")

    def _snapshot_dir(self, id_: str) -> Path:
        return self._snapshots_dir / id_

    def _upper_path(self, id_: str) -> Path:
        return self._snapshots_dir / id_ / "fs"

    def _work_path(self, id_: str) -> Path:
        return self._snapshots_dir / id_ / "work"

    def _measure(self, key: str, id_: str) -> Usage:
        """The disk usage of an active snapshot's upper dir, walked outside any transaction."""
        try:
            return disk_usage(self._upper_path(id_))
        except FileNotFoundError:
            # Removed by another call meanwhile: say so, as if the walk had come later.
            with self._ms.read() as tx:
                if tx.get_info(key)[0] != id_:
                    raise NotFound(f"snapshot {key!r} was removed while its usage was measured") from None
            raise

    def _mounts(self, snapshot: Snapshot) -> list[Mount]:
        return snapshot_mounts(
            snapshot.kind,
            upper=str(self._upper_path(snapshot.id)),
            work=str(self._work_path(snapshot.id)),
            lowers=[self.lower_dir(layer) for layer in snapshot.parents],
            index_off=self._index_off,
        )

    # -- directory changes inside transactions -------------------------------------

    def _create(self, kind: Kind, key: str, parent: str, labels: dict[str, str] | None) -> list[Mount]:
        new: str | None = None
        placed: Path | None = None
        try:
            with self._ms.write() as tx:
                # Made inside the transaction, so cleanup() never sees it half-built.
                new = self._new_directory(kind)
                snapshot = tx.create_snapshot(kind, key, parent, labels)
                if snapshot.parents:
                    # The new layer's root takes the owner of the layer below, as overlay.go does.
                    below = os.stat(self.lower_dir(snapshot.parents[0]))
                    os.lchown(os.path.join(new, "fs"), below.st_uid, below.st_gid)
                target = self._snapshot_dir(snapshot.id)
                if os.path.lexists(target):
                    # Left by a crash after the rename but before the commit, whose id the
                    # rolled-back sequence hands out again: nothing refers to it.
                    log.warning("removing stale snapshot directory", path=str(target))
                    _remove_tree(target)
                os.rename(new, target)
                new, placed = None, target
                _fsync_dir(self._snapshots_dir)
        except BaseException:
            for path in (new, placed):
                if path is not None:
                    _remove_tree(path)
            raise
        log.debug("snapshot created", key=key, parent=parent, id=snapshot.id, kind=kind.name.lower())
        return self._mounts(snapshot)

    def _new_directory(self, kind: Kind) -> str:
        path = tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=self._snapshots_dir)
        try:
            # Explicit modes: the daemon's umask must not change what containers see.
            os.mkdir(os.path.join(path, "fs"))
            os.chmod(os.path.join(path, "fs"), 0o755)
            if kind is Kind.ACTIVE:
                os.mkdir(os.path.join(path, "work"))
                os.chmod(os.path.join(path, "work"), 0o711)
        except BaseException:
            _remove_tree(path)
            raise
        return path

    def _set_aside(self, id_: str) -> Path | None:
        """Rename a removed snapshot's directory to ``rm-<id>``; None if it had none."""
        source = self._snapshot_dir(id_)
        aside = self._snapshots_dir / f"{_REMOVED_PREFIX}{id_}"
        if os.path.lexists(aside):
            _remove_tree(aside)
        try:
            os.rename(source, aside)
        except FileNotFoundError:
            log.warning("removed snapshot had no directory", id=id_, path=str(source))
            return None
        _fsync_dir(self._snapshots_dir)
        return aside

    def _recover_interrupted_removals(self, ids: dict[str, str]) -> None:
        """Move ``rm-<id>`` back to ``<id>`` where the remove never committed.

        Call inside a write transaction.
        """
        for entry in os.listdir(self._snapshots_dir):
            id_ = entry[len(_REMOVED_PREFIX) :]
            if not entry.startswith(_REMOVED_PREFIX) or id_ not in ids:
                continue
            target = self._snapshot_dir(id_)
            if os.path.lexists(target):
                continue  # the snapshot has its directory; this one is garbage
            log.warning("recovering directory of a snapshot whose removal did not complete", key=ids[id_], id=id_)
            os.rename(self._snapshots_dir / entry, target)
            _fsync_dir(self._snapshots_dir)


def disk_usage(root: str | os.PathLike) -> Usage:
    """Bytes allocated (``st_blocks * 512``) and distinct inodes under ``root``, root included.

    As containerd's ``fs.DiskUsage``: symlinks are not followed, hard links count once,
    and overlayfs whiteouts (0/0 character devices) count as inodes taking no blocks.
    """
    seen: set[tuple[int, int]] = set()
    size = 0
    pending = [os.fspath(root)]
    while pending:
        path = pending.pop()
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            size += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(path) as entries:
                pending.extend(entry.path for entry in entries)
    return Usage(size=size, inodes=len(seen))


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable before the metadata that depends on them commits."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: str | os.PathLike) -> None:
    """Delete a directory tree (or a stray file), logging, not raising, what could not be deleted."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
    except OSError as error:
        if error.errno != errno.ENOENT:
            log.warning("failed to remove path", path=str(path), error=str(error))
        return

    def report(function, failed_path, exc_info) -> None:
        error = exc_info[1]
        if isinstance(error, OSError) and error.errno == errno.ENOENT:
            return
        log.warning("failed to remove path", path=str(failed_path), error=str(error))

    shutil.rmtree(path, onerror=report)
