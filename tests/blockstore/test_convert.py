"""``bootseer convert``: round trip against GNU tar, hostile layers, idempotency, dedup, memory, the CLI.

The images are built by tests/support (every tar entry kind), converted into a local
store, and each converted layer is compared with ``tar -x`` of the same blob (as root,
xattrs kept): types, modes, owners, ns mtimes, sizes, contents (read back through the
packs, every block verified), symlink targets, device numbers, hard-link groups,
xattrs, whiteouts and opaque directories.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from bootseer.blockstore.convert.converter import ConversionError, Progress, convert_image, verify_layer
from bootseer.blockstore.objects.format import LayerIndex, chain_object, index_object, pack_object
from bootseer.blockstore.objects.store import FileStoreWriter
from bootseer.blockstore.convert.tarlayer import TarLimits
from bootseer import cli
from bootseer.images.registry import DigestMismatch, open_image
from tests.support import layers as L
from tests.support.oci import (
    MEDIA_LAYER_GZIP, SHARED_BLOCKS, RawBlob, blob_data, build_oci_layout, chain_ids, rich_layers,
)
from tests.support.registry import Registry
from tests.support.trees import disk_tree, extract_with_tar, index_tree

BLOCK = 1 << 20


def convert(ref: str, store: Path, **kwargs):
    writer = FileStoreWriter(store)
    with open_image(ref) as image:
        return convert_image(image, writer, **kwargs), writer


def load_index(store: Path, chain: str) -> LayerIndex:
    writer = FileStoreWriter(store)
    record = verify_layer(writer, chain)
    assert record is not None, f"chain {chain} is not in the store"
    return LayerIndex.decode(writer.get(index_object(record.index)), expected_sha256=record.index)


@pytest.fixture(scope="module")
def rich_image(tmp_path_factory):
    return build_oci_layout(tmp_path_factory.mktemp("rich") / "layout", rich_layers(), compression=["gzip", "zstd", "none"])


@pytest.mark.skipif(os.geteuid() != 0, reason="tar -x of device nodes and owners needs root")
def test_round_trip_equals_tar_extraction(rich_image, tmp_path):
    store = tmp_path / "store"
    result, _ = convert(rich_image.ref, store)
    chains = chain_ids(rich_image.diff_ids)
    assert [layer.chain_id for layer in result.layers] == chains
    for number, (chain, digest, diff_id) in enumerate(zip(chains, rich_image.layer_digests, rich_image.diff_ids)):
        record = verify_layer(FileStoreWriter(store), chain)
        assert record is not None
        assert (record.digest, record.diff_id, record.parent) == (digest, diff_id, chains[number - 1] if number else "")
        assert record.media_type == rich_image.media_types[number] and record.size == rich_image.layer_sizes[number]
        index = load_index(store, chain)
        extracted = tmp_path / f"tar-{number}"
        extract_with_tar(rich_image.blob_path(digest), extracted)
        expected, converted = disk_tree(extracted), index_tree(store, index)
        assert converted.keys() == expected.keys()
        for path in expected:
            assert converted[path] == expected[path], path


def test_round_trip_details(rich_image, tmp_path):
    """What the comparison with tar covers, spelled out where a regression would show first."""
    store = tmp_path / "store"
    convert(rich_image.ref, store)
    base, middle, top = (index_tree(store, load_index(store, c)) for c in chain_ids(rich_image.diff_ids))
    assert base["srv/abs"].target == "/etc/hosts" and base["srv/escape"].target == "../../../../etc/shadow"
    assert base["srv/big.bin"].links == ("srv/big.bin", "srv/big.link")
    assert base["srv/mtime-ns"].mtime_ns == 1_700_000_000_123_456_789
    assert base["srv/xattr.bin"].xattrs == (("user.a", b"1"), ("user.bin", b"\x00\xff\xfe"))
    assert base["dev/sda"].rdev == (8, 0) and base["run/fifo"].type == "fifo"
    assert L.clean("names/caf\udce9.txt") in base and len(L.clean(next(p for p in base if p.startswith("deep/") and base[p].type == "file"))) > 255
    assert base["srv/sparse.img"].size == 5 * BLOCK and base["etc/empty"].size == 0
    assert middle["etc/secret"] == type(middle["etc/secret"])("char", 0, 0, 0, L.EPOCH * 10**9, 0)
    assert middle["gone-dir"].type == "char"
    assert ("trusted.overlay.opaque", b"y") in middle["opaque-me"].xattrs
    assert top["replace-me"].mode == 0o600 and top["srv"].mode == 0o700


def test_second_run_uploads_nothing(rich_image, tmp_path):
    store = tmp_path / "store"
    first, _ = convert(rich_image.ref, store)
    assert first.puts > 0 and not any(layer.skipped for layer in first.layers)
    second, writer = convert(rich_image.ref, store)
    assert second.puts == 0 and writer.puts == 0 and writer.put_bytes == 0
    assert all(layer.skipped for layer in second.layers)


def test_a_layer_whose_record_fails_verification_is_converted_again(rich_image, tmp_path):
    store = tmp_path / "store"
    convert(rich_image.ref, store)
    chain = chain_ids(rich_image.diff_ids)[0]
    index = load_index(store, chain)
    (store / pack_object(index.packs[0])).unlink()  # a pack lost
    again, _ = convert(rich_image.ref, store)
    assert [layer.skipped for layer in again.layers] == [False, True, True]
    assert (store / pack_object(index.packs[0])).exists()
    assert load_index(store, chain).packs == index.packs


def _stored_blocks(store: Path) -> int:
    return sum(1 for _ in (store / "v1" / "packs").iterdir())


def test_dedup_across_layers_and_images(rich_image, tmp_path):
    store = tmp_path / "store"
    result, _ = convert(rich_image.ref, store)
    chains = chain_ids(rich_image.diff_ids)
    base, middle = load_index(store, chains[0]), load_index(store, chains[1])
    shared = {b.digest for b in base.blocks if b.rlen == BLOCK} & {b.digest for b in middle.blocks}
    assert len(shared) == 2  # the two blocks of SHARED_BLOCKS
    for digest in shared:
        in_base = next(b for b in base.blocks if b.digest == digest)
        in_middle = next(b for b in middle.blocks if b.digest == digest)
        assert base.packs[in_base.pack] == middle.packs[in_middle.pack]  # referenced where it is
        assert (in_base.offset, in_base.clen) == (in_middle.offset, in_middle.clen)
    assert result.layers[1].stats.in_store == 2
    # Another image sharing the blocks: only its new block is stored.
    other = build_oci_layout(tmp_path / "other", [L.Layer((L.File("x/again.bin", SHARED_BLOCKS + b"new tail"),))])
    again, _ = convert(other.ref, store)
    stats = again.layers[0].stats
    assert (stats.blocks, stats.in_store, stats.stored) == (3, 2, 1)
    assert again.layers[0].stats.dedup_ratio == pytest.approx(2 / 3)


def test_equal_blocks_in_one_layer_and_zero_blocks_are_stored_once(tmp_path):
    data = blob_data(BLOCK)
    image = build_oci_layout(tmp_path / "img", [L.Layer((
        L.File("a", data + data + data), L.File("zeros", bytes(3 * BLOCK)), L.Sparse("holes", 8 * BLOCK, ((0, b"x"),)),
    ))])  # fmt: skip
    result, _ = convert(image.ref, tmp_path / "store")
    stats = result.layers[0].stats
    assert stats.stored == 2  # the block of "a", and the first block of "holes"
    assert stats.zero == 1 and stats.in_layer == 3 + 2 + 7 - 1
    index = load_index(tmp_path / "store", chain_ids(image.diff_ids)[0])
    assert all(b.is_zero for b in index.blocks if b.digest == index.blocks[index.entries[-1].blocks[1]].digest)


# -- hostile layers -----------------------------------------------------------------------------


def _pax_header_of(size: int) -> L.Raw:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    record = b"comment="
    body = b"x" * (size - len(record) - 12)
    line = record + body + b"\n"
    line = str(len(line) + len(str(len(line))) + 1).encode() + b" " + line
    info.size = len(line)
    return L.Raw(info, line)


def _bad_checksum_header() -> bytes:
    header = bytearray(tarfile.TarInfo("innocent").tobuf(tarfile.USTAR_FORMAT))
    header[148:156] = b"0000000\0"
    return bytes(header)


HOSTILE = {
    "dot-dot": ([L.raw("../evil", data=b"x")], "path traversal"),
    "dot-dot-inside": ([L.raw("a/../../evil", data=b"x")], "path traversal"),
    "absolute": ([L.raw("/etc/evil", data=b"x")], "is absolute"),
    "hardlink-dot-dot": ([L.raw("link", tarfile.LNKTYPE, linkname="../../etc/passwd")], "outside the layer"),
    "hardlink-absolute": ([L.raw("link", tarfile.LNKTYPE, linkname="/etc/passwd")], "outside the layer"),
    "hardlink-missing": ([L.raw("link", tarfile.LNKTYPE, linkname="nowhere")], "not an earlier entry"),
    "hardlink-later": ([L.raw("link", tarfile.LNKTYPE, linkname="later"), L.raw("later", data=b"x")], "not an earlier entry"),
    "hardlink-to-dir": ([L.raw("d", tarfile.DIRTYPE, mode=0o755), L.raw("link", tarfile.LNKTYPE, linkname="d")], "not a regular file"),
    "hardlink-to-symlink": ([L.raw("s", tarfile.SYMTYPE, linkname="/etc/passwd"), L.raw("link", tarfile.LNKTYPE, linkname="s")],
                            "not a regular file"),
    "through-symlink": ([L.raw("evil", tarfile.SYMTYPE, linkname="/tmp"), L.raw("evil/planted", data=b"x")],
                        "parent 'evil' is not a directory"),
    "root-not-a-dir": ([L.raw("./", data=b"x")], "root is not a directory"),
    "oversized-pax": ([_pax_header_of(2 << 20), L.raw("f", data=b"x")], "extended header of"),
    "long-name": ([L.raw("a/" * 2100 + "f", data=b"x")], "longer than 4096 bytes"),
    "long-component": ([L.raw("d/" + "n" * 256, data=b"x")], "component longer than 255"),
    "empty-symlink": ([L.raw("s", tarfile.SYMTYPE, linkname="")], "empty target"),
    "unsupported-type": ([L.raw("vol", b"V")], "unsupported tar entry type"),
    "bad-checksum": ([L.raw("first", data=b"x"), L.RawBytes(_bad_checksum_header())], "after entry 'first'"),
    "garbage-header": ([L.raw("first", data=b"x"), L.RawBytes(b"\xff" * 512)], "malformed tar header"),
}


def _xattr_layer(value: bytes) -> L.Layer:
    return L.Layer((L.File("f", b"x", xattrs={"user.big": value}),))


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_layer_is_refused_and_nothing_is_published(case, tmp_path):
    entries, reason = HOSTILE[case]
    good = L.Layer((L.File("ok.txt", b"fine\n"),))
    hostile = L.Layer(tuple(entries), add_parents=False)
    image = build_oci_layout(tmp_path / "img", [good, hostile], compression="gzip")
    outside = tmp_path / "etc"
    with pytest.raises(ConversionError) as caught:
        convert(image.ref, tmp_path / "store")
    message = str(caught.value)
    assert reason in message and "layer 2/2" in message, message
    chains = chain_ids(image.diff_ids)
    assert (tmp_path / "store" / chain_object(chains[0])).exists()  # the good layer below is published
    assert not (tmp_path / "store" / chain_object(chains[1])).exists()
    assert not outside.exists() and not (tmp_path / "evil").exists() and not Path("/tmp/planted").exists()


@pytest.mark.parametrize(
    "layer, reason",
    [
        (_xattr_layer(b"v" * (65 << 10)), "holds 66560 bytes"),
        (L.Layer((L.File("f", b"x", xattrs={"user." + "n" * 300: b"v"}),)), "longer than 255 bytes"),
        (L.Layer((L.File("f", b"x", mtime="not-a-number"),)), "is not a number"),
    ],
    ids=["xattr-value", "xattr-name", "pax-mtime"],
)
def test_hostile_pax_records(layer, reason, tmp_path):
    image = build_oci_layout(tmp_path / "img", [layer])
    with pytest.raises(ConversionError, match=reason):
        convert(image.ref, tmp_path / "store")
    assert not (tmp_path / "store" / "v1" / "chains").exists()


def test_truncated_and_corrupt_blobs(tmp_path):
    tar = L.layer_tar(L.Layer((L.File("big", blob_data(100_000)), L.File("after", b"x"))))
    cases = {
        "truncated-data": (RawBlob(tar[:50_000]), "truncated"),
        "truncated-header": (RawBlob(tar[:512 + 100_352 + 100]), "truncated"),
        "corrupt-gzip": (RawBlob(gzip.compress(tar)[:-8] + b"\0" * 8, MEDIA_LAYER_GZIP), "gzip stream is corrupt"),
        "not-a-tar": (RawBlob(b"hello, I am not a tar" * 100), "malformed tar header"),
        "wrong-compression": (RawBlob(gzip.compress(tar)), "but the blob is gzip"),
        "wrong-diff-id": (RawBlob(tar, diff_id="sha256:" + "0" * 64), "but the image config says"),
    }
    for name, (blob, reason) in cases.items():
        image = build_oci_layout(tmp_path / name, [blob])
        with pytest.raises(ConversionError) as caught:
            convert(image.ref, tmp_path / f"store-{name}")
        assert reason in str(caught.value), (name, str(caught.value))
        assert not (tmp_path / f"store-{name}" / "v1" / "chains").exists(), name


def test_a_blob_that_is_not_its_digest_is_never_converted(tmp_path):
    image = build_oci_layout(tmp_path / "img", [L.Layer((L.File("f", b"original"),))], compression="none")
    blob = image.blob_path(image.layer_digests[0])
    data = bytearray(blob.read_bytes())
    data[data.index(b"original")] = ord("O")
    blob.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch):
        convert(image.ref, tmp_path / "store")
    assert not (tmp_path / "store" / "v1" / "chains").exists()


def test_entry_limit(tmp_path):
    image = build_oci_layout(tmp_path / "img", [L.Layer(tuple(L.File(f"f{i}", b"") for i in range(10)))])
    with pytest.raises(ConversionError, match="more than 5 entries"):
        convert(image.ref, tmp_path / "store", limits=TarLimits(max_entries=5))


def test_absolute_symlinks_are_stored_and_never_followed(tmp_path):
    """A layer full of symlinks pointing out: stored as they are; nothing outside is read or written."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not read me")
    layer = L.Layer((
        L.Symlink("to-secret", str(outside / "secret")),
        L.Symlink("to-dir", str(outside)),
        L.Symlink("up", "../../../../../" + str(outside).lstrip("/")),
        L.File("real", b"real file"),
    ))  # fmt: skip
    image = build_oci_layout(tmp_path / "img", [layer])
    before = sorted(os.listdir(outside))
    convert(image.ref, tmp_path / "store")
    tree = index_tree(tmp_path / "store", load_index(tmp_path / "store", image.diff_ids[0]))
    assert tree["to-secret"].target == str(outside / "secret") and tree["to-secret"].sha256 == ""
    assert tree["to-dir"].size == len(str(outside)) and tree["real"].sha256
    assert sorted(os.listdir(outside)) == before and (outside / "secret").read_bytes() == b"do not read me"


