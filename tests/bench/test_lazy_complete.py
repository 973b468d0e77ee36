"""The lazy-layers benchmark's ``lazy-complete`` scenario (issue 36), without running it: its wait on the layer
server's ``status`` (a fake client), and what the report makes of its runs (the start table, the wait's section and
issue 36's target line)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench import lazy_bench
from bench.image_build import Image, LayerBlob
from bench.lazy_report import report
from bench.lazy_scenarios import BASELINES, KINDS, PER_DATA_PATH, SCENARIOS, BlobsWait, Run, Scenario, completes, named

MB = 1_000_000


class FakeInstall:
    """What the report asks of the containerd it names."""

    def describe(self) -> str:
        return "containerd (fake)"


def fanotify(blobs: int, complete: int, held: int, missing: int, stored: int) -> dict[str, Any]:
    """A layer server's ``status`` → ``fanotify`` section, as much of it as the wait reads."""
    return {"blobs": blobs, "complete": complete, "held_marked": held, "missing_blocks": missing,
            "background_fill": {"enabled": True, "running": complete < blobs, "batches": stored // (4 * MB),
                                "blocks": stored // 65536, "stored_bytes": stored, "failed": 0, "yielded": 0}}


@pytest.fixture
def fake_status(monkeypatch: pytest.MonkeyPatch):
    """``set(answers)``: the layer server's ``status`` answers each of ``answers`` in turn, then the last for ever."""
    from bootseer.blockstore.server import client

    answers: list[dict[str, Any]] = []

    class FakeClient:
        def __init__(self, socket_path: Any, *, timeout: float = 5) -> None:
            pass

        def status(self) -> dict[str, Any]:
            return {"fanotify": answers.pop(0) if len(answers) > 1 else answers[0]}

    monkeypatch.setattr(client, "LayerServerClient", FakeClient)
    monkeypatch.setattr(lazy_bench, "BLOBS_POLL_S", 0.01)
    return answers.extend


def test_the_wait_ends_once_every_blob_is_complete_and_unmarked_with_what_the_fill_wrote(fake_status):
    fake_status([fanotify(4, 1, 0, 3000, 10 * MB), fanotify(4, 2, 0, 1500, 100 * MB),
                 fanotify(4, 4, 2, 0, 260 * MB), fanotify(4, 4, 0, 0, 260 * MB)])
    wait = lazy_bench.wait_blobs_complete(Path("/nonexistent"), timeout=30)
    assert wait.complete
    assert (wait.blobs, wait.complete_blobs, wait.held_marked, wait.missing_blocks) == (4, 4, 0, 0)
    assert wait.fill_bytes == 250 * MB  # during the wait: the status at its end less at its start
    assert wait.filled_seconds is not None and wait.filled_seconds <= wait.seconds


def test_a_wait_that_times_out_says_so_and_what_was_left(fake_status):
    fake_status([fanotify(4, 3, 0, 700, 0), fanotify(4, 3, 0, 500, 8 * MB)])
    wait = lazy_bench.wait_blobs_complete(Path("/nonexistent"), timeout=0.2)
    assert not wait.complete and wait.filled_seconds is None
    assert (wait.complete_blobs, wait.blobs, wait.missing_blocks, wait.fill_bytes) == (3, 4, 500, 8 * MB)
    assert "blobs NOT complete" in lazy_bench.blobs_wait_summary(wait)


def test_lazy_complete_is_a_lazy_start_per_data_path_against_overlay_local_that_only_fanotify_runs():
    assert KINDS["lazy"][-1] == "lazy-complete" and "lazy-complete" in PER_DATA_PATH
    assert BASELINES["lazy-complete"] == "overlay-local" and "lazy-complete" in SCENARIOS
    assert completes("fanotify") and completes("fanotify+built")
    assert not any(completes(path) for path in ("erofs", "erofs+built", "loop", "tree", None))


def _report(complete_runs: list[Run], errors: tuple[str, ...] = (), paths: tuple[str, ...] = ("fanotify",)) -> str:
    scenarios = {named(base, path): Scenario(named(base, path))
                 for base in SCENARIOS for path in (paths if base in PER_DATA_PATH else [None])}

    def run(seconds: float, **server: float) -> Run:
        return Run(seconds=seconds, pull_seconds=0.0, link_bytes=0, output="BOOTSEER-FIRST-OUTPUT",
                   server=dict(server))

    scenarios["overlay-cold"].runs.append(run(20.0))
    scenarios["overlay-local"].runs.append(run(3.0))
    scenarios["overlay-warm"].runs.append(run(2.0))
    for path in paths:
        scenarios[named("lazy-cold", path)].runs.append(run(12.0, **{"fanotify.events.filled": 1500}))
        scenarios[named("lazy-local", path)].runs.append(run(3.9, **{"fanotify.events.present": 2600}))
        scenarios[named("lazy-warm", path)].runs.append(run(2.4, **{"fanotify.events.present": 40}))
    scenarios[named("lazy-complete", paths[0])].runs.extend(complete_runs)
    scenarios[named("lazy-complete", paths[0])].errors.extend(errors)
    image = Image(layout=Path("/nonexistent"), tag="t", manifest_digest="sha256:0",
                  layers=(LayerBlob("base", "sha256:1", 100 * MB, "sha256:2", 300 * MB, "base"),))
    args = argparse.Namespace(rate="1gbit", reps=len(complete_runs) or 1, background_fill="on", fill_group=None)
    context = {"containerds": [FakeInstall()], "wall": 60.0, "load": (1.0, 1.0), "data_paths": list(paths),
               "data_path_flag": {"snapshotter": True}, "notes": []}
    return report(args, image, scenarios, context)


def _complete_run(seconds: float, present: float = 0) -> Run:
    wait = BlobsWait(seconds=61.5, complete=True, filled_seconds=38.2, blobs=4, complete_blobs=4, held_marked=0,
                     missing_blocks=0, fill_bytes=252 * MB, fill_blocks=11563, fill_batches=70, fill_yielded=0,
                     fill_failed=0)
    server = {"fanotify.events.present": present, "fanotify.events.filled": 0, "fuse.requests.getattr": 0,
              "fanotify.blobs": 4, "fanotify.complete": 4, "fanotify.missing_blocks": 0}
    return Run(seconds=seconds, pull_seconds=0.0, link_bytes=0, output="BOOTSEER-FIRST-OUTPUT", server=server,
               blobs_wait=wait)


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


def test_the_report_shows_lazy_complete_against_overlay_local_its_wait_and_issue_36s_target_met():
    text = _report([_complete_run(3.1)])
    row = _line(text, "| lazy-complete@fanotify |")
    assert "| 3.10 |" in row and "| 1.03 |" in row  # median, × overlay-local
    assert row.rstrip(" |").split(" | ")[-2] == "0"  # userspace requests
    assert "## Blobs that complete: the wait before lazy-complete (issue 36)" in text
    assert "| background fill wrote during the wait (MB stored) | 252.0 |" in text
    assert "| waited (s): from the end of lazy-warm to every blob whole and unmarked | 61.5 |" in text
    target = _line(text, "| [fanotify] second start with the page cache dropped once the blobs are complete")
    assert target.endswith("| met |") and "1.03×; 0 (after 62 s idle)" in target
    rows = [line for line in text.splitlines() if line.startswith("| lazy-complete | fanotify |")]
    assert len(rows) == 2  # the data-path section's and the userspace section's
    assert rows[1].endswith("| 4 of 4 (0 blocks missing) |")


def test_issue_36s_target_is_missed_by_a_start_that_raised_events_or_took_too_long():
    events = _line(_report([_complete_run(3.1, present=12)]), "| [fanotify] second start with the page cache")
    assert events.endswith("| MISSED (userspace requests) |") and "1.03×; 12" in events
    slow = _line(_report([_complete_run(3.3)]), "| [fanotify] second start with the page cache")
    assert slow.endswith("| MISSED (time) |")


def test_a_wait_that_timed_out_leaves_the_target_not_measured_and_the_failure_said():
    text = _report([], errors=("run 1: not run: blobs NOT complete after 600.0 s (...)",))
    target = _line(text, "| [fanotify] second start with the page cache")
    assert target.endswith("| — | not measured (see Failures) |")
    assert "- lazy-complete@fanotify: run 1: not run: blobs NOT complete after 600.0 s" in text
    assert "| lazy-complete@fanotify |" in text  # the start table still names it, with no runs


def test_other_data_paths_get_no_lazy_complete_row_and_no_issue_36_line():
    text = _report([], paths=("erofs",))
    assert "lazy-complete@erofs" not in text and "Targets of issue 36" not in text
