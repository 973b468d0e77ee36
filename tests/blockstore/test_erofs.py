"""blockstore.objects.erofs_image: EROFS metadata images of layer indexes, checked by erofs-utils and by the kernel.

Images of the converted test layers (tests/support/oci.rich_layers) and of hand-made
hostile-but-valid indexes go through ``fsck.erofs`` (with the blob as ``--device``,
and ``--extract`` against ``tar -x``), ``dump.erofs``, and real file-backed kernel
mounts compared with ``tar -x`` entry by entry and byte for byte (the blob is written
from the store's packs at the blob geometry); then overlayfs over the EROFS mounts.
The ENOTBLK fallback is driven by an image on a tmpfs the test mounts.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import random
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from bootseer.blockstore.convert.layer_image import inline_candidates
from bootseer.blockstore.datapath import erofs_mount
from bootseer.blockstore.objects import erofs_image as erofs
from bootseer.blockstore.objects.erofs_image import (
    BLOCK_SIZE,
    ErofsError,
    build_image,
    image_cache_name,
    write_image,
)
from bootseer.blockstore.datapath.erofs_mount import ErofsMount, ErofsMountError, mount_erofs, unmount_erofs
from bootseer.blockstore.objects.format import ZERO_PACK, Block, Entry, EntryType, LayerIndex
from tests.support.layer_store import BuiltLayer, build_store, stored_image
from tests.support.mounts import force_unmount, mount_entry
from tests.support.oci import (
    APP_FILE,
    APP_FILE_DATA,
    BLOB_FILE,
    DELETED_FILE,
    LONG_NAME,
    NON_UTF8_NAME,
    OPAQUE_DIR,
    OPAQUE_NEW,
    PATCH_FILE,
    PATCH_FILE_DATA,
    blob_data,
    demo_layers,
    rich_layers,
)
from tests.support.trees import Meta, apply_layers, as_whiteouts, disk_tree, extract_with_tar, read_block

LAYER_BLOCK_SIZE = 64 << 10
REPO = Path(__file__).resolve().parents[2]
OPAQUE = "trusted.overlay.opaque"
XATTR_PREFIXES = ("user.", "trusted.", "security.")
DIFF_ID = "sha256:" + "d" * 64
PACK = "a" * 64
BIG_XATTR = bytes(range(256)) * 40  #: an inline xattr value over several metadata blocks

pytestmark = pytest.mark.skipif(shutil.which("fsck.erofs") is None, reason="erofs-utils is not installed (ctr_examples/install-deps.sh)")


# -- where images live: a filesystem the kernel can back an EROFS mount with ----------------------


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on (the longest mountpoint above it in the mount table)."""
    best, kind = "", ""
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            point = point.replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fstype
    return kind


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory on a disk filesystem (file-backed EROFS needs ``read_folio``: tmpfs and overlayfs lack it)."""
    base = tmp_path_factory.mktemp("erofs")
    if _filesystem_type(base) in ("tmpfs", "overlay", "ramfs"):
        base = Path(tempfile.mkdtemp(prefix=".erofs-test-", dir=REPO))
        yield base
        shutil.rmtree(base, ignore_errors=True)
        return
    yield base


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[BuiltLayer]]:
    store = tmp_path_factory.mktemp("store")
    layout = tmp_path_factory.mktemp("layout")
    return store, build_store(store, rich_layers(LAYER_BLOCK_SIZE), block_size=LAYER_BLOCK_SIZE, layout=layout)


@pytest.fixture(scope="module")
def extracted(built: tuple[Path, list[BuiltLayer]], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("extracted")
    for number, layer in enumerate(built[1]):
        extract_with_tar(layer.blob, base / str(number))
    return [base / str(number) for number in range(len(built[1]))]


def write_blob(store: Path, index: LayerIndex, path: Path, skip: set[int] = set()) -> None:
    """The layer's blob as the layer server will serve it: block ``n`` (verified) at ``n * block_size``
    (zeros for the blocks ``skip`` names)."""
    with open(path, "wb") as blob:
        blob.truncate(index.blob_size)
        for number, block in enumerate(index.blocks):
            if not block.is_zero and number not in skip:
                blob.seek(index.blob_offset(number))
                blob.write(read_block(store, index, number))


@pytest.fixture(scope="module", params=["node-built", "converter-built"])
def images(request: pytest.FixtureRequest, built: tuple[Path, list[BuiltLayer]], disk_dir: Path) -> list[tuple[Path, Path]]:
    """(image, blob) of each test layer, on disk: the image a node builds from the index, or the one the
    converter stored (its small files' data inside; their blocks are then zeros in this blob, so a test
    that reads them right read them from the image)."""
    store, layers = built
    out = []
    for number, layer in enumerate(layers):
        image, blob = disk_dir / f"layer{number}-{request.param}.erofs", disk_dir / f"layer{number}-{request.param}.blob"
        if request.param == "node-built":
            with open(image, "wb") as f:
                write_image(layer.index, f)
            write_blob(store, layer.index, blob)
        else:
            table, data = stored_image(store, layer.record)
            image.write_bytes(data)
            inline = inline_candidates(layer.index, table.inline_max)
            assert inline, "the test layers have small files"
            write_blob(store, layer.index, blob, skip={layer.index.entries[n].blocks[0] for n in inline})
        out.append((image, blob))
    return out


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mountpoints to unmount at the end, topmost last."""
    points: list[Path] = []
    yield points
    for point in reversed(points):
        force_unmount(point)