# -- memory ----------------------------------------------------------------------------------


def test_memory_stays_bounded_on_a_large_layer(tmp_path):
    """A 1.2 GiB layer (192 MiB of data, a 1 GiB hole) converts with under 16 MiB of Python heap.

    Measured here: a 4.1 MiB peak.  Tolerance: the block size (1 MiB) times a few
    buffers (tarfile's, zstd's, the pack writer's) plus the per-entry and per-block
    records, with room to spare; the layer itself is 75 times the bound.
    """
    layer = L.Layer((
        L.BigFile("data/big.bin", 192 << 20, seed=1),
        L.Sparse("data/hole.img", 1 << 30, ((0, b"start"), ((1 << 30) - 3, b"end"))),
    ))  # fmt: skip
    image = build_oci_layout(tmp_path / "img", [layer], compression="none")
    tracemalloc.start()
    try:
        result, _ = convert(image.ref, tmp_path / "store")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stats = result.layers[0].stats
    assert stats.raw_bytes == (192 << 20) + (1 << 30)
    assert peak < 16 << 20, f"peak Python heap {peak / (1 << 20):.1f} MiB"


# -- the command line ------------------------------------------------------------------------


def test_cli_converts_and_prints_progress_and_a_summary(rich_image, tmp_path, capsys):
    store = tmp_path / "store"
    assert cli.main(["convert", rich_image.ref, "--store", str(store), "--block-size", "512K"]) == 0
    out, err = capsys.readouterr()
    assert "3 layers (3 converted, 0 already in the store)" in out
    assert "layer 1/3" in err and "dedup" in err and "\r" not in err  # plain lines: stderr is not a terminal
    assert load_index(store, chain_ids(rich_image.diff_ids)[0]).block_size == 512 << 10
    assert cli.main(["convert", rich_image.ref, "--store", f"file://{store}", "--block-size", "512K"]) == 0
    assert "(0 converted, 3 already in the store)" in capsys.readouterr().out


