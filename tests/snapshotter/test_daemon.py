"""The ``bootseer-snapshotter`` daemon as containerd meets it: a real process on a unix socket.

Each test starts the installed ``bootseer-snapshotter`` on a temporary root and socket
and talks to it over real gRPC (:mod:`tests.support.daemon`: :class:`SnapshotterDaemon`
and the ``snapshotter_factory`` and ``snapd`` fixtures).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from bootseer import __version__
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2 as api
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as api_grpc
from bootseer.snapshotter import config
from bootseer.snapshotter.metastore import SCHEMA_VERSION
from tests.support.daemon import BINARY, START_TIMEOUT, DaemonFactory, SnapshotterDaemon, scrape, started_record
from tests.support.waiting import free_port


# --- command line and configuration --------------------------------------------------------


def test_version() -> None:
    result = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"bootseer-snapshotter {__version__}"


def test_startup_log_names_version_root_address(snapd: SnapshotterDaemon) -> None:
    record = started_record(snapd)
    assert record["version"] == __version__
    assert record["root"] == str(snapd.root)
    assert record["address"] == str(snapd.address)
    assert record["metrics_address"] == "off"
    assert record["pid"] == snapd.process.pid


def test_config_file_with_flag_override(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    config_root = tmp_path / "config-root"
    config_address = tmp_path / "config.sock"
    flag_address = tmp_path / "flag.sock"
    config_file = tmp_path / "snapshotter.toml"
    config_file.write_text(
        f'root = "{config_root}"\naddress = "{config_address}"\nlog_level = "debug"\nlog_format = "text"\n'
    )
    # The fixture always passes --log-format json: that flag overrides the file's "text".
    daemon = snapshotter_factory("--config", str(config_file), root=None, address=flag_address)
    with pytest.raises(grpc.RpcError) as err:
        daemon.stub.Stat(api.StatSnapshotRequest(key="missing"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    assert not config_address.exists()
    assert (config_root / "lock").read_text().strip() == str(daemon.process.pid)
    assert daemon.stop() == 0
    records = daemon.log_records()
    assert len(records) == len(daemon.log.splitlines())  # every line is JSON: the flag won
    assert started_record(daemon)["root"] == str(config_root)
    # log_level = "debug" from the file: failed calls are logged at debug level.
    assert any(r["level"] == "debug" and r.get("key") == "missing" for r in records), daemon.log


def test_example_config_sets_every_key_to_its_default() -> None:
    example = Path(__file__).resolve().parents[2] / "ctr_examples" / "bootseer-snapshotter.toml"
    given = config.read_file(example)
    assert set(given) == set(config.DEFAULTS)  # every key is there...
    assert config.resolve(given, {}) == config.resolve({}, {})  # ...set to the value its default means ("4M": 4 << 20)


def test_fetch_memory_limit_reaches_the_layer_server_command_line() -> None:
    """``[fetch] memory_limit`` is the layer server's ``--memory-limit`` (its RSS follows it)."""
    from bootseer.blockstore.server.client import ServerSettings

    settings = config.resolve({"fetch.memory_limit": "256M", "store.url": "file:///store"}, {})
    assert settings.fetch_memory_limit == 256 << 20
    assert config.resolve({}, {}).fetch_memory_limit == 1 << 30
    assert ServerSettings(memory_limit=settings.fetch_memory_limit).document()["memory-limit"] == 256 << 20
    assert "memory-limit" not in ServerSettings().document()


def test_decode_threads_are_one_per_cpu_unless_set_and_reach_the_layer_server() -> None:
    """``[fetch] decode_threads`` is the layer server's ``--decode-threads`` (0, the default: not passed, the
    server takes one per CPU it may run on); a negative or absurd count is refused naming the key."""
    from bootseer.blockstore.server.client import ServerSettings

    assert config.resolve({}, {}).fetch_decode_threads == 0
    assert "decode-threads" not in ServerSettings().document()
    settings = config.resolve({"fetch.decode_threads": 1}, {})
    assert ServerSettings(decode_threads=settings.fetch_decode_threads).document()["decode-threads"] == 1
    for wrong in (-1, config.MAX_DECODE_THREADS + 1):
        with pytest.raises(config.ConfigError, match=r"fetch\.decode_threads"):
            config.resolve({"fetch.decode_threads": wrong}, {})


