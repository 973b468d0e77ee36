"""Signed conversions, hot lists and deps records, and the trust policy a node serves under (docs/trust.md).

The attack of issue 14 item 9, for real: a store writer without a key replaces what a
digest-pinned image contains, an index with the right diff_id whose file points at
blocks the attacker stored (another image's pack), and a new chain record naming it.
A node with no keys serves the forgery (the documented no-policy behaviour); a node
configured with the converter's key refuses it and falls back to the ordinary download
(a log line and ``remote_fallbacks_total{reason="untrusted"}``), and serves the
genuine, signed layer.  Then each object kind on its own, with the real layer server's
code in-process on a real ``file://`` store: records signed by an untrusted key, a
valid signature moved to another layer, an unsigned hot list, a forged deps record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
import pytest
import trio

from bootseer.blockstore.server.client import LayerUntrusted, ServerSettings
from bootseer.blockstore.convert.converter import convert_image
from bootseer.blockstore.objects.format import ChainRecord, chain_object, decode_sealed, encode_sealed
from bootseer.images.chains import chain_id
from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig
from bootseer.blockstore.objects.signing import SigningKey, TrustPolicy, Untrusted, generate_key
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.depsnap.prefix import lookup as deps_lookup
from bootseer.depsnap.record import DepsRecord, deps_object
from bootseer.hotlist.recorder import Recording
from bootseer.hotlist.publishing import publish
from bootseer.hotlist.service import HotListConfig, HotListService
from bootseer.hotlist.format import HOTLIST_MAGIC, HOTLIST_VERSION, HotBlock, HotList, HotListUntrusted, hotlist_object
from bootseer.images.registry import open_image
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2 as api
from bootseer.snapshotter import config
from bootseer.snapshotter.types import Mount
from tests.support.daemon import scrape, started_record
from tests.support.forgery import forge_file
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import build_oci_layout
from tests.support.mounts import force_unmount, mount_entry
from tests.support.snapshots import mounted

BLOCK_SIZE = 64 << 10
GENUINE = b"#!/bin/sh\necho the genuine tool\n"
EVIL = b"#!/bin/sh\necho the attacker's tool, same name, same image digest\n"
REF_LABEL = "containerd.io/snapshot.ref"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


@dataclasses.dataclass
class Keys:
    converter: SigningKey
    converter_pub: Path
    attacker: SigningKey
    writer: SigningKey
    writer_pub: Path


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    directory = tmp_path / "keys"
    directory.mkdir()
    return Keys(
        converter=generate_key(directory / "converter"),
        converter_pub=directory / "converter.pub",
        attacker=generate_key(directory / "attacker"),
        writer=generate_key(directory / "node"),
        writer_pub=directory / "node.pub",
    )


@dataclasses.dataclass
class Store:
    path: Path
    victim: list[BuiltLayer]  #: the genuine image, converted and signed by the converter key
    evil: BuiltLayer  #: the attacker's own image in the same store (its blocks are what the forgery names)

    @property
    def url(self) -> str:
        return f"file://{self.path}"

    @property
    def writer(self) -> FileStoreWriter:
        return FileStoreWriter(self.path)


@pytest.fixture
def store(tmp_path: Path, keys: Keys) -> Store:
    path = tmp_path / "store"
    victim = build_store(
        path,
        [Layer((File("bin/tool", GENUINE, mode=0o755), File("etc/motd", b"hello\n"))), Layer((File("b", b"second\n"),))],
        block_size=BLOCK_SIZE, layout=tmp_path / "victim", sign_key=keys.converter,
    )  # fmt: skip
    (evil,) = build_store(path, [Layer((File("payload", EVIL),))], block_size=BLOCK_SIZE, layout=tmp_path / "evil")
    return Store(path, victim, evil)


def forge(store: Store, layer: BuiltLayer, *, sign: SigningKey | None = None) -> ChainRecord:
    """``layer``'s ``bin/tool`` pointed at the attacker's blocks (:func:`tests.support.forgery.forge_file`)."""
    return forge_file(store.path, layer.chain_id, "bin/tool", store.evil.chain_id, "payload", sign=sign)


def put_record(store: Store, record: ChainRecord) -> None:
    store.writer.put(chain_object(record.chain_id), record.encode())


def unpack_labels(chain: str) -> dict[str, str]:
    return {REF_LABEL: chain, "containerd.io/gc.root": "test"}


def to_mounts(mounts: Any) -> list[Mount]:
    return [Mount(type=m.type, source=m.source, options=tuple(m.options)) for m in mounts]


# -- end to end: the daemon and its layer server -------------------------------------------------------


@root_only
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")
@pytest.mark.timeout(300)
def test_a_forged_index_is_served_without_keys_and_refused_with_them(
    tmp_path: Path, snapshotter_factory: Any, store: Store, keys: Keys
) -> None:
    bottom = store.victim[0]
    genuine = bottom.record
    forge(store, bottom)

    # No keys: the store is trusted as it is, so the forgery is what the container runs.
    open_node = snapshotter_factory("--store", store.url, root=tmp_path / "open", address=tmp_path / "open.sock")
    with pytest.raises(grpc.RpcError) as raised:
        open_node.stub.Prepare(api.PrepareSnapshotRequest(key="extract-1", labels=unpack_labels(bottom.chain_id)))
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS, raised.value.details()
    container = open_node.stub.Prepare(api.PrepareSnapshotRequest(key="c", parent=bottom.chain_id)).mounts
    with mounted(to_mounts(container), tmp_path / "open-rootfs") as rootfs:
        assert (rootfs / "bin/tool").read_bytes() == EVIL
    assert any("no [trust] converter_keys" in r["msg"] for r in open_node.log_records())

    # The converter's key configured: the unsigned record is refused, the layer downloaded as usual.
    node = snapshotter_factory(
        "--store", store.url, "--converter-key", str(keys.converter_pub), "--metrics-address", "127.0.0.1:0",
        root=tmp_path / "trusting", address=tmp_path / "trusting.sock",
    )  # fmt: skip
    (plain,) = node.stub.Prepare(api.PrepareSnapshotRequest(key="extract-1", labels=unpack_labels(bottom.chain_id))).mounts
    assert plain.type == "bind"  # an ordinary snapshot for the unpacker to fill
    samples = scrape(started_record(node)["metrics_address"])
    assert samples[("bootseer_snapshotter_remote_fallbacks_total", (("reason", "untrusted"),))] == 1
    (line,) = [r for r in node.log_records() if r.get("reason") == "untrusted"]
    assert line["level"] == "warning" and "not signed by a trusted converter key" in line["detail"]

    # The genuine, signed record back: served lazily, the genuine bytes.
    node.stub.Remove(api.RemoveSnapshotRequest(key="extract-1"))
    put_record(store, genuine)
    with pytest.raises(grpc.RpcError) as raised:
        node.stub.Prepare(api.PrepareSnapshotRequest(key="extract-2", labels=unpack_labels(bottom.chain_id)))
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS, raised.value.details()
    container = node.stub.Prepare(api.PrepareSnapshotRequest(key="c", parent=bottom.chain_id)).mounts
    with mounted(to_mounts(container), tmp_path / "trusting-rootfs") as rootfs:
        assert (rootfs / "bin/tool").read_bytes() == GENUINE
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    started = LayerServerClient(ServerPaths(tmp_path / "trusting").socket).status()["settings"]
    assert started["converter-key"] == [str(keys.converter_pub)]  # a path: only public keys, never key material



# -- the layer server's checks, in-process -------------------------------------------------------------


def run_server(tmp_path: Path, store: Store, trust: TrustPolicy, body: Any, sign_key: SigningKey | None = None) -> Any:
    """``await body(server)`` with a real LayerServer on ``store`` (no FUSE session: mounts build the trees).

    Its hot lists are looked up only when the test asks (no prefetch started by a mount), so
    what the test counts is its own look-ups."""

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            settings = LayerServerConfig(root=tmp_path / "node", store=store.url, cache_dir=tmp_path / "cache", trust=trust,
                                         sign_key=sign_key)  # fmt: skip
            settings.paths.indexes.mkdir(parents=True, exist_ok=True)
            server = LayerServer(settings, nursery, extension=lambda host: HotListService(host, HotListConfig(enabled=False)))
            try:
                return await body(server)
            finally:
                nursery.cancel_scope.cancel()

    return trio.run(main)


def test_the_layer_server_mounts_only_chain_records_a_trusted_converter_signed(
    tmp_path: Path, store: Store, keys: Keys
) -> None:
    bottom, top = store.victim
    trust = TrustPolicy.load([keys.converter_pub])

    async def body(server: LayerServer) -> None:
        await server.mount(top.chain_id)  # genuine and signed: served

        forge(store, bottom, sign=keys.attacker)  # signed, but not by a key this node trusts
        with pytest.raises(LayerUntrusted, match=f"signatures by: {keys.attacker.public.id}"):
            await server.mount(bottom.chain_id)
        forge(store, bottom)  # unsigned
        with pytest.raises(LayerUntrusted, match="signatures by: none"):
            await server.mount(bottom.chain_id)

        # The converter's valid signature kept on a record that names the forged index...
        forged = forge(store, bottom)
        put_record(store, dataclasses.replace(forged, signatures=bottom.record.signatures))
        with pytest.raises(LayerUntrusted):
            await server.mount(bottom.chain_id)
        # ... or moved, with the rest of a genuine record, to another layer's ChainID.
        other_diff = "sha256:" + "7" * 64
        moved = dataclasses.replace(bottom.record, chain_id=chain_id(top.chain_id, other_diff), parent=top.chain_id,
                                    diff_id=other_diff, signed=None)  # fmt: skip
        put_record(store, moved)
        with pytest.raises(LayerUntrusted):
            await server.mount(moved.chain_id)

        # A dependency layer is mounted on the word of the trusted deps record naming its index;
        # that word never makes it an image layer, which needs the converter's signature.
        await server.mount(bottom.chain_id, deps_index=forged.index)
        with pytest.raises(LayerUntrusted):
            await server.mount(bottom.chain_id)
        with pytest.raises(LayerUntrusted):
            await server.mount(bottom.chain_id, deps_index="0" * 64)

    run_server(tmp_path, store, trust, body)


def _hot_list(built: list[BuiltLayer]) -> HotList:
    layers = [layer.chain_id for layer in built]
    index = built[0].index
    block = next(b for b in index.blocks if not b.is_zero)
    return HotList(layers[-1], "", layers, [HotBlock(layers[0], block.digest, index.packs[block.pack], block.offset,
                                                      block.clen, block.rlen, 0.1)])  # fmt: skip


def ignored(reason: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value("bootseer_hotlist_ignored_total", {"reason": reason}) or 0.0


def test_a_hot_list_no_trusted_writer_signed_is_ignored(tmp_path: Path, store: Store, keys: Keys) -> None:
    top = store.victim[-1].chain_id
    trust = TrustPolicy.load([keys.converter_pub], [keys.writer_pub])
    name = hotlist_object(top)

    async def body(server: LayerServer) -> list[str]:
        for layer in store.victim:
            await server.mount(layer.chain_id)
        outcomes = []
        for data in (_hot_list(store.victim).encode(), _hot_list(store.victim).encode(keys.attacker)):
            store.writer.put(name, data)
            before = ignored("untrusted")
            with pytest.raises(HotListUntrusted):
                await server.extension.lookup.find(top, "")
            outcomes.append(f"ignored {ignored('untrusted') - before:g}")
        # The node's own list, signed with its key as it publishes: used.
        store.writer.put(name, _hot_list(store.victim).encode(keys.writer))
        hot = await server.extension.lookup.find(top, "")
        outcomes.append(f"used {len(hot.blocks)}")
        return outcomes

    assert run_server(tmp_path, store, trust, body) == ["ignored 1", "ignored 1", "used 1"]


def test_the_layer_server_signs_the_hot_lists_it_publishes_with_the_node_key(tmp_path: Path, store: Store, keys: Keys) -> None:
    layers = [layer.chain_id for layer in store.victim]
    recorded = _hot_list(store.victim)

    async def body(server: LayerServer) -> str:
        recording = Recording(container="job", image=layers[-1], profile="", layers=layers, started=trio.current_time(),
                              publish_to=store.url)  # fmt: skip
        recording.blocks = list(recorded.blocks)
        hotlists = server.extension  # a recording ends as the service ends it: signed with the server's key
        await publish(hotlists.recordings, recording, server.sign_key, hotlists.finished)
        return recording.outcome

    assert run_server(tmp_path, store, TrustPolicy(), body, sign_key=keys.writer) == "published"
    published = HotList.decode(store.writer.get(hotlist_object(layers[-1])), expected_image=layers[-1])
    assert TrustPolicy(writer_keys=(keys.writer.public,)).check("hotlist", published.signed, "it") == keys.writer.public


def test_a_hot_list_signature_does_not_carry_over_to_another_image(store: Store, keys: Keys) -> None:
    """The list names its image (what its store path names): signed for one image, it is not signed for another."""
    data = _hot_list(store.victim).encode(keys.writer)
    document = json.loads(decode_sealed(data, HOTLIST_MAGIC, HOTLIST_VERSION, 1 << 20, "hot list"))
    document["image"], document["layers"] = store.victim[0].chain_id, document["layers"][:1]
    moved = encode_sealed(HOTLIST_MAGIC, HOTLIST_VERSION, json.dumps(document).encode())
    trust = TrustPolicy(writer_keys=(keys.writer.public,))
    assert trust.check("hotlist", HotList.decode(data).signed, "the genuine list") == keys.writer.public
    with pytest.raises(Untrusted, match="not signed by a trusted writer key"):
        trust.check("hotlist", HotList.decode(moved, expected_image=store.victim[0].chain_id).signed, "the moved list")


# -- deps records ---------------------------------------------------------------------------------------


def _deps_record(key: str) -> DepsRecord:
    diff_id = "sha256:" + "d" * 64
    return DepsRecord(key=key, mode="prefix", chain_id=chain_id("", diff_id), parent="", diff_id=diff_id,
                      index="e" * 64, files=3, bytes=10, prefix="/opt/env")  # fmt: skip


def untrusted_deps() -> float:
    return prometheus_client.REGISTRY.get_sample_value("bootseer_deps_untrusted_total") or 0.0


def test_a_deps_record_no_trusted_writer_signed_is_a_miss(store: Store, keys: Keys) -> None:
    key, other = "1" * 64, "2" * 64
    trust = TrustPolicy.load((), [keys.writer_pub])
    store.writer.put(deps_object(key), _deps_record(key).encode())  # forged: unsigned
    assert deps_lookup(store.url, key) is not None  # no writer keys: the store is trusted as it is
    before = untrusted_deps()
    assert deps_lookup(store.url, key, trust=trust) is None
    assert untrusted_deps() - before == 1

    store.writer.put(deps_object(key), _deps_record(key).sign(keys.attacker).encode())
    assert deps_lookup(store.url, key, trust=trust) is None

    signed = _deps_record(key).sign(keys.writer)
    store.writer.put(deps_object(key), signed.encode())
    found = deps_lookup(store.url, key, trust=trust)
    assert found is not None and found.chain_id == signed.chain_id

    # The node's signature moved to another key's record: refused.
    moved = dataclasses.replace(_deps_record(other), signatures=signed.signatures)
    store.writer.put(deps_object(other), moved.encode())
    assert deps_lookup(store.url, other, trust=trust) is None


@root_only
@pytest.mark.timeout(300)
def test_deps_run_signs_its_capture_and_a_trusting_node_restores_only_a_signed_record(
    tmp_path: Path, keys: Keys, layer_server_reaper: Any
) -> None:
    """Bare metal, real layer servers: node 1 captures and signs; node 2, trusting only that node
    key (and only the converter's for image layers), restores it (the deps layer is served on the
    record's word); with the signature stripped, node 3 installs instead."""
    layer_server_reaper(tmp_path)
    prefix = tmp_path / "env"
    install = ["sh", "-c", f"mkdir -p {prefix}/lib && echo installed > {prefix}/lib/x"]

    def run(node: str, *options: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "bootseer.cli", "deps", "run", "--prefix", str(prefix), "--store", str(tmp_path / "store"),
                "--root", node, *options, "--", *install]  # fmt: skip
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)  # key paths relative to it

    trusting = ("--writer-key", "keys/node.pub", "--converter-key", "keys/converter.pub")
    try:
        first = run("n1", "--sign-key", "keys/node")
        assert "captured" in first.stderr, first.stderr
        (record_path,) = (tmp_path / "store" / "v1" / "deps").glob("*.json")
        record = json.loads(record_path.read_text())
        assert [s["key"] for s in record["signatures"]] == [keys.writer.public.id]

        prefix.rename(tmp_path / "installed")
        hit = run("n2", *trusting)
        assert "hit" in hit.stderr, hit.stderr
        assert (prefix / "lib" / "x").read_text() == "installed\n"
        subprocess.run([sys.executable, "-m", "bootseer.cli", "deps", "release", str(prefix), "--root", "n2"],
                       cwd=tmp_path, check=True, capture_output=True)  # fmt: skip

        del record["signatures"]  # what a store writer without the node key can publish
        record_path.write_text(json.dumps(record))
        miss = run("n3", *trusting)
        assert "hit" not in miss.stderr and "installed" in miss.stderr, miss.stderr
        assert "ignoring a deps record no trusted writer signed" in miss.stderr
        assert mount_entry(prefix) is None and (prefix / "lib" / "x").read_text() == "installed\n"
    finally:
        if mount_entry(prefix) is not None:
            force_unmount(prefix)


