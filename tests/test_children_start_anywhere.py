"""The processes BootSeer starts work whatever the working directory: a ``bootseer/`` folder there shadows nothing.

Issue 35, case 18.  ``python -m MODULE`` puts the working directory first on ``sys.path``; a
child started that way from inside a checkout of the project (any directory holding a
``bootseer/`` folder) imported that folder instead of the installed package and died
(``ModuleNotFoundError: No module named 'bootseer.blockstore'``), and its layer server with it.
Every ``python -m`` child the project starts now runs with ``-P``.

The test installs BootSeer as a user does, from its wheel (built here from this checkout with
``pip wheel``) into a virtual environment of its own, whose ``bootseer`` is the wheel's, never
the editable checkout (the other packages come from the test environment through a ``.pth``
file).  It then starts, with the working directory inside a directory holding a decoy
``bootseer/`` package, ``bootseer layer-server`` on the ``erofs`` data path (its image
checker is a ``python -m`` child) and on ``fanotify`` (its event holder is one), and the
``bootseer-snapshotter`` daemon, which starts a layer server; each must serve a converted
layer whose files read right.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from bootseer.blockstore.datapath.fanotify import unsupported
from bootseer.blockstore.objects.format import EntryType
from bootseer.blockstore.server.client import LayerServerClient, ServerPaths, ServerSettings
from tests.blockstore.test_layer_server import built, extracted  # noqa: F401 (fixtures)
from tests.support.layer_servers import stop_layer_servers
from tests.support.layer_store import BuiltLayer
from tests.support.processes import wait_process_gone
from tests.support.waiting import wait_until
from tests.support.wheels import install_env

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

REPO = Path(__file__).resolve().parents[1]
#: What the wheel is built from: the project's metadata and its package folders (setup.cfg's package_dir).
SOURCES = ("setup.cfg", "pyproject.toml", "README.md")
PACKAGE_DIRS = ("bootseer", "proto", "snapshotter", "blockstore", "hotlist", "depsnap", "ckptmount")
START_TIMEOUT_S = 60.0


class Started:
    """A process this test started (``name``, ``running``, ``returncode``: what ``wait_until(alive=)`` watches)."""

    def __init__(self, name: str, argv: list[str], cwd: Path, log: Path) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # fmt: skip

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def stop(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with BootSeer installed from this checkout's wheel; its ``bin``."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        shutil.copy2(REPO / name, source / name)
    for name in PACKAGE_DIRS:
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = install_env(work)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(work / "out"), str(source)], check=True, env=env, cwd=work, timeout=300)  # fmt: skip
    wheel = next((work / "out").glob("bootseer-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    # The dependencies (and pip): the test environment's site-packages as plain paths (their own .pth files,
    # the editable install's finder among them, are not run), after the wheel's own.
    Path(purelib, "bootseer-deps.pth").write_text("".join(f"{path}\n" for path in sys.path if path.endswith("-packages")))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, env=env, cwd=work, timeout=300)  # fmt: skip
    where = subprocess.run([str(python), "-P", "-c", "import bootseer.blockstore.server, sys; print(bootseer.__file__)"],
                           check=True, capture_output=True, text=True, cwd="/", timeout=60).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(purelib), f"bootseer imported from {where}, not from the wheel's install"
    return venv / "bin"


@pytest.fixture
def checkout(tmp_path: Path, wheel_env: Path) -> Path:
    """A directory holding a decoy ``bootseer/`` package, as a checkout does; shown to shadow the installed one."""
    place = tmp_path / "checkout"
    (place / "bootseer").mkdir(parents=True)
    (place / "bootseer" / "__init__.py").write_text('"""A decoy: not the installed package."""\n')
    shadowed = subprocess.run([str(wheel_env / "python"), "-c", "import bootseer.blockstore"], cwd=place,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "No module named 'bootseer.blockstore'" in shadowed.stderr, shadowed.stderr  # what ``-m`` children met
    return place


def _reads_right(client: LayerServerClient, layer: BuiltLayer, extracted: Path) -> None:
    """Mount ``layer`` and read its small files (the image's) and a big one (the blob's) against ``tar -x``."""
    lower = Path(client.mount(layer.chain_id).lower_dir)
    files = [e for e in layer.index.entries if e.type is EntryType.FILE and e.link is None and e.size > 0]
    assert any(e.size <= 4096 for e in files) and any(e.size > 4096 for e in files)
    for entry in files:
        assert (lower / entry.path).read_bytes() == (extracted / entry.path).read_bytes(), entry.path


@pytest.fixture
def roots(tmp_path: Path) -> Iterator[list[Path]]:
    """Node roots whose layer servers (and event holders) are stopped at teardown."""
    found: list[Path] = []
    yield found
    for root in found:
        stop_layer_servers(root)


def _serves_from_the_checkout(argv: list[str], checkout: Path, root: Path, layer: BuiltLayer, extracted: Path,
                              data_path: str) -> None:
    """Run ``argv`` (a layer server for ``root``) in ``checkout`` and read ``layer`` through it."""
    server = Started("layer server", argv, checkout, root.parent / "server.log")
    client = LayerServerClient(ServerPaths(root).socket)
    try:
        wait_until("the layer server to answer", client.answers, START_TIMEOUT_S, interval=0.05, alive=server)
        assert client.status()["data_path"]["path"] == data_path
        _reads_right(client, layer, extracted)
    except BaseException:
        print(server.log.read_text(errors="replace")[-6000:])
        raise
    finally:
        server.stop()


def _settings_file(tmp_path: Path, settings: ServerSettings) -> Path:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(settings.document()))
    return path


@pytest.mark.parametrize("data_path", ["erofs", "fanotify"])
def test_the_bootseer_layer_server_command_started_inside_a_checkout_serves_a_layer(
    built: Any, extracted: list[Path], wheel_env: Path, checkout: Path, roots: list[Path], tmp_path: Path,
    data_path: str,
) -> None:
    """On ``erofs`` the server starts the image checker, on ``fanotify`` the event holder too: both ``-m`` children."""
    if data_path == "fanotify" and (why := unsupported(tmp_path)) is not None:
        pytest.skip(f"no fanotify pre-content marks here: {why}")
    store, layers = built
    root = tmp_path / "root"
    roots.append(root)
    settings = _settings_file(tmp_path, ServerSettings(store=f"file://{store}", data_path=data_path))
    argv = [str(wheel_env / "bootseer"), "--log-level", "debug", "layer-server", "--root", str(root),
            "--settings-file", str(settings)]  # fmt: skip
    _serves_from_the_checkout(argv, checkout, root, layers[0], extracted[0], data_path)


def test_the_layer_server_command_line_of_ensure_server_started_inside_a_checkout_serves_a_layer(
    built: Any, extracted: list[Path], wheel_env: Path, checkout: Path, roots: list[Path], tmp_path: Path
) -> None:
    """``ensure_server`` runs its command line in ``/``; here the same command line runs in the checkout."""
    store, layers = built
    root = tmp_path / "root"
    roots.append(root)
    settings = ServerSettings(store=f"file://{store}", data_path="erofs", python=str(wheel_env / "python"))
    argv = settings.argv(root, str(_settings_file(tmp_path, settings)))
    _serves_from_the_checkout(argv, checkout, root, layers[0], extracted[0], "erofs")


def test_the_snapshotter_daemon_started_inside_a_checkout_starts_a_layer_server_that_serves_a_layer(
    built: Any, extracted: list[Path], wheel_env: Path, checkout: Path, roots: list[Path], tmp_path: Path
) -> None:
    store, layers = built
    root = tmp_path / "root"
    roots.append(root)
    daemon = Started("bootseer-snapshotter", [str(wheel_env / "bootseer-snapshotter"), "--root", str(root),
                                              "--address", str(tmp_path / "snapshotter.sock"), "--store", f"file://{store}"],
                     checkout, tmp_path / "daemon.log")  # fmt: skip
    paths = ServerPaths(root)
    client = LayerServerClient(paths.socket)
    try:
        wait_until("the daemon's layer server to answer", client.answers, START_TIMEOUT_S, interval=0.05,
                   alive=daemon)  # fmt: skip
        wait_until("the daemon's socket", (tmp_path / "snapshotter.sock").exists, START_TIMEOUT_S, alive=daemon)
        server = int(client.status()["pid"])
        argv = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
        assert argv[0] == os.fsencode(wheel_env / "python"), argv  # the wheel's environment's server
        _reads_right(client, layers[0], extracted[0])
    except BaseException:
        print(daemon.log.read_text(errors="replace")[-4000:])
        print(paths.log.read_text(errors="replace")[-4000:] if paths.log.exists() else "(no layer server log)")
        raise
    finally:
        daemon.stop()
    assert daemon.returncode == 0
    stop_layer_servers(root)
    wait_process_gone(server)
