"""Dependency snapshots in containerd, with every real part: registry, private containerd, ``bootseer-snapshotter
--store`` and its layer server, ``ctr run --snapshotter-label containerd.io/snapshot/bootseer.deps=KEY``.

The first container finds no snapshot: its entry point installs (a shell "install" into ``/opt/deps``,
which also deletes a file of the image, as an upgrade does), signals ``/.bootseer/deps-done`` and waits for
``/.bootseer/deps-captured``; the snapshotter captures the writable layer and publishes it.  The second
container (and one on a fresh node over the same store) gets the deps layer stacked under its writable layer:
the guard line sees ``/.bootseer/deps-hit`` and skips the install, and the installed files (modes, a
symlink) and the deletion are there.  Removing it unmounts the deps layer.
"""

from __future__ import annotations

import json
import shutil

import pytest

from bootseer.images.chains import chain_ids
from bootseer.snapshotter.deps_hooks import DEPS_LABEL
from bootseer.depsnap.key import compute_key, container_store_key
from bootseer.depsnap.record import DepsRecord
from integration.harness import layer_server
from tests.support.oci import APP_FILE, demo_layers
from tests.support.stack import Stack
from tests.support.waiting import wait_for_component

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# data.bin is larger than the files a layer's EROFS image holds inline: its reads reach the layer's blob.
INSTALL = ("mkdir -p /opt/deps/bin /opt/deps/lib && echo 'echo tool-ran' > /opt/deps/bin/tool && "
           "head -c 65536 /dev/urandom > /opt/deps/lib/data.bin && "
           f"chmod 0750 /opt/deps/bin/tool && ln -s ../bin/tool /opt/deps/lib/link && rm {APP_FILE}")  # fmt: skip
# The one guard line, then what the job does either way.
JOB = ("[ -e /.bootseer/deps-hit ] && echo HIT || { " + INSTALL + " && touch /.bootseer/deps-done && "
       "until ls /.bootseer | grep -qx deps-captured; do sleep 0.2; done; cat /.bootseer/deps-captured; }; "
       "sh /opt/deps/bin/tool; cat /opt/deps/lib/data.bin > /dev/null; ls -l /opt/deps/bin/tool | cut -c1-10; "
       "readlink /opt/deps/lib/link; "
       f"[ -e {APP_FILE} ] && echo app-present || echo app-gone")  # fmt: skip


def run_with_deps(stack: Stack, ref: str, name: str, key: str) -> list[str]:
    out = stack.containerd.ctr_out("run", "--rm", "--fifo-dir", str(stack.fifo_dir), "--snapshotter",
                                   stack.snapshotter_name, "--snapshotter-label", f"{DEPS_LABEL}={key}",
                                   ref, name, "sh", "-c", JOB, timeout=180)  # fmt: skip
    return out.split()


def test_miss_captures_the_writable_layer_and_a_hit_stacks_it(stacks) -> None:
    first = stacks()
    image, ref = first.build_and_push()
    first.pull(ref)
    top = chain_ids(image.diff_ids)[-1]
    key = compute_key(["sh", "-c", INSTALL], base_chain=top).key

    assert run_with_deps(first, ref, "deps-1", key) == ["published", "tool-ran", "-rwxr-x---", "../bin/tool", "app-gone"]
    # The record is named by the key scoped to the containerd namespace the container ran in.
    name = container_store_key(key, namespace=first.namespace)
    record_path = first.store_dir / "v1" / "deps" / f"{name}.json"
    record = DepsRecord.decode(record_path.read_bytes(), expected_key=name)
    assert record.mode == "container" and record.parent == top

    # A second container on the node: the deps layer is stacked, the install skipped.
    assert run_with_deps(first, ref, "deps-2", key) == ["HIT", "tool-ran", "-rwxr-x---", "../bin/tool", "app-gone"]
    # --rm removed the container; containerd's garbage collector removes its snapshot (run now: its next pass
    # may be tens of seconds away on a loaded machine), and with it the last user of the deps layer, which is
    # then no longer served.
    first.containerd.collect_garbage()
    wait_for_component("the deps layer to be unmounted", lambda: record.chain_id not in [
        layer["chain_id"] for layer in layer_server(first).status()["layers"]], 30)

    # The key on another image (its first two layers only): neither stacked nor captured; the job installs.
    other, other_ref = first.build_and_push(name="bootseer/other", layers=demo_layers()[:2])
    first.pull(other_ref)
    out = run_with_deps(first, other_ref, "deps-other", key)
    assert out[0] == "skipped:" and "another image" in " ".join(out) and out[-4:] == ["tool-ran", "-rwxr-x---",
                                                                                      "../bin/tool", "app-gone"]
    assert DepsRecord.decode(record_path.read_bytes(), expected_key=name) == record

    # A fresh node (own registry, containerd, snapshotter root, empty cache) over a copy of the store, in the
    # same containerd namespace (another namespace's record has another name).
    second = stacks(namespace=first.namespace)
    image2, ref2 = second.build_and_push()
    assert image2.diff_ids == image.diff_ids
    shutil.copytree(first.store_dir, second.store_dir, dirs_exist_ok=True)
    second.pull(ref2)
    assert run_with_deps(second, ref2, "deps-3", key) == ["HIT", "tool-ran", "-rwxr-x---", "../bin/tool", "app-gone"]
    # Only one record, never rewritten by the hit.
    assert json.loads(record_path.read_bytes())["key"] == name


