#!/usr/bin/env bash
# BootSeer demo: a real containerd starts a multi-layer image lazily through BootSeer.
#
# On a fresh Debian machine, as root:  ctr_examples/demo.sh
#
# Installs what is missing (ctr_examples/install-deps.sh: Debian packages and a venv at
# .venv with BootSeer; skip with BOOTSEER_SKIP_INSTALL=1), then, in a temp dir and on
# 127.0.0.1 only, starts a local registry, bootseer-snapshotter with a local store (it
# starts the layer server) and a private containerd (the host's containerd, if any, is not
# touched); builds and pushes a four-layer image, converts it into the store with
# `bootseer convert`, pulls it with `bootseer rpull` (every layer lazy: no layer blob is
# downloaded), runs it with `ctr run --snapshotter bootseer` and shows how few bytes the
# run fetched, kills the daemon under a running container that then reads a file it never
# read before, brings the daemon back, and lets containerd's GC remove the lazy snapshots;
# each step is printed with its timing, and the start's profile is kept in
# ./bootseer-demo-profile/ (`--profile-dir DIR`).
# Everything else is cleaned up on exit, Ctrl-C or failure.  `--keep` keeps the temp dir.
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
