"""A local blob damaged while no layer server held it is checked before it is served again: never a zero or a wrong byte.

Issue 35, cases 3 and 4: a blob truncated, or a byte of it changed, while its server was
stopped.  The integration tests run a real ``bootseer layer-server`` on the ``fanotify`` data
path over a converted layer (tests/blockstore/test_fanotify.py's), fill the blob by reading
through the kernel's EROFS mount, stop the server (SIGTERM once the blob is whole: the event
holder is released; SIGKILL with holes left, then the holder killed too: nothing holds the
blob; SIGTERM with holes left and the holder kept: the next server adopts the blob's writer),
damage the blob on disk, drop the page cache and start the next server: every file reads back
with its SHA-256 and the server's log names the blocks it dropped.  The unit tests run
:mod:`bootseer.blockstore.datapath.blob_check` and :class:`LocalBlob` over real sparse files on
``/var/tmp`` (ext4: ``SEEK_DATA``/``SEEK_HOLE`` and hole punching as the server sees them).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath import fanotify
from bootseer.blockstore.datapath.fanotify import unsupported
from tests.blockstore.test_fanotify import _expected, _holders, blob_of, converted, drop_caches, read_all  # noqa: F401
from tests.blockstore.test_layer_server import node_factory  # noqa: F401 (fixture)
from tests.support.layer_servers import layer_server_processes, stop_event_holders
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
    pytest.mark.skipif(unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
]

CUT = 5 << 20  #: where a truncated blob ends (issue 35's case 3)
#: Half the big files, two of them wholly past CUT in the blob: a partial fill that a truncation cuts into.
PARTIAL = ["data/file0.bin", "data/file2.bin", "data/file5.bin", "data/file7.bin"]
CHECKED = "local blob checked before it is served"


def expected_paths() -> list[str]:
    """Every file of the layer."""
    return sorted(_expected())


def _block_of(built: Any, path: str, number: int) -> int:
    """The index's block number of block ``number`` of the file at ``path``."""
    entry = next(entry for entry in built.index.entries if entry.path == path)
    return entry.blocks[number]


def _checks(node: Any) -> list[dict[str, str]]:
    """The fields of each ``CHECKED`` line of the node's log."""
    return [dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line)) for line in node.log().splitlines() if CHECKED in line]


def _fill(converted: Any, node_factory: Any, paths: list[str]) -> tuple[Any, Any, str, dict[str, str]]:
    """A fanotify node with the layer mounted and ``paths`` read through it (their blocks on disk, and no other:
    no fill groups, so the blob keeps its holes)."""
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify", fill_group=0)
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, paths) == {path: expected[path] for path in paths}
    return node, client, lower, expected


def _stop_with_nothing_holding_the_blob(node: Any, client: Any, how: str) -> None:
    """``complete``: SIGTERM once the blob is whole; ``holes``: SIGKILL with holes left.  Then the event holders
    are killed (whatever they kept: the group and the blob's marks go with them), so nothing holds the blob."""
    if how == "complete":
        wait_until("the blob is complete", lambda: client.status()["fanotify"]["complete"] == 1)
        node.stop(signal.SIGTERM)
    else:
        assert client.status()["fanotify"]["complete"] == 0
        pid = node.pid()
        os.kill(pid, signal.SIGKILL)
        wait_until("the server is gone", lambda: pid not in layer_server_processes(node.root))
    # A holder may start a standby as another dies: kill them until none is left.
    wait_until("no event holder is left", lambda: stop_event_holders(node.root) or not _holders(node))


def _flip(blob: Path, offset: int) -> None:
    with open(blob, "r+b", buffering=0) as opened:
        byte = os.pread(opened.fileno(), 1, offset)
        os.pwrite(opened.fileno(), bytes([byte[0] ^ 0x5A]), offset)


