"""A local blob's fill map checked against the blob on disk before a layer server serves it again.

A :class:`~bootseer.blockstore.datapath.local_blobs.LocalBlob`'s fill map says which of its
blocks are on disk, and a block it claims is never fetched again: the kernel reads it from the
blob (or the event holder allows the read from the map alone).  The map is right while one
server holds the blob (a block is written, then noted); between two servers anything may have
happened to the files: the blob truncated (its tail reads as zeros once it is extended again),
a hole punched, a byte changed.  So whenever a blob of this boot is opened again, made anew over
its files or adopted from the event holder's kept writer, :func:`check_claims` checks each
block the map claims (``FILLED`` or ``AHEAD``; ``UNREAD`` blocks are read by no file and stay):

* **the blob's size**: a block whose bytes reach past the blob's end is missing (the blob is
  extended to its size only after that, never trusted as it was);
* **holes** (``SEEK_DATA``/``SEEK_HOLE``): a block whose bytes are not all data is missing;
* **digests**, where the blob may have changed while no server held it: every claimed block is
  read from the blob (its ``rlen`` raw bytes at :meth:`LayerIndex.blob_offset`) and hashed with
  SHA-256, as the fetcher checks a block (:func:`~bootseer.blockstore.objects.format.decode_block`:
  the digest is of the raw bytes); one that does not match is missing.

"May have changed" is decided by the record of the last clean close (:class:`CloseRecord`,
``CACHE/blobs/<index>.closed``): the blob's and the map's inode, size, ``st_mtime_ns`` and
``st_ctime_ns`` and the boot, written by :func:`write_record` when a server closes the blob
cleanly (``LocalBlob.close``, ``LocalBlob.record_clean_close`` at an orderly stop) and taken
(read and deleted) by :func:`take_record` as soon as the blob is opened for serving, before
anything is written to it.  A server that crashes, or a blob still being served, leaves no
record, and the next open verifies every claimed block; a record that does not match the files
(a write, a truncation, a ``touch``, a new inode: ``st_ctime`` cannot be set back, and the
kernels this path runs on, 6.14+, give a change after a ``stat`` a fine-grained ``ctime``)
verifies them too.  Only a blob whose files are exactly as a clean close left them skips the
hashing; the size and hole checks always run (they cost a few system calls).

Blocks that fail are dropped (:func:`drop`): their map byte is set to 0 first (so the blob
stays marked and every read of them raises an event: they are fetched again and verified, never
served), then their slot is punched out of the blob, so that a missing block is a hole on disk as
well.  Hashing runs in the constructor's worker thread, spread over up to :data:`HASH_THREADS`
threads (``pread`` and ``hashlib`` release the interpreter lock), reading runs of adjacent blocks
up to :data:`READ_BYTES` at a time.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bootseer.atomic import write_atomically
from bootseer.blockstore.datapath.event_holder import AHEAD
from bootseer.blockstore.objects.block_table import LayerBlocks

FILLED = 1  #: a fill map's byte for a block on disk (local_blobs: 0 missing, 1 on disk, 2 read by no file)
#: The map's bytes that claim a block on disk: read (``FILLED``) or written ahead of any read (``AHEAD``).
ON_DISK = frozenset({FILLED, AHEAD})
#: Threads hashing one blob's claimed blocks at once.
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
#: The most bytes one ``pread`` of adjacent claimed blocks reads for hashing.
READ_BYTES = 8 << 20
#: A record larger than this is not one (it is read no further, and the blob is verified).
MAX_RECORD_BYTES = 4096
_RECORD_VERSION = 1

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int


# -- the record of a clean close ------------------------------------------------------------


@dataclass(frozen=True)
class FileStamp:
    """What a file's ``fstat`` says that any change to it changes: where it is, its size and its times."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileStamp:
        stat = os.fstat(fd)
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@dataclass(frozen=True)
class CloseRecord:
    """The blob's and its fill map's stamps as a clean close left them, and the boot it was in."""

    boot: str
    blob: FileStamp
    map: FileStamp

    def encode(self) -> bytes:
        return json.dumps({"version": _RECORD_VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> CloseRecord | None:
        """The record in ``data``, or None if it is not one (damaged, another version): then nothing is trusted."""
        fields = set(FileStamp.__dataclass_fields__)
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(document, dict) or document.get("version") != _RECORD_VERSION or not isinstance(document.get("boot"), str):
            return None
        stamps = [document.get(name) for name in ("blob", "map")]
        if not all(isinstance(stamp, dict) and set(stamp) == fields
                   and all(type(value) is int for value in stamp.values()) for stamp in stamps):  # fmt: skip
            return None
        return cls(document["boot"], FileStamp(**stamps[0]), FileStamp(**stamps[1]))


def record_path(blob: Path) -> Path:
    """Where the record of ``blob``'s last clean close lives: ``<index>.closed`` beside ``<index>.blob``."""
    return blob.with_suffix(".closed")


def write_record(path: Path, writer: int, map_fd: int, boot: str) -> CloseRecord:
    """Record that the blob (open as ``writer``) and its fill map (``map_fd``) are closed cleanly now: written
    last, after every write to either (a later write changes their stamps, and the record no longer matches).
    Not made durable: a record names its boot, so after a reboot it never matches, and every block the map
    claims is hashed anyway."""
    record = CloseRecord(boot, FileStamp.of(writer), FileStamp.of(map_fd))
    write_atomically(path, record.encode(), durable=False, mode=0o600)
    return record


def take_record(path: Path) -> CloseRecord | None:
    """The record at ``path``, deleted (a blob opened for serving has no record until its next clean close), or
    None if there is none or it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:  # a symlink or worse where the record should be: trust nothing, and remove it
        path.unlink(missing_ok=True)
        return None
    try:
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return CloseRecord.decode(data) if len(data) <= MAX_RECORD_BYTES else None


def unchanged_since(record: CloseRecord | None, writer: int, map_fd: int, boot: str) -> bool:
    """Whether the blob (``writer``) and its map (``map_fd``) are exactly as ``record`` left them in this boot."""
    return record is not None and record == CloseRecord(boot, FileStamp.of(writer), FileStamp.of(map_fd))


# -- the checks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """What :func:`check_claims` found: the blocks it dropped, by the check each failed (ascending, disjoint)."""

    claimed: int  #: blocks the map claimed (``FILLED`` or ``AHEAD``) before the checks
    verified: bool  #: whether their digests were checked (the blob may have changed since a clean close)
    beyond_end: list[int]  #: blocks whose bytes reach past the blob's end
    in_holes: list[int]  #: blocks whose bytes are not all data on disk
    corrupt: list[int]  #: blocks whose bytes do not hash to their digest
    seconds: float  #: how long the checks took

    @property
    def dropped(self) -> list[int]:
        return sorted(self.beyond_end + self.in_holes + self.corrupt)


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` byte ranges of the file that hold data (``SEEK_DATA``/``SEEK_HOLE``), up to ``size``."""
    extents = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data from here to the end
                break
            raise
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        extents.append((start, end))
        offset = end
    return extents


def beyond_end(index: LayerBlocks, refs: Sequence[int], size: int) -> list[int]:
    """The blocks of ``refs`` whose raw bytes reach past ``size`` (a blob cut short)."""
    return [ref for ref in refs if index.blob_offset(ref) + index.blocks[ref].rlen > size]


def in_holes(index: LayerBlocks, refs: Sequence[int], extents: Sequence[tuple[int, int]]) -> list[int]:
    """The blocks of ``refs`` (ascending) whose raw bytes do not lie wholly in one of ``extents`` (ascending, as
    :func:`data_extents` gives them: adjacent data is one extent)."""
    out, position = [], 0
    for ref in refs:
        start = index.blob_offset(ref)
        end = start + index.blocks[ref].rlen
        while position < len(extents) and extents[position][1] <= start:
            position += 1
        if end > start and not (position < len(extents) and extents[position][0] <= start and end <= extents[position][1]):
            out.append(ref)
    return out


def _runs(index: LayerBlocks, refs: Sequence[int]) -> Iterator[list[int]]:
    """``refs`` (ascending) in runs of adjacent blocks of at most :data:`READ_BYTES` (one ``pread`` each)."""
    run: list[int] = []
    for ref in refs:
        if run and (ref != run[-1] + 1 or (ref - run[0] + 1) * index.block_size > READ_BYTES):
            yield run
            run = []
        run.append(ref)
    if run:
        yield run


def _corrupt_in_run(fd: int, index: LayerBlocks, run: list[int]) -> list[int]:
    first = index.blob_offset(run[0])
    length = index.blob_offset(run[-1]) - first + index.blocks[run[-1]].rlen
    data = memoryview(os.pread(fd, length, first))
    bad = []
    for ref in run:
        block = index.blocks[ref]
        at = index.blob_offset(ref) - first
        raw = data[at : at + block.rlen]
        if len(raw) != block.rlen or hashlib.sha256(raw).hexdigest() != block.digest:
            bad.append(ref)
    return bad


def corrupt(fd: int, index: LayerBlocks, refs: Sequence[int], threads: int = HASH_THREADS) -> list[int]:
    """The blocks of ``refs`` (ascending) whose raw bytes in the blob (read through ``fd``) do not hash to their
    digest, as the fetcher checks a block: SHA-256 of the block's ``rlen`` bytes at its blob offset."""
    runs = list(_runs(index, refs))
    if threads <= 1 or len(runs) <= 1:
        return [ref for run in runs for ref in _corrupt_in_run(fd, index, run)]
    with ThreadPoolExecutor(max_workers=min(threads, len(runs)), thread_name_prefix="blob-check") as pool:
        return sorted(ref for bad in pool.map(lambda run: _corrupt_in_run(fd, index, run), runs) for ref in bad)


def check_claims(fd: int, index: LayerBlocks, filled: bytearray, *, verify: bool) -> CheckResult:
    """Check every block ``filled`` claims (``FILLED``) against the blob open as ``fd`` (not yet extended to its
    size: its size is part of the check), digests too when ``verify``; every block that fails is set to 0 in
    ``filled`` (the caller writes the map and punches the blob: :func:`drop`).  Blocking."""
    started = time.perf_counter()
    claimed = [ref for ref, state in enumerate(filled) if state in ON_DISK]
    size = os.fstat(fd).st_size
    cut = beyond_end(index, claimed, size)
    if cut:
        gone = set(cut)
        left = [ref for ref in claimed if ref not in gone]
    else:
        left = claimed
    holed = in_holes(index, left, data_extents(fd, size)) if left else []
    if holed:
        gone = set(holed)
        left = [ref for ref in left if ref not in gone]
    bad = corrupt(fd, index, left) if verify and left else []
    result = CheckResult(len(claimed), verify, cut, holed, bad, time.perf_counter() - started)
    for ref in result.dropped:
        filled[ref] = 0
    return result


def punch(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``length`` bytes at ``offset`` of the file (a hole; its size kept); False if the filesystem
    cannot (the map's 0 is what keeps the range from being served, the hole only mirrors it)."""
    if length <= 0:
        return True
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(code, f"cannot punch a hole at {offset}+{length}: {os.strerror(code)}")


def drop(writer: int, map_fd: int, map_start: int, index: LayerBlocks, refs: Sequence[int]) -> None:
    """Mark blocks ``refs`` missing in the fill map (``map_start``: where its block bytes begin), then punch their
    slots out of the blob (``writer``, a descriptor that raises no event), only up to the blob's end."""
    for ref in refs:
        os.pwrite(map_fd, b"\x00", map_start + ref)
    size = os.fstat(writer).st_size
    for ref in refs:
        start = index.blob_offset(ref)
        if start < size:
            punch(writer, start, min(index.block_size, size - start))


__all__ = [
    "CheckResult", "CloseRecord", "FileStamp", "beyond_end", "check_claims", "corrupt", "data_extents", "drop",
    "in_holes", "punch", "record_path", "take_record", "unchanged_since", "write_record",
]  # fmt: skip
