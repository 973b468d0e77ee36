"""The node's data path (how a layer's tree reaches overlayfs) and the layer server's EROFS mounts.

A node serves every layer one way, chosen once at the layer server's start
(``--data-path``, the snapshotter's ``[fuse] data_path``):

* ``fanotify``: as ``erofs``, but the image's device is the layer's *local blob*, a sparse
  file in the node cache's directory (``CACHE/blobs/``) that the layer server fills on the
  kernel's fanotify pre-access events (:mod:`.local_blobs`; Linux 6.14+ on a filesystem that
  takes the marks: ext4 here): a byte already on the node is read by the kernel from local disk, with no
  userspace at all once the blob is whole.  The fanotify group outlives the layer server
  (:mod:`.event_holder`), and so do the EROFS mounts: a restarted server takes them over.
* ``erofs``: the kernel's EROFS answers the tree, file-backed (Linux 6.12+): one
  metadata image per layer (:mod:`blockstore.objects.erofs_image`: the converter's, fetched from
  the store, verified and checked (:meth:`ErofsLayers.install_image`), or for a conversion
  without one built from the verified index; cached under ``ROOT/layers/erofs/``, and a kept
  one verified and checked again before each mount: :meth:`ErofsLayers.kept_image`) mounted at ``ROOT/layers/lower/<slot>``
  with ``device=`` the layer's FUSE blob file (``ROOT/layers/mnt/blobs/<slot>``); FUSE
  sees only block reads of the blob.
* ``loop``: the same, the image and the blob each behind a read-only loop device
  (kernels with EROFS that refuse a file-backed mount: ENOTBLK).
* ``tree``: the per-file FUSE tree ``ROOT/layers/mnt/<slot>`` (no EROFS).

``auto`` (the default) probes: ``fanotify`` if the kernel has pre-content events, the cache
directory's filesystem takes their marks and a file-backed EROFS mount works, else EROFS listed in ``/proc/filesystems`` (the list is read
from :attr:`DataPathProbe.filesystems`, a test seam: EROFS built into a kernel cannot
be unloaded to test its absence), then a file-backed mount of the image of an empty
layer with an empty blob, made under ``ROOT/layers/`` where the layer images live:
``erofs`` if it mounts, ``loop`` on ENOTBLK, ``tree`` when there is no EROFS or the
probe fails otherwise (the reason is logged).  A forced path the kernel cannot give
is a :class:`DataPathUnavailable`, which the server's CLI refuses start-up with.

:class:`ErofsLayers` owns the EROFS mounts of one server: images, mounts, unmounts,
and the stale mounts a killed server left on ``lower/`` (their device was the dead
FUSE session's blob).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
import trio

from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.erofs_image import build_image, image_cache_name, image_size, write_image
from bootseer.blockstore.datapath.erofs_check import ImageRefused, blob_blocks
from bootseer.blockstore.datapath.image_checker import CheckerProcess, ImageCheck
from bootseer.blockstore.datapath.erofs_mount import ErofsMountError, mount_erofs, unmount_erofs
from bootseer.blockstore.datapath.fanotify import unsupported
from bootseer.blockstore.objects.format import (
    MAX_IMAGE_TABLE_BYTES,
    ChainRecord,
    Entry,
    EntryType,
    FormatError,
    LayerImage,
    LayerIndex,
    sealed_size_bound,
)
from bootseer.blockstore.datapath.tree import LayersRoot
from bootseer.atomic import replacing
from bootseer.log import get_logger

log = get_logger(__name__)

#: What ``--data-path`` takes.
DATA_PATHS = ("auto", "fanotify", "erofs", "loop", "tree")
#: The data paths whose lower dirs are EROFS mounts.
EROFS_PATHS = ("fanotify", "erofs", "loop")
FILESYSTEMS = "/proc/filesystems"

DATA_PATH = prometheus_client.Gauge(
    "bootseer_layer_server_data_path", "1 for the data path this layer server serves layers by", ["path"]
)
IMAGES = prometheus_client.Counter(
    "bootseer_layer_images",
    "EROFS images of layers made ready to mount, by where they came from: store (the converter's, fetched "
    "and checked), cached (on this node already), built (from the index: a conversion without an image), "
    "refused (the store's failed its digest or its check: the layer is not served), kept_refused (one kept on "
    "this node failed its digest or its check before a mount or a restart's restore: removed, fetched again)",
    ["source"],
)
for _source in ("store", "cached", "built", "refused", "kept_refused"):
    IMAGES.labels(_source)


class DataPathUnavailable(Exception):
    """A forced data path this kernel cannot give (the message says why)."""


@dataclass(frozen=True)
class DataPathChoice:
    path: str  #: ``erofs``, ``loop`` or ``tree``
    reason: str  #: why: one phrase for the start-up log line and ``status``


@dataclass(frozen=True)
class DataPathProbe:
    """Chooses the data path of a node whose layer server keeps its files under ``layers``."""

    layers: Path
    filesystems: str = FILESYSTEMS  #: where the kernel's filesystem list is read (a test seam)
    blobs: Path | None = None  #: where local blobs would live (the ``fanotify`` path's probe); None: no such path

    def kernel_has_erofs(self) -> bool:
        with open(self.filesystems, encoding="ascii", errors="replace") as listing:
            return any(line.split()[-1:] == ["erofs"] for line in listing)

    def try_mount(self, blob_directory: Path | None = None) -> str:
        """``file`` or ``loop``: how a mount of an empty layer's image went (its blob in ``blob_directory``,
        read buffered, if given); ErofsMountError if it failed."""
        probe = self.layers / f".data-path-probe-{os.getpid()}"
        shutil.rmtree(probe, ignore_errors=True)
        probe.mkdir(mode=0o700)
        blob = (blob_directory or probe) / f".data-path-probe-blob-{os.getpid()}"
        try:
            empty = LayerIndex("sha256:" + "0" * 64, 4096, [Entry("", EntryType.DIR, 0o755)], [], [])
            (probe / "image").write_bytes(build_image(empty))
            blob.write_bytes(b"")
            (probe / "mnt").mkdir()
            mounted = mount_erofs(probe / "image", probe / "mnt", device=blob, direct=blob_directory is None)
            unmount_erofs(probe / "mnt")
            return mounted.mode
        finally:
            shutil.rmtree(probe, ignore_errors=True)
            blob.unlink(missing_ok=True)

    def fanotify_refused(self) -> str | None:
        """Why the ``fanotify`` path cannot be had here (None: it can): no pre-content events, a cache
        filesystem that refuses their marks, or no file-backed EROFS mount with a blob there."""
        if self.blobs is None:
            return "no local blob directory"
        try:
            self.blobs.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            return f"cannot make {self.blobs}: {exc}"
        why = unsupported(self.blobs)
        if why is not None:
            return why
        try:
            if self.try_mount(self.blobs) != "file":
                return f"the kernel refuses a file-backed EROFS mount with a blob in {self.blobs}"
        except (ErofsMountError, OSError) as exc:
            return f"the EROFS probe mount with a blob in {self.blobs} failed: {exc}"
        return None

    def choose(self, requested: str) -> DataPathChoice:
        """The data path for ``requested`` (one of :data:`DATA_PATHS`); DataPathUnavailable for a forced one this kernel lacks."""
        if requested not in DATA_PATHS:
            raise DataPathUnavailable(f"unknown data path {requested!r} (one of {', '.join(DATA_PATHS)})")
        if requested == "tree":
            return DataPathChoice("tree", "forced")
        try:
            has_erofs = self.kernel_has_erofs()
        except OSError as exc:
            has_erofs, missing = False, f"cannot read {self.filesystems}: {exc.strerror}"
        else:
            missing = f"the kernel has no EROFS (not in {self.filesystems})"
        if not has_erofs:
            if requested == "auto":
                return DataPathChoice("tree", missing)
            raise DataPathUnavailable(f"data path {requested}: {missing}")
        if requested == "loop":
            return DataPathChoice("loop", "forced")
        fanotify_refused = None
        if requested in ("fanotify", "auto"):
            fanotify_refused = self.fanotify_refused()
            if fanotify_refused is None:
                return DataPathChoice("fanotify", "forced" if requested == "fanotify" else
                                      "fanotify pre-content events and a file-backed EROFS mount work")  # fmt: skip
            if requested == "fanotify":
                raise DataPathUnavailable(f"data path fanotify: {fanotify_refused}")
        try:
            mode = self.try_mount()
        except (ErofsMountError, OSError) as exc:
            if requested == "auto":
                return DataPathChoice("tree", f"the EROFS probe mount failed: {exc}")
            raise DataPathUnavailable(f"data path erofs: the EROFS probe mount failed: {exc}") from None
        if mode == "file":
            return DataPathChoice("erofs", "forced" if requested == "erofs" else
                                  f"a file-backed EROFS mount works (no fanotify path: {fanotify_refused})")  # fmt: skip
        if requested == "erofs":
            raise DataPathUnavailable(
                f"data path erofs: the kernel refuses a file-backed EROFS mount of an image under {self.layers} "
                f"(ENOTBLK: kernel before 6.12, or a filesystem without read_folio such as tmpfs); use loop or auto"
            )
        return DataPathChoice("loop", f"file-backed EROFS refused under {self.layers} (ENOTBLK): over loop devices")


def store_image_check(table: LayerImage, record: ChainRecord) -> ImageCheck:
    """What the converter's image of ``record``'s layer is checked against (fetched, or kept): the blob size
    and block size its table names, and the record's entries."""
    return ImageCheck(table.blob_size, table.block_size, record.files)


