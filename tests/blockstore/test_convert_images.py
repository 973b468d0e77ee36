"""``bootseer convert`` publishes each layer's EROFS image: named by the chain record, covered by its
signature, small files inside, added to older conversions without uploading a layer block again.

What the image holds (the same tree as the index and as ``tar -x``, fsck.erofs, a real mount) is
tested in tests/blockstore/test_erofs.py over both image sources; what a node does with it, in
tests/blockstore/test_layer_images.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from bootseer.blockstore.convert.converter import convert_image, verify_layer
from bootseer.blockstore.objects.block_table import LayerBlockTable
from bootseer.blockstore.convert.layer_image import inline_candidates
from bootseer.blockstore.objects.erofs_image import build_image
from bootseer.blockstore.objects.format import (
    ChainRecord, EntryType, FormatError, LayerImage, LayerIndex, block_table_object, chain_object, image_object,
    image_size_bound, index_object,
)  # fmt: skip
from bootseer.blockstore.objects.signing import generate_key
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.images.registry import open_image
from tests.support.layer_store import stored_image
from tests.support.oci import build_oci_layout, chain_ids, rich_layers
from tests.support.trees import read_block

BLOCK = 64 << 10


class RecordingStore(FileStoreWriter):
    """A file store that records the name of every object put."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.put_names: list[str] = []

    def _put(self, name: str, data: bytes | Path) -> None:
        self.put_names.append(name)
        super()._put(name, data)


def convert(ref: str, store: Path, **kwargs):
    writer = RecordingStore(store)
    with open_image(ref) as image:
        return convert_image(image, writer, block_size=BLOCK, **kwargs), writer


def records(store: Path, image) -> list[ChainRecord]:
    writer = FileStoreWriter(store)
    found = [verify_layer(writer, chain) for chain in chain_ids(image.diff_ids)]
    assert all(found)
    return found  # type: ignore[return-value]


def index_of(store: Path, record: ChainRecord) -> LayerIndex:
    return LayerIndex.decode(FileStoreWriter(store).get(index_object(record.index)), record=record)


@pytest.fixture(scope="module")
def rich_image(tmp_path_factory):
    return build_oci_layout(tmp_path_factory.mktemp("rich") / "layout", rich_layers(BLOCK), compression="none")


def test_every_layer_gets_the_image_of_its_index_with_its_small_files_inside(rich_image, tmp_path):
    store = tmp_path / "store"
    result, _ = convert(rich_image.ref, store)
    for layer, record in zip(result.layers, records(store, rich_image)):
        assert record.image and layer.image is not None
        table, image = stored_image(store, record)
        index = index_of(store, record)
        assert (table.index, table.diff_id, table.inline_max, table.size) == (record.index, record.diff_id, 4096, len(image))
        # Exactly the writer's image of the index with the small files' bytes, read from their blocks.
        inline = {n: read_block(store, index, b.blocks[0]) if not index.blocks[b.blocks[0]].is_zero else bytes(b.size)
                  for n, b in ((n, index.entries[n]) for n in inline_candidates(index, 4096))}  # fmt: skip
        assert image == build_image(index, inline=inline)
        small = [e for e in index.entries if e.type is EntryType.FILE and e.link is None and 0 < e.size <= 4096]
        assert len(inline) == len(small) == layer.image.inline_files > 0
        assert layer.image.inline_bytes == sum(e.size for e in small)
        assert image != build_image(index)  # the data is in it


def test_the_chain_records_signature_covers_the_image(rich_image, tmp_path):
    key = generate_key(tmp_path / "converter")
    store = tmp_path / "store"
    convert(rich_image.ref, store, sign_key=key)
    record = records(store, rich_image)[0]
    assert record.signature_check().signer([key.public]) is not None
    other = LayerImage.decode(FileStoreWriter(store).get(image_object(record.image)), record=record)
    forged_table = other.encode()[:-1] + b"\0"  # any other table has another name
    forged = ChainRecord.decode(record.encode().replace(record.image.encode(), hashlib.sha256(forged_table).hexdigest().encode()))
    assert forged.image != record.image and forged.signature_check().signer([key.public]) is None
    with pytest.raises(FormatError, match="does not match its digest"):
        LayerImage.decode(forged_table, record=record)


def test_every_layer_gets_its_block_table_named_and_signed_by_its_record(rich_image, tmp_path):
    key = generate_key(tmp_path / "converter")
    store = tmp_path / "store"
    convert(rich_image.ref, store, sign_key=key)
    for record in records(store, rich_image):
        index = index_of(store, record)
        data = FileStoreWriter(store).get(block_table_object(record.block_table))
        assert hashlib.sha256(data).hexdigest() == record.block_table
        table = LayerBlockTable.decode(data, record=record)
        assert (list(table.blocks), table.packs, table.block_size) == (index.blocks, index.packs, index.block_size)
        assert (table.entry_count, table.file_bytes, table.small_files) == (len(index.entries), index.file_bytes, index.small_files)
        assert table.small_files > 0
        assert record.signature_check().signer([key.public]) is not None
        other = hashlib.sha256(data + b"\0").hexdigest()  # any other table has another name
        forged = ChainRecord.decode(record.encode().replace(record.block_table.encode(), other.encode()))
        assert forged.block_table == other and forged.signature_check().signer([key.public]) is None


def test_a_layer_whose_block_table_is_missing_is_converted_again_and_no_image_means_no_table(rich_image, tmp_path):
    store = tmp_path / "store"
    convert(rich_image.ref, store)
    record = records(store, rich_image)[0]
    (store / block_table_object(record.block_table)).unlink()
    assert verify_layer(FileStoreWriter(store), record.chain_id) is None
    again, writer = convert(rich_image.ref, store)
    assert not again.layers[0].skipped and block_table_object(record.block_table) in writer.put_names
    none = tmp_path / "none"
    convert(rich_image.ref, none, inline_max=None)
    assert all(not r.block_table and not r.image for r in records(none, rich_image))
    assert not (none / "v1" / "blocktables").exists()


