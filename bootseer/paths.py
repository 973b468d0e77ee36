"""Where a node keeps BootSeer's state: the default root, and the layer server's files under a root.

One definition of the node's paths, read by every daemon and command that takes a
``--root`` (the snapshotter, the layer server, ``bootseer hotlist``, ``bootseer deps``,
``bootseer peers``, ``bootseer profile``), so a path is named once and derived from the
root everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: The node's BootSeer root unless ``--root`` (or the snapshotter's ``root``) says otherwise.
DEFAULT_ROOT = "/var/lib/bootseer"
#: Dependency snapshots' node state (``bootseer deps run --root``) unless told otherwise.
DEFAULT_DEPS_ROOT = f"{DEFAULT_ROOT}/deps"


@dataclass(frozen=True)
class ServerPaths:
    """The layer server's files under a node's ``--root``."""

    root: Path

    @property
    def layers(self) -> Path:
        return self.root / "layers"

    @property
    def socket(self) -> Path:
        return self.layers / "control.sock"

    @property
    def table(self) -> Path:
        return self.layers / "table.json"

    @property
    def mountpoint(self) -> Path:
        return self.layers / "mnt"

    @property
    def indexes(self) -> Path:
        """Local copies of mounted layers' indexes, so a restart needs no store."""
        return self.layers / "indexes"

    @property
    def log(self) -> Path:
        return self.layers / "server.log"

    @property
    def server_lock(self) -> Path:
        """Held by the running server for its whole life (one server per root)."""
        return self.layers / "server.lock"

    @property
    def start_lock(self) -> Path:
        """Held by whoever is starting a server (one starter at a time)."""
        return self.layers / "start.lock"

    @property
    def erofs_images(self) -> Path:
        """The EROFS images of the mounted layers' indexes (``erofs`` and ``loop`` data paths)."""
        return self.layers / "erofs"

    @property
    def erofs_lowers(self) -> Path:
        """Where the layers' EROFS mounts are, one directory per slot."""
        return self.layers / "lower"

    @property
    def events_socket(self) -> Path:
        """The event holder's socket (``fanotify`` data path: it holds the group across server restarts)."""
        return self.layers / "events.sock"

    @property
    def events_log(self) -> Path:
        return self.layers / "events.log"

    def blob(self, slot: int) -> Path:
        """The FUSE blob file of the layer in ``slot`` (``mnt/blobs/<slot>``: its EROFS image's device)."""
        return self.mountpoint / "blobs" / str(slot)  # blockstore.datapath.tree.BLOBS

    def lower_dir(self, slot: int, data_path: str = "tree") -> str:
        """The lower dir of the layer in ``slot`` on ``data_path``: its EROFS mount (``erofs``, ``loop``, ``fanotify``)
        or its per-file FUSE tree (``tree``, which every data path also serves)."""
        if data_path in ("erofs", "loop", "fanotify"):
            return str(self.erofs_lowers / str(slot))
        return str(self.mountpoint / str(slot))
