"""Shared FUSE plumbing: read-only pyfuse3 filesystems served under a trio lifecycle.

* :mod:`bootseer.fuse.nodes` -- how a filesystem describes its tree: directories,
  files, symlinks and per-open file handles (plus simple in-memory nodes).
* :mod:`bootseer.fuse.inodes` -- stable inode numbers and the kernel's references.
* :mod:`bootseer.fuse.operations` -- the pyfuse3 request handlers: errno mapping,
  EROFS for writes, cache timeouts, metrics.
* :mod:`bootseer.fuse.mount` -- mountpoint checks, mount options and :func:`serve`,
  which mounts, serves and always unmounts (signals and external ``umount`` included).

A filesystem is a root :class:`~bootseer.fuse.nodes.Directory`; serving it is::

    ops = ReadOnlyOperations(root, name="bootseer-ckpt", entry_timeout=5, attr_timeout=5)
    await serve(ops, mountpoint, options=mount_options(fsname=url, subtype="bootseer-ckpt"))
"""

from bootseer.fuse.mount import MountError, check_mountpoint, mount_options, serve
from bootseer.fuse.nodes import (
    Attributes,
    BytesFile,
    Directory,
    File,
    Node,
    OpenFile,
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
    "MountError",
    "Node",
    "OpenFile",
    "ReadOnlyOperations",
    "StaticDirectory",
    "StaticSymlink",
    "Symlink",
    "check_mountpoint",
    "errno_of",
    "mount_options",
    "serve",
]
