#!/usr/bin/env bash
# Builds the images of the injected-pod test (tests/e2e/test_pod_e2e.py) with podman, all from
# Debian packages on the base scripts/image.sh makes (and caches), and prints their names on
# stdout, one per line, as KEY=IMAGE:
#
#   COMPONENT=localhost/dapr-delayed-pubsub:latest   scripts/image.sh's image, under the name
#                                                    deploy/kubernetes/app.yaml gives it
#   DAPRD=localhost/daprd:<version>                  the daprd of scripts/daprd.sh, laid out as
#                                                    Dapr's own image: /daprd, its user
#   APP=localhost/python:3.11-slim-bookworm          a local stand-in for the Docker Hub image
#                                                    app.yaml's app container names: Debian's
#                                                    python3 as `python` (examples/subscriber.py
#                                                    needs nothing else)
#   REDIS=localhost/delayed-pubsub-redis:bookworm    Debian's redis-server
#
# podman reuses its layer cache: a second run takes seconds. Everything but the names goes to stderr.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

podman_args=()
runtime="${PODMAN_RUNTIME:-}"
[[ -z "$runtime" && -x /usr/sbin/runc ]] && runtime=/usr/sbin/runc
[[ -n "$runtime" ]] && podman_args+=(--runtime "$runtime")

component="$("$root/scripts/image.sh")"
base=localhost/delayed-pubsub-base:bookworm
daprd="$("$root/scripts/daprd.sh")"
version="$(sed -n 's/^require github.com\/dapr\/dapr v\([0-9][0-9.]*\).*/\1/p' "$root/tools/daprd/go.mod")"

build() {  # build IMAGE CONTEXT_DIR [podman build flags]: the Containerfile in CONTEXT_DIR, on the Debian base
    say "podman build -t $1"
    podman "${podman_args[@]}" build --quiet --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
        --build-arg "BASE_IMAGE=$base" "${@:3}" -t "$1" "$2" >&2
}

podman "${podman_args[@]}" tag "$component" localhost/dapr-delayed-pubsub:latest

work="$(mktemp -d "${TMPDIR:-/tmp}/pod-images.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir "$work/daprd" "$work/app" "$work/redis"
cp "$daprd" "$work/daprd/daprd"
# daprd's user is the one of Dapr's own image (dapr/dapr docker/Dockerfile, the version we build).
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then PATH="$PATH:/usr/local/go/bin"; fi
dapr_module="$(cd "$root/tools/injectpatch" && go list -mod=readonly -m -f '{{.Dir}}' github.com/dapr/dapr)"
daprd_user="$(sed -n 's/^USER \([0-9:]*\)$/\1/p' "$dapr_module/docker/Dockerfile")"
[[ -n "$daprd_user" ]] || die "no USER in $dapr_module/docker/Dockerfile"
cp "$root/deploy/podman/daprd.Containerfile" "$work/daprd/Containerfile"
cp "$root/deploy/podman/app.Containerfile" "$work/app/Containerfile"
cp "$root/deploy/podman/redis.Containerfile" "$work/redis/Containerfile"
build "localhost/daprd:$version" "$work/daprd" --build-arg "DAPRD_USER=$daprd_user"
build localhost/python:3.11-slim-bookworm "$work/app"
build localhost/delayed-pubsub-redis:bookworm "$work/redis"

printf 'COMPONENT=%s\n' localhost/dapr-delayed-pubsub:latest
printf 'DAPRD=%s\n' "localhost/daprd:$version"
printf 'APP=%s\n' localhost/python:3.11-slim-bookworm
printf 'REDIS=%s\n' localhost/delayed-pubsub-redis:bookworm
