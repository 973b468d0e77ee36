"""The contract between the fetch engine and a storage backend.

A backend exposes a tree of files under one root URL.  Paths are relative to that
root, use ``/`` separators and never start with ``/``; ``""`` is the root itself.
All methods block and are called from worker threads, never from the trio thread.
Range reads go through :class:`Connection` objects so that the engine can keep one
per parallel stream and throw a broken one away (a retry always uses a new one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class SourceError(Exception):
    """A backend failed; the message names the URL and what went wrong."""


class NotFound(SourceError):
    """The path does not exist at the source (ENOENT); never retried."""


class NotADirectory(SourceError):
    """A directory operation named a file (ENOTDIR); never retried."""


class PermanentError(SourceError):
    """The source refused in a way a retry cannot fix (bad credentials, bad URL)."""


class Changed(PermanentError):
    """The file at the source is no longer the version the read asked for (EIO).

    Never retried on the same version: serving it would mix bytes of two versions.
    A new stat or listing gives the new version, and reads of that succeed."""


class TransientError(SourceError):
    """The source failed in a way a retry on a new connection may fix."""


@dataclass(frozen=True)
class Entry:
    """One file or directory at the source."""

    name: str  #: last path component ("" for the root)
    size: int  #: bytes; 0 for directories
    is_dir: bool
    mtime: float  #: seconds since the epoch; 0.0 where the source keeps none
    #: Opaque validator of this file's content, as exact as the source offers (a strong
    #: ETag, inode + mtime in ns + size, HDFS's modification time + size ...); "" for
    #: directories and where the source offers nothing.  Two versions of a file never
    #: share one, so stripes and cache entries are keyed by it.
    version: str = ""


class Connection(Protocol):
    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        """Return ``length`` bytes from ``offset``, fewer only where the file ends.

        With ``version`` (an :attr:`Entry.version` from a stat or a listing), the bytes
        must come from that version of the file: a source that finds another raises
        :class:`Changed`, never returns them.  Never returns more than ``length`` bytes
        nor reads more than that into memory, whatever the server claims."""

    def close(self) -> None: ...


class RangeSource(Protocol):
    url: str  #: the root URL as given (it may hold credentials: never log it)
    display_url: str  #: the root URL without credentials or query: for logs, messages and labels

    def stat(self, path: str) -> Entry: ...

    def listdir(self, path: str) -> list[Entry]: ...

    def connect(self) -> Connection:
        """Open a new connection (a new TCP stream, client or file handle)."""

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        """Bytes of ``path`` (``version``) from ``offset`` to ``offset + length`` that this source
        returned failed their caller's verification (a checksum), which fetches them again.

        A source that can serve bytes by more than one route stops using the one that
        served these (the HTTP source's store proxy); one that reads from one place has
        nothing to learn.  Never raises."""

    def close(self) -> None: ...


@runtime_checkable
class WritableSource(Protocol):
    """A :class:`RangeSource` that can store a small file whole (the local and S3 backends): for what BootSeer
    writes beside a checkpoint, its digest lists (:mod:`bootseer.fetch.digests`)."""

    def put(self, path: str, data: bytes) -> None:
        """Replace the file at ``path`` with ``data``: a reader sees the old content or the new, never a mix.
        Raises SourceError (or OSError) if it cannot."""


@dataclass(frozen=True)
class ProxyStatus:
    """The store proxy a source reads through while it is healthy (``[store] proxy``), at one moment."""

    url: str  #: the proxy's URL without credentials
    up: bool  #: reads go through it now (else direct, until it passes its probe again)


@runtime_checkable
class ProxiedSource(Protocol):
    """A :class:`RangeSource` that may read through a store proxy (the HTTP source): what it reports of it."""

    def proxy_status(self) -> ProxyStatus | None:
        """The proxy's state, or None if this source reads direct."""
