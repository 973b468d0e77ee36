"""``bootseer-snapshotter``: the daemon containerd talks to as a snapshotter proxy plugin.

containerd's config points a ``proxy_plugins`` entry at the daemon's socket::

    [proxy_plugins.bootseer]
      type = "snapshot"
      address = "/run/bootseer/snapshotter.sock"

The daemon serves containerd's Snapshots API (:mod:`.grpc_service`) over a unix socket
from a thread pool; the :class:`~.snapshots.Snapshotter` below it is thread-safe.

Lifecycle:

* Start: claim the socket path (an exclusive ``flock`` on ``ADDRESS.lock`` until
  the socket serves, so two daemons racing for one path cannot both win), open
  the root (its Snapshotter holds an exclusive ``flock`` on ``ROOT/lock``: two
  daemons never share a root), restore the snapshots already under ROOT, then
  listen.  The socket is bound under a private name, made under a umask that leaves
  it ``0600`` from the moment it exists, and renamed onto ADDRESS, so the path
  switches atomically from a stale socket to ours; missing parent directories are
  made ``0711``.  A socket nobody answers on is left over from a daemon that died
  and is replaced; one that answers belongs to a live process and the new daemon
  refuses to start.
* SIGTERM or SIGINT: stop accepting calls, let calls in flight finish (up to
  :data:`GRACE_PERIOD` seconds; a second signal cuts that short), close the
  Snapshotter, remove the socket if it is still the one this daemon bound (same
  device and inode: a path taken over meanwhile is left alone), exit 0.
* With a store (``--store``/``[store] url``): after the root's lock, find or start the
  layer server (``bootseer layer-server``, in a session of its own under ROOT/layers:
  it outlives the daemon; the ``[cache]``, ``[fetch]`` and ``[hotlist]`` settings are its
  flags), restore re-mounts every remote snapshot through it, and a
  watch thread starts it again if it dies.  A server that cannot start is logged and
  every Prepare falls back to downloading; the daemon still serves.  One that refuses
  its settings (exit status 2) would refuse them every time: the daemon then refuses
  to start, with that line.  Store URLs reach the server on pipes, never its argv.
* Restart: every snapshot under ROOT survives.  The mounts handed to containerd are
  plain kernel overlay and bind mounts, which the kernel keeps on its own, so running
  containers keep working while the daemon is down or restarting; only new
  snapshot operations wait for it.

Exit status: 0 after a clean shutdown; 2 when it refuses to start (a bad command
line or config file, or a start-up check that failed: the one-line message names
the path and the reason); 1 when it fails unexpectedly (logged with a traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import select
import signal
import socket
import stat
import sys
import threading
import uuid
from pathlib import Path
from types import FrameType

import grpc
import prometheus_client

from bootseer import __version__
from bootseer.log import FORMATS, LEVELS, get_logger, setup_logging
from bootseer.metrics import serve_metrics

from bootseer.blockstore.node.block_cache import check_cache_dir
from bootseer.blockstore.server.client import LayerServerError, ServerSettings, ServerStartError
from bootseer.paths import ServerPaths
from bootseer.fetch.engine import EngineConfig
from bootseer.fetch.sources import carries_secret, redact_url

from . import config, grpc_service
from .backend import LayerBackend
from .errors import CorruptMetadata, RootLocked, SchemaTooNew
from .layer_backend import LayerServerBackend
from .deps_hooks import DepsContext, DepsObserver
from .observers import HotListObserver
from .snapshots import Snapshotter

log = get_logger(__name__)

PROG = "bootseer-snapshotter"
GRACE_PERIOD = 10.0  #: seconds calls in flight get to finish at shutdown
GRPC_WORKERS = 32  #: concurrent calls; containerd unpacks several layers at once
SOCKET_UMASK = 0o177  #: the socket is created 0600
SOCKET_DIR_MODE = 0o711
SOCKET_PATH_MAX = 107  #: sun_path holds 108 bytes with the terminating NUL
LAYER_SERVER_CHECK_INTERVAL = 5.0  #: seconds between checks that the layer server still runs


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="containerd remote snapshotter (proxy plugin) for BootSeer.",
        epilog="Flags override the config file; see ctr_examples/bootseer-snapshotter.toml.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--config", metavar="FILE", help="TOML config file with the keys below (flags win)")
    # Defaults live in config.DEFAULTS; None here means "not given on the command line".
    parser.add_argument("--root", metavar="DIR", help=f"snapshot storage (default {config.DEFAULTS['root']})")
    parser.add_argument("--address", metavar="SOCKET", help=f"unix socket to serve on (default {config.DEFAULTS['address']})")
    parser.add_argument("--log-level", choices=LEVELS, help="default info")
    parser.add_argument("--log-format", choices=FORMATS, help="default text (logfmt)")
    parser.add_argument("--metrics-address", metavar="HOST:PORT", help="serve Prometheus /metrics here (default off)")
    lazy = parser.add_argument_group("lazy layers (remote snapshots; off unless a store is given)")
    lazy.add_argument("--store", metavar="URL", help="store of converted layers: file://, s3://, http(s)://, hdfs://")
    lazy.add_argument("--cache-dir", metavar="DIR", help="the node's block cache (default ROOT/cache)")
    lazy.add_argument("--cache-size", metavar="SIZE", help=f"bytes the block cache and the local blobs may hold together (default {config.DEFAULTS['cache.size']})")
    lazy.add_argument(
        "--publish-store", metavar="URL",
        help="writable store the layer server publishes hot lists to, where --store is read-only (an http front); "
             "default: the store of layers",
    )  # fmt: skip
    lazy.add_argument(
        "--layer-server-metrics-address", metavar="HOST:PORT",
        help="serve the layer server's Prometheus /metrics (FUSE requests, fetches, cache) here, "
             "when this daemon starts it (default off)",
    )  # fmt: skip
    lazy.add_argument(
        "--data-path", metavar="PATH",
        help="[fuse] data_path: how the layer server gives overlayfs a layer's tree: auto (default: EROFS "
             "where the kernel has it), erofs (file-backed), loop (EROFS over loop devices) or tree (per-file FUSE)",
    )  # fmt: skip
    lazy.add_argument(
        "--fill-group", metavar="SIZE",
        help=f"[datapath] fill_group: on fanotify, raw bytes of adjacent blocks an event for a hole fills at once "
             f"(0: only the read's; default {config.DEFAULTS['datapath.fill_group']})",
    )  # fmt: skip
    trust = parser.add_argument_group("trust (docs/trust.md; no keys: the store is trusted as it is)")
    trust.add_argument("--converter-key", action="append", metavar="FILE",
                       help="serve only layers whose chain record this converter key (.pub) signed; repeatable")  # fmt: skip
    trust.add_argument("--writer-key", action="append", metavar="FILE",
                       help="use only hot lists and deps records this node key (.pub) signed; repeatable")  # fmt: skip
    trust.add_argument("--sign-key", metavar="FILE", help="this node's private key: signs its hot lists and deps captures")
    lazy.add_argument(
        "--deps-scope", metavar="NAME",
        help="[depsnap] scope: dependency snapshots are restored and published only within this scope "
             "(and the container's containerd namespace); default none",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        file_settings = config.read_file(args.config) if args.config else {}
        settings = config.resolve(file_settings, {key: getattr(args, dest) for key, dest in config.FLAGS.items()})
    except config.ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)  # one line, naming the key
        return 2
    try:
        config.check_local_stores(settings)
        missing_store = ""
    except config.ConfigError as exc:
        # A node that has served layers (its layer server's table exists) must start again
        # while its store is away: running containers' layers come back from local copies.
        if not ServerPaths(settings.root).table.exists():
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        missing_store = str(exc)
    setup_logging(settings.log_level, settings.log_format)
    if missing_store:
        log.warning("the store is not there; starting anyway to restore this node's layers", error=missing_store)
    for flag, url in (("--store", args.store), ("--publish-store", args.publish_store)):
        if url and carries_secret(url):
            log.warning(f"{flag} carries a credential on the command line, which every local user can read; "
                        f"put it in the config file ([store] url, [hotlist] publish_store) instead", store=redact_url(url))  # fmt: skip
    try:
        return Daemon(settings).run()
    except StartupError as exc:
        log.error(f"{PROG} cannot start", error=str(exc))
        return 2
    except Exception:
        log.error(f"{PROG} failed", exc_info=True)
        return 1


class Daemon:
    """One run of the daemon: :meth:`run` returns when a signal has stopped it."""

    def __init__(self, settings: config.Config) -> None:
        self.settings = settings
        self._server: grpc.Server | None = None
        self._signals: int | None = None  # read end of the signal wake-up pipe

    def run(self) -> int:
        root, address = self.settings.root, self.settings.address
        with contextlib.ExitStack() as cleanup:
            # First, so a signal during a long restore still means a clean stop.
            self._catch_signals(cleanup)
            check_socket_path(address)
            make_dirs(address.parent, SOCKET_DIR_MODE)
            claim = SocketClaim(address)
            cleanup.callback(claim.release)
            check_socket_free(address)

            if self.settings.store_url:  # a refusal is the one line it prints: before any other warning
                try:
                    check_cache_dir(self.settings.block_cache_dir)
                except ValueError as exc:
                    raise StartupError(f"--cache-dir: {exc}") from None
            backend = self._layer_backend()
            snapshotter = open_snapshotter(root, backend)
            cleanup.callback(self._close_snapshotter, snapshotter)
            if backend is not None:  # containers on lazy layers: dependency snapshots, then their hot lists
                snapshotter.observe(DepsObserver(backend, snapshotter.snapshots_dir, snapshotter.stat,
                                                 deps_context(self.settings)))  # fmt: skip
                snapshotter.observe(HotListObserver(backend.root))
            if backend is not None:  # after the root's lock: one daemon per root starts its server
                self._start_layer_server(backend)
                self._watch_layer_server(backend, cleanup)
            snapshotter.restore()  # logs what it restored and any damage it found

            collector = grpc_service.SnapshotCountCollector(snapshotter)
            prometheus_client.REGISTRY.register(collector)
            cleanup.callback(prometheus_client.REGISTRY.unregister, collector)
            metrics_address = self._serve_metrics()

            self._server = grpc_service.create_server(snapshotter, GRPC_WORKERS)
            cleanup.callback(self._server.stop, None)  # on the way out after a failure; else a no-op
            bound = listen(self._server, address)
            cleanup.callback(remove_socket, address, bound)
            self._server.start()
            claim.release()  # the path now answers: the next daemon sees a live socket
            log.info(
                f"{PROG} started",
                version=__version__,
                root=str(root),
                address=str(address),
                metrics_address=metrics_address or "off",
                store=redact_url(self.settings.store_url) if self.settings.store_url else "off",
                pid=os.getpid(),
            )

            log.info("shutdown requested", signal=self._next_signal(timeout=None))
            log.info(f"{PROG} stopping", grace_period=GRACE_PERIOD)
            stopped = self._server.stop(GRACE_PERIOD)
            while not stopped.is_set():
                second = self._next_signal(timeout=0.1)
                if second:
                    log.warning("second shutdown signal: cancelling calls in flight", signal=second)
                    self._server.stop(0)  # a shorter grace replaces the running one
        log.info(f"{PROG} stopped")
        return 0

    def _catch_signals(self, cleanup: contextlib.ExitStack) -> None:
        """Make SIGTERM and SIGINT readable, as signal numbers, from a pipe.

        The kernel may deliver a process signal to any thread, gRPC's included, and
        Python then runs the handler only once the main thread next executes bytecode:
        a main thread blocked in a lock or condition wait would never see it.  With a
        wake-up fd, the C-level handler writes the signal number into a pipe from
        whichever thread it runs on, and the main thread blocks reading that pipe.
        """
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        cleanup.callback(os.close, read_end)
        cleanup.callback(os.close, write_end)
        self._signals = read_end
        previous = {signum: signal.signal(signum, _ignore_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        cleanup.callback(signal.set_wakeup_fd, previous_fd)
        for signum, handler in previous.items():
            cleanup.callback(signal.signal, signum, handler)

    def _next_signal(self, timeout: float | None) -> str | None:
        """The name of the next SIGTERM/SIGINT, waiting up to ``timeout`` seconds (None: for ever)."""
        assert self._signals is not None
        while True:
            ready, _, _ = select.select([self._signals], [], [], timeout)
            if not ready:
                return None
            try:
                received = os.read(self._signals, 1)
            except BlockingIOError:
                continue  # another reader took it; wait again
            if received and received[0] in (signal.SIGTERM, signal.SIGINT):
                return signal.Signals(received[0]).name

    def _layer_backend(self) -> LayerServerBackend | None:
        """The remote-snapshot backend the settings ask for; None without a store."""
        settings = self.settings
        if not settings.store_url:
            return None
        server = ServerSettings(
            store=settings.store_url,
            cache_dir=str(settings.block_cache_dir),
            cache_size=settings.cache_size,
            streams=settings.fetch_streams,
            retry_timeout=settings.fetch_retry_timeout,
            memory_limit=settings.fetch_memory_limit,
            decode_threads=settings.fetch_decode_threads or None,
            publish_store=settings.publish_store or None,
            **config.server_proxy_settings(settings.store_proxy),
            hotlist=settings.hotlist_enabled,
            hotlist_quiet=settings.hotlist_recording.quiet,
            hotlist_window=settings.hotlist_recording.window,
            hotlist_marker=settings.hotlist_recording.marker,
            prefetch_concurrency=settings.hotlist_prefetch.concurrency,
            prefetch_batch=settings.hotlist_prefetch.batch_bytes,
            prefetch_cold_rate=settings.hotlist_prefetch.cold_rate,
            prefetch_page_cache=settings.hotlist_prefetch.page_cache,
            metrics_address=settings.layer_server_metrics_address or None,
            data_path=settings.data_path,
            hole_wait=settings.hole_wait,
            fill_group=settings.fill_group,
            background_fill=settings.background_fill,
            converter_keys=tuple(map(str, settings.converter_keys)),
            writer_keys=tuple(map(str, settings.writer_keys)),
            sign_key=str(settings.sign_key) if settings.sign_key else None,
            peers=settings.peers,
            log_level=settings.log_level,
        )
        engine = EngineConfig(streams=settings.fetch_streams, retry_timeout=settings.fetch_retry_timeout)
        if not settings.trust.enforced("chain"):
            log.warning("no [trust] converter_keys: layers are served as the store holds them, "
                        "forged ones included (docs/trust.md)")  # fmt: skip
        else:
            log.info("trust policy", **settings.trust.describe())
        return LayerServerBackend(settings.root, settings.store_url, server, engine, trust=settings.trust)

    @staticmethod
    def _start_layer_server(backend: LayerServerBackend) -> None:
        """Find or start the layer server; if it cannot start, serve on and fall back per layer.

        A pull must never fail because of the lazy path: each Prepare then tries to
        start the server again and, failing, downloads the layer as without a store.
        A server that refuses its settings (exit status 2) would refuse them every
        time: that is a :class:`StartupError`, not a loop of restarts.
        """
        try:
            backend.start()
        except ServerStartError as exc:
            if exc.exit_status == 2:
                raise StartupError(f"the layer server refused its settings: {exc.reason or exc}") from None
            log.error("the layer server cannot start; layers are downloaded until it can", error=str(exc))
        except LayerServerError as exc:
            log.error("the layer server cannot start; layers are downloaded until it can", error=str(exc))
        else:
            log.info("layer server ready", socket=str(ServerPaths(backend.root).socket))

    @staticmethod
    def _watch_layer_server(backend: LayerServerBackend, cleanup: contextlib.ExitStack) -> None:
        """Check the layer server every :data:`LAYER_SERVER_CHECK_INTERVAL` seconds; start it again if it died.

        Running containers read their lazy layers from it: a server that died is
        noticed and replaced (it restores its table) without waiting for a Prepare.
        """
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(LAYER_SERVER_CHECK_INTERVAL):
                try:
                    if backend.ensure_running():
                        log.info("layer server started again", socket=str(ServerPaths(backend.root).socket))
                except LayerServerError as exc:
                    log.error("the layer server cannot start; layers are downloaded until it can", error=str(exc))

        thread = threading.Thread(target=watch, name="layer server watch", daemon=True)
        thread.start()
        cleanup.callback(thread.join)
        cleanup.callback(stop.set)

    def _serve_metrics(self) -> str:
        if not self.settings.metrics_address:
            return ""
        try:
            host, port = serve_metrics(self.settings.metrics_address)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {self.settings.metrics_address}: {exc.strerror}") from exc
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @staticmethod
    def _close_snapshotter(snapshotter: Snapshotter) -> None:
        try:
            snapshotter.close()
        except Exception:
            log.error("closing the snapshotter failed", exc_info=True)
            raise


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """Python-level handler of SIGTERM/SIGINT: the work happens in :meth:`Daemon.run`,
    which reads the signal from the wake-up pipe; this only keeps the default action
    (exit at once) from running."""


def deps_context(settings: config.Config) -> DepsContext:
    """What dependency snapshots need of the daemon's settings: one publish store for what a node writes
    (``[hotlist] publish_store``, the setting the layer server publishes hot lists with, takes captures too;
    without it, the store of layers)."""
    return DepsContext(store_url=settings.store_url, publish_store=settings.publish_store or settings.store_url,
                       trust=settings.trust, sign_key_path=settings.sign_key, scope=settings.deps_scope,
                       images=dict(settings.deps_images))  # fmt: skip


def open_snapshotter(root: Path, backend: LayerBackend | None = None) -> Snapshotter:
    """The Snapshotter of ``root``; it locks the root (``ROOT/lock``), one daemon per root."""
    try:
        return Snapshotter(root, backend)
    except RootLocked as exc:
        raise StartupError(
            f"{exc}; two daemons must never share a root: stop the other one or choose another --root"
        ) from None
    except (SchemaTooNew, CorruptMetadata) as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        where = f" ({exc.filename!r})" if exc.filename and str(exc.filename) != str(root) else ""
        raise StartupError(f"cannot use root {str(root)!r}{where}: {exc.strerror or exc}") from None


def make_dirs(path: Path, mode: int) -> None:
    """Create ``path`` and its missing parents with ``mode``, not filtered by the umask."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    if not path.is_dir():
        raise StartupError(f"cannot create the socket's directory: {str(path)!r} exists and is not a directory")
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue
        except OSError as exc:
            raise StartupError(f"cannot create socket directory {str(directory)!r}: {exc.strerror}") from exc
        os.chmod(directory, mode)


