#!/usr/bin/env bash
# Idempotent set-up of everything `make demo` and `make test` need:
#   .venv (Python >= 3.11) with the project installed editable, its dev, spark, examples and dashboard
#   extras;
#   redis-server and a Java runtime (for the Spark tests), from apt when missing;
#   podman, runc and mmdebstrap (the container image test builds its base from Debian packages);
#   chromium (the dashboard's browser tests drive it headless; Playwright's own browser download is
#   never used);
#   a daprd (scripts/daprd.sh: found, or built once into ~/.cache; the first build takes minutes).
# Safe to run again: each step checks before it acts.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# --- Python venv ---------------------------------------------------------------------------
if [[ ! -x "$py" ]]; then
    base=""
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            base="$candidate"
            break
        fi
    done
    [[ -n "$base" ]] || die "Python >= 3.11 is required (python3.11+ not found on PATH)"
    say "creating .venv with $base ($("$base" --version))"
    "$base" -m venv "$venv"
fi

# Re-install only when pyproject.toml changed since the last successful install.
extras="${SETUP_EXTRAS:-dev,spark,examples,dashboard}"
stamp="$venv/.setup-$(printf '%s' "$extras" | tr ',' '-')"
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]] || ! "$venv/bin/delayed-pubsub" --help >/dev/null 2>&1; then
    say "installing the project into .venv: pip install -e '.[$extras]'"
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet -e ".[$extras]"
    touch "$stamp"
fi

# --- system packages -----------------------------------------------------------------------
apt_packages=()
command -v redis-server >/dev/null 2>&1 || apt_packages+=(redis-server)
command -v podman >/dev/null 2>&1 || apt_packages+=(podman)
# podman's default runtime (crun) fails on hosts with hybrid cgroups; scripts/image.sh uses runc.
[[ -x /usr/sbin/runc ]] || apt_packages+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || apt_packages+=(mmdebstrap)
if [[ ",$extras," == *",dashboard,"* ]] && ! command -v chromium >/dev/null 2>&1; then
    apt_packages+=(chromium)
fi
# The host's zone files: schedules stored by older versions under names such as right/… are
# still read from them (new ones are refused); newer Debian ships those in tzdata-legacy.
if [[ ! -e /usr/share/zoneinfo/right/UTC ]]; then
    apt_packages+=(tzdata)
    if command -v apt-cache >/dev/null 2>&1 && apt-cache show tzdata-legacy >/dev/null 2>&1; then
        apt_packages+=(tzdata-legacy)
    fi
fi
if [[ ",$extras," == *",spark,"* ]] && ! command -v java >/dev/null 2>&1; then
    apt_packages+=(openjdk-17-jre-headless)
fi
if ((${#apt_packages[@]})); then
    command -v apt-get >/dev/null 2>&1 ||
        die "missing ${apt_packages[*]} and no apt-get here: install them with your package manager"
    say "installing ${apt_packages[*]} (apt-get)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi
# Debian starts a system redis-server on :6379 after install; we never use it (private ports only).

# --- daprd ---------------------------------------------------------------------------------
say "finding daprd (builds it once into ${XDG_CACHE_HOME:-~/.cache}/dapr-delayed-pubsub if needed)"
daprd="$("$root/scripts/daprd.sh")"
say "daprd: $daprd ($("$daprd" --version 2>/dev/null || echo '?'))"