def mount(image: Path, blob: Path, point: Path, mounts: list[Path]) -> ErofsMount:
    point.mkdir(parents=True, exist_ok=True)
    mounts.append(point)
    return mount_erofs(image, point, device=blob)


def fsck(image: Path, blob: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["fsck.erofs", f"--device={blob}", *extra, str(image)], capture_output=True, text=True, timeout=300)


def dump_path(image: Path, blob: Path, path: str) -> str:
    done = subprocess.run(["dump.erofs", f"--device={blob}", f"--path=/{path}", str(image)], capture_output=True, timeout=60)
    assert done.returncode == 0 and b"<E>" not in done.stderr + done.stdout, done.stderr
    return done.stdout.decode("utf-8", "surrogateescape")


def sparse_blob(index: LayerIndex, path: Path) -> Path:
    """A blob of the right size holding zeros (for checks that do not look at file bytes)."""
    return write_blob_of(index, {}, path)


# -- hand-made indexes ---------------------------------------------------------------------------


def _block(data: bytes, offset: int = 0) -> Block:
    return Block(hashlib.sha256(data).hexdigest(), 0, offset, 100, len(data))


def _zero_block(length: int) -> Block:
    return Block(hashlib.sha256(bytes(length)).hexdigest(), ZERO_PACK, 0, 0, length)


