"""Dependency snapshots on bare metal: ``bootseer deps run --prefix DIR -- INSTALL...`` and ``release``.

**A hit** (the store has a deps record for the key): DIR becomes an overlayfs mount
whose lower directories are the deps layer, served lazily by the node's layer server
(``bootseer layer-server --root ROOT``, started on first use), above DIR's prior
contents if it had any, with a writable upper directory under ``ROOT/mounts``: the job
can write (bytecode of modules first imported, more installs) without touching the
snapshot, and nothing is copied up front.  It lives until ``bootseer deps release DIR``
(which unmounts it and drops what the job wrote) or a reboot; the layer server keeps
serving the layer meanwhile (and after its own restart, from its saved table).
Mounting needs root (overlayfs and a FUSE mount with ``allow_other``).

**Hot lists** apply to a restored prefix as to an image: the restore tells the layer
server, which prefetches the deps layer's hot list if the store has one, and else
records the restore's first reads, by any process (a prefix has no container whose
cgroup would name its reader), until ``DIR/.bootseer-seal`` appears, 10 s pass
without a new block, the 120 s window ends or the prefix is released; the list is
published where captures go (``--publish-store``, else the store).

**A miss**: the command runs as given and must install into DIR (``pip install
--target DIR``/``--prefix DIR``, ``DIR/bin/pip install`` of a venv at DIR, ``uv pip
install --python DIR/bin/python``...; ``$BOOTSEER_DEPS_PREFIX`` holds DIR).  If it
exits 0, what it created, changed or deleted under DIR is captured and published
(:mod:`depsnap.capture`); a failed command captures nothing and its status is ours.
Capturing needs no root.

**One node, one prefix**: runs on one prefix take ``ROOT/locks/<prefix hash>.lock``
in turn (a second run waits, then finds the first's result in place: the restored
mount, or the prefix it installed, remembered in ``ROOT/prefixes/<hash>.json`` with
the key and the prefix's contents before).  Across nodes the store decides: the
first record published wins, later captures of the key are dropped.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import prometheus_client
import trio

from bootseer.atomic import write_atomically
from bootseer.blockstore.convert.layer_image import DEFAULT_INLINE_MAX
from bootseer.blockstore.datapath.overlay import overlay_options
from bootseer.blockstore.server import client as control
from bootseer.blockstore.objects.format import FormatError
from bootseer.blockstore.objects.signing import SigningKey, TrustPolicy, Untrusted
from bootseer.blockstore.objects.store import StoreError, open_store, open_store_writer
from bootseer.fetch.engine import EngineConfig
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.source import SourceError
from bootseer.hotlist import hooks as hotlist_hooks
from bootseer.hotlist.format import PROFILE_LABEL
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks, traced

from .capture import CaptureError, CaptureResult, Tree, diff, publish_capture, scan
from .key import DepsKey, compute_key, tree_digest
from .record import MAX_RECORD_BYTES, DepsRecord, deps_object
from bootseer.paths import DEFAULT_DEPS_ROOT, ServerPaths

log = get_logger(__name__)

PREFIX_ENV = "BOOTSEER_DEPS_PREFIX"
#: Seconds a store look-up may take (retries included) before the run installs as on a miss.
LOOKUP_TIMEOUT = 20.0

UNTRUSTED = prometheus_client.Counter(
    "bootseer_deps_untrusted_total",
    "Deps records ignored because no trusted writer key signed them (the install ran as on a miss)",
)


class DepsError(Exception):
    """A dependency-snapshot operation that cannot go on (named cause, nothing half done)."""


class StoreUnreachable(DepsError):
    """The store failed (not "no such snapshot")."""


@dataclass
class PrefixState:
    """What bootseer did to one prefix on this node (``ROOT/prefixes/<hash>.json``)."""

    prefix: str
    key: str
    state: str  #: ``restored`` (an overlay mount) or ``installed`` (the command ran here)
    prior_content: str  #: the prefix's content digest before bootseer touched it (the key's input)
    chain_id: str = ""
    store: str = ""
    upper: str = ""
    at: str = ""
    installed_tree: str = ""  #: (installed) :func:`tree_signature` right after the install: unchanged since?
    published: bool = False  #: (installed) its capture is in the store (this run's or another's)


def tree_signature(prefix: Path) -> str:
    """A digest of what ``lstat`` says of every entry under ``prefix`` (cheap: no contents read).

    Any write, chmod, rename or deletion moves a ctime or removes a path, so a prefix
    whose signature is unchanged holds what it held.
    """
    tree = scan(prefix)
    rows = sorted((path, n.kind, n.mode, n.size, n.mtime_ns, n.ctime_ns, n.ino) for path, n in tree.items())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


class NodeRoot:
    """The node's directories for bare-metal dependency snapshots."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    @staticmethod
    def prefix_id(prefix: Path) -> str:
        return hashlib.sha256(str(prefix).encode()).hexdigest()[:24]

    def lock_path(self, prefix: Path) -> Path:
        return self.root / "locks" / f"{self.prefix_id(prefix)}.lock"

    def state_path(self, prefix: Path) -> Path:
        return self.root / "prefixes" / f"{self.prefix_id(prefix)}.json"

    def mount_dir(self, prefix: Path) -> Path:
        return self.root / "mounts" / self.prefix_id(prefix)

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    def load_state(self, prefix: Path) -> PrefixState | None:
        try:
            doc = json.loads(self.state_path(prefix).read_text())
            return PrefixState(**doc)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise DepsError(f"{self.state_path(prefix)} is corrupt ({exc}); remove it if {prefix} is not mounted") from None

    def save_state(self, state: PrefixState) -> None:
        path = self.state_path(Path(state.prefix))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(asdict(state), indent=1).encode())

    def drop_state(self, prefix: Path) -> None:
        self.state_path(prefix).unlink(missing_ok=True)

    def states(self) -> list[PrefixState]:
        out = []
        for path in sorted((self.root / "prefixes").glob("*.json")):
            try:
                out.append(PrefixState(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                log.warning("skipping an unreadable prefix state", path=str(path))
        return out

    @contextlib.contextmanager
    def locked(self, prefix: Path) -> Iterator[None]:
        """Hold the prefix's lock (waiting for another run on it, with a line saying so)."""
        path = self.lock_path(prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"bootseer deps: waiting for another run on {prefix}", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


# -- the store -------------------------------------------------------------------------------


def lookup(store: str, key: str, *, timeout: float = LOOKUP_TIMEOUT, trust: TrustPolicy = TrustPolicy()) -> DepsRecord | None:
    """The deps record of ``key`` in ``store`` (any readable URL); None if there is none, it is malformed
    or ``trust`` has writer keys and none of them signed it (a miss: the install runs; logged and counted).

    StoreUnreachable when the store fails.
    """

    async def read() -> bytes | None:
        with trio.fail_after(timeout):
            async with open_store(store, EngineConfig(retry_timeout=min(timeout, 10.0))) as reader:
                return await reader.read_object(deps_object(key), MAX_RECORD_BYTES)

    try:
        data = trio.run(read)
    except (FetchError, SourceError, trio.TooSlowError, OSError) as exc:
        raise StoreUnreachable(f"store {store}: {exc or 'no answer'}") from None
    except FormatError as exc:
        log.warning("ignoring a malformed deps record", key=key, error=str(exc))
        return None
    if data is None:
        return None
    try:
        record = DepsRecord.decode(data, expected_key=key)
    except FormatError as exc:
        log.warning("ignoring a malformed deps record", key=key, error=str(exc))
        return None
    try:
        trust.check("deps", record.signature_check(), f"the deps record {key}")
    except Untrusted as exc:
        UNTRUSTED.inc()
        log.warning("ignoring a deps record no trusted writer signed; installing as on a miss", key=key, error=str(exc))
        return None
    return record


# -- mounting ---------------------------------------------------------------------------------


def _run_mount(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise DepsError(f"{what}: {' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def is_mountpoint(path: Path) -> bool:
    return os.path.ismount(path)


def restore(node: NodeRoot, prefix: Path, record: DepsRecord, store: str, prior_content: str,
            settings: control.ServerSettings, hotlist_profile: str = "") -> PrefixState:  # fmt: skip
    """Mount ``record``'s layer at ``prefix`` (overlay: deps layer, prior contents, writable upper).

    Then the layer server is told (:func:`bootseer.hotlist.hooks.prefix_restored`): the deps
    layer's hot list for ``hotlist_profile`` is prefetched if the store has one, else this
    restore's first reads, by any process, are recorded into one (docs/hotlist.md).
    """
    if os.geteuid() != 0:
        raise DepsError("restoring a dependency snapshot mounts overlayfs and FUSE: run as root")
    if is_mountpoint(prefix):
        raise DepsError(f"{prefix} is a mount point already; release or unmount it first")
    try:
        client = control.ensure_server(node.root, settings)
        mounted = client.mount(record.chain_id, store=store, deps_index=record.index)  # the record was trusted
    except control.LayerServerError as exc:
        raise DepsError(f"cannot serve the deps layer {record.chain_id}: {exc}") from None
    work_root = node.mount_dir(prefix)
    if work_root.exists():
        shutil.rmtree(work_root)  # left by a restore that was killed before it saved its state
    upper, work = work_root / "upper", work_root / "work"
    upper.mkdir(parents=True)
    work.mkdir()
    below = os.stat(mounted.lower_dir)  # overlayfs's root takes the upper root's owner and mode
    os.chown(upper, below.st_uid, below.st_gid)
    os.chmod(upper, below.st_mode & 0o7777)
    os.utime(upper, ns=(below.st_atime_ns, below.st_mtime_ns))  # so the restored root's mtime is the captured one
    prefix.mkdir(parents=True, exist_ok=True)
    lowers = [mounted.lower_dir] + ([str(prefix)] if prior_content not in ("absent", "empty") else [])
    options = overlay_options(lowers, upper=str(upper), work=str(work))
    _run_mount(["mount", "-t", "overlay", "overlay", "-o", ",".join(options), str(prefix)], "overlay mount")
    state = PrefixState(prefix=str(prefix), key=record.key, state="restored", prior_content=prior_content,
                        chain_id=record.chain_id, store=store, upper=str(upper), at=_now())  # fmt: skip
    try:
        node.save_state(state)
    except BaseException:
        subprocess.run(["umount", str(prefix)], capture_output=True)
        raise
    labels = {PROFILE_LABEL: hotlist_profile} if hotlist_profile else {}
    action = hotlist_hooks.prefix_restored(node.root, node.prefix_id(prefix), record.chain_id, str(upper), labels)
    log.info("prefix restored", prefix=str(prefix), chain_id=record.chain_id, hotlist=action)
    return state


def release(node: NodeRoot, prefix: Path, *, lazy: bool = False) -> str:
    """Undo what bootseer did to ``prefix``; a line saying what was done.  DepsError if nothing is known of it."""
    with node.locked(prefix):
        state = node.load_state(prefix)
        if state is None:
            raise DepsError(f"{prefix}: no dependency snapshot of this node (nothing to release)")
        if state.state == "installed":
            node.drop_state(prefix)
            return f"{prefix}: installed here, not restored: its files stay; bootseer forgets it"
        # Its hot-list recording seals now (and is published), its prefetch stops.
        hotlist_hooks.prefix_released(node.root, node.prefix_id(prefix))
        if is_mountpoint(prefix):
            argv = ["umount", "-l", str(prefix)] if lazy else ["umount", str(prefix)]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise DepsError(f"cannot unmount {prefix} ({done.stderr.strip()}): is a job still using it? "
                                "(--lazy detaches it now and frees it when the last user goes)")  # fmt: skip
        shutil.rmtree(node.mount_dir(prefix), ignore_errors=True)
        node.drop_state(prefix)
        still_used = any(s.chain_id == state.chain_id and s.state == "restored" for s in node.states())
        if not still_used:
            try:
                control.LayerServerClient(ServerPaths(node.root).socket).unmount(state.chain_id)
            except control.LayerNotMounted:
                pass
            except control.LayerServerError as exc:
                log.warning("the layer server did not unmount the deps layer", chain_id=state.chain_id, error=str(exc))
        return f"{prefix}: released (unmounted; what the job wrote there is gone)"


# -- run --------------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    action: str  #: ``hit``, ``present`` (already in place), ``captured``, ``installed`` (not published), ``failed``
    key: str
    status: int = 0  #: the exit status to return
    detail: str = ""
    capture: CaptureResult | None = None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@traced("deps.run", phase="dependencies", attrs=profile_hooks.deps_run_attrs)  # start-up profiler: hit/restore or install
def run(
    argv: Sequence[str],
    *,
    prefix: str | os.PathLike[str],
    store: str | None,
    publish_store: str | None = None,
    root: str | os.PathLike[str] = DEFAULT_DEPS_ROOT,
    python: str | None = None,
    extra_files: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    settings: control.ServerSettings | None = None,
    publish: bool = True,
    hotlist_profile: str = "",
    scope: str = "",
    inline_max: int | None = DEFAULT_INLINE_MAX,
) -> RunOutcome:
    """Restore the dependency snapshot of this install at ``prefix``, or run the install and capture it.

    ``settings`` (the layer server's) also give the trust policy (docs/trust.md): with
    writer keys, only a record one of them signed is restored; with a sign key, the
    capture is signed.  KeyFileError if a key file is bad.

    ``scope``: an input of the key (:func:`bootseer.depsnap.key.compute_key`): snapshots of
    other scopes are neither restored nor replaced.  ``inline_max``: the capture's EROFS image
    holds files of at most that many bytes (None: it is published without an image).
    """
    settings = settings or control.ServerSettings(store=store)
    trust = TrustPolicy.load(settings.converter_keys, settings.writer_keys)
    sign_key = trust.load_sign_key(settings.sign_key) if settings.sign_key else None
    prefix_path = Path(prefix).absolute()
    node = NodeRoot(root)
    env = dict(os.environ if env is None else env)
    with node.locked(prefix_path):
        state = node.load_state(prefix_path)
        key: DepsKey | None = None
        if state is not None:
            key = compute_key(argv, prefix=prefix_path, env=env, python=python, prior_content=state.prior_content,
                              extra_files=extra_files, scope=scope)  # fmt: skip
            in_place = (is_mountpoint(prefix_path) if state.state == "restored"
                        else state.installed_tree == tree_signature(prefix_path))  # fmt: skip
            if key.key == state.key and in_place:
                if state.state == "installed" and not state.published and publish and (publish_store or store) \
                        and state.prior_content in ("absent", "empty"):
                    # Installed here, its capture interrupted (killed, store down): the change is all
                    # of the prefix, so it can be captured now.
                    return _capture(node, argv, prefix_path, key, {}, scan(prefix_path), state, store, publish_store,
                                    sign_key, inline_max)  # fmt: skip
                return RunOutcome("present", key.key, detail=f"{prefix_path} holds this install already ({state.state})")
            if state.state == "restored" and is_mountpoint(prefix_path):
                raise DepsError(f"{prefix_path} holds the restored snapshot {state.key[:12]} of another install; "
                                f"`bootseer deps release {prefix_path}` first")  # fmt: skip
            node.drop_state(prefix_path)  # stale (a reboot unmounted it; files changed since): start afresh
            key = None
        if key is None:
            key = compute_key(argv, prefix=prefix_path, env=env, python=python, extra_files=extra_files, scope=scope)
        prior = key.inputs["prefix-content"]
        record = None
        if store:
            try:
                record = lookup(store, key.key, trust=trust)
            except StoreUnreachable as exc:
                log.warning("the store failed; installing as on a miss", error=str(exc))
        if record is not None:
            if record.mode != "prefix" or record.prefix != str(prefix_path):
                log.warning("deps record is for another prefix; ignoring it", key=key.key, prefix=record.prefix)
            else:
                try:
                    restore(node, prefix_path, record, store or "", prior, settings, hotlist_profile)
                    return RunOutcome("hit", key.key, detail=f"restored {prefix_path} from {record.chain_id}")
                except DepsError as exc:
                    # Never a failed job for want of a snapshot: install as without one.
                    log.warning("the dependency snapshot cannot be restored; installing", key=key.key, error=str(exc))
        return _install_and_capture(node, argv, prefix_path, key, env, store, publish_store, publish, sign_key, inline_max)


def _install_and_capture(node: NodeRoot, argv: Sequence[str], prefix: Path, key: DepsKey, env: dict[str, str],
                         store: str | None, publish_store: str | None, publish: bool,
                         sign_key: SigningKey | None, inline_max: int | None) -> RunOutcome:  # fmt: skip
    before = scan(prefix)
    child_env = {**env, PREFIX_ENV: str(prefix)}
    try:
        status = subprocess.run(list(argv), env=child_env).returncode
    except FileNotFoundError:
        raise DepsError(f"{argv[0]}: command not found") from None
    if status != 0:
        detail = f"the install failed (status {status}): nothing captured"
        return RunOutcome("failed", key.key, status=status if status > 0 else 128 - status, detail=detail)
    after = scan(prefix)
    state = PrefixState(prefix=str(prefix), key=key.key, state="installed", at=_now(),
                        prior_content=key.inputs["prefix-content"], installed_tree=tree_signature(prefix))  # fmt: skip
    node.save_state(state)
    if not publish or not (publish_store or store):
        return RunOutcome("installed", key.key, detail="installed; not published (no store given)")
    return _capture(node, argv, prefix, key, before, after, state, store, publish_store, sign_key, inline_max)


def _capture(node: NodeRoot, argv: Sequence[str], prefix: Path, key: DepsKey, before: Tree, after: Tree,
             state: PrefixState, store: str | None, publish_store: str | None,
             sign_key: SigningKey | None, inline_max: int | None) -> RunOutcome:  # fmt: skip
    """Publish the change from ``before`` to ``after`` under ``key``; the state remembers that it is published."""
    target = publish_store or store
    assert target
    change = diff(before, after)
    if change.empty:
        return RunOutcome("installed", key.key, detail="installed; the install changed nothing: not published")
    try:
        writer = open_store_writer(target)
    except (ValueError, StoreError) as exc:  # ReadOnlyStore: an http front
        return RunOutcome("installed", key.key, detail=f"installed; not published: {exc} (give --publish-store)")
    node.spool.mkdir(parents=True, exist_ok=True)
    try:
        with writer:
            result = publish_capture(writer, key=key.key, root=prefix, tree=after, change=change, mode="prefix",
                                     prefix=str(prefix), command=list(argv), inputs=key.inputs,
                                     spool_dir=str(node.spool), sign_key=sign_key, inline_max=inline_max)  # fmt: skip
    except (CaptureError, StoreError) as exc:
        log.error("the install worked but its capture was not published", key=key.key, error=str(exc))
        return RunOutcome("installed", key.key, detail=f"installed; not published: {exc}")
    state.published = True
    node.save_state(state)
    if not result.published:
        return RunOutcome("installed", key.key, capture=result,
                          detail="installed; another run published this key first (its snapshot stays)")  # fmt: skip
    return RunOutcome("captured", key.key, capture=result,
                      detail=f"captured {result.files} entries ({result.bytes} bytes) as {result.chain_id}")  # fmt: skip


__all__ = ["DepsError", "NodeRoot", "RunOutcome", "lookup", "release", "restore", "run", "tree_digest"]
