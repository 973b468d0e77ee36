"""Peer-sharing test helpers: real layer servers with peers on, which member owns which block, a member's
side of the wire, and a peer that misbehaves on purpose.

The tests of peers (tests/blockstore/test_peers*.py) share these rather than import each other:

* :class:`Nodes` starts real ``bootseer layer-server`` processes (each its own root) as the
  snapshotter starts them, and stops them all at teardown; the ``nodes`` fixture gives a
  test one.  ``peer_layer`` (a module-scoped fixture) is a converted store of one layer
  holding :data:`BIG` (49 blocks of :data:`BLOCK_SIZE`: every member owns some) and a small
  file; :data:`TOKEN` is the group's token in :attr:`Nodes.token`.
* :func:`pack_bytes_fetched` says what a counting store served of pack objects, :func:`scrape`
  what a node's ``/metrics`` says.
* :func:`owned_by` says which blocks a member owns; :func:`block_request`,
  :func:`place_request` and :func:`read_answer` are a member's side of the wire, for tests that
  talk to a real node's peer listener over a plain socket.
* :class:`FakePeer` (the ``fake_peer`` fixture makes them) answers block requests the way a test
  asks ("corrupt": the right length, the wrong bytes; "cut": half a body, then the connection
  shut; "silent": nothing; "refuse": 401; "processing": ``102 Processing`` every 0.1 s, never an
  answer; "drip": a 200 head, then the body one byte every 0.3 s; and as compressed frames
  (``Content-Encoding: zstd``): "frame-bomb", a frame that decompresses to 4 times the block;
  "frame-corrupt", a good frame of the wrong bytes; "frame-oversize", a body beyond the block's
  worst case; "encoding", an encoding the asker never asked for), records each request's path
  and Authorization header, and runs in a thread of the test, or in another network namespace as
  ``python -m tests.support.peers HOST:PORT BEHAVIOUR`` (which prints ``listening`` once it is,
  then each request's path as it gets it).

The fixtures are offered to every test by tests/conftest.py.
"""

from __future__ import annotations

import gzip
import os
import socket
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zstandard

from bootseer.blockstore.server.client import LayerServerClient, ServerSettings, ensure_server

from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.format import Block, LayerIndex, max_stored_length
from bootseer.blockstore.peers.wire import block_target, content_length, parse_block_target, parse_head
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.ownership import peer_store_id, rendezvous_score
from bootseer.blockstore.peers.config import PeerConfig
from bootseer.fetch.sources import redact_url
from tests.support.http import RangeHTTPServer
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import blob_data

BLOCK_SIZE = 64 << 10  #: the block size of :func:`peer_layer`'s store
BIG = blob_data(48 * BLOCK_SIZE + 777)  #: ``data/big.bin`` of :func:`peer_layer`: 49 blocks, every member owns some
TOKEN = "peer-token-0123456789"  #: the group's token (in :attr:`Nodes.token`)

root_only = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")


