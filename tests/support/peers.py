"""Peer-sharing test helpers: which member owns which block, and a peer that misbehaves on purpose.

:class:`FakePeer` answers block requests the way a test asks ("corrupt": the right length, the
wrong bytes; "cut": half a body, then the connection shut; "silent": nothing; "refuse": 401;
"processing": ``102 Processing`` every 0.1 s, never an answer; "drip": a 200 head, then the
body one byte every 0.3 s),
records each request's path and Authorization header, and runs in a thread of the test, or in
another network namespace as ``python -m tests.support.peers HOST:PORT BEHAVIOUR`` (which prints
``listening`` once it is, then each request's path as it gets it).

:func:`block_request` and :func:`read_answer` are a member's side of the wire, for tests that
talk to a real node's peer listener over a plain socket.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bootseer.blockstore.format import Block, LayerIndex
from bootseer.blockstore.peer_wire import BlockPlace, block_target, content_length, parse_block_target, parse_head
from bootseer.blockstore.peers import peer_store_id, rendezvous_score
from bootseer.fetch.sources import redact_url


def owned_by(index: LayerIndex, members: list[str], member: str) -> list[int]:
    """Numbers of the stored blocks of ``index`` that ``member`` owns among ``members``."""
    return [
        number for number, block in enumerate(index.blocks)
        if not block.is_zero and max(members, key=lambda m: rendezvous_score(m, block.digest)) == member
    ]  # fmt: skip


def block_request(store_url: str, index: LayerIndex, block: Block, token: str | None) -> bytes:
    """The request a member sends for ``block`` of ``index`` in the store at ``store_url``."""
    place = BlockPlace(block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    target = block_target(peer_store_id(redact_url(store_url)), place, "demand")
    return f"GET {target} HTTP/1.1\r\n{auth}\r\n".encode()


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The next final answer on ``sock`` (``102 Processing`` skipped): status, headers (lower-case names)
    and body.  ConnectionError if the connection ends before it is whole."""
    buffer = b""

    def more() -> None:
        nonlocal buffer
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError(f"connection closed after {len(buffer)} bytes of an answer")
        buffer += data

    while True:
        while b"\r\n\r\n" not in buffer:
            more()
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        _, status, headers = parse_head(head, request=False)
        if not status.startswith("1"):
            break
    length = content_length(headers, 64 << 20)
    while len(buffer) < length:
        more()
    return int(status), headers, buffer[:length]


class FakePeer(ThreadingHTTPServer):
    """A peer that answers block requests as ``behaviour`` says (see the module docstring)."""

    daemon_threads = True

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.requests: list[tuple[str, str]] = []  # (path, Authorization)
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), FakePeerHandler)
        self.address = f"127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class FakePeerHandler(BaseHTTPRequestHandler):
    server: FakePeer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Authorization", "")))
        _store, place, _priority = parse_block_target(self.path)
        behaviour = self.server.behaviour
        if behaviour == "silent":
            self.server.release.wait(60)
            return
        if behaviour == "processing":  # an owner forever "at work": it keeps talking, never delivers
            while not self.server.release.wait(0.1):
                if not self._sent(b"HTTP/1.1 102 Processing\r\n\r\n"):
                    return
            return
        if behaviour == "refuse":
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = os.urandom(place.rlen)  # the right length, the wrong bytes
        self.send_response(200)
        self.send_header("Content-Length", str(place.rlen))
        self.end_headers()
        if behaviour == "drip":  # the body at 3 bytes a second: never in time
            for byte in body:
                if self.server.release.wait(0.3) or not self._sent(bytes([byte])):
                    return
            return
        if behaviour == "cut":
            self.wfile.write(body[: place.rlen // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)

    def _sent(self, data: bytes) -> bool:
        """Whether ``data`` went out (False once the asker has hung up)."""
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            return False
        return True



class _PrintedRequests(list):
    """Requests printed as they come (the namespace's process reports them on stdout)."""

    def append(self, request: Any) -> None:
        super().append(request)
        print(request[0], flush=True)


class _PrintingPeer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], behaviour: str) -> None:
        self.behaviour = behaviour
        self.requests = _PrintedRequests()
        self.release = threading.Event()
        super().__init__(address, FakePeerHandler)


def main(argv: list[str]) -> None:
    host, port = argv[0].rsplit(":", 1)
    server = _PrintingPeer((host, int(port)), argv[1])
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
