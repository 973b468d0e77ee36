"""bootseer.atomic: a replaced file is old or new, never torn, whoever writes it and however the writer ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bootseer.atomic import replacing, write_atomically
from tests.support.waiting import wait_until


def test_a_write_replaces_the_whole_file_and_leaves_no_temp_name(tmp_path: Path) -> None:
    target = tmp_path / "table.json"
    target.write_bytes(b"old")
    write_atomically(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert os.listdir(tmp_path) == ["table.json"]
    assert target.stat().st_mode & 0o777 == 0o644


def test_a_writer_that_fails_half_way_leaves_the_old_content_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with replacing(target) as file:
            file.write(b"half of the new")
            raise RuntimeError("the writer fails")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_two_writers_of_one_path_never_share_a_temp_file(tmp_path: Path) -> None:
    """Both are inside their block at once (each waits for the other): with one temp name the
    second would truncate the first's half-written file, and one rename would find nothing."""
    target = tmp_path / "shared"
    both_open = threading.Barrier(2, timeout=30)
    temps: list[str] = []

    def write(content: bytes) -> None:
        with replacing(target) as file:
            temps.append(file.name)
            file.write(content[:4])
            both_open.wait()
            file.write(content[4:])

    threads = [threading.Thread(target=write, args=(c * 4096,)) for c in (b"A", b"B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(temps)) == 2
    assert target.read_bytes() in (b"A" * 4096, b"B" * 4096)
    assert os.listdir(tmp_path) == ["shared"]


def test_a_writer_killed_mid_write_leaves_the_old_content(tmp_path: Path) -> None:
    target = tmp_path / "table.json"
    target.write_bytes(b"old")
    started = tmp_path / "started"
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from bootseer.atomic import replacing\n"
        "with replacing(sys.argv[1]) as f:\n"
        "    f.write(b'new' * 1000); f.flush()\n"
        "    Path(sys.argv[2]).touch()\n"
        "    time.sleep(600)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(target), str(started)])
    try:
        wait_until("the writer to be inside its write", started.exists)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert target.read_bytes() == b"old"
    leftovers = [name for name in os.listdir(tmp_path) if name not in ("table.json", "started")]
    assert all(name.startswith(".table.json.") and name.endswith(".tmp") for name in leftovers)


def test_before_rename_sees_the_whole_new_content_and_can_stop_the_replacement(tmp_path: Path) -> None:
    """What an image check does: read the written temp file, and refuse it (the old content stays, no temp left)."""
    target = tmp_path / "image"
    target.write_bytes(b"old")
    seen: list[bytes] = []

    def refuse(temp: Path) -> None:
        seen.append(temp.read_bytes())
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        with replacing(target, durable=False, before_rename=refuse) as out:
            out.write(b"new ")
            out.write(b"content")
    assert seen == [b"new content"] and target.read_bytes() == b"old" and os.listdir(tmp_path) == ["image"]
    with replacing(target, durable=False, before_rename=lambda temp: seen.append(temp.read_bytes())) as out:
        out.write(b"accepted")
    assert seen[-1] == b"accepted" and target.read_bytes() == b"accepted" and os.listdir(tmp_path) == ["image"]
