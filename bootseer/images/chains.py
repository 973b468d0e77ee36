"""ChainIDs: the OCI image spec's name for a stack of layers, from the layers' diff IDs.

A layer's ChainID is its diff ID at the bottom of an image, and the SHA-256 of
``"<parent ChainID> <diff ID>"`` above it; containerd names snapshots by it and the block
store names a converted layer's chain record by it.
"""

from __future__ import annotations

import hashlib
from typing import Iterable


def chain_id(parent_chain_id: str, diff_id: str) -> str:
    """containerd's (and the OCI image spec's) ChainID of a layer over ``parent_chain_id``."""
    if not parent_chain_id:
        return diff_id
    return "sha256:" + hashlib.sha256(f"{parent_chain_id} {diff_id}".encode()).hexdigest()


def chain_ids(diff_ids: Iterable[str]) -> list[str]:
    """The ChainID of every layer of an image, bottom first, from its config's ``diff_ids``."""
    result: list[str] = []
    for diff_id in diff_ids:
        result.append(chain_id(result[-1] if result else "", diff_id))
    return result


__all__ = ["chain_id", "chain_ids"]
