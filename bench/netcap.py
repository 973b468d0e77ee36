"""Bandwidth caps for the benchmark: a per-connection and an aggregate cap, in the kernel.

The benchmark's server must cap *each connection*, as a remote store or a congested
link does, so that one sequential stream is slow and parallel streams add up to the
server's aggregate cap.  nginx's ``limit_rate`` cannot do that for range requests: it
allows each *request* ``limit_rate`` bytes at once before pacing (its allowance is
``rate * (seconds since the request started + 1)``), so an 8 MiB range request at a
12 MB/s cap is served at full speed.  A whole-file GET would be capped and a striped
reader would not, which would flatter the striped reader.

So the caps live in the kernel instead, where request sizes cannot dodge them: the
benchmark runs in a private network namespace (``unshare --net``; the mount namespace
stays shared, so FUSE mounts are visible as usual) whose loopback device gets an HTB
qdisc.  The client's ephemeral ports are pinned to a small range; every port gets its
own HTB class capped at the per-connection rate, and all those classes share a parent
capped at the aggregate rate.  Traffic towards the server port (requests, ACKs) is not
shaped.  This kernel has neither ``sch_fq`` (per-flow ``maxrate``) nor ``cls_flow``,
so each port's class is picked by a plain ``u32`` match on the destination port.
"""

from __future__ import annotations

import os
import subprocess
import sys

#: Set in the environment of the re-executed benchmark, inside its namespace.
NETNS_ENV = "BOOTSEER_BENCH_NETNS"

#: Client ports: every TCP connection the benchmark opens gets one of these, and with
#: it its own class.  128 ports cover the streams of one reader plus connections in
#: TIME_WAIT (loopback reuses those anyway: ``tcp_tw_reuse``).
CLIENT_PORTS = range(49152, 49152 + 128)


def in_private_netns() -> bool:
    return os.environ.get(NETNS_ENV) == "1"


def reexec_in_private_netns() -> None:
    """Replace this process with itself run under ``unshare --net``; needs root.

    The namespace, its loopback device and the qdisc on it vanish when the last
    process in it exits, so nothing on the host's network is ever touched.  The
    command line is the one this process was started with (``sys.orig_argv``:
    ``python -m bench.ckpt_bench ARGS``), not ``sys.argv``, whose first item is the
    module's file: run by its path, the benchmark would not find the ``bench`` package.
    """
    if os.geteuid() != 0:
        sys.exit("error: the benchmark needs root (it shapes traffic in a private network namespace)")
    env = dict(os.environ, **{NETNS_ENV: "1"})
    argv = ["unshare", "--net", "--", sys.executable, *sys.orig_argv[1:]]
    os.execvpe("unshare", argv, env)


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")


def _bits(bytes_per_second: float) -> str:
    # tc's "mbps" means megabytes; spell the rate in bits so nothing is ambiguous.
    return f"{int(bytes_per_second * 8)}bit"


def apply_caps(conn_rate: float, aggregate_rate: float, server_port: int) -> None:
    """Shape this namespace's loopback: ``conn_rate`` per connection, ``aggregate_rate`` in all.

    Rates are in bytes per second.  Must run inside the private namespace.
    """
    if not in_private_netns():
        raise RuntimeError("refusing to shape traffic outside the benchmark's private network namespace")
    if server_port in CLIENT_PORTS:
        raise ValueError(f"server port {server_port} lies in the client port range")
    _run("ip", "link", "set", "lo", "up")
    first, last = CLIENT_PORTS[0], CLIENT_PORTS[-1]
    _run("sysctl", "-qw", f"net.ipv4.ip_local_port_range={first} {last}")
    _run("sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")
    # Buckets a little deeper than one 64 KiB loopback packet: the cap holds within
    # milliseconds, and a GSO packet never has to wait for more tokens than a bucket holds.
    leaf_burst = max(256 * 1024, int(conn_rate * 0.01))
    parent_burst = max(1024 * 1024, int(aggregate_rate * 0.005))
    quantum = "131072"
    _run("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "2")
    _run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb",
         "rate", _bits(aggregate_rate), "ceil", _bits(aggregate_rate),
         "burst", str(parent_burst), "cburst", str(parent_burst), "quantum", quantum)
    # Everything that is not server-to-client data (requests, ACKs) goes unshaped.
    _run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:2", "htb",
         "rate", "20gbit", "burst", "4m", "cburst", "4m", "quantum", quantum)
    # A leaf sending within its own ``rate`` is never checked against its parent, so
    # the leaves' guaranteed rates must add up to no more than the aggregate; each
    # borrows the rest, up to ``ceil``, from the parent, which enforces the aggregate.
    guaranteed = min(conn_rate, aggregate_rate / len(CLIENT_PORTS))
    for index, port in enumerate(CLIENT_PORTS):
        classid = f"1:{0x100 + index:x}"
        _run("tc", "class", "add", "dev", "lo", "parent", "1:1", "classid", classid, "htb",
             "rate", _bits(guaranteed), "ceil", _bits(conn_rate),
             "burst", str(leaf_burst), "cburst", str(leaf_burst), "quantum", quantum)
        _run("tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "sport", str(server_port), "0xffff",
             "match", "ip", "dport", str(port), "0xffff", "flowid", classid)


def describe_caps() -> str:
    """``tc -s class show`` for the record (bytes and drops per class)."""
    return subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True, text=True).stdout
