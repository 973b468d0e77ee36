"""The dependency-snapshot example (``ctr_examples/deps-example/run.sh``), step by step with timings.

Builds an image (busybox, the demo's files, and an /app layer with entrypoint.sh, install.sh, job.sh and a
tar of "packages"), pushes it to a local registry, pulls it through ``bootseer-snapshotter --store``, computes
the key with ``bootseer deps key --base <top ChainID>``, runs the job twice with the label
``containerd.io/snapshot/bootseer.deps=KEY`` and lists the store's snapshots with ``bootseer deps ls``.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from bootseer.images.chains import chain_ids  # noqa: E402
from bootseer.snapshotter.deps_hooks import DEPS_LABEL  # noqa: E402
from tests.support.layers import File, Layer  # noqa: E402
from tests.support.oci import demo_layers  # noqa: E402
from tests.support.processes import run  # noqa: E402
from tests.support.stack import Stack  # noqa: E402

BOOTSEER = str(REPO / ".venv" / "bin" / "bootseer")


def packages_tar() -> bytes:
    """What the stand-in install unpacks: two small "packages"."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("trainer/VERSION", b"1.4.2\n"), ("trainer/__init__.py", b"def train(): pass\n"),
                           ("tokenizer/__init__.py", b"VOCAB = 32000\n")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def app_layer() -> Layer:
    files = [File(f"app/{name}", (HERE / name).read_bytes(), 0o755) for name in ("entrypoint.sh", "install.sh", "job.sh")]
    return Layer(tuple(files + [File("app/packages.tar", packages_tar())]), "the job")


def timed(title: str, fn):
    print(f"==> {title}", flush=True)
    started = time.monotonic()
    result = fn()
    print(f"    ({time.monotonic() - started:.2f} s)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    if args.keep:
        os.environ["BOOTSEER_KEEP_TMP"] = "1"
    with Stack(store=True) as stack:
        image, ref = timed("build and push the image", lambda: stack.build_and_push(
            name="bootseer/deps-example", layers=[*demo_layers(), app_layer()]))
        timed(f"pull {ref} through the bootseer snapshotter", lambda: stack.pull(ref))
        top = chain_ids(image.diff_ids)[-1]
        key_out = run([BOOTSEER, "deps", "key", "--base", top, "--input", str(HERE / "install.sh"), "--",
                               "sh", "/app/install.sh"]).stdout.decode()  # fmt: skip
        key = key_out.split()[1]
        print(key_out)
        for n, what in ((1, "first run: a miss, the job installs and the snapshotter captures"),
                        (2, "second run: a hit, the install is skipped")):  # fmt: skip
            out = timed(what, lambda: stack.containerd.ctr_out(
                "run", "--rm", "--fifo-dir", str(stack.fifo_dir), "--snapshotter", stack.snapshotter_name,
                "--snapshotter-label", f"{DEPS_LABEL}={key}", ref, f"deps-example-{n}", "/app/entrypoint.sh",
                timeout=300))  # fmt: skip
            print("    " + out.strip().replace("\n", "\n    "))
        print(run([BOOTSEER, "deps", "ls", "--store", stack.store_url.removeprefix("file://"),
                           "--root", str(stack.base / "no-node-state")]).stdout.decode())  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
