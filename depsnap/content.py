"""The digest of a directory tree as an install sees it: the key's ``prefix-content`` and local trees.

Two trees get the same digest when they hold the same environment, wherever and
whenever they were made: paths, types, permission bits, sizes, contents and link
targets count; mtimes, owners and inode numbers never do.  What is derived or
records only how a tree was made is left out (:func:`tree_digest`):

* **bytecode**: every ``__pycache__`` directory (Python reads a ``__pycache__/*.pyc``
  only for a source beside it, so it is derived from that source; it embeds the
  source's mtime, which differs each time a venv is made) and ``NAME.pyc`` beside
  ``NAME.py`` (a source file takes precedence: the ``.pyc`` is never loaded).  A
  ``.pyc`` without its source is code and counts;
* in a ``*.dist-info/RECORD``, the rows naming such bytecode (pip lists them without
  hashes, other installers may hash them), and the rows' order (which means nothing);
* in ``pyvenv.cfg`` at the tree's top, the ``command`` line: how ``venv`` was invoked
  (``python3`` or ``python3.11``), while what it made is in the tree itself.

The walk opens every directory and file through its parent's descriptor
(:mod:`bootseer.confined`: no link swapped in during the walk is ever followed) and checks
each opened object is the one ``lstat`` saw; a tree that changes under it is an error.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Iterable

from bootseer import confined

#: Directories nested deeper than this below the root are refused (one descriptor per level is open).
MAX_DEPTH = 256
#: A RECORD or pyvenv.cfg larger than this is hashed as it is (no real one comes near).
MAX_NORMALISED_BYTES = 16 << 20
#: Directory names never descended into, nor recorded: bytecode caches are derived.
DERIVED_DIRS = frozenset({"__pycache__"})

_VENV_COMMAND = re.compile(rb"^\s*command\s*=")


class TreeError(ValueError):
    """The tree cannot be hashed: it changed while it was read, nests too deep, or cannot be read."""


def file_digest(path: Path) -> str:
    """``sha256:`` of a file's bytes (a file the caller named: it is opened by path)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def is_derived_bytecode(name: str, siblings: set[str] | frozenset[str]) -> bool:
    """Whether the directory entry ``name`` is bytecode of a source among ``siblings`` (its directory's names)."""
    return name.endswith(".pyc") and name[:-1] in siblings


def _record_rows(data: bytes) -> bytes:
    """A RECORD's rows without those naming derived bytecode, sorted, one JSON list a line."""
    rows = list(csv.reader(io.StringIO(data.decode("utf-8", errors="surrogateescape"))))
    paths = {row[0] for row in rows if row}
    kept = []
    for row in rows:
        if not row:
            continue
        path = PurePosixPath(row[0])
        if DERIVED_DIRS.intersection(path.parts[:-1]) or is_derived_bytecode(row[0], paths):
            continue
        kept.append(json.dumps(row, ensure_ascii=True))
    return "\n".join(sorted(kept)).encode()


def _normalise(data: bytes, *, record: bool, venv_config: bool) -> bytes:
    if record:
        return _record_rows(data)
    if venv_config:
        return b"".join(line for line in data.splitlines(keepends=True) if not _VENV_COMMAND.match(line))
    return data


def _hash_file(dir_fd: int, name: str, seen: os.stat_result, *, record: bool, venv_config: bool) -> str:
    try:
        fd = confined.open_as_scanned(dir_fd, name, confined.Seen(seen.st_dev, seen.st_ino, seen.st_size))
    except confined.NotAsScanned:
        raise TreeError(f"{name} was replaced while the tree was hashed") from None
    except OSError as exc:
        raise TreeError(f"cannot open {name}: {exc.strerror}") from None
    try:
        h = hashlib.sha256()
        if (record or venv_config) and seen.st_size <= MAX_NORMALISED_BYTES:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            h.update(_normalise(b"".join(chunks), record=record, venv_config=venv_config))
        else:
            while chunk := os.read(fd, 1 << 20):
                h.update(chunk)
        return "sha256:" + h.hexdigest()
    finally:
        os.close(fd)


def _walk(dir_fd: int, rel: str, skip: frozenset[str], depth: int, h: hashlib._Hash) -> int:
    """Hash the entries below the open directory ``dir_fd`` (named ``rel`` under the root); how many there were."""
    if depth > MAX_DEPTH:
        raise TreeError(f"{rel}: directories nest deeper than {MAX_DEPTH}")
    with os.scandir(dir_fd) as it:
        names = sorted(entry.name for entry in it)
    siblings = frozenset(names)
    in_dist_info = rel.endswith(".dist-info")
    count = 0
    for name in names:
        if is_derived_bytecode(name, siblings):
            continue
        path = f"{rel}/{name}" if rel else name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise TreeError(f"{path} was removed while the tree was hashed") from None
        if stat.S_ISDIR(st.st_mode) and (name in skip or name in DERIVED_DIRS):
            continue
        count += 1
        record: list[object] = [path, stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode)]
        child_fd = None
        if stat.S_ISREG(st.st_mode):
            digest = _hash_file(dir_fd, name, st, record=in_dist_info and name == "RECORD",
                                venv_config=not rel and name == "pyvenv.cfg")  # fmt: skip
            record += [st.st_size, digest]
        elif stat.S_ISLNK(st.st_mode):
            record.append(os.readlink(name, dir_fd=dir_fd))
        elif stat.S_ISDIR(st.st_mode):
            try:
                child_fd = confined.open_beneath(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                raise TreeError(f"cannot open {path}: {exc.strerror}") from None
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            record.append([os.major(st.st_rdev), os.minor(st.st_rdev)])
        h.update(json.dumps(record, ensure_ascii=True).encode() + b"\n")
        if child_fd is not None:
            try:
                opened = os.fstat(child_fd)
                if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                    raise TreeError(f"{path} was replaced while the tree was hashed")
                count += _walk(child_fd, path, skip, depth + 1, h)
            finally:
                os.close(child_fd)
    return count


def tree_digest(root: Path, *, skip: Iterable[str] = ()) -> str:
    """A digest of the tree under ``root`` (module docstring: what counts and what is left out).

    ``skip``: names of further directories left out (``.git``).  ``"absent"`` for a
    missing root, ``"empty"`` for an empty directory, a file's digest for a file.
    ``root`` itself is followed if it is a link (the caller named it); nothing below it is.
    TreeError if the tree changes while it is read or cannot be read.
    """
    try:
        top = os.stat(root)
    except FileNotFoundError:
        return "absent"
    if stat.S_ISREG(top.st_mode):
        return file_digest(root)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise TreeError(f"cannot read {root}: {exc.strerror}") from None
    h = hashlib.sha256()
    try:
        count = _walk(fd, "", frozenset(skip), 0, h)
    except TreeError as exc:
        raise TreeError(f"{root}: {exc}") from None
    except OSError as exc:
        raise TreeError(f"{root}: {exc.filename or ''} {exc.strerror}".strip()) from None
    finally:
        os.close(fd)
    return "sha256:" + h.hexdigest() if count else "empty"
