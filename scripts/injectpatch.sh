#!/usr/bin/env bash
# Prints, as YAML, the Pod that the Dapr sidecar injector makes of a Deployment's pod template:
# the injector's own code (github.com/dapr/dapr pkg/injector/patcher, the dapr version of
# tools/daprd/go.mod), configured as Dapr's Helm chart of that version configures it.
#
#   scripts/injectpatch.sh MANIFEST DEPLOYMENT SIDECAR_IMAGE [extra tools/injectpatch flags]
#   scripts/injectpatch.sh deploy/kubernetes/app.yaml orders-app localhost/daprd:1.18.1
#
# tools/injectpatch is built once into ${XDG_CACHE_HOME:-~/.cache}/dapr-delayed-pubsub (keyed by
# its sources; it reuses the Go module cache the daprd build filled). Everything but the YAML
# goes to stderr.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

(($# >= 3)) || die "usage: scripts/injectpatch.sh MANIFEST DEPLOYMENT SIDECAR_IMAGE [flags]"
manifest="$(realpath "$1")"
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
    PATH="$PATH:/usr/local/go/bin"
fi
command -v go >/dev/null 2>&1 || die "no Go toolchain: tools/injectpatch needs one (>= the 'go' line of its go.mod)"

src="$root/tools/injectpatch"
key="$(cat "$src/main.go" "$src/go.mod" "$src/go.sum" | sha256sum | cut -c1-16)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/dapr-delayed-pubsub"
bin="$cache/injectpatch-$key"
if [[ ! -x "$bin" ]]; then
    say "building tools/injectpatch (the Dapr injector's patcher; minutes the first time)"
    mkdir -p "$cache"
    (cd "$src" && go build -mod=readonly -trimpath -o "$bin.partial.$$" .) >&2 || die "building tools/injectpatch failed"
    mv -f "$bin.partial.$$" "$bin"
fi
dapr_module="$(cd "$src" && go list -mod=readonly -m -f '{{.Dir}}' github.com/dapr/dapr)"
[[ -d "$dapr_module" ]] || die "the github.com/dapr/dapr module is not in the Go module cache (run: cd tools/injectpatch && go mod download)"
"$bin" -manifest "$manifest" -deployment "$2" -sidecar-image "$3" -dapr-module "$dapr_module" "${@:4}"
