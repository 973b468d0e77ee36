"""Plain values the snapshot logic hands to the gRPC service (and back)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime


class Kind(enum.IntEnum):
    """Snapshot kinds, numbered as containerd's ``Kind`` enum on the wire."""

    UNKNOWN = 0
    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3


@dataclass(frozen=True)
class Mount:
    """One mount as containerd's ``types.Mount``: what to pass to mount(2)."""

    type: str
    source: str
    options: tuple[str, ...] = ()
    target: str = ""


@dataclass(frozen=True)
class Info:
    name: str
    parent: str
    kind: Kind
    labels: dict[str, str] = field(default_factory=dict)
    created: datetime | None = None
    updated: datetime | None = None


@dataclass(frozen=True)
class Usage:
    size: int  #: bytes on disk
    inodes: int