def test_a_capture_of_one_namespace_is_not_stacked_in_another(stacks) -> None:
    """The same label in another containerd namespace, over a copy of the store: a miss, which installs and
    publishes that namespace's own record (issue 14, item 2: it used to be stacked)."""
    first = stacks()
    image, ref = first.build_and_push()
    first.pull(ref)
    key = compute_key(["sh", "-c", INSTALL], base_chain=chain_ids(image.diff_ids)[-1]).key
    assert run_with_deps(first, ref, "deps-a", key)[0] == "published"

    other = stacks()  # another namespace
    assert other.namespace != first.namespace
    _, other_ref = other.build_and_push()
    shutil.copytree(first.store_dir, other.store_dir, dirs_exist_ok=True)
    other.pull(other_ref)
    assert run_with_deps(other, other_ref, "deps-b", key) == ["published", "tool-ran", "-rwxr-x---", "../bin/tool",
                                                              "app-gone"]  # fmt: skip
    names = {p.stem for p in (other.store_dir / "v1" / "deps").glob("*.json")}
    assert names == {container_store_key(key, namespace=ns) for ns in (first.namespace, other.namespace)}


def test_a_stacked_deps_layer_gets_a_hot_list_of_its_own(stacks) -> None:
    """With the image served lazily too, the deps layer is the top of the image for hot lists: the first start
    on it records the reads of the installed files (keyed by the deps layer's ChainID), and it is published."""
    from integration.harness import bootseer_convert as convert
    from integration.harness import bootseer_rpull as rpull
    from integration.harness import hotlist_show as show
    from integration.harness import hotlist_status

    stack = stacks()
    image, ref = stack.build_and_push()
    convert(stack, ref)
    rpull(stack, ref)  # every layer lazy: the container's parent is a served chain
    top = chain_ids(image.diff_ids)[-1]
    key = compute_key(["sh", "-c", INSTALL], base_chain=top).key
    assert run_with_deps(stack, ref, "deps-lazy-1", key)[0] == "published"
    name = container_store_key(key, namespace=stack.namespace)
    record = DepsRecord.decode((stack.store_dir / "v1" / "deps" / f"{name}.json").read_bytes(), expected_key=name)
    out = stack.containerd.ctr_out("run", "--rm", "--fifo-dir", str(stack.fifo_dir), "--snapshotter",
                                   stack.snapshotter_name, "--snapshotter-label", f"{DEPS_LABEL}={key}", ref,
                                   "deps-lazy-2", "sh", "-c", JOB, timeout=180)  # fmt: skip  (its removal seals the recording)
    assert out.split()[0] == "HIT"
    wait_for_component("the deps start's recording", lambda: [
        f for f in hotlist_status(stack)["finished"] if f["kind"] == "recording" and f["image"] == record.chain_id])
    [listed] = show(stack, record.chain_id)
    layers = {layer["chain_id"]: layer for layer in listed["layers"]}
    assert set(layers) == {*chain_ids(image.diff_ids), record.chain_id}
    assert layers[record.chain_id]["blocks"] >= 1  # /opt/deps/lib/data.bin, read from the deps layer's blob
