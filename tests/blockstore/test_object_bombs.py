"""A small store object must not take a node down (issue 14, items 3 and 4).

A store writer controls every object a layer server decodes.  A 5.8 KB hot list
(64 MiB of one tiny row), a well-formed hot list of a million rows for an image of a
few dozen blocks, and a 3 KB layer index (32 MiB of one tiny entry) are each refused
with an error naming the bound, while the real ``bootseer layer-server`` process's
peak RSS (``VmHWM``) stays within :data:`RSS_GROWTH_BOUND` of what it was, and the
server keeps serving other layers.  A hot list is decoded in a worker thread: a FUSE
read of an unrelated layer completes while its decode is held inside the worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from bootseer.blockstore.server.client import LayerCorrupt, LayerServerClient, ServerSettings, ensure_server
from bootseer.blockstore.objects.format import ChainRecord, Entry, FormatError, LayerIndex, chain_object
from bootseer.blockstore.server.layer_server import LayerServerConfig, run_server
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.hotlist.format import HotList, HotListError, hotlist_object
from bootseer.hotlist.service import HotListConfig, HotListService
from tests.support import autojump
from tests.support.forgery import rewrite_index
from tests.support.bombs import hotlist_bomb, index_bomb, store_index_bomb, valid_hotlist
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import File, Layer
from tests.support.oci import blob_data, rich_layers

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

BLOCK_SIZE = 64 << 10
#: How much the layer server's peak RSS may grow while it refuses a bomb (it grew by 0.5-1.6 GiB).
RSS_GROWTH_BOUND = 48 << 20
UNRELATED_PATH = "data/unrelated.bin"
UNRELATED_BYTES = blob_data(2 * BLOCK_SIZE + 100)
LOG_WAIT_S = 120.0


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer], BuiltLayer]:
    """A store with a three-layer image and an unrelated one-layer image."""
    store = tmp_path_factory.mktemp("store")
    image = build_store(store, rich_layers(BLOCK_SIZE), block_size=BLOCK_SIZE, layout=tmp_path_factory.mktemp("image"))
    unrelated = build_store(store, [Layer((File(UNRELATED_PATH, UNRELATED_BYTES),))], block_size=BLOCK_SIZE,
                            layout=tmp_path_factory.mktemp("unrelated"))  # fmt: skip
    return store, image, unrelated[0]


@pytest.fixture
def store(built: tuple[Path, list[BuiltLayer], BuiltLayer], tmp_path: Path) -> Path:
    """This test's copy of the store (bombs are put in it)."""
    copy = tmp_path / "store"
    shutil.copytree(built[0], copy)
    return copy


@pytest.fixture
def server(store: Path, tmp_path: Path) -> Iterator[LayerServerClient]:
    """A real ``bootseer layer-server`` over ``store``, started as the snapshotter starts it."""
    root = tmp_path / "root"
    try:
        yield ensure_server(root, ServerSettings(store=f"file://{store}", retry_timeout=5))
    finally:
        stop_layer_servers(root)


def _memory_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _peak_rss(client: LayerServerClient) -> int:
    """The layer server process's peak resident set so far, in bytes (VmHWM)."""
    return _memory_kib(int(client.status()["pid"]), "VmHWM") << 10


def _wait_for_log(root: Path, text: str) -> str:
    """The server log's line containing ``text``, once it is there (the hot-list lookup is a background task)."""
    log = root / "layers" / "server.log"
    deadline = time.monotonic() + LOG_WAIT_S
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines() if log.exists() else ():
            if text in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in {log} after {LOG_WAIT_S}s")


def _read_unrelated(client: LayerServerClient, unrelated: BuiltLayer) -> bytes:
    return (Path(client.mount(unrelated.chain_id).lower_dir) / UNRELATED_PATH).read_bytes()


def _refuse_hot_list(client: LayerServerClient, store: Path, root: Path, built: Any, data: bytes) -> tuple[str, int]:
    """Serve the unrelated layer and the image with ``data`` as its hot list; the log line
    that ignored the list and how much the server's peak RSS grew meanwhile."""
    _store, image, unrelated = built
    top = image[-1].chain_id
    assert _read_unrelated(client, unrelated) == UNRELATED_BYTES
    for layer in image[:-1]:
        client.mount(layer.chain_id)
    FileStoreWriter(store).put(hotlist_object(top), data)
    before = _peak_rss(client)
    client.mount(top)  # the image's top: the server looks its hot list up and decodes it
    line = _wait_for_log(root, "hot list ignored")
    grown = _peak_rss(client) - before
    assert _read_unrelated(client, unrelated) == UNRELATED_BYTES  # still served
    return line, grown


