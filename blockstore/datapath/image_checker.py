"""The bounded check of a store's EROFS image, run in a process of its own beside the layer server.

:func:`~bootseer.blockstore.datapath.erofs_check.check_image` parses hostile bytes in pure
Python, one pass over the image: on the torch layer of the benchmark image about as much CPU
as decoding the layer's index, which a mount needs at the same time.  In the layer server's
own process the two would take turns on the GIL; in a process of their own they run on two
cores, so a mount waits for the longer of the two instead of their sum.  The process also
keeps the parse of a hostile image away from the server's memory: a checker that crashed or
hangs costs that image (refused) and a fresh checker, never the server.

:class:`CheckerProcess` keeps one worker process (``spawn``: no copy of the server's threads
or FUSE session), started with the server so that the first mount does not wait for an
interpreter to start, and restarted after a crash or a check that ran past its deadline.
Its calls block: callers run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bootseer.blockstore.datapath.erofs_check import ImageRefused, ImageSummary, addressed_chunks, check_image
from bootseer.log import get_logger

log = get_logger(__name__)

#: A check taking longer than this is given up (the image refused, the checker replaced). The
#: check is linear in the image (at most 1 GiB): seconds at worst on a loaded node.
CHECK_DEADLINE = 120.0


@dataclass(frozen=True)
class ImageCheck:
    """What a store's image is checked against before a mount: the layer's blob size and chunk size,
    and how many inodes it may have (the layer's entries)."""

    blob_size: int
    chunk_size: int
    max_inodes: int


def check_file(path: str, blob_size: int, chunk_size: int, max_inodes: int) -> ImageSummary:
    """:func:`check_image` of the image file at ``path``, mapped read-only (what the worker runs: the
    image's bytes are never copied through a pipe).  Whatever goes wrong is an ImageRefused."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if not size:
            raise ImageRefused("the image is empty")
        mapped = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ)
        try:
            try:
                return check_image(memoryview(mapped), blob_size=blob_size, chunk_size=chunk_size, max_inodes=max_inodes)
            except ImageRefused as exc:
                refusal = str(exc)  # not the exception: its frames hold views of the mapping
            except Exception as exc:  # a checker bug is a refusal, never a mounted image
                refusal = f"the check failed ({type(exc).__name__}: {exc})"
            raise ImageRefused(refusal)
        finally:
            with contextlib.suppress(BufferError):  # a view still held: the mapping goes with its last view
                mapped.close()


def addressed_file(path: str, blob_size: int, chunk_size: int, max_inodes: int) -> list[int]:
    """:func:`~bootseer.blockstore.datapath.erofs_check.addressed_chunks` of the image file at ``path`` (an image
    checked already), mapped read-only; sorted.  Whatever goes wrong is an ImageRefused."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), os.fstat(file.fileno()).st_size, prot=mmap.PROT_READ)
        try:
            try:
                return sorted(addressed_chunks(memoryview(mapped), blob_size=blob_size, chunk_size=chunk_size,
                                               max_inodes=max_inodes))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - its frames hold views of the mapping: keep only the words
                refusal = f"{type(exc).__name__}: {exc}"
            raise ImageRefused(refusal)
        finally:
            with contextlib.suppress(BufferError):
                mapped.close()


class CheckerProcess:
    """One worker process that runs :func:`check_image` (see the module's docstring)."""

    def __init__(self, deadline: float = CHECK_DEADLINE) -> None:
        self.deadline = deadline
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    def start(self) -> None:
        """Start the worker now (its interpreter and imports), so that a mount does not wait for them."""
        self._executor().submit(int).result(timeout=self.deadline)

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        for process in list(getattr(pool, "_processes", {}).values()):  # a hung check: end it
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def check(self, image: Path, check: ImageCheck) -> ImageSummary:
        """:func:`check_image` of the image file ``image`` in the worker (:func:`check_file`); ImageRefused if
        it refuses the image, or the worker crashes or runs past the deadline on it (then a new worker takes
        the next check).  Nothing may write to ``image`` meanwhile."""
        return self._call(check_file, image, check)

    def addressed(self, image: Path, check: ImageCheck) -> list[int]:
        """The chunks of the blob that the files of image ``image`` address (:func:`addressed_file`), in the
        worker: a parse of the whole image, kept off the layer server's interpreter lock.  As :meth:`check`."""
        return self._call(addressed_file, image, check)

    def _call(self, function: Any, image: Path, check: ImageCheck) -> Any:
        pool = self._executor()
        future = pool.submit(function, str(image), check.blob_size, check.chunk_size, check.max_inodes)
        try:
            return future.result(timeout=self.deadline)
        except FutureTimeout:
            self._replace(pool)
            log.error("the EROFS image check ran past its deadline; the checker is replaced", deadline_s=self.deadline)
            raise ImageRefused(f"its check took longer than {self.deadline:g}s") from None
        except BrokenProcessPool:
            self._replace(pool)
            log.error("the EROFS image checker died; it is replaced")
            raise ImageRefused("the checker process died on it") from None

    def close(self) -> None:
        """Stop the worker (a check in progress is abandoned)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["CHECK_DEADLINE", "CheckerProcess", "ImageCheck", "addressed_file", "check_file"]
