"""Layer tars for tests: entry specs of every kind and a deterministic tar writer.

A :class:`Layer` is a tuple of entry specs; :func:`layer_tar` (bytes) or
:func:`write_layer_tar` (streamed into a file, for layers too large to hold) turns it
into a POSIX/PAX tar as image builders write them.  The same specs always give the
same bytes, so digests and diff_ids are stable across runs.

Paths are written without a leading ``/`` (``"/app/x"`` and ``"app/x"`` are the same
entry); non-UTF-8 names are ``str`` with surrogate escapes (``"caf\\udce9"`` is the
byte ``0xe9``), as Python's ``os.fsdecode`` gives them.  Missing parent directories are
added as :class:`Dir` entries (0755, root) before their first child unless the layer
says ``add_parents=False``.

Hostile tars: :class:`Raw` writes a ``tarfile.TarInfo`` exactly as given (``../x``,
``/etc/x``, a hardlink out of the layer...) and :class:`RawBytes` appends bytes as
they are (a malformed header); neither gets parents added or its name cleaned.
:func:`pax_sparse` writes a sparse file in GNU tar's PAX formats (0.0, 0.1, 1.0), with
any map, as :class:`RawBytes`; :class:`Sparse` is the old GNU format.
"""

from __future__ import annotations

import dataclasses
import io
import random
import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Mapping, Sequence, Union

#: Fixed mtime (seconds) of every entry unless a spec says otherwise; also the gzip header's.
EPOCH = 1_700_000_000

#: How a layer marks deletions of lower-layer content (OCI image-spec "Whiteouts").
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"

BLOCK = tarfile.BLOCKSIZE

Mtime = Union[int, str]
"""Seconds since the epoch, or a PAX decimal string with a fraction (``"1700000000.123456789"``)."""


@dataclass(frozen=True)
class Dir:
    path: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    mtime: Mtime = EPOCH
    xattrs: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class File:
    path: str
    data: bytes
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: Mtime = EPOCH
    xattrs: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class BigFile:
    """A file of ``size`` deterministic pseudo-random bytes, generated while the tar is written."""

    path: str
    size: int
    seed: int = 0
    mode: int = 0o644

    def chunks(self, chunk: int = 1 << 20) -> Iterator[bytes]:
        rng = random.Random(self.seed)
        left = self.size
        while left:
            n = min(chunk, left)
            yield rng.randbytes(n)
            left -= n

    def data(self) -> bytes:
        """The whole contents (for checking a small one)."""
        return b"".join(self.chunks())


@dataclass(frozen=True)
class Symlink:
    """A symbolic link; ``target`` is stored as given (absolute and ``..`` targets included)."""

    path: str
    target: str
    uid: int = 0
    gid: int = 0
    mtime: Mtime = EPOCH


@dataclass(frozen=True)
class Hardlink:
    """A hard link to ``target``, an entry earlier in the same layer (a path in the tar)."""

    path: str
    target: str


@dataclass(frozen=True)
class Device:
    """A character (``kind="char"``) or block (``kind="block"``) device node."""

    path: str
    kind: str
    major: int
    minor: int
    mode: int = 0o644


@dataclass(frozen=True)
class Fifo:
    path: str
    mode: int = 0o644


@dataclass(frozen=True)
class Sparse:
    """A GNU (old format, type ``S``) sparse file of ``size`` bytes holding ``runs`` of data.

    ``runs`` are ``(offset, bytes)``, ascending and not overlapping, at most three (the
    map fits in the header with GNU tar's closing ``(size, 0)`` entry for a trailing hole);
    everything else reads as zeros.
    """

    path: str
    size: int
    runs: tuple[tuple[int, bytes], ...]
    mode: int = 0o644

    def data(self) -> bytes:
        out = bytearray(self.size)
        for offset, chunk in self.runs:
            out[offset : offset + len(chunk)] = chunk
        return bytes(out)


@dataclass(frozen=True)
class Whiteout:
    """Deletes ``path`` (file or directory) of the layers below."""

    path: str


