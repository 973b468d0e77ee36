"""The layer server's control API, from the caller's side: a blocking client and ``ensure_server``.

The snapshotter daemon (its gRPC threads) talks to the long-lived layer server
(:mod:`blockstore.server.layer_server`, ``bootseer layer-server``) over ``ROOT/layers/control.sock``,
a unix socket only root may open (0600 in a 0700 directory).  The protocol is JSON
lines: one request object per connection, ``{"op": "mount", "chain_id": ...}``, and one
answer, ``{"ok": true, ...}`` or ``{"ok": false, "error": {"kind": ..., "message": ...}}``.
Error kinds come back as the exceptions below, so callers branch on domain kinds,
never on messages.  :meth:`LayerServerClient.batch` sends several requests in one round trip
(a container's Prepare: a dependency layer's mount and its hot-list notice).

:func:`ensure_server` connects to the running server or starts one, race-safe (a lock
file serialises starters, so two callers at once start one server), in a session of
its own (``setsid``: it outlives the daemon that started it) with its output in
``ROOT/layers/server.log``.

This module imports neither trio nor pyfuse3: it runs in the daemon.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.peers.config import PeerConfig
from bootseer.paths import ServerPaths


#: Longest request or answer line; a peer sending more is cut off.
MAX_MESSAGE = 1 << 20

#: Seconds a call waits for its answer (mount fetches a chain record and an index).
DEFAULT_TIMEOUT = 10.0
MOUNT_TIMEOUT = 300.0


# -- errors ------------------------------------------------------------------------------


class LayerServerError(Exception):
    """Something the layer server could not do; subclasses say which kind."""

    kind = "internal"


class ServerUnavailable(LayerServerError):
    """No layer server answers on the socket (not running, died, or too slow)."""

    kind = "unavailable"


class ServerTimedOut(ServerUnavailable):
    """The layer server took the connection but did not answer within the call's timeout.

    It is running (busy, or stuck on a store), so starting another cannot help, and
    asking again would only double the caller's wait: callers give up instead.
    """


class ServerStartError(LayerServerError):
    """:func:`ensure_server` could not start a layer server; the message says why.

    ``exit_status`` is the server's, if it exited (2: it refused its settings, see
    :mod:`snapshotter.layer_daemon`), and ``reason`` the last line it logged.
    """

    kind = "start_failed"

    def __init__(self, message: str, *, exit_status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.exit_status = exit_status
        self.reason = reason


class LayerNotConverted(LayerServerError):
    """The store holds no chain record for this ChainID (the layer was not converted)."""

    kind = "not_converted"


class LayerNotMounted(LayerServerError):
    """``check`` or ``unmount`` of a ChainID the server does not serve."""

    kind = "not_mounted"


class StoreUnavailable(LayerServerError):
    """The store failed (or did not answer in the retry timeout) while loading a layer."""

    kind = "store_unavailable"


class LayerCorrupt(LayerServerError):
    """A store object of the layer failed verification (tampered with or truncated)."""

    kind = "corrupt"


class LayerUntrusted(LayerServerError):
    """The layer's chain record is not signed by a converter key the server trusts (docs/trust.md)."""

    kind = "untrusted"


class InvalidRequest(LayerServerError):
    """The request was malformed (a bad ChainID, an unknown operation)."""

    kind = "invalid"


ERROR_KINDS: dict[str, type[LayerServerError]] = {
    cls.kind: cls
    for cls in (
        LayerServerError,
        ServerUnavailable,
        ServerStartError,
        LayerNotConverted,
        LayerNotMounted,
        StoreUnavailable,
        LayerCorrupt,
        LayerUntrusted,
        InvalidRequest,
    )
}


# -- the client ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MountedLayer:
    """Where a mounted layer is: its slot and the lower directory overlayfs takes."""

    chain_id: str
    slot: int
    lower_dir: str


