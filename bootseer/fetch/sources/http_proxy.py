"""An HTTP proxy in front of an HTTP(S) store: its settings, its health and the fallback to the store direct.

A node can read its store through a caching HTTP proxy (Dragonfly's dfdaemon, squid,
nginx, or any forward proxy), the shape of nydus's ``backend.config.proxy``.  This
module is what :class:`~bootseer.fetch.sources.http.HttpSource` needs beside its own
requests: :class:`ProxyConfig`, the checked settings (``[store] proxy``,
``bootseer layer-server --store-proxy``), and :class:`ProxyHealth`, which says for
each range read whether it goes through the proxy.

Health: a proxy is an optimization, never a reason for a read to fail.  It is taken
as healthy until a read through it goes wrong in any way (a network error; any
answer but ``206`` or ``416``, ``200`` with the whole file, a redirect, ``403`` and
``404`` included; a garbled answer; no answer within ``read_timeout`` per grid
block; a CONNECT it refuses), a block it served fails the reader's SHA-256 check
(:meth:`ProxyHealth.corrupt`, through ``RangeSource.corrupt``), or a health check
fails; that read is done again direct and from then on every read goes to the store
direct.  A checker thread, from the first read on, checks the proxy every
``check_interval`` seconds, up or down (up: a proxy that hangs is found so): with
``ping_url`` a ``GET`` of that URL (made direct, not through the proxy; healthy: a
2xx answer, as dfdaemon's ``/server/ping`` gives), without one a ``GET /`` of the
proxy itself (healthy: an HTTP answer but 5xx and 407: tinyproxy and squid answer a
request that names no site with an error page, which still shows that the proxy is
up and answering).  A proxy that is down must also pass a range probe before reads
go back to it: the first bytes of the last file read through it, asked through the
proxy (a ``206`` with the right ``Content-Range`` and version, within the check's
timeout) and direct, must be the same bytes.  Each turn is one log line, never one
per request; a check that finds the proxy down also closes the connections to it,
so reads stuck on a proxy that hangs are retried direct rather than waiting out
their read timeout.

The proxy's URL may carry credentials (``http://user:password@proxy:3128``, sent
as ``Proxy-Authorization``): :attr:`ProxyConfig.display_url` and every message show
it through :func:`~bootseer.fetch.sources.redact_url`, and its ``repr`` hides it.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol
from urllib.parse import unquote, urlsplit

import prometheus_client

from bootseer.fetch.source import TransientError
from bootseer.fetch.sources import carries_secret, redact_url
from bootseer.log import get_logger

log = get_logger(__name__)

DEFAULT_CHECK_INTERVAL = 5.0  #: seconds between health checks (nydus's default ``check_interval``)
#: The least a health check waits for its answer, whatever the interval: checks run one after another,
#: so a slow answer only delays the next; at 0.2 s a healthy proxy's ping on a loaded 2-core machine
#: missed it, and the proxy was set aside (found by CI, twice).
MIN_PING_TIMEOUT = 1.0
#: Seconds a request of one grid block through the proxy may take, all of it (connect, head, body): a
#: proxy on or near the node sends 1 MiB in milliseconds, and fetches it from the store on a miss in well
#: under a second; past this the read is done direct.  Raise it with a large ``block_size`` or a slow store.
DEFAULT_READ_TIMEOUT = 5.0
#: The grid of range requests through the proxy: one raw block of a layer (blockstore.objects.format's default)
#: compresses to at most about this, so a block costs at most two of these over the node's link.
DEFAULT_BLOCK_SIZE = 1 << 20
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 64 << 20

REQUESTS = prometheus_client.Counter(
    "bootseer_fetch_http_requests",
    "Range requests to HTTP(S) stores, by route (proxy: through the store proxy; direct: to the store)",
    ["route"],
)
BYTES = prometheus_client.Counter(
    "bootseer_fetch_http_bytes",
    "Body bytes of range answers from HTTP(S) stores, by route (through the proxy: whole proxy blocks)",
    ["route"],
)
PROXY_UP = prometheus_client.Gauge(
    "bootseer_fetch_proxy_up", "1 while reads go through the store proxy, 0 while it is down and reads go direct",
    ["proxy"],
)  # fmt: skip
FALLBACKS = prometheus_client.Counter(
    "bootseer_fetch_proxy_fallbacks",
    "Turns from the store proxy to the store direct, by cause (request: a read through it failed or took longer "
    "than its read timeout; corrupt: a block it served failed verification; check: a health check failed; stale: "
    "one read got another version of its file through the proxy and was done again direct)",
    ["cause"],
)
for _route in ("proxy", "direct"):
    REQUESTS.labels(_route)
    BYTES.labels(_route)
for _cause in ("request", "corrupt", "check", "stale"):
    FALLBACKS.labels(_cause)


@dataclass(frozen=True)
class ProxyConfig:
    """The settings of a store proxy, checked when made: ValueError, one line, for a setting that cannot work.

    ``url`` is ``http://[user:password@]host:port`` (an HTTP proxy: a plain-http store is
    asked through it with absolute-URI requests, an https store through a ``CONNECT``
    tunnel); ``ping_url`` is the health check's URL ("" for a ``GET /`` of the proxy);
    ``block_size`` is the grid that range requests through the proxy are aligned to;
    ``read_timeout`` the seconds one request of a grid block through the proxy may
    take in all (past it the read is done direct and the proxy set aside).
    """

    url: str = field(repr=False)
    ping_url: str = ""
    check_interval: float = DEFAULT_CHECK_INTERVAL
    block_size: int = DEFAULT_BLOCK_SIZE
    read_timeout: float = DEFAULT_READ_TIMEOUT

    def __post_init__(self) -> None:
        shown = redact_url(self.url) if "://" in self.url else self.url
        if not self.url:
            raise ValueError("empty proxy URL")
        parts = urlsplit(self.url)
        scheme = parts.scheme.lower() if "://" in self.url else ""
        if scheme != "http":
            raise ValueError(
                f"proxy URL {shown!r}: scheme {scheme!r} is not http:// (an HTTP proxy; "
                "https:// stores are read through it with CONNECT)"
            )
        if not parts.hostname:
            raise ValueError(f"proxy URL {shown!r} names no host (http://HOST:PORT)")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"proxy URL {shown!r} has a bad port: {exc}") from None
        if port is None:
            raise ValueError(f"proxy URL {shown!r} names no port (http://HOST:PORT)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"proxy URL {shown!r}: a proxy is a host and port; it takes no path, query or fragment")
        if self.ping_url:
            ping = urlsplit(self.ping_url)
            if ping.scheme.lower() not in ("http", "https") or not ping.hostname:
                raise ValueError(f"proxy ping URL {redact_url(self.ping_url)!r}: expected http(s)://HOST[:PORT]/PATH")
            if carries_secret(self.ping_url):
                raise ValueError(f"proxy ping URL {redact_url(self.ping_url)!r}: a health check takes no credentials")
        if not (isinstance(self.check_interval, (int, float)) and 0 < self.check_interval < math.inf):
            raise ValueError(f"proxy check interval must be a positive number of seconds, not {self.check_interval!r}")
        if not (isinstance(self.read_timeout, (int, float)) and 0 < self.read_timeout < math.inf):
            raise ValueError(f"proxy read timeout must be a positive number of seconds, not {self.read_timeout!r}")
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"proxy block size must be {MIN_BLOCK_SIZE >> 10}K to {MAX_BLOCK_SIZE >> 20}M, not {self.block_size}"
            )

    @property
    def display_url(self) -> str:
        """The proxy's URL without its credentials: for logs, messages and the health gauge's label."""
        return redact_url(self.url).rstrip("/")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    @property
    def headers(self) -> dict[str, str]:
        """``Proxy-Authorization`` for the URL's ``user:password@``, else nothing."""
        parts = urlsplit(self.url)
        if parts.username is None:
            return {}
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        return {"Proxy-Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()}


class _Closable(Protocol):
    def close(self) -> None: ...

    def abort(self) -> None:
        """From another thread: end the request in progress on it, which then fails (never sent again)."""


class _Watchdog:
    """Aborts requests through the proxy that pass their deadline: one thread for every request of a proxy.

    :meth:`arm` before a request, :meth:`disarm` after it (returns whether it was
    aborted).  Timeouts on the socket bound each receive, not the request: a proxy
    that sends a byte now and then would hold a read for as long as it likes.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, _Closable]] = {}
        self._fired: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, channel: _Closable, seconds: float) -> int:
        with self._cond:
            number = next(self._ids)
            self._armed[number] = (time.monotonic() + seconds, channel)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return number

    def disarm(self, number: int) -> bool:
        """Forget request ``number``; True if its deadline passed and it was aborted."""
        with self._cond:
            self._armed.pop(number, None)
            fired = number in self._fired
            self._fired.discard(number)
            return fired

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for number, (when, channel) in list(self._armed.items()):
                    if when <= now:
                        # Under the lock: a request that ended and a new one on the same
                        # channel cannot be aborted for the deadline of the one before.
                        del self._armed[number]
                        self._fired.add(number)
                        channel.abort()
                soonest = min((when for when, _channel in self._armed.values()), default=None)
                self._cond.wait(None if soonest is None else max(soonest - now, 0.0))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class ProxyHealth:
    """Whether reads go through the proxy now: the state, its checker thread and its metrics (module docstring).

    ``ping(timeout)`` is one health check: it returns if the proxy is healthy and
    raises (any exception, its message the reason) if not.  ``probe(timeout)`` is the
    range probe a proxy that is down must pass too (same contract; it returns at once
    when there is nothing to probe yet).  The checker thread starts with the first
    :meth:`usable` and ends with :meth:`close`.
    """

    def __init__(
        self, config: ProxyConfig, ping: Callable[[float], None], *, connect_timeout: float,
        probe: Callable[[float], None] | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self._ping = ping
        self._probe = probe
        #: a check waits at most this long: the interval, but never less than MIN_PING_TIMEOUT (a short
        #: interval on a loaded node must not set a healthy proxy aside), nor longer than a connect may take
        self.ping_timeout = min(max(config.check_interval, MIN_PING_TIMEOUT), connect_timeout)
        self._up = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stale_logged = False
        self._channels: weakref.WeakSet[_Closable] = weakref.WeakSet()  # connections to the proxy, to abort
        self._watchdog = _Watchdog(f"proxy deadlines {config.display_url}")
        self._gauge = PROXY_UP.labels(config.display_url)
        self._gauge.set(1)

    @property
    def up(self) -> bool:
        return self._up

    def usable(self) -> bool:
        """Whether the next read goes through the proxy (and the checker runs from now on)."""
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(
                        target=self._check_loop, name=f"proxy check {self.config.display_url}", daemon=True
                    )
                    self._thread.start()
        return self._up

    def track(self, channel: _Closable) -> None:
        """Close ``channel`` (a connection to the proxy) when the proxy is found down, aborting its read."""
        with self._lock:
            self._channels.add(channel)

    @contextlib.contextmanager
    def deadline(self, channel: _Closable, where: str) -> Iterator[None]:
        """Bound one request over ``channel`` (to the proxy) by :attr:`ProxyConfig.read_timeout`, all of it.

        Past it the request is aborted and fails with TransientError saying so (the
        caller then reads direct and calls :meth:`failed`)."""
        number = self._watchdog.arm(channel, self.config.read_timeout)
        try:
            yield
        except TransientError:
            if self._watchdog.disarm(number):
                raise TransientError(
                    f"{where}: no whole answer through the proxy in its read timeout ({self.config.read_timeout:g}s)"
                ) from None
            raise
        finally:
            self._watchdog.disarm(number)

    def failed(self, reason: str) -> None:
        """A read through the proxy failed: reads go direct until a check finds it healthy."""
        self._turn(False, reason, cause="request")

    def corrupt(self, reason: str) -> None:
        """Bytes a read got through the proxy failed the caller's verification: reads go direct
        until a check finds it healthy (its range probe included)."""
        self._turn(False, reason, cause="corrupt")

    def stale(self, reason: str) -> None:
        """A read through the proxy got another version of its file; it is done again direct, the proxy kept.

        Logged as a warning the first time, then at debug level (the metric counts each)."""
        FALLBACKS.labels("stale").inc()
        level, self._stale_logged = ("debug" if self._stale_logged else "warning"), True
        getattr(log, level)("the store proxy gave another version of a file; that read goes direct",
                            proxy=self.config.display_url, reason=reason)  # fmt: skip

    def check(self) -> bool:
        """One health check now; the state follows it.  Returns whether the proxy is healthy.

        A proxy that is down must pass the range probe too: answering its ping says
        nothing of what it answers to a range (a hang, a redirect, garbled bytes)."""
        try:
            self._ping(self.ping_timeout)
            if not self._up and self._probe is not None:
                self._probe(self.ping_timeout)
        except Exception as exc:  # noqa: BLE001 - whatever the check raises, the proxy is not usable
            self._turn(False, str(exc) or repr(exc), cause="check")
            # Every failed check, not only the turn: a read that chose the proxy just before the
            # turn may have connected to it after the turn closed what was open then.
            self._abort_reads()
            return False
        self._turn(True, "", cause="check")
        return True

    def _check_loop(self) -> None:
        while not self._stop.wait(self.config.check_interval):
            self.check()

    def _turn(self, healthy: bool, reason: str, *, cause: str) -> None:
        with self._lock:
            if self._up == healthy or self._closed:
                return
            self._up = healthy
        self._gauge.set(1 if healthy else 0)
        if healthy:
            log.info("store proxy healthy again; reading through it", proxy=self.config.display_url)
            return
        FALLBACKS.labels(cause).inc()
        log.warning("store proxy down; reading the store direct until a health check finds it healthy",
                    proxy=self.config.display_url, cause=cause, reason=reason)  # fmt: skip
        self._abort_reads()

    def _abort_reads(self) -> None:
        """Abort every request to the proxy: a read stuck on a proxy that hangs fails now, and is done direct."""
        with self._lock:
            channels = list(self._channels)
        for channel in channels:
            channel.abort()

    def close(self) -> None:
        """Stop the checker (waiting for a check in progress, bounded by :attr:`ping_timeout`) and the watchdog."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        self._watchdog.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.ping_timeout + 1)


__all__ = ["BYTES", "DEFAULT_BLOCK_SIZE", "DEFAULT_CHECK_INTERVAL", "DEFAULT_READ_TIMEOUT", "FALLBACKS", "MIN_PING_TIMEOUT", "PROXY_UP", "REQUESTS",
           "ProxyConfig", "ProxyHealth"]  # fmt: skip