def every_kind_index(block_size: int = BLOCK_SIZE) -> LayerIndex:
    """One entry of every kind an index holds, with xattrs of every namespace and awkward names."""
    data = bytes(range(256)) * (block_size // 256)
    blocks = [_block(data), _block(data[:100], 1), _zero_block(block_size), _zero_block(10)]
    long_name = "n" * 255
    entries = [
        Entry("", EntryType.DIR, 0o755, mtime_ns=1_700_000_000_123_456_789),
        Entry("bin", EntryType.DIR, 0o711, uid=1, gid=2),
        Entry("bin/tool", EntryType.FILE, 0o4755, uid=70000, gid=80000, mtime_ns=-1_500_000_000, size=block_size + 100, blocks=(0, 1),
              xattrs={"security.capability": b"\x01\x00\x00\x02" + bytes(16), "user.mime": b"app/x", "trusted.t": b"\xff" * 300}),
        Entry("bin/tool-link", EntryType.FILE, 0o644, link=2),
        Entry("bin/zeros", EntryType.FILE, 0o600, size=2 * block_size + 10, blocks=(2, 2, 3), xattrs={"user.big": BIG_XATTR}),
        Entry("bin/empty", EntryType.FILE, 0o644, xattrs={"user.empty-value": b""}),
        Entry("etc", EntryType.DIR, 0o750, xattrs={OPAQUE: b"y"}),
        Entry("etc/tool-again", EntryType.FILE, 0o600, link=2),
        Entry("etc/" + long_name, EntryType.FILE, 0o644, mtime_ns=7),
        Entry("etc/empty-dir", EntryType.DIR, 0o700),
        Entry("gone", EntryType.CHAR, 0),
        Entry("null", EntryType.CHAR, 0o666, rdev=(1, 3)),
        Entry("big-minor", EntryType.CHAR, 0o600, rdev=(4095, (1 << 20) - 1)),
        Entry("sda", EntryType.BLOCK, 0o660, rdev=(8, 0)),
        Entry("fifo", EntryType.FIFO, 0o600, xattrs={"trusted.on-fifo": b"1"}),
        Entry("link", EntryType.SYMLINK, 0o777, size=len("/bin/tool"), target="/bin/tool"),
        Entry("long-link", EntryType.SYMLINK, 0o777, size=4095, target="x/" * 2047 + "y"),
        Entry("mid-link", EntryType.SYMLINK, 0o777, size=4000, target="z" * 4000),
        Entry("caf\udce9", EntryType.DIR, 0o755),
        Entry("caf\udce9/\udcff\udcfe", EntryType.FILE, 0o644, size=100, blocks=(1,)),
        Entry("-dash", EntryType.FILE, 0o644),  # sorts before "." and ".."
    ]  # fmt: skip
    index = LayerIndex(DIFF_ID, block_size, entries, blocks, [PACK])
    index.validate()
    return index


def wide_and_deep_index(files: int = 3000, depth: int = 60) -> LayerIndex:
    """A directory with ``files`` long names (many dirent blocks) and a chain of ``depth`` directories."""
    entries = [Entry("", EntryType.DIR, 0o755), Entry("wide", EntryType.DIR, 0o755)]
    entries += [Entry(f"wide/{number:05d}-" + "w" * 100, EntryType.FILE, 0o644) for number in range(files)]
    path = ""
    for level in range(depth):
        path = f"{path}/d{level}" if path else "deep"
        entries.append(Entry(path, EntryType.DIR, 0o755))
    entries.append(Entry(f"{path}/bottom", EntryType.FILE, 0o644))
    index = LayerIndex(DIFF_ID, BLOCK_SIZE, entries, [], [])
    index.validate()
    return index


def many_chunks_index(chunks: int) -> tuple[LayerIndex, dict[int, bytes], bytes]:
    """One file of ``chunks`` 4 KiB blocks, every tenth a hole: its index, the blob's blocks by number, its contents.

    Block 0 is the one zero block (a layer's blocks are distinct, so every hole refers to it).
    """
    blocks, by_number, numbers, contents = [_zero_block(BLOCK_SIZE)], {}, [], bytearray()
    for position in range(chunks):
        if position % 10 == 3:
            numbers.append(0)
            contents += bytes(BLOCK_SIZE)
            continue
        data = position.to_bytes(8, "little") * (BLOCK_SIZE // 8)
        by_number[len(blocks)] = data
        numbers.append(len(blocks))
        blocks.append(_block(data))
        contents += data
    entries = [Entry("", EntryType.DIR, 0o755), Entry("large.bin", EntryType.FILE, 0o644, size=len(contents), blocks=tuple(numbers))]
    index = LayerIndex(DIFF_ID, BLOCK_SIZE, entries, blocks, [PACK])
    index.validate()
    return index, by_number, bytes(contents)


def write_blob_of(index: LayerIndex, contents_by_block: dict[int, bytes], path: Path) -> Path:
    with open(path, "wb") as blob:
        blob.truncate(index.blob_size)
        for number, data in contents_by_block.items():
            blob.seek(index.blob_offset(number))
            blob.write(data)
    return path


def erofs_tree(root: Path) -> dict[str, Meta]:
    return disk_tree(root, overlay=False, xattr_prefixes=XATTR_PREFIXES)


# -- erofs-utils accept the images ---------------------------------------------------------------


def test_fsck_accepts_the_test_layers_and_extracts_what_tar_extracts(
    images: list[tuple[Path, Path]], extracted: list[Path], built: tuple[Path, list[BuiltLayer]], tmp_path: Path
) -> None:
    for number, ((image, blob), reference, layer) in enumerate(zip(images, extracted, built[1])):
        checked = fsck(image, blob)
        assert checked.returncode == 0, checked.stderr
        out = tmp_path / f"fsck{number}"
        done = fsck(image, blob, f"--extract={out}")
        assert done.returncode == 0, done.stderr
        # fsck.erofs 1.5 extracts contents, types, owners, mtimes and modes (chown after chmod: no setuid/setgid
        # left; no xattrs; hard links as copies), and writes the chunks of a file with holes back to back (later
        # erofs-utils seek over them): the kernel tests check all of those.
        holes = {e.path for e in layer.index.entries if any(b.is_zero for b in layer.index.file_blocks(e))}
        assert holes <= {"srv/sparse.img", "data/holes.img"}

        def extractable(tree: dict[str, Meta]) -> dict[str, Meta]:
            return {path: Meta(m.type, m.mode & 0o1777, m.uid, m.gid, m.mtime_ns if m.type != "symlink" else 0,
                               0 if path in holes else m.size, "" if path in holes else m.sha256, m.target, m.rdev)
                    for path, m in as_whiteouts(tree).items()}  # fmt: skip

        assert extractable(disk_tree(out, overlay=False)) == extractable(disk_tree(reference, overlay=True)), number


def test_fsck_and_dump_accept_every_entry_kind(disk_dir: Path) -> None:
    index = every_kind_index()
    image = disk_dir / "kinds.erofs"
    image.write_bytes(build_image(index))
    blob = sparse_blob(index, disk_dir / "kinds.blob")
    checked = fsck(image, blob)
    assert checked.returncode == 0, checked.stderr
    superblock = subprocess.run(["dump.erofs", f"--device={blob}", "-s", str(image)], capture_output=True, text=True, timeout=60).stdout
    assert "features:" in superblock and "chunked_file device_table" in superblock and "sb_csum" not in superblock
    assert re.search(r"inode count: +(\d+)", superblock).group(1) == str(len(index.entries) - 2)  # type: ignore[union-attr]  # 2 links
    tool = dump_path(image, blob, "bin/tool")
    assert re.search(r"Size: 4196 .*regular file", tool) and "Links: 3" in tool and "Layout: 4" in tool
    assert "Uid: 70000   Gid: 80000" in tool and "1969-12-31 23:59:58.500000000" in tool  # (dump.erofs 1.5 shows mode & 0777)
    assert dump_path(image, blob, "bin/tool-link").split("NID:")[1].split()[0] == tool.split("NID:")[1].split()[0]
    assert "Layout: 0" in dump_path(image, blob, "bin/empty")
    assert "char dev" in dump_path(image, blob, "gone") and "fifo" in dump_path(image, blob, "fifo")
    assert re.search(r"Size: 4095 .*symlink", dump_path(image, blob, "long-link"))
    assert "Layout: 2" in dump_path(image, blob, "link")  # a short target is inline
    assert re.search(r"Size: 100 .*regular file", dump_path(image, blob, "caf\udce9/\udcff\udcfe"))
    assert "regular file" in dump_path(image, blob, "etc/" + "n" * 255)
    assert "directory" in dump_path(image, blob, "etc/empty-dir")


def test_fsck_and_dump_accept_a_wide_directory_and_a_deep_tree(disk_dir: Path) -> None:
    index = wide_and_deep_index()
    image = disk_dir / "wide.erofs"
    image.write_bytes(build_image(index))
    blob = sparse_blob(index, disk_dir / "wide.blob")  # no file has data: an empty blob, still device 1
    checked = fsck(image, blob)
    assert checked.returncode == 0, checked.stderr
    wide = dump_path(image, blob, "wide")
    size = int(re.search(r"Size: (\d+)", wide).group(1))  # type: ignore[union-attr]
    assert size > 60 * BLOCK_SIZE  # dirents over many blocks
    assert "regular file" in dump_path(image, blob, index.entries[-1].path)


def test_fsck_accepts_a_file_of_many_chunks(disk_dir: Path) -> None:
    index, by_number, _ = many_chunks_index(3000)
    image = disk_dir / "chunks.erofs"
    image.write_bytes(build_image(index))
    blob = write_blob_of(index, by_number, disk_dir / "chunks.blob")
    checked = fsck(image, blob)
    assert checked.returncode == 0, checked.stderr
    assert "Layout: 4" in dump_path(image, blob, "large.bin")


# -- the kernel mounts them: the trees equal tar -x ---------------------------------------------


def test_each_mounted_layer_equals_its_tar_extraction(
    images: list[tuple[Path, Path]], extracted: list[Path], built: tuple[Path, list[BuiltLayer]], tmp_path: Path, mounts: list[Path]
) -> None:
    for number, ((image, blob), reference, layer) in enumerate(zip(images, extracted, built[1])):
        point = tmp_path / f"m{number}"
        mounted = mount(image, blob, point, mounts)
        assert mounted.mode == "file" and mount_entry(point).fstype == "erofs"  # type: ignore[union-attr]
        view = erofs_tree(point)
        assert as_whiteouts(view) == as_whiteouts(disk_tree(reference, overlay=True, xattr_prefixes=XATTR_PREFIXES)), number
        assert len(view) == len(layer.index.entries) - 1
    base, middle = tmp_path / "m0", tmp_path / "m1"
    # What the layers hold, named: so the comparison above cannot pass on empty trees.
    assert os.lstat(base / "dev/null").st_rdev == os.makedev(1, 3)
    assert stat.S_ISBLK(os.lstat(base / "dev/sda").st_mode) and stat.S_ISFIFO(os.lstat(base / "run/fifo").st_mode)
    big, link = os.lstat(base / "srv/big.bin"), os.lstat(base / "srv/big.link")
    assert big.st_ino == link.st_ino and big.st_nlink == 2 and big.st_size == 3 * LAYER_BLOCK_SIZE + 12345
    assert os.lstat(base / "srv").st_nlink == 2
    assert os.getxattr(base / "srv/xattr.bin", "user.bin") == b"\x00\xff\xfe"
    assert os.readlink(base / "srv/escape") == "../../../../etc/shadow"
    assert (base / NON_UTF8_NAME).read_bytes() == b"non-utf8\n" and (base / LONG_NAME).read_bytes() == b"long\n"
    assert os.lstat(base / "srv/mtime-ns").st_mtime_ns == 1_700_000_000_123_456_789
    sparse = (base / "srv/sparse.img").read_bytes()
    tail = 4 * LAYER_BLOCK_SIZE + 7
    assert len(sparse) == 5 * LAYER_BLOCK_SIZE and sparse[:4096] == b"head" * 1024 and sparse[tail : tail + 40] == b"tail" * 10
    assert sparse[4096:tail] == bytes(tail - 4096)  # the holes read as zeros
    whiteout = os.lstat(middle / "etc/secret")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(middle / "opaque-me", OPAQUE) == b"y"
    with pytest.raises(OSError) as excinfo:
        os.getxattr(middle / "app", OPAQUE)
    assert excinfo.value.errno == errno.ENODATA


def test_an_overlay_over_erofs_lowers_equals_the_applied_layers(images: list[tuple[Path, Path]], extracted: list[Path], disk_dir: Path,
                                                                tmp_path: Path, mounts: list[Path]) -> None:  # fmt: skip
    lowers = [str(mount(image, blob, tmp_path / f"lower{n}", mounts).mountpoint) for n, (image, blob) in enumerate(images)]
    upper, work, merged = disk_dir / "upper", disk_dir / "work", tmp_path / "merged"
    for directory in (upper, work, merged):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
    mounts.append(merged)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={':'.join(reversed(lowers))},upperdir={upper},workdir={work}",
                    str(merged)], check=True, capture_output=True, timeout=30)  # fmt: skip
    expected = apply_layers([disk_tree(d, overlay=True) for d in extracted])
    assert disk_tree(merged, overlay=False) == expected
    # The whiteouts hide, the opaque directory hides what is below it, the last entry wins.
    assert not (merged / "etc/secret").exists() and not (merged / "gone-dir").exists()
    assert os.listdir(merged / "opaque-me") == ["new.txt"]
    assert (merged / "replace-me").read_bytes() == b"fourth and last\n"
    # Writes go to the upper directory; the lowers stay as they were.
    (merged / "etc/hosts").write_bytes(b"changed\n")
    (merged / "srv/big.bin").unlink()
    assert (upper / "etc/hosts").read_bytes() == b"changed\n" and (Path(lowers[0]) / "etc/hosts").read_bytes() == b"127.0.0.1 localhost\n"
    assert (Path(lowers[0]) / "srv/big.bin").exists() and not (merged / "srv/big.bin").exists()
    with pytest.raises(OSError) as excinfo:
        (Path(lowers[0]) / "etc/new").write_bytes(b"x")
    assert excinfo.value.errno == errno.EROFS


