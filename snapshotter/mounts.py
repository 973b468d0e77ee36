"""The mounts that make a snapshot visible, exactly as containerd's overlay snapshotter returns them.

containerd (or ``ctr``) performs these mounts itself; the snapshotter only describes
them.  The shapes, from ``snapshots/overlay/overlay.go``:

* no parent: a bind mount of the snapshot's own directory, ``rw`` (active) or ``ro`` (view);
* a view of one parent: a read-only bind mount of the parent's directory;
* an active snapshot with parents: overlayfs with ``upperdir``/``workdir`` and the
  parents as ``lowerdir`` (closest parent first);
* a view of several parents: overlayfs with only ``lowerdir`` (read-only by nature).
"""

from __future__ import annotations

from typing import Sequence

from bootseer.blockstore.datapath.overlay import overlay_options

from .types import Kind, Mount


def snapshot_mounts(kind: Kind, upper: str, work: str, lowers: Sequence[str]) -> list[Mount]:
    """The mounts of an active or view snapshot.

    ``upper``/``work`` are the snapshot's own directories (unused by a view with
    parents); ``lowers`` are its parents' directories, closest first.
    """
    if not lowers:
        return [Mount(type="bind", source=upper, options=("ro" if kind is Kind.VIEW else "rw", "rbind"))]
    if kind is Kind.VIEW and len(lowers) == 1:
        return [Mount(type="bind", source=lowers[0], options=("ro", "rbind"))]
    writable = kind is Kind.ACTIVE
    options = overlay_options(lowers, upper=upper if writable else None, work=work if writable else None)
    return [Mount(type="overlay", source="overlay", options=tuple(options))]
