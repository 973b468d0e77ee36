"""The layer server's local copies of the indexes of the layers it serves (``ROOT/layers/indexes/``).

A restarted server puts every layer back in its slot before it answers anyone, and without
the store: from these copies.  Each copy is the store's index object byte for byte, named by
the SHA-256 the chain record names it by, and verified against it when read, as the store's
object is.  A copy is written to a temp name and renamed, so it is whole or absent.  The
methods here block (file I/O, decoding): callers run them in a worker thread.
"""

from __future__ import annotations

from pathlib import Path

from bootseer.atomic import write_atomically
from bootseer.blockstore.objects.format import ChainRecord, FormatError, LayerIndex
from bootseer.log import get_logger

log = get_logger(__name__)


class IndexCopies:
    """The index copies in ``directory``, one file per index object (named by its SHA-256)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, record: ChainRecord) -> Path:
        """Where the copy of ``record``'s index is kept."""
        return self.directory / record.index

    def load(self, record: ChainRecord) -> LayerIndex | None:
        """The saved copy of ``record``'s index, if there is a good one (a damaged one is logged, and None)."""
        try:
            data = self.path(record).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return LayerIndex.decode(data, record=record)
        except FormatError as exc:
            log.warning("local index copy is damaged; fetching it again", index=record.index, error=str(exc))
            return None

    def save(self, record: ChainRecord, data: bytes) -> None:
        """Keep ``data`` (the index object as fetched and verified) as the copy of ``record``'s index.

        A copy already there with other bytes (damaged, or re-encoded by an older
        server) is replaced.
        """
        path = self.path(record)
        try:
            if path.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        write_atomically(path, data)

    def remove(self, record: ChainRecord) -> None:
        """Drop the copy of ``record``'s index (no layer served uses it any more)."""
        self.path(record).unlink(missing_ok=True)


__all__ = ["IndexCopies"]
