#!/usr/bin/env bash
# Fetch the containerd versions the tests run besides the system's (Debian 12's 1.6) into a cache
# directory, never touching the system's packages:
#
#   ctr_examples/install-containerd.sh [--cache DIR] [SERIES...]     (SERIES: 1.7 2.1; default both)
#
# Each series is one pinned Debian package (below).  apt fetches it from the archive named by the
# URIs of the machine's own Debian sources (/etc/apt/sources.list.d/debian.sources, else
# /etc/apt/sources.list), with a private apt state under DIR/apt (its own sources list, lists and
# cache), and verifies it against the archive's signed index (debian-archive-keyring); dpkg-deb
# unpacks it into DIR/SERIES, whose usr/bin then holds containerd, ctr and containerd-shim-runc-v2
# (tests/support/containerd.py runs them with BOOTSEER_CONTAINERD=SERIES).  The packages need only libc6
# (>= 2.34) and runc from the system.  For containerd's snapshotter conformance suite of that
# version (integration/test_conformance.py), DIR/SERIES-go gets the same version's Go sources
# (golang-github-containerd-containerd-dev, pinned alike) with every golang-* package they depend
# on and the suite's Go toolchain (golang-go), all from the same suite, unpacked (usr/share/gocode,
# usr/lib/go-*): nothing is installed.  A series already unpacked at its pinned version is skipped.
# DIR defaults to /var/cache/bootseer/containerd.  Run as root.
set -euo pipefail

#: series -> "suite package-version": the pins.  A pin that left its suite makes this fail, naming
#: what the suite has now; bump it here (and in the README's "tested with" table).
declare -A PINS=(
    [1.7]="trixie 1.7.24~ds1-6+deb13u1"
    [2.1]="sid 2.1.9+ds1-5"
)
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

cache=/var/cache/bootseer/containerd
series=()
while (($#)); do
    case $1 in
        --cache) cache=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) [[ -n ${PINS[$1]:-} ]] || { echo "install-containerd: unknown series '$1' (known: ${!PINS[*]})" >&2; exit 2; }
           series+=("$1"); shift ;;
    esac
