"""The ``bootseer-snapshotter`` daemon as a test meets it: a real process on a unix socket.

* :class:`SnapshotterDaemon`: one daemon process, its JSON log kept in a file, a gRPC
  stub once it answers.
* Fixtures (offered to every test by tests/conftest.py): ``snapshotter_factory``
  (``factory(*flags, root=, address=, wait=True)`` starts daemons, all stopped at
  teardown, then the layer servers they started) and ``snapd`` (one daemon on a fresh root).
* :func:`started_record` (the daemon's "started" log line), :func:`scrape` (a
  Prometheus endpoint's samples).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as api_grpc

BINARY = Path(sys.executable).with_name("bootseer-snapshotter")
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


class SnapshotterDaemon:
    """One ``bootseer-snapshotter`` process, its log (stderr) kept in a file."""

    def __init__(self, workdir: Path, root: Path | None, address: Path | None, *args: str) -> None:
        self.root = root
        self.address = address
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"daemon-{len(list(workdir.glob('daemon-*.log')))}.log"
        command = [str(BINARY), "--log-format", "json"]
        if root is not None:
            command += ["--root", str(root)]
        if address is not None:
            command += ["--address", str(address)]
        command += list(args)
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        self._channel: grpc.Channel | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        """The JSON log lines (non-JSON lines, such as tracebacks from a crash, are skipped)."""
        records = []
        for line in self.log.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
        return records

    def wait_ready(self) -> "SnapshotterDaemon":
        """Wait until the daemon answers on its socket; fail with its log if it exits first."""
        assert self.address is not None, "the tests always name the socket"
        # A channel of its own: gRPC shares connections between channels to one target
        # in a process, which would reach an earlier daemon still connected on this path.
        channel = grpc.insecure_channel(f"unix:{self.address}", options=[("grpc.use_local_subchannel_pool", 1)])
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + START_TIMEOUT
        while not ready.done():
            if self.process.poll() is not None or time.monotonic() > deadline:
                ready.cancel()
                channel.close()
                pytest.fail(f"daemon not ready (exit status {self.process.poll()}):\n{self.log}")
            time.sleep(0.05)
        # Another process could have answered on the socket: make sure ours is alive.
        assert self.process.poll() is None, f"daemon exited ({self.process.returncode}):\n{self.log}"
        self._channel = channel
        return self

    @property
    def stub(self) -> api_grpc.SnapshotsStub:
        assert self._channel is not None, "call wait_ready() first"
        return api_grpc.SnapshotsStub(self._channel)

    def wait_exit(self, timeout: float = STOP_TIMEOUT) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"daemon still running after {timeout}s:\n{self.log}")

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the daemon and return its exit status."""
        self.close_channel()
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.wait_exit()

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def kill(self) -> None:
        """Make sure the process is gone, whatever state it is in (teardown)."""
        self.close_channel()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)


DaemonFactory = Callable[..., SnapshotterDaemon]


@pytest.fixture
def snapshotter_factory(tmp_path: Path, layer_server_reaper: Callable[[Path], None]) -> Iterator[DaemonFactory]:
    """Starts daemons (``factory(*flags, root=, address=, wait=True)``); all are stopped at teardown,
    then the layer servers a daemon with ``--store`` started under their roots (they outlive it).

    ``root`` and ``address`` default to ``tmp_path/root`` and ``tmp_path/run/s.sock``;
    ``None`` leaves the flag out.
    """
    daemons: list[SnapshotterDaemon] = []

    def start(
        *args: str,
        root: Path | None = tmp_path / "root",
        address: Path | None = tmp_path / "run" / "s.sock",
        wait: bool = True,
    ) -> SnapshotterDaemon:
        daemon = SnapshotterDaemon(tmp_path / "logs", root, address, *args)
        daemons.append(daemon)
        layer_server_reaper(root if root is not None else tmp_path)  # after the daemons: their watch restarts one
        return daemon.wait_ready() if wait else daemon

    yield start
    for daemon in daemons:
        daemon.kill()


@pytest.fixture
def snapd(snapshotter_factory: DaemonFactory) -> SnapshotterDaemon:
    """A running daemon on a fresh root."""
    return snapshotter_factory()


def started_record(daemon: SnapshotterDaemon) -> dict:
    records = [r for r in daemon.log_records() if r["msg"] == "bootseer-snapshotter started"]
    assert records, daemon.log
    return records[0]


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """The samples a Prometheus endpoint at ``address`` serves, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
