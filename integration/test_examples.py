"""The files in ctr_examples/ do what they say: configs containerd accepts, the demo runs.

The configs are checked against the daemon's own defaults, so the socket path in
containerd's config, the systemd unit and the daemon never drift apart.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from bootseer.snapshotter import config as daemon_config
from integration import harness

pytestmark = pytest.mark.integration

EXAMPLES = harness.REPO_ROOT / "ctr_examples"
DEFAULT_SOCKET = daemon_config.DEFAULTS["address"]


def test_v2_config_is_what_containerd_1x_loads():
    if shutil.which("containerd") is None:
        pytest.skip("containerd missing")
    dump = subprocess.run(["containerd", "--config", str(EXAMPLES / "containerd-config-v2.toml"), "config", "dump"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    loaded = tomllib.loads(dump)
    assert loaded["proxy_plugins"]["bootseer"] == {"type": "snapshot", "address": DEFAULT_SOCKET}
    cri = loaded["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["snapshotter"] == "bootseer"
    assert cri["disable_snapshot_annotations"] is False


def test_v3_config_names_the_daemon_in_the_2x_sections():
    # No containerd 2.x here to load it: check the keys containerd 2.x documents.
    loaded = tomllib.loads((EXAMPLES / "containerd-config-v3.toml").read_text())
    assert loaded["version"] == 3
    assert loaded["proxy_plugins"]["bootseer"] == {"type": "snapshot", "address": DEFAULT_SOCKET}
    images = loaded["plugins"]["io.containerd.cri.v1.images"]
    assert images["snapshotter"] == "bootseer"
    assert images["disable_snapshot_annotations"] is False
    assert "io.containerd.grpc.v1.cri" not in loaded["plugins"]  # the 1.x section has no effect in 2.x


def test_systemd_unit_starts_before_containerd_and_waits_for_the_socket():
    unit = (EXAMPLES / "bootseer-snapshotter.service").read_text()
    assert re.search(r"^Before=.*\bcontainerd\.service\b", unit, re.M)
    exec_start = re.search(r"^ExecStart=(\S+) (.*)$", unit, re.M)
    assert exec_start and exec_start.group(1).endswith("/bootseer-snapshotter")
    assert re.search(r"^ExecStartPost=.*-S " + re.escape(DEFAULT_SOCKET), unit, re.M)
    assert re.search(r"^KillSignal=SIGTERM$", unit, re.M)


@pytest.mark.timeout(300)
def test_demo_runs_and_cleans_up(runnable, tmp_path):
    if harness.snapshotter_available():
        pytest.skip(harness.snapshotter_available())
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("bootseer-it-*"))
    profile_dir = tmp_path / "profile"
    done = subprocess.run([str(EXAMPLES / "demo.sh"), "--profile-dir", str(profile_dir)],
                          env=dict(os.environ, BOOTSEER_SKIP_INSTALL="1"),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"demo failed:\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "hello from bootseer" in out
    assert "can't open '/etc/obsolete.conf'" in out  # the whiteout
    assert re.search(r"snapshots left: 0, directories under \S+: 0$", out, re.M)
    assert out.rstrip().endswith("demo finished")
    # Nothing the demo made is left (another run's directories may come and go meanwhile).
    assert not set(Path(os.environ.get("TMPDIR", "/tmp")).glob("bootseer-it-*")) - before
    # The profile outlives the temp dir, and the demo says where it is.
    assert f"{profile_dir / 'profile.html'} (timeline)" in out
    assert "first_step" in (profile_dir / "profile.json").read_text()
    assert "<svg" in (profile_dir / "profile.html").read_text()
