"""blockstore.datapath.tree: the nodes a layer server shows, from a layer index, without a mount.

What the kernel sees through them (a real FUSE mount, overlayfs over it, against
``tar -x``) is tests/blockstore/test_layer_server.py; here: inode numbers, link counts, device
numbers, xattrs, names and reads, checked node by node on an index built by hand.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

import pytest
import trio

from bootseer.blockstore.objects.format import ZERO_PACK, Block, Entry, EntryType, FormatError, LayerIndex
from bootseer.blockstore.datapath.tree import (
    SLOT_SHIFT,
    LayerDirectory,
    LayerFile,
    LayersRoot,
    LayerSpecial,
    LayerSymlink,
    LayerTree,
    inode_number,
)
from bootseer.fuse import ReadOnlyOperations
from bootseer.fuse.inodes import ROOT_INODE

BS = 4096
DATA = bytes(range(256)) * 40  # 10240 bytes: three blocks, the last one short


class RecordingReader:
    """The layer reader's contract over DATA, remembering every read it was asked for."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.short = False

    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        self.reads.append((entry.path, offset, size))
        data = DATA[offset : offset + size]
        return data[:-1] if self.short else data


def _index() -> LayerIndex:
    blocks = [
        Block(hashlib.sha256(DATA[i : i + BS]).hexdigest(), 0, i, 100, len(DATA[i : i + BS])) for i in range(0, len(DATA), BS)
    ]
    blocks.append(Block(hashlib.sha256(bytes(BS)).hexdigest(), ZERO_PACK, 0, 0, BS))
    entries = [
        Entry("", EntryType.DIR, 0o755, mtime_ns=5),
        Entry("bin", EntryType.DIR, 0o755),
        Entry("bin/tool", EntryType.FILE, 0o4755, uid=0, gid=0, size=len(DATA), blocks=(0, 1, 2),
              xattrs={"security.capability": b"\x01\x02"}),
        Entry("bin/tool-link", EntryType.FILE, 0o644, link=2),
        Entry("etc", EntryType.DIR, 0o750, uid=10, gid=20, xattrs={"trusted.overlay.opaque": b"y"}),
        Entry("etc/tool-again", EntryType.FILE, 0o600, link=2),
        Entry("etc/zero", EntryType.FILE, 0o644, size=BS, blocks=(3,)),
        Entry("etc/empty", EntryType.FILE, 0o644),
        Entry("etc/sub", EntryType.DIR, 0o755),
        Entry("gone", EntryType.CHAR, 0),
        Entry("null", EntryType.CHAR, 0o666, rdev=(1, 3)),
        Entry("sda", EntryType.BLOCK, 0o660, rdev=(8, 0)),
        Entry("fifo", EntryType.FIFO, 0o600),
        Entry("link", EntryType.SYMLINK, 0o777, size=len("/bin/tool"), target="/bin/tool"),
        Entry("caf\udce9", EntryType.FILE, 0o644),
    ]  # fmt: skip
    index = LayerIndex("sha256:" + "1" * 64, BS, entries, blocks, ["a" * 64])
    index.validate()
    return index


def _tree(slot: int = 3) -> tuple[LayerTree, RecordingReader]:
    reader = RecordingReader()
    return LayerTree(slot, _index(), reader, name="sha256:test"), reader


async def _walk(tree: LayerTree, path: str):
    node = tree.root()
    for part in filter(None, path.split("/")):
        assert isinstance(node, LayerDirectory)
        node = await node.lookup(part)
    return node


def test_inode_numbers_come_from_slot_and_entry() -> None:
    assert inode_number(1, 0) == (1 << SLOT_SHIFT) + 1
    assert inode_number(7, 4) == (7 << SLOT_SHIFT) + 5
    with pytest.raises(ValueError):
        inode_number(0, 0)  # slot 0 would collide with the mount root's inode 1
    tree, _ = _tree(slot=7)

    async def check() -> None:
        assert tree.root().inode == inode_number(7, 0) != ROOT_INODE
        assert (await _walk(tree, "etc")).inode == inode_number(7, 4)
        # Built twice (a restarted server): the same numbers.
        again, _ = _tree(slot=7)
        for path in ("bin/tool", "etc/sub", "link", "null"):
            assert (await _walk(again, path)).inode == (await _walk(tree, path)).inode

    trio.run(check)


def test_hard_links_are_one_node_with_every_name_counted() -> None:
    tree, _ = _tree()

    async def check() -> None:
        tool = await _walk(tree, "bin/tool")
        for path in ("bin/tool-link", "etc/tool-again"):
            link = await _walk(tree, path)
            assert isinstance(link, LayerFile)
            assert link.inode == tool.inode and link.key == tool.key
            assert link.attributes() == tool.attributes()
        attributes = tool.attributes()
        assert attributes.nlink == 3
        assert attributes.mode == stat.S_IFREG | 0o4755 and attributes.size == len(DATA)
        assert (await _walk(tree, "etc/zero")).attributes().nlink == 1

    trio.run(check)


def test_directories_count_their_subdirectories() -> None:
    tree, _ = _tree()

    async def check() -> None:
        assert tree.root().attributes().nlink == 4  # ".", its name, bin/.. and etc/..
        etc = await _walk(tree, "etc")
        assert etc.attributes().nlink == 3
        assert (etc.attributes().uid, etc.attributes().gid, stat.S_IMODE(etc.attributes().mode)) == (10, 20, 0o750)
        assert [name for name, _ in await etc.entries()] == ["tool-again", "zero", "empty", "sub"]
        assert tree.root().attributes().mtime_ns == 5

    trio.run(check)


