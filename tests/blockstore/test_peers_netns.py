"""Peer block sharing across network namespaces (issue 16's CI tests): nodes share blocks, and a
peer that lies, hangs, dies, refuses or leaves never costs a wrong byte, only a store fetch.

Each node is its own ``bootseer layer-server`` (own root and node cache) in a network namespace
of its own, the store an nginx in another (:mod:`tests.support.peernodes`); every byte a test
reads through a node's mount is compared with the store's (:meth:`PeerNode.verify_layer`).

One converted store serves every test (module-scoped): image ``[A]`` (layer A, 4 MiB of
incompressible data in two files, no hot list: reads) and image ``[A, B]`` (B, 4 MiB more, whose
hot list names every block of B, written straight into the store as a recording would publish
it: mounting the image on a node starts a hot-list prefetch of B).

Tests that count bytes give peers a 10 s deadline (:data:`PATIENT`), so that a busy 2-core
machine never makes an answer late and the store hedged; only the hung peer's test, which is
about the deadline, has a short one.  A misbehaving peer is made so at a point the test waits
for, never after a guessed time: an owner hung once the asker has read a block from it, an owner
killed once it has served its first block (its uploads slowed with ``--peer-upload-rate``, so
that most of its share is still to come), a members file rewritten once a prefetch has fetched
its first batch (small batches, one at a time, so that each later batch finds the new owners).
The loopback versions of these cases, and the protocol's own units, are in tests/blockstore/test_peers.py.

The last test is a regression test of the block fetcher without processes: two fetchers, each
the other's peer, reading the same two blocks at once used to wait on each other for good.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
import trio

from bootseer.blockstore.server.client import MountedLayer, ServerSettings
from bootseer.blockstore.objects.format import LayerIndex
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.ownership import rendezvous_score
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.fetch.engine import open_engine
from bootseer.fetch.stripes import Priority
from bootseer.fetch.sources.local import LocalSource
from bootseer.hotlist.format import HotBlock, HotList, hotlist_object
from tests.support import autojump
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import blob_data
from tests.support.peernodes import PeerCluster, PeerNode, leftovers, peer_args, write_token
from tests.support.waiting import wait_until
from tests.support.peers import owned_by

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 64 << 10
LAYER_BYTES = 4 << 20
DATA = blob_data(2 * LAYER_BYTES)  # A's half and B's half share no block
#: A peer deadline no busy test machine misses: a test that counts bytes never sees a spurious hedge.
PATIENT = "10"
#: Uploads slow enough that a node's share of a layer takes seconds: a kill or a hang lands mid-transfer.
SLOW_UPLOADS = "512K"


@dataclasses.dataclass(frozen=True)
class Store:
    """The module's converted store: layer A (image ``[A]``) and B (top of ``[A, B]``, with a hot list)."""

    path: Path
    a: BuiltLayer
    b: BuiltLayer

    @property
    def image(self) -> list[str]:
        return [self.a.chain_id, self.b.chain_id]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    path = tmp_path_factory.mktemp("store")
    half = LAYER_BYTES // 2
    layers = [
        Layer((File("data/a1.bin", DATA[:half]), File("data/a2.bin", DATA[half:LAYER_BYTES]))),
        Layer((File("data/b.bin", DATA[LAYER_BYTES:]),)),
    ]
    # Without EROFS images: the test counts the layers' file blocks moved (an image's go through peers too).
    a, b = build_store(path, layers, block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"), inline_max=None)
    index = b.index
    hot = [HotBlock(b.chain_id, block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen, n / 1000)
           for n, block in enumerate(index.blocks) if not block.is_zero]  # fmt: skip
    FileStoreWriter(path).put(hotlist_object(b.chain_id),
                              HotList(b.chain_id, "", [a.chain_id, b.chain_id], hot, node="recorder").encode())
    return Store(path, a, b)


def stored_bytes(index: LayerIndex) -> int:
    """What the store sends for every block of ``index`` once (compressed bytes)."""
    return sum(block.clen for block in index.blocks if not block.is_zero)


@pytest.fixture
def token(tmp_path: Path) -> Path:
    return write_token(tmp_path / "token")


@pytest.fixture
def clusters(tmp_path: Path, store: Store) -> Iterator[Callable[..., PeerCluster]]:
    """``make(nodes, **PeerCluster options)``: an open cluster on the module's store, closed (and checked
    gone) at teardown."""
    made: list[PeerCluster] = []

    def make(nodes: int, **options: Any) -> PeerCluster:
        cluster = PeerCluster(tmp_path / f"c{len(made)}", store.path, nodes, **options).__enter__()
        made.append(cluster)  # (a cluster that failed to open has closed what it made)
        return cluster

    yield make
    left = []
    for cluster in made:
        try:
            cluster.__exit__(None, None, None)
        finally:  # every cluster goes, whatever one's teardown raised
            left += leftovers(cluster)
    assert left == []


def start_all(nodes: Sequence[PeerNode]) -> None:
    """Start the nodes' servers at once (a start is mostly the interpreter's import time)."""
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_ready()


def in_threads(work: Sequence[Callable[[], Any]], timeout: float = 120) -> list[Any]:
    """Run each of ``work`` in a thread of its own, all at once; their results (the first error raised)."""
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []
    go = threading.Barrier(len(work))

    def run(number: int) -> None:
        go.wait()
        try:
            results[number] = work[number]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"a thread still runs after {timeout:g}s"
    if errors:
        raise errors[0]
    return results


def owner_among(members: Sequence[str], digest: str) -> str:
    """The member owning block ``digest`` in a group of ``members`` (the highest rendezvous score)."""
    return max(members, key=lambda address: rendezvous_score(address, digest))


def member(status: dict[str, Any], address: str) -> dict[str, Any]:
    """The entry of ``address`` in a ``peers.status`` answer's members."""
    return next(entry for entry in status["members"] if entry["address"] == address)


def prefetch_of(node: PeerNode, image: str) -> dict[str, Any] | None:
    """The node's prefetch of ``image``, running or finished (``hotlist.status``), None before it starts."""
    status = node.client.call({"op": "hotlist.status"})
    for running in status["prefetches"]:
        if running["image"] == image:
            return running
    done = [s for s in status["finished"] if s.get("kind") == "prefetch" and s["image"] == image]
    return done[-1] if done else None


def finished_prefetch(node: PeerNode, image: str) -> dict[str, Any]:
    return wait_until(f"{node.name}'s prefetch of the image to finish",
                      lambda: (p := prefetch_of(node, image)) is not None and p["finished"] and p, timeout=120)


def verify_image(node: PeerNode, mounted: Sequence[MountedLayer], layers: Sequence[BuiltLayer], store: Path) -> None:
    """Every byte of every layer read through ``node``'s mounts is the store's."""
    compared = sum(node.verify_layer(m, layer.index, store) for m, layer in zip(mounted, layers))
    assert compared == LAYER_BYTES * len(layers)


# -- blocks come from peers -------------------------------------------------------------------------


def read_at_once(cluster: PeerCluster, layer: BuiltLayer, store: Path) -> int:
    """Every node mounts ``layer`` and reads every byte of it, all at once (a thread each), each byte
    checked; the response body bytes the store sent meanwhile."""
    before = cluster.store_body_bytes()
    mounted = [node.mount(layer.chain_id) for node in cluster.nodes]
    in_threads([lambda node=node, m=m: node.verify_layer(m, layer.index, store)
                for node, m in zip(cluster.nodes, mounted)])  # fmt: skip
    return cluster.store_body_bytes() - before


def test_four_nodes_reading_one_layer_at_once_fetch_it_from_the_store_about_once(
        clusters: Callable[..., PeerCluster], store: Store, token: Path) -> None:
    """With peers the store sends about one copy of the layer for four nodes; without, four."""
    nodes = 4
    stored = stored_bytes(store.a.index)
    cluster = clusters(nodes, node_args=peer_args(token, "--peer-deadline", PATIENT))
    with_peers = read_at_once(cluster, store.a, store.path)
    statuses = [node.peers_status() for node in cluster.nodes]
    for node, status in zip(cluster.nodes, statuses):
        assert status["received"]["blocks"] > 0, (node.name, status)
        assert node.metric("bootseer_peer_bytes_total", direction="received") == status["received"]["bytes"]
        assert status["fallbacks"] == status["bad_blocks"] == status["errors"] == 0, (node.name, status)
    # What one node received from a peer, that peer served.
    assert sum(s["received"]["blocks"] for s in statuses) == sum(s["served"]["blocks"] for s in statuses)
    assert stored <= with_peers <= 1.25 * stored, (with_peers, stored)

    # The same nodes, fresh (empty roots and caches), peers off: each fetches its own copy.
    for node in cluster.nodes:
        node.stop()
        shutil.rmtree(node.base)
        node.extra_args = ()
    start_all(cluster.nodes)
    without = read_at_once(cluster, store.a, store.path)
    assert without >= nodes * stored, (without, stored)
    assert without > 3 * with_peers, (without, with_peers)


# -- a peer that lies ---------------------------------------------------------------------------------


def test_a_peer_in_another_namespace_serving_corrupt_blocks_costs_store_fetches_never_a_wrong_byte(
        clusters: Callable[..., PeerCluster], store: Store, token: Path, tmp_path: Path) -> None:
    cluster = clusters(2, node_args=peer_args(token, "--peer-deadline", PATIENT), start=False)
    asker, liar = cluster.nodes
    members = cluster.peer_addresses()
    theirs = owned_by(store.a.index, members, liar.peer_address)
    assert theirs, "the lying peer owns no block: the test would test nothing"
    requests = tmp_path / "liar-requests"
    with open(requests, "wb") as out:
        fake = subprocess.Popen([*liar.member.launcher(), sys.executable, "-m", "tests.support.peers", liar.peer_address, "corrupt"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip
    try:
        wait_until("the lying peer to listen", lambda: b"listening" in requests.read_bytes() or fake.poll() is not None)
        assert fake.poll() is None, requests.read_text()
        asker.start()
        assert asker.verify_layer(asker.mount(store.a.chain_id), store.a.index, store.path) == LAYER_BYTES
        status = asker.peers_status()
    finally:
        fake.kill()
        fake.wait(30)
    asked = [line for line in requests.read_text().splitlines() if line.startswith("/v1/blocks/")]
    assert asked, "the lying peer was never asked"
    assert status["bad_blocks"] >= 1 and status["fallbacks"] >= 1 and status["received"]["blocks"] == 0, status
    assert asker.metric("bootseer_peer_requests_total", outcome="bad_block") == status["bad_blocks"]
    # Skipped after its first bad blocks: the rest of its blocks went to the store without asking it.
    assert member(status, liar.peer_address)["state"] == "skipped"
    assert len(asked) < len(theirs)
    # Every block came from the store (the lying peer's too).
    assert asker.metric("bootseer_block_fetched_bytes_total") >= stored_bytes(store.a.index)


# -- a peer that hangs ----------------------------------------------------------------------------------


def test_an_owner_hung_in_the_middle_of_the_reads_is_waited_for_the_deadline_then_skipped(
        clusters: Callable[..., PeerCluster], store: Store, token: Path) -> None:
    # A deadline the test is about: short, yet more than a healthy owner ever needs for one block.
    cluster = clusters(2, node_args=peer_args(token, "--peer-deadline", "1"))
    asker, owner = cluster.nodes
    index = store.a.index
    theirs = set(owned_by(index, cluster.peer_addresses(), owner.peer_address))
    entry = next(e for e in index.entries if e.path == "data/a1.bin")
    position = next(n for n, ref in enumerate(entry.blocks) if ref in theirs)
    mounted = asker.mount(store.a.chain_id)
    # A block the owner owns, read with the owner well (its read-ahead goes through the peers too) ...
    offset = position * BLOCK_SIZE
    assert asker.read(mounted, entry.path, offset, BLOCK_SIZE) == DATA[offset : offset + BLOCK_SIZE]
    well = asker.peers_status()
    assert 0 < well["received"]["blocks"] < len(theirs) and well["late"] == well["fallbacks"] == 0, well
    owner.hang()  # ... then the owner stops: the kernel holds its connections, it answers nothing
    try:
        compared = asker.verify_layer(mounted, index, store.path)
        status = asker.peers_status()
    finally:
        owner.resume()
    assert compared == LAYER_BYTES
    assert status["late"] >= 1 and status["fallbacks"] >= 1, status
    assert asker.metric("bootseer_peer_fallbacks_total", reason="late") >= 1
    assert asker.metric("bootseer_peer_requests_total", outcome="late") >= 1
    hung = member(status, owner.peer_address)
    assert hung["state"] == "skipped" and "silent" in hung["last_error"], hung
    # The rest of its blocks came from the store.
    assert status["received"]["blocks"] < len(theirs)


# -- a peer that dies ------------------------------------------------------------------------------------


def test_an_owner_killed_mid_transfer_during_a_hot_list_prefetch_leaves_the_prefetch_whole(
        clusters: Callable[..., PeerCluster], store: Store, token: Path) -> None:
    asking = peer_args(token, "--peer-deadline", PATIENT)
    slow = peer_args(token, "--peer-deadline", PATIENT, "--peer-upload-rate", SLOW_UPLOADS)
    cluster = clusters(2, node_args=lambda node, c: (slow if node.index else asking)(node, c))
    asker, victim = cluster.nodes
    theirs = owned_by(store.b.index, cluster.peer_addresses(), victim.peer_address)
    mounted = asker.mount_image(store.image)  # the top's mount starts the prefetch of B's hot list
    wait_until("the victim's first block served", lambda: victim.peers_status()["served"]["blocks"] > 0)
    victim.kill()
    prefetch = finished_prefetch(asker, store.b.chain_id)
    assert prefetch["failed_blocks"] == 0 and prefetch["fetched_blocks"] == prefetch["planned_blocks"], prefetch
    status = asker.peers_status()
    assert 0 < status["received"]["blocks"] < len(theirs), (status, len(theirs))
    assert status["errors"] >= 1 and status["fallbacks"] >= 1, status
    assert asker.metric("bootseer_peer_requests_total", outcome="error") == status["errors"]
    assert member(status, victim.peer_address)["failures"] >= 1
    verify_image(asker, mounted, [store.a, store.b], store.path)


# -- a wrong token ----------------------------------------------------------------------------------------


def test_a_wrong_token_across_namespaces_is_refused_and_the_asker_uses_the_store(
        clusters: Callable[..., PeerCluster], store: Store, token: Path, tmp_path: Path) -> None:
    other = write_token(tmp_path / "other-token")
    right, wrong = peer_args(token, "--peer-deadline", PATIENT), peer_args(other, "--peer-deadline", PATIENT)
    cluster = clusters(2, node_args=lambda node, c: (wrong if node.index == 0 else right)(node, c))
    asker, owner = cluster.nodes
    assert owned_by(store.a.index, cluster.peer_addresses(), owner.peer_address)
    assert asker.verify_layer(asker.mount(store.a.chain_id), store.a.index, store.path) == LAYER_BYTES
    asked, answered = asker.peers_status(), owner.peers_status()
    assert asked["received"]["blocks"] == 0 and answered["served"]["blocks"] == 0
    assert asked["fallbacks"] >= 1 and asker.metric("bootseer_peer_requests_total", outcome="unauthorized") >= 1
    refused = member(asked, owner.peer_address)
    assert refused["state"] == "skipped" and "token" in refused["last_error"], refused
    assert owner.metric("bootseer_peer_served_total", outcome="unauthorized") >= 1
    assert owner.metric("bootseer_peer_served_total", outcome="ok") == 0
    assert asker.metric("bootseer_block_fetched_bytes_total") >= stored_bytes(store.a.index)
    for secret in (token, other):
        assert secret.read_text().strip() not in asker.log_tail(10**7) + owner.log_tail(10**7)


# -- a membership change ------------------------------------------------------------------------------------


def write_members(path: Path, addresses: Sequence[str]) -> None:
    """The members file, replaced at once (as the Slurm prolog of docs/peers.md does)."""
    new = path.with_suffix(".new")
    new.write_text("".join(f"{address}\n" for address in addresses))
    new.replace(path)


def test_the_members_file_rewritten_during_a_prefetch_moves_blocks_and_the_prefetch_finishes_whole(
        clusters: Callable[..., PeerCluster], store: Store, token: Path, tmp_path: Path) -> None:
    """Node 0 prefetches with members {0, 1}; the file then says {0, 2}: node 1 leaves, node 2 joins."""
    members = tmp_path / "members"
    batch = 4 * BLOCK_SIZE

    def args(node: PeerNode, cluster: PeerCluster) -> list[str]:
        more = ["--peer-upload-rate", SLOW_UPLOADS] if node.index else []
        return ["--peer-listen", node.peer_address, "--peers-file", str(members), "--peer-token-file", str(token),
                "--peer-deadline", PATIENT, *more]

    # Small batches one at a time: each batch finds its owners as it starts, so a change reaches the rest.
    settings = ServerSettings(prefetch_batch=batch, prefetch_concurrency=1, prefetch_page_cache=False)
    cluster = clusters(3, node_args=args, settings=settings, start=False)
    asker, leaver, joiner = cluster.nodes
    write_members(members, [asker.peer_address, leaver.peer_address])
    start_all(cluster.nodes)
    plan = [block for block in store.b.index.blocks if not block.is_zero]  # the hot list: every block of B
    mounted = asker.mount_image(store.image)
    wait_until("the prefetch's first batch", lambda: (p := prefetch_of(asker, store.b.chain_id)) and p["fetched_blocks"])
    after = [asker.peer_address, joiner.peer_address]
    write_members(members, after)
    wait_until("node 0 to see the new members",
               lambda: sorted(m["address"] for m in asker.peers_status()["members"]) == sorted(after))
    seen = prefetch_of(asker, store.b.chain_id)
    assert seen is not None
    # Batches after the one in flight (at most batch / the smallest block's blocks) found the new owners.
    in_flight = batch // min(block.clen for block in plan)
    done_or_going = seen["fetched_blocks"] + in_flight
    moved_to_joiner = [block for block in plan[done_or_going:]
                       if owner_among(after, block.digest) == joiner.peer_address]
    assert moved_to_joiner, f"the prefetch was (nearly) done when the change was seen: {seen}"

    prefetch = finished_prefetch(asker, store.b.chain_id)
    assert prefetch["failed_blocks"] == 0 and prefetch["fetched_blocks"] == prefetch["planned_blocks"] == len(plan)
    # The newcomer served the blocks it came to own; the leaver was asked only before it left.
    assert joiner.peers_status()["served"]["blocks"] >= len(moved_to_joiner)
    before = [asker.peer_address, leaver.peer_address]
    leavers = [block for block in plan[:done_or_going] if owner_among(before, block.digest) == leaver.peer_address]
    assert leaver.peers_status()["served"]["blocks"] <= len(leavers)
    verify_image(asker, mounted, [store.a, store.b], store.path)
    status = asker.peers_status()
    assert status["fallbacks"] == status["bad_blocks"] == status["errors"] == 0, status


# -- regression: two nodes reading the same blocks at once ----------------------------------------------------


class Crossing:
    """Block fetchers in one process, each the others' peer: fetcher ``me`` takes block ``digest`` to be
    owned by fetcher ``views[me][digest]`` (one view for all by default: ``owners``), and asking its owner
    calls that fetcher's ``block_for_peer`` (as its peer server would), but only once every fetcher has
    begun asking: each fetcher's call then has all its blocks pending before any serves another."""

    def __init__(self, owners: dict[str, int], *, views: list[dict[str, int]] | None = None) -> None:
        self.views = views if views is not None else [owners, owners]
        self.fetchers: list[BlockFetcher] = []
        self.asking: set[int] = set()
        self.both = trio.Event()


@dataclasses.dataclass
class CrossedPeers:
    """Fetcher ``me``'s peers in a :class:`Crossing` (a :class:`~bootseer.blockstore.node.peers.PeerBlocks`)."""

    crossing: Crossing
    me: int

    def owner(self, digest: str) -> str | None:
        owner = self.crossing.views[self.me][digest]
        return None if owner == self.me else f"node{owner}"

    async def fetch(self, store: str, places: Sequence[BlockPlace], priority: Priority,
                    deliver: Callable[[str, bytes], None], late: Callable[[str], None]) -> None:  # fmt: skip
        crossing = self.crossing
        crossing.asking.add(self.me)
        if len(crossing.asking) == len(crossing.views):
            crossing.both.set()
        await crossing.both.wait()

        async def ask(place: BlockPlace) -> None:
            owner = crossing.views[self.me][place.digest]
            data = await crossing.fetchers[owner].block_for_peer(place, priority)
            if data is None:
                late(place.digest)
            else:
                deliver(place.digest, data)

        async with trio.open_nursery() as nursery:
            for place in places:
                nursery.start_soon(ask, place)


def test_two_nodes_reading_blocks_the_other_owns_at_once_never_wait_on_each_other(store: Store) -> None:
    """Regression: a block was ready to a peer only once the whole call fetching it ended.  Node 0 reading
    blocks (p, q) and node 1 reading (p, q) at once, p node 0's and q node 1's: node 0 served p only when its
    call had q from node 1, which served q only when its call had p from node 0, and both waited until the
    peers' 60 s request limit ran out (the store was then asked: netns clusters reading at once stalled)."""
    index = store.a.index
    p, q = index.blocks[0], index.blocks[1]

    async def main() -> list[list[bytes]]:
        crossing = Crossing({p.digest: 0, q.digest: 1})
        async with open_engine(LocalSource(str(store.path))) as engine0, \
                open_engine(LocalSource(str(store.path))) as engine1:  # fmt: skip
            for me, engine in enumerate((engine0, engine1)):
                crossing.fetchers.append(BlockFetcher(engine, None, peers=CrossedPeers(crossing, me),
                                                      peer_store="store"))  # fmt: skip
            got: list[list[bytes]] = [[], []]

            async def read(me: int) -> None:
                got[me] = await crossing.fetchers[me].blocks(index, [0, 1])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, 0)
                nursery.start_soon(read, 1)
        return got

    expected = DATA[: 2 * BLOCK_SIZE]
    got = autojump.run(main, hold_for_threads=True)  # a deadlock fails at the mock clock's test timeout
    assert [b"".join(blocks) for blocks in got] == [expected, expected]


def test_three_nodes_that_disagree_on_an_owner_never_wait_in_a_circle(store: Store) -> None:
    """Regression: while a membership changes, nodes may name different owners for one block.  Node 0 taking
    node 1 for p's owner, node 1 taking node 2 and node 2 taking node 0, each asking its owner while its own
    call for p asks another: an owner that joined its own pending call would wait on the next node, and the
    three would wait in a circle until the peers' 60 s request limit.  An owner joins only a call that gets
    the block without a peer, so each fetches p from the store for its asker instead."""
    index = store.a.index
    p = index.blocks[0]

    async def main() -> list[list[bytes]]:
        crossing = Crossing({}, views=[{p.digest: 1}, {p.digest: 2}, {p.digest: 0}])
        async with open_engine(LocalSource(str(store.path))) as e0, open_engine(LocalSource(str(store.path))) as e1, \
                open_engine(LocalSource(str(store.path))) as e2:  # fmt: skip
            for me, engine in enumerate((e0, e1, e2)):
                crossing.fetchers.append(BlockFetcher(engine, None, peers=CrossedPeers(crossing, me),
                                                      peer_store="store"))  # fmt: skip
            got: list[list[bytes]] = [[], [], []]

            async def read(me: int) -> None:
                got[me] = await crossing.fetchers[me].blocks(index, [0])

            async with trio.open_nursery() as nursery:
                for me in range(3):
                    nursery.start_soon(read, me)
        return got

    got = autojump.run(main, hold_for_threads=True)  # a circle fails at the mock clock's test timeout
    assert [b"".join(blocks) for blocks in got] == [DATA[:BLOCK_SIZE]] * 3
