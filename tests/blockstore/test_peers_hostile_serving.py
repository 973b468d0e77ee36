"""What a hostile member can make an owner do: the store bytes, the priority and the memory its requests cost.

A member holds the group's token, so its requests are authenticated; what bounds it is what
the owner does with them (issue 21, cases 1 and 2; docs/peers.md, "What a member can make an
owner do").  The owner is a real ``bootseer layer-server`` over a counting HTTP store, asked by
a raw socket with requests the owner's own client would never send: a made-up digest at a real
pack, a ``clen`` far beyond what a block of ``rlen`` bytes can take, a block larger than any the
owner serves, more requests than its budget.  The priority and memory of peer serving are
checked on a real :class:`PeerServer` in this process, whose getter records what it is asked.
"""

from __future__ import annotations

import hashlib
import random
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from bootseer.blockstore.objects.format import max_stored_length, pack_object
from bootseer.blockstore.peers.wire import block_target
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.server import PeerServer
from bootseer.blockstore.peers.config import BUDGET_WINDOW, PeerConfig
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.node.peers import PeerPayload
from bootseer.fetch.engine import open_engine
from bootseer.fetch.stripes import Priority
from bootseer.fetch.faults import FaultySource
from bootseer.fetch.sources.local import LocalSource
from tests.support.autojump import run as autojump_run
from tests.support.http import RangeHTTPServer
from tests.support.waiting import free_port
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import blob_data
from tests.support.packed_layers import BLOCK as BLOCK4K
from tests.support.packed_layers import engine_config, entry, pack_layer
from tests.support.peers import TOKEN, Nodes, pack_bytes_fetched, place_request, read_answer, root_only

BLOCK_SIZE = 64 << 10
DATA = blob_data(96 * BLOCK_SIZE)  # incompressible: a pack of about 6 MiB


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuiltLayer]:
    store = tmp_path_factory.mktemp("store")
    layers = [Layer((File("data/big.bin", DATA),))]
    (layer,) = build_store(store, layers, block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))
    return store, layer


def made_up(number: int) -> str:
    return hashlib.sha256(b"no such block %d" % number).hexdigest()


class Owner:
    """A layer server serving peers on loopback (with a member that never answers), asked over raw sockets."""

    def __init__(self, nodes: Nodes, http: RangeHTTPServer, layer: BuiltLayer, **peer_settings: Any) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        config = PeerConfig(listen=self.address, members=(self.address, "127.0.0.1:1"), token_file=str(nodes.token),
                            **peer_settings)  # fmt: skip
        self.client = nodes.start(http.url, config)
        self.lower = Path(self.client.mount(layer.chain_id).lower_dir)
        self.url = http.url
        self.pack = layer.index.packs[0]

    def ask(self, place: BlockPlace) -> tuple[int, bytes]:
        """The final status of one request for ``place`` and its body (1xx answers skipped)."""
        host, port = self.address.split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(place_request(self.url, place, TOKEN))
            status, _headers, body = read_answer(sock)
            return status, body


@root_only
@pytest.mark.parametrize("what", ["clen beyond what rlen can take", "rlen beyond the blocks the owner serves"])
def test_a_request_naming_more_bytes_than_a_block_can_take_costs_the_store_nothing(
    built: Any, nodes: Nodes, what: str
) -> None:
    """Regression (issue 21): a made-up digest with clen = 128 MiB made the store send 256 MiB (fetched, failed
    verification, fetched again); here the whole pack (about 6 MiB) sent twice."""
    store, layer = built
    pack_size = (store / pack_object(layer.index.packs[0])).stat().st_size
    with RangeHTTPServer(store) as http:
        owner = Owner(nodes, http, layer)
        before = pack_bytes_fetched(http)
        if what == "clen beyond what rlen can take":
            place = BlockPlace(made_up(0), owner.pack, 0, pack_size, BLOCK_SIZE)
            expected = 400
        else:  # a block of the format's sizes, but 16 times the blocks of every layer the owner serves
            place = BlockPlace(made_up(0), owner.pack, 0, 16 * BLOCK_SIZE, 16 * BLOCK_SIZE)
            expected = 404
        status, body = owner.ask(place)
        sent = pack_bytes_fetched(http) - before
    assert (status, sent) == (expected, 0), (status, body, sent)
    assert b"clen" in body or b"no layer this node serves" in body


