"""blockstore.datapath.erofs_check: the bounded check of an EROFS image before the kernel sees it.

What the writer (``blockstore.objects.erofs_image``) writes passes, node-built and with small
files inline (hand-made and random indexes, and the real converter's images), and reads back
as the index it was written from, entry by entry; ``fsck.erofs`` accepts the same images.
Each malformation the check exists for is made by patching bytes of a good image and must be
refused naming it; random byte flips and truncations are refused with ImageRefused or pass,
never another exception.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import shutil
import struct
import subprocess
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from bootseer.blockstore.convert.layer_image import inline_candidates
from bootseer.blockstore.datapath.erofs_check import ImageRefused, ImageSummary, TreeEntry, check_image, read_tree
from bootseer.blockstore.objects.erofs_image import BLOCK_SIZE, build_image
from bootseer.blockstore.objects.format import Block, Entry, EntryType, LayerIndex
from tests.blockstore.test_erofs import (
    DIFF_ID,
    PACK,
    every_kind_index,
    many_chunks_index,
    random_index,
    wide_and_deep_index,
)
from tests.support.layer_store import build_store, stored_image
from tests.support.oci import rich_layers
from tests.support.trees import read_block


def stored(data: bytes, offset: int = 0) -> Block:
    """A block of ``data`` in the (made-up) pack: the writer needs only its length and whether it is zeros."""
    return Block(hashlib.sha256(data).hexdigest(), 0, offset, 100, len(data))


def check(image: bytes, index: LayerIndex, **override: int) -> ImageSummary:
    limits = dict(blob_size=index.blob_size, chunk_size=index.block_size, max_inodes=len(index.entries)) | override
    return check_image(image, **limits)


def tree(image: bytes, index: LayerIndex) -> dict[str, TreeEntry]:
    entries = list(read_tree(image, blob_size=index.blob_size, chunk_size=index.block_size, max_inodes=len(index.entries)))
    out = {entry.path: entry for entry in entries}
    assert len(out) == len(entries), "a path is yielded twice"
    return out


def expected_tree(index: LayerIndex, inline: dict[int, bytes]) -> dict[str, TreeEntry]:
    """What read_tree must give for ``index`` written with ``inline``: every entry, a hard link as the file it names."""
    entries = index.entries
    names = Counter(number if entry.link is None else entry.link for number, entry in enumerate(entries))
    subdirectories = Counter(entry.parent for entry in entries[1:] if entry.type is EntryType.DIR)
    per_block = index.block_size // BLOCK_SIZE
    out = {}
    for number, entry in enumerate(entries):
        owner = number if entry.link is None else entry.link
        inode = entries[owner]
        chunks: tuple[int | None, ...] = ()
        data = None
        if inode.type is EntryType.FILE:
            if owner in inline:
                data = inline[owner]
            elif inode.size:
                chunks = tuple(None if index.blocks[block].is_zero else block * per_block for block in inode.blocks)
            else:
                data = b""
        nlink = 2 + subdirectories[entry.path] if inode.type is EntryType.DIR else names[owner]
        out[entry.path] = TreeEntry(entry.path, inode.type, inode.mode, inode.uid, inode.gid, inode.mtime_ns, inode.size, nlink,
                                    inode.xattrs, inode.rdev, inode.target, chunks, data)  # fmt: skip
    return out


def inline_of(index: LayerIndex, which: str, seed: int = 0) -> dict[int, bytes]:
    """File bytes for the writer's ``inline``: none, the files of one block of at most 4 KiB (the converter's
    default), or every non-empty regular file (any size: whole blocks and a tail)."""
    rng = random.Random(seed)
    out = {}
    for number, entry in enumerate(index.entries):
        if entry.type is not EntryType.FILE or entry.link is not None or not entry.size or which == "none":
            continue
        if which == "all" or entry.size <= 4096:
            out[number] = rng.randbytes(entry.size)
    return out


def inline_sizes_index() -> LayerIndex:
    """Files of every size class an inline file's layout turns on: a tail alone, a whole block, blocks and a
    tail, and tails that cannot follow their inode (4000 bytes after 64 + xattrs): FLAT_PLAIN with a tail."""
    sizes = (1, 100, 4095, 4096, 4097, 3 * 4096, 2 * 4096 + 4000, 4000, 5000)
    blocks = [stored(bytes([n]) * 4096) for n in range(1, 4)]
    blocks += [stored(bytes(size % 4096), n) for n, size in enumerate(sizes) if size % 4096]
    short = {size % 4096: 3 + n for n, size in enumerate(s for s in sizes if s % 4096)}
    entries = [Entry("", EntryType.DIR, 0o755)]
    for number, size in enumerate(sizes):
        whole = (0, 1, 2)[: size // 4096] + ((short[size % 4096],) if size % 4096 else ())
        entries.append(Entry(f"f{number}", EntryType.FILE, 0o644, size=size, blocks=whole, xattrs={"user.pad": bytes(200)}))
    index = LayerIndex(DIFF_ID, BLOCK_SIZE, entries, blocks, [PACK])
    index.validate()
    return index


INDEXES: dict[str, Callable[[], LayerIndex]] = {
    "inline-sizes": inline_sizes_index,
    "every-kind": every_kind_index,
    "every-kind-64k": lambda: every_kind_index(64 << 10),
    "random-1": lambda: random_index(1),
    "random-2": lambda: random_index(2),
    "random-3": lambda: random_index(3),
    "wide-and-deep": wide_and_deep_index,
    "many-chunks": lambda: many_chunks_index(300)[0],
}


def summary_of(index: LayerIndex, inline: dict[int, bytes]) -> ImageSummary:
    inodes = [entry for entry in index.entries if entry.link is None]
    files = [(number, entry) for number, entry in enumerate(index.entries) if entry.type is EntryType.FILE and entry.link is None]
    return ImageSummary(
        inodes=len(inodes),
        directories=sum(entry.type is EntryType.DIR for entry in inodes),
        files=len(files),
        inline_bytes=sum(len(data) for data in inline.values()),
        chunks=sum(len(entry.blocks) for number, entry in files if number not in inline),
    )


# -- what the writer writes passes, and reads back as its index --------------------------------------


@pytest.mark.parametrize("which", ["none", "small", "all"])
@pytest.mark.parametrize("name", list(INDEXES))
def test_writer_images_pass_and_read_back_as_their_index(name: str, which: str) -> None:
    index = INDEXES[name]()
    inline = inline_of(index, which)
    image = build_image(index, inline=inline)
    assert check(image, index) == summary_of(index, inline)
    assert check(memoryview(image), index) == summary_of(index, inline)
    got, want = tree(image, index), expected_tree(index, inline)
    assert got.keys() == want.keys()
    for path, entry in got.items():
        if entry.type is EntryType.DIR:  # a directory's size is its dirents', which the index does not say
            assert entry.size > 0
            entry = dataclasses.replace(entry, size=0)
        assert entry == want[path], path


def test_the_test_indexes_cover_every_layout_the_writer_has() -> None:
    """Inline files of whole blocks, of a tail, of both, and tails that do not fit after their inode."""
    index = inline_sizes_index()
    image = build_image(index, inline=inline_of(index, "all"))
    layouts = Counter()
    for at in range(0, len(image) - 64, 32):  # every slot that holds an inode of a regular file with data
        (i_format, _, mode, _, size) = struct.unpack_from("<HHHHQ", image, at)
        if i_format in (1, 5, 9) and mode >> 12 == 0o10 and 0 < size < 1 << 20 and image[at + 48 : at + 64] == bytes(16):
            layouts[i_format >> 1, size % BLOCK_SIZE == 0, size > BLOCK_SIZE] += 1
    assert layouts[0, False, False] and layouts[0, False, True] and layouts[2, False, False] and layouts[2, False, True]
    assert layouts[0, True, False] and layouts[0, True, True], layouts


def test_the_converters_images_pass_and_hold_the_files_bytes(tmp_path: Path) -> None:
    block_size = 64 << 10
    store = tmp_path / "store"
    layers = build_store(store, rich_layers(block_size), block_size=block_size, layout=tmp_path / "layout")
    inlined = 0
    for layer in layers:
        table, image = stored_image(store, layer.record)
        index = layer.index
        inline = {number: read_block(store, index, index.entries[number].blocks[0])
                  for number in inline_candidates(index, table.inline_max)}  # fmt: skip
        assert check(image, index) == summary_of(index, inline)
        got, want = tree(image, index), expected_tree(index, inline)
        assert {path: dataclasses.replace(entry, size=0) if entry.type is EntryType.DIR else entry for path, entry in got.items()} == want
        inlined += len(inline)
    assert inlined, "the test layers have small files"


@pytest.mark.skipif(shutil.which("fsck.erofs") is None, reason="fsck.erofs (erofs-utils) is not installed")
@pytest.mark.parametrize(("name", "which"), [("every-kind", "none"), ("every-kind", "all"), ("inline-sizes", "all"), ("random-1", "small"),
                                             ("random-2", "all"), ("many-chunks", "none")])  # fmt: skip
def test_fsck_accepts_the_images_the_check_accepts(name: str, which: str, tmp_path: Path) -> None:
    index = INDEXES[name]()
    image = build_image(index, inline=inline_of(index, which))
    check(image, index)
    path, blob = tmp_path / "image.erofs", tmp_path / "image.blob"
    path.write_bytes(image)
    with open(blob, "wb") as out:
        out.truncate(index.blob_size)
    done = subprocess.run(["fsck.erofs", f"--device={blob}", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "<E>" not in done.stdout + done.stderr, done.stdout + done.stderr


def test_arguments_no_layer_has_are_the_callers_error() -> None:
    index = every_kind_index()
    image = build_image(index)
    for limits in (dict(chunk_size=12288), dict(chunk_size=2048), dict(blob_size=-1), dict(max_inodes=0)):
        with pytest.raises(ValueError) as excinfo:
            check(image, index, **limits)
        assert not isinstance(excinfo.value, ImageRefused)


# -- each malformation, made by patching a good image -----------------------------------------------


def small_index() -> tuple[LayerIndex, dict[int, bytes]]:
    """A layer of one entry of each kind the patches need: ``ab`` chunk-based (two names), ``cd`` inline after
    its inode, ``f4k`` in a data block of the image."""
    data = b"\x01" * BLOCK_SIZE
    blocks = [stored(data), stored(data[:100], 1), stored(b"0123456789", 2), stored(b"\x02" * BLOCK_SIZE, 3)]
    entries = [
        Entry("", EntryType.DIR, 0o755),
        Entry("ab", EntryType.FILE, 0o644, size=BLOCK_SIZE + 100, blocks=(0, 1)),
        Entry("ab2", EntryType.FILE, 0o644, link=1),
        Entry("cd", EntryType.FILE, 0o644, size=10, blocks=(2,)),
        Entry("d", EntryType.DIR, 0o755),
        Entry("d/sub", EntryType.DIR, 0o755),
        Entry("e", EntryType.DIR, 0o755),
        Entry("f4k", EntryType.FILE, 0o644, size=BLOCK_SIZE, blocks=(3,)),
        Entry("link", EntryType.SYMLINK, 0o777, size=10, target="tgt-marker"),
        Entry("xa", EntryType.FILE, 0o644, xattrs={"user.k": b"v"}),
    ]
    index = LayerIndex(DIFF_ID, BLOCK_SIZE, entries, blocks, [PACK])
    index.validate()
    return index, {3: b"0123456789", 7: b"\x02" * BLOCK_SIZE}


class Image:
    """A good image of :func:`small_index` to patch, and where its parts are."""

    def __init__(self, index: LayerIndex | None = None, inline: dict[int, bytes] | None = None) -> None:
        self.index, inline = (index, inline or {}) if index is not None else small_index()
        self.bytes = bytearray(build_image(self.index, inline=inline))
        self.root = struct.unpack_from("<H", self.bytes, 1024 + 14)[0]

    def listing(self, nid: int) -> dict[bytes, tuple[int, int, int]]:
        """A directory inlined after its inode (as every one here is): name -> (its dirent's offset, its nid, its name's offset)."""
        at = nid * 32
        i_format, icount, _, _, size = struct.unpack_from("<HHHHQ", self.bytes, at)
        assert (i_format, icount) == (5, 0) and size < 4096
        start = at + 64
        count = struct.unpack_from("<H", self.bytes, start + 8)[0] // 12
        dirents = [struct.unpack_from("<QH", self.bytes, start + 12 * n) for n in range(count)]
        ends = [offset for _, offset in dirents[1:]] + [size]
        return {bytes(self.bytes[start + offset : start + end]): (start + 12 * n, child, start + offset)
                for n, ((child, offset), end) in enumerate(zip(dirents, ends))}  # fmt: skip

    def where(self, path: str) -> tuple[int, int, int]:
        """The dirent of ``path`` ("d/sub", "d/.", ".."): its offset, the nid it names, its name's offset."""
        nid = self.root
        parts = path.split("/")
        for part in parts[:-1]:
            nid = self.listing(nid)[part.encode()][1]
        return self.listing(nid)[parts[-1].encode()]

    def dirent(self, path: str) -> int:
        return self.where(path)[0]

    def name(self, path: str) -> int:
        return self.where(path)[2]

    def nid(self, path: str) -> int:
        return struct.unpack_from("<Q", self.bytes, self.dirent(path))[0]

    def inode(self, path: str) -> int:
        return self.nid(path) * 32 if path else self.root * 32

    def put(self, fmt: str, at: int, *values: int) -> None:
        struct.pack_into(fmt, self.bytes, at, *values)