def test_a_rerun_gives_an_image_from_before_block_tables_its_table_uploading_nothing_else(rich_image, tmp_path):
    store = tmp_path / "store"
    convert(rich_image.ref, store)
    writer = FileStoreWriter(store)
    for record in records(store, rich_image):  # as a conversion before block tables left it
        old = dataclasses.replace(record, block_table="", signatures=(), signed=None)
        writer.put(chain_object(record.chain_id), old.encode())
        (store / block_table_object(record.block_table)).unlink()
    again, writer = convert(rich_image.ref, store)
    assert all(layer.skipped and layer.image is None for layer in again.layers)
    assert {name.split("/")[1] for name in writer.put_names} == {"blocktables", "chains"}
    assert all(record.block_table for record in records(store, rich_image))


def test_a_rerun_adds_images_to_an_older_conversion_uploading_no_layer_block_then_nothing(rich_image, tmp_path):
    store = tmp_path / "store"
    older, writer = convert(rich_image.ref, store, inline_max=None)
    assert all(not record.image for record in records(store, rich_image))
    layer_objects = {name for name in writer.put_names if not name.startswith('v1/chains/')}
    again, writer = convert(rich_image.ref, store)
    assert [layer.skipped for layer in again.layers] == [True] * len(again.layers)
    assert all(layer.image is not None for layer in again.layers)
    assert not layer_objects & set(writer.put_names)  # no pack, index or segment of the layers put again (records are)
    assert {name.split("/")[1] for name in writer.put_names} == {"packs", "dedup", "images", "blocktables", "chains"}
    assert "given their EROFS image" in again.summary()
    assert all(record.image and record.block_table for record in records(store, rich_image))
    third, writer = convert(rich_image.ref, store)
    assert writer.put_names == [] and all(layer.image is None for layer in third.layers)


def test_an_image_that_does_not_verify_is_published_again(rich_image, tmp_path):
    store = tmp_path / "store"
    convert(rich_image.ref, store)
    record = records(store, rich_image)[0]
    (store / image_object(record.image)).unlink()
    again, writer = convert(rich_image.ref, store)
    assert again.layers[0].image is not None and image_object(record.image) in writer.put_names
    assert records(store, rich_image)[0].image == record.image  # the same bytes, the same name


def test_a_signed_older_conversion_is_left_as_it_is_without_a_key_and_signed_again_with_it(rich_image, tmp_path):
    key = generate_key(tmp_path / "converter")
    store = tmp_path / "store"
    convert(rich_image.ref, store, sign_key=key, inline_max=None)
    before = [(store / chain_object(chain)).read_bytes() for chain in chain_ids(rich_image.diff_ids)]
    unsigned, writer = convert(rich_image.ref, store)
    assert writer.put_names == [] and all("its record is signed and no signing key was given" in layer.image_note
                                          for layer in unsigned.layers)  # fmt: skip
    assert [(store / chain_object(chain)).read_bytes() for chain in chain_ids(rich_image.diff_ids)] == before
    signed, writer = convert(rich_image.ref, store, sign_key=key)
    assert all(layer.skipped and layer.image is not None for layer in signed.layers)
    for record in records(store, rich_image):
        assert record.image and record.signature_check().signer([key.public]) is not None


def test_the_cli_takes_the_inline_bound_and_can_publish_no_image(rich_image, tmp_path):
    def run(store: Path, *args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "bootseer.cli", "convert", rich_image.ref, "--store", str(store), "--block-size", "64K", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300)

    none = run(tmp_path / "none", "--no-image")
    assert none.returncode == 0 and all(not r.image for r in records(tmp_path / "none", rich_image))
    zero = run(tmp_path / "zero", "--inline-max", "0")
    assert zero.returncode == 0 and "EROFS image" in zero.stderr and "(0 small files inline)" in zero.stderr
    table, image = stored_image(tmp_path / "zero", records(tmp_path / "zero", rich_image)[0])
    assert table.inline_max == 0 and image == build_image(index_of(tmp_path / "zero", records(tmp_path / "zero", rich_image)[0]))
    bad = run(tmp_path / "bad", "--inline-max", "128M")
    assert bad.returncode == 2 and "--inline-max" in bad.stderr


def test_an_image_table_claiming_more_than_its_layer_can_hold_is_refused_before_a_block_is_fetched(rich_image, tmp_path):
    """A table is held to what its record's layer can take (image_size_bound), as an index is to index_limits."""
    store = tmp_path / "store"
    convert(rich_image.ref, store)
    record = records(store, rich_image)[0]
    table = LayerImage.decode(FileStoreWriter(store).get(image_object(record.image)), record=record)
    bound = image_size_bound(record)
    assert table.size <= bound < 1 << 30  # the real image fits, and the bound is the record's, not the format's
    size = -(-(bound + 1) // 4096) * 4096
    count = -(-size // table.block_size)
    piece = table.blocks[0]
    blocks = [dataclasses.replace(piece, rlen=min(table.block_size, size - n * table.block_size)) for n in range(count)]
    data = dataclasses.replace(table, size=size, blocks=blocks).encode()
    claimed = dataclasses.replace(record, image=hashlib.sha256(data).hexdigest())
    with pytest.raises(FormatError, match=f"up to {bound} .what a layer of {record.files} entries can take"):
        LayerImage.decode(data, record=claimed)
