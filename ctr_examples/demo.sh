#!/usr/bin/env bash
# BootSeer demo: a real containerd pulls and runs a multi-layer image through BootSeer.
#
# On a fresh Debian machine, as root:  ctr_examples/demo.sh
#
# Installs what is missing (ctr_examples/install-deps.sh: Debian packages and a venv at
# .venv with BootSeer; skip with BOOTSEER_SKIP_INSTALL=1), then, in a temp dir and on
# 127.0.0.1 only, starts a local registry, bootseer-snapshotter and a private containerd
# (the host's containerd, if any, is not touched), builds and pushes a three-layer image,
# pulls it and runs it with `ctr run --snapshotter bootseer`, kills the daemon under a
# running container and brings it back, and prints each step with its timing.
# Everything is cleaned up on exit, Ctrl-C or failure.  `--keep` keeps the temp dir.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${BOOTSEER_VENV:-$repo/.venv}

if [[ $EUID -ne 0 ]]; then
    echo "demo: run as root (containerd, runc and overlay mounts need it)" >&2
    exit 1
fi
if [[ -z ${BOOTSEER_SKIP_INSTALL:-} ]]; then
    "$repo/ctr_examples/install-deps.sh"
fi
cd "$repo"
exec "$venv/bin/python" -m integration.demo "$@"
