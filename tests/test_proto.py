"""The committed gRPC stubs are exactly what ``proto/generate.py`` makes from the vendored protos."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc

PROTO = Path(__file__).resolve().parent.parent / "proto"


def test_generate_reproduces_the_committed_stubs(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev/test extra) generates the stubs")
    copy = tmp_path / "proto"
    shutil.copytree(PROTO, copy, ignore=shutil.ignore_patterns("*_pb2*.py", "__pycache__"))
    subprocess.run([sys.executable, str(copy / "generate.py")], check=True)
    committed = sorted(p.relative_to(PROTO) for p in PROTO.rglob("*_pb2*.py"))
    generated = sorted(p.relative_to(copy) for p in copy.rglob("*_pb2*.py"))
    assert generated == committed
    for relative in committed:
        assert (copy / relative).read_text() == (PROTO / relative).read_text(), f"{relative} is out of date"


def test_service_is_containerds_on_the_wire() -> None:
    # containerd's proxy client calls /containerd.services.snapshots.v1.Snapshots/<Method>.
    service = snapshots_pb2.DESCRIPTOR.services_by_name["Snapshots"]
    assert service.full_name == "containerd.services.snapshots.v1.Snapshots"
    assert [m.name for m in service.methods] == [
        "Prepare", "View", "Mounts", "Commit", "Remove", "Stat", "Update", "List", "Usage", "Cleanup",
    ]
    assert service.methods_by_name["List"].server_streaming
    assert snapshots_pb2.Kind.Value("COMMITTED") == 3
    assert hasattr(snapshots_pb2_grpc, "add_SnapshotsServicer_to_server")


def test_vendoring_reproduces_the_committed_protos(tmp_path: Path) -> None:
    """``generate.py --vendor`` from containerd's Go sources gives exactly the committed ``.proto`` files."""
    generate = _generate()
    if not generate.GO_API_DIR.is_dir():
        pytest.skip(f"{generate.GO_API_DIR} missing: apt-get install golang-github-containerd-containerd-dev")
    generate.vendor(generate.GO_API_DIR, tmp_path)
    for source in generate.SOURCES:
        assert (tmp_path / source).read_text() == (PROTO / source).read_text(), f"{source} differs"
    committed = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    assert committed == sorted(generate.SOURCES + generate.CRI_SOURCES), "a vendored .proto is not listed in generate.py"


def test_strip_gogoproto_refuses_what_it_cannot_strip() -> None:
    generate = _generate()
    text = "/*\nlicence\n*/\n\nsyntax = \"proto3\";\nmessage M {\n\tstring a = 1 [json_name = \"x\", (gogoproto.nullable) = false];\n}\n"
    with pytest.raises(ValueError, match="gogoproto left"):
        generate.strip_gogoproto(text, "api/x.proto")


@pytest.mark.parametrize("module, service, methods", [
    ("content.v1.content_pb2", "containerd.services.content.v1.Content",
     ["Info", "Update", "List", "Delete", "Read", "Status", "ListStatuses", "Write", "Abort"]),
    ("images.v1.images_pb2", "containerd.services.images.v1.Images", ["Get", "List", "Create", "Update", "Delete"]),
    ("leases.v1.leases_pb2", "containerd.services.leases.v1.Leases",
     ["Create", "Delete", "List", "AddResource", "DeleteResource", "ListResources"]),
    ("diff.v1.diff_pb2", "containerd.services.diff.v1.Diff", ["Apply", "Diff"]),
])
def test_rpull_services_are_containerds_on_the_wire(module: str, service: str, methods: list[str]) -> None:
    # rpull calls these as /<full name>/<Method> on containerd's socket: names and order are containerd's.
    import importlib

    pb2 = importlib.import_module(f"bootseer.proto.containerd.services.{module}")
    descriptor = pb2.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
    assert descriptor.full_name == service
    assert [m.name for m in descriptor.methods] == methods
    grpc_module = importlib.import_module(f"bootseer.proto.containerd.services.{module}_grpc")
    assert hasattr(grpc_module, f"{service.rsplit('.', 1)[1]}Stub")


def test_write_action_and_descriptor_fields() -> None:
    from bootseer.proto.containerd.services.content.v1 import content_pb2
    from bootseer.proto.containerd.types import descriptor_pb2

    assert [content_pb2.WriteAction.Value(n) for n in ("STAT", "WRITE", "COMMIT")] == [0, 1, 2]
    fields = {f.name: f.number for f in descriptor_pb2.Descriptor.DESCRIPTOR.fields}
    assert fields == {"media_type": 1, "digest": 2, "size": 3, "annotations": 5}
    assert content_pb2.WriteContentRequest.DESCRIPTOR.fields_by_name["labels"].number == 7