def test_hotlist_settings_reach_the_layer_server_the_daemon_starts(
    tmp_path: Path, snapshotter_factory: DaemonFactory
) -> None:
    """``[hotlist]`` keys and ``--publish-store`` become the started layer server's options."""
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    store, publish = tmp_path / "store", tmp_path / "publish"
    store.mkdir()
    config_file = tmp_path / "snapshotter.toml"
    config_file.write_text(
        '[hotlist]\npublish_store = "/not/this/one"\nquiet = 3\nwindow = 30.5\nmarker = "-done"\n'
        'prefetch_concurrency = 2\nprefetch_batch = "1M"\nprefetch_cold_rate = "8M"\n'
    )
    root = tmp_path / "root"
    snapshotter_factory("--config", str(config_file), "--store", f"file://{store}", "--publish-store", str(publish), root=root)
    status = LayerServerClient(ServerPaths(root).socket).status()
    argv = [arg.decode() for arg in Path(f"/proc/{status['pid']}/cmdline").read_bytes().split(b"\0")]
    started = status["settings"]  # what the server runs with (from the settings document on its pipe)

    # The flag wins over the file; settings reach the server in one document on a pipe, never in its argv.
    assert status["publish_store"] == str(publish) and started["publish-store"] == str(publish)
    assert argv[argv.index("--settings-file") + 1].startswith("/dev/fd/") and str(publish) not in " ".join(argv)
    assert (started["hotlist-quiet"], started["hotlist-window"]) == (3.0, 30.5)
    assert started["hotlist-marker"] == "-done"  # a marker starting with "-" is still a value
    assert (started["prefetch-concurrency"], started["prefetch-batch"], started["prefetch-cold-rate"]) == (
        2, 1 << 20, 8 << 20,
    )  # fmt: skip
    assert "no-hotlist" not in started


def test_peer_and_proxy_settings_reach_the_layer_server_the_daemon_starts(
    tmp_path: Path, snapshotter_factory: DaemonFactory
) -> None:
    """``[peers] fetch_budget, max_connections, deadline`` and ``[store] proxy_read_timeout`` (issue 21) become
    the started layer server's options, and the server runs with them (its peers status and start-up log)."""
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    me = f"127.0.0.1:{free_port()}"
    config_file = tmp_path / "snapshotter.toml"
    config_file.write_text(
        f'[store]\nurl = "http://127.0.0.1:{free_port()}/"\nproxy = "http://127.0.0.1:{free_port()}"\n'
        'proxy_read_timeout = 7\n'
        f'[peers]\nlisten = "{me}"\nmembers = ["{me}"]\nfetch_budget = "64M"\nmax_connections = 16\ndeadline = 2\n'
    )
    root = tmp_path / "root"
    snapshotter_factory("--config", str(config_file), root=root)
    client = LayerServerClient(ServerPaths(root).socket)
    started = client.status()["settings"]
    assert (started["peer-fetch-budget"], started["peer-max-connections"], started["peer-deadline"]) == (
        64 << 20, 16, 2.0,
    )  # fmt: skip
    assert started["store-proxy-read-timeout"] == 7.0
    status = client.call({"op": "peers.status"})
    assert (status["fetch_budget"], status["connections"]["limit"], status["deadline"]) == (64 << 20, 16, 2.0)
    log = ServerPaths(root).log.read_text(errors="replace")
    assert "reading http(s) stores through a proxy" in log and "read_timeout=7.0" in log, log[-2000:]


