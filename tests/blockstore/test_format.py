"""The store's objects (index, chain record, dedup segment) and the tar reader's semantics.

Objects: round trips, and every kind of damage (a flipped byte, truncation, another
version, inconsistent contents, a record under another chain's name) is a FormatError.
Tar semantics: what ``read_layer`` makes of whiteouts, opaque markers, duplicate
entries, implicit parents, hard links whose target is replaced, names, xattrs and
compression, each checked on a tar built by tests/support.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import io
import json
import re
import struct
import tarfile

import pytest
import zstandard

from bootseer.blockstore.objects.format import (
    FORMAT_VERSION,
    ZERO_PACK,
    Block,
    ChainRecord,
    DedupSegment,
    Entry,
    EntryType,
    FormatError,
    LayerIndex,
    StoredBlock,
    chain_object,
    decode_sealed,
    dedup_object,
    encode_sealed,
    index_object,
    pack_object,
)
from bootseer.images.chains import chain_id, chain_ids
from bootseer.blockstore.convert.tarlayer import LayerError, read_layer
from tests.support import layers as L
from tests.support.sealed import same_sealed_object
from tests.support.oci import chain_ids as reference_chain_ids

D1, D2, D3 = ("sha256:" + c * 64 for c in "123")
BS = 1 << 20


class Sink:
    """A block sink that keeps blocks in memory (small test layers only)."""

    def __init__(self) -> None:
        self.data: list[bytes] = []

    def add(self, data: bytes) -> int:
        self.data.append(data)
        return len(self.data) - 1

    def add_zeros(self, length: int, count: int) -> int:
        return self.add(bytes(length))


def parse(layer: L.Layer, compress=lambda b: b):
    sink = Sink()
    parsed = read_layer(io.BytesIO(compress(L.layer_tar(layer))), sink, block_size=BS)
    return {e.path: e for e in parsed.entries}, parsed, sink


def contents(entries, sink, path) -> bytes:
    entry = entries[path]
    if entry.link is not None:
        entry = next(e for e in entries.values() if e.link is None and e.path == list(entries)[entry.link])
    return b"".join(sink.data[b] for b in entry.blocks)


# -- names and chain ids ------------------------------------------------------------------------


def test_chain_ids_are_containerds():
    assert chain_ids([D1, D2, D3]) == reference_chain_ids([D1, D2, D3])
    assert chain_id("", D1) == D1
    assert chain_id(D1, D2) == "sha256:" + hashlib.sha256(f"{D1} {D2}".encode()).hexdigest()


def test_object_paths_are_versioned_and_refuse_bad_names():
    assert chain_object(D1) == f"v{FORMAT_VERSION}/chains/{'1' * 64}.json"
    assert index_object("a" * 64) == "v1/indexes/" + "a" * 64
    assert pack_object("b" * 64) == "v1/packs/" + "b" * 64 and dedup_object("c" * 64) == "v1/dedup/" + "c" * 64
    for bad in ("../x", "A" * 64, "a" * 63, ""):
        with pytest.raises(FormatError):
            pack_object(bad)
    with pytest.raises(FormatError):
        chain_object("sha256:../../etc")


# -- the layer index -----------------------------------------------------------------------------


def small_index() -> LayerIndex:
    data = b"hello world\n"
    digest = hashlib.sha256(data).hexdigest()
    zero = hashlib.sha256(bytes(BS)).hexdigest()
    return LayerIndex(
        diff_id=D1,
        block_size=BS,
        entries=[
            Entry("", EntryType.DIR, 0o755),
            Entry("dir", EntryType.DIR, 0o700, uid=1, gid=2, mtime_ns=123, xattrs={"trusted.overlay.opaque": b"y"}),
            Entry("dir/f", EntryType.FILE, 0o644, size=len(data), blocks=(0,)),
            Entry("dir/link", EntryType.FILE, 0o644, size=len(data), link=2),
            Entry("dir/sparse", EntryType.FILE, 0o600, size=BS + len(data), blocks=(1, 0)),
            Entry("dir/caf\udce9", EntryType.SYMLINK, 0o777, size=9, target="/etc/\udcffxyz"),
            Entry("gone", EntryType.CHAR, 0),
            Entry("null", EntryType.CHAR, 0o666, rdev=(1, 3)),
            Entry("fifo", EntryType.FIFO, 0o644),
        ],
        blocks=[Block(digest, 0, 0, 21, len(data)), Block(zero, ZERO_PACK, 0, 0, BS)],
        packs=["d" * 64],
    )


def test_index_round_trip():
    index = small_index()
    data = index.encode()
    decoded = LayerIndex.decode(data, expected_sha256=hashlib.sha256(data).hexdigest())
    assert decoded == index
    assert decoded.entries[5].target == "/etc/\udcffxyz"  # non-UTF-8 bytes survive as surrogates


#: ``small_index().encode()`` as the code before the sealed-object helper wrote it (zstd 1.5.7).
STORED_INDEX = base64.b64decode(
    "QlNMSURYMDEBAAAAmAEAAAAAAABUs6M0lUh+PRNRaqQCOqGMq7S+hiCTgS+CfmpZJhKI1yi1L/1gPAJ1DADGWUwiQGmsAxiuzwxY"
    "AX0aiCVk79ywm6oOuFwDt2RFB/rOKIpyIEEAQABDAJQlc4mXZO9AXnLt5ENYc6tm/Bx78Yfk9Af4JzHj4nsgzTFO8FVBeQoSs1nk"
    "9wkeTUXEc3iqFHQr9Jvgocg4TX8h/Do6qVw7llz0SRm5IRXhg3FyR0UOdt1q0uNQqq3Usrb2WKq8fthEpU1qeXmPMBbVS/E9RZuT"
    "zbOmqOhMM9GqAkq3oXEBgYF6+BodxEUTwIiLUxGaAFqhJ3KgL8AnfJdivgreIPo6to31GDzzvaPQw0PfH37xhao4kKJ+kyQB7F2T"
    "s1+NpMGKNd200ot+3WLLEinYiYipaAyuwEjoNkyoGg6/fF9KDZ5hGM+rk0YEHecm55hb9XHi4lHwiIRCWRI+wMvv82VVlyUgYMJx"
    "mB0MjHSh6kp+FSeFvmtMAMhQSiWOVOCWgTwEswOX2HVEi9jAMOxzoeWI9SYT5lKrvzLxZgzOrfQmNuwuDSbjFINdM2SE5p+hUtES"
    "WaGMi8WkNyXuBA=="
)
STORED_WITH_ZSTD = (1, 5, 7)


def test_an_index_stored_before_the_sealed_object_helper_reads_the_same_and_is_written_the_same():
    assert LayerIndex.decode(STORED_INDEX, expected_sha256=hashlib.sha256(STORED_INDEX).hexdigest()) == small_index()
    assert same_sealed_object(small_index().encode(), STORED_INDEX, STORED_WITH_ZSTD)
    assert STORED_INDEX[:8] == b"BSLIDX01" and len(STORED_INDEX) - 52 == struct.unpack_from("<Q", STORED_INDEX, 12)[0]



def test_sealed_objects_check_magic_version_checksum_and_size_with_the_callers_error():
    class WidgetError(FormatError):
        pass

    sealed = encode_sealed(b"WIDGET01", 3, b"payload" * 100)
    assert decode_sealed(sealed, b"WIDGET01", 3, 700, "widget") == b"payload" * 100
    for data, magic, version, limit, message in (
        (sealed[:51], b"WIDGET01", 3, 700, "widget is truncated (51 bytes)"),
        (sealed, b"GADGET01", 3, 700, "not a BootSeer widget (bad magic)"),
        (sealed, b"WIDGET01", 2, 700, "widget format version 3 is not supported (this BootSeer reads 2)"),
        (sealed[:-1], b"WIDGET01", 3, 700, "widget payload fails its checksum"),
        (sealed, b"WIDGET01", 3, 699, "widget is larger than 699 bytes uncompressed"),
    ):
        with pytest.raises(WidgetError, match=re.escape(message)):
            decode_sealed(data, magic, version, limit, "widget", WidgetError)
    with pytest.raises(ValueError, match="8 bytes"):
        encode_sealed(b"SHORT", 1, b"")


def test_every_damaged_byte_is_caught():
    data = small_index().encode()
    for position in range(0, len(data), max(1, len(data) // 97)):
        damaged = data[:position] + bytes([data[position] ^ 0x40]) + data[position + 1 :]
        with pytest.raises(FormatError):
            LayerIndex.decode(damaged)
    for cut in (0, 10, 51, len(data) - 1):
        with pytest.raises(FormatError):
            LayerIndex.decode(data[:cut])
    with pytest.raises(FormatError, match="does not match its digest"):
        LayerIndex.decode(data, expected_sha256="0" * 64)


def test_a_zstd_bomb_is_refused_in_bounded_memory(monkeypatch):
    import struct
    import tracemalloc

    from bootseer.blockstore.objects import format as fmt

    monkeypatch.setattr(fmt, "MAX_INDEX_BYTES", 1 << 20)
    compressed = zstandard.ZstdCompressor().compress(b"{" + b" " * (32 << 20) + b"}")
    data = struct.pack("<8sIQ32s", b"BSLIDX01", 1, len(compressed), hashlib.sha256(compressed).digest()) + compressed
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="larger than 1048576 bytes"):
            LayerIndex.decode(data)
        with pytest.raises(FormatError, match="larger than"):
            DedupSegment.decode(b"BSDEDUP1" + compressed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # the limit and a piece, not the 32 MiB the bomb holds


def _reencode(index: LayerIndex, document_change=None) -> bytes:
    """An index object with a consistent header around a (possibly changed) JSON document."""
    payload = json.loads(zstandard.ZstdDecompressor().stream_reader(index.encode()[52:]).read())
    if document_change:
        document_change(payload)
    compressed = zstandard.ZstdCompressor().compress(json.dumps(payload).encode())
    import struct

    return struct.pack("<8sIQ32s", b"BSLIDX01", 1, len(compressed), hashlib.sha256(compressed).digest()) + compressed


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["entries"].__setitem__(2, {**d["entries"][2], "p": "nodir/f"}), "parent is not a directory"),
        (lambda d: d["entries"].__setitem__(2, {**d["entries"][2], "p": "dir/../../etc/passwd"}), "'..' component"),
        (lambda d: d["entries"].__setitem__(2, {**d["entries"][2], "p": "/etc/passwd"}), "absolute"),
        (lambda d: d["entries"].__setitem__(3, {**d["entries"][3], "h": 5}), "hard link"),
        (lambda d: d["entries"].__setitem__(2, {**d["entries"][2], "b": [7]}), "out of range"),
        (lambda d: d["entries"].__setitem__(2, {**d["entries"][2], "s": 99}), "holds 12 bytes, not 99"),
        (lambda d: d["entries"].__setitem__(5, {**d["entries"][5], "s": 3}), "symlink"),
        (lambda d: d["entries"].append(d["entries"][2]), "listed twice"),
        (lambda d: d["blocks"].__setitem__(0, [d["blocks"][0][0], 4, 0, 21, 12]), "bad pack reference"),
        (lambda d: d["blocks"].__setitem__(1, [d["blocks"][1][0], -1, 5, 0, BS]), "zero block"),
        (lambda d: d.__setitem__("block_size", 3), "block size"),
        (lambda d: d.__setitem__("format", 2), "format"),
        (lambda d: d["entries"].__setitem__(1, {**d["entries"][1], "x": {"a": "!!notbase64"}}), "malformed"),
        (lambda d: d["entries"].__setitem__(1, {**d["entries"][1], "x": {"a\u0000b": ""}}), "bad name"),
        (lambda d: d["entries"].__setitem__(1, {**d["entries"][1], "x": {"user.v": "A" * 90000}}), "value over"),
        (lambda d: d["entries"].__setitem__(8, {**d["entries"][8], "p": "f" * 256}), "longer than 255"),
        (lambda d: d["entries"].__setitem__(8, {**d["entries"][8], "d": [1, 3]}), "device number"),
        (lambda d: d["entries"].__setitem__(8, {**d["entries"][8], "l": "/etc"}), "link target on a fifo"),
        (lambda d: d["entries"].__setitem__(8, {**d["entries"][8], "p": "fi\ud800fo"}), r"'\\ud800' at 2 stands for no bytes"),
        (lambda d: d["entries"].__setitem__(8, {**d["entries"][8], "p": "caf\udcc3\udca9"}), "escapes bytes that are valid UTF-8"),
        (lambda d: d["entries"].__setitem__(8, {**d["entries"][8], "p": "\udc41"}), "stands for no bytes"),
        (lambda d: d["entries"].__setitem__(5, {**d["entries"][5], "l": "/etc/\udfff"}), "link target: .* stands for no bytes"),
        (lambda d: d["entries"].__setitem__(1, {**d["entries"][1], "x": {"user.\ud800": ""}}), "xattr name: .* stands for no bytes"),
        (lambda d: d["entries"].__setitem__(1, {**d["entries"][1], "x": {"trusted.overlay.redirect": "L2V0Yw=="}}), "overlayfs metadata"),
    ],
    ids=["orphan", "dot-dot", "absolute", "link-forward", "block-range", "size", "symlink-size", "twice",
         "pack-range", "zero-stored", "block-size", "version", "xattr", "xattr-name", "xattr-value", "long-name",
         "rdev-on-fifo", "target-on-fifo", "name-lone-surrogate", "name-second-spelling", "name-ascii-escape",
         "target-lone-surrogate", "xattr-name-lone-surrogate", "xattr-redirect"],  # fmt: skip
)
def test_inconsistent_index_is_refused(change, message):
    with pytest.raises(FormatError, match=message):
        LayerIndex.decode(_reencode(small_index(), change))
    LayerIndex.decode(_reencode(small_index()))  # the unchanged document decodes


# -- chain records --------------------------------------------------------------------------------


def record(**changes) -> ChainRecord:
    base = ChainRecord(chain_id=chain_id(D1, D2), parent=D1, diff_id=D2, digest=D3, media_type="m", size=10,
                       index="e" * 64, block_size=BS, files=3, bytes=100)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_chain_record_round_trip_and_checks():
    good = record()
    assert ChainRecord.decode(good.encode(), expected_chain_id=good.chain_id) == good
    with pytest.raises(FormatError, match="stored under"):
        ChainRecord.decode(good.encode(), expected_chain_id=D3)
    with pytest.raises(FormatError, match="not the ChainID"):
        ChainRecord.decode(record(diff_id=D3).encode())
    with pytest.raises(FormatError, match="not a sha256"):
        ChainRecord.decode(record(digest="md5:abc").encode())
    with pytest.raises(FormatError, match="64 hex"):
        ChainRecord.decode(record(index="../../x").encode())
    document = json.loads(good.encode())
    for change in ({"format": 99}, {"size": "lots"}, {"chain_id": None}):
        with pytest.raises(FormatError):
            ChainRecord.decode(json.dumps({**document, **change}).encode())
    for junk in (b"", b"[]", b"\xff\xfe", b'{"format": 1}'):
        with pytest.raises(FormatError):
            ChainRecord.decode(junk)


# -- dedup segments -------------------------------------------------------------------------------


def test_dedup_segment_round_trip_and_checks():
    segment = DedupSegment(packs={"a" * 64: 100}, blocks=[StoredBlock("b" * 64, "a" * 64, 10, 50, 1000)])
    data = segment.encode()
    assert DedupSegment.decode(data, expected_sha256=hashlib.sha256(data).hexdigest()) == segment
    with pytest.raises(FormatError, match="does not match its name"):
        DedupSegment.decode(data, expected_sha256="0" * 64)
    with pytest.raises(FormatError, match="outside its pack"):
        DedupSegment.decode(DedupSegment({"a" * 64: 30}, segment.blocks).encode())
    with pytest.raises(FormatError, match="names no listed pack"):
        DedupSegment.decode(DedupSegment({"c" * 64: 100}, segment.blocks).encode())
    with pytest.raises(FormatError):
        DedupSegment.decode(data[:-3])


# -- tar semantics ------------------------------------------------------------------------------


def test_implicit_parents_get_containerds_defaults():
    entries, _, _ = parse(L.Layer((L.File("a/b/c.txt", b"x", uid=5),), add_parents=False))
    assert list(entries) == ["", "a", "a/b", "a/b/c.txt"]
    for path in ("a", "a/b"):
        assert (entries[path].type, entries[path].mode, entries[path].uid, entries[path].mtime_ns) == (EntryType.DIR, 0o755, 0, 0)


def test_root_entry_and_dot_slash_names():
    layer = L.Layer((L.raw("./", tarfile.DIRTYPE, mode=0o700), L.raw("./x//y/", tarfile.DIRTYPE), L.raw("./x/y/./f", data=b"1")),
                    add_parents=False)  # fmt: skip
    entries, _, _ = parse(layer)
    assert entries[""].mode == 0o700 and list(entries) == ["", "x", "x/y", "x/y/f"]


def test_later_entries_replace_earlier_ones():
    layer = L.Layer((
        L.Dir("d", 0o755), L.File("d/child", b"c"),
        L.Dir("d", 0o700, uid=7),  # a directory over a directory: children stay, new metadata
        L.Dir("e"), L.File("e/child", b"c"),
        L.File("e", b"now a file"),  # a file over a directory: the subtree goes
        L.File("f", b"first"), L.Symlink("f", "target"),  # anything over a file replaces it
    ))  # fmt: skip
    entries, _, sink = parse(layer)
    assert entries["d"].mode == 0o700 and entries["d"].uid == 7 and "d/child" in entries
    assert entries["e"].type is EntryType.FILE and "e/child" not in entries
    assert contents(entries, sink, "e") == b"now a file"
    assert entries["f"].type is EntryType.SYMLINK and entries["f"].target == "target"


def test_hard_links_keep_the_inode_when_the_target_is_replaced():
    layer = L.Layer((L.File("a", b"old", mode=0o600), L.Hardlink("b", "a"), L.Hardlink("c", "./b"), L.File("a", b"new")))
    entries, _, sink = parse(layer)
    assert contents(entries, sink, "a") == b"new" and entries["a"].link is None
    paths = list(entries)
    b, c = entries["b"], entries["c"]
    assert b.link is None and b.mode == 0o600 and contents(entries, sink, "b") == b"old"  # b now holds the old inode
    assert c.link == paths.index("b") and c.size == 3


def test_whiteouts_and_opaque_markers():
    layer = L.Layer((
        L.Opaque("o"), L.Dir("o", 0o711),  # the marker before its directory's own entry: still opaque
        L.Whiteout("deep/er/gone"), L.raw(".wh..wh.plnk", data=b""),
        L.File("x", b"1", xattrs={"trusted.overlay.redirect": b"/etc", "trusted.overlay.opaque": b"y", "user.k": b"v"}),
        L.Dir("by-xattr", xattrs={"trusted.overlay.opaque": b"y", "trusted.overlay.redirect": b"/etc"}),
        L.Dir("not-y", xattrs={"trusted.overlay.opaque": b"x"}),
    ), add_parents=False)  # fmt: skip
    entries, _, _ = parse(layer)
    assert entries["o"].xattrs == {"trusted.overlay.opaque": b"y"} and entries["o"].mode == 0o711
    gone = entries["deep/er/gone"]
    assert (gone.type, gone.rdev, gone.mode) == (EntryType.CHAR, (0, 0), 0)
    assert entries["deep/er"].type is EntryType.DIR
    assert not any(".wh." in path for path in entries)
    assert entries["x"].xattrs == {"user.k": b"v"}  # overlayfs metadata from the tar itself is dropped...
    assert entries["by-xattr"].xattrs == {"trusted.overlay.opaque": b"y"}  # ...but for opaque=y on a directory
    assert entries["not-y"].xattrs == {}


#: overlayfs's own xattrs (those a root mount acts on on a lower layer, kernel 6.18: redirect, metacopy,
#: origin, whiteout(s) and opaque ``x``, escaped ``overlay.*``, and its bookkeeping), the ``userxattr``
#: spellings of a few, and ordinary xattrs.
OVERLAY_XATTR_CASES = [
    *(f"trusted.overlay.{name}" for name in ("redirect", "metacopy", "origin", "upper", "impure", "nlink", "whiteout",
                                             "whiteouts", "protattr", "uuid", "overlay.opaque", "overlay.redirect")),
    "user.overlay.redirect", "user.overlay.metacopy", "user.overlay.opaque", "user.k", "trusted.t", "security.capability",
]  # fmt: skip


def _accepted_by_index(entry: Entry) -> bool:
    index = LayerIndex(diff_id=D1, block_size=BS, entries=[Entry("", EntryType.DIR, 0o755), entry], blocks=[], packs=[])
    try:
        LayerIndex.decode(index.encode())
    except FormatError as exc:
        assert "overlayfs metadata" in str(exc), exc
        return False
    return True


@pytest.mark.parametrize("value", [b"y", b"x", b"/etc"])
def test_index_validation_refuses_exactly_the_overlayfs_xattrs_the_converter_drops(value):
    """One rule for both: a hand-written index carries no overlayfs metadata a converted one could not."""
    cases = [*OVERLAY_XATTR_CASES, "trusted.overlay.opaque"]
    layer = L.Layer(tuple(node for number, name in enumerate(cases)
                          for node in (L.Dir(f"d{number}", xattrs={name: value}), L.File(f"f{number}", b"", xattrs={name: value}))),
                    add_parents=False)  # fmt: skip
    entries, _, _ = parse(layer)
    for number, name in enumerate(cases):
        for path in (f"d{number}", f"f{number}"):
            kept = name in entries[path].xattrs
            assert kept == _accepted_by_index(entries[path] if kept else dataclasses.replace(
                entries[path], path="e", xattrs={name: value})), (name, value, path)  # fmt: skip
    kept = {name for number, name in enumerate(cases) if name in entries[f"d{number}"].xattrs}
    overlay = {name for name in kept if name.startswith("trusted.overlay.")}
    assert overlay == ({"trusted.overlay.opaque"} if value == b"y" else set())  # opaque=y on a directory only
    assert {"user.overlay.redirect", "user.overlay.metacopy", "user.k", "trusted.t"} <= kept  # the layer's own data


@pytest.mark.parametrize("name", [".wh.", ".wh..", ".wh...", "d/.wh.."])
def test_whiteouts_of_no_name_are_refused(name):
    with pytest.raises(LayerError, match="names no entry"):
        parse(L.Layer((L.raw(name, data=b""),), add_parents=False))


def test_diff_id_covers_every_byte_and_compression_is_detected():
    layer = L.Layer((L.File("f", b"data" * 1000),))
    tar = L.layer_tar(layer)
    for compress, name in ((lambda b: b, "none"), (lambda b: gzip.compress(b, mtime=0), "gzip"),
                           (lambda b: zstandard.ZstdCompressor().compress(b), "zstd")):  # fmt: skip
        _, parsed, _ = parse(layer, compress)
        assert parsed.diff_id == "sha256:" + hashlib.sha256(tar).hexdigest() and parsed.compression == name
        assert parsed.tar_bytes == len(tar) and parsed.file_bytes == 4000


def test_a_tar_without_its_end_marker_is_accepted():
    entries, parsed, _ = parse(L.Layer((L.File("f", b"x"),), end_marker=False))
    assert "f" in entries


def test_file_contents_are_cut_into_blocks():
    data = bytes(range(256)) * (3 * BS // 256) + b"tail"
    entries, _, sink = parse(L.Layer((L.File("f", data), L.File("empty", b""))))
    assert [len(sink.data[b]) for b in entries["f"].blocks] == [BS, BS, BS, 4]
    assert contents(entries, sink, "f") == data and entries["empty"].blocks == () and entries["empty"].size == 0


def test_sparse_files_read_as_zeros_between_runs():
    sparse = L.Sparse("s", 3 * BS + 5, ((10, b"abc"), (2 * BS, b"xyz")))
    entries, _, sink = parse(L.Layer((sparse,)))
    assert contents(entries, sink, "s") == sparse.data() and entries["s"].size == 3 * BS + 5


def test_a_tree_2000_deep_and_replaced_whole():
    deep = "/".join(["d"] * 2000)
    entries, _, _ = parse(L.Layer((L.File(f"{deep}/f", b"x"), L.File("d", b"flat now")), add_parents=False))
    assert list(entries) == ["", "d"]
    entries, _, _ = parse(L.Layer((L.File(f"{deep}/f", b"x"),), add_parents=False))
    assert len(entries) == 2002 and LayerIndex.decode(LayerIndex(D1, BS, list(entries.values()),
                                                                 [Block("0" * 64, ZERO_PACK, 0, 0, 1)], []).encode())  # fmt: skip


def test_errors_name_the_entry():
    with pytest.raises(LayerError) as caught:
        parse(L.Layer((L.File("ok", b""), L.raw("../../x", data=b"")), add_parents=False))
    assert caught.value.entry == "../../x" and "path traversal" in caught.value.reason
    assert str(caught.value).startswith("entry '../../x': ")


def _pax_sparse_10(map_text: bytes, realsize: int = 100) -> L.Raw:
    """A PAX 1.0 sparse member whose data begins with ``map_text`` (the map GNU tar writes there)."""
    info = tarfile.TarInfo("GNUSparseFile.0/s")
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "s",
                        "GNU.sparse.realsize": str(realsize)}  # fmt: skip
    data = map_text + b"\0" * (-len(map_text) % 512) + b"payload!"
    info.size = len(data)
    return L.Raw(info, data)


def test_pax_sparse_1_0_maps():
    entries, _, sink = parse(L.Layer((_pax_sparse_10(b"1\n10\n8\n"),), add_parents=False))
    assert entries["s"].size == 100 and contents(entries, sink, "s") == bytes(10) + b"payload!" + bytes(82)
    for map_text, reason in ((b"99999999\n", "sparse map of 99999999 runs"), (b"two\n", "malformed PAX 1.0 sparse map"),
                             (b"1" * 600, "malformed PAX 1.0 sparse map"), (b"1\n200\n8\n", "ends past the size")):  # fmt: skip
        with pytest.raises(LayerError, match=reason):
            parse(L.Layer((_pax_sparse_10(map_text),), add_parents=False))