@dataclass(frozen=True)
class Opaque:
    """Hides everything the layers below have under directory ``path``."""

    path: str


@dataclass(frozen=True)
class Raw:
    """A header written exactly as ``info`` says (no cleaning, no parents), with ``data`` if given."""

    info: tarfile.TarInfo
    data: bytes | None = None

    @property
    def path(self) -> str:
        return self.info.name


@dataclass(frozen=True)
class RawBytes:
    """Bytes appended to the tar as they are (a malformed or truncated header)."""

    data: bytes
    path: str = ""


Entry = Union[Dir, File, BigFile, Symlink, Hardlink, Device, Fifo, Sparse, Whiteout, Opaque, Raw, RawBytes]


@dataclass(frozen=True)
class Layer:
    entries: tuple[Entry, ...]
    comment: str = ""
    add_parents: bool = True  #: add missing parent directories before their first child
    end_marker: bool = True  #: end with the two zero blocks (False: a tar cut off after its last member)

    def file_digests(self) -> dict[str, str]:
        """The SHA-256 (hex) of each regular file's content (:class:`File` and :class:`BigFile`), by path."""
        import hashlib

        out = {}
        for entry in self.entries:
            if isinstance(entry, BigFile):
                out[entry.path] = hashlib.sha256(b"".join(entry.chunks())).hexdigest()
            elif isinstance(entry, File):
                out[entry.path] = hashlib.sha256(entry.data).hexdigest()
        return out


def clean(path: str) -> str:
    """A spec's path as the tar names it: no leading ``/``."""
    path = path.strip("/")
    if not path:
        raise ValueError(f"entry path {path!r} names no entry below /")
    return path


