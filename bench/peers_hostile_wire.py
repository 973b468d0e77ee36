"""What a hostile peer wire costs a real layer server (issue 21, cases 3-5): figures before and after.

Each case starts one ``bootseer layer-server`` with peers on (loopback, a token, a 49-block
layer behind a local HTTP store), does one hostile thing to it, and prints what it measured:

* ``slowloris``: N connections (300) each sent a byte of a never-ending head every second;
  how many are still open 1, 6 and 12 s after they were opened.
* ``auth``: wrong tokens sent as fast as possible on one connection for 2 s (how many were
  checked), then new connections from the same address for 2 s (how many had their token
  checked, how many were turned away unread).
* ``emfile``: the server's soft file descriptor limit lowered to 200 (``prlimit``), 400
  silent connections opened, then a ping on a new connection: its answer and how long it
  took, and how many "Too many open files" and tracebacks the log holds.
* ``processing`` / ``drip``: a member (:class:`tests.support.peers.FakePeer`) that answers
  ``102 Processing`` every 0.1 s for ever, or drips its body a byte every 0.3 s; how long
  reads of 3 of its blocks take, and how the node sees it afterwards.

Run as root from a worktree, one case at a time or all::

    .venv/bin/python -m bench.peers_hostile_wire all
    .venv/bin/python -m bench.peers_hostile_wire slowloris --connections 1000

Results: bench/results/peers-hostile-wire.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path


from bootseer.blockstore.server.client import LayerServerClient, ServerSettings, ensure_server

from bootseer.paths import ServerPaths
from bootseer.blockstore.peers.config import PeerConfig
from tests.support.http import RangeHTTPServer
from tests.support.waiting import free_port
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import blob_data
from tests.support.peers import FakePeer, owned_by

BLOCK = 64 << 10
TOKEN = "peer-token-0123456789"
WRONG = b"GET /v1/blocks/" + b"a" * 64 + b" HTTP/1.1\r\nAuthorization: Bearer wrong-token-0123456789\r\n\r\n"


def still_open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has not closed (each is sent one more head byte)."""
    alive = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            sock.send(b"a")
            if sock.recv(1, socket.MSG_PEEK) == b"":
                continue
            alive += 1  # an answer byte: open still
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
    return alive


def slowloris(address: tuple[str, int], count: int) -> None:
    socks = [socket.create_connection(address) for _ in range(count)]
    for sock in socks:
        sock.send(b"GET /v1/ping HTTP/1.1\r\nX-Slow: ")
    start = time.monotonic()
    for second in range(1, 13):
        time.sleep(max(0.0, start + second - time.monotonic()))
        alive = still_open(socks)
        if second in (1, 6, 12):
            print(f"slowloris: {alive} of {count} connections open {time.monotonic() - start:.1f} s after opening")
    for sock in socks:
        sock.close()


def auth(address: tuple[str, int], root: Path) -> None:
    checked = 0
    start = time.monotonic()
    with socket.create_connection(address, timeout=5) as sock:
        while time.monotonic() - start < 2:
            try:
                sock.sendall(WRONG)
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            checked += data.count(b"HTTP/1.1 401")
    print(f"auth: {checked} wrong tokens checked on one connection (for up to 2 s, until it was closed)")
    tries = checked_new = 0
    start = time.monotonic()
    while time.monotonic() - start < 2:
        tries += 1
        try:
            with socket.create_connection(address, timeout=5) as sock:
                sock.sendall(WRONG)
                data = sock.recv(1000)
        except OSError:
            continue
        checked_new += data.startswith(b"HTTP/1.1 401") and b"held off" not in data
    print(f"auth: then {tries} new connections in 2 s: {checked_new} had their token checked, "
          f"{tries - checked_new} were turned away unread")  # fmt: skip
    log = ServerPaths(root).log.read_text(errors="replace")
    print(f"auth: log lines about authentication: {sum('authenticat' in line for line in log.splitlines())}")


def emfile(address: tuple[str, int], client: LayerServerClient, root: Path) -> None:
    pid = int(client.status()["pid"])
    hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (200, hard))
    flood = [socket.create_connection(address, timeout=5) for _ in range(400)]
    time.sleep(3)
    start = time.monotonic()
    try:
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(b"GET /v1/ping HTTP/1.1\r\n\r\n")
            answer = sock.recv(100)[:15]
        print(f"emfile: a ping during the flood answered {answer!r} after {time.monotonic() - start:.2f} s")
    except OSError as exc:
        print(f"emfile: a ping during the flood failed after {time.monotonic() - start:.2f} s: {exc}")
    for sock in flood:
        sock.close()
    log = ServerPaths(root).log.read_text(errors="replace")
    print(f"emfile: log: {log.count('Too many open files')} 'Too many open files', {log.count('Traceback')} tracebacks")


def stalling(behaviour: str, http: RangeHTTPServer, layer: BuiltLayer, root: Path, token: Path) -> None:
    peer = FakePeer(behaviour)
    try:
        me = f"127.0.0.1:{free_port()}"
        members = (me, peer.address)
        client = ensure_server(root, ServerSettings(store=http.url, retry_timeout=10, peers=PeerConfig(
            listen=me, members=members, token_file=str(token), deadline=0.5)))  # fmt: skip
        lower = Path(client.mount(layer.chain_id).lower_dir)
        for number in owned_by(layer.index, list(members), peer.address)[:3]:
            start = time.monotonic()
            with open(lower / "data/big.bin", "rb") as file:
                file.seek(number * BLOCK)
                file.read(4096)
            print(f"{behaviour}: a read of block {number} (the peer's) took {time.monotonic() - start:.2f} s")
        status = client.call({"op": "peers.status"})
        seen = next(m for m in status["members"] if m["address"] == peer.address)
        print(f"{behaviour}: the peer was asked {len(peer.requests)} times; the node sees it {seen}")
    finally:
        peer.close()


def run(case: str, work: Path, layer: BuiltLayer, args: argparse.Namespace) -> None:
    token = work / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    root = work / f"node-{case}"
    try:
        with RangeHTTPServer(work / "store") as http:
            if case in ("processing", "drip"):
                stalling(case, http, layer, root, token)
                return
            port = free_port()
            me = f"127.0.0.1:{port}"
            client = ensure_server(root, ServerSettings(store=http.url, retry_timeout=10, peers=PeerConfig(
                listen=me, members=(me, "127.0.0.1:1"), token_file=str(token))))  # fmt: skip
            address = ("127.0.0.1", port)
            if case == "slowloris":
                slowloris(address, args.connections)
            elif case == "auth":
                auth(address, root)
            else:
                emfile(address, client, root)
    finally:
        stop_layer_servers(root)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("case", choices=("slowloris", "auth", "emfile", "processing", "drip", "all"))
    parser.add_argument("--connections", type=int, default=300, help="slowloris connections (300)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts)")
    work = Path(tempfile.mkdtemp(prefix="bootseer-hostile-wire-"))
    (work / "store").mkdir()
    big = File("data/big.bin", blob_data(48 * BLOCK + 777))
    (layer,) = build_store(work / "store", [Layer((big,))], block_size=BLOCK, layout=work / "layout")
    cases = ("slowloris", "auth", "emfile", "processing", "drip") if args.case == "all" else (args.case,)
    for case in cases:
        run(case, work, layer, args)


if __name__ == "__main__":
    main(sys.argv[1:])
