"""The HTTP(S) backend: Range requests over persistent ``http.client`` connections.

A :class:`HttpConnection` owns one keep-alive TCP (or TLS) connection; a retry by
the engine uses a new one.  Partial reads must come back as ``206`` with a
``Content-Range`` that matches the request; a ``200`` answer to a Range request
(a server that ignores ranges, or an ``If-Range`` that no longer matches because
the file changed) is refused, never taken for the range.

Metadata: :meth:`HttpSource.stat` sends ``HEAD`` (size from ``Content-Length``,
mtime from ``Last-Modified``).  A file's version (:func:`http_version`) is the
strongest validator the server gives: a strong ``ETag`` that says more than the
date, else the ``Last-Modified`` second and size (all an nginx JSON index gives,
and all nginx's own ETag says, so a listing and a stat agree there).  A read of a
version sends it as ``If-Range`` and checks the answer: the ``Content-Range``
total, the date, and the ETag, which every ``206`` must carry; a ``200`` to a
ranged request with ``If-Range`` means the file changed.  A date-only version is
pinned to the first strong ETag an answer carries (:class:`_EtagPins`), for all
connections.  A file changed since raises :class:`~bootseer.fetch.source.Changed`.
No body is read past the length asked for, whatever ``Content-Length`` the server
announces.  A URL ending in ``/``, or one the server redirects to the same path
plus ``/``, is a directory.  :meth:`HttpSource.listdir` reads nginx's
``autoindex_format json`` or an HTML index (the ``<a href>`` links that name a
direct child; files in an HTML index cost one ``HEAD`` each); an entry that is
malformed or that the server refuses is skipped with a warning.

Proxy: with ``proxy`` (``[store] proxy``), range reads go through an HTTP proxy while
it is healthy and direct while it is not, in requests aligned to the proxy's block
grid (:class:`HttpSource`; health and fallback: :mod:`.http_proxy`).  The same
connections and checks serve both routes: :class:`HttpEndpoint` knows how to reach a
server through a proxy (absolute-URI requests for http, ``CONNECT`` for https).

The plumbing (:class:`HttpEndpoint`, :class:`HttpChannel`, :class:`ChannelPool`,
:func:`status_error`) is shared with the WebHDFS backend, and with the registry client
(:mod:`bootseer.images.registry`), which also asks for any URL a redirect names
(:meth:`HttpEndpoint.at`), follows redirects to blob storage
(:func:`request_following`: credentials never leave their origin, no https to plain
http unless asked) and streams bodies (:class:`HttpExchange`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import email.utils
import http.client
import json
import re
import socket
import ssl
import threading
from collections import deque
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Iterator, Mapping
from urllib.parse import quote, unquote, urljoin, urlsplit

from bootseer.fetch.source import (
    Changed, Entry, NotADirectory, NotFound, PermanentError, ProxyStatus, SourceError, TransientError,
)
from bootseer.fetch.sources import check_range, redact_url, split_path, valid_name
from bootseer.fetch.sources.http_proxy import BYTES, REQUESTS, ProxyConfig, ProxyHealth
from bootseer.log import get_logger

log = get_logger(__name__)

MAX_LISTING_BYTES = 64 << 20  #: a directory index larger than this is refused
MAX_ERROR_BODY_BYTES = 64 << 10  #: error bodies longer than this are not read (the connection is dropped)
#: Range reads through the proxy a source remembers, to tell whether bytes its caller found corrupt came
#: by the proxy (:meth:`HttpSource.corrupt`): a caller verifies what it fetched right after the fetch.
PROXIED_MEMORY = 4096
#: The bytes a proxy that is down must serve the same as the store before reads go back to it.
PROBE_BYTES = 4096

# Network failures: a retry on a new connection may succeed.
NETWORK_ERRORS = (OSError, http.client.HTTPException)
# What a keep-alive connection the server closed while idle looks like on reuse.
_STALE_KEEPALIVE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


#: Answers that send the client elsewhere (with a ``Location``).
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


def transient_status(status: int) -> bool:
    """Whether an HTTP status says the same request may succeed later: 408, 425, 429 and 5xx."""
    return status in (408, 425, 429) or status >= 500


def status_error(url: str, status: int, reason: str, detail: str = "") -> SourceError:
    """Map an unexpected HTTP status to the contract's error classes."""
    message = f"{url}: HTTP {status} {reason}".rstrip() + (f": {detail}" if detail else "")
    if status in (404, 410):
        return NotFound(message)
    if transient_status(status):
        return TransientError(message)
    return PermanentError(message)  # 401/403 (credentials), 400, 405, ...


def http_date(value: str | None) -> float:
    """Seconds since the epoch for an HTTP date, 0.0 if absent or malformed."""
    if not value:
        return 0.0
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return 0.0


class _TimedConnectMixin:
    """Connect within ``timeout`` (connect timeout), then wait ``read_timeout`` per socket op."""

    read_timeout: float
    sock: object

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock.settimeout(self.read_timeout)  # type: ignore[attr-defined]


class _HTTPConnection(_TimedConnectMixin, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_TimedConnectMixin, http.client.HTTPSConnection):
    pass


