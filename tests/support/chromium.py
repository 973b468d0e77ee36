"""Render a page in headless Chromium (Debian's ``chromium``): its DOM and a PNG screenshot, for the tests.

The profiler's HTML timeline is checked the way people see it: what Chromium built from the page
(``--dump-dom``) and a screenshot of it. As root Chromium needs ``--no-sandbox``; each call gets a
profile directory of its own under the caller's directory, so nothing is left in ``$HOME``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(page: Path, out: Path, *, width: int = 1200, height: int = 1400) -> tuple[str, Path]:
    """The DOM Chromium built from ``page`` and a screenshot ``out/timeline.png``; skips without Chromium."""
    binary = chromium()
    if binary is None:
        pytest.skip("chromium is not installed (ctr_examples/install-deps.sh installs it)")
    argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={out / 'chromium-profile'}", "--hide-scrollbars"]
    dom = subprocess.run([*argv, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    png = out / "timeline.png"
    shot = subprocess.run([*argv, f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    return dom.stdout, png
