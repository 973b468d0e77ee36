"""Tiny real wheels for install tests, built with ``pip wheel`` from pyproject projects: no network.

:func:`build_wheels` makes ``NAME-VERSION-py3-none-any.whl`` files whose package
``NAME`` has ``VERSION`` and a ``main()``; with ``script`` a console script
``NAME-hello`` prints ``hello from NAME VERSION``.  :func:`install_env` is an
environment for the installers without this session's settings (pip's
configuration, ``PYTHONDONTWRITEBYTECODE``): installs write bytecode, as a user's do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent


def install_env(home: Path) -> dict[str, str]:
    """An environment for pip and uv: this venv's tools first on PATH, no config files, bytecode written."""
    return {"PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "PIP_CONFIG_FILE": os.devnull,
            "UV_NO_CONFIG": "1", "UV_CACHE_DIR": str(home / "uv-cache"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "LANG": "C.UTF-8"}  # fmt: skip


def build_wheels(work: Path, out: Path, packages: Sequence[tuple[str, str]], *, script: bool = True) -> Path:
    """Build a wheel of each ``(name, version)`` into ``out`` (projects under ``work``); ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, version in packages:
        project = work / f"{name}-{version}"
        (project / "src" / name).mkdir(parents=True)
        lines = ["[build-system]", 'requires = ["setuptools"]', 'build-backend = "setuptools.build_meta"',
                 "[project]", f'name = "{name}"', f'version = "{version}"', "dependencies = []"]  # fmt: skip
        if script:
            lines += ["[project.scripts]", f'{name}-hello = "{name}:main"']
        (project / "pyproject.toml").write_text("\n".join(lines) + "\n")
        (project / "src" / name / "__init__.py").write_text(
            f"VERSION = {json.dumps(version)}\ndef main():\n    print('hello from {name} {version}')\n")
        # One at a time: one resolution may not hold two versions of a package.
        subprocess.run([PYTHON, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                        "-w", str(out), str(project)], check=True, env=install_env(work), cwd=work)  # fmt: skip
    return out
