"""Registry redirects (issue 14, item 8): no downgrade to plain http, no credentials to another origin;
and retries by the fetch layer's policy (``images.HTTP_RETRY``): a 429 or 5xx is tried again, a bounded
number of times, and an unreachable registry fails with a clear error.

Real local servers: a "registry" that answers TLS and plain HTTP on one port (it looks
at the first byte of each connection), so a redirect can change only the scheme, and a
second server on another port standing for object storage.  Both record the requests
they get, with their headers, so the tests check what was actually sent.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from bootseer.fetch.retry import RetryPolicy
from bootseer.images import registry as images
from bootseer.images.registry import Descriptor, Platform, RegistryReference, RegistrySource

pytest.importorskip("cryptography", reason="makes the servers' certificate")

from tests.support.tls import self_signed  # noqa: E402  (needs cryptography)

BLOB = b"layer bytes " * 1000
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()
USER, PASSWORD = "puller", "PASSWORD-s3cr3t"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
TOKEN = "TOKEN-s3cr3t"


class Recorded:
    """One request a test server got: the scheme it came over, its path and headers."""

    def __init__(self, scheme: str, path: str, headers: dict[str, str]) -> None:
        self.scheme, self.path, self.headers = scheme, path, headers

    def __repr__(self) -> str:
        return f"<{self.scheme} {self.path} auth={'Authorization' in self.headers}>"


class RecordingServer(ThreadingHTTPServer):
    """Answers ``routes`` (path prefix -> handler) over TLS or plain HTTP on one port."""

    daemon_threads = True

    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.context = context
        self.requests: list[Recorded] = []
        self.redirects: dict[str, str] = {}  #: path -> Location (a 307)
        self.require_auth: str | None = None  #: an Authorization value /v2/ paths want, else 401
        self.challenge = 'Basic realm="test"'
        self.failures: dict[str, list[int]] = {}  #: path -> statuses answered (in order) before it works

    def get_request(self):
        conn, address = self.socket.accept()
        first = conn.recv(1, socket.MSG_PEEK)
        if first == b"\x16":  # a TLS ClientHello
            conn = self.context.wrap_socket(conn, server_side=True)
            conn.scheme = "https"  # type: ignore[attr-defined]
        return conn, address

    def url(self, scheme: str, path: str) -> str:
        return f"{scheme}://127.0.0.1:{self.server_address[1]}{path}"

    def sent_authorization(self, scheme: str | None = None) -> list[Recorded]:
        return [r for r in self.requests if "Authorization" in r.headers and scheme in (None, r.scheme)]


class _Handler(BaseHTTPRequestHandler):
    server: RecordingServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        scheme = getattr(self.connection, "scheme", "http")
        self.server.requests.append(Recorded(scheme, self.path, dict(self.headers)))
        path = self.path.split("?", 1)[0]
        if path.startswith("/token"):
            return self._send(200, b'{"token": "%s"}' % TOKEN.encode(), {"Content-Type": "application/json"})
        if self.server.require_auth and path.startswith("/v2/") and self.headers.get("Authorization") != self.server.require_auth:
            return self._send(401, b"", {"WWW-Authenticate": self.server.challenge})
        failing = self.server.failures.get(path)
        if failing:
            return self._send(failing.pop(0), b'{"errors": [{"code": "UNAVAILABLE", "message": "try later"}]}', {})
        if path in self.server.redirects:
            return self._send(307, b"", {"Location": self.server.redirects[path]})
        self._send(200, BLOB, {"Content-Type": "application/octet-stream"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def servers(tmp_path: Path, monkeypatch) -> Iterator[tuple[RecordingServer, RecordingServer]]:
    """(registry, elsewhere): two servers on 127.0.0.1, trusted through SSL_CERT_FILE."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    started = [RecordingServer(context), RecordingServer(context)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in started]
    for thread in threads:
        thread.start()
    try:
        yield started[0], started[1]
    finally:
        for server in started:
            server.shutdown()
            server.server_close()


def _source(registry: RecordingServer, *, plain_http: bool) -> RegistrySource:
    ref = RegistryReference.parse(f"127.0.0.1:{registry.server_address[1]}/team/app:v1")
    return RegistrySource(ref, plain_http=plain_http, platform=Platform.host(), credentials=(USER, PASSWORD))


