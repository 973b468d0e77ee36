"""Verified on-disk caches, bounded and shared safely by processes: fetched stripes, and the base of the block cache.

:class:`VerifiedFileCache` keeps payloads under caller-supplied keys (lowercase hex:
a key is a file name).  Each entry is one file holding a header (magic, payload
length, an xxh3-128 hash of the key, an xxh3-128 checksum of the payload) and the
payload.  Every read checks all of it, and a subclass may add a check of its own
(:meth:`VerifiedFileCache.verify`: the block cache checks a block's SHA-256); an
entry that is truncated, corrupt or not what its name says is deleted, logged and
reported as a miss, so the caller fetches it again.  Nothing unverified is ever
returned.

:class:`StripeCache` is the fetch engine's: each stripe is named by a hash of
everything that identifies its bytes: the source URL, the path, the file's size and
version (the source's content validator: ETag, inode + mtime in ns, ...), the stripe
index and the stripe size.  ``blockstore/node/block_cache.py``'s ``BlockCache`` names blocks by
their content hash instead, so every store and mirror shares its entries.

Writes go to a temporary file in the same directory and are renamed into place, so
readers in this or another process see a whole entry or none; no fsync is needed
because a torn entry after a crash fails its checksum.  Recency is the entry file's
mtime (touched on every hit), and whoever finds the cache over ``max_bytes`` scans
it and deletes least recently used entries down to 90%; concurrent deletion by two
processes is harmless.  A cache that shares its bound with something else (a layer server's
local blobs in use) is given ``others``, what that holds now: the entries are bounded by
``max_bytes`` less it.  The cache never raises: a disk problem is logged and behaves
as a miss.

A subclass may keep its entries' file pages out of the kernel's page cache
(:attr:`VerifiedFileCache.keep_out_of_page_cache`; the block cache does): after a
write the entry's pages are written back and dropped, after a read they are dropped,
so the cache's own copy of a payload never sits in memory beside the copy its
caller hands on (see :func:`drop_file_pages`).

Where a source gives no version the file's mtime stands in for it, and where it
reports no mtime either (0.0) entries are keyed by size alone, so a file rewritten in
place with the same size would be served stale; such sources should not be cached.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import prometheus_client
import xxhash

from bootseer.log import get_logger

log = get_logger(__name__)

MAGIC = b"BSSTRIP1"  #: the stripe cache's entries
_HEADER = struct.Struct("<8sQ16s16s")  # magic, payload length, key hash, payload xxh3-128
_KEY = re.compile(r"[0-9a-f]{16,128}")
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died
_LOW_WATER = 0.9  # eviction frees down to this fraction of max_bytes
#: While writes keep failing (a full or read-only disk), one warning line at the first
#: failure, then one line with the count at most this often: not one per block.
WRITE_FAILURE_SUMMARY_SECONDS = 60.0

# One family per event for every cache; the ``cache`` label says which (stripes, blocks).
HITS = prometheus_client.Counter("bootseer_fetch_cache_hits", "Entries served from an on-disk cache", ["cache"])
MISSES = prometheus_client.Counter(
    "bootseer_fetch_cache_misses", "Entries looked up and not in an on-disk cache", ["cache"]
)
CORRUPT = prometheus_client.Counter(
    "bootseer_fetch_cache_corrupt", "On-disk cache entries that failed verification and were discarded", ["cache"]
)
EVICTIONS = prometheus_client.Counter("bootseer_fetch_cache_evictions", "On-disk cache entries evicted (LRU)", ["cache"])
ERRORS = prometheus_client.Counter("bootseer_fetch_cache_errors", "On-disk cache reads or writes that failed", ["cache"])
BYTES = prometheus_client.Gauge(
    "bootseer_fetch_cache_bytes", "Bytes in an on-disk cache, as its last scan found plus what was written since",
    ["cache"], multiprocess_mode="max",
)


# sync_file_range(2): Python's os module lacks it.  Start writeback of the range, and wait
# for any already under way before and for ours after, so the pages are clean when it returns.
_SYNC_FILE_RANGE_ALL = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER
_sync_file_range = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def drop_file_pages(fd: int, written: bool) -> None:
    """Drop the page cache pages of the open file ``fd``; ``written``: write its dirty pages back first.

    ``POSIX_FADV_DONTNEED`` only drops clean pages (it merely starts writeback of
    dirty ones), so a file just written is first written back with
    ``sync_file_range(2)`` and waited for: the file's data only, no journal commit
    or flush of the disk's cache (crash safety does not depend on it: a torn entry
    fails its checksum).  Where that call is missing (not Linux), ``fdatasync``
    does the same, at a journal commit's cost.  Raises OSError when the write-back
    fails (the entry is then not to be trusted to be on disk); the advice itself
    cannot fail in a way that matters and is not checked.
    """
    if written and _sync_file_range is None:
        os.fdatasync(fd)
    elif written and _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_ALL) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"writing the entry back: {os.strerror(number)}")
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # advice: a filesystem that ignores or refuses it only keeps the pages


@dataclass
class CacheStats:
    """Counters of one cache object (this process), for status output and tests."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  #: entries that failed verification, deleted
    evictions: int = 0  #: entries this process evicted
    errors: int = 0  #: disk reads or writes that failed
    bytes: int = 0  #: bytes on disk (entries and headers), as of the last scan plus writes since
    max_bytes: int = 0


