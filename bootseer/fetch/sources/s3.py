"""The S3 backend (``s3://bucket/prefix``), through boto3.

Keys are paths: ``s3://bucket/ckpt`` roots the source at key ``ckpt``, which is a
file if an object has that key and a directory if keys start with ``ckpt/``
(an object wins over a prefix of the same name).  Zero-byte ``dir/`` marker
objects make empty directories visible and are never listed as files.

Each :class:`S3Connection` has its own boto3 client (its own connection pool), so
a retry on a new connection really is one; connections make a single attempt and
leave retrying to the engine, while metadata calls use botocore's standard
retries.  Credentials come from the options or boto3's usual chain (environment,
profile, instance metadata).  An object's version is its ETag, which
``HeadObject`` and ``ListObjectsV2`` give alike; a read of a version is
conditional on it (``If-Match``), so an object rewritten since raises
:class:`~bootseer.fetch.source.Changed` instead of mixing two versions.  A body
is never read past the length asked for.
"""

from __future__ import annotations

import re
import threading
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from bootseer.fetch.source import Changed, Entry, NotADirectory, NotFound, PermanentError, SourceError, TransientError
from bootseer.fetch.sources import check_range, redact_url, split_path, valid_name
from bootseer.log import get_logger

log = get_logger(__name__)

_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}
# Failures of the transport itself (connect, read, a body cut short).
_TRANSIENT_BOTOCORE = (
    botocore.exceptions.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    botocore.exceptions.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ...
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ResponseStreamingError,
)
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+)\s*$")


