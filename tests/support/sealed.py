"""Comparing sealed store objects (``blockstore.objects.format.encode_sealed``) with bytes stored by older code."""

from __future__ import annotations

import struct

import zstandard

_HEADER = struct.Struct("<8sIQ32s")  # as docs/FORMAT.md defines it, independently of the code under test


def same_sealed_object(encoded: bytes, stored: bytes, stored_with_zstd: tuple[int, int, int]) -> bool:
    """Whether ``encoded`` is the object ``stored`` (written by zstd ``stored_with_zstd``) byte for byte.

    zstd at one level is deterministic for one library version, so with that version
    the bytes must be equal.  A newer zstd may compress the same payload differently,
    which changes no reader's result: then the header fields and the decompressed
    payload must be equal.
    """
    if zstandard.ZSTD_VERSION == stored_with_zstd:
        return encoded == stored
    magic, version, _, _ = _HEADER.unpack_from(encoded)
    if (magic, version) != _HEADER.unpack_from(stored)[:2]:
        return False
    decompress = zstandard.ZstdDecompressor().decompress
    return decompress(encoded[_HEADER.size :]) == decompress(stored[_HEADER.size :])
