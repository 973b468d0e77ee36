"""Read one layer tar, as a stream, into the entries of a layer index and blocks of file contents.

:func:`read_layer` takes the layer blob as it comes (gzip, zstd or plain tar, told apart
by their magic bytes), decompresses and parses it in one pass and hands every
regular file's contents, ``block_size`` bytes at a time, to a :class:`BlockSink` (the
converter's pack writer), so memory stays bounded whatever the layer's size: what it
keeps is one record per entry and one block number per block.  It returns the layer's
tree in the form an overlayfs lower directory has (:class:`blockstore.objects.format.Entry`)
and the diffID (SHA-256 of the uncompressed tar) it computed on the way.

Tar semantics, as containerd's applier (``archive/tar.go``) and GNU tar extract:

* Names are cleaned (``./a//b/`` is ``a/b``); ``.`` or ``./`` is the layer root.  A name
  with a ``..`` component or starting with ``/`` is refused (:class:`LayerError`), never
  clamped: a tar that tries to leave its root is broken or hostile.
* A later entry for a path replaces the earlier one (a directory replacing a directory
  keeps its children and takes the new metadata; anything else replacing a directory
  removes the subtree, as containerd's ``RemoveAll`` does).  A parent that is not
  listed is created as a directory 0755 owned by root with mtime 0 (containerd's
  ``mkparent``); a parent that exists but is not a directory is refused.
* Hard links must name an earlier regular file of this layer (resolved the same way
  as names); a link out of the layer, to nothing, or to a non-regular entry is refused.
  Linked paths share one inode (its metadata and blocks); replacing one of them later
  leaves the others with the old inode.
* Symlink targets are kept byte for byte, absolute ones and ``..`` included: they are
  resolved inside the container's root at run time, and BootSeer never follows them.
* Whiteouts: ``.wh.NAME`` becomes a character device 0/0 (mode 0) named NAME,
  ``.wh..wh..opq`` sets ``trusted.overlay.opaque=y`` on its directory, other
  ``.wh..wh.*`` names (aufs bookkeeping) are skipped.  Xattrs come from PAX
  ``SCHILY.xattr.*`` records; of the ``trusted.overlay.*`` xattrs in the tar itself only
  ``opaque=y`` on a directory is kept (it means what the marker means); the others
  (``redirect``, ``origin``, ``metacopy``...) are dropped: overlayfs metadata that points
  elsewhere must not come from an image.
* Sparse files (GNU old format and PAX 0.0/0.1/1.0, as :mod:`tarfile` parses their
  maps) and runs of zeros in any file become zero blocks, stored nowhere.  Only the
  blocks that hold data are read: a hole's whole blocks cost O(1) together, so a
  file costs O(runs + data), never O(its claimed size).  PAX ``mtime`` keeps
  nanoseconds; names that are not UTF-8 are kept as surrogate escapes.

Every refusal names the entry and the reason; tarfile's own errors (bad checksums,
truncation, garbage) are turned into the same :class:`LayerError`.  Header sizes,
names, link targets, xattrs, sparse maps and the entry count are bounded by
:class:`TarLimits`, checked before anything that large is read into memory; so are
the layer's size (its uncompressed tar, and its files' claimed sizes, holes
included: ``--max-layer-size``, 64 GiB by default) and its block references (one per
block of each file, what the index stores).
"""

from __future__ import annotations

import gzip
import hashlib
import tarfile
import zlib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import BinaryIO, Protocol

import zstandard

from bootseer.blockstore.objects.format import OPAQUE_XATTR, Entry, EntryType, overlay_xattr_allowed

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_XATTR_PAX = "SCHILY.xattr."

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ_CHUNK = 1 << 20

#: Default of :attr:`TarLimits.max_layer_bytes` (``bootseer convert --max-layer-size``).
DEFAULT_MAX_LAYER_BYTES = 64 << 30


