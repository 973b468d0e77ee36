"""``docker-registry`` (Debian's ``docker-registry`` package) as a local OCI registry, and pushing to it.

:class:`Registry` serves on 127.0.0.1 from a directory of its own, over HTTP or (given a certificate)
HTTPS, with any extra config (an ``auth:`` section, say); :meth:`Registry.push` copies an OCI layout's
image into it with skopeo.
"""

from __future__ import annotations

import signal
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Collection

from tests.support.oci import BuiltImage
from tests.support.processes import ManagedProcess, run
from tests.support.waiting import WaitFailed, free_port, wait_until


class Registry:
    """``docker-registry serve`` on 127.0.0.1 with filesystem storage under ``base``."""

    def __init__(self, base: Path, binary: str = "docker-registry", *, avoid: Collection[int] = ()):
        """``avoid``: ports the registry must not take (another process of the caller's was given them
        and starts later: :func:`~tests.support.waiting.free_port` only says a port was free a moment ago)."""
        self.base = base
        self.binary = binary
        self.avoid = frozenset(avoid)
        self.port = 0
        self.process: ManagedProcess | None = None
        #: YAML appended to the config at the next start (an ``auth:`` section, say).
        self.extra_config = ""
        #: (certificate, key) PEM files: serve HTTPS with them from the next start.
        self.tls: tuple[Path, Path] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "storage").mkdir(exist_ok=True)
        for attempt in range(3):  # free_port() can race with another process
            self.port = free_port()
            while self.port in self.avoid:
                self.port = free_port()
            config = self.base / "config.yml"
            config.write_text(
                "version: 0.1\n"
                "log:\n  level: info\n  accesslog:\n    disabled: true\n"
                f"storage:\n  filesystem:\n    rootdirectory: {self.base / 'storage'}\n"
                "  delete:\n    enabled: true\n"
                f"http:\n  addr: {self.address}\n"
                + (f"  tls:\n    certificate: {self.tls[0]}\n    key: {self.tls[1]}\n" if self.tls else "")
                + self.extra_config
            )
            self.process = ManagedProcess("docker-registry", [self.binary, "serve", str(config)],
                                          self.base / "registry.log")
            self.process.start()
            try:
                wait_until(f"registry on {self.address}", self._answers, timeout, interval=0.1, alive=self.process)
                return
            except WaitFailed:
                self.process.stop(signal.SIGKILL)
                if attempt == 2:
                    raise

    def _answers(self) -> bool:
        try:
            # Up is all this asks, so a TLS registry's (test) certificate is not checked here.
            context = ssl._create_unverified_context() if self.tls else None
            scheme = "https" if self.tls else "http"
            with urllib.request.urlopen(f"{scheme}://{self.address}/v2/", timeout=2, context=context) as resp:
                return resp.status == 200
        except urllib.error.HTTPError as e:
            return e.code == 401  # up, and asking for credentials (an auth: section)
        except (urllib.error.URLError, OSError):
            return False

    def push(self, image: BuiltImage, name: str, timeout: float = 300) -> str:
        """Push the layout's ``image.tag`` as ``name:tag``; return the pullable reference."""
        ref = f"{self.address}/{name}:{image.tag}"
        run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
             f"oci:{image.layout}:{image.tag}", f"docker://{ref}"], timeout=timeout)
        return ref

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
