"""Start-up profile events: the one event model, the per-node spool, and the emitting API.

Every BootSeer process that takes part in a job's start (the snapshotter daemon, the layer
server, ``bootseer rpull``, the checkpoint mount, ``bootseer profile run``, a job's own Python
code) writes :class:`Event` records as JSON lines to the node's *spool*, a directory (by
default ``ROOT/profile`` under the snapshotter's root). ``bootseer profile collect`` reads the
spool back into one trace per node and job.

Off by default and free when off: every emitting function starts with a test of the module
global ``_spool`` and returns; nothing is imported, opened or formatted. Profiling is switched
on for a process by the environment, read once at import:

* ``BOOTSEER_PROFILE=/abs/dir``: events go to that spool directory;
* ``BOOTSEER_PROFILE=1`` (or ``on``): events go to ``ROOT/profile`` of the snapshotter root the
  process serves, once it calls :func:`use_root` (the daemon and the layer server do); the
  resolved directory is put back into the environment, so the layer server and other children
  inherit it;
* ``BOOTSEER_JOB=ID`` tags events with a job; ``BOOTSEER_NODE`` overrides the host name.

When on, an event costs one ``json.dumps`` and one ``write(2)`` on an ``O_APPEND`` file of the
process's own (``events-<pid>.jsonl``; one write per line, so lines of concurrent threads never
mix). A file is rotated at :data:`FILE_LIMIT` bytes (one previous generation kept) and a
spool is pruned, oldest files first, to :data:`SPOOL_LIMIT` bytes when a process opens it, so a
spool stays bounded however long a node runs.

This module imports only the standard library, so ``bootseer.profile.mark`` works in any job.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from bootseer import confined

#: Version of the event record; readers refuse other versions.
EVENT_VERSION = 1
#: Kinds of event, as in Chrome's trace format: a complete span, an instant, a counter sample.
KINDS = ("span", "instant", "counter")
#: The start-up phases a report breaks a start into, in order.
PHASES = ("image", "container", "dependencies", "checkpoint", "import", "first_step")
#: A spool file is rotated at this size; a process keeps at most two (the current and one before).
FILE_LIMIT = 8 << 20
#: A spool is pruned to this many bytes (oldest files first) when a process opens it.
SPOOL_LIMIT = 64 << 20
#: Mark names: what a file name and a shell word can carry without quoting.
MARK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: At most this many marks are read from one marks directory (the container writes it: bound the work).
MAX_MARKS = 1024
#: The directory a container started through the snapshotter sees at its root (see hooks.py).
CONTAINER_MARKS_DIR = "/.bootseer"
ENV_PROFILE = "BOOTSEER_PROFILE"
ENV_JOB = "BOOTSEER_JOB"
ENV_NODE = "BOOTSEER_NODE"
ENV_MARKS = "BOOTSEER_MARKS"

F = TypeVar("F", bound=Callable[..., Any])


class EventError(ValueError):
    """An event record that is not one: the message names the field."""


@dataclass(frozen=True)
class Event:
    """One thing that happened during a start, on one node.

    ``start`` is Unix time in seconds; ``end`` is set for spans (``end >= start``). Counters
    carry the sampled cumulative ``value`` (bytes fetched so far, say). ``bytes`` is what a
    span moved, when it moved any.
    """

    name: str  #: dotted, component first: ``image.pull``, ``task.start``, ``mark.first_step``
    kind: str  #: one of :data:`KINDS`
    start: float
    end: float | None = None
    phase: str = ""  #: one of :data:`PHASES`, or "" (shown, not counted in a phase)
    node: str = ""
    job: str = ""
    pid: int = 0
    bytes: int = 0
    value: float | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return (self.end - self.start) if self.end is not None else 0.0

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"v": EVENT_VERSION, "name": self.name, "kind": self.kind, "start": self.start}
        for key in ("end", "value"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
        for key in ("phase", "node", "job", "pid", "bytes"):
            if getattr(self, key):
                record[key] = getattr(self, key)
        if self.attrs:
            record["attrs"] = self.attrs
        return record

    @classmethod
    def from_json(cls, record: object) -> "Event":
        """The event a spool line or trace entry describes; :class:`EventError` says what is wrong."""
        if not isinstance(record, dict):
            raise EventError("an event is a JSON object")
        if record.get("v") != EVENT_VERSION:
            raise EventError(f"event version {record.get('v')!r}, this BootSeer reads {EVENT_VERSION}")

        def typed(key: str, types: tuple[type, ...], default: Any) -> Any:
            value = record.get(key, default)
            if value is not default and (not isinstance(value, types) or isinstance(value, bool)):
                raise EventError(f"event field {key!r} must be {'/'.join(t.__name__ for t in types)}, not {value!r}")
            return value

        name = typed("name", (str,), None)
        if not name:
            raise EventError("event has no name")
        kind = typed("kind", (str,), None)
        if kind not in KINDS:
            raise EventError(f"event {name}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
        start = typed("start", (int, float), None)
        if start is None:
            raise EventError(f"event {name}: no start time")
        end = typed("end", (int, float), None)
        if kind == "span" and (end is None or end < start):
            raise EventError(f"event {name}: a span needs an end at or after its start")
        phase = typed("phase", (str,), "")
        if phase and phase not in PHASES:
            raise EventError(f"event {name}: unknown phase {phase!r}")
        attrs = typed("attrs", (dict,), {})
        return cls(name=name, kind=kind, start=float(start), end=None if end is None else float(end), phase=phase,
                   node=typed("node", (str,), ""), job=typed("job", (str,), ""), pid=typed("pid", (int,), 0),
                   bytes=typed("bytes", (int,), 0), value=typed("value", (int, float), None), attrs=dict(attrs))


# --------------------------------------------------------------------------- the spool


class Spool:
    """This process's writer into a spool directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], *, file_limit: int = FILE_LIMIT,
                 spool_limit: int = SPOOL_LIMIT) -> None:
        self.directory = Path(directory)
        self.file_limit = file_limit
        self.node = os.environ.get(ENV_NODE) or socket.gethostname()
        self.job = os.environ.get(ENV_JOB, "")
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self._written = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        prune(self.directory, spool_limit)

    @property
    def path(self) -> Path:
        return self.directory / f"events-{os.getpid()}.jsonl"

    def _open(self) -> int:
        # After a fork the child writes a file of its own (its pid's), never its parent's.
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._pid = os.getpid()
            self._written = os.fstat(self._fd).st_size
        return self._fd

    def write(self, event: Event) -> None:
        line = (json.dumps(event.to_json(), separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            fd = self._open()
            if self._written + len(line) > self.file_limit:
                os.close(fd)
                self._fd = None
                os.replace(self.path, self.directory / f"events-{os.getpid()}.1.jsonl")
                fd = self._open()
            os.write(fd, line)
            self._written += len(line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None


def prune(directory: Path, limit: int) -> None:
    """Remove the oldest spool files until the spool holds at most ``limit`` bytes."""
    files = []
    for path in directory.glob("events-*.jsonl"):
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= limit:
            break
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        total -= size


def read_spool(directory: str | os.PathLike[str]) -> tuple[list[Event], list[str]]:
    """Every event in a spool, in time order, and a description of each line that was not one."""
    events: list[Event] = []
    problems: list[str] = []
    for path in sorted(Path(directory).glob("events-*.jsonl")):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # pruned meanwhile
            continue
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                events.append(Event.from_json(json.loads(line)))
            except (ValueError, EventError) as exc:  # a torn last line of a killed process, a foreign file
                problems.append(f"{path.name}:{number}: {exc}")
    events.sort(key=lambda e: (e.start, e.end or e.start))
    return events, problems


# --------------------------------------------------------------------------- on and off

_spool: Spool | None = None
_wants_root = False


def _from_environment() -> None:
    global _spool, _wants_root
    setting = os.environ.get(ENV_PROFILE, "")
    if setting in ("1", "on", "true", "yes"):
        _wants_root = True
    elif setting.startswith("/"):
        try:
            _spool = Spool(setting)
        except OSError:  # a profiler must never stop what it watches
            _spool = None


def enabled() -> bool:
    """Whether this process records events."""
    return _spool is not None


def enable(directory: str | os.PathLike[str]) -> Spool:
    """Record this process's events into the spool ``directory`` (and its children's: exported)."""
    global _spool
    _spool = Spool(directory)
    os.environ[ENV_PROFILE] = str(_spool.directory.absolute())
    return _spool


def disable() -> None:
    global _spool
    if _spool is not None:
        _spool.close()
    _spool = None


def use_root(root: str | os.PathLike[str]) -> None:
    """Called by daemons with the snapshotter root they serve: ``BOOTSEER_PROFILE=1`` means ``ROOT/profile``."""
    if _wants_root and _spool is None:
        try:
            enable(Path(root).absolute() / "profile")
        except OSError:
            pass


def spool() -> Spool | None:
    return _spool


# --------------------------------------------------------------------------- emitting


def emit(name: str, kind: str = "instant", /, *, start: float | None = None, end: float | None = None,
         phase: str = "", bytes: int = 0, value: float | None = None, job: str = "",
         **attrs: Any) -> None:
    """Record one event now (or at ``start``); nothing at all when profiling is off."""
    spool = _spool
    if spool is None:
        return
    try:
        spool.write(Event(name=name, kind=kind, start=time.time() if start is None else start, end=end,
                          phase=phase, node=spool.node, job=job or spool.job, pid=os.getpid(), bytes=bytes,
                          value=value, attrs=attrs))
    except OSError:  # a full disk must not fail a snapshot or a read
        pass


def counter(name: str, value: float, /, *, phase: str = "", **attrs: Any) -> None:
    """Sample a cumulative counter (bytes fetched so far, ...)."""
    if _spool is not None:
        emit(name, "counter", phase=phase, value=value, **attrs)


@contextlib.contextmanager
def span(name: str, /, *, phase: str = "", **attrs: Any) -> Iterator[dict[str, Any]]:
    """Time a block as one span; the yielded dict takes attributes (``bytes`` too) known only at its end."""
    if _spool is None:
        yield {}
        return
    started = time.time()
    extra: dict[str, Any] = {}
    try:
        yield extra
    except BaseException as exc:
        extra.setdefault("error", type(exc).__name__)
        raise
    finally:
        moved = int(extra.pop("bytes", 0) or 0)
        emit(name, "span", start=started, end=time.time(), phase=phase, bytes=moved, **attrs, **extra)


def traced(name: str, *, phase: str = "", attrs: Callable[..., dict[str, Any]] | None = None) -> Callable[[F], F]:
    """Decorate a function so each call is a span; ``attrs(result)`` adds attributes from its result.

    Off, the wrapper costs one global test per call.
    """

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _spool is None:
                return function(*args, **kwargs)
            with span(name, phase=phase) as extra:
                result = function(*args, **kwargs)
                if attrs is not None:
                    try:
                        extra.update(attrs(result))
                    except Exception:  # noqa: BLE001 - attributes are best effort, the call's result is not
                        pass
                return result

        return wrapper  # type: ignore[return-value]

    return decorate


def mark(name: str, **attrs: Any) -> bool:
    """Mark a moment of the job's start (``mark("first_step")``); True if it was recorded somewhere.

    In a process with profiling on, an event. Else, in a container started through the
    snapshotter with profiling on (it has ``/.bootseer``), or under ``bootseer profile run``
    (``$BOOTSEER_MARKS``), a line appended to the file named after the mark in that directory,
    which the snapshotter (or ``run``) turns into an event. The shell form is the same file:
    ``touch /.bootseer/first_step`` (its modification time is the mark's time).
    Anywhere else nothing happens. Never raises for I/O; a bad name is a ValueError.
    """
    if not MARK_NAME.match(name):
        raise ValueError(f"a mark name is 1-63 of A-Z a-z 0-9 . _ - (starting with a letter or digit), not {name!r}")
    now = time.time()
    if _spool is not None:
        emit(f"mark.{name}", "instant", start=now, mark=name, **attrs)
        return True
    directory = os.environ.get(ENV_MARKS) or CONTAINER_MARKS_DIR
    if not os.path.isdir(directory):
        return False
    line = json.dumps({"t": now, "pid": os.getpid(), "attrs": attrs}, default=str) + "\n"
    try:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def read_marks(directory: str | os.PathLike[str]) -> list[tuple[str, float, int, dict[str, Any]]]:
    """The marks in a marks directory: (name, time, pid, attrs) for each, in time order.

    A file's lines are the Python API's (one per call, each with its time); an empty file or
    one written by the shell form counts once, at its modification time. Names that are not
    mark names (anything else the job put there) are skipped; so is anything but a regular
    file. The directory is the container's to write: it is opened ``O_NOFOLLOW`` (a symlink
    as ``/.bootseer`` reads as no marks) and each file beneath its descriptor, only once
    ``fstat`` says it is a regular file (:mod:`bootseer.confined`): never a link out of it. At most :data:`MAX_MARKS` marks
    are read, each file's first 64 KiB.
    """
    marks: list[tuple[str, float, int, dict[str, Any]]] = []
    try:
        fd = confined.open_dir(directory)
    except OSError:
        return marks
    try:
        with os.scandir(fd) as entries:
            names = sorted(entry.name for entry in entries if MARK_NAME.match(entry.name))[:MAX_MARKS]
        for name in names:
            if len(marks) >= MAX_MARKS:
                break
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                data = confined.read_small(fd, name, 1 << 16) if stat.S_ISREG(st.st_mode) else None
            except OSError:
                continue
            if data is not None:
                _parse_mark(marks, name, st, data)
    finally:
        os.close(fd)
    marks.sort(key=lambda m: m[1])
    return marks


def _parse_mark(marks: list[tuple[str, float, int, dict[str, Any]]], name: str, st: os.stat_result,
                data: bytes) -> None:  # fmt: skip
    """Append the marks of one file's ``data`` (its lines, or once at its mtime) to ``marks``, up to MAX_MARKS."""
    found = False
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
            when = float(record["t"])
        except (ValueError, KeyError, TypeError):
            continue
        pid = record.get("pid") if isinstance(record.get("pid"), int) else 0
        attrs = record.get("attrs") if isinstance(record.get("attrs"), dict) else {}
        marks.append((name, when, pid, attrs))
        found = True
        if len(marks) >= MAX_MARKS:
            return
    if not found:
        marks.append((name, st.st_mtime, 0, {}))


_from_environment()
