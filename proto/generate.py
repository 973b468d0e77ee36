"""Regenerate the Python stubs for containerd's protos (``python proto/generate.py``).

The ``.proto`` files under ``proto/containerd`` are vendored from containerd; the
generated ``*_pb2.py``/``*_pb2_grpc.py`` modules sit next to them and are committed,
so installing BootSeer does not need ``grpcio-tools``.  protoc writes absolute
imports rooted at the proto path (``from containerd.types import ...``); the
package is installed as ``bootseer.proto``, so those imports are rewritten.

``python proto/generate.py --vendor [GO_API_DIR]`` first copies the ``.proto`` files of
:data:`SOURCES` from containerd's Go sources (default: Debian's
``golang-github-containerd-containerd-dev``, containerd 1.6.20), stripped of the gogoproto
options and import (Go code generation hints; the wire format does not change) and with
their imports rooted at ``containerd/``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
SOURCES = [
    "containerd/types/mount.proto",
    "containerd/types/descriptor.proto",
    "containerd/services/snapshots/v1/snapshots.proto",
    "containerd/services/content/v1/content.proto",
    "containerd/services/images/v1/images.proto",
    "containerd/services/leases/v1/leases.proto",
    "containerd/services/diff/v1/diff.proto",
    "containerd/services/events/v1/events.proto",
    "containerd/events/task.proto",
    "containerd/events/image.proto",
    "containerd/events/container.proto",
]
_IMPORT = re.compile(r"^from containerd(\.[\w.]+)? import", re.MULTILINE)

#: Where Debian's golang-github-containerd-containerd-dev puts containerd's API protos.
GO_API_DIR = Path("/usr/share/gocode/src/github.com/containerd/containerd/api")
CONTAINERD_VERSION = "1.6.20"
_GO_IMPORT_PREFIX = "github.com/containerd/containerd/api/"
_GOGO_IMPORT = re.compile(r'^import weak "gogoproto/gogo.proto";\n', re.MULTILINE)
_GOGO_OPTION_LINES = re.compile(r"^[ \t]*option \(gogoproto\.[^;]*;\n(?:[ \t]*option \(gogoproto\.[^;]*;\n)*(?:[ \t]*\n)?",
                                re.MULTILINE)
_GOGO_FIELD_OPTIONS = re.compile(r"\s*\[\s*\(gogoproto\.[^\]]*\]")
# containerd's fieldpath plugin (Go code generation for event filters): an import and message/file options.
_FIELDPATH_IMPORT = re.compile(r'^import weak "github\.com/containerd/containerd/protobuf/plugin/fieldpath\.proto";\n', re.MULTILINE)
_FIELDPATH_OPTIONS = re.compile(r"^[ \t]*option \(containerd\.plugin\.fieldpath(?:_all)?\) = true;\n", re.MULTILINE)
_LICENSE_END = "*/\n"


def strip_gogoproto(text: str, origin: str) -> str:
    """containerd's ``.proto`` text without gogoproto, imports rooted at ``containerd/``, marked as vendored."""
    text = _GOGO_IMPORT.sub("", text)
    text = _GOGO_OPTION_LINES.sub("", text)
    text = _GOGO_FIELD_OPTIONS.sub("", text)
    text = _FIELDPATH_IMPORT.sub("", text)
    text = _FIELDPATH_OPTIONS.sub("", text)
    if "gogoproto" in text:
        raise ValueError(f"{origin}: gogoproto left after stripping (a field mixing gogo and other options?)")
    text = text.replace(f'import "{_GO_IMPORT_PREFIX}', 'import "containerd/')
    head, sep, rest = text.partition(_LICENSE_END)
    if not sep:
        raise ValueError(f"{origin}: no licence header")
    note = (f"\n// Vendored from containerd {CONTAINERD_VERSION} ({origin}); "
            "gogoproto options removed, wire format unchanged.\n")
    return head + sep + note + rest


def vendor(go_api_dir: Path = GO_API_DIR, dest: Path = PROTO_ROOT) -> None:
    """Copy :data:`SOURCES` from containerd's Go API sources into ``dest``, stripped (see :func:`strip_gogoproto`)."""
    for source in SOURCES:
        relative = source.removeprefix("containerd/")
        text = (go_api_dir / relative).read_text()
        target = dest / source
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(strip_gogoproto(text, f"api/{relative}"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vendor"]:
        vendor(Path(argv[1]) if len(argv) > 1 else GO_API_DIR)
    elif argv:
        print(f"usage: {sys.argv[0]} [--vendor [GO_API_DIR]]", file=sys.stderr)
        return 2
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