def _info(path: str, mtime: Mtime = EPOCH, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    if isinstance(mtime, str):
        whole = mtime.split(".")[0]
        info.mtime = int(whole) if whole.lstrip("-").isdigit() else EPOCH  # a malformed one is for hostile tars
        info.pax_headers = {"mtime": mtime}
    else:
        info.mtime = mtime
    info.uid, info.gid = uid, gid
    info.uname = info.gname = "root" if uid == 0 and gid == 0 else ""
    return info


def _xattrs(info: tarfile.TarInfo, xattrs: Mapping[str, bytes]) -> None:
    headers = dict(info.pax_headers)
    for name, value in sorted(xattrs.items()):
        headers[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
    info.pax_headers = headers


def member(entry: Entry) -> tuple[tarfile.TarInfo, bytes | Iterator[bytes] | None]:
    """The tar header of one spec and its data (bytes, chunks, or None)."""
    if isinstance(entry, Raw):
        return entry.info, entry.data
    path = clean(entry.path)
    if isinstance(entry, Whiteout):
        parent, _, name = path.rpartition("/")
        return member(File(f"{parent}/{WHITEOUT_PREFIX}{name}" if parent else WHITEOUT_PREFIX + name, b""))
    if isinstance(entry, Opaque):
        return member(File(f"{path}/{OPAQUE_MARKER}", b""))
    if isinstance(entry, Dir):
        info = _info(path, entry.mtime, entry.uid, entry.gid)
        info.type, info.mode = tarfile.DIRTYPE, entry.mode
        _xattrs(info, entry.xattrs)
        return info, None
    if isinstance(entry, File):
        info = _info(path, entry.mtime, entry.uid, entry.gid)
        info.type, info.mode, info.size = tarfile.REGTYPE, entry.mode, len(entry.data)
        _xattrs(info, entry.xattrs)
        return info, entry.data
    if isinstance(entry, BigFile):
        info = _info(path)
        info.type, info.mode, info.size = tarfile.REGTYPE, entry.mode, entry.size
        return info, entry.chunks()
    if isinstance(entry, Symlink):
        info = _info(path, entry.mtime, entry.uid, entry.gid)
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.target, 0o777
        return info, None
    if isinstance(entry, Hardlink):
        info = _info(path)
        info.type, info.linkname, info.mode = tarfile.LNKTYPE, clean(entry.target), 0o644
        return info, None
    if isinstance(entry, Device):
        if entry.kind not in ("char", "block"):
            raise ValueError(f"device kind must be 'char' or 'block', not {entry.kind!r}")
        info = _info(path)
        info.type = tarfile.CHRTYPE if entry.kind == "char" else tarfile.BLKTYPE
        info.mode, info.devmajor, info.devminor = entry.mode, entry.major, entry.minor
        return info, None
    if isinstance(entry, Fifo):
        info = _info(path)
        info.type, info.mode = tarfile.FIFOTYPE, entry.mode
        return info, None
    raise TypeError(f"not a header spec: {entry!r}")


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def sparse_header(entry: Sparse) -> tuple[bytes, bytes]:
    """The GNU ``S`` header block(s) of ``entry`` and its stored data (the runs, padded)."""
    runs = list(entry.runs)
    if not runs or runs[-1][0] + len(runs[-1][1]) < entry.size:
        runs.append((entry.size, b""))  # GNU tar marks a trailing hole with an empty run at the end
    if len(runs) > 4:
        raise ValueError("Sparse supports at most three runs (no extension headers)")
    stored = b"".join(chunk for _, chunk in entry.runs)
    info = _info(clean(entry.path))
    info.type, info.mode, info.size = tarfile.REGTYPE, entry.mode, len(stored)
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    main = len(header) - BLOCK  # a long name puts a GNU longname header before the main one
    header[main + 156 : main + 157] = tarfile.GNUTYPE_SPARSE
    position = main + 386
    for offset, chunk in runs:
        header[position : position + 24] = _octal(offset, 12) + _octal(len(chunk), 12)
        position += 24
    header[main + 482] = 0  # no extension headers
    header[main + 483 : main + 495] = _octal(entry.size, 12)
    header[main + 148 : main + 156] = b" " * 8
    checksum = sum(header[main : main + BLOCK])
    header[main + 148 : main + 156] = b"%06o\0 " % checksum
    padding = -len(stored) % BLOCK
    return bytes(header), stored + b"\0" * padding


def pax_records(records: Sequence[tuple[str, str]]) -> bytes:
    """PAX extended-header records (``"<len> key=value\\n"``), repeated keys allowed (PAX 0.0 sparse maps)."""
    out = b""
    for key, value in records:
        body = f" {key}={value}\n".encode("utf-8", "surrogateescape")
        length = len(body) + 1
        while len(str(length).encode()) + len(body) != length:
            length += 1
        out += str(length).encode() + body
    return out


def _ustar(name: str, kind: bytes, size: int, mode: int = 0o644) -> bytes:
    info = _info(name)
    info.type, info.size, info.mode = kind, size, mode
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def pax_sparse(path: str, size: int, runs: Sequence[tuple[int, bytes]], *, version: str = "1.0") -> RawBytes:
    """One sparse file as GNU tar writes it in PAX format ``version`` (``0.0``, ``0.1`` or ``1.0``).

    ``size`` is the file's (claimed) size and ``runs`` its ``(offset, bytes)`` of data,
    ascending; everything else is a hole.  Nothing checks that the runs fit the size,
    so hostile maps can be written too.  The member is returned as :class:`RawBytes`
    (a PAX header, then the file header and its stored data), written as it is.
    """
    name = clean(path)
    stored = b"".join(chunk for _, chunk in runs)
    if version == "1.0":
        records = [("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.name", name),
                   ("GNU.sparse.realsize", str(size))]  # fmt: skip
        sparse_map = f"{len(runs)}\n" + "".join(f"{offset}\n{len(chunk)}\n" for offset, chunk in runs)
        prefix = sparse_map.encode() + b"\0" * (-len(sparse_map) % BLOCK)
        data = prefix + stored
    elif version == "0.1":
        records = [("GNU.sparse.size", str(size)), ("GNU.sparse.numblocks", str(len(runs))), ("GNU.sparse.name", name),
                   ("GNU.sparse.map", ",".join(f"{offset},{len(chunk)}" for offset, chunk in runs))]  # fmt: skip
        data = stored
    elif version == "0.0":
        records = [("GNU.sparse.size", str(size)), ("GNU.sparse.numblocks", str(len(runs))), ("GNU.sparse.name", name)]
        for offset, chunk in runs:
            records += [("GNU.sparse.offset", str(offset)), ("GNU.sparse.numbytes", str(len(chunk)))]
        data = stored
    else:
        raise ValueError(f"PAX sparse format {version!r} is not 0.0, 0.1 or 1.0")
    pax = pax_records(records)
    parent, _, base = name.rpartition("/")
    stand_in = f"{parent}/GNUSparseFile.0/{base}" if parent else f"GNUSparseFile.0/{base}"
    out = _ustar(f"PaxHeaders.0/{base}"[:99], tarfile.XHDTYPE, len(pax)) + pax + b"\0" * (-len(pax) % BLOCK)
    out += _ustar(stand_in[:99], tarfile.REGTYPE, len(data)) + data + b"\0" * (-len(data) % BLOCK)
    return RawBytes(out, path=name)


def _entries_with_parents(layer: Layer) -> Iterator[Entry]:
    seen: set[str] = set()
    for entry in layer.entries:
        if layer.add_parents and not isinstance(entry, (Raw, RawBytes)):
            path = clean(entry.path)
            if isinstance(entry, Whiteout | Opaque):
                path = path + "/x" if isinstance(entry, Opaque) else path
            parts = path.split("/")
            for depth in range(1, len(parts)):
                parent = "/".join(parts[:depth])
                if parent not in seen:
                    seen.add(parent)
                    yield Dir(parent)
            seen.add(clean(entry.path))
        yield entry


def write_layer_tar(layer: Layer, out: BinaryIO) -> None:
    """Write the tar of ``layer`` into ``out``, streaming big files (memory stays small)."""
    tar = tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
    try:
        for entry in _entries_with_parents(layer):
            if isinstance(entry, RawBytes):
                tar.fileobj.write(entry.data)
                tar.offset += len(entry.data)
                continue
            if isinstance(entry, Sparse):
                header, stored = sparse_header(entry)
                tar.fileobj.write(header + stored)
                tar.offset += len(header) + len(stored)
                continue
            info, data = member(entry)
            if data is None or isinstance(data, bytes):
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
                continue
            # Chunks: header, then the data streamed, then padding (what addfile does, unbuffered).
            header = info.tobuf(tar.format, tar.encoding, tar.errors)
            tar.fileobj.write(header)
            written = 0
            for chunk in data:
                tar.fileobj.write(chunk)
                written += len(chunk)
            if written != info.size:
                raise ValueError(f"{info.name}: wrote {written} bytes, header says {info.size}")
            tar.fileobj.write(b"\0" * (-written % BLOCK))
            tar.offset += len(header) + written + (-written % BLOCK)
        if not layer.end_marker:
            tar.closed = True  # skip close()'s two zero blocks; flush what the stream holds
            tar.fileobj.close()
            return
    except BaseException:
        tar.closed = True
        raise
    tar.close()


def layer_tar(layer: Layer) -> bytes:
    """The uncompressed tar of ``layer``."""
    buf = io.BytesIO()
    write_layer_tar(layer, buf)
    return buf.getvalue()


def raw(name: str, kind: bytes = tarfile.REGTYPE, *, linkname: str = "", data: bytes | None = None,
        mode: int = 0o644) -> Raw:  # fmt: skip
    """A :class:`Raw` header named exactly ``name`` (for hostile tars)."""
    info = _info(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    if data is not None:
        info.size = len(data)
    return Raw(info, data)


def replace(entry: Entry, **changes: object) -> Entry:
    """``entry`` with fields changed (a convenience over ``dataclasses.replace``)."""
    return dataclasses.replace(entry, **changes)  # type: ignore[type-var]