def test_progress_on_a_terminal_is_one_live_line():
    stream = io.StringIO()
    progress = Progress(stream, live=True, interval=0)
    from bootseer.blockstore.convert.converter import BlockStats

    stats = BlockStats(blocks=10, raw_bytes=10 << 20, stored=4)
    progress.start_layer("layer 1/1", stats, lambda: 5 << 20)
    progress.tick()
    progress.line("layer 1/1: done")
    text = stream.getvalue()
    assert text.startswith("\r\033[Klayer 1/1: 5.0 MiB read, 10.0 MiB of files, 10 blocks, 4 new, dedup 60%")
    assert text.endswith("\r\033[Klayer 1/1: done\n")


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["convert", "oci:/nonexistent/layout", "--store", "{store}"], 1, "bootseer convert: oci:/nonexistent/layout: /nonexistent"),
        (["convert", "http://registry/x", "--store", "{store}"], 2, "without a scheme"),
        (["convert", "{ref}", "--store", "ftp://host/x"], 2, "bad --store"),
        (["convert", "{ref}", "--store", "https://cdn.example/store"], 2, "read-only"),
        (["convert", "{ref}", "--store", "{store}", "--block-size", "3M"], 2, "power of two"),
        (["convert", "{ref}"], 2, "--store"),
        (["convert", "{ref}", "--store", "{store}", "--platform", "linux"], 2, "bad platform"),
        (["convert", "{ref}", "--store", "{store}", "--spool-dir", "/nonexistent/spool"], 2, "not a directory"),
    ],
    ids=["missing-layout", "url-ref", "bad-scheme", "http-store", "block-size", "no-store", "platform", "spool"],
)
def test_cli_errors(argv, code, message, rich_image, tmp_path, capsys):
    argv = [a.format(store=tmp_path / "store", ref=rich_image.ref) for a in argv]
    try:
        status = cli.main(argv)
    except SystemExit as exit:  # argparse's own usage errors
        status = exit.code
    assert status == code
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.startswith("bootseer convert")]) <= 1