class SocketClaim:
    """An exclusive ``flock`` on ``ADDRESS.lock`` while this daemon takes the socket path.

    Checking that a socket is free and binding it cannot be one system call, so the
    lock makes them one step: of two daemons started at once on one path, the second
    fails here at once, or, once the first serves, finds its live socket.  The lock
    covers the claim (check, restore, bind, rename), not the daemon's life: a daemon
    whose socket was unlinked from under it has lost the path, and a new one may take
    it (the old one's shutdown then leaves the new socket alone).  The file holds the
    claimant's pid for the message, and stays behind (unlinking it would let a third
    daemon lock a new file while a second still holds the old one).
    """

    def __init__(self, address: Path) -> None:
        self.path = address.with_name(address.name + ".lock")
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot open socket lock {str(self.path)!r}: {exc.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            self.release()
            raise StartupError(
                f"another {PROG} (pid {holder}) is starting on socket {str(address)!r} "
                f"(it holds {str(self.path)!r}); stop it first or choose another --address"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Let the next daemon claim the path; releasing twice is fine."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def check_socket_path(address: Path) -> None:
    """Refuse a path too long for a unix socket before anything is created."""
    if len(os.fsencode(address)) > SOCKET_PATH_MAX:
        raise StartupError(f"socket path {str(address)!r} is longer than the {SOCKET_PATH_MAX} bytes unix sockets allow")


def check_socket_free(address: Path) -> None:
    """Refuse a socket at ``address`` that a live process serves; a stale one is left to be replaced."""
    try:
        st = os.lstat(address)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError(f"cannot use socket path {str(address)!r}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{str(address)!r} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect(os.fspath(address))
        except ConnectionRefusedError:
            pass  # nobody listens: left over from a daemon that died
        except OSError as exc:
            raise StartupError(f"cannot tell whether {str(address)!r} is in use: {exc}") from exc
        else:
            raise StartupError(
                f"another process is serving on {str(address)!r}; stop it first or choose another --address"
            )
    log.info("replacing stale socket", address=str(address))


def listen(server: grpc.Server, address: Path) -> tuple[int, int]:
    """Bind ``server`` to the unix socket ``address``, created 0600; returns its (st_dev, st_ino).

    gRPC binds a private name beside ``address`` that is then renamed onto it: the
    rename replaces a stale socket atomically, and gRPC, which unlinks the path it
    bound when it stops, can then only unlink a name nobody else uses.
    """
    # Short, so a path that fits sun_path almost always has a private name that fits too.
    private = address.with_name(f".bs{uuid.uuid4().hex[:8]}")
    if len(os.fsencode(private)) > SOCKET_PATH_MAX:
        raise StartupError(
            f"socket path {str(address)!r} is too long: its temporary name {str(private)!r} passes the "
            f"{SOCKET_PATH_MAX} bytes unix sockets allow"
        )
    # The umask is process-wide; nothing else creates files while the daemon starts.
    previous = os.umask(SOCKET_UMASK)
    try:
        server.add_insecure_port(f"unix:{private}")
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {str(address)!r}: {exc}") from exc
    finally:
        os.umask(previous)
    try:
        st = os.lstat(private)
        os.rename(private, address)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(private)
        raise StartupError(f"cannot listen on {str(address)!r}: {exc.strerror}") from None
    return st.st_dev, st.st_ino


def remove_socket(address: Path, bound: tuple[int, int]) -> None:
    """Unlink ``address`` only if it still is the socket this daemon bound (device and inode)."""
    try:
        st = os.lstat(address)
        if (st.st_dev, st.st_ino) == bound:
            os.unlink(address)
        else:
            log.info("socket path now belongs to another socket; leaving it", address=str(address))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove socket", address=str(address), error=exc.strerror)


if __name__ == "__main__":
    sys.exit(main())
