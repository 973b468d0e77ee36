"""A PNG of the profiler's HTML timeline, taken by headless Chromium (Debian's ``chromium``).

``bootseer profile report|compare --png FILE`` and the tests use it. The page itself stays
script-free; to size the picture to the whole page, :func:`screenshot` first loads a private
copy of it with one line of script added that writes the laid-out width and height into the
DOM (read back with ``--dump-dom``), then screenshots the original page in a window of that
size. Chromium runs with a profile directory of its own (``--user-data-dir``, removed
afterwards, so nothing lands in ``$HOME``) and, as root, with ``--no-sandbox`` (its sandbox
refuses to run as root).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

#: The names Debian and other distributions give the browser, tried in this order.
BINARIES = ("chromium", "chromium-browser", "google-chrome")
#: The script added to the measuring copy: the page's laid-out size as an attribute of <html>.
_MEASURE = ("<script>document.documentElement.setAttribute('data-bootseer-size', "
            "document.documentElement.scrollWidth + 'x' + document.documentElement.scrollHeight)</script>")
_SIZE = re.compile(r'data-bootseer-size="(\d+)x(\d+)"')
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Added to the measured width and height: the body's far margins, which scrollWidth/scrollHeight leave out.
MARGIN = 16
#: Bounds on the picture's size (pixels): a runaway page must not make a gigapixel PNG.
MAX_WIDTH, MAX_HEIGHT = 4000, 16000


class ScreenshotError(RuntimeError):
    """No picture: Chromium is missing or failed; the message says which and why."""


def find_chromium() -> str | None:
    """The path of a Chromium binary on ``$PATH``, or None."""
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_argv(binary: str, profile_dir: Path) -> list[str]:
    """Headless Chromium with a private profile; ``--no-sandbox`` only as root, where it is needed."""
    argv = [binary, "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile_dir}"]
    if os.geteuid() == 0:
        argv.insert(2, "--no-sandbox")
    return argv


def _run(argv: list[str], what: str, timeout: float) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ScreenshotError(f"chromium: {what} took over {timeout:.0f} s") from None
    if done.returncode != 0:
        raise ScreenshotError(f"chromium: {what} failed (exit status {done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def _chromium(binary: str | None) -> str:
    found = binary or find_chromium()
    if found is None:
        raise ScreenshotError("chromium is not installed (apt-get install chromium; "
                              "ctr_examples/install-deps.sh installs it)")
    return found


def dump_dom(page: Path, *, binary: str | None = None, timeout: float = 120) -> str:
    """The DOM Chromium built from ``page`` (``--dump-dom``)."""
    with tempfile.TemporaryDirectory(prefix="bootseer-chromium-") as profile:
        return _run([*chromium_argv(_chromium(binary), Path(profile)), "--dump-dom", Path(page).absolute().as_uri()],
                    f"loading {page}", timeout)


def page_size(page: Path, *, binary: str | None = None, timeout: float = 120) -> tuple[int, int]:
    """The laid-out width and height of ``page`` in CSS pixels, measured in a script-added copy."""
    text = Path(page).read_text()
    marked = text.replace("</body>", _MEASURE + "</body>", 1) if "</body>" in text else text + _MEASURE
    with tempfile.TemporaryDirectory(prefix="bootseer-measure-") as directory:
        copy = Path(directory) / "page.html"
        copy.write_text(marked)
        found = _SIZE.search(dump_dom(copy, binary=binary, timeout=timeout))
    if found is None:
        raise ScreenshotError(f"chromium: could not measure {page} (its script did not run)")
    return int(found.group(1)), int(found.group(2))


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's header (its IHDR chunk); raises ValueError for anything else."""
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def screenshot(page: Path, png: Path, *, width: int | None = None, height: int | None = None,
               binary: str | None = None, timeout: float = 120) -> tuple[int, int]:
    """Write a PNG of ``page`` to ``png``; the picture's width and height in pixels.

    Without ``width``/``height`` the window is the page's own laid-out size (the whole page,
    no scrolling); either may be given to force it. The PNG is written to a temporary name
    beside ``png`` and renamed, so a failed shot leaves no half-written file.
    """
    page, png = Path(page).absolute(), Path(png).absolute()
    if width is None or height is None:
        measured = page_size(page, binary=binary, timeout=timeout)
        width, height = width or measured[0] + MARGIN, height or measured[1] + MARGIN
    width, height = max(1, min(width, MAX_WIDTH)), max(1, min(height, MAX_HEIGHT))
    partial = png.with_name(f".{png.name}.partial.png")
    partial.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="bootseer-chromium-") as profile:
        _run([*chromium_argv(_chromium(binary), Path(profile)), f"--screenshot={partial}",
              f"--window-size={width},{height}", page.as_uri()], f"screenshot of {page}", timeout)
    try:
        size = png_size(partial.read_bytes()[:24])
    except (OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise ScreenshotError(f"chromium: no PNG from the screenshot of {page}: {exc}") from None
    os.replace(partial, png)
    return size
