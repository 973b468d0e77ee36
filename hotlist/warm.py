"""Warming the kernel's page cache with an image's hot blocks, so the job's first reads never reach FUSE.

Prefetching a hot list puts its blocks in the node cache, but a read of one still costs a
FUSE request: in the layer server a round trip through the kernel, pyfuse3 and trio, a
node-cache read and a SHA-256 check.  Measured on a restored torch environment whose every
hot block was already in the node cache: 3,240 FUSE reads took 9.5 s of a 16.7 s import.
The kernel can serve those reads from its page cache instead, with no request at all, if
the pages are there: the layer server's files are opened with ``keep_cache``, and
overlayfs reads a lower file through the lower file's own page cache.

So, as each batch of the hot list is fetched (the raw blocks just verified, in memory), a
:class:`PageCacheWarmer` hands them to the kernel with FUSE's store notification
(``pyfuse3.notify_store``: the bytes go straight into the file's page cache, no read
request, no second verification), at the file offsets they back, in the hot list's
order.  The kernel takes a store only for an inode it holds, so the warmer first looks
each file up through the server's own mount (``os.stat`` from the worker thread; the
lookup is answered by the server's trio loop meanwhile), which also leaves the file's
dentry cached for the job.  A block shared by several files (dedup: the same small
``INSTALLER``, ``__init__.py`` or licence in many packages) is stored into each of them,
up to :data:`MAX_PLACEMENTS` files (the page cache is per file).  Nothing is opened or
read through the mount, so the hot-list accounting (of opens and reads) sees none of it.

The page cache stays the kernel's to manage: under memory pressure it drops the pages and
the job's read reaches FUSE and the node cache as without warming.  What is stored is
bounded by the hot list (the bytes the recorded boot read first).  A store that fails (an
inode the kernel dropped meanwhile: ENOENT; a kernel without store notifications: ENOSYS,
which turns warming off) is skipped: warming only ever saves time.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Callable, Sequence

from bootseer.blockstore.format import EntryType, LayerIndex
from bootseer.blockstore.layerfs import inode_number
from bootseer.hotlist.format import ResolvedBlock
from bootseer.log import get_logger

log = get_logger(__name__)

#: Files one block is stored into at most (a block in more files is a common small file).
MAX_PLACEMENTS = 16

#: ``store(inode, offset, data)``: put ``data`` into the kernel's page cache of ``inode``.
Store = Callable[[int, int, bytes], None]


def _notify_store(inode: int, offset: int, data: bytes) -> None:
    import pyfuse3

    pyfuse3.notify_store(inode, offset, data)


@dataclass(frozen=True)
class Placement:
    """Where a block's bytes go: a file of the layer (its path in the mount, its inode) and an offset."""

    path: str
    inode: int
    offset: int
    length: int  #: the block's bytes in this file (the last block of a file may be short)


class PageCacheWarmer:
    """Store hot blocks in the page cache of the files they back (see the module docstring).

    ``indexes`` maps each layer's ChainID to its index, ``slots`` to its slot in the
    layer server and ``directories`` to its directory in the mount; ``digests`` are the
    blocks worth placing (the hot list's): only those are mapped to files, in one pass
    over each index.
    """

    def __init__(
        self,
        indexes: dict[str, LayerIndex],
        slots: dict[str, int],
        directories: dict[str, str],
        digests: set[str],
        store: Store = _notify_store,
    ) -> None:
        self._store = store
        self._where: dict[tuple[str, str], list[Placement]] = {}
        for layer, index in indexes.items():
            for number, entry in enumerate(index.entries):
                if entry.type is not EntryType.FILE or entry.link is not None or not entry.blocks:
                    continue
                for position, ref in enumerate(entry.blocks):
                    digest = index.blocks[ref].digest
                    if digest not in digests:
                        continue
                    places = self._where.setdefault((layer, digest), [])
                    offset = position * index.block_size
                    length = min(index.block_size, entry.size - offset)
                    if length > 0 and len(places) < MAX_PLACEMENTS:
                        places.append(Placement(os.path.join(directories[layer], entry.path),
                                                inode_number(slots[layer], number), offset, length))  # fmt: skip
        self._looked_up: set[str] = set()
        self.enabled = True
        self.stored_bytes = 0
        self.skipped = 0

    def warm(self, layer: str, blocks: Sequence[ResolvedBlock], data: Sequence[bytes]) -> int:
        """Blocking (a worker thread): store ``data`` (the raw bytes of ``blocks``, of ``layer``); bytes stored."""
        done = 0
        for block, payload in zip(blocks, data):
            for where in self._where.get((layer, block.hot.digest), ()):
                if not self.enabled:
                    break
                if len(payload) < where.length:
                    continue
                try:
                    if where.path not in self._looked_up:
                        os.stat(where.path)  # the kernel stores only into an inode it holds
                        self._looked_up.add(where.path)
                    self._store(where.inode, where.offset,
                                payload if len(payload) == where.length else payload[: where.length])  # fmt: skip
                    done += where.length
                except OSError as exc:
                    self.skipped += 1
                    if exc.errno == errno.ENOSYS:
                        self.enabled = False
                        log.warning("the kernel takes no FUSE store notifications: prefetch warms no page cache")
                    else:
                        log.debug("page-cache warming skipped a block", path=where.path, offset=where.offset,
                                  error=str(exc))  # fmt: skip
        self.stored_bytes += done
        return done


__all__ = ["Placement", "PageCacheWarmer", "Store"]
