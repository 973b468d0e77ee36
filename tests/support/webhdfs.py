"""A small, real WebHDFS server over a local directory, for tests.

Two threaded HTTP servers on 127.0.0.1, as in a real cluster: the *namenode*
answers ``GETFILESTATUS`` and ``LISTSTATUS`` with WebHDFS JSON and ``OPEN`` with a
``307`` redirect to the *datanode*, which streams the bytes of ``offset`` and
``length``.  Errors are ``RemoteException`` JSON as Hadoop sends them.  Each
server has :class:`~tests.support.http.Faults` to inject: drop the connection
mid-body, answer a status (503...) instead, or (datanode) announce a huge
``Content-Length``.  The namenode's :attr:`_Server.status_patch` overrides fields
of every FileStatus it sends (malformed answers); with ``tls=True`` the namenode
speaks TLS (``swebhdfs://``, a self-signed certificate: ``verify=False``) while
the datanode stays plain HTTP.  Each server records the targets and headers of
the requests it saw.

Use it as a context manager or through the ``webhdfs_factory`` fixture (offered to
every test by tests/conftest.py)::

    def test_read(tmp_path, webhdfs_factory):
        server = webhdfs_factory(tmp_path)
        source = open_source(server.url + "ckpt", user="alice")
        server.datanode_faults.drop(times=1, after_bytes=100)
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from tests.support.http import Faults, started_servers

PREFIX = "/webhdfs/v1"


def file_status(path: Path, suffix: str) -> dict[str, Any]:
    st = path.stat()
    is_dir = path.is_dir()
    return {
        "accessTime": int(st.st_atime * 1000),
        "blockSize": 134217728,
        "childrenNum": len(list(path.iterdir())) if is_dir else 0,
        "fileId": st.st_ino,
        "group": "supergroup",
        "length": 0 if is_dir else st.st_size,
        "modificationTime": int(st.st_mtime * 1000),
        "owner": "hdfs",
        "pathSuffix": suffix,
        "permission": oct(st.st_mode & 0o777)[2:],
        "replication": 0 if is_dir else 3,
        "storagePolicy": 0,
        "type": "DIRECTORY" if is_dir else "FILE",
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def send_json(self, code: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def remote_exception(self, code: int, exception: str, message: str) -> None:
        java = {"FileNotFoundException": "java.io.FileNotFoundException"}.get(exception, f"org.apache.hadoop.{exception}")
        self.send_json(code, {"RemoteException": {"exception": exception, "javaClassName": java, "message": message}})

    def parse(self) -> tuple[str, Path | None, dict[str, str]]:
        """``(hdfs path, local path or None if it escapes, query)``."""
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        hdfs_path = unquote(parts.path)[len(PREFIX):] or "/"
        clean = posixpath.normpath(hdfs_path)
        if not unquote(parts.path).startswith(PREFIX) or ".." in clean.split("/"):
            return hdfs_path, None, query
        return hdfs_path, self.server.root / clean.lstrip("/"), query

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        self.server.headers_seen.append(dict(self.headers))
        if code := self.server.faults.take("status"):
            self.remote_exception(code, "StandbyException" if code == 503 else "IOException", f"injected {code}")
            return
        hdfs_path, local, query = self.parse()
        if local is None:
            self.remote_exception(400, "IllegalArgumentException", f"Invalid path name {hdfs_path}")
            return
        self.serve(hdfs_path, local, query)

    def serve(self, hdfs_path: str, local: Path, query: dict[str, str]) -> None:
        raise NotImplementedError


class _NamenodeHandler(_Handler):
    def serve(self, hdfs_path: str, local: Path, query: dict[str, str]) -> None:
        op = query.get("op", "").upper()
        if not local.exists():
            self.remote_exception(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
            return
        patch = self.server.status_patch
        if op == "GETFILESTATUS":
            self.send_json(200, {"FileStatus": file_status(local, "")})
        elif op == "LISTSTATUS":
            if local.is_dir():
                only = self.server.status_patch_names
                statuses = [
                    {**file_status(child, child.name), **(patch if only is None or child.name in only else {})}
                    for child in sorted(local.iterdir())
                ]
            else:
                statuses = [file_status(local, "")]  # HDFS lists a file as itself
            self.send_json(200, {"FileStatuses": {"FileStatus": statuses}})
        elif op == "OPEN":
            if local.is_dir():
                self.remote_exception(404, "FileNotFoundException", f"Path is not a file: {hdfs_path}")
                return
            size = local.stat().st_size
            offset = int(query.get("offset", 0))
            if offset > size or offset < 0:
                self.remote_exception(403, "IOException", f"Offset={offset} out of the range [0, {size}]")
                return
            params = f"op=OPEN&namenoderpcaddress=127.0.0.1:8020&offset={offset}"
            if "length" in query:
                params += f"&length={int(query['length'])}"
            if "delegation" in query:  # Hadoop hands the token on to the datanode
                params += f"&delegation={quote(query['delegation'])}"
            location = f"http://127.0.0.1:{self.server.peer_port}{PREFIX}{quote(hdfs_path)}?{params}"
            self.send_response(307)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.remote_exception(400, "IllegalArgumentException", f"Invalid value for webhdfs parameter \"op\": {op}")


class _DatanodeHandler(_Handler):
    def serve(self, hdfs_path: str, local: Path, query: dict[str, str]) -> None:
        if query.get("op", "").upper() != "OPEN" or not local.is_file():
            self.remote_exception(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
            return
        size = local.stat().st_size
        offset = int(query.get("offset", 0))
        length = min(int(query.get("length", size)), max(size - offset, 0))
        faults = self.server.faults
        huge = faults.take("huge_length")
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(faults.HUGE_LENGTH if huge else length))
        self.end_headers()
        if huge:
            self.close_connection = True
            faults.send_huge(self.wfile, self.connection)
            return
        if faults.send_file_range(self.wfile, self.connection, local, offset, length):
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, root: Path, handler: type[_Handler]):
        super().__init__(("127.0.0.1", 0), handler)
        self.root = root
        self.faults = Faults()
        self.peer_port = 0
        self.requests: list[str] = []  #: request targets seen, for assertions
        self.headers_seen: list[dict[str, str]] = []  #: their headers
        self.status_patch: dict[str, Any] = {}  #: fields that override those of listed FileStatuses
        self.status_patch_names: set[str] | None = None  #: the names status_patch applies to (None: all)
        self.thread = threading.Thread(target=self.serve_forever, name=f"webhdfs-{handler.__name__}", daemon=True)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hangs up mid-answer is what fault tests do; say nothing.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class WebHdfsServer:
    """A namenode and a datanode serving ``root``; :attr:`url` is ``webhdfs://127.0.0.1:PORT/``."""

    def __init__(self, root: str | os.PathLike, *, tls: bool = False) -> None:
        root = Path(root).resolve()
        self.namenode = _Server(root, _NamenodeHandler)
        self.datanode = _Server(root, _DatanodeHandler)
        self.namenode.peer_port = self.datanode.server_address[1]
        self.tls = tls
        self._cert_dir: str | None = None
        if tls:
            self._cert_dir = tempfile.mkdtemp(prefix="bootseer-webhdfs-tls-")
            cert, key = os.path.join(self._cert_dir, "cert.pem"), os.path.join(self._cert_dir, "key.pem")
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                 "-keyout", key, "-out", cert],
                check=True, capture_output=True, timeout=60,
            )
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            self.namenode.socket = context.wrap_socket(self.namenode.socket, server_side=True)

    @property
    def port(self) -> int:
        return self.namenode.server_address[1]

    @property
    def url(self) -> str:
        return f"{'swebhdfs' if self.tls else 'webhdfs'}://127.0.0.1:{self.port}/"

    @property
    def namenode_faults(self) -> Faults:
        return self.namenode.faults

    @property
    def datanode_faults(self) -> Faults:
        return self.datanode.faults

    def start(self) -> WebHdfsServer:
        self.namenode.thread.start()
        self.datanode.thread.start()
        return self

    def stop(self) -> None:
        for server in (self.namenode, self.datanode):
            if server.thread.is_alive():
                server.shutdown()
                server.thread.join(timeout=10)
            server.server_close()
        if self._cert_dir is not None:
            shutil.rmtree(self._cert_dir, ignore_errors=True)

    def __enter__(self) -> WebHdfsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@pytest.fixture
def webhdfs_factory() -> Iterator:
    """``webhdfs_factory(root, tls=False)`` -> a started WebHdfsServer over ``root``."""
    yield from started_servers(WebHdfsServer)
