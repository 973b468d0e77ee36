"""The layer server's control socket: JSON lines over ``ROOT/layers/control.sock``.

One request per connection: a line of JSON naming its ``op``, answered with one line,
``{"ok": true, ...}`` or ``{"ok": false, "error": {"kind", "message"}}`` (the kinds are
:class:`~bootseer.blockstore.server.client.LayerServerError`'s; anything else is ``internal``).
What an operation does, and how its answer is framed and counted, is the
:class:`~bootseer.blockstore.server.ops.ControlOps` table's business; this module only reads,
bounds and sends lines, and counts the connections (the round trips).  The callers' end is
:mod:`bootseer.blockstore.server.client`.
"""

from __future__ import annotations

import functools
import json
import os
import socket as stdlib_socket
from pathlib import Path

import prometheus_client
import trio

from bootseer.blockstore.server.client import MAX_MESSAGE, InvalidRequest
from bootseer.blockstore.server.ops import ControlOps, failure
from bootseer.log import get_logger

log = get_logger(__name__)

#: One per connection: the round trips (a batch of requests is one; :mod:`.ops` counts the requests).
CONNECTIONS = prometheus_client.Counter(
    "bootseer_layer_server_control_connections", "Control connections answered: one per round trip"
)
#: Seconds a client has to send its whole request line before it is dropped.
REQUEST_TIMEOUT = 30.0


async def handle_connection(control: ControlOps, stream: trio.SocketStream) -> None:
    """Read one request line from ``stream``, answer it through ``control``, close."""
    async with stream:
        buffer = b""
        with trio.move_on_after(REQUEST_TIMEOUT):  # a peer that sends no whole line in time is dropped
            while b"\n" not in buffer and len(buffer) <= MAX_MESSAGE:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                buffer += chunk
        line = buffer.split(b"\n", 1)[0]
        op = "?"
        if len(line) > MAX_MESSAGE:
            answer = failure(op, InvalidRequest(f"request longer than {MAX_MESSAGE} bytes"))
        else:
            try:
                request = json.loads(line)
            except ValueError:
                answer = failure(op, InvalidRequest("a request is one line of JSON"))
            else:
                op = str(request.get("op", "?")) if isinstance(request, dict) else "?"
                answer = await control.answer(request)
        CONNECTIONS.inc()
        try:
            await stream.send_all(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("control client went away before its answer", op=op)


async def serve_control(
    control: ControlOps, path: Path, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Listen on ``path`` (0600; bound under a temp name and renamed into place, so a
    client never connects to a half-made socket) and answer requests until cancelled."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.unlink(missing_ok=True)
    sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        await sock.bind(str(temp))
        os.chmod(temp, 0o600)
        sock.listen(64)
        os.rename(temp, path)
    except BaseException:
        sock.close()
        temp.unlink(missing_ok=True)
        raise
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(functools.partial(handle_connection, control), [listener], handler_nursery=nursery)
    finally:
        path.unlink(missing_ok=True)


__all__ = ["CONNECTIONS", "handle_connection", "serve_control"]
