"""The fetch engine for plain (synchronous) Python code: file objects and whole-file reads.

A :class:`Client` runs one :class:`~bootseer.fetch.engine.Engine` for one source in
a background thread of its own (``trio.run``); its methods hand work to that thread
with ``trio.from_thread`` and block until it is done, so any number of threads may
use one client.  ::

    state = torch.load(bootseer.fetch.open("s3://bucket/ckpt/model.pt"))
    tensors = safetensors.torch.load(bootseer.fetch.read_bytes("hdfs://nn/ckpt/model.safetensors"))

    with bootseer.fetch.Client("http://store/ckpt/") as client:
        for entry in client.listdir(""):
            blob = client.read_bytes(entry.name)

:meth:`Client.open` returns a seekable, buffered, read-only file object; reads go
through the engine (striped, parallel, with read-ahead while they are sequential).
:meth:`Client.read_bytes` fetches a whole file with all streams at once, straight
into the ``bytes`` object it returns.

Where a digest list is stored beside a file (``NAME.bootseer-digests``, :mod:`bootseer.fetch.digests`)
and matches it as storage reports it now, both verify every byte they return against it: a chunk that
does not match is fetched again once, then the read fails with FetchError (EIO).  :func:`write_digests`
writes such a list (a checkpoint's save hook); ``bootseer ckpt digest`` is the same from a shell.
"""

from __future__ import annotations

import functools
import io
import threading
from typing import Any

import trio

from bootseer.fetch.bytes_builder import BytesBuilder
from bootseer.fetch.digests import DEFAULT_CHUNK_SIZE, DigestList, build, sibling_url
from bootseer.fetch.engine import Engine, EngineConfig, display_url, open_engine
from bootseer.fetch.reader import Reader
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.source import Entry, RangeSource, SourceError, WritableSource
from bootseer.fetch.sources import open_source, redact_url
from bootseer.log import get_logger
from bootseer.profile import traced

log = get_logger(__name__)

# Reads smaller than this fetch this much into the file object's own buffer, so that
# pickle's many tiny reads do not each cross into the engine's thread.
SMALL_READ_BUFFER = 256 * 1024
START_TIMEOUT_SECONDS = 60.0