BLOB_PATH = f"/v2/team/app/blobs/{DIGEST}"
DESCRIPTOR = Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", DIGEST, len(BLOB))


def _read_blob(source: RegistrySource) -> bytes:
    with source.open_blob(DESCRIPTOR) as blob:
        return blob.read()


def test_https_to_http_redirect_is_refused_and_carries_no_credentials(servers):
    registry, elsewhere = servers
    registry.require_auth = BASIC
    source = _source(registry, plain_http=False)

    # A redirect within the origin keeps the credentials; one to object storage (another
    # port, https) drops them and still works: its URL carries its own signature.
    registry.redirects[BLOB_PATH] = registry.url("https", "/v2/team/app/data/1")
    registry.redirects["/v2/team/app/data/1"] = elsewhere.url("https", "/bucket/blob?X-Signature=abc")
    assert _read_blob(source) == BLOB
    assert [r.path for r in registry.sent_authorization("https")][-2:] == [BLOB_PATH, "/v2/team/app/data/1"]
    assert [r.path for r in elsewhere.requests] == ["/bucket/blob?X-Signature=abc"]
    assert elsewhere.sent_authorization() == []

    # The same host and port, the scheme downgraded to http: refused, nothing sent in clear.
    registry.redirects["/v2/team/app/data/1"] = registry.url("http", "/v2/team/app/data/2")
    with pytest.raises(images.RegistryError, match="refusing a redirect .*https to plain http") as refused:
        _read_blob(source)
    assert PASSWORD not in str(refused.value)
    assert [r for r in registry.requests if r.scheme == "http"] == []


def test_token_service_redirect_downgrade_is_refused(servers):
    registry, _elsewhere = servers
    registry.require_auth = f"Bearer {TOKEN}"
    registry.challenge = f'Bearer realm="{registry.url("https", "/auth")}",service="test"'
    # The token service (the realm) would send the client, with its Basic credentials, to plain http.
    registry.redirects["/auth"] = registry.url("http", "/token")
    with pytest.raises(images.RegistryError, match="https to plain http"):
        _read_blob(_source(registry, plain_http=False))
    assert [r for r in registry.requests if r.scheme == "http"] == []


def test_plain_http_allows_a_scheme_change_but_never_with_credentials(servers):
    registry, elsewhere = servers
    registry.require_auth = BASIC
    source = _source(registry, plain_http=True)
    # --plain-http registry: a redirect to https on the same host and port is followed,
    # without the Authorization header (the scheme changed, so the origin did).
    registry.redirects[BLOB_PATH] = elsewhere.url("https", "/blob")
    elsewhere.redirects["/blob"] = elsewhere.url("http", "/blob-plain")  # and back down: allowed, asked for
    assert _read_blob(source) == BLOB
    assert [r.scheme for r in registry.sent_authorization()] == ["http"]
    assert elsewhere.sent_authorization() == []

    registry.redirects[BLOB_PATH] = registry.url("https", "/v2/team/app/elsewhere")
    registry.require_auth = None  # the https side answers anyone: what matters is what it was sent
    assert _read_blob(source) == BLOB
    assert registry.sent_authorization("https") == []


def test_a_503_is_tried_again_and_the_third_attempt_is_served(servers):
    registry, _elsewhere = servers
    registry.failures[BLOB_PATH] = [503, 429]
    assert _read_blob(_source(registry, plain_http=False)) == BLOB
    assert [r.path for r in registry.requests] == [BLOB_PATH] * 3


def test_a_registry_that_keeps_failing_is_given_up_after_the_policys_attempts(servers):
    registry, _elsewhere = servers
    assert images.HTTP_RETRY.max_attempts == 3
    registry.failures[BLOB_PATH] = [503] * 10
    with pytest.raises(images.RegistryError, match="answered 503 Service Unavailable: UNAVAILABLE try later"):
        _read_blob(_source(registry, plain_http=False))
    assert [r.path for r in registry.requests] == [BLOB_PATH] * 3  # no fourth attempt
    assert registry.failures[BLOB_PATH] == [503] * 7


