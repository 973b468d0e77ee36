"""containerd's side of a start, from its events API: image pulls, containers, tasks.

:func:`watch` subscribes to ``containerd.services.events.v1.Events/Subscribe`` on containerd's
socket and writes each event of interest to the spool with containerd's own timestamp
(``/images/create``, ``/containers/create``, ``/tasks/create``, ``/tasks/start``,
``/tasks/exit``, ``/tasks/delete``, ``/tasks/oom``). containerd keeps no history of events, so
the watcher must run before the start it profiles (``bootseer profile containerd``, one per
node, beside the snapshotter).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import grpc
from google.protobuf import message

from bootseer.log import get_logger
from bootseer.profile import events
from bootseer.proto.containerd.events import container_pb2, image_pb2, task_pb2
from bootseer.proto.containerd.services.events.v1 import events_pb2, events_pb2_grpc

log = get_logger(__name__)

#: containerd's topic -> (event name, phase, message type, fields copied into the attributes).
TOPICS: dict[str, tuple[str, str, type[message.Message], tuple[str, ...]]] = {
    # An image is created when its pull is done (ctr pull, CRI, rpull): the image phase's end.
    "/images/create": ("image.created", "image", image_pb2.ImageCreate, ("name",)),
    "/images/update": ("image.updated", "", image_pb2.ImageUpdate, ("name",)),
    "/containers/create": ("container.create", "container", container_pb2.ContainerCreate, ("id", "image")),
    "/tasks/create": ("task.create", "container", task_pb2.TaskCreate, ("container_id", "pid")),
    "/tasks/start": ("task.start", "container", task_pb2.TaskStart, ("container_id", "pid")),
    "/tasks/exit": ("task.exit", "", task_pb2.TaskExit, ("container_id", "id", "pid", "exit_status")),
    "/tasks/oom": ("task.oom", "", task_pb2.TaskOOM, ("container_id",)),
    "/tasks/delete": ("task.delete", "", task_pb2.TaskDelete, ("container_id", "pid", "exit_status")),
}


class ContainerdEventsError(RuntimeError):
    """containerd's events stream could not be opened or broke; the message says why."""


def decode(envelope: events_pb2.Envelope) -> tuple[str, str, float, dict[str, Any]] | None:
    """(event name, phase, Unix time, attributes) of an envelope we profile; None for other topics."""
    known = TOPICS.get(envelope.topic)
    if known is None:
        return None
    name, phase, kind, fields = known
    # containerd's type URLs are bare message names ("containerd.events.TaskStart"), which protobuf's
    # Any.Unpack refuses (it wants a "/"): compare the name after the last "/" ourselves.
    if envelope.event.type_url.rsplit("/", 1)[-1] != kind.DESCRIPTOR.full_name:
        return None  # another type under a known topic: not ours to guess at
    payload = kind()
    try:
        payload.ParseFromString(envelope.event.value)
    except message.DecodeError:
        return None
    attrs: dict[str, Any] = {"namespace": envelope.namespace}
    for field in fields:
        # Named as the other components name them: the container's ID, the image's reference.
        renamed = {"container_id": "container", "name": "image"}.get(field, field)
        if field == "id" and "container" not in attrs:
            renamed = "container"
        attrs[renamed] = getattr(payload, field)
    when = envelope.timestamp.seconds + envelope.timestamp.nanos / 1e9
    return name, phase, when, attrs


def subscribe(address: str, namespace: str = "", *, ready: threading.Event | None = None,
              stop: threading.Event | None = None) -> Iterator[events_pb2.Envelope]:
    """containerd's event envelopes (of ``namespace``, or all) until ``stop`` is set or the stream ends."""
    channel = grpc.insecure_channel(f"unix://{address}")
    try:
        stub = events_pb2_grpc.EventsStub(channel)
        filters = [f'namespace=="{namespace}"'] if namespace else []
        stream = stub.Subscribe(events_pb2.SubscribeRequest(filters=filters))
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), stream.cancel()), daemon=True).start()
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
        except grpc.FutureTimeoutError:
            raise ContainerdEventsError(f"containerd at {address} does not answer") from None
        if ready is not None:
            ready.set()
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and stop is not None and stop.is_set():
                return
            raise ContainerdEventsError(f"containerd's event stream at {address}: {exc.code().name}: "
                                        f"{exc.details()}") from None
    finally:
        channel.close()


def watch(address: str, namespace: str = "", *, ready: threading.Event | None = None,
          stop: threading.Event | None = None, on_event: Callable[[str], None] | None = None) -> int:
    """Write containerd's events to the spool until ``stop``; how many were written."""
    written = 0
    for envelope in subscribe(address, namespace, ready=ready, stop=stop):
        decoded = decode(envelope)
        if decoded is None:
            continue
        name, phase, when, attrs = decoded
        events.emit(name, start=when, phase=phase, **attrs)
        written += 1
        if on_event is not None:
            on_event(name)
    return written
