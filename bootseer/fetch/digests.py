"""Digest lists: what storage vouches a checkpoint file's bytes are, chunk by chunk.

A checkpoint file is not content-addressed, so bytes of it that came by a route other than the
storage's own answer (a peer, later; a disk cache; a flaky proxy) can only be checked against a
record that storage itself keeps: a *digest list*, stored beside the file as
``NAME.bootseer-digests`` (:data:`SUFFIX`), written by ``bootseer ckpt digest`` or
:func:`bootseer.fetch.api.write_digests` after a save.  It holds, for one file: the file's size,
its version as storage reports it (the source's :attr:`~bootseer.fetch.source.Entry.version`: an
ETag, ``inode:mtime_ns:ctime_ns:size`` for local/NFS files, HDFS's modification time and size...),
a chunk size (a power of two, :data:`MIN_CHUNK_SIZE` to :data:`MAX_CHUNK_SIZE`) and the SHA-256 of
every chunk.  A list is used for a file only if its size and version are the file's as a stat
finds them now (:meth:`DigestList.mismatch`): a rewritten file has a new version, and its old
list is ignored.

The encoding (all integers big-endian; docs/ckpt-mount.md#digest-lists)::

    magic      8 bytes   b"BSDIGEST"
    format     u16       1 (FORMAT_VERSION); any other is refused
    chunk_log  u8        log2 of the chunk size, 16..26
    reserved   u8        0
    size       u64       the file's size in bytes
    version    u16 length, then that many bytes of UTF-8 (at most MAX_VERSION_BYTES)
    count      u64       number of chunks: exactly ceil(size / chunk size)
    digests    count * 32 bytes, SHA-256 of each chunk in order (the last one may be short)

Nothing follows.  :meth:`DigestList.decode` refuses anything else with :class:`DigestListError`
(ValueError) naming what is wrong, and bounds what it decodes: a list is at most
:data:`MAX_LIST_BYTES` and its chunk count must be the file size's exactly, so a list cannot make
a reader allocate more than its own length.

This module is the format, its hashing and its lookup at a source; the fetch engine verifies
stripes against a list (:mod:`bootseer.fetch.workers`), the Python API and the checkpoint mount
look lists up (:func:`load`) and pass them to :meth:`Engine.open <bootseer.fetch.engine.Engine.open>`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from bootseer.fetch.source import Entry, NotFound, RangeSource

SUFFIX = ".bootseer-digests"  #: a file's list is stored beside it under its name plus this
MAGIC = b"BSDIGEST"
FORMAT_VERSION = 1
MIN_CHUNK_SIZE = 1 << 16  #: 64 KiB
MAX_CHUNK_SIZE = 1 << 26  #: 64 MiB
DEFAULT_CHUNK_SIZE = 1 << 22  #: 4 MiB: divides the engine's default 8 MiB stripes
MAX_VERSION_BYTES = 1024
MAX_LIST_BYTES = 16 << 20  #: 16 MiB: 512 Ki chunks, 2 TiB of file at 4 MiB chunks
DIGEST_BYTES = 32

_HEAD = struct.Struct(">8sHBBQH")  # magic, format, chunk_log, reserved, size, version length
_COUNT = struct.Struct(">Q")


class DigestListError(ValueError):
    """A digest list that is malformed, oversized or of an unknown format; the message says which."""


def check_chunk_size(chunk_size: int) -> int:
    """``chunk_size`` if it is a power of two within bounds, else DigestListError."""
    if (not isinstance(chunk_size, int) or chunk_size < MIN_CHUNK_SIZE or chunk_size > MAX_CHUNK_SIZE
            or chunk_size & (chunk_size - 1)):  # fmt: skip
        raise DigestListError(
            f"chunk size must be a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}, not {chunk_size!r}"
        )
    return chunk_size


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


@dataclass(frozen=True, eq=False)
class DigestList:
    """One file's digest list.  Equal (and hashed) by its encoding's SHA-256, :attr:`identity`, so the engine
    can key stripes by it cheaply."""

    size: int  #: the file's size
    version: str  #: the file's version as its source reports it ("" where the source gives none)
    chunk_size: int
    digests: tuple[bytes, ...]  #: SHA-256 of each chunk
    identity: str = field(init=False)  #: hex SHA-256 of :meth:`encode`

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size)
        if not isinstance(self.size, int) or self.size < 0 or self.size >= 1 << 64:
            raise DigestListError(f"invalid file size {self.size!r}")
        if len(self.version.encode()) > MAX_VERSION_BYTES:
            raise DigestListError(f"version is longer than {MAX_VERSION_BYTES} bytes")
        if len(self.digests) != chunk_count(self.size, self.chunk_size):
            raise DigestListError(
                f"{len(self.digests)} digests for a file of {self.size} bytes in chunks of {self.chunk_size} "
                f"(want {chunk_count(self.size, self.chunk_size)})"
            )
        if any(len(digest) != DIGEST_BYTES for digest in self.digests):
            raise DigestListError("a digest is not 32 bytes")
        object.__setattr__(self, "identity", hashlib.sha256(self.encode()).hexdigest())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DigestList) and other.identity == self.identity

    def __hash__(self) -> int:
        return hash(self.identity)

    def __repr__(self) -> str:
        return f"<DigestList size={self.size} chunk_size={self.chunk_size} version={self.version!r} {self.identity[:12]}>"

    # -- the encoding ------------------------------------------------------------------

    def encode(self) -> bytes:
        version = self.version.encode()
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, self.chunk_size.bit_length() - 1, 0, self.size, len(version))
        return b"".join((head, version, _COUNT.pack(len(self.digests)), *self.digests))

    @classmethod
    def decode(cls, data: bytes, *, where: str = "digest list") -> DigestList:
        """The list ``data`` encodes; DigestListError (naming ``where``) for anything malformed or oversized."""
        if len(data) > MAX_LIST_BYTES:
            raise DigestListError(f"{where}: {len(data)} bytes, more than a digest list may hold ({MAX_LIST_BYTES})")
        if len(data) < _HEAD.size:
            raise DigestListError(f"{where}: truncated ({len(data)} bytes)")
        magic, fmt, chunk_log, reserved, size, version_length = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise DigestListError(f"{where}: not a digest list (bad magic)")
        if fmt != FORMAT_VERSION:
            raise DigestListError(f"{where}: format {fmt}, this BootSeer reads format {FORMAT_VERSION}")
        if reserved != 0:
            raise DigestListError(f"{where}: reserved byte is {reserved}, not 0")
        if not MIN_CHUNK_SIZE.bit_length() - 1 <= chunk_log <= MAX_CHUNK_SIZE.bit_length() - 1:
            raise DigestListError(f"{where}: chunk size 2**{chunk_log} is out of bounds")
        chunk_size = 1 << chunk_log
        if version_length > MAX_VERSION_BYTES:
            raise DigestListError(f"{where}: version of {version_length} bytes (at most {MAX_VERSION_BYTES})")
        position = _HEAD.size + version_length
        if len(data) < position + _COUNT.size:
            raise DigestListError(f"{where}: truncated ({len(data)} bytes)")
        try:
            version = data[_HEAD.size:position].decode()
        except UnicodeDecodeError:
            raise DigestListError(f"{where}: the version is not UTF-8") from None
        (count,) = _COUNT.unpack_from(data, position)
        position += _COUNT.size
        want = chunk_count(size, chunk_size)
        if count != want:
            raise DigestListError(f"{where}: {count} chunks for {size} bytes in chunks of {chunk_size} (want {want})")
        if len(data) != position + count * DIGEST_BYTES:
            raise DigestListError(
                f"{where}: {len(data)} bytes, want exactly {position + count * DIGEST_BYTES} for {count} chunks"
            )
        digests = tuple(data[at:at + DIGEST_BYTES] for at in range(position, len(data), DIGEST_BYTES))
        return cls(size, version, chunk_size, digests)

    # -- using it ----------------------------------------------------------------------

    def mismatch(self, entry: Entry) -> str | None:
        """Why this list is not of the file ``entry`` (a stat now) describes, or None if it is."""
        if entry.size != self.size:
            return f"the list is of a file of {self.size} bytes, the file is {entry.size}"
        if entry.version != self.version:
            return f"the list is of version {self.version!r}, the file is {entry.version!r}"
        return None

    def first_mismatch(self, offset: int, data: bytes | memoryview) -> int | None:
        """The index of the first chunk of ``data`` (whole chunks from ``offset``, a chunk boundary) whose
        SHA-256 is not the list's, or None if all match.  Raises ValueError for a range not made of whole chunks."""
        if offset % self.chunk_size or (len(data) % self.chunk_size and offset + len(data) != self.size):
            raise ValueError(f"bytes {offset}+{len(data)} are not whole chunks of {self.chunk_size}")
        first = offset // self.chunk_size
        with memoryview(data) as view:
            for number, at in enumerate(range(0, len(view), self.chunk_size)):
                if hashlib.sha256(view[at:at + self.chunk_size]).digest() != self.digests[first + number]:
                    return first + number
        return None

    def chunks_in(self, length: int) -> int:
        """How many chunks ``length`` bytes from a chunk boundary cover."""
        return chunk_count(length, self.chunk_size)


