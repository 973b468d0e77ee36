"""The store proxy (issue 16): http(s) store reads through a real HTTP proxy, its health check and the direct fallback.

The proxy is Debian's tinyproxy, started by each test on a free 127.0.0.1 port with its
own config and log in a temp dir (never the package's system service).  Its outgoing
connections leave from 127.0.0.2 (``Bind``) and carry its ``Via`` header, so the
store, a :class:`~tests.support.http.RangeHTTPServer` that records each request's
client address, tells a request the proxy relayed from one the node made direct.

Shown: a layer server's blocks read through the proxy (in the proxy's log and coming
from it at the store), every byte verified; the proxy stopped mid-run, then restarted:
reads go direct with no EIO and no wrong byte, and back through the proxy once its
health check passes, with one log line per turn; a proxy that hangs and a ping URL
that fails turn reads direct; an https store read through a CONNECT tunnel; ranges
through the proxy aligned to its block grid, so that a caching proxy (Debian's nginx
with ``proxy_cache`` keyed by URL and range) serves a second node the blocks a first
one fetched, whatever ranges each asked for; a proxy's credentials never in argv,
logs or status; bad proxy settings refused at start-up in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from bootseer.blockstore.server.client import ServerSettings, ensure_server

from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.format import max_stored_length
from bootseer.blockstore.objects.format import BlockPlace
from bootseer.blockstore.peers.config import PeerConfig
from bootseer.fetch.sources import open_source
from bootseer.fetch.sources.http import HttpSource
from bootseer.fetch.sources.http_proxy import ProxyConfig, ProxyHealth
from tests.support.daemon import BINARY
from tests.support.http import RangeHTTPServer, RangeRequestHandler, range_gets, wait_for_port
from tests.support.waiting import free_port, wait_until
from tests.support.layer_store import build_store
from tests.support.layer_servers import stop_layer_servers
from tests.support.layers import BigFile, Layer
from tests.support.peers import place_request, read_answer
from tests.support.tls import self_signed

pytestmark = pytest.mark.timeout(300)

TINYPROXY = shutil.which("tinyproxy") or "/usr/sbin/tinyproxy"
PROXY_OUT = "127.0.0.2"  #: the address tinyproxy's connections to the store leave from
USER, PASSWORD = "node", "pr0xy-s3cret"
BLOCK_SIZE = 64 << 10  #: the layer's raw block size
PROXY_BLOCK = 256 << 10  #: the proxy grid of these tests
WAIT_S = 30.0  #: deadline of every wait on a condition


class Tinyproxy:
    """A private tinyproxy: config, pid file and log in ``state``; ``BasicAuth`` if ``auth``."""

    def __init__(self, state: Path, *, auth: bool = False) -> None:
        self.state = state
        self.auth = auth
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        state.mkdir(parents=True, exist_ok=True)

    @property
    def log(self) -> Path:
        return self.state / "tinyproxy.log"

    @property
    def url(self) -> str:
        credentials = f"{USER}:{PASSWORD}@" if self.auth else ""
        return f"http://{credentials}127.0.0.1:{self.port}"

    def start(self) -> Tinyproxy:
        conf = self.state / "tinyproxy.conf"
        conf.write_text(
            f"Port {self.port}\nListen 127.0.0.1\nBind {PROXY_OUT}\nTimeout 30\nMaxClients 64\n"
            f'LogFile "{self.log}"\nLogLevel Connect\nPidFile "{self.state / "tinyproxy.pid"}"\n'
            f'Allow 127.0.0.1\nViaProxyName "bootseer-test-proxy"\n'
            + (f"BasicAuth {USER} {PASSWORD}\n" if self.auth else "")
        )
        self.process = subprocess.Popen([TINYPROXY, "-d", "-c", str(conf)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_for_port(self.port, self.process)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process takes no SIGTERM
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def requests(self) -> list[str]:
        """The request lines tinyproxy logged (``GET http://...``, ``CONNECT host:port``)."""
        if not self.log.exists():
            return []
        return re.findall(r"Request \(file descriptor \d+\): (\S+ \S+)", self.log.read_text(errors="replace"))


class ClientRecording(RangeRequestHandler):
    """The store's access log: who asked (client address, ``Via``) for what (target, Range)."""

    def serve(self, body: bool) -> None:
        self.server.access.append(  # type: ignore[attr-defined]
            (self.client_address[0], self.headers.get("Via") or "", self.path, self.headers.get("Range") or "")
        )
        super().serve(body)


class Store(RangeHTTPServer):
    def __init__(self, root: Path) -> None:
        super().__init__(root, ClientRecording)
        self.access: list[tuple[str, str, str, str]] = []

    def since(self, start: int, *, part: str = "") -> list[tuple[str, str, str, str]]:
        return [entry for entry in self.access[start:] if part in entry[2]]


@pytest.fixture
def proxy_factory(tmp_path: Path) -> Iterator[Callable[..., Tinyproxy]]:
    proxies: list[Tinyproxy] = []

    def make(**options: Any) -> Tinyproxy:
        proxy = Tinyproxy(tmp_path / f"tinyproxy{len(proxies)}", **options)
        proxies.append(proxy)
        return proxy.start()

    yield make
    for proxy in proxies:
        proxy.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    root = tmp_path / "www"
    root.mkdir()
    with Store(root) as server:
        yield server


def _ranges(entries: list[tuple[str, str, str, str]]) -> list[tuple[int, int]]:
    found = []
    for _client, _via, _target, header in entries:
        first, last = header.removeprefix("bytes=").split("-")
        found.append((int(first), int(last)))
    return found


# -- the source itself --------------------------------------------------------------------------------


def test_reads_through_the_proxy_ask_for_whole_blocks_of_its_grid(store: Store, proxy_factory: Any) -> None:
    proxy = proxy_factory()
    data = os.urandom(5 * PROXY_BLOCK + 1234)  # the last block is short
    (store.root / "file.bin").write_bytes(data)
    source = open_source(store.url, proxy=ProxyConfig(proxy.url, block_size=PROXY_BLOCK))
    try:
        version = source.stat("file.bin").version
        connection = source.connect()
        for offset, length in [(0, 10), (PROXY_BLOCK - 5, 10), (3 * PROXY_BLOCK + 7, 2 * PROXY_BLOCK),
                               (len(data) - 100, 1000), (len(data) + 5, 10)]:  # fmt: skip
            assert connection.read_range("file.bin", offset, length, version) == data[offset : offset + length]
        assert connection.read_range("file.bin", 100, 50) == data[100:150]  # no version: the size is not known
        connection.close()
    finally:
        source.close()
    reads = store.since(0, part="file.bin")
    gets = [entry for entry in reads if entry[3]]
    assert gets and all(client == PROXY_OUT and "bootseer-test-proxy" in via for client, via, _t, _r in gets)
    for first, last in _ranges(gets):
        assert first % PROXY_BLOCK == 0, (first, last)
        assert (last + 1) % PROXY_BLOCK == 0 or last + 1 == len(data), (first, last)
    assert len([line for line in proxy.requests() if "file.bin" in line]) == len(gets)


_CACHING_NGINX = """\
daemon off;
master_process off;
{user}
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log {state}/access.log;
    client_body_temp_path {state}/tmp;
    proxy_temp_path {state}/tmp;
    fastcgi_temp_path {state}/tmp;
    uwsgi_temp_path {state}/tmp;
    scgi_temp_path {state}/tmp;
    proxy_cache_path {state}/cache keys_zone=blocks:1m;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            # A forward proxy that keeps each (URL, Range) answer: the simplest cache of ranges.
            proxy_pass http://$http_host;
            proxy_cache blocks;
            proxy_cache_key "$http_host$request_uri $http_range";
            proxy_set_header Range $http_range;
            proxy_set_header If-Range $http_if_range;
            proxy_cache_valid 200 206 10m;
        }}
    }}
}}
"""


@pytest.fixture
def caching_proxy(tmp_path: Path) -> Iterator[str]:
    """Debian's nginx as a caching forward proxy on a free port (its own config and cache): its URL."""
    state = tmp_path / "nginx"
    (state / "tmp").mkdir(parents=True)
    port = free_port()
    (state / "nginx.conf").write_text(_CACHING_NGINX.format(
        user="user root;" if os.geteuid() == 0 else "", state=state, port=port))  # fmt: skip
    process = subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-p", str(state), "-c", str(state / "nginx.conf"),
                                "-e", str(state / "error.log")], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_port(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_caching_proxy_serves_a_second_node_the_blocks_a_first_one_fetched(store: Store, caching_proxy: str) -> None:
    """Two nodes read the same bytes in different ranges (as their engines coalesced them): through the
    proxy both ask for the same grid blocks, so the store sends each block once."""
    data = os.urandom(8 * PROXY_BLOCK)
    (store.root / "file.bin").write_bytes(data)
    reads = {
        "first": [(10, 3 * PROXY_BLOCK), (5 * PROXY_BLOCK + 7, 2 * PROXY_BLOCK)],
        "second": [(PROXY_BLOCK + 5, 100), (2 * PROXY_BLOCK - 1, 2), (3 * PROXY_BLOCK - 10, 10), (6 * PROXY_BLOCK, 5)],
    }
    seen: dict[str, list[tuple[int, int]]] = {}
    for node, ranges in reads.items():
        source = open_source(store.url, proxy=ProxyConfig(caching_proxy, block_size=PROXY_BLOCK))
        try:
            version = source.stat("file.bin").version
            connection = source.connect()
            start = len(store.access)
            for offset, length in ranges:
                assert connection.read_range("file.bin", offset, length, version) == data[offset : offset + length]
            connection.close()
        finally:
            source.close()
        seen[node] = _ranges([entry for entry in store.since(start, part="file.bin") if entry[3]])
    assert seen["first"] == [(k * PROXY_BLOCK, (k + 1) * PROXY_BLOCK - 1) for k in (0, 1, 2, 3, 5, 6, 7)]
    assert seen["second"] == [], "the second node's blocks came from the proxy's cache"


def test_an_https_store_is_read_through_a_connect_tunnel_with_the_proxys_credentials(
    tmp_path: Path, proxy_factory: Any
) -> None:
    proxy = proxy_factory(auth=True)
    cert, key = self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    (tmp_path / "www").mkdir()
    data = os.urandom(3 * PROXY_BLOCK)
    (tmp_path / "www" / "file.bin").write_bytes(data)
    store = Store(tmp_path / "www")
    store.socket = context.wrap_socket(store.socket, server_side=True)
    store.start()
    url = f"https://127.0.0.1:{store.port}/"
    source = HttpSource(url, ca_file=str(cert), proxy=ProxyConfig(proxy.url, block_size=PROXY_BLOCK))
    try:
        connection = source.connect()
        assert connection.read_range("file.bin", PROXY_BLOCK + 3, 1000) == data[PROXY_BLOCK + 3 : PROXY_BLOCK + 1003]
        connection.close()
        assert source.proxy is not None and source.proxy.up
    finally:
        source.close()
        store.stop()
    assert f"CONNECT 127.0.0.1:{store.port}" in proxy.requests()
    gets = [entry for entry in store.access if entry[3]]
    # Through the tunnel the store sees the proxy's address but no Via: the proxy only relays bytes.
    assert gets and all(client == PROXY_OUT and not via for client, via, _t, _r in gets)
    assert _ranges(gets) == [(PROXY_BLOCK, 2 * PROXY_BLOCK - 1)]
    assert PASSWORD not in proxy.log.read_text()


def test_a_proxy_that_hangs_is_found_down_by_its_check_and_the_read_in_flight_goes_direct(
    store: Store, proxy_factory: Any
) -> None:
    proxy = proxy_factory()
    data = os.urandom(2 * PROXY_BLOCK)
    (store.root / "file.bin").write_bytes(data)
    # The read timeout is far beyond the test's own: only the check can end the hung read.
    source = HttpSource(store.url, read_timeout=3600, connect_timeout=1,
                        proxy=ProxyConfig(proxy.url, check_interval=0.2, block_size=PROXY_BLOCK))  # fmt: skip
    try:
        connection = source.connect()
        assert connection.read_range("file.bin", 0, 10) == data[:10]
        assert proxy.process is not None
        proxy.process.send_signal(signal.SIGSTOP)  # takes connections, answers nothing
        start = len(store.access)
        assert connection.read_range("file.bin", PROXY_BLOCK + 1, 99) == data[PROXY_BLOCK + 1 : PROXY_BLOCK + 100]
        assert source.proxy is not None and not source.proxy.up
        assert [(client, r) for client, _via, _t, r in store.since(start)] == [("127.0.0.1", f"bytes={PROXY_BLOCK + 1}-{PROXY_BLOCK + 99}")]
        proxy.process.send_signal(signal.SIGCONT)
        wait_until("the proxy healthy again", lambda: source.proxy.up, WAIT_S, interval=0.05)
        start = len(store.access)
        assert connection.read_range("file.bin", 5, 5) == data[5:10]
        # Through the proxy only; the woken proxy may still relay a request (a health check's range
        # probe) a client gave up on while it was stopped, so there may be more than one.
        clients = [client for client, *_ in store.since(start)]
        assert clients and set(clients) == {PROXY_OUT}, clients
        connection.close()
    finally:
        source.close()


def test_a_healthy_proxy_slower_to_answer_its_check_than_a_short_interval_is_kept() -> None:
    """Regression (CI, twice): a check waited at most its interval, so at 0.2 s a healthy proxy whose ping
    took longer on a loaded machine was set aside.  A check now waits at least a second (never past the
    connect timeout)."""
    waits: list[float] = []

    def ping(timeout: float) -> None:  # a proxy that answers in 0.5 s, if the check waits that long
        waits.append(timeout)
        if timeout < 0.5:
            raise TimeoutError(f"no answer in {timeout} s")

    health = ProxyHealth(ProxyConfig("http://127.0.0.1:1", check_interval=0.2), ping, connect_timeout=10)
    try:
        assert health.check() is True and health.up, waits
        assert waits == [1.0]
        assert ProxyHealth(ProxyConfig("http://127.0.0.1:1", check_interval=0.2), ping, connect_timeout=0.3).ping_timeout == 0.3
    finally:
        health.close()


def test_a_ping_url_that_fails_sends_reads_direct_and_one_that_answers_brings_them_back(
    store: Store, proxy_factory: Any
) -> None:
    proxy = proxy_factory()
    data = os.urandom(PROXY_BLOCK)
    (store.root / "file.bin").write_bytes(data)
    ping = store.url + "healthz"  # 404 until the file exists: the proxy's health endpoint says no
    source = HttpSource(store.url, proxy=ProxyConfig(proxy.url, ping_url=ping, check_interval=0.1, block_size=PROXY_BLOCK))
    try:
        connection = source.connect()
        assert source.proxy is not None
        source.proxy.usable()  # starts the checker
        wait_until("the proxy found down by its ping URL", lambda: not source.proxy.up, WAIT_S, interval=0.05)
        start = len(store.access)
        assert connection.read_range("file.bin", 10, 10) == data[10:20]
        assert [(client, r) for client, _v, target, r in store.since(start) if "file.bin" in target] == [("127.0.0.1", "bytes=10-19")]
        (store.root / "healthz").write_text("ok\n")
        wait_until("the proxy healthy again", lambda: source.proxy.up, WAIT_S, interval=0.05)
        start = len(store.access)
        assert connection.read_range("file.bin", 10, 10) == data[10:20]
        assert [client for client, _v, target, _r in store.since(start) if "file.bin" in target] == [PROXY_OUT]
        connection.close()
    finally:
        source.close()


def test_a_proxy_that_drips_a_range_is_cut_off_at_its_read_timeout_and_the_read_goes_direct(store: Store) -> None:
    """The proxy's read timeout bounds a whole request, not each receive: a body dripped one byte
    every 0.1 s (every receive in time) is aborted and the read done direct, the proxy set aside."""
    data = os.urandom(2 * PROXY_BLOCK)
    (store.root / "file.bin").write_bytes(data)
    proxy = RangeHTTPServer(store.root).start()
    proxy.faults.range_answer = "drip"
    source = HttpSource(store.url, read_timeout=3600, proxy=ProxyConfig(
        f"http://127.0.0.1:{proxy.port}", check_interval=3600, block_size=PROXY_BLOCK, read_timeout=0.5))  # fmt: skip
    try:
        connection = source.connect()
        assert connection.read_range("file.bin", 100, 1000) == data[100:1100]
        assert source.proxy is not None and not source.proxy.up
        assert [(client, r) for client, _v, target, r in store.access if "file.bin" in target and r] == [
            ("127.0.0.1", "bytes=100-1099")]  # fmt: skip
        assert range_gets(proxy) == 1
        connection.close()
    finally:
        source.close()
        proxy.stop()


# -- a layer server reading its layers through the proxy ----------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_layer_blocks_go_through_the_proxy_direct_while_it_is_down_and_back_when_it_returns(
    tmp_path: Path, store: Store, proxy_factory: Any
) -> None:
    big = BigFile("srv/big.bin", 256 * BLOCK_SIZE, seed=16)
    [layer] = build_store(store.root, [Layer((big,))], block_size=BLOCK_SIZE, layout=tmp_path / "layout")
    expected = big.data()
    proxy = proxy_factory(auth=True)
    metrics_port = free_port()
    root = tmp_path / "node"
    settings = ServerSettings(
        store=store.url, store_proxy=proxy.url, store_proxy_check_interval=0.2, store_proxy_block_size=PROXY_BLOCK,
        metrics_address=f"127.0.0.1:{metrics_port}", retry_timeout=5, log_level="debug",
        extra_args=("--stripe-size", str(4 * BLOCK_SIZE)),
    )  # fmt: skip
    try:
        client = ensure_server(root, settings)
        base = Path(client.mount(layer.chain_id).lower_dir)
        # Three parts read one after another, each far beyond the read-ahead of the one before.
        first_part, second_part, third_part = [(start << 20, (start + 2) << 20) for start in (0, 6, 12)]

        def read(start: int, stop: int) -> None:
            with open(base / big.path, "rb", buffering=0) as file:
                file.seek(start)
                while start < stop:
                    chunk = file.read(min(128 << 10, stop - start))
                    assert chunk == expected[start : start + len(chunk)], f"wrong bytes at {start}"
                    start += len(chunk)

        start = len(store.access)
        read(*first_part)
        packs = store.since(start, part="/packs/")
        assert packs and all(client == PROXY_OUT and "bootseer-test-proxy" in via for client, via, _t, _r in packs)
        assert any("/packs/" in line for line in proxy.requests())
        for first, _last in _ranges(packs):
            assert first % PROXY_BLOCK == 0

        [shown] = client.status()["stores"].values()
        assert shown["proxy"]["up"] is True and shown["proxy"]["proxy"].startswith("http://127.0.0.1:")

        proxy.stop()
        start = len(store.access)
        read(*second_part)  # no EIO, no wrong byte
        [shown] = client.status()["stores"].values()
        assert shown["proxy"]["up"] is False  # the status answer says what the gauge says
        packs = store.since(start, part="/packs/")
        assert packs and all(client == "127.0.0.1" and not via for client, via, _t, _r in packs)

        proxy.start()  # the same port
        log = ServerPaths(root).log
        wait_until("back to the proxy", lambda: "store proxy healthy again" in log.read_text(errors="replace"), WAIT_S, interval=0.05)
        start = len(store.access)
        read(*third_part)
        packs = store.since(start, part="/packs/")
        assert packs and all(client == PROXY_OUT for client, *_ in packs)

        text = log.read_text(errors="replace")
        assert text.count("store proxy down") == 1 and text.count("store proxy healthy again") == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert re.search(r'^bootseer_fetch_proxy_up\{proxy="http://127\.0\.0\.1:\d+"\} 1\.0$', metrics, re.M), metrics
        fallbacks = re.findall(r'^bootseer_fetch_proxy_fallbacks_total\{cause="(?:request|check)"\} (\S+)$', metrics, re.M)
        assert sum(map(float, fallbacks)) == 1, fallbacks  # the read that found it gone, or the check that did
        for route in ("proxy", "direct"):
            assert float(re.search(rf'^bootseer_fetch_http_bytes_total\{{route="{route}"\}} (\S+)$', metrics, re.M)[1]) > 0
        # The proxy's credentials: in no argv, log line, status answer or metric.
        status = json.dumps(client.status())
        pid = int(client.status()["pid"])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        for where, what in (("argv", cmdline), ("log", text), ("status", status), ("metrics", metrics)):
            assert PASSWORD not in what, where
        assert "--settings-file /dev/fd/" in cmdline.replace("\0", " ")  # the proxy URL came in the document
        started = client.status()["settings"]["store-proxy"]
        assert started.startswith("http://127.0.0.1:") and started == shown["proxy"]["proxy"]  # redacted
    finally:
        stop_layer_servers(root)


