"""The blocks on disk in the open local blobs, by digest: what peers are served from on the ``fanotify`` path.

A blob fill writes a verified block into its layer's blob only (:mod:`.local_blobs`), so the
node cache no longer holds what a node has read, and a peer asking for such a block would be sent
to the store.  :class:`FilledBlocks` is the layer server's
:class:`~bootseer.blockstore.node.local_blocks.LocalBlocks` (the block fetcher asks it for a
peer's block before the node cache and the store): a lookup from a block's digest to the places
(blob, block number) of the open blobs whose index names it, built when a blob is opened and
dropped when it is closed.  :meth:`FilledBlocks.read` takes the first place whose fill map says
``FILLED`` or ``AHEAD``, reads the block's raw bytes through the blob's writer (opened before the blob's mark:
the read raises no event), and returns them only if they hash to the digest (SHA-256, as the
fetcher checks a block); a block that fails is logged and counted, and the next place, or the
store, serves the peer.  A blob being closed is never read (its writer is duplicated under the
blob's lock, so a descriptor number closed and reused meanwhile is never read instead).

Blobs kept on disk with no layer mounted (:mod:`.blob_store`) are not looked in: their blocks go
to peers from the store until a layer opens the blob again.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import prometheus_client

from bootseer.blockstore.datapath.blob_check import ON_DISK
from bootseer.log import get_logger

if TYPE_CHECKING:
    from bootseer.blockstore.datapath.local_blobs import LocalBlob

log = get_logger(__name__)

PEER_READS = prometheus_client.Counter(
    "bootseer_local_blob_peer_reads",
    "Blocks a peer asked for that were looked up in the local blobs, by outcome: served (read and verified), "
    "corrupt (the bytes on disk did not hash to the digest: not served), absent (no open blob holds it on disk)",
    ["outcome"],
)
for _outcome in ("served", "corrupt", "absent"):
    PEER_READS.labels(_outcome)


@dataclass(frozen=True)
class FilledBlocksStatistics:
    """What :meth:`FilledBlocks.statistics` reports."""

    served: int  #: blocks read from a blob for a peer, verified
    corrupt: int  #: blocks whose bytes in a blob failed their digest (not served)
    absent: int  #: lookups no open blob held on disk (none failed: none was there)


class FilledBlocks:
    """Digest -> (blob, block number) of the open local blobs; reads verified blocks for peers (see the module)."""

    def __init__(self) -> None:
        self._places: dict[str, list[tuple[LocalBlob, int]]] = {}
        self._served = self._corrupt = self._absent = 0

    def add(self, blob: LocalBlob) -> None:
        """Look in ``blob`` from now on (an open).  Trio thread."""
        for ref, block in enumerate(blob.index.blocks):
            if not block.is_zero:
                self._places.setdefault(block.digest, []).append((blob, ref))

    def remove(self, blob: LocalBlob) -> None:
        """Look in ``blob`` no more (a close).  Trio thread."""
        for block in blob.index.blocks:
            places = self._places.get(block.digest)
            if places is None:
                continue
            places[:] = [place for place in places if place[0] is not blob]
            if not places:
                del self._places[block.digest]

    def read(self, digest: str, rlen: int) -> bytes | None:
        """Block ``digest`` of ``rlen`` raw bytes from the first open blob that holds it on disk, verified; None if
        none does.  Blocking (a worker thread)."""
        failed = False
        for blob, ref in list(self._places.get(digest, ())):
            block = blob.index.blocks[ref]
            if block.rlen != rlen or blob.filled[ref] not in ON_DISK:
                continue
            data = _read(blob, blob.index.blob_offset(ref), rlen)
            if data is None:
                continue
            if hashlib.sha256(data).hexdigest() == digest:
                self._served += 1
                PEER_READS.labels("served").inc()
                return data
            failed = True
            self._corrupt += 1
            PEER_READS.labels("corrupt").inc()
            log.warning("a block of a local blob does not hash to its digest: not served to the peer", index=blob.name,
                        block=ref, digest=digest)  # fmt: skip
        if not failed:
            self._absent += 1
            PEER_READS.labels("absent").inc()
        return None

    def statistics(self) -> FilledBlocksStatistics:
        return FilledBlocksStatistics(self._served, self._corrupt, self._absent)


def _read(blob: LocalBlob, offset: int, length: int) -> bytes | None:
    """``length`` bytes at ``offset`` of ``blob`` through a duplicate of its writer (None: the blob is closed)."""
    fd = blob.duplicate_writer()
    if fd is None:
        return None
    try:
        return os.pread(fd, length, offset)
    except OSError as exc:
        log.warning("cannot read a block of a local blob for a peer", index=blob.name, error=str(exc))
        return None
    finally:
        os.close(fd)


__all__ = ["FilledBlocks", "FilledBlocksStatistics", "PEER_READS"]