class LayerError(ValueError):
    """A layer tar that BootSeer refuses to convert: ``entry`` (may be None) and ``reason`` say why."""

    def __init__(self, entry: str | None, reason: str) -> None:
        self.entry = entry
        self.reason = reason
        where = f"entry {entry!r}" if entry is not None else "layer tar"
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class TarLimits:
    """Bounds on what one layer tar may hold; beyond them it is refused, not read."""

    max_path: int = 4096  #: bytes of a cleaned path (Linux PATH_MAX)
    max_name: int = 255  #: bytes of one path component (NAME_MAX)
    max_link: int = 4096  #: bytes of a symlink or hardlink target
    max_header: int = 1 << 20  #: bytes of one PAX or GNU long-name/long-link header's data
    max_xattr_name: int = 255  #: bytes of an xattr name (XATTR_NAME_MAX)
    max_xattr_value: int = 64 << 10  #: bytes of one xattr value (XATTR_SIZE_MAX)
    max_xattrs: int = 1 << 20  #: bytes of all xattrs of one entry
    max_sparse: int = 1 << 16  #: runs in one sparse file's map
    max_entries: int = 10_000_000  #: entries in the layer
    #: bytes of the layer: of its uncompressed tar (counted as it is read), and of its regular
    #: files' claimed sizes (holes of sparse files included; each checked from its header,
    #: before its bytes are read)
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES
    max_block_refs: int = 1 << 22  #: block references in the layer's index (one per block of each file)


class BlockSink(Protocol):
    """Where file contents go, one block at a time; each call returns the block's number."""

    def add(self, data: bytes) -> int:
        """Store one block of raw bytes (which may all be zero)."""
        ...

    def add_zeros(self, length: int, count: int) -> int:
        """Record ``count`` all-zero blocks of ``length`` bytes (a hole: no bytes are read or passed)."""
        ...


@dataclass
class ParsedLayer:
    """What :func:`read_layer` found: the tree, the diffID and how much it read."""

    entries: list[Entry]  #: root first, parents before children (see :class:`blockstore.objects.format.LayerIndex`)
    diff_id: str  #: ``sha256:`` of the uncompressed tar, every byte of it
    tar_bytes: int  #: length of the uncompressed tar
    file_bytes: int  #: bytes of regular file contents (each inode once)
    compression: str  #: ``gzip``, ``zstd`` or ``none`` (as detected)


# -- the byte streams -------------------------------------------------------------------


class HashingReader:
    """A read-only file that hashes and counts every byte read through it, at most ``limit`` of them.

    Past ``limit`` it raises :class:`LayerError`: a few KB of zstd can stand for a
    terabyte of tar (padding after the end-of-archive marker, say), all of which the
    diffID would otherwise hash.
    """

    def __init__(self, raw: BinaryIO, limit: int | None = None) -> None:
        self.raw = raw
        self.limit = limit
        self.hash = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.hash.update(data)
        self.count += len(data)
        if self.limit is not None and self.count > self.limit:
            raise LayerError(None, f"uncompressed tar is larger than the layer limit of {self.limit} bytes (--max-layer-size)")
        return data

    def drain(self) -> None:
        """Read (and hash) whatever is left."""
        while self.read(_READ_CHUNK):
            pass

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


class _Prefixed:
    """``raw`` with ``head`` (bytes already read from it to sniff the format) put back in front."""

    def __init__(self, head: bytes, raw: BinaryIO) -> None:
        self.head, self.raw = head, raw

    def read(self, size: int = -1) -> bytes:
        if self.head:
            if size < 0:
                data, self.head = self.head + self.raw.read(), b""
                return data
            data, self.head = self.head[:size], self.head[size:]
            if len(data) < size:
                data += self.raw.read(size - len(data))
            return data
        return self.raw.read(size)

    def readable(self) -> bool:
        return True


