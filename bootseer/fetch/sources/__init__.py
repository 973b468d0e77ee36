"""The storage backends of the fetch engine, and :func:`open_source` to pick one by URL.

Each backend implements :class:`bootseer.fetch.source.RangeSource` over a tree rooted
at one URL (path ``""`` is that URL itself, a directory or a single file):

========================================  =========================================
``/path``, ``file:///path``               :class:`~.local.LocalSource` (local, NFS, Lustre)
``http://host/path``, ``https://...``     :class:`~.http.HttpSource` (Range requests)
``s3://bucket/prefix``                    :class:`~.s3.S3Source` (boto3)
``hdfs://namenode[:port]/path``           :class:`~.hdfs.HdfsSource` (hdfs-native, no JVM)
``webhdfs://host:port/path``              :class:`~.webhdfs.WebHdfsSource` (REST; ``swebhdfs://`` TLS)
========================================  =========================================

Backends are imported only when a URL needs them, so that a local mount never pays
for importing boto3.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any
from urllib.parse import urlsplit

from bootseer.fetch.source import PermanentError, RangeSource

# scheme -> (module, class); "" is a plain filesystem path.
BACKENDS: dict[str, tuple[str, str]] = {
    "": ("local", "LocalSource"),
    "file": ("local", "LocalSource"),
    "http": ("http", "HttpSource"),
    "https": ("http", "HttpSource"),
    "s3": ("s3", "S3Source"),
    "hdfs": ("hdfs", "HdfsSource"),
    "webhdfs": ("webhdfs", "WebHdfsSource"),
    "swebhdfs": ("webhdfs", "WebHdfsSource"),
}


#: What the part after ``scheme://`` names, for the schemes that need one.
HOST_PARTS: dict[str, str] = {
    "http": "host", "https": "host", "s3": "bucket", "hdfs": "namenode", "webhdfs": "host", "swebhdfs": "host",
}


def check_url(url: str) -> str:
    """``url``'s scheme ("" for a plain path) if the URL can name a store, else ValueError.

    The one check of a URL's shape, made by :func:`open_source` and at start-up by
    every command that takes a store: an empty URL, an unknown scheme (``htp://``), a
    scheme without what it must name (``s3://`` without a bucket, ``http://`` without
    a host) or a bad port.  No I/O.  Messages show the URL redacted.
    """
    if not url:
        raise ValueError("empty source URL")
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme not in BACKENDS:
        supported = ", ".join(f"{s}://" for s in BACKENDS if s) + " or a plain /path"
        raise ValueError(f"unsupported source URL {redact_url(url)!r}: scheme {scheme!r} is not one of {supported}")
    parts = urlsplit(url)
    needed = HOST_PARTS.get(scheme)
    if needed and not parts.hostname:
        raise ValueError(f"source URL {redact_url(url)!r} names no {needed} ({scheme}://{needed.upper()}/...)")
    try:
        parts.port
    except ValueError as exc:
        raise ValueError(f"source URL {redact_url(url)!r} has a bad port: {exc}") from None
    return scheme


def check_local_root(url: str) -> None:
    """For a local store (``/path``, ``file://``): ValueError unless its root is an existing directory.

    A start-up check: a typo in a local store path must be refused, not read as a
    store in which nothing is converted.  Other schemes are not contacted.
    """
    if check_url(url) not in ("", "file"):
        return
    from .local import _path_from_url

    path = _path_from_url(url)
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise ValueError(f"store {redact_url(url)!r}: {path} {what}")


def source_class(url: str) -> type:
    """Return the backend class that serves ``url``; ValueError for a URL :func:`check_url` refuses."""
    module_name, class_name = BACKENDS[check_url(url)]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)


def source_options(cls: type) -> list[str]:
    """The keyword options a backend class accepts (besides the URL)."""
    parameters = inspect.signature(cls).parameters.values()
    return [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]


#: Options a caller may give for every store it opens, whatever its kind (the layer server's
#: ``source_options``): each goes to the backends that take it, and the others read as if it were
#: not given.  ``proxy`` (``[store] proxy``) is taken by the HTTP(S) backend only.
STORE_WIDE_OPTIONS = frozenset({"proxy"})


def open_source(url: str, **options: Any) -> RangeSource:
    """Open the backend for ``url``, rooted at it, passing ``options`` to it.

    Raises ValueError for an unknown scheme, an unknown option (other than one of
    :data:`STORE_WIDE_OPTIONS`) or a malformed URL.  Opening does no I/O on remote
    backends; the first :meth:`stat` does.
    """
    cls = source_class(url)
    accepted = source_options(cls)
    options = {name: value for name, value in options.items() if name in accepted or name not in STORE_WIDE_OPTIONS}
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for {cls.__name__} ({redact_url(url)!r}); "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    return cls(url, **options)


def split_path(path: str) -> list[str]:
    """Check a source-relative path and return its components (``[]`` for the root).

    Refuses what could step outside the root or name something ambiguously:
    absolute paths, ``.``/``..`` components, empty components (``a//b``, a trailing
    ``/``) and NUL bytes.  Raises PermanentError naming the path (a retry cannot
    make it acceptable).
    """
    if not isinstance(path, str):
        raise TypeError(f"source path must be a str, not {type(path).__name__}")
    if path == "":
        return []
    if path.startswith("/"):
        raise PermanentError(f"refused source path {path!r}: must be relative to the source root")
    if "\0" in path:
        raise PermanentError(f"refused source path {path!r}: contains a NUL byte")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            what = f"a {part!r}" if part else "an empty"
            raise PermanentError(f"refused source path {path!r}: has {what} component")
    return parts


def redact_url(url: str) -> str:
    """``url`` without what may be secret: ``user:password@``, the query (a token) and the fragment.

    What every source shows as :attr:`~bootseer.fetch.source.RangeSource.display_url`
    and puts in its messages; a plain path comes back as it is.
    """
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def carries_secret(url: str) -> bool:
    """Whether :func:`redact_url` would hide part of ``url`` (a ``user:password@``, a query, a fragment)."""
    if "://" not in url:
        return False
    parts = urlsplit(url)
    return "@" in parts.netloc or bool(parts.query) or bool(parts.fragment)


def valid_name(name: object) -> bool:
    """Whether a remote listing's ``name`` can be a file name in the tree.

    Not empty, ``.`` or ``..``, no ``/`` or NUL, and valid Unicode: a JSON listing can
    carry a lone surrogate (``"bad\\ud800x"``), which no file name can be encoded
    to and no URL can be built from.  Listings skip such entries (with a warning)
    rather than fail the whole directory.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_range(offset: int, length: int) -> None:
    """ValueError for a negative offset or length (a caller bug, never retried)."""
    if offset < 0 or length < 0:
        raise ValueError(f"invalid range: offset={offset} length={length}")


__all__ = [
    "BACKENDS", "STORE_WIDE_OPTIONS", "carries_secret", "check_local_root", "check_url", "open_source", "source_class", "source_options", "split_path", "redact_url", "valid_name",
    "check_range",
]  # fmt: skip
