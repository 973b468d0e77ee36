"""containerd's own snapshotter test suite against bootseer-snapshotter.

Builds ``integration/conformance`` (a Go test calling containerd's
``snapshots/testsuite.SnapshotterSuite`` through the ``snapshots/proxy`` client, a
fresh daemon per case) offline in GOPATH mode from Debian's Go sources of the containerd
``BOOTSEER_CONTAINERD`` chooses (:func:`containerd_go_sources`: 1.6's from
golang-github-containerd-containerd-dev with the system's Go 1.19; 1.7's and 2.1's, with
Go 1.24 and 1.27, unpacked by ``ctr_examples/install-containerd.sh``), runs it, and
fails naming the failing subtests with their messages.  The ``overlay-baseline`` case
runs the same binary against containerd's own overlayfs snapshotter served through the
same gRPC proxy: if that fails, the suite or this machine is at fault, not the daemon.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.containerd import (
    ContainerdGoSources, containerd_go_sources, containerd_install, containerd_unavailable,
)
from tests.support.processes import HarnessError
from tests.support.stack import snapshotter_available, snapshotter_binary

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(1500)]

PACKAGE_DIR = Path(__file__).resolve().parent / "conformance"
IMPORT_PATH = "bootseer/integration/conformance"
SUITE_TIMEOUT_S = 1200  #: the suite runs its cases in parallel; 128LayersMount alone takes a while
TOP_TEST = "TestBootseerSnapshotter"


def go_test_env(gopath: Path, sources: ContainerdGoSources) -> dict[str, str]:
    env = sources.env(gopath)
    if "GOCACHE" not in env and not os.environ.get("HOME"):
        env["GOCACHE"] = str(gopath / "cache")
    return env


#: The subtests each suite skips by itself, for every snapshotter: 1.6's skips Rename ("rename test still fails on
#: some kernels with overlay"); 1.7's and 2.1's run it (the directory rename of a lower layer left out, as for
#: containerd's overlayfs: the suite is told the daemon's mounts are overlayfs, which they are).
SUITE_SKIPS = {"1.6": {"Rename"}}


@pytest.fixture(scope="module")
def go_sources() -> ContainerdGoSources:
    why = containerd_unavailable()
    if why:
        pytest.skip(why)
    try:
        return containerd_go_sources(containerd_install())
    except HarnessError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def suite_binary(tmp_path_factory, go_sources: ContainerdGoSources) -> Path:
    if os.geteuid() != 0:
        pytest.skip("the suite mounts overlayfs: needs root")
    gopath = tmp_path_factory.mktemp("gopath")
    # GOPATH mode wants the package under GOPATH/src: link it there.
    link = gopath / "src" / IMPORT_PATH
    link.parent.mkdir(parents=True)
    link.symlink_to(PACKAGE_DIR)
    binary = gopath / "conformance.test"
    tags = ["-tags", ",".join(go_sources.tags)] if go_sources.tags else []
    build = subprocess.run([go_sources.go, "test", "-c", *tags, "-o", str(binary), IMPORT_PATH],
                           cwd=gopath, env=go_test_env(gopath, go_sources), capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, f"building the conformance suite failed:\n{build.stdout}\n{build.stderr}"
    return binary


def subtest_results(output: str) -> dict[str, tuple[str, str]]:
    """``{subtest: (PASS|FAIL|SKIP, its log lines)}`` from ``-test.v`` output.

    With parallel subtests, go test interleaves their logs in sections headed
    ``=== CONT  Test/Name`` (or ``=== RUN``) and prints the ``--- FAIL: Test/Name``
    verdicts at the end; each line of a section belongs to the section's subtest.
    """
    logs: dict[str, list[str]] = {}
    statuses: dict[str, str] = {}
    current = None
    for line in output.splitlines():
        section = re.match(rf"^=== (?:RUN|CONT|PAUSE)\s+{TOP_TEST}/(\S+)", line)
        verdict = re.match(rf"^\s*--- (PASS|FAIL|SKIP): {TOP_TEST}/(\S+) \(", line)
        if section:
            current = section.group(1)
        elif verdict:
            statuses[verdict.group(2)] = verdict.group(1)
            current = verdict.group(2)  # go prints a finished subtest's remaining logs below its verdict
        elif line.startswith(("=== ", "--- ", "PASS", "FAIL", "ok ")):
            current = None
        elif current:
            logs.setdefault(current, []).append(line)
    return {name: (status, "\n".join(logs.get(name, []))) for name, status in statuses.items()}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The suite's TMPDIR: each case's daemon socket lives there, and unix socket paths must fit 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="bsc-", dir="/tmp"))
    yield path
    leaked = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(f"{path}/")]
    for point in reversed(leaked):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)
    shutil.rmtree(path, ignore_errors=True)
    assert not leaked, f"the suite left mounts behind: {leaked}"


@pytest.mark.parametrize("target", ["bootseer", "overlay-baseline"])
def test_containerd_snapshotter_suite(suite_binary: Path, target: str, short_tmp: Path):
    env = dict(os.environ, TMPDIR=str(short_tmp))
    if target == "bootseer":
        why = snapshotter_available()
        if why:
            pytest.skip(why)
        env["BOOTSEER_SNAPSHOTTER"] = snapshotter_binary()
        env.pop("BOOTSEER_BASELINE", None)
    else:
        env["BOOTSEER_BASELINE"] = "overlay"
    try:
        done = subprocess.run([str(suite_binary), "-test.v", "-test.timeout", f"{SUITE_TIMEOUT_S}s"],
                              env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"suite hung past {SUITE_TIMEOUT_S + 60}s; output so far:\n{e.stdout}\n{e.stderr}")
    output = done.stdout + done.stderr
    results = subtest_results(output)
    failed = {name: msgs for name, (status, msgs) in results.items() if status == "FAIL"}
    summary = ", ".join(f"{n}={s}" for n, (s, _) in sorted(results.items()))
    print(f"{target}: {summary}")
    assert not failed, f"{len(failed)} of {len(results)} subtests failed: {sorted(failed)}\n" + "\n".join(
        f"--- {name}\n{msgs[-4000:]}" for name, msgs in sorted(failed.items()))
    assert done.returncode == 0, f"suite exited {done.returncode}:\n{output[-20000:]}"
    assert results, f"no subtest results in the output:\n{output[-20000:]}"
    # Only the suite's own skips (SUITE_SKIPS); any other would hide a subtest.
    skipped = {name for name, (status, _) in results.items() if status == "SKIP"}
    allowed = SUITE_SKIPS.get(containerd_install().series, set())
    assert skipped <= allowed, f"unexpected skips: {sorted(skipped - allowed)}"
