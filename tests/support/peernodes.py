"""Several BootSeer nodes on one machine, for peer block sharing: network namespaces, a store, a layer server each.

A :class:`PeerCluster` (a context manager) makes a :class:`~tests.support.netns.Lan`: a
store namespace where nginx serves a converted store directory (``bootseer convert`` or
:func:`tests.support.layer_store.build_store` wrote it), and N node namespaces, all on one
link-local ``/24`` behind a bridge, each node's link optionally shaped with ``tbf``
(``node_rate``) and the store behind its own shaped link (``store_rate``) that every
node's store reads share.  In each node namespace runs that node's own ``bootseer
layer-server`` (its own ``--root`` and ``--cache-dir`` under ``base``, ``--store`` the
nginx, ``--metrics-address`` its own address) with the extra arguments the caller gives
per node (peer flags: :func:`peer_args`); the command line is :class:`~blockstore.server.client.ServerSettings`'s,
run through ``nsenter --net`` so its FUSE mounts are the host's to read.

A :class:`PeerNode` mounts layers through the server's control socket, reads files
through its mounts and compares every byte with the store's own (:meth:`PeerNode.verify_layer`),
reads its ``/metrics``, ``status`` and ``peers.status``, and can be stopped, killed or hung
(SIGSTOP) and resumed.  The store counts what left it (:meth:`PeerCluster.store_egress`: the
store link's counters; :meth:`PeerCluster.store_body_bytes`: nginx's access log).

Leaving the context (pass or fail) resumes and stops every node's server, unmounts what
they left, stops nginx and removes every namespace and veth pair (killing whatever still
ran in one); :func:`leftovers` says what of a cluster is still there (tests assert none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from bootseer.blockstore.server.client import LayerServerClient, MountedLayer, ServerSettings

from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.format import EntryType, LayerIndex
from tests.support import netns
from tests.support.layer_servers import fuse_mounts, layer_server_processes, stop_layer_servers
from tests.support.nginx import Nginx
from tests.support.trees import read_file

#: Every node's metrics and peer port, on its own address (each node has a namespace: no clashes).
METRICS_PORT = 9100
PEER_PORT = 7070
STORE_PORT = 8080
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_tags = iter(range(1, 1 << 30))
#: The status and ``$body_bytes_sent`` after the request line of nginx's combined log format.
_STATUS_AND_BYTES = re.compile(r'" \d{3} (\d+) "')

#: Per-node extra ``bootseer layer-server`` arguments: a list per node, or a function of the node and the cluster.
NodeArgs = Sequence[Sequence[str]] | Callable[["PeerNode", "PeerCluster"], Sequence[str]]


class PeerNodeError(RuntimeError):
    """A node's server did not start, answer or stop as asked; the message has its log's tail."""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus page as ``{(sample name, sorted labels): value}``."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


@dataclasses.dataclass
class PeerNode:
    """One node: its namespace on the LAN, its layer server's root and cache, the server process."""

    index: int
    member: netns.LanMember
    base: Path  #: this node's directory: ``root/``, ``cache/``, ``server.log``
    store_url: str
    settings: ServerSettings
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def ip(self) -> str:
        return self.member.ip

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def cache_dir(self) -> Path:
        return self.base / "cache"

    @property
    def log_path(self) -> Path:
        return self.base / "server.log"

    @property
    def peer_address(self) -> str:
        """``HOST:PORT`` this node's peer server would listen on (``--peer-listen``), by convention."""
        return f"{self.ip}:{PEER_PORT}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.ip}:{METRICS_PORT}/metrics"

    @property
    def client(self) -> LayerServerClient:
        return LayerServerClient(ServerPaths(self.root).socket)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def argv(self) -> list[str]:
        """The server's command line: :class:`ServerSettings`'s, in this node's namespace, with its own root,
        cache, metrics address, store and the extra arguments."""
        settings = dataclasses.replace(self.settings, cache_dir=str(self.cache_dir),
                                       metrics_address=f"{self.ip}:{METRICS_PORT}")
        # The settings as the snapshotter passes them (one JSON document), in a file of the node's: the
        # launcher runs the server in another namespace, where no pipe of ours is.  The store is the
        # cluster's nginx, which takes no credential: it can go in argv.
        self.base.mkdir(parents=True, exist_ok=True)
        settings_file = self.base / "settings.json"
        settings_file.write_text(json.dumps(settings.document()))
        return [*self.member.launcher(), *settings.argv(self.root, str(settings_file)), "--store", self.store_url,
                *self.extra_args]

    def launch(self, extra_args: Sequence[str] | None = None) -> None:
        """Start the server (``extra_args`` replace the node's); :meth:`wait_ready` waits for it."""
        if self.pid is not None:
            raise PeerNodeError(f"{self.name}: its server runs already (pid {self.pid})")
        if extra_args is not None:
            self.extra_args = tuple(extra_args)
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(self.argv())}\n".encode())
            log.flush()
            # A session of its own, as ensure_server starts it: a signal to the test's group misses it.
            self.process = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True, cwd="/")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the server answers ``status`` on its control socket; PeerNodeError if it exits or never does."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                self.client.call({"op": "status"}, timeout=2)
                return
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise PeerNodeError(f"{self.name}: the layer server exited ({code}) before answering:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise PeerNodeError(f"{self.name}: the layer server did not answer in {timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def start(self, extra_args: Sequence[str] | None = None, timeout: float = START_TIMEOUT_S) -> None:
        """:meth:`launch` and :meth:`wait_ready`."""
        self.launch(extra_args)
        self.wait_ready(timeout)

    def log_tail(self, limit: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-limit:] if self.log_path.exists() else ""

    # -- signals ---------------------------------------------------------------------------

    def _signal(self, signum: int) -> None:
        if self.process is None or self.process.poll() is not None:
            raise PeerNodeError(f"{self.name}: no server runs to signal")
        os.kill(self.process.pid, signum)

    def hang(self) -> None:
        """SIGSTOP the server: it holds its connections and answers nothing (a hung peer)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a hung server."""
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server (a node that dies) and unmount what it served; returns once it is gone."""
        self._signal(signal.SIGKILL)
        self._reap(STOP_TIMEOUT_S)
        stop_layer_servers(self.root)  # its FUSE mount (and EROFS over it) stays until unmounted

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the server (after SIGCONT, should it hang), SIGKILL after ``timeout``; then unmount its mounts."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
                os.kill(self.process.pid, signal.SIGTERM)
            try:
                self._reap(timeout)
            except PeerNodeError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGKILL)
                self._reap(timeout)
        stop_layer_servers(self.root)

    def _reap(self, timeout: float) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise PeerNodeError(f"{self.name}: the server (pid {self.process.pid}) still runs after {timeout:g}s") from None

    # -- the server's views ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.client.status()

    def peers_status(self) -> dict[str, Any]:
        """The ``peers.status`` control operation's answer (a server with peer sharing)."""
        return self.client.call({"op": "peers.status"})

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The server's ``/metrics`` (:func:`metric_samples`)."""
        return metric_samples(self.metrics_text())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        wanted = set(labels.items())
        return sum(value for (sample, have), value in self.metrics().items()
                   if sample == name and wanted <= set(have))

    # -- layers ----------------------------------------------------------------------------

    def mount(self, chain_id: str, **options: Any) -> MountedLayer:
        """Serve the layer (the control socket's ``mount``)."""
        return self.client.mount(chain_id, **options)

    def mount_image(self, chain_ids: Sequence[str]) -> list[MountedLayer]:
        """Mount an image's layers bottom first, as rpull does (the top's mount starts a hot-list prefetch)."""
        return [self.mount(chain_id) for chain_id in chain_ids]

    def read(self, mounted: MountedLayer, path: str, offset: int = 0, size: int | None = None) -> bytes:
        """Bytes of ``path`` (relative to the layer's root) read through the node's mount of the layer."""
        with open(os.path.join(mounted.lower_dir, path), "rb", buffering=0) as f:
            f.seek(offset)
            if size is not None:
                return _read_exactly(f, size)
            return f.read()

    def verify_layer(self, mounted: MountedLayer, index: LayerIndex, store: Path) -> int:
        """Read every regular file of the layer through the mount and compare it with the store's packs
        (:func:`tests.support.trees.read_file`, every block checked against its digest); the bytes compared.
        AssertionError naming the first file that differs."""
        compared = 0
        for number, entry in enumerate(index.entries):
            if entry.type is not EntryType.FILE:
                continue
            expected = read_file(store, index, number)
            got = self.read(mounted, entry.path)
            assert got == expected, f"{self.name}: {entry.path} read through {mounted.lower_dir} differs from the store"
            compared += len(got)
        return compared


def _read_exactly(f: Any, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = f.read(left)
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class PeerCluster(netns.Opened):
    """``nodes`` nodes and a store on one LAN; see the module docstring.  A context manager.

    ``store_dir``: the converted store nginx serves.  ``node_args``: extra ``bootseer
    layer-server`` arguments per node (a list per node, or ``f(node, cluster)``, which can
    name every node's :attr:`PeerNode.peer_address`).  ``node_rate`` / ``store_rate``: tbf
    rates (``1gbit``) of each node's link and of the store's (None: unshaped).
    ``settings``: the servers' other options (by default no fill groups: the tests count the blocks each node
    asks of its peers exactly, and a fill group's neighbours would add to them).  ``start``: start every node's server on entry
    (else call :meth:`PeerNode.start` per node).
    """

    def __init__(self, base: Path, store_dir: Path, nodes: int, *, node_args: NodeArgs = (),
                 node_rate: str | None = None, store_rate: str | None = None,
                 settings: ServerSettings = ServerSettings(fill_group=0), start: bool = True, tag: str | None = None) -> None:
        self.base, self.store_dir, self.count = base, store_dir, nodes
        self.node_args, self.node_rate, self.store_rate = node_args, node_rate, store_rate
        self.settings, self.start_nodes = settings, start
        # Unique on the host across clusters of this process and others: pid and a counter (12 chars at most).
        self.tag = tag or f"{os.getpid() % 10**7}{next(_tags)}"[:12]
        self.lan = netns.Lan(self.tag)
        self.nodes: list[PeerNode] = []
        self.store: netns.LanMember | None = None
        self.nginx: Nginx | None = None

    @property
    def store_url(self) -> str:
        assert self.store is not None
        return f"http://{self.store.ip}:{STORE_PORT}/"

    def peer_addresses(self) -> list[str]:
        return [node.peer_address for node in self.nodes]

    def open(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.lan.open()
        self.store = self.lan.add("store", self.store_rate)
        # Workers as root: a test's store lies in its private temporary directory.
        self.nginx = Nginx(self.store_dir, self.base / "nginx", STORE_PORT, host=self.store.ip,
                           launcher=self.store.launcher(), user="root")
        self.nginx.__enter__()
        for index in range(self.count):
            member = self.lan.add(f"n{index}", self.node_rate)
            self.nodes.append(PeerNode(index, member, self.base / f"node{index}", self.store_url, self.settings))
        for node in self.nodes:
            node.extra_args = tuple(self._args_of(node))
        if self.start_nodes:
            for node in self.nodes:  # all at once: a start is mostly the interpreter's import time
                node.launch()
            for node in self.nodes:
                node.wait_ready()

    def _args_of(self, node: PeerNode) -> Sequence[str]:
        if callable(self.node_args):
            return self.node_args(node, self)
        return self.node_args[node.index] if node.index < len(self.node_args) else ()

    def store_egress(self) -> int:
        """Bytes the store has sent on its link since the cluster began (the link's counters: HTTP
        headers and TCP/IP framing included)."""
        assert self.store is not None
        return self.store.counters().sent

    def store_body_bytes(self) -> int:
        """Response body bytes nginx logged (``$body_bytes_sent`` of every access-log line so far)."""
        assert self.nginx is not None
        log = self.nginx.prefix / "access.log"
        total = 0
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                # combined format: ... "GET /path HTTP/1.1" STATUS BYTES "referer" "agent"
                found = _STATUS_AND_BYTES.search(line)
                if found:
                    total += int(found.group(1))
        return total

    def close(self) -> None:
        """Stop every node's server and unmount, stop nginx, remove the LAN; every step tried."""
        errors: list[str] = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as exc:  # noqa: BLE001 - the rest must still go
                errors.append(f"{node.name}: {exc}")
        with contextlib.suppress(Exception):
            stop_layer_servers(self.base)  # a server started by hand under base, or one a stop missed
        if self.nginx is not None:
            self.nginx.__exit__(None, None, None)
        try:
            self.lan.close()
        except netns.NetnsError as exc:
            errors.append(str(exc))
        if errors:
            raise PeerNodeError("; ".join(errors))


def write_token(path: Path) -> Path:
    """A fresh random peer-group token in ``path`` (mode 0600), for ``--peer-token-file``."""
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def peer_args(token_file: Path, *more: str, members: int | None = None) -> Callable[[PeerNode, PeerCluster], list[str]]:
    """``node_args`` that turn peer sharing on: each node listens on its :attr:`PeerNode.peer_address`, the
    members are the first ``members`` nodes (default: all), the token is ``token_file``; ``more`` are added."""

    def args(node: PeerNode, cluster: PeerCluster) -> list[str]:
        listed = cluster.peer_addresses()[:members]
        return ["--peer-listen", node.peer_address, "--peers", ",".join(listed),
                "--peer-token-file", str(token_file), *more]

    return args


def leftovers(cluster: PeerCluster) -> list[str]:
    """What of ``cluster`` still exists: namespaces, the host's interface, layer servers, mounts, nginx."""
    found = netns.leftovers(cluster.tag)
    found += [f"layer server pid {pid}" for pid in layer_server_processes(cluster.base)]
    found += [f"mount {point}" for point in fuse_mounts(cluster.base)]
    if cluster.nginx is not None and cluster.nginx.process is not None and cluster.nginx.process.poll() is None:
        found.append(f"nginx pid {cluster.nginx.process.pid}")
    for node in cluster.nodes:
        if node.process is not None and _alive(node.process.pid):
            found.append(f"{node.name} server pid {node.process.pid}")
    return found
