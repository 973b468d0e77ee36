"""First-writer-wins publishing and removal, as functions: kept for the callers not yet moved.

The code is :meth:`bootseer.blockstore.store.StoreWriter.put_if_absent` and
:meth:`~bootseer.blockstore.store.StoreWriter.remove` (atomic per backend: see there);
call those.  ``depsnap`` still imports these two names, and this module goes once it
calls the writer's methods.
"""

from __future__ import annotations

from bootseer.blockstore.store import StoreWriter


def publish_if_absent(writer: StoreWriter, name: str, data: bytes) -> bool:
    """``writer.put_if_absent(name, data)``: True if this call stored it (first writer wins)."""
    return writer.put_if_absent(name, data)


def remove_object(writer: StoreWriter, name: str) -> bool:
    """``writer.remove(name)``: True if it existed."""
    return writer.remove(name)


__all__ = ["publish_if_absent", "remove_object"]
