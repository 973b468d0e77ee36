"""The node-local block cache: verified raw blocks on disk, shared by every layer, image, store and process.

Blocks are named by their content hash (the SHA-256 of their raw bytes, as the layer
index names them), so one entry serves every layer and image that holds the block
and every store or mirror it came from.  The cache is the fetch engine's verified
file cache (:class:`~bootseer.fetch.file_cache.VerifiedFileCache`: atomic writes,
checksummed entries, LRU eviction down from ``max_bytes`` by whichever process finds
it full, safe for many processes) with one more check: an entry is served only if
its bytes hash to the name it is stored under, so a disk that flips a bit, or
someone who writes a plausible entry by hand, can make a read miss, never wrong.
It lives under the daemon's ``--root`` (``ROOT/cache``) by default and survives
restarts; nothing in it needs cleaning up after a crash (a torn entry fails its
checksum, a dead writer's temporary file is swept by the next scan).

Raw rather than compressed blocks: a hit then costs a read and a hash, no
decompression, and the hash checks what is served.

The entries' file pages are kept out of the page cache (written back and dropped
after a write, dropped after a read): the kernel already caches what a block serves
in the page cache of the file it was read through (the FUSE file of the per-file
tree, or a layer's blob file under EROFS), and the fetcher keeps recent blocks in
memory, so the cache's own pages would only hold each block's bytes once more.  A
hit therefore reads the disk, which is what the cache is for: blocks the page cache
no longer has.  Methods block (disk I/O and
hashing): call them from a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from bootseer.fetch.file_cache import CacheStats, VerifiedFileCache

__all__ = ["BlockCache", "CacheStats", "check_cache_dir"]


def check_cache_dir(directory: str | os.PathLike[str]) -> None:
    """ValueError, one line naming the cause, unless ``directory`` is (or can be made) a writable directory.

    Checked at start-up, by writing a temporary file in it, so that a cache that
    cannot be written is refused at once instead of failing every block write.
    """
    path = os.fspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except FileExistsError:
        raise ValueError(f"cache directory {path!r} is not a directory") from None
    except OSError as exc:
        what = "is not a directory" if isinstance(exc, (NotADirectoryError, FileExistsError)) else "cannot be written"
        raise ValueError(f"cache directory {path!r} {what}: {exc.strerror or exc}") from None

#: Bytes the node's block cache may hold unless told otherwise (``bootseer layer-server --cache-size``,
#: the snapshotter's ``[cache] size``), together with the ``fanotify`` path's local blobs
#: (:mod:`bootseer.blockstore.datapath.blob_store`: the cache is bounded by it less the blobs in use).
DEFAULT_CACHE_SIZE = 16 << 30


class BlockCache(VerifiedFileCache):
    """Raw blocks under ``directory`` keyed by their SHA-256 (64 hex digits), at most ``max_bytes`` (LRU).

    ``get(digest)`` returns the block's bytes only if they hash to ``digest``;
    ``put(digest, data)`` stores them.  ``put`` does not hash again: the caller has
    just verified the block, and an entry stored under a wrong name would only ever
    be a miss, since ``get`` checks.
    """

    MAGIC = b"BSBLOCK1"
    kind = "blocks"
    keep_out_of_page_cache = True

    @staticmethod
    def check_key(key: str) -> str:
        """``key`` if it is a block digest (64 lowercase hex digits), else ValueError."""
        if not isinstance(key, str) or len(key) != 64 or key.strip("0123456789abcdef"):
            raise ValueError(f"a block cache key is a SHA-256 in hex (64 lowercase digits), not {key!r}")
        return key

    def verify(self, key: str, payload: bytes) -> str | None:
        if hashlib.sha256(payload).hexdigest() != key:
            return "bytes do not hash to the digest they are stored under"
        return None
