"""Capture what an install changed in a directory as a layer of the block format, and publish it under a key.

Two shapes of "what changed", one code path after them:

* **a prefix** (bare metal): :func:`scan` the directory before the install and after
  it; :func:`diff` gives the entries created or changed (parents included, with their
  metadata) and the paths deleted (whiteouts).  A change is anything in ``lstat``
  (type, mode, owner, size, mtime, ctime, inode, link target): ctime moves on every
  write, chmod and link, so nothing is hashed to find changes;
* **an overlayfs upper directory** (a container's writable layer): everything in it,
  already in overlay form (whiteouts are 0/0 character devices, opaque directories
  carry ``trusted.overlay.opaque=y``).

:func:`write_tar` writes the change as an OCI layer tar (PAX: nanosecond mtimes,
xattrs, ``.wh.`` whiteouts, ``.wh..wh..opq``, hard links), hashing it for its diffID
on the way; :func:`publish_capture` feeds that tar to the converter's own packer
(:func:`blockstore.convert.converter.convert_layer`: packs, dedup segment, index, chain record),
then **verifies** the layer against the directory (every entry's metadata, every
block's SHA-256 read again from disk, and a second scan that must equal the first: a
tree that changed while it was captured is never published), and writes the deps
record **last**, first writer wins.  An install that failed is never given to this
module; a capture killed at any point leaves at most unreferenced objects.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import os
import socket
import stat
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable

from bootseer import __version__, confined
from bootseer.blockstore.convert.converter import ConversionError, DedupTable, convert_layer, verify_layer
from bootseer.blockstore.convert.layer_image import DEFAULT_INLINE_MAX
from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, OVERLAY_XATTR_PREFIX, EntryType, LayerIndex, index_object
from bootseer.images.chains import chain_id
from bootseer.blockstore.objects.signing import SigningKey
from bootseer.blockstore.objects.store import StoreWriter
from bootseer.blockstore.convert.tarlayer import OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX
from bootseer.log import get_logger

from .record import DepsRecord, deps_object

log = get_logger(__name__)

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"


class CaptureError(Exception):
    """A capture that must not be published (the tree changed under it, an entry cannot be stored...)."""


@dataclass(frozen=True)
class Node:
    """One entry of a scanned tree: what ``lstat`` (and ``readlink``) says about it."""

    kind: int  #: ``stat.S_IFMT``
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int
    nlink: int
    rdev: int = 0
    target: str = ""

    def same(self, other: Node) -> bool:
        """Unchanged (nlink aside: a new hard link elsewhere changes ctime anyway)."""
        return (self.kind, self.mode, self.uid, self.gid, self.size, self.mtime_ns, self.ctime_ns, self.ino,
                self.rdev, self.target) == (other.kind, other.mode, other.uid, other.gid, other.size,
                                            other.mtime_ns, other.ctime_ns, other.ino, other.rdev, other.target)  # fmt: skip


Tree = dict[str, Node]  # relative path ("" is the root) -> node


def _node(st: os.stat_result, target: str = "") -> Node:
    kind = stat.S_IFMT(st.st_mode)
    return Node(kind=kind, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                size=st.st_size if kind in (stat.S_IFREG, stat.S_IFLNK) else 0, mtime_ns=st.st_mtime_ns,
                ctime_ns=st.st_ctime_ns, ino=st.st_ino, dev=st.st_dev, nlink=st.st_nlink, rdev=st.st_rdev,
                target=target)  # fmt: skip


def _open_root(root: str) -> int | None:
    """A descriptor of the directory ``root`` (None if it does not exist); CaptureError if it is not a directory."""
    try:
        return confined.open_dir(root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise CaptureError(f"{root} is not a directory") from None
        raise


def scan(root: str | os.PathLike[str], *, exclude: Iterable[str] = ()) -> Tree:
    """Every entry under ``root`` (``{}`` if it does not exist); other filesystems' mount points are left out.

    ``exclude``: relative paths not scanned (nor anything under them).  The tree is read
    through directory descriptors (:func:`bootseer.confined.walk`): whoever writes in it
    cannot make the scan leave it.
    """
    root = os.fspath(root)
    fd = _open_root(root)
    if fd is None:
        return {}
    try:
        top = os.fstat(fd)
        tree: Tree = {"": _node(top)}

        def add(path: str, st: os.stat_result, parent_fd: int) -> None:
            if st.st_dev != top.st_dev and stat.S_ISDIR(st.st_mode):
                log.warning("not capturing another filesystem mounted in the tree", path=os.path.join(root, path))
                return
            target = ""
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(path.rpartition("/")[2], dir_fd=parent_fd)
                except OSError as exc:  # EINVAL, ENOENT: no longer the link just seen
                    raise CaptureError(f"{os.path.join(root, path)}: {exc.strerror}: the tree changed while it "
                                       "was scanned") from None  # fmt: skip
            tree[path] = _node(st, target)

        confined.walk(fd, exclude=exclude, on_entry=add)
    except confined.NotAsScanned as exc:
        raise CaptureError(f"{os.path.join(root, exc.filename or '')}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return tree


def _parts(path: str) -> tuple[str, ...]:
    return tuple(path.split("/")) if path else ()


@dataclass
class Change:
    """What a layer must hold: entries (with the root and every parent) and whiteouts."""

    entries: list[str]  #: paths of the after-tree, parents before children
    whiteouts: list[str] = field(default_factory=list)  #: deleted paths (the topmost of each deleted subtree)
    opaque: set[str] = field(default_factory=set)  #: directories that replace a directory (nothing below shows)

    @property
    def empty(self) -> bool:
        return not self.whiteouts and all(p == "" for p in self.entries)


def diff(before: Tree, after: Tree) -> Change:
    """The change from ``before`` to ``after`` (both :func:`scan` results of one directory)."""
    if "" not in after:
        raise CaptureError("the directory is gone after the install")
    wanted: set[str] = {""}
    opaque: set[str] = set()
    replaced: set[str] = set()  # paths whose old subtree no longer shows through (new inode or type)

    def under_replaced(path: str) -> bool:
        parts = _parts(path)
        return any("/".join(parts[:i]) in replaced for i in range(len(parts)))

    if "" in before and before[""].ino != after[""].ino:
        replaced.add("")  # the directory itself was made again: nothing of the old one shows
        opaque.add("")
    for path in sorted(after, key=_parts):
        node = after[path]
        old = before.get(path)
        if old is not None and old.same(node) and not under_replaced(path):
            continue
        wanted.add(path)
        if path and old is not None and (old.kind != node.kind or old.ino != node.ino):
            replaced.add(path)
            if node.kind == stat.S_IFDIR and old.kind == stat.S_IFDIR:
                opaque.add(path)  # a directory deleted and made again: what was under the old one is gone
    whiteouts = []
    for path in sorted(before, key=_parts):
        if path in after:
            continue
        parent = path.rpartition("/")[0]
        if parent in after and parent not in replaced and not under_replaced(parent):
            whiteouts.append(path)  # the topmost deleted path only: a whiteout hides everything below it
            wanted.add(parent)
    entries = set(wanted)
    for path in list(wanted) + whiteouts:  # every parent, with its metadata
        parts = _parts(path)
        for i in range(len(parts)):
            entries.add("/".join(parts[:i]))
    return Change(entries=sorted(entries, key=_parts), whiteouts=sorted(whiteouts, key=_parts), opaque=opaque)


def upper_change(upper: Tree) -> Change:
    """An overlayfs upper directory as a change: all of it (whiteouts and opaque marks come from the tree)."""
    return Change(entries=sorted(upper, key=_parts))


# -- the tar -------------------------------------------------------------------------------


class _HashingWriter:
    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.count += len(data)
        return self.raw.write(data)


@dataclass
class Expected:
    """What the published layer must hold, entry by entry (the index's view), for verification."""

    kind: EntryType
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int = 0
    target: str = ""
    rdev: tuple[int, int] = (0, 0)
    link_to: str | None = None  #: a hard link's first path
    source: str = ""  #: the file (relative to the captured root) whose blocks the layer holds
    seen: confined.Seen | None = None  #: what the scan saw of that file: it is read again only if it still is
    xattrs: dict[str, bytes] = field(default_factory=dict)  #: as the index keeps them (opaque as the marker says)


_KINDS = {stat.S_IFREG: EntryType.FILE, stat.S_IFDIR: EntryType.DIR, stat.S_IFLNK: EntryType.SYMLINK,
          stat.S_IFCHR: EntryType.CHAR, stat.S_IFBLK: EntryType.BLOCK, stat.S_IFIFO: EntryType.FIFO}  # fmt: skip


def _info(name: str, node: Node, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name or ".")
    info.type = kind
    info.mode = node.mode
    info.uid, info.gid = node.uid, node.gid
    info.uname = info.gname = ""
    info.mtime = node.mtime_ns // 1_000_000_000
    info.pax_headers["mtime"] = f"{node.mtime_ns // 1_000_000_000}.{node.mtime_ns % 1_000_000_000:09d}"
    return info


def write_tar(root: str | os.PathLike[str], tree: Tree, change: Change, out: BinaryIO, *,
              overlay_upper: bool = False) -> tuple[str, int, dict[str, Expected]]:  # fmt: skip
    """Write ``change`` of ``tree`` (rooted at ``root``) to ``out`` as a layer tar.

    Returns the diffID, the tar's length and what the layer's index must then hold
    (path -> :class:`Expected`).  ``overlay_upper``: ``tree`` is an overlayfs upper
    directory, whose 0/0 character devices are whiteouts and whose
    ``trusted.overlay.opaque=y`` marks opaque directories.
    """
    root = os.fspath(root)
    root_fd = _open_root(root)
    if root_fd is None:
        raise CaptureError(f"{root} is gone")
    try:
        if (os.fstat(root_fd).st_dev, os.fstat(root_fd).st_ino) != (tree[""].dev, tree[""].ino):
            raise CaptureError(f"{root} is not the directory that was scanned")
        return _write_tar(root, root_fd, tree, change, out, overlay_upper)
    finally:
        os.close(root_fd)


def _read_entry(root: str, root_fd: int, path: str, seen: confined.Seen) -> BinaryIO:
    """The regular file ``path`` open for reading, if it is still the one the scan saw; CaptureError if not."""
    try:
        return os.fdopen(confined.open_as_scanned(root_fd, path, seen), "rb")
    except OSError as exc:  # NotAsScanned, a symlink now in a parent (ELOOP), gone...
        raise CaptureError(f"{os.path.join(root, path)}: {exc.strerror}: the tree changed while it was captured, "
                           "capture refused (nothing read from it, nothing uploaded)") from None  # fmt: skip


def _write_tar(root: str, root_fd: int, tree: Tree, change: Change, out: BinaryIO,
               overlay_upper: bool) -> tuple[str, int, dict[str, Expected]]:  # fmt: skip
    hashed = _HashingWriter(out)
    expected: dict[str, Expected] = {}
    first_path: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=hashed, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8",  # type: ignore[call-overload]
                      errors="surrogateescape") as tar:  # fmt: skip
        for path in change.entries:
            node = tree[path]
            full = os.path.join(root, path) if path else root
            parent, _, base = path.rpartition("/")
            if base.startswith(WHITEOUT_PREFIX):
                raise CaptureError(f"{full}: a name starting with {WHITEOUT_PREFIX} cannot be stored in a layer")
            mtime = node.mtime_ns
            if overlay_upper and node.kind == stat.S_IFCHR and node.rdev == 0:
                whiteout(tar, expected, path, node.uid, node.gid, mtime)
                continue
            try:
                xattrs = confined.xattrs_beneath(root_fd, path)
            except OSError as exc:  # a parent is no longer a directory of the tree
                raise CaptureError(f"{full}: {exc.strerror}: the tree changed while it was captured") from None
            is_opaque = path in change.opaque or (overlay_upper and xattrs.get(OPAQUE_XATTR) == b"y")
            kept = {n: v for n, v in xattrs.items() if not n.startswith(OVERLAY_XATTR_PREFIX)}
            if is_opaque and node.kind == stat.S_IFDIR:
                kept[OPAQUE_XATTR] = b"y"
            common = dict(mode=node.mode, uid=node.uid, gid=node.gid, mtime_ns=mtime, xattrs=kept)
            kind = _KINDS.get(node.kind)
            if kind is None:
                raise CaptureError(f"{full}: a socket (or other special file) cannot be stored in a layer")
            if kind is EntryType.DIR:
                info = _info(path, node, tarfile.DIRTYPE)
            elif kind is EntryType.FILE:
                identity = (node.dev, node.ino)
                if node.nlink > 1 and identity in first_path:
                    info = _info(path, node, tarfile.LNKTYPE)
                    info.linkname = first_path[identity]
                    expected[path] = Expected(kind, link_to=first_path[identity], size=node.size, **common)  # type: ignore[arg-type]
                    _add_xattrs(info, xattrs)
                    tar.addfile(info)
                    continue
                first_path[identity] = path
                info = _info(path, node, tarfile.REGTYPE)
                info.size = node.size
            elif kind is EntryType.SYMLINK:
                info = _info(path, node, tarfile.SYMTYPE)
                info.linkname = node.target
            elif kind is EntryType.FIFO:
                info = _info(path, node, tarfile.FIFOTYPE)
            else:
                info = _info(path, node, tarfile.CHRTYPE if kind is EntryType.CHAR else tarfile.BLKTYPE)
                info.devmajor, info.devminor = os.major(node.rdev), os.minor(node.rdev)
            _add_xattrs(info, xattrs)
            if kind is EntryType.FILE:
                with _read_entry(root, root_fd, path, confined.Seen(node.dev, node.ino, node.size)) as f:
                    try:
                        tar.addfile(info, f)
                    except OSError as exc:  # shorter than scanned: tarfile's "unexpected end of data"
                        raise CaptureError(f"{full} changed while it was captured ({exc})") from None
            else:
                tar.addfile(info)
            expected[path] = Expected(kind, size=node.size if kind in (EntryType.FILE, EntryType.SYMLINK) else 0,
                                      target=node.target, source=path if kind is EntryType.FILE else "",
                                      seen=confined.Seen(node.dev, node.ino, node.size) if kind is EntryType.FILE else None,
                                      rdev=(os.major(node.rdev), os.minor(node.rdev)) if kind in (EntryType.CHAR, EntryType.BLOCK) else (0, 0),
                                      **common)  # type: ignore[arg-type]  # fmt: skip
            if is_opaque and kind is EntryType.DIR:
                marker = tarfile.TarInfo(f"{path}/{OPAQUE_MARKER}" if path else OPAQUE_MARKER)
                marker.mtime = node.mtime_ns // 1_000_000_000
                tar.addfile(marker)
        for path in change.whiteouts:
            parent = tree[path.rpartition("/")[0]]
            whiteout(tar, expected, path, parent.uid, parent.gid, parent.mtime_ns)
    return "sha256:" + hashed.hash.hexdigest(), hashed.count, expected


