"""``bootseer layer-server``: the node's long-lived FUSE server of converted layers.

Started by the snapshotter daemon (``blockstore.server.client.ensure_server``) in a session
of its own, or by hand or a systemd unit.  Runs in the foreground until SIGTERM or
SIGINT (then it unmounts and exits 0) or until its mount is unmounted from outside.

Exit status: 0 after a clean stop; 2 for a bad option, a root another server holds,
a damaged table, a mountpoint that cannot be mounted on or a forced ``--data-path`` the
kernel cannot give; 1 for anything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import trio

from bootseer.blockstore.node.block_cache import check_cache_dir
from bootseer.blockstore.server.client import read_secret_file, read_setting_file
from bootseer.paths import ServerPaths
from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.datapath.choice import DATA_PATHS, FILESYSTEMS, DataPathUnavailable
from bootseer.blockstore.datapath.fill_group import check_fill_group
from bootseer.blockstore.objects.signing import KeyFileError, TrustPolicy
from bootseer.blockstore.server.layer_server import LayerServer, LayerServerConfig, ServerAlreadyRunning, run_server
from bootseer.units import parse_size
from bootseer.fetch.engine import EngineConfig
from bootseer.fetch.malloc import return_large_blocks
from bootseer.fetch.sources import carries_secret, check_local_root, check_url, redact_url
from bootseer.fetch.sources.http_proxy import DEFAULT_BLOCK_SIZE, DEFAULT_CHECK_INTERVAL, DEFAULT_READ_TIMEOUT, ProxyConfig
from bootseer.fuse import MountError
from bootseer.blockstore.peers.options import add_layer_server_arguments as add_peer_arguments, layer_server_peer_config
from bootseer.hotlist.cli import add_layer_server_arguments, layer_server_hotlist_config
from bootseer.hotlist.service import HotListService
from bootseer.log import get_logger
from bootseer.metrics import serve_metrics
from bootseer.paths import DEFAULT_ROOT

log = get_logger(__name__)

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, not {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "layer-server",
        help="serve converted image layers over FUSE (started by the snapshotter)",
        description=(
            "Serve converted image layers read-only over one FUSE mount at ROOT/layers/mnt, one directory "
            "per layer (overlayfs lower dirs), controlled on ROOT/layers/control.sock.  One per node; "
            "it outlives the snapshotter daemon and restores its layers after a restart."
        ),
        epilog="Sizes: 8M, 16MiB, 1G, 4096 (K, M, G, T and KiB, MiB... are powers of 1024; KB, MB... of 1000).",
    )
    parser.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR", help=f"the node's BootSeer root ({DEFAULT_ROOT})")
    parser.add_argument(
        "--settings-file", metavar="FILE",
        help="read settings from FILE, one JSON object: each key an option of this command without its dashes, "
             "its value what the option takes (a string or a number, true for a flag, a list for a repeatable "
             "option), e.g. {\"store\": \"https://user:pw@host/store\", \"cache-size\": \"8G\", \"no-hotlist\": true}. "
             "What the snapshotter starts the server with (on a pipe: credentials never reach the command line); "
             "an option set both here and on the command line is refused",
    )  # fmt: skip
    parser.add_argument("--store", metavar="URL", help="default store of layers (file://, s3://, http(s)://, hdfs://)")
    parser.add_argument(
        "--store-file", metavar="FILE",
        help="read --store from the first line of FILE: a URL with a credential (user:password@, ?token=) "
             "must not be on the command line, which every local user can read",
    )  # fmt: skip
    parser.add_argument(
        "--store-proxy", metavar="URL",
        help="read http(s) stores through this HTTP proxy (http://HOST:PORT: dfdaemon, squid, tinyproxy) while it "
             "is healthy, direct while it is not (docs/lazy-layers.md, 'Store proxy')",
    )  # fmt: skip
    parser.add_argument("--store-proxy-file", metavar="FILE",
                        help="read --store-proxy from the first line of FILE (a proxy URL with user:password@)")  # fmt: skip
    parser.add_argument("--store-proxy-ping-url", metavar="URL",
                        help="the proxy's health check: a GET of URL must answer 2xx (default: any answer of the proxy but "
                             "5xx and 407); a proxy that is down must also serve a range probe as the store does")  # fmt: skip
    parser.add_argument("--store-proxy-check-interval", type=_seconds, metavar="SECONDS",
                        help=f"seconds between health checks of the proxy ({DEFAULT_CHECK_INTERVAL:g})")  # fmt: skip
    parser.add_argument("--store-proxy-block-size", type=parse_size, metavar="SIZE",
                        help=f"range requests through the proxy ask for whole blocks of this grid "
                             f"({DEFAULT_BLOCK_SIZE >> 20}M)")  # fmt: skip
    parser.add_argument("--store-proxy-read-timeout", type=_seconds, metavar="SECONDS",
                        help=f"seconds a request of one block through the proxy may take, all of it; past it the read "
                             f"is done direct and the proxy set aside ({DEFAULT_READ_TIMEOUT:g})")  # fmt: skip
    parser.add_argument("--cache-dir", metavar="DIR", help="the node's block cache (ROOT/cache)")
    parser.add_argument("--cache-size", type=parse_size, default=LayerServerConfig.cache_size, metavar="SIZE",
                        help=f"bytes the block cache and the fanotify local blobs may hold together ({LayerServerConfig.cache_size >> 30}G)")
    parser.add_argument("--streams", type=_positive_int, metavar="N", help="parallel range requests per store (16)")
    parser.add_argument(
        "--retry-timeout", type=_seconds, metavar="SECONDS",
        help=f"retry a failing fetch this long, then fail the read with EIO ({EngineConfig.retry_timeout:g})",
    )  # fmt: skip
    parser.add_argument("--stripe-size", type=parse_size, metavar="SIZE", help="largest range request")
    parser.add_argument(
        "--memory-limit", type=parse_size, metavar="SIZE",
        help=f"stripe bytes held in memory, per store ({EngineConfig.memory_limit >> 20}M); the process's RSS follows it",
    )  # fmt: skip
    parser.add_argument("--metrics-address", metavar="HOST:PORT", help="serve Prometheus metrics on /metrics")
    parser.add_argument(
        "--shutdown-grace", type=_seconds, default=LayerServerConfig.shutdown_grace, metavar="SECONDS",
        help=f"on SIGTERM, how long requests in flight may take to finish ({LayerServerConfig.shutdown_grace:g})",
    )  # fmt: skip
    parser.add_argument("--converter-key", action="append", default=[], metavar="FILE",
                        help="serve only layers whose chain record this converter key (a .pub file) signed; repeatable")  # fmt: skip
    parser.add_argument("--writer-key", action="append", default=[], metavar="FILE",
                        help="prefetch only hot lists this node key (a .pub file) signed; repeatable")  # fmt: skip
    parser.add_argument("--sign-key", metavar="FILE", help="the node's private key: signs the hot lists it publishes")
    parser.add_argument(
        "--data-path", choices=DATA_PATHS, default=LayerServerConfig.data_path,
        help="how overlayfs gets a layer's tree: auto (the default: EROFS where the kernel has it, probed at "
             "start), erofs (file-backed EROFS over the layer's FUSE blob), loop (EROFS over loop devices), "
             "tree (the per-file FUSE tree; see docs/lazy-layers.md, 'Data paths'); "
             "a forced path the kernel cannot give refuses start-up",
    )  # fmt: skip
    parser.add_argument(
        "--hole-wait", type=_seconds, default=LayerServerConfig.hole_wait, metavar="SECONDS",
        help="fanotify data path: how long a read of a hole may wait with no layer server to answer it "
             f"before it fails with EIO (the event holder's bound; {LayerServerConfig.hole_wait:g})",
    )  # fmt: skip
    parser.add_argument("--fill-group", type=parse_size, default=LayerServerConfig.fill_group, metavar="SIZE",
                        help="fanotify data path: raw bytes of the blob an event for a hole fills at once, the read's "
                             f"blocks with their neighbours (0: only the read's; {LayerServerConfig.fill_group >> 20}M)")
    parser.add_argument("--decode-threads", type=_positive_int, default=None, metavar="N",
                        help="worker threads that decompress, hash and write fetched blocks, for every store together "
                             "(default: one per CPU the server may run on; fewer leave the job its cores)")
    parser.add_argument("--no-background-fill", action="store_true",
                        help="fanotify data path: never fill the rest of a layer's blob in the background (it is "
                             "filled, once the link has been idle a while, so that blobs complete)")  # fmt: skip
    parser.add_argument("--background-fill-rate", type=parse_size, default=BackgroundFillConfig.rate, metavar="SIZE",
                        help=f"stored bytes per second the background fill takes at most ({BackgroundFillConfig.rate >> 20}M)")
    parser.add_argument("--background-fill-idle", type=_seconds, default=BackgroundFillConfig.idle, metavar="SECONDS",
                        help=f"seconds without any fetch before the background fill starts ({BackgroundFillConfig.idle:g})")
    # A test seam (undocumented in --help): the kernel's filesystem list the data-path probe
    # reads, so a test can show a node without EROFS on a kernel that has it built in.
    parser.add_argument("--kernel-filesystems", default=FILESYSTEMS, metavar="FILE", help=argparse.SUPPRESS)
    add_layer_server_arguments(parser)  # --publish-store, --hotlist-*, --prefetch-* (bootseer.hotlist.cli)
    add_peer_arguments(parser)  # --peer-*, --peers* (bootseer.blockstore.peers.options)
    parser.set_defaults(func=layer_server_command, settings_parser=parser)


def _usage_error(message: str) -> int:
    print(f"bootseer layer-server: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _first_error(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _read_store_files(args: argparse.Namespace, from_document: set[str]) -> None:
    """Set ``args.store``/``args.publish_store`` from their ``--*-file`` flags; warn of a credential in argv
    (not of one in the settings document: ``from_document``, the dests it set)."""
    for name in ("store", "publish_store", "store_proxy"):
        flag, path = "--" + name.replace("_", "-"), getattr(args, f"{name}_file")
        if name in from_document:
            continue  # a document's URL is no command line's
        if path is not None:
            if getattr(args, name) is not None:
                raise ValueError(f"give {flag} or {flag}-file, not both")
            try:
                setattr(args, name, read_secret_file(path))
            except ValueError as exc:
                raise ValueError(f"{flag}-file: {exc}") from None
        elif getattr(args, name) and carries_secret(getattr(args, name)):
            log.warning(
                f"{flag} carries a credential on the command line, which every local user can read; "
                f"give it with {flag}-file instead", store=redact_url(getattr(args, name)),
            )  # fmt: skip


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options of ``bootseer layer-server`` a settings document may set, by name without dashes."""
    # argparse keeps its options in a list it does not name publicly; this is the one place that reads it.
    return {string[2:]: action for action in parser._actions for string in action.option_strings
            if string.startswith("--") and action.dest not in ("help", "settings_file")}  # fmt: skip


