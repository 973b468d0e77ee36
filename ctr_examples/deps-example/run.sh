#!/usr/bin/env bash
# Dependency snapshots with a real containerd: a job whose entry point installs its dependencies runs twice
# with `ctr run --snapshotter-label containerd.io/snapshot/bootseer.deps=KEY`.  The first run installs and
# the snapshotter captures the install into a local store; the second run gets it stacked under its writable
# layer and skips the install (the one guard line in entrypoint.sh).
#
# As root, from anywhere:  ctr_examples/deps-example/run.sh [--keep]
# Everything (registry, bootseer-snapshotter with its layer server, a private containerd) runs in a temp dir
# on 127.0.0.1 and is torn down on exit.  BOOTSEER_SKIP_INSTALL=1 skips ctr_examples/install-deps.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ $EUID -ne 0 ]]; then
    echo "deps-example: run as root (containerd, runc and overlay mounts need it)" >&2
    exit 1
fi
if [[ -z ${BOOTSEER_SKIP_INSTALL:-} ]]; then
    "$repo/ctr_examples/install-deps.sh"
fi
cd "$repo"
exec "${BOOTSEER_VENV:-$repo/.venv}/bin/python" ctr_examples/deps-example/example.py "$@"
