"""The event holder under faults and hostile clients (issue 35): the group outlives any two of its holders,
reads never see a zero, every wait is bounded, and no holder outlives its purpose.

Real processes throughout: a real ``bootseer layer-server`` on ``fanotify`` over a layer converted by the
real converter (tests/blockstore/test_fanotify.py's ``converted``), its real event holders, EROFS mounts
over real sparse blobs, reads in reader processes; or, for what a client may send, a holder started
alone (:func:`~bootseer.blockstore.datapath.local_blobs._start_holder`, as a server starts it) with a test
playing its server on the real socket.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from bootseer.blockstore.datapath import fanotify
from bootseer.blockstore.datapath.event_holder import (
    DONE,
    EVENT,
    EVENTS,
    FORGET,
    HELLO,
    KEEP,
    MAP_HEADER,
    READY,
    REFUSED,
    RELEASE,
    WRITER,
    received_fds,
)
from bootseer.blockstore.datapath.local_blobs import _start_holder
from bootseer.paths import ServerPaths
from tests.blockstore.test_fanotify import _expected, blob_of, converted, drop_caches, read_all, start_reader  # noqa: F401
from tests.blockstore.test_layer_server import node_factory  # noqa: F401,F811 (fixture)
from tests.support.layer_servers import EVENT_HOLDER, active_event_holder, fuse_mounts, layer_server_processes, stop_event_holders
from tests.support.mounts import force_unmount
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
    pytest.mark.skipif(fanotify.unsupported(Path("/var/tmp")) is not None, reason="no fanotify pre-content marks here"),
]

BIG = [f"data/file{n}.bin" for n in range(8)]


def holders(root: Path) -> list[int]:
    return sorted(layer_server_processes(root, EVENT_HOLDER))


def kill_together(*pids: int) -> None:
    """SIGKILL ``pids`` at once (each stopped first: none sees another die)."""
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            os.kill(pid, signum)
    wait_until("the processes are gone", lambda: not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def waits_on_fanotify(pid: int) -> bool:
    """Whether process ``pid`` is blocked in the kernel on a fanotify permission event."""
    try:
        return "fanotify" in Path(f"/proc/{pid}/stack").read_text()
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def held_node(converted: Any, node_factory: Any, range_http_factory: Any, **settings: Any) -> tuple[Any, Any, str, Any]:
    """A fanotify node over an HTTP store whose pack reads are held from now on: (node, client, lower dir, release)."""
    store, built = converted
    server = range_http_factory(store)
    node = node_factory(server.url, data_path="fanotify", **settings)
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    packs = {"/" + str(p.relative_to(store)) for p in (store / "v1" / "packs").rglob("*") if p.is_file()}
    release = server.faults.hold(packs)
    return node, client, lower, (release, server)


def finish(readers: list[subprocess.Popen[str]]) -> dict[str, str]:
    results: dict[str, str] = {}
    for reader in readers:
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        results.update(json.loads(out))
    return results


# -- the group outlives any two of its holders ------------------------------------------------------


def test_killing_the_server_and_the_active_holder_together_leaves_reads_waiting_then_right(
    converted: Any, node_factory: Any, range_http_factory: Any
) -> None:
    node, client, lower, (release, server) = held_node(converted, node_factory, range_http_factory)
    readers = [start_reader(lower, BIG[n::4]) for n in range(4)]
    try:
        wait_until("events wait on the server", lambda: client.status()["fanotify"]["pending"] >= 1)
        active, server_pid = active_event_holder(node.root), node.pid()
        kill_together(server_pid, active)
        late = start_reader(lower, ["data/file7.bin"])  # started with no server and the active holder dead
        wait_until("the standby took over and started a standby of its own", lambda: len(holders(node.root)) == 2)
        assert active not in holders(node.root)
        assert all(reader.poll() is None for reader in [*readers, late]), "a read ended with no server to fill it"
        node.ensure()
        release.set()
        results = finish([*readers, late])
    finally:
        release.set()
    expected = _expected()
    assert results == {path: expected[path] for path in BIG}
    assert "taking over" in (node.root / "layers" / "events.log").read_text()


def test_killing_both_holders_under_waiting_reads_has_the_server_start_a_holder_seeded_with_its_group(
    converted: Any, node_factory: Any, range_http_factory: Any
) -> None:
    node, client, lower, (release, server) = held_node(converted, node_factory, range_http_factory)
    readers = [start_reader(lower, BIG[n::2]) for n in range(2)]
    try:
        wait_until("events wait on the server", lambda: client.status()["fanotify"]["pending"] >= 1)
        before = holders(node.root)
        kill_together(*before)
        wait_until("a seeded holder and its standby hold the group", lambda: len(set(holders(node.root)) - set(before)) == 2)
        assert all(reader.poll() is None for reader in readers)
        release.set()
        results = finish(readers)
    finally:
        release.set()
    expected = _expected()
    assert results == {path: expected[path] for path in BIG}
    assert "seeded with this server's group" in node.log()
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected  # later reads too: the new holder passes their events on


# -- clients ------------------------------------------------------------------------------------------


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def _greeting(sock: socket.socket) -> tuple[list[bytes], list[int]]:
    """The messages a holder greets a server with, up to READY (kinds), and the descriptors they carried."""
    kinds, fds = [], []
    while True:
        data, ancillary, _flags, _ = sock.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
        fds += received_fds(ancillary)
        kinds.append(data[:1])
        if data[:1] in (READY, REFUSED, b""):
            return kinds, fds


def test_a_client_that_connects_to_the_holder_while_a_server_is_connected_is_refused_and_reads_go_on(
    converted: Any, node_factory: Any
) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify")
    lower = node.ensure().mount(built.chain_id).lower_dir
    for _ in range(3):  # a health check, socat: connect, perhaps read, close
        with _connect(node.paths.events_socket) as probe:
            kinds, fds = _greeting(probe)
            assert kinds == [REFUSED] and not fds
    expected = _expected()
    reader = start_reader(lower, sorted(expected))
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    assert json.loads(out) == expected


def test_a_release_sent_while_a_blob_has_holes_is_refused_and_the_next_server_fills_them(
    converted: Any, node_factory: Any
) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify")
    lower = node.ensure().mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, ["small/s1.txt"]) == {"small/s1.txt": expected["small/s1.txt"]}
    node.stop(signal.SIGTERM)
    before = holders(node.root)
    with _connect(node.paths.events_socket) as client:  # no server now: this client is the holder's server
        kinds, fds = _greeting(client)
        for fd in fds:
            os.close(fd)
        assert kinds[0] == HELLO and kinds[-1] == READY
        client.sendmsg([RELEASE])
        log = node.root / "layers" / "events.log"
        wait_until("the holder refuses the release", lambda: "release refused" in log.read_text())
    assert holders(node.root) == before
    node.ensure()
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected


def test_a_fill_map_truncated_while_served_neither_kills_the_holder_nor_serves_a_hole(
    converted: Any, node_factory: Any
) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify")
    client = node.ensure()
    lower = client.mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, BIG[:2]) == {path: expected[path] for path in BIG[:2]}
    before = holders(node.root)
    fill_map = blob_of(node, built).with_suffix(".filled")
    os.truncate(fill_map, 0)
    drop_caches()
    assert read_all(lower, sorted(expected)) == expected
    assert holders(node.root) == before


def test_a_holder_whose_server_went_away_while_it_passed_events_on_sleeps(
    converted: Any, node_factory: Any, range_http_factory: Any
) -> None:
    node, client, lower, (release, server) = held_node(converted, node_factory, range_http_factory)
    reader = start_reader(lower, BIG[:1])
    try:
        wait_until("events wait on the server", lambda: client.status()["fanotify"]["pending"] >= 1)
        active = active_event_holder(node.root)
        os.kill(active, signal.SIGSTOP)  # it finds a new event and its server's end closed in one wake-up
        node.stop(signal.SIGKILL)
        late = start_reader(lower, BIG[1:2])
        wait_until("the new read waits in the kernel for the stopped holder", lambda: waits_on_fanotify(late.pid))
        os.kill(active, signal.SIGCONT)
        log = node.root / "layers" / "events.log"
        wait_until("the holder notices its server is gone", lambda: "server gone" in log.read_text())
        held = holders(node.root)
        start = {pid: cpu_seconds(pid) for pid in held}
        began = time.monotonic()
        wait_until("two seconds pass", lambda: time.monotonic() - began >= 2.0)  # a window to measure CPU over
        spent = {pid: cpu_seconds(pid) - start[pid] for pid in held}
        assert all(seconds < 0.5 for seconds in spent.values()), spent
        node.ensure()
        release.set()
        expected = _expected()
        assert finish([reader, late]) == {path: expected[path] for path in BIG[:2]}
    finally:
        release.set()


def test_a_read_of_a_hole_with_no_server_fails_with_eio_after_the_hole_wait(converted: Any, node_factory: Any) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify", hole_wait=2)
    lower = node.ensure().mount(built.chain_id).lower_dir
    node.stop(signal.SIGKILL)  # and nobody restarts it
    reader = start_reader(lower, BIG[:1])
    _out, err = reader.communicate(timeout=60)  # not forever
    assert reader.returncode != 0 and "Input/output error" in err
    assert "no layer server answered them in time" in (node.root / "layers" / "events.log").read_text()
    node.ensure()  # a server again: the same read is right
    assert read_all(lower, BIG[:1]) == {BIG[0]: _expected()[BIG[0]]}


# -- a holder alone: what a client may send ---------------------------------------------------------------


@pytest.fixture
def lone_holder(tmp_path: Path) -> Iterator[ServerPaths]:
    """A holder started as a server starts it, for a root of its own on this disk (no layer server)."""
    paths = ServerPaths(Path("/var/tmp") / f"bootseer-holder-{os.getpid()}-{tmp_path.name}")
    paths.layers.mkdir(parents=True)
    try:
        _start_holder(paths, hole_wait=120, idle_exit=3600)
        wait_until("the holder and its standby run", lambda: len(holders(paths.root)) == 2)
        yield paths
    finally:
        stop_event_holders(paths.root)
        shutil.rmtree(paths.root, ignore_errors=True)


HOSTILE = [
    ("FORGET, not UTF-8", FORGET + b"\xff\xfe\xfd", 0),
    ("KEEP, not UTF-8", KEEP + b"\xff\xfe", 2),
    ("KEEP, a path", KEEP + b"../../etc", 2),
    ("KEEP, one descriptor", KEEP + b"abc", 1),
    ("KEEP, three descriptors", KEEP + b"abc", 3),
    ("KEEP, a pipe's descriptors", KEEP + b"abc", -2),
    ("KEEP, a fill map claiming 2**40 blocks", KEEP + b"abc", -3),
    ("DONE, a ragged body", DONE + b"\x01\x02\x03", 0),
    ("DONE, numbers never given", DONE + struct.pack("<3i", 0, 1, 2), 0),
    ("unknown kind", b"Q" + b"x" * 100, 1),
    ("huge", FORGET + b"a" * 150_000, 0),
    ("descriptors alone", b"", 2),
]


def _fds(count: int, scratch: Path) -> list[int]:
    if count == -2:
        return list(os.pipe())
    if count == -3:  # a blob and a fill map whose header names far more blocks than the map holds
        forged = scratch.with_name("forged.filled")
        forged.write_bytes(MAP_HEADER.pack(b"BSBLOBMAP1", b"0" * 36, 1 << 40) + b"\x01")
        return [os.open(scratch, os.O_RDONLY), os.open(forged, os.O_RDONLY)]
    return [os.open(scratch, os.O_RDONLY) for _ in range(count)]


def test_whatever_a_client_sends_the_holder_survives_and_still_passes_events_on(lone_holder: ServerPaths) -> None:
    scratch = lone_holder.layers / "scratch"
    scratch.write_bytes(b"")
    before = holders(lone_holder.root)
    client = _connect(lone_holder.events_socket)
    kinds, fds = _greeting(client)
    assert kinds[0] == HELLO and len(fds) == 1
    group = fds[0]
    for _what, message, count in HOSTILE:
        passed = _fds(count, scratch)
        try:
            client.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(passed)}i", *passed))] if passed else [])
        finally:
            for fd in passed:
                os.close(fd)
    log = lone_holder.layers / "events.log"
    wait_until("each malformed message is logged", lambda: log.read_text().count("malformed message") >= len(HOSTILE) - 1)
    assert holders(lone_holder.root) == before
    # Still the group's reader: a read of a marked file waits for it, and it passes the event on to us.
    data = lone_holder.layers / "data"
    data.write_bytes(b"right bytes\n")
    fanotify.mark(group, data)
    reader = subprocess.Popen([sys.executable, "-c", f"print(open({str(data)!r}).read(), end='')"], stdout=subprocess.PIPE, text=True)
    answered: list[int] = []
    fds = []
    try:
        while reader.poll() is None:  # every event the read raises comes to us: allow each
            client.settimeout(0.5)
            try:
                message, ancillary, _flags, _ = client.recvmsg(4096, socket.CMSG_SPACE(4 * 64))
            except TimeoutError:
                continue
            fds = received_fds(ancillary)
            if message[:1] == EVENTS:
                for number, _pid, _offset, _count in (EVENT.iter_unpack(message[1 : 1 + EVENT.size * len(fds)])):
                    fanotify.answer(group, number, fanotify.ALLOW)
                    answered.append(number)
            for fd in fds:
                os.close(fd)
            fds = []
        assert reader.communicate(timeout=30)[0] == "right bytes\n"
        assert answered  # the read waited for the events the holder passed on
        client.sendmsg([DONE + struct.pack(f"<{len(answered)}i", *answered)])
    finally:
        for fd in fds:
            os.close(fd)
        if reader.poll() is None:
            reader.kill()
        os.close(group)
        client.close()


def test_a_holder_with_nothing_to_hold_exits_after_its_idle_time_and_takes_its_standby_along(tmp_path: Path) -> None:
    paths = ServerPaths(Path("/var/tmp") / f"bootseer-idle-{os.getpid()}")
    paths.layers.mkdir(parents=True)
    try:
        _start_holder(paths, hole_wait=120, idle_exit=1)
        wait_until("the holder and its standby run", lambda: len(holders(paths.root)) == 2)
        wait_until("both exit", lambda: not holders(paths.root), timeout=30)
        assert not paths.events_socket.exists()
    finally:
        stop_event_holders(paths.root)
        shutil.rmtree(paths.root, ignore_errors=True)


def test_sigterm_leaves_holders_whose_blob_has_holes_and_ends_those_with_nothing_to_hold(
    converted: Any, node_factory: Any, lone_holder: ServerPaths
) -> None:
    for pid in holders(lone_holder.root):  # nothing to hold: they go
        os.kill(pid, signal.SIGTERM)
    wait_until("the lone holders exit on SIGTERM", lambda: not holders(lone_holder.root), timeout=30)
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify")
    lower = node.ensure().mount(built.chain_id).lower_dir
    expected = _expected()
    assert read_all(lower, ["small/s2.txt"]) == {"small/s2.txt": expected["small/s2.txt"]}
    node.stop(signal.SIGTERM)
    before = holders(node.root)
    for pid in before:
        os.kill(pid, signal.SIGTERM)
    log = node.root / "layers" / "events.log"
    wait_until("both log the signal ignored", lambda: log.read_text().count("signal ignored") >= 2)
    assert holders(node.root) == before
    node.ensure()
    assert read_all(lower, sorted(expected)) == expected


def test_the_holders_of_a_deleted_root_exit(converted: Any, node_factory: Any) -> None:
    store, built = converted
    node = node_factory(f"file://{store}", data_path="fanotify")
    lower = node.ensure().mount(built.chain_id).lower_dir
    assert read_all(lower, ["small/s3.txt"])  # holes left: the holders would stay for the next server
    node.stop(signal.SIGKILL)
    assert holders(node.root)
    for mountpoint in fuse_mounts(node.root):
        force_unmount(mountpoint)
    shutil.rmtree(node.root)
    wait_until("the holders of the deleted root exit", lambda: not holders(node.root), timeout=30)
