"""A whole node on one machine: registry, ``bootseer-snapshotter`` and a private containerd in one temp dir.

* :class:`Snapshotter` runs ``bootseer-snapshotter`` (:func:`snapshotter_binary`: ``$BOOTSEER_SNAPSHOTTER``,
  else this checkout's venv) and can stop, kill and restart it.
* :class:`Stack` composes it with :class:`~tests.support.registry.Registry` and
  :class:`~tests.support.containerd.Containerd` and tears everything down (tasks, shims, mounts,
  processes, files) even when the body failed; :meth:`Stack.logs` gathers every process's log for
  failure reports.

All processes log to files under the stack's directory; every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Sequence

from tests.support.containerd import (
    BUILTIN_OVERLAY, SNAPSHOTTER_NAME, Containerd, ContainerdInstall,
)
from tests.support.layers import Layer
from tests.support.oci import BuiltImage, build_oci_layout, demo_layers
from tests.support.processes import HarnessError, ManagedProcess, command_output, is_zombie, mounts_under, pids_mentioning, run
from tests.support.registry import Registry
from tests.support.waiting import free_port, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Lines of each component's log a failure report shows (the files keep everything).
LOG_TAIL_LINES = 200


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
        return f"{binary} --help failed: {command_output(probe.stdout, probe.stderr)}"
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
        wait_until(f"bootseer-snapshotter socket {self.socket}", self._accepts, timeout, interval=0.1,
                   alive=self.process)

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
        self.store_dir: Path | None = self.base / "store" if store else None
        if self.store_dir is not None:
            # An operator makes the store's directory before pointing nodes at it: the daemon refuses a
            # local store that does not exist (a typo), so it exists, empty, before anything is converted.
            self.store_dir.mkdir(parents=True, exist_ok=True)
        metrics_port = free_port() if store else None
        self.metrics_address: str | None = f"127.0.0.1:{metrics_port}" if store else None
        # The daemon takes its metrics port after the registry has started: the registry must not take it first.
        self.registry = (Registry(self.base / "registry", avoid={metrics_port} if metrics_port else ())
                         if with_registry else None)  # fmt: skip
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
        wait_until(f"task {name} to stop", lambda: self.task_status(name) != "RUNNING", 30, interval=0.1)
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
        for pid in pids_mentioning(str(self.containerd.address)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _kill_layer_server(self) -> None:
        """The daemon's layer server outlives it by design (its own session): end it by its ``--root``."""
        if self.daemon is None:
            return
        pids = pids_mentioning(f"--root {self.daemon.root} ")
        holders = set(pids_mentioning("datapath.event_holder"))  # it ignores SIGTERM by design: killed once the server is
        pids, holders = [pid for pid in pids if pid not in holders], [pid for pid in pids if pid in holders]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not is_zombie(pid)]
            time.sleep(0.1)
        for pid in pids + holders:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _unmount_all(self) -> None:
        failed = []
        for point in mounts_under(self.base):
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