@dataclass(frozen=True)
class HttpEndpoint:
    """Where and how to connect: one scheme://host:port with timeouts, TLS and headers."""

    scheme: str
    host: str
    port: int
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    headers: Mapping[str, str] | None = None
    ssl_context: ssl.SSLContext | None = None
    proxy: ProxyConfig | None = None  #: the HTTP proxy requests go through (see :meth:`via`); None: direct

    @property
    def origin(self) -> str:
        """``scheme://host:port``, an IPv6 host in brackets (so that it joins and splits as a URL)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def open(self) -> http.client.HTTPConnection:
        """A new, not yet connected ``http.client`` connection (to the proxy, if there is one).

        Through a proxy, an https server is reached with a ``CONNECT`` tunnel (TLS
        inside it, end to end; the proxy's credentials go in the CONNECT only), a
        plain-http one with absolute-URI requests to the proxy (:meth:`request_target`).
        """
        host, port = (self.proxy.host, self.proxy.port) if self.proxy is not None else (self.host, self.port)
        if self.scheme == "https":
            conn: http.client.HTTPConnection = _HTTPSConnection(
                host, port, timeout=self.connect_timeout, context=self.ssl_context
            )
            if self.proxy is not None:
                conn.set_tunnel(self.host, self.port, headers=self.proxy.headers)
        else:
            conn = _HTTPConnection(host, port, timeout=self.connect_timeout)
        conn.read_timeout = self.read_timeout  # type: ignore[attr-defined]
        return conn

    def via(self, proxy: ProxyConfig) -> HttpEndpoint:
        """This server, reached through ``proxy``: a plain-http request carries the proxy's
        ``Proxy-Authorization`` itself; through an https tunnel only the CONNECT does."""
        headers = {**(self.headers or {}), **proxy.headers} if self.scheme == "http" else self.headers
        return dataclasses.replace(self, headers=headers, proxy=proxy)

    def request_target(self, target: str) -> str:
        """What the request line names for ``target`` (a path and query): the absolute URI
        when a plain-http request goes through a proxy, else ``target`` itself."""
        if self.proxy is not None and self.scheme == "http":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"http://{host}:{self.port}{target}"
        return target

    def with_address(self, scheme: str, host: str, port: int) -> HttpEndpoint:
        """The same timeouts and TLS settings for another server (a redirect target).

        The headers (credentials among them) go along only where the origin stays
        the same: another host never sees them.
        """
        headers = self.headers if (scheme, host, port) == (self.scheme, self.host, self.port) else None
        endpoint = HttpEndpoint(scheme, host, port, self.connect_timeout, self.read_timeout, headers, self.ssl_context)
        return endpoint.via(self.proxy) if self.proxy is not None else endpoint  # through the same proxy

    def with_headers(self, headers: Mapping[str, str]) -> HttpEndpoint:
        """This endpoint with ``headers`` sent on every request too (credentials: :meth:`with_address`,
        and so :meth:`at` and :func:`request_following`, send them to this origin only)."""
        return dataclasses.replace(self, headers={**(self.headers or {}), **headers})

    def at(self, url: str) -> tuple[HttpEndpoint, str]:
        """``(endpoint, target)`` for an absolute ``http(s)`` URL: :meth:`with_address` of its
        scheme, host and port, and its path and query as the request target.

        PermanentError for another scheme, no host or a bad port (the message shows
        the URL through :func:`~bootseer.fetch.sources.redact_url`).
        """
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise PermanentError(f"{redact_url(url)!r}: not an http or https URL")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise PermanentError(f"{redact_url(url)!r}: bad port") from None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return self.with_address(scheme, parts.hostname, port), target


def make_ssl_context(verify: bool, ca_file: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class HttpChannel:
    """One persistent HTTP connection to an endpoint.

    A request that finds the reused keep-alive socket closed by the server (before
    any byte of an answer) is sent once more on a new socket, as every HTTP client
    does; any other network failure closes the channel and raises TransientError.
    A caller must read each response's body to the end (:meth:`read_body`,
    :meth:`read_exact`) or :meth:`close` the channel.  Messages never show the
    request's query (it may carry a token).
    """

    def __init__(self, endpoint: HttpEndpoint) -> None:
        self.endpoint = endpoint
        self._conn: http.client.HTTPConnection | None = None
        self._reused = False
        self._aborted = False  # :meth:`abort` was called during the request in progress
        self._target = ""  # of the last request, for messages

    def request(self, method: str, target: str, headers: Mapping[str, str] | None = None) -> http.client.HTTPResponse:
        all_headers = {**(self.endpoint.headers or {}), **(headers or {})}
        self._target = target
        self._aborted = False
        for _attempt in range(2):
            if self._conn is None:
                self._conn = self.endpoint.open()
                self._reused = False
            # Our own reference: close() from another thread drops ``self._conn`` at any moment,
            # and the call on it must then fail as a network error, not on None.
            conn, reused = self._conn, self._reused
            try:
                conn.request(method, self.endpoint.request_target(target), headers=all_headers)
                response = conn.getresponse()
            except _STALE_KEEPALIVE as exc:
                self.close()
                if reused and not self._aborted:  # an abort looks the same: it is not sent again
                    continue
                raise TransientError(f"{self.where}: {method} failed: {exc!r}") from None
            except NETWORK_ERRORS as exc:
                self.close()
                raise TransientError(f"{self.where}: {method} failed: {exc!r}") from None
            self._reused = True
            return response
        raise AssertionError("unreachable")

    def read_body(self, response: http.client.HTTPResponse, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes of it in memory.

        A body announced (``Content-Length``) or found longer than ``limit`` raises
        PermanentError, and the channel is closed rather than drained.  A body cut
        short raises TransientError (and closes the channel).
        """
        try:
            # http.client's remaining length: the Content-Length, 0 for HEAD/204/304,
            # None for a chunked body or one that ends with the connection.
            if response.length is not None and response.length > limit:
                self.close()
                raise PermanentError(f"{self.where}: response of {response.length} bytes exceeds {limit}")
            body = response.read(limit + 1)
            if len(body) > limit:
                self.close()
                raise PermanentError(f"{self.where}: response exceeds {limit} bytes")
            return body
        except (http.client.IncompleteRead, *NETWORK_ERRORS) as exc:
            self.close()
            raise TransientError(f"{self.where}: connection lost while reading the response: {exc!r}") from None

    def read_exact(self, response: http.client.HTTPResponse, length: int) -> bytes:
        """A body of exactly ``length`` bytes (the range asked for).

        A ``Content-Length`` that says otherwise is refused (PermanentError) before
        a byte of the body is read; a body cut short raises TransientError.
        """
        if response.length is not None and response.length != length:
            self.close()
            raise PermanentError(f"{self.where}: Content-Length {response.length} for a range of {length} bytes")
        body = self.read_body(response, limit=length)
        if len(body) != length:
            self.close()
            raise TransientError(f"{self.where}: connection lost after {len(body)} of {length} bytes")
        return body

    @property
    def where(self) -> str:
        """The URL of the last request without its query, for messages."""
        return self.endpoint.origin + self._target.partition("?")[0]

    def discard(self, response: http.client.HTTPResponse) -> bytes:
        """Read a short (error) body, or drop the connection if it is long; returns what was read."""
        announced = response.getheader("Content-Length")
        if announced is None or not announced.isdigit() or int(announced) > MAX_ERROR_BODY_BYTES:
            self.close()
            return b""
        return self.read_body(response, limit=MAX_ERROR_BODY_BYTES)

    def abort(self) -> None:
        """From another thread: end the request in progress, which fails (TransientError) rather
        than being sent again on a new connection as a closed keep-alive's would be."""
        self._aborted = True
        self.close()

    def close(self) -> None:
        """Close the connection; from another thread, this aborts a read blocked on it.

        close() alone leaves a thread blocked in recv() waiting for the read timeout;
        shutdown() wakes it at once."""
        conn = self._conn
        if conn is not None:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected (any more): nothing to wake
            conn.close()
            self._conn = None


