"""A layer's EROFS image as the converter builds it: the node's tree, with its small files' data inside.

A node used to build every layer's EROFS metadata image from the layer index itself, on every
node and every start.  The converter builds it once instead (:func:`build_layer_image`), and
``bootseer convert`` stores it beside the index (``converter.publish_image``).  The image is
the node-built one (:func:`bootseer.blockstore.objects.erofs_image.write_image`, the same
writer) with one difference: regular files of at most ``inline_max`` bytes hold their data in
the image, so a container's read of a small ``.py`` or ``.pyc`` file is served by the kernel
from the image, with no read of the layer's blob (a FUSE request each, on the EROFS data path).
Larger files stay chunk-mapped onto the blob.  What ``inline_max`` is, and the figures it was
chosen by, are in docs/FORMAT.md ("Converter-built images").

The small files' bytes are read back from the store (``read_blocks``: the converter's
:class:`~bootseer.blockstore.convert.converter.BlockVerifier`, which groups neighbours into
range reads and checks every block against its SHA-256), so a first conversion and a rerun
that adds images to an older conversion take the same path, and a byte that is not the
index's block never reaches an image.  Their total is bounded (:data:`MAX_INLINE_BYTES`):
past it the largest small files stay on the blob.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bootseer.blockstore.objects.erofs_image import write_image
from bootseer.blockstore.objects.format import MAX_IMAGE_INLINE_BYTES, Block, EntryType, LayerIndex, StoredBlock

#: Regular files of at most this many bytes hold their data in the layer's image (docs/FORMAT.md).
DEFAULT_INLINE_MAX = 4096
#: The most file bytes one image holds (what reading them back keeps in memory at once; a node's bound).
MAX_INLINE_BYTES = MAX_IMAGE_INLINE_BYTES

ReadBlocks = Callable[[Sequence[StoredBlock]], dict[StoredBlock, bytes]]


class ImageBuildError(Exception):
    """The image of a layer cannot be built (a small file's block cannot be read back, or EROFS cannot hold the tree)."""


@dataclass(frozen=True)
class BuiltImage:
    """An image written to a spool file: where, how big, its SHA-256, and what it holds inline."""

    path: Path
    size: int
    sha256: str
    inline_max: int
    inline_files: int
    inline_bytes: int


def inline_candidates(index: LayerIndex, inline_max: int) -> dict[int, Block]:
    """The regular files (entry number -> their one block) whose data goes into the image, smallest first
    while their total stays within :data:`MAX_INLINE_BYTES`.  Hard links are their target's."""
    small = [(entry.size, number) for number, entry in enumerate(index.entries)
             if entry.type is EntryType.FILE and entry.link is None and 0 < entry.size <= inline_max
             and len(entry.blocks) == 1]  # fmt: skip
    small.sort()
    chosen: dict[int, Block] = {}
    total = 0
    for size, number in small:
        if total + size > MAX_INLINE_BYTES:
            break
        total += size
        chosen[number] = index.blocks[index.entries[number].blocks[0]]
    return chosen


def build_layer_image(index: LayerIndex, out_path: Path, *, packs: Sequence[str], inline_max: int,
                      read_blocks: ReadBlocks) -> BuiltImage:  # fmt: skip
    """Write ``index``'s image with its small files' data to ``out_path``; ImageBuildError naming why not.

    ``packs`` are the pack names ``index.blocks`` refer to by number (``index.packs``, or the
    names a conversion in progress gave them); ``read_blocks`` reads stored blocks back, checked.
    """
    from bootseer.blockstore.objects.erofs_image import ErofsError

    chosen = inline_candidates(index, inline_max)
    places = {number: StoredBlock(block.digest, packs[block.pack], block.offset, block.clen, block.rlen)
              for number, block in chosen.items() if not block.is_zero}  # fmt: skip
    raw = read_blocks(list(places.values())) if places else {}
    inline: dict[int, bytes] = {}
    for number, block in chosen.items():
        if block.is_zero:
            inline[number] = bytes(block.rlen)
            continue
        data = raw.get(places[number])
        if data is None:
            raise ImageBuildError(f"block sha256:{block.digest} of {index.entries[number].path!r} does not read back "
                                  f"from pack {places[number].pack} as that block")  # fmt: skip
        inline[number] = data
    try:
        with open(out_path, "wb") as out:
            size = write_image(index, out, inline=inline)
    except ErofsError as exc:
        raise ImageBuildError(f"the layer's tree cannot be an EROFS image: {exc}") from None
    digest = hashlib.sha256()
    with open(out_path, "rb") as image:
        while piece := image.read(1 << 20):
            digest.update(piece)
    return BuiltImage(out_path, size, digest.hexdigest(), inline_max, len(inline), sum(map(len, inline.values())))


__all__ = ["DEFAULT_INLINE_MAX", "MAX_INLINE_BYTES", "BuiltImage", "ImageBuildError", "build_layer_image",
           "inline_candidates"]  # fmt: skip
