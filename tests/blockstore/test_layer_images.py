"""A node mounts the converter's EROFS image of a layer and builds nothing; a hostile image never reaches the kernel.

Each test starts a real ``bootseer layer-server`` on the ``erofs`` data path (as the snapshotter
does: tests/blockstore/test_layer_server.py's ``Node``) over layers converted by the real
converter, and checks what the kernel and the server show: the files through the lower dir,
the images the node keeps, the server's log lines and ``bootseer_layer_images`` metric, and
the kernel log (a refused image must leave no EROFS error in it).  Hostile images are written
into the store as a writer with no converter key can (:func:`tests.support.forgery.replace_image`):
every digest consistent, only the image's bytes wrong.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.objects.erofs_image import build_image
from bootseer.blockstore.objects.format import Block, EntryType
from bootseer.blockstore.objects.signing import generate_key
from bootseer.blockstore.datapath.erofs_check import ImageRefused
from bootseer.blockstore.datapath.image_checker import CheckerProcess, ImageCheck
from bootseer.blockstore.server.client import LayerCorrupt, LayerUntrusted
from tests.blockstore.test_layer_server import BLOCK_SIZE, built, extracted, node_factory, rich_big_bin  # noqa: F401 (fixtures)
from tests.support.forgery import replace_image
from tests.support.layer_store import BuiltLayer, build_store, stored_image
from tests.support.oci import rich_layers
from tests.support.trees import as_whiteouts, disk_tree
from tests.support.waiting import free_port

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

XATTR_PREFIXES = ("user.", "trusted.", "security.")


def _store(tmp_path: Path, **kwargs: Any) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path / "store"
    return store, build_store(store, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE, layout=tmp_path / "layout", **kwargs)


@pytest.fixture
def converted(tmp_path: Path) -> tuple[Path, list[BuiltLayer]]:
    """The test layers converted with their EROFS images (each test may damage its own store)."""
    return _store(tmp_path)


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def images_counted(text: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r'bootseer_layer_images_total\{source="(\w+)"\} ([0-9.]+)', text)}


def fuse_reads(text: str) -> float:
    found = re.search(r'bootseer_fuse_requests_total\{fs="bootseer-layers",op="read"\} ([0-9.]+)', text)
    return float(found.group(1)) if found else 0.0


def kernel_log() -> list[str]:
    done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    return done.stdout.splitlines()


def erofs_errors(before: list[str]) -> list[str]:
    """EROFS lines the kernel logged since ``before`` other than its mount notices."""
    new = kernel_log()[len(before) :]
    return [line for line in new if "erofs" in line.lower() and "mounted with root inode" not in line]


def test_a_node_mounts_the_converters_image_builds_nothing_and_reads_small_files_without_the_blob(
    converted: Any, extracted: list[Path], node_factory: Any
) -> None:
    store, layers = converted
    port = free_port()
    node = node_factory(f"file://{store}", data_path="erofs", metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    lower = Path(client.mount(layers[0].chain_id).lower_dir)
    kept = sorted(os.listdir(node.paths.erofs_images))
    assert kept == [f"{layers[0].record.image}.erofs-store"]  # the store's image, no image built from the index
    assert (node.paths.erofs_images / kept[0]).read_bytes() == stored_image(store, layers[0].record)[1]
    assert images_counted(metrics(port))["store"] == 1 and images_counted(metrics(port))["built"] == 0
    assert "fetched the layer's EROFS image" in node.log() and "building it from its index" not in node.log()
    # Every small file reads right with no read of the blob; a large one reads through it.
    reads = fuse_reads(metrics(port))
    small = [e for e in layers[0].index.entries if e.type is EntryType.FILE and e.link is None and 0 < e.size <= 4096]
    assert len(small) >= 5
    for entry in small:
        assert (lower / entry.path).read_bytes() == (extracted[0] / entry.path).read_bytes(), entry.path
    assert fuse_reads(metrics(port)) == reads
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin() and fuse_reads(metrics(port)) > reads
    tree = disk_tree(lower, overlay=False, xattr_prefixes=XATTR_PREFIXES)
    assert as_whiteouts(tree) == as_whiteouts(disk_tree(extracted[0], overlay=True, xattr_prefixes=XATTR_PREFIXES))
    # A restart mounts the kept image again; an unmount removes it.
    node.stop()
    client = node.ensure()
    assert (Path(client.check(layers[0].chain_id).lower_dir) / "srv/big.bin").read_bytes() == rich_big_bin()
    assert images_counted(metrics(port))["cached"] == 1
    client.unmount(layers[0].chain_id)
    assert os.listdir(node.paths.erofs_images) == []


def test_an_older_conversion_is_built_from_its_index_with_a_log_line_and_the_metric(
    tmp_path: Path, extracted: list[Path], node_factory: Any
) -> None:
    store, layers = _store(tmp_path, inline_max=None)
    assert not layers[0].record.image
    port = free_port()
    node = node_factory(f"file://{store}", data_path="erofs", metrics_address=f"127.0.0.1:{port}")
    lower = Path(node.ensure().mount(layers[0].chain_id).lower_dir)
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin()
    assert len(re.findall(r"layer has no converter-built EROFS image.*" + layers[0].chain_id, node.log())) == 1
    assert images_counted(metrics(port))["built"] == 1 and images_counted(metrics(port))["store"] == 0
    assert os.listdir(node.paths.erofs_images) == [f"{layers[0].record.index}.erofs-v1"]


# -- hostile images ----------------------------------------------------------------------------------------


def _root_dirents(image: bytes) -> list[tuple[int, bytes]]:
    """(byte offset of the dirent, name) of the root directory of a writer's image (its data inline)."""
    root = 1280  # nid 40: the writer's first inode
    i_format, icount = struct.unpack_from("<HH", image, root)
    assert (i_format >> 1) & 7 == 2 and icount == 0, "the test layers' root is a FLAT_INLINE directory without xattrs"
    start = root + 64
    count = struct.unpack_from("<H", image, start + 8)[0] // 12
    offsets = [struct.unpack_from("<H", image, start + 12 * n + 8)[0] for n in range(count)] + [None]
    size = struct.unpack_from("<Q", image, root + 8)[0]
    names = []
    for n in range(count):
        end = offsets[n + 1] if offsets[n + 1] is not None else size
        names.append((start + 12 * n, image[start + offsets[n] : start + end]))
    return names


