"""A store URL's credentials never leave the processes that need them (issue 14, item 7).

Real processes: the snapshotter daemon, configured with ``[store] url =
"http://USER:PASSWORD@host/store/?token=TOKEN"``, starts its layer server, which
mounts a converted layer from a real HTTP store.  The password and the token must be
in none of: the layer server's command line (``/proc/PID/cmdline``, readable by every
local user), ``layers/server.log``, ``layers/table.json``, the control socket's
``status`` answer, the daemon's log.  They do reach the store (every request carries
them), and a layer server started again with the same settings restores the layer
from the table that names its store only by id.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest

from bootseer.blockstore.server.client import LayerServerClient, ServerSettings, ensure_server

from bootseer.paths import ServerPaths
from tests.support.daemon import DaemonFactory
from tests.support.http import RangeHTTPServer
from tests.support.layer_store import BuiltLayer, build_store
from tests.support.layers import Dir, File, Layer
from tests.support.processes import wait_process_gone

PASSWORD = "PASSWORD-7e1f"
TOKEN = "TOKEN-93ab"
SECRETS = (PASSWORD, TOKEN, base64.b64encode(f"puller:{PASSWORD}".encode()).decode())
BLOCK_SIZE = 64 * 1024
RESTART_TIMEOUT = 60.0


@pytest.fixture
def http_store(tmp_path: Path):
    """(server, credentialed store URL, built layers): one converted layer behind a real HTTP server."""
    layers = [Layer((Dir("etc"), File("etc/motd", b"served lazily\n" * 1000)))]
    built = build_store(tmp_path / "www" / "store", layers, block_size=BLOCK_SIZE, layout=tmp_path / "layout")
    server = RangeHTTPServer(tmp_path / "www").start()
    url = f"http://puller:{PASSWORD}@127.0.0.1:{server.port}/store/?token={TOKEN}"
    try:
        yield server, url, built
    finally:
        server.stop()


def _no_secret(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} shows a credential: {text[:2000]}"




def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_a_credentialed_store_url_is_in_no_argv_log_table_or_status(
    tmp_path: Path, http_store, snapshotter_factory: DaemonFactory
) -> None:
    server, url, built = http_store
    layer: BuiltLayer = built[0]
    config_file = tmp_path / "snapshotter.toml"
    config_file.write_text(f'log_level = "debug"\n[store]\nurl = "{url}"\n')
    os.chmod(config_file, 0o600)
    root = tmp_path / "root"
    daemon = snapshotter_factory("--config", str(config_file), root=root)
    paths = ServerPaths(root)
    client = LayerServerClient(paths.socket)

    mounted = client.mount(layer.chain_id)
    assert (Path(mounted.lower_dir) / "etc" / "motd").read_bytes() == b"served lazily\n" * 1000
    # The credentials reached the store, on every request: the server was given them.
    assert server.requests
    for _method, target, headers in server.requests:
        assert target.endswith(f"?token={TOKEN}") and PASSWORD in base64.b64decode(headers["Authorization"][6:]).decode()

    status = client.status()
    pid = status["pid"]
    _no_secret("the layer server's command line", _cmdline(pid))
    _no_secret("the status answer", json.dumps(status))
    assert status["store"] == f"http://127.0.0.1:{server.port}/store/"  # shown, redacted
    _no_secret("table.json", paths.table.read_text())
    _no_secret("server.log", paths.log.read_text())
    _no_secret("the daemon's log", daemon.log)
    _no_secret("the daemon's command line", _cmdline(daemon.process.pid))
    from bootseer.blockstore.server.layer_server import store_id

    row = json.loads(paths.table.read_text())["layers"][0]
    assert row["store_id"] == store_id(url) and row["store"] == status["store"]

    # Stopped and started again by the daemon's watch, with the same settings: the layer
    # comes back from the table, whose row names its store only by id.
    client.shutdown()
    deadline = time.monotonic() + RESTART_TIMEOUT
    while True:
        try:
            restarted = client.status()
            if restarted["pid"] != pid:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, f"the daemon did not start its layer server again:\n{daemon.log}"
        time.sleep(0.2)
    assert [(x["chain_id"], x["slot"], x["served"]) for x in restarted["layers"]] == [(layer.chain_id, mounted.slot, True)]
    assert client.check(layer.chain_id).lower_dir == mounted.lower_dir
    _no_secret("the restarted layer server's command line", _cmdline(restarted["pid"]))
    _no_secret("server.log", paths.log.read_text())


def test_a_row_whose_store_is_not_configured_is_reported(tmp_path: Path, http_store, layer_server_reaper) -> None:
    """The table's row names a store the restarted server was not given: reported, not guessed."""
    server, url, built = http_store
    root = tmp_path / "root"
    layer_server_reaper(root)
    paths = ServerPaths(root)
    client = ensure_server(root, ServerSettings(store=url))
    client.mount(built[0].chain_id)
    wait_process_gone(client.shutdown(), RESTART_TIMEOUT)
    other = url.replace(PASSWORD, "another-password")
    client = ensure_server(root, ServerSettings(store=other))
    layers = client.status()["layers"]
    assert [(x["chain_id"], x["served"]) for x in layers] == [(built[0].chain_id, False)]
    assert "is not one this layer server was given" in layers[0]["error"]
    _no_secret("the status answer", json.dumps(client.status()))
    # load_table resolves a row against the URLs it is given, and saving keeps the id.
    from bootseer.blockstore.server.layer_server import load_table, save_table, store_id

    rows = load_table(paths.table, [url])
    assert rows[0].store == url
    save_table(tmp_path / "copy.json", rows)
    assert json.loads((tmp_path / "copy.json").read_text())["layers"][0]["store_id"] == store_id(url)