@root_only
def test_a_made_up_block_costs_the_store_one_fetch_of_at_most_its_bound(built: Any, nodes: Nodes) -> None:
    """Regression (issue 21): a block that fails verification while fetched for a peer was fetched again."""
    store, layer = built
    clen = max_stored_length(BLOCK_SIZE)
    with RangeHTTPServer(store) as http:
        owner = Owner(nodes, http, layer)
        before = pack_bytes_fetched(http)
        status, body = owner.ask(BlockPlace(made_up(1), owner.pack, 0, clen, BLOCK_SIZE))
        sent = pack_bytes_fetched(http) - before
        assert (status, sent) == (404, clen), (status, body, sent)
        assert "not fetched again" in nodes.log(0)
        # The node's own reads are as they were: the real block at that place reads right.
        assert (owner.lower / "data/big.bin").read_bytes() == DATA


@root_only
def test_an_asking_peer_beyond_its_fetch_budget_is_answered_503_and_costs_the_store_no_more(
    built: Any, nodes: Nodes
) -> None:
    store, layer = built
    clen = max_stored_length(BLOCK_SIZE)
    budget = 16 * clen  # refilled over BUDGET_WINDOW (10 s): 1.6 blocks' worth a second
    with RangeHTTPServer(store) as http:
        owner = Owner(nodes, http, layer, fetch_budget=budget)
        before = pack_bytes_fetched(http)
        started = time.monotonic()
        statuses = [owner.ask(BlockPlace(made_up(n), owner.pack, n * 4096, clen, BLOCK_SIZE)) for n in range(64)]
        elapsed = time.monotonic() - started
        sent = pack_bytes_fetched(http) - before
        status = owner.client.call({"op": "peers.status"})
    refused = [body for code, body in statuses if code == 503]
    assert refused and all(b"Over Budget" in body for body in refused), statuses[-1]
    assert status["over_budget"] == len(refused)
    # Each admitted request cost the store its block once; no more were admitted than the budget and what
    # refilled while they ran allow (a bound whatever the machine's speed, not a speed target).
    admitted = len(statuses) - len(refused)
    assert sent == admitted * clen, (sent, admitted)
    assert admitted <= 16 + int(elapsed * 16 / BUDGET_WINDOW) + 1, (admitted, elapsed)
    assert "asked for more store bytes than its budget" in nodes.log(0)


# -- a real PeerServer in this process: what its getter is asked, how much it holds ---------------------------


def test_an_owner_fetches_a_peers_block_below_its_own_reads_whatever_priority_the_peer_asks() -> None:
    """Regression (issue 21): the owner fetched at the priority the peer asked, so a peer's demand shared the
    node's DEMAND queue (the node's own 1 MiB reads took 5.4 s under 16 hostile requests)."""
    asked: list[Priority] = []

    async def get_block(store: str, place: BlockPlace, priority: Priority, allowance: Any,
                        compressed: bool) -> PeerPayload:  # fmt: skip
        asked.append(priority)
        return PeerPayload(b"x" * place.rlen, False)

    async def main() -> None:
        server = PeerServer(PeerConfig(listen=f"127.0.0.1:{free_port()}"), None, get_block)
        with trio.fail_after(60):  # a hang detector: on the old code the getter's call fails and nothing answers
            await ask_each(server)

    async def ask_each(server: PeerServer) -> None:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(server.run)
            for priority in ("demand", "readahead", "prefetch"):
                place = BlockPlace(made_up(0), "b" * 64, 0, 100, 100)
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all(f"GET {block_target('c' * 32, place, priority)} HTTP/1.1\r\n\r\n".encode())
                answer = b""
                while b"xxxx" not in answer:
                    answer += await stream.receive_some()
                await stream.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert asked == [Priority.READAHEAD, Priority.PREFETCH, Priority.PREFETCH]
    assert all(priority > Priority.DEMAND for priority in asked)


