"""The peer protocol's wire: just enough HTTP/1.1 over trio streams, both ends, bounded everywhere.

A peer request is one ``GET`` (no body) naming a block by its digest and where it
lies in the store (:class:`BlockPlace`), with the cluster token; the answer is
``200`` with the block's bytes, or a status with a short text body.  An asker that
says ``Accept-Encoding: zstd`` may get the store's compressed frame of the block
(``Content-Encoding: zstd``, ``Content-Length`` at most the block's worst case,
:func:`~bootseer.blockstore.objects.format.max_stored_length`), which it decompresses
and verifies as a frame from the store; otherwise the answer is the raw block
(``Content-Length`` = its raw length).  An owner that has to fetch the block from the
store first sends ``102 Processing`` interim answers meanwhile (RFC 2518; any
HTTP/1.1 client must skip 1xx answers) so that its peer can tell an owner at work
from a hung one.  Connections are kept alive and reused.

Everything read is bounded: a head by :data:`HEAD_LIMIT`, a body by the length the
reader expects (never by what the other side claims), each receive by a deadline
the caller gives, and a whole head, if the caller asks, by a deadline of its own.
Nothing here knows about blocks beyond :class:`BlockPlace`'s fields; the client
(``blockstore/peers/client.py``) and the server (``blockstore/peers/server.py``) do the rest.
"""

from __future__ import annotations

import ssl
import urllib.parse

import trio

from bootseer.blockstore.objects.format import BlockPlace

#: The longest request or response head read (request line or status line and headers).
HEAD_LIMIT = 8 << 10
#: The path prefix of block requests (a version, so that a later protocol can live beside it).
BLOCKS_PATH = "/v1/blocks/"
PING_PATH = "/v1/ping"
PRIORITIES = ("demand", "readahead", "prefetch")
#: The content coding of a block sent as the store's compressed frame.
FRAME_ENCODING = "zstd"

# The protocol's timing, which both ends count on (``deadline`` is the group's, shared by its members).
#: An owner fetching a block from the store tells its asker it is at work this often.
KEEPALIVE = 0.1
#: Deadlines a peer that keeps talking may take before the store is asked too: to answer (its
#: ``102 Processing`` keepalives do not extend it), and to send a body beyond its length at MIN_BODY_RATE.
PATIENCE = 4


class WireError(Exception):
    """The other end broke the protocol or the connection (the message says how)."""


def block_target(store: str, place: BlockPlace, priority: str) -> str:
    """The request target of ``place`` in the store the peers know as ``store``."""
    query = urllib.parse.urlencode(
        {"store": store, "pack": place.pack, "offset": place.offset, "clen": place.clen, "rlen": place.rlen,
         "priority": priority}  # fmt: skip
    )
    return f"{BLOCKS_PATH}{place.digest}?{query}"


def parse_block_target(target: str) -> tuple[str, BlockPlace, str]:
    """(store, place, priority) of a block request's target, or ValueError saying what is wrong."""
    path, _, query = target.partition("?")
    if not path.startswith(BLOCKS_PATH):
        raise ValueError("not a block request")
    fields = urllib.parse.parse_qs(query, strict_parsing=False, max_num_fields=16)

    def one(name: str) -> str:
        values = fields.get(name)
        if not values or len(values) != 1:
            raise ValueError(f"{name} must be given once")
        return values[0]

    def number(name: str) -> int:
        text = one(name)
        if not text.isdigit() or len(text) > 20:
            raise ValueError(f"{name} is not a number")
        return int(text)

    priority = fields.get("priority", ["demand"])[0]
    if priority not in PRIORITIES:
        raise ValueError("unknown priority")
    store = one("store")
    if len(store) > 128 or store.strip("0123456789abcdef"):
        raise ValueError("store is not a store id")
    place = BlockPlace(path[len(BLOCKS_PATH) :], one("pack"), number("offset"), number("clen"), number("rlen"))
    return store, place.check(), priority


