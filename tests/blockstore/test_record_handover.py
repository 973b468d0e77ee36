"""A layer's chain record is read from the store once per Prepare: the snapshotter's look-up reads it, and the
layer's mount hands those bytes to the layer server, which decodes and trust-checks them as its own read.

A real ``bootseer layer-server`` (tests/blockstore/test_layer_server.py's ``Node``) and the snapshotter's
real :class:`~bootseer.snapshotter.layer_backend.LayerServerBackend` over a ``file://`` store: the record
is taken out of the store between the look-up and the mount, so a server that read it again could not
mount the layer.  What a caller hands over is hostile to the server as the store's bytes are.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.objects.format import chain_object
from bootseer.blockstore.objects.signing import generate_key
from bootseer.blockstore.server.client import LayerCorrupt, LayerUntrusted, ServerSettings
from bootseer.fetch.engine import EngineConfig
from bootseer.snapshotter.errors import LayerUnavailable
from bootseer.snapshotter.layer_backend import LayerServerBackend
from tests.blockstore.test_layer_server import BLOCK_SIZE, node_factory  # noqa: F401 (fixtures)
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]


def _layers(tmp_path: Path, **kwargs: Any) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path / "store"
    layers = [Layer((File("a.txt", b"bottom\n"),)), Layer((File("b.txt", b"top\n"),))]
    return store, build_store(store, layers, block_size=BLOCK_SIZE, layout=tmp_path / "layout", **kwargs)


def test_a_mount_takes_the_record_its_look_up_read_and_the_store_is_not_asked_again(tmp_path: Path, node_factory: Any) -> None:
    store, (bottom, top) = _layers(tmp_path)
    url = f"file://{store}"
    node = node_factory(url)
    node.ensure()
    backend = LayerServerBackend(node.root, url, ServerSettings(store=url), EngineConfig(retry_timeout=2))
    assert backend.lookup(bottom.chain_id) is not None
    (store / chain_object(bottom.chain_id)).unlink()  # a server that read the record again would find none
    assert (Path(backend.mount(bottom.chain_id)) / "a.txt").read_bytes() == b"bottom\n"
    # A mount with no look-up before it (a restore, a retry) reads the record itself, as before.
    backend.unmount(bottom.chain_id)
    with pytest.raises(LayerUnavailable) as raised:
        backend.mount(bottom.chain_id)
    assert raised.value.reason == "not_converted"
    assert (Path(backend.mount(top.chain_id)) / "b.txt").read_bytes() == b"top\n"


def test_a_handed_over_record_is_checked_as_the_stores_would_be(tmp_path: Path, node_factory: Any) -> None:
    key = generate_key(tmp_path / "converter")
    store, (bottom, top) = _layers(tmp_path, sign_key=key)
    node = node_factory(f"file://{store}", converter_keys=(str(tmp_path / "converter.pub"),))
    client = node.ensure()
    # Another layer's record (genuine, signed) handed over for this ChainID: refused, not mounted.
    with pytest.raises(LayerCorrupt, match="stored under"):
        client.mount(bottom.chain_id, record=top.record.encode())
    # The genuine record without its signature: this node takes only what its converter keys signed.
    unsigned = dataclasses.replace(bottom.record, signatures=(), signed=None)
    with pytest.raises(LayerUntrusted):
        client.mount(bottom.chain_id, record=unsigned.encode())
    assert client.status()["layers"] == []
    with pytest.raises(LayerCorrupt, match="malformed|not a JSON object"):
        client.mount(bottom.chain_id, record=b"[1, 2]")
    mounted = client.mount(bottom.chain_id, record=(store / chain_object(bottom.chain_id)).read_bytes())
    assert (Path(mounted.lower_dir) / "a.txt").read_bytes() == b"bottom\n"
