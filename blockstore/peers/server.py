"""Serving verified blocks to peers: the peer listener, what a connection may hold, and failed authentications.

The owner serves only blocks it has verified (memory, its verifying node cache, or
just fetched and checked), ``max_uploads`` at once and at most ``upload_rate``
bytes per second in all, so serving never starves the node's own start; a request
beyond what it can queue is answered ``503`` at once, and one whose block it has not
got within :data:`BUSY_AFTER` deadlines ``503 Busy`` (the asker goes to the store and
does not skip it: an owner busy with its own reads is not a peer that never delivers).
What a member can make an owner do is bounded (docs/peers.md, "What a member can
make an owner do"): a request names at most the bytes its block can take
(``peer_wire``), a block no larger than the blocks of the layers this node serves,
and is fetched once (a made-up digest is refused, not fetched again); its store
fetch runs below the node's own reads (a peer's ``demand`` is this node's
READAHEAD), at most ``max_uploads`` at once, its buffers held within
:func:`~bootseer.blockstore.peers.limits.peer_memory_share` of ``memory_limit``; and each asking peer may make the
node fetch at most ``fetch_budget`` store bytes per :data:`~bootseer.blockstore.peers.config.BUDGET_WINDOW` seconds
(``503`` beyond it, counted as ``over_budget``).
Requests must carry the group's token (``Authorization: Bearer``) unless the
server listens on loopback only; the token is read from a file and never logged.
A connection must send its request head within :data:`HEAD_DEADLINE`, at most
``max_connections`` are open (those that never authenticated are dropped first), and
a wrong token closes its connection and holds off its address (:class:`PeerServer`).
What a peer learns and what the network can get is in docs/peers.md.

Blocks come from the layer server through a :data:`BlockGetter`, with the asking peer's
:class:`~bootseer.blockstore.node.peers.PeerAllowance`; the server knows no store.
"""

from __future__ import annotations

import errno
import hmac
import math
import os
import resource
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from bootseer.blockstore.node.peers import PeerAllowance, PeerPayload
from bootseer.blockstore.objects.format import MAX_BLOCK_SIZE, BlockPlace
from bootseer.blockstore.peers.config import PeerConfig, parse_address, split_address
from bootseer.blockstore.peers.limits import ByteLimiter, PeerBudgets, PeerRefused, TokenBucket
from bootseer.blockstore.peers.stats import PEER_BYTES, PEER_CONNECTIONS, PEER_SERVED, PeerCounters, PeerStatistics
from bootseer.blockstore.peers.wire import (
    BLOCKS_PATH, FRAME_ENCODING, KEEPALIVE, PATIENCE, PING_PATH, PROCESSING, HttpStream, WireError, parse_block_target, parse_head,
    response_head, server_tls_context,
)  # fmt: skip
from bootseer.fetch.stripes import Priority
from bootseer.log import get_logger

log = get_logger(__name__)

#: Deadlines an owner may take to get a peer's block and an upload slot for it before it answers
#: ``503 Busy`` instead (the asker then uses its store and does not skip it): fewer than PATIENCE, so
#: that an owner honestly at work below its own reads answers before its asker's patience runs out
#: (which would skip it as a peer that keeps talking without delivering).  Members share ``deadline``.
BUSY_AFTER = PATIENCE - 1
#: An idle incoming connection is closed after this many seconds.
SERVER_IDLE = 60.0
#: A request head (and a TLS handshake before the first) must be whole this many seconds after the
#: connection was accepted, or, on a kept-alive connection, after the head's first byte.
HEAD_DEADLINE = 5.0
#: A failed authentication refuses its address's new connections this long, doubled for each failure
#: in a row up to AUTH_BACKOFF_MAX (a failure after a quiet AUTH_BACKOFF_MAX starts over).
AUTH_BACKOFF = 1.0
AUTH_BACKOFF_MAX = 60.0
#: Addresses whose failed authentications are remembered (the least recent beyond it are forgotten).
AUTH_ADDRESSES = 4096
#: Failed authentications are logged at most once in this many seconds (with how many there were).
AUTH_LOG_INTERVAL = 10.0
#: An accept that fails for want of file descriptors or memory is retried after this many seconds.
ACCEPT_RETRY = 0.1
#: A block's body goes out in pieces of this many bytes, each taken from ``upload_rate`` as it is sent.
UPLOAD_PIECE = 256 << 10
#: Block requests an owner queues beyond those it serves before answering 503.
QUEUE_PER_UPLOAD = 8

