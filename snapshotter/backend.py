"""What serves remote snapshots: the seam between the snapshot logic and the layer server.

:class:`~.snapshots.Snapshotter` takes a :class:`LayerBackend`, as stargz-snapshotter's
``snapshot.go`` takes a ``FileSystem``: the snapshot logic decides *when* a layer is
served lazily (Prepare with ``containerd.io/snapshot.ref``, parent checked, two-phase
mount, Remove, restore) and the backend knows *how* (the store's chain records, the
FUSE layer server).  The daemon's backend is :class:`~.layer_backend.LayerServerBackend`;
tests use small real ones.

Every method is blocking and thread-safe (gRPC threads call them).  A failure is a
:class:`~.errors.LayerUnavailable` whose ``reason`` names what failed; a layer that is
simply not converted is ``None`` from :meth:`LayerBackend.lookup`, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from .errors import LayerUnavailable


@dataclass(frozen=True)
class RemoteLayer:
    """A converted layer as the store's chain record describes it."""

    chain_id: str
    parent: str  #: the ChainID of the layers below ("" for a bottom layer)
    diff_id: str  #: digest of the uncompressed layer tar
    digest: str  #: digest of the (compressed) layer blob in the registry
    size: int  #: the layer blob's size in bytes
    files: int = 0  #: entries in the layer's index


@dataclass(frozen=True)
class ControlRequest:
    """One request for the layer server's control socket (:mod:`bootseer.blockstore.server.client`), and how long
    its caller may wait for its answer."""

    fields: dict[str, Any]  #: the request object (``op`` and its arguments)
    timeout: float  #: seconds


class LayerBackend(Protocol):
    def lookup(self, chain_id: str) -> RemoteLayer | None:
        """The converted layer ``chain_id``; None if the store has none.

        Raises :class:`~.errors.LayerUnavailable` when the store (or the backend)
        fails, so a failure never reads as "not converted".
        """
        ...

    def mount(self, chain_id: str, deps_index: str | None = None) -> str:
        """Serve ``chain_id`` (idempotent) and return the lower directory overlayfs takes.

        ``deps_index``: ``chain_id`` is a dependency layer and a deps record the caller
        trusts names this index, which then stands for a converter's signature (docs/trust.md).
        """
        ...

    def warm(self, chain_ids: Sequence[str]) -> None:
        """Start loading ``chain_ids`` (an image's layers above the one being prepared) so that their
        mounts find them loaded; returns at once.  Best effort: it never raises (a failure only
        leaves the mounts to load as they would)."""
        ...

    def check(self, chain_id: str) -> str:
        """The lower directory of ``chain_id`` if it is served and healthy; LayerUnavailable if not."""
        ...

    def serves(self, lower_dir: str) -> bool:
        """Whether ``lower_dir``, which a :meth:`mount` answered, still serves its layer as far as the node can tell
        without asking the server (its mount is there); False sends the caller to :meth:`check`."""
        ...

    def send(self, requests: Sequence[ControlRequest]) -> list[dict[str, Any] | LayerUnavailable]:
        """Send ``requests`` in one round trip (a Prepare's requests of its observers: :mod:`.observers`), answered
        one after another, each on its own: its answer's fields or its failure, in order.  A server that cannot be
        reached (or answers the round trip wrong) fails each.  Waits at most the longest of their timeouts."""
        ...

    def unmount(self, chain_id: str) -> None:
        """Stop serving ``chain_id``; serving nothing under that ChainID is fine."""
        ...

    def mounted(self) -> Sequence[str]:
        """The ChainIDs served now (Cleanup unmounts those no snapshot uses)."""
        ...