class ChannelPool:
    """Idle channels for metadata requests made from many threads at once."""

    def __init__(self, endpoint: HttpEndpoint, max_idle: int = 4) -> None:
        self.endpoint = endpoint
        self.max_idle = max_idle
        self._idle: list[HttpChannel] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def channel(self) -> Iterator[HttpChannel]:
        """A channel, returned to the pool if the block succeeds, closed if it raises.

        A channel is returned even after a SourceError that left it usable (an HTTP
        404 read to the end); the channel itself closes on network failures.
        """
        with self._lock:
            chan = self._idle.pop() if self._idle else HttpChannel(self.endpoint)
        try:
            yield chan
        except BaseException as exc:
            if not isinstance(exc, (NotFound, NotADirectory)):
                chan.close()
            self._give_back(chan)
            raise
        self._give_back(chan)

    def _give_back(self, chan: HttpChannel) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(chan)
                return
        chan.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for chan in idle:
            chan.close()


# -- requests that follow redirects ----------------------------------------------------


class RedirectRefused(PermanentError):
    """A redirect that must not be followed: from https to plain http, unless the caller allows it."""


class HttpExchange:
    """A response and the channel it came on, closed together (:func:`request_following`'s answer).

    Read its body whole and bounded (:meth:`read_body`) or as a stream (:meth:`read`),
    then :meth:`close` it; a network failure while reading raises TransientError and
    closes the channel.  :attr:`url` is where the response came from, after redirects
    (it may carry a signature in its query: show it through ``redact_url``).
    """

    def __init__(self, channel: HttpChannel, response: http.client.HTTPResponse, url: str) -> None:
        self.channel, self.response, self.url = channel, response, url

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def reason(self) -> str:
        return self.response.reason

    def header(self, name: str) -> str | None:
        return self.response.getheader(name)

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes of the body (all of it for -1); ``b""`` at its end, and only there.

        A body that ends before its ``Content-Length`` raises TransientError (``http.client``
        would report that end as the end of the body when asked for ``size`` bytes)."""
        remaining = self.response.length  # None: chunked, or ends with the connection
        try:
            data = self.response.read(size) if size >= 0 else self.response.read()
        except (http.client.IncompleteRead, *NETWORK_ERRORS) as exc:
            self.channel.close()
            raise TransientError(f"{self.channel.where}: connection lost while reading the response: {exc!r}") from None
        if not data and size != 0 and remaining:
            self.channel.close()
            raise TransientError(f"{self.channel.where}: connection lost with {remaining} bytes of the body to come")
        return data

    def read_body(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (:meth:`HttpChannel.read_body`: PermanentError beyond)."""
        return self.channel.read_body(self.response, limit)

    def close(self) -> None:
        try:
            self.response.close()
        finally:
            self.channel.close()


def request_following(
    endpoint: HttpEndpoint, method: str, target: str, headers: Mapping[str, str] | None = None, *,
    max_redirects: int, allow_downgrade: bool = False,
) -> HttpExchange:  # fmt: skip
    """``method target`` at ``endpoint``, following up to ``max_redirects`` redirects.

    Each hop goes on a new channel to the endpoint of its ``Location``
    (:meth:`HttpEndpoint.at`: the same timeouts, TLS context and proxy), so the
    endpoint's own headers, credentials among them, go along only while the origin
    (scheme, host, port) stays the same: as soon as a hop leaves it, as blob
    redirects to object storage or a CDN normally do (their URLs carry their own
    signature), they are dropped for good.  ``headers`` go to every hop.  A redirect
    from https to plain http raises :class:`RedirectRefused` unless ``allow_downgrade``
    (it would send the request, and what it names, in clear text); more redirects
    than ``max_redirects`` raise PermanentError; a network failure raises
    TransientError.  The last answer (anything but a redirect with a ``Location``)
    comes back open, whatever its status.
    """
    first = endpoint.origin + target
    for _hop in range(max_redirects + 1):
        channel = HttpChannel(endpoint)
        response = channel.request(method, target, headers)
        here = endpoint.origin + target
        location = response.getheader("Location") if response.status in REDIRECT_STATUSES else None
        if not location:
            return HttpExchange(channel, response, here)
        channel.close()
        there = urljoin(here, location)
        next_endpoint, target = endpoint.at(there)
        if endpoint.scheme == "https" and next_endpoint.scheme == "http" and not allow_downgrade:
            raise RedirectRefused(
                f"refusing a redirect from {redact_url(here)} to {redact_url(there)} (https to plain http)"
            )
        endpoint = next_endpoint
    raise PermanentError(f"{redact_url(first)}: more than {max_redirects} redirects")


