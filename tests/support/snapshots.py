"""Shared helpers of the snapshotter tests: perform returned mounts for real, always undo them;
a directory-serving layer backend for the remote snapshots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from bootseer.snapshotter.backend import ControlRequest, RemoteLayer
from bootseer.snapshotter.errors import LayerUnavailable
from bootseer.snapshotter.types import Mount


def mount_all(mounts: Sequence[Mount], target: str | os.PathLike) -> None:
    """Mount like containerd's ``mount.All``, using util-linux mount(8)."""
    for m in mounts:
        command = ["mount"]
        if m.type != "bind":
            command += ["-t", m.type]
        if m.options:
            command += ["-o", ",".join(m.options)]
        subprocess.run(command + [m.source, os.fspath(target)], check=True, capture_output=True, timeout=30)


def is_mountpoint(path: str | os.PathLike) -> bool:
    """From the mount table: ``os.path.ismount`` misses bind mounts within one filesystem."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as table:
        return any(line.split()[4] == path for line in table)


def unmount(target: str | os.PathLike) -> None:
    """Unmount everything on ``target`` (lazily if busy); fine if nothing is mounted."""
    for _ in range(16):  # mounts may be stacked
        if not is_mountpoint(target):
            return
        result = subprocess.run(["umount", os.fspath(target)], capture_output=True, timeout=30)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", os.fspath(target)], capture_output=True, timeout=30)
    assert not is_mountpoint(target), f"could not unmount {target}"


@contextmanager
def mounted(mounts: Sequence[Mount], target: str | os.PathLike) -> Iterator[Path]:
    """The mounts performed on ``target`` (created if needed) for the block."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    try:
        mount_all(mounts, target)
        yield target
    finally:
        unmount(target)


def write_files(root: str | os.PathLike, files: dict[str, str]) -> None:
    """Create ``files`` (relative path -> text) under ``root``, with parent dirs."""
    for name, text in files.items():
        path = Path(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def read_tree(root: str | os.PathLike) -> dict[str, str]:
    """Every regular file under ``root`` (relative path -> text) and every directory (-> '/')."""
    tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            tree[os.path.relpath(os.path.join(dirpath, name), root)] = "/"
        for name in filenames:
            path = os.path.join(dirpath, name)
            tree[os.path.relpath(path, root)] = Path(path).read_text()
    return tree


def snapshot_dirs(root: str | os.PathLike) -> set[str]:
    return set(os.listdir(Path(root, "snapshots")))


class DirectoryLayers:
    """A real :class:`~bootseer.snapshotter.backend.LayerBackend` for tests: "converted" layers are
    directories, served as read-only bind mounts.

    ``convert()`` puts a layer in the store (``STORE/<hex>/record.json`` and its tree
    in ``STORE/<hex>/fs``); ``mount`` bind-mounts the tree read-only at
    ``MNT/<hex[:12]>``, as the layer server serves a layer at ``ROOT/layers/mnt/<slot>``.
    The kernel's mount table is the state, so it survives the test's process being
    killed.  ``down`` makes the store unreachable (lookups and mounts fail the way a
    store that stopped answering does); ``crash_on_mount`` SIGKILLs the process right
    after a mount, before the snapshotter can record it.
    """

    def __init__(self, store: Path, mnt: Path) -> None:
        self.store, self.mnt = Path(store), Path(mnt)
        self.store.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.down = False
        self.crash_on_mount = False
        self.mount_gate: threading.Event | None = None  #: set: mounts wait for it (a slow store)
        self.mounting = threading.Event()  #: set once a mount has started
        self.calls: list[tuple[str, str]] = []

    def convert(self, chain_id: str, parent: str, files: dict[str, str], diff_id: str = "") -> None:
        layer = self.store / chain_id.split(":")[-1]
        write_files(layer / "fs", files)
        record = {"chain_id": chain_id, "parent": parent, "diff_id": diff_id or chain_id, "digest": chain_id,
                  "size": 1, "files": len(files)}  # fmt: skip
        (layer / "record.json").write_text(json.dumps(record))

    def lower_dir(self, chain_id: str) -> Path:
        return self.mnt / chain_id.split(":")[-1][:12]

    # -- LayerBackend ----------------------------------------------------------------------

    def lookup(self, chain_id: str) -> RemoteLayer | None:
        self.calls.append(("lookup", chain_id))
        self._check_up(chain_id)
        record = self.store / chain_id.split(":")[-1] / "record.json"
        if not record.exists():
            return None
        return RemoteLayer(**json.loads(record.read_text()))

    def warm(self, chain_ids: Sequence[str]) -> None:
        self.calls.extend(("warm", chain_id) for chain_id in chain_ids)

    def mount(self, chain_id: str, deps_index: str | None = None) -> str:
        self.calls.append(("mount", chain_id))
        self.mounting.set()
        if self.mount_gate is not None:
            assert self.mount_gate.wait(60), "the test never let the mount finish"
        self._check_up(chain_id)
        source = self.store / chain_id.split(":")[-1] / "fs"
        if not source.is_dir():
            raise LayerUnavailable("not_converted", f"no layer {chain_id}")
        target = self.lower_dir(chain_id)
        if not is_mountpoint(target):
            target.mkdir(exist_ok=True)
            subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(target)], check=True, capture_output=True)
        if self.crash_on_mount:
            os.kill(os.getpid(), signal.SIGKILL)
        return str(target)

    def check(self, chain_id: str) -> str:
        self.calls.append(("check", chain_id))
        target = self.lower_dir(chain_id)
        if not is_mountpoint(target):
            raise LayerUnavailable("not_mounted", f"{chain_id} is not served")
        return str(target)

    def serves(self, lower_dir: str) -> bool:
        return is_mountpoint(Path(lower_dir))

    def send(self, requests: Sequence[ControlRequest]) -> list[dict[str, Any] | LayerUnavailable]:
        """A ``mount`` as :meth:`mount` does it; any other request is only noted in :attr:`calls`."""
        answers: list[dict[str, Any] | LayerUnavailable] = []
        for request in requests:
            fields = request.fields
            if fields["op"] != "mount":
                self.calls.append((str(fields["op"]), str(fields.get("key", ""))))
                answers.append({})
                continue
            try:
                lower = self.mount(str(fields["chain_id"]), fields.get("deps_index"))
            except LayerUnavailable as exc:
                answers.append(exc)
            else:
                answers.append({"chain_id": fields["chain_id"], "slot": 0, "lower_dir": lower})
        return answers

    def unmount(self, chain_id: str) -> None:
        self.calls.append(("unmount", chain_id))
        self._check_up(chain_id)
        unmount(self.lower_dir(chain_id))

    def mounted(self) -> list[str]:
        self._check_up("")
        served = []
        for layer in self.store.iterdir():
            record = json.loads((layer / "record.json").read_text())
            if is_mountpoint(self.lower_dir(record["chain_id"])):
                served.append(record["chain_id"])
        return served

    def close(self) -> None:
        """Unmount everything (teardown)."""
        for entry in self.mnt.iterdir():
            unmount(entry)

    def _check_up(self, chain_id: str) -> None:
        if self.down:
            raise LayerUnavailable("store_error", f"the store did not answer for {chain_id}")