@pytest.fixture(scope="module")
def peer_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuiltLayer]:
    """A store directory holding one converted layer: ``data/big.bin`` (:data:`BIG`) and ``data/small.txt``.

    Without an EROFS image: the tests count the layer's file blocks each node asks for; an
    image's blocks go through peers the same way (``test_a_layers_image_is_fetched_through_peers``)."""
    store = tmp_path_factory.mktemp("store")
    layers = [Layer((File("data/big.bin", BIG), File("data/small.txt", b"hello peers\n")))]
    (layer,) = build_store(store, layers, block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"), inline_max=None)
    return store, layer


class Nodes:
    """Layer servers of one test, each with its own root; all stopped at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.roots: list[Path] = []
        self.token = tmp_path / "token"
        self.token.write_text(TOKEN + "\n")
        os.chmod(self.token, 0o600)

    def start(self, store: str, peers: PeerConfig | None, **settings: Any) -> LayerServerClient:
        root = self.tmp_path / f"node{len(self.roots)}"
        self.roots.append(root)
        settings.setdefault("retry_timeout", 10)
        # The tests count the blocks each node fetches and serves exactly: a fill group's neighbours (other files'
        # blocks) would add to both sides.  Fill groups with peers are the benchmark's (bench/peers_bench.py).
        settings.setdefault("fill_group", 0)
        return ensure_server(root, ServerSettings(store=store, peers=peers, log_level="debug", **settings))

    def log(self, number: int) -> str:
        return ServerPaths(self.roots[number]).log.read_text(errors="replace")

    def stop_all(self) -> None:
        for root in self.roots:
            stop_layer_servers(root)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    """The test's :class:`Nodes` (under its ``tmp_path``), all stopped at teardown."""
    group = Nodes(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def fake_peer() -> Iterator[Callable[[str], FakePeer]]:
    """``make(behaviour)``: a :class:`FakePeer`, closed at teardown."""
    made: list[FakePeer] = []

    def make(behaviour: str) -> FakePeer:
        made.append(FakePeer(behaviour))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def pack_bytes_fetched(http: RangeHTTPServer) -> int:
    """Bytes of pack objects the store served (by the ranges it was asked for)."""
    total = 0
    for _method, target, headers in http.requests:
        if "/packs/" in target:
            first, last = headers["Range"].removeprefix("bytes=").split("-")
            total += int(last) - int(first) + 1
    return total


def scrape(address: str) -> dict[str, float]:
    """The samples of a /metrics page, by their line's name and labels."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}  # fmt: skip


def owned_by(index: LayerIndex, members: list[str], member: str) -> list[int]:
    """Numbers of the stored blocks of ``index`` that ``member`` owns among ``members``."""
    return [
        number for number, block in enumerate(index.blocks)
        if not block.is_zero and max(members, key=lambda m: rendezvous_score(m, block.digest)) == member
    ]  # fmt: skip


def block_request(store_url: str, index: LayerIndex, block: Block, token: str | None, *, frames: bool = False) -> bytes:
    """The request a member sends for ``block`` of ``index`` in the store at ``store_url`` (``frames``:
    saying it takes the store's compressed frames)."""
    return place_request(store_url, BlockPlace(block.digest, index.packs[block.pack], block.offset, block.clen,
                                               block.rlen), token, frames=frames)  # fmt: skip


def place_request(store_url: str, place: BlockPlace, token: str | None, priority: str = "demand", *,
                  frames: bool = False) -> bytes:  # fmt: skip
    """A member's request for whatever ``place`` names (a real block or a made-up one) in the store at
    ``store_url``, at ``priority`` (``frames``: saying it takes the store's compressed frames; without,
    as a member before frames asks)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    coding = "Accept-Encoding: zstd\r\n" if frames else ""
    target = block_target(peer_store_id(redact_url(store_url)), place, priority)
    return f"GET {target} HTTP/1.1\r\nHost: bootseer-peer\r\n{coding}{auth}\r\n".encode()


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
    #: socketserver's default backlog is 5: an asker's burst of connections beyond it waited for a SYN
    #: retransmit (1 s), past a short deadline, so the peer failed as "no connection in time" first
    request_queue_size = 128

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
        if behaviour.startswith("frame-") or behaviour == "encoding":
            body = {
                "frame-bomb": lambda: zstandard.ZstdCompressor().compress(bytes(4 * place.rlen)),
                "frame-corrupt": lambda: zstandard.ZstdCompressor().compress(body),
                "frame-oversize": lambda: os.urandom(max_stored_length(place.rlen) + 1),
                "encoding": lambda: gzip.compress(body),
            }[behaviour]()
            self.send_header("Content-Encoding", "gzip" if behaviour == "encoding" else "zstd")
        self.send_header("Content-Length", str(len(body)))
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
    request_queue_size = FakePeer.request_queue_size

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