def test_events_service_and_task_events_are_containerds_on_the_wire() -> None:
    # The profiler subscribes to /containerd.services.events.v1.Events/Subscribe and decodes each
    # envelope's Any by its type URL (containerd.events.TaskStart, ...): names and numbers are containerd's.
    from google.protobuf import any_pb2, timestamp_pb2

    from bootseer.proto.containerd.events import container_pb2, image_pb2, task_pb2
    from bootseer.proto.containerd.services.events.v1 import events_pb2, events_pb2_grpc

    service = events_pb2.DESCRIPTOR.services_by_name["Events"]
    assert service.full_name == "containerd.services.events.v1.Events"
    assert [m.name for m in service.methods] == ["Publish", "Forward", "Subscribe"]
    assert service.methods_by_name["Subscribe"].server_streaming
    assert hasattr(events_pb2_grpc, "EventsStub")
    envelope = {f.name: f.number for f in events_pb2.Envelope.DESCRIPTOR.fields}
    assert envelope == {"timestamp": 1, "namespace": 2, "topic": 3, "event": 4}
    assert task_pb2.TaskStart.DESCRIPTOR.full_name == "containerd.events.TaskStart"
    assert {f.name: f.number for f in task_pb2.TaskExit.DESCRIPTOR.fields} == {
        "container_id": 1, "id": 2, "pid": 3, "exit_status": 4, "exited_at": 5}
    assert {f.name: f.number for f in task_pb2.TaskCreate.DESCRIPTOR.fields}["pid"] == 6
    assert image_pb2.ImageCreate.DESCRIPTOR.full_name == "containerd.services.images.v1.ImageCreate"
    assert container_pb2.ContainerCreate.DESCRIPTOR.full_name == "containerd.events.ContainerCreate"
    # A round trip through the envelope, as containerd sends it.
    packed = any_pb2.Any()
    packed.Pack(task_pb2.TaskExit(container_id="job", pid=42, exit_status=3,
                                  exited_at=timestamp_pb2.Timestamp(seconds=1700000000)))
    wire = events_pb2.Envelope(namespace="ns", topic="/tasks/exit", event=packed).SerializeToString()
    back = events_pb2.Envelope.FromString(wire)
    assert back.event.type_url == "type.googleapis.com/containerd.events.TaskExit"
    exit_event = task_pb2.TaskExit()
    assert back.event.Unpack(exit_event) and exit_event.exit_status == 3 and exit_event.container_id == "job"


def test_strip_gogoproto_removes_containerds_fieldpath_plugin() -> None:
    generate = _generate()
    text = ('/*\nlicence\n*/\n\nsyntax = "proto3";\n'
            'import weak "github.com/containerd/containerd/protobuf/plugin/fieldpath.proto";\n'
            'option (containerd.plugin.fieldpath_all) = true;\n'
            'message M {\n\toption (containerd.plugin.fieldpath) = true;\n\tstring a = 1;\n}\n')
    out = generate.strip_gogoproto(text, "api/x.proto")
    assert "fieldpath" not in out and "\tstring a = 1;" in out


def _generate() -> ModuleType:
    """proto/generate.py (a tool, not a package's module), loaded from its file."""
    spec = importlib.util.spec_from_file_location("generate", PROTO / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cri_vendoring_takes_only_the_pinned_upstream_file(tmp_path: Path) -> None:
    """``--vendor-cri`` refuses a file that is not cri-api v0.25.0's api.proto (by sha256), with one line, status 2."""
    generate = _generate()
    wrong = tmp_path / "api.proto"
    wrong.write_text("syntax = \"proto3\";\n")
    with pytest.raises(ValueError, match="is not cri-api v0.25.0's api.proto"):
        generate.vendor_cri(wrong, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert generate.main(["--vendor-cri", str(wrong)]) == 2


def test_cri_proto_is_upstreams_without_gogoproto() -> None:
    """The committed CRI proto is cri-api's minus its gogoproto import and file options: every other line is kept."""
    generate = _generate()
    text = (PROTO / generate.CRI_SOURCES[0]).read_text()
    assert "gogoproto" not in text.replace("gogoproto options removed", "")
    assert "Vendored from k8s.io/cri-api v0.25.0 (pkg/apis/runtime/v1/api.proto)" in text
    upstream_head = ('/*\nlicence\n*/\n\nsyntax = "proto3";\n\npackage runtime.v1;\n\n'
                     'import "github.com/gogo/protobuf/gogoproto/gogo.proto";\n\n'
                     'option (gogoproto.goproto_stringer_all) = false;\noption (gogoproto.stringer_all) =  true;\n\n'
                     'service RuntimeService {}\n')
    out = generate.strip_gogoproto(upstream_head, "pkg/apis/runtime/v1/api.proto", "k8s.io/cri-api v0.25.0")
    assert "gogo" not in out.replace("gogoproto options removed", "") and "service RuntimeService {}" in out


def test_cri_services_are_the_kubelets_on_the_wire() -> None:
    # The kubelet calls /runtime.v1.RuntimeService/<Method> and /runtime.v1.ImageService/<Method> on containerd.
    from bootseer.proto.cri.runtime.v1 import api_pb2, api_pb2_grpc

    runtime = api_pb2.DESCRIPTOR.services_by_name["RuntimeService"]
    assert runtime.full_name == "runtime.v1.RuntimeService"
    assert {"RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "CreateContainer", "StartContainer",
            "RemoveContainer", "ExecSync", "ContainerStatus"} <= {m.name for m in runtime.methods}
    image = api_pb2.DESCRIPTOR.services_by_name["ImageService"]
    assert [m.name for m in image.methods] == ["ListImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"]
    assert {f.name: f.number for f in api_pb2.PullImageRequest.DESCRIPTOR.fields} == {
        "image": 1, "auth": 2, "sandbox_config": 3}
    assert api_pb2.ContainerConfig.DESCRIPTOR.fields_by_name["log_path"].number == 11
    assert hasattr(api_pb2_grpc, "RuntimeServiceStub") and hasattr(api_pb2_grpc, "ImageServiceStub")
