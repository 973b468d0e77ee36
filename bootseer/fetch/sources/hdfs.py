"""The HDFS backend (``hdfs://namenode[:port]/path``) over the native RPC protocol.

Uses the ``hdfs-native`` package (a Rust client: no JVM, no libhdfs); its
``read_range`` releases the GIL, so parallel streams really run in parallel.
``hdfs://host:port`` names one namenode; ``hdfs://nameservice`` (no port) an HA
name service resolved from ``HADOOP_CONF_DIR`` or the ``config`` option.  Each
:class:`HdfsConnection` has its own client (its own namenode RPC connection)
and keeps the file readers it opened (block locations already fetched).

hdfs-native retries namenode failovers itself with exponential sleeps (15 tries
and up to 15 s between them by default, minutes in all).  That would hide an
outage from the engine, so the defaults here are a few quick failovers
(``max_failovers``); the engine retries on a new connection.

A file's version is its modification time (ms) and length, which
``get_file_info`` and ``list_status`` give alike.  A connection's reader is
opened between two looks at the file's status that agree, so it is known to
read that version; a read of another version opens a new reader, and raises
:class:`~bootseer.fetch.source.Changed` if the file is not that version now.

Tested here: URL parsing, path refusal, error mapping and a namenode that is not
there (a closed 127.0.0.1 port gives TransientError).  No HDFS cluster can run in
the test environment, so reads against a live namenode/datanodes are untested.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping, NamedTuple
from urllib.parse import unquote, urlsplit

from bootseer.fetch.source import Changed, Entry, NotADirectory, NotFound, PermanentError, SourceError, TransientError
from bootseer.fetch.sources import check_range, redact_url, split_path

# Markers in hdfs-native's RuntimeError messages (its HdfsError variants and the Java
# exception class names it passes through) that a retry cannot fix.
_PERMANENT_MARKERS = (
    "InvalidArgument",
    "InvalidPath",
    "UrlParseError",
    "UnsupportedFeature",
    "UnsupportedErasureCodingPolicy",
    "IsADirectory",
    "AccessControlException",
    "AuthorizationException",
    "InvalidToken",
    "SaslException",
    "SASLError",
    "GSSAPIError",
    "NoSASLMechanism",
    "No fs.defaultFS",
    "No NameNode hosts",
    "No host for name service",
)
_NOT_FOUND_MARKERS = ("FileNotFound", "java.io.FileNotFoundException")


def hdfs_error(where: str, exc: BaseException) -> SourceError:
    """Map an exception raised by hdfs-native to the contract's error classes."""
    message = f"{where}: {exc}"
    text = str(exc)
    if isinstance(exc, FileNotFoundError) or any(marker in text for marker in _NOT_FOUND_MARKERS):
        return NotFound(message)
    if isinstance(exc, NotADirectoryError):
        return NotADirectory(message)
    if isinstance(exc, (PermissionError, IsADirectoryError, ValueError, TypeError)):
        return PermanentError(message)
    if any(marker in text for marker in _PERMANENT_MARKERS):
        return PermanentError(message)
    # OSError (connection refused/reset, timeouts), RuntimeError for checksum,
    # datanode, standby and RPC failures: a new connection may do better.
    return TransientError(message)


def file_version(status: Any) -> str:
    """The :attr:`Entry.version` of an hdfs-native FileStatus of a file."""
    return f"{status.modification_time}:{status.length}"


def _entry(name: str, status: Any) -> Entry:
    mtime = status.modification_time / 1000.0
    if status.isdir:
        return Entry(name=name, size=0, is_dir=True, mtime=mtime)
    return Entry(name=name, size=status.length, is_dir=False, mtime=mtime, version=file_version(status))