def test_the_hot_list_bomb_is_refused_in_bounded_memory(server: LayerServerClient, store: Path, tmp_path: Path, built: Any) -> None:
    data = hotlist_bomb(built[1][-1].chain_id, [layer.chain_id for layer in built[1]])
    assert len(data) < 8 << 10  # about 5.8 KB stored, 64 MiB decompressed
    line, grown = _refuse_hot_list(server, store, tmp_path / "root", built, data)
    assert grown < RSS_GROWTH_BOUND, f"the layer server's peak RSS grew by {grown >> 20} MiB"
    assert "invalid" in line and "the blocks of the image's layers" in line, line


def test_a_valid_million_row_hot_list_for_a_small_image_is_refused_in_bounded_memory(
    server: LayerServerClient, store: Path, tmp_path: Path, built: Any
) -> None:
    image = built[1]
    data = valid_hotlist(image[-1].chain_id, [layer.chain_id for layer in image], 10**6)
    assert HotList.decode(data, expected_image=image[-1].chain_id).blocks[-1].at == pytest.approx(1.0 - 1e-6)  # well-formed
    line, grown = _refuse_hot_list(server, store, tmp_path / "root", built, data)
    assert grown < RSS_GROWTH_BOUND, f"the layer server's peak RSS grew by {grown >> 20} MiB"
    assert "invalid" in line and "the blocks of the image's layers" in line, line


def test_the_index_bomb_is_refused_in_bounded_memory(server: LayerServerClient, store: Path, built: Any) -> None:
    chain = store_index_bomb(FileStoreWriter(store), 32 << 20)
    record = ChainRecord.decode(FileStoreWriter(store).get(chain_object(chain)) or b"")
    assert (store / "v1" / "indexes" / record.index).stat().st_size < 4 << 10  # about 3 KB stored, 32 MiB decompressed
    assert _read_unrelated(server, built[2]) == UNRELATED_BYTES
    before = _peak_rss(server)
    with pytest.raises(LayerCorrupt) as refused:
        server.mount(chain)
    grown = _peak_rss(server) - before
    assert grown < RSS_GROWTH_BOUND, f"the layer server's peak RSS grew by {grown >> 20} MiB"
    assert re.search(r"larger than \d+ bytes uncompressed \(chain record .*: 3 files, 4096 bytes\)", str(refused.value)), refused.value
    assert _read_unrelated(server, built[2]) == UNRELATED_BYTES


def test_an_index_is_bounded_by_the_entries_its_record_names(built: Any) -> None:
    """More entries than the record's ``files`` are refused while parsing, whatever the payload's size."""
    layer = built[1][0]
    data = layer.index.encode()
    fewer = dataclasses.replace(layer.record, index=hashlib.sha256(data).hexdigest(), files=len(layer.index.entries) - 1)
    with pytest.raises(FormatError, match=rf"more than {len(layer.index.entries) - 1} entries \(chain record"):
        LayerIndex.decode(data, record=fewer)
    assert LayerIndex.decode(data, record=dataclasses.replace(fewer, files=len(layer.index.entries))) == layer.index
    bomb = index_bomb(layer.record.diff_id, 4 << 20)
    with pytest.raises(FormatError, match=r"(more than \d+ entries|larger than \d+ bytes uncompressed) \(chain record"):
        LayerIndex.decode(bomb, record=dataclasses.replace(layer.record, index=hashlib.sha256(bomb).hexdigest()))


