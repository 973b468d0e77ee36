"""Real-component harness: OCI images, a local registry, a private containerd, the daemon.

Everything the integration tests and the demo (``python -m integration.demo``) need to
run BootSeer the way a cluster does, on one machine and with nothing shared with the
host's own services:

* :func:`build_oci_layout` writes an OCI image layout (``oci-layout``, ``index.json``,
  manifest, config and gzip tar layers with correct digests and diff_ids) from layer
  specs, no docker needed; :func:`demo_layers` is the three-layer image the tests use
  (busybox base, an upper layer adding files, a top layer with a whiteout and an
  opaque directory).
* :class:`Registry` runs ``docker-registry`` on 127.0.0.1 and pushes layouts with skopeo.
* :class:`Snapshotter` runs ``bootseer-snapshotter`` and can stop, kill and restart it.
* :func:`containerd_install` is the containerd to run: ``BOOTSEER_CONTAINERD`` (``1.6``, ``1.7``,
  ``2.1``, the default, or a directory; read here only) names it, and its directory gives
  ``containerd``, ``ctr`` and the shim (docs/testing.md, "Which containerd").
* :class:`Containerd` runs that containerd with its own root, state and sockets and the
  daemon registered as the ``bootseer`` proxy snapshotter, in the config dialect of its
  version; :meth:`Containerd.ctr` runs its ``ctr`` against it in a namespace of its own.
* :class:`Stack` composes the three in one temp dir and tears everything down (tasks,
  shims, mounts, processes, files) even when the body failed; :meth:`Stack.logs`
  gathers every process's log for failure reports.
* :class:`CriStack` is a Kubernetes node: its containerd runs the CRI plugin
  (:class:`CriContainerd`: CNI bridge, pause image, bootseer as the CRI snapshotter), driven
  by :class:`CriClient` as the kubelet drives it; :func:`snapshotter_view` reads the labels
  the daemon's Prepare received.

All processes log to files under the stack's directory; every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Sequence

from tests.support import waiting
from tests.support.waiting import WaitFailed, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent

#: The name containerd knows the daemon by (``[proxy_plugins.bootseer]``).
SNAPSHOTTER_NAME = "bootseer"
#: containerd's built-in snapshotter: the reference the harness itself is checked against
#: (``BOOTSEER_IT_SNAPSHOTTER=overlayfs`` runs the integration tests on it, no daemon).
BUILTIN_OVERLAY = "overlayfs"

#: Lines of each component's log a failure report shows (the files keep everything).
LOG_TAIL_LINES = 200

#: Per-call bound on ``ctr`` during teardown: a wedged shim must not stall it (shims are killed after).
TEARDOWN_CALL_TIMEOUT = 10

class HarnessError(RuntimeError):
    """A component did not start, stop or answer as expected; the message says which and why."""


#: The tests' one wait (``tests.support.waiting``), polling every 0.1 s here: a check of the
#: integration tests often runs ``ctr`` or reads a daemon's status.
wait_until = functools.partial(waiting.wait_until, interval=0.1)


# --------------------------------------------------------------------------- images

# The image builder lives in tests/support (shared with the unit tests); re-exported here
# so that ``harness.build_oci_layout``, ``harness.demo_layers`` and the rest keep working.
from tests.support.layers import EPOCH, OPAQUE_MARKER, WHITEOUT_PREFIX, Dir, Entry, File, Layer, Opaque, Symlink, Whiteout  # noqa: E402,F401
from tests.support.oci import (  # noqa: E402,F401
    APP_FILE, APP_FILE_DATA, BLOB_FILE, BLOB_SIZE, DELETED_FILE, MEDIA_CONFIG, MEDIA_LAYER_GZIP, MEDIA_MANIFEST,
    OPAQUE_DIR, OPAQUE_NEW, OPAQUE_OLD, PATCH_FILE, PATCH_FILE_DATA, BuiltImage, blob_data, build_oci_layout,
    busybox_layer, chain_ids, demo_layers, expected_inodes,
)

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"

#: The lazy-layer tests' extra layer: PARTS files of one block each (1 MiB, convert's default block size).
PART_SIZE = 1 << 20
PARTS = 8


def part_path(i: int) -> str:
    return f"/data/parts/part{i}.bin"


def part_data(i: int) -> bytes:
    """Distinct, incompressible-looking contents of part ``i``."""
    return b"".join(hashlib.sha256(f"part {i} {n}".encode()).digest() for n in range(PART_SIZE // 32))


def lazy_layers() -> list[Layer]:
    """The demo image (busybox, files, whiteout + opaque dir) plus a layer of PARTS one-block files:
    what a lazy pull reads a little of."""
    parts = Layer(tuple(File(part_path(i), part_data(i)) for i in range(PARTS)), "layer 3: one-block files")
    return [*demo_layers(), parts]


def add_platform_index(image: BuiltImage, other: BuiltImage, tag: str = "multi") -> dict:
    """Add to ``image.layout`` an image index tagged ``tag``: ``image`` as linux/amd64 and ``other``
    (built in another layout; its blobs are copied over) as linux/arm64/v8.  Returns its descriptor."""
    blobs = image.layout / "blobs" / "sha256"
    for blob in (other.layout / "blobs" / "sha256").iterdir():
        shutil.copy(blob, blobs / blob.name)

    def entry(built: BuiltImage, platform: dict) -> dict:
        size = (blobs / built.manifest_digest.removeprefix("sha256:")).stat().st_size
        return {"mediaType": MEDIA_MANIFEST, "digest": built.manifest_digest, "size": size, "platform": platform}

    index = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [
        entry(image, {"os": "linux", "architecture": "amd64"}),
        entry(other, {"os": "linux", "architecture": "arm64", "variant": "v8"}),
    ]}).encode()
    digest = "sha256:" + hashlib.sha256(index).hexdigest()
    (blobs / digest.removeprefix("sha256:")).write_bytes(index)
    desc = {"mediaType": MEDIA_INDEX, "digest": digest, "size": len(index),
            "annotations": {"org.opencontainers.image.ref.name": tag}}
    top = json.loads((image.layout / "index.json").read_text())
    top["manifests"].append(desc)
    (image.layout / "index.json").write_text(json.dumps(top))
    return desc


# --------------------------------------------------------------------------- processes


class ManagedProcess:
    """One child process in its own process group, logging to a file (appended across restarts)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, python: bool = False):
        """``python``: the process is a Python program; it gets faulthandler, and SIGABRT
        before SIGKILL when it does not stop, so its log shows where it hung."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.abort_for_stacks = python
        self.env = dict(os.environ, PYTHONFAULTHANDLER="1") if python else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.running:
            raise HarnessError(f"{self.name} is already running")
        with open(self.log_path, "ab") as log:
            log.write(f"===== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=self.env, start_new_session=True,
                )
            except OSError as e:
                raise HarnessError(f"cannot start {self.name} ({self.argv[0]}): {e}") from e

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send_signal(self, sig: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        """Send ``sig`` to the process group, wait, SIGKILL after ``timeout``; return the exit status.

        Raises :class:`HarnessError` if ``sig`` did not end it in time (it is killed anyway).
        """
        if self.proc is None:
            return None
        if not self.running:
            return self.proc.returncode
        self.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if self.abort_for_stacks:
                # faulthandler (PYTHONFAULTHANDLER=1) writes every thread's stack to the log on SIGABRT.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(3)
            self.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            raise HarnessError(f"{self.name} did not exit within {timeout:.0f}s of signal {sig}; killed"
                               + (" (stacks in its log)" if self.abort_for_stacks else ""))
        finally:
            with open(self.log_path, "ab") as log:
                log.write(f"===== {time.strftime('%H:%M:%S')} stopped: status {self.proc.returncode}\n".encode())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def run(argv: Sequence[str], *, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; on failure raise :class:`HarnessError` with its output."""
    try:
        done = subprocess.run(list(argv), capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"timed out after {timeout}s: {' '.join(argv)}\n{_output(e.stdout, e.stderr)}") from e
    if check and done.returncode != 0:
        raise HarnessError(
            f"exit status {done.returncode}: {' '.join(argv)}\n{_output(done.stdout, done.stderr)}"
        )
    return done


