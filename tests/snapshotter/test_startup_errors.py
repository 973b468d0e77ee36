"""Typos that must not silently turn the lazy path off (issue 14, item 10).

Each start-up mistake is refused by the real command, ``bootseer layer-server`` or
``bootseer-snapshotter``: exit status 2 and one line on stderr naming the cause (no
traceback, no usage text).  A store that cannot be read at run time (its root gone)
is a store error, never "not converted"; a cache whose writes fail says so once, with
a count, not once per block.

Issue 21: key files someone else could change, private keys others can read, a FIFO given
as a key and a node sign key that is a converter key are refused the same way (docs/trust.md);
a refusal names a setting as it was given: the flag, or the config file's key, never a flag
that does not exist.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.server.client import ServerSettings
from bootseer.blockstore.objects.signing import generate_key, load_signing_key
from bootseer.fetch.engine import EngineConfig
from bootseer.snapshotter import config
from bootseer.snapshotter.errors import LayerUnavailable
from bootseer.snapshotter.layer_backend import LayerServerBackend
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
    caplog.set_level(logging.INFO, logger="bootseer.fetch.file_cache")
    keys = [("ab" + f"{n:062x}") for n in range(137)]
    for key in keys:
        cache.put(key, b"block")
    assert cache.stats().errors == 137
    failures = [r for r in caplog.records if r.name == "bootseer.fetch.file_cache"]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "cache write failed" in failures[0].getMessage()

    cache.put("cd" + "0" * 62, b"block")  # writes work again: one line saying how many failed
    recovered = [r for r in caplog.records if r.name == "bootseer.fetch.file_cache"][1:]
    assert len(recovered) == 1 and "work again" in recovered[0].getMessage()
    assert recovered[0].fields["failed_since_last_report"] == 136


# -- key files (issue 21, cases 7-9) ---------------------------------------------------------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user")
NOBODY = 65534
#: A command that reads a FIFO as a key file is given this long before the test calls it hung.
HANG_DEADLINE = 60


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A 0755 directory holding a converter key pair (``conv``, ``conv.pub``) and a node key pair (``node``)."""
    directory = tmp_path / "keys"
    directory.mkdir()
    generate_key(directory / "conv")
    generate_key(directory / "node")
    return directory


def _copy(source: Path, to: Path, mode: int) -> Path:
    shutil.copyfile(source, to)
    to.chmod(mode)
    return to


def _directory(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)  # past the umask
    return path


def _writable_pub(keys: Path, tmp_path: Path, mode: int) -> Path:
    return _copy(keys / "conv.pub", keys / "w.pub", mode)


def _link_in_sticky_dir_to_a_writable_pub(keys: Path, tmp_path: Path) -> Path:
    sticky = _directory(tmp_path / "sticky", 0o1777)  # as /tmp
    _copy(keys / "conv.pub", sticky / "w.pub", 0o666)
    (sticky / "link.pub").symlink_to(sticky / "w.pub")
    return sticky / "link.pub"


def _someone_elses_link_in_sticky_dir(keys: Path, tmp_path: Path) -> Path:
    sticky = _directory(tmp_path / "sticky", 0o1777)
    (sticky / "link.pub").symlink_to(keys / "conv.pub")
    os.lchown(sticky / "link.pub", NOBODY, NOBODY)  # its owner may replace it, sticky bit or not
    return sticky / "link.pub"


def _link_in_writable_dir(keys: Path, tmp_path: Path) -> Path:
    shared = _directory(tmp_path / "shared", 0o777)
    (shared / "link.pub").symlink_to(keys / "conv.pub")
    return shared / "link.pub"


def _pub_in_group_writable_dir(keys: Path, tmp_path: Path) -> Path:
    return _copy(keys / "conv.pub", _directory(tmp_path / "group", 0o775) / "c.pub", 0o644)


def _someone_elses_pub(keys: Path, tmp_path: Path) -> Path:
    path = _copy(keys / "conv.pub", keys / "other.pub", 0o644)
    os.chown(path, NOBODY, NOBODY)
    return path


