"""Peer-sharing test helpers: which member owns which block, and a peer that misbehaves on purpose.

:class:`FakePeer` answers block requests the way a test asks ("corrupt": the right length, the
wrong bytes; "cut": half a body, then the connection shut; "silent": nothing; "refuse": 401),
records each request's path and Authorization header, and runs in a thread of the test, or in
another network namespace as ``python -m tests.support.peers HOST:PORT BEHAVIOUR`` (which prints
``listening`` once it is, then each request's path as it gets it).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bootseer.blockstore.format import LayerIndex
from bootseer.blockstore.peer_wire import parse_block_target
from bootseer.blockstore.peers import rendezvous_score


def owned_by(index: LayerIndex, members: list[str], member: str) -> list[int]:
    """Numbers of the stored blocks of ``index`` that ``member`` owns among ``members``."""
    return [
        number for number, block in enumerate(index.blocks)
        if not block.is_zero and max(members, key=lambda m: rendezvous_score(m, block.digest)) == member
    ]  # fmt: skip


class FakePeer(ThreadingHTTPServer):
    """A peer that answers block requests as ``behaviour`` says: "corrupt", "cut", "silent" or "refuse"."""

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
        if behaviour == "refuse":
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = os.urandom(place.rlen)  # the right length, the wrong bytes
        self.send_response(200)
        self.send_header("Content-Length", str(place.rlen))
        self.end_headers()
        if behaviour == "cut":
            self.wfile.write(body[: place.rlen // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)




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