@pytest.mark.parametrize("how", ["complete", "holes"])
def test_a_blob_truncated_while_no_server_held_it_reads_back_right_not_as_zeros(
    converted: Any, node_factory: Any, how: str
) -> None:
    """Issue 35, case 3: the blocks past the cut are dropped before the blob is extended back, and fetched again."""
    _store, built = converted
    node, client, lower, expected = _fill(converted, node_factory, expected_paths() if how == "complete" else PARTIAL)
    _stop_with_nothing_holding_the_blob(node, client, how)
    blob = blob_of(node, built)
    cut = [ref for ref, block in enumerate(built.index.blocks) if built.index.blob_offset(ref) + block.rlen > CUT]
    assert cut, "the layer's blob does not reach past the cut"
    os.truncate(blob, CUT)
    drop_caches()
    client = node.ensure()
    assert read_all(lower, sorted(expected)) == expected
    checks = _checks(node)
    assert len(checks) == 1 and int(checks[0]["beyond_end"]) > 0 and int(checks[0]["dropped"]) >= int(checks[0]["beyond_end"])
    assert os.stat(blob).st_size == built.index.blob_size


@pytest.mark.parametrize("how", ["complete", "holes"])
def test_a_byte_flipped_while_no_server_held_the_blob_is_refetched_not_served(converted: Any, node_factory: Any, how: str) -> None:
    """Issue 35, case 4: no clean-close record matches, so every claimed block is hashed; the flipped one is dropped."""
    _store, built = converted
    node, client, lower, expected = _fill(converted, node_factory, expected_paths() if how == "complete" else PARTIAL)
    _stop_with_nothing_holding_the_blob(node, client, how)
    blob = blob_of(node, built)
    flipped = _block_of(built, "data/file2.bin", 3)
    _flip(blob, built.index.blob_offset(flipped) + 1000)
    drop_caches()
    client = node.ensure()
    assert read_all(lower, sorted(expected)) == expected
    checks = _checks(node)
    assert len(checks) == 1 and checks[0]["verified"] == "True"
    assert checks[0]["corrupt"] == "1" and checks[0]["dropped"] == "1"


def test_a_byte_flipped_in_a_blob_the_holder_kept_is_refetched_when_the_next_server_adopts_it(
    converted: Any, node_factory: Any
) -> None:
    """SIGTERM with holes left: the event holder keeps the blob's writer and answers reads of blocks on disk
    itself, writes included; a byte written meanwhile is found when the next server adopts the writer."""
    _store, built = converted
    node, client, lower, expected = _fill(converted, node_factory, PARTIAL)
    node.stop(signal.SIGTERM)
    assert _holders(node)  # holes: the group outlives the server
    blob = blob_of(node, built)
    flipped = _block_of(built, "data/file2.bin", 3)
    _flip(blob, built.index.blob_offset(flipped) + 1000)  # a block on disk: the holder allows the write
    drop_caches()
    client = node.ensure()
    assert client.status()["fanotify"]["holder_adopted"] is True
    assert read_all(lower, sorted(expected)) == expected
    checks = _checks(node)
    assert len(checks) == 1 and checks[0]["adopted"] == "True" and checks[0]["corrupt"] == "1"


# -- the checks themselves, on a real sparse file ---------------------------------------------------


@pytest.fixture
def var_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="blob-recheck-") as directory:
        yield Path(directory)


def _blob_with(converted: Any, directory: Path, refs: list[int]) -> Path:
    """A sparse blob of the layer in ``directory`` holding blocks ``refs`` at their offsets (the rest holes)."""
    from tests.support.trees import read_block

    store, built = converted
    index = built.index
    path = directory / f"{built.record.index}.blob"
    with open(path, "wb") as blob:
        blob.truncate(index.blob_size)
        for ref in refs:
            blob.seek(index.blob_offset(ref))
            blob.write(read_block(store, index, ref))
    return path