def test_layer_server_metrics_address_reaches_the_layer_server_the_daemon_starts(
    tmp_path: Path, snapshotter_factory: DaemonFactory
) -> None:
    """``[fuse] metrics_address`` (``--layer-server-metrics-address``) is the started layer
    server's ``--metrics-address``, and it answers there with the FUSE metrics."""
    import urllib.request

    from bootseer.blockstore.server.client import LayerServerClient

    from bootseer.paths import ServerPaths

    assert config.resolve({"fuse.metrics_address": "127.0.0.1:9309"}, {}).layer_server_metrics_address == "127.0.0.1:9309"
    assert config.resolve({}, {}).layer_server_metrics_address == ""
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    root = tmp_path / "root"
    snapshotter_factory("--store", f"file://{store}", "--layer-server-metrics-address", f"127.0.0.1:{port}", root=root)
    assert LayerServerClient(ServerPaths(root).socket).status()["settings"]["metrics-address"] == f"127.0.0.1:{port}"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert 'bootseer_layer_server_up 1.0' in answer.read().decode()


def test_hotlist_can_be_turned_off_for_the_layer_server() -> None:
    from bootseer.blockstore.server.client import ServerSettings

    settings = config.resolve({"hotlist.enabled": False, "store.url": "file:///store"}, {})
    assert settings.hotlist_enabled is False
    assert ServerSettings(hotlist=settings.hotlist_enabled).document()["no-hotlist"] is True
    default = ServerSettings().document()
    assert "no-hotlist" not in default and "publish-store" not in default
    assert "no-prefetch-page-cache" not in default
    assert config.resolve({}, {}).hotlist_prefetch.page_cache is True
    off = config.resolve({"hotlist.prefetch_page_cache": False, "store.url": "file:///store"}, {}).hotlist_prefetch
    assert off.page_cache is False
    assert ServerSettings(prefetch_page_cache=off.page_cache).document()["no-prefetch-page-cache"] is True