def whiteout(tar: tarfile.TarFile, expected: dict[str, Expected], path: str, uid: int, gid: int, mtime_ns: int) -> None:
    parent, _, base = path.rpartition("/")
    info = tarfile.TarInfo(f"{parent}/{WHITEOUT_PREFIX}{base}" if parent else WHITEOUT_PREFIX + base)
    info.mode, info.uid, info.gid = 0, uid, gid
    info.mtime = mtime_ns // 1_000_000_000
    info.pax_headers["mtime"] = f"{mtime_ns // 1_000_000_000}.{mtime_ns % 1_000_000_000:09d}"
    tar.addfile(info)
    expected[path] = Expected(EntryType.CHAR, mode=0, uid=uid, gid=gid, mtime_ns=mtime_ns)


def _add_xattrs(info: tarfile.TarInfo, xattrs: dict[str, bytes]) -> None:
    for name, value in xattrs.items():
        if name.startswith(OVERLAY_XATTR_PREFIX):
            continue  # overlayfs's own bookkeeping: opaque is the .wh..wh..opq marker, the rest must not travel
        info.pax_headers["SCHILY.xattr." + name] = value.decode("utf-8", "surrogateescape")


# -- verification ----------------------------------------------------------------------------


def verify_index(index: LayerIndex, expected: dict[str, Expected], root: str | os.PathLike[str]) -> None:
    """Check the layer's index against the tree at ``root``: every entry, every block read again from disk (each
    file only if it is still the one the scan saw); CaptureError if not."""
    root = os.fspath(root)
    root_fd = _open_root(root)
    if root_fd is None:
        raise CaptureError(f"{root} is gone")
    try:
        _verify_index(index, expected, root, root_fd)
    finally:
        os.close(root_fd)


