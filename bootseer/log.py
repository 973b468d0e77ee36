"""Structured logging for every BootSeer process.

Records carry key/value fields next to the message and are written as logfmt
(``time=... level=info msg="snapshot prepared" key=...``, the shape containerd's own
logs have) or as JSON lines.  Use :func:`get_logger` and pass fields as keyword
arguments::

    log = get_logger(__name__)
    log.info("snapshot prepared", key=key, parent=parent)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, MutableMapping

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_LOGGING_KWARGS = {"exc_info", "stack_info", "stacklevel", "extra"}


class FieldLogger(logging.LoggerAdapter):
    """A logger whose calls take key/value fields as keyword arguments."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in _LOGGING_KWARGS}
        extra = dict(kwargs.get("extra") or {})
        extra["fields"] = {**extra.get("fields", {}), **fields}
        kwargs["extra"] = extra
        return msg, kwargs


def get_logger(name: str) -> FieldLogger:
    return FieldLogger(logging.getLogger(name), {})


def _base_fields(record: logging.LogRecord) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    fields: dict[str, Any] = {
        "time": f"{stamp}.{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields.update(getattr(record, "fields", {}))
    return fields


def _logfmt_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\\\n\t'):
        return json.dumps(text)
    return text


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = _base_fields(record)
        if record.exc_info:
            fields["error"] = self.formatException(record.exc_info)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = _base_fields(record)
        if record.exc_info:
            fields["error"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


def setup_logging(level: str = "info", fmt: str = "text", stream: Any = None) -> None:
    """Route all logging to ``stream`` (stderr by default) in the chosen format."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
