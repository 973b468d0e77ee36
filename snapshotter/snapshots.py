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

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import functools
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import prometheus_client

from bootseer import confined
from bootseer.atomic import fsync_directory
from bootseer.images.chains import layers_above
from bootseer.locks import KeyedLocks
from bootseer.profile import events as profile_events, hooks as profile_hooks
from bootseer.log import get_logger

from .backend import LayerBackend, RemoteLayer
from .errors import AlreadyExists, FailedPrecondition, LayerUnavailable, NotFound, RootLocked, SnapshotError
from .filters import parse_all as parse_filters
from .filters import snapshot_adaptor
from .metastore import BACKING_DIR, BACKING_REMOTE, STATE_MOUNTING, Layer, MetaStore, Record, Snapshot, Transaction
from .mounts import snapshot_mounts
from .observers import PreparedContainer, ProfileObserver, SnapshotObserver
from .types import Info, Kind, Mount, Usage

log = get_logger(__name__)

_NEW_PREFIX = "new-"
_REMOVED_PREFIX = "rm-"

#: containerd's unpacker labels each layer's Prepare with the ChainID it will commit.
REF_LABEL = "containerd.io/snapshot.ref"
#: Hints the CRI plugin adds (``pkg/snapshotters/annotations.go``); used for logs and checks.
CRI_IMAGE_REF_LABEL = "containerd.io/snapshot/cri.image-ref"
CRI_LAYER_DIGEST_LABEL = "containerd.io/snapshot/cri.layer-digest"
CRI_IMAGE_LAYERS_LABEL = "containerd.io/snapshot/cri.image-layers"

REMOTE_FALLBACKS = prometheus_client.Counter(
    "bootseer_snapshotter_remote_fallbacks_total",
    "Prepares with containerd.io/snapshot.ref that fell back to download-and-unpack, by reason "
    "(not_converted, parent_mismatch, store_error, server_unavailable, corrupt, untrusted, mount_failed).",
    ["reason"],
)
REMOTE_PREPARES = prometheus_client.Counter(
    "bootseer_snapshotter_remote_snapshots_total",
    "Layers committed as remote snapshots (served lazily, not downloaded).",
)


