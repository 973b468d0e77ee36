"""Dependency snapshots in containerd: stack a deps layer under a container's writable layer, or capture one.

The daemon registers a :class:`DepsObserver` with the Snapshotter
(:mod:`bootseer.snapshotter.observers`), built from a :class:`DepsContext` of the node's
settings; all the logic is here.  A container asks for a snapshot with the label
``containerd.io/snapshot/bootseer.deps=KEY`` on its writable snapshot (``ctr run
--snapshotter-label ...``; containerd passes a proxy snapshotter only labels under
``containerd.io/snapshot/``, so the short ``bootseer.io/deps`` works only for clients
that talk to the snapshotter directly).  KEY comes from ``bootseer deps key --base
<image top ChainID> -- CMD...``.

**Scoping**: KEY is what the container asks for, not the record's name.  The record
is ``v1/deps/<container_store_key(KEY, namespace, scope)>.json``
(:func:`bootseer.depsnap.key.container_store_key`): the containerd namespace the
snapshot is prepared in (:func:`snapshot_namespace`: the first component of the
snapshot's key, which containerd's metadata store makes ``NS/N/name``) and the
daemon's ``[depsnap] scope``, neither of which the container chooses.  A container of namespace B with the label of a snapshot
captured in namespace A misses, installs, and its capture is B's own record.

* **Hit** (:meth:`DepsObserver.container_prepared`): the store has a record of KEY made on this
  very image (its ``parent`` is the Prepare's parent, the image's top ChainID): the
  layer server mounts the deps layer and it goes into the overlay's ``lowerdir`` just
  under the writable layer, on every Mounts call (:meth:`DepsObserver.lowers`, from
  ``SNAPSHOT_DIR/deps.json``).  ``/.bootseer/deps-hit`` (holding KEY) appears in the
  container: the entry point's guard line skips the install when it is there.
* **Miss**: the snapshot is watched (every 0.5 s) for ``/.bootseer/deps-done``, which
  the job creates after its install step succeeded; then everything in the writable
  layer (but ``/.bootseer``, ``/tmp``, ``/var/tmp``, ``/run``, ``/proc``, ``/sys``,
  ``/dev`` and ``/root/.cache``) is captured as a layer on the image's top ChainID
  and published (:func:`bootseer.depsnap.capture.publish_capture`: verified, record
  last, first writer wins) to the daemon's publish store (``[hotlist] publish_store`` /
  ``--publish-store``) or else its store.
  The job must not write under the captured paths until ``/.bootseer/deps-captured``
  exists (it holds ``published``, ``exists`` or ``failed: why``): a tree that changes
  during the capture is never published.  The job reads it with ``ls /.bootseer``
  (the snapshotter writes it into the upper directory behind overlayfs's back; a
  readdir of that upper-only directory sees it, a lookup cached as negative may not).
* The deps layer stays mounted while a snapshot stacks it (:meth:`DepsObserver.holds_layer`, so Cleanup
  and Remove of other snapshots leave it), and is unmounted with the last one.

A daemon restart keeps stacked layers (``deps.json`` and the layer server's own
table); a capture that was waiting for its marker when the daemon stopped is not
resumed (the next container with the key captures).
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from bootseer import confined
from bootseer.atomic import write_atomically
from bootseer.blockstore.objects.signing import SigningKey, TrustPolicy, load_signing_key
from bootseer.blockstore.server.client import MOUNT_TIMEOUT, LayerServerError, mount_request, mounted_answer
from bootseer.blockstore.objects.store import StoreError, open_store_writer
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks, traced

from bootseer.depsnap.capture import CaptureError, publish_capture, scan, upper_change
from bootseer.depsnap.key import DepsKeyError, check_key, container_store_key
from bootseer.depsnap.prefix import StoreUnreachable, lookup
from bootseer.depsnap.record import DepsRecord

from .backend import ControlRequest, LayerBackend
from .errors import FailedPrecondition, LayerUnavailable, SnapshotError
from .observers import PreparedContainer, ServerRequest
from .snapshots import CRI_IMAGE_REF_LABEL
from .types import Info

log = get_logger(__name__)

DEPS_LABEL = "containerd.io/snapshot/bootseer.deps"
SHORT_DEPS_LABEL = "bootseer.io/deps"
MARKER_DIR = ".bootseer"
DONE_MARKER = "deps-done"
HIT_MARKER = "deps-hit"
CAPTURED_MARKER = "deps-captured"
STATE_FILE = "deps.json"
#: Paths of the writable layer never captured (markers, scratch space, runtime mount points, caches).
EXCLUDED = (MARKER_DIR, ".bootseer-seal", "tmp", "var/tmp", "run", "proc", "sys", "dev", "root/.cache")
POLL_INTERVAL = 0.5
LOOKUP_TIMEOUT = 10.0


_CHAIN_AT_END = re.compile(r"(sha256:[0-9a-f]{64})$")
#: containerd's metadata store names a snapshot ``<namespace>/<id>/<name>`` (``createKey`` in
#: ``metadata/snapshot.go``); a namespace is an identifier (``namespaces.Validate``: no ``/``).
_NAMESPACED_KEY = re.compile(r"^([A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*)/[0-9]+/.")


def snapshot_namespace(key: str, header: str = "") -> str:
    """The containerd namespace a snapshot ``key`` was made in: its ``NS/N/`` prefix.

    containerd 1.6 does not pass its ``containerd-namespace`` header on to a proxy
    snapshotter (checked: the Prepare arrives without it), but its metadata store names
    every snapshot it asks for ``NS/N/name``, and the caller chooses only ``name``.
    ``header``: the header, for a key not of that form (a client that calls the
    snapshotter directly); else "".
    """
    match = _NAMESPACED_KEY.match(key)
    return match.group(1) if match else header


def base_chain(parent: str) -> str | None:
    """The image's top ChainID from a Prepare's parent: containerd names committed snapshots of image
    layers ``<namespace>/<n>/<chainID>`` when it talks to a proxy snapshotter; None for anything else."""
    match = _CHAIN_AT_END.search(parent)
    return match.group(1) if match else None


def key_of(labels: dict[str, str] | None) -> str | None:
    """The deps key a snapshot's labels ask for; None if none (a malformed one is logged and ignored)."""
    labels = labels or {}
    text = labels.get(DEPS_LABEL) or labels.get(SHORT_DEPS_LABEL)
    if not text:
        return None
    try:
        return check_key(text)
    except DepsKeyError as exc:
        log.warning("ignoring a malformed deps label", error=str(exc))
        return None


