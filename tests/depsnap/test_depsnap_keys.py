"""Dependency keys: the same prior environment gives the same key wherever and whenever it was made, and keys
are scoped (bare metal ``--scope``; in containerd the namespace and the daemon's ``[depsnap] scope``).

Prior environments are real: ``python -m venv``, ``uv venv`` with ``uv pip install --compile-bytecode``, and a
``pip install --target`` directory, each made twice.  "Made at another time" is made deterministic: every file's
mtime is set to a given instant and the bytecode compiled again (``compileall -f``), so each ``.pyc`` embeds that
instant, exactly as it embeds the creation time in a venv made then.  The hit test restores through the real
layer server (FUSE) and overlayfs and runs the restored environment's python; the namespace test drives the real
``bootseer-snapshotter`` daemon with containerd's ``containerd-namespace`` request header.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from bootseer.blockstore.server.client import LayerServerClient
from bootseer.paths import ServerPaths
from bootseer.snapshotter.deps_hooks import DEPS_LABEL
from bootseer.depsnap.key import compute_key, tree_digest
from bootseer.depsnap.record import DepsRecord
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2 as api
from tests.support.mounts import force_unmount, mount_entry
from tests.support.wheels import PYTHON, VENV_BIN, build_wheels, install_env

UV = str(VENV_BIN / "uv")
DAY = 86400
MADE_AT = (1_700_000_000, 1_700_000_000 + 3 * DAY)  #: two creation times
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="restoring mounts overlayfs and FUSE: needs root")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheels(tmp_path_factory.mktemp("projects"), tmp_path_factory.mktemp("wheels"),
                        [("alpha", "1.0"), ("alpha", "1.1"), ("gamma", "3.0")])  # fmt: skip


@pytest.fixture
def work(tmp_path: Path, layer_server_reaper):
    """A directory for node roots, a store, a home; teardown unmounts what a test left and stops its layer servers."""
    layer_server_reaper(tmp_path / "node1")
    layer_server_reaper(tmp_path / "node2")
    yield tmp_path
    for mounted in [p for p in tmp_path.glob("*") if mount_entry(p) is not None]:
        force_unmount(mounted)


def run(argv: list[str], home: Path) -> str:
    done = subprocess.run(argv, env=install_env(home), cwd=home, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def made_at(prefix: Path, when: int, python: str, home: Path) -> None:
    """Make ``prefix`` look made at ``when``: every mtime set to it, bytecode compiled again from those sources."""
    for dirpath, dirnames, filenames in os.walk(prefix):
        for name in [*dirnames, *filenames]:
            os.utime(Path(dirpath) / name, (when, when), follow_symlinks=False)
    run([python, "-m", "compileall", "-q", "-f", str(prefix)], home)


def pyc_of(prefix: Path) -> dict[str, bytes]:
    return {str(p.relative_to(prefix)): p.read_bytes() for p in prefix.rglob("__pycache__/*.pyc")}


def install_key(prefix: Path, wheels: Path, home: Path, *install: str):
    return compute_key([str(prefix / "bin" / "pip"), "install", "--no-index", "--find-links", str(wheels), *install],
                       prefix=prefix, env=install_env(home), cwd=home)  # fmt: skip


def _venv(prefix: Path, home: Path, when: int) -> None:
    run([PYTHON, "-m", "venv", str(prefix)], home)
    made_at(prefix, when, str(prefix / "bin" / "python"), home)


def test_a_venv_made_at_another_time_has_the_same_key(tmp_path: Path, wheels: Path) -> None:
    """Two real ``python -m venv`` at one path, made at different times: one key; their bytecode differs (it
    embeds the creation time); a venv that differs (a package more, a source changed) has another key."""
    prefix = tmp_path / "env"
    keys, bytecode = [], []
    for when in MADE_AT:
        if prefix.exists():
            subprocess.run(["rm", "-rf", str(prefix)], check=True)
        _venv(prefix, tmp_path, when)
        bytecode.append(pyc_of(prefix))
        keys.append(install_key(prefix, wheels, tmp_path, "alpha==1.1"))
    assert len(bytecode[0]) > 100 and bytecode[0].keys() == bytecode[1].keys()
    assert all(bytecode[0][name] != bytecode[1][name] for name in bytecode[0])  # every .pyc embeds its time
    assert keys[0].key == keys[1].key, (keys[0].inputs["prefix-content"], keys[1].inputs["prefix-content"])

    # Another prior environment is another key: a package more, or a source file of pip changed.
    run([str(prefix / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(wheels), "gamma==3.0"], tmp_path)
    with_gamma = install_key(prefix, wheels, tmp_path, "alpha==1.1")
    assert with_gamma.key != keys[1].key
    run([str(prefix / "bin" / "pip"), "uninstall", "-q", "-y", "gamma"], tmp_path)
    with next(prefix.glob("lib/python3*/site-packages/pip/__init__.py")).open("a") as source:
        source.write("# changed\n")
    assert install_key(prefix, wheels, tmp_path, "alpha==1.1").key not in (keys[1].key, with_gamma.key)


def test_a_uv_venv_made_at_another_time_has_the_same_key(tmp_path: Path, wheels: Path) -> None:
    """``uv venv`` with a package installed ``--compile-bytecode``, made twice at different times: one key; with
    another version of the package, another key."""
    prefix = tmp_path / "env"
    keys = []
    for when in MADE_AT:
        if prefix.exists():
            subprocess.run(["rm", "-rf", str(prefix)], check=True)
        run([UV, "venv", "-q", str(prefix)], tmp_path)
        run([UV, "pip", "install", "-q", "--compile-bytecode", "--python", str(prefix / "bin" / "python"),
             "--no-index", "--find-links", str(wheels), "alpha==1.0"], tmp_path)  # fmt: skip
        made_at(prefix, when, str(prefix / "bin" / "python"), tmp_path)
        keys.append(compute_key([UV, "pip", "install", "--python", str(prefix / "bin" / "python"), "--no-index",
                                 "--find-links", str(wheels), "gamma==3.0"], prefix=prefix, env=install_env(tmp_path),
                                cwd=tmp_path))  # fmt: skip
    assert keys[0].key == keys[1].key, (keys[0].inputs["prefix-content"], keys[1].inputs["prefix-content"])
    run([UV, "pip", "install", "-q", "--compile-bytecode", "--python", str(prefix / "bin" / "python"), "--no-index",
         "--find-links", str(wheels), "alpha==1.1"], tmp_path)  # fmt: skip
    other = compute_key([UV, "pip", "install", "--python", str(prefix / "bin" / "python"), "--no-index",
                         "--find-links", str(wheels), "gamma==3.0"], prefix=prefix, env=install_env(tmp_path), cwd=tmp_path)  # fmt: skip
    assert other.key != keys[0].key


def test_a_target_prefix_made_at_another_time_has_the_same_key(tmp_path: Path, wheels: Path) -> None:
    """A ``pip install --target`` directory holding a package, made twice at different times: one key; with
    another version in it, another key."""
    prefix = tmp_path / "target"
    command = [PYTHON, "-m", "pip", "install", "--target", str(prefix), "--no-index", "--find-links", str(wheels),
               "gamma==3.0"]  # fmt: skip
    keys = []
    for when in MADE_AT:
        if prefix.exists():
            subprocess.run(["rm", "-rf", str(prefix)], check=True)
        run([PYTHON, "-m", "pip", "install", "-q", "--target", str(prefix), "--no-index", "--find-links", str(wheels),
             "alpha==1.0"], tmp_path)  # fmt: skip
        made_at(prefix, when, PYTHON, tmp_path)
        assert pyc_of(prefix)
        keys.append(compute_key(command, prefix=prefix, env=install_env(tmp_path), cwd=tmp_path))
    assert keys[0].key == keys[1].key, (keys[0].inputs["prefix-content"], keys[1].inputs["prefix-content"])
    run([PYTHON, "-m", "pip", "install", "-q", "--upgrade", "--target", str(prefix), "--no-index", "--find-links",
         str(wheels), "alpha==1.1"], tmp_path)  # fmt: skip
    assert compute_key(command, prefix=prefix, env=install_env(tmp_path), cwd=tmp_path).key != keys[0].key


def test_prior_content_ignores_record_order_and_bytecode_rows_but_not_sources(tmp_path: Path) -> None:
    """A RECORD's row order and its bytecode rows (hashed by some installers) do not count; a source's row does,
    and so does a ``.pyc`` without its source (it is the code)."""

    def tree(name: str, rows: list[str], files: dict[str, str]) -> Path:
        root = tmp_path / name
        (root / "pkg-1.0.dist-info").mkdir(parents=True)
        (root / "pkg-1.0.dist-info" / "RECORD").write_text("".join(row + "\n" for row in rows))
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        return root

    source = "pkg/__init__.py,sha256=AAAA,10"
    first = tree("a", [source, "pkg/__pycache__/__init__.cpython-311.pyc,sha256=BBBB,99", "pkg-1.0.dist-info/RECORD,,"],
                 {"pkg/__init__.py": "x = 1\n", "pkg/__pycache__/__init__.cpython-311.pyc": "one"})
    second = tree("b", ["pkg-1.0.dist-info/RECORD,,", "pkg/__pycache__/__init__.cpython-311.pyc,sha256=CCCC,98", source],
                  {"pkg/__init__.py": "x = 1\n", "pkg/__pycache__/__init__.cpython-311.pyc": "other"})
    assert tree_digest(first) == tree_digest(second)
    changed = tree("c", ["pkg/__init__.py,sha256=DDDD,10", "pkg-1.0.dist-info/RECORD,,"], {"pkg/__init__.py": "x = 1\n"})
    assert tree_digest(changed) != tree_digest(first)
    (second / "pkg" / "orphan.pyc").write_text("code without a source")
    assert tree_digest(second) != tree_digest(first)


def deps(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [PYTHON, "-m", "bootseer.cli", "deps", *args]
    done = subprocess.run(argv, env=install_env(home), cwd=home, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@needs_root
def test_a_capture_over_one_venv_restores_over_a_venv_made_at_another_time(work: Path, wheels: Path) -> None:
    """``python -m venv P && bootseer deps run --prefix P -- P/bin/pip install alpha`` on one node captures; on a
    fresh node whose venv at P was made at another time the same run is a hit, and the restored environment's
    python imports the package and runs its script."""
    prefix, store = work / "env", work / "store"
    install = [str(prefix / "bin" / "pip"), "install", "--no-index", "--find-links", str(wheels), "alpha==1.1"]

    def deps_run(node: str) -> str:
        return deps(work, "run", "--prefix", str(prefix), "--store", str(store), "--root", str(work / node), "--",
                    *install).stderr  # fmt: skip

    _venv(prefix, work, MADE_AT[0])
    assert "bootseer deps: captured" in deps_run("node1")
    subprocess.run(["rm", "-rf", str(prefix)], check=True)

    _venv(prefix, work, MADE_AT[1])  # a fresh node: its own venv at P, made at another time
    assert "bootseer deps: hit" in deps_run("node2")
    assert mount_entry(prefix) is not None
    python = str(prefix / "bin" / "python")
    out = run([python, "-c", "import alpha, pip, sys; print(alpha.VERSION, alpha.__file__.startswith(sys.prefix))"], work)
    assert out.split() == ["1.1", "True"]
    assert run([str(prefix / "bin" / "alpha-hello")], work).strip() == "hello from alpha 1.1"
    assert run([python, "-m", "pip", "--version"], work).startswith("pip ")
    deps(work, "release", str(prefix), "--root", str(work / "node2"))


def test_bare_metal_keys_are_scoped(tmp_path: Path) -> None:
    """``--scope`` is an input of a prefix's key: another scope, another key (and one printed as an input)."""
    command = ["sh", "-c", "true"]
    env = install_env(tmp_path)
    plain = compute_key(command, prefix=tmp_path / "p", env=env, python=PYTHON)
    team_a = compute_key(command, prefix=tmp_path / "p", env=env, python=PYTHON, scope="team-a")
    team_b = compute_key(command, prefix=tmp_path / "p", env=env, python=PYTHON, scope="team-b")
    assert len({plain.key, team_a.key, team_b.key}) == 3 and team_a.inputs["scope"] == "team-a"
    shown = deps(tmp_path, "key", "--prefix", str(tmp_path / "p"), "--python", PYTHON, "--scope", "team-a", "--",
                 *command).stdout  # fmt: skip
    assert shown.splitlines()[0] == f"key {team_a.key}"