@pytest.mark.parametrize(
    "content, expected",
    [
        ('rooot = "/x"\n', ["'rooot'", "unknown key"]),
        ("root = 5\n", ["'root'", "string", "integer"]),
        ('log_level = "loud"\n', ["log_level", "loud"]),
        ('metrics_address = "no-port"\n', ["metrics_address", "HOST:PORT"]),
        ('[fuse]\nmetrics_address = "no-port"\n', ["fuse.metrics_address", "HOST:PORT"]),
        ('metrics_address = "127.0.0.1:9300"\n[fuse]\nmetrics_address = "127.0.0.1:9300"\n', ["fuse.metrics_address", "own port"]),
        ('root = "/x\n', ["not valid TOML"]),
        ("[root]\npath = '/x'\n", ["'root'", "string", "table"]),
        ('[store]\nurll = "file:///x"\n', ["'store.urll'", "unknown key"]),
        ('store = "file:///x"\n', ["'store'", "unknown key"]),
        ("[fetch]\nstreams = \"8\"\n", ["'fetch.streams'", "integer", "string"]),
        ("[fetch]\nstreams = 0\n", ["fetch.streams", "at least 1"]),
        ("[fetch]\nretry_timeout = true\n", ["'fetch.retry_timeout'", "boolean"]),
        ('[cache]\nsize = "lots"\n', ["cache.size", "invalid size"]),
        ('[store]\nurl = "ftp://host/store"\n', ["store.url", "ftp"]),
        ('[fetch]\nmemory_limit = "1M"\n', ["fetch.memory_limit", "at least one stripe"]),
        ('[fetch]\nmemory_limit = "plenty"\n', ["fetch.memory_limit", "invalid size"]),
        ('[hotlist]\nenabled = "yes"\n', ["'hotlist.enabled'", "boolean", "string"]),
        ('[hotlist]\nquiett = 5\n', ["'hotlist.quiett'", "unknown key"]),
        ('[hotlist]\nquiet = 0\n', ["hotlist.quiet", "positive"]),
        ('[hotlist]\nmarker = "a/b"\n', ["hotlist.marker", "plain file name"]),
        ('[hotlist]\nprefetch_concurrency = 0\n', ["hotlist.prefetch_concurrency", "positive"]),
        ('[hotlist]\nprefetch_batch = "lots"\n', ["hotlist.prefetch_batch", "invalid size"]),
        ('[hotlist]\npublish_store = "/srv/lists"\n', ["hotlist.publish_store", "store of layers"]),
        ('[store]\nurl = "file:///s"\n[hotlist]\npublish_store = "http://front/s"\n', ["hotlist.publish_store", "read-only"]),
        ('[store]\nurl = "file:///s"\n[hotlist]\npublish_store = "ftp://h/s"\n', ["hotlist.publish_store", "ftp"]),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, content: str, expected: list[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(content)
    root = tmp_path / "root"
    result = subprocess.run(
        [str(BINARY), "--config", str(config), "--root", str(root), "--address", str(tmp_path / "s.sock")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    for text in expected:
        assert text in result.stderr
    assert not root.exists(), "a bad config must not touch anything"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "/nonexistent/bootseer.toml"], "cannot read config file"),
        (["--metrics-address", "localhost"], "--metrics-address"),
        (["--log-level", "loud"], "--log-level"),
        (["--root", ""], "--root"),
        (["--cache-size", "-5"], "--cache-size"),
        (["--store", "gopher://x/y"], "--store"),
        (["--store", "/srv/store", "--publish-store", "https://front/store"], "--publish-store"),
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    result = subprocess.run(
        [str(BINARY), "--address", str(tmp_path / "s.sock"), *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr


# --- socket and root ---------------------------------------------------------------------


def test_socket_permissions(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    address = tmp_path / "run" / "nested" / "s.sock"
    daemon = snapshotter_factory(root=tmp_path / "root", address=address)
    st = os.lstat(address)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    for created in (tmp_path / "run", tmp_path / "run" / "nested"):
        assert stat.S_IMODE(os.stat(created).st_mode) == 0o711
    assert stat.S_IMODE(os.stat(daemon.root).st_mode) == 0o700


def test_stale_socket_is_replaced(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    address = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as leftover:  # bound, never listening: what a crash leaves
        leftover.bind(str(address))
    assert stat.S_ISSOCK(os.lstat(address).st_mode)
    daemon = snapshotter_factory(root=tmp_path / "root", address=address)
    daemon.stub.Prepare(api.PrepareSnapshotRequest(key="k"))
    assert any(r["msg"] == "replacing stale socket" for r in daemon.log_records())


def test_file_at_address_is_not_replaced(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    address = tmp_path / "s.sock"
    address.write_text("precious")
    daemon = snapshotter_factory(root=tmp_path / "root", address=address, wait=False)
    assert daemon.wait_exit() == 2
    assert "is not a socket" in daemon.log
    assert address.read_text() == "precious"


def test_second_daemon_on_same_socket_is_refused(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    address = tmp_path / "s.sock"
    first = snapshotter_factory(root=tmp_path / "root1", address=address)
    first.stub.Prepare(api.PrepareSnapshotRequest(key="k"))
    inode = os.lstat(address).st_ino

    second = snapshotter_factory(root=tmp_path / "root2", address=address, wait=False)
    assert second.wait_exit() == 2
    assert "another process is serving" in second.log
    assert os.lstat(address).st_ino == inode
    assert first.stub.Stat(api.StatSnapshotRequest(key="k")).info.name == "k"


def test_socket_taken_over_is_left_to_its_new_owner(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    # A's socket is unlinked from under it; B claims the path; A's shutdown must not
    # unlink B's socket (gRPC itself unlinks the path it bound when it stops).
    address = tmp_path / "s.sock"
    first = snapshotter_factory(root=tmp_path / "root1", address=address)
    os.unlink(address)
    second = snapshotter_factory(root=tmp_path / "root2", address=address)
    second.stub.Prepare(api.PrepareSnapshotRequest(key="b"))
    inode = os.lstat(address).st_ino

    assert first.stop() == 0
    assert stat.S_ISSOCK(os.lstat(address).st_mode) and os.lstat(address).st_ino == inode
    assert second.stub.Stat(api.StatSnapshotRequest(key="b")).info.name == "b"
    assert any(r["msg"].startswith("socket path now belongs to another socket") for r in first.log_records())
    assert second.stop() == 0
    assert not os.path.lexists(address)


def test_daemons_started_at_once_on_one_path_exactly_one_serves(
    tmp_path: Path, snapshotter_factory: DaemonFactory
) -> None:
    address = tmp_path / "s.sock"
    for round_ in range(10):  # the old check-then-bind let both up within a few rounds here
        racers = [
            snapshotter_factory(root=tmp_path / f"root-{round_}-{i}", address=address, wait=False) for i in range(2)
        ]
        deadline = time.monotonic() + START_TIMEOUT
        while all(r.process.poll() is None for r in racers):  # until the loser gives up
            assert time.monotonic() < deadline, "\n".join(r.log for r in racers)
            time.sleep(0.05)
        (loser,) = [r for r in racers if r.process.poll() is not None]
        (winner,) = [r for r in racers if r is not loser]
        assert loser.wait_exit() == 2, loser.log
        (refusal,) = [r for r in loser.log_records() if r["msg"] == "bootseer-snapshotter cannot start"]
        assert str(address) in refusal["error"]
        assert "another bootseer-snapshotter" in refusal["error"] or "another process is serving" in refusal["error"]
        winner.wait_ready()
        winner.stub.Prepare(api.PrepareSnapshotRequest(key="k"))
        assert winner.stop() == 0
        assert not os.path.lexists(address)


def test_second_daemon_on_same_root_is_refused(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    root = tmp_path / "root"
    first = snapshotter_factory(root=root, address=tmp_path / "s1.sock")
    first.stub.Prepare(api.PrepareSnapshotRequest(key="k"))

    second = snapshotter_factory(root=root, address=tmp_path / "s2.sock", wait=False)
    assert second.wait_exit() == 2
    assert f"in use by another snapshotter (pid {first.process.pid})" in refusal(second)
    assert "two daemons must never share a root" in refusal(second)
    assert not (tmp_path / "s2.sock").exists()
    assert first.stub.Stat(api.StatSnapshotRequest(key="k")).info.name == "k"


def refusal(daemon: SnapshotterDaemon) -> str:
    """The one-line reason a daemon gave for not starting; its whole log is that line."""
    assert "Traceback" not in daemon.log, daemon.log
    (record,) = [r for r in daemon.log_records() if r["msg"] == "bootseer-snapshotter cannot start"]
    assert len(daemon.log.splitlines()) == 1, daemon.log
    return record["error"]


def test_socket_parent_that_is_a_file_is_refused(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    parent = tmp_path / "not-a-dir"
    parent.write_text("x")
    for address in (parent / "s.sock", parent / "deeper" / "s.sock"):
        daemon = snapshotter_factory(root=tmp_path / "root", address=address, wait=False)
        assert daemon.wait_exit() == 2
        assert f"{str(parent)!r} exists and is not a directory" in refusal(daemon)
    assert parent.read_text() == "x"


def test_corrupt_metadata_is_refused_and_kept(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    root = tmp_path / "root"
    root.mkdir()
    garbage = b"this is no sqlite database\n" * 200
    (root / "metadata.db").write_bytes(garbage)
    daemon = snapshotter_factory(root=root, wait=False)
    assert daemon.wait_exit() == 2
    reason = refusal(daemon)
    assert str(root / "metadata.db") in reason and "not a database" in reason
    assert "two daemons" not in reason
    assert (root / "metadata.db").read_bytes() == garbage, "the damaged file is evidence: never overwritten"


def test_newer_schema_is_refused_naming_the_cause(tmp_path: Path, snapshotter_factory: DaemonFactory) -> None:
    root = tmp_path / "root"
    assert snapshotter_factory(root=root).stop() == 0
    with sqlite3.connect(root / "metadata.db") as db:
        db.execute("UPDATE schema_version SET version = version + 1")
    db.close()
    daemon = snapshotter_factory(root=root, wait=False)
    assert daemon.wait_exit() == 2
    reason = refusal(daemon)
    assert f"schema version {SCHEMA_VERSION + 1} is newer" in reason and "upgrade bootseer" in reason
    assert "two daemons" not in reason and "in use" not in reason


# --- lifecycle ---------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(snapd: SnapshotterDaemon, signum: int) -> None:
    snapd.stub.Prepare(api.PrepareSnapshotRequest(key="k"))
    assert snapd.stop(signum) == 0
    assert not os.path.lexists(snapd.address)
    messages = [r["msg"] for r in snapd.log_records()]
    assert "shutdown requested" in messages
    assert messages[-1] == "bootseer-snapshotter stopped"


SYS_TGKILL = {"x86_64": 234, "aarch64": 131}  # tgkill(2) has no libc wrapper before glibc 2.30


def tgkill(pid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to the one thread ``tid`` of process ``pid`` (tgkill(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL[os.uname().machine], pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


def test_signal_delivered_to_another_thread_stops_cleanly(snapd: SnapshotterDaemon) -> None:
    # The kernel may deliver a process signal to any thread; the main thread must
    # still see it, wherever it is blocked.
    snapd.stub.Prepare(api.PrepareSnapshotRequest(key="k"))
    pid = snapd.process.pid
    others = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid)
    assert others, "the daemon runs gRPC threads"
    snapd.close_channel()
    tgkill(pid, others[-1], signal.SIGTERM)
    assert snapd.wait_exit() == 0
    assert not os.path.lexists(snapd.address)
    assert [r["msg"] for r in snapd.log_records()][-1] == "bootseer-snapshotter stopped"


def start_blocked_list(daemon: SnapshotterDaemon, count: int = 600) -> tuple[Iterator, int]:
    """Begin a List the daemon cannot finish until we read it; returns the stream and items read."""
    stub = daemon.stub
    labels = {f"label{j}": str(j) * 4000 for j in range(4)}
    for i in range(count):  # ~10 MB of List: more than gRPC's flow-control window holds
        stub.Prepare(api.PrepareSnapshotRequest(key=f"k{i}", labels=labels))
    stream = stub.List(api.ListSnapshotsRequest())
    return stream, len(next(stream).info)


def test_shutdown_lets_calls_in_flight_finish(snapd: SnapshotterDaemon) -> None:
    stream, received = start_blocked_list(snapd, count=600)
    snapd.process.send_signal(signal.SIGTERM)
    wait_for_log(snapd, "bootseer-snapshotter stopping")
    assert snapd.process.poll() is None, "the daemon must wait for the call in flight"
    with grpc.insecure_channel(f"unix:{snapd.address}") as channel:  # new calls are refused
        with pytest.raises(grpc.RpcError) as err:
            api_grpc.SnapshotsStub(channel).Stat(api.StatSnapshotRequest(key="k0"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    received += sum(len(response.info) for response in stream)
    assert received == 600
    assert snapd.stop() == 0


def test_second_signal_cancels_calls_in_flight(snapd: SnapshotterDaemon) -> None:
    stream, _ = start_blocked_list(snapd)
    snapd.process.send_signal(signal.SIGTERM)
    wait_for_log(snapd, "bootseer-snapshotter stopping")
    snapd.process.send_signal(signal.SIGINT)
    assert snapd.wait_exit() == 0
    assert any(r["msg"].startswith("second shutdown signal") for r in snapd.log_records()), snapd.log
    with pytest.raises(grpc.RpcError):
        for _ in stream:
            pass
    assert not os.path.lexists(snapd.address)


def wait_for_log(daemon: SnapshotterDaemon, message: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not any(r["msg"] == message for r in daemon.log_records()):
        assert time.monotonic() < deadline, f"no {message!r} in the log:\n{daemon.log}"
        assert daemon.process.poll() is None, f"daemon exited:\n{daemon.log}"
        time.sleep(0.05)


def snapshot_state(stub: api_grpc.SnapshotsStub) -> dict[str, tuple[api.Info, list]]:
    """Every snapshot's Info and mounts, to compare across restarts."""
    state = {}
    for response in stub.List(api.ListSnapshotsRequest()):
        for info in response.info:
            # Only active snapshots and views have mounts of their own.
            mounts = [] if info.kind == api.COMMITTED else list(stub.Mounts(api.MountsRequest(key=info.name)).mounts)
            state[info.name] = (info, mounts)
    return state


def make_snapshots(stub: api_grpc.SnapshotsStub) -> None:
    stub.Prepare(api.PrepareSnapshotRequest(key="extract-1", labels={"containerd.io/snapshot.ref": "sha256:1"}))
    stub.Commit(api.CommitSnapshotRequest(name="layer-1", key="extract-1"))
    stub.Prepare(api.PrepareSnapshotRequest(key="extract-2", parent="layer-1"))
    stub.Commit(api.CommitSnapshotRequest(name="layer-2", key="extract-2", labels={"gc": "keep"}))
    stub.Prepare(api.PrepareSnapshotRequest(key="container-rw", parent="layer-2"))
    stub.View(api.ViewSnapshotRequest(key="container-ro", parent="layer-2"))


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_restart_keeps_snapshots(snapshotter_factory: DaemonFactory, how: str) -> None:
    first = snapshotter_factory()
    make_snapshots(first.stub)
    before = snapshot_state(first.stub)
    assert set(before) == {"layer-1", "layer-2", "container-rw", "container-ro"}
    if how == "sigterm":
        assert first.stop() == 0
    else:  # a crash: the socket is left behind and the next daemon replaces it
        first.stop(signal.SIGKILL)
        assert stat.S_ISSOCK(os.lstat(first.address).st_mode)

    second = snapshotter_factory()
    assert snapshot_state(second.stub) == before
    # And the restored state is live: the active snapshot can still be committed.
    second.stub.Commit(api.CommitSnapshotRequest(name="layer-3", key="container-rw"))
    assert second.stub.Stat(api.StatSnapshotRequest(key="layer-3")).info.parent == "layer-2"


# --- metrics -----------------------------------------------------------------------------




def test_metrics_endpoint_counts_calls(snapshotter_factory: DaemonFactory) -> None:
    daemon = snapshotter_factory("--metrics-address", "127.0.0.1:0")
    metrics_address = started_record(daemon)["metrics_address"]
    host, _, port = metrics_address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0

    stub = daemon.stub
    stub.Prepare(api.PrepareSnapshotRequest(key="a"))
    stub.Prepare(api.PrepareSnapshotRequest(key="b"))
    stub.Commit(api.CommitSnapshotRequest(name="c", key="b"))
    with pytest.raises(grpc.RpcError):
        stub.Stat(api.StatSnapshotRequest(key="missing"))
    assert len([i for r in stub.List(api.ListSnapshotsRequest()) for i in r.info]) == 2

    samples = scrape(metrics_address)

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    requests = "bootseer_snapshotter_grpc_requests_total"
    assert value(requests, method="Prepare", code="OK") == 2
    assert value(requests, method="Commit", code="OK") == 1
    assert value(requests, method="Stat", code="NOT_FOUND") == 1
    assert value(requests, method="List", code="OK") == 1
    assert value("bootseer_snapshotter_grpc_errors_total", method="Stat", code="NOT_FOUND") == 1
    assert value("bootseer_snapshotter_grpc_errors_total", method="Prepare", code="OK") is None
    assert value("bootseer_snapshotter_grpc_request_duration_seconds_count", method="Prepare") == 2
    assert value("bootseer_snapshotter_snapshots", kind="active") == 1
    assert value("bootseer_snapshotter_snapshots", kind="committed") == 1
    assert value("bootseer_snapshotter_snapshots", kind="view") == 0
