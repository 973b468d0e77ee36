"""Real HTTP servers over a local directory, for tests of anything that reads over HTTP.

* :class:`NginxServer` -- Debian's nginx serving a directory with Range support, a
  JSON (``autoindex_format json``) or HTML directory index, and an optional
  per-connection ``limit_rate``.  What production deployments look like.
* :class:`RangeHTTPServer` -- a small threaded Python server with the same
  behaviour (Range, HEAD, HTML index, 301 for a directory without its ``/``) that
  can inject faults: drop a connection mid-body, answer a status such as 503,
  ignore the Range header and send the whole file with ``200``, announce a huge
  ``Content-Length`` (and count what the client let it send), serve a given
  directory index, refuse a path, hold GETs of given paths until the test releases
  them, or rewrite a file between requests at the same size and date with a new
  strong ETag each time.  Over the store's own directory it is also a proxy gone
  wrong (:attr:`Faults.range_answer`): it takes absolute-URI requests as any forward
  proxy does and serves them as a proxy with every file in its cache would, except
  that every Range GET gets a corrupt body, a redirect, the whole file, a refusal
  or no answer at all, while its health check (``GET /``) still answers.

Both listen on 127.0.0.1 only.  Pytest fixtures ``nginx_factory`` and
``range_http_factory`` (defined here, offered to every test by tests/conftest.py)
start servers on demand and stop them at teardown::

    def test_read(tmp_path, nginx_factory):
        server = nginx_factory(tmp_path, limit_rate="1m")
        url = server.url + "file.bin"
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import html
import os
import posixpath
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.support.waiting import free_port

import pytest

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
START_TIMEOUT_S = 10.0


def wait_for_port(port: int, process: subprocess.Popen | None = None, timeout: float = START_TIMEOUT_S) -> None:
    """Block until something accepts on 127.0.0.1:``port``; RuntimeError if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


# -- nginx -------------------------------------------------------------------------

_NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    default_type application/octet-stream;
    client_body_temp_path {state}/tmp;
    proxy_temp_path {state}/tmp;
    fastcgi_temp_path {state}/tmp;
    uwsgi_temp_path {state}/tmp;
    scgi_temp_path {state}/tmp;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{
            autoindex on;
            autoindex_format {autoindex_format};
            {limit_rate}
        }}
    }}
}}
"""


class NginxServer:
    """nginx serving ``root`` at :attr:`url` (``http://127.0.0.1:PORT/``).

    ``autoindex_format`` is ``"json"`` or ``"html"``; ``limit_rate`` (nginx syntax,
    e.g. ``"512k"``) caps each connection's rate.
    """

    def __init__(self, root: str | os.PathLike, *, autoindex_format: str = "json", limit_rate: str | None = None):
        if autoindex_format not in ("json", "html"):
            raise ValueError(f"autoindex_format must be 'json' or 'html', not {autoindex_format!r}")
        self.root = Path(root).resolve()
        self.autoindex_format = autoindex_format
        self.limit_rate = limit_rate
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._state = Path(tempfile.mkdtemp(prefix="bootseer-nginx-"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> NginxServer:
        (self._state / "tmp").mkdir(exist_ok=True)
        for _attempt in range(5):  # another process may take the port between probe and bind
            self.port = free_port()
            conf = self._state / "nginx.conf"
            conf.write_text(
                _NGINX_CONF.format(
                    # Workers must be able to read the test's private tmp dirs.
                    user="user root;" if os.geteuid() == 0 else "",
                    state=self._state,
                    port=self.port,
                    root=self.root,
                    autoindex_format=self.autoindex_format,
                    limit_rate=f"limit_rate {self.limit_rate};" if self.limit_rate else "",
                )
            )
            self.process = subprocess.Popen(
                [NGINX, "-p", str(self._state), "-c", str(conf), "-e", str(self._state / "error.log")],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for_port(self.port, self.process)
                return self
            except RuntimeError:
                self._kill()
        log = (self._state / "error.log").read_text(errors="replace")
        self.stop()
        raise RuntimeError(f"nginx did not start; error log:\n{log}")

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: nginx's fast shutdown, workers included
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self._state, ignore_errors=True)

    def __enter__(self) -> NginxServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- Python range server with faults -----------------------------------------------


@dataclass
class Faults:
    """Faults a :class:`RangeHTTPServer` injects into its next GET responses.

    Each counter is consumed by one response that matches; they are thread-safe.
    """

    drop_after_bytes: int = 4096  #: bytes of body sent before a drop
    #: origin ("http://host:port") the directory redirects name, as a server behind a
    #: proxy does when it puts its own address in Location; None: a relative Location
    redirect_origin: str | None = None
    _drops: int = 0
    _statuses: list[int] = field(default_factory=list)
    _ignore_range: int = 0
    _hang_ups: int = 0
    _huge_lengths: int = 0
    #: bytes of body a huge-length answer managed to send before the client hung up
    huge_sent: int = 0
    huge_done: threading.Event = field(default_factory=threading.Event)
    #: (Content-Type, body) served instead of every directory index; None: the real one
    index: tuple[str, bytes] | None = None
    #: request path -> status answered to every HEAD and GET of it (say 403), until removed
    refused: dict[str, int] = field(default_factory=dict)
    #: request paths whose GETs wait for this event (see :meth:`hold`); waiting: how many wait now
    held: set[str] = field(default_factory=set)
    release: threading.Event = field(default_factory=threading.Event)
    waiting: int = 0
    #: how every Range GET is answered from now on, None: right.  "corrupt": the range with one
    #: byte in every 4 KiB of it flipped; "hang": never (until the server stops); "drip": the right
    #: answer, its body one byte every 0.1 s (each receive gets a byte in time); 200: the whole file; another
    #: status (302 to elsewhere, 403, 404): that status and no body.  Other GETs (a proxy's
    #: health check) and HEADs are answered right.
    range_answer: str | int | None = None
    #: set when the server stops: what a "hang" answer waits for
    stopping: threading.Event = field(default_factory=threading.Event)
    _rewrites: dict[str, tuple[list[bytes], bool]] = field(default_factory=dict)
    _rewrite_count: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    #: what a huge-length answer announces, and what it offers to send of it
    HUGE_LENGTH = 1 << 40
    HUGE_OFFERED = 256 << 20

    def drop(self, times: int = 1, after_bytes: int = 4096) -> None:
        """Close the next ``times`` GET connections after ``after_bytes`` of body."""
        with self._lock:
            self._drops += times
            self.drop_after_bytes = after_bytes

    def status(self, code: int, times: int = 1) -> None:
        """Answer the next ``times`` GETs with ``code`` and an empty body."""
        with self._lock:
            self._statuses.extend([code] * times)

    def ignore_range(self, times: int = 1) -> None:
        """Answer the next ``times`` Range GETs with ``200`` and the whole file."""
        with self._lock:
            self._ignore_range += times

    def hang_up(self, times: int = 1) -> None:
        """After the next ``times`` complete answers, close the keep-alive connection
        without a word, as a server does when its idle timeout expires."""
        with self._lock:
            self._hang_ups += times

    def huge_length(self, times: int = 1) -> None:
        """Announce a ``Content-Length`` of :attr:`HUGE_LENGTH` in the next ``times`` GET
        answers and offer :attr:`HUGE_OFFERED` bytes of body; :attr:`huge_sent` says
        how many the client took before hanging up (set once :attr:`huge_done` is)."""
        with self._lock:
            self._huge_lengths += times
            self.huge_done.clear()

    def hold(self, paths: set[str]) -> threading.Event:
        """Make every GET of a request path in ``paths`` (``/v1/packs/...``) wait, once it is
        received, until the returned event is set (a store that is slow for those objects,
        as long as the test wants); :attr:`waiting` counts the GETs held now."""
        with self._lock:
            self.held = set(paths)
            self.release.clear()
        return self.release

    def wait_if_held(self, path: str) -> None:
        """Block a GET of ``path`` while it is held (see :meth:`hold`)."""
        with self._lock:
            if path not in self.held or self.release.is_set():
                return
            self.waiting += 1
        try:
            self.release.wait(120)  # a test that forgets to release still ends
        finally:
            with self._lock:
                self.waiting -= 1

    def rewrite_between_requests(self, path: str, contents: list[bytes], *, honour_if_range: bool = True) -> None:
        """Serve request path ``path`` (``/f``) as ``contents[0]``, then ``contents[1]``, ...
        (the last one from then on), one per request (HEAD or GET), each with a strong ETag of its
        content (:func:`content_etag`) while ``Last-Modified`` (the file's) and the length stay
        the same: a rewrite within the same second, or a server with coarse dates.
        ``honour_if_range=False`` answers a Range with 206 whatever If-Range says."""
        if len({len(content) for content in contents}) != 1:
            raise ValueError("a same-size rewrite needs contents of one size")
        with self._lock:
            self._rewrites[path] = (list(contents), honour_if_range)
            self._rewrite_count[path] = 0

    def rewritten(self, path: str) -> tuple[bytes, str, bool] | None:
        """``(content, ETag, honour If-Range)`` for this request of ``path``, if it is rewritten."""
        with self._lock:
            if path not in self._rewrites:
                return None
            contents, honour = self._rewrites[path]
            turn = self._rewrite_count[path]
            self._rewrite_count[path] = turn + 1
        content = contents[min(turn, len(contents) - 1)]
        return content, content_etag(content), honour

    def send_huge(self, wfile, connection: socket.socket) -> None:
        """The body of a huge-length answer: zeros until the client hangs up."""
        chunk = bytes(1 << 16)
        sent = 0
        try:
            while sent < self.HUGE_OFFERED:
                wfile.write(chunk)
                sent += len(chunk)
            wfile.flush()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            self.huge_sent = sent
            self.huge_done.set()

    def send_file_range(
        self, wfile, connection: socket.socket, path: Path, offset: int, length: int, *, corrupt: bool = False
    ) -> bool:
        """Send ``length`` bytes of ``path`` from ``offset`` (``corrupt``: the first byte of every 4 KiB of
        them flipped), or, if
        a drop is armed, hang up after ``drop_after_bytes`` of them; True if the connection was dropped
        (the handler closes it)."""
        drop = self.take("drop")
        with open(path, "rb") as file:
            file.seek(offset)
            sent = 0
            while sent < length:
                chunk = file.read(min(length - sent, 1 << 16))
                if not chunk:
                    break
                if self.range_answer == "drip":
                    for at in range(len(chunk)):
                        if self.stopping.wait(0.1):
                            return True
                        wfile.write(chunk[at : at + 1])
                        wfile.flush()
                    sent += len(chunk)
                    continue
                if corrupt:
                    flipped = bytearray(chunk)
                    for at in range(-sent % 4096, len(flipped), 4096):
                        flipped[at] ^= 0x5A
                    chunk = bytes(flipped)
                if drop and sent + len(chunk) >= self.drop_after_bytes:
                    wfile.write(chunk[: max(self.drop_after_bytes - sent, 0)])
                    wfile.flush()
                    connection.shutdown(socket.SHUT_RDWR)
                    return True
                wfile.write(chunk)
                sent += len(chunk)
        return False

    def take(self, kind: str) -> int | bool:
        with self._lock:
            if kind == "status":
                return self._statuses.pop(0) if self._statuses else 0
            if kind == "drop" and self._drops:
                self._drops -= 1
                return True
            if kind == "ignore_range" and self._ignore_range:
                self._ignore_range -= 1
                return True
            if kind == "hang_up" and self._hang_ups:
                self._hang_ups -= 1
                return True
            if kind == "huge_length" and self._huge_lengths:
                self._huge_lengths -= 1
                return True
            return False


def content_etag(content: bytes) -> str:
    """The strong ETag a rewritten file is served with: a hash of its bytes, as many servers do."""
    return '"%s"' % hashlib.sha256(content).hexdigest()[:16]


_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``(first, last)`` for a single-range ``Range`` header, None if unsatisfiable.

    Raises ValueError for a header this server does not understand.
    """
    match = _RANGE.match(header.strip())
    if not match or match.groups() == ("", ""):
        raise ValueError(header)
    first_text, last_text = match.groups()
    if first_text == "":  # suffix range: the last N bytes
        length = int(last_text)
        return (max(size - length, 0), size - 1) if length and size else None
    first = int(first_text)
    last = min(int(last_text), size - 1) if last_text else size - 1
    return (first, last) if first < size and first <= last else None


class RangeRequestHandler(BaseHTTPRequestHandler):
    """Serves files of ``server.root`` with Range, HEAD, and an HTML directory index."""

    protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
    server: RangeHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def resolve(self) -> Path | None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        clean = posixpath.normpath(path)
        if ".." in clean.split("/"):
            return None
        return self.server.root / clean.lstrip("/")

    def send_empty(self, code: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self.serve(body=False)

    def do_GET(self) -> None:
        self.serve(body=True)

    def serve(self, body: bool) -> None:
        self.server.requests.append((self.command, self.path, dict(self.headers)))
        faults = self.server.faults
        if code := faults.refused.get(urllib.parse.urlsplit(self.path).path):
            self.send_empty(code)
            return
        if body and (code := faults.take("status")):
            self.send_empty(code)
            return
        if body:
            faults.wait_if_held(urllib.parse.urlsplit(self.path).path)
        wrong = faults.range_answer if body and self.headers.get("Range") else None
        if wrong == "hang":
            faults.stopping.wait(120)  # a test that forgets to stop the server still ends
            self.close_connection = True
            return
        if isinstance(wrong, int) and wrong != 200:
            self.send_empty(wrong, {"Location": "http://127.0.0.1:9/elsewhere"} if 300 <= wrong < 400 else None)
            return
        target = self.resolve()
        if target is None or not target.exists():
            self.send_empty(404)
            return
        if target.is_dir():
            if not urllib.parse.urlsplit(self.path).path.endswith("/"):
                location = urllib.parse.urlsplit(self.path).path + "/"
                self.send_empty(301, {"Location": (faults.redirect_origin or "") + location})
                return
            self.send_index(target, body)
            return
        size = target.stat().st_size
        validators = {
            "Last-Modified": email.utils.formatdate(target.stat().st_mtime, usegmt=True),
            "ETag": f'"{target.stat().st_mtime_ns:x}-{size:x}"',
            "Accept-Ranges": "bytes",
        }
        rewritten = faults.rewritten(urllib.parse.urlsplit(self.path).path)
        honour_if_range = True
        if rewritten is not None:
            content, validators["ETag"], honour_if_range = rewritten
            size = len(content)
        first, last = 0, size - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header and body and wrong != 200 and not faults.take("ignore_range"):
            if_range = self.headers.get("If-Range")
            if not honour_if_range or if_range is None or if_range in (validators["ETag"], validators["Last-Modified"]):
                try:
                    wanted = parse_range(range_header, size)
                except ValueError:
                    self.send_empty(400)
                    return
                if wanted is None:
                    self.send_empty(416, {"Content-Range": f"bytes */{size}"})
                    return
                first, last = wanted
                status = 206
        huge = body and faults.take("huge_length")
        self.send_response(status)
        for name, value in validators.items():
            self.send_header(name, value)
        if status == 206:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(faults.HUGE_LENGTH if huge else last - first + 1))
        self.end_headers()
        if huge:
            self.close_connection = True
            faults.send_huge(self.wfile, self.connection)
            return
        if not body:
            return
        if rewritten is not None:
            faults.take("drop")  # an armed drop is spent on this answer, as before
            self.wfile.write(content[first : last + 1])
            return
        if faults.send_file_range(self.wfile, self.connection, target, first, last - first + 1,
                                  corrupt=wrong == "corrupt" and status == 206):
            self.close_connection = True
            return
        if faults.take("hang_up"):
            self.wfile.flush()
            self.close_connection = True

    def send_index(self, directory: Path, body: bool) -> None:
        if self.server.faults.index is not None:
            content_type, page = self.server.faults.index
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if body:
                self.wfile.write(page)
            return
        links = ['<a href="../">../</a>']
        for child in sorted(directory.iterdir()):
            name = child.name + ("/" if child.is_dir() else "")
            links.append(f'<a href="{urllib.parse.quote(name)}">{html.escape(name)}</a>')
        page = ("<html><body><h1>Index</h1><pre>\n" + "\n".join(links) + "\n</pre></body></html>\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self.wfile.write(page)


class RangeHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server over ``root`` on 127.0.0.1 with injectable :attr:`faults`."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, root: str | os.PathLike, handler: type[BaseHTTPRequestHandler] = RangeRequestHandler):
        super().__init__(("127.0.0.1", 0), handler)
        self.root = Path(root).resolve()
        self.faults = Faults()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  #: (method, target, headers) seen
        self._thread: threading.Thread | None = None

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hangs up mid-answer is what fault tests do; say nothing.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> RangeHTTPServer:
        self._thread = threading.Thread(target=self.serve_forever, name=f"range-http-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.faults.stopping.set()
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.server_close()

    def __enter__(self) -> RangeHTTPServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SilentRangeHandler(RangeRequestHandler):
    """Answers HEAD and listings; takes a range GET and never answers it."""

    def do_GET(self) -> None:
        if self.headers.get("Range"):
            self.server.requests.append((self.command, self.path, dict(self.headers)))
            self.server.release.wait(120)  # until the test ends
            return
        super().do_GET()


def range_gets(server) -> int:
    """Range GETs ``server`` (a RangeHTTPServer) has been sent."""
    return sum(1 for method, _, headers in list(server.requests) if method == "GET" and "Range" in headers)


# -- pytest fixtures -----------------------------------------------------------------


def started_servers(server_class: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """The body of a server-factory fixture: yields ``start(root, **options)``, which
    makes and starts a ``server_class``, and stops every one it started at teardown."""
    servers: list[Any] = []

    def start(root: str | os.PathLike, **options: Any) -> Any:
        server = server_class(root, **options)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def nginx_factory() -> Iterator:
    """``nginx_factory(root, autoindex_format="json", limit_rate=None)`` -> a started NginxServer."""
    yield from started_servers(NginxServer)


@pytest.fixture
def range_http_factory() -> Iterator:
    """``range_http_factory(root)`` -> a started RangeHTTPServer (with ``.faults``)."""
    yield from started_servers(RangeHTTPServer)
