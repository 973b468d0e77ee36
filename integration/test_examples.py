"""The files in ctr_examples/ do what they say: configs containerd accepts, the demo runs.

The configs are checked against the daemon's own defaults, so the socket path in
containerd's config, the systemd unit and the daemon never drift apart, and each is loaded
into the containerd of its dialect (``BOOTSEER_CONTAINERD``: the v2 file into 1.6 and 1.7,
the v3 file into 2.x) and run there.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from bootseer.snapshotter import config as daemon_config
from integration.harness import running
from tests.support.containerd import Containerd, ContainerdInstall, containerd_install, containerd_unavailable
from tests.support.oci import APP_FILE, APP_FILE_DATA, chain_ids
from tests.support.stack import REPO_ROOT, Stack, snapshotter_available

pytestmark = pytest.mark.integration

EXAMPLES = REPO_ROOT / "ctr_examples"
DEFAULT_SOCKET = daemon_config.DEFAULTS["address"]


#: The shipped config for each config dialect: containerd 1.6 and 1.7 read ``version = 2``, 2.x ``version = 3``.
EXAMPLE_CONFIGS = {2: EXAMPLES / "containerd-config-v2.toml", 3: EXAMPLES / "containerd-config-v3.toml"}
#: What containerd 2.x's ``config dump`` adds to every proxy plugin (empty unless a config sets them).
PROXY_FIELDS_2X = {"platform", "capabilities", "exports"}


def chosen_containerd() -> ContainerdInstall:
    why = containerd_unavailable()
    if why:
        pytest.skip(why)
    return containerd_install()


def example_for(install: ContainerdInstall) -> Path:
    return EXAMPLE_CONFIGS[install.config_version]


def test_the_shipped_config_is_what_this_containerd_loads():
    """The example of this containerd's dialect, through its own ``config dump`` (what it parsed and
    migrated), names the daemon's socket and makes bootseer the CRI plugin's snapshotter with labels on."""
    install = chosen_containerd()
    loaded = install.loaded_config(example_for(install))
    proxy = loaded["proxy_plugins"]["bootseer"]
    assert {k: proxy[k] for k in ("type", "address")} == {"type": "snapshot", "address": DEFAULT_SOCKET}
    # Whatever else a containerd reports for a proxy plugin (2.x: platform, capabilities, exports) is its default.
    assert set(proxy) - {"type", "address"} <= PROXY_FIELDS_2X and not any(
        proxy[k] for k in set(proxy) - {"type", "address"}), proxy
    if install.version >= (2, 0):
        images = loaded["plugins"]["io.containerd.cri.v1.images"]
        assert (images["snapshotter"], images["disable_snapshot_annotations"]) == ("bootseer", False)
        assert images["discard_unpacked_layers"] is False
        # ctr's pulls go through the transfer service: it may unpack into bootseer.
        unpack = loaded["plugins"]["io.containerd.transfer.v1.local"]["unpack_config"]
        assert {(u["platform"], u["snapshotter"]) for u in unpack} >= {("linux", "bootseer")}, unpack
    else:
        cri = loaded["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
        assert (cri["snapshotter"], cri["disable_snapshot_annotations"]) == ("bootseer", False)
        assert cri["discard_unpacked_layers"] is False


def test_v3_config_names_the_daemon_in_the_2x_sections():
    # The file itself (what a reader merges), whichever containerd runs here.
    loaded = tomllib.loads((EXAMPLES / "containerd-config-v3.toml").read_text())
    assert loaded["version"] == 3
    assert loaded["proxy_plugins"]["bootseer"] == {"type": "snapshot", "address": DEFAULT_SOCKET}
    images = loaded["plugins"]["io.containerd.cri.v1.images"]
    assert images["snapshotter"] == "bootseer"
    assert images["disable_snapshot_annotations"] is False
    assert "io.containerd.grpc.v1.cri" not in loaded["plugins"]  # the 1.x section has no effect in 2.x


class ExampleContainerd(Containerd):
    """A containerd running the shipped config of its dialect as a node would, with only what must be private
    here (root, state, sockets) added and the daemon's socket the stack's; CRI stays off (no kubelet here)."""

    def config_text(self) -> str:
        example = example_for(self.install).read_text().replace(f'"{DEFAULT_SOCKET}"', f'"{self.snapshotter_socket}"')
        version = f"version = {self.config_dialect()}\n"
        assert version in example, f"{example_for(self.install)} is not {version.strip()}"
        return example.replace(version, version + self.private_settings(), 1) + self.private_tables()


@pytest.mark.timeout(300)
def test_the_shipped_config_pulls_and_runs_on_bootseer(runnable):
    """The README's commands against a containerd running the shipped config: ``ctr images pull --snapshotter
    bootseer`` (2.x: through its transfer service) unpacks into the daemon, ``ctr run`` sees the image."""
    stack = Stack()
    stack.containerd = ExampleContainerd(stack.containerd.base, stack.containerd.snapshotter_socket, stack.namespace)
    with running(stack):
        image, ref = stack.build_and_push()
        stack.pull(ref)
        assert {row["key"] for row in stack.containerd.snapshots()} == set(chain_ids(image.diff_ids))
        assert stack.run_container(ref, "example", "cat", APP_FILE) == APP_FILE_DATA.decode()


def test_systemd_unit_starts_before_containerd_and_waits_for_the_socket():
    unit = (EXAMPLES / "bootseer-snapshotter.service").read_text()
    assert re.search(r"^Before=.*\bcontainerd\.service\b", unit, re.M)
    exec_start = re.search(r"^ExecStart=(\S+) (.*)$", unit, re.M)
    assert exec_start and exec_start.group(1).endswith("/bootseer-snapshotter")
    assert re.search(r"^ExecStartPost=.*-S " + re.escape(DEFAULT_SOCKET), unit, re.M)
    assert re.search(r"^KillSignal=SIGTERM$", unit, re.M)


@pytest.mark.timeout(300)
def test_demo_runs_and_cleans_up(runnable, tmp_path):
    if snapshotter_available():
        pytest.skip(snapshotter_available())
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
    # Nothing the demo made is left: its temp dir (the one it names; other runs' come and go meanwhile) is gone.
    base = re.search(r"containerd under (\S+)", out)
    assert base and base.group(1).startswith(os.environ.get("TMPDIR", "/tmp")) and not Path(base.group(1)).exists()
    # The profile outlives the temp dir, and the demo says where it is.
    assert f"{profile_dir / 'profile.html'} (timeline)" in out
    assert "first_step" in (profile_dir / "profile.json").read_text()
    assert "<svg" in (profile_dir / "profile.html").read_text()