def _swap_names(image: Image) -> None:
    at_ab, at_cd = image.name("ab"), image.name("cd")
    image.bytes[at_ab : at_ab + 2], image.bytes[at_cd : at_cd + 2] = b"cd", b"ab"


def _past_the_blob(image: Image) -> None:
    image.put("<I", image.inode("ab") + 64 + 12, image.index.blob_size // BLOCK_SIZE)


def _bad_device(image: Image) -> None:
    image.put("<H", image.inode("ab") + 64 + 2, 2)


def _tail_across(image: Image) -> None:
    at = image.inode("cd")
    image.put("<Q", at + 8, BLOCK_SIZE - at % BLOCK_SIZE - 64 + 1)  # one byte more than the inode's block holds


def _symlink_nul(image: Image) -> None:
    image.bytes[image.bytes.index(b"tgt-marker") + 3] = 0


MALFORMED: dict[str, tuple[Callable[[Image], object], str]] = {
    # superblock and device table
    "bad magic": (lambda i: i.put("<I", 1024, 0xE0F5E1E3), "magic 0xe0f5e1e3"),
    "block size": (lambda i: i.put("<B", 1024 + 12, 13), "block size 2^13"),
    "extra incompat feature bit": (lambda i: i.put("<I", 1024 + 80, 0x1C), "incompat features 0x1c"),
    "a compat feature": (lambda i: i.put("<I", 1024 + 8, 1), "compat features 0x1"),
    "two devices": (lambda i: i.put("<H", 1024 + 86, 2), "2 extra devices"),
    "wrong device size": (lambda i: i.put("<I", 1152 + 64, 7), "the blob is 7 blocks, but this layer's is 4"),
    "a field the writer leaves zero": (lambda i: i.put("<I", 1024 + 40, 1), "meta_blkaddr is set"),
    "more blocks than the image": (lambda i: i.put("<I", 1024 + 36, len(i.bytes) // BLOCK_SIZE + 1), "blocks, but the image is"),
    "root not a directory": (lambda i: i.put("<H", 1024 + 14, i.nid("xa")), "the root is not a directory"),
    "root out of range": (lambda i: i.put("<H", 1024 + 14, 3), "nid 3 (''): out of range"),
    # inodes
    "inode nid out of range": (lambda i: i.put("<Q", i.dirent("ab"), len(i.bytes) // 32), "('ab'): out of range"),
    "inode straddling a block": (lambda i: i.put("<Q", i.dirent("ab"), BLOCK_SIZE // 32 - 1), "straddles a 4 KiB block"),
    "compact inode": (lambda i: i.put("<H", i.inode("xa"), 0), "('xa'): a compact inode"),
    "unknown layout": (lambda i: i.put("<H", i.inode("xa"), 1 | 3 << 1), "data layout 3"),
    "chunk-based directory": (lambda i: i.put("<H", i.inode("e"), 1 | 4 << 1), "('e'): chunk-based, but not a regular file"),
    "a socket": (lambda i: i.put("<H", i.inode("xa") + 4, 0o140644), "a file type the writer never writes"),
    "too many inodes": (lambda i: i.put("<Q", 1024 + 16, 11), "11 inodes, not 1..10"),
    "superblock miscounts inodes": (lambda i: i.put("<Q", 1024 + 16, 10), "10 inodes, but the tree has 9"),
    "superblock undercounts inodes": (lambda i: i.put("<Q", 1024 + 16, 8), "i_ino 9 is not a fresh number in 1..8"),
    "reserved inode bytes": (lambda i: i.put("<B", i.inode("xa") + 60, 1), "reserved inode bytes"),
    "wrong nlink": (lambda i: i.put("<I", i.inode("ab") + 44, 3), "('ab'): nlink 3, but 2 names"),
    "wrong directory nlink": (lambda i: i.put("<I", i.inode("d") + 44, 2), "('d'): nlink 2, but 1 subdirectories"),
    # xattrs
    "xattr past the end": (lambda i: i.put("<H", i.inode("xa") + 2, 0xFFFF), "xattr area (to byte"),
    "shared xattrs": (lambda i: i.put("<B", i.inode("xa") + 64 + 4, 1), "1 shared xattrs"),
    "xattr name index": (lambda i: i.put("<B", i.inode("xa") + 64 + 12 + 1, 5), "xattr name index 5"),
    "xattr entry past its size": (lambda i: i.put("<H", i.inode("xa") + 64 + 12 + 2, 40), "runs past the inode's declared xattr size"),
    # data
    "chunk past the blob": (_past_the_blob, "chunk 1 at blob block 4 is past the blob"),
    "bad chunk device": (_bad_device, "chunk 0: device id 2"),
    "wrong chunk format": (lambda i: i.put("<I", i.inode("ab") + 16, 0x21), "chunk format 0x21"),
    "file larger than its chunks": (lambda i: i.put("<Q", i.inode("ab") + 8, 3 * BLOCK_SIZE), "chunk 2: device id"),
    "inline tail crossing a block": (_tail_across, "inline tail at byte"),
    "data past the image": (lambda i: i.put("<I", i.inode("f4k") + 16, 100), "('f4k'): its 1 data blocks at block 100 are past the end"),
    "data over the superblock": (lambda i: i.put("<I", i.inode("f4k") + 16, 0), "('f4k'): its data overlaps the superblock or another"),
    "an inline tail over the next inode": (lambda i: i.put("<Q", i.inode("cd") + 8, 200), "('d'): its record overlaps"),
    # directories
    "directory loop": (lambda i: i.put("<Q", i.dirent("d/sub"), i.root), "('d/sub'): a directory reached twice"),
    "directory hard link": (lambda i: i.put("<Q", i.dirent("e"), i.nid("d")), "('e'): a directory reached twice"),
    "name with '/'": (lambda i: i.put("<B", i.name("xa") + 1, ord("/")), "a name with '/': b'x/'"),
    "name with NUL": (lambda i: i.put("<B", i.name("ab") + 1, 0), "a name with a NUL byte: b'a\\x00'"),
    "unsorted names": (_swap_names, "names not strictly sorted: b'ab2' after b'cd'"),
    "'.' elsewhere": (lambda i: i.put("<Q", i.dirent("d/."), i.root), "'.' is nid"),
    "'..' of the root": (lambda i: i.put("<Q", i.dirent(".."), i.nid("d")), "'..' is nid"),
    "no '.'": (lambda i: i.put("<B", i.name("e/."), ord("-")), "('e'): a directory without '.' or '..'"),
    "an empty name": (lambda i: i.put("<H", i.dirent("ab2") + 8, i.name("ab") - i.inode("") - 64), "a name of 0 bytes (1..255)"),
    "dirent type disagrees": (lambda i: i.put("<B", i.dirent("link") + 10, 1), "('link'): its dirent says file type 1"),
    "first name offset": (lambda i: i.put("<H", i.inode("") + 64 + 8, 13), "first name offset 13"),
    "directory larger than its names": (lambda i: i.put("<Q", i.inode("d") + 8, struct.unpack_from("<Q", i.bytes, i.inode("d") + 8)[0] + 1),
                                        "size runs past its last name"),
    # symlinks
    "symlink with NUL": (_symlink_nul, "('link'): a symlink target with a NUL byte"),
    "empty symlink": (lambda i: i.put("<Q", i.inode("link") + 8, 0), "an empty symlink"),
    "symlink too long": (lambda i: i.put("<Q", i.inode("link") + 8, 5000), "a symlink target of 5000 bytes"),
    # the image's length
    "truncated within a block": (lambda i: i.bytes.__delitem__(slice(-100, None)), "not a whole number of 4096-byte blocks"),
    "truncated by a block": (lambda i: i.bytes.__delitem__(slice(-BLOCK_SIZE, None)), "blocks, but the image is"),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_each_malformation_is_refused_naming_it(what: str) -> None:
    image = Image()
    check(bytes(image.bytes), image.index)  # good before the patch
    patch, message = MALFORMED[what]
    patch(image)
    with pytest.raises(ImageRefused) as excinfo:
        check(bytes(image.bytes), image.index)
    assert message in str(excinfo.value) and "\n" not in str(excinfo.value)
    with pytest.raises(ImageRefused) as again:
        list(read_tree(bytes(image.bytes), blob_size=image.index.blob_size, chunk_size=BLOCK_SIZE, max_inodes=len(image.index.entries)))
    assert str(again.value) == str(excinfo.value)


def test_a_chunk_not_aligned_to_a_chunk_is_refused() -> None:
    data = b"\x01" * (64 << 10)
    entries = [Entry("", EntryType.DIR, 0o755), Entry("big", EntryType.FILE, 0o644, size=len(data), blocks=(1,))]
    index = LayerIndex(DIFF_ID, 64 << 10, entries, [stored(data), stored(data, 1)], [PACK])
    image = Image(index)
    assert check(bytes(image.bytes), index).chunks == 1
    image.put("<I", image.inode("big") + 64 + 4, 17)  # block 1 is at 16 (4 KiB units); 17 is inside it
    with pytest.raises(ImageRefused) as excinfo:
        check(bytes(image.bytes), index)
    assert "('big'): chunk 0 at blob block 17 is past the blob or not aligned to a chunk" in str(excinfo.value)


def test_a_tree_larger_than_the_layer_is_refused() -> None:
    image = Image()
    with pytest.raises(ImageRefused) as excinfo:
        check(bytes(image.bytes), image.index, max_inodes=8)
    assert "9 inodes, not 1..8" in str(excinfo.value)


def test_overlayfs_metadata_in_an_image_is_refused() -> None:
    """The writer writes any trusted.* xattr it is given; an image carrying overlayfs's redirect is refused."""
    redirected = Entry("d", EntryType.DIR, 0o755, xattrs={"trusted.overlay.redirect": b"/etc"})
    index = LayerIndex(DIFF_ID, BLOCK_SIZE, [Entry("", EntryType.DIR, 0o755), redirected], [], [])
    with pytest.raises(ImageRefused) as excinfo:
        check(build_image(index), index)
    assert "('d'): xattr 'trusted.overlay.redirect' is overlayfs metadata" in str(excinfo.value)


# -- random damage: refused or accepted, never another exception ------------------------------------


def test_random_flips_and_truncations_are_refused_or_pass_and_nothing_else() -> None:
    index = random_index(4, entries=150)
    image = build_image(index, inline=inline_of(index, "small"))
    limits = dict(blob_size=index.blob_size, chunk_size=index.block_size, max_inodes=len(index.entries))
    rng = random.Random(24)
    outcomes: Counter[str] = Counter()
    for trial in range(2000):
        damaged = bytearray(image)
        kind = rng.random()
        if kind < 0.1:  # truncated, at a block boundary or anywhere
            cut = rng.randrange(len(image))
            damaged = damaged[: cut - cut % BLOCK_SIZE if rng.random() < 0.5 else cut]
        else:  # most damage in the metadata (the front of the image), where the check has something to read
            for _ in range(rng.choice((1, 1, 2, 4))):
                at = 1024 + int(rng.random() ** 2 * (len(image) - 1028))
                if kind < 0.55:
                    damaged[at] ^= 1 << rng.randrange(8)
                else:  # a whole field: zero, all ones, small, or random
                    value = rng.choice((0, 0xFFFFFFFF, rng.randrange(64), rng.getrandbits(32)))
                    damaged[at : at + 4] = value.to_bytes(4, "little")
        try:
            check_image(bytes(damaged), **limits)
            if trial % 10 == 0:
                list(read_tree(bytes(damaged), **limits))
            outcomes["passed"] += 1
        except ImageRefused:
            outcomes["refused"] += 1
    # Most flips that pass land in what the check has no rule for: xattr values, symlink targets, file bytes, mtimes.
    assert outcomes["refused"] > 500 and outcomes["passed"] > 100, outcomes