# -- converting, keys and configuration ------------------------------------------------------------------


def test_convert_with_a_sign_key_converts_again_a_layer_it_did_not_sign(tmp_path: Path, keys: Keys) -> None:
    image = build_oci_layout(tmp_path / "layout", [Layer((File("a", b"a\n"),))], compression="none")
    writer = FileStoreWriter(tmp_path / "store")
    with open_image(image.ref) as source:
        assert not convert_image(source, writer, block_size=BLOCK_SIZE).layers[0].skipped  # unsigned
    with open_image(image.ref) as source:
        result = convert_image(source, writer, block_size=BLOCK_SIZE, sign_key=keys.converter)
    # A signature vouches for what this converter made from the tar, never for an index it only found.
    assert not result.layers[0].skipped
    record = ChainRecord.decode(writer.get(chain_object(result.layers[0].chain_id)))
    assert TrustPolicy(converter_keys=(keys.converter.public,)).check("chain", record.signed, "x") == keys.converter.public
    with open_image(image.ref) as source:
        assert convert_image(source, writer, block_size=BLOCK_SIZE, sign_key=keys.converter).layers[0].skipped


def test_keys_generate_writes_a_private_key_0600_and_a_public_line_and_never_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "conv"
    command = [sys.executable, "-m", "bootseer.cli", "keys", "generate", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    words = Path(f"{out}.pub").read_text().split()
    assert words[0] == "bootseer-ed25519" and words[2] == "conv"
    shown = subprocess.run([sys.executable, "-m", "bootseer.cli", "keys", "show", f"{out}.pub"], capture_output=True, text=True)
    assert shown.stdout.split()[1] in done.stdout  # the id
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "never overwritten" in again.stderr


def test_trust_keys_reach_the_layer_server_as_paths_and_a_bad_key_is_refused_naming_it(tmp_path: Path, keys: Keys) -> None:
    settings = config.resolve(
        {"store.url": "file:///s", "trust.converter_keys": [str(keys.converter_pub)], "trust.writer_keys": [str(keys.writer_pub)],
         "trust.sign_key": str(tmp_path / "keys" / "node")}, {},
    )  # fmt: skip
    assert settings.trust.converter_keys == (keys.converter.public,)
    document = ServerSettings(converter_keys=tuple(map(str, settings.converter_keys)), sign_key=str(settings.sign_key)).document()
    assert document["converter-key"] == [str(keys.converter_pub)]
    assert document["sign-key"] == str(tmp_path / "keys" / "node")  # a path: the key itself is in no setting
    private = (tmp_path / "keys" / "node").read_text()
    assert private.splitlines()[1] not in json.dumps(document)
    with pytest.raises(config.ConfigError, match="trust.converter_keys.*not a public key"):
        config.resolve({"trust.converter_keys": [str(tmp_path / "keys" / "node")]}, {})  # a private key given as public
