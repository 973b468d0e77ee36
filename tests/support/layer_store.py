"""Converted layers in a ``file://`` store for the layer server's tests.

:func:`build_store` writes :class:`~tests.support.layers.Layer` specs as an OCI layout
(:func:`tests.support.oci.build_oci_layout`, uncompressed blobs) and converts it with
the real converter (:func:`blockstore.convert.converter.convert_image`) into a store directory,
then reads back what the server will read: each layer's chain record and index.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from bootseer.blockstore.convert.converter import convert_image, verify_layer
from bootseer.blockstore.objects.format import ChainRecord, LayerImage, LayerIndex, image_object, index_object
from bootseer.blockstore.objects.signing import SigningKey
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.images.registry import open_image
from tests.support.layers import Layer
from tests.support.oci import build_oci_layout
from tests.support.trees import read_block


@dataclass
class BuiltLayer:
    chain_id: str
    blob: Path  #: the layer tar (uncompressed), for ``tar -x``
    index: LayerIndex
    record: ChainRecord


def build_store(
    store: Path, layers: list[Layer], *, block_size: int, layout: Path, sign_key: SigningKey | None = None,
    inline_max: int | None = 4096,
) -> list[BuiltLayer]:
    """Convert ``layers`` (bottom first) into the store directory ``store`` through an OCI layout at ``layout``
    (the chain records signed by ``sign_key``, a converter key, if given; ``inline_max`` None: without EROFS
    images, as conversions made before them)."""
    image = build_oci_layout(layout, layers, compression="none")
    writer = FileStoreWriter(store)
    with open_image(image.ref) as source:
        result = convert_image(source, writer, block_size=block_size, sign_key=sign_key, inline_max=inline_max)
    built = []
    for number, layer in enumerate(result.layers):
        record = verify_layer(writer, layer.chain_id)
        assert record is not None, f"{layer.chain_id} was not converted"
        data = writer.get(index_object(record.index))
        assert data is not None
        blob = image.blob_path(image.layer_digests[number])
        built.append(BuiltLayer(layer.chain_id, blob, LayerIndex.decode(data, expected_sha256=record.index), record))
    return built


def stored_image(store: Path, record: ChainRecord) -> tuple[LayerImage, bytes]:
    """The table and bytes of the converter's EROFS image of ``record``'s layer in store directory ``store``:
    every block checked (:func:`~tests.support.trees.read_block`), the whole against its SHA-256."""
    data = FileStoreWriter(store).get(image_object(record.image))
    assert data is not None, f"{record.chain_id} has no image {record.image!r}"
    table = LayerImage.decode(data, record=record)
    image = b"".join(read_block(store, table, number) for number in range(len(table.blocks)))  # type: ignore[arg-type]
    assert hashlib.sha256(image).hexdigest() == table.sha256 and len(image) == table.size
    return table, image
