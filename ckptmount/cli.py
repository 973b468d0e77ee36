"""``bootseer ckpt ...`` subcommands: ``bootseer ckpt mount SOURCE MOUNTPOINT`` and ``bootseer ckpt digest PATH_OR_URL...``.

``mount`` exit status: 0 after a clean unmount (``umount``, SIGTERM, SIGINT); 2 for a bad
option or a mountpoint that cannot be mounted on; 1 when the source cannot be read
at mount time.  Nothing stays mounted after any of them.

``digest`` writes each file's digest list beside it (:func:`bootseer.fetch.api.write_digests`);
exit status 0 if every list was written, 2 for a bad option, 1 if any file failed (the others are
still done; a list that was not written leaves the old one, if any, as it was).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Any
from urllib.parse import urlsplit

import trio

from bootseer.ckptmount.mount import SourceUnavailable, mount_checkpoint
from bootseer.fetch.api import write_digests
from bootseer.fetch.digests import DEFAULT_CHUNK_SIZE, check_chunk_size, sibling_url
from bootseer.fetch.digests import SUFFIX as DIGESTS_SUFFIX
from bootseer.fetch.malloc import return_large_blocks
from bootseer.fetch.engine import EngineConfig, display_url
from bootseer.fetch.source import RangeSource, SourceError
from bootseer.fetch.sources import open_source, redact_url, source_class, source_options
from bootseer.fuse import MountError, check_mountpoint
from bootseer.log import get_logger
from bootseer.metrics import serve_metrics

log = get_logger(__name__)

from bootseer.units import parse_size  # noqa: E402  (``--stripe-size`` and friends)

EXIT_USAGE = 2
EXIT_FAILURE = 1

def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


def _positive_int(text: str) -> int:
    return _count(text, 1)


def _non_negative_int(text: str) -> int:
    return _count(text, 0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or any(c in name for c in " \t\r\n") or "\n" in value or "\r" in value:
        raise argparse.ArgumentTypeError(f"invalid header {text!r} (expected 'Name: value')")
    return name.strip(), value.strip()


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"invalid setting {text!r} (expected KEY=VALUE)")
    return key.strip(), value


# EngineConfig fields set from options of the same name; left unset, the engine's
# own defaults apply.
_ENGINE_OPTIONS = [field.name for field in dataclasses.fields(EngineConfig)]

# Backend options: argparse dest -> (open_source option, URL schemes it applies to;
# None for any backend that accepts the option).
_BACKEND_OPTIONS: dict[str, tuple[str, frozenset[str] | None]] = {
    "http_header": ("headers", frozenset({"http", "https", "webhdfs", "swebhdfs"})),
    "s3_endpoint_url": ("endpoint_url", frozenset({"s3"})),
    "s3_region": ("region", frozenset({"s3"})),
    "s3_profile": ("profile", frozenset({"s3"})),
    "s3_addressing_style": ("addressing_style", frozenset({"s3"})),
    "webhdfs_user": ("user", frozenset({"webhdfs", "swebhdfs"})),
    "hdfs_config": ("config", frozenset({"hdfs"})),
    "hdfs_kerberos_principal": ("kerberos_principal", frozenset({"hdfs"})),
    "hdfs_kerberos_keytab": ("kerberos_keytab", frozenset({"hdfs"})),
    "hdfs_kerberos_cache": ("kerberos_cache", frozenset({"hdfs"})),
    "connect_timeout": ("connect_timeout", None),
    "read_timeout": ("read_timeout", None),
    "ca_file": ("ca_file", None),
    "verify": ("verify", None),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-") if dest != "verify" else "--no-verify-tls"


def backend_options(args: argparse.Namespace, url: str | None = None) -> dict[str, Any]:
    """``open_source`` options from the command line for ``url`` (default: ``args.source``); ValueError for
    one that does not apply to the source's kind."""
    url = args.source if url is None else url
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    accepted = source_options(source_class(url))
    options: dict[str, Any] = {}
    for dest, (option, schemes) in _BACKEND_OPTIONS.items():
        value = getattr(args, dest)
        if value is None or value == []:
            continue
        if (schemes is not None and scheme not in schemes) or option not in accepted:
            kind = f"{scheme}://" if scheme else "local"
            raise ValueError(f"{_flag(dest)} does not apply to {kind} sources")
        options[option] = dict(value) if isinstance(value, list) else value
    return options


def _human_size(size: int) -> str:
    for unit, power in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << power and size % (1 << power) == 0:
            return f"{size >> power}{unit}"
    return str(size)


def _engine_defaults() -> dict[str, str]:
    """The engine's defaults, as help text shows them (read from EngineConfig, so they never drift)."""
    shown = {}
    for item in dataclasses.fields(EngineConfig):
        value = item.default
        shown[item.name] = _human_size(value) if item.name.endswith(("_size", "_max", "_limit")) else str(value)
    return shown