class VerifiedFileCache:
    """Payloads on disk under ``directory``, at most ``max_bytes`` of them (LRU), keyed by hex strings.

    Thread-safe; several processes may share one directory.  Subclasses set
    :attr:`MAGIC` (what their entry files start with) and :attr:`kind` (the
    ``cache`` label of the metrics), and may add a check in :meth:`verify`.
    """

    MAGIC = b"BSCACHE1"
    kind = "generic"
    #: True: an entry's file pages leave the page cache once written or read (:func:`drop_file_pages`),
    #: for a cache whose payloads the caller keeps in memory of its own (the kernel's page cache of the
    #: file it serves them through).  Costs a wait for the disk per write and a disk read per hit.
    keep_out_of_page_cache = False

    def __init__(self, directory: str, max_bytes: int, *, others: Callable[[], int] | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"cache size must be positive, not {max_bytes}")
        if len(self.MAGIC) != 8:
            raise TypeError(f"{type(self).__name__}.MAGIC must be 8 bytes")
        self.directory = os.path.abspath(directory)
        self.max_bytes = max_bytes
        #: Bytes that others hold within the same ``max_bytes`` (a layer server's local blobs in use): the
        #: entries are evicted down from what they leave.  Called in whichever thread writes or scans.
        self._others = others
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._stats = CacheStats(max_bytes=max_bytes)
        self._hits, self._misses = HITS.labels(self.kind), MISSES.labels(self.kind)
        self._corrupt, self._evictions = CORRUPT.labels(self.kind), EVICTIONS.labels(self.kind)
        self._errors, self._bytes = ERRORS.labels(self.kind), BYTES.labels(self.kind)
        # Bytes on disk as of the last scan plus what this process wrote since; a
        # rescan every eighth of max_bytes written keeps other processes' writes in view.
        self._estimate = 0
        self._written_since_scan = 0
        self._failing = False  # the last write failed (and was reported)
        self._failed_writes = 0  # failed writes since the last line about them
        self._failed_writes_reported = 0.0  # time.monotonic() of that line
        self._evict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.directory!r}, max_bytes={self.max_bytes})"

    def stats(self) -> CacheStats:
        """A copy of this object's counters."""
        with self._lock:
            return CacheStats(**{**self._stats.__dict__, "bytes": self._estimate})

    def verify(self, key: str, payload: bytes) -> str | None:
        """A subclass's own check of an entry that passed the checksum: what is wrong with it, or None."""
        return None

    @staticmethod
    def check_key(key: str) -> str:
        """``key`` if it is a valid entry name (16 to 128 lowercase hex digits), else ValueError."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"cache key must be 16 to 128 lowercase hex digits, not {key!r}")
        return key

    def path_of(self, key: str) -> str:
        self.check_key(key)
        return os.path.join(self.directory, key[:2], key)

    def contains(self, key: str) -> bool:
        """Whether an entry for ``key`` is on disk: a cheap test (one stat) that verifies nothing.

        For deciding whether to fetch ahead of time (a prefetch skips what is here);
        only :meth:`get` says whether the entry is good.
        """
        return os.path.exists(self.path_of(key))

    def _count(self, counter: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + amount)
        getattr(self, "_" + counter).inc(amount)

    def get(self, key: str) -> bytes | None:
        """The verified payload stored under ``key``, or None (missing, or corrupt and now deleted)."""
        path = self.path_of(key)
        try:
            with open(path, "rb") as file:
                header = file.read(_HEADER.size)
                problem = self._check_header(header, key)
                if problem is None:
                    length = _HEADER.unpack(header)[1]
                    on_disk = os.fstat(file.fileno()).st_size - _HEADER.size
                    # A corrupt length must not make us allocate it: read no more than is there.
                    payload = file.read(min(length, on_disk))
                    problem = self._check_payload(payload, length, header, file.read(1))
                if self.keep_out_of_page_cache:
                    drop_file_pages(file.fileno(), written=False)
        except FileNotFoundError:
            self._count("misses")
            return None
        except OSError as exc:
            self._count("errors")
            log.warning("cache read failed; fetching instead", cache=self.kind, path=path, error=str(exc))
            return None
        if problem is None:
            problem = self.verify(key, payload)
        if problem is not None:
            self._count("corrupt")
            log.warning("discarding corrupt cache entry", cache=self.kind, path=path, problem=problem)
            self._remove(path)
            return None
        try:
            os.utime(path)  # recency for LRU eviction
        except OSError:
            pass  # evicted meanwhile: the bytes read are still good
        self._count("hits")
        return payload

    @staticmethod
    def _key_hash(key: str) -> bytes:
        return xxhash.xxh3_128_digest(key.encode("ascii"))

    def _check_header(self, header: bytes, key: str) -> str | None:
        if len(header) < _HEADER.size:
            return f"truncated header ({len(header)} bytes)"
        magic, _length, key_hash, _checksum = _HEADER.unpack(header)
        if magic != self.MAGIC:
            return f"bad magic {magic!r}"
        if key_hash != self._key_hash(key):
            return "entry belongs to another key"
        return None

    @staticmethod
    def _check_payload(payload: bytes, length: int, header: bytes, trailing: bytes) -> str | None:
        if len(payload) != length:
            return f"truncated payload ({len(payload)} of {length} bytes)"
        if trailing:
            return "trailing bytes after the payload"
        if xxhash.xxh3_128_digest(payload) != _HEADER.unpack(header)[3]:
            return "checksum mismatch"
        return None

    def put(self, key: str, payload: bytes) -> None:
        """Store ``payload`` under ``key`` atomically, then evict if over the size bound."""
        size = _HEADER.size + len(payload)
        if size > self.max_bytes:
            return
        path = self.path_of(key)
        header = _HEADER.pack(self.MAGIC, len(payload), self._key_hash(key), xxhash.xxh3_128_digest(payload))
        temp = os.path.join(os.path.dirname(path), f"{_TEMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temp, "wb") as file:
                file.write(header)
                file.write(payload)
                if self.keep_out_of_page_cache:
                    file.flush()
                    drop_file_pages(file.fileno(), written=True)
            os.replace(temp, path)
        except OSError as exc:
            self._count("errors")
            self._write_failed(path, exc)
            self._remove(temp)
            return
        if self._failing:
            self._write_worked()
        with self._lock:
            self._estimate += size
            self._written_since_scan += size
            due = self._estimate > self._limit() or self._written_since_scan > self.max_bytes // 8
        self._bytes.set(self._estimate)
        if due:
            self._evict()

    def _limit(self) -> int:
        """The bytes the entries may hold now: ``max_bytes`` less what others hold within it."""
        return max(0, self.max_bytes - self._others()) if self._others is not None else self.max_bytes

    def _write_failed(self, path: str, exc: OSError) -> None:
        """Count a failed write; say so on the first, then once per :data:`WRITE_FAILURE_SUMMARY_SECONDS`."""
        now = time.monotonic()
        with self._lock:
            first = not self._failing
            due = not first and now - self._failed_writes_reported >= WRITE_FAILURE_SUMMARY_SECONDS
            failed = self._failed_writes + 1
            if first or due:
                self._failing, self._failed_writes, self._failed_writes_reported = True, 0, now
            else:
                self._failed_writes = failed
        if first:
            log.warning("cache write failed; not cached (further failures are counted, not logged one by one)",
                        cache=self.kind, path=path, error=str(exc))  # fmt: skip
        elif due:
            log.warning("cache writes are still failing; not cached", cache=self.kind, failed=failed,
                        seconds=WRITE_FAILURE_SUMMARY_SECONDS, error=str(exc))  # fmt: skip

    def _write_worked(self) -> None:
        """A write succeeded after failures: one line with how many failed since the last line."""
        with self._lock:
            was_failing, failed = self._failing, self._failed_writes
            self._failing, self._failed_writes = False, 0
        if was_failing:
            log.info("cache writes work again", cache=self.kind, failed_since_last_report=failed)

    def _evict(self) -> None:
        """Scan the cache; delete least recently used entries while over the bound, and dead temp files."""
        with self._lock:
            entries = []
            total = 0
            now = time.time()
            try:
                # Only the entries' shards (``key[:2]``): other directories beside them (a layer server's
                # local blobs, ``blobs/``) are not the cache's to evict.
                subdirs = [entry.path for entry in os.scandir(self.directory) if entry.is_dir() and len(entry.name) == 2]
                for subdir in subdirs:
                    for entry in os.scandir(subdir):
                        try:
                            st = entry.stat()
                        except FileNotFoundError:
                            continue
                        if entry.name.startswith(_TEMP_PREFIX):
                            if now - st.st_mtime > _STALE_TEMP_SECONDS:
                                self._remove(entry.path)
                            continue
                        entries.append((st.st_mtime, entry.path, st.st_size))
                        total += st.st_size
            except OSError as exc:
                self._stats.errors += 1
                self._errors.inc()
                log.warning("cache scan failed", cache=self.kind, directory=self.directory, error=str(exc))
                return
            limit = self._limit()
            if total > limit:
                entries.sort()
                target = int(limit * _LOW_WATER)
                for _mtime, path, size in entries:
                    if total <= target:
                        break
                    self._remove(path)
                    self._stats.evictions += 1
                    self._evictions.inc()
                    total -= size
            self._estimate = total
            self._written_since_scan = 0
            self._bytes.set(total)

    def discard(self, key: str) -> None:
        """Delete the entry of ``key`` (its caller found its payload wrong by a check of its own)."""
        self._remove(self.path_of(self.check_key(key)))

    def _remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            pass  # not there: nothing to delete (a write that failed may never have made it)
        except OSError as exc:
            self._errors.inc()
            log.warning("could not delete a cache file", cache=self.kind, path=path, error=str(exc))


class StripeCache(VerifiedFileCache):
    """The fetch engine's stripes on disk under ``directory``, at most ``max_bytes`` of them (LRU)."""

    MAGIC = MAGIC
    kind = "stripes"

    @staticmethod
    def key(url: str, path: str, size: int, version: str, mtime: float, index: int, stripe_size: int) -> str:
        """The name of a stripe's entry: a hash of everything that identifies its bytes.

        ``version`` is the source's :attr:`~bootseer.fetch.source.Entry.version` of the
        file; only where it is "" (the source gives none) does ``mtime`` stand in for it.
        """
        validator = ["version", version] if version else ["mtime", repr(float(mtime))]
        identity = json.dumps([url, path, size, validator, index, stripe_size])
        return xxhash.xxh3_128_hexdigest(identity.encode())
