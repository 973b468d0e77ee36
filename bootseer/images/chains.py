"""ChainIDs: the OCI image spec's name for a stack of layers, from the layers' diff IDs.

A layer's ChainID is its diff ID at the bottom of an image, and the SHA-256 of
``"<parent ChainID> <diff ID>"`` above it; containerd names snapshots by it and the block
store names a converted layer's chain record by it.

:data:`LABEL_LAYERS_ABOVE` is the one label BootSeer adds to a layer's Prepare: the ChainIDs of
the image's layers above it, which ``bootseer rpull`` sets (:func:`layers_above_label`) and the
snapshotter reads (:func:`layers_above`) to have the layer server load them while this one mounts.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Sequence

#: On a layer's Prepare: the ChainIDs of the image's layers above it, lowest first, comma-separated, as
#: many as fit in one label (containerd refuses a label over 4096 bytes, key and value together).
LABEL_LAYERS_ABOVE = "containerd.io/snapshot/bootseer.layers-above"
#: containerd refuses labels whose key and value together exceed this (labels/validate.go).
MAX_LABEL_BYTES = 4096
#: At most this many ChainIDs are read from the label (what one fits, and then some).
MAX_LAYERS_ABOVE = 64
_CHAIN_ID = re.compile(r"sha256:[0-9a-f]{64}")


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


def label_list(items: Iterable[str], key: str) -> str:
    """``items`` comma-separated, as many as fit in one label named ``key`` (containerd's pkg/snapshotters
    getLayers does the same for the CRI's layer digests)."""
    out = ""
    for value in items:
        item = value if not out else "," + value
        if len(key) + len(out) + len(item) > MAX_LABEL_BYTES:
            break
        out += item
    return out


def layers_above_label(chain: Sequence[str], index: int) -> str:
    """The value of :data:`LABEL_LAYERS_ABOVE` on the Prepare of layer ``index`` of ``chain`` (its ChainIDs,
    bottom first): those above it, lowest first, as many as fit ("" for the top layer)."""
    return label_list(chain[index + 1 : index + 1 + MAX_LAYERS_ABOVE], LABEL_LAYERS_ABOVE)


def layers_above(labels: dict[str, str]) -> list[str]:
    """The ChainIDs a Prepare's :data:`LABEL_LAYERS_ABOVE` names: well-formed ones only, at most
    :data:`MAX_LAYERS_ABOVE`, each once (a label is the caller's word: it only ever costs a load ahead)."""
    value = labels.get(LABEL_LAYERS_ABOVE, "")
    out: list[str] = []
    for item in value.split(",")[:MAX_LAYERS_ABOVE]:
        item = item.strip()
        if _CHAIN_ID.fullmatch(item) and item not in out:
            out.append(item)
    return out


__all__ = ["LABEL_LAYERS_ABOVE", "MAX_LABEL_BYTES", "chain_id", "chain_ids", "label_list", "layers_above", "layers_above_label"]
