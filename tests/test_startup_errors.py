"""Typos that must not silently turn the lazy path off (issue 14, item 10).

Each start-up mistake is refused by the real command, ``bootseer layer-server`` or
``bootseer-snapshotter``: exit status 2 and one line on stderr naming the cause (no
traceback, no usage text).  A store that cannot be read at run time (its root gone)
is a store error, never "not converted"; a cache whose writes fail says so once, with
a count, not once per block.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bootseer.blockstore.cache import BlockCache
from bootseer.blockstore.control import ServerSettings
from bootseer.fetch.engine import EngineConfig
from bootseer.snapshotter.errors import LayerUnavailable
from bootseer.snapshotter.layer_server import LayerServerBackend
from tests.support.daemon import BINARY, DaemonFactory

CHAIN_ID = "sha256:" + "ab" * 32


def _refusal(result: subprocess.CompletedProcess, *expected: str) -> str:
    """The one stderr line of a refused start; asserts exit 2, one line, the expected words."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _layer_server(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "bootseer.cli", "layer-server", "--root", str(tmp_path / "root"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _snapshotter(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [str(BINARY), "--root", str(tmp_path / "root"), "--address", str(tmp_path / "run" / "s.sock"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--cache-dir", "/etc/hostname"], ["--cache-dir", "/etc/hostname", "not a directory"]),
        (["--cache-dir", "/etc/hostname/cache"], ["--cache-dir", "not a directory"]),
        (["--store", "htp://x/store"], ["--store", "'htp'"]),
        (["--store", "s3://"], ["--store", "no bucket"]),
        (["--store", "http:///store"], ["--store", "no host"]),
        (["--store", "/no/such/dir"], ["--store", "/no/such/dir", "does not exist"]),
        (["--store", "file:///etc/hostname"], ["--store", "not a directory"]),
        (["--store-file", "/no/such/file"], ["--store-file", "/no/such/file"]),
    ],
)
def test_layer_server_refuses_start_up_mistakes_in_one_line(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    _refusal(_layer_server(tmp_path, *args), *expected)


def test_layer_server_refuses_a_cache_on_a_read_only_mount(tmp_path: Path, store: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    subprocess.run(["mount", "--bind", str(cache), str(cache)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(cache)], check=True)
        line = _refusal(_layer_server(tmp_path, "--store", str(store), "--cache-dir", str(cache)), "--cache-dir")
        assert "cannot be written" in line and "Read-only file system" in line
    finally:
        subprocess.run(["umount", str(cache)], check=True)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--store", "s3://"], ["--store", "no bucket"]),
        (["--store", "/no/such/dir"], ["--store", "/no/such/dir", "does not exist"]),
        (["--store", "htp://x"], ["--store", "'htp'"]),
    ],
)
def test_snapshotter_refuses_store_typos_in_one_line(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    _refusal(_snapshotter(tmp_path, *args), *expected)
    assert not (tmp_path / "root").exists(), "a refused start must not touch the root"


def test_snapshotter_refuses_a_cache_dir_that_is_a_file(tmp_path: Path, store: Path) -> None:
    """Was: the daemon ran on, restarting the layer server every 5 s with a traceback, and downloaded every layer."""
    line = _refusal(_snapshotter(tmp_path, "--store", str(store), "--cache-dir", "/etc/hostname"), "--cache-dir")
    assert "/etc/hostname" in line
    assert not (tmp_path / "root" / "layers" / "server.log").exists(), "no layer server was started"


def test_snapshotter_refuses_when_its_layer_server_refuses_its_settings(tmp_path: Path, store: Path, layer_server_reaper) -> None:
    """A setting only the layer server can find wrong (its metrics port is taken): the daemon exits 2, not loops."""
    layer_server_reaper(tmp_path / "root")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _snapshotter(tmp_path, "--store", str(store), "--layer-server-metrics-address", f"127.0.0.1:{port}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    refusals = [line for line in result.stderr.splitlines() if "cannot start" in line]
    assert len(refusals) == 1, result.stderr
    assert "layer server refused its settings" in refusals[0] and "--metrics-address" in refusals[0]


def test_a_store_whose_root_is_gone_is_a_store_error_not_not_converted(tmp_path: Path, store: Path) -> None:
    """Its root removed at run time (an unmounted export): the lookup is a store error, never 'not converted'."""
    backend = LayerServerBackend(tmp_path / "root", str(store), ServerSettings(), EngineConfig(retry_timeout=1))
    assert backend.lookup(CHAIN_ID) is None  # an existing store without the layer: not converted
    assert backend.store_up is True and _store_up() == 1.0
    store.rmdir()
    with pytest.raises(LayerUnavailable) as failed:
        backend.lookup(CHAIN_ID)
    assert failed.value.reason == "store_error"
    assert "does not exist" in str(failed.value)
    # The snapshotter's health says so: the store is down, not the layer unconverted.
    assert backend.store_up is False and _store_up() == 0.0
    store.mkdir()
    assert backend.lookup(CHAIN_ID) is None
    assert backend.store_up is True and _store_up() == 1.0


def _store_up() -> float | None:
    import prometheus_client

    return prometheus_client.REGISTRY.get_sample_value("bootseer_snapshotter_store_up")


def test_cache_write_failures_are_one_line_and_a_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = BlockCache(str(tmp_path / "cache"), 1 << 30)
    (tmp_path / "cache" / "ab").write_bytes(b"")  # the shard directory of every key below is a file
    caplog.set_level(logging.INFO, logger="bootseer.fetch.cache")
    keys = [("ab" + f"{n:062x}") for n in range(137)]
    for key in keys:
        cache.put(key, b"block")
    assert cache.stats().errors == 137
    failures = [r for r in caplog.records if r.name == "bootseer.fetch.cache"]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "cache write failed" in failures[0].getMessage()

    cache.put("cd" + "0" * 62, b"block")  # writes work again: one line saying how many failed
    recovered = [r for r in caplog.records if r.name == "bootseer.fetch.cache"][1:]
    assert len(recovered) == 1 and "work again" in recovered[0].getMessage()
    assert recovered[0].fields["failed_since_last_report"] == 136
