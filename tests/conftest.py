"""Unit-test set-up: no layer server and no FUSE mount outlives the tests that made it.

A layer server runs in a session of its own and outlives whatever started it (the
snapshotter daemon, ``ensure_server``), so a test that fails half-way, or a daemon
killed while it was starting one, would leave it serving a mount under the test's
temporary directory (pytest then cannot delete it and renames it ``garbage-*``).

* ``layer_server_reaper`` (a fixture): ``reap(root)`` names a node root; at teardown,
  pass or fail, every ``bootseer layer-server`` process of that root is stopped
  (SIGTERM, then SIGKILL) and the FUSE mount on ``ROOT/layers/mnt`` unmounted.
* At the end of the session, a layer-server process or a FUSE mount left anywhere
  under this session's temporary directory fails the run, naming what was left (and
  is cleaned up, so the next run starts clean).

The fixtures of tests/support are offered to every test here, so no test module
imports another one for its fixtures: ``nginx_factory``, ``range_http_factory``
(:mod:`tests.support.http`), ``moto_s3``, ``s3_bucket`` (:mod:`tests.support.s3`),
``webhdfs_factory`` (:mod:`tests.support.webhdfs`), ``snapshotter_factory``, ``snapd``
(:mod:`tests.support.daemon`), ``nodes``, ``peer_layer``, ``fake_peer`` (:mod:`tests.support.peers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.support.daemon import snapd, snapshotter_factory  # noqa: F401  (fixtures)
from tests.support.http import nginx_factory, range_http_factory  # noqa: F401  (fixtures)
from tests.support.layer_servers import EVENT_HOLDER, fuse_mounts, layer_server_processes, stop_layer_servers
from tests.support.mounts import force_unmount
from tests.support.peers import fake_peer, nodes, peer_layer  # noqa: F401  (fixtures)
from tests.support.s3 import moto_s3, s3_bucket  # noqa: F401  (fixtures)
from tests.support.webhdfs import webhdfs_factory  # noqa: F401  (a fixture)


@pytest.fixture
def layer_server_reaper() -> Iterator[Callable[[Path], None]]:
    """``reap(root)``: stop the layer servers of ``root`` and unmount their FUSE mount at teardown."""
    roots: list[Path] = []
    yield roots.append
    for root in roots:
        stop_layer_servers(root)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the session loudly if a test left a layer server or a FUSE mount in its temporary directory."""
    base = tmp_path_factory.getbasetemp()
    yield
    processes = {**layer_server_processes(base), **layer_server_processes(base, EVENT_HOLDER)}
    mounts = fuse_mounts(base)
    if processes or mounts:
        stop_layer_servers(base)
        for mountpoint in fuse_mounts(base):
            force_unmount(mountpoint)
        left = [f"layer server pid {pid} (--root {root})" for pid, root in processes.items()] + mounts
        pytest.fail("tests left these behind (now stopped):\n  " + "\n  ".join(left), pytrace=False)
