"""Trust end to end, with every real part: a registry, ``bootseer convert --sign-key`` into a local
store, a writer with no key replacing a layer (the forged-index attack of issue 14 item 9),
``bootseer-snapshotter --converter-key`` (and the layer server it starts), a private containerd,
``bootseer rpull`` and ``ctr run``.

The node trusts only the converter: the signed layer is served lazily, the forged one is
downloaded from the registry as if it had never been converted (visibly: a log line and
``remote_fallbacks_total{reason="untrusted"}``), and the container runs the genuine bytes.
Dependency snapshots in containers: a node trusting one node key stacks the capture that node
signed (its deps layer mounted on the record's word, the converter's key required of image
layers) and installs over the same record with its signature stripped.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bootseer.blockstore.objects.signing import generate_key
from integration import harness
from integration.harness import bootseer_convert as convert, bootseer_rpull as rpull
from tests.support.forgery import forge_file
from tests.support.layers import File, Layer
from tests.support.oci import busybox_layer, chain_ids
from tests.support.processes import run
from tests.support.stack import Stack
from integration.test_depsnap import run_with_deps
from integration.test_lazy import metric_total

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GENUINE = b"the genuine tool\n"
EVIL = b"the attacker's tool, under the genuine image's digest\n"


def test_a_node_that_trusts_the_converter_downloads_a_forged_layer_and_runs_the_genuine_image(
    runnable, tmp_path: Path
) -> None:
    key = tmp_path / "converter"
    generate_key(key)
    stack = Stack(store=True, daemon_args=["--converter-key", f"{key}.pub"])
    with harness.running(stack):
        image, ref = stack.build_and_push(
            name="bootseer/trusted", layers=[busybox_layer(), Layer((File("/app/tool", GENUINE),), "app")]
        )
        run([harness.BOOTSEER, "convert", "--plain-http", "--store", stack.store_url, "--sign-key", str(key), ref],
                    timeout=300)  # fmt: skip
        evil, evil_ref = stack.build_and_push(name="bootseer/evil", layers=[Layer((File("/payload", EVIL),), "evil")])
        convert(stack, evil_ref)  # the attacker's own image, unsigned: where the forgery's blocks come from
        chains = chain_ids(image.diff_ids)
        forge_file(stack.store_dir, chains[1], "app/tool", chain_ids(evil.diff_ids)[0], "payload")

        out = rpull(stack, ref)
        assert "2 layers on bootseer: 1 lazy, 1 downloaded" in out, out
        assert metric_total(stack, r'fallbacks_total\{.*reason="untrusted"') == 1
        assert re.search(rf"not served lazily.*chain_id={chains[1]}.*reason=untrusted.*not signed by a trusted converter key",
                         stack.daemon.process.log_text())  # fmt: skip
        assert stack.run_container(ref, "trusted", "cat", "/app/tool").encode() == GENUINE


def test_a_node_trusting_a_node_key_stacks_its_signed_capture_and_installs_over_a_stripped_one(
    stacks, tmp_path: Path
) -> None:
    node_key, converter = tmp_path / "node", tmp_path / "converter"
    generate_key(node_key)
    generate_key(converter)
    key = "5" * 64  # the label's key: what the job names its dependencies by
    first = stacks(daemon_args=["--sign-key", str(node_key)])
    image, ref = first.build_and_push()
    first.pull(ref)
    assert run_with_deps(first, ref, "deps-1", key)[0] == "published"
    (record_path,) = (first.store_dir / "v1" / "deps").glob("*.json")
    record = json.loads(record_path.read_text())
    assert [s["key"] for s in record["signatures"]] == [_key_id(node_key)]

    second = stacks(namespace=first.namespace,  # deps keys are scoped by namespace
                    daemon_args=["--writer-key", f"{node_key}.pub", "--converter-key", f"{converter}.pub"])
    _image, ref2 = second.build_and_push()
    shutil.copytree(first.store_dir, second.store_dir, dirs_exist_ok=True)
    second.pull(ref2)  # not converted: downloaded; only the deps layer is served from the store
    assert run_with_deps(second, ref2, "deps-2", key)[0] == "HIT"

    del record["signatures"]  # what a store writer without the node key can publish
    (second.store_dir / record_path.relative_to(first.store_dir)).write_text(json.dumps(record))
    out = run_with_deps(second, ref2, "deps-3", key)
    assert out[0] == "exists", out  # a miss: the job installed, and the capture found the name taken
    assert metric_total(second, r"^bootseer_deps_untrusted_total$") == 1
    assert "ignoring a deps record no trusted writer signed" in second.daemon.process.log_text()


def _key_id(private_key: Path) -> str:
    from bootseer.blockstore.objects.signing import load_signing_key

    return load_signing_key(private_key).public.id