# -- a proxy gone wrong: its reads done direct, never an EIO --------------------------------------------


PROXY_FAULTS = ["corrupt", 302, 200, 403, 404, "hang"]


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
@pytest.mark.parametrize("from_start", [True, False], ids=["from-the-mount", "after-the-mount"])
@pytest.mark.parametrize("fault", PROXY_FAULTS, ids=[str(fault) for fault in PROXY_FAULTS])
def test_a_proxy_that_answers_ranges_wrong_is_set_aside_and_every_read_is_done_direct(
    tmp_path: Path, store: Store, fault: str | int, from_start: bool
) -> None:
    """A proxy whose ping answers but whose ranges come back corrupt, redirected, whole (200), refused (403,
    404) or never: the mount (its chain record and index read through the proxy) and every byte of the file
    are right, no EIO, the proxy is down in the status and the metrics with one log line, and the reads go
    to the store direct.  ``after-the-mount``: the proxy serves the mount and the first reads right, then
    goes wrong (a corrupt block then fails the block reader's SHA-256 check, not the index's)."""
    big = BigFile("srv/big.bin", 256 * BLOCK_SIZE, seed=21)
    [layer] = build_store(store.root, [Layer((big,))], block_size=BLOCK_SIZE, layout=tmp_path / "layout")
    expected = big.data()
    # A proxy with every file of the store in its cache: it serves the store's directory itself.
    proxy = RangeHTTPServer(store.root).start()
    if from_start:
        proxy.faults.range_answer = fault
    metrics_port = free_port()
    root = tmp_path / "node"
    settings = ServerSettings(
        store=store.url, store_proxy=f"http://127.0.0.1:{proxy.port}", store_proxy_check_interval=0.2,
        store_proxy_block_size=PROXY_BLOCK, metrics_address=f"127.0.0.1:{metrics_port}", retry_timeout=20,
        log_level="debug", extra_args=("--stripe-size", str(4 * BLOCK_SIZE)),
    )  # fmt: skip
    try:
        client = ensure_server(root, settings)
        base = Path(client.mount(layer.chain_id).lower_dir)
        with open(base / big.path, "rb", buffering=0) as file:
            if not from_start:
                first = file.read(1 << 20)
                assert first == expected[: 1 << 20]
                [shown] = client.status()["stores"].values()
                assert range_gets(proxy) > 0 and shown["proxy"]["up"] is True
                proxy.faults.range_answer = fault
            start = len(store.access)
            file.seek(0 if from_start else 1 << 20)
            position = file.tell()
            while chunk := file.read(128 << 10):
                assert chunk == expected[position : position + len(chunk)], f"wrong bytes at {position}"
                position += len(chunk)
            assert position == len(expected)
        [shown] = client.status()["stores"].values()
        assert shown["proxy"]["up"] is False
        packs = store.since(start, part="/packs/")
        assert packs and all(client == "127.0.0.1" for client, *_ in packs)  # the node itself: direct
        text = ServerPaths(root).log.read_text(errors="replace")
        assert text.count("store proxy down") == 1 and "store proxy healthy again" not in text
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert re.search(r'^bootseer_fetch_proxy_up\{proxy="http://127\.0\.0\.1:\d+"\} 0\.0$', metrics, re.M), metrics
        fallbacks = dict(re.findall(r'^bootseer_fetch_proxy_fallbacks_total\{cause="(\w+)"\} (\S+)$', metrics, re.M))
        cause = "corrupt" if fault == "corrupt" else "request"
        assert float(fallbacks[cause]) == 1 and sum(map(float, fallbacks.values())) == 1, fallbacks
    finally:
        stop_layer_servers(root)
        proxy.stop()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_a_peers_request_for_a_made_up_block_never_sets_the_proxy_aside(tmp_path: Path, store: Store) -> None:
    """Regression (the store proxy's fallback x peer serving, issue 21 cases 1 and 6): bytes an owner fetched
    for a peer's request that fail the digest the peer named were reported to the engine as corrupt, so the
    source blamed the proxy that served them and set it aside; one request for a made-up block per check
    interval kept a healthy proxy down for every read of the node.  The peer names the digest: a failure
    says nothing about the route.  The request is still refused and never fetched again."""
    big = BigFile("srv/big.bin", 16 * BLOCK_SIZE, seed=5)
    [layer] = build_store(store.root, [Layer((big,))], block_size=BLOCK_SIZE, layout=tmp_path / "layout")
    proxy = RangeHTTPServer(store.root).start()  # a proxy with every file of the store in its cache
    listen = f"127.0.0.1:{free_port()}"
    root = tmp_path / "node"
    settings = ServerSettings(
        store=store.url, store_proxy=f"http://127.0.0.1:{proxy.port}", store_proxy_check_interval=3600,
        store_proxy_block_size=PROXY_BLOCK, log_level="debug",
        peers=PeerConfig(listen=listen, members=(listen, "127.0.0.1:1")),  # loopback: no token
    )  # fmt: skip
    try:
        client = ensure_server(root, settings)
        client.mount(layer.chain_id)
        made_up = BlockPlace(hashlib.sha256(b"no such block").hexdigest(), layer.index.packs[0], 0,
                             max_stored_length(BLOCK_SIZE), BLOCK_SIZE)  # fmt: skip
        before = range_gets(proxy)
        with socket.create_connection(("127.0.0.1", int(listen.rsplit(":", 1)[1])), timeout=WAIT_S) as sock:
            sock.sendall(place_request(store.url, made_up, None))
            status, _headers, body = read_answer(sock)
        assert status == 404, (status, body)
        assert range_gets(proxy) - before == 1  # fetched once, through the proxy
        [shown] = client.status()["stores"].values()
        log = ServerPaths(root).log.read_text(errors="replace")
        assert "not fetched again" in log
        assert shown["proxy"]["up"] is True and "store proxy down" not in log, shown
    finally:
        stop_layer_servers(root)
        proxy.stop()


