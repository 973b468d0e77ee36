"""Sizes as people write them (``8M``, ``16GiB``, ``512k``), for every command line and config file.

A module of its own, light to import: the daemon's config, ``bootseer deps`` and the
layer server parse sizes without loading the checkpoint mount (trio, FUSE, the fetch engine).
"""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes from ``8M``, ``16MiB``, ``1G``, ``512k`` or ``4096``.

    ``K``, ``M``, ``G``, ``T`` and their ``KiB`` forms are powers of 1024; ``KB``,
    ``MB``, ``GB``, ``TB`` are powers of 1000.
    """
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 8M, 16MiB, 1G, 4096)")
    number, prefix, suffix = match.group(1), match.group(2).lower(), match.group(3).lower()
    if suffix == "i" or (suffix and not prefix and suffix != "b"):
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 8M, 16MiB, 1G, 4096)")
    base = 1000 if suffix == "b" and prefix else 1024
    value = float(number) * base ** _POWERS[prefix]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)
