"""A shaped link for the benchmark: a network namespace on the far end of a veth pair.

The lazy-layers benchmark needs its servers (the registry and the store's nginx) behind
one link of a known rate, so that a pull and the lazy reads of a container cross the
same bottleneck.  This module makes that link: a named network namespace
(``ip netns add``), a veth pair with one end in it, link-local addresses on a ``/30``
(169.254.x.y, never routed anywhere), and a ``tbf`` qdisc at the same rate on both ends
(``sch_netem`` is not available here, so the link adds no delay of its own).

Unlike :mod:`netcap` (per-connection caps on a private namespace's loopback, for a
client and server that both live inside it), the clients here (containerd, the
snapshotter, its layer server) stay in the host's namespace and the servers move
into the new one: only the servers' processes are started through
:meth:`ShapedLink.launcher`.  Nothing but the veth pair is added to the host, and
:meth:`ShapedLink.close` removes the pair and the namespace even when the benchmark
failed; traffic goes only to the namespace's own address.

:class:`Lan` is the many-namespace form, for several nodes on one machine (the peer-node
harness, :mod:`tests.support.peernodes`, and ``bench/peers_bench.py``): a switch namespace
holding a bridge, each member a namespace of its own attached to it by a veth pair (its
link shaped with the same ``tbf`` when given a rate), all on one link-local ``/24``, and the
host attached by one unshaped pair so that the caller can reach every member.  Programs
run in a member through :meth:`LanMember.launcher` (``nsenter --net``): unlike ``ip netns
exec`` it leaves the mount namespace alone, so a FUSE mount a member's process makes is
the host's to read and to find at teardown.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

#: Where the /30s are carved from: IPv4 link-local, which no router forwards.
LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
#: 169.254.0.0/24 and 169.254.255.0/24 are reserved (RFC 3927) and never used.


_Self = TypeVar("_Self", bound="Opened")


class NetnsError(RuntimeError):
    """A step of making or removing the link failed; the message names the command."""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network already on an interface or in a route of the host."""
    used = []
    for line in _run("ip", "-4", "-o", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _run("ip", "-4", "route", "show", "table", "all").splitlines():
        first = line.split()[0] if line.split() else ""
        try:
            used.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue  # "default", "broadcast", "local" ...
    return used


def _free_subnet(seed: int, prefixlen: int = 30) -> ipaddress.IPv4Network:
    """A link-local network of ``prefixlen`` that overlaps nothing on this host (another benchmark's link
    included), never in the reserved first and last /24."""
    candidates = list(LINK_LOCAL.subnets(new_prefix=prefixlen))
    used = _used_networks()
    reserved = 2 ** (prefixlen - 24)  # how many of them fill a /24, skipped at each end
    usable = candidates[reserved:len(candidates) - reserved]
    for offset in range(len(usable)):
        subnet = usable[(seed + offset) % len(usable)]
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise NetnsError(f"no free 169.254.0.0/16 /{prefixlen} for the benchmark's link")


def _shape(prefix: tuple[str, ...], dev: str, rate: str) -> None:
    """A ``tbf`` qdisc at ``rate`` on ``dev`` (in the namespace ``prefix`` runs commands in)."""
    # tbf's bucket must hold the largest (GSO) packet a veth hands it, 64 KiB, and one
    # timer tick's worth at the rate; 1 MiB holds both at 1 Gbit/s and caps any
    # burst above the rate at 8 ms worth.
    _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1048576", "latency", "50ms")


class Opened:
    """A context manager over ``open()`` and ``close()``: entering opens (and closes what was made when that
    fails half-way), leaving closes, whatever happened in between."""

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Counters:
    """Bytes through the host's end of the link since it was made."""

    received: int  #: from the namespace to the host: what the clients downloaded
    sent: int  #: from the host to the namespace: requests, pushes

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.received - other.received, self.sent - other.sent)