done
((${#series[@]})) || series=(1.7 2.1)

say() { echo "install-containerd: $*" >&2; }
die() { say "$*"; exit 1; }

# The upstream version a package version carries ("1.7.24~ds1-6+deb13u1" -> "1.7.24").
upstream() { local v=${1%%[~+-]*}; echo "$v"; }

# DIR/VERSION is the pin, and "containerd --version" of DIR/usr/bin names its upstream version, the other
# two binaries there.
unpacked_ok() {
    local dir=$1 want=$2
    [[ -x $dir/usr/bin/containerd && -x $dir/usr/bin/ctr && -x $dir/usr/bin/containerd-shim-runc-v2 ]] || return 1
    [[ $(cat "$dir/VERSION" 2>/dev/null) == "$want" ]] || return 1
    "$dir/usr/bin/containerd" --version 2>/dev/null | grep -qw -- "v\?$(upstream "$want")[^ ]*"
}

# The archive's URI: the URIs of the first Debian stanza that is not the security archive.
archive_uri() {
    local uri=""
    if [[ -r /etc/apt/sources.list.d/debian.sources ]]; then
        uri=$(awk '
            /^[[:space:]]*$/ { if (u != "" && s !~ /-security/) { print u; exit } u = ""; s = ""; next }
            /^URIs:/ { u = $2 } /^Suites:/ { s = $0 }
            END { if (u != "" && s !~ /-security/) print u }' /etc/apt/sources.list.d/debian.sources | head -n1)
    fi
    if [[ -z $uri && -r /etc/apt/sources.list ]]; then
        # deb [options] URI SUITE COMPONENTS...
        uri=$(sed -E 's/\[[^]]*\]//' /etc/apt/sources.list |
              awk '$1 == "deb" && $3 !~ /-security/ { print $2; exit }')
    fi
    [[ -n $uri ]] || die "no Debian archive in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"
    echo "$uri"
}

[[ $(id -u) == 0 ]] || die "run as root"
for tool in apt-get dpkg-deb flock; do
    command -v "$tool" >/dev/null || die "$tool missing (this needs Debian's apt and dpkg)"
done
[[ -r $KEYRING ]] || die "$KEYRING missing: install debian-archive-keyring"
command -v runc >/dev/null || die "runc missing: install the runc package (the containerd packages need it)"

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # one installer at a time (several checkouts share the cache)

# DIR/VERSION is the pin, DIR holds the suite's sources and a Go toolchain that runs.
go_ok() {
    local dir=$1 want=$2
    [[ $(cat "$dir/VERSION" 2>/dev/null) == "$want" ]] || return 1
    [[ -d $dir/usr/share/gocode/src/github.com/containerd/containerd ]] || return 1
    local go
    go=$(ls -d "$dir"/usr/lib/go-*/bin/go 2>/dev/null | tail -n1)
    [[ -n $go ]] && GOROOT=${go%/bin/go} "$go" version >/dev/null 2>&1
}

todo=()
for s in "${series[@]}"; do
    read -r _ version <<<"${PINS[$s]}"
    if unpacked_ok "$cache/$s" "$version" && go_ok "$cache/$s-go" "$version"; then
        say "containerd $s: $version already in $cache/$s (Go sources in $cache/$s-go)"
    else
        todo+=("$s")
    fi
done
((${#todo[@]})) || exit 0

state=$cache/apt
mkdir -p "$state/lists/partial" "$state/cache/archives/partial" "$state/download"
: >"$state/status"  # resolve dependencies as on an empty system: nothing of the host's counts
# apt downloads as its sandbox user where that user may write.
! id _apt >/dev/null 2>&1 || chown _apt "$state/download"
uri=$(archive_uri)
: >"$state/sources.list"
for s in "${todo[@]}"; do
    read -r suite _ <<<"${PINS[$s]}"
    line="deb [signed-by=$KEYRING] $uri $suite main"
    grep -qxF "$line" "$state/sources.list" || echo "$line" >>"$state/sources.list"
done
apt_opts=(
    -o "Dir::Etc::SourceList=$state/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
    -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache" -o "Dir::State::status=$state/status"
    -o APT::Install-Recommends=0
)
say "apt-get update of $(awk '{print $4}' "$state/sources.list" | paste -sd' ') from $uri (private state in $state)"
apt-get "${apt_opts[@]}" -qq update

for s in "${todo[@]}"; do
    read -r suite version <<<"${PINS[$s]}"
    if unpacked_ok "$cache/$s" "$version"; then
        say "containerd $s: $version already in $cache/$s"
        continue
    fi
    rm -f "$state/download/"*.deb
    if ! (cd "$state/download" && apt-get "${apt_opts[@]}" -qq download "containerd=$version"); then
        now=$(apt-cache "${apt_opts[@]}" madison containerd 2>/dev/null | awk -F'|' '{gsub(/ /,"",$2); print $2}' | paste -sd' ')
        die "containerd $version is not in $suite any more (the archive has: ${now:-nothing}): bump the pin in $0"
    fi
    deb=$(ls "$state/download/"*.deb)
    tmp=$(mktemp -d "$cache/.unpack-$s.XXXXXX")
    dpkg-deb -x "$deb" "$tmp"
    echo "$version" >"$tmp/VERSION"
    unpacked_ok "$tmp" "$version" || { rm -rf "$tmp"; die "$deb unpacked, but its containerd does not report $(upstream "$version")"; }
    rm -rf "$cache/$s.old"
    [[ ! -e $cache/$s ]] || mv "$cache/$s" "$cache/$s.old"
    mv "$tmp" "$cache/$s"
    rm -rf "$cache/$s.old" "$deb"
    say "containerd $s: $version unpacked into $cache/$s ($("$cache/$s/usr/bin/containerd" --version))"
done

# The conformance suite's sources: the -dev package of the pinned version, every golang-* package it
# needs (arch all, sources only) and golang-go, as apt resolves them on an empty system.
for s in "${todo[@]}"; do
    read -r suite version <<<"${PINS[$s]}"
    go_ok "$cache/$s-go" "$version" && continue
    rm -f "$state/download/"*.deb
    packages=$(apt-get "${apt_opts[@]}" -s install "golang-github-containerd-containerd-dev=$version" golang-go \
               -t "$suite" 2>/dev/null | awk '/^Inst golang-/ { v = $3; gsub(/[()]/, "", v); print $2 "=" v }')
    [[ -n $packages ]] || die "apt cannot resolve golang-github-containerd-containerd-dev=$version in $suite"
    (cd "$state/download" && apt-get "${apt_opts[@]}" -qq download $packages)
    tmp=$(mktemp -d "$cache/.unpack-$s-go.XXXXXX")
    for deb in "$state/download/"*.deb; do
        dpkg-deb -x "$deb" "$tmp"
    done
    rm -rf "$tmp/usr/bin" "$tmp/usr/share/doc" "$tmp/usr/share/man"  # tools and docs the build never uses
    echo "$version" >"$tmp/VERSION"
    go_ok "$tmp" "$version" || { rm -rf "$tmp"; die "containerd $s: the Go sources unpacked, but no working Go toolchain or sources in them"; }
    rm -rf "$cache/$s-go"
    mv "$tmp" "$cache/$s-go"
    rm -f "$state/download/"*.deb
    say "containerd $s: Go sources of $version ($(wc -w <<<"$packages") packages, $(du -sh "$cache/$s-go" | cut -f1)) in $cache/$s-go"
done