# -- a registry, and a store that does not keep what it is given --------------------------------


def test_cli_converts_from_a_registry_over_plain_http(rich_image, tmp_path, capsys):
    registry = Registry(tmp_path / "registry")
    registry.start()
    try:
        ref = registry.push(rich_image, "bootseer/rich")
        store = tmp_path / "store"
        assert cli.main(["convert", ref, "--store", str(store), "--plain-http"]) == 0
        assert "3 layers (3 converted" in capsys.readouterr().out
        for chain in chain_ids(rich_image.diff_ids):
            assert load_index(store, chain).diff_id in rich_image.diff_ids
        assert cli.main(["convert", ref, "--store", str(store)]) == 1  # HTTPS to a plain-HTTP registry
        err = capsys.readouterr().err
        assert err.startswith(f"bootseer convert: {ref}: ") and err.count("\n") == 1
    finally:
        registry.stop()


class LosingStore(FileStoreWriter):
    """A store that truncates what it is given for names under ``lose`` (a broken mirror, a full disk)."""

    def __init__(self, root: Path, lose: str) -> None:
        super().__init__(root)
        self.lose = lose

    def _put(self, name, data):
        if name.startswith(self.lose):
            data = (data if isinstance(data, bytes) else Path(data).read_bytes())[:-2]
        super()._put(name, data)