class ShapedLink(Opened):
    """A namespace ``name`` reachable at :attr:`server_ip`, shaped to ``rate`` each way.

    A context manager: entering makes everything, leaving removes it.  ``rate`` is in tc's
    syntax (``1gbit``).
    """

    def __init__(self, rate: str = "1gbit", name: str | None = None) -> None:
        pid = os.getpid()
        self.name = name or f"bootseer-bench-{pid}"
        # Interface names are at most 15 bytes.
        self.host_if, self.ns_if = f"bsb{pid}h"[:15], f"bsb{pid}n"[:15]
        self.rate = rate
        subnet = _free_subnet(pid)
        hosts = list(subnet.hosts())
        self.prefixlen = subnet.prefixlen
        self.client_ip, self.server_ip = str(hosts[0]), str(hosts[1])
        self._made: list[str] = []

    def launcher(self) -> tuple[str, ...]:
        """The command prefix that runs a program inside the namespace."""
        return ("ip", "netns", "exec", self.name)

    def open(self) -> None:
        _run("ip", "netns", "add", self.name)
        self._made.append("netns")
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._made.append("veth")
        _run("ip", "link", "set", self.ns_if, "netns", self.name)
        inside = self.launcher()
        _run("ip", "addr", "add", f"{self.client_ip}/{self.prefixlen}", "dev", self.host_if)
        _run(*inside, "ip", "addr", "add", f"{self.server_ip}/{self.prefixlen}", "dev", self.ns_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run(*inside, "ip", "link", "set", self.ns_if, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        for prefix, dev in ((inside, self.ns_if), ((), self.host_if)):
            _shape(prefix, dev, self.rate)

    def counters(self) -> Counters:
        """The host end's byte counters (``/sys/class/net/IF/statistics``)."""
        stats = Path("/sys/class/net") / self.host_if / "statistics"
        return Counters(int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    def describe(self) -> str:
        """The qdiscs of both ends with their counters, for the record."""
        inside = subprocess.run([*self.launcher(), "tc", "-s", "qdisc", "show", "dev", self.ns_if],
                                capture_output=True, text=True).stdout
        outside = subprocess.run(["tc", "-s", "qdisc", "show", "dev", self.host_if],
                                 capture_output=True, text=True).stdout
        return f"server end ({self.ns_if}):\n{inside}client end ({self.host_if}):\n{outside}"

    def close(self) -> None:
        """Remove the pair and the namespace (each step tried even if one fails)."""
        errors = []
        if "veth" in self._made:
            done = subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, text=True)
            if done.returncode != 0 and "Cannot find device" not in done.stderr:
                errors.append(done.stderr.strip())
        if "netns" in self._made:
            done = subprocess.run(["ip", "netns", "del", self.name], capture_output=True, text=True)
            if done.returncode != 0:
                errors.append(done.stderr.strip())
        self._made.clear()
        if errors:
            raise NetnsError("; ".join(errors))


def _link_counters(namespace: str, dev: str) -> tuple[int, int]:
    """(received, sent) bytes of ``dev`` in network namespace ``namespace`` (``ip -s -j link``)."""
    stats = json.loads(_run("ip", "-n", namespace, "-s", "-j", "link", "show", "dev", dev))[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


@dataclass(frozen=True)
class LanMember:
    """One namespace on a :class:`Lan`: its interface ``eth0`` has address :attr:`ip`."""

    name: str  #: the namespace (``ip netns``)
    ip: str
    rate: str | None  #: the tbf rate of its link, both ways (None: unshaped)
    port: str  #: its veth end on the switch's bridge

    IFACE = "eth0"

    def launcher(self) -> tuple[str, ...]:
        """The command prefix that runs a program in this member's network namespace, and only that
        (``nsenter --net``: the mount namespace stays the caller's, see the module docstring)."""
        return ("nsenter", f"--net=/run/netns/{self.name}", "--")

    def counters(self) -> Counters:
        """Bytes through the member's own end of its link: ``sent`` is what it sent (its egress)."""
        received, sent = _link_counters(self.name, self.IFACE)
        return Counters(received=received, sent=sent)

    def pids(self) -> list[int]:
        """The processes in this member's network namespace now."""
        done = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30)
        return [int(word) for word in done.stdout.split() if word.isdigit()]


class LanError(NetnsError):
    """A step of making or removing the LAN failed."""


class Lan(Opened):
    """Network namespaces on one link-local ``/24`` behind a bridge: a context manager.

    ``tag`` makes the names unique on the host (default: this process's pid); the host gets
    :attr:`host_ip` on its one veth pair (unshaped), members get ``.10`` upwards in the
    order :meth:`add` makes them.  :meth:`close` (leaving the context) kills whatever
    still runs in a member's namespace (only this LAN's processes can be there), then
    removes every namespace and with them every veth pair, even after a failure.
    """

    SWITCH_BRIDGE = "br0"
    HOST_PORT = "host"
    FIRST_MEMBER = 10

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or str(os.getpid())
        self.switch = f"bootseer-lan{self.tag}-sw"
        self.host_if = f"bsl{self.tag}"[:15]
        subnet = _free_subnet(int(self.tag) if self.tag.isdigit() else abs(hash(self.tag)), prefixlen=24)
        self.subnet = subnet
        self.host_ip = str(subnet.network_address + 1)
        self.members: list[LanMember] = []
        self._made: list[str] = []

    def _switch(self) -> tuple[str, ...]:
        return ("ip", "-n", self.switch)

    def open(self) -> None:
        """The switch namespace, its bridge, and the host's pair onto it."""
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run(*self._switch(), "link", "add", self.SWITCH_BRIDGE, "type", "bridge")
        _run(*self._switch(), "link", "set", self.SWITCH_BRIDGE, "up")
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.HOST_PORT, "netns", self.switch)
        _run(*self._switch(), "link", "set", self.HOST_PORT, "master", self.SWITCH_BRIDGE, "up")
        _run("ip", "addr", "add", f"{self.host_ip}/{self.subnet.prefixlen}", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")

    def add(self, name: str, rate: str | None = None) -> LanMember:
        """A new namespace ``bootseer-lanTAG-NAME`` on the LAN, its link shaped to ``rate`` both ways if given."""
        number = len(self.members)
        ip = self.subnet.network_address + self.FIRST_MEMBER + number
        if ip >= self.subnet.broadcast_address:
            raise LanError(f"a /{self.subnet.prefixlen} holds no more than {number} members")
        member = LanMember(name=f"bootseer-lan{self.tag}-{name}", ip=str(ip), rate=rate, port=f"p{number}")
        _run("ip", "netns", "add", member.name)
        self._made.append(member.name)
        self.members.append(member)
        inside = ("ip", "-n", member.name)
        _run(*self._switch(), "link", "add", member.port, "type", "veth", "peer", "name", member.IFACE,
             "netns", member.name)
        _run(*self._switch(), "link", "set", member.port, "master", self.SWITCH_BRIDGE, "up")
        _run(*inside, "addr", "add", f"{member.ip}/{self.subnet.prefixlen}", "dev", member.IFACE)
        _run(*inside, "link", "set", member.IFACE, "up")
        _run(*inside, "link", "set", "lo", "up")
        if rate is not None:
            # The member's end shapes what it sends, the switch's end what it receives.
            _shape(("ip", "netns", "exec", member.name), member.IFACE, rate)
            _shape(("ip", "netns", "exec", self.switch), member.port, rate)
        return member

    def describe(self) -> str:
        """Every shaped link's qdiscs with their counters, for the record."""
        out = []
        for member in self.members:
            if member.rate is not None:
                out.append(f"{member.name} ({member.ip}):\n" + subprocess.run(
                    ["ip", "netns", "exec", member.name, "tc", "-s", "qdisc", "show", "dev", member.IFACE],
                    capture_output=True, text=True).stdout)
        return "".join(out)

    def close(self) -> None:
        """Kill what still runs in the members, remove every namespace (and so every pair); each step tried."""
        errors = []
        for member in self.members:
            if member.name not in self._made:
                continue
            for pid in member.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for name in reversed(self._made):
            done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if done.returncode != 0:
                errors.append(done.stderr.strip())
        self._made.clear()
        # The host's end goes with the switch namespace's; one left means the switch was never made.
        done = subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, text=True)
        if done.returncode != 0 and "Cannot find device" not in done.stderr:
            errors.append(done.stderr.strip())
        if errors:
            raise LanError("; ".join(errors))


def leftovers(tag: str) -> list[str]:
    """Namespaces and host interfaces a :class:`Lan` of ``tag`` would have made that exist now (test teardown)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found = [name for name in names if name.startswith(f"bootseer-lan{tag}-")]
    host_if = f"bsl{tag}"[:15]
    if Path("/sys/class/net", host_if).exists():
        found.append(f"interface {host_if}")
    return found
