"""Whole-file replacement that a crash cannot tear: the one implementation of an atomic write.

A reader of ``path`` sees its old content or its new content, never a mix and never a
prefix, whatever happens to the writer (an exception, SIGKILL, a power cut when
``durable``): the new content goes to a temp file beside ``path`` under a unique name
(``mkstemp``: ``O_EXCL``, so two writers of one path never share a temp file), is
flushed and, when ``durable``, fsync'ed; it is then renamed over ``path``, and, when
``durable``, the directory is fsync'ed so the rename itself survives a crash.  On an
error the temp file is removed; a SIGKILL can leave one behind (named
``.NAME.*.tmp``), which no reader ever opens.

Not for writes inside a container's writable layer or a prefix: there a path can hold a
symlink planted by the container, and :mod:`bootseer.confined` writes through directory
descriptors (``openat2``) instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make a rename, link or unlink in directory ``path`` durable."""
    directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, durable: bool = True, temp_prefix: str | None = None,
              mode: int = 0o644, before_rename: Callable[[Path], None] | None = None) -> Iterator[BinaryIO]:
    """A binary file whose content replaces ``path`` when the block ends without an error.

    ``temp_prefix``: the temp file's name starts with it (default ``.NAME.``), for callers
    that sweep their own leftovers.  ``mode``: the new file's permissions (as given: not masked by the umask).
    ``before_rename``: called with the temp file's path once the content is written and flushed,
    before it replaces ``path``; what it raises stops the replacement (the temp file is removed).
    """
    target = Path(path)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=temp_prefix or f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            if durable:
                os.fsync(file.fileno())
        if before_rename is not None:
            before_rename(Path(temp))
        os.rename(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if durable:
        fsync_directory(target.parent)


def write_atomically(path: str | os.PathLike[str], data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (see the module docstring)."""
    with replacing(path, durable=durable, mode=mode) as file:
        file.write(data)


__all__ = ["fsync_directory", "replacing", "write_atomically"]