class LayerServerClient:
    """Blocking calls to the layer server on ``socket_path``; safe to share between threads.

    Each call opens its own connection, so a server that died and was started again
    is simply found again by the next call; a call while none runs raises
    :class:`ServerUnavailable`.
    """

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"<LayerServerClient {self.socket_path}>"

    def mount(
        self, chain_id: str, *, store: str | None = None, deps_index: str | None = None, record: bytes | None = None,
        timeout: float = MOUNT_TIMEOUT,
    ) -> MountedLayer:
        """Serve the layer ``chain_id`` (idempotent); where it is (``.lower_dir``, ``.slot``).

        ``store`` overrides the server's ``--store`` for this layer.  ``deps_index``
        (a dependency layer's): the index a deps record the caller verified names, which
        stands for a converter's signature (docs/trust.md).  ``record``: the layer's chain
        record as the caller just read it from that store (its bytes): the server decodes
        and trust-checks it as its own read, and does not read it again.  Raises
        :class:`LayerNotConverted`, :class:`StoreUnavailable`, :class:`LayerCorrupt`,
        :class:`LayerUntrusted`, :class:`InvalidRequest` or :class:`ServerUnavailable`.
        """
        request = mount_request(chain_id, store=store, deps_index=deps_index, record=record)
        return mounted_answer(self.call(request, timeout=timeout))

    def warm(self, chain_ids: Sequence[str], *, store: str | None = None) -> int:
        """Have the server load ``chain_ids`` ahead of their mounts (an image's layers above the one being
        prepared: :mod:`blockstore.server.warming`); answers at once, with how many loads it started."""
        request: dict[str, Any] = {"op": "warm", "chain_ids": list(chain_ids)}
        if store is not None:
            request["store"] = store
        return int(self.call(request)["warming"])

    def check(self, chain_id: str) -> MountedLayer:
        """Where ``chain_id`` is, if it is served and healthy; raises :class:`LayerNotMounted`
        if the server does not serve it, :class:`StoreUnavailable` if it could not be
        restored, :class:`ServerUnavailable` if no server answers."""
        return mounted_answer(self.call({"op": "check", "chain_id": chain_id}))

    def unmount(self, chain_id: str) -> None:
        """Stop serving ``chain_id``; :class:`LayerNotMounted` if it was not served."""
        self.call({"op": "unmount", "chain_id": chain_id})

    def shutdown(self) -> int:
        """Stop the server as SIGTERM would (unmount, exit 0; the table stays); its pid."""
        return int(self.call({"op": "shutdown"})["pid"])

    def status(self) -> dict[str, Any]:
        """The server's state: pid, layers and slots, fetch and cache statistics, health."""
        return self.call({"op": "status"})

    def answers(self) -> bool:
        """Whether a server answers on the socket now (its ``status``)."""
        try:
            self.status()
            return True
        except ServerUnavailable:
            return False

    def call(self, request: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        """Send one request and return the answer's fields; raises the answer's error kind."""
        timeout = self.timeout if timeout is None else timeout
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)
                conn.connect(self.socket_path)
                conn.sendall(line)
                data = _read_line(conn)
        except FileNotFoundError:
            raise ServerUnavailable(f"no layer server: {self.socket_path} does not exist") from None
        except ConnectionRefusedError:
            raise ServerUnavailable(f"no layer server listens on {self.socket_path} (it is not running)") from None
        except socket.timeout:
            raise ServerTimedOut(
                f"the layer server on {self.socket_path} did not answer {request.get('op')!r} in {timeout:g}s"
            ) from None
        except OSError as exc:
            raise ServerUnavailable(f"the layer server on {self.socket_path} failed: {exc}") from None
        if not data:
            raise ServerUnavailable(f"the layer server on {self.socket_path} closed the connection without answering")
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        return _fields(answer, f"the layer server on {self.socket_path}", data)

    def batch(
        self, requests: Sequence[dict[str, Any]], *, timeout: float | None = None
    ) -> list[dict[str, Any] | LayerServerError]:
        """Send ``requests`` in one round trip (the ``batch`` operation: :mod:`.ops`), answered one after another,
        each on its own: its answer's fields, or the error of its kind, in the order sent.  Raises as
        :meth:`call` for the round trip itself (a server gone, one that answers the batch wrong)."""
        answers = self.call({"op": "batch", "requests": list(requests)}, timeout=timeout).get("answers")
        if not isinstance(answers, list) or len(answers) != len(requests):
            raise LayerServerError(f"the layer server on {self.socket_path} answered a batch of {len(requests)} wrong")
        results: list[dict[str, Any] | LayerServerError] = []
        for request, answer in zip(requests, answers):
            try:
                results.append(_fields(answer, f"the layer server's answer to {request.get('op')!r}", answer))
            except LayerServerError as exc:
                results.append(exc)
        return results


def mount_request(chain_id: str, *, store: str | None = None, deps_index: str | None = None,
                  record: bytes | None = None) -> dict[str, Any]:  # fmt: skip
    """The ``mount`` request of :meth:`LayerServerClient.mount` (for a :meth:`~LayerServerClient.batch` too)."""
    request: dict[str, Any] = {"op": "mount", "chain_id": chain_id}
    if store is not None:
        request["store"] = store
    if deps_index is not None:
        request["deps_index"] = deps_index
    if record is not None:
        request["record"] = record.decode("utf-8", "surrogateescape")
    return request


