"""Shared FUSE plumbing: read-only pyfuse3 filesystems served under a trio lifecycle.

* :mod:`bootseer.fuse.nodes` -- how a filesystem describes its tree: directories,
  files, symlinks and per-open file handles (plus simple in-memory nodes).
* :mod:`bootseer.fuse.inodes` -- stable inode numbers and the kernel's references.
* :mod:`bootseer.fuse.operations` -- the pyfuse3 request handlers: errno mapping,
  EROFS for writes, cache timeouts, metrics.
* :mod:`bootseer.fuse.mount` -- mountpoint checks, mount options, the process's
  :class:`FuseSession` and :func:`serve`, which mounts, serves and closes it;
  :func:`end_on_signals`, the usual SIGTERM/SIGINT policy a program may adopt.

A filesystem is a root :class:`~bootseer.fuse.nodes.Directory`; serving it is::

    ops = ReadOnlyOperations(root, name="bootseer-ckpt", entry_timeout=5, attr_timeout=5)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            options = mount_options(fsname=url, subtype="bootseer-ckpt")
            session = await nursery.start(functools.partial(serve, ops, mountpoint, options=options))
            nursery.start_soon(end_on_signals, session, signals)
"""

from bootseer.fuse.mount import (
    FuseSession,
    MountError,
    check_mountpoint,
    end_on_signals,
    mount_options,
    serve,
    unmount_dead,
)
from bootseer.fuse.nodes import (
    Attributes,
    BytesFile,
    Directory,
    File,
    Node,
    OpenFile,
    Special,
    StaticDirectory,
    StaticSymlink,
    Symlink,
)
from bootseer.fuse.operations import ReadOnlyOperations, errno_of

__all__ = [
    "Attributes",
    "BytesFile",
    "Directory",
    "File",
    "FuseSession",
    "MountError",
    "Node",
    "OpenFile",
    "ReadOnlyOperations",
    "Special",
    "StaticDirectory",
    "StaticSymlink",
    "Symlink",
    "check_mountpoint",
    "end_on_signals",
    "errno_of",
    "mount_options",
    "serve",
    "unmount_dead",
]