def _pub_in_someone_elses_dir(keys: Path, tmp_path: Path) -> Path:
    theirs = _directory(tmp_path / "theirs", 0o755)
    os.chown(theirs, NOBODY, NOBODY)
    return _copy(keys / "conv.pub", theirs / "c.pub", 0o644)


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda k, t: _writable_pub(k, t, 0o666), ["w.pub' is writable by group or others (mode 0666)"]),
        (lambda k, t: _writable_pub(k, t, 0o664), ["w.pub' is writable by group or others (mode 0664)"]),
        (_link_in_sticky_dir_to_a_writable_pub, ["link.pub' (the file", "sticky/w.pub its symlinks lead to", "(mode 0666)"]),
        pytest.param(_someone_elses_link_in_sticky_dir, ["link.pub': symlink", "belongs to uid 65534"], marks=root_only),
        (_link_in_writable_dir, ["link.pub': directory", "shared is writable by group or others (mode 0777) without the sticky bit"]),
        (_pub_in_group_writable_dir, ["c.pub': directory", "group is writable by group or others (mode 0775)"]),
        pytest.param(_someone_elses_pub, ["other.pub' belongs to uid 65534"], marks=root_only),
        pytest.param(_pub_in_someone_elses_dir, ["c.pub': directory", "theirs belongs to uid 65534"], marks=root_only),
    ],
    ids=["pub-0666", "pub-0664", "link-in-sticky-dir-to-0666", "someone-elses-link-in-sticky-dir", "link-in-0777-dir",
         "pub-in-0775-dir", "someone-elses-pub", "pub-in-someone-elses-dir"],  # fmt: skip
)
def test_a_public_key_file_someone_else_can_change_is_refused_naming_it(tmp_path: Path, keys: Path, make: Any,
                                                                        expected: list[str]) -> None:  # fmt: skip
    """Was: each was trusted, so whoever could write the file chose which conversions a node serves."""
    path = make(keys, tmp_path)
    line = _refusal(_layer_server(tmp_path, "--converter-key", str(path)), f"key file '{path}", *expected)
    assert line.startswith("bootseer layer-server: error: "), line
    shown = _refusal(_keys_show(path), f"key file '{path}", *expected)
    assert shown.startswith("bootseer keys show: "), shown


def test_a_writable_key_in_the_config_file_is_refused_naming_the_key_and_the_file(tmp_path: Path, keys: Path, store: Path) -> None:
    path = _writable_pub(keys, tmp_path, 0o666)
    (tmp_path / "c.toml").write_text(f'[store]\nurl = "{store}"\n[trust]\nwriter_keys = ["{path}"]\n')
    _refusal(_snapshotter(tmp_path, "--config", str(tmp_path / "c.toml")),
             "key 'trust.writer_keys' in the config file", f"key file '{path}' is writable by group or others")  # fmt: skip
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_private_key_others_can_read_is_refused_naming_it(tmp_path: Path, keys: Path, store: Path, mode: int) -> None:
    """Was: a 0644 sign key was used (ssh refuses such a key too)."""
    path = _copy(keys / "node", keys / "open", mode)
    expected = [f"private key file '{path}' is open to group or others", "chmod 600"]
    _refusal(_layer_server(tmp_path, "--sign-key", str(path)), *expected, f"(mode {mode:04o})")
    _refusal(_snapshotter(tmp_path, "--store", str(store), "--sign-key", str(path)), "--sign-key: ", *expected)
    _refusal(_keys_show(path), *expected, f"(mode {mode:04o})")


def test_key_files_only_root_or_the_user_can_change_are_accepted(tmp_path: Path, keys: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """What the checks let through: a key in a sticky directory, links kept by root or the user (from a
    sticky directory too), relative paths, a private key of 0400 or behind links as a Kubernetes
    Secret volume mounts it (``KEY -> ..data/KEY``, ``..data -> ..2026_12_03``)."""
    sticky = _directory(tmp_path / "sticky", 0o1777)
    _copy(keys / "conv.pub", sticky / "c.pub", 0o644)
    (sticky / "link.pub").symlink_to(keys / "conv.pub")
    secret = _directory(tmp_path / "secret", 0o1777)
    _directory(secret / "..2026_12_03", 0o755)
    _copy(keys / "node", secret / "..2026_12_03" / "node", 0o400)
    (secret / "..data").symlink_to("..2026_12_03")
    (secret / "node").symlink_to("..data/node")
    monkeypatch.chdir(tmp_path)
    resolved = config.resolve({"trust.converter_keys": [str(sticky / "c.pub"), str(sticky / "link.pub")],
                               "trust.writer_keys": ["keys/./node.pub", "sticky/../keys/node.pub"],
                               "trust.sign_key": str(secret / "node")}, {})  # fmt: skip
    assert len(resolved.trust.converter_keys) == 2 and len(resolved.trust.writer_keys) == 2
    done = _keys_show(secret / "node")
    assert done.returncode == 0 and done.stdout.split()[1] == load_signing_key(keys / "node").public.id


def test_a_fifo_as_a_key_file_is_refused_at_once(tmp_path: Path, keys: Path, store: Path) -> None:
    """Was: ``bootseer keys show FIFO`` and a FIFO in ``[trust]`` blocked on the open for ever (the
    deadline here is a hang detector)."""
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo, 0o600)
    _refusal(_keys_show(fifo), f"key file '{fifo}' is not a regular file")
    _refusal(_layer_server(tmp_path, "--converter-key", str(fifo)), f"key file '{fifo}' is not a regular file")
    _refusal(_layer_server(tmp_path, "--sign-key", str(fifo)), f"key file '{fifo}' is not a regular file")
    (tmp_path / "c.toml").write_text(f'[store]\nurl = "{store}"\n[trust]\nconverter_keys = ["{fifo}"]\n')
    _refusal(_snapshotter(tmp_path, "--config", str(tmp_path / "c.toml")), "trust.converter_keys", "not a regular file")


