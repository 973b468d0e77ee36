"""``bootseer deps key|run|release|ls|prune|rm``: dependency snapshots from the command line.

* ``key [--prefix DIR | --base CHAINID] -- CMD...``: print the key of an install and
  every input that went into it (``--base``: the container mode, for the label
  ``containerd.io/snapshot/bootseer.deps=KEY``).
* ``run --prefix DIR [--store URL] [--publish-store URL] -- CMD...``: restore DIR from
  the store on a hit, else run CMD (which installs into DIR) and capture it.
* ``release DIR [--lazy]``: unmount a restored DIR.
* ``ls [--store URL]``: the store's snapshots, and this node's prefixes.
* ``prune --store URL [--older-than AGE] [--max-size SIZE]``, ``rm KEY --store URL``:
  remove deps records (the layers stay for the store's garbage collector).

Exit status: 0 done; the install's own status when it failed; 1 nothing there
(``rm``, ``release``); 2 bad input or failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bootseer.blockstore.node.block_cache import DEFAULT_CACHE_SIZE
from bootseer.fetch.sources import redact_url
from bootseer.paths import DEFAULT_DEPS_ROOT
from bootseer.units import parse_size

if TYPE_CHECKING:
    from .record import DepsRecord

EXIT_MISSING = 1
EXIT_ERROR = 2
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """Seconds from ``90``, ``30m``, ``12h``, ``7d``, ``2w``."""
    match = _AGE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid age {text!r} (examples: 30m, 12h, 7d)")
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]


def _command(args: argparse.Namespace) -> list[str]:
    argv = list(args.cmd)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("bootseer deps: give the install command after --")
    return argv


def _error(text: str) -> int:
    print(f"bootseer deps: {text}", file=sys.stderr)
    return EXIT_ERROR


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deps", help="dependency snapshots: install once, restore on every later start",
                                   description="Dependency snapshots: what an install step leaves behind, captured "
                                               "once as a layer and stacked under every later run.")  # fmt: skip
    commands = parser.add_subparsers(dest="deps_command", metavar="ACTION", required=True)
    store_default = os.environ.get("BOOTSEER_STORE") or None
    publish_default = os.environ.get("BOOTSEER_PUBLISH_STORE") or None
    scope_default = os.environ.get("BOOTSEER_DEPS_SCOPE") or ""

    key = commands.add_parser("key", help="print an install's key and its inputs")
    where = key.add_mutually_exclusive_group(required=True)
    where.add_argument("--prefix", metavar="DIR", help="bare metal: the directory the command installs into")
    where.add_argument("--base", metavar="CHAINID", help="containerd: the ChainID of the image's top layer")
    key.add_argument("--python", metavar="PATH", help="the interpreter the install runs with (default: found from CMD)")
    key.add_argument("--input", action="append", default=[], metavar="FILE", help="another file CMD reads (repeatable)")
    key.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="with --base: a variable of the container's environment (repeatable; this process's "
                          "environment does not count for a container)")  # fmt: skip
    key.add_argument("--scope", default=scope_default, metavar="NAME",
                     help="keep these snapshots apart from other scopes' (with --prefix: as `deps run --scope`; with "
                          "--base: the snapshotter's [depsnap] scope, to print the record's name); default "
                          "$BOOTSEER_DEPS_SCOPE")  # fmt: skip
    key.add_argument("--namespace", metavar="NS",
                     help="with --base: the containerd namespace the container runs in (prints the name of its record)")
    key.add_argument("--json", action="store_true", help="print JSON")
    key.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    key.set_defaults(func=key_command)

    run = commands.add_parser("run", help="restore DIR from a snapshot, or install into it and capture",
                              description="On a hit DIR becomes the installed environment (an overlay mount, "
                                          "served lazily; needs root); on a miss CMD runs (it must install into "
                                          "DIR; $BOOTSEER_DEPS_PREFIX holds it) and DIR's changes are captured.")  # fmt: skip
    run.add_argument("--prefix", required=True, metavar="DIR", help="the directory the command installs into")
    run.add_argument("--store", default=store_default, metavar="URL", help="the block store to read; default $BOOTSEER_STORE")
    run.add_argument("--publish-store", default=publish_default, metavar="URL",
                     help="writable store to publish to, where --store is read-only; default $BOOTSEER_PUBLISH_STORE")  # fmt: skip
    run.add_argument("--no-publish", action="store_true", help="restore on a hit, but never publish a capture")
    run.add_argument("--root", default=DEFAULT_DEPS_ROOT, help=f"this node's state and layer server ({DEFAULT_DEPS_ROOT})")
    run.add_argument("--cache-dir", metavar="DIR", help="the layer server's block cache (default ROOT/cache)")
    run.add_argument("--cache-size", type=parse_size, metavar="SIZE", help=f"block cache size ({DEFAULT_CACHE_SIZE >> 30}G)")
    run.add_argument("--python", metavar="PATH", help="the interpreter the install runs with (default: found from CMD)")
    run.add_argument("--input", action="append", default=[], metavar="FILE", help="another file CMD reads (repeatable)")
    run.add_argument("--scope", default=scope_default, metavar="NAME",
                     help="restore and publish only snapshots of this scope (a team, a project); default "
                          "$BOOTSEER_DEPS_SCOPE, else none")  # fmt: skip
    run.add_argument("--hotlist-profile", default="", metavar="NAME",
                     help="on a hit, the hot list of the job's reads to prefetch or record (default: the default one)")
    run.add_argument("--no-hotlist", action="store_true",
                     help="on a hit, neither prefetch nor record a hot list (when this run starts the layer server)")
    run.add_argument("--writer-key", action="append", default=[], metavar="FILE",
                     help="restore only a snapshot this node key (a .pub file) signed; repeatable (docs/trust.md)")  # fmt: skip
    run.add_argument("--converter-key", action="append", default=[], metavar="FILE",
                     help="for the layer server this starts: serve only conversions this key signed; repeatable")  # fmt: skip
    run.add_argument("--sign-key", metavar="FILE", help="this node's private key: signs the capture it publishes")
    run.add_argument("--no-image", dest="image", action="store_false",
                     help="publish the capture without its EROFS image (a restore then builds it from the index)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    run.set_defaults(func=run_command)

    rel = commands.add_parser("release", help="unmount a restored DIR (what the job wrote there is dropped)")
    rel.add_argument("prefix", metavar="DIR")
    rel.add_argument("--root", default=DEFAULT_DEPS_ROOT)
    rel.add_argument("--lazy", action="store_true", help="detach now even if a process still uses DIR")
    rel.set_defaults(func=release_command)

    ls = commands.add_parser("ls", help="the store's dependency snapshots and this node's prefixes")
    ls.add_argument("--store", default=publish_default or store_default, metavar="URL",
                    help="a listable store (a directory, s3://, hdfs://; not http)")  # fmt: skip
    ls.add_argument("--root", default=DEFAULT_DEPS_ROOT)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=ls_command)

    prune = commands.add_parser("prune", help="remove snapshots older than an age, or the oldest past a total size")
    prune.add_argument("--store", default=publish_default or store_default, required=not (publish_default or store_default),
                       metavar="URL", help="the writable store")  # fmt: skip
    prune.add_argument("--older-than", type=parse_age, metavar="AGE", help="captured longer ago than this (7d, 12h)")
    prune.add_argument("--max-size", type=parse_size, metavar="SIZE", help="keep the newest whose bytes add up to this")
    prune.add_argument("--dry-run", action="store_true", help="say what would go")
    prune.set_defaults(func=prune_command)

    rm = commands.add_parser("rm", help="remove one snapshot by key")
    rm.add_argument("key", metavar="KEY")
    rm.add_argument("--store", default=publish_default or store_default, required=not (publish_default or store_default),
                    metavar="URL", help="the writable store")  # fmt: skip
    rm.set_defaults(func=rm_command)


def key_command(args: argparse.Namespace) -> int:
    from .key import DepsKeyError, check_scope, compute_key, container_store_key

    argv = _command(args)
    if args.namespace is not None and not args.base:
        return _error("--namespace is for --base (a container's containerd namespace)")
    env = None
    if args.env:
        if args.prefix:
            return _error("--env is for --base (a container); on bare metal the environment is this process's")
        bad = [e for e in args.env if "=" not in e or e.startswith("=")]
        if bad:
            return _error(f"--env takes NAME=VALUE, not {bad[0]!r}")
        env = dict(e.split("=", 1) for e in args.env)
    try:
        key = compute_key(argv, prefix=args.prefix, base_chain=args.base, python=args.python, extra_files=args.input,
                          env=env, scope=args.scope if args.prefix else "")  # fmt: skip
        record_name = None
        if args.base and args.namespace is not None:
            scope = check_scope(args.scope) if args.scope else ""
            record_name = container_store_key(key.key, namespace=args.namespace, scope=scope)
    except DepsKeyError as exc:
        return _error(str(exc))
    if args.json:
        print(json.dumps({"key": key.key, "inputs": key.inputs, "record": record_name}, indent=1))
    else:
        print(key.describe())
        if record_name is not None:
            print(f"record {record_name} (namespace {args.namespace!r}, scope {args.scope!r}: the store's name for it)")
    return 0


def run_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.convert.layer_image import DEFAULT_INLINE_MAX
    from bootseer.blockstore.server.client import ServerSettings
    from bootseer.blockstore.objects.signing import KeyFileError
    from bootseer.hotlist.format import HotListError, check_profile

    from .key import DepsKeyError
    from .prefix import DepsError, run

    argv = _command(args)
    try:
        check_profile(args.hotlist_profile)
    except HotListError as exc:
        return _error(f"--hotlist-profile: {exc}")
    # Hot lists of the deps layer go where its captures go.
    settings = ServerSettings(store=args.store, cache_dir=args.cache_dir, cache_size=args.cache_size,
                              publish_store=args.publish_store, hotlist=not args.no_hotlist,
                              converter_keys=tuple(args.converter_key), writer_keys=tuple(args.writer_key),
                              sign_key=args.sign_key)  # fmt: skip
    try:
        outcome = run(argv, prefix=args.prefix, store=args.store, publish_store=args.publish_store, root=args.root,
                      python=args.python, extra_files=args.input, settings=settings, publish=not args.no_publish,
                      hotlist_profile=args.hotlist_profile, scope=args.scope,
                      inline_max=DEFAULT_INLINE_MAX if args.image else None)  # fmt: skip
    except (DepsKeyError, DepsError, KeyFileError) as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"{exc.filename or ''}: {exc.strerror or exc}")
    print(f"bootseer deps: {outcome.action} (key {outcome.key[:16]}): {outcome.detail}", file=sys.stderr)
    return outcome.status


def release_command(args: argparse.Namespace) -> int:
    from .prefix import DepsError, NodeRoot, release

    try:
        print(release(NodeRoot(args.root), Path(args.prefix).absolute(), lazy=args.lazy))
    except DepsError as exc:
        print(f"bootseer deps: {exc}", file=sys.stderr)
        return EXIT_MISSING if "nothing to release" in str(exc) else EXIT_ERROR
    return 0


def _records(store: str) -> list[tuple[str, Any]]:
    """(key, DepsRecord or error text) of every record in a listable store."""
    from bootseer.blockstore.objects.format import FormatError
    from bootseer.blockstore.objects.store import open_store_writer

    from .record import DEPS_PREFIX, DepsRecord, key_of_object

    out: list[tuple[str, Any]] = []
    with open_store_writer(store) as writer:
        for name in writer.list(DEPS_PREFIX):
            key = key_of_object(name)
            if key is None:
                continue
            data = writer.get(name)
            if data is None:
                continue
            try:
                out.append((key, DepsRecord.decode(data, expected_key=key)))
            except FormatError as exc:
                out.append((key, f"malformed: {exc}"))
    return out


def ls_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.objects.store import StoreError

    from .prefix import NodeRoot

    rows: list[dict[str, Any]] = []
    if args.store:
        try:
            for key, record in _records(args.store):
                if isinstance(record, str):
                    rows.append({"key": key, "error": record})
                else:
                    rows.append({"key": key, "mode": record.mode, "where": record.prefix or record.parent,
                                 "chain_id": record.chain_id, "files": record.files, "bytes": record.bytes,
                                 "captured_at": record.captured_at, "node": record.node, "command": record.command})  # fmt: skip
        except (StoreError, ValueError) as exc:
            return _error(f"--store {redact_url(args.store)}: {exc} (ls needs a listable store: a directory, s3://, hdfs://)")
    local = [vars(s) for s in NodeRoot(args.root).states()] if os.path.isdir(args.root) else []
    if args.json:
        print(json.dumps({"snapshots": rows, "prefixes": local}, indent=1))
        return 0
    for row in rows:
        if "error" in row:
            print(f"{row['key'][:16]}  {row['error']}")
        else:
            print(f"{row['key'][:16]}  {row['mode']:9}  {row['files']:7} files  {row['bytes'] / 2**20:9.1f} MiB  "
                  f"{row['captured_at']}  {row['where']}  {' '.join(row['command'])}")  # fmt: skip
    for state in local:
        print(f"local {state['state']:9} {state['prefix']}  key {state['key'][:16]}")
    return 0


def _captured_at(record: DepsRecord) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(record.captured_at)
    except (TypeError, ValueError):
        return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


def prune_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.objects.store import StoreError, open_store_writer

    from .record import deps_object

    if args.older_than is None and args.max_size is None:
        return _error("prune: give --older-than and/or --max-size")
    try:
        records = [(k, r) for k, r in _records(args.store) if not isinstance(r, str)]
        now = datetime.datetime.now(datetime.timezone.utc)
        newest_first = sorted(records, key=lambda kr: _captured_at(kr[1]), reverse=True)
        doomed: list[str] = []
        kept_bytes = 0
        for key, record in newest_first:
            age = (now - _captured_at(record)).total_seconds()
            too_old = args.older_than is not None and age > args.older_than
            too_big = args.max_size is not None and kept_bytes + record.bytes > args.max_size
            if too_old or too_big:
                doomed.append(key)
            else:
                kept_bytes += record.bytes
        with open_store_writer(args.store) as writer:
            for key in doomed:
                if not args.dry_run:
                    writer.remove(deps_object(key))
                print(f"{'would remove' if args.dry_run else 'removed'} {key}")
    except (StoreError, ValueError) as exc:
        return _error(f"prune: {exc}")
    print(f"{len(doomed)} removed, {len(records) - len(doomed)} kept ({kept_bytes / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


def rm_command(args: argparse.Namespace) -> int:
    from bootseer.blockstore.objects.store import StoreError, open_store_writer

    from .key import DepsKeyError, check_key
    from .record import deps_object

    try:
        key = check_key(args.key)
        with open_store_writer(args.store) as writer:
            removed = writer.remove(deps_object(key))
    except (DepsKeyError, StoreError, ValueError) as exc:
        return _error(f"rm: {exc}")
    if not removed:
        print(f"bootseer deps: no snapshot {key} in {redact_url(args.store)}", file=sys.stderr)
        return EXIT_MISSING
    print(f"removed {key}")
    return 0
