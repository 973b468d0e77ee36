"""The committed gRPC stubs are exactly what ``proto/generate.py`` makes from the vendored protos."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
