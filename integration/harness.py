"""What the integration tests share beyond tests/support: their images, the ``bootseer`` command, CRI.

The machinery that runs BootSeer the way a cluster does (a registry, a private containerd, the daemon,
a whole node) is tests/support's, shared with the unit tests and the benchmarks: ``tests.support.stack``
(:class:`~tests.support.stack.Stack`), ``tests.support.containerd``, ``tests.support.registry``,
``tests.support.processes``, ``tests.support.oci``.  Here, only what the integration tests alone use:

* :func:`running`: a stack started and torn down the way every integration test needs it (its logs in the
  failure report, its teardown errors failing the test).
* :func:`lazy_layers`: the demo image plus a layer of one-block files, what a lazy pull reads a little of.
* The ``bootseer`` command against a stack: :func:`bootseer_convert`, :func:`bootseer_rpull`,
  :func:`layer_server`, :func:`assert_served_on`, :func:`hotlist_status`, :func:`hotlist_show`.
* :class:`CriStack` is a Kubernetes node: its containerd runs the CRI plugin
  (:class:`CriContainerd`: CNI bridge, pause image, bootseer as the CRI snapshotter), driven
  by :class:`CriClient` as the kubelet drives it; :func:`snapshotter_view` reads the labels
  the daemon's Prepare received.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

from tests.support.containerd import BUILTIN_OVERLAY, SNAPSHOTTER_NAME, Containerd, transfer_unpack_config
from tests.support.layers import File, Layer
from tests.support.oci import BuiltImage, build_oci_layout, demo_layers
from tests.support.processes import HarnessError, run
from tests.support.stack import REPO_ROOT, Stack
from tests.support.waiting import wait_for_component



# --------------------------------------------------------------------------- a stack for one test

S = TypeVar("S", bound=Stack)


@contextlib.contextmanager
def running(stack: S) -> Iterator[S]:
    """``stack`` started for the ``with`` body and torn down after it; its logs printed (pytest shows them when
    the test fails), then its teardown errors fail the test, unless the body failed first."""
    try:
        with stack:
            yield stack
    finally:
        print(stack.logs())
    assert not stack.teardown_errors, f"teardown: {stack.teardown_errors}"


# --------------------------------------------------------------------------- images

#: The lazy-layer tests' extra layer: PARTS files of one block each (1 MiB, convert's default block size).
PART_SIZE = 1 << 20
PARTS = 8


def part_path(i: int) -> str:
    return f"/data/parts/part{i}.bin"


def part_data(i: int) -> bytes:
    """Distinct, incompressible-looking contents of part ``i``."""
    return b"".join(hashlib.sha256(f"part {i} {n}".encode()).digest() for n in range(PART_SIZE // 32))


def lazy_layers() -> list[Layer]:
    """The demo image (busybox, files, whiteout + opaque dir) plus a layer of PARTS one-block files:
    what a lazy pull reads a little of."""
    parts = Layer(tuple(File(part_path(i), part_data(i)) for i in range(PARTS)), "layer 3: one-block files")
    return [*demo_layers(), parts]


# -- the bootseer command line, for the lazy stack's tests ----------------------------

#: The ``bootseer`` command of this checkout's venv (or the one on PATH).
BOOTSEER = str(REPO_ROOT / ".venv" / "bin" / "bootseer") if (REPO_ROOT / ".venv" / "bin" / "bootseer").exists() \
    else shutil.which("bootseer") or "bootseer"


def bootseer_convert(stack: Stack, ref: str) -> str:
    """``bootseer convert`` of ``ref`` (in the stack's registry) into the stack's store; its output."""
    return run([BOOTSEER, "convert", "--plain-http", "--store", stack.store_url, ref], timeout=300).stdout.decode()


def bootseer_rpull(stack: Stack, ref: str) -> str:
    """``bootseer rpull`` of ``ref`` into the stack's containerd through the bootseer snapshotter; its output."""
    done = run([BOOTSEER, "rpull", "--address", str(stack.containerd.address), "--namespace", stack.namespace,
                "--plain-http", "--snapshotter", SNAPSHOTTER_NAME, ref], timeout=300)  # fmt: skip
    return done.stdout.decode()


def layer_server(stack: Stack):
    """A control client of the layer server the stack's daemon started."""
    from bootseer.blockstore.server.client import LayerServerClient
    from bootseer.paths import ServerPaths

    return LayerServerClient(ServerPaths(stack.daemon.root).socket)


def served_data_path(requested: str) -> str:
    """The data path a layer server given ``--data-path requested`` serves by on this machine: what the
    kernel offers for ``auto`` (the stacks live on the root filesystem, not tmpfs: fanotify where the kernel
    has pre-content events and that filesystem takes their marks, else EROFS file-backed)."""
    import tempfile

    from bootseer.blockstore.datapath.fanotify import unsupported

    if requested != "auto":
        return requested
    with open("/proc/filesystems") as listing:
        if not any(line.split()[-1:] == ["erofs"] for line in listing):
            return "tree"
    return "fanotify" if unsupported(Path(tempfile.gettempdir())) is None else "erofs"


def assert_served_on(stack: Stack, requested: str) -> None:
    """Every layer the stack's layer server serves is on the data path ``requested`` gives here."""
    status = layer_server(stack).status()
    expected = served_data_path(requested)
    assert status["data_path"]["path"] == expected and {row["data_path"] for row in status["layers"]} <= {expected}, status


def hotlist_status(stack: Stack) -> dict:
    """The layer server's recordings and prefetches (``hotlist.status``)."""
    return layer_server(stack).call({"op": "hotlist.status"})


def hotlist_show(stack: Stack, ref_or_chain: str, *extra: str) -> list[dict]:
    """``bootseer hotlist show --json`` against the stack's store."""
    done = run([BOOTSEER, "hotlist", "show", "--json", "--plain-http", "--store", stack.store_url, ref_or_chain, *extra],
               timeout=120)  # fmt: skip
    return json.loads(done.stdout)


# --------------------------------------------------------------------------- CRI (Kubernetes)

#: The containerd namespace the CRI plugin keeps every pod, container and image in.
CRI_NAMESPACE = "k8s.io"
#: Where Debian's containernetworking-plugins puts the CNI plugins (bridge, loopback, host-local).
CNI_BIN_DIR = Path("/usr/lib/cni")
#: The pause image's one file: static busybox as ``/bin/sleep`` (busybox runs the applet its name says).
PAUSE_CMD = ("/bin/sleep", "2147483647")


def pause_layers(busybox: Path = Path("/bin/busybox")) -> list[Layer]:
    """The sandbox (pause) image a CRI stack pushes: one layer, static busybox as ``/bin/sleep``."""
    if not busybox.is_file():
        raise HarnessError(f"{busybox} missing: install busybox-static")
    return [Layer((File("bin/sleep", busybox.read_bytes(), 0o755),), "pause: busybox sleep")]


class CriContainerd(Containerd):
    """A private containerd with its CRI plugin on, as a Kubernetes node runs it, ``bootseer`` its snapshotter.

    The settings that matter (docs/kubernetes.md says why): ``snapshotter = "bootseer"``,
    ``disable_snapshot_annotations = false``, ``restrict_oom_score_adj = true`` (root here lacks
    CAP_SYS_RESOURCE), a sandbox image from the local registry, a plain-HTTP registry host
    (``config_path``), runc's state under the stack (``options.Root``: nothing shared with another
    containerd's ``k8s.io`` namespace), and a CNI bridge of the stack's own that carries nothing off
    the machine (no gateway, no masquerade, IPAM state under the stack).
    """

    def __init__(self, base: Path, snapshotter_socket: Path, *, registry: str, sandbox_image: str,
                 snapshotter: str = SNAPSHOTTER_NAME):
        super().__init__(base, snapshotter_socket, CRI_NAMESPACE, snapshotter=snapshotter)
        self.registry = registry
        self.sandbox_image = sandbox_image
        # A bridge name of at most 15 bytes, unique to this stack; a /24 of its own in 10.213/16.
        suffix = uuid.uuid4().hex[:8]
        self.bridge = f"bsit{suffix}"
        self.subnet = f"10.213.{int(suffix[:2], 16)}.0/24"
        self.cni_conf_dir = base / "cni" / "net.d"
        #: The CRI plugin's snapshotter from the next start, if not :attr:`snapshotter` (a node rolled off BootSeer).
        self.cri_snapshotter: str | None = None
        #: CRI's ``discard_unpacked_layers`` from the next start (a pull lets containerd's GC drop layer blobs).
        self.discard_unpacked_layers = False
        #: ``disable_snapshot_annotations = false`` (True) or ``true``, from the next start. On 2.x, False also
        #: means the 2.x default pull path: through the transfer service (:meth:`cri_config_v3`).
        self.snapshot_annotations = True
        #: The proxy plugin's ``exports`` from the next start (2.x's transfer service reads
        #: ``enable_remote_snapshot_annotations`` there).
        self.snapshotter_exports: dict[str, str] = {}

    @property
    def runc_root(self) -> Path:
        return self.base / "runc"

    def cri_disabled_lines(self) -> str:
        return ""  # the CRI plugin on

    def config_text(self) -> str:
        """:class:`Containerd`'s config with the CRI plugin left on and configured, in the dialect of the
        containerd that runs (:meth:`cri_config_v2` for 1.x, :meth:`cri_config_v3` for 2.x)."""
        cri = self.cri_config_v3() if self.config_dialect() == 3 else self.cri_config_v2()
        exports = "".join(f'  {name} = "{value}"\n' for name, value in self.snapshotter_exports.items())
        return super().config_text() + cri + (f"\n[proxy_plugins.{SNAPSHOTTER_NAME}.exports]\n{exports}" if exports else "")

    def cri_config_v2(self) -> str:
        """containerd 1.6 and 1.7 (``version = 2``): one CRI plugin, ``io.containerd.grpc.v1.cri``."""
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""
[{cri}]
  sandbox_image = "{self.sandbox_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
{self._pull_settings()}  default_runtime_name = "runc"
{self._runc_runtime(f"{cri}.containerd")}
[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{self.cni_conf_dir}"
  max_conf_num = 1

[{cri}.registry]
  config_path = "{self.base / 'certs.d'}"
"""

    def cri_config_v3(self) -> str:
        """containerd 2.x (``version = 3``): the CRI plugin split in three. ``io.containerd.cri.v1.images``
        pulls (snapshotter, snapshot annotations, discarding layers, the sandbox image, registries),
        ``io.containerd.cri.v1.runtime`` runs pods (runc, CNI, OOM score), ``io.containerd.grpc.v1.cri``
        serves the API and its streams.

        With :attr:`snapshot_annotations`, ``use_local_image_pull = true`` says what 2.1 does anyway with
        ``disable_snapshot_annotations = false`` (it logs a warning and falls back): the CRI plugin pulls
        through containerd's client, which labels the layers. Without, it pulls through the transfer
        service, whose ``unpack_config`` must name the CRI snapshotter (PullImage fails "no unpack
        platforms defined" otherwise)."""
        images, runtime = "plugins.'io.containerd.cri.v1.images'", "plugins.'io.containerd.cri.v1.runtime'"
        pulls_into = self.cri_snapshotter or self.snapshotter
        # Containerd.config_text names bootseer and overlayfs already (from 1.7 on).
        named = self.snapshot_annotations or pulls_into in (SNAPSHOTTER_NAME, BUILTIN_OVERLAY)
        transfer = "" if named else transfer_unpack_config(pulls_into)
        return f"""{transfer}
[{images}]
{self._pull_settings()}  use_local_image_pull = {str(self.snapshot_annotations).lower()}

[{images}.pinned_images]
  sandbox = "{self.sandbox_image}"

[{images}.registry]
  config_path = "{self.base / 'certs.d'}"

[{runtime}]
  restrict_oom_score_adj = true
  disable_apparmor = true

[{runtime}.containerd]
  default_runtime_name = "runc"
{self._runc_runtime(f"{runtime}.containerd")}
[{runtime}.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{self.cni_conf_dir}"
  max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def _pull_settings(self) -> str:
        """BootSeer's pull settings, the same keys in both dialects (1.x: in the CRI plugin's ``containerd``
        table; 2.x: in ``io.containerd.cri.v1.images``)."""
        return (f'  snapshotter = "{self.cri_snapshotter or self.snapshotter}"\n'
                f"  disable_snapshot_annotations = {str(not self.snapshot_annotations).lower()}\n"
                f"  discard_unpacked_layers = {str(self.discard_unpacked_layers).lower()}\n")

    def _runc_runtime(self, containerd_table: str) -> str:
        """The ``runc`` runtime handler under ``containerd_table``, its state under the stack."""
        return (f'\n[{containerd_table}.runtimes.runc]\n  runtime_type = "io.containerd.runc.v2"\n'
                f'\n[{containerd_table}.runtimes.runc.options]\n  Root = "{self.runc_root}"\n')

    def cni_config(self) -> dict:
        """The one CNI network: a bridge without gateway or masquerade, IPAM state under the stack."""
        return {"cniVersion": "0.4.0", "name": f"bootseer-it-{self.bridge}", "plugins": [{
            "type": "bridge", "bridge": self.bridge, "isGateway": False, "ipMasq": False, "hairpinMode": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet}]],
                     "dataDir": str(self.base / "cni" / "ipam")},
        }]}

    def start(self, timeout: float = 60) -> None:
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        (self.cni_conf_dir / "10-bootseer-it.conflist").write_text(json.dumps(self.cni_config(), indent=2))
        hosts = self.base / "certs.d" / self.registry
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(f'server = "http://{self.registry}"\n\n'
                                          f'[host."http://{self.registry}"]\n  capabilities = ["pull", "resolve"]\n')
        super().start(timeout)
        wait_for_component("the CRI plugin to answer", lambda: self._cri_ready(), timeout, interval=0.3, alive=self.process)

    def _cri_ready(self) -> bool:
        import grpc

        try:
            with CriClient(self.address) as cri:
                conditions = {c.type: c.status for c in cri.status().status.conditions}
        except grpc.RpcError:
            return False
        return conditions.get("RuntimeReady", False) and conditions.get("NetworkReady", False)

    def remove_bridge(self) -> None:
        """Delete the stack's CNI bridge (the bridge plugin leaves it when the last pod goes)."""
        if Path(f"/sys/class/net/{self.bridge}").exists():
            run(["ip", "link", "del", self.bridge], timeout=30)


class CriClient:
    """The CRI v1 API of a containerd, called as the kubelet calls it (RuntimeService and ImageService)."""

    def __init__(self, address: Path, timeout: float = 120):
        import grpc

        from bootseer.proto.cri.runtime.v1 import api_pb2, api_pb2_grpc

        self.api = api_pb2
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{address}")
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self._channel)
        self.images = api_pb2_grpc.ImageServiceStub(self._channel)

    def __enter__(self) -> "CriClient":
        return self

    def __exit__(self, *exc) -> None:
        self._channel.close()

    def status(self):
        return self.runtime.Status(self.api.StatusRequest(), timeout=10)

    def pull(self, ref: str, timeout: float = 300) -> str:
        """``PullImage``; the image's ID (its config digest)."""
        return self.images.PullImage(self.api.PullImageRequest(image=self.api.ImageSpec(image=ref)),
                                     timeout=timeout).image_ref

    def remove_image(self, ref: str) -> None:
        self.images.RemoveImage(self.api.RemoveImageRequest(image=self.api.ImageSpec(image=ref)), timeout=self.timeout)

    def image_status(self, ref: str):
        return self.images.ImageStatus(self.api.ImageStatusRequest(image=self.api.ImageSpec(image=ref)),
                                       timeout=self.timeout).image

    def sandbox_config(self, name: str, log_dir: Path, annotations: dict[str, str] | None = None):
        """A pod's sandbox config as the kubelet fills it in (metadata, log directory, pod network namespace)."""
        api = self.api
        return api.PodSandboxConfig(
            metadata=api.PodSandboxMetadata(name=name, uid=uuid.uuid4().hex, namespace="default", attempt=0),
            hostname=name, log_directory=str(log_dir), annotations=annotations or {},
            labels={"io.kubernetes.pod.name": name},
            linux=api.LinuxPodSandboxConfig(security_context=api.LinuxSandboxSecurityContext(
                namespace_options=api.NamespaceOption(network=api.POD, pid=api.CONTAINER, ipc=api.POD))))

    def run_pod(self, config) -> str:
        return self.runtime.RunPodSandbox(self.api.RunPodSandboxRequest(config=config), timeout=self.timeout).pod_sandbox_id

    def create_container(self, pod_id: str, pod_config, name: str, image: str, argv: Sequence[str], *,
                         annotations: dict[str, str] | None = None) -> str:
        api = self.api
        config = api.ContainerConfig(
            metadata=api.ContainerMetadata(name=name, attempt=0), image=api.ImageSpec(image=image),
            command=list(argv), log_path=f"{name}.log", annotations=annotations or {},
            labels={"io.kubernetes.container.name": name}, linux=api.LinuxContainerConfig())
        return self.runtime.CreateContainer(api.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=pod_config), timeout=self.timeout).container_id

    def start_container(self, container_id: str) -> None:
        self.runtime.StartContainer(self.api.StartContainerRequest(container_id=container_id), timeout=self.timeout)

    def container_status(self, container_id: str):
        return self.runtime.ContainerStatus(self.api.ContainerStatusRequest(container_id=container_id),
                                            timeout=self.timeout).status

    def wait_exited(self, container_id: str, timeout: float = 120):
        """The container's status once it has exited (HarnessError after ``timeout``)."""
        def exited():
            status = self.container_status(container_id)
            return status if status.state == self.api.CONTAINER_EXITED else None

        return wait_for_component(f"container {container_id} to exit", exited, timeout, interval=0.2)

    def exec_sync(self, container_id: str, argv: Sequence[str], timeout: int = 60) -> str:
        """``ExecSync``; its stdout (HarnessError with stderr if it exits non-zero)."""
        done = self.runtime.ExecSync(self.api.ExecSyncRequest(container_id=container_id, cmd=list(argv), timeout=timeout),
                                     timeout=timeout + 10)
        if done.exit_code != 0:
            raise HarnessError(f"exec {list(argv)} in {container_id}: status {done.exit_code}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode(errors="replace")

    def remove_container(self, container_id: str) -> None:
        self.runtime.StopContainer(self.api.StopContainerRequest(container_id=container_id, timeout=0), timeout=self.timeout)
        self.runtime.RemoveContainer(self.api.RemoveContainerRequest(container_id=container_id), timeout=self.timeout)

    def remove_pod(self, pod_id: str) -> None:
        self.runtime.StopPodSandbox(self.api.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=self.timeout)
        self.runtime.RemovePodSandbox(self.api.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=self.timeout)

    def pods(self) -> list[str]:
        return [p.id for p in self.runtime.ListPodSandbox(self.api.ListPodSandboxRequest(), timeout=self.timeout).items]


def cri_log_lines(path: Path) -> list[str]:
    """The message of each line of a CRI container log (``TIMESTAMP STREAM TAG MESSAGE``, tag F or P)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            lines.append(parts[3])
    return lines


class CriStack(Stack):
    """A :class:`Stack` whose containerd runs the CRI plugin (:class:`CriContainerd`), driven by :meth:`cri`.

    ``discard_unpacked_layers`` and ``snapshot_annotations``: :class:`CriContainerd`'s. Starting it pushes
    the pause image to its registry before containerd starts (the CRI config names it);
    teardown first stops and removes every pod through CRI (their network namespaces and CNI state go
    with them), then does what :class:`Stack` does, then deletes the stack's CNI bridge.
    """

    def __init__(self, base: Path | None = None, *, discard_unpacked_layers: bool = False,
                 snapshot_annotations: bool = True, **options):
        options.setdefault("namespace", CRI_NAMESPACE)
        super().__init__(base, **options)
        if self.registry is None:
            raise HarnessError("a CRI stack needs its registry (the sandbox image is pulled from it)")
        self.containerd = CriContainerd(self.base / "ctrd", self.base / "snap" / "snapshotter.sock",
                                        registry="127.0.0.1:0", sandbox_image="", snapshotter=self.containerd.snapshotter)
        self.containerd.discard_unpacked_layers = discard_unpacked_layers
        self.containerd.snapshot_annotations = snapshot_annotations
        self.pod_logs = self.base / "pods"
        self._pods = 0
        self.pause_image: BuiltImage | None = None  #: the sandbox image, once :meth:`start` built it

    def start(self) -> None:
        self.registry.start()
        self.containerd.registry = self.registry.address
        pause = build_oci_layout(self.base / "images" / "pause", pause_layers(), tag="v1", cmd=PAUSE_CMD)
        self.containerd.sandbox_image = self.registry.push(pause, "bootseer/pause")
        self.pause_image = pause
        if self.daemon is not None:
            self.daemon.start()
        self.containerd.start()

    def cri(self) -> CriClient:
        return CriClient(self.containerd.address)

    def run_pod(self, name: str, annotations: dict[str, str] | None = None) -> tuple[str, object]:
        """``RunPodSandbox`` of a pod named ``name``; its id and config (CreateContainer needs both)."""
        self._pods += 1
        log_dir = self.pod_logs / f"{name}-{self._pods}"
        log_dir.mkdir(parents=True, exist_ok=True)
        with self.cri() as cri:
            config = cri.sandbox_config(name, log_dir, annotations)
            return cri.run_pod(config), config

    def run_in_pod(self, pod: tuple[str, object], name: str, image: str, *argv: str,
                   annotations: dict[str, str] | None = None) -> str:
        """CreateContainer + StartContainer of ``argv`` in ``pod``; the container's id."""
        pod_id, config = pod
        with self.cri() as cri:
            container = cri.create_container(pod_id, config, name, image, argv, annotations=annotations)
            cri.start_container(container)
        return container

    def output(self, pod: tuple[str, object], container: str, timeout: float = 120) -> list[str]:
        """The exited container's output lines, read from its CRI log file (HarnessError if it failed)."""
        with self.cri() as cri:
            status = cri.wait_exited(container, timeout)
        lines = cri_log_lines(Path(status.log_path))
        if status.exit_code != 0:
            raise HarnessError(f"container {container} exited with status {status.exit_code}: {lines}")
        return lines

    def close(self) -> None:
        try:
            if self.containerd.process is not None and self.containerd.process.running:
                with self.cri() as cri:
                    for pod in cri.pods():
                        cri.remove_pod(pod)
        except Exception as e:  # keep tearing down: Stack.close kills what is left
            self.teardown_errors.append(f"remove pods: {e}")
        super().close()
        try:
            self.containerd.remove_bridge()
        except Exception as e:
            self.teardown_errors.append(f"remove the CNI bridge: {e}")


def snapshotter_view(stack: Stack) -> dict[str, dict]:
    """Every snapshot as the daemon itself holds it (its own List over its socket, not containerd's view):
    ``{name: {"parent", "kind", "labels"}}``; the labels are those its Prepare (or Commit) received."""
    import grpc

    from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc

    if stack.daemon is None:
        raise HarnessError("this stack runs no bootseer daemon")
    with grpc.insecure_channel(f"unix://{stack.daemon.socket}") as channel:
        stub = snapshots_pb2_grpc.SnapshotsStub(channel)
        return {info.name: {"parent": info.parent, "kind": snapshots_pb2.Kind.Name(info.kind), "labels": dict(info.labels)}
                for response in stub.List(snapshots_pb2.ListSnapshotsRequest(snapshotter=SNAPSHOTTER_NAME), timeout=30)
                for info in response.info}