def test_peer_serving_holds_at_most_its_memory_and_max_uploads_blocks_at_once() -> None:
    """16 requests for 64 KiB blocks at once, with memory for 4 of them (fetched and raw bytes): the getter is
    never running for more than 4, the server never holds more than its memory, and all 16 are answered."""
    rlen = 64 << 10
    per_request = max_stored_length(rlen) + rlen
    running, most = 0, 0
    release = trio.Event()

    async def get_block(store: str, place: BlockPlace, priority: Priority, allowance: Any,
                        compressed: bool) -> PeerPayload:  # fmt: skip
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return PeerPayload(b"x" * place.rlen, False)

    answered = processing = 0

    async def ask(host: str, port: int, number: int) -> None:
        nonlocal answered, processing
        place = BlockPlace(made_up(number), "b" * 64, 0, max_stored_length(rlen), rlen)
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(f"GET {block_target('c' * 32, place, 'demand')} HTTP/1.1\r\n\r\n".encode())
        received = b""
        while b"102 Processing" not in received:
            received += await stream.receive_some()
        processing += 1  # the owner is at work on it: its request waits for memory or is being got
        body = 0
        while body < rlen:
            data = await stream.receive_some()
            assert data
            body += data.count(b"x")
        answered += 1
        await stream.aclose()

    async def main() -> PeerServer:
        # A deadline whose BUSY_AFTER (90 s) no wait for memory here reaches: every request is served.
        server = PeerServer(PeerConfig(listen=f"127.0.0.1:{free_port()}", max_uploads=8, deadline=30), None,
                            get_block, memory=4 * per_request)  # fmt: skip
        with trio.fail_after(60):  # a hang detector
            async with trio.open_nursery() as nursery:
                host, port = await nursery.start(server.run)
                async with trio.open_nursery() as askers:
                    for number in range(16):
                        askers.start_soon(ask, host, port, number)
                    while processing < 16:  # every request has reached the owner's getter or waits for memory
                        await trio.sleep(0.01)
                    release.set()
                nursery.cancel_scope.cancel()
        return server

    server = trio.run(main)
    assert answered == 16
    stats = server.statistics()
    assert most == 4 and stats.held_peak <= 4 * per_request and stats.held_bytes == 0
    assert stats.held_limit == 4 * per_request and stats.served_blocks == 16


# -- a real BlockFetcher over a paused store: a peer's fetch never holds up the node's own read ------------


def test_a_nodes_own_read_of_a_block_a_peer_asked_for_goes_before_the_peers_lower_priority_work(
    tmp_path: Path,
) -> None:
    """The node's own DEMAND read of a block that a peer's request (at READAHEAD) is fetching used to wait on
    that request's pending fetch, behind every other READAHEAD fetch; now it asks the engine itself, which
    raises the queued fetch to DEMAND (one fetch, no second one)."""
    store = tmp_path / "store"
    store.mkdir()
    rng = random.Random(21)
    index = pack_layer(store, {"big.bin": rng.randbytes(40 * BLOCK4K), "other.bin": rng.randbytes(4 * BLOCK4K)})
    big, other = entry(index, "big.bin"), entry(index, "other.bin")
    first, wanted, later = (index.blocks[big.blocks[n]] for n in (0, 20, 30))
    ahead = index.blocks[other.blocks[0]]
    source = FaultySource(LocalSource(str(store)))

    async def main() -> None:
        async with open_engine(source, engine_config(streams=1, coalesce_gap=0)) as engine:
            fetcher = BlockFetcher(engine, None)
            place = BlockPlace(wanted.digest, index.packs[wanted.pack], wanted.offset, wanted.clen, wanted.rlen)
            source.pause()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetcher.blocks, index, [big.blocks[0]])  # in flight: the one stream is busy
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(fetcher.blocks, index, [other.blocks[0]], Priority.READAHEAD)  # queued
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(fetcher.block_for_peer, place, Priority.READAHEAD)  # a peer's demand, queued
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(fetcher.blocks, index, [big.blocks[20]])  # the node's own read of that block
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(fetcher.blocks, index, [big.blocks[30]], Priority.READAHEAD)  # queued last
                await trio.testing.wait_all_tasks_blocked()
                source.resume()
            assert engine.statistics().extents_raised == 1

    autojump_run(main)
    packs = [pack_object(name) for name in index.packs]
    assert [(r.path, r.offset) for r in source.reads] == [
        (packs[first.pack], first.offset),
        (packs[wanted.pack], wanted.offset),  # the own read's block, raised to DEMAND: before the read-ahead
        (packs[ahead.pack], ahead.offset),
        (packs[later.pack], later.offset),
    ]
    source.close()


def test_the_fetch_budget_reaches_the_layer_server_and_one_smaller_than_a_block_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    from bootseer.blockstore.server.client import ServerSettings
    from bootseer.blockstore.peers.config import PeerConfigError
    from bootseer.snapshotter import config

    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    listen = f"127.0.0.1:{free_port()}"
    merged = {"peers.listen": listen, "peers.members": [listen], "peers.token_file": str(token)}
    settings = config.resolve({**merged, "peers.fetch_budget": "64M"}, {})
    assert settings.peers.fetch_budget == 64 << 20
    assert ServerSettings(peers=settings.peers).document()["peer-fetch-budget"] == 64 << 20
    assert config.resolve(merged, {}).peers.fetch_budget == PeerConfig.fetch_budget == 1 << 30
    with pytest.raises(config.ConfigError, match="peers.fetch_budget"):
        config.resolve({**merged, "peers.fetch_budget": "4K"}, {})
    with pytest.raises(PeerConfigError, match="fetch_budget"):
        PeerConfig(listen=listen, members=(listen,), fetch_budget=-1).check()
