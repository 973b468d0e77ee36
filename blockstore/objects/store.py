"""Reading and writing a block store: one interface over file://, s3://, hdfs:// and http(s)://.

Writing (the converter): :func:`open_store_writer` gives a :class:`StoreWriter` for a
local directory (``file:///dir`` or a plain path), S3 (``s3://bucket/prefix``) or HDFS
(``hdfs://namenode[:port]/path``).  Every :meth:`StoreWriter.put` is atomic -- a reader
sees the whole object or nothing -- through a temp name and a rename (file, HDFS) or
S3's own all-or-nothing PUT and multipart completion.  :meth:`StoreWriter.put_if_absent`
is the first-writer-wins put of objects named by what they are for rather than by their
bytes (hot lists, deps records): atomic on each backend (see its docstring).  The S3 and HDFS writers reuse
the fetch sources' URL parsing and client setup (:class:`~bootseer.fetch.sources.s3.S3Source`,
:class:`~bootseer.fetch.sources.hdfs.HdfsSource`), so both sides of a store agree on
what a URL means; credentials come from boto3's standard chain (or the options) and
never appear in a message: only :func:`~bootseer.fetch.sources.redact_url` forms do.
An ``http(s)://`` store is read-only (nginx, a CDN or a Dragonfly peer in front of a
store directory or bucket); write to what stands behind it.

Reading (nodes): :class:`StoreReader` reads chain records and indexes through a
``bootseer.fetch`` :class:`~bootseer.fetch.engine.Engine` rooted at the store URL, with
the engine's ``stat`` and :class:`~bootseer.fetch.reader.Reader` (pinned to the
version it stat'ed), so retries, timeouts, EIO, version checks and metrics are the
engine's, and blocks are fetched by the same engine (``fetch_extents``).  A record or
index whose bytes fail verification is reported to the engine as corrupt
(:meth:`~bootseer.fetch.engine.Engine.corrupt`: a store proxy that served it is set
aside) and read once more; only a second failure calls the object corrupt.

The HDFS writer is real client code (hdfs-native); no HDFS server can run in the
test environment, so it is tested for URL handling, a namenode that is not there and
its calls against a local stand-in for the client (see docs/FORMAT.md).
"""

from __future__ import annotations

import abc
import functools
import os
import shutil
import uuid
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar
from urllib.parse import unquote, urlsplit

import trio

from bootseer.blockstore.objects.block_table import LayerBlockTable, block_table_bound
from bootseer.blockstore.objects.format import (
    MAX_CHAIN_RECORD_BYTES,
    MAX_IMAGE_TABLE_BYTES,
    ChainRecord,
    FormatError,
    LayerImage,
    LayerIndex,
    block_table_object,
    chain_object,
    image_object,
    index_limits,
    index_object,
    sealed_size_bound,
)
from bootseer.fetch.engine import Engine, EngineConfig, open_engine
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.source import Entry, NotADirectory, NotFound, SourceError
from bootseer.fetch.sources import check_range, open_source, redact_url, split_path
from bootseer.atomic import fsync_directory
from bootseer.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

#: An encoded index larger than this is refused before it is read.
MAX_INDEX_OBJECT_BYTES = 1 << 30

_COPY_CHUNK = 8 << 20


class StoreError(OSError):
    """A store operation failed; the message names the store (no credentials) and the object."""


class ReadOnlyStore(StoreError):
    """The URL names a store that cannot be written (http(s)://)."""


def _check_name(name: str) -> list[str]:
    try:
        parts = split_path(name)
    except SourceError as exc:
        raise ValueError(str(exc)) from None
    if not parts:
        raise ValueError("an object name must not be empty")
    return parts