def _verify_index(index: LayerIndex, expected: dict[str, Expected], root: str, root_fd: int) -> None:
    entries = {e.path: (n, e) for n, e in enumerate(index.entries)}
    if set(entries) != set(expected):
        extra = sorted(set(entries) - set(expected))[:3]
        missing = sorted(set(expected) - set(entries))[:3]
        raise CaptureError(f"the layer's entries differ from the tree (extra {extra}, missing {missing})")
    for path, want in expected.items():
        number, entry = entries[path]
        got = (entry.type, entry.mode, entry.uid, entry.gid, entry.mtime_ns, entry.size, entry.target, entry.rdev,
               entry.xattrs)
        if got != (want.kind, want.mode, want.uid, want.gid, want.mtime_ns, want.size, want.target, want.rdev,
                   want.xattrs):
            raise CaptureError(f"{path or '/'}: the layer holds {got}, the tree {want}")
        if want.link_to is not None:
            if entry.link is None or index.entries[entry.link].path != want.link_to:
                raise CaptureError(f"{path}: not the hard link to {want.link_to} it is in the tree")
            continue
        if want.kind is EntryType.FILE:
            blocks = index.file_blocks(entry)
            assert want.seen is not None
            with _read_entry(root, root_fd, want.source, want.seen) as f:
                for block in blocks:
                    data = f.read(block.rlen)
                    if hashlib.sha256(data).hexdigest() != block.digest:
                        raise CaptureError(f"{os.path.join(root, want.source)}: a block differs from the file on disk")
                if f.read(1):
                    raise CaptureError(f"{os.path.join(root, want.source)}: the file is longer than the layer holds")


