"""A throw-away nginx serving one directory on 127.0.0.1, for the benchmark.

Debian's nginx runs in the foreground (``daemon off``) from a private prefix
directory that holds its config, pid file, logs and temp paths, so it touches
nothing under /etc or /var.  Static files get Range support and ``sendfile``; the
JSON autoindex lets a backend list the directory.  The bandwidth caps are not set
here but in the kernel (see :mod:`netcap`), except with ``limit_rate`` for
comparison.
"""

from __future__ import annotations

import http.client
import subprocess
import time
from pathlib import Path

CONFIG_TEMPLATE = """\
{user}worker_processes 1;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    # One connection per stream for the whole run: never close a busy one.
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    server {{
        listen {host}:{port};
        root {root};
        location / {{
            autoindex on;
            autoindex_format json;
            {limit_rate}
        }}
    }}
}}
"""


class Nginx:
    """nginx serving ``root`` on ``host``:``port``; a context manager.

    ``launcher`` prefixes nginx's command line, e.g. ``ip netns exec NS`` to serve from
    inside a network namespace (``host`` then being an address reachable from here).
    ``user``: the workers' user (nginx's default, ``nobody``, cannot read a test's private
    temporary directory; ``root`` can).
    """

    def __init__(self, root: Path, prefix: Path, port: int, limit_rate: int | None = None,
                 host: str = "127.0.0.1", launcher: tuple[str, ...] = (), user: str | None = None) -> None:
        self.root, self.prefix, self.port = root, prefix, port
        self.host, self.launcher, self.user = host, launcher, user
        self.limit_rate = limit_rate
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def config(self) -> str:
        rate = f"limit_rate {self.limit_rate};" if self.limit_rate else ""
        user = f"user {self.user};\n" if self.user else ""
        return CONFIG_TEMPLATE.format(user=user, prefix=self.prefix, host=self.host, port=self.port, root=self.root,
                                      limit_rate=rate)

    def __enter__(self) -> "Nginx":
        (self.prefix / "tmp").mkdir(parents=True, exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(self.config())
        self.process = subprocess.Popen(
            [*self.launcher, "nginx", "-p", str(self.prefix), "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=open(self.prefix / "stderr.log", "wb"),
        )
        try:
            self._wait_ready(timeout=10.0)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = (self.prefix / "stderr.log").read_text() + (self.prefix / "error.log").read_text()
                raise RuntimeError(f"nginx exited with status {self.process.returncode}: {log.strip()}")
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
                conn.request("HEAD", "/")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not answer on port {self.port} within {timeout} s")
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.process and self.process.poll() is None:
            # SIGQUIT is nginx's graceful stop; SIGTERM its fast one: no need to wait for transfers.
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
