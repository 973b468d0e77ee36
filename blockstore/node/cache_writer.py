"""The node cache's writer: verified blocks go to disk behind the reads that fetched them.

A write into the :class:`~bootseer.blockstore.node.block_cache.BlockCache` costs a few
hundred microseconds (a temporary file, a rename), more than decoding a small block, so a
read never waits for it: the fetcher hands its verified blocks to a :class:`CacheWriter`,
whose one thread writes them, and reads them from :attr:`CacheWriter.pending` meanwhile.
The queue is bounded (:data:`CACHE_WRITE_QUEUE_BYTES`): a fetcher whose blocks do not fit
writes them itself, in its worker thread.
"""

from __future__ import annotations

import threading
from collections import deque

from bootseer import cpu
from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.log import get_logger

log = get_logger(__name__)


#: Verified blocks that may wait in memory for the node cache's writer: a layer server's memory
#: beyond ``--memory-limit`` (the stripes) by at most this much (a slow cache disk fills it).
CACHE_WRITE_QUEUE_BYTES = 64 << 20


class CacheWriter:
    """Writes verified blocks into the node cache behind the reads that fetched them.

    A write costs a few hundred microseconds (a temporary file, a rename), more than
    decoding a small block: a read should not wait for it.  Blocks go into a queue
    that one thread at a time drains, started when the queue fills from empty; it is
    not a daemon thread, so a process that exits normally writes what is queued
    first (a killed one loses it: the next read fetches again).  At most
    ``limit_bytes`` wait; beyond that :meth:`submit` refuses and the caller writes
    itself.  Until written, a block is in the fetcher's memory of recent blocks.
    """

    def __init__(self, cache: BlockCache, limit_bytes: int = CACHE_WRITE_QUEUE_BYTES) -> None:
        self.cache = cache
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[tuple[str, bytes]] = deque()
        #: digest -> raw bytes of the blocks queued or being written: read as if in memory meanwhile
        self.pending: dict[str, bytes] = {}
        self._bytes = 0  # queued or being written
        self._thread: threading.Thread | None = None

    def submit(self, blocks: list[tuple[str, bytes]]) -> bool:
        """Queue ``(digest, raw bytes)`` pairs to be written; False (nothing queued) when the queue is full."""
        size = sum(len(data) for _, data in blocks)
        with self._lock:
            if self._bytes + size > self.limit_bytes:
                return False
            self._queue.extend(blocks)
            self.pending.update(blocks)
            self._bytes += size
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="bootseer block cache writer", daemon=False)
                self._thread.start()
        return True

    def write(self, blocks: list[tuple[str, bytes]]) -> None:
        """Blocking: write ``blocks`` now, in the caller's thread."""
        for digest, data in blocks:
            self._put(digest, data)

    def wait_idle(self) -> None:
        """Blocking: return once everything queued is written."""
        with self._lock:
            self._idle.wait_for(lambda: self._thread is None)

    def _put(self, digest: str, data: bytes) -> None:
        try:
            with cpu.stage("cache_write"):
                self.cache.put(digest, data)  # counts and logs its own OSErrors
        except Exception as exc:  # a bug must not kill the writer and strand the queue
            log.error("writing a block into the node cache failed", block=digest, error=repr(exc))

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    self._idle.notify_all()
                    return
                digest, data = self._queue.popleft()
            try:
                self._put(digest, data)
            finally:
                with self._lock:
                    self._bytes -= len(data)
                    if self.pending.get(digest) is data:
                        del self.pending[digest]