class _Decompressed:
    """The uncompressed tar of a layer blob; decompression errors become :class:`LayerError`."""

    def __init__(self, blob: BinaryIO) -> None:
        head = b""
        while len(head) < 4:
            more = blob.read(4 - len(head))
            if not more:
                break
            head += more
        source = _Prefixed(head, blob)
        if head.startswith(_GZIP_MAGIC):
            self.compression = "gzip"
            self._stream: BinaryIO = gzip.GzipFile(fileobj=source, mode="rb")  # type: ignore[arg-type]
        elif head.startswith(_ZSTD_MAGIC):
            self.compression = "zstd"
            self._stream = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)  # type: ignore[assignment]
        else:
            self.compression = "none"
            self._stream = source  # type: ignore[assignment]

    def read(self, size: int = -1) -> bytes:
        try:
            return self._stream.read(size)
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
            raise LayerError(None, f"{self.compression} stream is corrupt or truncated: {exc}") from None


# -- tarfile, strict ------------------------------------------------------------------------

#: What tarfile raises for malformed input besides LayerError (``ValueError`` covers
#: ``int()`` of bad numbers and ``UnicodeError``; never OSError, which is ours: a full spool disk).
_TARFILE_ERRORS = (tarfile.TarError, ValueError, OverflowError, EOFError)

