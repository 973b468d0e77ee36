"""containerd's Snapshots gRPC API on top of :class:`~bootseer.snapshotter.snapshots.Snapshotter`.

:class:`SnapshotService` only translates: protobuf messages to the plain values of
:mod:`.types` and back.  Everything every call shares lives in one place,
:class:`ServiceInterceptor`: turning :class:`~.errors.SnapshotError` kinds into
their status codes, turning unexpected exceptions into INTERNAL (logged with the
traceback), and the Prometheus metrics.  :func:`create_server` assembles the two.

containerd's proxy client (``snapshots/proxy/proxy.go``) maps status codes back to
its ``errdefs`` kinds (``errdefs/grpc.go``): NOT_FOUND, ALREADY_EXISTS,
FAILED_PRECONDITION, INVALID_ARGUMENT, UNAVAILABLE and UNIMPLEMENTED each have a
kind that containerd's callers branch on (ALREADY_EXISTS from Prepare means "this
layer is already unpacked").  Any other code, INTERNAL included, becomes
``ErrUnknown``, which containerd reports as a plain failure.  The message travels
as is and containerd appends the kind (``snapshot "x" not found: not found``), so
messages here name the object and never repeat the kind.

The ``snapshotter`` field every request carries names the proxy plugin in
containerd's config; this daemon serves one snapshotter and ignores it.  A client's
gRPC metadata ``containerd-namespace``, if the request has it, is passed on by
Prepare (dependency snapshots are scoped to the namespace, docs/depsnap.md);
containerd 1.6 itself sends none to a proxy snapshotter, whose keys it names
``NS/N/name`` instead (:func:`bootseer.snapshotter.deps_hooks.snapshot_namespace`).
"""

from __future__ import annotations

import time
from concurrent import futures
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator, NoReturn

import grpc
import prometheus_client
from google.protobuf import empty_pb2, timestamp_pb2
from prometheus_client.core import GaugeMetricFamily

from bootseer.log import get_logger
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2 as api
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as api_grpc
from bootseer.proto.containerd.types import mount_pb2

from . import errors
from .snapshots import Snapshotter
from .types import Info, Kind, Mount, Usage

log = get_logger(__name__)

#: The gRPC metadata containerd puts the request's namespace in (``namespaces.GRPCHeader``).
NAMESPACE_HEADER = "containerd-namespace"

# containerd's own service sends List in blocks of 100; Go's gRPC client refuses
# messages over 4 MiB, and labels can make an Info several KiB, so blocks are also
# cut before they pass MAX_LIST_BLOCK_BYTES.
MAX_LIST_BLOCK_ITEMS = 100
MAX_LIST_BLOCK_BYTES = 1 << 20

REQUESTS = prometheus_client.Counter(
    "bootseer_snapshotter_grpc_requests_total",
    "Snapshots API calls handled, by method and gRPC status code.",
    ["method", "code"],
)
ERRORS = prometheus_client.Counter(
    "bootseer_snapshotter_grpc_errors_total",
    "Snapshots API calls that ended in an error status, by method and code.",
    ["method", "code"],
)
LATENCY = prometheus_client.Histogram(
    "bootseer_snapshotter_grpc_request_duration_seconds",
    "Time to handle a Snapshots API call (for List: until the last block is sent), by method.",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


# --- the error kinds' status codes ------------------------------------------------------

#: Each kind's status code, looked up along the kind's class hierarchy (a RootLocked is
#: a FailedPrecondition); containerd's errdefs turns each back into its kind.
STATUS_CODES: dict[type[errors.SnapshotError], grpc.StatusCode] = {
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.CorruptMetadata: grpc.StatusCode.DATA_LOSS,
    errors.LayerUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: errors.SnapshotError) -> grpc.StatusCode:
    """The gRPC status code of a snapshot error kind (UNKNOWN for the bare base class)."""
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.UNKNOWN


# --- conversions ----------------------------------------------------------------------


def mounts_to_proto(mounts: Iterable[Mount]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, target=m.target, options=list(m.options)) for m in mounts]


def timestamp_to_proto(when: datetime | None) -> timestamp_pb2.Timestamp | None:
    if when is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(when)  # aware datetimes are converted to UTC; naive ones are taken as UTC
    return stamp


def info_to_proto(info: Info) -> api.Info:
    return api.Info(
        name=info.name,
        parent=info.parent,
        kind=int(info.kind),
        labels=info.labels,
        created_at=timestamp_to_proto(info.created),
        updated_at=timestamp_to_proto(info.updated),
    )


