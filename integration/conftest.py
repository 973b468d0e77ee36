"""Fixtures for the real-component tests: a private containerd + bootseer-snapshotter + registry.

``BOOTSEER_CONTAINERD`` (``1.6``, ``1.7``, ``2.1`` (the default) or a directory) chooses the containerd
(:func:`tests.support.containerd.containerd_install`; the run's header line names it: the root conftest.py).
``BOOTSEER_IT_SNAPSHOTTER=overlayfs`` runs the same tests against containerd's built-in
overlayfs snapshotter (no daemon): the check that a failure is the daemon's and not the
harness's.  ``BOOTSEER_KEEP_TMP=1`` keeps each stack's temp dir for a post-mortem.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

import pytest

from integration import harness
from tests.support.containerd import SNAPSHOTTER_NAME, containerd_unavailable
from tests.support.oci import BuiltImage
from tests.support.stack import Stack, snapshotter_available

SNAPSHOTTER = os.environ.get("BOOTSEER_IT_SNAPSHOTTER", SNAPSHOTTER_NAME)
#: What the stacks run from PATH; containerd, ctr and the shim come from the chosen containerd's directory.
TOOLS = ("runc", "docker-registry", "skopeo", "umount")


def _why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (containerd, mounts)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools {missing}: run ctr_examples/install-deps.sh"
    why = containerd_unavailable()
    if why:
        return why
    if SNAPSHOTTER == SNAPSHOTTER_NAME:
        return snapshotter_available()
    return None


@pytest.fixture(scope="session")
def runnable() -> None:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)


@pytest.fixture
def stack(runnable) -> Iterator[Stack]:
    """A started stack, torn down after the test; its logs land in the failure report."""
    with harness.running(Stack(snapshotter=SNAPSHOTTER)) as s:
        yield s


@pytest.fixture
def pulled(stack: Stack) -> tuple[BuiltImage, str]:
    """The demo image, built, pushed to the stack's registry and pulled into the snapshotter."""
    image, ref = stack.build_and_push()
    stack.pull(ref)
    return image, ref


@contextlib.contextmanager
def _stack_factory(kind: type[Stack]):
    """``make(**options)``: one more started ``kind`` with a local store; all torn down (logs printed) at the end."""
    made: list[Stack] = []

    def make(**options) -> Stack:
        stack = kind(store=True, **options)
        made.append(stack)
        stack.start()
        return stack

    try:
        yield make
    finally:
        for stack in made:
            stack.close()
            print(stack.logs())
        for stack in made:
            assert not stack.teardown_errors, f"teardown: {stack.teardown_errors}"


@pytest.fixture
def stacks(runnable):
    """A factory of started stacks with a local store (``stacks(**Stack options)``: one more node; the option
    ``namespace=NS`` is its containerd namespace, else a new one), all torn down after the test."""
    with _stack_factory(Stack) as make:
        yield make


#: What a CRI stack needs besides the tools above: the CNI plugins (Debian's containernetworking-plugins) and ip.
CRI_TOOLS = ("ip",)


@pytest.fixture
def cri_stacks(runnable):
    """A factory of started CRI stacks (:class:`harness.CriStack`: containerd's CRI plugin on, the daemon its
    snapshotter, a local store), each one Kubernetes node; all torn down after the test."""
    missing = [t for t in CRI_TOOLS if shutil.which(t) is None]
    missing += [f"{harness.CNI_BIN_DIR}/{p}" for p in ("bridge", "loopback", "host-local")
                if not (harness.CNI_BIN_DIR / p).exists()]
    if missing:
        pytest.skip(f"missing {missing}: run ctr_examples/install-deps.sh")
    with _stack_factory(harness.CriStack) as make:
        yield make
