"""A node serves a converter-built layer from its binary block table: the JSON index is never fetched.

Each test starts a real ``bootseer layer-server`` (tests/blockstore/test_layer_server.py's ``Node``) over
the test layers converted by the real converter, on the ``erofs`` and ``fanotify`` data paths, whose
lower dir is the converter's EROFS image: the layer's JSON index is removed from the store, so a node
that asked for it could not mount the layer.  An older store (records that name no block table) is
served from its JSON index as before, and a table that is not the record's is refused.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.fanotify import unsupported
from bootseer.blockstore.objects.format import EntryType, block_table_object, chain_object, index_object
from bootseer.blockstore.server.client import LayerCorrupt
from tests.blockstore.test_layer_server import built, extracted, node_factory, rich_big_bin  # noqa: F401 (fixtures)
from tests.support.layer_store import BuiltLayer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]


@pytest.fixture
def store(built: tuple[Path, list[BuiltLayer]], tmp_path: Path) -> tuple[Path, list[BuiltLayer]]:
    """A copy of the converted test layers' store, each test's own to take objects out of."""
    copy = tmp_path / "store"
    shutil.copytree(built[0], copy)
    return copy, built[1]


def _small_files(layer: BuiltLayer) -> list[str]:
    return [e.path for e in layer.index.entries if e.type is EntryType.FILE and e.link is None and 0 < e.size <= 4096]


@pytest.mark.parametrize("data_path", ["erofs", "fanotify"])
def test_a_converter_layer_is_served_from_its_block_table_and_its_json_index_is_never_fetched(
    data_path: str, store: Any, extracted: list[Path], node_factory: Any
) -> None:
    if data_path == "fanotify" and unsupported(Path("/var/tmp")) is not None:
        pytest.skip("no fanotify pre-content marks here")
    root, layers = store
    record = layers[0].record
    assert record.block_table and record.image
    (root / index_object(record.index)).unlink()  # a node that asks for the index cannot mount the layer
    node = node_factory(f"file://{root}", data_path=data_path)
    client = node.ensure()
    lower = Path(client.mount(layers[0].chain_id).lower_dir)
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin()
    for path in _small_files(layers[0]):
        assert (lower / path).read_bytes() == (extracted[0] / path).read_bytes(), path
    shown = {row["chain_id"]: row for row in client.status()["layers"]}[layers[0].chain_id]
    assert shown["entries"] == record.files == len(layers[0].index.entries)
    copies = os.listdir(node.paths.indexes)  # the node's copy is the table, for restarts (beside its image table's)
    assert record.block_table in copies and record.index not in copies
    # A restart puts the layer back from that copy, with the store's index still missing.
    node.stop()
    client = node.ensure()
    assert (Path(client.check(layers[0].chain_id).lower_dir) / "srv/big.bin").read_bytes() == rich_big_bin()
    client.unmount(layers[0].chain_id)
    assert record.block_table not in os.listdir(node.paths.indexes)


def test_an_older_store_whose_records_name_no_block_table_is_served_from_its_json_index(
    store: Any, extracted: list[Path], node_factory: Any
) -> None:
    root, layers = store
    record = layers[0].record
    older = dataclasses.replace(record, block_table="", signatures=(), signed=None)  # as converters before tables wrote it
    (root / chain_object(record.chain_id)).write_bytes(older.encode())
    (root / block_table_object(record.block_table)).unlink()
    node = node_factory(f"file://{root}", data_path="erofs")
    lower = Path(node.ensure().mount(layers[0].chain_id).lower_dir)
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin()
    for path in _small_files(layers[0]):
        assert (lower / path).read_bytes() == (extracted[0] / path).read_bytes(), path
    assert record.index in os.listdir(node.paths.indexes)


def test_a_block_table_that_is_not_the_records_is_refused_and_the_layer_not_mounted(store: Any, node_factory: Any) -> None:
    root, layers = store
    record = layers[0].record
    table = root / block_table_object(record.block_table)
    data = bytearray(table.read_bytes())
    data[-1] ^= 1
    table.write_bytes(bytes(data))
    node = node_factory(f"file://{root}", data_path="erofs")
    client = node.ensure()
    with pytest.raises(LayerCorrupt, match="block table of chain record .* does not match its digest"):
        client.mount(layers[0].chain_id)
    assert client.status()["layers"] == []


def test_a_hot_list_prefetch_on_erofs_warms_a_table_served_layers_files_through_its_index_asked_then(
    store: Any, node_factory: Any
) -> None:
    """The page-cache warming through an EROFS mount reads each hot block's range of the files that hold it: a block
    table lists no files, so the prefetch asks the server for the layer's index then (LayerHost.layer_index)."""
    from bootseer.hotlist.format import HotBlock, HotList, hotlist_object
    from bootseer.blockstore.objects.store import FileStoreWriter
    from tests.support.waiting import wait_until

    root, layers = store
    bottom = layers[0]
    big = next(e for e in bottom.index.entries if e.path == "srv/big.bin")
    hot = [bottom.index.blocks[ref] for ref in big.blocks[:2]]
    chain = [layer.chain_id for layer in layers]
    listed = HotList(chain[-1], "", chain, [HotBlock(bottom.chain_id, b.digest, bottom.index.packs[b.pack], b.offset,
                                                     b.clen, b.rlen, 0.1) for b in hot])  # fmt: skip
    FileStoreWriter(root).put(hotlist_object(chain[-1]), listed.encode())
    node = node_factory(f"file://{root}", data_path="erofs")
    client = node.ensure()
    for layer in layers:
        client.mount(layer.chain_id)
    assert bottom.record.block_table in os.listdir(node.paths.indexes)  # served from its table

    def warmed() -> int:
        running = client.call({"op": "hotlist.status"})["prefetches"]
        return sum(int(p["warmed_bytes"]) for p in running)

    wait_until("the prefetch warmed the hot blocks' file bytes", lambda: warmed() >= sum(b.rlen for b in hot))
    assert bottom.record.index in os.listdir(node.paths.indexes)  # the index, loaded for the files, kept as a copy
    assert "warms no page cache" not in node.log()
