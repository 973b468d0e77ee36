"""The contract between the fetch engine and a storage backend.

A backend exposes a tree of files under one root URL.  Paths are relative to that
root, use ``/`` separators and never start with ``/``; ``""`` is the root itself.
All methods block and are called from worker threads, never from the trio thread.
Range reads go through :class:`Connection` objects so that the engine can keep one
per parallel stream and throw a broken one away (a retry always uses a new one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SourceError(Exception):
    """A backend failed; the message names the URL and what went wrong."""


class NotFound(SourceError):
    """The path does not exist at the source (ENOENT); never retried."""


class NotADirectory(SourceError):
    """A directory operation named a file (ENOTDIR); never retried."""


class PermanentError(SourceError):
    """The source refused in a way a retry cannot fix (bad credentials, bad URL)."""


class TransientError(SourceError):
    """The source failed in a way a retry on a new connection may fix."""


@dataclass(frozen=True)
class Entry:
    """One file or directory at the source."""

    name: str  #: last path component ("" for the root)
    size: int  #: bytes; 0 for directories
    is_dir: bool
    mtime: float  #: seconds since the epoch; 0.0 where the source keeps none


class Connection(Protocol):
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes from ``offset``, fewer only where the file ends."""

    def close(self) -> None: ...


class RangeSource(Protocol):
    url: str  #: the root URL, for messages and metrics labels

    def stat(self, path: str) -> Entry: ...

    def listdir(self, path: str) -> list[Entry]: ...

    def connect(self) -> Connection:
        """Open a new connection (a new TCP stream, client or file handle)."""

    def close(self) -> None: ...
