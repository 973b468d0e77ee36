"""The error kinds of containerd's snapshotter API.

containerd's proxy client maps gRPC status codes back to its ``errdefs`` kinds, and
its callers branch on them (an ALREADY_EXISTS from Prepare means "the layer is
already there, skip the download").  The snapshot logic raises these; the gRPC
service turns each into its status code.
"""

from __future__ import annotations

import grpc


class SnapshotError(Exception):
    """Base of the snapshotter's errors; ``code`` is the gRPC status it maps to."""

    code = grpc.StatusCode.UNKNOWN


class NotFound(SnapshotError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SnapshotError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SnapshotError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(SnapshotError):
    code = grpc.StatusCode.INVALID_ARGUMENT