# -- directory indexes ---------------------------------------------------------------


class _LinkParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(value for name, value in attrs if name == "href" and value)


def index_links(page: str, dir_url: str) -> list[tuple[str, bool]]:
    """``(name, is_dir)`` for each link of an HTML index that names a direct child of ``dir_url``."""
    parser = _LinkParser()
    parser.feed(page)
    base = urlsplit(dir_url)
    found: dict[str, bool] = {}
    for href in parser.hrefs:
        target = urlsplit(urljoin(dir_url, href))
        if (target.scheme, target.netloc) != (base.scheme, base.netloc) or target.query:
            continue  # another site, or a sort link such as Apache's "?C=N;O=D"
        path = unquote(target.path)
        prefix = unquote(base.path)
        if not path.startswith(prefix):
            continue  # the parent directory, or an absolute link elsewhere
        rest = path[len(prefix):]
        is_dir = rest.endswith("/")
        name = rest[:-1] if is_dir else rest
        if valid_name(name):
            found[name] = is_dir
    return sorted(found.items())


def parse_json_index(body: bytes, url: str) -> list[Entry]:
    """Entries of an nginx ``autoindex_format json`` listing.

    A malformed listing (not JSON, not a list) raises PermanentError; a malformed
    item (no usable name: not valid Unicode, ``..``, a ``/``; a file without a
    usable size) is skipped with a warning, so one bad entry never hides the rest.
    """
    try:
        items = json.loads(body)
    except ValueError as exc:
        raise PermanentError(f"{url}: malformed JSON directory index: {exc}") from None
    if not isinstance(items, list):
        raise PermanentError(f"{url}: JSON directory index is not a list")
    entries = []
    for item in items:
        if not isinstance(item, dict) or not valid_name(item.get("name")):
            log.warning("skipping malformed directory index item", url=url, item=ascii(item)[:200])
            continue
        kind = item.get("type")
        if kind not in ("file", "directory"):
            continue  # nginx's "other": sockets, devices
        if kind == "directory":
            entries.append(Entry(name=item["name"], size=0, is_dir=True, mtime=http_date(item.get("mtime"))))
            continue
        size = item.get("size")
        # bool is an int to Python, not a size to anyone.
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            log.warning("skipping directory index item with a bad size", url=url, name=item["name"],
                        size=ascii(size)[:100])  # fmt: skip
            continue
        mtime = item.get("mtime")
        version = http_version(size, mtime if isinstance(mtime, str) else None, None)
        entries.append(Entry(name=item["name"], size=size, is_dir=False, mtime=http_date(mtime), version=version))
    return sorted(entries, key=lambda entry: entry.name)


# -- the source ----------------------------------------------------------------------

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")
_UNSATISFIED_RANGE = re.compile(r"bytes\s+\*/(\d+)\s*$")


def strong_etag(etag: str | None) -> str | None:
    """``etag`` if it is a strong entity tag, None for a weak one (``W/"..."``) or none.

    Only a strong tag names exact bytes: a weak one may stay the same across a
    rewrite, and If-Range must not carry it (RFC 9110, 13.1.5)."""
    if etag and not etag.startswith("W/") and len(etag) >= 2 and etag[0] == etag[-1] == '"':
        return etag
    return None


def _date_etag(etag: str, modified: float, size: int) -> bool:
    """Whether ``etag`` says no more than the date and size (nginx's ``"<mtime hex>-<size hex>"``)."""
    return etag == f'"{int(modified):x}-{size:x}"'


def http_version(size: int, last_modified: str | None, etag: str | None) -> str:
    """The :attr:`Entry.version` of a file from its validators: the strongest the server gives.

    ``etag:<size>:<strong ETag>`` where there is a strong ETag that says more than
    the date (a server that hashes the content, or counts rewrites); otherwise
    ``lm:<Last-Modified second>:<size>`` where there is a date (nginx's ETag is
    exactly that date and size, and its JSON index gives the date, so a listing and
    a stat of the same file agree); ``size:<size>`` where there is neither (then
    only the size is checked).
    """
    modified = http_date(last_modified)
    tag = strong_etag(etag)
    if tag and not (modified and _date_etag(tag, modified, size)):
        return f"etag:{size}:{tag}"
    if modified:
        return f"lm:{int(modified)}:{size}"
    return f"size:{size}"


@dataclass(frozen=True)
class _Version:
    """What a read checks for a version made by :func:`http_version`."""

    size: int
    last_modified: str | None  #: the HTTP date, compared with Last-Modified (and If-Range without an ETag)
    etag: str | None  #: the strong ETag: sent as If-Range, and every answer must carry exactly it

    @classmethod
    def parse(cls, version: str, where: str) -> _Version:
        kind, _, rest = version.partition(":")
        first, _, second = rest.partition(":")
        try:
            if kind == "lm":
                return cls(int(second), email.utils.formatdate(int(first), usegmt=True), None)
            if kind == "etag" and strong_etag(second):
                return cls(int(first), None, second)
            if kind == "size" and not second:
                return cls(int(first), None, None)
        except (ValueError, OverflowError):
            pass
        raise Changed(f"{where}: {version!r} is not a version this source made")

    def pinned(self, etag: str) -> _Version:
        """This version with the strong ETag its first answer carried: later answers must carry it too."""
        return _Version(self.size, self.last_modified, etag)

    @property
    def if_range(self) -> str | None:
        return self.etag or self.last_modified

    def mismatch(self, response: http.client.HTTPResponse) -> str | None:
        """What in ``response``'s validators says it is another version, if anything.

        An answer without the ETag the version is pinned to is another version as far
        as anyone can tell (RFC 9110 makes a 206 carry the ETag a 200 would)."""
        if self.last_modified is not None:
            found = response.getheader("Last-Modified")
            if found is not None and int(http_date(found)) != int(http_date(self.last_modified)):
                return f"Last-Modified {self.last_modified} -> {found}"
        if self.etag is not None:
            found = response.getheader("ETag")
            if found != self.etag:
                return f"ETag {self.etag} -> {found}"
        return None


