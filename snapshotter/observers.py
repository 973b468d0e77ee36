"""The Snapshotter's lifecycle observers: what it tells the parts the daemon plugs in.

containerd's snapshotter knows snapshots; the extensions that care when a container's
snapshot comes and goes -- the start-up profiler, dependency snapshots
(:class:`~bootseer.snapshotter.deps_hooks.DepsObserver`), hot lists
(:class:`HotListObserver`) -- are registered by the daemon
(:meth:`~bootseer.snapshotter.snapshots.Snapshotter.observe`) and seen by the
Snapshotter only as :class:`SnapshotObserver`.  The Snapshotter calls them in the order
they were registered when a container's snapshot is prepared, and in the reverse order
when a snapshot is removed (what was set up last is torn down first).

What an observer has to ask the layer server about a prepared container it does not send
itself: it adds a :class:`ServerRequest` to the container, and once every observer has seen
it the Snapshotter sends them all in one round trip (a dependency layer's mount and the
hot-list notice that names it: a container's start makes one round trip, with a deps hit
or without) and hands each its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bootseer.hotlist import hooks as hotlist_hooks
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks

from .backend import ControlRequest
from .errors import LayerUnavailable

log = get_logger(__name__)


@dataclass(frozen=True)
class ServerRequest:
    """What an observer has to ask the layer server about a container it was told of: sent with the Prepare's
    other requests in one round trip once every observer has seen the container
    (:meth:`LayerBackend.send <bootseer.snapshotter.backend.LayerBackend.send>`)."""

    #: The request, built when it is sent, from the container as it is then.  Built again once every answer is
    #: in: a request whose inputs an earlier answer changed (a dependency layer that could not be stacked after
    #: all) is sent again, on its own.
    build: Callable[[], ControlRequest]
    #: Given its answer's fields or its failure (never raises).
    answered: Callable[[dict[str, Any] | LayerUnavailable], None]


@dataclass
class PreparedContainer:
    """An active snapshot just prepared on ``parent`` (a container's rootfs, if containerd made it for one)."""

    key: str
    parent: str
    labels: dict[str, str]
    upper: str  #: its writable directory
    namespace: str  #: the request's ``containerd-namespace`` header ("" if it had none)
    #: The layer the container's reads start at: its parent, or a dependency layer an observer stacked on it.
    reads_start_at: str
    #: Set by an observer that changed what the snapshot mounts (stacked a layer under it).
    mounts_changed: bool = False
    #: The observers' requests for the layer server, in the order they were told (:class:`ServerRequest`).
    requests: list[ServerRequest] = field(default_factory=list)


class SnapshotObserver(Protocol):
    """What the Snapshotter tells (and asks) a part the daemon registered.  No method may fail the operation
    except :meth:`lowers`, whose errors are the Snapshotter's own kinds (``bootseer.snapshotter.errors``)."""

    def container_prepared(self, container: PreparedContainer) -> None:
        """An active snapshot was prepared (not a layer's: those are remote or unpacked)."""
        ...

    def snapshot_removed(self, key: str, active: bool, snapshot_dir: Path | None) -> None:
        """Snapshot ``key`` was removed; its directory, set aside, is ``snapshot_dir`` until this returns."""
        ...

    def lowers(self, upper: str) -> list[str]:
        """Lower directories to stack right under the active snapshot whose writable directory is ``upper``."""
        ...

    def holds_layer(self, chain_id: str) -> bool:
        """Whether layer ``chain_id`` must stay mounted for this observer (no snapshot references it)."""
        ...


class ProfileObserver:
    """The start-up profiler's view of containers: each container's prepare and its marks (``docs/profile.md``)."""

    def container_prepared(self, container: PreparedContainer) -> None:
        profile_hooks.container_prepared(container.key, container.parent, container.labels, Path(container.upper))

    def snapshot_removed(self, key: str, active: bool, snapshot_dir: Path | None) -> None:
        if snapshot_dir is not None:
            profile_hooks.container_removed(key, snapshot_dir)  # the container's marks, before they go

    def lowers(self, upper: str) -> list[str]:
        return []

    def holds_layer(self, chain_id: str) -> bool:
        return False


class HotListObserver:
    """Tells the layer server under ``root`` when a container on lazy layers comes and goes (it records or
    prefetches the container's hot list: :mod:`bootseer.hotlist.hooks`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def container_prepared(self, container: PreparedContainer) -> None:
        def build() -> ControlRequest:
            return ControlRequest(hotlist_hooks.prepared_request(container.key, container.reads_start_at,
                                                                 container.labels, container.upper),
                                  hotlist_hooks.NOTIFY_TIMEOUT)  # fmt: skip

        def answered(answer: dict[str, Any] | LayerUnavailable) -> None:
            if isinstance(answer, LayerUnavailable):  # never fails the Prepare: reads are served as always
                level = log.debug if answer.reason == "server_unavailable" else log.warning
                level("hot-list notice not taken", key=container.key, reason=answer.reason, error=str(answer))
            else:
                hotlist_hooks.prepared_answered(container.key, container.reads_start_at, answer)

        if container.parent:
            container.requests.append(ServerRequest(build, answered))

    def snapshot_removed(self, key: str, active: bool, snapshot_dir: Path | None) -> None:
        if active:
            hotlist_hooks.container_removed(self.root, key)

    def lowers(self, upper: str) -> list[str]:
        return []

    def holds_layer(self, chain_id: str) -> bool:
        return False


__all__ = ["HotListObserver", "PreparedContainer", "ProfileObserver", "ServerRequest", "SnapshotObserver"]
