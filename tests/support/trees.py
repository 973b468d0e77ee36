"""Compare file trees: a converted layer (index + packs of a local store) against a plain extraction.

* :func:`disk_tree` -- the metadata of a directory tree as ``tar -x`` left it (``lstat``
  only: nothing is followed), in overlayfs lower-dir form when ``overlay=True``
  (``.wh.NAME`` files become 0/0 character devices, ``.wh..wh..opq`` an opaque xattr).
* :func:`index_tree` -- the same view of a :class:`~blockstore.objects.format.LayerIndex`, reading
  file contents from the packs of a store directory with :func:`read_file` (a FUSE-free
  consumer: blocks verified against their digests, symlinks never resolved).
* :func:`extract_with_tar` -- GNU tar as root with xattrs, the reference extraction.
* :func:`apply_layers` -- what overlayfs shows of lower-dir trees stacked (bottom first);
  :func:`as_whiteouts` compares whiteouts by what overlayfs looks at.

Each tree is ``{path: Meta}``; hard links are compared as groups of paths sharing an inode.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from bootseer.blockstore.objects.format import EntryType, LayerIndex, pack_object

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"


@dataclass(frozen=True)
class Meta:
    type: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    sha256: str = ""  #: of a regular file's contents
    target: str = ""
    rdev: tuple[int, int] = (0, 0)
    xattrs: tuple[tuple[str, bytes], ...] = ()
    links: tuple[str, ...] = field(default=(), compare=True)  #: every path of a hard-linked inode, sorted


_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFCHR: "char",
          stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}  # fmt: skip


def _sha_of_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def disk_tree(root: Path, *, overlay: bool = True, xattr_prefixes: tuple[str, ...] = ("user.", "trusted.")) -> dict[str, Meta]:
    """``{relative path: Meta}`` of everything under ``root`` (not ``root`` itself)."""
    found: dict[str, Meta] = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    opaque: set[str] = set()
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = Path(directory, name)
            rel = str(full.relative_to(root))
            st = os.lstat(full)
            kind = _TYPES[stat.S_IFMT(st.st_mode)]
            parent = rel.rpartition("/")[0]
            if overlay and name == OPAQUE_MARKER:
                opaque.add(parent)
                continue
            if overlay and name.startswith(WHITEOUT_PREFIX):
                target = f"{parent}/{name[len(WHITEOUT_PREFIX):]}" if parent else name[len(WHITEOUT_PREFIX) :]
                found[target] = Meta("char", 0, st.st_uid, st.st_gid, st.st_mtime_ns, 0)
                continue
            xattrs: tuple[tuple[str, bytes], ...] = ()
            if kind != "symlink":
                xattrs = tuple(sorted((x, os.getxattr(full, x, follow_symlinks=False))
                                      for x in os.listxattr(full, follow_symlinks=False)
                                      if x.startswith(xattr_prefixes)))  # fmt: skip
            found[rel] = Meta(
                type=kind,
                mode=stat.S_IMODE(st.st_mode),
                uid=st.st_uid,
                gid=st.st_gid,
                mtime_ns=st.st_mtime_ns,
                size=st.st_size if kind in ("file", "symlink") else 0,
                sha256=_sha_of_file(full) if kind == "file" else "",
                target=os.readlink(full) if kind == "symlink" else "",
                rdev=(os.major(st.st_rdev), os.minor(st.st_rdev)) if kind in ("char", "block") else (0, 0),
                xattrs=xattrs,
            )
            if kind == "file" and st.st_nlink > 1:
                inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
    for directory in opaque:
        meta = found[directory]
        found[directory] = _replace(meta, xattrs=tuple(sorted(meta.xattrs + (("trusted.overlay.opaque", b"y"),))))
    for paths in inodes.values():
        group = tuple(sorted(paths))
        for path in paths:
            found[path] = _replace(found[path], links=group if len(group) > 1 else ())
    return found


def _replace(meta: Meta, **changes: object) -> Meta:
    import dataclasses

    return dataclasses.replace(meta, **changes)  # type: ignore[arg-type]


def read_block(store: Path, index: LayerIndex, number: int) -> bytes:
    """The raw bytes of block ``number`` of ``index``, from the packs of store directory ``store``.

    Decompressed and checked against its SHA-256 (AssertionError if it does not match).
    """
    block = index.blocks[number]
    if block.is_zero:
        data = bytes(block.rlen)
    else:
        with open(store / pack_object(index.packs[block.pack]), "rb") as pack:
            pack.seek(block.offset)
            data = zstandard.ZstdDecompressor().decompress(pack.read(block.clen), max_output_size=block.rlen)
    assert len(data) == block.rlen and hashlib.sha256(data).hexdigest() == block.digest, f"block {block.digest} is corrupt"
    return data


def read_file(store: Path, index: LayerIndex, entry_number: int) -> bytes:
    """The contents of FILE entry ``entry_number``, from the packs of store directory ``store``.

    Every block is decompressed and checked against its SHA-256 (AssertionError if not).
    """
    entry = index.entries[entry_number]
    assert entry.type is EntryType.FILE, entry
    if entry.link is not None:
        entry = index.entries[entry.link]
    out = b"".join(read_block(store, index, number) for number in entry.blocks)
    assert len(out) == entry.size
    return out


def index_tree(store: Path, index: LayerIndex) -> dict[str, Meta]:
    """``{path: Meta}`` of a converted layer (root excluded), contents read from ``store``."""
    found: dict[str, Meta] = {}
    groups: dict[int, list[str]] = {}
    for number, entry in enumerate(index.entries):
        if number == 0:
            continue
        kind = entry.type.value
        sha = ""
        if entry.type is EntryType.FILE:
            root = entry.link if entry.link is not None else number
            sha = hashlib.sha256(read_file(store, index, root)).hexdigest()
            groups.setdefault(root, []).append(entry.path)
        found[entry.path] = Meta(
            type=kind,
            mode=entry.mode,
            uid=entry.uid,
            gid=entry.gid,
            mtime_ns=entry.mtime_ns,
            size=entry.size if entry.type in (EntryType.FILE, EntryType.SYMLINK) else 0,
            sha256=sha,
            target=entry.target,
            rdev=entry.rdev,
            xattrs=tuple(sorted(entry.xattrs.items())) if entry.type is not EntryType.SYMLINK else (),
        )
    for paths in groups.values():
        if len(paths) > 1:
            group = tuple(sorted(paths))
            for path in paths:
                found[path] = _replace(found[path], links=group)
    return found


OPAQUE_XATTR = "trusted.overlay.opaque"


def is_whiteout(meta: Meta) -> bool:
    return meta.type == "char" and meta.rdev == (0, 0)


def as_whiteouts(tree: dict[str, Meta]) -> dict[str, Meta]:
    """Whiteouts compared by what overlayfs looks at: a character device 0/0."""
    return {path: Meta("char", 0, 0, 0, 0, 0) if is_whiteout(meta) else meta for path, meta in tree.items()}


def apply_layers(layers: list[dict[str, Meta]]) -> dict[str, Meta]:
    """The merged view of layers in lower-dir form (bottom first), as overlayfs shows it."""
    merged: dict[str, Meta] = {}

    def remove(path: str, *, keep_self: bool) -> None:
        for rel in [r for r in merged if r.startswith(path + "/") or (r == path and not keep_self)]:
            del merged[rel]

    for layer in layers:
        for path, meta in sorted(layer.items()):
            if is_whiteout(meta):
                remove(path, keep_self=False)
                continue
            if meta.type == "dir" and (OPAQUE_XATTR, b"y") in meta.xattrs:
                remove(path, keep_self=True)
            elif meta.type != "dir":
                remove(path, keep_self=False)
            merged[path] = _replace(meta, xattrs=tuple(x for x in meta.xattrs if x[0] != OPAQUE_XATTR))
    # Hard-link groups as the merged view has them: only the names still there.
    return {
        path: _replace(meta, links=tuple(p for p in meta.links if p in merged)) if meta.links else meta
        for path, meta in merged.items()
    }


def extract_with_tar(blob: Path, dest: Path) -> None:
    """Extract layer blob ``blob`` (gzip, zstd or plain) into ``dest`` with GNU tar, as root, xattrs kept."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(blob, "rb") as f:
        head = f.read(4)
    if head == b"\x28\xb5\x2f\xfd":  # GNU tar needs the zstd program for --zstd: decompress here
        plain = dest.parent / (dest.name + ".tar")
        with open(blob, "rb") as source, open(plain, "wb") as out:
            zstandard.ZstdDecompressor().copy_stream(source, out)
        try:
            extract_with_tar(plain, dest)
        finally:
            plain.unlink()
        return
    decompress = ["-z"] if head[:2] == b"\x1f\x8b" else []
    subprocess.run(
        ["tar", "-x", *decompress, "--delay-directory-restore", "--xattrs", "--xattrs-include=*", "--same-owner", "--same-permissions",
         "--numeric-owner", "-f", str(blob), "-C", str(dest)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