# -- containerd: the namespace -----------------------------------------------------------------

TOP = "sha256:" + "ab" * 32  #: the image's top ChainID (a committed snapshot; nothing is converted)


def _prepare(daemon, namespace: str, name: str, *, parent: str = "", labels: dict[str, str] | None = None):
    """A Prepare as containerd 1.6 sends it to a proxy snapshotter: the key ``NS/N/name``, no namespace header."""
    request = api.PrepareSnapshotRequest(key=f"{namespace}/{name}", parent=parent, labels=labels or {})
    return daemon.stub.Prepare(request).mounts


def _image(daemon, namespace: str) -> str:
    """The image's top layer committed in ``namespace``, named as containerd's metadata store names it."""
    _prepare(daemon, namespace, "1/extract")
    name = f"{namespace}/2/{TOP}"
    daemon.stub.Commit(api.CommitSnapshotRequest(key=f"{namespace}/1/extract", name=name))
    return name


def _options(mounts) -> dict[str, str]:
    return dict(option.split("=", 1) for option in mounts[0].options if "=" in option)


def _wait_for(path: Path, daemon, seconds: float = 60.0) -> str:
    """The contents of ``path`` once the daemon writes it (it polls every 0.5 s); fails with the log after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared:\n{daemon.log}"
        time.sleep(0.1)
    return path.read_text().strip()


@needs_root
def test_a_capture_of_namespace_a_is_never_stacked_for_namespace_b(tmp_path: Path, snapshotter_factory) -> None:
    """Through the real daemon: a container of namespace A misses and its writable layer is captured; another
    container of A gets it stacked; a container of B with the very same label does not (it is B's own miss), and
    the record is named by the key scoped to A (``bootseer deps key --base --namespace`` prints the name)."""
    store = tmp_path / "store"
    store.mkdir()
    daemon = snapshotter_factory("--store", str(store))
    label = compute_key(["sh", "-c", "install"], base_chain=TOP).key
    labels = {DEPS_LABEL: label}
    parent_a, parent_b = _image(daemon, "team-a"), _image(daemon, "team-b")

    first = _options(_prepare(daemon, "team-a", "3/job-1", parent=parent_a, labels=labels))
    upper = Path(first["upperdir"])
    (upper / "opt" / "deps").mkdir(parents=True)
    (upper / "opt" / "deps" / "tool").write_text("installed in team-a\n")
    (upper / ".bootseer" / "deps-done").touch()
    assert _wait_for(upper / ".bootseer" / "deps-captured", daemon) == "published"

    other_b = _options(_prepare(daemon, "team-b", "4/job-2", parent=parent_b, labels=labels))
    assert not (Path(other_b["upperdir"]) / ".bootseer" / "deps-hit").exists()
    assert other_b["lowerdir"].count(":") == first["lowerdir"].count(":")  # nothing stacked under it
    again_a = _options(_prepare(daemon, "team-a", "5/job-3", parent=parent_a, labels=labels))
    assert (Path(again_a["upperdir"]) / ".bootseer" / "deps-hit").read_text().strip() == label
    [stacked] = [d for d in again_a["lowerdir"].split(":") if (Path(d) / "opt" / "deps" / "tool").exists()]
    assert (Path(stacked) / "opt" / "deps" / "tool").read_text() == "installed in team-a\n"

    shown = deps(tmp_path, "key", "--base", TOP, "--namespace", "team-a", "--", "sh", "-c", "install").stdout
    name = shown.splitlines()[-1].split()[1]
    [record_path] = (store / "v1" / "deps").glob("*.json")
    assert record_path.name == f"{name}.json" != f"{label}.json"
    record = DepsRecord.decode(record_path.read_bytes(), expected_key=name)
    assert record.parent == TOP and record.inputs["namespace"] == "team-a" and record.inputs["label"] == label
    for namespace, key in (("team-a", "5/job-3"), ("team-b", "4/job-2"), ("team-a", "3/job-1")):
        daemon.stub.Remove(api.RemoveSnapshotRequest(key=f"{namespace}/{key}"))


def test_the_namespace_is_the_first_component_of_containerds_key() -> None:
    """containerd names a proxy's snapshots ``NS/N/name`` and chooses NS; a name with slashes cannot change it. The
    ``containerd-namespace`` header counts only for a key not of that form (a client calling directly)."""
    from bootseer.snapshotter.deps_hooks import snapshot_namespace

    assert snapshot_namespace("team-a/12/job") == "team-a"
    assert snapshot_namespace("team-b/3/team-a/7/job", "team-a") == "team-b"
    assert snapshot_namespace("job", "team-c") == "team-c" and snapshot_namespace("job") == ""
    assert snapshot_namespace("../1/x", "h") == "h"


def test_the_daemon_takes_a_scope_and_refuses_a_bad_one(tmp_path: Path) -> None:
    """``[depsnap] scope`` (or ``--deps-scope``) is checked at start-up: a bad one is one line and exit 2."""
    from bootseer.snapshotter.config import ConfigError, read_file, resolve

    config = tmp_path / "config.toml"
    config.write_text('[depsnap]\nscope = "cluster-1"\n')
    assert resolve(read_file(config), {}).deps_scope == "cluster-1"
    with pytest.raises(ConfigError, match="depsnap.scope"):
        resolve({"depsnap.scope": "two words"}, {})
    done = subprocess.run([str(VENV_BIN / "bootseer-snapshotter"), "--root", str(tmp_path / "r"), "--deps-scope",
                           "no spaces allowed"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--deps-scope" in done.stderr.strip().splitlines()[-1], done.stderr


def test_the_nodes_image_mapping_is_checked_and_gives_a_container_its_key(tmp_path: Path) -> None:
    """``[depsnap] images`` (image reference or top ChainID -> deps key) is checked at start-up, naming the key; a
    container snapshot without a deps label gets the key of its image's top ChainID, else of the reference its
    parent layer was pulled by (CRI's ``cri.image-ref`` label), and an explicit label is not overridden."""
    from bootseer.snapshotter.deps_hooks import mapped_key
    from bootseer.snapshotter.config import ConfigError, read_file, resolve
    from bootseer.snapshotter.errors import NotFound
    from bootseer.snapshotter.types import Info, Kind

    good = compute_key(["sh", "-c", "pip install x"], base_chain="sha256:" + "a" * 64).key
    chain = "sha256:" + "b" * 64
    config = tmp_path / "config.toml"
    config.write_text(f'[depsnap.images]\n"registry.example/train:v3" = "{good}"\n"{chain}" = "{good}"\n')
    assert resolve(read_file(config), {}).deps_images == {"registry.example/train:v3": good, chain: good}
    for bad in ({"registry.example/x:1": "not a key"}, {"registry.example/x:1": 3}, {"": good}):
        with pytest.raises(ConfigError, match="depsnap.images"):
            resolve({"depsnap.images": bad}, {})

    class Node:
        deps_images = {"registry.example/train:v3": good, chain: good}

        def stat(self, key: str) -> Info:
            if key.endswith("c" * 64):
                return Info(key, "", Kind.COMMITTED, {"containerd.io/snapshot/cri.image-ref": "registry.example/train:v3"})
            if key.endswith("d" * 64):
                return Info(key, "", Kind.COMMITTED, {"containerd.io/snapshot/cri.image-ref": "registry.example/other:1"})
            raise NotFound(key)

    node = Node()
    assert mapped_key(node.deps_images, node.stat, "k8s.io/9/ctr", chain) == good  # by top ChainID
    assert mapped_key(node.deps_images, node.stat, "k8s.io/9/ctr", "k8s.io/4/sha256:" + "c" * 64) == good  # by the parent's image reference
    assert mapped_key(node.deps_images, node.stat, "k8s.io/9/ctr", "sha256:" + "d" * 64) is None  # another image
    assert mapped_key(node.deps_images, node.stat, "k8s.io/9/ctr", "sha256:" + "e" * 64) is None  # parent gone
    assert mapped_key(node.deps_images, node.stat, "k8s.io/9/ctr", "") is None  # not over an image layer
    node.deps_images = {}
    assert mapped_key(node.deps_images, node.stat, "k8s.io/9/ctr", chain) is None


def _control_requests(address: str) -> dict[str, float]:
    """The layer server's control requests so far, by operation (its watch's ``status`` left out), and its round
    trips (``connections``: every connection, the watch's ``status`` ones taken off)."""
    from tests.support.daemon import scrape

    counts: dict[str, float] = {}
    for (name, labels), value in scrape(address).items():
        if name == "bootseer_layer_server_requests_total":
            op = dict(labels)["op"]
            counts[op] = counts.get(op, 0) + value
        elif name == "bootseer_layer_server_control_connections_total":
            counts["connections"] = counts.get("connections", 0) + value
    counts["connections"] = counts.get("connections", 0) - counts.get("status", 0)
    counts.pop("status", None)
    return counts


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {op: after[op] - before.get(op, 0) for op in after if after[op] != before.get(op, 0)}


@needs_root
def test_a_container_start_makes_one_control_round_trip_with_or_without_a_dependency_hit(tmp_path: Path, snapshotter_factory) -> None:
    """The round trips to the layer server's control socket of a container's start (containerd's Prepare, then the
    task's Mounts), counted by the server: one.  A plain start sends the hot-list notice; a dependency hit sends
    the deps layer's mount and the notice in one ``batch``, and its Mounts takes the deps layer's lower dir
    from its mount as long as it is mounted there (no ``check``: three round trips before, four before that).
    Once the deps layer is unmounted behind the snapshotter's back, a Mounts asks the server again and mounts it."""
    from tests.support.waiting import free_port

    store = tmp_path / "store"
    store.mkdir()
    metrics = f"127.0.0.1:{free_port()}"
    daemon = snapshotter_factory("--store", str(store), "--layer-server-metrics-address", metrics)
    parent = _image(daemon, "ns")
    before = _control_requests(metrics)
    _prepare(daemon, "ns", "3/plain", parent=parent)
    daemon.stub.Mounts(api.MountsRequest(key="ns/3/plain"))
    assert _delta(before, _control_requests(metrics)) == {"connections": 1, "hotlist.prepared": 1}
    labels = {DEPS_LABEL: compute_key(["sh", "-c", "install"], base_chain=TOP).key}
    upper = Path(_options(_prepare(daemon, "ns", "4/job-1", parent=parent, labels=labels))["upperdir"])
    (upper / "opt" / "deps").mkdir(parents=True)
    (upper / "opt" / "deps" / "tool").write_text("installed\n")
    (upper / ".bootseer" / "deps-done").touch()
    assert _wait_for(upper / ".bootseer" / "deps-captured", daemon) == "published"
    before = _control_requests(metrics)
    hit = _options(_prepare(daemon, "ns", "5/job-2", parent=parent, labels=labels))
    assert (Path(hit["upperdir"]) / ".bootseer" / "deps-hit").exists()
    assert _options(daemon.stub.Mounts(api.MountsRequest(key="ns/5/job-2")).mounts)["lowerdir"] == hit["lowerdir"]
    assert _delta(before, _control_requests(metrics)) == {"connections": 1, "batch": 1, "mount": 1, "hotlist.prepared": 1}
    deps_lower = hit["lowerdir"].split(":")[0]
    assert (Path(deps_lower) / "opt" / "deps" / "tool").read_text() == "installed\n"
    # The server stops serving it behind the snapshotter's back: the next Mounts asks, and has it mounted again.
    chain = json.loads((Path(hit["upperdir"]).parent / "deps.json").read_text())["chain_id"]
    LayerServerClient(ServerPaths(tmp_path / "root").socket).unmount(chain)
    assert not os.path.ismount(deps_lower)
    before = _control_requests(metrics)
    assert _options(daemon.stub.Mounts(api.MountsRequest(key="ns/5/job-2")).mounts)["lowerdir"] == hit["lowerdir"]
    assert (Path(deps_lower) / "opt" / "deps" / "tool").read_text() == "installed\n"
    assert _delta(before, _control_requests(metrics)) == {"connections": 2, "check": 1, "mount": 1}
    for key in ("5/job-2", "4/job-1", "3/plain"):
        daemon.stub.Remove(api.RemoveSnapshotRequest(key=f"ns/{key}"))
