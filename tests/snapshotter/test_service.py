"""Every Snapshots RPC through a real ``bootseer-snapshotter`` over its unix socket.

What containerd's proxy client sees: results, streamed List blocks, and the status
codes its ``errdefs`` turns back into error kinds.
"""

from __future__ import annotations

import os
import shutil
from concurrent import futures
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2

from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2 as api
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as api_grpc
from tests.support.daemon import SnapshotterDaemon

Code = grpc.StatusCode


def rpc_error(call, *args) -> grpc.RpcError:
    """Make a call that must fail; return its error."""
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value


def writable_dir(mounts) -> Path:
    """The directory an active snapshot's writes land in."""
    (mount,) = mounts
    if mount.type == "bind":
        return Path(mount.source)
    (upper,) = [o.removeprefix("upperdir=") for o in mount.options if o.startswith("upperdir=")]
    return Path(upper)


def listed(stub: api_grpc.SnapshotsStub, *filters: str) -> list[api.ListSnapshotsResponse]:
    return list(stub.List(api.ListSnapshotsRequest(snapshotter="bootseer", filters=filters)))


def names(responses: list[api.ListSnapshotsResponse]) -> set[str]:
    return {info.name for response in responses for info in response.info}


def test_prepare_commit_view_stat(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    before = datetime.now(timezone.utc)
    prepared = stub.Prepare(api.PrepareSnapshotRequest(snapshotter="bootseer", key="extract", labels={"a": "1"}))
    (mount,) = prepared.mounts
    assert mount.type == "bind" and "rw" in mount.options
    assert Path(mount.source).is_dir()
    assert stub.Mounts(api.MountsRequest(key="extract")).mounts == prepared.mounts
    (writable_dir(prepared.mounts) / "file").write_text("layer content")

    stub.Commit(api.CommitSnapshotRequest(name="layer", key="extract", labels={"b": "2"}))
    info = stub.Stat(api.StatSnapshotRequest(key="layer")).info
    after = datetime.now(timezone.utc)
    assert (info.name, info.parent, info.kind) == ("layer", "", api.COMMITTED)
    assert dict(info.labels) == {"b": "2"}  # commit's labels replace the active snapshot's
    created = info.created_at.ToDatetime(timezone.utc)
    assert before - timedelta(seconds=1) <= created <= after + timedelta(seconds=1)
    assert info.updated_at.ToDatetime(timezone.utc) >= created
    assert rpc_error(stub.Stat, api.StatSnapshotRequest(key="extract")).code() == Code.NOT_FOUND

    child = stub.Prepare(api.PrepareSnapshotRequest(key="rw", parent="layer")).mounts
    (overlay,) = child
    assert overlay.type == "overlay"
    assert f"lowerdir={mount.source}" in overlay.options
    rw = stub.Stat(api.StatSnapshotRequest(key="rw")).info
    assert (rw.parent, rw.kind) == ("layer", api.ACTIVE)

    view = stub.View(api.ViewSnapshotRequest(key="ro", parent="layer")).mounts
    assert [(m.type, m.source, "ro" in m.options) for m in view] == [("bind", mount.source, True)]
    assert stub.Stat(api.StatSnapshotRequest(key="ro")).info.kind == api.VIEW
    assert stub.Mounts(api.MountsRequest(key="ro")).mounts == view


def test_error_codes(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    stub.Prepare(api.PrepareSnapshotRequest(key="active"))
    stub.Prepare(api.PrepareSnapshotRequest(key="extract"))
    stub.Commit(api.CommitSnapshotRequest(name="base", key="extract"))
    stub.Prepare(api.PrepareSnapshotRequest(key="child", parent="base"))

    cases = [
        (stub.Prepare, api.PrepareSnapshotRequest(key="active"), Code.ALREADY_EXISTS, "active"),
        (stub.Prepare, api.PrepareSnapshotRequest(key="x", parent="nope"), Code.NOT_FOUND, "nope"),
        (stub.Prepare, api.PrepareSnapshotRequest(key="x", parent="active"), Code.INVALID_ARGUMENT, "active"),
        (stub.Prepare, api.PrepareSnapshotRequest(key=""), Code.INVALID_ARGUMENT, "key"),
        (stub.View, api.ViewSnapshotRequest(key="base"), Code.ALREADY_EXISTS, "base"),
        (stub.Mounts, api.MountsRequest(key="nope"), Code.NOT_FOUND, "nope"),
        (stub.Mounts, api.MountsRequest(key="base"), Code.FAILED_PRECONDITION, "base"),
        (stub.Commit, api.CommitSnapshotRequest(name="base", key="active"), Code.ALREADY_EXISTS, "base"),
        (stub.Commit, api.CommitSnapshotRequest(name="new", key="nope"), Code.NOT_FOUND, "nope"),
        (stub.Commit, api.CommitSnapshotRequest(name="new", key="base"), Code.FAILED_PRECONDITION, "base"),
        (stub.Remove, api.RemoveSnapshotRequest(key="base"), Code.FAILED_PRECONDITION, "base"),
        (stub.Remove, api.RemoveSnapshotRequest(key="nope"), Code.NOT_FOUND, "nope"),
        (stub.Stat, api.StatSnapshotRequest(key="nope"), Code.NOT_FOUND, "nope"),
        (stub.Usage, api.UsageRequest(key="nope"), Code.NOT_FOUND, "nope"),
        (stub.Update, api.UpdateSnapshotRequest(info=api.Info(name="nope")), Code.NOT_FOUND, "nope"),
        (stub.Update, api.UpdateSnapshotRequest(), Code.INVALID_ARGUMENT, "info"),
        (
            stub.Update,
            api.UpdateSnapshotRequest(info=api.Info(name="base", kind=42)),
            Code.INVALID_ARGUMENT,
            "kind 42",
        ),
        (
            stub.Update,
            api.UpdateSnapshotRequest(
                info=api.Info(name="base", parent="other"), update_mask=field_mask_pb2.FieldMask(paths=["parent"])
            ),
            Code.INVALID_ARGUMENT,
            "parent",
        ),
        (
            stub.Prepare,
            api.PrepareSnapshotRequest(key="x", labels={"big": "v" * 5000}),
            Code.INVALID_ARGUMENT,
            "label",
        ),
    ]
    for call, request, code, mentioned in cases:
        error = rpc_error(call, request)
        assert (error.code(), mentioned in error.details()) == (code, True), (call, request, error)
    # Failed calls change nothing.
    assert names(listed(stub)) == {"active", "base", "child"}


def test_remove(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    mounts = stub.Prepare(api.PrepareSnapshotRequest(key="k")).mounts
    directory = writable_dir(mounts)
    assert directory.is_dir()
    stub.Remove(api.RemoveSnapshotRequest(key="k"))
    assert rpc_error(stub.Stat, api.StatSnapshotRequest(key="k")).code() == Code.NOT_FOUND
    assert not directory.exists()
    # The key is free again.
    stub.Prepare(api.PrepareSnapshotRequest(key="k"))


def test_update_labels(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    stub.Prepare(api.PrepareSnapshotRequest(key="k", labels={"keep": "1", "drop": "2"}))
    first = stub.Stat(api.StatSnapshotRequest(key="k")).info

    def update(labels: dict[str, str], *paths: str) -> api.Info:
        request = api.UpdateSnapshotRequest(
            snapshotter="bootseer",
            info=api.Info(name="k", labels=labels),
            update_mask=field_mask_pb2.FieldMask(paths=paths) if paths else None,
        )
        return stub.Update(request).info

    # Paths set one label and delete another (absent from info); the rest is kept.
    updated = update({"new": "3"}, "labels.new", "labels.drop")
    assert dict(updated.labels) == {"keep": "1", "new": "3"}
    assert updated.updated_at.ToDatetime() >= first.updated_at.ToDatetime()
    assert updated.created_at == first.created_at
    assert stub.Stat(api.StatSnapshotRequest(key="k")).info == updated

    # No mask: every mutable field, i.e. the labels are replaced.
    assert dict(update({"only": "this"}).labels) == {"only": "this"}
    assert dict(update({"all": "new"}, "labels").labels) == {"all": "new"}


@pytest.mark.parametrize("field", ["created_at", "updated_at"])
@pytest.mark.parametrize(
    "seconds, nanos",
    [(10**12, 0), (-(10**12), 0), (2**63 - 1, 0), (253402300800, 0), (-62135596801, 0), (0, -1), (0, 10**9)],
)
def test_update_with_out_of_range_timestamp_is_invalid_argument(
    snapd: SnapshotterDaemon, field: str, seconds: int, nanos: int
) -> None:
    stub = snapd.stub
    stub.Prepare(api.PrepareSnapshotRequest(key="k", labels={"a": "1"}))
    info = api.Info(name="k", labels={"a": "2"})
    getattr(info, field).CopyFrom(timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos))
    error = rpc_error(stub.Update, api.UpdateSnapshotRequest(info=info))
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"{field} out of range" in error.details()
    assert dict(stub.Stat(api.StatSnapshotRequest(key="k")).info.labels) == {"a": "1"}  # nothing changed
    # The limits themselves are valid timestamps.
    getattr(info, field).CopyFrom(timestamp_pb2.Timestamp(seconds=253402300799, nanos=999_999_999))
    assert dict(stub.Update(api.UpdateSnapshotRequest(info=info)).info.labels) == {"a": "2"}
    assert not any(r["msg"] == "call failed with an unexpected error" for r in snapd.log_records())


def test_usage(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    mounts = stub.Prepare(api.PrepareSnapshotRequest(key="k")).mounts
    empty = stub.Usage(api.UsageRequest(key="k"))
    (writable_dir(mounts) / "data").write_bytes(os.urandom(64 * 1024))
    (writable_dir(mounts) / "dir").mkdir()
    grown = stub.Usage(api.UsageRequest(key="k"))
    assert grown.inodes == empty.inodes + 2
    assert grown.size >= empty.size + 64 * 1024

    stub.Commit(api.CommitSnapshotRequest(name="layer", key="k"))
    assert stub.Usage(api.UsageRequest(key="layer")) == grown


def test_list_streams_in_bounded_blocks(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    count = 250
    for i in range(count):
        stub.Prepare(api.PrepareSnapshotRequest(key=f"k{i:03}", labels={"parity": "even" if i % 2 == 0 else "odd"}))
    stub.Commit(api.CommitSnapshotRequest(name="committed", key="k000"))

    responses = listed(stub)
    assert len(responses) >= 3  # 251 snapshots in blocks of at most 100
    assert all(0 < len(response.info) <= 100 for response in responses)
    assert names(responses) == {f"k{i:03}" for i in range(1, count)} | {"committed"}
    assert sum(len(response.info) for response in responses) == count

    assert len(names(listed(stub, "labels.parity==odd"))) == count // 2
    assert names(listed(stub, "name==k001", "kind==committed")) == {"k001", "committed"}
    assert names(listed(stub, "kind==active,labels.parity==even")) == {f"k{i:03}" for i in range(2, count, 2)}
    assert listed(stub, "name==none") == []
    error = rpc_error(listed, stub, "name==")
    assert error.code() == Code.INVALID_ARGUMENT


def test_backtracking_filter_neither_stalls_list_nor_blocks_other_calls(snapd: SnapshotterDaemon) -> None:
    # (a+)+$ over "aaa...a!" takes a backtracking engine 2**40 steps; Go's regexp (and
    # RE2) answer in linear time.  The deadlines only bound a broken daemon's hang.
    stub = snapd.stub
    stub.Prepare(api.PrepareSnapshotRequest(key="victim", labels={"a": "a" * 40 + "!"}))
    stub.Prepare(api.PrepareSnapshotRequest(key="other", labels={"a": "aaa"}))
    with futures.ThreadPoolExecutor(1) as pool:
        listing = pool.submit(
            lambda: list(stub.List(api.ListSnapshotsRequest(filters=['labels."a"~="(a+)+$"']), timeout=30))
        )
        assert stub.Stat(api.StatSnapshotRequest(key="victim"), timeout=15).info.name == "victim"
        assert names(listing.result()) == {"other"}
    assert snapd.stop() == 0  # and SIGTERM still stops it


@pytest.mark.parametrize("depth", [1001, 10_000])
def test_deeply_nested_filter_regex_is_invalid_argument(snapd: SnapshotterDaemon, depth: int) -> None:
    snapd.stub.Prepare(api.PrepareSnapshotRequest(key="k"))
    pattern = "(" * depth + "a" + ")" * depth
    error = rpc_error(listed, snapd.stub, f"name~=/{pattern}/")
    assert error.code() == Code.INVALID_ARGUMENT
    assert "nests too deeply" in error.details()
    assert names(listed(snapd.stub, "name~=/^k$/")) == {"k"}


def test_list_blocks_stay_small_with_big_labels(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    # 4 labels of ~4 KiB each: 90 snapshots take ~1.4 MiB, fewer than 100 per block.
    labels = {f"label{j}": str(j) * 4000 for j in range(4)}
    for i in range(90):
        stub.Prepare(api.PrepareSnapshotRequest(key=f"k{i}", labels=labels))
    responses = listed(stub)
    assert len(responses) >= 2
    assert all(response.ByteSize() <= 1 << 20 for response in responses)
    assert len(names(responses)) == 90
    assert all(dict(info.labels) == labels for response in responses for info in response.info)


def test_cleanup_keeps_snapshots_and_removes_strays(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    stub.Prepare(api.PrepareSnapshotRequest(key="extract"))
    stub.Commit(api.CommitSnapshotRequest(name="layer", key="extract"))
    stub.Prepare(api.PrepareSnapshotRequest(key="rw", parent="layer"))
    before = listed(stub)
    stray = snapd.root / "snapshots" / "999999"
    (stray / "fs").mkdir(parents=True)

    stub.Cleanup(api.CleanupRequest(snapshotter="bootseer"))
    assert listed(stub) == before
    assert not stray.exists()


def test_unexpected_error_is_internal_and_logged(snapd: SnapshotterDaemon) -> None:
    stub = snapd.stub
    mounts = stub.Prepare(api.PrepareSnapshotRequest(key="k")).mounts
    # Damage from outside: the snapshot's directory vanishes under the daemon.
    shutil.rmtree(writable_dir(mounts))
    error = rpc_error(stub.Usage, api.UsageRequest(key="k"))
    assert error.code() == Code.INTERNAL
    assert "FileNotFoundError" in error.details()

    (record,) = [r for r in snapd.log_records() if r["msg"] == "call failed with an unexpected error"]
    assert (record["level"], record["method"], record["key"]) == ("error", "Usage", "k")
    assert "Traceback" in record["error"]
    # The daemon goes on serving.
    assert stub.Stat(api.StatSnapshotRequest(key="k")).info.name == "k"