# -- the bootseer command line, for the lazy stack's tests ----------------------------

#: The ``bootseer`` command of this checkout's venv (or the one on PATH).
BOOTSEER = str(REPO_ROOT / ".venv" / "bin" / "bootseer") if (REPO_ROOT / ".venv" / "bin" / "bootseer").exists() \
    else shutil.which("bootseer") or "bootseer"


def bootseer_convert(stack: "Stack", ref: str) -> str:
    """``bootseer convert`` of ``ref`` (in the stack's registry) into the stack's store; its output."""
    return run([BOOTSEER, "convert", "--plain-http", "--store", stack.store_url, ref], timeout=300).stdout.decode()


def bootseer_rpull(stack: "Stack", ref: str) -> str:
    """``bootseer rpull`` of ``ref`` into the stack's containerd through the bootseer snapshotter; its output."""
    done = run([BOOTSEER, "rpull", "--address", str(stack.containerd.address), "--namespace", stack.namespace,
                "--plain-http", "--snapshotter", SNAPSHOTTER_NAME, ref], timeout=300)  # fmt: skip
    return done.stdout.decode()


def layer_server(stack: "Stack"):
    """A control client of the layer server the stack's daemon started."""
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    return LayerServerClient(ServerPaths(stack.daemon.root).socket)


def served_data_path(requested: str) -> str:
    """The data path a layer server given ``--data-path requested`` serves by on this machine: what the
    kernel offers for ``auto`` (EROFS file-backed: the stacks live on the root filesystem, not tmpfs)."""
    if requested != "auto":
        return requested
    with open("/proc/filesystems") as listing:
        return "erofs" if any(line.split()[-1:] == ["erofs"] for line in listing) else "tree"


def assert_served_on(stack: "Stack", requested: str) -> None:
    """Every layer the stack's layer server serves is on the data path ``requested`` gives here."""
    status = layer_server(stack).status()
    expected = served_data_path(requested)
    assert status["data_path"]["path"] == expected and {row["data_path"] for row in status["layers"]} <= {expected}, status


def hotlist_status(stack: "Stack") -> dict:
    """The layer server's recordings and prefetches (``hotlist.status``)."""
    return layer_server(stack).call({"op": "hotlist.status"})


def hotlist_show(stack: "Stack", ref_or_chain: str, *extra: str) -> list[dict]:
    """``bootseer hotlist show --json`` against the stack's store."""
    done = run([BOOTSEER, "hotlist", "show", "--json", "--plain-http", "--store", stack.store_url, ref_or_chain, *extra],
               timeout=120)  # fmt: skip
    return json.loads(done.stdout)