class _EtagPins:
    """The strong ETag each date-only version (``lm:``) of a file was first read with.

    A listing may give only a date (nginx's JSON index), and a server may keep the
    date while the content and its ETag change (a rewrite within the second, coarse
    dates).  The first answer for such a version pins its ETag; every later read of
    that version sends it as If-Range and refuses an answer with another, so all the
    bytes ever served for one version (in the engine, in the kernel's page cache of
    its inode) are of one content.  Kept for the life of the source: a pin dropped
    while pages of the version may still be cached would let a read mix them.
    """

    def __init__(self) -> None:
        self._pins: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def get(self, path: str, version: str) -> str | None:
        with self._lock:
            return self._pins.get((path, version))

    def pin(self, path: str, version: str, etag: str) -> str:
        """The ETag ``version`` is pinned to: ``etag`` if it is the first, else the first one."""
        with self._lock:
            return self._pins.setdefault((path, version), etag)


def parse_endpoint_url(
    url: str,
    schemes: tuple[str, ...],
    *,
    connect_timeout: float,
    read_timeout: float,
    headers: Mapping[str, str] | None,
    verify: bool,
    ca_file: str | None,
    default_ports: Mapping[str, int],
    transport: Mapping[str, str] | None = None,
) -> tuple[HttpEndpoint, str, str]:
    """``(endpoint, path, query)`` of an HTTP-like URL; ValueError if malformed."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        raise ValueError(f"{redact_url(url)!r}: scheme must be one of {', '.join(schemes)}")
    if not parts.hostname:
        raise ValueError(f"{redact_url(url)!r}: no host")
    if parts.fragment:
        raise ValueError(f"{redact_url(url)!r}: a fragment has no meaning for a source URL")
    try:
        port = parts.port or default_ports[scheme]
    except ValueError as exc:
        raise ValueError(f"{redact_url(url)!r}: bad port: {exc}") from None
    if connect_timeout <= 0 or read_timeout <= 0:
        raise ValueError("connect_timeout and read_timeout must be positive")
    all_headers = dict(headers or {})
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        all_headers.setdefault("Authorization", "Basic " + base64.b64encode(credentials.encode()).decode())
    wire_scheme = (transport or {}).get(scheme, scheme)
    context = make_ssl_context(verify, ca_file) if wire_scheme == "https" else None
    endpoint = HttpEndpoint(wire_scheme, parts.hostname, port, connect_timeout, read_timeout, all_headers, context)
    return endpoint, parts.path, parts.query


class HttpSource:
    """Files under an HTTP(S) URL, read with Range requests.

    Options: ``headers`` (extra request headers, e.g. ``{"Authorization": ...}``),
    ``connect_timeout`` and ``read_timeout`` in seconds, ``verify`` (TLS
    certificate checks) and ``ca_file`` (a CA bundle for them).  A query string in
    the URL (a token) is sent with every request; ``user:password@`` in the URL
    becomes Basic authentication.

    ``proxy`` (a :class:`~bootseer.fetch.sources.http_proxy.ProxyConfig`, or its URL
    alone) sends range reads through an HTTP proxy while it is healthy, and to the
    store direct while it is not (:class:`~bootseer.fetch.sources.http_proxy.ProxyHealth`).
    Through the proxy each read asks for whole blocks of the proxy's grid
    (``block_size``, the last one cut at the file's end), one request per block,
    whatever range the engine coalesced, so that every node asks for the same ranges
    and a proxy that caches by URL and range serves them from its cache; the bytes
    outside the range are dropped.  Metadata (``HEAD``, listings) goes direct.  Any
    failure of a read through the proxy (see :mod:`.http_proxy`) redoes it direct;
    :meth:`corrupt` sets the proxy aside when bytes it served fail their caller's check.
    """

    default_streams = 16

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        verify: bool = True,
        ca_file: str | None = None,
        proxy: ProxyConfig | str | None = None,
    ) -> None:
        self.url = url
        self.endpoint, path, self.query = parse_endpoint_url(
            url,
            ("http", "https"),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            headers=headers,
            verify=verify,
            ca_file=ca_file,
            default_ports={"http": 80, "https": 443},
        )
        self.root_is_dir = path.endswith("/") or path == ""
        self.base_path = path.rstrip("/")  # as given, already %-encoded
        self.pool = ChannelPool(self.endpoint)
        self.display_url = redact_url(url)
        self.etag_pins = _EtagPins()  #: shared by all connections: a pin holds for every stream
        config = ProxyConfig(proxy) if isinstance(proxy, str) else proxy
        #: whether reads go through the proxy now; None without one
        self.proxy = (
            ProxyHealth(config, self._ping, connect_timeout=connect_timeout, probe=self._probe) if config else None
        )
        self.proxy_endpoint = self.endpoint.via(config) if config else None
        #: (path, version, offset, end) of the last range reads served through the proxy, newest last
        self._proxied: deque[tuple[str, str, int, int]] = deque(maxlen=PROXIED_MEMORY)
        self._proxied_lock = threading.Lock()
        self._probe_file: tuple[str, str] | None = None  # (path, version) last read through the proxy, or tried
        self._tls = (verify, ca_file)  # for an https ping URL

    def __repr__(self) -> str:
        return f"HttpSource({self.display_url!r})"

    def target(self, path: str, directory: bool = False) -> str:
        """The request target (path and query) for a source path."""
        parts = split_path(path)
        target = self.base_path + "".join("/" + quote(part, safe="") for part in parts)
        if directory or not target:
            target += "/"
        return target + (f"?{self.query}" if self.query else "")

    def where(self, target: str) -> str:
        """The URL of a request target for messages: no credentials, no query."""
        return self.endpoint.origin + target.partition("?")[0]

    # -- metadata -------------------------------------------------------------

    def _head(self, chan: HttpChannel, target: str) -> http.client.HTTPResponse:
        response = chan.request("HEAD", target)
        chan.read_body(response, limit=0)  # empty for HEAD; leaves the connection reusable
        return response

    def _is_slash_redirect(self, response: http.client.HTTPResponse, target: str) -> bool:
        """Whether the answer redirects ``dir`` to ``dir/``: the mark of a directory.

        Only the path is compared: behind a proxy the server often names its own
        host or port in the Location.  The redirect is never followed (the listing is
        asked of our own URL with the slash), so another origin there is harmless.
        """
        location = response.getheader("Location") or ""
        wanted = urlsplit(self.where(target))
        moved = urlsplit(urljoin(self.where(target), location))
        return unquote(moved.path) == unquote(wanted.path) + "/"

    def _file_entry(self, chan: HttpChannel, path: str, target: str, response: http.client.HTTPResponse) -> Entry:
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit():
            size = int(length)
        else:
            size = self._probe_size(chan, target)
        last_modified = response.getheader("Last-Modified")
        version = http_version(size, last_modified, response.getheader("ETag"))
        name = path.rsplit("/", 1)[-1]
        return Entry(name=name, size=size, is_dir=False, mtime=http_date(last_modified), version=version)

    def _probe_size(self, chan: HttpChannel, target: str) -> int:
        """The size of a file whose HEAD gave none, from a one-byte range's Content-Range."""
        response = chan.request("GET", target, {"Range": "bytes=0-0"})
        if response.status == 416:
            chan.discard(response)
            return 0  # an empty file
        if response.status != 206:
            chan.discard(response)
            raise PermanentError(
                f"{self.where(target)}: no Content-Length and no Range support (HTTP {response.status})"
            )
        match = _CONTENT_RANGE.match(response.getheader("Content-Range") or "")
        chan.read_exact(response, 1)
        if not match or match.group(3) == "*":
            raise PermanentError(f"{self.where(target)}: cannot tell the file's size")
        return int(match.group(3))

    def stat(self, path: str) -> Entry:
        name = path.rsplit("/", 1)[-1]
        with self.pool.channel() as chan:
            if path == "" and self.root_is_dir:
                target = self.target("", directory=True)
                response = self._head(chan, target)
                if 200 <= response.status < 300:
                    return Entry(name="", size=0, is_dir=True, mtime=http_date(response.getheader("Last-Modified")))
                raise status_error(self.where(target), response.status, response.reason)
            target = self.target(path)
            response = self._head(chan, target)
            if 200 <= response.status < 300:
                return self._file_entry(chan, path, target, response)
            if response.status in (301, 302, 303, 307, 308):
                if self._is_slash_redirect(response, target):
                    return Entry(name=name, size=0, is_dir=True, mtime=0.0)
                location = redact_url(urljoin(self.where(target), response.getheader("Location") or ""))
                raise PermanentError(
                    f"{self.where(target)}: redirected to {location!r}; "
                    "redirects to other files are not supported"
                )
            if response.status == 404:
                # Servers that do not redirect "dir" to "dir/" answer 404 for it.
                dir_target = self.target(path, directory=True)
                dir_response = self._head(chan, dir_target)
                if 200 <= dir_response.status < 300:
                    return Entry(name=name, size=0, is_dir=True, mtime=0.0)
            raise status_error(self.where(target), response.status, response.reason)

    def listdir(self, path: str) -> list[Entry]:
        if not self.stat(path).is_dir:
            raise NotADirectory(f"{self.where(self.target(path))}: not a directory")
        target = self.target(path, directory=True)
        with self.pool.channel() as chan:
            response = chan.request("GET", target)
            if response.status != 200:
                chan.discard(response)
                raise status_error(self.where(target), response.status, response.reason)
            body = chan.read_body(response, limit=MAX_LISTING_BYTES)
        content_type = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if content_type == "application/json":
            return parse_json_index(body, self.where(target))
        if content_type in ("text/html", "application/xhtml+xml"):
            return self._html_entries(path, body.decode("utf-8", "replace"), self.where(target))
        raise PermanentError(f"{self.where(target)}: cannot list a directory index of type {content_type!r}")

    def _html_entries(self, path: str, page: str, dir_url: str) -> list[Entry]:
        entries = []
        for name, is_dir in index_links(page, dir_url):
            if is_dir:
                entries.append(Entry(name=name, size=0, is_dir=True, mtime=0.0))
                continue
            try:  # an HTML index gives no reliable size: ask the file itself
                entries.append(self.stat(f"{path}/{name}" if path else name))
            except NotFound:
                continue
            except PermanentError as exc:
                # One link the server refuses (403, a redirect elsewhere, no size)
                # hides that entry, not the directory; a TransientError still fails
                # the listing, which the engine retries.
                log.warning("skipping directory index link the server refuses", url=dir_url, name=name,
                            error=str(exc))  # fmt: skip
        return entries

    def _ping(self, timeout: float) -> None:
        """One health check of the proxy (see :mod:`~bootseer.fetch.sources.http_proxy`); raises unless healthy."""
        assert self.proxy is not None
        config = self.proxy.config
        if config.ping_url:
            verify, ca_file = self._tls
            endpoint, path, query = parse_endpoint_url(
                config.ping_url, ("http", "https"), connect_timeout=timeout, read_timeout=timeout, headers=None,
                verify=verify, ca_file=ca_file, default_ports={"http": 80, "https": 443},
            )  # fmt: skip
            target, healthy = (path or "/") + (f"?{query}" if query else ""), range(200, 300)
        else:
            # An answer from the proxy itself that is not a failure of its own: it is up and speaks
            # HTTP (tinyproxy and squid answer a request that names no site with a 4xx page).  With
            # its credentials: a 407 then says they are refused, and reads through it would be.
            endpoint = HttpEndpoint("http", config.host, config.port, timeout, timeout, headers=config.headers)
            target, healthy = "/", range(100, 500)
        chan = HttpChannel(endpoint)
        try:
            response = chan.request("GET", target)
            chan.discard(response)
        finally:
            chan.close()
        if response.status not in healthy or (not config.ping_url and response.status == 407):
            raise TransientError(f"health check {chan.where}: HTTP {response.status} {response.reason}".rstrip())

    def _probe(self, timeout: float) -> None:
        """The range probe a proxy that is down must pass (see :mod:`~bootseer.fetch.sources.http_proxy`):
        the first :data:`PROBE_BYTES` of the last file read (or tried) through it, through the proxy
        (its first grid block, a whole answer) and direct, each within ``timeout``, must be the same
        bytes; raises unless they are."""
        if self._probe_file is None:
            return  # nothing read through the proxy yet: its ping says all there is to know
        path, version = self._probe_file
        probe = HttpConnection(self, timeout=timeout)
        try:
            through = probe.read_on(probe.proxied, path, 0, PROBE_BYTES, version)
            direct = probe.read_on(probe.channel, path, 0, PROBE_BYTES, version)
        finally:
            probe.close()
        if through != direct:
            raise TransientError(f"range probe of {self.where(self.target(path))}: the proxy's bytes are not the store's")

    def reading_through_proxy(self, path: str, version: str) -> None:
        """A read of ``path`` (``version``) goes through the proxy now: the range probe's file from now on."""
        self._probe_file = (path, version)

    def served_by_proxy(self, path: str, version: str, offset: int, length: int) -> None:
        """Remember a range read the proxy served (for :meth:`corrupt` and the range probe)."""
        with self._proxied_lock:
            self._proxied.append((path, version, offset, offset + length))

    def corrupt(self, path: str, offset: int, length: int, version: str = "") -> None:
        """Bytes ``offset`` to ``offset + length`` of ``path`` (``version``) that this source served
        failed their caller's verification: if the proxy served them, it is set aside (reads go
        direct, so the caller's refetch asks the store itself) until a check finds it healthy."""
        if self.proxy is None:
            return
        end = offset + length
        with self._proxied_lock:
            served = any(
                place == path and seen == version and first < end and offset < last
                for place, seen, first, last in self._proxied
            )
        if served:
            self.proxy.corrupt(f"{self.where(self.target(path))} bytes {offset}-{end - 1} through the proxy "
                               f"failed verification")  # fmt: skip

    def proxy_status(self) -> ProxyStatus | None:
        """The store proxy's state (:class:`~bootseer.fetch.source.ProxiedSource`), None without one."""
        return None if self.proxy is None else ProxyStatus(self.proxy.config.display_url, self.proxy.up)

    def connect(self) -> HttpConnection:
        return HttpConnection(self)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.pool.close()


class HttpConnection:
    """One keep-alive connection for range reads (one request at a time), and one to the proxy if there is one.

    ``timeout`` (seconds) replaces the source's connect and read timeouts (the proxy's range probe)."""

    def __init__(self, source: HttpSource, *, timeout: float | None = None) -> None:
        self.source = source
        endpoint, proxy_endpoint = source.endpoint, source.proxy_endpoint
        if timeout is not None:
            endpoint = dataclasses.replace(endpoint, connect_timeout=timeout, read_timeout=timeout)
            if proxy_endpoint is not None:
                proxy_endpoint = dataclasses.replace(proxy_endpoint, connect_timeout=timeout, read_timeout=timeout)
        self.channel = HttpChannel(endpoint)
        self.proxied: HttpChannel | None = None
        if source.proxy is not None and proxy_endpoint is not None:
            self.proxied = HttpChannel(proxy_endpoint)
            source.proxy.track(self.proxied)
        self._lock = threading.Lock()

    def read_range(self, path: str, offset: int, length: int, version: str = "") -> bytes:
        """The range, through the proxy while it is healthy, else direct.

        A read the proxy fails in any way (a network error or no whole answer in its
        read timeout; any answer but 206 and 416: a 5xx, 407, a redirect, 403, 404,
        200 with the whole file; a garbled answer) sets the proxy aside and is done
        again direct at once; one that gets another version of the file through the
        proxy (``Changed``: a stale cache) is done again direct, and raises only if the
        store says so too.
        """
        with self._lock:
            proxy = self.source.proxy
            if proxy is not None and self.proxied is not None and length > 0 and proxy.usable():
                self.source.reading_through_proxy(path, version)
                try:
                    data = self.read_on(self.proxied, path, offset, length, version)
                except Changed as exc:
                    proxy.stale(str(exc))
                except SourceError as exc:
                    # A proxy is an optimization: whatever it answers, the store may still serve the read.
                    proxy.failed(str(exc))
                else:
                    self.source.served_by_proxy(path, version, offset, len(data))
                    return data
            return self.read_on(self.channel, path, offset, length, version)

    def read_on(self, channel: HttpChannel, path: str, offset: int, length: int, version: str) -> bytes:
        """The range over ``channel``: through the proxy (:attr:`proxied`) in whole blocks of its grid, else as is."""
        check_range(offset, length)
        target = self.source.target(path)
        expected = _Version.parse(version, self.source.where(target)) if version else None
        if expected is not None:
            # The version's size bounds the read: ask only for bytes that exist.
            length = max(0, min(length, expected.size - offset))
            if expected.etag is None and (pinned := self.source.etag_pins.get(path, version)) is not None:
                expected = expected.pinned(pinned)
        if length == 0:
            return b""
        proxy = self.source.proxy
        align = proxy.config.block_size if proxy is not None and channel is self.proxied else 0
        return self._read(channel, path, version, target, offset, length, expected, align=align)

    def _read(
        self, channel: HttpChannel, path: str, version: str, target: str, offset: int, length: int,
        expected: _Version | None, *, align: int,
    ) -> bytes:  # fmt: skip
        """Bytes ``offset`` to ``offset + length`` over ``channel``, in requests of whole ``align`` blocks
        (the last one cut at the version's size) if ``align``, else in requests of the range itself."""
        chunks: list[bytes] = []
        end = offset + length
        at = offset - offset % align if align else offset  # where the next request starts
        while at < end:
            stop = at - at % align + align if align else end
            if align and expected is not None:
                stop = min(stop, expected.size)
            chunk, at_eof, etag = self._read_bounded(channel, target, at, stop - at, expected)
            if expected is not None and expected.etag is None:
                # The first strong ETag seen for a date-only version pins it (for
                # every stream: a stripe of another content fails, never mixes).
                found = strong_etag(etag)
                if found is not None:
                    pinned = self.source.etag_pins.pin(path, version, found)
                    if pinned != found:
                        raise Changed(
                            f"{self.source.where(target)}: file changed (ETag {pinned} -> {found}, "
                            f"Last-Modified unchanged); refusing to mix versions"
                        )
                    expected = expected.pinned(found)
            chunks.append(chunk[max(0, offset - at) : end - at])  # the wanted part of a whole block
            at += len(chunk)
            if at_eof:
                break
        return b"".join(chunks)

    def _read_bounded(
        self, channel: HttpChannel, target: str, offset: int, length: int, expected: _Version | None
    ) -> tuple[bytes, bool, str | None]:
        """:meth:`_read_once`, within the proxy's read timeout when ``channel`` goes through the proxy."""
        proxy = self.source.proxy
        if proxy is None or channel is not self.proxied:
            return self._read_once(channel, target, offset, length, expected)
        with proxy.deadline(channel, self.source.where(target)):
            return self._read_once(channel, target, offset, length, expected)

    def _read_once(
        self, channel: HttpChannel, target: str, offset: int, length: int, expected: _Version | None
    ) -> tuple[bytes, bool, str | None]:
        """One Range GET over ``channel``: ``(bytes, reached end of file, the answer's ETag)``."""
        where = self.source.where(target)
        route = "direct" if channel.endpoint.proxy is None else "proxy"
        REQUESTS.labels(route).inc()
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        if expected is not None and expected.if_range:
            headers["If-Range"] = expected.if_range
        response = channel.request("GET", target, headers)
        if response.status == 206:
            match = _CONTENT_RANGE.match(response.getheader("Content-Range") or "")
            if not match:
                channel.close()
                raise PermanentError(f"{where}: 206 with bad Content-Range {response.getheader('Content-Range')!r}")
            first, last = int(match.group(1)), int(match.group(2))
            total = None if match.group(3) == "*" else int(match.group(3))
            if first != offset or last < first or last > offset + length - 1:
                channel.close()
                raise PermanentError(f"{where}: asked for bytes {offset}-{offset + length - 1}, got {first}-{last}")
            if expected is not None:
                # A server may ignore If-Range: the answer's own total and validators
                # must still be those of the version.
                if total is None:
                    channel.close()
                    raise PermanentError(f"{where}: Content-Range gives no total size; cannot check the version")
                changed = expected.mismatch(response)
                if total != expected.size:
                    changed = f"size {expected.size} -> {total}"
                if changed:
                    channel.close()
                    raise Changed(f"{where}: file changed ({changed}); refusing to mix versions")
            body = channel.read_exact(response, last - first + 1)
            BYTES.labels(route).inc(len(body))
            return body, total is not None and last == total - 1, response.getheader("ETag")
        if response.status == 416:
            match = _UNSATISFIED_RANGE.match(response.getheader("Content-Range") or "")
            channel.discard(response)
            if match and expected is not None and int(match.group(1)) != expected.size:
                raise Changed(f"{where}: file changed (size {expected.size} -> {match.group(1)})")
            if match and offset >= int(match.group(1)):
                return b"", True, None
            raise PermanentError(f"{where}: range {offset}+{length} refused (HTTP 416)")
        if response.status == 412:
            channel.discard(response)
            raise Changed(f"{where}: file changed (HTTP 412 Precondition Failed)")
        if response.status == 200:
            # The whole file instead of the range: never taken for the range.  Drop
            # the connection rather than download a body that may be gigabytes.
            channel.close()
            if expected is not None:
                changed = expected.mismatch(response)
                if response.length is not None and response.length != expected.size:
                    changed = f"size {expected.size} -> {response.length}"
                if changed or ("If-Range" in headers and route == "direct"):
                    # The If-Range no longer matched (RFC 9110: then the whole, current
                    # file comes back): the file changed, even where no validator shows it.
                    # From a proxy whose validators show no change, it is the proxy that
                    # ignored the Range (a proxy gone wrong, not a stale cache).
                    raise Changed(
                        f"{where}: file changed ({changed or 'If-Range ' + headers['If-Range'] + ' not matched'}); "
                        "refusing to mix versions"
                    )
            elif response.length is not None and response.length <= offset:
                # nginx answers a range of an empty file (or past the end) with its
                # whole, shorter body: no byte of it is in the range.
                return b"", True, None
            raise PermanentError(f"{where}: server ignored the Range header (HTTP 200 with the whole file)")
        detail = channel.discard(response)[:200].decode("utf-8", "replace").strip()
        if response.status == 407 and route == "proxy":
            # The proxy's own refusal (its credentials), not the store's: a read direct may succeed.
            raise TransientError(f"{where}: the proxy refused its credentials (HTTP 407)")
        raise status_error(where, response.status, response.reason, "" if "<" in detail else detail)

    def close(self) -> None:
        # Without the lock: closing the socket is how another thread aborts a read
        # stuck on a silent server.
        self.channel.close()
        if self.proxied is not None:
            self.proxied.close()