def test_an_unreachable_registry_fails_clearly_after_its_retries():
    with socket.socket() as sock:  # a port nothing listens on (bound, never listening: refused)
        sock.bind(("127.0.0.1", 0))
        ref = RegistryReference.parse(f"127.0.0.1:{sock.getsockname()[1]}/team/app:v1")
        source = RegistrySource(ref, plain_http=True, platform=Platform.host(), credentials=(USER, PASSWORD))
        with pytest.raises(images.RegistryError, match=r"GET http://127\.0\.0\.1:\d+/v2/team/app/blobs/.* failed: .*"
                                                         r"Connection ?Refused") as failed:
            _read_blob(source)
    assert PASSWORD not in str(failed.value) and BASIC not in str(failed.value)


# -- what is not retried (a real range server, tests/support/http.py, laid out as a registry's blob paths) --


LONG = BLOB * 100  # long enough to be cut in its body
LONG_DESCRIPTOR = Descriptor(DESCRIPTOR.media_type, "sha256:" + hashlib.sha256(LONG).hexdigest(), len(LONG))
LONG_PATH = f"/v2/team/app/blobs/{LONG_DESCRIPTOR.digest}"


@pytest.fixture
def blob_server(tmp_path: Path, range_http_factory):
    root = tmp_path / "registry"
    (root / LONG_PATH.lstrip("/")).parent.mkdir(parents=True)
    (root / LONG_PATH.lstrip("/")).write_bytes(LONG)
    return range_http_factory(root)


def _plain_source(server) -> RegistrySource:
    ref = RegistryReference.parse(f"127.0.0.1:{server.port}/team/app:v1")
    return RegistrySource(ref, plain_http=True, platform=Platform.host(), credentials=(USER, PASSWORD))


def _gets(server, path: str = LONG_PATH) -> int:
    return sum(1 for method, target, _ in server.requests if method == "GET" and target == path)


def test_permanent_answers_are_not_retried(blob_server):
    missing = Descriptor(DESCRIPTOR.media_type, "sha256:" + "0" * 64, 3)
    with pytest.raises(images.ImageNotFound, match="404"):
        _read_blob_of(_plain_source(blob_server), missing)
    assert _gets(blob_server, f"/v2/team/app/blobs/{missing.digest}") == 1
    blob_server.faults.refused[LONG_PATH] = 403
    with pytest.raises(images.AuthError, match="403"):
        _read_blob_of(_plain_source(blob_server), LONG_DESCRIPTOR)
    assert _gets(blob_server) == 1


def test_a_blob_cut_in_its_body_is_an_error_never_short_bytes(blob_server):
    # The answer had begun: a body cut short is not retried behind the reader's back, and the reader
    # gets an error instead of the end of the blob.
    blob_server.faults.drop(after_bytes=len(LONG) // 2)
    # A network failure, said as one (not a DigestMismatch: the bytes that came were right).
    with pytest.raises(images.RegistryError, match="read failed after .*connection lost"):
        _read_blob_of(_plain_source(blob_server), LONG_DESCRIPTOR)
    assert _gets(blob_server) == 1


def test_a_registry_that_keeps_failing_is_given_up_at_the_policys_deadline(blob_server):
    blob_server.faults.refused[LONG_PATH] = 502
    ref = RegistryReference.parse(f"127.0.0.1:{blob_server.port}/team/app:v1")
    policy = RetryPolicy(timeout=1.0, first_delay=0.05, max_delay=0.2)  # no attempt cap: the deadline decides
    source = RegistrySource(ref, plain_http=True, platform=Platform.host(), credentials=(USER, PASSWORD), retry=policy)
    started = time.monotonic()
    with pytest.raises(images.RegistryError, match="answered 502"):
        _read_blob_of(source, LONG_DESCRIPTOR)
    assert 1.0 <= time.monotonic() - started < 3.0
    assert _gets(blob_server) >= 5


def test_408_and_425_are_tried_again_as_the_fetch_layer_does(blob_server):
    blob_server.faults.status(408)
    blob_server.faults.status(425)
    assert _read_blob_of(_plain_source(blob_server), LONG_DESCRIPTOR) == LONG
    assert _gets(blob_server) == 3


def _read_blob_of(source: RegistrySource, descriptor: Descriptor) -> bytes:
    with source.open_blob(descriptor) as blob:
        return blob.read()