def s3_error(where: str, exc: Exception) -> SourceError:
    """Map a boto3/botocore exception to the contract's error classes."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        message = f"{where}: {code or status} {error.get('Message', '')}".rstrip()
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFound(message)
        if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
            return TransientError(message)
        return PermanentError(message)  # AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, ...
    if isinstance(exc, botocore.exceptions.SSLError):
        return PermanentError(f"{where}: TLS failed (certificate?): {exc}")
    if isinstance(exc, _TRANSIENT_BOTOCORE) or isinstance(exc, OSError):
        return TransientError(f"{where}: {exc}")
    # NoCredentialsError, ParamValidationError, NoRegionError, ...: configuration.
    return PermanentError(f"{where}: {exc}")


class S3Source:
    """Objects under ``s3://bucket/prefix``.

    Options: ``endpoint_url`` (S3-compatible stores, e.g. MinIO or Ceph RGW),
    ``region``, ``access_key_id``/``secret_access_key``/``session_token`` (else
    boto3's credential chain), ``profile``, ``addressing_style`` (``"path"`` or
    ``"virtual"``), ``verify`` (TLS certificate checks), ``ca_file`` (a CA bundle for them),
    ``connect_timeout`` and ``read_timeout`` in seconds.
    """

    default_streams = 16

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        addressing_style: str | None = None,
        verify: bool = True,
        ca_file: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3" or not parts.netloc:
            raise ValueError(f"{redact_url(url)!r}: expected s3://bucket[/prefix]")
        if parts.query or parts.fragment:
            raise ValueError(f"{redact_url(url)!r}: an S3 URL takes no query or fragment")
        if (access_key_id is None) != (secret_access_key is None):
            raise ValueError("access_key_id and secret_access_key must be given together")
        if addressing_style not in (None, "path", "virtual", "auto"):
            raise ValueError(f"addressing_style must be 'path', 'virtual' or 'auto', not {addressing_style!r}")
        self.url = url
        self.bucket = parts.netloc
        self.root_key = parts.path.strip("/")
        if self.root_key:
            split_path(self.root_key)  # refuse "s3://b/a/../x" and "a//b" up front
        self.endpoint_url = endpoint_url
        self.verify: bool | str = ca_file if (verify and ca_file) else verify
        self._session = boto3.session.Session(
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            region_name=region,
            profile_name=profile,
        )
        s3_options = {"addressing_style": addressing_style} if addressing_style else {}
        base = {"connect_timeout": connect_timeout, "read_timeout": read_timeout, "s3": s3_options}
        self._metadata_config = botocore.config.Config(**base, retries={"mode": "standard", "max_attempts": 3})
        self._read_config = botocore.config.Config(**base, retries={"mode": "standard", "total_max_attempts": 1})
        # Sessions are not thread-safe; creating clients is serialised.
        self._session_lock = threading.Lock()
        self._metadata_client = self.new_client(self._metadata_config)
        self.display_url = redact_url(url)

    def __repr__(self) -> str:
        return f"S3Source({self.display_url!r})"

    def new_client(self, config: botocore.config.Config) -> Any:
        with self._session_lock:
            return self._session.client("s3", endpoint_url=self.endpoint_url, verify=self.verify, config=config)

    def key(self, path: str) -> str:
        return "/".join([self.root_key, *split_path(path)] if self.root_key else split_path(path))

    def where(self, path: str) -> str:
        return f"s3://{self.bucket}/{self.key(path)}"

    def stat(self, path: str) -> Entry:
        key = self.key(path)
        name = path.rsplit("/", 1)[-1]
        client = self._metadata_client
        if not key:  # the bucket itself
            try:
                client.head_bucket(Bucket=self.bucket)
            except Exception as exc:
                raise s3_error(f"s3://{self.bucket}", exc) from None
            return Entry(name="", size=0, is_dir=True, mtime=0.0)
        try:
            head = client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            error = s3_error(self.where(path), exc)
            if not isinstance(error, NotFound):
                raise error from None
        else:
            size = int(head["ContentLength"])
            mtime = head["LastModified"].timestamp()
            return Entry(name=name, size=size, is_dir=False, mtime=mtime, version=head.get("ETag") or "")
        if self._has_children(key):
            return Entry(name=name, size=0, is_dir=True, mtime=0.0)
        raise error from None

    def _has_children(self, key: str) -> bool:
        try:
            page = self._metadata_client.list_objects_v2(Bucket=self.bucket, Prefix=key + "/", MaxKeys=1)
        except Exception as exc:
            raise s3_error(self.where(""), exc) from None
        return bool(page.get("KeyCount") or page.get("Contents") or page.get("CommonPrefixes"))

    def listdir(self, path: str) -> list[Entry]:
        key = self.key(path)
        prefix = f"{key}/" if key else ""
        entries: dict[str, Entry] = {}
        seen_anything = False
        try:
            paginator = self._metadata_client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    seen_anything = True
                    name = common["Prefix"][len(prefix):].rstrip("/")
                    if valid_name(name):
                        # An object of the same name wins, as in stat().
                        entries.setdefault(name, Entry(name=name, size=0, is_dir=True, mtime=0.0))
                for item in page.get("Contents", []):
                    seen_anything = True
                    name = item["Key"][len(prefix):]
                    if valid_name(name):
                        entries[name] = Entry(
                            name=name,
                            size=int(item["Size"]),
                            is_dir=False,
                            mtime=item["LastModified"].timestamp(),
                            version=item.get("ETag") or "",
                        )
                    elif name:  # "" is the directory's own marker
                        log.warning(
                            "skipping an S3 key that is not a valid name", url=self.display_url, key=item["Key"]
                        )
        except Exception as exc:
            raise s3_error(self.where(path), exc) from None
        if not seen_anything and key:
            # Nothing under the prefix: an empty listing is only right for the bucket.
            if not self.stat(path).is_dir:
                raise NotADirectory(f"{self.where(path)}: not a directory")
        return sorted(entries.values(), key=lambda entry: entry.name)

    def put(self, path: str, data: bytes) -> None:
        """Store ``data`` as the object at ``path`` (one PutObject: S3 replaces an object whole)."""
        try:
            self._metadata_client.put_object(Bucket=self.bucket, Key=self.key(path), Body=data)
        except Exception as exc:
            raise s3_error(self.where(path), exc) from None

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        """Nothing to learn: this source reads every range from one place (see RangeSource.corrupt)."""

    def connect(self) -> S3Connection:
        return S3Connection(self)

    def close(self) -> None:
        self._metadata_client.close()


class S3Connection:
    """Range reads with a boto3 client of its own."""

    def __init__(self, source: S3Source) -> None:
        self.source = source
        self.client = source.new_client(source._read_config)

    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        check_range(offset, length)
        source = self.source
        if length == 0:
            return b""
        where = source.where(path)
        request: dict[str, Any] = {
            "Bucket": source.bucket,
            "Key": source.key(path),
            "Range": f"bytes={offset}-{offset + length - 1}",
        }
        if version:
            request["IfMatch"] = version
        try:
            response = self.client.get_object(**request)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412"):
                raise Changed(f"{where}: object changed (ETag is no longer {version})") from None
            if code == "InvalidRange":
                return b""  # the offset is at or past the end of the object
            raise s3_error(where, exc) from None
        except Exception as exc:
            raise s3_error(where, exc) from None
        body = response["Body"]
        try:
            match = _CONTENT_RANGE.match(response.get("ContentRange") or "")
            if not match:
                raise PermanentError(f"{where}: no Content-Range in the answer to a Range request")
            first, last, total = (int(group) for group in match.groups())
            if first != offset or last > offset + length - 1 or (last < offset + length - 1 and last != total - 1):
                raise PermanentError(
                    f"{where}: asked for bytes {offset}-{offset + length - 1}, got {first}-{last}/{total}"
                )
            if version and response.get("ETag") != version:  # IfMatch held, or the server ignored it
                raise Changed(f"{where}: object changed (ETag {version} -> {response.get('ETag')})")
            wanted = last - first + 1
            announced = response.get("ContentLength")
            if announced is not None and int(announced) != wanted:
                raise PermanentError(f"{where}: Content-Length {announced} for a range of {wanted} bytes")
            data = body.read(wanted)
        except BaseException as exc:
            body.close()  # never drained: what a refused answer has left stays unread
            if isinstance(exc, SourceError) or not isinstance(exc, Exception):
                raise
            raise s3_error(where, exc) from None
        if len(data) != wanted:
            body.close()
            raise TransientError(f"{where}: body of {len(data)} bytes for range {first}-{last}")
        return data

    def close(self) -> None:
        self.client.close()
