"""The layer server's local copies of the indexes (or block tables) of the layers it serves (``ROOT/layers/indexes/``).

A restarted server puts every layer back in its slot before it answers anyone, and without
the store: from these copies.  Each copy is the store's object byte for byte, named by
the SHA-256 the chain record names it by, and verified against the record when read, as the
store's object is: the layer's JSON index, or, for a layer served from its converter-built
EROFS image, its binary block table (:mod:`~bootseer.blockstore.objects.block_table`), whichever
the server loaded.  A copy is written to a temp name and renamed, so it is whole or absent.  The
methods here block (file I/O, decoding): callers run them in a worker thread.
"""

from __future__ import annotations

from pathlib import Path

from bootseer.atomic import write_atomically
from bootseer.blockstore.objects.block_table import LayerBlocks, LayerBlockTable
from bootseer.blockstore.objects.format import ChainRecord, FormatError, LayerIndex
from bootseer.log import get_logger

log = get_logger(__name__)


class IndexCopies:
    """The copies in ``directory``, one file per index or block table object (named by its SHA-256)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, record: ChainRecord, *, table: bool = False) -> Path:
        """Where the copy of ``record``'s index (with ``table``, its block table) is kept."""
        return self.directory / (record.block_table if table else record.index)

    def load(self, record: ChainRecord, *, table: bool = False) -> LayerBlocks | None:
        """The saved copy of ``record``'s index (with ``table``, its block table), if there is a good one (a
        damaged one is logged, and None)."""
        try:
            data = self.path(record, table=table).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return LayerBlockTable.decode(data, record=record) if table else LayerIndex.decode(data, record=record)
        except FormatError as exc:
            log.warning("local index copy is damaged; fetching it again", index=record.index, table=table, error=str(exc))
            return None

    def save(self, record: ChainRecord, data: bytes, *, table: bool = False) -> None:
        """Keep ``data`` (the object as fetched and verified) as the copy of ``record``'s index (with ``table``,
        its block table).

        A copy already there with other bytes (damaged, or re-encoded by an older
        server) is replaced.
        """
        path = self.path(record, table=table)
        try:
            if path.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        write_atomically(path, data)

    def remove(self, record: ChainRecord) -> None:
        """Drop the copies of ``record``'s index and block table (no layer served uses them any more)."""
        self.path(record).unlink(missing_ok=True)
        if record.block_table:
            self.path(record, table=True).unlink(missing_ok=True)


__all__ = ["IndexCopies"]
