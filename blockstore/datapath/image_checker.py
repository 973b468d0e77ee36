"""The bounded check of a store's EROFS image, run in a process of its own beside the layer server.

:func:`~bootseer.blockstore.datapath.erofs_check.check_image` parses hostile bytes in pure
Python, one pass over the image: on the torch layer of the benchmark image about as much CPU
as decoding the layer's index, which a mount needs at the same time.  In the layer server's
own process the two would take turns on the GIL; in a process of their own they run on two
cores, so a mount waits for the longer of the two instead of their sum.  The process also
keeps the parse of a hostile image away from the server's memory: a checker that crashed or
hangs costs that image (refused) and a fresh checker, never the server.

:class:`CheckerProcess` keeps one worker: this module run as
``python -P -m bootseer.blockstore.datapath.image_checker --parent PID`` (a plain child process,
no ``multiprocessing``: no resource tracker, no copy of the server's threads or FUSE session;
``-P``: a ``bootseer/`` folder in the working directory never shadows the installed package).
It is started with the server, so that the first mount does not wait for an interpreter to
start, and it speaks a small protocol on its standard input and output (below).  It exits when
its standard input ends (the server closed it, or died) and, since it does not read its input
during a check, when its parent changes (checked every :data:`PARENT_POLL_S`): the worker never
outlives its server, SIGKILLed or not.

* A worker found dead before a check started (it died while idle) is replaced, and the check
  runs on the fresh worker: the image is not at fault.
* A worker that dies during a check refuses that image (it may be a hostile image's doing) and
  is replaced for the next check.
* A check that runs past the deadline (:data:`CHECK_DEADLINE`) refuses the image; the worker
  is killed and replaced.

Its calls block (callers run them in worker threads) and are thread-safe: the calls of several
threads take turns on the one worker.

The protocol: the worker writes ``R`` once its imports are done.  A request is a 4-byte
big-endian length and a JSON object (``{"op": "check" | "addressed", "path", "blob_size",
"chunk_size", "max_inodes"}``); the worker answers ``S`` as it starts the check, then ``A``, a
4-byte length and a JSON object: ``{"summary": {...}}`` (:class:`ImageSummary`'s fields),
``{"chunks": [...]}``, ``{"refused": "why"}`` or ``{"oserror": [errno, "words"]}`` (the image file
could not be read: the node's disk, not the image; raised as OSError).  JSON, never pickle: the
server decodes nothing from the worker that could run code, whatever a hostile image did to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bootseer.blockstore.datapath.erofs_check import ImageRefused, ImageSummary, addressed_chunks, check_image
from bootseer.log import get_logger

log = get_logger(__name__)

#: A check taking longer than this is given up (the image refused, the checker replaced). The
#: check is linear in the image (at most 1 GiB): seconds at worst on a loaded node.
CHECK_DEADLINE = 120.0

#: How often a worker checks that its parent (the layer server) is still the one that started it.
PARENT_POLL_S = 0.5

#: The largest request or answer frame either side accepts (an image's addressed chunks: a few MiB of JSON).
MAX_FRAME = 1 << 30

#: What the worker runs (``python -P -m WORKER_MODULE --parent PID``): this module.
WORKER_MODULE = "bootseer.blockstore.datapath.image_checker"

_READY, _STARTED, _ANSWER = b"R", b"S", b"A"
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class ImageCheck:
    """What a store's image is checked against before a mount: the layer's blob size and chunk size,
    and how many inodes it may have (the layer's entries)."""

    blob_size: int
    chunk_size: int
    max_inodes: int


class CheckerUnavailable(RuntimeError):
    """The worker process could not be started (it exited or stayed silent instead of becoming ready)."""


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


def _frame(document: dict[str, Any]) -> bytes:
    body = json.dumps(document, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


class _Overdue(Exception):
    """The worker did not answer before the deadline."""


class _Worker:
    """One worker process and the reading end of its answers."""

    def __init__(self) -> None:
        argv = [sys.executable, "-P", "-m", WORKER_MODULE, "--parent", str(os.getpid())]
        # Its standard error is the server's (its log); close_fds: it holds none of the server's files.
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._input = self.process.stdin
        self._output = self.process.stdout.fileno()
        self.ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> bool:
        return self.process.poll() is not None

    def read(self, size: int, deadline: float) -> bytes | None:
        """``size`` bytes of the worker's answers; None if they end first (the worker exited); _Overdue once
        ``deadline`` (``time.monotonic()``) passes."""
        data = bytearray()
        poller = select.poll()
        poller.register(self._output, select.POLLIN)
        while len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise _Overdue
            chunk = os.read(self._output, size - len(data))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    def wait_ready(self, deadline: float) -> None:
        """Return once the worker has started (its imports done); CheckerUnavailable if it exits or is silent
        until ``deadline``."""
        if self.ready:
            return
        try:
            mark = self.read(1, deadline)
        except _Overdue:
            self.kill()
            raise CheckerUnavailable("the checker process did not start in time") from None
        if mark != _READY:
            self.kill()
            raise CheckerUnavailable(f"the checker process exited as it started (status {self.process.returncode})")
        self.ready = True

    def send(self, request: dict[str, Any]) -> bool:
        """Write ``request``; False if the worker is gone (its input closed)."""
        try:
            self._input.write(_frame(request))
            return True
        except (BrokenPipeError, ValueError):  # ValueError: the pipe was closed here (close())
            return False

    def stop(self) -> None:
        """End the worker now and reap it (whatever it was doing); its pipes stay open (a call may be reading)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()

    def kill(self) -> None:
        """End the worker now, reap it and close its pipes (only by the thread holding the calls' lock)."""
        self.stop()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


class CheckerProcess:
    """One worker process that runs :func:`check_image` (see the module's docstring)."""

    def __init__(self, deadline: float = CHECK_DEADLINE) -> None:
        self.deadline = deadline
        self._calls = threading.Lock()  #: held for a whole call: the calls take turns on the one worker
        self._state = threading.Lock()  #: guards _worker and _closed (close() does not wait for a call)
        self._worker: _Worker | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The process ID of the current worker, None if there is none (not started, closed, or replaced
        lazily at the next call)."""
        with self._state:
            return self._worker.pid if self._worker is not None else None

    def start(self) -> None:
        """Start the worker now (its interpreter and imports) and wait until it is ready, so that a mount does
        not wait for them; CheckerUnavailable if it cannot start.  Starts a closed checker again."""
        with self._calls:
            with self._state:
                self._closed = False
            self._ready_worker()

    def _ready_worker(self) -> _Worker:
        """The live worker, ready (a dead one replaced); called holding ``_calls``."""
        with self._state:
            if self._closed:
                raise CheckerUnavailable("the checker is closed")
            worker = self._worker
            if worker is not None and worker.exited():
                log.warning("the EROFS image checker had died while idle; a new one takes over",
                            pid=worker.pid, status=worker.process.returncode)  # fmt: skip
                worker.kill()  # reaps it, closes its pipes
                worker = self._worker = None
            if worker is None:
                worker = self._worker = _Worker()
        try:
            worker.wait_ready(time.monotonic() + max(self.deadline, 10.0))  # an interpreter's start, not a check
        except CheckerUnavailable:
            self._drop(worker)
            raise
        return worker

    def _drop(self, worker: _Worker) -> None:
        """Kill ``worker`` and forget it: the next call starts a fresh one."""
        with self._state:
            if self._worker is worker:
                self._worker = None
        worker.kill()

    def check(self, image: Path, check: ImageCheck) -> ImageSummary:
        """:func:`check_image` of the image file ``image`` in the worker (:func:`check_file`); ImageRefused if
        it refuses the image, or the worker crashes or runs past the deadline on it (then a new worker takes
        the next check), or no worker can be started; OSError if the worker cannot read ``image``.  Nothing may
        write to ``image`` meanwhile."""
        return self._call("check", image, check, lambda answer: ImageSummary(**answer["summary"]))

    def addressed(self, image: Path, check: ImageCheck) -> list[int]:
        """The chunks of the blob that the files of image ``image`` address (:func:`addressed_file`), in the
        worker: a parse of the whole image, kept off the layer server's interpreter lock.  As :meth:`check`."""
        return self._call("addressed", image, check, lambda answer: [int(chunk) for chunk in answer["chunks"]])

    def _call(self, op: str, image: Path, check: ImageCheck, decode: Callable[[dict[str, Any]], Any]) -> Any:
        request = {"op": op, "path": os.fspath(image), "blob_size": check.blob_size, "chunk_size": check.chunk_size,
                   "max_inodes": check.max_inodes}  # fmt: skip
        with self._calls:
            for attempt in (1, 2):  # a worker found dead before the check started: once more on a fresh one
                try:
                    worker = self._ready_worker()
                except CheckerUnavailable as exc:
                    raise ImageRefused(f"no checker process to check it ({exc})") from None
                deadline = time.monotonic() + self.deadline
                try:
                    started = worker.send(request) and worker.read(1, deadline) == _STARTED
                    if not started:
                        self._drop(worker)
                        if attempt == 1:
                            log.warning("the EROFS image checker was gone before the check started; a new one runs it")
                            continue
                        raise ImageRefused("the checker process died before the check started, twice") from None
                    answer = self._answer(worker, deadline)
                except _Overdue:
                    self._drop(worker)
                    log.error("the EROFS image check ran past its deadline; the checker is replaced", deadline_s=self.deadline)
                    raise ImageRefused(f"its check took longer than {self.deadline:g}s") from None
                if answer is None:
                    self._drop(worker)
                    if self._is_closed():
                        raise ImageRefused("the checker was stopped during the check") from None
                    log.error("the EROFS image checker died during a check; it is replaced", image=os.fspath(image))
                    raise ImageRefused("the checker process died on it") from None
                if "refused" in answer:
                    raise ImageRefused(str(answer["refused"]))
                try:
                    if "oserror" in answer:
                        number, words = answer["oserror"]
                        failure = OSError(int(number), str(words), os.fspath(image))
                    else:
                        return decode(answer)
                except (KeyError, TypeError, ValueError) as exc:
                    self._drop(worker)
                    raise ImageRefused(f"the checker's answer is malformed ({type(exc).__name__})") from None
                raise failure
        raise AssertionError("unreachable")

    def _answer(self, worker: _Worker, deadline: float) -> dict[str, Any] | None:
        """The worker's answer to the check it started; None if it exited first (or answered garbage)."""
        head = worker.read(1 + _LENGTH.size, deadline)
        if head is None or head[:1] != _ANSWER:
            return None
        (length,) = _LENGTH.unpack(head[1:])
        if length > MAX_FRAME:
            return None
        body = worker.read(length, deadline)
        if body is None:
            return None
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def _is_closed(self) -> bool:
        with self._state:
            return self._closed

    def close(self) -> None:
        """Stop the worker now, without waiting for a call in progress (its check is abandoned: it fails with
        ImageRefused); later calls fail with ImageRefused until :meth:`start`."""
        with self._state:
            worker, self._worker = self._worker, None
            self._closed = True
        if worker is None:
            return
        worker.stop()  # a call reading its answers sees them end, and closes its pipes
        if self._calls.acquire(blocking=False):  # no call in progress: close them here
            try:
                worker.kill()
            finally:
                self._calls.release()


# -- the worker process ---------------------------------------------------------------------------

_OPERATIONS: dict[str, Callable[[str, int, int, int], Any]] = {"check": check_file, "addressed": addressed_file}


def _watch_parent(parent: int) -> None:
    """Exit the process once its parent is no longer ``parent`` (it died; the worker was re-parented)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _run(request: dict[str, Any]) -> dict[str, Any]:
    try:
        result = _OPERATIONS[request["op"]](str(request["path"]), int(request["blob_size"]),
                                            int(request["chunk_size"]), int(request["max_inodes"]))  # fmt: skip
    except ImageRefused as exc:
        return {"refused": str(exc)}
    except OSError as exc:  # the node's disk, not the image: the caller gets the OSError, as if it read the file
        return {"oserror": [exc.errno or 0, exc.strerror or str(exc)]}
    if isinstance(result, ImageSummary):
        return {"summary": dataclasses.asdict(result)}
    return {"chunks": result}


def _serve(parent: int) -> None:
    """The worker: answer requests on standard input until it ends or the parent changes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the server's to act on; it closes us
    threading.Thread(target=_watch_parent, args=(parent,), name="parent watch", daemon=True).start()
    answers = os.dup(1)
    os.dup2(2, 1)  # whatever prints goes to the server's log, never into the answers
    _write_all(answers, _READY)
    while True:
        head = _read_exactly(0, _LENGTH.size)
        if head is None:
            return  # the server closed our input, or died
        (length,) = _LENGTH.unpack(head)
        body = _read_exactly(0, length) if length <= MAX_FRAME else None
        if body is None:
            return
        _write_all(answers, _STARTED)
        answer = _frame(_run(json.loads(body)))
        _write_all(answers, _ANSWER + answer)


def main(argv: list[str] | None = None) -> None:
    """``python -P -m bootseer.blockstore.datapath.image_checker --parent PID``: the worker of a CheckerProcess."""
    import argparse

    parser = argparse.ArgumentParser(prog="image_checker", description=main.__doc__)
    parser.add_argument("--parent", type=int, required=True, help="the process ID of the server: exit once it is gone")
    args = parser.parse_args(argv)
    _serve(args.parent)


__all__ = ["CHECK_DEADLINE", "WORKER_MODULE", "CheckerProcess", "CheckerUnavailable", "ImageCheck", "addressed_file",
           "check_file"]


if __name__ == "__main__":
    main()
