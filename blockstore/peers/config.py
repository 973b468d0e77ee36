"""A node's peer-sharing settings (``[peers]``, ``--peer-*``): the one definition, checked, and free of trio.

:class:`PeerConfig` is what the snapshotter's configuration file, the layer server's
options and the control client's :class:`~bootseer.blockstore.server.client.ServerSettings`
all hold; it imports neither trio nor anything that does, so the daemon and a control
client load it without the peer service.  Addresses are checked here too
(:func:`parse_address`), since a configuration names them.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, max_stored_length

if TYPE_CHECKING:  # the member lists use trio; this module must load without it
    from bootseer.blockstore.peers.membership import Membership

#: Tokens shorter than this are refused (a length, not a measure of randomness: make them random).
MIN_TOKEN_BYTES = 16
#: The window of an asking peer's ``fetch_budget``: its store bytes refill over this many seconds.
BUDGET_WINDOW = 10.0


def parse_address(text: str) -> str:
    """``HOST:PORT`` normalised (an IPv6 host in brackets), or ValueError naming what is wrong."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"peer address {text!r}: an IPv6 address is written [ADDR]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"peer address {text!r} is not HOST:PORT")
        if ":" in host:
            raise ValueError(f"peer address {text!r}: an IPv6 address is written [ADDR]:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {text!r}: port {port!r} is not a number from 1 to 65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not host or any(c.isspace() or c in "/@[]" for c in host) or ":" in host:
            raise ValueError(f"peer address {text!r}: {host!r} is neither an IP address nor a host name") from None
        return f"{host.lower()}:{int(port)}"
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def split_address(address: str) -> tuple[str, int]:
    """The host (without brackets) and port of a normalised address."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` names a loopback address (``localhost`` included)."""
    host, _ = split_address(parse_address(address))
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> str:
    """The token in ``path`` (one line of :data:`MIN_TOKEN_BYTES` to 4096 bytes; ValueError naming the file if
    unreadable or not such a line, never the token)."""
    try:
        with open(path, "rb") as file:
            data = file.read(4097)
    except OSError as exc:
        raise ValueError(f"peer token file {path}: {exc.strerror}") from None
    token = data.decode("utf-8", "replace").strip()
    if not token or len(data) > 4096 or any(c.isspace() for c in token):
        raise ValueError(f"peer token file {path}: must hold one token of {MIN_TOKEN_BYTES} to 4096 bytes "
                         "without spaces")  # fmt: skip
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise ValueError(f"peer token file {path}: the token is {len(token.encode())} bytes, fewer than the "
                         f"{MIN_TOKEN_BYTES} needed (make one with: openssl rand -hex 32)")  # fmt: skip
    return token


@dataclass(frozen=True)
class PeerConfig:
    """The ``[peers]`` settings (``bootseer layer-server --peer-*``); nothing is shared unless enabled."""

    listen: str | None = None  #: HOST:PORT this node serves blocks on
    advertise: str | None = None  #: this node's address as members list it (default: ``listen``)
    members: tuple[str, ...] = ()  #: a static list
    members_file: str | None = None  #: a file re-read when it changes
    members_dns: str | None = None  #: NAME:PORT: every A/AAAA record of NAME
    token_file: str | None = None  #: the group's shared token
    deadline: float = 0.5  #: seconds a peer may stay silent before the store is asked too
    upload_rate: int = 0  #: bytes per second served to peers in all (0: no limit)
    max_uploads: int = 8  #: blocks served at once (and got for peers at once)
    fetch_budget: int = 1 << 30  #: store bytes one asking peer may make this node fetch per BUDGET_WINDOW (0: no limit)
    max_connections: int = 1024  #: connections the listener keeps open (unauthenticated ones dropped first)
    fetch_concurrency: int = 16  #: requests to peers in flight at once
    skip_seconds: float = 10.0  #: how long a failing peer is skipped
    tls_cert: str | None = None  #: serve HTTPS with this certificate (PEM) ...
    tls_key: str | None = None  #: ... and its key
    ca: str | None = None  #: ask peers over HTTPS, trusting this CA (PEM)
    file_poll: float = 1.0  #: seconds between checks of ``members_file``
    dns_interval: float = 10.0  #: seconds between lookups of ``members_dns``

    @property
    def enabled(self) -> bool:
        return bool(self.listen or self.members or self.members_file or self.members_dns)

    def check(self) -> Membership:
        """The membership, checked; :class:`PeerConfigError` (one line, naming the setting) for settings that
        cannot work, a members file that cannot be read or a token file that holds no token."""
        sources = [bool(self.members), bool(self.members_file), bool(self.members_dns)]
        if sum(sources) > 1:
            raise PeerConfigError("members", "give one of members, members_file and members_dns")
        if not any(sources):
            raise PeerConfigError("members", "no members (give members, members_file or members_dns)")
        if not self.listen:
            raise PeerConfigError("listen", "HOST:PORT is needed: a member that does not serve loses its blocks")
        for name in ("listen", "advertise"):
            value = getattr(self, name)
            if value:
                try:
                    parse_address(value)
                except ValueError as exc:
                    raise PeerConfigError(name, str(exc)) from None
        if self.advertise is None and split_address(parse_address(self.listen))[0] in ("0.0.0.0", "::"):
            raise PeerConfigError("advertise", "is needed with a wildcard listen address (how members list this node)")
        if not is_loopback(self.listen) and not self.token_file:
            raise PeerConfigError("token_file", "is needed when listen is not a loopback address")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise PeerConfigError("tls_cert", "tls_cert and tls_key go together")
        if not 0 < self.deadline <= 60:
            raise PeerConfigError("deadline", f"must be more than 0 and at most 60 seconds, not {self.deadline}")
        if self.upload_rate < 0:
            raise PeerConfigError("upload_rate", f"must not be negative, not {self.upload_rate}")
        if self.max_uploads < 1:
            raise PeerConfigError("max_uploads", f"must be at least 1, not {self.max_uploads}")
        if self.fetch_budget < 0 or 0 < self.fetch_budget < max_stored_length(DEFAULT_BLOCK_SIZE):
            raise PeerConfigError("fetch_budget", f"must be 0 (no limit) or at least {max_stored_length(DEFAULT_BLOCK_SIZE)} "
                                  f"bytes (a block of the default size), not {self.fetch_budget}")  # fmt: skip
        if self.max_connections < 1:
            raise PeerConfigError("max_connections", f"must be at least 1, not {self.max_connections}")
        if self.fetch_concurrency < 1 or self.skip_seconds < 0:
            raise PeerConfigError("fetch_concurrency", "must be at least 1 (and skip_seconds not negative)")
        if self.token_file:
            try:
                read_token_file(self.token_file)
            except ValueError as exc:
                raise PeerConfigError("token_file", str(exc)) from None
        for name, path in (("tls_cert", self.tls_cert), ("tls_key", self.tls_key), ("ca", self.ca)):
            if path and not os.path.isfile(path):
                raise PeerConfigError(name, f"{path} is not a file")
        key = "members_file" if self.members_file else "members_dns" if self.members_dns else "members"
        try:
            membership = self.membership()
        except ValueError as exc:
            raise PeerConfigError(key, str(exc)) from None
        from bootseer.blockstore.peers.membership import StaticMembers

        if isinstance(membership, StaticMembers) and self.self_address not in membership.members():
            # A file or a DNS name may list this node later (a Slurm job's prolog, a pod not yet ready):
            # PeerService warns about those instead.
            how = "advertise" if self.advertise else "listen"
            raise PeerConfigError("members", f"this node ({self.self_address}, its {how} address) is not among them: "
                                             "list it, or give advertise as the members name it")  # fmt: skip
        return membership

    @property
    def self_address(self) -> str:
        return parse_address(self.advertise or self.listen or "")

    def membership(self) -> Membership:
        """The member list these settings name (imported here: the member lists use trio, this module does not)."""
        from bootseer.blockstore.peers.membership import DnsMembers, FileMembers, StaticMembers

        if self.members_file:
            return FileMembers(self.members_file, poll=self.file_poll)
        if self.members_dns:
            return DnsMembers.parse(self.members_dns, interval=self.dns_interval)
        return StaticMembers(tuple(self.members))


class PeerConfigError(ValueError):
    """A ``[peers]`` setting that cannot work: ``key`` names it (``str()`` is ``peers: KEY: why``)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"peers: {key}: {why}")
        self.key = key
        self.why = why


__all__ = ["BUDGET_WINDOW", "MIN_TOKEN_BYTES", "PeerConfig", "PeerConfigError", "is_loopback", "parse_address",
           "read_token_file", "split_address"]