def test_an_unrelated_layer_is_read_through_fuse_while_a_hot_list_decodes(
    store: Path, tmp_path: Path, built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot list's decode is held inside its worker thread until the test has read a file
    of another layer through the FUSE mount: on the FUSE loop's thread, that read could not
    be answered until the decode ended."""
    _store, image, unrelated = built
    real_decode = HotList.decode.__func__  # type: ignore[attr-defined]
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    on_the_loop: list[str] = []

    def held_decode(cls: type[HotList], data: bytes, **kwargs: Any) -> HotList:
        if threading.current_thread() is threading.main_thread():
            on_the_loop.append("decoded on the trio thread that serves FUSE")  # holding it here would hang the test
        else:
            started.set()
            release.wait()
        try:
            return real_decode(cls, data, **kwargs)
        finally:
            started.set()
            finished.set()

    monkeypatch.setattr(HotList, "decode", classmethod(held_decode))
    FileStoreWriter(store).put(hotlist_object(image[-1].chain_id), hotlist_bomb(image[-1].chain_id, [layer.chain_id for layer in image]))
    config = LayerServerConfig(root=tmp_path / "root", store=f"file://{store}")
    read: list[bytes] = []

    async def drive(server: Any) -> None:
        import trio

        try:
            mounted = await server.mount(unrelated.chain_id)
            for layer in image:
                await server.mount(layer.chain_id)  # the top's mount starts the hot-list lookup
            assert await trio.to_thread.run_sync(started.wait, LOG_WAIT_S)
            path = Path(mounted["lower_dir"]) / UNRELATED_PATH
            read.append(await trio.to_thread.run_sync(path.read_bytes))  # answered by the FUSE loop meanwhile
            release.set()
            assert await trio.to_thread.run_sync(finished.wait, LOG_WAIT_S)
        finally:
            release.set()
            server.session.terminate()

    async def main() -> None:
        await run_server(config, on_ready=drive, extension=lambda host: HotListService(host, HotListConfig()))

    try:
        autojump.run(main)
    finally:
        release.set()
        stop_layer_servers(tmp_path / "root")
    assert read == [UNRELATED_BYTES]
    assert on_the_loop == []


def test_a_hot_list_over_the_images_blocks_is_refused_while_it_is_parsed() -> None:
    layers = ["sha256:" + "1" * 64, "sha256:" + "2" * 64]
    data = valid_hotlist(layers[-1], layers, 1000)
    assert len(HotList.decode(data, max_blocks=1000).blocks) == 1000
    with pytest.raises(HotListError, match=r"more than 999 blocks|larger than \d+ bytes uncompressed \(999 rows"):
        HotList.decode(data, max_blocks=999)


def test_hotlist_show_bounds_a_list_by_the_images_chain_records(store: Path, built: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``bootseer hotlist show`` decodes what nodes decode, within the same bound: the blocks
    the image's chain records allow."""
    from bootseer.cli import main

    image = built[1]
    top = image[-1].chain_id
    FileStoreWriter(store).put(hotlist_object(top), valid_hotlist(top, [layer.chain_id for layer in image], 10_000))
    status = main(["hotlist", "show", top, "--store", str(store)])
    err = capsys.readouterr().err
    assert status != 0 and "the blocks of the image's layers" in err, err


def test_a_document_cut_into_pieces_anywhere_reads_as_json_loads_reads_it() -> None:
    """Numbers, strings and literals cut by a piece's end ("1.|5", "2e|+3", "tr|ue") are read whole."""
    import json

    from bootseer.blockstore.objects.jsonstream import ArrayRule, read_document

    document = {"rows": [[1.5, -2e3, 12345678901234567890, "a\u00e9\"b", True, None, {"k": [0.25]}]] * 5,
                "duration": 0.125, "n": -7, "s": "x" * 40}  # fmt: skip
    text = json.dumps(document, separators=(",", ":")).encode()
    for size in range(1, 48):
        pieces = iter([text[i : i + size] for i in range(0, len(text), size)])
        got = read_document(pieces, "doc", {"rows": ArrayRule(5, tuple)}, max_value_chars=1 << 10)
        assert got == {**document, "rows": [tuple(row) for row in document["rows"]]}, size
    with pytest.raises(ValueError, match="more than 4 rows"):
        read_document(iter([text]), "doc", {"rows": ArrayRule(4, tuple)}, max_value_chars=1 << 10)


def _with_entry(at: str, **changes: Any) -> Callable[[LayerIndex], LayerIndex]:
    """An index change: the entry at path ``at`` with ``changes`` (``xattrs`` are added to its own)."""

    def change(index: LayerIndex) -> LayerIndex:
        def changed(entry: Entry) -> Entry:
            extra = {"xattrs": {**entry.xattrs, **changes["xattrs"]}} if "xattrs" in changes else {}
            return dataclasses.replace(entry, **{**changes, **extra})

        assert any(e.path == at for e in index.entries), at
        return dataclasses.replace(index, entries=[changed(e) if e.path == at else e for e in index.entries])

    return change


#: Hand-written indexes the converter never writes, each with what the refusal says.
HOSTILE_INDEXES = {
    "name": (_with_entry("etc/empty", path="etc/\ud800"), "stands for no bytes"),
    "link target": (_with_entry("srv/rel", target="big\ud800.bin"), "link target: '\\ud800' at 3 stands for no bytes"),
    "xattr name": (_with_entry("srv", xattrs={"user.\ud800": b"1"}), "xattr name: '\\ud800' at 5 stands for no bytes"),
    "redirect": (_with_entry("srv", xattrs={"trusted.overlay.redirect": b"/etc"}), "overlayfs metadata"),
    "metacopy": (_with_entry("srv/xattr.bin", xattrs={"trusted.overlay.metacopy": b""}), "overlayfs metadata"),
}


def test_a_hand_written_index_the_converter_never_writes_is_corrupt_not_internal(
    server: LayerServerClient, store: Path, built: Any
) -> None:
    """A lone surrogate in a name, link target or xattr name (no bytes stand for it) and overlayfs
    metadata the converter drops: each mount is refused as ``corrupt`` (was: ``internal``, a
    UnicodeEncodeError, for the surrogates, and a served layer for the xattrs), and the server serves on."""
    layer = built[1][0]
    genuine = store / chain_object(layer.chain_id)
    record = genuine.read_bytes()
    for what, (change, message) in HOSTILE_INDEXES.items():
        genuine.write_bytes(record)  # each change made to the converter's index
        rewrite_index(store, layer.chain_id, change)
        with pytest.raises(LayerCorrupt) as refused:
            server.mount(layer.chain_id)
        assert message in str(refused.value), (what, str(refused.value))
    assert _read_unrelated(server, built[2]) == UNRELATED_BYTES
