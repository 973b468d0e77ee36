"""Who a node's peers are: a static list, a file re-read when it changes, or a DNS name.

Every node of a group must see the same members to agree on each block's owner
(rendezvous hashing over the members, :mod:`bootseer.blockstore.peers.ownership`), so the list
includes the node itself: it is left out only where a node would ask itself.  A
member is an address ``HOST:PORT`` (``[v6]:PORT`` for IPv6), compared as text after
normalisation, so every node must list a member the same way (the same IP, or the
same name): the way a member advertises itself (``--peer-advertise``) is the way the
list must name it.

* :class:`StaticMembers`: the list given on the command line or in the config.
* :class:`FileMembers`: one address per line, ``#`` comments, re-read whenever its
  mtime, size or inode changes (checked every ``poll`` seconds); an unreadable or
  malformed file keeps the last good list, with a warning.  This is the shape of a
  Slurm job's host list (``scontrol show hostnames``) or a ConfigMap mounted as a file.
* :class:`DnsMembers`: every A/AAAA record of a name, all at one port, re-resolved
  every ``interval`` seconds: a Kubernetes headless Service over the DaemonSet's
  pods resolves to every pod's IP.  A failed lookup keeps the last good list.

``members()`` never blocks; :meth:`run` (where there is something to watch) keeps
the list current in the nursery of the service that owns it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import trio

from bootseer.blockstore.peers.config import is_loopback, parse_address, split_address
from bootseer.log import get_logger

log = get_logger(__name__)

#: At most this many members are kept (a file or a DNS answer with more is cut, with a warning).
MAX_MEMBERS = 100_000
#: A membership file larger than this is refused (a line per member: 100k short lines fit).
MAX_FILE_BYTES = 8 << 20


class Membership(Protocol):
    """The current members, this node included (see the module docstring)."""

    def members(self) -> tuple[str, ...]: ...

    def describe(self) -> dict[str, str]: ...

    async def run(self) -> None:
        """Keep :meth:`members` current until cancelled (returns at once if nothing changes)."""


def _normalised(addresses: Iterable[str], what: str) -> tuple[str, ...]:
    out: dict[str, None] = {}
    for address in addresses:
        out[parse_address(address)] = None
        if len(out) >= MAX_MEMBERS:
            log.warning("too many peers; the rest are left out", source=what, kept=MAX_MEMBERS)
            break
    return tuple(sorted(out))


@dataclass
class StaticMembers:
    """A fixed list (ValueError at construction for a malformed address)."""

    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        self.addresses = _normalised(self.addresses, "static list")

    def members(self) -> tuple[str, ...]:
        return self.addresses

    def describe(self) -> dict[str, str]:
        return {"kind": "static", "members": str(len(self.addresses))}

    async def run(self) -> None:
        return


def read_members_file(path: str) -> tuple[str, ...]:
    """The addresses of a membership file (ValueError naming the line for a bad one, OSError if unreadable)."""
    with open(path, "rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    addresses = []
    for number, raw in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            try:
                addresses.append(parse_address(line))
            except ValueError as exc:
                raise ValueError(f"{path} line {number}: {exc}") from None
    return _normalised(addresses, path)


class FileMembers:
    """Members from a file, re-read when it changes (see the module docstring)."""

    def __init__(self, path: str, *, poll: float = 1.0) -> None:
        self.path = path
        self.poll = poll
        self._members: tuple[str, ...] = ()
        self._seen: tuple[int, int, int, int] | None = None
        self.reloads = 0
        self._reload(first=True)

    def members(self) -> tuple[str, ...]:
        return self._members

    def describe(self) -> dict[str, str]:
        return {"kind": "file", "path": self.path, "members": str(len(self._members))}

    def _reload(self, *, first: bool = False) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if first:
                raise ValueError(f"peers file {self.path}: {exc.strerror}") from None
            if self._seen is not None:
                log.warning("peers file is gone; keeping the last members", path=self.path, members=len(self._members))
                self._seen = None
            return
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen == self._seen:
            return
        self._seen = seen
        try:
            members = read_members_file(self.path)
        except (OSError, ValueError) as exc:
            if first:
                raise ValueError(f"peers file: {exc}") from None
            log.warning("peers file cannot be read; keeping the last members", path=self.path, error=str(exc))
            return
        if members != self._members:
            if not first:
                log.info("peers changed", path=self.path, members=len(members), was=len(self._members))
            self._members = members
            self.reloads += 1

    async def run(self) -> None:
        while True:
            await trio.sleep(self.poll)
            self._reload()


class DnsMembers:
    """Every A/AAAA record of ``name`` at ``port``, re-resolved every ``interval`` seconds."""

    def __init__(self, name: str, port: int, *, interval: float = 10.0) -> None:
        self.name = name
        self.port = port
        self.interval = interval
        self._members: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, **kwargs: float) -> DnsMembers:
        """From ``NAME:PORT`` (ValueError if malformed)."""
        address = parse_address(text)
        host, port = split_address(address)
        return cls(host, port, **kwargs)

    def members(self) -> tuple[str, ...]:
        return self._members

    def describe(self) -> dict[str, str]:
        return {"kind": "dns", "name": f"{self.name}:{self.port}", "members": str(len(self._members))}

    async def resolve(self) -> None:
        """Look the name up once; keep the last members if the lookup fails."""
        try:
            answers = await trio.socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("peers name does not resolve; keeping the last members", name=self.name, error=str(exc))
            return
        members = _normalised(
            ((f"[{a[4][0]}]:{self.port}" if a[0] == socket.AF_INET6 else f"{a[4][0]}:{self.port}") for a in answers),
            f"dns {self.name}",
        )
        if members != self._members:
            log.info("peers changed", name=self.name, members=len(members), was=len(self._members))
            self._members = members

    async def run(self) -> None:
        while True:
            await self.resolve()
            await trio.sleep(self.interval)


__all__ = [
    "DnsMembers",
    "FileMembers",
    "Membership",
    "StaticMembers",
    "read_members_file",
]
