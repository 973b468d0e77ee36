"""Serving one checkpoint source as a read-only FUSE mount.

:func:`mount_checkpoint` runs the fetch engine and the FUSE session side by side in
one trio run: it opens the engine over the source, checks that the source answers,
mounts, and serves until the mount ends (``umount``, SIGTERM/SIGINT).  A source that
fails later does not end the mount: the reads it fails get EIO after the engine's
retry timeout, and reads succeed again once it is back.
"""

from __future__ import annotations

import functools
import os
import signal
from typing import TYPE_CHECKING

import pyfuse3
import trio

from bootseer.ckptmount.tree import CheckpointFile, CheckpointTree
from bootseer.fetch.engine import EngineConfig, display_url, open_engine
from bootseer.fuse import ReadOnlyOperations, end_on_signals, mount_options, serve
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks

if TYPE_CHECKING:
    from bootseer.fetch.source import RangeSource

log = get_logger(__name__)

SUBTYPE = "bootseer-ckpt"


class SourceUnavailable(Exception):
    """The source did not answer at mount time; nothing was mounted."""


async def mount_checkpoint(
    source: RangeSource,
    mountpoint: str,
    *,
    config: EngineConfig,
    listing_ttl: float,
    allow_other: bool = False,
    digest_source: RangeSource | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mount ``source`` (a :class:`~bootseer.fetch.source.RangeSource`) read-only on
    ``mountpoint`` and serve it until the mount ends; ``task_status.started()`` once
    the mount is ready.  Only the mounting user may read it unless ``allow_other``.
    ``digest_source``: where the digest list of a source that is one file lies (its URL plus
    ``.bootseer-digests``); files in a directory source have theirs beside them.

    Raises :class:`SourceUnavailable` if the source's root cannot be read, and
    :class:`~bootseer.fuse.MountError` if the mount cannot be made.
    """
    shown = display_url(source)
    options = mount_options(fsname=shown, subtype=SUBTYPE, allow_other=allow_other)
    async with open_engine(source, config) as engine:
        tree = CheckpointTree(engine, listing_ttl=listing_ttl, digest_source=digest_source)
        try:
            root = await tree.root(shown)
        except OSError as exc:
            raise SourceUnavailable(f"cannot read the source {shown}: {exc.strerror or exc}") from exc
        ops = ReadOnlyOperations(root, name=SUBTYPE, entry_timeout=listing_ttl, attr_timeout=listing_ttl)
        # Opened before mounting, so a signal at any moment after the mount unmounts cleanly.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                tree.on_version_gone = functools.partial(_forget_in_kernel, ops, nursery)
                session = await nursery.start(functools.partial(serve, ops, mountpoint, options=options))
                nursery.start_soon(end_on_signals, session, signals)
                nursery.start_soon(functools.partial(profile_hooks.sample_counter, "checkpoint.bytes", lambda: engine.statistics().bytes_fetched, phase="checkpoint", until=session.ended, source=shown))  # profiler
                log.info("mounted", source=shown, mountpoint=mountpoint)
                task_status.started()


def _forget_in_kernel(ops: ReadOnlyOperations, nursery: trio.Nursery, node: CheckpointFile) -> None:
    """Drop the kernel's cached pages and name of a file whose version is gone at the source.

    The pages are of that version only (reads are pinned to it), so this is not
    about wrong bytes: a reader that reopens the name gets the new version at once,
    instead of the old inode's pages until the entry timeout.  Called from a read
    handler, it must not wait: the kernel's invalidation waits for the pages that
    read holds locked, so it runs in a thread of its own once the reply is out.
    """
    number = ops.inodes.number(node)
    parent = ops.inodes.parent(number)
    name = os.fsencode(node.path.rpartition("/")[2]) if node.path else None
    nursery.start_soon(_invalidate, number, parent, name)


async def _invalidate(number: int, parent: int, name: bytes | None) -> None:
    def blocking() -> None:
        try:
            pyfuse3.invalidate_inode(number)
            if name is not None:
                pyfuse3.invalidate_entry(parent, name)
        except OSError as exc:  # ENOENT: the kernel had forgotten it already
            log.debug("invalidating a changed file's cache failed", inode=number, error=repr(exc))

    await trio.to_thread.run_sync(blocking, abandon_on_cancel=True)