def announce(choice: DataPathChoice) -> None:
    """The start-up log line and the gauge of the chosen data path."""
    for path in EROFS_PATHS + ("tree",):  # fanotify, erofs, loop, tree
        DATA_PATH.labels(path).set(1 if path == choice.path else 0)
    log.info("data path chosen", data_path=choice.path, reason=choice.reason)


class ErofsLayers:
    """The EROFS mounts of one layer server: one image and one mount per served layer.

    Images are cached as ``ROOT/layers/erofs/<image_cache_name(index)>`` (one per index,
    shared by the layers that have it), mounts are at ``ROOT/layers/lower/<slot>``.
    Every mount and unmount runs in a worker thread: mounting on a FUSE blob makes
    FUSE requests that the server's own trio thread answers.
    """

    def __init__(self, paths: ServerPaths, path: str, threads: trio.CapacityLimiter) -> None:
        if path not in EROFS_PATHS:
            raise ValueError(f"not an EROFS data path: {path!r}")
        self.paths = paths
        self.path = path
        self.images = paths.erofs_images
        self.lowers = paths.erofs_lowers
        self._threads = threads  #: the server's decode limiter: image builds are O(entries)
        #: Where store images are checked (a process of its own, started by :meth:`prepare`).
        self.checker = CheckerProcess()

    def lower_dir(self, slot: int) -> str:
        return self.paths.lower_dir(slot, self.path)

    def image_path(self, index_name: str) -> Path:
        """Where the image a node builds from index ``index_name`` is cached."""
        return self.images / image_cache_name(index_name)

    def store_image_path(self, image_name: str) -> Path:
        """Where the converter's image of table ``image_name`` is kept once verified and checked (a name
        no build has: the two never stand for each other)."""
        if len(image_name) != 64 or image_name.strip("0123456789abcdef"):
            raise ValueError(f"image name is not 64 hex digits: {image_name!r}")
        return self.images / f"{image_name}.erofs-store"

    def store_table_path(self, image_name: str) -> Path:
        """Where the local copy of the store's image table ``image_name`` is kept while its image is: the
        store's object byte for byte, beside the layers' index copies (``ROOT/layers/indexes/``), verified
        by its name (the SHA-256 a chain record names it by) when it is read, as the store's object is."""
        self.store_image_path(image_name)  # the same name, the same check
        return self.paths.indexes / f"{image_name}.image-table"

    def install_image(self, image_name: str, sha256: str, pieces: Sequence[bytes], check: ImageCheck | None,
                      *, table: bytes) -> Path:  # fmt: skip
        """Keep the converter's image ``image_name`` made of ``pieces`` (verified blocks of its table) once
        its bytes hash to ``sha256`` and, unless ``check`` is None (its record is signed by a trusted
        converter), the bounded check accepted the file written (in the checker process:
        :mod:`~bootseer.blockstore.datapath.image_checker`) before it is renamed into place; else
        ImageRefused naming why, and nothing is kept.  ``table`` (the table object's bytes, which hash to
        ``image_name``) is kept first, at :meth:`store_table_path`: what :meth:`kept_image` verifies the
        kept image against before a later mount.  Blocking: run it in a worker thread."""
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)
        if digest.hexdigest() != sha256:
            raise ImageRefused(f"the image's bytes do not hash to the sha256 its table names ({sha256[:12]}...)")

        def checked(written: Path) -> None:
            if check is not None:
                try:
                    self.checker.check(written, check)
                except ImageRefused as exc:
                    raise ImageRefused(f"the image fails its check: {exc}") from None

        path = self.store_image_path(image_name)
        with replacing(self.store_table_path(image_name), durable=False) as out:  # a cache, as the image is
            out.write(table)
        with replacing(path, durable=False, before_rename=checked) as out:  # a cache: a lost image is fetched again
            out.writelines(pieces)
        return path

    def kept_image(self, record: ChainRecord, *, check: bool) -> Path | None:
        """The converter's image of ``record``'s layer kept on this node, verified again before it is mounted:
        the local copy of its table must hash to ``record.image`` (:meth:`LayerImage.decode`: so the SHA-256
        it names is the one the trusted record names, whatever was edited on this node), the image must be
        the table's size and hash to the table's SHA-256 and, with ``check`` (no trusted converter signed
        ``record``), the bounded check must accept it (in the checker process).  None if no image is kept;
        ImageRefused naming why, once the image and its table copy are removed (the caller fetches it
        again).  Blocking (one read of the image, then its check): run it in a worker thread."""
        path = self.store_image_path(record.image)
        try:
            image = open(path, "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:  # a directory in its place, say: nothing to remove, and nothing mounted
            raise ImageRefused(f"it cannot be opened: {exc}") from None
        kept = os.fstat(image.fileno())
        try:
            with image:
                table = self._kept_table(record)
                size = kept.st_size
                if size != table.size:
                    raise ImageRefused(f"it is {size} bytes, its table's {table.size}")
                if hashlib.file_digest(image, "sha256").hexdigest() != table.sha256:
                    raise ImageRefused(f"its bytes do not hash to the sha256 its table names ({table.sha256[:12]}...)")
            if check:
                try:
                    self.checker.check(path, store_image_check(table, record))
                except ImageRefused as exc:
                    raise ImageRefused(f"it fails its check: {exc}") from None
        except ImageRefused:
            self._remove_refused(record.image, kept)
            raise
        except OSError as exc:  # EIO, say: whatever it holds, it is not mounted
            self._remove_refused(record.image, kept)
            raise ImageRefused(f"it cannot be read: {exc}") from None
        return path

    def _remove_refused(self, image_name: str, refused: os.stat_result) -> None:
        """Remove the kept image ``image_name`` and its table copy if the image is still the file ``refused``
        (not one a fresh fetch put in its place meanwhile)."""
        try:
            now = self.store_image_path(image_name).stat()
        except FileNotFoundError:
            return
        if (now.st_dev, now.st_ino) == (refused.st_dev, refused.st_ino):
            self.remove_image("", image_name)

    def _kept_table(self, record: ChainRecord) -> LayerImage:
        """The local copy of ``record``'s image table, verified against ``record.image``; ImageRefused if it is
        missing (an image kept by a server before tables were kept) or refused."""
        bound = sealed_size_bound(MAX_IMAGE_TABLE_BYTES)
        try:
            with open(self.store_table_path(record.image), "rb") as copy:
                data = copy.read(bound + 1)  # more than the bound: refused by the decode, unread past it
        except FileNotFoundError:
            raise ImageRefused("its table's local copy is missing") from None
        try:
            return LayerImage.decode(data, record=record)
        except FormatError as exc:
            raise ImageRefused(f"its table's local copy is refused: {exc}") from None

    def prepare(self, *, keep_mounts: bool = False) -> None:
        """Create the directories, start the image checker, remove half-written images, and lazily unmount
        every mount on ``lower/`` (a killed server's: their blob device was its FUSE session, now dead),
        unless ``keep_mounts``: on ``fanotify`` with the event holder up, those mounts read local blobs
        still marked in the group that outlived the server, and the restored layers take them over."""
        for directory in (self.images, self.lowers, self.paths.indexes):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.checker.start()
        for stale in self.images.glob(".*.tmp"):  # bootseer.atomic.replacing's temp names
            stale.unlink(missing_ok=True)
        for stale in self.paths.indexes.glob(".*.image-table.*.tmp"):  # the table copies' (store_table_path)
            stale.unlink(missing_ok=True)
        if keep_mounts:
            return
        for lower in self.lowers.iterdir():
            while os.path.ismount(lower):
                log.warning("unmounting a stale EROFS mount left by a server that is gone", lower_dir=str(lower))
                unmount_erofs(lower, lazy=True)

    def cached(self, path: Path) -> bool:
        """Whether ``path`` (a :meth:`store_image_path`) is on this node already (not whether it is still right:
        :meth:`kept_image` verifies it again before it is mounted)."""
        return path.is_file()

    def blob_size_of(self, path: Path) -> int:
        """The blob size the kept image ``path`` addresses (its device table, which its check held it to)."""
        with open(path, "rb") as image:
            return blob_blocks(image.read(2048)) * 4096

    def ensure_image(self, index: LayerIndex, index_name: str) -> Path:
        """The cached image of ``index``, built (temp name + rename) if missing or of the wrong size."""
        path = self.image_path(index_name)
        try:
            cached = path.stat().st_size
        except FileNotFoundError:
            pass  # the usual case on a fresh node: no layout pass only to learn the size
        else:
            if cached == image_size(index):
                return path
            log.warning("cached EROFS image has the wrong size; building it again", image=str(path))
        with replacing(path, durable=False) as out:  # a cache: a lost image is built again
            write_image(index, out)
        return path

    def mounted(self, slot: int) -> bool:
        """Whether the layer in ``slot`` has its EROFS mount (one a server before this one made, on ``fanotify``)."""
        return os.path.ismount(self.lower_dir(slot))

    def _mount(self, slot: int, image: Path, device: Path | None = None) -> str:
        lower = Path(self.lower_dir(slot))
        lower.mkdir(exist_ok=True, mode=0o755)
        while os.path.ismount(lower):  # left by an earlier mount of this slot that failed half-way
            unmount_erofs(lower, lazy=True)
        blob = device or self.paths.blob(slot)
        # The read-ahead the FUSE tree has (LayersRoot.read_ahead_kb): fewer, larger blob reads.
        # A local blob (fanotify) is read buffered: its fills are in its page cache, read from there.
        mount_erofs(image, lower, device=blob, loop=self.path == "loop", read_ahead_kb=LayersRoot.read_ahead_kb,
                    direct=device is None)  # fmt: skip
        return str(lower)

    async def mount(self, slot: int, image: Path, device: Path | None = None) -> str:
        """Mount ``image`` as the layer in ``slot`` over its blob (the FUSE one, served already, or the
        local ``device``, marked already); its lower dir."""
        return await trio.to_thread.run_sync(self._mount, slot, image, device)

    def _unmount(self, slot: int) -> bool:
        lower = self.lower_dir(slot)
        if not os.path.ismount(lower):
            return False
        try:
            unmount_erofs(lower)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            log.warning("EROFS mount is busy; detaching it lazily (it goes when its last user does)", lower_dir=lower)
            unmount_erofs(lower, lazy=True)
            return True
        return False

    async def unmount(self, slot: int) -> bool:
        """Unmount the layer in ``slot`` (lazily if it is busy: True); nothing if it is not mounted."""
        return await trio.to_thread.run_sync(self._unmount, slot)

    def remove_image(self, index_name: str, image_name: str = "") -> None:
        """Remove the images of a layer no longer served: built from ``index_name`` (none if it is ""), and the
        store's ``image_name`` with its table copy."""
        if index_name:
            self.image_path(index_name).unlink(missing_ok=True)
        if image_name:
            self.store_image_path(image_name).unlink(missing_ok=True)
            self.store_table_path(image_name).unlink(missing_ok=True)

    def _detach_all(self) -> None:
        for lower in self.lowers.iterdir():
            while os.path.ismount(lower):
                unmount_erofs(lower, lazy=True)
                log.info("detached EROFS mount", lower_dir=str(lower))

    async def detach_all(self, *, keep_mounts: bool = False) -> None:
        """Lazily unmount every EROFS mount (before the FUSE mount their blobs are on goes), unless
        ``keep_mounts`` (``fanotify``: they read local blobs, and the next server takes them over), and
        stop the image checker: the server is stopping."""
        if not keep_mounts:
            await trio.to_thread.run_sync(self._detach_all)
        self.checker.close()


__all__ = [
    "DATA_PATHS",
    "DataPathChoice",
    "DataPathProbe",
    "DataPathUnavailable",
    "EROFS_PATHS",
    "ErofsLayers",
    "IMAGES",
    "announce",
    "store_image_check",
]
