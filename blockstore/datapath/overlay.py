"""overlayfs mount options, and the one kernel check they rest on, made once.

A container's snapshot (:mod:`bootseer.snapshotter.mounts`) and a restored bare-metal
prefix (:mod:`bootseer.depsnap.prefix`) both stack lower directories -- the layers'
EROFS mounts or FUSE trees -- under an upper and a work directory; this module is the
one place that spells their options.  ``index=off`` is passed wherever the kernel knows
the option, as containerd does: with the index on, remounting a lower directory under
another upper fails, and snapshots share lower directories all the time.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

#: Present when the running overlayfs knows the ``index`` option.
INDEX_PARAMETER = "/sys/module/overlay/parameters/index"


@functools.cache
def supports_index_off() -> bool:
    """Whether the kernel knows overlayfs's ``index`` option, so ``index=off`` may be passed (checked once)."""
    return os.path.exists(INDEX_PARAMETER)


def overlay_options(lowers: Sequence[str], *, upper: str | None = None, work: str | None = None) -> list[str]:
    """The options of an overlay mount of ``lowers`` (closest first), writable when ``upper`` and ``work`` are given."""
    if not lowers:
        raise ValueError("an overlay mount needs at least one lower directory")
    if (upper is None) != (work is None):
        raise ValueError("a writable overlay mount needs both an upper and a work directory")
    options = ["index=off"] if supports_index_off() else []
    if upper is not None:
        options += [f"workdir={work}", f"upperdir={upper}"]
    options.append("lowerdir=" + ":".join(lowers))
    return options


__all__ = ["INDEX_PARAMETER", "overlay_options", "supports_index_off"]