# -- publishing -------------------------------------------------------------------------------


@dataclass
class CaptureResult:
    record: DepsRecord | None  #: what the store holds under the key now (this capture's, or the winner's)
    published: bool  #: this capture wrote the record
    chain_id: str
    files: int
    bytes: int
    uploaded_bytes: int


def publish_capture(
    writer: StoreWriter,
    *,
    key: str,
    root: str | os.PathLike[str],
    tree: Tree,
    change: Change,
    mode: str,
    parent: str = "",
    prefix: str = "",
    command: list[str] | None = None,
    inputs: dict[str, str] | None = None,
    overlay_upper: bool = False,
    exclude: Iterable[str] = (),
    spool_dir: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    sign_key: SigningKey | None = None,
    inline_max: int | None = DEFAULT_INLINE_MAX,
) -> CaptureResult:
    """Make ``change`` a layer in ``writer``'s store, verify it against ``root``, then publish the deps record
    (signed by ``sign_key``, the node's key, if given: it names the layer's index, so it vouches for the layer).
    The layer is published with its EROFS image, files of at most ``inline_max`` bytes inside
    (None: none; a node then builds the image from the index), so a restore mounts it and builds nothing.

    Raises CaptureError (nothing published: the tree changed, an entry cannot be
    stored, the layer does not match) or StoreError (the store failed).  Returns a
    result whose ``published`` is False when another capture of the key won.
    """
    with tempfile.TemporaryDirectory(prefix="bootseer-deps-", dir=spool_dir) as spool:
        tar_path = Path(spool) / "layer.tar"
        with open(tar_path, "wb") as out:
            diff_id, size, expected = write_tar(root, tree, change, out, overlay_upper=overlay_upper)  # type: ignore[arg-type]
        chain = chain_id(parent, diff_id)
        table = DedupTable.load(writer)
        try:
            with open(tar_path, "rb") as blob:
                result = convert_layer(writer, table, blob, chain=chain, parent=parent, diff_id=diff_id, digest=diff_id,
                                       media_type=LAYER_MEDIA_TYPE, size=size, block_size=block_size,
                                       compression="none", spool_dir=spool, label=f"deps {key[:12]}",
                                       inline_max=inline_max)  # fmt: skip
        except ConversionError as exc:
            raise CaptureError(str(exc)) from None
    chain_record = verify_layer(writer, chain)
    if chain_record is None:
        raise CaptureError(f"the captured layer {chain} does not verify in {writer.display_url}")
    data = writer.get(index_object(chain_record.index))
    assert data is not None  # verify_layer read it
    index = LayerIndex.decode(data, record=chain_record)
    verify_index(index, expected, root)
    again = scan(root, exclude=exclude)
    changed = [p for p in set(tree) | set(again) if p not in tree or p not in again or not tree[p].same(again[p])]
    if changed:
        raise CaptureError(f"the tree changed while it was captured ({len(changed)} entries, e.g. {sorted(changed)[0]!r})")
    record = DepsRecord(
        key=key, mode=mode, chain_id=chain, parent=parent, diff_id=diff_id, index=chain_record.index,
        files=chain_record.files, bytes=chain_record.bytes, prefix=prefix, command=list(command or []),
        inputs=dict(inputs or {}), node=socket.gethostname(), capturer=f"bootseer {__version__}",
        captured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )  # fmt: skip
    if sign_key is not None:
        record = record.sign(sign_key)
    name = deps_object(key)
    published = writer.put_if_absent(name, record.encode())  # last: this is what makes the snapshot visible
    back = writer.get(name)
    try:
        stored = DepsRecord.decode(back, expected_key=key) if back is not None else None
    except ValueError as exc:
        raise CaptureError(f"the deps record {name} reads back malformed: {exc}") from None
    if published and stored != record:
        raise CaptureError(f"the deps record {name} reads back different from what was written")
    if not published:
        log.info("another run published this dependency snapshot first; keeping its record", key=key,
                 chain_id=stored.chain_id if stored else None)  # fmt: skip
    return CaptureResult(record=stored, published=published, chain_id=chain, files=result.files,
                         bytes=chain_record.bytes, uploaded_bytes=result.uploaded_bytes)  # fmt: skip