def test_a_sign_key_that_is_a_converter_key_is_refused(tmp_path: Path, keys: Path, store: Path) -> None:
    """Was: accepted, so every node held the key that makes any layer trusted (docs/trust.md)."""
    conv, pub = keys / "conv", keys / "conv.pub"
    expected = f"sign key '{conv}' is a trusted converter key"
    _refusal(_layer_server(tmp_path, "--converter-key", str(pub), "--sign-key", str(conv)), expected)
    _refusal(_snapshotter(tmp_path, "--store", str(store), "--converter-key", str(pub), "--sign-key", str(conv)),
             "--sign-key: ", expected)  # fmt: skip
    (tmp_path / "c.toml").write_text(f'[store]\nurl = "{store}"\n[trust]\nconverter_keys = ["{pub}"]\nsign_key = "{conv}"\n')
    _refusal(_snapshotter(tmp_path, "--config", str(tmp_path / "c.toml")), "key 'trust.sign_key' in the config file", expected)
    deps = subprocess.run([sys.executable, "-m", "bootseer.cli", "deps", "run", "--prefix", str(tmp_path / "env"),
                           "--store", str(store), "--root", str(tmp_path / "node"), "--converter-key", str(pub),
                           "--sign-key", str(conv), "--", "true"], capture_output=True, text=True, timeout=60)  # fmt: skip
    lines = deps.stderr.strip().splitlines()
    assert deps.returncode != 0 and len(lines) == 1 and lines[0].startswith(f"bootseer deps: {expected}"), deps.stderr
    # The node's own key beside the converter's is what a node is given.
    assert config.resolve({"trust.converter_keys": [str(pub)], "trust.sign_key": str(keys / "node")}, {}).sign_key == keys / "node"


def _keys_show(path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "bootseer.cli", "keys", "show", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_DEADLINE)


# -- settings named as they were given (issue 21, case 11) ------------------------------------------


@pytest.mark.parametrize(
    "peers, expected",
    [
        ('listen = "0.0.0.0:7000"\nadvertise = "10.1.2.3:7000"\nmembers = ["10.1.2.3:7000"]',
         "[peers] token_file: is needed when listen is not a loopback address"),
        ('listen = "0.0.0.0:7000"\nmembers = ["10.1.2.3:7000"]\ntoken_file = "TOKEN"',
         "[peers] advertise: is needed with a wildcard listen address"),
        ('listen = "127.0.0.1:7000"', "[peers] members: no members"),
        ('listen = "127.0.0.1:7000"\nmembers = ["127.0.0.1:7000"]\ntls_key = "TOKEN"', "[peers] tls_cert: tls_cert and tls_key go together"),
    ],
    ids=["token_file", "advertise", "members", "tls_cert"],
)
def test_a_missing_peers_setting_is_named_as_the_config_key_to_set(tmp_path: Path, store: Path, peers: str, expected: str) -> None:
    """Was: ``--peers.token-file: is needed ...``, a flag that does not exist."""
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-for-any-minimum-0123456789abcdef\n")
    token.chmod(0o600)
    (tmp_path / "c.toml").write_text(f'[store]\nurl = "{store}"\n[peers]\n{peers.replace("TOKEN", str(token))}\n')
    line = _refusal(_snapshotter(tmp_path, "--config", str(tmp_path / "c.toml")), expected)
    assert line.startswith(f"bootseer-snapshotter: error: {expected}") and "--" not in line, line


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--peer-listen", "0.0.0.0:7000", "--peer-advertise", "10.1.2.3:7000", "--peers", "10.1.2.3:7000"],
         "--peer-token-file: is needed"),
        (["--peer-listen", "0.0.0.0:7000", "--peers", "10.1.2.3:7000", "--peer-token-file", "TOKEN"], "--peer-advertise: is needed"),
        (["--peer-listen", "127.0.0.1:7000"], "--peers: no members"),
        (["--peer-listen", "127.0.0.1:7000", "--peers", "127.0.0.1:7000", "--peer-tls-key", "TOKEN"], "--peer-tls-cert: "),
        (["--peer-listen", "127.0.0.1:7000", "--peers", "127.0.0.1:7000", "--peer-deadline", "99"], "--peer-deadline: "),
        (["--peer-listen", "127.0.0.1:7000", "--peers", "127.0.0.1:7000", "--peer-fetch-budget", "4K"],
         "--peer-fetch-budget: must be 0 (no limit) or at least"),
        (["--peer-listen", "127.0.0.1:7000", "--peers", "127.0.0.1:7000", "--peer-max-connections", "0"],
         "--peer-max-connections: must be at least 1"),
    ],
    ids=["token_file", "advertise", "members", "tls_cert", "deadline", "fetch_budget", "max_connections"],
)
def test_a_layer_server_peer_refusal_names_its_flag(tmp_path: Path, args: list[str], expected: str) -> None:
    """Was: ``peers: token_file: ...``, the config file's name for a setting given as a flag (and, for the
    settings added beside that fix, ``peers: fetch_budget: ...`` and ``peers: max_connections: ...``)."""
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-for-any-minimum-0123456789abcdef\n")
    token.chmod(0o600)
    line = _refusal(_layer_server(tmp_path, *[str(token) if a == "TOKEN" else a for a in args]), expected)
    assert line.startswith(f"bootseer layer-server: error: {expected}"), line