def _state_path(upper: str | os.PathLike[str]) -> Path:
    return Path(upper).parent / STATE_FILE


def _read_state(snapshot_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((snapshot_dir / STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("unreadable deps state", path=str(snapshot_dir / STATE_FILE), error=str(exc))
        return None


def _write_state(upper: str, state: dict[str, Any]) -> None:
    write_atomically(_state_path(upper), json.dumps(state).encode())


def _marker(upper: str, name: str, text: str) -> None:
    """Write ``/.bootseer/NAME`` into the container's writable layer (temp name + rename: whole or absent).

    The layer is the container's: written beneath a descriptor of it, following no link
    (a symlink as ``/.bootseer`` is an error, one as ``NAME`` is replaced).
    """
    with confined.opened_dir(upper) as fd:
        confined.write_file(fd, f"{MARKER_DIR}/{name}", (text + "\n").encode(), mode=0o644)


def _marks_dir(upper: str) -> None:
    """Make ``/.bootseer`` where the job signals, whatever its uid (sticky and world-writable, as /tmp)."""
    with confined.opened_dir(upper) as fd:
        marks = confined.make_dirs(fd, MARKER_DIR, 0o1777)
        try:
            os.fchmod(marks, 0o1777)
        finally:
            os.close(marks)


def _done_marker_present(upper: str) -> bool:
    """Whether the job left ``/.bootseer/deps-done``: a regular file, looked up confined (a symlink as it, or
    as ``/.bootseer``, is no marker)."""
    try:
        with confined.opened_dir(upper) as fd:
            return confined.exists_beneath(fd, f"{MARKER_DIR}/{DONE_MARKER}", stat.S_IFREG)
    except OSError:
        return False


def _neither(upper: str, reason: str) -> None:
    """Neither stacked nor watched: the job installs, and its wait for the capture ends at once."""
    try:
        _marks_dir(upper)
        _marker(upper, CAPTURED_MARKER, f"skipped: {reason}")
    except OSError as exc:
        log.warning("cannot write the deps marker", upper=upper, error=str(exc))


@dataclass(frozen=True)
class DepsContext:
    """What dependency snapshots need of the node, built once by the daemon from its settings."""

    store_url: str  #: where deps records are looked up (the daemon's store of layers)
    publish_store: str  #: where captures are written: ``[hotlist] publish_store`` if set, else the store
    trust: TrustPolicy = field(default_factory=TrustPolicy)  #: whose records are stacked (``[trust]``)
    sign_key_path: Path | None = None  #: ``[trust] sign_key``: captures are signed with it
    scope: str = ""  #: ``[depsnap] scope``: records are found and published only within it
    #: ``[depsnap] images``: image reference or top ChainID -> deps key, for snapshots without a deps label
    images: Mapping[str, str] = field(default_factory=dict)

    def sign_key(self) -> SigningKey | None:
        """The node's key (loaded when a capture is signed), or None."""
        return load_signing_key(self.sign_key_path) if self.sign_key_path else None


def mapped_key(images: Mapping[str, str], stat: Callable[[str], Info], key: str, parent: str) -> str | None:
    """The deps key the node's ``[depsnap] images`` gives a container snapshot without a deps label; None if none.

    The mapping is looked up by the image's top ChainID (the parent's name) and then by the image reference
    containerd's CRI unpacker labelled the parent layer with (``containerd.io/snapshot/cri.image-ref``, sent
    with ``disable_snapshot_annotations = false``): the reference that first pulled that layer on this node.
    It is what a cluster operator can set for Kubernetes pods, whose annotations CRI passes only to the pod
    sandbox's snapshot, never to a container's (docs/kubernetes.md).
    """
    base = base_chain(parent)
    if not images or base is None:
        return None
    found = images.get(base)
    if found is None:
        try:
            reference = stat(parent).labels.get(CRI_IMAGE_REF_LABEL, "")
        except SnapshotError:  # the parent went meanwhile: prepare itself fails on it
            return None
        found = images.get(reference) if reference else None
    if found is not None:
        log.info("deps key from the node's [depsnap] images", key=key, parent=parent, deps=found)
    return found


# -- the observer ------------------------------------------------------------------------------


class DepsObserver:
    """Dependency snapshots as the Snapshotter's lifecycle observer (:class:`~.observers.SnapshotObserver`).

    ``backend`` serves the deps layers, ``snapshots_dir`` is where the Snapshotter keeps
    each snapshot's directory (their ``deps.json`` say which stack a layer), ``stat``
    the Snapshotter's own (a parent's labels), ``context`` the node's settings.
    """

    def __init__(self, backend: LayerBackend, snapshots_dir: Path, stat: Callable[[str], Info], context: DepsContext) -> None:
        self.backend = backend
        self.snapshots_dir = snapshots_dir
        self.stat = stat
        self.context = context

    def container_prepared(self, container: PreparedContainer) -> None:
        """On a hit, ask for the deps layer's mount with the Prepare's other requests (:meth:`_mounted` stacks it
        under the container); on a miss, watch the container for a capture."""
        key, upper = container.key, container.upper
        requested = key_of(container.labels)
        if requested is None:
            requested = mapped_key(self.context.images, self.stat, key, container.parent)
        if requested is None:
            return
        namespace = snapshot_namespace(key, container.namespace)
        deps_key = self.store_key(requested, namespace)
        base = base_chain(container.parent)
        if base is None:
            log.warning("deps label on a snapshot that is not over an image layer; ignored", key=key,
                        parent=container.parent)  # fmt: skip
            _neither(upper, "the snapshot is not over an image layer")
            return
        try:
            record = lookup(self.context.store_url, deps_key, timeout=LOOKUP_TIMEOUT, trust=self.context.trust)
        except StoreUnreachable as exc:
            log.warning("deps lookup failed; the container installs as on a miss", key=key, deps=deps_key, error=str(exc))
            record = None
        if record is None:
            _write_state(upper, {"key": deps_key, "state": "watching", "parent": base})
            _marks_dir(upper)
            WATCHER.watch(self.context, key, deps_key, base, upper, {"container": key, "label": requested,
                                                                     "namespace": namespace, "scope": self.context.scope})
            profile_hooks.deps_container("miss", key, requested)  # start-up profiler
            log.info("dependency snapshot missing: capturing when the job signals", key=key, deps=deps_key,
                     label=requested, namespace=namespace, scope=self.context.scope,
                     marker=f"/{MARKER_DIR}/{DONE_MARKER}")  # fmt: skip
            return
        if record.mode != "container" or record.parent != base:
            log.warning("deps record is of another image; not stacked, not captured", key=key, deps=deps_key,
                        parent=container.parent, record_parent=record.parent)  # fmt: skip
            _neither(upper, "the key's snapshot was captured on another image")
            return
        # The deps layer's chain record's parent is the image's top layer, so for the hot lists the deps layer is the
        # top of the image: the first start on it records the reads of the dependencies with the image's
        # (``v1/hotlists/<deps ChainID>/...``), later starts prefetch them.  Unless its mount fails (:meth:`_mounted`).
        container.reads_start_at = record.chain_id
        # The record is trusted: its index stands for a converter's signature.
        mount = ControlRequest(mount_request(record.chain_id, deps_index=record.index), MOUNT_TIMEOUT)
        container.requests.append(ServerRequest(lambda: mount, lambda answer: self._mounted(
            container, answer, record, deps_key=deps_key, requested=requested, namespace=namespace)))

    def _mounted(self, container: PreparedContainer, answer: dict[str, Any] | LayerUnavailable, record: DepsRecord, *,
                 deps_key: str, requested: str, namespace: str) -> None:  # fmt: skip
        """The deps layer's mount answered: stack it under the container, or leave the container to install."""
        key, upper = container.key, container.upper
        if not isinstance(answer, LayerUnavailable):
            try:
                lower = mounted_answer(answer).lower_dir
            except LayerServerError as exc:
                answer = LayerUnavailable("mount_failed", f"layer server: {exc}")
        if isinstance(answer, LayerUnavailable):
            log.warning("deps layer cannot be served; the container installs", key=key, deps=deps_key, error=str(answer))
            _neither(upper, f"the snapshot cannot be served: {answer}")
            container.reads_start_at = container.parent
            return
        _write_state(upper, {"key": deps_key, "state": "stacked", "chain_id": record.chain_id, "index": record.index,
                             "lower_dir": lower})  # fmt: skip
        _marker(upper, HIT_MARKER, requested)
        container.mounts_changed = True
        log.info("dependency snapshot stacked", key=key, deps=deps_key, label=requested, namespace=namespace,
                 chain_id=record.chain_id)  # fmt: skip
        profile_hooks.deps_container("hit", key, requested, chain_id=record.chain_id)  # start-up profiler

    def store_key(self, requested: str, namespace: str) -> str:
        """The record name of the label's key ``requested`` for a Prepare in ``namespace`` on this node."""
        return container_store_key(requested, namespace=namespace, scope=self.context.scope)

    def lowers(self, upper: str) -> list[str]:
        """The deps layer's lower directory, if one is stacked under this snapshot (asked again on every Mounts):
        the one its mount answered while the node still serves it there (:meth:`LayerBackend.serves`), else the
        layer server's answer now."""
        state = _read_state(Path(upper).parent)
        if state is None or state.get("state") != "stacked":
            return []
        chain = str(state["chain_id"])
        lower = state.get("lower_dir")
        if isinstance(lower, str) and self.backend.serves(lower):
            return [lower]
        try:
            try:
                return [self.backend.check(chain)]
            except LayerUnavailable:
                return [self.backend.mount(chain, deps_index=state.get("index"))]
        except LayerUnavailable as exc:
            # Without it the container would see /.bootseer/deps-hit and no packages: fail loudly instead.
            raise FailedPrecondition(f"the dependency layer {chain} of this snapshot cannot be served: {exc}") from None

    def holds_layer(self, chain_id: str, *, besides: Path | None = None) -> bool:
        """Whether a snapshot (other than the directory ``besides``) stacks the deps layer ``chain_id``."""
        try:
            directories = list(self.snapshots_dir.iterdir())
        except FileNotFoundError:
            return False
        for directory in directories:
            if directory == besides or directory.name.startswith(("rm-", "new-")):
                continue
            state = _read_state(directory)
            if state is not None and state.get("state") == "stacked" and state.get("chain_id") == chain_id:
                return True
        return False

    def snapshot_removed(self, key: str, active: bool, snapshot_dir: Path | None) -> None:
        """Unmount the snapshot's deps layer if it was the last to stack it."""
        if not active or snapshot_dir is None:
            return
        state = _read_state(snapshot_dir)
        WATCHER.forget_upper(snapshot_dir)
        if state is None or state.get("state") != "stacked":
            return
        chain = str(state["chain_id"])
        if self.holds_layer(chain, besides=snapshot_dir):
            return
        try:
            self.backend.unmount(chain)
            log.info("unused dependency layer unmounted", chain_id=chain)
        except LayerUnavailable as exc:
            log.warning("cannot unmount an unused dependency layer", chain_id=chain, error=str(exc))


# -- capture on a miss -------------------------------------------------------------------------


@dataclass
class _Watch:
    context: DepsContext
    key: str  #: the snapshot's key (containerd's)
    deps_key: str
    parent: str  #: the image's top ChainID
    upper: str
    inputs: dict[str, str]  #: what scoped the key (shown by ``bootseer deps ls --json``)


class Watcher:
    """One thread per process polling watched writable layers for the done marker; captures run in threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[str, _Watch] = {}  # upper -> watch
        self._thread: threading.Thread | None = None
        self.captures: list[threading.Thread] = []

    def watch(self, context: DepsContext, key: str, deps_key: str, parent: str, upper: str, inputs: dict[str, str]) -> None:
        with self._lock:
            self._watches[upper] = _Watch(context, key, deps_key, parent, upper, inputs)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="deps marker watch", daemon=True)
                self._thread.start()

    def forget_upper(self, snapshot_dir: Path) -> None:
        with self._lock:
            for upper in [u for u in self._watches if Path(u).parent.name == snapshot_dir.name]:
                del self._watches[upper]

    def _run(self) -> None:
        while True:
            with self._lock:
                watches = list(self._watches.values())
                if not watches:
                    self._thread = None
                    return
            for watch in watches:
                if not os.path.isdir(watch.upper):
                    with self._lock:
                        self._watches.pop(watch.upper, None)
                    continue
                if _done_marker_present(watch.upper):
                    with self._lock:
                        self._watches.pop(watch.upper, None)
                    thread = threading.Thread(target=capture_container, args=(watch,), name=f"deps capture {watch.key}")
                    self.captures.append(thread)
                    thread.start()
            time.sleep(POLL_INTERVAL)


WATCHER = Watcher()


@traced("deps.capture", phase="dependencies", attrs=lambda outcome: {"outcome": outcome, "background": True})  # profiler
def capture_container(watch: _Watch) -> str:
    """Capture a container's writable layer and publish it under its deps key; the outcome, also in the marker."""
    started = time.monotonic()
    outcome = "failed: unknown"
    try:
        tree = scan(watch.upper, exclude=EXCLUDED)
        with open_store_writer(watch.context.publish_store) as writer:
            result = publish_capture(writer, key=watch.deps_key, root=watch.upper, tree=tree, change=upper_change(tree),
                                     mode="container", parent=watch.parent, overlay_upper=True, exclude=EXCLUDED,
                                     command=[], inputs=watch.inputs,
                                     sign_key=watch.context.sign_key())  # fmt: skip
        outcome = "published" if result.published else "exists"
        _write_state(watch.upper, {"key": watch.deps_key, "state": "captured", "chain_id": result.chain_id})
        log.info("dependency snapshot captured", key=watch.key, deps=watch.deps_key, chain_id=result.chain_id,
                 files=result.files, bytes=result.bytes, published=result.published,
                 seconds=round(time.monotonic() - started, 3))  # fmt: skip
    except (CaptureError, StoreError, ValueError, OSError) as exc:
        outcome = f"failed: {exc}"
        log.error("dependency snapshot not captured", key=watch.key, deps=watch.deps_key, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - the job waits for the marker: it must always be written
        outcome = f"failed: {type(exc).__name__}: {exc}"
        log.exception("dependency snapshot not captured (unexpected error)", key=watch.key, deps=watch.deps_key)
    try:
        _marker(watch.upper, CAPTURED_MARKER, outcome)
    except OSError as exc:
        log.warning("cannot tell the container the capture ended", key=watch.key, error=str(exc))
    return outcome
