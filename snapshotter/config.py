"""Settings of the ``bootseer-snapshotter`` daemon: defaults, TOML file, command-line flags.

Precedence, lowest first: :data:`DEFAULTS`, the TOML file given with ``--config``,
then the flags.  The file's top-level keys are the daemon's own (``root``,
``address``, ``log_level``, ``log_format``, ``metrics_address``); the lazy layers
take sections, as stargz-snapshotter's config.toml does: ``[store] url`` (and ``proxy``,
``proxy_ping_url``, ``proxy_check_interval``, ``proxy_block_size``, ``proxy_read_timeout``: an HTTP proxy http(s) stores
are read through, docs/lazy-layers.md; in the file only, never a flag, as its URL may hold credentials),
``[cache] dir, size``, ``[fetch] streams, retry_timeout, memory_limit`` and ``[hotlist]
enabled, publish_store, quiet, window, marker, prefetch_concurrency, prefetch_batch,
prefetch_cold_rate, prefetch_page_cache`` (the layer server's hot-list options, docs/hotlist.md) and ``[fuse]
metrics_address`` (the layer server's own Prometheus endpoint; empty: off) and ``data_path`` (``auto``,
``erofs``, ``loop`` or ``tree``: how the layer server gives overlayfs each layer's tree, docs/lazy-layers.md;
flag ``--data-path``), ``[trust]
converter_keys, writer_keys, sign_key`` (docs/trust.md), ``[depsnap] scope`` (the
scope of this node's dependency snapshots, docs/depsnap.md; flag ``--deps-scope``) and ``images`` (the node's
image -> deps key mapping, for Kubernetes pods, docs/kubernetes.md), and ``[peers]
listen, advertise, members, members_file, members_dns, token_file, deadline, upload_rate,
max_uploads, fetch_budget, max_connections, tls_cert, tls_key, ca`` (block sharing between nodes, docs/peers.md; off unless
``listen`` is set).  Inside the
program a section's key is dotted (``store.url``); the flags ``--store``, ``--cache-dir``,
``--cache-size``, ``--publish-store`` and ``--layer-server-metrics-address`` set five of them.  The daemon passes the
``[fetch]``, ``[hotlist]`` and ``[peers]`` settings to the layer server it starts, as its flags.  An unknown key or a value of the wrong type is a
:class:`ConfigError` that names the key, so a typo never leaves a setting silently at
its default.  ``ctr_examples/bootseer-snapshotter.toml`` documents every key.

With no ``store.url`` the daemon serves plain snapshots only, exactly as it did
before the lazy layers; the other sections then change nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from bootseer.blockstore.datapath.background_fill_config import BackgroundFillConfig
from bootseer.blockstore.datapath.event_holder import HOLE_WAIT
from bootseer.blockstore.datapath.fill_group import FILL_GROUP, check_fill_group
from bootseer.blockstore.node.block_cache import DEFAULT_CACHE_SIZE
from bootseer.blockstore.peers.config import PeerConfig, PeerConfigError
from bootseer.blockstore.objects.signing import KeyFileError, TrustPolicy
from bootseer.units import parse_size
from bootseer.fetch.engine import EngineConfig
from bootseer.fetch.sources import check_local_root, check_url, redact_url
from bootseer.fetch.sources.http_proxy import DEFAULT_BLOCK_SIZE, DEFAULT_CHECK_INTERVAL, DEFAULT_READ_TIMEOUT, ProxyConfig
from bootseer.hotlist.prefetch import PrefetchLimits
from bootseer.hotlist.recorder import RecordingLimits
from bootseer.log import FORMATS, LEVELS
from bootseer.metrics import parse_address
from bootseer.paths import DEFAULT_ROOT


class ConfigError(ValueError):
    """A setting is missing, unknown or invalid; the message names the key and its source."""


@dataclass(frozen=True)
class Config:
    root: Path  #: directory holding every snapshot and the metadata
    address: Path  #: unix socket containerd's ``proxy_plugins`` entry points at
    log_level: str = "info"
    log_format: str = "text"
    metrics_address: str = ""  #: ``HOST:PORT`` of the Prometheus endpoint; empty: off
    store_url: str = ""  #: where converted layers are; empty: no remote snapshots
    store_proxy: ProxyConfig | None = None  #: ``[store] proxy`` and its ``proxy_*`` keys; None: read the store direct
    cache_dir: Path | None = None  #: the node's block cache; None: ``ROOT/cache``
    cache_size: int = DEFAULT_CACHE_SIZE  #: bytes the block cache and the local blobs may hold together
    fetch_streams: int = 16  #: parallel range requests per store
    fetch_retry_timeout: float = EngineConfig.retry_timeout  #: seconds a failing fetch is retried before the read fails (EIO)
    fetch_memory_limit: int = EngineConfig.memory_limit  #: stripe bytes the layer server holds in memory per store
    #: ``[fetch] decode_threads``: the layer server's threads that decompress, hash and write blocks (0: one per CPU)
    fetch_decode_threads: int = 0
    hotlist_enabled: bool = True  #: record first boots and prefetch later ones
    publish_store: str = ""  #: writable store hot lists are written to; empty: the layers' store
    hotlist_recording: RecordingLimits = field(default_factory=RecordingLimits)  #: when a recording ends by itself
    hotlist_prefetch: PrefetchLimits = field(default_factory=PrefetchLimits)  #: how much a prefetch does at once
    layer_server_metrics_address: str = ""  #: ``HOST:PORT`` of the layer server's Prometheus endpoint; empty: off
    data_path: str = "auto"  #: ``[fuse] data_path``: auto, fanotify, erofs, loop or tree (the layer server's ``--data-path``)
    #: ``[datapath] hole_wait``: seconds a read of a hole on ``fanotify`` waits with no layer server before EIO
    hole_wait: float = HOLE_WAIT
    #: ``[datapath] fill_group``: raw bytes an event for a hole on ``fanotify`` fills at once (datapath.fill_group)
    fill_group: int = FILL_GROUP
    #: ``[datapath] background_fill``, ``background_fill_rate``, ``background_fill_idle``: the rest of each blob
    #: filled once the link is idle (blockstore.datapath.background_fill)
    background_fill: BackgroundFillConfig = field(default_factory=BackgroundFillConfig)
    converter_keys: tuple[Path, ...] = ()  #: ``[trust] converter_keys``: .pub files whose conversions are served
    writer_keys: tuple[Path, ...] = ()  #: ``[trust] writer_keys``: .pub files whose hot lists and deps records are used
    sign_key: Path | None = None  #: ``[trust] sign_key``: the node's private key (signs hot lists, deps captures)
    trust: TrustPolicy = field(default_factory=TrustPolicy)  #: the loaded ``converter_keys`` and ``writer_keys``
    deps_scope: str = ""  #: dependency snapshots are found and published only within this scope (and namespace)
    peers: PeerConfig = field(default_factory=PeerConfig)  #: ``[peers]``: block sharing with other nodes (off by default)
    #: ``[depsnap] images``: image reference or top ChainID -> deps key, for containers whose snapshot has no deps
    #: label (Kubernetes: CRI passes no pod annotation to a container's snapshot; docs/kubernetes.md)
    deps_images: dict[str, str] = field(default_factory=dict)

    @property
    def block_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.root / "cache"


#: ``[fetch] decode_threads`` at most.
MAX_DECODE_THREADS = 256

DEFAULTS: dict[str, Any] = {
    "root": DEFAULT_ROOT,
    "address": "/run/bootseer/snapshotter.sock",
    "log_level": "info",
    "log_format": "text",
    "metrics_address": "",
    "store.url": "",
    "store.proxy": "",
    "store.proxy_ping_url": "",
    "store.proxy_check_interval": DEFAULT_CHECK_INTERVAL,
    "store.proxy_block_size": DEFAULT_BLOCK_SIZE,
    "store.proxy_read_timeout": DEFAULT_READ_TIMEOUT,
    "cache.dir": "",
    "cache.size": f"{DEFAULT_CACHE_SIZE >> 30}G",
    "fetch.streams": 16,
    "fetch.decode_threads": 0,
    "fetch.retry_timeout": EngineConfig.retry_timeout,
    "fetch.memory_limit": EngineConfig.memory_limit,
    "hotlist.enabled": True,
    "hotlist.publish_store": "",
    "hotlist.quiet": RecordingLimits.quiet,
    "hotlist.window": RecordingLimits.window,
    "hotlist.marker": RecordingLimits.marker,
    "hotlist.prefetch_concurrency": PrefetchLimits.concurrency,
    "hotlist.prefetch_batch": PrefetchLimits.batch_bytes,
    "hotlist.prefetch_cold_rate": PrefetchLimits.cold_rate,
    "hotlist.prefetch_page_cache": PrefetchLimits.page_cache,
    "fuse.metrics_address": "",
    "fuse.data_path": "auto",
    "datapath.hole_wait": HOLE_WAIT,
    "datapath.fill_group": f"{FILL_GROUP >> 20}M",
    "datapath.background_fill": BackgroundFillConfig.enabled,
    "datapath.background_fill_rate": f"{BackgroundFillConfig.rate >> 20}M",
    "datapath.background_fill_idle": BackgroundFillConfig.idle,
    "trust.converter_keys": [],
    "trust.writer_keys": [],
    "trust.sign_key": "",
    "depsnap.scope": "",
    "peers.listen": "",
    "peers.advertise": "",
    "peers.members": [],
    "peers.members_file": "",
    "peers.members_dns": "",
    "peers.token_file": "",
    "peers.deadline": PeerConfig.deadline,
    "peers.upload_rate": PeerConfig.upload_rate,
    "peers.max_uploads": PeerConfig.max_uploads,
    "peers.fetch_budget": PeerConfig.fetch_budget,
    "peers.max_connections": PeerConfig.max_connections,
    "peers.tls_cert": "",
    "peers.tls_key": "",
    "peers.ca": "",
    "depsnap.images": {},
}

#: The TOML types each key accepts (an integer also serves where seconds are a float).
KEY_TYPES: dict[str, tuple[type, ...]] = {
    **{key: (str,) for key in DEFAULTS},
    "cache.size": (str, int),
    "store.proxy_check_interval": (float, int),
    "store.proxy_block_size": (str, int),
    "store.proxy_read_timeout": (float, int),
    "fetch.streams": (int,),
    "fetch.decode_threads": (int,),
    "fetch.retry_timeout": (float, int),
    "fetch.memory_limit": (str, int),
    "hotlist.enabled": (bool,),
    "hotlist.quiet": (float, int),
    "hotlist.window": (float, int),
    "hotlist.prefetch_concurrency": (int,),
    "hotlist.prefetch_batch": (str, int),
    "hotlist.prefetch_cold_rate": (str, int),
    "hotlist.prefetch_page_cache": (bool,),
    "datapath.hole_wait": (float, int),
    "datapath.fill_group": (str, int),
    "datapath.background_fill": (bool,),
    "datapath.background_fill_rate": (str, int),
    "datapath.background_fill_idle": (float, int),
    "trust.converter_keys": (list,),
    "trust.writer_keys": (list,),
    "peers.members": (list,),
    "peers.deadline": (float, int),
    "peers.upload_rate": (str, int),
    "peers.max_uploads": (int,),
    "peers.fetch_budget": (str, int),
    "peers.max_connections": (int,),
    "depsnap.images": (dict,),
}

#: The argparse destination of each key that has a flag.
FLAGS: dict[str, str] = {
    "root": "root",
    "address": "address",
    "log_level": "log_level",
    "log_format": "log_format",
    "metrics_address": "metrics_address",
    "store.url": "store",
    "cache.dir": "cache_dir",
    "cache.size": "cache_size",
    "hotlist.publish_store": "publish_store",
    "fuse.metrics_address": "layer_server_metrics_address",
    "fuse.data_path": "data_path",
    "datapath.fill_group": "fill_group",
    "trust.converter_keys": "converter_key",
    "trust.writer_keys": "writer_key",
    "trust.sign_key": "sign_key",
    "depsnap.scope": "deps_scope",
}

SECTIONS = ("store", "cache", "fetch", "hotlist", "fuse", "datapath", "trust", "depsnap", "peers")


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse the TOML file at ``path`` and check its keys and value types."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc
    flat: dict[str, Any] = {}
    for name, value in table.items():
        if name in SECTIONS and isinstance(value, dict):
            flat.update({f"{name}.{key}": item for key, item in value.items()})
        else:
            flat[name] = value
    for key, value in flat.items():
        if key not in KEY_TYPES:
            known = ", ".join(KEY_TYPES)
            raise ConfigError(f"config file {str(path)!r}: unknown key {key!r} (known keys: {known})")
        expected = KEY_TYPES[key]
        # bool is an int to Python, never to a TOML reader.
        if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
            raise ConfigError(
                f"config file {str(path)!r}: key {key!r} must be a {' or '.join(map(_type_name, expected))}, "
                f"got {_type_name(type(value))} {value!r}"
            )
    return flat


def resolve(file_settings: Mapping[str, Any], flag_settings: Mapping[str, Any | None]) -> Config:
    """Merge defaults, file and flags (a flag left as ``None`` was not given) and validate."""
    merged = dict(DEFAULTS)
    source = {key: "default" for key in DEFAULTS}
    for origin, settings in (("config file", file_settings), ("flag", flag_settings)):
        for key, value in settings.items():
            if value is not None:
                merged[key] = value
                source[key] = origin

    def invalid(key: str, why: str) -> ConfigError:
        """The refusal of ``key``, named as it was given: the flag, the config file's key, or (left at its
        default) the key to set, ``[peers] token_file``; never a flag that does not exist."""
        section, _, name = key.rpartition(".")
        setting = f"[{section}] {name}" if section else name
        flag = "--" + FLAGS[key].replace("_", "-") if key in FLAGS else ""
        if source[key] == "flag":
            where = flag
        elif source[key] == "config file":
            where = f"key {key!r} in the config file"
        else:
            where = f"{flag} / {setting}" if flag else setting
        return ConfigError(f"{where}: {why}")

    for key in ("root", "address"):
        if not merged[key]:
            raise invalid(key, "must not be empty")
    if merged["log_level"] not in LEVELS:
        raise invalid("log_level", f"must be one of {', '.join(LEVELS)}, not {merged['log_level']!r}")
    if merged["log_format"] not in FORMATS:
        raise invalid("log_format", f"must be one of {', '.join(FORMATS)}, not {merged['log_format']!r}")
    if merged["metrics_address"]:
        try:
            parse_address(merged["metrics_address"])
        except ValueError as exc:
            raise invalid("metrics_address", str(exc)) from None
    layer_server_metrics = merged["fuse.metrics_address"]
    if layer_server_metrics:
        try:
            parse_address(layer_server_metrics)
        except ValueError as exc:
            raise invalid("fuse.metrics_address", str(exc)) from None
        if layer_server_metrics == merged["metrics_address"]:
            raise invalid("fuse.metrics_address", f"is the daemon's own metrics_address ({layer_server_metrics}); give each its own port")
    from bootseer.blockstore.datapath.choice import DATA_PATHS

    if merged["fuse.data_path"] not in DATA_PATHS:
        raise invalid("fuse.data_path", f"must be one of {', '.join(DATA_PATHS)}, not {merged['fuse.data_path']!r}")
    if not 0 < float(merged["datapath.hole_wait"]) <= 86400:
        raise invalid("datapath.hole_wait", f"must be seconds in (0, 86400], not {merged['datapath.hole_wait']!r}")
    store_url = merged["store.url"]
    if store_url:
        try:
            check_url(store_url)
        except ValueError as exc:
            raise invalid("store.url", str(exc)) from None
    store_proxy = _store_proxy(merged, store_url, invalid)
    size = merged["cache.size"]
    try:
        cache_size = size if isinstance(size, int) else parse_size(size)
    except argparse.ArgumentTypeError as exc:
        raise invalid("cache.size", str(exc)) from None
    if cache_size <= 0:
        raise invalid("cache.size", f"must be positive, not {size!r}")
    if merged["fetch.streams"] < 1:
        raise invalid("fetch.streams", f"must be at least 1, not {merged['fetch.streams']}")
    if not 0 <= merged["fetch.decode_threads"] <= MAX_DECODE_THREADS:
        raise invalid("fetch.decode_threads", f"must be 0 (one per CPU) to {MAX_DECODE_THREADS}, "
                                              f"not {merged['fetch.decode_threads']}")  # fmt: skip
    if not merged["fetch.retry_timeout"] > 0:
        raise invalid("fetch.retry_timeout", f"must be positive seconds, not {merged['fetch.retry_timeout']}")
    limit = merged["fetch.memory_limit"]
    try:
        memory_limit = limit if isinstance(limit, int) else parse_size(limit)
    except argparse.ArgumentTypeError as exc:
        raise invalid("fetch.memory_limit", str(exc)) from None
    if memory_limit < EngineConfig.stripe_size:
        raise invalid("fetch.memory_limit", f"must hold at least one stripe ({EngineConfig.stripe_size >> 20}M), not {limit!r}")
    publish_store = merged["hotlist.publish_store"]
    if publish_store:
        if not store_url:
            raise invalid("hotlist.publish_store", "needs a store of layers ([store] url or --store) to publish beside")
        _check_writable(publish_store, lambda why: invalid("hotlist.publish_store", why))
    recording = RecordingLimits()
    for key, field_name in (("hotlist.quiet", "quiet"), ("hotlist.window", "window"), ("hotlist.marker", "marker")):
        value = merged[key] if key == "hotlist.marker" else float(merged[key])
        try:  # one key at a time, so the message names the key that is wrong
            recording = dataclasses.replace(recording, **{field_name: value})
        except ValueError as exc:
            raise invalid(key, f"{exc}, not {merged[key]!r}") from None
    prefetch = PrefetchLimits()
    for key, field_name in (
        ("hotlist.prefetch_concurrency", "concurrency"),
        ("hotlist.prefetch_batch", "batch_bytes"),
        ("hotlist.prefetch_cold_rate", "cold_rate"),
    ):
        value = merged[key]
        try:
            number = value if isinstance(value, int) else parse_size(value)
        except argparse.ArgumentTypeError as exc:
            raise invalid(key, str(exc)) from None
        try:
            prefetch = dataclasses.replace(prefetch, **{field_name: number})
        except ValueError as exc:
            raise invalid(key, f"{exc}, not {value!r}") from None
    prefetch = dataclasses.replace(prefetch, page_cache=merged["hotlist.prefetch_page_cache"])
    fill_group = merged["datapath.fill_group"]
    try:
        fill_group = check_fill_group(fill_group if isinstance(fill_group, int) else parse_size(fill_group))
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise invalid("datapath.fill_group", str(exc)) from None
    rate = merged["datapath.background_fill_rate"]
    try:
        rate = rate if isinstance(rate, int) else parse_size(rate)
    except argparse.ArgumentTypeError as exc:
        raise invalid("datapath.background_fill_rate", str(exc)) from None
    background_fill = BackgroundFillConfig(enabled=merged["datapath.background_fill"])
    for key, field_name, value in (("datapath.background_fill_rate", "rate", rate),
                                   ("datapath.background_fill_idle", "idle", float(merged["datapath.background_fill_idle"]))):
        try:
            background_fill = dataclasses.replace(background_fill, **{field_name: value})
        except ValueError as exc:
            raise invalid(key, str(exc)) from None
    key_files: dict[str, tuple[Path, ...]] = {}
    for key in ("trust.converter_keys", "trust.writer_keys"):
        if not all(isinstance(item, str) and item for item in merged[key]):
            raise invalid(key, "must be a list of public key file paths")
        key_files[key] = tuple(Path(item).absolute() for item in merged[key])
    try:
        trust = TrustPolicy.load(key_files["trust.converter_keys"], ())
    except KeyFileError as exc:
        raise invalid("trust.converter_keys", str(exc)) from None
    try:
        trust = dataclasses.replace(trust, writer_keys=TrustPolicy.load((), key_files["trust.writer_keys"]).writer_keys)
    except KeyFileError as exc:
        raise invalid("trust.writer_keys", str(exc)) from None
    sign_key = Path(merged["trust.sign_key"]).absolute() if merged["trust.sign_key"] else None
    if sign_key is not None:
        try:
            trust.load_sign_key(sign_key)  # refused now, not at the first publish
        except KeyFileError as exc:
            raise invalid("trust.sign_key", str(exc)) from None
    deps_scope = merged["depsnap.scope"]
    if deps_scope:
        from bootseer.depsnap.key import DepsKeyError, check_scope

        try:
            check_scope(deps_scope)
        except DepsKeyError as exc:
            raise invalid("depsnap.scope", str(exc)) from None
    peers = _peer_config(merged, invalid)
    deps_images = _deps_images(merged["depsnap.images"], invalid)
    root = Path(merged["root"]).absolute()
    return Config(
        root=root,
        address=Path(merged["address"]).absolute(),
        log_level=merged["log_level"],
        log_format=merged["log_format"],
        metrics_address=merged["metrics_address"],
        store_url=store_url,
        store_proxy=store_proxy,
        cache_dir=Path(merged["cache.dir"]).absolute() if merged["cache.dir"] else None,
        cache_size=cache_size,
        fetch_streams=merged["fetch.streams"],
        fetch_decode_threads=merged["fetch.decode_threads"],
        fetch_retry_timeout=float(merged["fetch.retry_timeout"]),
        fetch_memory_limit=memory_limit,
        hotlist_enabled=merged["hotlist.enabled"],
        publish_store=publish_store,
        hotlist_recording=recording,
        hotlist_prefetch=prefetch,
        layer_server_metrics_address=layer_server_metrics,
        data_path=merged["fuse.data_path"],
        hole_wait=float(merged["datapath.hole_wait"]),
        fill_group=fill_group,
        background_fill=background_fill,
        converter_keys=key_files["trust.converter_keys"],
        writer_keys=key_files["trust.writer_keys"],
        sign_key=sign_key,
        trust=trust,
        deps_scope=deps_scope,
        peers=peers,
        deps_images=deps_images,
    )


def _peer_config(merged: dict[str, Any], invalid: Callable[[str, str], ConfigError]) -> PeerConfig:
    """The ``[peers]`` section as a checked :class:`PeerConfig` (ConfigError naming the key)."""
    if not all(isinstance(item, str) and item for item in merged["peers.members"]):
        raise invalid("peers.members", "must be a list of \"HOST:PORT\" strings")
    rate = merged["peers.upload_rate"]
    try:
        upload_rate = rate if isinstance(rate, int) else parse_size(rate)
    except argparse.ArgumentTypeError as exc:
        raise invalid("peers.upload_rate", str(exc)) from None
    budget = merged["peers.fetch_budget"]
    try:
        fetch_budget = budget if isinstance(budget, int) else parse_size(budget)
    except argparse.ArgumentTypeError as exc:
        raise invalid("peers.fetch_budget", str(exc)) from None

    def path(key: str) -> str | None:
        return str(Path(merged[key]).absolute()) if merged[key] else None

    config = PeerConfig(
        listen=merged["peers.listen"] or None,
        advertise=merged["peers.advertise"] or None,
        members=tuple(merged["peers.members"]),
        members_file=path("peers.members_file"),
        members_dns=merged["peers.members_dns"] or None,
        token_file=path("peers.token_file"),
        deadline=float(merged["peers.deadline"]),
        upload_rate=upload_rate,
        max_uploads=merged["peers.max_uploads"],
        fetch_budget=fetch_budget,
        max_connections=merged["peers.max_connections"],
        tls_cert=path("peers.tls_cert"),
        tls_key=path("peers.tls_key"),
        ca=path("peers.ca"),
    )
    if config.enabled:
        try:
            config.check()
        except PeerConfigError as exc:
            raise invalid(f"peers.{exc.key}", exc.why) from None
    return config


def _deps_images(table: Mapping[str, Any], invalid: Callable[[str, str], ConfigError]) -> dict[str, str]:
    """``[depsnap] images`` checked: each image reference (or ``sha256:`` top ChainID) names a valid deps key."""
    from bootseer.depsnap.key import DepsKeyError, check_key

    images = {}
    for image, key in table.items():
        if not image or not isinstance(key, str):
            raise invalid("depsnap.images", f"{image!r} must map an image reference to a deps key (a string)")
        try:
            images[image] = check_key(key)
        except DepsKeyError as exc:
            raise invalid("depsnap.images", f"{image!r}: {exc}") from None
    return images


def check_local_stores(settings: Config) -> None:
    """ConfigError unless a local store of layers (a path, ``file://``) is an existing directory.

    The start-up check that looks at the disk (:func:`resolve` does not): a typo in a
    store path is refused, not read as a store in which nothing is converted.  (A
    publish store is written, and made, by the layer server: it need not exist yet.)
    """
    if settings.store_url:
        try:
            check_local_root(settings.store_url)
        except ValueError as exc:
            raise ConfigError(f"--store / [store] url: {exc}") from None


def _store_proxy(merged: Mapping[str, Any], store_url: str, invalid: Callable[[str, str], ConfigError]) -> ProxyConfig | None:
    """The checked ``[store] proxy*`` keys, None without ``proxy``; a ConfigError names the key that is wrong."""
    size = merged["store.proxy_block_size"]
    try:
        block_size = size if isinstance(size, int) else parse_size(size)
    except argparse.ArgumentTypeError as exc:
        raise invalid("store.proxy_block_size", str(exc)) from None
    settings = {
        "store.proxy_ping_url": ("ping_url", merged["store.proxy_ping_url"]),
        "store.proxy_check_interval": ("check_interval", float(merged["store.proxy_check_interval"])),
        "store.proxy_block_size": ("block_size", block_size),
        "store.proxy_read_timeout": ("read_timeout", float(merged["store.proxy_read_timeout"])),
    }
    proxy = merged["store.proxy"]
    if not proxy:
        defaults = {"ping_url": "", "check_interval": DEFAULT_CHECK_INTERVAL, "block_size": DEFAULT_BLOCK_SIZE,
                    "read_timeout": DEFAULT_READ_TIMEOUT}
        for key, (name, value) in settings.items():
            if value != defaults[name]:
                raise invalid(key, "needs [store] proxy")
        return None
    if not store_url:
        raise invalid("store.proxy", "needs a store of layers ([store] url or --store) to read through it")
    if check_url(store_url) not in ("http", "https"):
        raise invalid("store.proxy", f"only http(s) stores are read through a proxy; [store] url is {redact_url(store_url)!r}")
    try:
        config = ProxyConfig(proxy)
    except ValueError as exc:
        raise invalid("store.proxy", str(exc)) from None
    for key, (name, value) in settings.items():  # one key at a time, so the message names the key that is wrong
        try:
            config = dataclasses.replace(config, **{name: value})
        except ValueError as exc:
            raise invalid(key, str(exc)) from None
    return config


def server_proxy_settings(proxy: ProxyConfig | None) -> dict[str, Any]:
    """The ``ServerSettings`` fields that give the layer server ``proxy`` (its URL goes on a pipe, not in argv)."""
    if proxy is None:
        return {}
    return {"store_proxy": proxy.url, "store_proxy_ping_url": proxy.ping_url or None,
            "store_proxy_check_interval": proxy.check_interval, "store_proxy_block_size": proxy.block_size,
            "store_proxy_read_timeout": proxy.read_timeout}  # fmt: skip


def _check_writable(url: str, invalid: Callable[[str], ConfigError]) -> None:
    """Refuse a publish store that cannot be written (http(s)://, a bad URL), naming why.

    Only the URL is checked (no connection is made: the store may come up after the
    daemon); the layer server reports a store that fails when it publishes.
    """
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in ("http", "https"):
        raise invalid("an http(s) store is read-only; give the directory or bucket behind it")
    if scheme not in ("", "file", "s3", "hdfs"):
        raise invalid(f"unsupported store URL {redact_url(url)!r}: expected a path, file://, s3:// or hdfs://")
    try:
        check_url(url)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def _type_name(kind: type) -> str:
    """TOML's name for a Python type, as a user writing the file knows it."""
    names = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}
    return names.get(kind, kind.__name__)
