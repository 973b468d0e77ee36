"""Kubernetes' path, without a kubelet: containerd's CRI plugin (1.6, 1.7 or 2.x: the ``containerd`` the
harness runs) driven over its gRPC API as the kubelet drives it (``PullImage``, ``RunPodSandbox``,
``CreateContainer``, ``StartContainer``, ``ExecSync``, the removals), with ``snapshotter = "bootseer"``, real
runc, CNI bridge networking and a local registry (:class:`integration.harness.CriStack`).  Where containerd
versions differ, the test says which version does what (docs/kubernetes.md lists the differences).

* ``PullImage`` of a converted image is lazy: no layer blob leaves the registry for containerd, every layer
  is a remote snapshot (the daemon's metric), and a pod's container prints the image's bytes (its CRI log);
* the labels CRI passes to the snapshotter's Prepare, exactly, for image layers, the pod sandbox's
  snapshot and a container's (docs/kubernetes.md lists them; from 1.7 on no container annotation reaches
  a container's snapshot);
* an unconverted image falls back to download-and-unpack with its log line and metric, and runs; with
  ``discard_unpacked_layers = true`` both still work and containerd's GC drops the fallen-back blobs;
* removing container, pod and image leaves no snapshot, mount, served layer or recording once
  containerd's GC ran;
* a first pod's reads become the image's hot list; on a fresh node ``PullImage`` prefetches it before any
  pod exists, and the prefetch's summary counts what the warmed page cache served;
* a dependency snapshot reaches a pod's container: by the container annotation CRI passes on (1.6 only),
  and by the node's ``[depsnap] images`` mapping of the image (what a pod spec, which cannot set that
  annotation, gets; the only way from 1.7 on);
* the snapshotter restarted under a running pod: the pod keeps reading never-read files, a new pod starts;
* the node's example config of the running containerd's version loads into it and sets what the tests run.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest

from bootseer.paths import ServerPaths
from bootseer.snapshotter.deps_hooks import DEPS_LABEL
from bootseer.depsnap.key import compute_key, container_store_key
from integration import harness
from integration.harness import (
    CRI_NAMESPACE, bootseer_convert as convert, hotlist_show as show, hotlist_status, layer_server, lazy_layers,
    part_data, part_path,
)
from tests.support.containerd import BUILTIN_OVERLAY, SNAPSHOTTER_NAME, containerd_install, containerd_version
from tests.support.layers import File, Layer
from tests.support.oci import APP_FILE, APP_FILE_DATA, PATCH_FILE, PATCH_FILE_DATA, BuiltImage, busybox_layer, chain_ids
from tests.support.processes import mounts_under
from tests.support.stack import REPO_ROOT
from tests.support.waiting import wait_for_component
from integration.test_depsnap import INSTALL
from integration.test_depsnap import JOB as DEPS_JOB
from integration.test_hotlist import JOB as HOT_JOB
from integration.test_hotlist import part_digests
from integration.test_lazy import blocks, metric_total

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

#: What the CRI plugin's unpacker labels every image layer's Prepare with (disable_snapshot_annotations = false).
LAYER_LABELS = {"containerd.io/snapshot.ref", "containerd.io/snapshot/cri.image-ref", "containerd.io/snapshot/cri.layer-digest",
                "containerd.io/snapshot/cri.image-layers", "containerd.io/snapshot/cri.manifest-digest"}  # fmt: skip
LONG = "echo started > /run-state; exec sleep 100000"


#: The registry's log field of a request containerd made: logfmt quotes the value only when it needs to
#: (1.6 and 1.7 from Debian send ``containerd/1.7.24~ds1``, quoted for its ``~``; 2.1.9 ``containerd/2.1.9+unknown``).
CONTAINERD_AGENT = re.compile(r'useragent="?containerd/')


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def container_annotations_reach_the_snapshot() -> bool:
    """Whether CRI labels a container's snapshot with its ``containerd.io/snapshot/*`` annotations: containerd
    1.6 does; 1.7 and 2.x do not (containerd commit 44e12dc5d, "Windows snapshotter touch ups": the kubelet
    cannot set such annotations anyway). A pod's annotations reach its sandbox's snapshot in every version."""
    return containerd_version() < (1, 7, 0)


def layer_blob_gets(stack: harness.CriStack, image: BuiltImage) -> list[str]:
    """The registry's log lines of containerd fetching one of ``image``'s layer blobs."""
    return [line for line in stack.registry.process.log_text().splitlines()
            if CONTAINERD_AGENT.search(line) and any(f"/blobs/{d}" in line for d in image.layer_digests)]


def converted(stack: harness.CriStack, name: str = "bootseer/lazy") -> tuple[BuiltImage, str]:
    image, ref = stack.build_and_push(name=name, layers=lazy_layers())
    convert(stack, ref)
    return image, ref


def wait_running(stack: harness.CriStack, container: str) -> None:
    with stack.cri() as cri:
        wait_for_component(f"container {container} to write /run-state", lambda: cri.exec_sync(
            container, ["sh", "-c", "cat /run-state 2>/dev/null; true"]).strip() == "started", 30)


def test_lazy_pull_runs_a_pod_and_the_labels_cri_passes(cri_stacks: Any) -> None:
    stack = cri_stacks()
    image, ref = converted(stack)
    remote = metric_total(stack, r"^bootseer_snapshotter_remote_snapshots_total$")
    with stack.cri() as cri:
        assert cri.pull(ref) == image.config_digest
    assert layer_blob_gets(stack, image) == []  # the registry sent containerd no layer blob
    assert metric_total(stack, r"^bootseer_snapshotter_remote_snapshots_total$") == remote + len(image.diff_ids)
    chain = chain_ids(image.diff_ids)
    view = harness.snapshotter_view(stack)
    for depth, key in enumerate(chain):
        layer = view[key]
        assert layer["kind"] == "COMMITTED" and layer["parent"] == (chain[depth - 1] if depth else "")
        # Exactly these labels, and what they say:
        assert set(layer["labels"]) == LAYER_LABELS, layer["labels"]
        assert layer["labels"]["containerd.io/snapshot.ref"] == key
        assert layer["labels"]["containerd.io/snapshot/cri.image-ref"] == ref
        assert layer["labels"]["containerd.io/snapshot/cri.layer-digest"] == image.layer_digests[depth]
        assert layer["labels"]["containerd.io/snapshot/cri.image-layers"] == ",".join(image.layer_digests[depth:])
        assert layer["labels"]["containerd.io/snapshot/cri.manifest-digest"] == image.manifest_digest
    # No layer blob in containerd's content store: the image's manifest and config only.
    content = set(stack.containerd.ctr_out("content", "ls", "-q").split())
    assert set(image.layer_digests).isdisjoint(content) and {image.manifest_digest, image.config_digest} <= content

    # A pod and a container, as the kubelet makes them; annotations of both kinds on each.
    pod = stack.run_pod("lazy-pod", annotations={f"{DEPS_LABEL}": "from-the-pod", "example.com/pod": "x",
                                                  "containerd.io/snapshot/example.pod": "p"})
    script = f"cat {APP_FILE} {PATCH_FILE}; sha256sum {part_path(0)}"
    container = stack.run_in_pod(pod, "app", ref, "sh", "-c", script,
                                 annotations={"containerd.io/snapshot/example.container": "c", "example.com/c": "y"})
    lines = stack.output(pod, container)
    assert lines[:2] == [APP_FILE_DATA.decode().strip(), PATCH_FILE_DATA.decode().strip()]
    assert lines[2].split()[0] == sha(part_data(0))

    view = harness.snapshotter_view(stack)
    [sandbox_key] = [k for k in view if k.endswith(f"/{pod[0]}")]
    [container_key] = [k for k in view if k.endswith(f"/{container}")]
    pause_top = chain_ids(stack.pause_image.diff_ids)[-1]
    # The sandbox's snapshot: the pod's annotations under containerd.io/snapshot/, nothing else.
    assert view[sandbox_key]["kind"] == "ACTIVE" and view[sandbox_key]["parent"].endswith(pause_top)
    assert view[sandbox_key]["labels"] == {DEPS_LABEL: "from-the-pod", "containerd.io/snapshot/example.pod": "p"}
    # The container's: in 1.6 the container config's annotations under containerd.io/snapshot/; none of the pod's.
    # From 1.7 on: nothing at all.
    assert view[container_key]["kind"] == "ACTIVE" and view[container_key]["parent"].endswith(chain[-1])
    expected = {"containerd.io/snapshot/example.container": "c"} if container_annotations_reach_the_snapshot() else {}
    assert view[container_key]["labels"] == expected
    # Keys are <namespace>/<n>/<id>: the pod sandbox's id and the container's id, in k8s.io.
    assert re.fullmatch(rf"{CRI_NAMESPACE}/\d+/{container}", container_key), container_key

    # The pod is on the stack's CNI bridge, with an address of the stack's own subnet.
    with stack.cri() as cri:
        status = cri.runtime.PodSandboxStatus(cri.api.PodSandboxStatusRequest(pod_sandbox_id=pod[0]), timeout=30).status
    prefix = stack.containerd.subnet.rsplit(".", 1)[0] + "."
    assert status.state == cri.api.SANDBOX_READY and status.network.ip.startswith(prefix), status.network

    # ExecSync in a running container, as `kubectl exec` gets it.
    running = stack.run_in_pod(pod, "long", ref, "sh", "-c", LONG)
    wait_running(stack, running)
    with stack.cri() as cri:
        assert cri.exec_sync(running, ["sha256sum", part_path(5)]).split()[0] == sha(part_data(5))


def test_unconverted_image_falls_back_visibly(cri_stacks: Any) -> None:
    stack = cri_stacks()
    layers = [busybox_layer(), Layer((File("/other.txt", b"not converted\n"),), "other")]
    image, ref = stack.build_and_push(name="bootseer/plain", layers=layers)
    not_converted = r'fallbacks_total\{.*reason="not_converted"'
    fallbacks = metric_total(stack, not_converted)
    with stack.cri() as cri:
        cri.pull(ref)
    assert metric_total(stack, not_converted) == fallbacks + 2  # one per layer
    for chain_id in chain_ids(image.diff_ids):
        assert re.search(rf"not served lazily.*chain_id={chain_id}.*reason=not_converted",
                         stack.daemon.process.log_text()), chain_id
    assert len(layer_blob_gets(stack, image)) == 2  # downloaded, as containerd does without BootSeer
    pod = stack.run_pod("plain-pod")
    assert stack.output(pod, stack.run_in_pod(pod, "plain", ref, "cat", "/other.txt")) == ["not converted"]


def two_layer_image(stack: harness.CriStack, name: str, text: bytes) -> tuple[BuiltImage, str]:
    """An image of layers no other image of these tests has (busybox as /bin/cat, then /other.txt holding
    ``text``): its pull unpacks every layer afresh. Pushed, not converted."""
    cat = File("bin/cat", Path("/bin/busybox").read_bytes(), 0o755)
    return stack.build_and_push(name=name, layers=[Layer((cat,), "cat"),
                                                   Layer((File("/other.txt", text),), "other")])


def test_discarding_unpacked_layers_keeps_lazy_pulls_and_the_fallback(cri_stacks: Any) -> None:
    """``discard_unpacked_layers = true`` (CRI lets containerd's GC drop a layer's blob once unpacked): a converted
    image still pulls lazily; an unconverted one falls back, is downloaded and unpacked during the pull, and its
    layer blobs leave the content store; after that GC, pods of both run (the lazy snapshots were kept)."""
    stack = cri_stacks(discard_unpacked_layers=True)
    lazy, lazy_ref = converted(stack)
    plain, plain_ref = two_layer_image(stack, "bootseer/plain", b"not converted\n")
    with stack.cri() as cri:
        cri.pull(lazy_ref)
        cri.pull(plain_ref)
    assert layer_blob_gets(stack, lazy) == [] and len(layer_blob_gets(stack, plain)) == 2
    # containerd's GC drops the fallen-back layers' blobs (the image keeps its manifest and config).
    wait_for_component("containerd's GC to drop the unpacked layers' blobs", lambda: set(plain.layer_digests).isdisjoint(
        stack.containerd.ctr_out("content", "ls", "-q").split()), 60)
    assert {plain.manifest_digest, plain.config_digest} <= set(stack.containerd.ctr_out("content", "ls", "-q").split())
    pod = stack.run_pod("discard-pod")
    assert stack.output(pod, stack.run_in_pod(pod, "plain", plain_ref, "cat", "/other.txt")) == ["not converted"]
    script = f"cat {APP_FILE}; sha256sum {part_path(3)}"
    lines = stack.output(pod, stack.run_in_pod(pod, "lazy", lazy_ref, "sh", "-c", script))
    assert lines[0] == APP_FILE_DATA.decode().strip() and lines[1].split()[0] == sha(part_data(3))


def test_without_snapshot_annotations_pulls_stay_lazy_and_2x_labels_them_by_the_proxys_export(
        cri_stacks: Any) -> None:
    """``disable_snapshot_annotations = true`` (every version's default): ``PullImage`` of a converted image is
    still lazy, each layer's Prepare labelled ``containerd.io/snapshot.ref`` only, and a pod runs. containerd 2.x
    then pulls through its transfer service (its ``unpack_config`` naming bootseer); there the proxy plugin's
    ``exports`` ``enable_remote_snapshot_annotations = "true"`` brings the ``cri.*`` labels back."""
    stack = cri_stacks(snapshot_annotations=False)
    image, ref = converted(stack)
    remote = metric_total(stack, r"^bootseer_snapshotter_remote_snapshots_total$")
    with stack.cri() as cri:
        cri.pull(ref)
    assert layer_blob_gets(stack, image) == []
    assert metric_total(stack, r"^bootseer_snapshotter_remote_snapshots_total$") == remote + len(image.diff_ids)
    view = harness.snapshotter_view(stack)
    for key in chain_ids(image.diff_ids):
        assert view[key]["labels"] == {"containerd.io/snapshot.ref": key}, view[key]
    pod = stack.run_pod("unlabelled-pod")
    assert stack.output(pod, stack.run_in_pod(pod, "app", ref, "cat", APP_FILE)) == [APP_FILE_DATA.decode().strip()]
    if containerd_version() < (2, 0, 0):
        return  # 1.x's CRI pulls through containerd's client only

    containerd_log = (stack.containerd.base / "containerd.log").read_text()
    assert f'PullImage \\"{ref}\\" with snapshotter {SNAPSHOTTER_NAME} using transfer service' in containerd_log
    stack.containerd.stop()
    stack.containerd.snapshotter_exports = {"enable_remote_snapshot_annotations": "true"}
    stack.containerd.start()
    labelled, labelled_ref = two_layer_image(stack, "bootseer/labelled", b"labelled\n")
    convert(stack, labelled_ref)
    with stack.cri() as cri:
        cri.pull(labelled_ref)
    assert layer_blob_gets(stack, labelled) == []
    view = harness.snapshotter_view(stack)
    for depth, key in enumerate(chain_ids(labelled.diff_ids)):
        assert set(view[key]["labels"]) == LAYER_LABELS, view[key]
        assert view[key]["labels"]["containerd.io/snapshot/cri.image-ref"] == labelled_ref
        assert view[key]["labels"]["containerd.io/snapshot/cri.layer-digest"] == labelled.layer_digests[depth]
    assert stack.output(pod, stack.run_in_pod(pod, "labelled", labelled_ref, "cat", "/other.txt")) == ["labelled"]


def test_removal_leaves_nothing_once_gc_ran(cri_stacks: Any) -> None:
    stack = cri_stacks()
    image, ref = converted(stack)
    with stack.cri() as cri:
        cri.pull(ref)
    pod = stack.run_pod("gc-pod")
    container = stack.run_in_pod(pod, "app", ref, "sh", "-c", f"cat {APP_FILE} {part_path(1)} > /dev/null; {LONG}")
    wait_running(stack, container)
    assert layer_server(stack).status()["layers"] and hotlist_status(stack)["recordings"]
    pause_chain = set(chain_ids(stack.pause_image.diff_ids))

    with stack.cri() as cri:
        cri.remove_container(container)
        cri.remove_pod(pod[0])
        cri.remove_image(ref)
        assert cri.pods() == []
    # containerd's GC runs after the removals: then only the pause image's snapshot is left, everywhere.
    wait_for_component("containerd to collect the image's snapshots",
                       lambda: {row["key"] for row in stack.containerd.snapshots()} == pause_chain, 60)
    wait_for_component("the daemon to drop them", lambda: all(
        key.rsplit("/", 1)[-1] in pause_chain for key in harness.snapshotter_view(stack)), 60)
    wait_for_component("the daemon's snapshot directories to go",
                       lambda: len(stack.daemon.snapshot_dirs()) == len(pause_chain), 60)
    wait_for_component("the layer server to unmount the layers", lambda: not layer_server(stack).status()["layers"], 60)
    assert hotlist_status(stack)["recordings"] == []
    # No rootfs, shm or layer mount is left: only the layer server's own FUSE mount, which serves whatever comes next.
    assert mounts_under(stack.base) == [str(ServerPaths(stack.daemon.root).mountpoint)]
    assert {*image.layer_digests, image.manifest_digest, image.config_digest}.isdisjoint(
        stack.containerd.ctr_out("content", "ls", "-q").split())
    # And it pulls again, lazily.
    with stack.cri() as cri:
        cri.pull(ref)
    assert layer_blob_gets(stack, image) == []


def test_hot_list_recorded_on_a_first_pod_then_prefetched_on_a_fresh_node(cri_stacks: Any) -> None:
    first = cri_stacks()
    image, ref = converted(first, "bootseer/hot")
    top = chain_ids(image.diff_ids)[-1]
    with first.cri() as cri:
        cri.pull(ref)
    pod = first.run_pod("hot-pod")
    container = first.run_in_pod(pod, "job", ref, "sh", "-c", HOT_JOB + "; exec sleep 100000")
    finished = wait_for_component("the recording to be published", lambda: [
        f for f in hotlist_status(first)["finished"] if f["kind"] == "recording"])
    assert finished[0]["outcome"] == "published" and finished[0]["sealed_by"] == "marker", finished
    [listed] = show(first, ref)
    assert listed["image"] == top and listed["container"] == container  # the CRI container id
    hot = {b["digest"] for b in show(first, top, "--blocks")[0]["block_list"]}
    assert part_digests([1, 3]) <= hot and not part_digests([0, 2, 4, 5, 6, 7]) & hot

    # A fresh node (its own registry, containerd, daemon root and block cache) over a copy of the store.
    second = cri_stacks()
    shutil.rmtree(second.store_dir, ignore_errors=True)
    shutil.copytree(first.store_dir, second.store_dir)
    _, ref2 = second.build_and_push(name="bootseer/hot", layers=lazy_layers())
    with second.cri() as cri:
        cri.pull(ref2)
    # PullImage alone (no pod yet) started the prefetch, and it finished, page cache included.
    prefetch = wait_for_component("the prefetch to finish, page cache included", lambda: [
        p for p in hotlist_status(second)["prefetches"] if p["image"] == top and p["finished"] and p["warm_finished"]])[0]
    assert prefetch["fetched_blocks"] + prefetch["cached_blocks"] == listed["blocks"]
    assert prefetch["warmed_bytes"] >= 2 * harness.PART_SIZE
    fetched_before = blocks(second)[0]
    pod2 = second.run_pod("hot-pod-2")
    job = second.run_in_pod(pod2, "job", ref2, "sh", "-c", f"sha256sum {part_path(1)} {part_path(3)}; {HOT_JOB}; echo done")
    lines = second.output(pod2, job)
    assert [line.split()[0] for line in lines[:2]] == [sha(part_data(1)), sha(part_data(3))] and lines[-1] == "done"
    assert blocks(second)[0] - fetched_before <= 1  # what it read was there already
    with second.cri() as cri:
        cri.remove_container(job)
    summary = wait_for_component("the prefetch's summary", lambda: [
        f for f in hotlist_status(second)["finished"] if f["kind"] == "prefetch"])[0]
    # The pod's reads came from the page cache the prefetch filled: the summary says so, not "unread".
    # The pod's reads came from the page cache the prefetch filled: the summary says so (issue 17: it said
    # hits 0, misses 0, hit rate None and every byte unread).
    # (A block evicted before the end was read through the layer server: a hit then, not page-cache service.)
    used = summary["hits"] + summary["waited"] + summary["served_from_page_cache_blocks"]
    assert used >= 2 and summary["unread_bytes"] < summary["fetched_bytes"], summary
    assert summary["hit_rate"] is not None and summary["hit_rate"] >= 0.5, summary
    server_log = (second.daemon.root / "layers" / "server.log").read_text()
    [done] = [line for line in server_log.splitlines() if 'msg="hot-list prefetch done"' in line]
    assert "unread_bytes=" not in done and "hits=" not in done, done  # before any pod: nothing to say about reads
    [gone] = [line for line in server_log.splitlines() if 'msg="prefetched container gone"' in line]
    assert f"container={job}" in gone and "hit_rate=None" not in gone, gone


PUBLISHED = ["published", "tool-ran", "-rwxr-x---", "../bin/tool", "app-gone"]  # the job installed, captured
HIT = ["HIT", "tool-ran", "-rwxr-x---", "../bin/tool", "app-gone"]  # the deps layer was stacked: no install


def test_a_dependency_snapshot_reaches_a_pods_container(cri_stacks: Any) -> None:
    stack = cri_stacks()
    image, ref = stack.build_and_push()
    with stack.cri() as cri:
        cri.pull(ref)
    key = compute_key(["sh", "-c", INSTALL], base_chain=chain_ids(image.diff_ids)[-1]).key
    record = stack.store_dir / "v1" / "deps" / f"{container_store_key(key, namespace=CRI_NAMESPACE)}.json"

    def job(pod_name: str, annotations: dict[str, str] | None = None) -> list[str]:
        pod = stack.run_pod(pod_name)
        container = stack.run_in_pod(pod, "install", ref, "sh", "-c", DEPS_JOB, annotations=annotations)
        return " ".join(stack.output(pod, container, 180)).split()

    if container_annotations_reach_the_snapshot():
        # containerd 1.6: a container annotation (CRI passes it on to the container's snapshot).
        assert job("deps-pod-1", {DEPS_LABEL: key}) == PUBLISHED
        assert record.is_file()
        assert job("deps-pod-2", {DEPS_LABEL: key}) == HIT

    # A pod spec cannot set a container's annotations (the kubelet fills them), and from 1.7 on CRI passes none to
    # the container's snapshot: the node's [depsnap] images maps the image reference the layers were pulled by to
    # the key, and a container with no annotation gets it.
    config = stack.base / "snapshotter.toml"
    config.write_text(f'[depsnap.images]\n"{ref}" = "{key}"\n')
    stack.daemon.process.argv += ["--config", str(config)]
    stack.restart_daemon()
    if not container_annotations_reach_the_snapshot():
        # containerd 1.7 and 2.x: the mapping's first container installs, and its writable layer is captured.
        assert not record.exists()
        assert job("deps-pod-3") == PUBLISHED
        assert record.is_file()
    assert job("deps-pod-4") == HIT
    assert "deps key from the node's [depsnap] images" in stack.daemon.process.log_text()


def running_lazy_pod(stack: harness.CriStack) -> tuple[BuiltImage, str, tuple[str, object], str]:
    """A converted image pulled through CRI and a pod whose container runs :data:`LONG` from it:
    (image, reference, pod, container id)."""
    image, ref = converted(stack)
    with stack.cri() as cri:
        cri.pull(ref)
    pod = stack.run_pod("lazy-pod")
    container = stack.run_in_pod(pod, "long", ref, "sh", "-c", LONG)
    wait_running(stack, container)
    return image, ref, pod, container


def test_snapshotter_restarted_under_a_running_pod(cri_stacks: Any) -> None:
    stack = cri_stacks(daemon_args=["--fill-group", "0"])  # counts the blocks a read fetches: no fill groups
    _, ref, _, container = running_lazy_pod(stack)
    before = {row["key"] for row in stack.containerd.snapshots()}

    assert stack.daemon.stop(signal.SIGTERM) == 0
    with stack.cri() as cri:
        # Down: files never read before come from the layer server, which outlives the daemon.
        count = blocks(stack)[0]
        out = cri.exec_sync(container, ["sha256sum", part_path(2), part_path(3)])
        assert [line.split()[0] for line in out.splitlines()] == [sha(part_data(2)), sha(part_data(3))]
        assert blocks(stack)[0] == count + 2
    # A new pod cannot start meanwhile (its sandbox's snapshot is the daemon's to make): the call fails, it does
    # not hang, and the kubelet retries it; the pause image being unconverted makes no difference.
    with pytest.raises(grpc.RpcError) as refused:
        stack.run_pod("while-down")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    stack.daemon.start()
    stack.wait_for_snapshotter()
    with stack.cri() as cri:
        assert cri.container_status(container).state == cri.api.CONTAINER_RUNNING
        assert cri.exec_sync(container, ["sha256sum", part_path(4)]).split()[0] == sha(part_data(4))
    assert {row["key"] for row in stack.containerd.snapshots()} == before
    # A new pod starts from the same lazy layers.
    pod2 = stack.run_pod("after-restart")
    assert stack.output(pod2, stack.run_in_pod(pod2, "after", ref, "cat", PATCH_FILE)) == [PATCH_FILE_DATA.decode().strip()]


def test_a_node_whose_daemon_is_down_starts_pods_on_overlayfs_and_keeps_its_lazy_pods(cri_stacks: Any) -> None:
    """Rolling a node off BootSeer (or riding out a long outage of its daemon): CRI's snapshotter set back to
    overlayfs and containerd restarted. New pods start (their images downloaded in full); a pod running on lazy
    layers keeps running and reading never-read files (the layer server outlives the daemon); once the daemon is
    back, removing that pod leaves none of its snapshots behind."""
    stack = cri_stacks()
    image, ref, pod, lazy = running_lazy_pod(stack)

    assert stack.daemon.stop(signal.SIGTERM) == 0
    stack.containerd.stop()
    stack.containerd.cri_snapshotter = BUILTIN_OVERLAY
    stack.containerd.start()
    with stack.cri() as cri:
        assert cri.container_status(lazy).state == cri.api.CONTAINER_RUNNING
        assert cri.exec_sync(lazy, ["sha256sum", part_path(6)]).split()[0] == sha(part_data(6))
        cri.pull(ref)  # onto overlayfs: every layer downloaded
    assert len(layer_blob_gets(stack, image)) == len(image.layer_digests)
    pod2 = stack.run_pod("overlay-pod")
    assert stack.output(pod2, stack.run_in_pod(pod2, "app", ref, "cat", APP_FILE)) == [APP_FILE_DATA.decode().strip()]

    stack.daemon.start()
    stack.wait_for_snapshotter()
    with stack.cri() as cri:
        cri.remove_container(lazy)
        cri.remove_pod(pod[0])
    wait_for_component("the lazy pod's snapshot to go", lambda: not [
        key for key in harness.snapshotter_view(stack) if key.endswith(f"/{lazy}")], 60)


#: Each config dialect's node example: containerd 1.6 and 1.7 read ``version = 2``, 2.x ``version = 3``.
NODE_EXAMPLES = {2: "containerd-config-k8s-node.toml", 3: "containerd-config-k8s-node-v3.toml"}


def loaded_config(path: Path) -> dict:
    """What the containerd the tests run makes of the config at ``path``."""
    return containerd_install().loaded_config(path)


def bootseer_settings(loaded: dict) -> dict:
    """BootSeer's settings in a loaded config (:func:`loaded_config`), wherever its version keeps them: the
    proxy plugin, and the CRI image settings (2.x: ``io.containerd.cri.v1.images``; 1.x: the CRI plugin's
    ``containerd`` table)."""
    plugins = loaded["plugins"]
    images = plugins.get("io.containerd.cri.v1.images") or plugins["io.containerd.grpc.v1.cri"]["containerd"]
    proxy = loaded["proxy_plugins"]["bootseer"]
    names = ["snapshotter", "disable_snapshot_annotations", "discard_unpacked_layers"]
    if "use_local_image_pull" in images:
        names.append("use_local_image_pull")
    return {"type": proxy["type"], **{name: images[name] for name in names}}


def test_the_node_example_is_what_containerd_loads_and_what_the_tests_run(tmp_path: Path) -> None:
    """The node example of the running containerd's config dialect (ctr_examples/containerd-config-k8s-node.toml
    for 1.6 and 1.7, containerd-config-k8s-node-v3.toml for 2.x) loads into that containerd with BootSeer's
    settings as the CRI stack these tests run sets them (both loaded by the same containerd); 2.x also converts
    the 1.x example to the same settings (a node upgraded with its old file), but not a version 2 file whose CRI
    ``containerd`` table has no ``runtimes`` (containerd's conversion drops BootSeer's settings then)."""
    from bootseer.snapshotter.config import DEFAULTS

    tested_config = harness.CriContainerd(tmp_path / "ctrd", tmp_path / "s.sock", registry="r", sandbox_image="p")
    dialect = tested_config.config_dialect()
    example = REPO_ROOT / "ctr_examples" / NODE_EXAMPLES[dialect]
    assert f"\nversion = {dialect}\n" in example.read_text()
    (tmp_path / "tested.toml").write_text(tested_config.config_text())
    loaded, tested = loaded_config(example), loaded_config(tmp_path / "tested.toml")

    assert loaded["version"] == tested["version"] == dialect
    assert loaded["proxy_plugins"]["bootseer"]["address"] == DEFAULTS["address"]
    expected = {"type": "snapshot", "snapshotter": "bootseer", "disable_snapshot_annotations": False,
                "discard_unpacked_layers": False}
    if dialect == 3:
        expected["use_local_image_pull"] = True
    assert bootseer_settings(loaded) == bootseer_settings(tested) == expected
    if dialect == 3:
        converted_v2 = loaded_config(REPO_ROOT / "ctr_examples" / NODE_EXAMPLES[2])
        assert converted_v2["version"] == 3
        assert bootseer_settings(converted_v2) == {**expected, "use_local_image_pull": False}
        # But only because that file has a runtimes table: 2.x's conversion (plugins/cri/images/plugin.go,
        # migrateConfig) returns before it copies snapshotter, disable_snapshot_annotations and
        # discard_unpacked_layers when [plugins."io.containerd.grpc.v1.cri".containerd] has no runtimes.
        # A node's version 2 file without one silently pulls onto overlayfs after the upgrade (docs/kubernetes.md).
        without_runtimes = tmp_path / "v2-without-runtimes.toml"
        without_runtimes.write_text('version = 2\n[proxy_plugins.bootseer]\n  type = "snapshot"\n  address = "/s"\n'
                                    '[plugins."io.containerd.grpc.v1.cri".containerd]\n  snapshotter = "bootseer"\n'
                                    '  disable_snapshot_annotations = false\n')
        assert bootseer_settings(loaded_config(without_runtimes)) == {
            **expected, "snapshotter": "overlayfs", "disable_snapshot_annotations": True, "use_local_image_pull": False}
