#!/usr/bin/env bash
# Prints the path of a daprd binary on stdout, building one if none is found.
#
#   scripts/daprd.sh            the daprd of the tests and the demo (the version tools/daprd/go.mod pins)
#   scripts/daprd.sh VERSION    exactly that daprd version (e.g. 1.16.5): from the cache of 4. below,
#                               else built from tools/daprd/versions/VERSION/go.mod (or tools/daprd
#                               when VERSION is the pinned one); 1.-3. are skipped, since they may hold
#                               another version. scripts/daprd-matrix.sh uses this.
#
# Looked for, in this order:
#   1. $DAPRD                                   (an explicit choice always wins)
#   2. `daprd` on PATH
#   3. ~/.dapr/bin/daprd                        (where `dapr init` puts it)
#   4. ${XDG_CACHE_HOME:-~/.cache}/dapr-delayed-pubsub/daprd-<version>   (a previous build)
#   5. built from tools/daprd (the upstream daprd, Go modules pinned by go.mod/go.sum),
#      with `-tags stablecomponents`, into the cache of 4. The first build downloads
#      ~300 modules and compiles for several minutes (~6 min on 2 cores); later runs reuse it.
#
# Everything but the path goes to stderr, so `DAPRD=$(scripts/daprd.sh)` just works.
# A missing Go toolchain or a failed build exits non-zero with the reason: never a silent skip.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module_dir="$root/tools/daprd"

log() { printf 'daprd.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The dapr version a go.mod pins: one place to change it.
pinned_version() {
    local v
    v="$(sed -n 's/^require github.com\/dapr\/dapr v\([0-9][0-9.]*[^ ]*\).*/\1/p' "$1/go.mod" | head -n1)"
    [[ -n "$v" ]] || v="$(awk '$1 == "github.com/dapr/dapr" { sub(/^v/, "", $2); print $2; exit }' "$1/go.mod")"
    [[ -n "$v" ]] || die "cannot read the dapr version from $1/go.mod"
    printf '%s\n' "$v"
}

version="$(pinned_version "$module_dir")"
explicit=""
if (($# > 1)); then
    die "usage: scripts/daprd.sh [VERSION]"
elif (($# == 1)); then
    explicit="${1#v}"
    if [[ "$explicit" != "$version" ]]; then
        module_dir="$root/tools/daprd/versions/$explicit"
        [[ -f "$module_dir/go.mod" && -f "$module_dir/go.sum" ]] ||
            die "no go.mod and go.sum for daprd $explicit in tools/daprd/versions/$explicit"
        [[ "$(pinned_version "$module_dir")" == "$explicit" ]] ||
            die "tools/daprd/versions/$explicit/go.mod pins another dapr version"
    fi
    version="$explicit"
fi

cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/dapr-delayed-pubsub"
cached="$cache_dir/daprd-$version"

usable() { [[ -n "$1" && -f "$1" && -x "$1" ]]; }

if [[ -n "$explicit" ]]; then
    :  # an explicit version: only the cache of that version, or a build of it
elif [[ -n "${DAPRD:-}" ]]; then
    usable "$DAPRD" || die "DAPRD=$DAPRD is not an executable file"
    printf '%s\n' "$DAPRD"
    exit 0
fi
if [[ -z "$explicit" ]] && on_path="$(command -v daprd 2>/dev/null)" && usable "$on_path"; then
    printf '%s\n' "$on_path"
    exit 0
fi
if [[ -z "$explicit" ]] && usable "$HOME/.dapr/bin/daprd"; then
    printf '%s\n' "$HOME/.dapr/bin/daprd"
    exit 0
fi
if usable "$cached"; then
    printf '%s\n' "$cached"
    exit 0
fi

# Go's default install place, for shells whose PATH lacks it.
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
    PATH="$PATH:/usr/local/go/bin"
fi
go_needed="$(awk '$1 == "go" { print $2; exit }' "$module_dir/go.mod")"
alternatives="or install the Dapr CLI and run \`dapr init --slim\` (daprd in ~/.dapr/bin), or set DAPRD to a daprd binary"
command -v go >/dev/null 2>&1 ||
    die "no daprd found, and no Go toolchain to build one: install Go >= $go_needed (https://go.dev/dl/), $alternatives"
go_have="$(go env GOVERSION 2>/dev/null)"
go_have="${go_have#go}"
if [[ "$(printf '%s\n%s\n' "$go_needed" "$go_have" | sort -V | head -n1)" != "$go_needed" ]]; then
    # Go 1.21+ fetches the toolchain go.mod asks for, unless GOTOOLCHAIN forbids it.
    toolchain="$(go env GOTOOLCHAIN 2>/dev/null || echo local)"
    if [[ "$(printf '1.21\n%s\n' "$go_have" | sort -V | head -n1)" != "1.21" || "$toolchain" == local* ]]; then
        die "no daprd found, and Go $go_have is too old to build one: install Go >= $go_needed (https://go.dev/dl/), $alternatives"
    fi
    log "Go $go_have is older than the $go_needed that tools/daprd/go.mod needs: go will download that toolchain (GOTOOLCHAIN=$toolchain)"
fi

log "no daprd found; building daprd $version from ${module_dir#"$root/"} into $cached"
log "the first build downloads and compiles daprd's dependencies: expect several minutes (~6 min on 2 cores)"

work="$(mktemp -d "${TMPDIR:-/tmp}/daprd-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp "$module_dir/go.mod" "$module_dir/go.sum" "$root/tools/daprd/main.go" "$work/"
mkdir -p "$cache_dir"

start=$(date +%s)
# -mod=readonly: go.mod and go.sum are committed, so the build uses exactly those module
# versions and hashes (checked against the checksum database), nothing newer.
# Build into a temp name and rename, so an interrupted build never leaves a broken cache entry.
if ! (cd "$work" && go build -mod=readonly -tags stablecomponents -trimpath \
        -ldflags "-s -w -X github.com/dapr/dapr/pkg/buildinfo.version=$version" \
        -o "$cached.partial.$$" .) >&2; then
    rm -f "$cached.partial.$$"
    die "building daprd $version failed (see the Go output above). Check network access to the Go module
  proxy ($(go env GOPROXY)), or set DAPRD to an existing daprd binary."
fi
mv -f "$cached.partial.$$" "$cached"
log "built daprd $version in $(( $(date +%s) - start ))s: $cached"
printf '%s\n' "$cached"
