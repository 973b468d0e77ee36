"""The layer server's table (``blockstore/server/layer_table.py``): rows and table.json change together."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from bootseer.blockstore.objects.format import ChainRecord

from bootseer.images.chains import chain_id
from bootseer.blockstore.server.layer_table import Layer, LayerTable, load_table


def _layer(n: int, slot: int) -> Layer:
    diff_id = "sha256:" + f"{n:x}" * 64
    record = ChainRecord(chain_id("", diff_id), "", diff_id, "sha256:" + "e" * 64,
                         "application/vnd.oci.image.layer.v1.tar+gzip", 10, "a" * 64, 4096)  # fmt: skip
    return Layer(record.chain_id, slot, "file:///srv/store", record)


def test_rows_are_saved_as_they_change_and_read_back_in_their_slots(tmp_path: Path) -> None:
    table = LayerTable(tmp_path / "table.json")
    first, second = _layer(1, 1), _layer(2, 2)

    async def main() -> None:
        async with table.lock:
            assert await table.add(first) is True
            assert await table.add(second) is True
            assert await table.add(first) is False  # the same ChainID again: replaced, not new
            assert table.free_slot(lambda slot: slot == 3) == 4  # 1 and 2 taken, 3 still referenced by the kernel
            assert await table.remove(first.chain_id) is first
            assert await table.remove(first.chain_id) is None

    trio.run(main)
    assert [layer.chain_id for layer in table.by_slot()] == [second.chain_id] and len(table) == 1
    assert [(layer.chain_id, layer.slot) for layer in load_table(table.path, ["file:///srv/store"])] == [(second.chain_id, 2)]


def test_a_change_the_file_cannot_take_is_undone(tmp_path: Path) -> None:
    table = LayerTable(tmp_path / "table.json")
    kept, refused = _layer(1, 1), _layer(2, 2)

    async def main() -> None:
        async with table.lock:
            await table.add(kept)
            table.path.unlink()
            table.path.mkdir()  # the rename onto it fails (EISDIR) whoever runs this
            with pytest.raises(OSError):
                await table.add(refused)
            with pytest.raises(OSError):
                await table.remove(kept.chain_id)
            assert list(table) == [kept.chain_id]  # the refused row is out, the kept one still in
            assert os.listdir(tmp_path) == ["table.json"]  # and no temp file is left beside it
            table.path.rmdir()
            await table.save()

    trio.run(main)
    assert [row["chain_id"] for row in json.loads(table.path.read_text())["layers"]] == [kept.chain_id]