def _patched(image: bytes, offset: int, data: bytes) -> bytes:
    return image[:offset] + data + image[offset + len(data) :]


def _dirent(image: bytes, name: bytes) -> int:
    return next(offset for offset, found in _root_dirents(image) if found == name)


def _name_at(image: bytes, name: bytes) -> int:
    dirent = _dirent(image, name)
    return 1280 + 64 + struct.unpack_from("<H", image, dirent + 8)[0]


def _chunk_past_the_blob(layer: BuiltLayer) -> bytes:
    """The layer's own tree whose big file's last chunk is a block past the blob (an image of a longer blob)."""
    index = layer.index
    extra = Block("0" * 64, 0, 0, 1, index.block_size)
    number = next(n for n, e in enumerate(index.entries) if e.path == "srv/big.bin")
    entries = list(index.entries)
    entries[number] = dataclasses.replace(entries[number], blocks=entries[number].blocks[:-1] + (len(index.blocks),))
    return build_image(dataclasses.replace(index, entries=entries, blocks=index.blocks + [extra]))


MALFORMED = {
    "truncated": lambda image, layer: image[: len(image) // 2],
    "inode out of range": lambda image, layer: _patched(image, _dirent(image, b"etc"), struct.pack("<Q", 0xFFFFFFF0)),
    "directory loop": lambda image, layer: _patched(image, _dirent(image, b"etc"), struct.pack("<Q", 40)),
    "name with a slash": lambda image, layer: _patched(image, _name_at(image, b"etc") + 1, b"/"),
    "chunk past the blob": lambda image, layer: _chunk_past_the_blob(layer),
    "zeroed inodes": lambda image, layer: _patched(image, 1280, bytes(4096 - 1280)),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_image_is_refused_before_the_kernel_sees_it(kind: str, converted: Any, node_factory: Any) -> None:
    store, layers = converted
    image = stored_image(store, layers[0].record)[1]
    bad = MALFORMED[kind](image, layers[0])
    assert bad != image
    replace_image(store, layers[0].chain_id, bad)
    port = free_port()
    node = node_factory(f"file://{store}", data_path="erofs", metrics_address=f"127.0.0.1:{port}")
    client = node.ensure()
    before = kernel_log()
    with pytest.raises(LayerCorrupt, match="EROFS image .* is refused: the image fails its check"):
        client.mount(layers[0].chain_id)
    assert "the store's EROFS image of the layer is refused" in node.log()
    assert images_counted(metrics(port))["refused"] == 1 and os.listdir(node.paths.erofs_images) == []
    assert erofs_errors(before) == []
    assert client.status()["layers"] == []  # nothing half-mounted: the snapshotter downloads the layer


def test_a_forged_image_whose_bytes_are_not_its_digest_is_refused(converted: Any, node_factory: Any) -> None:
    store, layers = converted
    image = stored_image(store, layers[0].record)[1]
    replace_image(store, layers[0].chain_id, image[:-1] + b"\1", sha256=stored_image(store, layers[0].record)[0].sha256)
    node = node_factory(f"file://{store}", data_path="erofs")
    before = kernel_log()
    with pytest.raises(LayerCorrupt, match="do not hash to the sha256 its table names"):
        node.ensure().mount(layers[0].chain_id)
    assert erofs_errors(before) == [] and os.listdir(node.paths.erofs_images) == []


def test_with_converter_keys_only_a_signed_record_names_the_image_mounted(tmp_path: Path, node_factory: Any) -> None:
    key = generate_key(tmp_path / "converter")
    store, layers = _store(tmp_path, sign_key=key)
    node = node_factory(f"file://{store}", data_path="erofs", converter_keys=(str(tmp_path / "converter.pub"),))
    client = node.ensure()
    lower = Path(client.mount(layers[0].chain_id).lower_dir)
    assert (lower / "srv/big.bin").read_bytes() == rich_big_bin()
    assert re.search(r"fetched the layer's EROFS image.*checked=False", node.log())
    # The same image under a record no trusted key signed: refused before its image is fetched.
    replace_image(store, layers[1].chain_id, stored_image(store, layers[1].record)[1])
    with pytest.raises(LayerUntrusted, match="not signed by a trusted"):
        client.mount(layers[1].chain_id)


def test_an_image_checked_against_another_blob_size_than_the_indexs_is_refused(converted: Any, node_factory: Any) -> None:
    """The check runs while the index decodes, against the blob size the table states; the index must agree."""
    store, layers = converted
    image = _chunk_past_the_blob(layers[0])  # well formed for a blob one block longer than the layer's
    replace_image(store, layers[0].chain_id, image, blob_size=layers[0].index.blob_size + BLOCK_SIZE)
    node = node_factory(f"file://{store}", data_path="erofs")
    before = kernel_log()
    with pytest.raises(LayerCorrupt, match=r"it addresses a blob of \d+ bytes, the index's is \d+"):
        node.ensure().mount(layers[0].chain_id)
    assert erofs_errors(before) == [] and os.listdir(node.paths.erofs_images) == []


def test_a_check_past_its_deadline_refuses_the_image_and_the_next_check_gets_a_new_checker(
    converted: Any, tmp_path: Path
) -> None:
    store, layers = converted
    image = tmp_path / "image.erofs"
    image.write_bytes(stored_image(store, layers[0].record)[1])
    check = ImageCheck(layers[0].index.blob_size, BLOCK_SIZE, len(layers[0].index.entries))
    checker = CheckerProcess(deadline=30)
    try:
        checker.start()
        inodes = len(layers[0].index.entries) - sum(e.link is not None for e in layers[0].index.entries)
        assert checker.check(image, check).inodes == inodes
        checker.deadline = 0.000001
        with pytest.raises(ImageRefused, match="its check took longer than"):
            checker.check(image, check)
        checker.deadline = 30
        assert checker.check(image, check).inodes == inodes  # a fresh worker
        bad = tmp_path / "bad.erofs"
        bad.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
        with pytest.raises(ImageRefused):
            checker.check(bad, check)
    finally:
        checker.close()