def profiled_remote_prepare(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate :meth:`Snapshotter._prepare_remote` for the start-up profiler: each layer's Prepare a span.

    It lives beside the method whose arguments it reads (the profiler knows no snapshotter).  Each layer containerd's unpacker (``ctr pull``, CRI) or rpull prepares becomes an
    ``image.layer_prepare`` span: ``lazy`` when it is answered ALREADY_EXISTS (served from the
    store), ``downloaded`` when it falls back to an ordinary snapshot to unpack into.
    """
    @functools.wraps(function)
    def wrapper(self: Any, key: str, parent: str, labels: dict[str, str], chain_id: str) -> Any:
        if not profile_events.enabled():
            return function(self, key, parent, labels, chain_id)

        started, state = time.time(), "downloaded"
        try:
            return function(self, key, parent, labels, chain_id)
        except AlreadyExists:
            state = "lazy"
            raise
        except BaseException:
            state = "failed"
            raise
        finally:
            profile_events.emit("image.layer_prepare", "span", start=started, end=time.time(), phase="image",
                        chain_id=chain_id, state=state)

    return wrapper


class Snapshotter:
    """Thread-safe: the gRPC server calls it from many threads.

    With a ``backend``, a Prepare that carries ``containerd.io/snapshot.ref`` of a layer
    the store has converted becomes a remote snapshot (see :meth:`prepare`); without
    one every snapshot is a plain directory, exactly as before.
    """

    def __init__(self, root: str | os.PathLike, backend: LayerBackend | None = None) -> None:
        self.root = Path(root).absolute()
        self.backend = backend
        #: Told when containers' snapshots come and go (:mod:`.observers`): the profiler always,
        #: and what the daemon registers with :meth:`observe` (dependency snapshots, hot lists).
        self._observers: list[SnapshotObserver] = [ProfileObserver()]
        # One lock per ChainID: a mount and the unmount of the same layer never interleave.
        # Kept only while held or waited for: Prepares name every ChainID of every image.
        self._chain_locks = KeyedLocks()
        self._mounting: set[str] = set()  # ids of snapshots between the two phases, in this process
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._snapshots_dir = self.root / "snapshots"
        self._snapshots_dir.mkdir(mode=0o700, exist_ok=True)
        profile_hooks.use_root(self.root)  # BOOTSEER_PROFILE=1: the start-up profiler's spool is ROOT/profile
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

    # -- containerd's Snapshotter interface -------------------------------------

    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None, *,
                namespace: str = "") -> list[Mount]:  # fmt: skip
        """Create the active (writable) snapshot ``key`` on top of the committed ``parent``.

        ``namespace``: the request's ``containerd-namespace`` header, if it had one
        (containerd 1.6 sends none to a proxy; the key's ``NS/N/`` prefix names the
        namespace then); dependency snapshots are scoped to the namespace.

        With a backend and the label ``containerd.io/snapshot.ref=<chainID>`` of a layer
        the store has converted on top of ``parent``, the layer is committed as the
        remote snapshot ``chainID`` and :class:`AlreadyExists` is raised: containerd's
        unpacker then finds ``chainID`` by Stat and neither downloads nor unpacks it.
        Anything else (not converted, another parent, a store or layer server that
        fails) falls back to the ordinary snapshot, logged and counted.
        """
        chain_id = (labels or {}).get(REF_LABEL, "")
        if self.backend is not None and chain_id:
            return self._prepare_remote(key, parent, labels or {}, chain_id)
        snapshot, mounts = self._create(Kind.ACTIVE, key, parent, labels)
        container = PreparedContainer(key, parent, dict(labels or {}), str(self._upper_path(snapshot.id)), namespace,
                                      reads_start_at=parent)  # fmt: skip
        for observer in self._observers:
            observer.container_prepared(container)
        self._send_requests(container)
        if container.mounts_changed:
            mounts = self._mounts(snapshot)  # a dependency snapshot is stacked under it (.deps_hooks)
        return mounts

    def _send_requests(self, container: PreparedContainer) -> None:
        """Send the observers' requests for the layer server in one round trip and give each its answer; send again,
        each on its own, those whose request an answer changed (a dependency layer not stacked after all)."""
        if not container.requests or self.backend is None:
            return
        sent = [request.build() for request in container.requests]
        for request, answer in zip(container.requests, self.backend.send(sent)):
            request.answered(answer)
        for request, before in zip(container.requests, sent):
            now = request.build()
            if now != before:
                request.answered(self.backend.send([now])[0])

    @property
    def snapshots_dir(self) -> Path:
        """Where each snapshot's directory is (``ROOT/snapshots/<id>``)."""
        return self._snapshots_dir

    def observe(self, observer: SnapshotObserver) -> None:
        """Tell ``observer`` of every container's snapshot from now on, after those registered before it."""
        self._observers.append(observer)

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        """Create the read-only view ``key`` of the committed ``parent``."""
        return self._create(Kind.VIEW, key, parent, labels)[1]

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
                id_, kind, chain_id = tx.remove(key)
                aside = self._set_aside(id_)
        except BaseException:
            if aside is not None:
                # The metadata still has the snapshot: its directory goes back too.
                os.rename(aside, self._snapshot_dir(id_))
            raise
        log.debug("snapshot removed", key=key, id=id_, kind=kind.name.lower())
        for observer in reversed(self._observers):
            observer.snapshot_removed(key, kind is Kind.ACTIVE, aside)
        if aside is not None:
            _remove_tree(aside)
        if chain_id:
            self._release_remote(chain_id)

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
        """Delete the directories that no snapshot refers to (left by crashes or failed deletes).

        With a backend, also stop serving layers no snapshot uses (an unmount that
        failed at Remove is retried here).
        """
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
            fsync_directory(self._snapshots_dir)
        for path in garbage:
            log.info("removing unreferenced snapshot directory", path=str(path))
            _remove_tree(path)
        if self.backend is not None:
            try:
                served = list(self.backend.mounted())
            except LayerUnavailable as exc:
                log.warning("cannot list the layers served; unused ones stay mounted", reason=exc.reason, error=str(exc))
                return
            for chain_id in served:
                self._release_remote(chain_id)

    def restore(self) -> list[str]:
        """Re-establish what a restart needs, once at daemon start; safe to call again.

        Finishes interrupted removals the metadata never saw (moving their directory
        back); forgets remote snapshots a crash left between the two phases of their
        Prepare (containerd never got an answer for them); asks the backend to serve
        every remote snapshot again (check, else mount, recording a new lower dir);
        checks that every plain snapshot's directories exist.  Returns the problems
        found (each also logged).
        """
        problems = []
        with self._ms.write() as tx:
            self._recover_interrupted_removals(tx.id_map())
            records = tx.records()
        for record in records:
            if record.state == STATE_MOUNTING:
                self._forget_interrupted(record)
                continue
            if record.backing == BACKING_REMOTE:
                problem = self._restore_remote(record)
                if problem:
                    problems.append(problem)
                continue
            needed = [self.lower_dir(record.layer)]
            if record.kind is Kind.ACTIVE:
                needed.append(str(self._work_path(record.id)))
            for path in needed:
                if not os.path.isdir(path):
                    problem = f"snapshot {record.key!r} ({record.kind.name.lower()}, id {record.id}): {path} is missing"
                    log.error("snapshot directory missing", key=record.key, id=record.id, path=path)
                    problems.append(problem)
        remote = sum(1 for r in records if r.backing == BACKING_REMOTE)
        log.info("snapshots restored", snapshots=len(records), remote=remote, problems=len(problems))
        return problems

    def _forget_interrupted(self, record: Record) -> None:
        """Remove a ``"mounting"`` snapshot no Prepare of this process is finishing (a crash's)."""
        with self._chain_locks.hold(record.remote_ref):  # a Prepare in progress holds it throughout
            with self._ms.read() as tx:
                current = next((r for r in tx.records() if r.id == record.id), None)
            if current is None or current.state != STATE_MOUNTING or record.id in self._mounting:
                return
            log.warning(
                "forgetting a remote snapshot interrupted while its layer was mounted",
                key=record.key, id=record.id, chain_id=record.remote_ref,
            )  # fmt: skip
            with contextlib.suppress(NotFound):
                self.remove(record.key)

    def _restore_remote(self, record: Record) -> str:
        """Have the backend serve the remote snapshot ``record`` again; a problem or ""."""
        where = f"remote snapshot {record.key!r} (id {record.id}, chain {record.remote_ref})"
        if self.backend is None:
            log.error("remote snapshot but no store configured", key=record.key, id=record.id)
            return f"{where}: no store is configured, so its layer cannot be served"
        with self._chain_locks.hold(record.remote_ref):
            try:
                try:
                    lower = self.backend.check(record.remote_ref)
                except LayerUnavailable:
                    lower = self.backend.mount(record.remote_ref)
            except LayerUnavailable as exc:
                log.error("remote snapshot cannot be served", key=record.key, id=record.id, reason=exc.reason, error=str(exc))
                return f"{where}: {exc}"
            if lower != record.remote_dir:
                log.info("remote snapshot served from a new directory", key=record.key, lower_dir=lower)
                with self._ms.write() as tx:
                    tx.set_remote_dir(record.id, lower)
        return ""

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
        if layer.backing == BACKING_REMOTE:
            if self.backend is None:
                raise FailedPrecondition(
                    f"snapshot id {layer.id} is served lazily (chain {layer.remote_ref}) but no store is configured"
                )
            return layer.remote_dir
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

    def _observed_lowers(self, upper: str) -> list[str]:
        return [lower for observer in self._observers for lower in observer.lowers(upper)]

    def _mounts(self, snapshot: Snapshot) -> list[Mount]:
        return snapshot_mounts(
            snapshot.kind,
            upper=str(self._upper_path(snapshot.id)),
            work=str(self._work_path(snapshot.id)),
            lowers=(self._observed_lowers(str(self._upper_path(snapshot.id))) if snapshot.kind is Kind.ACTIVE else [])
            + [self.lower_dir(layer) for layer in snapshot.parents],
        )

    # -- directory changes inside transactions -------------------------------------

    def _create(
        self, kind: Kind, key: str, parent: str, labels: dict[str, str] | None, remote_ref: str = ""
    ) -> tuple[Snapshot, list[Mount]]:
        new: str | None = None
        placed: Path | None = None
        snapshot: Snapshot | None = None
        try:
            with self._ms.write() as tx:
                # Made inside the transaction, so cleanup() never sees it half-built.
                new = self._new_directory(kind)
                snapshot = tx.create_snapshot(kind, key, parent, labels, remote_ref=remote_ref)
                if remote_ref:
                    self._mounting.add(snapshot.id)
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
                fsync_directory(self._snapshots_dir)
        except BaseException:
            for path in (new, placed):
                if path is not None:
                    _remove_tree(path)
            if remote_ref and snapshot is not None:
                self._mounting.discard(snapshot.id)  # rolled back: the id may come round again
            raise
        log.debug("snapshot created", key=key, parent=parent, id=snapshot.id, kind=kind.name.lower())
        return snapshot, self._mounts(snapshot)

    # -- remote snapshots ----------------------------------------------------------------

    @profiled_remote_prepare  # start-up profiler: each layer's Prepare, lazy or downloaded
    def _prepare_remote(self, key: str, parent: str, labels: dict[str, str], chain_id: str) -> list[Mount]:
        """Prepare ``key`` as containerd's unpacker asks, committing ``chain_id`` lazily if the store has it.

        Two phases, so that the mount (which may fetch from the store for seconds)
        never runs inside a metadata transaction: (1) the active snapshot ``key`` is
        recorded ``"mounting"``; the backend mounts the layer; (2) ``key`` is committed
        as ``chain_id``, ``"ready"``, served from the lower dir.  A crash in between
        leaves a ``"mounting"`` row that :meth:`restore` forgets.
        """
        assert self.backend is not None
        hints = {
            name: labels[label]
            for name, label in (("image_ref", CRI_IMAGE_REF_LABEL), ("layer_digest", CRI_LAYER_DIGEST_LABEL))
            if label in labels
        }
        with self._chain_locks.hold(chain_id):
            layer, reason, detail = self._find_remote(chain_id, parent, labels)
            if layer is None:
                return self._fall_back(key, parent, labels, chain_id, reason, detail, hints)
            snapshot, mounts = self._create(Kind.ACTIVE, key, parent, labels, remote_ref=chain_id)
            try:
                try:
                    lower = self.backend.mount(chain_id)
                except Exception as exc:
                    if not isinstance(exc, LayerUnavailable):  # a bug below us must not fail the pull either
                        log.error("mounting a remote layer failed unexpectedly", chain_id=chain_id, exc_info=exc)
                    reason = exc.reason if isinstance(exc, LayerUnavailable) else "mount_failed"
                    # The snapshot just made is what the ordinary path needs: keep it, as a plain one.
                    with self._ms.write() as tx:
                        tx.abandon_remote(key, snapshot.id)
                    self._count_fallback(key, chain_id, reason, str(exc), hints)
                    self._release_remote(chain_id)
                    return mounts
                # This layer is served: now the ones above it load while containerd commits it and prepares the
                # next (never before: they would hold back this one's load, which the pull waits for first).
                self._warm_above(labels)
                try:
                    with self._ms.write() as tx:
                        tx.commit_active(
                            key, chain_id, _remote_usage(layer), labels, expected_id=snapshot.id, remote_dir=lower
                        )
                except AlreadyExists:
                    # Committed meanwhile by another path (an ordinary unpack): ours is redundant.
                    self._forget_prepared(key, chain_id)
                    raise AlreadyExists(f"target snapshot {chain_id!r} already exists") from None
                except BaseException:
                    self._forget_prepared(key, chain_id)
                    raise
            finally:
                self._mounting.discard(snapshot.id)
        REMOTE_PREPARES.inc()
        log.info("layer served lazily from the store", key=key, chain_id=chain_id, lower_dir=lower, **hints)
        raise AlreadyExists(f"target snapshot {chain_id!r} already exists (served lazily from the store)")

    def _warm_above(self, labels: dict[str, str]) -> None:
        """Have the backend load the layers a pull will prepare next (``bootseer rpull``'s
        :data:`~bootseer.images.chains.LABEL_LAYERS_ABOVE`), those this node does not hold yet."""
        assert self.backend is not None
        above = layers_above(labels)
        if not above:
            return
        with self._ms.read() as tx:
            wanted = [chain for chain in above if not _has_snapshot(tx, chain)]
        if not wanted:
            return
        try:
            self.backend.warm(wanted)
        except Exception as exc:  # a load ahead is a hint: a bug below us must not fail the pull
            log.error("asking the layer server to load the layers above failed unexpectedly", layers=len(wanted), exc_info=exc)

    def _find_remote(
        self, chain_id: str, parent: str, labels: dict[str, str]
    ) -> tuple[RemoteLayer | None, str, str]:
        """The converted layer to serve as ``chain_id`` on ``parent``, or (None, reason, detail)."""
        assert self.backend is not None
        with self._ms.read() as tx:
            try:
                _, existing, _ = tx.get_info(chain_id)
            except NotFound:
                existing = None
        if existing is not None and existing.kind is Kind.COMMITTED:
            # containerd Stats before it Prepares, but another pull may have won the race.
            raise AlreadyExists(f"target snapshot {chain_id!r} already exists")
        try:
            layer = self.backend.lookup(chain_id)
        except LayerUnavailable as exc:
            return None, exc.reason, str(exc)
        except Exception as exc:  # a bug below us must not fail the pull
            log.error("looking up a remote layer failed unexpectedly", chain_id=chain_id, exc_info=exc)
            return None, "store_error", f"{type(exc).__name__}: {exc}"
        if layer is None:
            return None, "not_converted", f"the store has no converted layer {chain_id}"
        if layer.parent != parent:
            return None, "parent_mismatch", (
                f"the store's layer {chain_id} sits on {layer.parent or 'nothing'}, not on {parent or 'nothing'}"
            )
        digest = labels.get(CRI_LAYER_DIGEST_LABEL)
        if digest and digest != layer.digest:
            # Same diff_id, another compression: the contents are the same, so serve them.
            log.info("layer blob digest differs from the converted one", chain_id=chain_id, digest=digest, converted=layer.digest)
        return layer, "", ""

    def _fall_back(
        self,
        key: str,
        parent: str,
        labels: dict[str, str],
        chain_id: str,
        reason: str,
        detail: str,
        hints: dict[str, str],
    ) -> list[Mount]:
        self._count_fallback(key, chain_id, reason, detail, hints)
        return self._create(Kind.ACTIVE, key, parent, labels)[1]

    @staticmethod
    def _count_fallback(key: str, chain_id: str, reason: str, detail: str, hints: dict[str, str]) -> None:
        REMOTE_FALLBACKS.labels(reason).inc()
        # An unconverted layer is the expected, quiet case; a failing store is not.
        level = log.info if reason in ("not_converted", "parent_mismatch") else log.warning
        level("layer not served lazily: download and unpack", key=key, chain_id=chain_id, reason=reason, detail=detail, **hints)

    def _forget_prepared(self, key: str, chain_id: str) -> None:
        """Undo phase one of a remote Prepare whose commit failed (the layer is released too)."""
        try:
            self.remove(key)
        except SnapshotError as exc:
            log.warning("cannot remove an unfinished remote snapshot", key=key, error=str(exc))
            self._release_remote(chain_id)

    def _release_remote(self, chain_id: str) -> None:
        """Unmount ``chain_id`` from the backend if no snapshot uses it any more (failures logged)."""
        if self.backend is None:
            return
        with self._chain_locks.hold(chain_id):
            with self._ms.read() as tx:
                users = tx.remote_users(chain_id)
            if users or any(observer.holds_layer(chain_id) for observer in self._observers):  # a stacked deps layer
                return
            try:
                self.backend.unmount(chain_id)
            except LayerUnavailable as exc:
                log.warning("cannot unmount an unused layer; Cleanup retries", chain_id=chain_id, reason=exc.reason, error=str(exc))
                return
        log.info("unused layer unmounted", chain_id=chain_id)

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
        fsync_directory(self._snapshots_dir)
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
            fsync_directory(self._snapshots_dir)


def _has_snapshot(tx: Transaction, key: str) -> bool:
    try:
        tx.get_info(key)
    except NotFound:
        return False
    return True


def _remote_usage(layer: RemoteLayer) -> Usage:
    """A remote snapshot's Usage: it takes no bytes under the snapshot root (its blocks live
    in the shared node cache, counted there), and as many inodes as its index has entries."""
    return Usage(size=0, inodes=layer.files)


def disk_usage(root: str | os.PathLike) -> Usage:
    """Bytes allocated (``st_blocks * 512``) and distinct inodes under ``root``, root included.

    As containerd's ``fs.DiskUsage``: symlinks are not followed, hard links count once,
    and overlayfs whiteouts (0/0 character devices) count as inodes taking no blocks.
    The tree is a container's: it is walked by directory descriptors (:func:`bootseer.confined.walk`),
    so a directory swapped for a symlink mid-walk never takes it out of ``root``.
    """
    seen: set[tuple[int, int]] = set()
    size = 0

    def count(_path: str, st: os.stat_result, _parent_fd: int = -1) -> None:
        nonlocal size
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            size += st.st_blocks * 512

    try:
        fd = confined.open_dir(root)
    except NotADirectoryError:
        count("", os.lstat(root))
        return Usage(size=size, inodes=len(seen))
    try:
        count("", os.fstat(fd))
        confined.walk(fd, on_entry=count)
    finally:
        os.close(fd)
    return Usage(size=size, inodes=len(seen))


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