class Client:
    """One source, one engine, in a background thread; a context manager.

    ``url_or_source`` is a source URL (opened with
    :func:`~bootseer.fetch.sources.open_source` and ``source_options``, and closed with
    the client) or a RangeSource the caller owns.  Paths are relative to it; ``""``
    is the URL itself, which may name a single file.

    ``digests``: verify reads of files that have a digest list beside them (on by default).  The
    list of the URL itself (path ``""``) is looked up beside it only where the client opened the
    URL (a source the caller owns has no name beside it).
    """

    def __init__(self, url_or_source: str | RangeSource, config: EngineConfig | None = None, *,
                 digests: bool = True, **source_options: Any):  # fmt: skip
        self.digests = digests
        self._digest_url: str | None = None  # where the list of path "" lies, for a URL the client opened
        self._source_options = source_options
        if isinstance(url_or_source, str):
            self.source: RangeSource = open_source(url_or_source, **source_options)
            self._owns_source = True
            self._digest_url = sibling_url(url_or_source)
        else:
            if source_options:
                raise ValueError(f"source options {sorted(source_options)} need a URL, not an opened source")
            self.source = url_or_source
            self._owns_source = False
        self.config = config or EngineConfig()
        self.url = display_url(self.source)  #: the source's URL without credentials or query
        self._engine: Engine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._thread_main, name=f"bootseer-fetch {self.url}", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_SECONDS):
            raise RuntimeError(f"{self.url}: the fetch engine did not start in {START_TIMEOUT_SECONDS:.0f}s")
        if self._error is not None:
            self._close_source()
            raise self._error

    def __repr__(self) -> str:
        return f"<Client {self.url}{' closed' if self._closed else ''}>"

    def _thread_main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the constructor, or logged if it ends a running client
            if not self._started.is_set():
                self._error = exc
            else:
                log.error("fetch client thread failed", url=self.url, error=repr(exc))
        finally:
            self._started.set()

    async def _serve(self) -> None:
        async with open_engine(self.source, self.config) as engine:
            self._engine = engine
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._started.set()
            await self._stop.wait()

    # -- calling into the engine's thread -------------------------------------------------

    def _call(self, async_function: Any, *args: Any) -> Any:
        if self._closed:
            raise ValueError(f"{self!r}: the client is closed")
        try:
            return trio.from_thread.run(async_function, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise FetchError(f"{self.url}: the fetch client stopped") from None

    def _call_sync(self, function: Any, *args: Any) -> Any:
        if self._closed:
            raise ValueError(f"{self!r}: the client is closed")
        if threading.current_thread() is self._thread:
            # A file object garbage-collected in the engine's own thread closes itself here.
            return function(*args)
        try:
            return trio.from_thread.run_sync(function, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise FetchError(f"{self.url}: the fetch client stopped") from None

    # -- the API ---------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine (for its ``stats``); use it only from the client's thread."""
        assert self._engine is not None
        return self._engine

    def stat(self, path: str) -> Entry:
        return self._call(self.engine.stat, path)

    def listdir(self, path: str) -> list[Entry]:
        return self._call(self.engine.listdir, path)

    def open(self, path: str) -> RemoteFile:
        """A read-only, seekable, buffered file object of ``path``.

        It reads the version of the file that ``open`` found: if the file changes at
        the source meanwhile, reads fail with FetchError (EIO) rather than mix versions.
        """
        entry = self.stat(path)
        if entry.is_dir:
            raise IsADirectoryError(f"{self.url}: {path or '.'} is a directory")
        digests = self.find_digests(path, entry)
        reader = self._call_sync(self.engine.open, path, entry.size, entry.mtime, entry.version, digests)
        return RemoteFile(self, reader, name=path or self.url)

    def find_digests(self, path: str, entry: Entry) -> DigestList | None:
        """The digest list reads of ``path`` (``entry``: its stat now) are verified against, or None: none
        is stored beside it, the client does not verify, or the list is not of this version (see
        :meth:`Engine.find_digests <bootseer.fetch.engine.Engine.find_digests>`)."""
        if not self.digests:
            return None
        if path:
            return self._call(self.engine.find_digests, path, entry)
        if self._digest_url is None:
            return None
        try:
            source = open_source(self._digest_url, **self._source_options)
        except (ValueError, SourceError) as exc:
            log.debug("no digest list beside the URL", url=self.url, error=str(exc))
            return None
        try:
            return self._call(functools.partial(self.engine.find_digests, path, entry, source=source, list_path=""))
        finally:
            source.close()

    def read_bytes(self, path: str) -> bytes:
        """The whole of ``path``, fetched with all streams in parallel.

        All of it is one version (the one a stat finds now): a file that changes
        while it is read fails with FetchError (EIO), never comes back mixed.
        """
        entry = self.stat(path)
        if entry.is_dir:
            raise IsADirectoryError(f"{self.url}: {path or '.'} is a directory")
        digests = self.find_digests(path, entry)
        builder = BytesBuilder(entry.size)
        try:
            self._call(self._read_whole, path, entry, digests, builder.view)
        except BaseException:
            builder.view.release()
            raise
        return builder.result()

    async def _read_whole(self, path: str, entry: Entry, digests: DigestList | None, target: memoryview) -> None:
        reader = self.engine.open(path, entry.size, entry.mtime, entry.version, digests)
        try:
            await reader.read_into(0, target)
        finally:
            reader.close()

    def close(self) -> None:
        """Stop the engine and its thread (reads in progress fail), and close an owned source."""
        if self._closed:
            return
        try:
            if self._stop is not None:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        self._thread.join()
        self._closed = True
        self._close_source()

    def _close_source(self) -> None:
        if self._owns_source:
            self.source.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class RemoteFile(io.BufferedIOBase):
    """A read-only, seekable file object over an engine :class:`Reader`.

    Thread-safe.  Small reads are served from a buffer of ``SMALL_READ_BUFFER`` bytes;
    large ones and ``readinto`` go straight to the engine.
    """

    def __init__(self, client: Client, reader: Reader, *, name: str, owns_client: bool = False) -> None:
        super().__init__()
        self.name = name
        self.mode = "rb"
        self._client = client
        self._reader = reader
        self._size = reader.size
        self._owns_client = owns_client
        self.version = reader.file.version  #: the version of the file it reads (the source's validator)
        self._position = 0
        self._buffer = b""
        self._buffer_start = 0
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<RemoteFile {self._client.url} {self.name!r}{' closed' if self.closed else ''}>"

    @property
    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        self._check_open()
        return True

    def seekable(self) -> bool:
        self._check_open()
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        self._check_open()
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        with self._lock:
            self._check_open()
            if whence == io.SEEK_SET:
                position = offset
            elif whence == io.SEEK_CUR:
                position = self._position + offset
            elif whence == io.SEEK_END:
                position = self._size + offset
            else:
                raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
            if position < 0:
                raise OSError(22, f"negative seek position {position}")
            self._position = position
            return position

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file.")

    def _buffered(self, size: int) -> memoryview:
        """What the buffer holds from the current position on, at most ``size`` bytes."""
        start = self._position - self._buffer_start
        if 0 <= start < len(self._buffer):
            return memoryview(self._buffer)[start : start + size]
        return memoryview(b"")

    def _fill(self) -> None:
        self._buffer = self._client._call(self._reader.read, self._position, SMALL_READ_BUFFER)
        self._buffer_start = self._position

    def _small_read(self, size: int) -> memoryview | None:
        """A read under SMALL_READ_BUFFER served from the file's own buffer (refilled once
        if need be), advancing the position; None when the read is too large for that or
        the buffer cannot hold it (the end of the file lies beyond what one fill brings)."""
        if size >= SMALL_READ_BUFFER:
            return None
        piece = self._buffered(size)
        if len(piece) < size:
            self._fill()
            piece = self._buffered(size)
        if len(piece) != size:
            return None
        self._position += size
        return piece

    def read(self, size: int | None = -1) -> bytes:
        with self._lock:
            self._check_open()
            remaining = max(0, self._size - self._position)
            size = remaining if size is None or size < 0 else min(size, remaining)
            if size == 0:
                return b""
            piece = self._small_read(size)
            if piece is not None:
                return bytes(piece)
            data = self._client._call(self._reader.read, self._position, size)
            self._position += len(data)
            return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        with self._lock, memoryview(buffer) as view, view.cast("B") as target:
            self._check_open()
            size = min(len(target), max(0, self._size - self._position))
            if size == 0:
                return 0
            piece = self._small_read(size)
            if piece is not None:
                target[:size] = piece
                return size
            count = self._client._call(self._reader.read_into, self._position, target[:size])
            self._position += count
            return count

    def readinto1(self, buffer: Any) -> int:
        return self.readinto(buffer)

    def peek(self, size: int = 0) -> bytes:
        """Bytes from the current position without moving it (at least one unless at the end)."""
        with self._lock:
            self._check_open()
            if self._position >= self._size:
                return b""
            piece = self._buffered(SMALL_READ_BUFFER)
            if not piece:
                self._fill()
                piece = self._buffered(SMALL_READ_BUFFER)
            return bytes(piece)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            try:
                if not self._client._closed:
                    self._client._call_sync(self._reader.close)
            finally:
                self._buffer = b""
                super().close()
                if self._owns_client:
                    self._client.close()


def open(url: str, *, config: EngineConfig | None = None, **source_options: Any) -> RemoteFile:
    """A file object of the file at ``url``; closing it stops the engine it uses."""
    client = Client(url, config, **source_options)
    try:
        file = client.open("")
    except BaseException:
        client.close()
        raise
    file._owns_client = True
    return file


@traced("checkpoint.read", phase="checkpoint", attrs=lambda data: {"bytes": len(data)})  # start-up profiler
def read_bytes(url: str, *, config: EngineConfig | None = None, **source_options: Any) -> bytes:
    """The whole file at ``url``, fetched with all streams in parallel."""
    with Client(url, config, **source_options) as client:
        return client.read_bytes("")


def write_digests(url: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE, config: EngineConfig | None = None,
                  **source_options: Any) -> DigestList:
    """Hash the file at ``url`` through the fetch engine and store its digest list beside it; the list.

    For a save hook: call it once the checkpoint file is complete.  The list records the
    version that was read (a file that changes while it is hashed fails with FetchError).  It
    is written where the source can store a file (:class:`~bootseer.fetch.source.WritableSource`:
    local and NFS paths, atomically; S3); ValueError for a URL with a query and for the other
    sources (HTTP, HDFS), which BootSeer only reads.
    """
    target_url = sibling_url(url)
    if target_url is None:
        raise ValueError(f"{redact_url(url)}: a URL with a query or fragment has no name beside it for a digest list")
    target = open_source(target_url, **source_options)
    try:
        if not isinstance(target, WritableSource):
            raise ValueError(f"{display_url(target)}: BootSeer cannot write to {type(target).__name__} sources "
                             "(digest lists are written to local/NFS paths and S3)")  # fmt: skip
        with Client(url, config, digests=False, **source_options) as client, client.open("") as file:
            digests = build(file.readinto, file.size, file.version, chunk_size)
        target.put("", digests.encode())
    finally:
        target.close()
    log.info("digest list written", url=display_url(target), size=digests.size, chunks=len(digests.digests),
             chunk_size=digests.chunk_size)  # fmt: skip
    return digests