class HttpStream:
    """One HTTP/1.1 connection: heads and exact-length bodies, each receive under a deadline."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def _receive(self, timeout: float) -> bytes:
        with trio.move_on_after(timeout) as scope:
            data = await self.stream.receive_some(256 << 10)
        if scope.cancelled_caught:
            raise trio.TooSlowError
        return data

    async def _receive_at_least(self, length: int, timeout: float) -> None:
        """Receive until :attr:`_buffer` holds ``length`` bytes, each receive within ``timeout`` of the last.

        One cancel scope for all the receives, its deadline moved on after each (not a scope per
        receive), and each receive asks for all that is still missing (not 256 KiB at a time)."""
        with trio.CancelScope() as scope:
            while len(self._buffer) < length:
                scope.deadline = trio.current_time() + timeout
                data = await self.stream.receive_some(min(max(length - len(self._buffer), 64 << 10), 1 << 20))
                if not data:
                    raise WireError(f"connection closed after {len(self._buffer)} of {length} body bytes")
                self._buffer += data
        if scope.cancelled_caught:
            raise trio.TooSlowError

    async def read_head(self, timeout: float, *, whole: float | None = None,
                        since: float | None = None) -> bytes | None:  # fmt: skip
        """The next head (without its blank line), None at a clean end of stream before one began.

        trio.TooSlowError when a receive waits more than ``timeout``, or, with ``whole``,
        when the head is not complete ``whole`` seconds after ``since`` (a trio clock
        time, such as the connection's accept) or else after its first byte came: a
        sender that drips a head a byte at a time is cut off however often it sends.
        WireError for a head over :data:`HEAD_LIMIT` or a stream cut inside one.
        """
        deadline = since + whole if whole is not None and since is not None else None
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self._buffer[:end])
                del self._buffer[: end + 4]
                return head
            if len(self._buffer) > HEAD_LIMIT:
                raise WireError(f"head longer than {HEAD_LIMIT} bytes")
            if whole is not None and deadline is None and self._buffer:
                deadline = trio.current_time() + whole  # the head began
            wait = timeout if deadline is None else min(timeout, deadline - trio.current_time())
            if wait <= 0:
                raise trio.TooSlowError
            data = await self._receive(wait)
            if not data:
                if self._buffer:
                    raise WireError("connection closed inside a head")
                return None
            self._buffer += data

    def buffered(self) -> int:
        """Bytes received and not yet read (of a head or body under way)."""
        return len(self._buffer)

    async def read_exact(self, length: int, timeout: float) -> bytes:
        """Exactly ``length`` bytes (WireError if the stream ends first; TooSlowError as :meth:`read_head`).

        What came before a TooSlowError or a cancellation stays buffered: a later call
        goes on from there.
        """
        if len(self._buffer) < length:
            await self._receive_at_least(length, timeout)
        if len(self._buffer) == length:  # the usual case: one copy out, none left to move
            out = bytes(self._buffer)
            self._buffer.clear()
            return out
        with memoryview(self._buffer) as view:
            out = bytes(view[:length])
        del self._buffer[:length]
        return out

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    def _socket(self) -> trio.socket.SocketType | None:
        stream: object = self.stream
        while hasattr(stream, "transport_stream"):
            stream = stream.transport_stream  # type: ignore[attr-defined]
        return getattr(stream, "socket", None)

    def remote_host(self) -> str:
        """The other end's IP address ("" when the stream is not a socket)."""
        sock = self._socket()
        try:
            return str(sock.getpeername()[0]) if sock is not None else ""
        except OSError:  # already reset
            return ""

    def close_now(self) -> None:
        """Close the connection's socket at once (no TLS goodbye): for connections nobody uses any more."""
        sock = self._socket()
        if sock is not None:
            sock.close()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(1):
                await self.stream.aclose()
                return
        await trio.aclose_forcefully(self.stream)


def parse_head(head: bytes, *, request: bool) -> tuple[str, str, dict[str, str]]:
    """(method, target, headers) of a request head, or (version, status, headers) of a response head.

    Header names are lower-cased; a repeated header keeps its last value.  WireError
    for a malformed head.
    """
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # latin-1 decodes any byte; kept for clarity
        raise WireError("head is not text") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or (request and (len(parts) != 3 or not parts[2].startswith("HTTP/1."))):
        raise WireError(f"malformed {'request' if request else 'status'} line")
    if not request and not (parts[0].startswith("HTTP/1.") and parts[1].isdigit() and len(parts[1]) == 3):
        raise WireError("malformed status line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise WireError("malformed header line")
        headers[name.lower()] = value.strip()
    return parts[0], parts[1], headers


def content_length(headers: dict[str, str], limit: int) -> int:
    """The head's Content-Length (0 if absent), WireError if malformed or above ``limit``."""
    text = headers.get("content-length", "0")
    if not text.isdigit() or len(text) > 20:
        raise WireError("malformed Content-Length")
    length = int(text)
    if length > limit:
        raise WireError(f"body of {length} bytes, more than the {limit} expected")
    return length


def response_head(status: int, reason: str, length: int, *, close: bool = False, kind: str = "text/plain",
                  encoding: str | None = None) -> bytes:  # fmt: skip
    """A response head with its blank line (``encoding``: its Content-Encoding, if any)."""
    connection = "close" if close else "keep-alive"
    coding = f"Content-Encoding: {encoding}\r\n" if encoding else ""
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {length}\r\n{coding}"
        f"Connection: {connection}\r\n\r\n"
    ).encode("ascii")


PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """An HTTPS server context from PEM files (ValueError, one line, if they cannot be loaded)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"peer TLS certificate {cert} / key {key}: {exc}") from None
    return context


def client_tls_context(ca: str | None) -> ssl.SSLContext:
    """An HTTPS client context trusting ``ca`` (PEM; None: the system's roots), host names checked."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"peer CA file {ca}: {exc}") from None


__all__ = [
    "BLOCKS_PATH",
    "FRAME_ENCODING",
    "HttpStream",
    "PING_PATH",
    "PROCESSING",
    "WireError",
    "block_target",
    "client_tls_context",
    "content_length",
    "parse_block_target",
    "parse_head",
    "response_head",
    "server_tls_context",
]
