"""A kept EROFS image is verified again before it is mounted again (issue 35, case 5): one damaged on the node is refused, fetched again, and never served.

Each test starts a real ``bootseer layer-server`` (as the snapshotter does:
tests/blockstore/test_layer_server.py's ``Node``) over a layer converted by the real converter
(twice in one image: two ChainIDs sharing one index and one EROFS image), damages the image the
node keeps (``ROOT/layers/erofs/<image>.erofs-store``) as a disk or a careless operator could
(a flipped byte in a small file's inline data, the file cut to 4 KiB), and reads every file
through the kernel in a reader process.  What is checked is what the kernel reads, the kept
file, the server's log and its ``bootseer_layer_images`` metric (``kept_refused``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.fanotify import unsupported
from bootseer.blockstore.objects.format import image_object
from tests.blockstore.test_fanotify import read_all
from tests.blockstore.test_layer_images import images_counted, metrics
from tests.blockstore.test_layer_server import node_factory  # noqa: F401 (fixture)
from tests.support.layer_store import BuiltLayer, build_store, stored_image
from tests.support.layers import BigFile, File, Layer
from tests.support.waiting import free_port

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

BLOCK_SIZE = 64 << 10
#: The small file whose inline data (in the image, not the blob) a flipped byte damages.
TARGET = "small/s30.txt"

DATA_PATHS = [
    "erofs",
    pytest.param("fanotify", marks=pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None,
                                                      reason="no fanotify pre-content marks here")),  # fmt: skip
]


def _layer() -> Layer:
    """One large file (in the blob) and 40 small ones (their data inline in the image: about 84 KiB of it)."""
    small = [File(f"small/s{n}.txt", f"small file {n}\n".encode() * (n * 5 + 1)) for n in range(40)]
    return Layer((BigFile("data/big.bin", 1 << 20, seed=7), *small))


def _expected() -> dict[str, str]:
    return _layer().file_digests()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    """The layer twice, one on the other: two ChainIDs whose records name one index and one image."""
    store = tmp_path_factory.mktemp("store")
    layers = build_store(store, [_layer(), _layer()], block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("layout"))
    assert layers[0].record.image == layers[1].record.image != ""
    return store, layers


def kept_image(node: Any, layer: BuiltLayer) -> Path:
    return node.paths.erofs_images / f"{layer.record.image}.erofs-store"


def damage(image: Path, how: str) -> None:
    """``flipped``: one byte of :data:`TARGET`'s inline data changed in place; ``truncated``: the file cut to 4 KiB."""
    if how == "truncated":
        assert image.stat().st_size > 4096
        os.truncate(image, 4096)
        return
    data = image.read_bytes()
    at = data.find(f"small file {TARGET[7:-4]}\n".encode())
    assert at > 4096, "the small file's data is not inline in the image"
    with open(image, "r+b") as out:
        out.seek(at)
        out.write(b"S")  # "small" -> "Small": same size, one byte
    assert image.read_bytes() != data


@pytest.mark.parametrize("how", ["flipped", "truncated"])
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_kept_image_damaged_while_the_server_was_down_is_refused_and_fetched_again_at_the_restart(
    converted: Any, node_factory: Any, data_path: str, how: str
) -> None:
    store, layers = converted
    layer = layers[0]
    port = free_port()
    node = node_factory(f"file://{store}", data_path=data_path, metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    lower = client.mount(layer.chain_id).lower_dir
    expected = _expected()
    read = "small/s1.txt"  # inline, as TARGET is (not read yet); the blob keeps its holes
    assert read_all(lower, [read]) == {read: expected[read]}
    # SIGTERM: on fanotify the EROFS mount and the event holder (the blob has holes) stay for the next server.
    node.stop()
    image = kept_image(node, layer)
    damage(image, how)

    client = node.ensure()
    [row] = client.status()["layers"]
    assert row["served"] and row["error"] == "", row
    lower = client.check(layer.chain_id).lower_dir
    assert read_all(lower, sorted(expected)) == expected  # TARGET's inline data included
    assert image.read_bytes() == stored_image(store, layer.record)[1]  # fetched again from the store
    counted = images_counted(metrics(port))
    assert (counted["kept_refused"], counted["store"], counted["cached"]) == (1, 1, 0)
    assert "the EROFS image kept on this node is refused: removed, fetched again from the store" in node.log()
    # The image fetched again is kept as any fetched image: the next restart mounts it as it is.
    node.stop()
    client = node.ensure()
    assert read_all(client.check(layer.chain_id).lower_dir, [TARGET]) == {TARGET: expected[TARGET]}
    counted = images_counted(metrics(port))
    assert (counted["kept_refused"], counted["cached"]) == (0, 1)


def test_a_later_mount_that_finds_the_image_kept_verifies_it_against_the_stores_table_not_an_edited_copy(
    converted: Any, node_factory: Any
) -> None:
    """The second ChainID's mount finds the image the first one's kept.  Damaged, with the local copy of its
    table rewritten to name the damaged bytes' SHA-256 (all an operator with the node's disk can do): the
    copy no longer hashes to the chain record's ``image``, so the kept image is refused and fetched again."""
    store, layers = converted
    port = free_port()
    node = node_factory(f"file://{store}", data_path="erofs", metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    client.mount(layers[0].chain_id)
    image = kept_image(node, layers[0])
    table_copy = node.paths.indexes / f"{layers[0].record.image}.image-table"
    damage(image, "flipped")
    table = stored_image(store, layers[0].record)[0]
    forged = dataclasses.replace(table, sha256=hashlib.sha256(image.read_bytes()).hexdigest())
    table_copy.write_bytes(forged.encode())

    lower = client.mount(layers[1].chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, sorted(expected)) == expected
    assert image.read_bytes() == stored_image(store, layers[1].record)[1]
    assert table_copy.read_bytes() == (store / image_object(layers[1].record.image)).read_bytes()
    counted = images_counted(metrics(port))
    assert (counted["kept_refused"], counted["store"], counted["cached"]) == (1, 2, 0)
    assert "its table's local copy is refused" in node.log()
    # The image and its table copy go with the last layer that uses them.
    client.unmount(layers[0].chain_id)
    assert image.exists() and table_copy.exists()
    client.unmount(layers[1].chain_id)
    assert os.listdir(node.paths.erofs_images) == [] and not table_copy.exists()