def info_from_proto(message: api.Info) -> Info:
    try:
        kind = Kind(message.kind)
    except ValueError:
        raise errors.InvalidArgument(f"snapshot {message.name!r}: unknown kind {message.kind}") from None
    return Info(
        name=message.name,
        parent=message.parent,
        kind=kind,
        labels=dict(message.labels),
        created=timestamp_from_proto(message, "created_at"),
        updated=timestamp_from_proto(message, "updated_at"),
    )


# google.protobuf.Timestamp's valid range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z.
_MIN_TIMESTAMP_SECONDS = -62135596800
_MAX_TIMESTAMP_SECONDS = 253402300799


def timestamp_from_proto(message: api.Info, field: str) -> datetime | None:
    """The ``field`` timestamp of ``message`` (None if unset); out of range is InvalidArgument."""
    if not message.HasField(field):
        return None
    stamp = getattr(message, field)
    if not (_MIN_TIMESTAMP_SECONDS <= stamp.seconds <= _MAX_TIMESTAMP_SECONDS and 0 <= stamp.nanos <= 999_999_999):
        raise errors.InvalidArgument(
            f"snapshot {message.name!r}: {field} out of range (seconds={stamp.seconds}, nanos={stamp.nanos}); "
            "a timestamp lies between 0001-01-01 and 9999-12-31 with nanos in [0, 999999999]"
        )
    return stamp.ToDatetime(timezone.utc)


def labels_from_proto(labels: Any) -> dict[str, str] | None:
    # proto3 cannot tell an empty map from an absent one; both mean "no labels".
    return dict(labels) or None


def list_blocks(infos: Iterable[Info]) -> Iterator[api.ListSnapshotsResponse]:
    """Group ``infos`` into List responses of bounded count and size."""
    block: list[api.Info] = []
    block_bytes = 0
    for info in infos:
        message = info_to_proto(info)
        size = message.ByteSize()
        if block and block_bytes + size > MAX_LIST_BLOCK_BYTES:
            yield api.ListSnapshotsResponse(info=block)
            block, block_bytes = [], 0
        block.append(message)
        block_bytes += size
        if len(block) >= MAX_LIST_BLOCK_ITEMS:
            yield api.ListSnapshotsResponse(info=block)
            block, block_bytes = [], 0
    if block:
        yield api.ListSnapshotsResponse(info=block)


def request_namespace(context: grpc.ServicerContext) -> str:
    """The containerd namespace of a request ("" from a client that sends none: one that talks to us directly).

    The first value, as containerd's own ``namespaces.fromGRPCHeader`` reads it.
    """
    for name, value in context.invocation_metadata() or ():
        if name == NAMESPACE_HEADER:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


# --- the service ----------------------------------------------------------------------


