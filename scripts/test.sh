#!/usr/bin/env bash
# The whole test suite, end-to-end tests under a real daprd included, after set-up and lint.
# Never skips what it cannot run: a missing redis-server, Java, daprd, podman or chromium is a failure here.
# Exit code: pytest's, or 1 when lint failed and pytest passed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

"$root/scripts/setup.sh"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=("redis-server")
command -v java >/dev/null 2>&1 || missing+=("java (a JRE 17+, for the Spark tests)")
command -v podman >/dev/null 2>&1 || missing+=("podman (for the container image test)")
command -v mmdebstrap >/dev/null 2>&1 || missing+=("mmdebstrap (builds the image's base from Debian packages)")
command -v chromium >/dev/null 2>&1 || missing+=("chromium (the dashboard's browser tests)")
if daprd="$("$root/scripts/daprd.sh")"; then
    export DAPRD="$daprd"  # the e2e fixtures reuse it instead of searching again
else
    missing+=("daprd (see the scripts/daprd.sh message above)")
fi
((${#missing[@]} == 0)) || die "cannot run the tests, missing: ${missing[*]}"

# The container tests' images (the component's, and the injected pod's daprd, app and Redis) and
# the injector's patcher, built (or found in podman's and Go's caches) before the clock of any
# test starts: a first build on a fresh machine takes minutes.
"$root/scripts/pod-images.sh" >/dev/null || die "scripts/pod-images.sh could not build the container images"
"$root/scripts/injectpatch.sh" deploy/kubernetes/app.yaml orders-app localhost/daprd >/dev/null ||
    die "scripts/injectpatch.sh could not build tools/injectpatch"

lint_status=0
"$root/scripts/lint.sh" || lint_status=$?
((lint_status == 0)) || say "lint FAILED (the tests run anyway; the exit code will say so)"

say "pytest tests/ (daprd: $DAPRD)"
start=$(date +%s)
pytest_status=0
"$venv/bin/pytest" tests -p no:cacheprovider "$@" || pytest_status=$?
say "pytest exit $pytest_status after $(( $(date +%s) - start ))s; lint exit $lint_status"

if ((pytest_status != 0)); then
    exit "$pytest_status"
fi
exit "$lint_status"