class HdfsSource:
    """Files under an ``hdfs://`` URL.

    Options: ``config`` (Hadoop settings, e.g. ``{"dfs.ha.namenodes.ns": ...}``,
    added to those in ``HADOOP_CONF_DIR``), ``max_failovers`` (namenode retries
    inside one call), ``kerberos_principal``/``kerberos_keytab``/``kerberos_cache``.
    """

    default_streams = 16

    def __init__(
        self,
        url: str,
        *,
        config: Mapping[str, str] | None = None,
        max_failovers: int = 2,
        kerberos_principal: str | None = None,
        kerberos_keytab: str | None = None,
        kerberos_cache: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() != "hdfs" or not parts.hostname:
            raise ValueError(f"{redact_url(url)!r}: expected hdfs://namenode[:port]/path")
        if parts.query or parts.fragment:
            raise ValueError(f"{redact_url(url)!r}: an HDFS URL takes no query or fragment")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"{redact_url(url)!r}: bad port: {exc}") from None
        if max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, not {max_failovers}")
        self.url = url
        self.namenode_url = f"hdfs://{parts.netloc}"
        root = unquote(parts.path).rstrip("/")
        if root:
            split_path(root.lstrip("/"))  # refuse ".." and empty components up front
        self.root = root or "/"
        self.config = {
            "dfs.client.failover.max.attempts": str(max_failovers),
            "dfs.client.failover.sleep.base.millis": "200",
            "dfs.client.failover.sleep.max.millis": "2000",
            **dict(config or {}),
        }
        self.kerberos = {
            "kerberos_principal": kerberos_principal,
            "kerberos_keytab": kerberos_keytab,
            "kerberos_cache": kerberos_cache,
        }
        self.client = self.new_client()
        # For messages: the namenode without a user name from the URL.
        self.display_origin = f"hdfs://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        self.display_url = redact_url(self.display_origin + parts.path)

    def __repr__(self) -> str:
        return f"HdfsSource({self.display_url!r})"

    def new_client(self) -> Any:
        import hdfs_native  # here, so that a URL typo fails before a missing wheel does

        try:
            return hdfs_native.Client(self.namenode_url, config=self.config, **self.kerberos)
        except Exception as exc:
            raise hdfs_error(self.display_url, exc) from None

    def hdfs_path(self, path: str) -> str:
        parts = split_path(path)
        if not parts:
            return self.root
        return self.root.rstrip("/") + "/" + "/".join(parts)

    def where(self, path: str) -> str:
        """The URL of ``path`` for messages."""
        return self.display_origin + self.hdfs_path(path)

    def stat(self, path: str) -> Entry:
        try:
            status = self.client.get_file_info(self.hdfs_path(path))
        except Exception as exc:
            raise hdfs_error(self.where(path), exc) from None
        return _entry(path.rsplit("/", 1)[-1], status)

    def listdir(self, path: str) -> list[Entry]:
        # HDFS lists a file as itself; a directory listing must name a directory.
        if not self.stat(path).is_dir:
            raise NotADirectory(f"{self.where(path)}: not a directory")
        entries = []
        try:
            for status in self.client.list_status(self.hdfs_path(path)):
                name = status.path.rstrip("/").rsplit("/", 1)[-1]
                if not name or name in (".", ".."):
                    continue
                entries.append(_entry(name, status))
        except Exception as exc:
            raise hdfs_error(self.where(path), exc) from None
        return sorted(entries, key=lambda entry: entry.name)

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        """Nothing to learn: this source reads every range from one place (see RangeSource.corrupt)."""

    def connect(self) -> HdfsConnection:
        return HdfsConnection(self)

    def close(self) -> None:
        pass


class _Reader(NamedTuple):
    reader: Any  #: an hdfs-native FileReader
    version: str  #: of the file it reads


class HdfsConnection:
    """A client of its own and the readers it opened (LRU-bounded)."""

    max_readers = 64

    def __init__(self, source: HdfsSource) -> None:
        self.source = source
        self.client = source.new_client()
        self._readers: OrderedDict[str, _Reader] = OrderedDict()
        self._lock = threading.Lock()

    def _open(self, path: str) -> _Reader:
        """A new reader and the version it reads: the file's status before and after
        the open agree, and the reader's size is theirs."""
        hdfs_path = self.source.hdfs_path(path)
        before = self.client.get_file_info(hdfs_path)
        if before.isdir:
            raise PermanentError(f"{self.source.where(path)}: is a directory")
        reader = self.client.read(hdfs_path)
        try:
            after = self.client.get_file_info(hdfs_path)
        except BaseException:
            reader.close()
            raise
        version = file_version(before)
        if file_version(after) != version or reader.size() != before.length:
            reader.close()
            raise TransientError(f"{self.source.where(path)}: file changed while it was opened")
        return _Reader(reader, version)

    def _reader(self, path: str, version: str) -> _Reader:
        """The cached reader of ``path`` if it reads ``version`` (any, if ""), else a new one."""
        cached = self._readers.get(path)
        if cached is not None and (not version or cached.version == version):
            self._readers.move_to_end(path)
            return cached
        if cached is not None:
            self._drop(path)
        opened = self._open(path)
        self._readers[path] = opened
        while len(self._readers) > self.max_readers:
            self._drop(next(iter(self._readers)))
        return opened

    def _drop(self, path: str) -> None:
        cached = self._readers.pop(path, None)
        if cached is not None:
            cached.reader.close()

    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        check_range(offset, length)
        where = self.source.where(path)
        with self._lock:
            try:
                opened = self._reader(path, version)
                if version and opened.version != version:
                    self._drop(path)
                    raise Changed(
                        f"{where}: file changed (version {version} -> {opened.version}); refusing to mix versions"
                    )
                length = max(0, min(length, opened.reader.size() - offset))
                if length == 0:
                    return b""
                data = opened.reader.read_range(offset, length)
            except SourceError:
                raise
            except Exception as exc:
                self._drop(path)
                raise hdfs_error(where, exc) from None
        if len(data) != length:
            raise TransientError(f"{where}: read {len(data)} bytes of {length} at {offset}")
        return data

    def close(self) -> None:
        with self._lock:
            while self._readers:
                self._drop(next(iter(self._readers)))
