"""The WebHDFS backend (``webhdfs://namenode:port/path``): HDFS over its REST API.

Metadata comes from the namenode (``GETFILESTATUS``, ``LISTSTATUS``).  A read asks
the namenode to ``OPEN`` with ``offset`` and ``length``; the namenode answers
``307`` with the datanode that holds the bytes, and the bytes come from there.
Each :class:`WebHdfsConnection` keeps one persistent connection to the namenode
and one per datanode it was sent to.  ``swebhdfs://`` is the same over TLS.

Errors arrive as ``{"RemoteException": {"exception": ..., "message": ...}}`` and
are mapped by exception name (``FileNotFoundException`` -> NotFound,
``AccessControlException`` -> PermanentError, ``StandbyException`` ->
TransientError, ...), else by HTTP status.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import quote, unquote, urlencode, urljoin, urlsplit

from bootseer.fetch.source import Entry, NotADirectory, NotFound, PermanentError, SourceError, TransientError
from bootseer.fetch.sources import check_range, split_path
from bootseer.fetch.sources.http import ChannelPool, HttpChannel, HttpEndpoint, parse_endpoint_url, status_error

API_PREFIX = "/webhdfs/v1"
MAX_METADATA_BYTES = 64 << 20
_NOT_FOUND_EXCEPTIONS = {"FileNotFoundException"}
_TRANSIENT_EXCEPTIONS = {"StandbyException", "RetriableException", "SafeModeException", "ObserverRetryOnActiveException"}
_PERMANENT_EXCEPTIONS = {
    "AccessControlException",
    "AuthorizationException",
    "SecurityException",
    "InvalidToken",
    "IllegalArgumentException",
    "UnsupportedOperationException",
}


def remote_error(where: str, status: int, reason: str, body: bytes) -> SourceError:
    """Map a WebHDFS error answer (a RemoteException JSON body, if any) to an error class."""
    try:
        remote = json.loads(body)["RemoteException"]
        exception = str(remote.get("exception", ""))
        message = f"{where}: {exception}: {remote.get('message', '')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return status_error(where, status, reason)
    if exception in _NOT_FOUND_EXCEPTIONS:
        return NotFound(message)
    if exception in _TRANSIENT_EXCEPTIONS:
        return TransientError(message)
    if exception in _PERMANENT_EXCEPTIONS:
        return PermanentError(message)
    return type(status_error(where, status, reason))(message)


@dataclass(frozen=True)
class _Pin:
    size: int
    mtime_ms: int


def _entry(name: str, status: Mapping[str, Any]) -> Entry:
    is_dir = status.get("type") == "DIRECTORY"
    return Entry(
        name=name,
        size=0 if is_dir else int(status.get("length", 0)),
        is_dir=is_dir,
        mtime=int(status.get("modificationTime", 0)) / 1000.0,
    )


class WebHdfsSource:
    """Files under a ``webhdfs://`` (or ``swebhdfs://``) URL.

    Options: ``user`` (sent as ``user.name``, simple authentication),
    ``delegation_token``, ``headers``, ``connect_timeout``/``read_timeout`` in
    seconds, ``verify``/``ca_file`` for swebhdfs.
    """

    default_streams = 16

    def __init__(
        self,
        url: str,
        *,
        user: str | None = None,
        delegation_token: str | None = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        verify: bool = True,
        ca_file: str | None = None,
    ) -> None:
        self.url = url
        self.endpoint, path, query = parse_endpoint_url(
            url,
            ("webhdfs", "swebhdfs"),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            headers=headers,
            verify=verify,
            ca_file=ca_file,
            default_ports={"webhdfs": 9870, "swebhdfs": 9871},
            transport={"webhdfs": "http", "swebhdfs": "https"},
        )
        if query:
            raise ValueError(f"{url!r}: give the user and token as options, not in a query")
        root = unquote(path).rstrip("/")
        if root:
            split_path(root.lstrip("/"))
        self.root = root or "/"
        self.auth_params = {"user.name": user, "delegation": delegation_token}
        self.pool = ChannelPool(self.endpoint)
        self._pins: dict[str, _Pin] = {}

    def __repr__(self) -> str:
        return f"WebHdfsSource({self.url!r})"

    def hdfs_path(self, path: str) -> str:
        parts = split_path(path)
        return self.root.rstrip("/") + "/" + "/".join(parts) if parts else self.root

    def where(self, path: str) -> str:
        return f"{self.endpoint.origin}{API_PREFIX}{self.hdfs_path(path)}"

    def target(self, path: str, op: str, **params: int | str) -> str:
        query = {"op": op, **params, **{k: v for k, v in self.auth_params.items() if v is not None}}
        return f"{API_PREFIX}{quote(self.hdfs_path(path))}?{urlencode(query)}"

    def call(self, chan: HttpChannel, path: str, op: str) -> Any:
        """A namenode operation answered with JSON; raises the mapped error otherwise."""
        response = chan.request("GET", self.target(path, op))
        body = chan.read_body(response, limit=MAX_METADATA_BYTES)
        if response.status != 200:
            raise remote_error(self.where(path), response.status, response.reason, body)
        try:
            return json.loads(body)
        except ValueError as exc:
            raise PermanentError(f"{self.where(path)}: {op} answered malformed JSON: {exc}") from None

    def stat(self, path: str) -> Entry:
        with self.pool.channel() as chan:
            answer = self.call(chan, path, "GETFILESTATUS")
        try:
            status = answer["FileStatus"]
        except (KeyError, TypeError):
            raise PermanentError(f"{self.where(path)}: GETFILESTATUS answer has no FileStatus") from None
        entry = _entry(path.rsplit("/", 1)[-1], status)
        if not entry.is_dir:
            self._pins[path] = _Pin(entry.size, int(status.get("modificationTime", 0)))
        return entry

    def listdir(self, path: str) -> list[Entry]:
        # LISTSTATUS of a file lists the file itself; a listing must name a directory.
        if not self.stat(path).is_dir:
            raise NotADirectory(f"{self.where(path)}: not a directory")
        with self.pool.channel() as chan:
            answer = self.call(chan, path, "LISTSTATUS")
        try:
            statuses = answer["FileStatuses"]["FileStatus"]
        except (KeyError, TypeError):
            raise PermanentError(f"{self.where(path)}: LISTSTATUS answer has no FileStatuses") from None
        entries = []
        for status in statuses:
            name = str(status.get("pathSuffix", ""))
            if name and name not in (".", "..") and "/" not in name and status.get("type") in ("FILE", "DIRECTORY"):
                entries.append(_entry(name, status))
        return sorted(entries, key=lambda entry: entry.name)

    def pin(self, path: str) -> _Pin | None:
        return self._pins.get(path)

    def connect(self) -> WebHdfsConnection:
        return WebHdfsConnection(self)

    def close(self) -> None:
        self.pool.close()


class WebHdfsConnection:
    """A namenode connection and one connection per datanode it redirected to."""

    def __init__(self, source: WebHdfsSource) -> None:
        self.source = source
        self.namenode = HttpChannel(source.endpoint)
        self.datanodes: dict[tuple[str, str, int], HttpChannel] = {}
        self._lock = threading.Lock()

    def _datanode(self, location: str, where: str) -> tuple[HttpChannel, str]:
        """The channel to the datanode a redirect names, and the request target there."""
        parts = urlsplit(location)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PermanentError(f"{where}: namenode redirected to an unusable location {location!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise PermanentError(f"{where}: namenode redirected to a bad port in {location!r}") from None
        key = (parts.scheme, parts.hostname, port)
        if key not in self.datanodes:
            endpoint: HttpEndpoint = self.source.endpoint.with_address(*key)
            self.datanodes[key] = HttpChannel(endpoint)
        return self.datanodes[key], parts.path + (f"?{parts.query}" if parts.query else "")

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        source = self.source
        where = source.where(path)
        pin = source.pin(path)
        if pin is None:
            source.stat(path)  # the size bounds the read; OPEN past the end is an error
            pin = source.pin(path)
            if pin is None:
                raise PermanentError(f"{where}: is a directory")
        length = max(0, min(length, pin.size - offset))
        if length == 0:
            return b""
        with self._lock:
            response = self.namenode.request("GET", source.target(path, "OPEN", offset=offset, length=length))
            if response.status not in (301, 302, 303, 307, 308):
                body = self.namenode.read_body(response, limit=MAX_METADATA_BYTES)
                if response.status == 200:
                    raise PermanentError(f"{where}: namenode served OPEN itself; expected a redirect to a datanode")
                raise remote_error(where, response.status, response.reason, body)
            self.namenode.read_body(response, limit=MAX_METADATA_BYTES)
            location = urljoin(source.endpoint.origin, response.getheader("Location") or "")
            channel, target = self._datanode(location, where)
            answer = channel.request("GET", target)
            if answer.status != 200:
                body = channel.discard(answer)
                raise remote_error(f"{where} (datanode {channel.endpoint.origin})", answer.status, answer.reason, body)
            data = channel.read_body(answer)
        if len(data) != length:
            # A datanode that serves fewer bytes than asked (not at EOF: the length
            # was clamped to the pinned size) cut the stream or the file shrank.
            channel.close()
            raise TransientError(f"{where}: datanode sent {len(data)} bytes of {length} at {offset}")
        return data

    def close(self) -> None:
        # Without the lock: closing the sockets is how another thread aborts a read
        # stuck on a silent datanode.
        self.namenode.close()
        for channel in list(self.datanodes.values()):
            channel.close()