def test_devices_whiteouts_fifos_symlinks_and_xattrs() -> None:
    tree, _ = _tree()

    async def check() -> None:
        gone = await _walk(tree, "gone")
        assert isinstance(gone, LayerSpecial)
        assert gone.attributes().mode == stat.S_IFCHR and gone.attributes().rdev == 0
        assert (await _walk(tree, "null")).attributes().rdev == os.makedev(1, 3)
        sda = (await _walk(tree, "sda")).attributes()
        assert stat.S_ISBLK(sda.mode) and sda.rdev == os.makedev(8, 0)
        assert stat.S_ISFIFO((await _walk(tree, "fifo")).attributes().mode)
        link = await _walk(tree, "link")
        assert isinstance(link, LayerSymlink) and await link.readlink() == "/bin/tool"
        assert link.attributes().size == len("/bin/tool")
        assert (await _walk(tree, "etc")).xattrs() == {"trusted.overlay.opaque": b"y"}
        assert (await _walk(tree, "bin/tool-link")).xattrs() == {"security.capability": b"\x01\x02"}
        assert (await _walk(tree, "bin")).xattrs() == {}
        assert (await _walk(tree, "caf\udce9")).attributes().size == 0

    trio.run(check)


def test_missing_names_and_immutability() -> None:
    tree, _ = _tree()

    async def check() -> None:
        assert tree.root().immutable
        with pytest.raises(FileNotFoundError):
            await tree.root().lookup("nothing")
        with pytest.raises(FileNotFoundError):
            await (await _walk(tree, "etc")).lookup("tool")

    trio.run(check)


def test_metadata_never_reads_and_reads_are_clipped() -> None:
    tree, reader = _tree()

    async def check() -> None:
        async def visit(directory: LayerDirectory) -> None:
            for _name, node in await directory.entries():
                node.attributes()
                node.xattrs()
                if isinstance(node, LayerDirectory):
                    await visit(node)
                elif isinstance(node, LayerSymlink):
                    await node.readlink()

        await visit(tree.root())
        assert reader.reads == []
        opened = await (await _walk(tree, "etc/tool-again")).open()
        assert opened.keep_cache
        assert await opened.read(BS - 2, 4) == DATA[BS - 2 : BS + 2]
        assert await opened.read(len(DATA) - 3, 100) == DATA[-3:]  # clipped at the end
        assert await opened.read(len(DATA), 100) == b""
        assert reader.reads == [("bin/tool", BS - 2, 4), ("bin/tool", len(DATA) - 3, 3)]
        empty = await (await _walk(tree, "etc/empty")).open()
        assert await empty.read(0, 4096) == b""
        reader.short = True
        with pytest.raises(OSError) as excinfo:
            await opened.read(0, 10)
        assert excinfo.value.errno == errno.EIO

    trio.run(check)


def test_the_root_lists_layers_by_slot() -> None:
    root = LayersRoot()
    first, _ = _tree(slot=2)
    second, _ = _tree(slot=10)
    root.layers = {10: second, 2: first}

    async def check() -> None:
        assert [name for name, _ in await root.entries()] == ["blobs", "2", "10"]
        assert (await root.lookup("10")).inode == inode_number(10, 0)
        for name in ("3", "02", "x", "", "-1"):
            with pytest.raises(FileNotFoundError):
                await root.lookup(name)
        assert not root.immutable  # layers come and go: no negative entries here
        assert root.attributes().nlink == 5  # 2, and a ".." in blobs/ and in each layer

    trio.run(check)


def test_negative_entries_only_where_the_directory_is_immutable() -> None:
    tree, _ = _tree(slot=1)
    root = LayersRoot()
    root.layers = {1: tree}
    ops = ReadOnlyOperations(root, name="layerfs-test", negative_timeout=60)

    async def check() -> None:
        layer = await ops.lookup(ROOT_INODE, b"1", None)
        missing = await ops.lookup(layer.st_ino, b"nothing", None)
        assert missing.st_ino == 0 and missing.entry_timeout == 60
        import pyfuse3

        with pytest.raises(pyfuse3.FUSEError) as excinfo:
            await ops.lookup(ROOT_INODE, b"2", None)
        assert excinfo.value.errno == errno.ENOENT
        etc = await ops.lookup(layer.st_ino, b"etc", None)
        assert await ops.getxattr(etc.st_ino, b"trusted.overlay.opaque", None) == b"y"
        assert await ops.listxattr(etc.st_ino, None) == [b"trusted.overlay.opaque"]
        with pytest.raises(pyfuse3.FUSEError) as excinfo:
            await ops.getxattr(etc.st_ino, b"user.none", None)
        assert excinfo.value.errno == errno.ENODATA
        null = await ops.lookup(layer.st_ino, b"null", None)
        assert null.st_rdev == os.makedev(1, 3)

    trio.run(check)


def test_an_index_too_large_to_number_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import bootseer.blockstore.datapath.tree as layerfs

    monkeypatch.setattr(layerfs, "MAX_ENTRIES", 5)
    with pytest.raises(FormatError, match="at most 5"):
        LayerTree(1, _index(), RecordingReader())