_LONG_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def _strict_tarinfo(limits: TarLimits) -> type[tarfile.TarInfo]:
    """A TarInfo class that refuses what tarfile would accept silently or read unbounded.

    tarfile treats an invalid header after the first as the end of the archive (a
    truncated or corrupted layer would convert as a shorter one) and reads PAX and
    long-name headers and sparse extension chains whole, whatever their size.
    """

    class StrictTarInfo(tarfile.TarInfo):
        @classmethod
        def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:
            try:
                return super().frombuf(buf, encoding, errors)
            except (tarfile.EOFHeaderError, tarfile.EmptyHeaderError):
                raise  # the end-of-archive marker, or the stream ends on a block boundary
            except tarfile.TruncatedHeaderError:
                raise LayerError(None, "tar ends in the middle of a header (truncated)") from None
            except tarfile.HeaderError as exc:
                raise LayerError(None, f"malformed tar header: {exc}") from None

        def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            if self.type in _LONG_TYPES and self.size > limits.max_header:
                raise LayerError(self.name, f"extended header of {self.size} bytes (limit {limits.max_header})")
            return super()._proc_member(tar)  # type: ignore[misc]

        def _proc_sparse(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            # tarfile's own loop collects extension blocks without bound; this one counts.
            structs, isextended, origsize = self._sparse_structs  # type: ignore[attr-defined]
            del self._sparse_structs  # type: ignore[attr-defined]
            while isextended:
                if len(structs) > limits.max_sparse:
                    raise LayerError(self.name, f"sparse map of more than {limits.max_sparse} runs")
                buf = tar.fileobj.read(tarfile.BLOCKSIZE)  # type: ignore[union-attr]
                if len(buf) != tarfile.BLOCKSIZE:
                    raise LayerError(self.name, "tar ends in a sparse extension header (truncated)")
                for position in range(0, 21 * 24, 24):
                    try:
                        offset = tarfile.nti(buf[position : position + 12])
                        numbytes = tarfile.nti(buf[position + 12 : position + 24])
                    except tarfile.InvalidHeaderError:
                        raise LayerError(self.name, "malformed sparse extension header") from None
                    if offset and numbytes:
                        structs.append((offset, numbytes))
                isextended = bool(buf[504])
            self.sparse = structs
            self.offset_data = tar.fileobj.tell()  # type: ignore[union-attr]
            tar.offset = self.offset_data + self._block(self.size)  # type: ignore[attr-defined]
            self.size = origsize
            return self

        def _proc_gnusparse_10(self, next: tarfile.TarInfo, pax_headers: dict, tar: tarfile.TarFile) -> None:
            # PAX sparse 1.0 keeps its map at the start of the data; tarfile reads as many
            # runs as the first line says.  This reads the count first and refuses a large one.
            fileobj = tar.fileobj
            assert fileobj is not None
            buf = fileobj.read(tarfile.BLOCKSIZE)
            numbers: list[int] = []
            wanted: int | None = None
            while wanted is None or len(numbers) < 2 * wanted:
                line, newline, rest = buf.partition(b"\n")
                if not newline:
                    if len(buf) > 64:  # no decimal number is that long
                        raise LayerError(next.name, "malformed PAX 1.0 sparse map")
                    more = fileobj.read(tarfile.BLOCKSIZE)
                    if len(more) != tarfile.BLOCKSIZE:
                        raise LayerError(next.name, "tar ends in a sparse map (truncated)")
                    buf += more
                    continue
                buf = rest
                try:
                    number = int(line)
                except ValueError:
                    raise LayerError(next.name, f"malformed PAX 1.0 sparse map line {line[:20]!r}") from None
                if number < 0:
                    raise LayerError(next.name, "negative number in a sparse map")
                if wanted is None:
                    if number > limits.max_sparse:
                        raise LayerError(next.name, f"sparse map of {number} runs (limit {limits.max_sparse})")
                    wanted = number
                else:
                    numbers.append(number)
            next.offset_data = fileobj.tell()
            next.sparse = list(zip(numbers[::2], numbers[1::2]))

    return StrictTarInfo


# -- the tree -----------------------------------------------------------------------------


@dataclass
class _Inode:
    """What hard links share: a file's metadata and contents."""

    mode: int
    uid: int
    gid: int
    mtime_ns: int
    xattrs: dict[str, bytes]
    size: int = 0
    blocks: tuple[int, ...] = ()


@dataclass
class _Node:
    type: EntryType
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    target: str = ""
    rdev: tuple[int, int] = (0, 0)
    xattrs: dict[str, bytes] = field(default_factory=dict)
    inode: _Inode | None = None  #: FILE nodes only
    children: dict[str, None] | None = None  #: DIR nodes only: names, in insertion order


def _encoded(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class _Tree:
    def __init__(self, limits: TarLimits) -> None:
        self.limits = limits
        self.nodes: dict[str, _Node] = {"": _Node(EntryType.DIR, children={})}

    def clean(self, name: str, what: str, entry: str) -> str:
        """A tar name as a relative path ("" for the root), or LayerError."""
        if "\0" in name:
            raise LayerError(entry, f"{what} has a NUL byte")
        if len(_encoded(name)) > self.limits.max_path:
            raise LayerError(entry, f"{what} is longer than {self.limits.max_path} bytes")
        if name.startswith("/"):
            raise LayerError(entry, f"{what} is absolute (a layer's names are relative to its root)")
        parts = [part for part in name.split("/") if part not in ("", ".")]
        if ".." in parts:
            raise LayerError(entry, f"{what} has a '..' component (path traversal)")
        for part in parts:
            if len(_encoded(part)) > self.limits.max_name:
                raise LayerError(entry, f"{what} has a component longer than {self.limits.max_name} bytes")
        return "/".join(parts)

    def ensure_parent(self, path: str, entry: str) -> None:
        parent = path.rpartition("/")[0]
        missing = []
        while parent not in self.nodes:
            missing.append(parent)
            parent = parent.rpartition("/")[0]
        if self.nodes[parent].type is not EntryType.DIR:
            raise LayerError(entry, f"parent {parent!r} is not a directory")
        for directory in reversed(missing):
            self._link(directory, _Node(EntryType.DIR, mode=0o755, children={}))

    def _link(self, path: str, node: _Node) -> None:
        self.nodes[path] = node
        parent, _, name = path.rpartition("/")
        children = self.nodes[parent].children
        assert children is not None
        children[name] = None

    def remove(self, path: str) -> None:
        """Remove ``path`` and, for a directory, everything under it (iteratively: trees may be 2048 deep)."""
        parent, _, name = path.rpartition("/")
        siblings = self.nodes[parent].children
        assert siblings is not None
        siblings.pop(name, None)
        stack = [path]
        while stack:
            current = stack.pop()
            node = self.nodes.pop(current)
            if node.children:
                stack.extend(f"{current}/{child}" for child in node.children)

    def put(self, path: str, node: _Node, entry: str) -> None:
        """Add ``node`` at ``path``: a later entry replaces an earlier one (see the module doc)."""
        if path == "":
            if node.type is not EntryType.DIR:
                raise LayerError(entry, "the layer root is not a directory")
            root = self.nodes[""]
            node.children = root.children
            node.xattrs = {**node.xattrs, **_opaque_of(root)}
            self.nodes[""] = node
            return
        self.ensure_parent(path, entry)
        old = self.nodes.get(path)
        if old is not None:
            if old.type is EntryType.DIR and node.type is EntryType.DIR:
                node.children = old.children
                node.xattrs = {**node.xattrs, **_opaque_of(old)}
                self.nodes[path] = node
                return
            self.remove(path)
        if node.type is EntryType.DIR and node.children is None:
            node.children = {}
        self._link(path, node)

    def count(self) -> int:
        return len(self.nodes)

    def entries(self) -> list[Entry]:
        """The tree, root first, depth first, children by name; hard links after their first path."""
        out: list[Entry] = []
        first_path: dict[int, int] = {}  # id(inode) -> entry number of its first path

        stack = [""]  # depth first, children by name; iterative: trees may be 2048 deep
        while stack:
            path = stack.pop()
            node = self.nodes[path]
            if node.type is EntryType.FILE:
                inode = node.inode
                assert inode is not None
                number = first_path.get(id(inode))
                common = dict(mode=inode.mode, uid=inode.uid, gid=inode.gid, mtime_ns=inode.mtime_ns,
                              size=inode.size, xattrs=dict(inode.xattrs))  # fmt: skip
                if number is None:
                    first_path[id(inode)] = len(out)
                    out.append(Entry(path=path, type=EntryType.FILE, blocks=inode.blocks, **common))  # type: ignore[arg-type]
                else:
                    out.append(Entry(path=path, type=EntryType.FILE, link=number, **common))  # type: ignore[arg-type]
                continue
            size = len(_encoded(node.target)) if node.type is EntryType.SYMLINK else 0
            out.append(Entry(path=path, type=node.type, mode=node.mode, uid=node.uid, gid=node.gid,
                             mtime_ns=node.mtime_ns, size=size, target=node.target, rdev=node.rdev,
                             xattrs=dict(node.xattrs)))  # fmt: skip
            if node.children is not None:
                stack.extend(f"{path}/{name}" if path else name for name in sorted(node.children, reverse=True))
        return out


def _opaque_of(node: _Node) -> dict[str, bytes]:
    return {OPAQUE_XATTR: node.xattrs[OPAQUE_XATTR]} if OPAQUE_XATTR in node.xattrs else {}


# -- members ------------------------------------------------------------------------------


def _mtime_ns(info: tarfile.TarInfo, entry: str) -> int:
    text = info.pax_headers.get("mtime")
    if text is not None:
        try:
            return int(Decimal(text).scaleb(9).to_integral_value(rounding="ROUND_FLOOR"))
        except (InvalidOperation, ValueError):
            raise LayerError(entry, f"PAX mtime {text!r} is not a number") from None
    return int(info.mtime) * 1_000_000_000


def _xattrs(info: tarfile.TarInfo, limits: TarLimits, entry: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    total = 0
    for key, value in info.pax_headers.items():
        if not key.startswith(_XATTR_PAX):
            continue
        name = key[len(_XATTR_PAX) :]
        raw = _encoded(value)
        if not name or "\0" in name or len(_encoded(name)) > limits.max_xattr_name:
            raise LayerError(entry, f"xattr name {name!r} is empty, has a NUL byte or is longer than {limits.max_xattr_name} bytes")
        if len(raw) > limits.max_xattr_value:
            raise LayerError(entry, f"xattr {name!r} holds {len(raw)} bytes (limit {limits.max_xattr_value})")
        total += len(name) + len(raw)
        if total > limits.max_xattrs:
            raise LayerError(entry, f"xattrs larger than {limits.max_xattrs} bytes in all")
        if not overlay_xattr_allowed(name, raw, info.isdir()):
            continue  # other overlayfs metadata (redirect, origin, metacopy...) must not come from an image
        out[name] = raw
    return out


def _data_runs(info: tarfile.TarInfo, limits: TarLimits, space: int, entry: str) -> list[tuple[int, int]]:
    """The ``(offset, length)`` runs of a regular file that hold data, checked; everything else is a hole.

    A file that is not sparse is one run (or none when empty).  A sparse map must be
    in order, within the file's size, and hold no more bytes than the member stores
    (``space``: the tar bytes between its data and the next header), so that reading
    the runs never reads into the next header.
    """
    if not info.sparse:
        return [(0, info.size)] if info.size else []
    if len(info.sparse) > limits.max_sparse:
        raise LayerError(entry, f"sparse map of {len(info.sparse)} runs (limit {limits.max_sparse})")
    runs = []
    end = stored = 0
    for offset, length in info.sparse:
        if length == 0:
            continue  # unused header slots and GNU tar's (size, 0) end marker
        if offset < end or length < 0 or offset + length > info.size:
            raise LayerError(entry, f"sparse map run ({offset}, {length}) overlaps, goes backwards or ends past the size {info.size}")
        runs.append((offset, length))
        end = offset + length
        stored += length
    if stored > space:
        raise LayerError(entry, f"sparse map holds {stored} bytes of data, but the tar stores only {space} for this file")
    return runs


@dataclass
class _Claims:
    """What the layer's regular files claim so far, against :class:`TarLimits`' layer bounds."""

    limits: TarLimits
    block_size: int
    bytes: int = 0
    block_refs: int = 0

    def claim(self, size: int, entry: str) -> None:
        """Count a file of ``size`` bytes; LayerError (before any of it is read) past a limit."""
        self.bytes += size
        self.block_refs += -(-size // self.block_size)
        if self.bytes > self.limits.max_layer_bytes:
            raise LayerError(entry, f"claims {size} bytes (holes included), which takes the layer's files to {self.bytes}, "
                                    f"over the layer limit of {self.limits.max_layer_bytes} bytes (--max-layer-size)")  # fmt: skip
        if self.block_refs > self.limits.max_block_refs:
            raise LayerError(entry, f"claims {size} bytes, which takes the layer to {self.block_refs} blocks of {self.block_size} "
                                    f"bytes, over the limit of {self.limits.max_block_refs} block references per layer")  # fmt: skip


def _read_contents(tar: tarfile.TarFile, info: tarfile.TarInfo, runs: list[tuple[int, int]], sink: BlockSink,
                   block_size: int, entry: str) -> tuple[int, ...]:  # fmt: skip
    """The block numbers of a regular file's contents, its data ``runs`` read from the tar stream in one pass.

    A hole costs O(1) however long it is (its whole blocks go to the sink as one
    :meth:`BlockSink.add_zeros`); only blocks that hold data are read, so the work is
    O(runs + data), never O(size) (a 10 KB tar can claim a 1 TiB sparse file).
    The runs' bytes lie back to back from ``info.offset_data``.
    """
    fileobj = tar.fileobj
    assert fileobj is not None
    size = info.size
    blocks: list[int] = []
    ends = [offset + length for offset, length in runs]
    stored_at = []  # where each run's bytes start in the tar stream
    place = info.offset_data
    for _, length in runs:
        stored_at.append(place)
        place += length

    def stored(run: int, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset``, which lie in run number ``run``."""
        target = stored_at[run] + offset - runs[run][0]
        if fileobj.tell() != target:
            fileobj.seek(target)  # forward only: runs are in order (skips what lies between, hashing it)
        data = fileobj.read(length)
        if len(data) != length:
            raise LayerError(entry, f"file data ends {length - len(data)} bytes early (truncated tar)")
        return data

    position = run = 0
    try:
        while position < size:
            while run < len(runs) and ends[run] <= position:
                run += 1
            hole_end = runs[run][0] if run < len(runs) else size
            whole = max(0, hole_end - position) // block_size  # (hole_end < position: a run goes on)
            if whole:  # whole blocks of a hole, in one call
                blocks.extend([sink.add_zeros(block_size, whole)] * whole)
                position += whole * block_size
                continue
            length = min(block_size, size - position)
            if hole_end == size:  # a hole to the end, shorter than a block
                blocks.append(sink.add_zeros(length, 1))
                position = size
                continue
            end = position + length
            if runs[run][0] <= position and end <= ends[run]:  # one run holds the whole block
                chunk = stored(run, position, length)
            else:  # data and holes: the runs' pieces over zeros
                buffer = bytearray(length)
                piece = run
                while piece < len(runs) and runs[piece][0] < end:
                    lo, hi = max(runs[piece][0], position), min(ends[piece], end)
                    buffer[lo - position : hi - position] = stored(piece, lo, hi - lo)
                    if ends[piece] > end:
                        break  # the run goes on into the next block
                    piece += 1
                chunk = bytes(buffer)
            blocks.append(sink.add(chunk))
            position = end
    except tarfile.ReadError as exc:
        raise LayerError(entry, f"file data unreadable: {exc} (truncated tar?)") from None
    return tuple(blocks)


def read_layer(blob: BinaryIO, sink: BlockSink, *, block_size: int, limits: TarLimits = TarLimits()) -> ParsedLayer:
    """Parse layer blob ``blob`` (gzip, zstd or plain tar) in one pass; contents go to ``sink``.

    Raises :class:`LayerError` for anything refused or malformed; ``sink`` may then
    hold blocks of the entries before, which nothing references.
    """
    decompressed = _Decompressed(blob)
    hashed = HashingReader(decompressed, limits.max_layer_bytes)  # type: ignore[arg-type]
    tree = _Tree(limits)
    claims = _Claims(limits, block_size)
    file_bytes = 0
    last = None
    try:
        tar = tarfile.open(fileobj=hashed, mode="r|", tarinfo=_strict_tarinfo(limits),  # type: ignore[call-overload]
                           encoding="utf-8", errors="surrogateescape")  # fmt: skip
    except tarfile.ReadError as exc:
        raise LayerError(None, f"not a tar archive: {exc}") from None
    except LayerError:
        raise
    with tar:
        while True:
            try:
                info = tar.next()
            except LayerError as exc:
                if exc.entry is None and last is not None:
                    raise LayerError(None, f"{exc.reason} (after entry {last!r})") from None
                raise
            except _TARFILE_ERRORS as exc:  # tarfile's own, and what its parsers let through (int(), decoding)
                raise LayerError(None, f"malformed tar after entry {last!r}: {exc}") from None
            if info is None:
                break
            tar.members.clear()  # tarfile keeps every member in a list; nothing here needs them
            last = info.name
            if tree.count() >= limits.max_entries:
                raise LayerError(info.name, f"more than {limits.max_entries} entries in the layer")
            try:
                file_bytes += _member(tar, info, tree, sink, claims)
            except LayerError:
                raise
            except _TARFILE_ERRORS as exc:
                raise LayerError(info.name, f"unreadable entry: {exc}") from None
    hashed.drain()  # the diffID covers every byte, the end-of-archive padding included
    return ParsedLayer(
        entries=tree.entries(),
        diff_id="sha256:" + hashed.hexdigest(),
        tar_bytes=hashed.count,
        file_bytes=file_bytes,
        compression=decompressed.compression,
    )


def _member(tar: tarfile.TarFile, info: tarfile.TarInfo, tree: _Tree, sink: BlockSink, claims: _Claims) -> int:
    """Add one tar member to ``tree``; returns the file bytes it added."""
    limits = claims.limits
    entry = info.name
    path = tree.clean(info.name, "name", entry)
    base = path.rpartition("/")[2]
    if base.startswith(WHITEOUT_PREFIX):
        parent = path.rpartition("/")[0]
        if base == OPAQUE_MARKER:
            tree.ensure_parent(path, entry)
            tree.nodes[parent].xattrs[OPAQUE_XATTR] = b"y"
            return 0
        if base.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            return 0  # aufs bookkeeping (.wh..wh.plnk, ...): nothing for overlayfs
        name = base[len(WHITEOUT_PREFIX) :]
        if name in ("", ".", ".."):
            raise LayerError(entry, f"whiteout of {name!r}, which names no entry")
        target = f"{parent}/{name}" if parent else name
        tree.put(target, _Node(EntryType.CHAR, mode=0, uid=info.uid, gid=info.gid, mtime_ns=_mtime_ns(info, entry)), entry)
        return 0
    if info.uid < 0 or info.gid < 0:
        raise LayerError(entry, f"negative owner {info.uid}:{info.gid}")
    mode = info.mode & 0o7777
    mtime_ns = _mtime_ns(info, entry)
    xattrs = _xattrs(info, limits, entry)
    common = dict(mode=mode, uid=info.uid, gid=info.gid, mtime_ns=mtime_ns, xattrs=xattrs)
    if info.isreg():  # REGTYPE, AREGTYPE, CONTTYPE and GNU sparse
        if info.size < 0:
            raise LayerError(entry, f"negative size {info.size}")
        runs = _data_runs(info, limits, tar.offset - info.offset_data, entry)
        # Check the place and the claim first, so that a refused entry reads no data into the sink.
        if path == "":
            raise LayerError(entry, "the layer root is not a directory")
        tree.ensure_parent(path, entry)
        claims.claim(info.size, entry)
        blocks = _read_contents(tar, info, runs, sink, claims.block_size, entry)
        inode = _Inode(size=info.size, blocks=blocks, **common)  # type: ignore[arg-type]
        tree.put(path, _Node(EntryType.FILE, inode=inode), entry)
        return info.size
    if info.isdir():
        tree.put(path, _Node(EntryType.DIR, **common), entry)  # type: ignore[arg-type]
        return 0
    if info.issym():
        target = info.linkname
        if not target:
            raise LayerError(entry, "symlink with an empty target")
        if "\0" in target or len(_encoded(target)) > limits.max_link:
            raise LayerError(entry, f"symlink target has a NUL byte or is longer than {limits.max_link} bytes")
        tree.put(path, _Node(EntryType.SYMLINK, target=target, **common), entry)  # type: ignore[arg-type]
        return 0
    if info.islnk():
        if len(_encoded(info.linkname)) > limits.max_link:
            raise LayerError(entry, f"hardlink target longer than {limits.max_link} bytes")
        try:
            target = tree.clean(info.linkname, "hardlink target", entry)
        except LayerError as exc:
            raise LayerError(entry, f"{exc.reason}: hardlink points outside the layer") from None
        node = tree.nodes.get(target)
        if node is None:
            raise LayerError(entry, f"hardlink to {info.linkname!r}, which is not an earlier entry of this layer")
        if node.type is not EntryType.FILE:
            raise LayerError(entry, f"hardlink to {info.linkname!r}, which is a {node.type.value}, not a regular file")
        if target == path:
            return 0  # a link to itself changes nothing
        tree.put(path, _Node(EntryType.FILE, inode=node.inode), entry)
        return 0
    if info.ischr() or info.isblk():
        kind = EntryType.CHAR if info.ischr() else EntryType.BLOCK
        if info.devmajor < 0 or info.devminor < 0:
            raise LayerError(entry, f"bad device number {info.devmajor}:{info.devminor}")
        tree.put(path, _Node(kind, rdev=(info.devmajor, info.devminor), **common), entry)  # type: ignore[arg-type]
        return 0
    if info.isfifo():
        tree.put(path, _Node(EntryType.FIFO, **common), entry)  # type: ignore[arg-type]
        return 0
    raise LayerError(entry, f"unsupported tar entry type {info.type!r}")
