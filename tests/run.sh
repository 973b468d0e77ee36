#!/usr/bin/env bash
# BootSeer's test command (the README's second command): as root on Debian, install what
# the tests need, then run the unit tests, the integration tests against real containerd,
# and containerd's own snapshotter conformance suite.  Extra arguments go to pytest.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${BOOTSEER_VENV:-$repo/.venv}
if [[ $(id -u) != 0 ]]; then
    echo "tests/run.sh: run as root (the tests mount filesystems and run containerd)" >&2
    exit 1
fi
"$repo/ctr_examples/install-deps.sh"
cd "$repo"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