class SnapshotService(api_grpc.SnapshotsServicer):
    """The ten Snapshots RPCs; errors are raised as :mod:`.errors` kinds for the interceptor."""

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.snapshotter = snapshotter

    def Prepare(self, request: api.PrepareSnapshotRequest, context: grpc.ServicerContext) -> api.PrepareSnapshotResponse:
        mounts = self.snapshotter.prepare(request.key, request.parent, labels_from_proto(request.labels),
                                          namespace=request_namespace(context))  # fmt: skip
        return api.PrepareSnapshotResponse(mounts=mounts_to_proto(mounts))

    def View(self, request: api.ViewSnapshotRequest, context: grpc.ServicerContext) -> api.ViewSnapshotResponse:
        mounts = self.snapshotter.view(request.key, request.parent, labels_from_proto(request.labels))
        return api.ViewSnapshotResponse(mounts=mounts_to_proto(mounts))

    def Mounts(self, request: api.MountsRequest, context: grpc.ServicerContext) -> api.MountsResponse:
        return api.MountsResponse(mounts=mounts_to_proto(self.snapshotter.mounts(request.key)))

    def Commit(self, request: api.CommitSnapshotRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self.snapshotter.commit(request.name, request.key, labels_from_proto(request.labels))
        return empty_pb2.Empty()

    def Remove(self, request: api.RemoveSnapshotRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self.snapshotter.remove(request.key)
        return empty_pb2.Empty()

    def Stat(self, request: api.StatSnapshotRequest, context: grpc.ServicerContext) -> api.StatSnapshotResponse:
        return api.StatSnapshotResponse(info=info_to_proto(self.snapshotter.stat(request.key)))

    def Update(self, request: api.UpdateSnapshotRequest, context: grpc.ServicerContext) -> api.UpdateSnapshotResponse:
        if not request.HasField("info"):
            raise errors.InvalidArgument("update request carries no snapshot info")
        # An empty mask means "every mutable field", as containerd's snapshotters read it.
        fieldpaths = list(request.update_mask.paths) or None
        info = self.snapshotter.update(info_from_proto(request.info), fieldpaths)
        return api.UpdateSnapshotResponse(info=info_to_proto(info))

    def List(self, request: api.ListSnapshotsRequest, context: grpc.ServicerContext) -> Iterator[api.ListSnapshotsResponse]:
        yield from list_blocks(self.snapshotter.list(list(request.filters) or None))

    def Usage(self, request: api.UsageRequest, context: grpc.ServicerContext) -> api.UsageResponse:
        usage: Usage = self.snapshotter.usage(request.key)
        return api.UsageResponse(size=usage.size, inodes=usage.inodes)

    def Cleanup(self, request: api.CleanupRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self.snapshotter.cleanup()
        return empty_pb2.Empty()


class ServiceInterceptor(grpc.ServerInterceptor):
    """Maps errors to status codes, logs and counts every call of the service it wraps."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        method = handler_call_details.method.rpartition("/")[2]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # the Snapshots API has no client-streaming methods

    def _unary(self, method: str, behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()
            try:
                response = behavior(request, context)
            except Exception as exc:
                self._fail(method, request, context, exc, started)
            self._done(method, context, started)
            return response

        return call

    def _stream(self, method: str, behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.monotonic()
            try:
                yield from behavior(request, context)
            except GeneratorExit:  # the client went away mid-stream
                self._record(method, grpc.StatusCode.CANCELLED, started)
                raise
            except Exception as exc:
                self._fail(method, request, context, exc, started)
            self._done(method, context, started)

        return call

    def _done(self, method: str, context: grpc.ServicerContext, started: float) -> None:
        self._record(method, context.code() or grpc.StatusCode.OK, started)

    def _fail(self, method: str, request: Any, context: grpc.ServicerContext, exc: Exception, started: float) -> NoReturn:
        """End the call with the status ``exc`` stands for; never returns."""
        fields = {"method": method, **_request_fields(request)}
        if isinstance(exc, errors.SnapshotError):
            code, message = status_code(exc), str(exc) or type(exc).__name__
            log.debug("call failed", code=code.name, error=message, **fields)
        else:
            code = grpc.StatusCode.INTERNAL
            message = f"internal error in bootseer-snapshotter (details in its log): {type(exc).__name__}: {exc}"
            log.error("call failed with an unexpected error", exc_info=exc, **fields)
        self._record(method, code, started)
        context.abort(code, message)
        raise AssertionError("unreachable: ServicerContext.abort raises")

    @staticmethod
    def _record(method: str, code: grpc.StatusCode, started: float) -> None:
        LATENCY.labels(method).observe(time.monotonic() - started)
        REQUESTS.labels(method, code.name).inc()
        if code is not grpc.StatusCode.OK:
            ERRORS.labels(method, code.name).inc()


def _request_fields(request: Any) -> dict[str, str]:
    """The identifying fields of a request, for log lines."""
    fields = {name: getattr(request, name) for name in ("key", "name", "parent") if getattr(request, name, "")}
    if isinstance(request, api.UpdateSnapshotRequest):
        fields["key"] = request.info.name
    return fields


class SnapshotCountCollector:
    """``bootseer_snapshotter_snapshots{kind}``: counted from the metadata at each scrape."""

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.snapshotter = snapshotter

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> list[GaugeMetricFamily]:
        try:
            infos = self.snapshotter.list(None)
        except Exception:
            # A scrape must not fail because of one gauge; the count is just absent.
            log.warning("cannot count snapshots for metrics", exc_info=True)
            return []
        counts = {kind: 0 for kind in Kind if kind is not Kind.UNKNOWN}
        for info in infos:
            counts[info.kind] = counts.get(info.kind, 0) + 1
        family = self._family()
        for kind, count in counts.items():
            family.add_metric([kind.name.lower()], count)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("bootseer_snapshotter_snapshots", "Snapshots stored, by kind.", labels=["kind"])


def create_server(snapshotter: Snapshotter, max_workers: int) -> grpc.Server:
    """A gRPC server, not yet bound nor started, serving ``snapshotter`` from a thread pool.

    Every method goes through :class:`ServiceInterceptor`.  The snapshot-count gauge is
    not registered here: its owner registers a :class:`SnapshotCountCollector` once.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[ServiceInterceptor()],
    )
    api_grpc.add_SnapshotsServicer_to_server(SnapshotService(snapshotter), server)
    return server
