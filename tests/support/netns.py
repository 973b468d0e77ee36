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
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Where the /30s are carved from: IPv4 link-local, which no router forwards.
LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
#: /30s in a /24: 169.254.0.0/24 and 169.254.255.0/24 are reserved (RFC 3927) and skipped.
SUBNETS_PER_24 = 64


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


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A link-local /30 that overlaps nothing on this host (another benchmark's link included)."""
    candidates = list(LINK_LOCAL.subnets(new_prefix=30))
    used = _used_networks()
    usable = candidates[SUBNETS_PER_24:-SUBNETS_PER_24]
    for offset in range(len(usable)):
        subnet = usable[(seed + offset) % len(usable)]
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise NetnsError("no free 169.254.0.0/16 /30 for the benchmark's link")


@dataclass(frozen=True)
class Counters:
    """Bytes through the host's end of the link since it was made."""

    received: int  #: from the namespace to the host: what the clients downloaded
    sent: int  #: from the host to the namespace: requests, pushes

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.received - other.received, self.sent - other.sent)


class ShapedLink:
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

    def __enter__(self) -> "ShapedLink":
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        # tbf's bucket must hold the largest (GSO) packet a veth hands it, 64 KiB, and one
        # timer tick's worth at the rate; 1 MiB holds both at 1 Gbit/s and caps any
        # burst above the rate at 8 ms worth.
        for prefix, dev in ((inside, self.ns_if), ((), self.host_if)):
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                 "burst", "1048576", "latency", "50ms")

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
