"""The layer server's table: the layers it serves, each in its slot, saved in ``ROOT/layers/table.json``.

A row (:class:`Layer`) names a layer by its ChainID, the slot its tree is served in,
its store (whole URL in memory, redacted and by ``store_id`` on disk), its chain
record and the data path it is served on.  :class:`LayerTable` holds the rows and
changes them and the file together, as containerd's snapshotters change metadata and
on-disk state in one transaction: a row added or removed is put back when the table
cannot be written.  The file is written to a temp name, fsynced and renamed
(:func:`bootseer.atomic.write_atomically`), so it is always a whole table; a restarted server reads it
back (:func:`load_table`) and puts every layer in the slot it had.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import trio

from bootseer.blockstore.server.client import LayerServerError
from bootseer.blockstore.objects.format import ChainRecord, FormatError
from bootseer.blockstore.datapath.tree import MAX_SLOT, LayerTree
from bootseer.atomic import write_atomically
from bootseer.fetch.sources import redact_url

TABLE_VERSION = 1


def store_id(url: str) -> str:
    """What the table names a store by: the SHA-256 of its whole URL, credentials included.

    The table shows only :func:`redact_url` of a URL; a restarted server finds the
    real one again among the URLs it was given whose id matches.
    """
    return "sha256:" + hashlib.sha256(url.encode()).hexdigest()


@dataclass
class Layer:
    """One row of the table: a layer the server serves (or is to serve: ``tree`` None).

    ``store`` is the whole URL (with any credential: never shown, never saved); it is
    "" for a saved row whose store this server was not given, which then only
    ``store_id`` and ``shown_store`` (redacted) name.
    """

    chain_id: str
    slot: int
    store: str
    record: ChainRecord
    tree: LayerTree | None = None
    error: str = ""  #: why the layer is not being served (restore failed)
    #: mounted as a dependency layer on the word of a deps record naming this index (no converter signature)
    deps_index: str = ""
    store_id: str = ""
    shown_store: str = ""
    data_path: str = "tree"  #: how it is served: fanotify, erofs, loop or tree (the node's data path when mounted)

    def __post_init__(self) -> None:
        if self.store:
            self.store_id = store_id(self.store)
            self.shown_store = redact_url(self.store)

    def to_json(self) -> dict[str, Any]:
        row = {
            "chain_id": self.chain_id,
            "slot": self.slot,
            "store": self.shown_store,
            "store_id": self.store_id,
            "record": json.loads(self.record.encode()),
            "data_path": self.data_path,
        }
        if self.deps_index:
            row["deps_index"] = self.deps_index
        return row


# -- the saved table -----------------------------------------------------------------------


def load_table(path: Path, stores: Iterable[str] = ()) -> list[Layer]:
    """The layers of a saved table (none if there is no table); ValueError if it is malformed.

    Each row's store is found again among ``stores`` (the URLs this server was given)
    by its ``store_id``; a row's shown URL is its store itself when it has nothing to
    redact (or the row is from a table older than store ids).  A row whose store is
    none of these comes back with ``store`` "" and ``error`` saying so.
    """
    known = {store_id(url): url for url in stores if url}
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return []
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); move it away to start with no layers") from None
    try:
        if document["version"] != TABLE_VERSION:
            raise ValueError(f"{path}: table version {document['version']!r} is not {TABLE_VERSION}")
        layers = []
        for row in document["layers"]:
            record = ChainRecord.decode(json.dumps(row["record"]).encode(), expected_chain_id=row["chain_id"])
            shown, saved_id = str(row["store"]), row.get("store_id")
            if saved_id is None or (saved_id == store_id(shown) and redact_url(shown) == shown):
                known.setdefault(store_id(shown), shown)
                saved_id = store_id(shown)
            layer = Layer(record.chain_id, int(row["slot"]), known.get(str(saved_id), ""), record,
                          deps_index=str(row.get("deps_index", "")), data_path=str(row.get("data_path", "tree")))
            if not layer.store:
                layer.store_id, layer.shown_store = str(saved_id), shown
                layer.error = (f"its store {shown} is not one this layer server was given "
                               f"(--store, or a mount's store): start it with that store to serve it again")
            layers.append(layer)
    except (KeyError, TypeError, FormatError) as exc:
        raise ValueError(f"{path} is malformed ({exc!r}); move it away to start with no layers") from None
    slots = [layer.slot for layer in layers]
    if len(set(slots)) != len(slots) or any(not 1 <= s <= MAX_SLOT for s in slots):
        raise ValueError(f"{path} gives two layers one slot, or a slot out of range")
    return layers


def save_table(path: Path, layers: list[Layer]) -> None:
    document = {"version": TABLE_VERSION, "layers": [layer.to_json() for layer in sorted(layers, key=lambda x: x.slot)]}
    write_atomically(path, (json.dumps(document, indent=1) + "\n").encode())


class LayerTable(Mapping[str, Layer]):
    """The rows of a layer server, by ChainID (a read-only mapping), and their file ``path``.

    Every change is made holding :attr:`lock` (a mount or an unmount holds it across its
    whole transaction, so two never interleave their rows or their saves).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = trio.Lock()
        self._rows: dict[str, Layer] = {}

    def __getitem__(self, chain_id: str) -> Layer:
        return self._rows[chain_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def by_slot(self) -> list[Layer]:
        """The rows in slot order."""
        return sorted(self._rows.values(), key=lambda layer: layer.slot)

    def free_slot(self, in_use: Callable[[int], bool]) -> int:
        """The lowest slot no row holds and ``in_use`` (the kernel still references it) does not claim."""
        taken = {layer.slot for layer in self._rows.values()}
        slot = 1
        while slot in taken or in_use(slot):
            slot += 1
        if slot > MAX_SLOT:
            raise LayerServerError("no free slot")
        return slot

    def restore(self, layer: Layer) -> None:
        """Put back a row read from the file at start (nothing is written)."""
        self._rows[layer.chain_id] = layer

    async def save(self) -> None:
        """Write the table as it is (in a worker thread: temp name, fsync, rename)."""
        await trio.to_thread.run_sync(save_table, self.path, list(self._rows.values()))

    async def add(self, layer: Layer) -> bool:
        """Put ``layer``'s row in (replacing its ChainID's) and save; whether it is new.

        A new row the file could not take is taken out again before the error goes on.
        """
        added = layer.chain_id not in self._rows
        self._rows[layer.chain_id] = layer
        try:
            await self.save()
        except BaseException:
            if added:
                del self._rows[layer.chain_id]
            raise
        return added

    async def remove(self, chain_id: str) -> Layer | None:
        """Take ``chain_id``'s row out and save; the row (None: there was none, nothing is written).

        A row the file could not lose is put back before the error goes on.
        """
        layer = self._rows.pop(chain_id, None)
        if layer is None:
            return None
        try:
            await self.save()
        except BaseException:
            self._rows[chain_id] = layer
            raise
        return layer


__all__ = ["Layer", "LayerTable", "TABLE_VERSION", "load_table", "save_table", "store_id"]