def _read_settings_document(args: argparse.Namespace, parser: argparse.ArgumentParser) -> set[str]:
    """Set ``args`` from the ``--settings-file`` document, each value through its option's own type and
    choices; the dests it set.  ValueError, one line naming the file and the key, for anything the
    command line would refuse."""
    path = args.settings_file
    try:
        document = json.loads(read_setting_file(path))
    except ValueError as exc:  # unreadable, too long, or not JSON
        raise ValueError(f"--settings-file: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError(f"--settings-file: {path} holds {type(document).__name__}, not a JSON object of settings")
    options = _options(parser)
    given = set()
    for key, value in document.items():
        action = options.get(key)
        if action is None:
            raise ValueError(f"--settings-file: unknown setting {key!r} (keys are the options of bootseer layer-server "
                             f"without their dashes)")  # fmt: skip
        default = parser.get_default(action.dest)
        if getattr(args, action.dest) != default:
            raise ValueError(f"--{key} is given both on the command line and in --settings-file")
        given.add(action.dest)
        if action.nargs == 0:  # a flag: --no-hotlist
            if not isinstance(value, bool):
                raise ValueError(f"--settings-file: {key}: want true or false, not {value!r}")
            setattr(args, action.dest, action.const if value else default)
            continue
        repeatable = isinstance(default, list)
        items = value if repeatable and isinstance(value, list) else [value]
        converted = []
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise ValueError(f"--settings-file: {key}: want a string or a number"
                                 f"{' (or a list of them)' if repeatable else ''}, not {item!r}")  # fmt: skip
            try:
                one = action.type(str(item)) if callable(action.type) else str(item)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                raise ValueError(f"--settings-file: {key}: {exc}") from None
            if action.choices is not None and one not in action.choices:
                raise ValueError(f"--settings-file: {key}: {one!r} is not one of {', '.join(map(str, action.choices))}")
            converted.append(one)
        setattr(args, action.dest, converted if repeatable else converted[0])
    return given


#: Options whose value is a URL that may carry a credential: shown redacted.
_URL_OPTIONS = frozenset({"store", "publish_store", "store_proxy", "store_proxy_ping_url"})


def _started_with(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The options that differ from their defaults, by name without dashes, URLs redacted: the status answer's."""
    shown: dict[str, Any] = {}
    for key, action in _options(parser).items():
        value = getattr(args, action.dest)
        if action.dest.endswith("_file") and action.dest.removesuffix("_file") in _URL_OPTIONS:
            continue  # where a URL was read from (a pipe): the URL itself is shown
        if value == parser.get_default(action.dest) or action.help == argparse.SUPPRESS:
            continue
        if action.dest in _URL_OPTIONS:
            value = redact_url(value)
        shown[key] = list(value) if isinstance(value, (list, tuple)) else value
    return shown


def _check_start_up(args: argparse.Namespace) -> None:
    """ValueError, one line naming the flag, for a store URL or a cache directory that cannot work."""
    for flag, url in (("--store", args.store), ("--publish-store", args.publish_store)):
        if url is not None:
            try:
                check_url(url)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
    if args.store is not None:
        try:
            check_local_root(args.store)  # a publish store is made by its first write: it may be missing
        except ValueError as exc:
            if not ServerPaths(Path(args.root)).table.exists():
                raise ValueError(f"--store: {exc}") from None
            # A restart must serve its saved layers from their local index copies, store or not.
            log.warning("the store is not there; restoring the saved layers without it", error=str(exc))
    try:
        check_cache_dir(args.cache_dir or os.path.join(args.root, "cache"))
    except ValueError as exc:
        raise ValueError(f"--cache-dir: {exc}") from None


def _store_proxy(args: argparse.Namespace) -> ProxyConfig | None:
    """The checked ``--store-proxy*`` settings, None without ``--store-proxy``; ValueError, one line naming the flag."""
    given = {
        "ping_url": args.store_proxy_ping_url,
        "check_interval": args.store_proxy_check_interval,
        "block_size": args.store_proxy_block_size,
        "read_timeout": args.store_proxy_read_timeout,
    }
    if args.store_proxy is None:
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"--store-proxy-{name.replace('_', '-')} needs --store-proxy")
        return None
    if args.store is not None and check_url(args.store) not in ("http", "https"):
        raise ValueError(f"--store-proxy: reads of http(s) stores only go through a proxy; --store is "
                         f"{redact_url(args.store)!r}")  # fmt: skip
    try:
        return ProxyConfig(args.store_proxy, **{name: value for name, value in given.items() if value is not None})
    except ValueError as exc:
        raise ValueError(f"--store-proxy: {exc}") from None


def layer_server_command(args: argparse.Namespace) -> int:
    """Run ``bootseer layer-server``; returns the exit status."""
    if os.geteuid() != 0:
        return _usage_error("the layer server mounts FUSE for overlayfs and must run as root")
    try:
        from_document = _read_settings_document(args, args.settings_parser) if args.settings_file else set()
        _read_store_files(args, from_document)
    except ValueError as exc:
        return _usage_error(str(exc))
    try:
        given = {
            name: getattr(args, name)
            for name in ("streams", "retry_timeout", "stripe_size", "memory_limit")
            if getattr(args, name) is not None
        }
        engine = EngineConfig(**given)
        if "stripe_size" in given and "memory_limit" not in given:
            engine = dataclasses.replace(engine, memory_limit=max(engine.memory_limit, engine.stripe_size))
    except (ValueError, TypeError) as exc:
        return _usage_error(str(exc))
    try:
        _check_start_up(args)
        proxy = _store_proxy(args)
    except ValueError as exc:
        return _usage_error(str(exc))
    if proxy is not None:
        log.info("reading http(s) stores through a proxy", proxy=proxy.display_url, ping_url=proxy.ping_url or None,
                 check_interval=proxy.check_interval, block_size=proxy.block_size,
                 read_timeout=proxy.read_timeout)  # fmt: skip
    config = LayerServerConfig(
        root=Path(args.root).resolve(),
        store=args.store,
        cache_dir=Path(args.cache_dir).resolve() if args.cache_dir else None,
        cache_size=args.cache_size,
        engine=engine,
        source_options={"proxy": proxy} if proxy is not None else {},
        shutdown_grace=args.shutdown_grace,
        data_path=args.data_path,
        hole_wait=args.hole_wait,
        fill_group=args.fill_group,
        decode_threads=args.decode_threads or 0,
        filesystems=args.kernel_filesystems,
        started_with=_started_with(args, args.settings_parser),
    )
    try:
        hotlist = layer_server_hotlist_config(args)
        config = dataclasses.replace(config, peers=layer_server_peer_config(args))
        check_fill_group(args.fill_group)
        if not args.hole_wait > 0:
            raise ValueError(f"--hole-wait must be a positive number of seconds, not {args.hole_wait:g}")
        config = dataclasses.replace(config, background_fill=BackgroundFillConfig(
            enabled=not args.no_background_fill, rate=args.background_fill_rate, idle=args.background_fill_idle))
    except ValueError as exc:
        return _usage_error(str(exc))
    try:
        trust = TrustPolicy.load(args.converter_key, args.writer_key)
        config = dataclasses.replace(config, trust=trust, sign_key=trust.load_sign_key(args.sign_key) if args.sign_key else None)
    except KeyFileError as exc:
        return _usage_error(str(exc))
    # Resident memory follows --memory-limit only if freed stripes leave the process
    # (glibc keeps them in its arenas otherwise: see bootseer.fetch.malloc).
    return_large_blocks()
    if args.metrics_address:
        try:
            host, port = serve_metrics(args.metrics_address)
        except (ValueError, OSError) as exc:
            return _usage_error(f"--metrics-address {args.metrics_address}: {exc}")
        log.info("serving metrics", address=f"{host}:{port}")

    def announce(server: LayerServer) -> None:
        # On stdout, for scripts that wait for the server.
        print(f"layer server ready on {server.paths.socket}", flush=True)

    status = 0
    try:
        trio.run(lambda: run_server(config, on_ready=announce, extension=lambda host: HotListService(host, hotlist)))
    except* (ServerAlreadyRunning, MountError, ValueError, DataPathUnavailable) as group:
        log.error("cannot start the layer server", root=str(config.root), error=str(_first_error(group)))
        status = EXIT_USAGE
    except* KeyboardInterrupt:
        status = 130  # only before the mount exists: once mounted, SIGINT unmounts cleanly
    if status == 0:
        log.info("layer server stopped", root=str(config.root))
    return status