#: The priority an owner fetches a peer's block at: below the node's own reads whatever the peer
#: says (a peer's demand read is this node's read-ahead; its read-ahead and prefetch, prefetch).
_SERVED_AT = {"demand": Priority.READAHEAD, "readahead": Priority.PREFETCH, "prefetch": Priority.PREFETCH}


#: Finds a verified block for a peer: (store id, place, priority, allowance, whether the peer takes
#: compressed frames) -> what to send (the store's frame of it, or its raw bytes), or None when this
#: node has no store of that id, the store fails (FetchError) or its bytes there are not that block;
#: a store fetch is charged to the allowance first (which raises PeerRefused).
BlockGetter = Callable[[str, BlockPlace, Priority, PeerAllowance, bool], Awaitable[PeerPayload | None]]


def largest_format_block() -> int:
    """The largest block the format allows: what a server may be asked for when it knows no better."""
    return MAX_BLOCK_SIZE


#: Why an accept fails when the process or the system is out of file descriptors or memory.
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def connection_cap(wanted: int) -> int:
    """``wanted``, or half the process's file descriptor limit if that is less (the layer server needs the rest)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft // 2))


class AuthThrottle:
    """Failed authentications by source address: each refuses the address's new connections for a while.

    :data:`AUTH_BACKOFF` seconds after a first failure, doubled for each failure in a row
    up to :data:`AUTH_BACKOFF_MAX`; a success, or a quiet :data:`AUTH_BACKOFF_MAX` after the
    refusal ends, starts over.  At most :data:`AUTH_ADDRESSES` addresses are remembered.
    """

    def __init__(self) -> None:
        self._failed: dict[str, tuple[int, float]] = {}  #: address -> (failures in a row, refused until)

    def refused(self, host: str, now: float) -> bool:
        entry = self._failed.get(host)
        return entry is not None and entry[1] > now

    def failed(self, host: str, now: float) -> float:
        """Count a failure of ``host``; the seconds its new connections are refused from now."""
        failures, until = self._failed.pop(host, (0, 0.0))
        if now > until + AUTH_BACKOFF_MAX:
            failures = 0
        seconds = min(AUTH_BACKOFF * 2**min(failures, 16), AUTH_BACKOFF_MAX)
        self._failed[host] = (failures + 1, now + seconds)  # (re)inserted last: the most recent
        while len(self._failed) > AUTH_ADDRESSES:
            del self._failed[next(iter(self._failed))]
        return seconds

    def succeeded(self, host: str) -> None:
        self._failed.pop(host, None)


@dataclass(eq=False)
class _Connection:
    """A connection to the peer listener, while it is open."""

    stream: HttpStream
    host: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    authenticated: bool = False  #: it made a request with the group's token (or there is no token)
    evicted: bool = False  #: dropped at the connection cap (its socket is closed already)


class PeerServer:
    """Serves verified blocks to peers over HTTP(S) (see the module docstring).

    What a connection may hold: its request head must be whole :data:`HEAD_DEADLINE`
    seconds after the accept (after its first byte on a kept-alive connection), and at
    most ``max_connections`` are open (fewer if the file descriptor limit is low): at the
    cap a new connection evicts the oldest one that has not authenticated, or is answered
    503 and closed if every one has.  A request with a wrong token is answered 401 and its
    connection closed, and its address's new connections are answered 401 unread and
    closed for a while (:class:`AuthThrottle`).  An accept that fails for want of file
    descriptors is logged once, then counted, and drops the oldest unauthenticated
    connection to make room.

    ``memory`` bounds the bytes held for peers' requests at once (:func:`peer_memory_share`);
    ``largest_block`` says the largest block a request may name (the block size of the
    layers this node serves).
    """

    def __init__(self, config: PeerConfig, token: str | None, get_block: BlockGetter, *,
                 counters: PeerCounters | None = None, memory: int = 256 << 20,
                 largest_block: Callable[[], int] = largest_format_block) -> None:  # fmt: skip
        self.config = config
        self._token = token.encode() if token else None
        self._get_block = get_block
        self._largest_block = largest_block
        self._budgets = PeerBudgets(config.fetch_budget)
        self._memory = ByteLimiter(memory)  # bytes held for peers' requests (fetched and raw), all peers together
        self._getting = trio.CapacityLimiter(config.max_uploads)  # blocks got for peers at once
        self._uploads = trio.CapacityLimiter(config.max_uploads)
        self._bucket = TokenBucket(config.upload_rate)
        self._tls = server_tls_context(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
        self._counters = counters if counters is not None else PeerCounters()
        self.address: tuple[str, int] | None = None  #: where it listens, once listening
        self._queued = 0
        self._connections: dict[HttpStream, _Connection] = {}  #: open ones, oldest first
        self.max_connections = connection_cap(config.max_connections)  #: the cap in force
        self._throttle = AuthThrottle()
        self._out_of_fds_logged = False
        self._auth_logged_at = -math.inf
        self._auth_unlogged = 0

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``config.listen`` and serve until cancelled (OSError if the address cannot be bound)."""
        assert self.config.listen is not None
        host, port = split_address(parse_address(self.config.listen))
        try:
            listeners: Sequence[trio.abc.Listener[Any]] = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise ValueError(f"peers: cannot listen on {self.config.listen}: {exc.strerror or exc}") from None
        self.address = listeners[0].socket.getsockname()[:2]  # type: ignore[attr-defined]
        if self._tls is not None:
            listeners = [trio.SSLListener(listener, self._tls, https_compatible=True) for listener in listeners]
        log.info("serving blocks to peers", address=f"{self.address[0]}:{self.address[1]}",
                 tls=self._tls is not None, token=self._token is not None,
                 max_connections=self.max_connections)  # fmt: skip
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept, listener, nursery)
            task_status.started(self.address)

    def statistics(self) -> PeerStatistics:
        """What this server counted (with a service's client, what both counted), what it holds for peers,
        and its connections, as a frozen copy."""
        authenticated = sum(1 for connection in self._connections.values() if connection.authenticated)
        return self._counters.frozen(
            held_bytes=self._memory.held, held_peak=self._memory.peak, held_limit=self._memory.total,
            connections_open=len(self._connections), connections_authenticated=authenticated,
            connections_limit=self.max_connections,
        )

    async def _accept(self, listener: trio.abc.Listener[Any], nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    raw = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _OUT_OF_DESCRIPTORS:
                        raise
                    if not self._out_of_descriptors(exc):
                        await trio.sleep(ACCEPT_RETRY)  # nothing to drop: wait for descriptors to come free
                    continue
                stream = HttpStream(raw)
                connection = self._admitted(stream)
                if isinstance(connection, _Connection):
                    nursery.start_soon(self._connection, connection)
                else:
                    await self._turn_away(stream, *connection)

    def _admitted(self, stream: HttpStream) -> _Connection | tuple[int, str]:
        """The accepted ``stream`` as an open connection, or the answer it is closed with at once: 401 when its
        address is held off after a failed authentication, 503 at the cap with no unauthenticated connection
        to evict."""
        host = stream.remote_host()
        if self._throttle.refused(host, time.monotonic()):
            PEER_CONNECTIONS.labels("throttled").inc()
            return 401, "Unauthorized: held off after a failed authentication"
        if len(self._connections) >= self.max_connections and not self._evict_one():
            PEER_CONNECTIONS.labels("refused").inc()
            return 503, "Busy: too many connections"
        PEER_CONNECTIONS.labels("accepted").inc()
        connection = _Connection(stream, host)
        self._connections[stream] = connection
        return connection

    async def _turn_away(self, stream: HttpStream, status: int, reason: str) -> None:
        """Answer ``status`` without reading the request (so that a member learns why: a bare close reads as a
        broken peer) and close the connection; over TLS, just close it (no handshake for it)."""
        if self._tls is None:
            body = reason.encode() + b"\n"
            with trio.move_on_after(ACCEPT_RETRY):  # a new connection's send buffer takes it at once
                try:
                    await stream.send(response_head(status, reason, len(body), close=True) + body)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it went away already
        stream.close_now()

    def _evict_one(self) -> bool:
        """Drop the oldest connection that has not authenticated; False if there is none."""
        victim = next((c for c in self._connections.values() if not c.authenticated), None)
        if victim is None:
            return False
        victim.evicted = True
        victim.scope.cancel()
        victim.stream.close_now()  # its descriptor is free now, not when its task next runs
        del self._connections[victim.stream]
        PEER_CONNECTIONS.labels("evicted").inc()
        return True

    def _out_of_descriptors(self, exc: OSError) -> bool:
        """Count and (once) log an accept that failed for want of descriptors; whether a connection was dropped."""
        PEER_CONNECTIONS.labels("accept_failed").inc()
        if not self._out_of_fds_logged:
            self._out_of_fds_logged = True
            log.warning("cannot accept peer connections: dropping unauthenticated ones to make room (logged once; "
                        "counted in bootseer_peer_connections_total{outcome=\"accept_failed\"})",
                        error=errno.errorcode.get(exc.errno or 0, "?"), reason=os.strerror(exc.errno or 0),
                        open=len(self._connections))  # fmt: skip
        return self._evict_one()

    async def _connection(self, connection: _Connection) -> None:
        stream = connection.stream
        try:
            with connection.scope:
                since: float | None = trio.current_time()  # the first head's deadline runs from the accept
                while True:
                    try:
                        head = await stream.read_head(HEAD_DEADLINE if since is not None else SERVER_IDLE,
                                                      whole=HEAD_DEADLINE, since=since)  # fmt: skip
                    except trio.TooSlowError:
                        if since is not None or stream.buffered():
                            PEER_CONNECTIONS.labels("head_timeout").inc()
                        return
                    since = None
                    if head is None:
                        return
                    if not await self._request(stream, head):
                        return
        except (WireError, OSError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("peer connection ended", error=str(exc))  # it went away or broke the protocol
        except Exception:  # a bug here must cost one peer connection, never the layer server
            log.error("serving a peer failed", exc_info=True)
        finally:
            if not connection.evicted:
                del self._connections[stream]
                await stream.aclose()

    def _authorized(self, stream: HttpStream, headers: dict[str, str]) -> bool:
        """Whether a request carries the group's token (always true without one).

        A failure is counted, logged now and then (the address, never what it sent) and
        refuses its address's new connections for a while; the caller closes the connection.
        """
        connection = self._connections.get(stream)
        host = connection.host if connection is not None else ""
        if self._token is not None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
                self._counters.auth_failures += 1
                now = time.monotonic()
                refused_for = self._throttle.failed(host, now)
                self._auth_unlogged += 1
                if now - self._auth_logged_at >= AUTH_LOG_INTERVAL:
                    log.warning("a peer request failed authentication; its address is refused for a while",
                                address=host, refused_for=refused_for, failures=self._auth_unlogged,
                                interval=AUTH_LOG_INTERVAL)  # fmt: skip
                    self._auth_logged_at, self._auth_unlogged = now, 0
                return False
        self._throttle.succeeded(host)
        if connection is not None:
            connection.authenticated = True
        return True

    async def _reply(self, stream: HttpStream, status: int, reason: str, outcome: str, close: bool = False) -> None:
        PEER_SERVED.labels(outcome).inc()
        body = reason.encode() + b"\n"
        await stream.send(response_head(status, reason, len(body), close=close) + body)

    async def _request(self, stream: HttpStream, head: bytes) -> bool:
        """Answer one request; False when the connection must close after it."""
        try:
            method, target, headers = parse_head(head, request=True)
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                raise WireError("a request has no body")
        except WireError:
            await self._reply(stream, 400, "Bad Request", "bad_request", close=True)
            return False
        keep = headers.get("connection", "").lower() != "close"
        if method != "GET":
            await self._reply(stream, 405, "Method Not Allowed", "bad_request", close=True)
            return False
        if target == PING_PATH:
            await stream.send(response_head(200, "OK", 3) + b"ok\n")
            return keep
        if not self._authorized(stream, headers):
            await self._reply(stream, 401, "Unauthorized", "unauthorized", close=True)
            return False
        if not target.startswith(BLOCKS_PATH):
            await self._reply(stream, 404, "Not Found", "bad_request")
            return keep
        try:
            store, place, priority = parse_block_target(target)
        except ValueError as exc:
            await self._reply(stream, 400, f"Bad Request: {exc}", "bad_request")
            return keep
        if place.rlen > self._largest_block():
            await self._reply(stream, 404, f"Not Found: no layer this node serves has blocks of {place.rlen} bytes",
                              "too_large")  # fmt: skip
            return keep
        if self._queued >= self.config.max_uploads * QUEUE_PER_UPLOAD:
            self._counters.busy += 1
            await self._reply(stream, 503, "Busy", "busy")
            return keep
        held = place.clen + place.rlen  # the most a request holds: the fetched bytes and the raw block
        taken = uploading = False
        compressed = FRAME_ENCODING in headers.get("accept-encoding", "").replace(" ", "").split(",")

        async def get() -> PeerPayload | None:
            """The block, with an upload slot taken for it; PeerRefused 503 if that takes BUSY_AFTER deadlines."""
            nonlocal taken, uploading
            with trio.move_on_after(BUSY_AFTER * self.config.deadline):
                await self._memory.acquire(held)
                taken = True
                async with self._getting:
                    allowance = self._budgets.allowance(_peer_host(stream))
                    data = await self._get_block(store, place, _SERVED_AT[priority], allowance, compressed)
                if data is not None:
                    await self._uploads.acquire_on_behalf_of(stream)
                    uploading = True  # (no checkpoint between: a cancel cannot leave the slot taken unnoted)
                return data
            raise PeerRefused(503, "Busy: the block is not at hand in time", "busy")

        self._queued += 1
        try:
            try:
                data = await self._block_with_keepalive(stream, get)
            finally:
                self._queued -= 1
            if isinstance(data, PeerRefused):
                if data.outcome == "over_budget":
                    self._counters.over_budget += 1
                elif data.outcome == "busy":
                    self._counters.busy += 1
                await self._reply(stream, data.status, data.reason, data.outcome)
                return keep
            if data is None:
                await self._reply(stream, 404, "Not Found", "missing")
                return keep
            body = data.body
            encoding = FRAME_ENCODING if data.compressed else None
            head = response_head(200, "OK", len(body), kind="application/octet-stream", encoding=encoding)
            view = memoryview(body)
            for start in range(0, len(view), UPLOAD_PIECE):  # each piece within upload_rate as it goes
                piece = view[start : start + UPLOAD_PIECE]
                await self._bucket.take(len(piece))
                await stream.send(head + piece if start == 0 else piece)
        finally:
            if uploading:
                self._uploads.release_on_behalf_of(stream)
            if taken:
                self._memory.release(held)
        PEER_SERVED.labels("ok").inc()
        PEER_BYTES.labels("served").inc(len(body))
        self._counters.served_blocks += 1
        self._counters.served_bytes += len(body)
        return keep

    async def _block_with_keepalive(self, stream: HttpStream,
                                    get: Callable[[], Awaitable[PeerPayload | None]]) -> PeerPayload | PeerRefused | None:  # fmt: skip
        """What ``get`` gives (the block's bytes, None, or the PeerRefused it raised), telling the asker
        ``102 Processing`` every KEEPALIVE seconds meanwhile.

        WireError when the asker goes away meanwhile (the fetch for it is then cancelled).
        """
        result: list[PeerPayload | PeerRefused | None] = []
        done = trio.Event()
        gone: BaseException | None = None

        async def run_get() -> None:
            try:
                result.append(await get())
            except PeerRefused as refused:
                result.append(refused)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_get)
            try:
                with trio.move_on_after(KEEPALIVE / 4):  # a block at hand needs no interim answer
                    await done.wait()
                while not done.is_set():
                    # Whole or not at all: a send cut by the block's arrival would garble the answer.
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(SERVER_IDLE) as scope:
                            await stream.send(PROCESSING)
                        if scope.cancelled_caught:
                            raise WireError("the asker reads nothing")
                    with trio.move_on_after(KEEPALIVE):
                        await done.wait()
            except (WireError, OSError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                gone = exc  # raised below, outside the nursery, as itself rather than in an exception group
                nursery.cancel_scope.cancel()
        if gone is not None:
            raise WireError(f"the asker went away: {gone}")
        return result[0] if result else None


def _peer_host(stream: HttpStream) -> str:
    """The address a peer's connection comes from (its host: a member's port is a new one each connection)."""
    inner: object = stream.stream
    while hasattr(inner, "transport_stream"):
        inner = inner.transport_stream  # type: ignore[attr-defined]
    sock = getattr(inner, "socket", None)
    try:
        return str(sock.getpeername()[0]) if sock is not None else "?"
    except OSError:
        return "?"
