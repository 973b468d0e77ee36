"""containerd as the tests, the demo and the benchmarks run it: which one, and a private instance of it.

* Which containerd: :data:`CONTAINERD_SETTING` (``BOOTSEER_CONTAINERD``: ``1.6``, ``1.7``, ``2.1``, the
  default, or a directory; read here only) names it, :func:`containerd_install` finds and checks its
  binaries (:class:`ContainerdInstall`), :func:`containerd_go_sources` the Go sources of its version
  (docs/testing.md, "Which containerd").
* :class:`Containerd` runs that containerd with its own root, state and sockets and the daemon
  registered as the ``bootseer`` proxy snapshotter, in the config dialect of its version;
  :meth:`Containerd.ctr` runs its ``ctr`` against it in a namespace of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.support.processes import HarnessError, ManagedProcess, run
from tests.support.waiting import wait_until

#: The name containerd knows the daemon by (``[proxy_plugins.bootseer]``).
SNAPSHOTTER_NAME = "bootseer"
#: containerd's built-in snapshotter: the reference the harness itself is checked against
#: (``BOOTSEER_IT_SNAPSHOTTER=overlayfs`` runs the integration tests on it, no daemon).
BUILTIN_OVERLAY = "overlayfs"

#: Per-call bound on ``ctr`` during teardown: a wedged shim must not stall it (shims are killed after).
TEARDOWN_CALL_TIMEOUT = 10


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
