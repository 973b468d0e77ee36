"""The error kinds of the snapshot logic, as containerd's ``errdefs`` names them.

containerd's proxy client maps gRPC status codes back to its ``errdefs`` kinds, and
its callers branch on them (an ALREADY_EXISTS from Prepare means "the layer is
already there, skip the download").  The snapshot logic raises these kinds and knows
nothing of gRPC; the service edge (:mod:`.grpc_service`) maps each kind to its status code,
and the daemon turns the start-up kinds (:class:`RootLocked`, :class:`SchemaTooNew`,
:class:`CorruptMetadata`) into a one-line refusal.
"""

from __future__ import annotations


class SnapshotError(Exception):
    """Base of the snapshotter's errors; the message names the object and never the kind."""


class NotFound(SnapshotError):
    """The snapshot (or its parent) does not exist."""


class AlreadyExists(SnapshotError):
    """A snapshot of that key or name exists already."""


class FailedPrecondition(SnapshotError):
    """The request is valid but the state does not allow it (wrong kind, has children, closed)."""


class InvalidArgument(SnapshotError):
    """The request itself is malformed: bad key, labels, filter, field path or timestamp."""


class RootLocked(FailedPrecondition):
    """Another snapshotter holds the root's lock; the message names the root and the holder's pid."""


class SchemaTooNew(FailedPrecondition):
    """The metadata database was written by a newer bootseer with a schema this one does not know."""


class CorruptMetadata(SnapshotError):
    """The metadata database cannot be read: not a database, damaged, or unreadable."""


class LayerUnavailable(SnapshotError):
    """A remote layer cannot be looked up, mounted or checked now.

    ``reason`` is a short word for logs and the fallback metric (``store_error``,
    ``server_unavailable``, ``corrupt``, ``untrusted``, ``mount_failed``, ``not_mounted``).  Prepare
    never lets it out: it falls back to the ordinary download-and-unpack path.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
