"""The EROFS image checker's worker process under faults: killed while idle, killed during a check, orphaned.

Issue 35, cases 14 and 16.  A worker killed while idle must not refuse the next image (it is not
the image's fault): a fresh worker runs that check.  A worker that dies during a check refuses
that image (it may be a hostile image's doing) and the next check gets a fresh worker.  A
layer server killed by SIGTERM or SIGKILL leaves no process of its checker behind (no worker,
no ``multiprocessing`` resource tracker): the tests find the server's descendants in ``/proc``
while it runs and wait, bounded, for every one of them to be gone after the kill.

Everything runs for real: :class:`~bootseer.blockstore.datapath.image_checker.CheckerProcess`
with its worker, or ``bootseer layer-server`` on the ``erofs`` data path started by
``ensure_server`` (tests/blockstore/test_layer_server.py's ``Node``), over layers converted by
the real converter with their EROFS images.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from bootseer.blockstore.datapath.erofs_check import ImageRefused
from bootseer.blockstore.datapath.image_checker import CheckerProcess, ImageCheck
from bootseer.blockstore.objects.format import EntryType
from tests.blockstore.test_layer_server import BLOCK_SIZE, built, extracted, node_factory  # noqa: F401 (fixtures)
from tests.support.layer_store import BuiltLayer, stored_image
from tests.support.processes import process_gone
from tests.support.waiting import WaitFailed, wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"),
]

#: How long a process may take to go once its reason to live is gone (the worker polls its parent every 0.5 s).
EXIT_BOUND_S = 10.0


# -- processes, read from /proc ---------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _identity(pid: int) -> tuple[int, int] | None:
    """``(pid, start time)``: names a process even if its pid is reused later; None if it is gone."""
    fields = _stat_fields(pid)
    return (pid, int(fields[19])) if fields is not None else None


def _alive(identity: tuple[int, int]) -> bool:
    return not process_gone(identity[0]) and _identity(identity[0]) == identity


def _descendants(pid: int) -> set[tuple[int, int]]:
    """Every live process under ``pid`` (children, their children...), as :func:`_identity`."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[tuple[int, int]] = set()
    todo = list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        identity = _identity(child)
        if identity is not None:
            found.add(identity)
            todo.extend(parents.get(child, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _waits_in_fifo_open(pid: int) -> bool:
    """Whether a thread of ``pid`` sleeps in the kernel opening a FIFO that has no writer yet."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            if Path(f"/proc/{pid}/task/{task}/wchan").read_text() == "wait_for_partner":
                return True
        except OSError:
            continue
    return False


# -- images ----------------------------------------------------------------------------------------------


def _image(built: tuple[Path, list[BuiltLayer]], tmp_path: Path) -> tuple[Path, ImageCheck, int]:
    """The converter's EROFS image of the first layer in a file, what it is checked against, and its inodes."""
    store, layers = built
    layer = layers[0]
    image = tmp_path / "image.erofs"
    image.write_bytes(stored_image(store, layer.record)[1])
    check = ImageCheck(layer.index.blob_size, BLOCK_SIZE, len(layer.index.entries))
    inodes = len(layer.index.entries) - sum(entry.link is not None for entry in layer.index.entries)
    return image, check, inodes


@pytest.fixture
def checker() -> Any:
    checker = CheckerProcess(deadline=60)
    try:
        checker.start()
        yield checker
    finally:
        checker.close()


# -- a checker process ------------------------------------------------------------------------------------


def test_a_worker_killed_while_idle_is_replaced_and_the_next_check_accepts_the_image(
    built: Any, tmp_path: Path, checker: CheckerProcess
) -> None:
    image, check, inodes = _image(built, tmp_path)
    assert checker.check(image, check).inodes == inodes
    for _ in range(2):  # killed twice: each time a fresh worker takes over
        first = checker.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_until(f"checker worker {first} to die", lambda: process_gone(first), EXIT_BOUND_S)
        assert checker.check(image, check).inodes == inodes  # not refused: the image is not at fault
        assert checker.pid not in (None, first)
        assert checker.addressed(image, check)  # and the other call too, on the same fresh worker


def test_a_worker_that_dies_during_a_check_refuses_that_image_and_the_next_check_gets_a_fresh_worker(
    built: Any, tmp_path: Path, checker: CheckerProcess
) -> None:
    image, check, inodes = _image(built, tmp_path)
    stuck = tmp_path / "stuck.erofs"
    os.mkfifo(stuck)  # the worker's open() of it waits for a writer: a check in progress, held there
    worker = checker.pid
    assert worker is not None
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(checker.check(stuck, check))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    thread = threading.Thread(target=run, name="check of a FIFO")
    thread.start()
    wait_until("the worker to sit in the check, opening the FIFO", lambda: _waits_in_fifo_open(worker), EXIT_BOUND_S)
    os.kill(worker, signal.SIGKILL)
    thread.join(EXIT_BOUND_S)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ImageRefused), outcome
    assert "the checker process died on it" in str(outcome[0])
    assert checker.check(image, check).inodes == inodes
    assert checker.pid not in (None, worker)


def test_checks_from_several_threads_at_once_each_get_their_own_answer(
    built: Any, tmp_path: Path, checker: CheckerProcess
) -> None:
    image, check, inodes = _image(built, tmp_path)
    truncated = tmp_path / "truncated.erofs"
    truncated.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
    results: dict[int, object] = {}

    def run(number: int) -> None:
        try:
            path = truncated if number % 2 else image
            results[number] = checker.check(path, check).inodes
        except ImageRefused as exc:
            results[number] = exc

    threads = [threading.Thread(target=run, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == list(range(8))
    for number, result in results.items():
        if number % 2:
            assert isinstance(result, ImageRefused), (number, result)
        else:
            assert result == inodes, (number, result)


# -- a layer server's checker -----------------------------------------------------------------------------


def test_a_layer_server_whose_checker_was_killed_while_idle_still_mounts_a_layer_from_its_checked_image(
    built: Any, extracted: list[Path], node_factory: Any
) -> None:
    store, layers = built
    node = node_factory(f"file://{store}", data_path="erofs")
    client = node.ensure()
    children = _descendants(node.pid())  # on erofs: the checker's process(es) only
    assert children, "the layer server started no checker process"
    for pid, _ in children:
        os.kill(pid, signal.SIGKILL)
    wait_until("the checker's processes to die", lambda: not any(_alive(child) for child in children), EXIT_BOUND_S)
    lower = Path(client.mount(layers[0].chain_id).lower_dir)  # its image checked by a fresh checker
    assert os.listdir(node.paths.erofs_images) == [f"{layers[0].record.image}.erofs-store"]
    small = [e for e in layers[0].index.entries if e.type is EntryType.FILE and e.link is None and 0 < e.size <= 4096]
    assert small
    for entry in small:
        assert (lower / entry.path).read_bytes() == (extracted[0] / entry.path).read_bytes(), entry.path
    assert "died while idle" in node.log()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_process_of_the_checker_outlives_its_layer_server(built: Any, node_factory: Any, signum: int) -> None:
    store, _ = built
    node = node_factory(f"file://{store}", data_path="erofs")
    node.ensure()
    server = node.pid()
    before = _descendants(server)
    assert before, "the layer server started no checker process"
    os.kill(server, signum)
    wait_until(f"layer server {server} to exit", lambda: process_gone(server), 30)

    def left() -> list[str]:
        return [f"{pid}: {_cmdline(pid)}" for pid, start in sorted(before) if _alive((pid, start))]

    try:
        wait_until(f"the {len(before)} process(es) of the server's checker to exit", lambda: not left(), EXIT_BOUND_S)
    except WaitFailed:
        pytest.fail(f"{signal.Signals(signum).name} of layer server {server} left its processes: {left()}")
