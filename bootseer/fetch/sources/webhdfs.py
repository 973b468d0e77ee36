"""The WebHDFS backend (``webhdfs://namenode:port/path``): HDFS over its REST API.

Metadata comes from the namenode (``GETFILESTATUS``, ``LISTSTATUS``).  A read asks
the namenode to ``OPEN`` with ``offset`` and ``length``; the namenode answers
``307`` with the datanode that holds the bytes, and the bytes come from there.
Each :class:`WebHdfsConnection` keeps one persistent connection to the namenode
and one per datanode it was sent to.  ``swebhdfs://`` is the same over TLS, and
a redirect from it to a plain ``http://`` datanode is refused.  The ``headers``
option (and ``user:password@`` credentials) go to the namenode's origin only,
never to datanodes elsewhere.

A file's version is its ``modificationTime``, ``length`` and ``fileId``, which
``GETFILESTATUS`` and ``LISTSTATUS`` give alike.  ``OPEN`` has no condition to
send, so a read of a version asks the namenode for the file's status again once
the bytes have arrived: a file rewritten before or while they were read raises
:class:`~bootseer.fetch.source.Changed`.  (HDFS writes the modification time on
create and close, so a version cannot come back once replaced.)

Errors arrive as ``{"RemoteException": {"exception": ..., "message": ...}}`` and
are mapped by exception name (``FileNotFoundException`` -> NotFound,
``AccessControlException`` -> PermanentError, ``StandbyException`` ->
TransientError, ...), else by HTTP status.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping
from urllib.parse import quote, unquote, urlencode, urljoin, urlsplit

from bootseer.fetch.source import Changed, Entry, NotADirectory, NotFound, PermanentError, SourceError, TransientError
from bootseer.fetch.sources import check_range, redact_url, split_path, valid_name
from bootseer.fetch.sources.http import ChannelPool, HttpChannel, HttpEndpoint, parse_endpoint_url, status_error
from bootseer.log import get_logger

log = get_logger(__name__)

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


def _count(status: Mapping[str, Any], field: str, where: str) -> int:
    """A non-negative integer field of a FileStatus; PermanentError if it is anything else."""
    value = status.get(field, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        name = status.get("pathSuffix") or "the file"
        raise PermanentError(f"{where}: namenode gives {name!r} a bad {field} {value!r}")
    return value


def _entry(name: str, status: Mapping[str, Any], where: str) -> Entry:
    if not isinstance(status, Mapping):
        raise PermanentError(f"{where}: namenode sent a FileStatus that is not an object: {status!r:.200}")
    is_dir = status.get("type") == "DIRECTORY"
    modified = _count(status, "modificationTime", where)
    if is_dir:
        return Entry(name=name, size=0, is_dir=True, mtime=modified / 1000.0)
    size = _count(status, "length", where)
    # The fileId (the inode number) tells a file deleted and created again apart even
    # when its time (ms) and length are the same; namenodes older than Hadoop 2.4 send none.
    file_id = status.get("fileId")
    identity = f":{file_id}" if isinstance(file_id, int) and not isinstance(file_id, bool) else ""
    return Entry(name=name, size=size, is_dir=False, mtime=modified / 1000.0, version=f"{modified}:{size}{identity}")


def _version_size(version: str, where: str) -> int:
    """The length a version made by :func:`_entry` names."""
    modified, _, rest = version.partition(":")
    size, _, file_id = rest.partition(":")
    if not (modified.isdigit() and size.isdigit() and (file_id == "" or file_id.lstrip("-").isdigit())):
        raise Changed(f"{where}: {version!r} is not a version this source made")
    return int(size)


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
            raise ValueError(f"{redact_url(url)!r}: give the user and token as options, not in a query")
        root = unquote(path).rstrip("/")
        if root:
            split_path(root.lstrip("/"))
        self.root = root or "/"
        self.auth_params = {"user.name": user, "delegation": delegation_token}
        self.pool = ChannelPool(self.endpoint)
        self.display_url = redact_url(url)

    def __repr__(self) -> str:
        return f"WebHdfsSource({self.display_url!r})"

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
        return self.entry_of(path, answer)

    def entry_of(self, path: str, answer: Any) -> Entry:
        """The Entry of a GETFILESTATUS answer for ``path``."""
        try:
            status = answer["FileStatus"]
        except (KeyError, TypeError):
            raise PermanentError(f"{self.where(path)}: GETFILESTATUS answer has no FileStatus") from None
        return _entry(path.rsplit("/", 1)[-1], status, self.where(path))

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
        if not isinstance(statuses, list):
            raise PermanentError(f"{self.where(path)}: LISTSTATUS answer's FileStatus is not a list")
        entries = []
        for status in statuses:
            name = status.get("pathSuffix") if isinstance(status, dict) else None
            if not valid_name(name) or status.get("type") not in ("FILE", "DIRECTORY"):
                if not (isinstance(status, dict) and status.get("type") == "SYMLINK"):
                    log.warning("skipping malformed LISTSTATUS entry", url=self.where(path), entry=ascii(status)[:200])
                continue
            try:
                entries.append(_entry(name, status, self.where(path)))
            except PermanentError as exc:
                # One entry with a bad length or time hides that entry, not the directory.
                log.warning("skipping malformed LISTSTATUS entry", url=self.where(path), error=str(exc))
        return sorted(entries, key=lambda entry: entry.name)

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        """Nothing to learn: this source reads every range from one place (see RangeSource.corrupt)."""

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
        shown = redact_url(location)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PermanentError(f"{where}: namenode redirected to an unusable location {shown!r}")
        if self.source.endpoint.scheme == "https" and parts.scheme != "https":
            # The bytes (and the delegation token in the target) would cross the
            # network in the clear: a TLS source never follows that.
            raise PermanentError(f"{where}: refused the namenode's redirect from TLS to plain {shown!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise PermanentError(f"{where}: namenode redirected to a bad port in {shown!r}") from None
        key = (parts.scheme, parts.hostname, port)
        if key not in self.datanodes:
            endpoint: HttpEndpoint = self.source.endpoint.with_address(*key)
            self.datanodes[key] = HttpChannel(endpoint)
        return self.datanodes[key], parts.path + (f"?{parts.query}" if parts.query else "")

    def _status(self, path: str) -> Entry:
        """GETFILESTATUS on this connection's namenode channel (the lock held)."""
        return self.source.entry_of(path, self.source.call(self.namenode, path, "GETFILESTATUS"))

    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        check_range(offset, length)
        source = self.source
        where = source.where(path)
        with self._lock:
            if version:
                size = _version_size(version, where)
            else:
                entry = self._status(path)  # the size bounds the read; OPEN past the end is an error
                if entry.is_dir:
                    raise PermanentError(f"{where}: is a directory")
                size = entry.size
            length = max(0, min(length, size - offset))
            if length == 0:
                return b""
            data = self._open(path, offset, length)
            if version:
                found = self._status(path).version
                if found != version:
                    raise Changed(f"{where}: file changed (version {version} -> {found}); refusing to mix versions")
        return data

    def _open(self, path: str, offset: int, length: int) -> bytes:
        """OPEN through the namenode's redirect: exactly ``length`` bytes from the datanode."""
        source = self.source
        where = source.where(path)
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
        # The length was clamped to the file's size: a datanode that sends fewer
        # bytes cut the stream (or the file shrank), one that announces more lies.
        return channel.read_exact(answer, length)

    def close(self) -> None:
        # Without the lock: closing the sockets is how another thread aborts a read
        # stuck on a silent datanode.
        self.namenode.close()
        for channel in list(self.datanodes.values()):
            channel.close()
