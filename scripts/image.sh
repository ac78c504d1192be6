#!/usr/bin/env bash
# Builds the component's container image with podman and prints its name on stdout.
#
# With no registry at hand (as in CI here), the base is made from Debian packages:
#   mmdebstrap --variant=apt --include=python3-minimal,python3-venv bookworm  -> a tarball,
#   podman import -> localhost/delayed-pubsub-base:bookworm,
# both cached (the tarball in ${XDG_CACHE_HOME:-~/.cache}/dapr-delayed-pubsub/container, the image
# in podman's store), so later runs only rebuild the layers whose inputs changed.
# BASE_IMAGE=python:3.11-slim-bookworm (or any base the Dockerfile takes) skips that and uses it.
#
# Env: IMAGE (default localhost/dapr-delayed-pubsub:dev), BASE_IMAGE, PODMAN_RUNTIME (default
# /usr/sbin/runc when present: crun fails on hosts with hybrid cgroups), PIP_CERT (a CA bundle
# for pip behind a TLS-intercepting proxy; default the system bundle, passed as a build secret,
# never stored in the image).
# Everything but the image name goes to stderr. Missing podman or mmdebstrap is an error.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

image="${IMAGE:-localhost/dapr-delayed-pubsub:dev}"
command -v podman >/dev/null 2>&1 || die "podman is not installed: run scripts/setup.sh (apt-get install -y podman runc mmdebstrap)"

podman_args=()
runtime="${PODMAN_RUNTIME:-}"
[[ -z "$runtime" && -x /usr/sbin/runc ]] && runtime=/usr/sbin/runc
[[ -n "$runtime" ]] && podman_args+=(--runtime "$runtime")

base="${BASE_IMAGE:-}"
if [[ -z "$base" ]]; then
    base=localhost/delayed-pubsub-base:bookworm
    cache="${XDG_CACHE_HOME:-$HOME/.cache}/dapr-delayed-pubsub/container"
    tarball="$cache/base-bookworm-python3.tar"
    if ! podman "${podman_args[@]}" image exists "$base"; then
        if [[ ! -s "$tarball" ]]; then
            command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is not installed: run scripts/setup.sh"
            mkdir -p "$cache"
            say "making the base image from Debian packages (mmdebstrap, about 20 s)"
            mmdebstrap --quiet --format=tar --variant=apt --include=python3-minimal,python3-venv bookworm "$tarball.part" >&2
            mv "$tarball.part" "$tarball"
        fi
        say "podman import $tarball as $base"
        podman "${podman_args[@]}" import --quiet "$tarball" "$base" >/dev/null
    fi
fi

build_args=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --build-arg "BASE_IMAGE=$base" -t "$image")
cert="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
[[ -s "$cert" ]] && build_args+=(--secret "id=pip-cert,src=$cert")
say "podman build -t $image (base $base)"
podman "${podman_args[@]}" build --quiet "${build_args[@]}" "$root" >&2
printf '%s\n' "$image"
