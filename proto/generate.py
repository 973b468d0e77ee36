"""Regenerate the Python stubs for containerd's protos (``python proto/generate.py``).

The ``.proto`` files under ``proto/containerd`` are vendored from containerd; the
generated ``*_pb2.py``/``*_pb2_grpc.py`` modules sit next to them and are committed,
so installing BootSeer does not need ``grpcio-tools``.  protoc writes absolute
imports rooted at the proto path (``from containerd.types import ...``); the
package is installed as ``bootseer.proto``, so those imports are rewritten.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
SOURCES = [
    "containerd/types/mount.proto",
    "containerd/services/snapshots/v1/snapshots.proto",
]
_IMPORT = re.compile(r"^from containerd(\.[\w.]+)? import", re.MULTILINE)


def main() -> int:
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *SOURCES,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for generated in PROTO_ROOT.glob("containerd/**/*_pb2*.py"):
        text = generated.read_text()
        generated.write_text(_IMPORT.sub(lambda m: f"from bootseer.proto.containerd{m.group(1) or ''} import", text))
    for package in {p.parent for p in PROTO_ROOT.glob("containerd/**/*.proto")} | {PROTO_ROOT / "containerd"}:
        while package != PROTO_ROOT:
            (package / "__init__.py").touch()
            package = package.parent
    return 0


if __name__ == "__main__":
    sys.exit(main())