def test_a_container_root_over_erofs_lowers_runs_the_demo_image(disk_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                                                tmp_path: Path, mounts: list[Path]) -> None:  # fmt: skip
    """The demo image (busybox, app files, a whiteout, an opaque dir): its busybox runs from the blob through EROFS."""
    if not Path("/bin/busybox").is_file():
        pytest.skip("busybox-static is not installed")
    store = tmp_path_factory.mktemp("demo-store")
    layers = build_store(store, demo_layers(), block_size=LAYER_BLOCK_SIZE, layout=tmp_path_factory.mktemp("demo-layout"))
    lowers = []
    for number, layer in enumerate(layers):
        image, blob = disk_dir / f"demo{number}.erofs", disk_dir / f"demo{number}.blob"
        image.write_bytes(build_image(layer.index))
        write_blob(store, layer.index, blob)
        checked = fsck(image, blob)
        assert checked.returncode == 0, checked.stderr
        lowers.append(str(mount(image, blob, tmp_path / f"demo{number}", mounts).mountpoint))
    merged = tmp_path / "root"
    merged.mkdir()
    mounts.append(merged)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={':'.join(reversed(lowers))}", str(merged)],
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    script = f"cat {APP_FILE} {PATCH_FILE}; ls {OPAQUE_DIR}; test -e {DELETED_FILE} || echo deleted; sha256sum {BLOB_FILE}"
    done = subprocess.run(["chroot", str(merged), "/bin/sh", "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = APP_FILE_DATA + PATCH_FILE_DATA + b"".join(f"{name}\n".encode() for name in OPAQUE_NEW) + b"deleted\n"
    assert done.stdout == expected + f"{hashlib.sha256(blob_data()).hexdigest()}  {BLOB_FILE}\n".encode()


def test_the_kernel_reads_every_entry_kind(disk_dir: Path, tmp_path: Path, mounts: list[Path]) -> None:
    index = every_kind_index()
    image, blob = disk_dir / "kinds-k.erofs", disk_dir / "kinds-k.blob"
    image.write_bytes(build_image(index))
    data = bytes(range(256)) * (BLOCK_SIZE // 256)
    write_blob_of(index, {0: data, 1: data[:100]}, blob)
    point = tmp_path / "kinds"
    mount(image, blob, point, mounts)
    tool = os.lstat(point / "bin/tool")
    assert (stat.S_IMODE(tool.st_mode), tool.st_uid, tool.st_gid, tool.st_nlink) == (0o4755, 70000, 80000, 3)
    assert tool.st_mtime_ns == -1_500_000_000 and os.lstat(point).st_mtime_ns == 1_700_000_000_123_456_789
    assert (point / "bin/tool").read_bytes() == data + data[:100]
    assert os.lstat(point / "etc/tool-again").st_ino == os.lstat(point / "bin/tool-link").st_ino == tool.st_ino
    assert os.getxattr(point / "bin/tool", "security.capability") == b"\x01\x00\x00\x02" + bytes(16)
    assert os.getxattr(point / "bin/tool", "trusted.t") == b"\xff" * 300
    assert sorted(os.listxattr(point / "bin/tool")) == ["security.capability", "trusted.t", "user.mime"]
    assert os.getxattr(point / "bin/empty", "user.empty-value") == b""
    assert os.getxattr(point / "fifo", "trusted.on-fifo", follow_symlinks=False) == b"1"  # (user.* only on files and dirs)
    assert (point / "bin/zeros").read_bytes() == bytes(2 * BLOCK_SIZE + 10)
    assert os.getxattr(point / "etc", OPAQUE) == b"y"
    assert (point / "etc" / ("n" * 255)).stat().st_mtime_ns == 7
    assert os.listdir(point / "etc/empty-dir") == []
    assert os.lstat(point / "big-minor").st_rdev == os.makedev(4095, (1 << 20) - 1)
    assert os.lstat(point / "gone").st_rdev == 0 and stat.S_ISCHR(os.lstat(point / "gone").st_mode)
    assert stat.S_ISBLK(os.lstat(point / "sda").st_mode) and os.lstat(point / "sda").st_rdev == os.makedev(8, 0)
    assert os.readlink(point / "link") == "/bin/tool"
    assert os.readlink(point / "long-link") == "x/" * 2047 + "y" and os.readlink(point / "mid-link") == "z" * 4000
    names = sorted(os.listdir(os.fsencode(point / "caf\udce9")))
    assert names == [b"\xff\xfe"] and (point / "caf\udce9" / "\udcff\udcfe").read_bytes() == data[:100]
    assert (point / "-dash").is_file() and sorted(os.listdir(point))[0] == "-dash"  # a name that sorts before "."
    assert os.lstat(point / "bin").st_nlink == 2 and os.lstat(point / "etc").st_nlink == 3
    assert os.lstat(point).st_nlink == 2 + 3  # its subdirectories bin, etc and caf\xe9
    assert os.getxattr(point / "bin/zeros", "user.big") == BIG_XATTR


def test_the_kernel_walks_a_wide_directory_a_deep_tree_and_many_chunks(disk_dir: Path, tmp_path: Path, mounts: list[Path]) -> None:
    index = wide_and_deep_index()
    image = disk_dir / "wide-k.erofs"
    image.write_bytes(build_image(index))
    point = tmp_path / "wide"
    mount(image, sparse_blob(index, disk_dir / "wide-k.blob"), point, mounts)
    names = os.listdir(point / "wide")
    assert sorted(names) == sorted(e.name for e in index.entries if e.parent == "wide")
    for entry in index.entries[2::97]:  # lookups hit every dirent block's binary search
        assert os.lstat(point / entry.path).st_mode == entry.st_mode
    assert (point / index.entries[-1].path).is_file() and (point / index.entries[-1].path).parent.parent.name == "d58"
    chunks, by_number, contents = many_chunks_index(3000)
    image, blob = disk_dir / "chunks-k.erofs", disk_dir / "chunks-k.blob"
    image.write_bytes(build_image(chunks))
    write_blob_of(chunks, by_number, blob)
    point = tmp_path / "chunks"
    mount(image, blob, point, mounts)
    assert hashlib.sha256((point / "large.bin").read_bytes()).digest() == hashlib.sha256(contents).digest()


def random_index(seed: int, entries: int = 600) -> LayerIndex:
    """A seeded, valid index that exercises the layout: names of 1..255 bytes (some not UTF-8), xattrs of
    0..6000 bytes, symlink targets of 1..4095 bytes, files of 0..5 chunks with holes, devices, fifos, links."""
    rng = random.Random(seed)
    blocks = [_zero_block(BLOCK_SIZE), _zero_block(1)] + [_block(bytes([n]) * BLOCK_SIZE) for n in range(1, 6)]
    by_parent: dict[str, list[Entry]] = {}
    directories, used = [""], {""}
    while len(used) < entries:
        parent = rng.choice(directories)
        name = "".join(rng.choice("abcXYZ-_.\xe9") for _ in range(rng.choice((1, 2, 8, 40, 200, 255))))
        if rng.random() < 0.1:
            name = name[:-1] + rng.choice("\udcff\udc80\udce9")
        while len(os.fsencode(name)) > 255:
            name = name[:-1]
        path = f"{parent}/{name}" if parent else name
        if name in (".", "..") or path in used:
            continue
        used.add(path)
        kind = rng.choice([EntryType.DIR, EntryType.FILE, EntryType.FILE, EntryType.SYMLINK, EntryType.CHAR, EntryType.FIFO,
                           EntryType.BLOCK])  # fmt: skip
        namespaces = ("trusted.", "security.") + (("user.",) if kind in (EntryType.DIR, EntryType.FILE) else ())
        sizes = (0, 1, 33, 700, 3000, 6000)
        xattrs = {f"{rng.choice(namespaces)}x{n}": rng.randbytes(rng.choice(sizes)) for n in range(rng.choice((0, 0, 1, 3)))}
        common = dict(mode=rng.randrange(0o10000), uid=rng.randrange((1 << 32) - 1), gid=rng.randrange(70000),
                      mtime_ns=rng.randrange(-(10**18), 4 * 10**18), xattrs=xattrs)  # fmt: skip
        if kind is EntryType.FILE:
            chunks = rng.randrange(6)
            short = rng.random() < 0.5  # a last block of 1 byte, else a full one
            size = 0 if not chunks else (chunks - 1) * BLOCK_SIZE + (1 if short else BLOCK_SIZE)
            numbers = tuple(rng.choice((0, 2, 3, 4, 5, 6)) for _ in range(chunks))
            if chunks and short:
                numbers = numbers[:-1] + (1,)
            entry = Entry(path, kind, size=size, blocks=numbers, **common)  # type: ignore[arg-type]
        elif kind is EntryType.SYMLINK:
            target = "t" * rng.choice((1, 60, 3900, 4000, 4031, 4032, 4095))
            entry = Entry(path, kind, size=len(target), target=target, **common)  # type: ignore[arg-type]
        elif kind in (EntryType.CHAR, EntryType.BLOCK):
            entry = Entry(path, kind, rdev=(rng.randrange(4096), rng.randrange(1 << 20)), **common)  # type: ignore[arg-type]
        else:
            entry = Entry(path, kind, **common)  # type: ignore[arg-type]
            if kind is EntryType.DIR:
                directories.append(path)
        by_parent.setdefault(parent, []).append(entry)
    ordered: list[Entry] = [Entry("", EntryType.DIR, 0o755)]

    def visit(directory: str) -> None:  # parents before children, children sorted: as an index lists them
        for entry in sorted(by_parent.get(directory, ()), key=lambda e: e.name):
            ordered.append(entry)
            if entry.type is EntryType.DIR:
                visit(entry.path)

    visit("")
    for number, entry in enumerate(ordered):  # some later files become hard links to earlier ones
        earlier = [n for n in range(number) if ordered[n].type is EntryType.FILE and ordered[n].link is None]
        if entry.type is EntryType.FILE and earlier and rng.random() < 0.15:
            ordered[number] = Entry(entry.path, EntryType.FILE, 0o644, link=rng.choice(earlier))
    index = LayerIndex(DIFF_ID, BLOCK_SIZE, ordered, blocks, [PACK])
    index.validate()
    return index


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_valid_indexes_pass_fsck_and_mount_as_they_say(seed: int, disk_dir: Path, tmp_path: Path, mounts: list[Path]) -> None:
    index = random_index(seed)
    image = disk_dir / f"random{seed}.erofs"
    image.write_bytes(build_image(index))
    blob = sparse_blob(index, disk_dir / f"random{seed}.blob")
    checked = fsck(image, blob)
    assert checked.returncode == 0, checked.stderr
    point = tmp_path / "r"
    mount(image, blob, point, mounts)
    inodes: dict[int, int] = {}
    for number, entry in enumerate(index.entries[1:], 1):
        owner = index.entries[entry.link] if entry.link is not None else entry
        st = os.lstat(point / entry.path)
        assert (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns) == (owner.st_mode, owner.uid, owner.gid, owner.mtime_ns), entry.path
        if entry.type is EntryType.FILE:
            assert st.st_size == owner.size and inodes.setdefault(entry.link or number, st.st_ino) == st.st_ino, entry.path
        elif entry.type is EntryType.SYMLINK:
            assert os.readlink(point / entry.path) == entry.target, entry.path
        elif entry.type in (EntryType.CHAR, EntryType.BLOCK):
            assert st.st_rdev == os.makedev(*entry.rdev), entry.path
        found = {name: os.getxattr(point / entry.path, name, follow_symlinks=False)
                 for name in os.listxattr(point / entry.path, follow_symlinks=False)}  # fmt: skip
        assert found == owner.xattrs, entry.path
    assert len(inodes) == sum(e.type is EntryType.FILE and e.link is None for e in index.entries)


# -- determinism, geometry and refusals ---------------------------------------------------------


def test_the_same_index_gives_the_same_bytes(built: tuple[Path, list[BuiltLayer]]) -> None:
    for layer in built[1]:
        first = build_image(layer.index)
        again = build_image(LayerIndex.decode(layer.index.encode()))
        assert first == again and len(first) % BLOCK_SIZE == 0
    kinds = build_image(every_kind_index())
    assert kinds == build_image(every_kind_index())
    assert kinds != build_image(every_kind_index(block_size=8192))


#: The image of :func:`every_kind_index` as WRITER_VERSION 1 writes it: what a node's cache may hold.
KINDS_IMAGE_SHA256 = "f5a867e93be293fa557ee36b80f8d0ba621289b4b939e9639b2e0a428187bab4"


def test_images_change_only_with_the_writer_version() -> None:
    digest = hashlib.sha256(build_image(every_kind_index())).hexdigest()
    message = "the writer's bytes changed: bump WRITER_VERSION (cached images are keyed by it)"
    assert (erofs.WRITER_VERSION, digest) == (1, KINDS_IMAGE_SHA256), message


def test_blob_geometry_maps_offsets_to_blocks(built: tuple[Path, list[BuiltLayer]]) -> None:
    index = built[1][0].index
    size = index.block_size
    assert index.blob_size == len(index.blocks) * size
    assert index.blob_offset(3) == 3 * size
    assert index.blob_blocks(0, 1) == range(0, 1)
    assert index.blob_blocks(size - 1, 2) == range(0, 2)
    assert index.blob_blocks(2 * size, 3 * size) == range(2, 5)
    assert index.blob_blocks(index.blob_size - 1, 10 * size) == range(len(index.blocks) - 1, len(index.blocks))
    assert index.blob_blocks(index.blob_size, size) == range(len(index.blocks), len(index.blocks))  # past the end: nothing
    assert index.blob_blocks(5, 0) == range(0, 0)
    assert image_cache_name("ab" * 32) == "ab" * 32 + ".erofs-v1"
    with pytest.raises(ValueError):
        image_cache_name("../x")


def _one_entry(entry: Entry, block_size: int = BLOCK_SIZE) -> LayerIndex:
    return LayerIndex(DIFF_ID, block_size, [Entry("", EntryType.DIR, 0o755), entry], [], [])


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (_one_entry(Entry("f", EntryType.FILE, 0o644), block_size=12288), "block size 12288 is not a power of two"),
        (_one_entry(Entry("f", EntryType.FILE, 0o644, xattrs={"system.nfs4_acl": b"x"})), "'system.nfs4_acl' is in a namespace"),
        (_one_entry(Entry("f", EntryType.FILE, 0o644, xattrs={"user.big": bytes(65536)})), "65536-byte value"),
        (_one_entry(Entry("f", EntryType.FILE, 0o644, xattrs={"user.": b"x"})), "empty name"),
        (_one_entry(Entry("d", EntryType.CHAR, 0o644, rdev=(4096, 0))), "device number 4096:0"),
        (_one_entry(Entry("f", EntryType.FILE, 0o644, uid=1 << 32)), "owner 4294967296:0 is not below 4294967295"),
        (_one_entry(Entry("f", EntryType.FILE, 0o644, gid=(1 << 32) - 1)), "owner 0:4294967295 is not below"),
        (_one_entry(Entry("l", EntryType.SYMLINK, 0o777, size=4096, target="t" * 4096)), "4096-byte symlink target"),
        (_one_entry(Entry("f", EntryType.FILE, 0o644, xattrs={"user.\udcc3\udca9": b"1", "user.\xe9": b"2"})), "are one name in bytes"),
        (LayerIndex(DIFF_ID, BLOCK_SIZE, [Entry("", EntryType.DIR, 0o755), Entry("\udcc3\udca9", EntryType.FILE, 0o644),
                                          Entry("\xe9", EntryType.FILE, 0o644)], [], []), "another entry's in the same directory"),
    ],
)
def test_what_erofs_cannot_hold_is_a_clear_error(index: LayerIndex, message: str) -> None:
    out = io.BytesIO()
    with pytest.raises(ErofsError) as excinfo:
        write_image(index, out)
    assert message in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert out.getvalue() == b""  # refused before a byte is written


# -- the mount helper: file-backed, else loop devices --------------------------------------------


def test_an_image_on_tmpfs_is_mounted_over_loop_devices(images: list[tuple[Path, Path]], extracted: list[Path], tmp_path: Path,
                                                        mounts: list[Path]) -> None:  # fmt: skip
    ram = tmp_path / "ram"
    ram.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(ram)], check=True, timeout=30)
    mounts.append(ram)
    image, blob = ram / "layer.erofs", ram / "layer.blob"
    shutil.copyfile(images[0][0], image)
    shutil.copyfile(images[0][1], blob)
    point = tmp_path / "m"
    point.mkdir()
    # The kernel refuses a file-backed mount of a tmpfs file: what the fallback is for.
    with pytest.raises(OSError) as excinfo:
        erofs_mount._mount(str(image), str(point), f"device={blob}", erofs_mount.MS_RDONLY)
    assert excinfo.value.errno == errno.ENOTBLK
    mounted = mount(image, blob, point, mounts)
    assert mounted.mode == "loop" and len(mounted.loop_devices) == 2
    entry = mount_entry(point)
    assert entry is not None and entry.fstype == "erofs" and entry.source == mounted.loop_devices[0]
    assert as_whiteouts(erofs_tree(point)) == as_whiteouts(disk_tree(extracted[0], overlay=True, xattr_prefixes=XATTR_PREFIXES))
    for device, backing in zip(mounted.loop_devices, (image, blob)):
        sysfs = Path("/sys/block", Path(device).name)
        assert (sysfs / "loop/backing_file").read_text().strip() == str(backing)
        # Read-only, and autoclear: the kernel detaches it when the mount lets go (our descriptors are closed).
        assert (sysfs / "ro").read_text().strip() == "1" and (sysfs / "loop/autoclear").read_text().strip() == "1"
    unmount_erofs(point)
    mounts.remove(point)
    assert mount_entry(point) is None
    # A blob that is not there is a clear error on this path too, and leaves nothing attached.
    with pytest.raises(ErofsMountError) as excinfo:
        mount_erofs(image, point, device=ram / "missing.blob")
    assert "missing.blob" in str(excinfo.value) and mount_entry(point) is None