def add_backend_options(parser: argparse.ArgumentParser) -> None:
    """The options of the storage backends (what :func:`backend_options` reads)."""
    backend = parser.add_argument_group("backends")
    backend.add_argument(
        "--http-header", type=_header, action="append", default=[], metavar="'NAME: VALUE'",
        help="extra HTTP request header for http(s):// and webhdfs:// (repeatable)",
    )
    backend.add_argument("--s3-endpoint-url", metavar="URL", help="S3-compatible endpoint (MinIO, Ceph RGW)")
    backend.add_argument("--s3-region", metavar="REGION")
    backend.add_argument("--s3-profile", metavar="PROFILE", help="AWS profile for credentials")
    backend.add_argument("--s3-addressing-style", choices=("path", "virtual", "auto"))
    backend.add_argument("--webhdfs-user", metavar="USER", help="user.name for WebHDFS requests")
    backend.add_argument(
        "--hdfs-config", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
        help="Hadoop client setting, e.g. dfs.nameservices=ns1 (repeatable; HADOOP_CONF_DIR is read too)",
    )
    backend.add_argument("--hdfs-kerberos-principal", metavar="PRINCIPAL")
    backend.add_argument("--hdfs-kerberos-keytab", metavar="PATH")
    backend.add_argument("--hdfs-kerberos-cache", metavar="PATH", help="Kerberos credential cache")
    backend.add_argument("--connect-timeout", type=_seconds, metavar="SECONDS", help="per connection attempt")
    backend.add_argument("--read-timeout", type=_seconds, metavar="SECONDS", help="per request")
    backend.add_argument("--ca-file", metavar="PATH", help="CA bundle for TLS")
    backend.add_argument(
        "--no-verify-tls", dest="verify", action="store_const", const=False, help="do not check TLS certificates"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    ckpt = subparsers.add_parser(
        "ckpt", help="striped checkpoint mount, digest lists", description="Striped checkpoint mount and digest lists."
    )
    ckpt.set_defaults(func=lambda args: ckpt.print_help() or EXIT_USAGE)
    commands = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND")
    mount = commands.add_parser(
        "mount",
        help="mount a checkpoint source read-only",
        description=(
            "Mount SOURCE (hdfs://, webhdfs://, s3://, http(s)://, file:// or a local path) read-only on "
            "MOUNTPOINT, reading files with parallel striped range requests.  Runs in the foreground "
            "until unmounted (umount, fusermount3 -u, SIGTERM or SIGINT); prints "
            "'mounted SOURCE at MOUNTPOINT' once ready."
        ),
        epilog="Sizes: 8M, 16MiB, 1G, 4096 (K, M, G, T and KiB, MiB... are powers of 1024; KB, MB... of 1000).",
    )
    mount.add_argument("source", metavar="SOURCE")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT")
    mount.add_argument("--foreground", action="store_true", help="run in the foreground (always the case)")

    defaults = _engine_defaults()
    engine = mount.add_argument_group("fetch engine")
    engine.add_argument(
        "--stripe-size", type=parse_size, metavar="SIZE", help=f"bytes per range request ({defaults['stripe_size']})"
    )
    engine.add_argument(
        "--streams", type=_positive_int, metavar="N", help="parallel range requests (the backend's default, 16)"
    )
    engine.add_argument(
        "--readahead-max", type=parse_size, metavar="SIZE",
        help=f"largest read-ahead window of one open file ({defaults['readahead_max']})",
    )
    engine.add_argument(
        "--memory-limit", type=parse_size, metavar="SIZE",
        help=f"fetched bytes held in memory, all files together ({defaults['memory_limit']})",
    )
    engine.add_argument(
        "--max-windows", type=_non_negative_int, metavar="N",
        help=f"open files that may read ahead at once; 0: no read-ahead ({defaults['max_windows']})",
    )
    engine.add_argument(
        "--retry-timeout", type=_seconds, metavar="SECONDS",
        help=f"retry a failing range this long, then fail the read with EIO ({defaults['retry_timeout']})",
    )
    engine.add_argument("--cache-dir", metavar="DIR", help="on-disk cache of fetched stripes (off)")
    engine.add_argument(
        "--cache-size", type=parse_size, metavar="SIZE", help=f"on-disk cache size ({defaults['cache_size']})"
    )

    serving = mount.add_argument_group("mount")
    serving.add_argument(
        "--listing-ttl", type=_seconds, default=10.0, metavar="SECONDS",
        help="how long directory listings and attributes are cached (10)",
    )
    serving.add_argument("--metrics-address", metavar="HOST:PORT", help="serve Prometheus metrics on /metrics")
    serving.add_argument(
        "--allow-other", action="store_true",
        help="let every local user read the mount (off: only the user who mounts; the files were fetched with "
        "that user's credentials). Needs root or user_allow_other in /etc/fuse.conf",
    )  # fmt: skip

    add_backend_options(mount)
    mount.set_defaults(func=mount_command)

    digest = commands.add_parser(
        "digest",
        help="write the digest list of checkpoint files",
        description=(
            "Read each file (a local/NFS path, file://, s3://; the store's own data, through the striped fetch "
            "engine), hash it in chunks and store its digest list beside it as NAME.bootseer-digests: SHA-256 "
            "per chunk, with the file's size and version as the store reports them.  Run it after a save: "
            "reads through the checkpoint mount and bootseer.fetch then verify every chunk they serve.  Prints "
            "one line per list written."
        ),
        epilog="Sizes: 4M, 1MiB ... (powers of 1024).  Lists are written to local/NFS paths and S3 only.",
    )
    digest.add_argument("paths", metavar="PATH_OR_URL", nargs="+")
    digest.add_argument(
        "--chunk-size", type=parse_size, default=DEFAULT_CHUNK_SIZE, metavar="SIZE",
        help=f"bytes per digest, a power of two from 64K to 64M, dividing the mount's stripe size "
        f"({_human_size(DEFAULT_CHUNK_SIZE)})",
    )  # fmt: skip
    digest.add_argument(
        "--streams", type=_positive_int, metavar="N", help="parallel range requests (the backend's default, 16)"
    )
    add_backend_options(digest)
    digest.set_defaults(func=digest_command)


def _first_error(group: BaseExceptionGroup) -> str:
    """The message of the first exception in ``group`` (nurseries nest their groups)."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return str(error)


def _usage_error(message: str, command: str = "mount") -> int:
    print(f"bootseer ckpt {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def digest_command(args: argparse.Namespace) -> int:
    """Run ``bootseer ckpt digest``; returns the exit status."""
    try:
        check_chunk_size(args.chunk_size)
        config = EngineConfig(streams=args.streams)
        options = {path: backend_options(args, path) for path in args.paths}
    except ValueError as exc:
        return _usage_error(str(exc), "digest")
    status = 0
    for path in args.paths:
        try:
            digests = write_digests(path, chunk_size=args.chunk_size, config=config, **options[path])
        except (ValueError, SourceError, OSError) as exc:
            log.error("digest list not written", path=redact_url(path), error=str(exc))
            status = EXIT_FAILURE
            continue
        print(f"{redact_url(path)}{DIGESTS_SUFFIX}: {len(digests.digests)} chunks of {digests.chunk_size} bytes, "
              f"{digests.size} bytes, version {digests.version or '(none)'}", flush=True)  # fmt: skip
    return status


async def _mount_and_announce(
    source: RangeSource, mountpoint: str, config: EngineConfig, listing_ttl: float, allow_other: bool,
    digest_source: RangeSource | None,
) -> None:  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(
                mount_checkpoint, source, mountpoint, config=config, listing_ttl=listing_ttl, allow_other=allow_other,
                digest_source=digest_source,
            )
        )
        # On stdout, for scripts that wait for the mount to be ready.
        print(f"mounted {display_url(source)} at {mountpoint}", flush=True)


def mount_command(args: argparse.Namespace) -> int:
    """Run ``bootseer ckpt mount``; returns the exit status."""
    try:
        # Options the mount has no flag for (coalesce_gap: extents only) keep the engine's default.
        given = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name, None) is not None}
        config = EngineConfig(**given)
        options = backend_options(args)
        check_mountpoint(args.mountpoint)
        source = open_source(args.source, **options)
    except (ValueError, TypeError, SourceError, MountError) as exc:
        return _usage_error(str(exc))
    # Where the digest list of a source that is one file lies (a directory's files have theirs beside them).
    digest_url = sibling_url(args.source)
    try:
        digest_source = open_source(digest_url, **options) if digest_url is not None else None
    except (ValueError, SourceError) as exc:
        log.info("no digest list will be looked up beside the source", error=str(exc))
        digest_source = None
    # Resident memory follows --memory-limit only if freed stripes leave the process.
    return_large_blocks()
    status = 0
    try:
        if args.metrics_address:
            try:
                host, port = serve_metrics(args.metrics_address)
            except (ValueError, OSError) as exc:
                return _usage_error(f"--metrics-address {args.metrics_address}: {exc}")
            log.info("serving metrics", address=f"{host}:{port}")
        trio.run(_mount_and_announce, source, args.mountpoint, config, args.listing_ttl, args.allow_other,
                 digest_source)  # fmt: skip
    except* MountError as group:
        log.error("cannot mount", mountpoint=args.mountpoint, error=_first_error(group))
        status = EXIT_USAGE
    except* SourceUnavailable as group:
        log.error("cannot mount", mountpoint=args.mountpoint, error=_first_error(group))
        status = EXIT_FAILURE
    except* KeyboardInterrupt:
        # Only before the mount exists: once mounted, SIGINT unmounts cleanly.
        status = 130
    finally:
        source.close()
        if digest_source is not None:
            digest_source.close()
    return status
