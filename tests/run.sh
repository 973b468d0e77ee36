#!/usr/bin/env bash
# BootSeer's test command (the README's second command): as root on Debian, install what
# the tests need, then run the unit tests, the integration tests against real containerd,
# and containerd's own snapshotter conformance suite.
#
#   tests/run.sh              CI: the whole suite on containerd $BOOTSEER_CONTAINERD (default 2.1),
#                             then the tests that face containerd (integration/,
#                             -m "integration or conformance": CRI and this version's conformance
#                             suite included)
#                             once more on each of $BOOTSEER_OTHER_CONTAINERDS (default "1.6 1.7");
#                             every run goes to the end, and any failure fails the command.
#   tests/run.sh ARGS...      one pytest run of ARGS on $BOOTSEER_CONTAINERD (default 2.1).
#
# Each run's header names its containerd ("containerd: containerd 2.1.9 (...)"), and a line
# "==> containerd SERIES: ..." introduces it and sums it up at the end.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${BOOTSEER_VENV:-$repo/.venv}
if [[ $(id -u) != 0 ]]; then
    echo "tests/run.sh: run as root (the tests mount filesystems and run containerd)" >&2
    exit 1
fi
"$repo/ctr_examples/install-deps.sh"
cd "$repo"
main=${BOOTSEER_CONTAINERD:-2.1}
if (($#)); then
    BOOTSEER_CONTAINERD=$main exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
fi

runs=("$main:")
for other in ${BOOTSEER_OTHER_CONTAINERDS-1.6 1.7}; do
    [[ $other == "$main" ]] || runs+=("$other:integration")
done
summary=()
failed=0
for run in "${runs[@]}"; do
    series=${run%%:*} subset=${run#*:}
    if [[ -n $subset ]]; then
        read -ra paths <<<"$subset"
        args=(-m "integration or conformance" "${paths[@]}")
        what="the containerd-facing tests ($subset, -m \"integration or conformance\")"
    else
        args=()
        what="the whole suite"
    fi
    echo "==> containerd $series: $what" >&2
    start=$SECONDS
    status=0
    BOOTSEER_CONTAINERD=$series "$venv/bin/python" -m pytest -p no:cacheprovider "${args[@]}" || status=$?
    summary+=("==> containerd $series: $what: $([[ $status == 0 ]] && echo passed || echo "FAILED (pytest status $status)") in $((SECONDS - start)) s")
    ((status == 0)) || failed=1
done
printf '%s\n' "${summary[@]}" >&2
exit $failed
