"""pytest settings for the whole repository.

Tests skip themselves when something they need is missing (root, Go, containerd's Go
sources, ...), which is right on a developer's machine.  Under CI (``CI`` set, as
``.ci/run`` is run), everything is installed first, so a skip can only mean the
installation broke: there it fails the test instead of letting CI pass untested.
The header of every run names the containerd the integration tests use.
"""

from __future__ import annotations

import os

import pytest

from tests.support.containerd import containerd_install, containerd_unavailable


def pytest_report_header(config) -> str:
    """The containerd the integration tests run (``BOOTSEER_CONTAINERD``), named on every run's header."""
    why = containerd_unavailable()
    return f"containerd: {why}" if why else f"containerd: {containerd_install().describe()}"


SKIPS_FAIL = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if SKIPS_FAIL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where everything it needs is installed: {reason}"
