"""Settings of the ``bootseer-snapshotter`` daemon: defaults, TOML file, command-line flags.

Precedence, lowest first: :data:`DEFAULTS`, the TOML file given with ``--config``,
then the flags.  The file takes the same keys as the flags (``root``, ``address``,
``log_level``, ``log_format``, ``metrics_address``); an unknown key or a value of
the wrong type is a :class:`ConfigError` that names the key, so a typo never leaves
a setting silently at its default.  ``ctr_examples/bootseer-snapshotter.toml``
documents every key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from bootseer.log import FORMATS, LEVELS
from bootseer.metrics import parse_address


class ConfigError(ValueError):
    """A setting is missing, unknown or invalid; the message names the key and its source."""


@dataclass(frozen=True)
class Config:
    root: Path  #: directory holding every snapshot and the metadata
    address: Path  #: unix socket containerd's ``proxy_plugins`` entry points at
    log_level: str = "info"
    log_format: str = "text"
    metrics_address: str = ""  #: ``HOST:PORT`` of the Prometheus endpoint; empty: off


DEFAULTS: dict[str, str] = {
    "root": "/var/lib/bootseer",
    "address": "/run/bootseer/snapshotter.sock",
    "log_level": "info",
    "log_format": "text",
    "metrics_address": "",
}

# Every key is a string today; the table stays so a future key of another type is one line.
KEY_TYPES: dict[str, type] = {key: str for key in DEFAULTS}


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse the TOML file at ``path`` and check its keys and value types."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc
    for key, value in table.items():
        if key not in KEY_TYPES:
            known = ", ".join(KEY_TYPES)
            raise ConfigError(f"config file {str(path)!r}: unknown key {key!r} (known keys: {known})")
        expected = KEY_TYPES[key]
        if not isinstance(value, expected):
            raise ConfigError(
                f"config file {str(path)!r}: key {key!r} must be a {_type_name(expected)}, "
                f"got {_type_name(type(value))} {value!r}"
            )
    return table


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
        flag = "--" + key.replace("_", "-")
        where = f"key {key!r} in the config file" if source[key] == "config file" else flag
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
    return Config(
        root=Path(merged["root"]).absolute(),
        address=Path(merged["address"]).absolute(),
        log_level=merged["log_level"],
        log_format=merged["log_format"],
        metrics_address=merged["metrics_address"],
    )


def _type_name(kind: type) -> str:
    """TOML's name for a Python type, as a user writing the file knows it."""
    names = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}
    return names.get(kind, kind.__name__)
