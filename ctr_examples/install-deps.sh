#!/usr/bin/env bash
# Install everything BootSeer, its demo and its tests need on a Debian machine, as root:
# the Debian packages (containerd, runc, registry, FUSE, Go for the conformance suite, ...),
# containerd 1.7 and 2.1 in a cache directory (install-containerd.sh)
# and a virtual environment at $BOOTSEER_VENV (default: .venv in the checkout) holding
# BootSeer installed from this checkout (editable, so the venv always runs the code in the
# tree) with the extras in $BOOTSEER_EXTRAS (default "test"; the benchmarks want "test,bench").
# Safe to run again; it only adds what is missing.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${BOOTSEER_VENV:-$repo/.venv}
extras=${BOOTSEER_EXTRAS:-test}

packages=(
    containerd runc docker-registry skopeo fuse3 libfuse3-dev pkg-config
    golang-go golang-github-containerd-containerd-dev busybox-static nginx-light
    containernetworking-plugins iproute2
    curl ca-certificates openssl gcc python3 python3-dev python3-venv
    debootstrap pigz chromium erofs-utils tinyproxy e2fsprogs
)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "install-deps: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The Debian packages start their services; BootSeer's tests and demo run private instances.
for unit in containerd docker-registry nginx tinyproxy; do
    systemctl disable --now "$unit" >/dev/null 2>&1 || true
done

# containerd 1.7 and 2.1 beside the system's 1.6 (pinned Debian packages, unpacked into a cache
# directory; the tests pick one with BOOTSEER_CONTAINERD, docs/testing.md).
"$repo/ctr_examples/install-containerd.sh"

if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q -e "$repo[$extras]"
echo "install-deps: ready ($venv)" >&2