def test_a_kernel_whose_erofs_refuses_directio_gets_a_buffered_mount_with_a_warning(
    images: list[tuple[Path, Path]], extracted: list[Path], tmp_path: Path, mounts: list[Path],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """EROFS without the ``directio`` option (EINVAL for it): the same mount is made without it, the blob read
    buffered, and a warning says so; every other refusal stays an error."""
    import logging

    real = erofs_mount._mount
    tried: list[str] = []

    def no_directio(source: str, target: str, data: str, flags: int) -> None:
        tried.append(data)
        if "directio" in data:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), source)
        real(source, target, data, flags)

    monkeypatch.setattr(erofs_mount, "_mount", no_directio)
    image, blob = images[0]
    point = tmp_path / "m"
    point.mkdir()
    with caplog.at_level(logging.WARNING, logger="bootseer.blockstore.datapath.erofs_mount"):
        mounted = mount_erofs(image, point, device=blob)
    mounts.append(point)
    assert (mounted.mode, mounted.direct) == ("file", False)
    assert tried == [f"device={blob},directio", f"device={blob}"]
    entry = mount_entry(point)
    assert entry is not None and entry.fstype == "erofs" and "directio" not in entry.options
    assert any("has no directio" in record.getMessage() for record in caplog.records)
    assert as_whiteouts(erofs_tree(point)) == as_whiteouts(disk_tree(extracted[0], overlay=True, xattr_prefixes=XATTR_PREFIXES))


def test_a_mount_the_kernel_refuses_is_a_clear_error(disk_dir: Path, tmp_path: Path, mounts: list[Path]) -> None:
    garbage = disk_dir / "garbage.erofs"
    garbage.write_bytes(bytes(8192))
    point = tmp_path / "g"
    point.mkdir()
    with pytest.raises(ErofsMountError) as excinfo:
        mount_erofs(garbage, point)
    assert str(garbage) in str(excinfo.value) and mount_entry(point) is None
    index = every_kind_index()
    image = disk_dir / "no-blob.erofs"
    image.write_bytes(build_image(index))
    with pytest.raises(ErofsMountError):
        mount_erofs(image, point, device=disk_dir / "missing.blob")
    assert mount_entry(point) is None