def _output(stdout: bytes | None, stderr: bytes | None) -> str:
    parts = []
    for label, data in (("stdout", stdout), ("stderr", stderr)):
        if data:
            parts.append(f"--- {label}:\n{data.decode(errors='replace').rstrip()}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- registry


class Registry:
    """``docker-registry serve`` on 127.0.0.1 with filesystem storage under ``base``."""

    def __init__(self, base: Path, binary: str = "docker-registry"):
        self.base = base
        self.binary = binary
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


# --------------------------------------------------------------------------- snapshotter


def snapshotter_binary() -> str:
    """The ``bootseer-snapshotter`` to test: $BOOTSEER_SNAPSHOTTER, else the repo's venv."""
    explicit = os.environ.get("BOOTSEER_SNAPSHOTTER")
    if explicit:
        return explicit
    venv = REPO_ROOT / ".venv" / "bin" / "bootseer-snapshotter"
    if venv.exists():
        return str(venv)
    found = shutil.which("bootseer-snapshotter")
    if not found:
        raise HarnessError("bootseer-snapshotter not found: set BOOTSEER_SNAPSHOTTER or run ctr_examples/install-deps.sh")
    return found


def snapshotter_available() -> str | None:
    """Why the daemon cannot run here, or None if it can (for pytest skips)."""
    try:
        binary = snapshotter_binary()
    except HarnessError as e:
        return str(e)
    probe = subprocess.run([binary, "--help"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        return f"{binary} --help failed: {_output(probe.stdout, probe.stderr)}"
    return None


class Snapshotter:
    """``bootseer-snapshotter --root ROOT --address SOCKET`` under ``base``."""

    def __init__(self, base: Path, *, log_level: str = "debug", extra_args: Sequence[str] = ()):
        self.base = base
        self.root = base / "root"
        self.socket = base / "snapshotter.sock"
        self.process = ManagedProcess(
            "bootseer-snapshotter",
            [snapshotter_binary(), "--root", str(self.root), "--address", str(self.socket),
             "--log-level", log_level, *extra_args],
            base / "snapshotter.log",
            python=True,
        )

    def start(self, timeout: float = 30) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.process.start()
        wait_until(f"bootseer-snapshotter socket {self.socket}", self._accepts, timeout, alive=self.process)

    def _accepts(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            try:
                s.connect(str(self.socket))
                return True
            except OSError:
                return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        return self.process.stop(sig, timeout)

    def snapshot_dirs(self) -> list[Path]:
        """The per-snapshot directories under ROOT/snapshots/."""
        snaps = self.root / "snapshots"
        return sorted(snaps.iterdir()) if snaps.is_dir() else []


# --------------------------------------------------------------------------- containerd


#: The one setting that chooses the containerd the tests, the demo and the benchmarks run:
#: a series (:data:`CONTAINERD_SERIES`) or a directory holding ``containerd``, ``ctr`` and
#: ``containerd-shim-runc-v2``.  Unset: :data:`CONTAINERD_DEFAULT`.
CONTAINERD_SETTING = "BOOTSEER_CONTAINERD"
CONTAINERD_DEFAULT = "2.1"
#: Where ``ctr_examples/install-containerd.sh`` unpacks each series it fetches (SERIES/usr/bin).
CONTAINERD_CACHE = Path("/var/cache/bootseer/containerd")
#: Each series and its binaries' directory: 1.6 is Debian 12's package, the others the install script's.
CONTAINERD_SERIES = {
    "1.6": Path("/usr/bin"),
    "1.7": CONTAINERD_CACHE / "1.7" / "usr" / "bin",
    "2.1": CONTAINERD_CACHE / "2.1" / "usr" / "bin",
}


@dataclasses.dataclass(frozen=True)
class ContainerdInstall:
    """One containerd: its three binaries come from :attr:`bin_dir` (containerd finds the shim on PATH)."""

    bin_dir: Path
    version: tuple[int, int, int]
    version_text: str  #: ``containerd --version`` as printed
    choice: str  #: what :data:`CONTAINERD_SETTING` said (or the default)

    @property
    def series(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    @property
    def config_version(self) -> int:
        """The config dialect the harness writes for it: ``version = 3`` from 2.0 on, else 2."""
        return 3 if self.version[0] >= 2 else 2

    @property
    def containerd(self) -> str:
        return str(self.bin_dir / "containerd")

    @property
    def ctr(self) -> str:
        return str(self.bin_dir / "ctr")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with :attr:`bin_dir` first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        return env

    def describe(self) -> str:
        return f"containerd {'.'.join(map(str, self.version))} ({CONTAINERD_SETTING}={self.choice}, {self.bin_dir})"

    def loaded_config(self, path: Path) -> dict:
        """``containerd --config PATH config dump``: what this containerd makes of the file (parsed, defaults
        filled in, and an older ``version`` migrated)."""
        import tomllib

        dump = subprocess.run([self.containerd, "--config", str(path), "config", "dump"], capture_output=True,
                              text=True, timeout=60, check=True).stdout
        return tomllib.loads(dump)


#: Where Debian 12's containerd 1.6 Go sources are (golang-github-containerd-containerd-dev, a GOPATH root).
SYSTEM_GO_SOURCES = Path("/usr/share/gocode")


@dataclasses.dataclass(frozen=True)
class ContainerdGoSources:
    """containerd's Go sources of one version with a Go toolchain that builds them offline in GOPATH mode:
    what ``integration/test_conformance.py`` builds containerd's snapshotter test suite of that version from."""

    gopath: Path  #: a GOPATH root holding src/github.com/containerd/containerd (and every dependency)
    go: str  #: the go command
    goroot: Path | None  #: its GOROOT when it is not the system's
    tags: tuple[str, ...]  #: build tags of integration/conformance for this version (containerd2 for 2.x)

    def env(self, own_gopath: Path, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of an offline GOPATH build: ``own_gopath`` first, then :attr:`gopath`."""
        env = dict(os.environ if base is None else base, GO111MODULE="off", GOPROXY="off", GOFLAGS="",
                   CGO_ENABLED="0", GOTOOLCHAIN="local", GOPATH=f"{own_gopath}{os.pathsep}{self.gopath}")
        if self.goroot is not None:
            env["GOROOT"] = str(self.goroot)
        return env


def containerd_go_sources(install: ContainerdInstall) -> ContainerdGoSources:
    """The Go sources of ``install``'s series: Debian 12's for 1.6 (with the system's Go), else those
    ``ctr_examples/install-containerd.sh`` unpacked beside its binaries; HarnessError saying what is missing."""
    if install.series == "1.6":
        go = shutil.which("go")
        if go is None or not (SYSTEM_GO_SOURCES / "src/github.com/containerd/containerd/snapshots/testsuite").is_dir():
            raise HarnessError("go or containerd 1.6's Go sources missing: install golang-go and "
                               "golang-github-containerd-containerd-dev (ctr_examples/install-deps.sh)")
        return ContainerdGoSources(SYSTEM_GO_SOURCES, go, None, ())
    root = CONTAINERD_CACHE / f"{install.series}-go"
    toolchains = sorted(root.glob("usr/lib/go-*/bin/go"), key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.parent.name)])
    if not toolchains or not (root / "usr/share/gocode/src/github.com/containerd/containerd").is_dir():
        raise HarnessError(f"containerd {install.series}'s Go sources missing in {root} "
                           f"(ctr_examples/install-containerd.sh {install.series})")
    return ContainerdGoSources(root / "usr/share/gocode", str(toolchains[-1]), toolchains[-1].parent.parent,
                               ("containerd2",) if install.version[0] >= 2 else ())


def _probe_containerd(choice: str) -> ContainerdInstall:
    bin_dir = CONTAINERD_SERIES.get(choice) or Path(choice)
    if choice not in CONTAINERD_SERIES and not bin_dir.is_absolute():
        raise HarnessError(f"{CONTAINERD_SETTING}={choice!r}: give one of {sorted(CONTAINERD_SERIES)} or an absolute "
                           "directory holding containerd, ctr and containerd-shim-runc-v2")
    missing = [b for b in ("containerd", "ctr", "containerd-shim-runc-v2") if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        hint = " (install it: ctr_examples/install-containerd.sh)" if choice in CONTAINERD_SERIES else ""
        raise HarnessError(f"containerd {choice}: {', '.join(missing)} missing in {bin_dir}{hint}")
    try:
        text = subprocess.run([str(bin_dir / "containerd"), "--version"], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise HarnessError(f"{bin_dir / 'containerd'} --version failed: {e}") from e
    # "containerd github.com/containerd/containerd/v2 2.1.9+unknown", "... 1.7.24~ds1 1.7.24~ds1-6+deb13u1"
    found = re.search(r"\sv?(\d+)\.(\d+)\.(\d+)", text)
    if found is None:
        raise HarnessError(f"{bin_dir / 'containerd'} --version printed no version: {text!r}")
    major, minor, patch = (int(n) for n in found.groups())
    install = ContainerdInstall(bin_dir, (major, minor, patch), text, choice)
    if choice in CONTAINERD_SERIES and install.series != choice:
        raise HarnessError(f"{CONTAINERD_SETTING}={choice}, but {install.containerd} is {install.series}: {text!r}")
    return install


@functools.lru_cache(maxsize=None)
def _containerd_install(choice: str) -> ContainerdInstall:
    return _probe_containerd(choice)


def containerd_install(choice: str | None = None) -> ContainerdInstall:
    """The containerd :data:`CONTAINERD_SETTING` chooses (read here only), or ``choice`` (a value that setting
    takes, for a tool comparing several: the benchmark); HarnessError if it is not there."""
    return _containerd_install(choice or os.environ.get(CONTAINERD_SETTING) or CONTAINERD_DEFAULT)


def containerd_version() -> tuple[int, int, int]:
    """The chosen containerd's version, e.g. ``(2, 1, 9)``."""
    return containerd_install().version


def containerd_unavailable() -> str | None:
    """Why the chosen containerd cannot run here, or None (for pytest skips)."""
    try:
        containerd_install()
    except HarnessError as e:
        return str(e)
    return None


_UNITS = {"B": 1, "kB": 1000, "KiB": 1024, "MB": 1000**2, "MiB": 1024**2, "GB": 1000**3, "GiB": 1024**3}


@dataclasses.dataclass(frozen=True)
class Usage:
    approx_bytes: int
    inodes: int


def transfer_unpack_config(snapshotter: str, platform: str = "linux") -> str:
    """The config lines (both dialects) that let containerd's transfer service unpack ``platform`` images into
    ``snapshotter``.  containerd 2.x's ``ctr images pull`` goes through that service, which refuses to unpack
    ("no unpack platforms defined") into a snapshotter no ``unpack_config`` names; naming one replaces its
    default (``overlayfs``), so a config lists every snapshotter it pulls into.  ``linux``: the host's arch."""
    return (f'\n[[plugins."io.containerd.transfer.v1.local".unpack_config]]\n'
            f'  platform = "{platform}"\n  snapshotter = "{snapshotter}"\n')


class Containerd:
    """A containerd with its own root/state/sockets, the daemon as proxy snapshotter ``bootseer``.

    ``install`` is the containerd to run (default: :func:`containerd_install`, the one
    :data:`CONTAINERD_SETTING` chooses); its ``ctr`` drives it and its directory is first on
    containerd's PATH, so the shim it starts is its own.
    """

    def __init__(self, base: Path, snapshotter_socket: Path, namespace: str, *,
                 snapshotter: str = SNAPSHOTTER_NAME, install: ContainerdInstall | None = None):
        self.base = base
        self.snapshotter = snapshotter  #: the one ``pull``/``run``/snapshot queries use
        self.install = install or containerd_install()
        self.namespace = namespace
        self.address = base / "containerd.sock"
        self.root = base / "root"
        self.state = base / "state"
        self.snapshotter_socket = snapshotter_socket
        self.process: ManagedProcess | None = None

    def config_dialect(self) -> int:
        """The config ``version`` written: containerd 2.x reads 3 natively (2 only by migrating it), 1.x reads 2."""
        return self.install.config_version

    def private_settings(self) -> str:
        """The top-level keys (before any table) that keep this containerd off the host's: its root and state;
        CRI off (:meth:`cri_disabled_lines`, which :class:`CriContainerd` overrides)."""
        return f'root = "{self.root}"\nstate = "{self.state}"\n{self.cri_disabled_lines()}'

    def cri_disabled_lines(self) -> str:
        """The config's line that switches the CRI plugin off (:class:`CriContainerd` leaves it out)."""
        return 'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'

    def private_tables(self) -> str:
        """The tables that keep this containerd off the host's: its sockets, debug log level, ``opt`` directory."""
        return f"""
[grpc]
  address = "{self.address}"

[ttrpc]
  address = "{self.address}.ttrpc"

[debug]
  address = "{self.base / 'debug.sock'}"
  level = "debug"

[plugins."io.containerd.internal.v1.opt"]
  path = "{self.base / 'opt'}"
"""

    def config_text(self) -> str:
        """The whole config: private paths, CRI off, the daemon as proxy plugin ``bootseer``; and from 1.7 on,
        the transfer service (2.x's ``ctr images pull``) allowed to unpack into ``bootseer`` and ``overlayfs``."""
        text = f"""\
version = {self.config_dialect()}
{self.private_settings()}{self.private_tables()}
[proxy_plugins.{SNAPSHOTTER_NAME}]
  type = "snapshot"
  address = "{self.snapshotter_socket}"
"""
        if self.install.version >= (1, 7):
            text += "".join(transfer_unpack_config(name) for name in (SNAPSHOTTER_NAME, BUILTIN_OVERLAY))
        return text

    def start(self, timeout: float = 60) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        config = self.base / "config.toml"
        config.write_text(self.config_text())
        self.process = ManagedProcess("containerd", [self.install.containerd, "--config", str(config)],
                                      self.base / "containerd.log")
        self.process.env = self.install.env(self.process.env)
        self.process.start()
        wait_until(f"containerd to list the {self.snapshotter} snapshotter as ok", self._plugin_ok, timeout,
                   interval=0.3, alive=self.process)

    def _plugin_ok(self) -> bool:
        done = subprocess.run([self.install.ctr, "-a", str(self.address), "plugins", "ls"],
                              capture_output=True, text=True, timeout=30)
        return any(line.split()[:2] == ["io.containerd.snapshotter.v1", self.snapshotter]
                   and line.split()[-1] == "ok" for line in done.stdout.splitlines())

    def ctr_argv(self, *args: str) -> list[str]:
        """The argv of ``ctr -a SOCKET -n NAMESPACE ARGS...`` with this containerd's own ``ctr``."""
        return [self.install.ctr, "-a", str(self.address), "-n", self.namespace, *args]

    def ctr(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """``ctr -a SOCKET -n NAMESPACE ARGS...``; raises :class:`HarnessError` on failure if ``check``."""
        return run(self.ctr_argv(*args), timeout=timeout, check=check)

    def ctr_out(self, *args: str, timeout: float = 120) -> str:
        return self.ctr(*args, timeout=timeout).stdout.decode(errors="replace")

    def collect_garbage(self) -> None:
        """Run containerd's garbage collector now and wait for it: what ``ctr run --rm`` leaves to a later GC pass
        (the container's snapshot) is removed from the snapshotter when this returns.  containerd spaces its
        passes by how long the last one took (``pause_threshold``): on a loaded machine that is tens of seconds.
        A lease deleted with ``--sync`` runs a pass synchronously (every containerd version here)."""
        lease = self.ctr_out("leases", "create").split()[0]
        self.ctr("leases", "delete", "--sync", lease)

    # -- snapshot queries, through containerd (its metadata store, then the proxy) --

    def snapshots(self) -> list[dict[str, str]]:
        """``ctr snapshots --snapshotter NAME ls`` as rows of KEY, PARENT, KIND."""
        lines = self.ctr_out("snapshots", "--snapshotter", self.snapshotter, "ls").splitlines()
        rows = []
        for line in lines[1:]:
            fields = line.split()
            if len(fields) == 3:
                rows.append({"key": fields[0], "parent": fields[1], "kind": fields[2]})
            elif len(fields) == 2:  # a base snapshot has no parent
                rows.append({"key": fields[0], "parent": "", "kind": fields[1]})
        return rows

    def snapshot_info(self, key: str) -> dict:
        return json.loads(self.ctr_out("snapshots", "--snapshotter", self.snapshotter, "info", key))

    def snapshot_usage(self, key: str) -> Usage:
        """``ctr snapshots usage KEY``; ctr prints sizes rounded ("3.0 MiB"), so bytes are approximate."""
        lines = self.ctr_out("snapshots", "--snapshotter", self.snapshotter, "usage", key).splitlines()
        fields = lines[1].split()  # KEY SIZE [UNIT] INODES
        number, unit = float(fields[1]), (fields[2] if len(fields) == 4 else "B")
        return Usage(approx_bytes=int(number * _UNITS[unit]), inodes=int(fields[-1]))

    # -- teardown --

    def kill_tasks(self) -> None:
        """Kill and delete every task and container of the namespace (best effort, each call bounded)."""
        if self.process is None or not self.process.running:
            return

        def attempt(*args: str) -> list[str]:
            with contextlib.suppress(HarnessError):
                return self.ctr(*args, check=False, timeout=TEARDOWN_CALL_TIMEOUT).stdout.decode().split()
            return []

        tasks = attempt("tasks", "ls", "-q")
        for task in tasks:
            attempt("tasks", "kill", "-a", "-s", "SIGKILL", task)
        for task in tasks:
            attempt("tasks", "delete", "-f", task)
        for container in attempt("containers", "ls", "-q"):
            attempt("containers", "rm", container)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    @property
    def runc_root(self) -> Path:
        """Where the runc shim keeps container state: per namespace, so ours is ours alone."""
        return Path("/run/containerd/runc") / self.namespace


# --------------------------------------------------------------------------- stack


def _mounts_under(base: Path) -> list[str]:
    """Mount points at or below ``base``, deepest first (octal escapes of mountinfo decoded)."""
    points = []
    prefix = str(base).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def _pids_mentioning(needle: str) -> list[int]:
    """Processes whose command line contains ``needle`` (our unique temp path): the shims we caused."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Stack:
    """Registry + bootseer-snapshotter + private containerd in one temp dir.

    Use as a context manager; teardown runs even if the body raised, and never raises
    over the body's exception (teardown problems go to :attr:`teardown_errors`).
    """

    def __init__(self, base: Path | None = None, *, namespace: str | None = None,
                 snapshotter: str = SNAPSHOTTER_NAME, with_registry: bool = True,
                 snapshotter_log_level: str = "debug", store: bool = False, daemon_args: Sequence[str] = (),
                 containerd: ContainerdInstall | None = None):
        """``snapshotter`` is ``"bootseer"`` (start the daemon) or :data:`BUILTIN_OVERLAY`.
        ``containerd``: the containerd to run (default: :func:`containerd_install`).

        ``store``: the daemon serves lazy layers from a local store at :attr:`store_url`
        (``--store``), with its metrics at :attr:`metrics_address`.  ``daemon_args``: more
        ``bootseer-snapshotter`` flags.
        """
        if snapshotter not in (SNAPSHOTTER_NAME, BUILTIN_OVERLAY):
            raise ValueError(f"snapshotter must be {SNAPSHOTTER_NAME!r} or {BUILTIN_OVERLAY!r}, not {snapshotter!r}")
        self._own_base = base is None
        # Short paths: unix socket paths must fit in 108 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="bootseer-it-")) if base is None else base
        self.namespace = namespace or f"bootseer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.registry = Registry(self.base / "registry") if with_registry else None
        self.store_dir: Path | None = self.base / "store" if store else None
        if self.store_dir is not None:
            # An operator makes the store's directory before pointing nodes at it: the daemon refuses a
            # local store that does not exist (a typo), so it exists, empty, before anything is converted.
            self.store_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_address: str | None = f"127.0.0.1:{free_port()}" if store else None
        daemon_args = (["--store", self.store_url, "--metrics-address", self.metrics_address] if store else []) + list(daemon_args)
        self.daemon = (Snapshotter(self.base / "snap", log_level=snapshotter_log_level, extra_args=daemon_args)
                       if snapshotter == SNAPSHOTTER_NAME else None)
        self.containerd = Containerd(self.base / "ctrd", self.base / "snap" / "snapshotter.sock",
                                     self.namespace, snapshotter=snapshotter, install=containerd)
        self.teardown_errors: list[str] = []
        self._exec_seq = 0
        self._saved_logs: str | None = None

    @property
    def store_url(self) -> str:
        """The ``file://`` URL of the stack's lazy-layer store (``store=True``)."""
        if self.store_dir is None:
            raise HarnessError("this stack has no store (Stack(store=True))")
        return f"file://{self.store_dir}"

    @property
    def fifo_dir(self) -> Path:
        """Where ``ctr`` makes its IO FIFOs: in our temp dir, not the host's /run/containerd/fifo."""
        return self.base / "fifo"

    @property
    def snapshotter_name(self) -> str:
        return self.containerd.snapshotter

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.registry is not None:
            self.registry.start()
        if self.daemon is not None:
            self.daemon.start()
        self.containerd.start()

    def build_and_push(self, name: str = "bootseer/demo", tag: str = "v1",
                       layers: Sequence[Layer] | None = None) -> tuple[BuiltImage, str]:
        """Build the (demo) image as an OCI layout and push it; return it and its reference."""
        if self.registry is None:
            raise HarnessError("this stack has no registry")
        image = build_oci_layout(self.base / "images" / name.replace("/", "_"),
                                 demo_layers() if layers is None else layers, tag=tag)
        return image, self.registry.push(image, name)

    def pull(self, ref: str, timeout: float = 300) -> None:
        self.containerd.ctr("images", "pull", "--plain-http", "--snapshotter", self.snapshotter_name, ref,
                            timeout=timeout)

    def wait_for_snapshotter(self, timeout: float = 30) -> None:
        """Wait until containerd reaches the (re)started daemon again.

        containerd keeps one gRPC connection per proxy plugin and, after losing it, redials
        with backoff capped at 3 s; until then its calls fail fast with UNAVAILABLE.
        """
        wait_until(f"containerd to reach the {self.snapshotter_name} snapshotter", lambda: self.containerd.ctr(
            "snapshots", "--snapshotter", self.snapshotter_name, "ls", check=False, timeout=30).returncode == 0,
            timeout, interval=0.2)

    def restart_daemon(self, sig: int = signal.SIGTERM) -> int | None:
        """Stop the daemon with ``sig``, start it again, wait until containerd reaches it; return its exit status."""
        if self.daemon is None:
            raise HarnessError("this stack runs no bootseer daemon")
        status = self.daemon.stop(sig)
        self.daemon.start()
        self.wait_for_snapshotter()
        return status

    def run_container(self, ref: str, name: str, *argv: str, timeout: float = 120) -> str:
        """``ctr run --rm --snapshotter NAME REF NAME ARGV...``; return its stdout."""
        return self.containerd.ctr_out("run", "--rm", "--fifo-dir", str(self.fifo_dir), "--snapshotter",
                                       self.snapshotter_name, ref, name, *argv, timeout=timeout)

    def start_container(self, ref: str, name: str, *argv: str, timeout: float = 120) -> None:
        """``ctr run -d``: a container left running (its task) until killed."""
        self.containerd.ctr("run", "-d", "--fifo-dir", str(self.fifo_dir), "--snapshotter", self.snapshotter_name,
                            ref, name, *argv, timeout=timeout)

    def exec(self, container: str, *argv: str, timeout: float = 60) -> str:
        """``ctr task exec`` in a running container; return its stdout."""
        self._exec_seq += 1
        return self.containerd.ctr_out("task", "exec", "--fifo-dir", str(self.fifo_dir), "--exec-id",
                                       f"exec{self._exec_seq}", container, *argv, timeout=timeout)

    def remove_container(self, name: str) -> None:
        """Kill the container's task, delete it, and remove the container (and its snapshot)."""
        self.containerd.ctr("task", "kill", "-s", "SIGKILL", name, check=False, timeout=30)
        wait_until(f"task {name} to stop", lambda: self.task_status(name) != "RUNNING", 30)
        self.containerd.ctr("task", "delete", name, timeout=60)
        self.containerd.ctr("containers", "rm", name, timeout=60)

    def task_status(self, name: str) -> str | None:
        """RUNNING, STOPPED, ... as ``ctr task ls`` shows it; None if there is no such task."""
        for line in self.containerd.ctr_out("task", "ls", timeout=30).splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == name:
                return fields[-1]
        return None

    def close(self) -> None:
        """Tear everything down; each step runs even if an earlier one failed."""
        steps = [
            ("kill tasks", self.containerd.kill_tasks),
            ("stop containerd", self.containerd.stop),
            ("kill leftover runc containers", self._kill_runc_leftovers),
            ("kill leftover shims", self._kill_shims),
            ("stop snapshotter", self.daemon.stop if self.daemon else lambda: None),
            ("stop the layer server", self._kill_layer_server),
            ("stop registry", self.registry.stop if self.registry else lambda: None),
            ("unmount", self._unmount_all),
        ]
        if self._own_base and not os.environ.get("BOOTSEER_KEEP_TMP"):
            steps.append(("save logs", self._save_logs))
            steps.append(("remove temp dir", lambda: shutil.rmtree(self.base)))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # keep tearing down: a leak is worse than a second error
                self.teardown_errors.append(f"{what}: {e}")

    def _kill_runc_leftovers(self) -> None:
        root = self.containerd.runc_root
        if not root.is_dir():
            return
        listing = run(["runc", "--root", str(root), "list", "-q"], check=False, timeout=30)
        for container in listing.stdout.decode().split():
            run(["runc", "--root", str(root), "kill", container, "KILL"], check=False, timeout=30)
            run(["runc", "--root", str(root), "delete", "-f", container], check=False, timeout=30)
        shutil.rmtree(root, ignore_errors=True)

    def _kill_shims(self) -> None:
        for pid in _pids_mentioning(str(self.containerd.address)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _kill_layer_server(self) -> None:
        """The daemon's layer server outlives it by design (its own session): end it by its ``--root``."""
        if self.daemon is None:
            return
        pids = _pids_mentioning(f"--root {self.daemon.root} ")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
            time.sleep(0.1)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _unmount_all(self) -> None:
        failed = []
        for point in _mounts_under(self.base):
            if subprocess.run(["umount", point], capture_output=True, timeout=30).returncode != 0:
                if subprocess.run(["umount", "-l", point], capture_output=True, timeout=30).returncode != 0:
                    failed.append(point)
        if failed:
            raise HarnessError(f"could not unmount {failed}")

    def _save_logs(self) -> None:
        self._saved_logs = self.logs()

    def logs(self) -> str:
        """Every component's log, labelled, for a failure report (kept after teardown)."""
        if self._saved_logs is not None:
            return self._saved_logs + "".join(f"\nteardown error: {e}" for e in self.teardown_errors)
        parts = []
        procs: list[ManagedProcess | None] = [
            self.daemon.process if self.daemon else None, self.containerd.process,
            self.registry.process if self.registry else None,
        ]
        for proc in procs:
            if proc is not None:
                lines = proc.log_text().splitlines()
                if len(lines) > LOG_TAIL_LINES:
                    lines = [f"[... {len(lines) - LOG_TAIL_LINES} earlier lines in {proc.log_path}]"] + lines[-LOG_TAIL_LINES:]
                parts.append(f"===================== {proc.name} ({proc.log_path})\n" + "\n".join(lines))
        if self.teardown_errors:
            parts.append("===================== teardown errors\n" + "\n".join(self.teardown_errors))
        return "\n".join(parts)


# --------------------------------------------------------------------------- CRI (Kubernetes)

#: The containerd namespace the CRI plugin keeps every pod, container and image in.
CRI_NAMESPACE = "k8s.io"
#: Where Debian's containernetworking-plugins puts the CNI plugins (bridge, loopback, host-local).
CNI_BIN_DIR = Path("/usr/lib/cni")
#: The pause image's one file: static busybox as ``/bin/sleep`` (busybox runs the applet its name says).
PAUSE_CMD = ("/bin/sleep", "2147483647")


def pause_layers(busybox: Path = Path("/bin/busybox")) -> list[Layer]:
    """The sandbox (pause) image a CRI stack pushes: one layer, static busybox as ``/bin/sleep``."""
    if not busybox.is_file():
        raise HarnessError(f"{busybox} missing: install busybox-static")
    return [Layer((File("bin/sleep", busybox.read_bytes(), 0o755),), "pause: busybox sleep")]


class CriContainerd(Containerd):
    """A private containerd with its CRI plugin on, as a Kubernetes node runs it, ``bootseer`` its snapshotter.

    The settings that matter (docs/kubernetes.md says why): ``snapshotter = "bootseer"``,
    ``disable_snapshot_annotations = false``, ``restrict_oom_score_adj = true`` (root here lacks
    CAP_SYS_RESOURCE), a sandbox image from the local registry, a plain-HTTP registry host
    (``config_path``), runc's state under the stack (``options.Root``: nothing shared with another
    containerd's ``k8s.io`` namespace), and a CNI bridge of the stack's own that carries nothing off
    the machine (no gateway, no masquerade, IPAM state under the stack).
    """

    def __init__(self, base: Path, snapshotter_socket: Path, *, registry: str, sandbox_image: str,
                 snapshotter: str = SNAPSHOTTER_NAME):
        super().__init__(base, snapshotter_socket, CRI_NAMESPACE, snapshotter=snapshotter)
        self.registry = registry
        self.sandbox_image = sandbox_image
        # A bridge name of at most 15 bytes, unique to this stack; a /24 of its own in 10.213/16.
        suffix = uuid.uuid4().hex[:8]
        self.bridge = f"bsit{suffix}"
        self.subnet = f"10.213.{int(suffix[:2], 16)}.0/24"
        self.cni_conf_dir = base / "cni" / "net.d"
        #: The CRI plugin's snapshotter from the next start, if not :attr:`snapshotter` (a node rolled off BootSeer).
        self.cri_snapshotter: str | None = None
        #: CRI's ``discard_unpacked_layers`` from the next start (a pull lets containerd's GC drop layer blobs).
        self.discard_unpacked_layers = False
        #: ``disable_snapshot_annotations = false`` (True) or ``true``, from the next start. On 2.x, False also
        #: means the 2.x default pull path: through the transfer service (:meth:`cri_config_v3`).
        self.snapshot_annotations = True
        #: The proxy plugin's ``exports`` from the next start (2.x's transfer service reads
        #: ``enable_remote_snapshot_annotations`` there).
        self.snapshotter_exports: dict[str, str] = {}

    @property
    def runc_root(self) -> Path:
        return self.base / "runc"

    def cri_disabled_lines(self) -> str:
        return ""  # the CRI plugin on

    def config_text(self) -> str:
        """:class:`Containerd`'s config with the CRI plugin left on and configured, in the dialect of the
        containerd that runs (:meth:`cri_config_v2` for 1.x, :meth:`cri_config_v3` for 2.x)."""
        cri = self.cri_config_v3() if self.config_dialect() == 3 else self.cri_config_v2()
        exports = "".join(f'  {name} = "{value}"\n' for name, value in self.snapshotter_exports.items())
        return super().config_text() + cri + (f"\n[proxy_plugins.{SNAPSHOTTER_NAME}.exports]\n{exports}" if exports else "")

    def cri_config_v2(self) -> str:
        """containerd 1.6 and 1.7 (``version = 2``): one CRI plugin, ``io.containerd.grpc.v1.cri``."""
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""
[{cri}]
  sandbox_image = "{self.sandbox_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
{self._pull_settings()}  default_runtime_name = "runc"
{self._runc_runtime(f"{cri}.containerd")}
[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{self.cni_conf_dir}"
  max_conf_num = 1

[{cri}.registry]
  config_path = "{self.base / 'certs.d'}"
"""

    def cri_config_v3(self) -> str:
        """containerd 2.x (``version = 3``): the CRI plugin split in three. ``io.containerd.cri.v1.images``
        pulls (snapshotter, snapshot annotations, discarding layers, the sandbox image, registries),
        ``io.containerd.cri.v1.runtime`` runs pods (runc, CNI, OOM score), ``io.containerd.grpc.v1.cri``
        serves the API and its streams.

        With :attr:`snapshot_annotations`, ``use_local_image_pull = true`` says what 2.1 does anyway with
        ``disable_snapshot_annotations = false`` (it logs a warning and falls back): the CRI plugin pulls
        through containerd's client, which labels the layers. Without, it pulls through the transfer
        service, whose ``unpack_config`` must name the CRI snapshotter (PullImage fails "no unpack
        platforms defined" otherwise)."""
        images, runtime = "plugins.'io.containerd.cri.v1.images'", "plugins.'io.containerd.cri.v1.runtime'"
        pulls_into = self.cri_snapshotter or self.snapshotter
        # Containerd.config_text names bootseer and overlayfs already (from 1.7 on).
        named = self.snapshot_annotations or pulls_into in (SNAPSHOTTER_NAME, BUILTIN_OVERLAY)
        transfer = "" if named else transfer_unpack_config(pulls_into)
        return f"""{transfer}
[{images}]
{self._pull_settings()}  use_local_image_pull = {str(self.snapshot_annotations).lower()}

[{images}.pinned_images]
  sandbox = "{self.sandbox_image}"

[{images}.registry]
  config_path = "{self.base / 'certs.d'}"

[{runtime}]
  restrict_oom_score_adj = true
  disable_apparmor = true

[{runtime}.containerd]
  default_runtime_name = "runc"
{self._runc_runtime(f"{runtime}.containerd")}
[{runtime}.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{self.cni_conf_dir}"
  max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def _pull_settings(self) -> str:
        """BootSeer's pull settings, the same keys in both dialects (1.x: in the CRI plugin's ``containerd``
        table; 2.x: in ``io.containerd.cri.v1.images``)."""
        return (f'  snapshotter = "{self.cri_snapshotter or self.snapshotter}"\n'
                f"  disable_snapshot_annotations = {str(not self.snapshot_annotations).lower()}\n"
                f"  discard_unpacked_layers = {str(self.discard_unpacked_layers).lower()}\n")

    def _runc_runtime(self, containerd_table: str) -> str:
        """The ``runc`` runtime handler under ``containerd_table``, its state under the stack."""
        return (f'\n[{containerd_table}.runtimes.runc]\n  runtime_type = "io.containerd.runc.v2"\n'
                f'\n[{containerd_table}.runtimes.runc.options]\n  Root = "{self.runc_root}"\n')

    def cni_config(self) -> dict:
        """The one CNI network: a bridge without gateway or masquerade, IPAM state under the stack."""
        return {"cniVersion": "0.4.0", "name": f"bootseer-it-{self.bridge}", "plugins": [{
            "type": "bridge", "bridge": self.bridge, "isGateway": False, "ipMasq": False, "hairpinMode": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet}]],
                     "dataDir": str(self.base / "cni" / "ipam")},
        }]}

    def start(self, timeout: float = 60) -> None:
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        (self.cni_conf_dir / "10-bootseer-it.conflist").write_text(json.dumps(self.cni_config(), indent=2))
        hosts = self.base / "certs.d" / self.registry
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(f'server = "http://{self.registry}"\n\n'
                                          f'[host."http://{self.registry}"]\n  capabilities = ["pull", "resolve"]\n')
        super().start(timeout)
        wait_until("the CRI plugin to answer", lambda: self._cri_ready(), timeout, interval=0.3, alive=self.process)

    def _cri_ready(self) -> bool:
        import grpc

        try:
            with CriClient(self.address) as cri:
                conditions = {c.type: c.status for c in cri.status().status.conditions}
        except grpc.RpcError:
            return False
        return conditions.get("RuntimeReady", False) and conditions.get("NetworkReady", False)

    def remove_bridge(self) -> None:
        """Delete the stack's CNI bridge (the bridge plugin leaves it when the last pod goes)."""
        if Path(f"/sys/class/net/{self.bridge}").exists():
            run(["ip", "link", "del", self.bridge], timeout=30)


class CriClient:
    """The CRI v1 API of a containerd, called as the kubelet calls it (RuntimeService and ImageService)."""

    def __init__(self, address: Path, timeout: float = 120):
        import grpc

        from bootseer.proto.cri.runtime.v1 import api_pb2, api_pb2_grpc

        self.api = api_pb2
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{address}")
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self._channel)
        self.images = api_pb2_grpc.ImageServiceStub(self._channel)

    def __enter__(self) -> "CriClient":
        return self

    def __exit__(self, *exc) -> None:
        self._channel.close()

    def status(self):
        return self.runtime.Status(self.api.StatusRequest(), timeout=10)

    def pull(self, ref: str, timeout: float = 300) -> str:
        """``PullImage``; the image's ID (its config digest)."""
        return self.images.PullImage(self.api.PullImageRequest(image=self.api.ImageSpec(image=ref)),
                                     timeout=timeout).image_ref

    def remove_image(self, ref: str) -> None:
        self.images.RemoveImage(self.api.RemoveImageRequest(image=self.api.ImageSpec(image=ref)), timeout=self.timeout)

    def image_status(self, ref: str):
        return self.images.ImageStatus(self.api.ImageStatusRequest(image=self.api.ImageSpec(image=ref)),
                                       timeout=self.timeout).image

    def sandbox_config(self, name: str, log_dir: Path, annotations: dict[str, str] | None = None):
        """A pod's sandbox config as the kubelet fills it in (metadata, log directory, pod network namespace)."""
        api = self.api
        return api.PodSandboxConfig(
            metadata=api.PodSandboxMetadata(name=name, uid=uuid.uuid4().hex, namespace="default", attempt=0),
            hostname=name, log_directory=str(log_dir), annotations=annotations or {},
            labels={"io.kubernetes.pod.name": name},
            linux=api.LinuxPodSandboxConfig(security_context=api.LinuxSandboxSecurityContext(
                namespace_options=api.NamespaceOption(network=api.POD, pid=api.CONTAINER, ipc=api.POD))))

    def run_pod(self, config) -> str:
        return self.runtime.RunPodSandbox(self.api.RunPodSandboxRequest(config=config), timeout=self.timeout).pod_sandbox_id

    def create_container(self, pod_id: str, pod_config, name: str, image: str, argv: Sequence[str], *,
                         annotations: dict[str, str] | None = None) -> str:
        api = self.api
        config = api.ContainerConfig(
            metadata=api.ContainerMetadata(name=name, attempt=0), image=api.ImageSpec(image=image),
            command=list(argv), log_path=f"{name}.log", annotations=annotations or {},
            labels={"io.kubernetes.container.name": name}, linux=api.LinuxContainerConfig())
        return self.runtime.CreateContainer(api.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=pod_config), timeout=self.timeout).container_id

    def start_container(self, container_id: str) -> None:
        self.runtime.StartContainer(self.api.StartContainerRequest(container_id=container_id), timeout=self.timeout)

    def container_status(self, container_id: str):
        return self.runtime.ContainerStatus(self.api.ContainerStatusRequest(container_id=container_id),
                                            timeout=self.timeout).status

    def wait_exited(self, container_id: str, timeout: float = 120):
        """The container's status once it has exited (HarnessError after ``timeout``)."""
        def exited():
            status = self.container_status(container_id)
            return status if status.state == self.api.CONTAINER_EXITED else None

        return wait_until(f"container {container_id} to exit", exited, timeout, interval=0.2)

    def exec_sync(self, container_id: str, argv: Sequence[str], timeout: int = 60) -> str:
        """``ExecSync``; its stdout (HarnessError with stderr if it exits non-zero)."""
        done = self.runtime.ExecSync(self.api.ExecSyncRequest(container_id=container_id, cmd=list(argv), timeout=timeout),
                                     timeout=timeout + 10)
        if done.exit_code != 0:
            raise HarnessError(f"exec {list(argv)} in {container_id}: status {done.exit_code}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode(errors="replace")

    def remove_container(self, container_id: str) -> None:
        self.runtime.StopContainer(self.api.StopContainerRequest(container_id=container_id, timeout=0), timeout=self.timeout)
        self.runtime.RemoveContainer(self.api.RemoveContainerRequest(container_id=container_id), timeout=self.timeout)

    def remove_pod(self, pod_id: str) -> None:
        self.runtime.StopPodSandbox(self.api.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=self.timeout)
        self.runtime.RemovePodSandbox(self.api.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=self.timeout)

    def pods(self) -> list[str]:
        return [p.id for p in self.runtime.ListPodSandbox(self.api.ListPodSandboxRequest(), timeout=self.timeout).items]


def cri_log_lines(path: Path) -> list[str]:
    """The message of each line of a CRI container log (``TIMESTAMP STREAM TAG MESSAGE``, tag F or P)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            lines.append(parts[3])
    return lines


class CriStack(Stack):
    """A :class:`Stack` whose containerd runs the CRI plugin (:class:`CriContainerd`), driven by :meth:`cri`.

    ``discard_unpacked_layers`` and ``snapshot_annotations``: :class:`CriContainerd`'s. Starting it pushes
    the pause image to its registry before containerd starts (the CRI config names it);
    teardown first stops and removes every pod through CRI (their network namespaces and CNI state go
    with them), then does what :class:`Stack` does, then deletes the stack's CNI bridge.
    """

    def __init__(self, base: Path | None = None, *, discard_unpacked_layers: bool = False,
                 snapshot_annotations: bool = True, **options):
        options.setdefault("namespace", CRI_NAMESPACE)
        super().__init__(base, **options)
        if self.registry is None:
            raise HarnessError("a CRI stack needs its registry (the sandbox image is pulled from it)")
        self.containerd = CriContainerd(self.base / "ctrd", self.base / "snap" / "snapshotter.sock",
                                        registry="127.0.0.1:0", sandbox_image="", snapshotter=self.containerd.snapshotter)
        self.containerd.discard_unpacked_layers = discard_unpacked_layers
        self.containerd.snapshot_annotations = snapshot_annotations
        self.pod_logs = self.base / "pods"
        self._pods = 0
        self.pause_image: BuiltImage | None = None  #: the sandbox image, once :meth:`start` built it

    def start(self) -> None:
        self.registry.start()
        self.containerd.registry = self.registry.address
        pause = build_oci_layout(self.base / "images" / "pause", pause_layers(), tag="v1", cmd=PAUSE_CMD)
        self.containerd.sandbox_image = self.registry.push(pause, "bootseer/pause")
        self.pause_image = pause
        if self.daemon is not None:
            self.daemon.start()
        self.containerd.start()

    def cri(self) -> CriClient:
        return CriClient(self.containerd.address)

    def run_pod(self, name: str, annotations: dict[str, str] | None = None) -> tuple[str, object]:
        """``RunPodSandbox`` of a pod named ``name``; its id and config (CreateContainer needs both)."""
        self._pods += 1
        log_dir = self.pod_logs / f"{name}-{self._pods}"
        log_dir.mkdir(parents=True, exist_ok=True)
        with self.cri() as cri:
            config = cri.sandbox_config(name, log_dir, annotations)
            return cri.run_pod(config), config

    def run_in_pod(self, pod: tuple[str, object], name: str, image: str, *argv: str,
                   annotations: dict[str, str] | None = None) -> str:
        """CreateContainer + StartContainer of ``argv`` in ``pod``; the container's id."""
        pod_id, config = pod
        with self.cri() as cri:
            container = cri.create_container(pod_id, config, name, image, argv, annotations=annotations)
            cri.start_container(container)
        return container

    def output(self, pod: tuple[str, object], container: str, timeout: float = 120) -> list[str]:
        """The exited container's output lines, read from its CRI log file (HarnessError if it failed)."""
        with self.cri() as cri:
            status = cri.wait_exited(container, timeout)
        lines = cri_log_lines(Path(status.log_path))
        if status.exit_code != 0:
            raise HarnessError(f"container {container} exited with status {status.exit_code}: {lines}")
        return lines

    def close(self) -> None:
        try:
            if self.containerd.process is not None and self.containerd.process.running:
                with self.cri() as cri:
                    for pod in cri.pods():
                        cri.remove_pod(pod)
        except Exception as e:  # keep tearing down: Stack.close kills what is left
            self.teardown_errors.append(f"remove pods: {e}")
        super().close()
        try:
            self.containerd.remove_bridge()
        except Exception as e:
            self.teardown_errors.append(f"remove the CNI bridge: {e}")


def snapshotter_view(stack: Stack) -> dict[str, dict]:
    """Every snapshot as the daemon itself holds it (its own List over its socket, not containerd's view):
    ``{name: {"parent", "kind", "labels"}}``; the labels are those its Prepare (or Commit) received."""
    import grpc

    from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc

    if stack.daemon is None:
        raise HarnessError("this stack runs no bootseer daemon")
    with grpc.insecure_channel(f"unix://{stack.daemon.socket}") as channel:
        stub = snapshots_pb2_grpc.SnapshotsStub(channel)
        return {info.name: {"parent": info.parent, "kind": snapshots_pb2.Kind.Name(info.kind), "labels": dict(info.labels)}
                for response in stub.List(snapshots_pb2.ListSnapshotsRequest(snapshotter=SNAPSHOTTER_NAME), timeout=30)
                for info in response.info}