def mounted_answer(answer: dict[str, Any]) -> MountedLayer:
    """Where a ``mount`` (or ``check``) answer says the layer is."""
    try:
        return MountedLayer(str(answer["chain_id"]), int(answer["slot"]), str(answer["lower_dir"]))
    except (KeyError, TypeError, ValueError):
        raise LayerServerError(f"a malformed mount answer: {str(answer)[:200]}") from None


def _fields(answer: Any, who: str, data: Any) -> dict[str, Any]:
    """The fields of an ``{"ok": true, ...}`` answer; the error kind of an ``{"ok": false, ...}`` one raised."""
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise LayerServerError(f"{who} sent a malformed answer: {str(data)[:200]!r}")
    if answer["ok"]:
        return answer
    error = answer.get("error")
    error = error if isinstance(error, dict) else {}
    kind = ERROR_KINDS.get(str(error.get("kind")), LayerServerError)
    raise kind(str(error.get("message", "unknown error")))


def _read_line(conn: socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk:
            return b"".join(chunks).split(b"\n", 1)[0]
        if size > MAX_MESSAGE:
            raise OSError(errno.EMSGSIZE, f"answer longer than {MAX_MESSAGE} bytes")


# -- starting the server ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """How :func:`ensure_server` starts ``bootseer layer-server`` (None: the server's default)."""

    store: str | None = None  #: the default store URL of mounted layers
    cache_dir: str | None = None  #: the node's block cache (default ``ROOT/cache``)
    cache_size: int | None = None  #: bytes
    streams: int | None = None  #: parallel range requests per store
    retry_timeout: float | None = None  #: seconds a failing fetch is retried before EIO
    memory_limit: int | None = None  #: stripe bytes each store's engine holds in memory
    metrics_address: str | None = None  #: HOST:PORT for Prometheus ``/metrics``
    data_path: str | None = None  #: auto, fanotify, erofs, loop or tree (blockstore.datapath.choice); None: the server's default (auto)
    hole_wait: float | None = None  #: seconds a read of a hole on ``fanotify`` waits with no server before EIO
    fill_group: int | None = None  #: ``fanotify``: raw bytes an event for a hole fills at once; None: the server's default
    decode_threads: int | None = None  #: threads that decompress, hash and write blocks; None: one per usable CPU
    background_fill: BackgroundFillConfig | None = None  #: ``fanotify``: the blobs' rest filled while idle; None: the server's default
    publish_store: str | None = None  #: writable store hot lists are published to (default: the layers' store)
    store_proxy: str | None = None  #: HTTP proxy URL http(s) stores are read through (may carry credentials)
    store_proxy_ping_url: str | None = None  #: the proxy's health check URL (never credentials)
    store_proxy_check_interval: float | None = None  #: seconds between the proxy's health checks
    store_proxy_block_size: int | None = None  #: bytes: range requests through the proxy are whole blocks of it
    store_proxy_read_timeout: float | None = None  #: seconds a request of one block through the proxy may take
    hotlist: bool = True  #: False: ``--no-hotlist`` (neither record nor prefetch)
    hotlist_quiet: float | None = None  #: seconds without a new block that end a recording
    hotlist_window: float | None = None  #: seconds after the prepare that end a recording
    hotlist_marker: str | None = None  #: file name at a container's root that ends its recording
    prefetch_concurrency: int | None = None  #: prefetch batches in flight
    prefetch_batch: int | None = None  #: compressed bytes per prefetch batch
    prefetch_cold_rate: int | None = None  #: bytes/s of the cold pass; 0: off
    prefetch_page_cache: bool = True  #: False: ``--no-prefetch-page-cache``
    converter_keys: tuple[str, ...] = ()  #: public key files: layers served only if one signed their chain record
    writer_keys: tuple[str, ...] = ()  #: public key files: hot lists used only if one signed them
    sign_key: str | None = None  #: the node's private key file (a path: the key itself never goes in argv)
    peers: PeerConfig | None = None  #: block sharing (``[peers]``); None or not enabled: off
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()  #: more ``bootseer layer-server`` options, passed as they are
    python: str = field(default_factory=lambda: sys.executable)
    start_timeout: float = 60.0  #: seconds to wait for a started server to answer

    def document(self) -> dict[str, Any]:
        """Every setting given, as ``bootseer layer-server --settings-file`` reads it.

        Keys are the server's option names without their dashes; a value is what its option
        takes on the command line (a string or a number), ``true`` for a flag, a list for a
        repeatable option.  The store and proxy URLs, which may carry credentials, are in it
        too: :func:`ensure_server` passes the document on a pipe, never on the command line,
        which every local user can read in ``/proc/PID/cmdline``.
        """
        options: list[tuple[str, Any]] = [
            ("store", self.store),
            ("publish-store", self.publish_store),
            ("store-proxy", self.store_proxy),
            ("cache-dir", self.cache_dir),
            ("cache-size", self.cache_size),
            ("streams", self.streams),
            ("retry-timeout", self.retry_timeout),
            ("memory-limit", self.memory_limit),
            ("metrics-address", self.metrics_address),
            ("data-path", self.data_path),
            ("hole-wait", self.hole_wait),
            ("fill-group", self.fill_group),
            ("decode-threads", self.decode_threads),
            *self._background_fill_options(),
            ("store-proxy-ping-url", self.store_proxy_ping_url),
            ("store-proxy-check-interval", self.store_proxy_check_interval),
            ("store-proxy-block-size", self.store_proxy_block_size),
            ("store-proxy-read-timeout", self.store_proxy_read_timeout),
            ("hotlist-quiet", self.hotlist_quiet),
            ("hotlist-window", self.hotlist_window),
            ("hotlist-marker", self.hotlist_marker),
            ("prefetch-concurrency", self.prefetch_concurrency),
            ("prefetch-batch", self.prefetch_batch),
            ("prefetch-cold-rate", self.prefetch_cold_rate),
            # Absolute: the server runs in / (a key path relative to the caller's directory would miss).
            ("sign-key", self.sign_key and os.path.abspath(self.sign_key)),
            ("converter-key", [os.path.abspath(path) for path in self.converter_keys] or None),
            ("writer-key", [os.path.abspath(path) for path in self.writer_keys] or None),
            ("no-hotlist", True if not self.hotlist else None),
            ("no-prefetch-page-cache", True if not self.prefetch_page_cache else None),
            *self._peer_options(),
        ]
        return {name: value for name, value in options if value is not None}

    def argv(self, root: str | os.PathLike[str], settings_file: str) -> list[str]:
        """The command line that starts the server for ``root`` with its settings in ``settings_file``
        (:meth:`document`, on a pipe: ``/dev/fd/N``): no setting, let alone a credential, in it.  ``-P``: no
        directory is put ahead of the installed package on the server's ``sys.path`` (``-m`` would put the
        working directory there, where a ``bootseer/`` folder, a checkout's say, would shadow it)."""
        return [self.python, "-P", "-m", "bootseer.cli", "--log-level", self.log_level, "layer-server",
                "--root", os.fspath(root), "--settings-file", settings_file, *self.extra_args]  # fmt: skip

    def _background_fill_options(self) -> list[tuple[str, Any]]:
        fill = self.background_fill
        if fill is None:
            return []
        return [("no-background-fill", True if not fill.enabled else None), ("background-fill-rate", fill.rate),
                ("background-fill-idle", fill.idle)]  # fmt: skip

    def _peer_options(self) -> list[tuple[str, Any]]:
        """The ``peer-*`` settings of :attr:`peers` (file paths only: the token stays in its file)."""
        peers = self.peers
        if peers is None or not peers.enabled:
            return []
        return [
            ("peer-listen", peers.listen),
            ("peer-advertise", peers.advertise),
            ("peers", ",".join(peers.members) or None),
            ("peers-file", peers.members_file),
            ("peers-dns", peers.members_dns),
            ("peer-token-file", peers.token_file and os.path.abspath(peers.token_file)),
            ("peer-deadline", peers.deadline),
            ("peer-upload-rate", peers.upload_rate),
            ("peer-max-uploads", peers.max_uploads),
            ("peer-fetch-budget", peers.fetch_budget),
            ("peer-max-connections", peers.max_connections),
            ("peer-tls-cert", peers.tls_cert),
            ("peer-tls-key", peers.tls_key),
            ("peer-ca", peers.ca),
        ]


@contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (waiting at most ``timeout`` seconds)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerStartError(f"another process has been starting the layer server for {timeout:g}s ({path})")
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _log_tail(path: Path, start: int, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return text[-limit:].strip()


#: Longest setting file read (a secret of ``--store-file``, or the whole ``--settings-file`` document): a pipe
#: from :func:`ensure_server` is written whole before the server starts, so it must fit the pipe's buffer.
MAX_SETTINGS = 60 * 1024


@contextmanager
def _settings_pipe(document: Mapping[str, Any]) -> Iterator[tuple[str, int]]:
    """A pipe holding ``document`` as JSON, its write end closed: ("/dev/fd/N", N).

    The read end is closed here once the server has inherited it (it reads it once).
    """
    data = json.dumps(document, sort_keys=True).encode() + b"\n"
    if len(data) > MAX_SETTINGS:
        raise ServerStartError(f"the layer server's settings are longer than {MAX_SETTINGS} bytes")
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            os.write(write_end, data)  # fits the pipe's buffer: never blocks
        finally:
            os.close(write_end)
        yield f"/dev/fd/{read_end}", read_end
    finally:
        os.close(read_end)


def read_setting_file(path: str) -> bytes:
    """The bytes of ``path``, at most :data:`MAX_SETTINGS`; ``/dev/fd/N`` (a pipe from :func:`ensure_server`)
    is read from descriptor N, which is then closed.  ValueError, naming the file, if it cannot be read."""
    inherited = path.removeprefix("/dev/fd/")
    try:
        if inherited.isdigit():
            with os.fdopen(int(inherited), "rb") as pipe:
                data = pipe.read(MAX_SETTINGS + 1)
        else:
            with open(path, "rb") as file:
                data = file.read(MAX_SETTINGS + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SETTINGS:
        raise ValueError(f"{path} is longer than {MAX_SETTINGS} bytes")
    return data


def read_secret_file(path: str) -> str:
    """The setting in ``path`` (its first line, stripped), as ``--store-file`` gives it
    (:func:`read_setting_file`); ValueError, naming the file, if it cannot be read or is empty."""
    lines = read_setting_file(path).decode(errors="replace").strip().splitlines()
    if not lines or not lines[0].strip():
        raise ValueError(f"{path} is empty")
    return lines[0].strip()


def ensure_server(root: str | os.PathLike[str], settings: ServerSettings = ServerSettings()) -> LayerServerClient:
    """A client of the layer server for ``root``, starting the server if none answers.

    Race-safe: starters take ``ROOT/layers/start.lock`` in turn and check again under
    it, so two callers at once start one server.  The server runs in a session of
    its own (it outlives the caller), with stdio appended to ``ROOT/layers/server.log``;
    its settings, store URLs (which may carry credentials) among them, reach it as one JSON
    document on an inherited pipe (:meth:`ServerSettings.document`), not in argv.
    Returns once the server answers ``status``.  Raises :class:`ServerStartError`
    (with the server's own last log lines) if it exits or does not answer within
    ``settings.start_timeout``.
    """
    paths = ServerPaths(Path(root))
    client = LayerServerClient(paths.socket)
    if client.answers():
        return client
    paths.layers.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(paths.layers, 0o700)
    with _locked(paths.start_lock, settings.start_timeout):
        if client.answers():  # someone else started it while we waited
            return client
        with open(paths.log, "ab") as log, _settings_pipe(settings.document()) as (settings_file, settings_fd):
            argv = settings.argv(root, settings_file)
            log_start = log.tell()
            try:
                process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
                    pass_fds=(settings_fd,), cwd="/",  # pins no directory of the caller's
                )
            except OSError as exc:
                raise ServerStartError(f"cannot start the layer server ({argv[0]}): {exc}") from None
        # Reap it when it exits, so a server that dies while we live is no zombie.
        threading.Thread(target=process.wait, name=f"layer server {process.pid} reaper", daemon=True).start()
        deadline = time.monotonic() + settings.start_timeout
        while time.monotonic() < deadline:
            if client.answers():
                return client
            if process.poll() is not None:
                tail = _log_tail(paths.log, log_start)
                raise ServerStartError(
                    f"the layer server exited with status {process.returncode} before answering; "
                    f"its log ({paths.log}):\n{tail}",
                    exit_status=process.returncode, reason=tail.splitlines()[-1] if tail else "",
                )
            time.sleep(0.05)
        raise ServerStartError(
            f"the layer server (pid {process.pid}) did not answer on {paths.socket} in {settings.start_timeout:g}s; "
            f"its log ({paths.log}):\n{_log_tail(paths.log, log_start)}"
        )


__all__ = [
    "ERROR_KINDS",
    "InvalidRequest",
    "LayerCorrupt",
    "LayerNotConverted",
    "LayerNotMounted",
    "LayerServerClient",
    "LayerServerError",
    "LayerUntrusted",
    "MountedLayer",
    "ServerPaths",
    "ServerSettings",
    "ServerStartError",
    "ServerTimedOut",
    "ServerUnavailable",
    "StoreUnavailable",
    "ensure_server",
    "read_secret_file",
    "read_setting_file",
]
