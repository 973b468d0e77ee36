"""Render a page in headless Chromium (Debian's ``chromium``): its DOM and a PNG screenshot, for the tests.

The profiler's HTML timeline is checked the way people see it: what Chromium built from the page
(``--dump-dom``) and a screenshot of it. Running Chromium (root's ``--no-sandbox``, a private
profile directory) is :mod:`bootseer.profile.screenshot`'s; this only skips without Chromium and
turns its failures into test failures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bootseer.profile.screenshot import ScreenshotError, dump_dom, find_chromium, screenshot


def require_chromium() -> str:
    """The Chromium binary; skips the test without one."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (ctr_examples/install-deps.sh installs it)")
    return binary


def render(page: Path, out: Path, *, width: int = 1200, height: int = 1400) -> tuple[str, Path]:
    """The DOM Chromium built from ``page`` and a screenshot ``out/timeline.png``; skips without Chromium."""
    binary = require_chromium()
    png = out / "timeline.png"
    try:
        dom = dump_dom(page, binary=binary)
        screenshot(page, png, width=width, height=height, binary=binary)
    except ScreenshotError as exc:
        pytest.fail(str(exc))
    return dom, png
