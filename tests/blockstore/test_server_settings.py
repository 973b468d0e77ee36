"""The layer server's settings as one document (``bootseer layer-server --settings-file``).

The snapshotter starts its layer server with every setting in one JSON document on an inherited
pipe (``ServerSettings.document``, ``ensure_server``): the server's command line names only its root
and that pipe.  The same document can be given in a file by hand.  Each value goes through the type
and the choices of the option it names, so a document is refused exactly where the command line
would be, with the key named, and exit status 2; an option set both in the document and on the
command line is refused rather than one of them silently winning.  Real processes throughout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bootseer.blockstore.server.client import ServerSettings, ensure_server
from tests.support.layer_store import build_store
from tests.support.layers import Dir, File, Layer

LAYER_SERVER = [sys.executable, "-m", "bootseer.cli", "layer-server"]


def refused(tmp_path: Path, document: object, *argv: str) -> str:
    """Start ``bootseer layer-server`` with ``document`` as its settings file: it must exit 2; its stderr."""
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(document))
    done = subprocess.run([*LAYER_SERVER, "--root", str(tmp_path / "root"), "--settings-file", str(settings), *argv],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.mark.parametrize("document, message", [
    ({"cache-sise": "8G"}, "unknown setting 'cache-sise'"),
    ({"cache_size": "8G"}, "unknown setting 'cache_size'"),
    ({"cache-size": "lots"}, "cache-size: invalid size 'lots'"),
    ({"cache-size": ["8G"]}, "cache-size: want a string or a number, not ['8G']"),
    ({"no-hotlist": "yes"}, "no-hotlist: want true or false, not 'yes'"),
    ({"data-path": "fast"}, "data-path: 'fast' is not one of auto, fanotify, erofs, loop, tree"),
    ({"streams": 0}, "streams: must be at least 1, not 0"),
    ({"hole-wait": 0}, "--hole-wait must be a positive number of seconds, not 0"),
    ({"background-fill-idle": 0}, "background_fill_idle must be seconds in (0, 86400], not 0"),
    ({"converter-key": [{"path": "x"}]}, "converter-key: want a string or a number (or a list of them)"),
    (["store", "file:///s"], "holds list, not a JSON object of settings"),
])
def test_a_bad_document_is_refused_naming_the_key(tmp_path: Path, document: object, message: str) -> None:
    assert message in refused(tmp_path, document)


def test_a_document_that_is_not_json_is_refused(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text('{"store": ')
    done = subprocess.run([*LAYER_SERVER, "--root", str(tmp_path / "root"), "--settings-file", str(settings)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 2 and "--settings-file:" in done.stderr and "Traceback" not in done.stderr


def test_an_option_in_the_document_and_on_the_command_line_is_refused(tmp_path: Path) -> None:
    assert "--streams is given both on the command line and in --settings-file" in refused(
        tmp_path, {"streams": 4}, "--streams", "8")
    assert "--store is given both" in refused(tmp_path, {"store": "file:///a"}, "--store", "file:///b")


def test_the_started_server_gets_every_setting_from_the_pipe_and_none_in_argv(tmp_path: Path, layer_server_reaper) -> None:
    """ensure_server's document reaches the server whole: the store it serves from, a flag, sizes."""
    layers = [Layer((Dir("etc"), File("etc/motd", b"from the document\n" * 100)))]
    built = build_store(tmp_path / "store", layers, block_size=64 * 1024, layout=tmp_path / "layout")
    root = tmp_path / "root"
    layer_server_reaper(root)
    settings = ServerSettings(store=f"file://{tmp_path / 'store'}", hotlist=False, cache_size=256 << 20,
                              retry_timeout=7, data_path="tree", decode_threads=1)  # fmt: skip
    client = ensure_server(root, settings)
    status = client.status()
    cmdline = Path(f"/proc/{status['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--settings-file" in cmdline and not any(b"store" in word for word in cmdline), cmdline
    assert cmdline[cmdline.index(b"--settings-file") + 1].startswith(b"/dev/fd/")
    assert status["store"] == f"file://{tmp_path / 'store'}"
    assert status["data_path"]["path"] == "tree"
    assert status["decode_threads"] == 1  # one thread decompresses, hashes and writes its blocks
    assert client.call({"op": "hotlist.status"})["enabled"] is False  # "no-hotlist": true
    mounted = client.mount(built[0].chain_id)
    lower = Path(mounted if isinstance(mounted, str) else mounted.lower_dir)
    assert (lower / "etc" / "motd").read_bytes() == b"from the document\n" * 100