def build(read_into: Callable[[memoryview], int], size: int, version: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> DigestList:
    """The list of a file of ``size`` bytes (``version``), read in order with ``read_into`` (a file's readinto).

    Holds one chunk in memory.  OSError if the file ends early."""
    check_chunk_size(chunk_size)
    buffer = bytearray(chunk_size)
    digests = []
    done = 0
    with memoryview(buffer) as view:
        while done < size:
            want = min(chunk_size, size - done)
            filled = 0
            while filled < want:
                got = read_into(view[filled:want])
                if not got:
                    raise OSError(f"the file ended at {done + filled} bytes, not {size}")
                filled += got
            digests.append(hashlib.sha256(view[:want]).digest())
            done += want
    return DigestList(size, version, chunk_size, tuple(digests))


def sibling_url(url: str) -> str | None:
    """The URL of the list of the file at source URL ``url``, or None where a name cannot be added (a query)."""
    if "://" not in url:
        return url + SUFFIX
    parts = urlsplit(url)
    if parts.query or parts.fragment or not parts.path or parts.path.endswith("/"):
        return None
    return urlunsplit(parts._replace(path=parts.path + SUFFIX))


def load(source: RangeSource, path: str) -> DigestList | None:
    """The list stored at ``path`` of ``source`` (read from storage itself), or None if there is none.

    Blocking.  DigestListError for one that is oversized or malformed; SourceError if storage fails."""
    try:
        entry = source.stat(path)
    except NotFound:
        return None
    where = f"{getattr(source, 'display_url', '?')}: {path or '.'}"
    if entry.is_dir:
        raise DigestListError(f"{where}: a directory, not a digest list")
    if entry.size > MAX_LIST_BYTES:
        raise DigestListError(f"{where}: {entry.size} bytes, more than a digest list may hold ({MAX_LIST_BYTES})")
    connection = source.connect()
    try:
        data = connection.read_range(path, 0, entry.size, entry.version)
    finally:
        connection.close()
    return DigestList.decode(data, where=where)


__all__ = [
    "DEFAULT_CHUNK_SIZE", "DigestList", "DigestListError", "MAX_LIST_BYTES", "SUFFIX",
    "build", "check_chunk_size", "load", "sibling_url",
]
