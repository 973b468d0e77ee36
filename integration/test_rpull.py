"""``bootseer rpull`` against a real containerd and registry (tests/support/stack.py), on containerd's
own overlayfs snapshotter: every layer is "downloaded" there, so this checks the client-side pull
itself -- the content, labels, snapshots and image record it leaves are what ``ctr images pull``
leaves, ``ctr run`` starts the image, and ``ctr images rm`` + GC removes everything.  The lazy path
(the bootseer snapshotter answering ALREADY_EXISTS) is integration/test_lazy.py's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bootseer.images import registry as images
from bootseer.images.chains import LABEL_LAYERS_ABOVE
from bootseer.images.registry import Descriptor
from bootseer.images.rpull import (
    LABEL_CRI_IMAGE_LAYERS, MAX_LABEL_BYTES, child_gc_labels, distribution_source, layer_digest_list,
)
from integration.harness import BOOTSEER, running
from tests.support.containerd import BUILTIN_OVERLAY, containerd_unavailable
from tests.support.layers import File, Layer
from tests.support.oci import (
    APP_FILE, APP_FILE_DATA, BLOB_FILE, OPAQUE_DIR, PATCH_FILE, PATCH_FILE_DATA, add_platform_index, blob_data,
    build_oci_layout, chain_ids, demo_layers,
)
from tests.support.processes import run
from tests.support.stack import Stack
from tests.support.waiting import wait_for_component

#: Real containerd (BOOTSEER_CONTAINERD's): CI runs this file on every containerd version (tests/run.sh).
pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- labels (no containerd)


def _desc(media_type: str, n: int) -> Descriptor:
    return Descriptor(media_type, "sha256:" + f"{n:064x}", n)


def test_child_gc_labels_are_containerds():
    config = _desc(images.MEDIA_OCI_CONFIG, 1)
    layers = [_desc("application/vnd.oci.image.layer.v1.tar+gzip", 2),
              _desc("application/vnd.docker.image.rootfs.diff.tar.gzip", 3)]
    assert child_gc_labels([config, *layers]) == {
        "containerd.io/gc.ref.content.config": config.digest,
        "containerd.io/gc.ref.content.l.0": layers[0].digest,
        "containerd.io/gc.ref.content.l.1": layers[1].digest,
    }
    manifests = [_desc(images.MEDIA_OCI_MANIFEST, 4), _desc(images.MEDIA_DOCKER_MANIFEST, 5),
                 _desc("application/x-other", 6)]
    assert child_gc_labels(manifests) == {
        "containerd.io/gc.ref.content.m.0": manifests[0].digest,
        "containerd.io/gc.ref.content.m.1": manifests[1].digest,
        "containerd.io/gc.ref.content.0": manifests[2].digest,
    }


def test_image_layers_label_stays_under_containerds_limit():
    layers = [_desc("application/vnd.oci.image.layer.v1.tar+gzip", n) for n in range(100)]
    value = layer_digest_list(layers)
    assert len(LABEL_CRI_IMAGE_LAYERS) + len(value) <= MAX_LABEL_BYTES
    assert value.split(",") == [d.digest for d in layers[: len(value.split(","))]]
    assert 50 < len(value.split(",")) < 100


def test_distribution_source_key_drops_the_port():
    source = images.open_image("127.0.0.1:5000/team/app:v1", plain_http=True)
    assert distribution_source(source) == ("containerd.io/distribution.source.127.0.0.1", "team/app")
    assert distribution_source(images.open_image("oci:/nonexistent:v1")) is None


# --------------------------------------------------------------------------- real containerd


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (containerd, mounts)"
    missing = [t for t in ("runc", "docker-registry", "skopeo") if shutil.which(t) is None]
    # containerd, ctr and the shim: the ones BOOTSEER_CONTAINERD chooses (the harness's)
    return f"missing {missing}: run ctr_examples/install-deps.sh" if missing else containerd_unavailable()


@pytest.fixture
def stack():
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    with running(Stack(snapshotter=BUILTIN_OVERLAY)) as s:
        yield s


def rpull(stack: Stack, ref: str, *extra: str, namespace: str | None = None,
          check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [BOOTSEER, "rpull", "--address", str(stack.containerd.address), "--namespace", namespace or stack.namespace,
         "--plain-http", "--snapshotter", BUILTIN_OVERLAY, *extra, ref],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"rpull failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def ctr(stack: Stack, namespace: str, *args: str) -> str:
    return run([stack.containerd.install.ctr, "-a", str(stack.containerd.address), "-n", namespace, *args]
                       ).stdout.decode()


def content_labels(stack: Stack, namespace: str) -> dict[str, dict[str, str]]:
    """``ctr content ls``: digest -> labels."""
    out = {}
    for line in ctr(stack, namespace, "content", "ls").splitlines()[1:]:
        fields = line.split()
        labels = fields[-1] if fields[-1] != "-" and "=" in fields[-1] else ""
        out[fields[0]] = dict(item.split("=", 1) for item in labels.split(",") if item)
    return out


def test_rpull_then_ctr_run(stack: Stack):
    image, ref = stack.build_and_push()
    done = rpull(stack, ref)
    assert "3 layers on overlayfs: 0 lazy, 3 downloaded" in done.stdout
    assert "already unpacked" in done.stdout

    assert ref in stack.containerd.ctr_out("images", "ls", "-q").split()
    chain = chain_ids(image.diff_ids)
    snapshots = {row["key"]: row for row in stack.containerd.snapshots()}
    assert set(snapshots) == set(chain)
    for depth, key in enumerate(chain):
        assert snapshots[key] == {"key": key, "parent": chain[depth - 1] if depth else "", "kind": "Committed"}
    # The extraction snapshots' labels made it onto the committed layers (as containerd's unpacker commits).
    info = stack.containerd.snapshot_info(chain[1])
    assert info["Labels"]["containerd.io/snapshot.ref"] == chain[1]
    assert info["Labels"]["containerd.io/snapshot/cri.layer-digest"] == image.layer_digests[1]
    assert info["Labels"]["containerd.io/snapshot/cri.image-ref"] == ref
    assert info["Labels"]["containerd.io/snapshot/cri.image-layers"] == ",".join(image.layer_digests[1:])
    assert info["Labels"][LABEL_LAYERS_ABOVE] == ",".join(chain[2:])  # the layers above, for a lazy snapshotter
    assert stack.containerd.ctr_out("leases", "ls").splitlines()[1:] == []  # the pull's lease is gone

    out = stack.run_container(ref, "rpulled", "sh", "-c",
                              f"cat {APP_FILE} {PATCH_FILE}; ls {OPAQUE_DIR}; sha256sum {BLOB_FILE}")
    lines = out.splitlines()
    assert lines[:3] == [APP_FILE_DATA.decode().strip(), PATCH_FILE_DATA.decode().strip(), "c.conf"]
    assert lines[3].split()[0] == hashlib.sha256(blob_data()).hexdigest()

    again = rpull(stack, ref)
    assert "0 lazy, 0 downloaded (0 B), 3 already unpacked" in again.stdout


def test_rpull_leaves_what_ctr_pull_leaves(stack: Stack):
    """Same content, same labels, same snapshots, same image target as ``ctr images pull`` (in another namespace)."""
    image, ref = stack.build_and_push()
    rpull(stack, ref)
    theirs = f"{stack.namespace}-ctr"
    try:
        ctr(stack, theirs, "images", "pull", "--plain-http", "--snapshotter", BUILTIN_OVERLAY, ref)
        assert content_labels(stack, stack.namespace) == content_labels(stack, theirs)
        mine_images = ctr(stack, stack.namespace, "images", "ls").splitlines()[1:]
        their_images = ctr(stack, theirs, "images", "ls").splitlines()[1:]
        assert [line.split()[:3] for line in mine_images] == [line.split()[:3] for line in their_images]
        mine_snaps = ctr(stack, stack.namespace, "snapshots", "--snapshotter", "overlayfs", "ls")
        assert mine_snaps == ctr(stack, theirs, "snapshots", "--snapshotter", "overlayfs", "ls")
    finally:
        run([stack.containerd.install.ctr, "-a", str(stack.containerd.address), "-n", theirs, "images", "rm",
                     "--sync", ref], check=False)


def test_gc_after_images_rm_removes_content_and_snapshots(stack: Stack):
    image, ref = stack.build_and_push()
    rpull(stack, ref)
    stack.run_container(ref, "once", "true")
    assert len(content_labels(stack, stack.namespace)) == 2 + len(image.layer_digests)
    stack.containerd.ctr("images", "rm", "--sync", ref)
    wait_for_component("containerd to drop every snapshot", lambda: not stack.containerd.snapshots(), 60)
    assert stack.containerd.ctr_out("content", "ls", "-q").split() == []
    overlay = stack.containerd.root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots"
    wait_for_component("the overlayfs directories to go",
                       lambda: not overlay.is_dir() or not list(overlay.iterdir()), 60)


def test_index_with_platforms(stack: Stack, tmp_path: Path):
    amd = build_oci_layout(tmp_path / "amd", demo_layers(), tag="v1")
    arm = build_oci_layout(tmp_path / "arm", [Layer((File("/arm.txt", b"arm\n"),))], tag="v1")
    add_platform_index(amd, arm)  # one layout holding an index of both, tagged "multi"

    ref = f"{stack.registry.address}/bootseer/multi:v1"
    run(["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false",
                 f"oci:{amd.layout}:multi", f"docker://{ref}"])
    done = rpull(stack, ref, "--platform", "linux/amd64")
    assert "3 downloaded" in done.stdout
    listing = stack.containerd.ctr_out("images", "ls").splitlines()[1]
    assert images.MEDIA_OCI_INDEX in listing
    labels = content_labels(stack, stack.namespace)
    index_digest = listing.split()[2]
    assert set(labels[index_digest]) >= {"containerd.io/gc.ref.content.m.0", "containerd.io/gc.ref.content.m.1"}
    assert stack.run_container(ref, "multi", "cat", APP_FILE).strip() == APP_FILE_DATA.decode().strip()


def test_corrupt_layer_fails_cleanly(stack: Stack):
    image, ref = stack.build_and_push()
    digest = image.layer_digests[1]
    stored = (stack.registry.base / "storage/docker/registry/v2/blobs/sha256" / digest[7:9] / digest[7:] / "data")
    data = bytearray(stored.read_bytes())
    data[1000] ^= 1
    stored.write_bytes(bytes(data))

    done = rpull(stack, ref, check=False)
    assert done.returncode == 1
    assert f"expected {digest}" in done.stderr
    # Nothing half-done stays: no image, no ingest, no lease, no extraction snapshot (the base layer stays
    # until GC, unreferenced, as containerd's own failed pull leaves it).
    assert stack.containerd.ctr_out("images", "ls", "-q").split() == []
    assert stack.containerd.ctr_out("content", "active").splitlines()[1:] == []
    assert stack.containerd.ctr_out("leases", "ls").splitlines()[1:] == []
    assert all(not row["key"].startswith("extract-") for row in stack.containerd.snapshots())
    assert digest not in stack.containerd.ctr_out("content", "ls", "-q").split()


def test_errors_are_clear(stack: Stack):
    image, ref = stack.build_and_push()
    missing = rpull(stack, ref.rsplit(":", 1)[0] + ":nope", check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr
    bad = rpull(stack, "Not A Ref", check=False)
    assert bad.returncode == 2 and "bad image reference" in bad.stderr
    nosock = subprocess.run([BOOTSEER, "rpull", "--address", "/nonexistent.sock", ref], capture_output=True, text=True,
                            timeout=60)
    assert nosock.returncode == 1 and "containerd socket /nonexistent.sock does not exist" in nosock.stderr
    wrong = subprocess.run([BOOTSEER, "rpull", "--address", str(stack.containerd.address), "--namespace",
                            stack.namespace, "--plain-http", "--snapshotter", "nosuch", ref],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "nosuch" in wrong.stderr


def test_an_interrupted_ingest_is_resumed(stack: Stack):
    """A blob write cut off mid-way (a killed rpull) leaves an ingest; the next pull resumes it at its offset."""
    from bootseer.images.rpull import Containerd, _blob_ref

    image, ref = stack.build_and_push()
    source = images.open_image(ref, plain_http=True)
    layer = source.resolve().layers[1]  # the 3 MiB one
    assert layer.size > 2 * (1 << 20)

    class Cut(Exception):
        pass

    def first_chunk_then_die():
        with source.open_blob(layer) as blob:
            yield blob.read(1 << 20)
        raise Cut

    with Containerd(str(stack.containerd.address), stack.namespace) as client:
        with pytest.raises(Cut):
            client.write_content(_blob_ref("layer", layer.digest), layer, first_chunk_then_die(), {})
    active = stack.containerd.ctr_out("content", "active").splitlines()[1:]
    assert len(active) == 1 and _blob_ref("layer", layer.digest) in active[0]

    done = rpull(stack, ref)
    assert "3 downloaded" in done.stdout
    assert "resuming an interrupted content write" in done.stderr and "offset=1048576" in done.stderr
    assert stack.containerd.ctr_out("content", "active").splitlines()[1:] == []
    assert stack.run_container(ref, "resumed", "sha256sum", BLOB_FILE).split()[0] == \
        hashlib.sha256(blob_data()).hexdigest()
