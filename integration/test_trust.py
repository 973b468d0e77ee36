"""Trust end to end, with every real part: a registry, ``bootseer convert --sign-key`` into a local
store, a writer with no key replacing a layer (the forged-index attack of issue 14 item 9),
``bootseer-snapshotter --converter-key`` (and the layer server it starts), a private containerd,
``bootseer rpull`` and ``ctr run``.

The node trusts only the converter: the signed layer is served lazily, the forged one is
downloaded from the registry as if it had never been converted (visibly: a log line and
``remote_fallbacks_total{reason="untrusted"}``), and the container runs the genuine bytes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bootseer.blockstore.signing import generate_key
from integration import harness
from integration.harness import bootseer_convert as convert
from integration.harness import bootseer_rpull as rpull
from integration.test_lazy import metric_total
from tests.support.forgery import forge_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GENUINE = b"the genuine tool\n"
EVIL = b"the attacker's tool, under the genuine image's digest\n"


def test_a_node_that_trusts_the_converter_downloads_a_forged_layer_and_runs_the_genuine_image(
    runnable, tmp_path: Path
) -> None:
    key = tmp_path / "converter"
    generate_key(key)
    stack = harness.Stack(store=True, daemon_args=["--converter-key", f"{key}.pub"])
    try:
        with stack:
            image, ref = stack.build_and_push(
                name="bootseer/trusted", layers=[harness.busybox_layer(), harness.Layer((harness.File("/app/tool", GENUINE),), "app")]
            )
            harness.run([harness.BOOTSEER, "convert", "--plain-http", "--store", stack.store_url, "--sign-key", str(key), ref],
                        timeout=300)  # fmt: skip
            evil, evil_ref = stack.build_and_push(name="bootseer/evil", layers=[harness.Layer((harness.File("/payload", EVIL),), "evil")])
            convert(stack, evil_ref)  # the attacker's own image, unsigned: where the forgery's blocks come from
            chains = harness.chain_ids(image.diff_ids)
            forge_file(stack.store_dir, chains[1], "app/tool", harness.chain_ids(evil.diff_ids)[0], "payload")

            out = rpull(stack, ref)
            assert "2 layers on bootseer: 1 lazy, 1 downloaded" in out, out
            assert metric_total(stack, r'fallbacks_total\{.*reason="untrusted"') == 1
            assert re.search(rf"not served lazily.*chain_id={chains[1]}.*reason=untrusted.*not signed by a trusted converter key",
                             stack.daemon.process.log_text())  # fmt: skip
            assert stack.run_container(ref, "trusted", "cat", "/app/tool").encode() == GENUINE
    finally:
        print(stack.logs())
    assert not stack.teardown_errors, f"teardown: {stack.teardown_errors}"
