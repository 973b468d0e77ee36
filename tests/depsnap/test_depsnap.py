"""Dependency snapshots on bare metal, with real pip and uv installing real wheels the tests build.

The wheels (``alpha`` 1.0 and 1.1 with a console script, ``beta`` 2.0 needing alpha)
are built once per module with ``pip wheel --no-build-isolation`` from tiny
pyproject projects: no network.  A hit is restored through the real layer server
(FUSE) and overlayfs, so those tests need root; the key, capture and publishing
tests do not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bootseer.blockstore.objects.format import FormatError
from bootseer.blockstore.objects.store import open_store_writer
from bootseer.depsnap.capture import diff, publish_capture, scan
from bootseer.depsnap.key import DepsKeyError, compute_key, strip_credentials
from bootseer.depsnap.record import DepsRecord, deps_object
from bootseer.paths import ServerPaths
from tests.support.mounts import force_unmount, mount_entry
from tests.support.waiting import wait_until

PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent
UV = str(VENV_BIN / "uv")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="restoring mounts overlayfs and FUSE: needs root")


def _project(root: Path, name: str, version: str, deps: list[str], script: bool) -> Path:
    project = root / f"{name}-{version}"
    (project / "src" / name).mkdir(parents=True)
    lines = ["[build-system]", 'requires = ["setuptools"]', 'build-backend = "setuptools.build_meta"',
             "[project]", f'name = "{name}"', f'version = "{version}"', f"dependencies = {json.dumps(deps)}"]
    if script:
        lines += ["[project.scripts]", f'{name}-hello = "{name}:main"']
    (project / "pyproject.toml").write_text("\n".join(lines) + "\n")
    (project / "src" / name / "__init__.py").write_text(
        f'VERSION = "{version}"\n' + "".join(f"import {d.split('>')[0].split('=')[0]}\n" for d in deps)
        + f'def main():\n    print("hello from {name} {version}")\n')  # fmt: skip
    return project


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("projects")
    out = tmp_path_factory.mktemp("wheels")
    projects = [_project(src, "alpha", "1.0", [], True), _project(src, "alpha", "1.1", [], True),
                _project(src, "beta", "2.0", ["alpha>=1.0"], False)]  # fmt: skip
    for project in projects:  # one at a time: one resolution may not hold two versions of alpha
        subprocess.run([PYTHON, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                        "-w", str(out), str(project)], check=True, env=clean_env(src), cwd=src)  # fmt: skip
    assert len(list(out.glob("*.whl"))) == 3
    return out


def clean_env(home: Path) -> dict[str, str]:
    """An environment without the session's pip settings and PYTHONDONTWRITEBYTECODE (installs write bytecode)."""
    return {"PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "PIP_CONFIG_FILE": os.devnull,
            "UV_NO_CONFIG": "1", "UV_CACHE_DIR": str(home / "uv-cache"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "LANG": "C.UTF-8"}  # fmt: skip


@pytest.fixture
def work(tmp_path: Path, layer_server_reaper):
    """A directory for a node root, a store and a home; teardown unmounts what a test left and stops its layer servers."""
    layer_server_reaper(tmp_path)
    yield tmp_path
    for mounted in [p for p in tmp_path.glob("*") if mount_entry(p) is not None]:
        force_unmount(mounted)


def deps(work: Path, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [PYTHON, "-m", "bootseer.cli", "deps", *args]
    done = subprocess.run(argv, env=env or clean_env(work), cwd=work, capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def run_args(work: Path, prefix: Path, *install: str, options: tuple[str, ...] = ()) -> list[str]:
    return ["run", "--prefix", str(prefix), "--store", str(work / "store"), "--root", str(work / "node"), *options,
            "--", *install]  # fmt: skip


def snapshot_tree(root: Path) -> dict[str, tuple]:
    """Everything a restored tree must keep: type, mode, owner, size, mtime, contents or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in ["", *dirnames, *filenames]:
            path = Path(dirpath) / name if name else Path(dirpath)
            rel = str(path.relative_to(root)) if path != root else ""
            if name == "" and rel in out:
                continue
            st = os.lstat(path)
            what: object = None
            if stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            size = st.st_size if not stat.S_ISDIR(st.st_mode) else 0
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, size, st.st_mtime_ns, what)
    return out


def records(store: Path) -> list[Path]:
    return sorted((store / "v1" / "deps").glob("*.json")) if (store / "v1" / "deps").exists() else []


# -- the key -----------------------------------------------------------------------------------


def test_key_follows_nested_files_index_urls_and_relevant_env(tmp_path: Path, wheels: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "req.txt").write_text("-r sub/base.txt\nbeta  # the app\n")
    (tmp_path / "sub" / "base.txt").write_text("-c pins.txt\nalpha\n")  # relative to sub/, not the cwd
    (tmp_path / "sub" / "pins.txt").write_text("alpha==1.0\n")
    env = clean_env(tmp_path)
    argv = ["pip", "install", "--target", str(tmp_path / "env"), "--no-index", "-f", str(wheels), "-r", "req.txt"]

    def key(argv: list[str] = argv, env: dict[str, str] = env) -> str:
        return compute_key(argv, prefix=tmp_path / "env", env=env, cwd=tmp_path, python=PYTHON).key

    first = compute_key(argv, prefix=tmp_path / "env", env=env, cwd=tmp_path, python=PYTHON)
    assert f"constraints:{tmp_path / 'sub' / 'pins.txt'}" in first.inputs
    assert f"find-links:{wheels}" in first.inputs and first.inputs["python.version"]
    # Not otherwise: same inputs, a touched file, an irrelevant variable.
    assert key() == first.key
    os.utime(tmp_path / "sub" / "pins.txt", ns=(1, 1))
    assert key() == first.key
    assert key(env={**env, "PIP_NO_COLOR": "1", "PIP_CACHE_DIR": "/x", "PYTHONUNBUFFERED": "1", "TERM": "dumb"}) == first.key
    # The nested-most file.
    (tmp_path / "sub" / "pins.txt").write_text("alpha==1.1\n")
    changed = key()
    assert changed != first.key
    (tmp_path / "sub" / "pins.txt").write_text("alpha==1.0\n")
    assert key() == first.key
    # Index URLs: in argv, in a requirement file, in the environment; credentials stripped.
    assert key(argv + ["--extra-index-url", "http://mirror.example/simple"]) != first.key
    (tmp_path / "sub" / "base.txt").write_text("-c pins.txt\n-i http://other.example/simple\nalpha\n")
    assert key() != first.key
    (tmp_path / "sub" / "base.txt").write_text("-c pins.txt\nalpha\n")
    assert key(env={**env, "PIP_INDEX_URL": "http://a.example/simple"}) != first.key
    with_password = compute_key(argv, prefix=tmp_path / "env", cwd=tmp_path, python=PYTHON,
                                env={**env, "PIP_INDEX_URL": "http://user:secret@a.example/simple"})  # fmt: skip
    assert "secret" not in with_password.describe()
    assert with_password.key == key(env={**env, "PIP_INDEX_URL": "http://other:rotated@a.example/simple"})
    # Relevant variables; a wheel added to the find-links directory.
    assert key(env={**env, "PYTHONPATH": "/opt/site"}) != first.key
    assert key(env={**env, "SOURCE_DATE_EPOCH": "0"}) != first.key
    (wheels / "gamma-1.0-py3-none-any.whl").write_bytes(b"not really")
    try:
        assert key() != first.key
    finally:
        (wheels / "gamma-1.0-py3-none-any.whl").unlink()
    # The prefix's prior contents and path.
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "x").write_text("")
    assert key() != first.key
    (tmp_path / "env" / "x").unlink()
    assert key() == first.key  # an empty prefix installs as a missing one
    (tmp_path / "env").rmdir()
    assert compute_key(argv, prefix=tmp_path / "env2", env=env, cwd=tmp_path, python=PYTHON).key != first.key


def test_key_uv_and_errors(tmp_path: Path, wheels: Path) -> None:
    (tmp_path / "req.txt").write_text("beta\n")
    env = clean_env(tmp_path)
    argv = [UV, "pip", "install", "--python", PYTHON, "--no-index", "--find-links", str(wheels), "-r", "req.txt"]
    key = compute_key(argv, prefix=tmp_path / "env", env=env, cwd=tmp_path)
    assert key.inputs["uv.version"].startswith("uv ")
    assert key.inputs["python"] == PYTHON
    assert compute_key(argv, prefix=tmp_path / "env", env={**env, "UV_RESOLUTION": "lowest"}, cwd=tmp_path).key != key.key
    assert compute_key(argv, prefix=tmp_path / "env", env={**env, "UV_CONCURRENT_DOWNLOADS": "2"}, cwd=tmp_path).key == key.key
    (tmp_path / "req.txt").write_text("-r missing.txt\n")
    with pytest.raises(DepsKeyError, match="missing.txt does not exist"):
        compute_key(argv, prefix=tmp_path / "env", env=env, cwd=tmp_path)
    (tmp_path / "req.txt").write_text("-r req.txt\nbeta\n")  # a file including itself is read once
    compute_key(argv, prefix=tmp_path / "env", env=env, cwd=tmp_path)
    assert strip_credentials("https://u:p@h.example:8443/s?x=1") == "https://h.example:8443/s?x=1"
    cli = deps(tmp_path, "key", "--prefix", str(tmp_path / "env"), "--", *argv)
    assert cli.stdout.startswith("key ") and "requirements:" in cli.stdout
    bad = deps(tmp_path, "key", "--prefix", str(tmp_path / "env"), "--", "pip", "install", "-r", "nope.txt", check=False)
    assert bad.returncode == 2 and "nope.txt does not exist" in bad.stderr


# -- capture, bare metal -------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize("image", ["converter-built", "node-built"])
def test_pip_target_miss_captures_and_hit_restores_an_identical_tree(work: Path, wheels: Path, image: str) -> None:
    """A capture publishes its EROFS image and a hit mounts it (built from the index with ``--no-image``)."""
    (work / "req.txt").write_text("beta\n")
    prefix = work / "env"
    install = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "-f", str(wheels), "--target", str(prefix), "-r", "req.txt"]
    first = deps(work, *run_args(work, prefix, *install, options=() if image == "converter-built" else ("--no-image",)))
    assert "captured" in first.stderr
    assert bool(list((work / "store" / "v1" / "images").glob("*"))) == (image == "converter-built")
    assert len(records(work / "store")) == 1
    installed = snapshot_tree(prefix)
    assert any(p.endswith(".pyc") for p in installed), "pip compiled bytecode, and it is captured"
    assert (prefix / "bin" / "alpha-hello").read_text().startswith("#!")
    # A fresh node: nothing local, the same store.
    os.rename(prefix, work / "installed")
    (work / "node").rename(work / "node-first")
    hit = deps(work, *run_args(work, prefix, *install))
    assert "hit" in hit.stderr, hit.stderr
    assert mount_entry(prefix).fstype == "overlay"
    assert snapshot_tree(prefix) == installed
    server_log = ServerPaths(work / "node").log.read_text()
    assert re.search(r"data path chosen.*data_path=fanotify", server_log)  # auto, on this kernel and ext4
    said = "fetched the layer's EROFS image" if image == "converter-built" else "building it from its index"
    assert said in server_log
    env = {**clean_env(work), "PYTHONPATH": str(prefix)}
    out = subprocess.run([PYTHON, "-c", "import beta, alpha; print(alpha.VERSION, alpha.__file__)"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split()[0] == "1.1" and out.stdout.split()[1].startswith(str(prefix))
    # The job can write (to the upper directory), and release drops that and unmounts.
    (prefix / "scratch").write_text("job output")
    again = deps(work, *run_args(work, prefix, *install))
    assert "present" in again.stderr
    # After a reboot (the mount gone, the empty mount point left) the next run restores it again.
    force_unmount(prefix)
    rebooted = deps(work, *run_args(work, prefix, *install))
    assert "hit" in rebooted.stderr and snapshot_tree(prefix) == installed
    released = deps(work, "release", str(prefix), "--root", str(work / "node"))
    assert "released" in released.stdout
    assert mount_entry(prefix) is None and not any(prefix.iterdir())
    assert deps(work, "release", str(prefix), "--root", str(work / "node"), check=False).returncode == 1


@needs_root
def test_uv_venv_with_prior_contents_upgrade_whiteouts_pip_check(work: Path, wheels: Path) -> None:
    """A venv (symlinks) made before; uv upgrades alpha 1.0 -> 1.1 (deleted files are whiteouts); pip check passes."""
    prefix = work / "venv"
    env = clean_env(work)
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(prefix)], check=True, env=env)
    subprocess.run([UV, "pip", "install", "-q", "--python", str(prefix / "bin" / "python"), "--no-index", "-f", str(wheels),
                    "alpha==1.0"], check=True, env=env)  # fmt: skip
    prior = snapshot_tree(prefix)
    (work / "req.txt").write_text("beta\nalpha==1.1\n")
    install = [UV, "pip", "install", "-q", "--compile-bytecode", "--python", str(prefix / "bin" / "python"),
               "--no-index", "-f", str(wheels), "-r", "req.txt"]  # fmt: skip
    first = deps(work, *run_args(work, prefix, *install))
    assert "captured" in first.stderr, first.stderr
    installed = snapshot_tree(prefix)
    gone = [p for p in prior if p not in installed]
    assert any("alpha-1.0.dist-info" in p for p in gone)
    script = prefix / "bin" / "alpha-hello"
    assert script.read_text().startswith(f"#!{prefix}/bin/python")
    # Put the prior venv back (the byte-identical tree of another node), then run again: a hit.
    subprocess.run(["rm", "-rf", str(prefix)], check=True)
    restore_prior = subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(prefix)], env=env)
    assert restore_prior.returncode == 0
    subprocess.run([UV, "pip", "install", "-q", "--python", str(prefix / "bin" / "python"), "--no-index", "-f", str(wheels),
                    "alpha==1.0"], check=True, env=env)  # fmt: skip
    deps(work, "release", str(prefix), "--root", str(work / "node"))  # forget "installed here"
    hit = deps(work, *run_args(work, prefix, *install))
    assert "hit" in hit.stderr, hit.stderr
    restored = snapshot_tree(prefix)
    same_content = {p: v[:5] + v[6:] for p, v in restored.items()}
    assert same_content == {p: v[:5] + v[6:] for p, v in installed.items()}  # the prior venv's own mtimes are this node's
    assert subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout.strip() == "hello from alpha 1.1"
    check = subprocess.run([PYTHON, "-m", "pip", "--python", str(prefix / "bin" / "python"), "check"], env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    deps(work, "release", str(prefix), "--root", str(work / "node"))
    assert mount_entry(prefix) is None and (prefix / "lib").exists()  # the prior venv is there again, untouched


@needs_root
def test_a_snapshot_that_cannot_be_restored_falls_back_to_installing(work: Path, wheels: Path) -> None:
    (work / "req.txt").write_text("beta\n")
    prefix = work / "env"
    install = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "-f", str(wheels), "--target", str(prefix), "-r", "req.txt"]
    deps(work, *run_args(work, prefix, *install))
    for chain in (work / "store" / "v1" / "chains").glob("*.json"):
        chain.unlink()  # the record names a layer the store no longer has
    subprocess.run(["rm", "-rf", str(prefix), str(work / "node")], check=True)
    again = deps(work, *run_args(work, prefix, *install))
    assert "cannot be restored; installing" in again.stderr and mount_entry(prefix) is None
    assert subprocess.run([PYTHON, "-c", "import beta"], env={**clean_env(work), "PYTHONPATH": str(prefix)}).returncode == 0


def _layer_server_status(root: Path) -> dict:
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    return LayerServerClient(ServerPaths(root).socket, timeout=10).call({"op": "hotlist.status"})


@needs_root
def test_a_restored_prefix_records_its_first_reads_and_later_restores_prefetch_them(work: Path, wheels: Path) -> None:
    """Bare metal: the first hit's reads (a host process, no container) become the deps layer's hot list; the next prefetches it."""
    (work / "req.txt").write_text("beta\n")
    prefix = work / "env"
    install = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "-f", str(wheels), "--target", str(prefix), "-r", "req.txt"]
    # Captured without its EROFS image: every file of the test wheels is small enough to be inside
    # one, and a read of those never reaches the layer's blob, so there would be nothing to record.
    deps(work, *run_args(work, prefix, *install, options=("--no-image",)))
    record = DepsRecord.decode(records(work / "store")[0].read_bytes())
    subprocess.run(["rm", "-rf", str(prefix), str(work / "node")], check=True)
    # Node A, the first hit: the restore starts a recording of any reader (there is no container).
    hit = deps(work, *run_args(work, prefix, *install))
    assert "hit" in hit.stderr, hit.stderr
    status = _layer_server_status(work / "node")
    [recording] = status["recordings"]
    assert recording["image"] == record.chain_id and recording["container"].startswith("deps-prefix-")
    env = {**clean_env(work), "PYTHONPATH": str(prefix)}
    subprocess.run([PYTHON, "-c", "import beta"], env=env, check=True)
    assert _layer_server_status(work / "node")["recordings"][0]["blocks"] > 0
    restored = snapshot_tree(prefix)  # reads every file: the list holds every block
    # Release seals it; the list is published beside the layer, keyed by the deps layer's ChainID.
    deps(work, "release", str(prefix), "--root", str(work / "node"))

    def published():
        done = [s for s in _layer_server_status(work / "node")["finished"] if s["kind"] == "recording"]
        return done[-1] if done else None

    summary = wait_until("the recording to be published", published)
    assert summary["outcome"] == "published" and summary["sealed_by"] == "removed", summary
    shown = subprocess.run([PYTHON, "-m", "bootseer.cli", "hotlist", "show", "--json", "--blocks", "--store",
                            str(work / "store"), record.chain_id], capture_output=True, text=True, env=clean_env(work))  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    [listed] = json.loads(shown.stdout)
    assert listed["blocks"] == summary["blocks"] > 0 and listed["container"] == summary["container"]
    # Node B, a later hit: the prefetch runs as the prefix is restored, before anything reads it.
    subprocess.run(["rm", "-rf", str(prefix)], check=True)
    node_b = work / "node-b"
    again = deps(work, "run", "--prefix", str(prefix), "--store", str(work / "store"), "--root", str(node_b), "--", *install)
    assert "hit" in again.stderr, again.stderr

    def prefetched():
        status = _layer_server_status(node_b)
        return next((p for p in status["prefetches"] if p["image"] == record.chain_id and p.get("finished")), None)

    prefetch = wait_until("the prefetch to finish", prefetched)
    assert prefetch["fetched_blocks"] + prefetch["cached_blocks"] == listed["blocks"] and not _layer_server_status(node_b)["recordings"]
    # The prefetch also put the files' bytes into the page cache (hotlist.warm): the tree reads back
    # identical, and no read reaches the layer server (no hit, no miss: FUSE never sees them).
    prefetch = wait_until("the page cache warmed", lambda: next((p for p in _layer_server_status(node_b)["prefetches"]
                                                                 if p["image"] == record.chain_id and p["warm_finished"]), None))  # fmt: skip
    assert prefetch["warmed_bytes"] > 0
    assert snapshot_tree(prefix) == restored
    subprocess.run([PYTHON, "-c", "import beta"], env=env, check=True)
    after = next(p for p in _layer_server_status(node_b)["prefetches"] if p["image"] == record.chain_id)
    assert (after["hits"], after["waited"], after["misses"]) == (0, 0, 0), after
    deps(work, "release", str(prefix), "--root", str(node_b))
    ended = [s for s in _layer_server_status(node_b)["finished"] if s["kind"] == "prefetch"]
    assert ended and ended[-1]["image"] == record.chain_id  # the release ended it
    # What the warmed page cache served is counted, not "unread" (issue 17: every byte showed as unread).
    assert ended[-1]["unread_bytes"] == 0, ended[-1]
    assert ended[-1]["served_from_page_cache_blocks"] == listed["blocks"], ended[-1]
    # --no-hotlist: a node whose layer server neither prefetches nor records.
    node_c = work / "node-c"
    deps(work, "run", "--no-hotlist", "--prefix", str(prefix), "--store", str(work / "store"), "--root", str(node_c),
         "--", *install)  # fmt: skip
    status = _layer_server_status(node_c)
    assert status["enabled"] is False and not status["recordings"] and not status["prefetches"]
    deps(work, "release", str(prefix), "--root", str(node_c))
    bad = deps(work, *run_args(work, prefix, *install, options=("--hotlist-profile", "no/slash")), check=False)
    assert bad.returncode == 2 and "--hotlist-profile" in bad.stderr


def test_failed_install_publishes_nothing(work: Path, wheels: Path) -> None:
    (work / "req.txt").write_text("beta\nno-such-package\n")
    prefix = work / "env"
    done = deps(work, *run_args(work, prefix, PYTHON, "-m", "pip", "install", "-q", "--no-index", "-f", str(wheels),
                                "--target", str(prefix), "-r", "req.txt"), check=False)  # fmt: skip
    assert done.returncode == 1 and "nothing captured" in done.stderr
    assert records(work / "store") == []
    assert not (work / "node" / "prefixes").exists() or not any((work / "node" / "prefixes").iterdir())


def test_capture_killed_half_way_publishes_nothing_and_a_rerun_publishes(work: Path, wheels: Path) -> None:
    (work / "req.txt").write_text("beta\n")
    prefix = work / "env"
    # The install writes 96 MiB besides the wheels, so the capture takes a while.
    script = (f"{PYTHON} -m pip install -q --no-index -f {wheels} --target {prefix} -r req.txt && "
              f"head -c 100663296 /dev/urandom > {prefix}/blob")  # fmt: skip
    args = run_args(work, prefix, "sh", "-c", script, options=("--input", "req.txt"))
    argv = [PYTHON, "-m", "bootseer.cli", "deps", *args]
    process = subprocess.Popen(argv, env=clean_env(work), cwd=work, stderr=subprocess.PIPE, text=True)
    packs = work / "store" / "v1" / "packs"

    def a_pack_stored() -> bool:
        assert process.poll() is None, f"the run ended before it stored a pack: {process.stderr.read() if process.stderr else ''}"
        return packs.is_dir() and any(not name.startswith(".") for name in os.listdir(packs))

    # Half-way by construction: the capture has put at least one pack (a whole object, not a
    # temp name); stopped there, it is seen to have published no deps record, then killed.
    wait_until("the capture to store its first pack", a_pack_stored, 120, interval=0.001)
    process.send_signal(signal.SIGSTOP)
    assert records(work / "store") == [], "the capture had already published: not half-way"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert records(work / "store") == []
    # The next run on the node publishes what the killed one installed.
    rerun = deps(work, *args)
    assert "captured" in rerun.stderr, rerun.stderr
    assert len(records(work / "store")) == 1


def test_two_concurrent_first_runs_one_captures_one_waits(work: Path, wheels: Path) -> None:
    (work / "req.txt").write_text("beta\n")
    prefix = work / "env"
    argv = [PYTHON, "-m", "bootseer.cli", "deps", *run_args(work, prefix, PYTHON, "-m", "pip", "install", "-q", "--no-index",
                                                            "-f", str(wheels), "--target", str(prefix), "-r", "req.txt")]  # fmt: skip
    runs = [subprocess.Popen(argv, env=clean_env(work), cwd=work, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[1] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outputs
    assert sum("captured" in o for o in outputs) == 1 and sum("present" in o for o in outputs) == 1, outputs
    assert any("waiting for another run" in o for o in outputs)
    assert len(records(work / "store")) == 1
    assert subprocess.run([PYTHON, "-c", "import beta"], env={**clean_env(work), "PYTHONPATH": str(prefix)}).returncode == 0


def test_captures_of_one_key_on_two_nodes_leave_one_whole_record(tmp_path: Path) -> None:
    """First writer wins: two nodes (two trees) publishing one key at once; the record is one of them, whole."""
    trees = []
    for n in range(2):
        root = tmp_path / f"node{n}"
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "mod.py").write_text(f"NODE = {n}\n")
        trees.append(root)
    writer = open_store_writer(str(tmp_path / "store"))
    results = [None, None]

    def capture(n: int) -> None:
        tree = scan(trees[n])
        results[n] = publish_capture(writer, key="b" * 64, root=trees[n], tree=tree, change=diff({}, tree),
                                     mode="prefix", prefix="/opt/env")  # fmt: skip

    threads = [threading.Thread(target=capture, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.published for r in results) == [False, True]
    stored = DepsRecord.decode((tmp_path / "store" / deps_object("b" * 64)).read_bytes(), expected_key="b" * 64)
    winner = next(r for r in results if r.published)
    assert stored.chain_id == winner.chain_id and all(r.record == stored for r in results)


def test_capture_refuses_a_tree_that_changes_under_it(tmp_path: Path) -> None:
    root = tmp_path / "env"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")
    tree = scan(root)
    (root / "a.py").write_text("x = 2\n")  # same size, new contents: the layer no longer matches the disk
    from bootseer.depsnap.capture import CaptureError

    with pytest.raises(CaptureError):
        publish_capture(open_store_writer(str(tmp_path / "store")), key="c" * 64, root=root, tree=tree,
                        change=diff({}, tree), mode="prefix", prefix=str(root))  # fmt: skip
    assert records(tmp_path / "store") == []


@needs_root
def test_an_overlay_upper_directory_is_captured_in_overlay_form(tmp_path: Path) -> None:
    """A container's writable layer: deletions (0/0 devices) become whiteouts, a directory made again is opaque,
    hard links, symlinks and xattrs are kept, the overlay's own xattrs are not."""
    from bootseer.blockstore.objects.format import EntryType, LayerIndex, index_object
    from bootseer.depsnap.capture import upper_change

    lower, upper, work_dir, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower / "swap", lower / "keep", upper, work_dir, merged):
        d.mkdir(parents=True)
    (lower / "gone.txt").write_text("old")
    (lower / "swap" / "a.txt").write_text("a")
    (lower / "keep" / "k.txt").write_text("k")
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={lower},upperdir={upper},workdir={work_dir}", str(merged)], check=True)  # fmt: skip
    try:
        (merged / "gone.txt").unlink()
        (merged / "swap" / "a.txt").unlink()
        (merged / "swap").rmdir()
        (merged / "swap").mkdir()
        (merged / "swap" / "b.txt").write_text("b")
        (merged / "new").mkdir()
        (merged / "new" / "f").write_text("f" * 5000)
        os.chmod(merged / "new" / "f", 0o4750)
        os.link(merged / "new" / "f", merged / "new" / "hard")
        os.symlink("../keep/k.txt", merged / "new" / "link")
        os.setxattr(merged / "new" / "f", "user.origin", b"pip")
        (merged / "keep" / "k.txt").write_text("changed")
    finally:
        force_unmount(merged)
    tree = scan(upper)
    writer = open_store_writer(str(tmp_path / "store"))
    result = publish_capture(writer, key="e" * 64, root=upper, tree=tree, change=upper_change(tree), mode="container",
                             parent="sha256:" + "a" * 64, overlay_upper=True)  # fmt: skip
    record = writer.get(f"v1/chains/{result.chain_id.removeprefix('sha256:')}.json")
    index_name = json.loads(record)["index"]
    index = LayerIndex.decode(writer.get(index_object(index_name)), expected_sha256=index_name)
    entries = {e.path: e for e in index.entries}
    assert entries["gone.txt"].type is EntryType.CHAR and entries["gone.txt"].rdev == (0, 0)
    assert entries["swap"].xattrs.get("trusted.overlay.opaque") == b"y" and "swap/b.txt" in entries
    assert "swap/a.txt" not in entries
    f, hard = entries["new/f"], entries["new/hard"]
    assert f.mode == 0o4750 and f.xattrs == {"user.origin": b"pip"} and hard.link == index.entries.index(f)
    assert entries["new/link"].target == "../keep/k.txt"
    assert entries["keep/k.txt"].size == len("changed")
    assert all(not name.startswith("trusted.overlay.") or name == "trusted.overlay.opaque"
               for e in index.entries for name in e.xattrs)


def test_record_checks_and_housekeeping(work: Path) -> None:
    root = work / "tree"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text("f")
    writer = open_store_writer(str(work / "store"))
    tree = scan(root)
    for n, key in enumerate(["1" * 64, "2" * 64, "3" * 64]):
        (root / "d" / "f").write_text("f" * (n + 1))
        tree = scan(root)
        publish_capture(writer, key=key, root=root, tree=tree, change=diff({}, tree), mode="prefix", prefix="/opt/x")
    data = (work / "store" / deps_object("1" * 64)).read_bytes()
    with pytest.raises(FormatError, match="stored under"):
        DepsRecord.decode(data, expected_key="2" * 64)
    tampered = json.loads(data)
    tampered["chain_id"] = "sha256:" + "0" * 64
    with pytest.raises(FormatError, match="chain_id"):
        DepsRecord.decode(json.dumps(tampered).encode())
    listed = deps(work, "ls", "--store", str(work / "store"), "--root", str(work / "node"), "--json")
    assert sorted(r["key"] for r in json.loads(listed.stdout)["snapshots"]) == ["1" * 64, "2" * 64, "3" * 64]
    assert deps(work, "rm", "1" * 64, "--store", str(work / "store")).returncode == 0
    assert deps(work, "rm", "1" * 64, "--store", str(work / "store"), check=False).returncode == 1
    assert deps(work, "rm", "xyz", "--store", str(work / "store"), check=False).returncode == 2
    kept = deps(work, "prune", "--store", str(work / "store"), "--max-size", "2")  # one record of 2 or 3 bytes fits
    assert "1 removed, 1 kept" in kept.stderr
    deps(work, "prune", "--store", str(work / "store"), "--older-than", "0s")
    assert records(work / "store") == []
    assert deps(work, "prune", "--store", str(work / "store"), check=False).returncode == 2


def test_interpreter_probe_is_cheap_and_says_what_the_slow_calls_say(tmp_path: Path) -> None:
    """The probe reads pip's ``__version__`` and glibc's confstr; the values (key inputs) are those of
    ``importlib.metadata`` and ``platform.libc_ver()``, so keys published before stay the same."""
    import importlib.metadata
    import platform

    from bootseer.depsnap.key import probe_interpreter

    facts = probe_interpreter(sys.executable)
    assert facts["pip"] == importlib.metadata.version("pip")
    assert facts["libc"] == "-".join(platform.libc_ver())
    key = compute_key([sys.executable, "-m", "pip", "install", "x"], prefix=tmp_path / "env", env={"PATH": "/usr/bin"})
    assert key.inputs["python.libc"] == facts["libc"] and key.inputs["pip.version"] == facts["pip"]


def test_deps_command_line_loads_no_checkpoint_or_fuse_code() -> None:
    """`bootseer deps` sits in a job's start-up path: registering it imports neither ckptmount nor trio
    (a third of a hit's time before), and a size option still parses."""
    code = ("import argparse, sys; from bootseer.depsnap import cli; p = argparse.ArgumentParser(); "
            "cli.register(p.add_subparsers()); bad = [m for m in ('bootseer.ckptmount.cli', 'pyfuse3') if m in sys.modules]; "
            "a = p.parse_args(['deps', 'run', '--prefix', '/x', '--cache-size', '2G', '--', 'true']); print(bad, a.cache_size)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["[]", str(2 << 30)]


def test_container_captures_go_to_the_daemons_publish_store(tmp_path: Path) -> None:
    """One publish store for what a node writes: the daemon's [hotlist] publish_store / --publish-store
    (the layer server's setting) takes captures too; without it, the daemon's store."""
    from bootseer.snapshotter.config import Config
    from bootseer.snapshotter.daemon import deps_context

    front = "http://127.0.0.1:1/"
    writable = str(tmp_path / "store")
    with_publish = Config(root=tmp_path, address=tmp_path / "sock", store_url=front, publish_store=writable)
    assert deps_context(with_publish).publish_store == writable
    without = Config(root=tmp_path, address=tmp_path / "sock", store_url=writable)
    assert deps_context(without).publish_store == writable
    os.environ["BOOTSEER_PUBLISH_STORE"] = "/elsewhere"  # the daemon's setting, not a variable of its environment
    try:
        assert deps_context(with_publish).publish_store == writable
    finally:
        del os.environ["BOOTSEER_PUBLISH_STORE"]