class StoreWriter(abc.ABC):
    """Objects of one store, by name (``v1/packs/<hex>``...), for the converter.

    Counters ``puts`` and ``put_bytes`` say what this writer uploaded (idempotency
    checks and the converter's summary).
    """

    display_url: str

    def __init__(self) -> None:
        self.puts = 0
        self.put_bytes = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.display_url}>"

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    @abc.abstractmethod
    def size(self, name: str) -> int | None:
        """The object's size in bytes, None if it does not exist; StoreError if the store fails."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes | None:
        """The object's bytes, None if it does not exist; StoreError if the store fails."""

    @abc.abstractmethod
    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset + length)`` of the object, fewer only where it ends; None if it does not exist.

        What the converter checks blocks of other layers' packs with, before it
        references them (a range of a pack, never the whole pack).  StoreError if the
        store fails.
        """

    def put(self, name: str, data: bytes | Path) -> None:
        """Store ``data`` (bytes, or a local file's contents) as ``name``, atomically."""
        _check_name(name)
        size = len(data) if isinstance(data, bytes) else Path(data).stat().st_size
        self._put(name, data)
        self.puts += 1
        self.put_bytes += size
        log.debug("stored object", store=self.display_url, name=name, size=size)

    @abc.abstractmethod
    def _put(self, name: str, data: bytes | Path) -> None: ...

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Store ``data`` as ``name`` unless the name exists; True if this call stored it.

        First writer wins: of several writers racing for one name (on one node or many),
        exactly one gets True and its bytes stay; the others get False and change
        nothing.  The object appears whole or not at all.  How each backend makes that
        atomic:

        * **file** (a local or NFS directory): written whole under a temp name (fsync),
          then ``link(2)``-ed to the name, which fails with EEXIST if it exists.
        * **S3**: ``PutObject`` with ``If-None-Match: *`` (S3's conditional write: 412
          for every writer but the first).  A server that does not implement it (older
          S3-compatible stores answer 501 NotImplemented) gets check-then-put: a HEAD,
          then a plain PUT, logged.  Two writers may then both see the name free; each
          PUT is atomic, so readers see one whole object (the last one), never a mix.
        * **HDFS**: written under a temp name, then renamed without overwrite (the
          namenode refuses a rename onto an existing name).

        StoreError when the store fails.  Blocking (network and disk I/O).
        """
        _check_name(name)
        stored = self._put_if_absent(name, data)
        if stored:
            self.puts += 1
            self.put_bytes += len(data)
            log.debug("stored object", store=self.display_url, name=name, size=len(data))
        return stored

    @abc.abstractmethod
    def _put_if_absent(self, name: str, data: bytes) -> bool: ...

    @abc.abstractmethod
    def remove(self, name: str) -> bool:
        """Delete ``name``; True if it existed, False if it did not.  StoreError when the store fails."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names of the objects directly under directory ``prefix`` (full names, sorted); [] if none."""

    def close(self) -> None:
        pass

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _link(source: str | os.PathLike[str], temp: Path) -> bool:
    """Hard-link ``source`` at ``temp`` if both are on one filesystem (the caller's file is then shared, not copied)."""
    try:
        os.link(source, temp)
    except OSError:
        return False  # EXDEV across filesystems, EPERM where links are refused: copy instead
    return True


class FileStoreWriter(StoreWriter):
    """A store in a local (or NFS) directory: temp file, fsync, rename, fsync of the directory.

    A file put from the same filesystem is hard-linked into place rather than copied,
    so the caller must not change it afterwards (the converter's spooled packs are
    deleted, never rewritten).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)
        self.display_url = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.root}: cannot create the store directory: {exc.strerror}") from None

    def path(self, name: str) -> Path:
        return self.root.joinpath(*_check_name(name))

    def size(self, name: str) -> int | None:
        try:
            return self.path(name).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.root}: stat {name}: {exc.strerror}") from None

    def get(self, name: str) -> bytes | None:
        try:
            return self.path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.root}: read {name}: {exc.strerror}") from None

    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        check_range(offset, length)
        try:
            fd = os.open(self.path(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.root}: read {name}: {exc.strerror}") from None
        try:
            pieces, done = [], 0
            while done < length:
                piece = os.pread(fd, length - done, offset + done)
                if not piece:
                    break  # the object ends here
                pieces.append(piece)
                done += len(piece)
            return b"".join(pieces)
        except OSError as exc:
            raise StoreError(f"{self.root}: read {name}: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _put(self, name: str, data: bytes | Path) -> None:
        with self._temp_file(name, data) as (temp, target):
            os.replace(temp, target)
            fsync_directory(target.parent)

    def _put_if_absent(self, name: str, data: bytes) -> bool:
        with self._temp_file(name, data) as (temp, target):
            try:
                os.link(temp, target)  # EEXIST for every writer but the first; the temp name goes below
            except FileExistsError:
                return False
            fsync_directory(target.parent)
            return True

    @contextmanager
    def _temp_file(self, name: str, data: bytes | Path) -> Iterator[tuple[Path, Path]]:
        """``data`` written whole and fsync'ed under a temp name beside ``name``'s path: (temp, target).

        The block moves it into place; the temp name is removed afterwards, whatever
        happened, and an OSError comes out as a StoreError naming the object.
        """
        target = self.path(name)
        temp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not isinstance(data, bytes) and _link(data, temp):
                with open(temp, "rb") as linked:  # a spooled file on the same filesystem: no copy
                    os.fsync(linked.fileno())
            else:
                with open(temp, "wb") as out:
                    if isinstance(data, bytes):
                        out.write(data)
                    else:
                        with open(data, "rb") as source:
                            shutil.copyfileobj(source, out, _COPY_CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
            yield temp, target
        except OSError as exc:
            raise StoreError(f"{self.root}: write {name}: {exc.strerror or exc}") from None
        finally:
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory itself could not be made: there is no temp file

    def remove(self, name: str) -> bool:
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"{self.root}: remove {name}: {exc.strerror}") from None
        return True

    def list(self, prefix: str) -> list[str]:
        directory = self.path(prefix)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"{self.root}: list {prefix}: {exc.strerror}") from None
        return sorted(f"{prefix}/{n}" for n in names if not n.startswith(".") and (directory / n).is_file())


class S3StoreWriter(StoreWriter):
    """A store under ``s3://bucket/prefix``, with the S3 fetch source's client setup.

    ``endpoint_url`` (else ``AWS_ENDPOINT_URL`` or the profile's ``endpoint_url``, which
    boto3 reads itself), ``region``, ``access_key_id``/``secret_access_key``/``session_token``
    (else boto3's credential chain), ``profile``, ``addressing_style``, ``verify``,
    ``ca_file``, timeouts: as :class:`~bootseer.fetch.sources.s3.S3Source` takes them.
    Files go up with boto3's managed transfer (multipart above 8 MiB): the object
    appears when the upload completes, whole.
    """

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__()
        from bootseer.fetch.sources.s3 import S3Source, s3_error  # boto3 only when S3 is used

        self._s3_error = s3_error
        self.source = S3Source(url, **options)
        self.display_url = self.source.display_url
        self.bucket = self.source.bucket
        import botocore.config

        s3_options = {"addressing_style": options["addressing_style"]} if options.get("addressing_style") else {}
        config = botocore.config.Config(
            connect_timeout=options.get("connect_timeout", 10.0),
            read_timeout=options.get("read_timeout", 60.0),
            retries={"mode": "standard", "max_attempts": 5},
            s3=s3_options,
        )
        self.client = self.source.new_client(config)

    def _error(self, what: str, name: str, exc: Exception) -> StoreError:
        return StoreError(f"{what}: {self._s3_error(self.source.where(name), exc)}")

    def _missing(self, exc: Exception) -> bool:
        """Whether ``exc`` says the object is not there (a missing bucket is a broken store, not a missing object)."""
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        return code != "NoSuchBucket" and isinstance(self._s3_error("", exc), NotFound)

    def size(self, name: str) -> int | None:
        _check_name(name)
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.source.key(name))
        except Exception as exc:
            if self._missing(exc):
                return None
            raise self._error("stat", name, exc) from None
        return int(head["ContentLength"])

    def get(self, name: str) -> bytes | None:
        _check_name(name)
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.source.key(name))
            return response["Body"].read()
        except Exception as exc:
            if self._missing(exc):
                return None
            raise self._error("read", name, exc) from None

    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        _check_name(name)
        check_range(offset, length)
        if length == 0:
            return b"" if self.exists(name) else None
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.source.key(name),
                                              Range=f"bytes={offset}-{offset + length - 1}")  # fmt: skip
            return response["Body"].read()
        except Exception as exc:
            if self._missing(exc):
                return None
            if getattr(exc, "response", {}).get("Error", {}).get("Code") == "InvalidRange":
                return b""  # the range starts past the object's end
            raise self._error("read", name, exc) from None

    def _put(self, name: str, data: bytes | Path) -> None:
        key = self.source.key(name)
        try:
            if isinstance(data, bytes):
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
            else:
                self.client.upload_file(str(data), self.bucket, key)
        except Exception as exc:
            cause = exc.__cause__ if exc.__cause__ is not None and type(exc).__name__ == "S3UploadFailedError" else exc
            raise self._error("write", name, cause if isinstance(cause, Exception) else exc) from None

    def _put_if_absent(self, name: str, data: bytes) -> bool:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.source.key(name), Body=data, IfNoneMatch="*")
        except Exception as exc:
            response = getattr(exc, "response", {}) or {}
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False  # taken (412), or another conditional write of it in flight (409)
            if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status == 501:
                log.warning("the S3 store does not do conditional writes; check-then-put instead "
                            "(two writers at once may both write: the last whole object stays)",
                            store=self.display_url, name=name, code=code)  # fmt: skip
                if self.exists(name):
                    return False
                self._put(name, data)
                return True
            raise self._error("write", name, exc) from None
        return True

    def remove(self, name: str) -> bool:
        if not self.exists(name):  # S3's DELETE answers 204 either way
            return False
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.source.key(name))
        except Exception as exc:
            raise self._error("remove", name, exc) from None
        return True

    def list(self, prefix: str) -> list[str]:
        _check_name(prefix)
        key_prefix = self.source.key(prefix) + "/"
        root = self.source.key("")
        names = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=key_prefix, Delimiter="/"):
                for item in page.get("Contents", []):
                    rest = item["Key"][len(key_prefix) :]
                    if rest and "/" not in rest:
                        full = item["Key"][len(root) + 1 :] if root else item["Key"]
                        names.append(full)
        except Exception as exc:
            raise self._error("list", prefix, exc) from None
        return sorted(names)

    def close(self) -> None:
        self.client.close()
        self.source.close()


class HdfsStoreWriter(StoreWriter):
    """A store under ``hdfs://namenode[:port]/path`` through hdfs-native (the HDFS fetch source's client).

    A put writes ``.NAME.tmp-<random>`` beside the object and renames it over the
    name (HDFS renames are atomic in the namenode).
    """

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__()
        from bootseer.fetch.sources.hdfs import HdfsSource, hdfs_error

        self._hdfs_error = hdfs_error
        self.source = HdfsSource(url, **options)
        self.display_url = self.source.display_url
        self.client = self.source.client

    def _error(self, what: str, name: str, exc: BaseException) -> StoreError:
        return StoreError(f"{what}: {self._hdfs_error(self.source.where(name), exc)}")

    def size(self, name: str) -> int | None:
        _check_name(name)
        try:
            return int(self.client.get_file_info(self.source.hdfs_path(name)).length)
        except Exception as exc:
            if isinstance(self._hdfs_error("", exc), NotFound):
                return None
            raise self._error("stat", name, exc) from None

    def get(self, name: str) -> bytes | None:
        _check_name(name)
        try:
            return bytes(self.client.read(self.source.hdfs_path(name)).read())
        except Exception as exc:
            if isinstance(self._hdfs_error("", exc), NotFound):
                return None
            raise self._error("read", name, exc) from None

    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        _check_name(name)
        check_range(offset, length)
        try:
            reader = self.client.read(self.source.hdfs_path(name))
            try:
                length = max(0, min(length, int(reader.size()) - offset))
                return bytes(reader.read_range(offset, length)) if length else b""
            finally:
                reader.close()
        except Exception as exc:
            if isinstance(self._hdfs_error("", exc), NotFound):
                return None
            raise self._error("read", name, exc) from None

    def _put(self, name: str, data: bytes | Path) -> None:
        self._write_and_rename(name, data, overwrite=True)

    def _put_if_absent(self, name: str, data: bytes) -> bool:
        return self._write_and_rename(name, data, overwrite=False)

    def _write_and_rename(self, name: str, data: bytes | Path, *, overwrite: bool) -> bool:
        """Write ``.NAME.tmp-<random>`` beside ``name`` and rename it onto the name.

        Without ``overwrite``, a name that exists makes the rename fail: False (the
        temp file is removed).  True once the object is in place.
        """
        target = self.source.hdfs_path(name)
        parent, _, base = target.rpartition("/")
        temp = f"{parent}/.{base}.tmp-{uuid.uuid4().hex[:12]}"
        renamed = False
        try:
            self.client.mkdirs(parent or "/", create_parent=True)
            writer = self.client.create(temp)
            try:
                if isinstance(data, bytes):
                    writer.write(data)
                else:
                    with open(data, "rb") as source:
                        while chunk := source.read(_COPY_CHUNK):
                            writer.write(chunk)
            finally:
                writer.close()
            try:
                self.client.rename(temp, target, overwrite=overwrite)
            except Exception:
                if not overwrite and self.exists(name):
                    return False  # another writer's object is there: first writer wins
                raise
            renamed = True
            return True
        except StoreError:
            raise
        except Exception as exc:
            raise self._error("write", name, exc) from None
        finally:
            if not renamed:
                try:
                    self.client.delete(temp)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass

    def remove(self, name: str) -> bool:
        if not self.exists(name):
            return False
        try:
            self.client.delete(self.source.hdfs_path(name))
        except Exception as exc:
            raise self._error("remove", name, exc) from None
        return True

    def list(self, prefix: str) -> list[str]:
        _check_name(prefix)
        try:
            statuses = list(self.client.list_status(self.source.hdfs_path(prefix)))
        except Exception as exc:
            if isinstance(self._hdfs_error("", exc), NotFound):
                return []
            raise self._error("list", prefix, exc) from None
        names = [s.path.rstrip("/").rsplit("/", 1)[-1] for s in statuses if not s.isdir]
        return sorted(f"{prefix}/{n}" for n in names if n and not n.startswith("."))


def open_store_writer(url: str, **options: Any) -> StoreWriter:
    """A :class:`StoreWriter` for ``url``: a path or ``file://``, ``s3://``, ``hdfs://``.

    ValueError for a malformed URL or unknown scheme, :class:`ReadOnlyStore` for
    ``http(s)://``, StoreError when the store cannot be reached or created.
    """
    if not url:
        raise ValueError("empty store URL")
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme == "":
        if options:
            raise ValueError(f"a local store takes no options ({', '.join(sorted(options))})")
        return FileStoreWriter(url)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ValueError(f"{redact_url(url)!r}: expected file:///absolute/path")
        return FileStoreWriter(unquote(parts.path))
    if scheme == "s3":
        return S3StoreWriter(url, **options)
    if scheme == "hdfs":
        return HdfsStoreWriter(url, **options)
    if scheme in ("http", "https"):
        raise ReadOnlyStore(
            f"{redact_url(url)}: an http(s) store is read-only; convert into the directory or bucket it serves"
        )
    raise ValueError(f"unsupported store URL {redact_url(url)!r}: expected a path, file://, s3:// or hdfs://")


# -- reading --------------------------------------------------------------------------------


class StoreReader:
    """Chain records and layer indexes of a store, read through ``engine`` (rooted at the store URL).

    Decoding an index is CPU work proportional to its entries (over a second for
    100k of them): it runs in a worker thread, under ``threads`` (the layer server
    passes the limiter its block fetchers share; None: trio's default limiter), so
    the trio thread that serves FUSE requests for every layer never waits on it.
    """

    def __init__(self, engine: Engine, *, threads: trio.CapacityLimiter | None = None) -> None:
        self.engine = engine
        self.threads = threads

    def __repr__(self) -> str:
        return f"<StoreReader {self.engine.url}>"

    async def read_object(self, name: str, max_size: int) -> bytes | None:
        """The bytes of object ``name`` (one version of it), None if it does not exist.

        FetchError (EIO) when the store fails, FormatError when the object is larger
        than ``max_size`` (nothing that large is read).
        """
        found = await self._read_entry(name, max_size)
        return None if found is None else found[1]

    async def _read_entry(self, name: str, max_size: int) -> tuple[Entry, bytes] | None:
        """:meth:`read_object`, with the entry (size and version) the bytes were read as."""
        try:
            entry = await self.engine.stat(name)
        except NotFound:
            return None
        if entry.is_dir:
            raise FormatError(f"{self.engine.url}: {name} is a directory, not an object")
        if entry.size > max_size:
            raise FormatError(f"{self.engine.url}: {name} is {entry.size} bytes, more than {max_size} allowed")
        reader = self.engine.open(name, entry.size, mtime=entry.mtime, version=entry.version)
        try:
            data = await reader.read(0, entry.size)
        finally:
            reader.close()
        if len(data) != entry.size:
            raise FetchError(f"{self.engine.url}: {name}: read {len(data)} of {entry.size} bytes")
        return entry, data

    async def _read_decoded(
        self, name: str, max_size: int, decode: Callable[[bytes], Awaitable[T]]
    ) -> tuple[T, bytes] | None:
        """Object ``name`` as ``decode`` makes it (FormatError: the bytes are not what they must be), and its
        bytes; None if it does not exist.

        Bytes that fail ``decode`` are reported to the engine as corrupt (a store proxy
        that served them is set aside, the engine's buffer of them dropped) and read once
        more: a proxy's bad bytes never make a layer corrupt.  A second failure raises.
        """
        for attempt in (1, 2):
            found = await self._read_entry(name, max_size)
            if found is None:
                return None
            entry, data = found
            try:
                return await decode(data), data
            except FormatError as exc:
                if attempt == 2:
                    raise
                log.warning("store object fails verification; reading it again", url=self.engine.url, object=name,
                            error=str(exc))  # fmt: skip
                self.engine.corrupt(name, 0, entry.size, entry.version)
        raise AssertionError("unreachable")

    async def chain(self, chain_id: str) -> ChainRecord | None:
        """The chain record of ``chain_id``; None if the layer is not converted in this store (:meth:`chain_and_bytes`)."""
        found = await self.chain_and_bytes(chain_id)
        return None if found is None else found[0]

    async def chain_and_bytes(self, chain_id: str) -> tuple[ChainRecord, bytes] | None:
        """The chain record of ``chain_id`` and the bytes it was decoded from (what the snapshotter hands the layer
        server, so that a layer's record is read once); None if the layer is not converted in this store.

        FetchError when the store fails, FormatError when the record is tampered with.
        A missing record is "not converted" only in a store that exists: when the
        store's root is missing too (a typo in ``--store``, a bucket or prefix that is
        not there, an unmounted NFS export) or is not a directory, that is a FetchError.
        """

        async def decode(data: bytes) -> ChainRecord:
            return ChainRecord.decode(data, expected_chain_id=chain_id)

        found = await self._read_decoded(chain_object(chain_id), MAX_CHAIN_RECORD_BYTES, decode)
        if found is None:
            await self._check_root()
            return None
        return found

    async def _check_root(self) -> None:
        """FetchError if the store's root does not exist or is not a directory.

        Only those two answers count: a root that cannot be listed (an http front
        without directory listings answers 403) may still serve its objects.
        """
        try:
            entry = await self.engine.stat("")
        except (NotFound, NotADirectory) as exc:
            raise FetchError(f"{self.engine.url}: the store does not exist ({exc})") from None
        except (FetchError, SourceError):
            return
        if not entry.is_dir:
            raise FetchError(f"{self.engine.url}: the store is a file, not a directory of objects")

    async def index(self, record: ChainRecord) -> LayerIndex:
        """The layer index ``record`` names, verified against ``record.index`` and its diff_id."""
        index, _data = await self.index_and_bytes(record)
        return index

    async def index_and_bytes(self, record: ChainRecord) -> tuple[LayerIndex, bytes]:
        """The layer index ``record`` names, verified as :meth:`index` does, and the exact
        bytes it was decoded from (their SHA-256 is ``record.index``): what a node keeps
        as its local copy, byte for byte the store's, so the copy is checked against the
        same name when it is read back."""
        name = index_object(record.index)

        async def decode(data: bytes) -> LayerIndex:
            # Hashing and parsing a large index takes seconds of CPU: never on the trio thread;
            # the record bounds what the index may hold (its files and bytes).
            index = await trio.to_thread.run_sync(functools.partial(LayerIndex.decode, data, record=record),
                                                  limiter=self.threads)  # fmt: skip
            if index.diff_id != record.diff_id or index.block_size != record.block_size:
                raise FormatError(f"{self.engine.url}: index {record.index} is not the layer of chain record {record.chain_id}")
            return index

        # An object larger than the record's layer can take is refused from its size, unread.
        found = await self._read_decoded(name, min(MAX_INDEX_OBJECT_BYTES, sealed_size_bound(index_limits(record).payload_bytes)), decode)
        if found is None:
            raise FormatError(f"{self.engine.url}: chain record {record.chain_id} names index {record.index}, which is missing")
        return found

    async def block_table_and_bytes(self, record: ChainRecord) -> tuple[LayerBlockTable, bytes]:
        """The binary block table ``record`` names (:mod:`.block_table`), verified against ``record.block_table``,
        its index, diff_id and counts, and the exact bytes it was decoded from (the node's local copy)."""

        async def decode(data: bytes) -> LayerBlockTable:
            # Milliseconds for tens of thousands of blocks, but a hash and a decompression of megabytes: in a thread.
            return await trio.to_thread.run_sync(functools.partial(LayerBlockTable.decode, data, record=record),
                                                 limiter=self.threads)  # fmt: skip

        bound = sealed_size_bound(block_table_bound(record))  # a larger object is refused from its size, unread
        found = await self._read_decoded(block_table_object(record.block_table), bound, decode)
        if found is None:
            raise FormatError(f"{self.engine.url}: chain record {record.chain_id} names block table "
                              f"{record.block_table}, which is missing")  # fmt: skip
        return found

    async def image(self, record: ChainRecord) -> LayerImage:
        """The table of the EROFS image ``record`` names (:class:`LayerImage`), verified against ``record.image``."""
        return (await self.image_and_bytes(record))[0]

    async def image_and_bytes(self, record: ChainRecord) -> tuple[LayerImage, bytes]:
        """:meth:`image`, and the exact bytes the table was decoded from (their SHA-256 is ``record.image``):
        what a node keeps beside the image, to verify the kept image against before a later mount."""

        async def decode(data: bytes) -> LayerImage:
            return LayerImage.decode(data, record=record)  # a few rows: on the trio thread

        found = await self._read_decoded(image_object(record.image), sealed_size_bound(MAX_IMAGE_TABLE_BYTES), decode)
        if found is None:
            raise FormatError(f"{self.engine.url}: chain record {record.chain_id} names image {record.image}, which is missing")
        return found


@asynccontextmanager
async def open_store(url: str, config: EngineConfig = EngineConfig(), **options: Any) -> AsyncIterator[StoreReader]:
    """A :class:`StoreReader` on a fresh engine over ``open_source(url, **options)`` for the block.

    An error raised in the block comes out as itself, not wrapped in the engine
    nursery's exception group.
    """
    source = open_source(url, **options)
    try:
        async with open_engine(source, config) as engine:
            yield StoreReader(engine)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise
    finally:
        source.close()