# -- settings ---------------------------------------------------------------------------------------------


def test_the_proxy_url_goes_on_a_pipe_never_in_argv() -> None:
    settings = ServerSettings(store="http://store:8080/", store_proxy=f"http://{USER}:{PASSWORD}@proxy:3128",
                              store_proxy_ping_url="http://proxy:3129/ping", store_proxy_block_size=PROXY_BLOCK,
                              store_proxy_read_timeout=2.5)  # fmt: skip
    document = settings.document()
    assert document["store-proxy"] == f"http://{USER}:{PASSWORD}@proxy:3128"  # in the document, on the pipe
    argv = settings.argv("/root", "/dev/fd/5")
    assert PASSWORD not in " ".join(argv) and "proxy:3128" not in " ".join(argv)
    assert argv[-2:] == ["--settings-file", "/dev/fd/5"]
    assert document["store-proxy-ping-url"] == "http://proxy:3129/ping"
    assert (document["store-proxy-block-size"], document["store-proxy-read-timeout"]) == (PROXY_BLOCK, 2.5)
    assert PASSWORD not in repr(ProxyConfig(f"http://{USER}:{PASSWORD}@proxy:3128"))


def _refusal(result: subprocess.CompletedProcess, *expected: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert PASSWORD not in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "proxy, expected",
    [
        (f"socks5://{USER}:{PASSWORD}@127.0.0.1:1080", ["'socks5'", "not http://"]),
        ("http://:3128", ["no host"]),
        ("http:///", ["no host"]),
        ("http://proxy", ["no port"]),
        ("http://proxy:3128/path", ["no path"]),
    ],
)
def test_bad_proxy_settings_are_refused_at_start_up_in_one_line(tmp_path: Path, proxy: str, expected: list[str]) -> None:
    secret = tmp_path / "proxy.url"
    secret.write_text(proxy + "\n")
    server = subprocess.run(
        [sys.executable, "-m", "bootseer.cli", "layer-server", "--root", str(tmp_path / "root"),
         "--store", "http://127.0.0.1:9/", "--store-proxy-file", str(secret)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    _refusal(server, "--store-proxy", *expected)
    config = tmp_path / "snapshotter.toml"
    config.write_text(f'[store]\nurl = "http://127.0.0.1:9/"\nproxy = "{proxy}"\n')
    daemon = subprocess.run(
        [str(BINARY), "--root", str(tmp_path / "droot"), "--address", str(tmp_path / "run" / "s.sock"),
         "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    _refusal(daemon, "store.proxy", *expected)
    assert not (tmp_path / "droot").exists()


@pytest.mark.parametrize(
    "toml, expected",
    [
        ('[store]\nurl = "s3://bucket/"\nproxy = "http://127.0.0.1:3128"\n', ["store.proxy", "only http(s) stores"]),
        ('[store]\nproxy = "http://127.0.0.1:3128"\n', ["store.proxy", "needs a store"]),
        ('[store]\nurl = "http://s/"\nproxy_check_interval = 2\n', ["store.proxy_check_interval", "needs [store] proxy"]),
        ('[store]\nurl = "http://s/"\nproxy = "http://p:1"\nproxy_block_size = "1K"\n', ["store.proxy_block_size"]),
        ('[store]\nurl = "http://s/"\nproxy = "http://p:1"\nproxy_ping_url = "ftp://p/"\n', ["store.proxy_ping_url"]),
        ('[store]\nurl = "http://s/"\nproxy = "http://p:1"\nproxy_check_interval = 0\n', ["store.proxy_check_interval"]),
        ('[store]\nurl = "http://s/"\nproxy = "http://p:1"\nproxy_read_timeout = 0\n', ["store.proxy_read_timeout"]),
        ('[store]\nurl = "http://s/"\nproxy_read_timeout = 9\n', ["store.proxy_read_timeout", "needs [store] proxy"]),
    ],
)
def test_proxy_keys_that_cannot_work_are_refused_naming_the_key(tmp_path: Path, toml: str, expected: list[str]) -> None:
    config = tmp_path / "snapshotter.toml"
    config.write_text(toml)
    daemon = subprocess.run(
        [str(BINARY), "--root", str(tmp_path / "droot"), "--address", str(tmp_path / "run" / "s.sock"),
         "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    _refusal(daemon, *expected)