def test_the_checks_find_blocks_past_the_end_in_holes_and_with_wrong_bytes_and_drop_them_as_holes(
    converted: Any, var_tmp: Path
) -> None:
    from bootseer.blockstore.datapath import blob_check
    from bootseer.blockstore.datapath.local_blobs import FILLED

    assert blob_check.FILLED == FILLED
    _store, built = converted
    index = built.index
    data = [ref for ref, block in enumerate(index.blocks) if not block.is_zero]
    written, unwritten = data[::2], data[1::2]
    path = _blob_with(converted, var_tmp, written)
    claimed = bytearray(len(index.blocks))
    for ref in data:  # the map claims every block; every other one was never written (a hole)
        claimed[ref] = FILLED
    flipped, last = written[3], written[-3]
    with open(path, "r+b", buffering=0) as blob:
        os.pwrite(blob.fileno(), b"\xff" * 3, index.blob_offset(flipped) + 17)
        extents = blob_check.data_extents(blob.fileno(), index.blob_size)
        assert extents and all(start < end for start, end in extents)
        assert blob_check.in_holes(index, written, extents) == []
        assert blob_check.in_holes(index, data, extents) == unwritten
        assert blob_check.corrupt(blob.fileno(), index, written) == [flipped]
        assert blob_check.corrupt(blob.fileno(), index, written, threads=1) == [flipped]
        assert blob_check.beyond_end(index, data, index.blob_offset(last) + 1) == [ref for ref in data if ref >= last]
        os.truncate(blob.fileno(), index.blob_offset(last) + 1)  # cut inside a written block
        filled = bytearray(claimed)
        result = blob_check.check_claims(blob.fileno(), index, filled, verify=True)
    assert result.claimed == len(data) and result.verified
    assert result.beyond_end == [ref for ref in data if ref >= last]
    assert result.in_holes == [ref for ref in unwritten if ref < last]
    assert result.corrupt == [flipped]
    assert result.dropped == sorted(result.beyond_end + result.in_holes + [flipped])
    assert [ref for ref in data if filled[ref] == FILLED] == [ref for ref in written if ref < last and ref != flipped]
    # Without digests only the size and holes fail; the flipped block stays (the record said nothing changed).
    with open(path, "r+b", buffering=0) as blob:
        unverified = blob_check.check_claims(blob.fileno(), index, bytearray(claimed), verify=False)
        assert not unverified.verified and unverified.corrupt == [] and flipped not in unverified.dropped
        # A dropped block becomes a hole: the holes check then finds it too, whatever its map byte says.
        map_fd = os.open(var_tmp / "map", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(map_fd, b"\x01" * len(index.blocks), 0)
            blob_check.drop(blob.fileno(), map_fd, 0, index, [flipped])
            assert os.pread(map_fd, len(index.blocks), 0)[flipped] == 0
        finally:
            os.close(map_fd)
        after = blob_check.data_extents(blob.fileno(), os.fstat(blob.fileno()).st_size)
        assert blob_check.in_holes(index, [flipped], after) == [flipped]
        assert os.pread(blob.fileno(), 8, index.blob_offset(flipped)) == bytes(8)


def test_a_clean_close_record_matches_only_untouched_files_and_is_gone_once_taken(var_tmp: Path) -> None:
    from bootseer.blockstore.datapath import blob_check

    blob, fill_map = var_tmp / "x.blob", var_tmp / "x.filled"
    blob.write_bytes(b"a" * 4096)
    fill_map.write_bytes(b"\x01")
    record_path = blob_check.record_path(blob)
    assert record_path == var_tmp / "x.closed"
    writer, map_fd = os.open(blob, os.O_RDWR), os.open(fill_map, os.O_RDWR)
    try:
        blob_check.write_record(record_path, writer, map_fd, "boot-1")
        record = blob_check.take_record(record_path)
        assert record is not None and not record_path.exists()
        assert blob_check.unchanged_since(record, writer, map_fd, "boot-1")
        assert not blob_check.unchanged_since(record, writer, map_fd, "boot-2")
        assert not blob_check.unchanged_since(None, writer, map_fd, "boot-1")
        os.pwrite(writer, b"a", 100)  # the same byte again: the times change all the same
        assert not blob_check.unchanged_since(record, writer, map_fd, "boot-1")
        record = blob_check.write_record(record_path, writer, map_fd, "boot-1")
        os.pwrite(map_fd, b"\x01", 0)
        assert not blob_check.unchanged_since(blob_check.take_record(record_path), writer, map_fd, "boot-1")
    finally:
        os.close(writer)
        os.close(map_fd)
    assert blob_check.take_record(record_path) is None
    for damaged in (b"{", b"[]", b'{"version": 1}', b"x" * 10000,
                    record.encode().replace(b'"size": 4096', b'"size": "4096"')):  # fmt: skip
        record_path.write_bytes(damaged)
        assert blob_check.take_record(record_path) is None and not record_path.exists()


def test_a_local_blob_opened_over_a_damaged_blob_of_this_boot_drops_the_damaged_blocks(converted: Any, var_tmp: Path) -> None:
    """``LocalBlob`` made anew over this boot's blob and map: a truncation and a flipped byte cost their blocks,
    the blob gets its size back only after, and with a clean-close record of untouched files nothing is hashed."""
    from bootseer.blockstore.datapath.local_blobs import FILLED, LocalBlob

    _store, built = converted
    index = built.index
    data = [ref for ref, block in enumerate(index.blocks) if not block.is_zero]
    group = fanotify.init_group()
    try:
        blob = LocalBlob(var_tmp, built.record.index, index, None, group)
        assert blob.missing_count == len(data)
        blob.write(data, [_read(converted, ref) for ref in data])
        assert blob.complete
        blob.close(remove=False)
        assert (var_tmp / f"{built.record.index}.closed").exists()  # a clean close leaves its record
        # Untouched: the record matches, nothing is dropped (and the record is taken).
        blob = LocalBlob(var_tmp, built.record.index, index, None, group)
        assert blob.complete and not (var_tmp / f"{built.record.index}.closed").exists()
        assert blob.check is not None and not blob.check.verified and not blob.check.dropped
        blob.record_clean_close()
        blob.close(remove=False)
        # Damaged after the clean close: a byte flipped, the tail cut off.
        flipped, cut_at = data[1], index.blob_offset(data[-2])
        _flip(blob.path, index.blob_offset(flipped) + 5)
        os.truncate(blob.path, cut_at)
        blob = LocalBlob(var_tmp, built.record.index, index, None, group)
        try:
            gone = [flipped] + [ref for ref in data if index.blob_offset(ref) + index.blocks[ref].rlen > cut_at]
            assert blob.check is not None and blob.check.verified and blob.check.corrupt == [flipped]
            assert blob.missing(range(len(index.blocks))) == sorted(gone)
            assert os.fstat(blob.writer).st_size == index.blob_size
            on_disk = (var_tmp / f"{built.record.index}.filled").read_bytes()[-len(index.blocks) :]
            assert [ref for ref in data if on_disk[ref] != FILLED] == sorted(gone)
            assert os.pread(blob.writer, 16, index.blob_offset(flipped)) == bytes(16)  # a hole now
        finally:
            blob.close(remove=True)
        assert not (var_tmp / f"{built.record.index}.closed").exists()
    finally:
        os.close(group)


def _read(converted: Any, ref: int) -> bytes:
    from tests.support.trees import read_block

    store, built = converted
    data = read_block(store, built.index, ref)
    assert hashlib.sha256(data).hexdigest() == built.index.blocks[ref].digest
    return data


def test_a_byte_flipped_in_a_whole_blob_the_holder_kept_is_refetched_once_the_blob_is_marked_again(
    converted: Any, node_factory: Any
) -> None:
    """SIGKILL once the blob is whole (unmarked): the holder keeps its writer, a write to it raises no event; the
    next server adopts it, finds the block, and marks the blob again: the kept mount's reads of it raise events."""
    _store, built = converted
    node, client, lower, expected = _fill(converted, node_factory, expected_paths())
    wait_until("the blob is complete", lambda: client.status()["fanotify"]["complete"] == 1)
    pid = node.pid()
    os.kill(pid, signal.SIGKILL)
    wait_until("the server is gone", lambda: pid not in layer_server_processes(node.root))
    assert _holders(node)
    blob = blob_of(node, built)
    _flip(blob, built.index.blob_offset(_block_of(built, "data/file6.bin", 9)) + 4000)
    drop_caches()
    client = node.ensure()
    assert client.status()["fanotify"]["holder_adopted"] is True
    assert read_all(lower, sorted(expected)) == expected
    checks = _checks(node)
    assert len(checks) == 1 and checks[0]["adopted"] == "True" and checks[0]["corrupt"] == "1"
    wait_until("the blob is complete again", lambda: client.status()["fanotify"]["complete"] == 1)
