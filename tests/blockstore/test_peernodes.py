"""The peer-node harness itself (tests/support/peernodes.py), peers off: several nodes in network
namespaces mount a converted image from a store in its own namespace, every byte read through their
mounts is the store's, and leaving the cluster, pass or fail, leaves no namespace, veth pair,
layer server, mount or nginx behind; the peer options the harness builds reach the servers (no
block moves between peers here: that is the peer sharing's own tests').

The image is :func:`tests.support.oci.rich_layers` (an entry of every kind, files spanning several
blocks), converted by :func:`tests.support.layer_store.build_store` into a store directory served by
nginx from the store namespace; each node's link and the store's are shaped with ``tbf``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bootseer.blockstore.server.client import ServerTimedOut, ServerUnavailable
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.oci import rich_layers
from tests.support.peernodes import PeerCluster, leftovers, peer_args, write_token
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

BLOCK_SIZE = 64 << 10


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path_factory.mktemp("store")
    layout = tmp_path_factory.mktemp("layout")
    return store, build_store(store, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE, layout=layout)


def test_three_nodes_read_the_image_from_the_store_namespace_every_byte_right(
        tmp_path: Path, built: tuple[Path, list[BuiltLayer]]) -> None:
    store, layers = built
    chains = [layer.chain_id for layer in layers]
    cluster = PeerCluster(tmp_path / "c", store, 3, node_rate="1gbit", store_rate="1gbit",
                          node_args=lambda node, c: ["--streams", "4"])
    with cluster:
        assert len({node.ip for node in cluster.nodes} | {cluster.store.ip}) == 4
        assert all("--streams" in node.argv() for node in cluster.nodes)
        for node in cluster.nodes:
            mounted = node.mount_image(chains)
            compared = sum(node.verify_layer(m, layer.index, store) for m, layer in zip(mounted, layers))
            assert compared == sum(e.size for layer in layers for e in layer.index.entries
                                   if e.type.value == "file")
            assert {row["chain_id"] for row in node.status()["layers"]} == set(chains)
        # Each node read the store over the LAN on its own: the store sent at least what they all fetched.
        fetched = [node.metric("bootseer_block_fetched_bytes_total") for node in cluster.nodes]
        assert all(f > 0 for f in fetched), fetched
        assert cluster.store_body_bytes() >= sum(fetched)
        assert cluster.store_egress() > cluster.store_body_bytes()  # headers and framing besides the bodies
        # Each node has its own root and cache, and its server runs in its own network namespace.
        assert len({node.cache_dir for node in cluster.nodes}) == 3
        for node in cluster.nodes:
            assert any(p.is_file() for p in node.cache_dir.rglob("*"))
            assert node.pid in node.member.pids()
        # What the teardown check looks for is there while the cluster is.
        here = leftovers(cluster)
        assert sum(name.startswith("bootseer-lan") for name in here) == 5  # the switch, the store, 3 nodes
        assert sum(item.startswith("layer server") for item in here) == 3 and any("nginx" in i for i in here)
    assert leftovers(cluster) == []


def test_hang_resume_and_kill_a_node(tmp_path: Path, built: tuple[Path, list[BuiltLayer]]) -> None:
    store, layers = built
    with PeerCluster(tmp_path / "c", store, 2) as cluster:
        hung, killed = cluster.nodes
        hung.mount_image([layer.chain_id for layer in layers])
        hung.hang()
        with pytest.raises(ServerTimedOut):
            hung.client.call({"op": "status"}, timeout=1)
        hung.resume()
        assert hung.status()["pid"] == hung.pid
        mounted = hung.mount_image([layer.chain_id for layer in layers])
        assert hung.verify_layer(mounted[-1], layers[-1].index, store) > 0
        killed.mount_image([layer.chain_id for layer in layers])
        pid = killed.pid
        killed.kill()
        assert killed.pid is None and pid not in killed.member.pids()
        with pytest.raises(ServerUnavailable):
            killed.status()
        killed.start()  # a restarted node restores its layers from its table
        wait_until("the restarted node to serve its layers", lambda: len(killed.status()["layers"]) == len(layers))
    assert leftovers(cluster) == []


def test_a_failure_inside_the_cluster_still_tears_everything_down(
        tmp_path: Path, built: tuple[Path, list[BuiltLayer]]) -> None:
    store, layers = built
    cluster = PeerCluster(tmp_path / "c", store, 2)
    with pytest.raises(RuntimeError, match="the test failed"):
        with cluster:
            for node in cluster.nodes:
                node.mount_image([layer.chain_id for layer in layers])
            cluster.nodes[0].hang()  # a hung server must not stop the teardown
            raise RuntimeError("the test failed")
    assert leftovers(cluster) == []


def test_peer_args_start_nodes_that_list_each_other(tmp_path: Path, built: tuple[Path, list[BuiltLayer]]) -> None:
    """The harness's peer options reach the servers: each listens on its own address, lists both nodes,
    and the other node's listener answers across the LAN (a block request without the token is refused)."""
    store, _layers = built
    token = write_token(tmp_path / "token")
    with PeerCluster(tmp_path / "c", store, 2, node_args=peer_args(token, "--peer-deadline", "0.5")) as cluster:
        addresses = cluster.peer_addresses()
        for node in cluster.nodes:
            status = node.peers_status()
            assert status["self"] == node.peer_address
            assert sorted(member["address"] for member in status["members"]) == sorted(addresses)
        asker, owner = cluster.nodes
        answer = subprocess.run([*asker.member.launcher(), "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                 f"http://{owner.peer_address}/v1/blocks/{'0' * 64}?store=x&pack={'0' * 64}"
                                 "&offset=0&clen=1&rlen=1"], capture_output=True, text=True, timeout=60)
        assert answer.stdout == "401"
    assert leftovers(cluster) == []
