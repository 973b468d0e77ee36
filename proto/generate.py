"""Regenerate the Python stubs for containerd's and the Kubernetes CRI's protos (``python proto/generate.py``).

The ``.proto`` files under ``proto/containerd`` are vendored from containerd, and
``proto/cri/runtime/v1/api.proto`` from ``k8s.io/cri-api`` (the CRI v1 API the kubelet
speaks to containerd's CRI plugin; the integration tests drive it as the kubelet does); the
generated ``*_pb2.py``/``*_pb2_grpc.py`` modules sit next to them and are committed,
so installing BootSeer does not need ``grpcio-tools``.  protoc writes absolute
imports rooted at the proto path (``from containerd.types import ...``); the
package is installed as ``bootseer.proto``, so those imports are rewritten.

``python proto/generate.py --vendor [GO_API_DIR]`` first copies the ``.proto`` files of
:data:`SOURCES` from containerd's Go sources (default: Debian's
``golang-github-containerd-containerd-dev``, containerd 1.6.20), stripped of the gogoproto
options and import (Go code generation hints; the wire format does not change) and with
their imports rooted at ``containerd/``.

``python proto/generate.py --vendor-cri API_PROTO`` copies the CRI API from a checkout of
kubernetes/cri-api (``git show v0.25.0:pkg/apis/runtime/v1/api.proto``: the version
containerd 1.6.20 is built with), checked against :data:`CRI_API_SHA256` and stripped the
same way.
"""

from __future__ import annotations

import hashlib
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
#: Vendored from kubernetes/cri-api at :data:`CRI_API_VERSION` (see :func:`vendor_cri`).
CRI_SOURCES = ["cri/runtime/v1/api.proto"]
_IMPORT = re.compile(r"^from (containerd|cri)(\.[\w.]+)? import", re.MULTILINE)

CRI_API_VERSION = "v0.25.0"
#: sha256 of ``pkg/apis/runtime/v1/api.proto`` at :data:`CRI_API_VERSION`, as upstream has it.
CRI_API_SHA256 = "59bb3b2bfd9e4c64d4d14e89ffc27e7b98d829bca95927889c56d45fe0b2f960"

#: Where Debian's golang-github-containerd-containerd-dev puts containerd's API protos.
GO_API_DIR = Path("/usr/share/gocode/src/github.com/containerd/containerd/api")
CONTAINERD_VERSION = "1.6.20"
_GO_IMPORT_PREFIX = "github.com/containerd/containerd/api/"
# containerd imports it weakly by its short path, cri-api by its Go path.
_GOGO_IMPORT = re.compile(r'^import (?:weak )?"(?:github\.com/gogo/protobuf/)?gogoproto/gogo.proto";\n', re.MULTILINE)
_GOGO_OPTION_LINES = re.compile(r"^[ \t]*option \(gogoproto\.[^;]*;\n(?:[ \t]*option \(gogoproto\.[^;]*;\n)*(?:[ \t]*\n)?",
                                re.MULTILINE)
_GOGO_FIELD_OPTIONS = re.compile(r"\s*\[\s*\(gogoproto\.[^\]]*\]")
# containerd's fieldpath plugin (Go code generation for event filters): an import and message/file options.
_FIELDPATH_IMPORT = re.compile(r'^import weak "github\.com/containerd/containerd/protobuf/plugin/fieldpath\.proto";\n', re.MULTILINE)
_FIELDPATH_OPTIONS = re.compile(r"^[ \t]*option \(containerd\.plugin\.fieldpath(?:_all)?\) = true;\n", re.MULTILINE)
_LICENSE_END = "*/\n"


def strip_gogoproto(text: str, origin: str, vendored_from: str = f"containerd {CONTAINERD_VERSION}") -> str:
    """A vendored ``.proto`` text without gogoproto, containerd's imports rooted at ``containerd/``, marked as
    vendored from ``vendored_from`` (``origin``: its path there)."""
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
    note = (f"\n// Vendored from {vendored_from} ({origin}); "
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


def vendor_cri(api_proto: Path, dest: Path = PROTO_ROOT) -> None:
    """Copy cri-api's ``pkg/apis/runtime/v1/api.proto`` (a file that must be :data:`CRI_API_VERSION`'s, by its
    sha256) into ``dest``, stripped of gogoproto (see :func:`strip_gogoproto`)."""
    data = api_proto.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CRI_API_SHA256:
        raise ValueError(f"{api_proto}: sha256 {digest} is not cri-api {CRI_API_VERSION}'s api.proto ({CRI_API_SHA256})")
    target = dest / CRI_SOURCES[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(strip_gogoproto(data.decode(), "pkg/apis/runtime/v1/api.proto", f"k8s.io/cri-api {CRI_API_VERSION}"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["--vendor"]:
            vendor(Path(argv[1]) if len(argv) > 1 else GO_API_DIR)
        elif argv[:1] == ["--vendor-cri"] and len(argv) == 2:
            vendor_cri(Path(argv[1]))
        elif argv:
            print(f"usage: {sys.argv[0]} [--vendor [GO_API_DIR] | --vendor-cri API_PROTO]", file=sys.stderr)
            return 2
    except (OSError, ValueError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *SOURCES,
        *CRI_SOURCES,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for generated in [*PROTO_ROOT.glob("containerd/**/*_pb2*.py"), *PROTO_ROOT.glob("cri/**/*_pb2*.py")]:
        text = generated.read_text()
        generated.write_text(_IMPORT.sub(lambda m: f"from bootseer.proto.{m.group(1)}{m.group(2) or ''} import", text))
    for package in {p.parent for p in PROTO_ROOT.glob("*/**/*.proto")} | {PROTO_ROOT / "containerd"}:
        while package != PROTO_ROOT:
            (package / "__init__.py").touch()
            package = package.parent
    return 0


if __name__ == "__main__":
    sys.exit(main())
