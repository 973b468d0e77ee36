"""Storage that holds a wrong byte under a digest list that still claims the file: for tests of verified reads.

A local file's version (``inode:mtime_ns:ctime_ns:size``) changes with any write, so a byte changed in
place would make its list stale (ignored), not wrong.  :func:`corrupt_in_place` changes the byte and
re-stamps the list with the version storage reports now, keeping the digests of the right content:
only the digests can tell, as with bit rot under an unchanged ETag.
"""

from __future__ import annotations

import os
from pathlib import Path

from bootseer.fetch.digests import SUFFIX, DigestList
from bootseer.fetch.sources.local import file_version


def corrupt_in_place(path: Path, offset: int) -> None:
    """Flip one bit of ``path`` at ``offset`` (same size) and re-stamp its digest list with the file's new version."""
    listed = path.parent / (path.name + SUFFIX)
    stale = DigestList.decode(listed.read_bytes())
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x01]))
    restamped = DigestList(stale.size, file_version(os.stat(path)), stale.chunk_size, stale.digests)
    listed.write_bytes(restamped.encode())
