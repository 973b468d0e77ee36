"""What the fetch engine fetches and keeps: versions of files, caller extents, and stripes.

* :class:`Priority`: who wants a stripe (a demand read, a read-ahead, a prefetch); lower first.
* :class:`FileVersion`: one version of one file, what its stripes (in memory and on disk) belong to.
* :class:`Extent`: a byte range a caller names by its own key (a block's digest and place); equal
  keys share one fetch and one buffer.
* :class:`Stripe` and :class:`StripeState`: one unit of work of the engine, a stripe of a file or
  one extent, with who holds it, its state (queued, backing off, fetching, done, failed, gone)
  and its retry clock; :class:`StripeKey` and :class:`ExtentKey` name them in the engine's table.
* :class:`FetchError`: what a read gets (EIO) when a stripe cannot be fetched.

Plain data and its invariants only: the engine (:mod:`bootseer.fetch.engine`, with its queue and
workers: :mod:`bootseer.fetch.queue`, :mod:`bootseer.fetch.workers`) moves stripes between
states, the :class:`~bootseer.fetch.reader.Reader` holds them for an open file.
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable

import trio

if TYPE_CHECKING:
    from bootseer.fetch.digests import DigestList


class Priority(enum.IntEnum):
    """Who wants a stripe; a lower value is served first."""

    DEMAND = 0  #: a reader is waiting for it now
    READAHEAD = 1  #: a sequential reader will want it soon
    PREFETCH = 2  #: someone predicts it will be read (hot blocks)


class FetchError(OSError):
    """A stripe could not be fetched (errno EIO); the message says which and why.

    ``FetchError("message")`` sets errno to EIO; the cause is chained as
    ``__cause__``.
    """

    def __init__(self, *args: Any) -> None:
        if len(args) == 1:
            args = (errno.EIO, args[0])
        super().__init__(*args)


class StripeState(enum.Enum):
    QUEUED = "queued"  # in the priority queue
    BACKOFF = "backoff"  # failed; waiting to be queued again
    FETCHING = "fetching"  # a worker is fetching it
    DONE = "done"  # its bytes are buffered
    FAILED = "failed"  # failed for good; ``error`` says why
    GONE = "gone"  # cancelled, dropped or evicted


@dataclass(frozen=True)
class FileVersion:
    """One version of one file: what its stripes, in memory and on disk, belong to."""

    path: str
    size: int
    version: str = ""  #: the source's :attr:`Entry.version`; "" where it gives none
    #: Where ``version`` is "": the mtime (from a stat or listing) that keys the disk
    #: cache, None if unknown.  Unused (None) where there is a version.
    mtime: float | None = None
    #: The digest list its stripes are verified against before anyone gets them (None: not verified).  Part of
    #: the key: readers with and without a list never share a stripe.
    digests: DigestList | None = None

    @classmethod
    def of(
        cls, path: str, size: int, version: str = "", mtime: float | None = None, digests: DigestList | None = None
    ) -> FileVersion:
        return cls(path, size, version, None if version else mtime, digests)


StripeKey = tuple[FileVersion, int]  # (file version, stripe index)


@dataclass(frozen=True)
class Extent:
    """A byte range of an object at the engine's source, named by its caller.

    Equal keys are the caller's promise of equal bytes: they share one fetch and
    one buffer, so a key must always name the same ``path``, ``offset``, ``length``
    and ``version`` (ValueError otherwise).
    """

    key: Hashable  #: the caller's identity of these bytes (a block's digest and place)
    path: str  #: the object's path at the source
    offset: int
    length: int
    version: str = ""  #: the :attr:`Entry.version` the bytes must come from; "" for any

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise TypeError(f"extent path must be a str, not {self.path!r}")
        if not isinstance(self.offset, int) or not isinstance(self.length, int) or self.offset < 0 or self.length < 0:
            raise ValueError(f"invalid extent {self.key!r}: offset={self.offset!r} length={self.length!r}")
        hash(self.key)  # an unhashable key fails here, with the caller's frame in the traceback


@dataclass(frozen=True)
class ExtentKey:
    """An extent's key in the engine's table, apart from every stripe key."""

    key: Hashable


class Stripe:
    """What workers fetch: one stripe of one version of a file, or one caller :class:`Extent`, and who wants it.

    An extent's ``file`` has size -1 (unknown: the caller names a range, not a
    file) and its ``index`` is -1.
    """

    __slots__ = (
        "key", "file", "path", "file_size", "index", "offset", "length", "state", "data", "error",
        "done", "holders", "waiters", "queued_priority", "last_used", "first_attempt", "attempts",
        "extent", "indexed", "mismatches",
    )  # fmt: skip

    def __init__(self, file: FileVersion, index: int, stripe_size: int, extent: Extent | None = None) -> None:
        self.extent = extent
        self.indexed = False  # in the engine's table of queued extents by object
        self.mismatches = 0  # answers that failed the file's digest list
        if extent is None:
            self.key: StripeKey | ExtentKey = (file, index)
            self.offset = index * stripe_size
            self.length = min(stripe_size, file.size - self.offset)
        else:
            self.key = ExtentKey(extent.key)
            self.offset = extent.offset
            self.length = extent.length
        self.file = file
        self.path = file.path
        self.file_size = file.size
        self.index = index
        self.state = StripeState.QUEUED
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.done = trio.Event()  # set on DONE or FAILED
        self.holders: dict[object, Priority] = {}
        self.waiters = 0  # tasks blocked on ``done``; protects a DONE stripe from eviction
        self.queued_priority = Priority.PREFETCH
        self.last_used = 0
        self.first_attempt: float | None = None  # when the retry clock started (trio time)
        self.attempts = 0

    def priority(self) -> Priority | None:
        """The most urgent hold, or None when nobody holds the stripe."""
        return min(self.holders.values()) if self.holders else None

    def wanted(self) -> bool:
        return bool(self.holders) or self.waiters > 0

    def describe(self) -> str:
        what = f"stripe {self.index}" if self.extent is None else f"extent {self.extent.key!r}"
        return f"{self.path or '.'} bytes {self.offset}-{self.offset + self.length - 1} ({what})"

    def object(self) -> tuple[str, str]:
        """The object version an extent lies in: extents of one may share a range request."""
        return (self.path, self.file.version)


def span(stripes: list[Stripe]) -> int:
    """Bytes from the first of ``stripes`` (in offset order) to the end of the last."""
    return stripes[-1].offset + stripes[-1].length - stripes[0].offset


def check_same_place(known: Extent, extent: Extent) -> None:
    """ValueError unless two extents of one key name the same bytes."""
    if (known.path, known.offset, known.length, known.version) != (extent.path, extent.offset, extent.length, extent.version):
        raise ValueError(
            f"extent key {extent.key!r} names two places: {known.path!r} {known.offset}+{known.length} "
            f"(version {known.version!r}) and {extent.path!r} {extent.offset}+{extent.length} (version {extent.version!r})"
        )