@pytest.mark.parametrize("lose, message", [("v1/packs/", "reads back as"), ("v1/indexes/", "reads back different"),
                                           ("v1/chains/", "reads back different")])  # fmt: skip
def test_what_was_uploaded_is_read_back_and_checked(lose, message, rich_image, tmp_path):
    writer = LosingStore(tmp_path / "store", lose)
    with open_image(rich_image.ref) as image, pytest.raises(ConversionError) as caught:
        convert_image(image, writer)
    assert message in str(caught.value) and str(caught.value).startswith("layer 1/3 ")
    if lose != "v1/chains/":
        assert not (tmp_path / "store" / "v1" / "chains").exists()


def test_a_conversion_killed_midway_publishes_nothing_and_a_rerun_completes(tmp_path):
    """kill -9 while a layer is being packed: no chain record, nothing half-written; the next run finishes."""
    import signal
    import subprocess
    import sys
    import time

    image = build_oci_layout(tmp_path / "img", [L.Layer((L.File("small", b"first layer"),)),
                                                L.Layer((L.BigFile("big.bin", 256 << 20, seed=5),))], compression="none")  # fmt: skip
    store, spool = tmp_path / "store", tmp_path / "spool"
    spool.mkdir()
    argv = [sys.executable, "-m", "bootseer.cli", "convert", image.ref, "--store", str(store), "--spool-dir", str(spool)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size > 32 << 20 for p in spool.rglob("pack-*")):
            assert process.poll() is None and time.monotonic() < deadline, "the conversion ended before it could be killed"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=30)
    chains = chain_ids(image.diff_ids)
    assert (store / chain_object(chains[0])).exists() and not (store / chain_object(chains[1])).exists()
    assert not [p for p in store.rglob("*") if ".tmp-" in p.name]
    result, _ = convert(image.ref, store)
    assert [layer.skipped for layer in result.layers] == [True, False]
    assert load_index(store, chains[1]).entries[-1].size == 256 << 20


