"""What a hostile member of a peer group costs an owner: store bytes, the node's own read latency and RSS.

One command (as root): ``.venv/bin/python -m bench.peer_abuse [--label after] [--output bench/results/peer_abuse.md]``.
The store is nginx in a network namespace behind a ``tbf`` link of ``--rate`` (200 MB/s,
issue 21's setting: tests/support/netns.py), holding one converted layer of 1 MiB blocks:
``data/target.bin`` (160 MiB, one pack with ``own.bin``) that requests name, and
``data/own.bin`` (64 MiB) that the node reads itself.  The owner is a real
``bootseer layer-server`` with peers on (loopback listener, a token, ``memory_limit`` 1 GiB)
that serves the layer.  Then:

1. **one request**: a made-up digest at the pack's start with ``clen`` = 128 MiB and
   ``rlen`` = 1 MiB (the most the old wire took); the store bytes it cost (the link's
   counter) and the owner's answer;
2. **own reads alone**: ``--reads`` reads of 1 MiB of ``own.bin`` at distinct block
   offsets in a shuffled order (so that neither the node's read-ahead nor a cache serves
   them), each timed;
3. **own reads under attack**: ``--attacked-reads`` further reads, one every
   ``--attack-seconds`` / that many seconds, while ``--attackers`` connections (16) each
   send such requests back to back (the 128 MiB request, or when the owner refuses it
   outright, the largest it accepts: ``clen`` = max_stored_length(1 MiB), each at a new
   offset); the owner's peak RSS (sampled every 50 ms), the store bytes and rate during
   the attack, and the owner's answers.

Run once on the code before a change and once after (``--label``) to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bootseer.blockstore.server.client import ServerSettings, ensure_server
from bootseer.blockstore.peers.wire import block_target
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.ownership import peer_store_id
from bootseer.blockstore.peers.config import PeerConfig
from bootseer.fetch.sources import redact_url
from tests.support import netns
from tests.support.waiting import free_port
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import build_store
from tests.support.layers import File, Layer
from tests.support.nginx import Nginx

MiB = 1 << 20
BLOCK = MiB
TOKEN = "peer-abuse-token-0123456789"
OLD_LIMIT = 128 * MiB  # the largest clen the wire took before issue 21


def max_stored_length(rlen: int) -> int:
    """format.max_stored_length (repeated: the code before the change has no such function)."""
    return rlen + (rlen >> 7) + 4096


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Attacker(threading.Thread):
    """Sends block requests for made-up digests back to back on fresh connections until stopped."""

    def __init__(self, owner: str, store: str, pack: str, number: int, clen: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.owner, self.store, self.pack, self.number, self.clen, self.stop = owner, store, pack, number, clen, stop
        self.statuses: dict[int, int] = {}

    def run(self) -> None:
        sequence = 0
        while not self.stop.is_set():
            sequence += 1
            digest = hashlib.sha256(b"made up %d %d" % (self.number, sequence)).hexdigest()
            offset = ((self.number * 1000 + sequence) * 4096) % (32 * MiB)
            status = ask(self.owner, self.store, BlockPlace(digest, self.pack, offset, self.clen, BLOCK), self.stop)
            self.statuses[status] = self.statuses.get(status, 0) + 1


def ask(owner: str, store: str, place: BlockPlace, stop: threading.Event | None = None) -> int:
    """The final status the owner answers a request for ``place`` with (0: cut off or stopped)."""
    host, port = owner.rsplit(":", 1)
    request = (f"GET {block_target(store, place, 'demand')} HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.settimeout(0.5)
        sock.sendall(request)
        received = b""
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except socket.timeout:
                if stop is not None and stop.is_set():
                    return 0
                continue
            if not chunk:
                break
            received += chunk
            heads = [part for part in received.split(b"\r\n\r\n") if part.startswith(b"HTTP/1.1 ")]
            final = [int(head.split(b" ")[1]) for head in heads if not head.startswith(b"HTTP/1.1 1")]
            if final:
                return final[0]
    return 0


def read_blocks(path: Path, blocks: list[int]) -> list[float]:
    times = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for number in blocks:
            started = time.monotonic()
            data = os.pread(fd, BLOCK, number * BLOCK)
            times.append(time.monotonic() - started)
            assert len(data) == BLOCK
    finally:
        os.close(fd)
    return times


def describe(times: list[float]) -> str:
    return f"median {statistics.median(times):.3f} s, max {max(times):.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1600mbit", help="the store link's rate, tc syntax (1600mbit = 200 MB/s)")
    parser.add_argument("--attackers", type=int, default=16)
    parser.add_argument("--reads", type=int, default=16, help="own reads alone")
    parser.add_argument("--attacked-reads", type=int, default=40, help="own reads under attack")
    parser.add_argument("--attack-seconds", type=float, default=20.0, help="how long the attack lasts")
    parser.add_argument("--label", default="", help="a name for this run (before, after)")
    parser.add_argument("--output", type=Path, help="append the results as markdown to this file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="peer-abuse-"))
    store = work / "store"
    own = random.Random(1).randbytes(64 * MiB)  # incompressible, and no block shared with target.bin
    target = random.Random(2).randbytes(160 * MiB)
    print("converting the layer...", flush=True)
    (layer,) = build_store(store, [Layer((File("data/target.bin", target), File("data/own.bin", own)))],
                           block_size=BLOCK, layout=work / "layout")  # fmt: skip
    pack = layer.index.packs[0]
    own_blocks = next(e for e in layer.index.entries if e.path == "data/own.bin").blocks
    lines = [f"## {args.label or 'run'}: {time.strftime('%Y-%m-%d %H:%M')} UTC, store link {args.rate}", ""]
    root = work / "node"
    token = work / "token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    try:
        with netns.ShapedLink(args.rate) as link, Nginx(store, work / "nginx", free_port(), host=link.server_ip,
                                                         launcher=link.launcher(), user="root") as nginx:  # fmt: skip
            address = f"127.0.0.1:{free_port()}"
            client = ensure_server(root, ServerSettings(
                store=nginx.url, memory_limit=1 << 30, retry_timeout=60,
                peers=PeerConfig(listen=address, members=(address,), token_file=str(token))))  # fmt: skip
            lower = Path(client.mount(layer.chain_id).lower_dir)
            pid = int(client.status()["pid"])
            peer_store = peer_store_id(redact_url(nginx.url))

            before = link.counters().received
            made_up = hashlib.sha256(b"one made-up block").hexdigest()
            status = ask(address, peer_store, BlockPlace(made_up, pack, 0, OLD_LIMIT, BLOCK))
            one = link.counters().received - before
            lines.append(f"* one request (made-up digest, clen {OLD_LIMIT}, rlen {BLOCK}): answered {status}, "
                         f"the store sent {one:,} bytes")  # fmt: skip
            clen = OLD_LIMIT if status != 400 else max_stored_length(BLOCK)
            if clen != OLD_LIMIT:
                before = link.counters().received
                status = ask(address, peer_store, BlockPlace(made_up, pack, 0, clen, BLOCK))
                worst = link.counters().received - before
                lines.append(f"* the largest request the owner takes (clen {clen}): answered {status}, "
                             f"the store sent {worst:,} bytes")  # fmt: skip

            order = list(range(len(own_blocks)))
            random.Random(21).shuffle(order)
            alone_blocks, attacked_blocks = order[: args.reads], order[args.reads : args.reads + args.attacked_reads]
            rss_before = rss_kib(pid)
            alone = read_blocks(lower / "data/own.bin", alone_blocks)
            lines.append(f"* own 1 MiB reads alone ({args.reads}): {describe(alone)}; RSS {rss_before // 1024} MiB")

            stop = threading.Event()
            attackers = [Attacker(address, peer_store, pack, n, clen, stop) for n in range(args.attackers)]
            peak = [0]

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss_kib(pid))
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            before = link.counters().received
            for attacker in attackers:
                attacker.start()
            started = time.monotonic()
            attacked: list[float] = []
            for number, block in enumerate(attacked_blocks):
                time.sleep(max(0.0, started + (number + 1) * args.attack_seconds / len(attacked_blocks) - time.monotonic()))
                attacked += read_blocks(lower / "data/own.bin", [block])
            seconds = time.monotonic() - started
            sent = link.counters().received - before
            stop.set()
            for attacker in attackers:
                attacker.join(60)
            statuses: dict[int, int] = {}
            for attacker in attackers:
                for code, count in attacker.statuses.items():
                    statuses[code] = statuses.get(code, 0) + count
            peers = client.call({"op": "peers.status"})
            lines.append(f"* own 1 MiB reads ({len(attacked)}) under {args.attackers} hostile connections (clen {clen}): "
                         f"{describe(attacked)}; owner RSS peak {peak[0] // 1024} MiB (memory_limit 1024 MiB); "
                         f"the store sent {sent:,} bytes in {seconds:.1f} s ({sent / seconds / 1e6:.0f} MB/s); "
                         f"answers {dict(sorted(statuses.items()))}; over_budget {peers.get('over_budget', '-')}, "
                         f"held_for_peers {peers.get('held_for_peers', '-')}")  # fmt: skip
    finally:
        stop_layer_servers(root)
        shutil.rmtree(work, ignore_errors=True)
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