def test_pack_writer_output_does_not_depend_on_its_threads(tmp_path):
    """Blocks are compressed on threads but written in order: same packs, same index, with 1 or 4 workers."""
    from bootseer.blockstore.convert.converter import DedupTable, PackWriter

    blocks = [blob_data(BLOCK)[i:] + bytes(i) for i in range(0, 40 * 997, 997)] + [bytes(BLOCK), b"short tail"]
    results = []
    for workers in (1, 4):
        spool = tmp_path / f"spool-{workers}"
        spool.mkdir()
        with PackWriter(BLOCK, DedupTable(FileStoreWriter(tmp_path / "store")), spool, workers=workers,
                        max_pack_bytes=8 << 20) as packs:  # fmt: skip
            numbers = [packs.add(block) for block in blocks + blocks[:3]]
            packs.finish()
        results.append((numbers, packs.blocks, packs.packs, [(p.sha256, p.size, p.path.read_bytes()) for p in packs.spooled]))
    assert results[0] == results[1]
    numbers, index_blocks, pack_names, spooled = results[0]
    assert numbers[-3:] == numbers[:3] and len(pack_names) == len(spooled) > 1  # rotated past 8 MiB
    for sha, size, data in spooled:
        assert hashlib.sha256(data).hexdigest() == sha and len(data) == size


def test_a_layers_index_does_not_depend_on_when_its_dedup_references_are_checked(tmp_path):
    """A layer that references a block of another layer's pack and stores new ones: the packs are numbered by
    first block, whether the reference is checked at once (a batch of one block) or after the new blocks
    were written (one batch at the end), so a conversion gives the same index, and one digest, every time."""
    from bootseer.blockstore.convert.converter import DedupTable, PackWriter

    store = tmp_path / "store"
    shared, new = blob_data(BLOCK), blob_data(3 * BLOCK)[BLOCK:]
    base = L.Layer((L.File("shared", shared),))
    convert(build_oci_layout(tmp_path / "base", [base]).ref, store)
    results = []
    for batch in (1, 64 << 20):
        spool = tmp_path / f"spool-{batch}"
        spool.mkdir()
        with PackWriter(BLOCK, DedupTable.load(FileStoreWriter(store)), spool, workers=1,
                        verify_batch_bytes=batch) as packs:  # fmt: skip
            packs.add(shared)
            packs.add(new[:BLOCK])
            packs.add(new[BLOCK:])
            packs.finish()
        assert packs.stats.in_store == 1 and packs.stats.stored == 2
        results.append((packs.blocks, packs.packs))
    assert results[0] == results[1]
    blocks, names = results[0]
    assert [b.pack for b in blocks] == [0, 1, 1] and names[1] == packs.spooled[0].sha256
