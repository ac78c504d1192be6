#!/usr/bin/env bash
# The end-to-end smoke against each daprd version users run (not part of `make test`).
#
#   scripts/daprd-matrix.sh [VERSION ...]
#
# Without arguments: the version tools/daprd/go.mod pins and every tools/daprd/versions/<VERSION>.
# For each version, one at a time: `scripts/daprd.sh VERSION` (cached in ~/.cache/dapr-delayed-pubsub,
# else built from Go modules at the lowest CPU priority: several minutes each), a check that the binary
# reports that version, then the smoke below under it. Prints a table; exit 1 if any version failed.
#
# The smoke: the README's quickstart, plain pub/sub (publish, subscribe, redelivery, raw payloads, bulk),
# delayed messages (delay, instant, TTL, SDK, bulk), recurring schedules and cancel, and retry with backoff
# and dead letters, all through a real daprd.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

smoke=(
    tests/e2e/test_quickstart_e2e.py
    tests/e2e/test_pubsub_e2e.py
    tests/e2e/test_delayed_e2e.py
    tests/e2e/test_schedules_e2e.py
    tests/e2e/test_retry_e2e.py
)

[[ -x "$venv/bin/pytest" ]] || die "no $venv/bin/pytest: run scripts/setup.sh (make setup) first"

versions=("$@")
if ((${#versions[@]} == 0)); then
    versions+=("$(sed -n 's/^require github.com\/dapr\/dapr v\([0-9][0-9.]*\).*/\1/p' tools/daprd/go.mod | head -n1)")
    for dir in tools/daprd/versions/*/; do
        [[ -f "$dir/go.mod" ]] && versions+=("$(basename "$dir")")
    done
fi

logs="$(mktemp -d "${TMPDIR:-/tmp}/daprd-matrix.XXXXXX")"
results=()
failed=0
for version in "${versions[@]}"; do
    say "daprd $version: finding or building it"
    if ! daprd="$(nice -n 19 "$root/scripts/daprd.sh" "$version" 2>"$logs/build-$version.log")"; then
        results+=("| $version | build failed | see $logs/build-$version.log |")
        failed=1
        continue
    fi
    reported="$("$daprd" --version 2>/dev/null || true)"
    if [[ "$reported" != "$version" ]]; then
        results+=("| $version | wrong binary | $daprd reports '$reported' |")
        failed=1
        continue
    fi
    say "daprd $version ($daprd): the e2e smoke"
    start=$SECONDS
    if DAPRD="$daprd" nice -n 10 "$venv/bin/pytest" -m e2e -q -p no:cacheprovider "${smoke[@]}" \
        >"$logs/smoke-$version.log" 2>&1; then
        outcome="passed"
    else
        outcome="FAILED"
        failed=1
    fi
    summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$logs/smoke-$version.log" | tail -n1 | tr -d '=' | xargs)"
    results+=("| $version | $outcome | ${summary:-no summary} in $((SECONDS - start)) s; log $logs/smoke-$version.log |")
done

printf '\n| daprd | smoke | detail |\n|---|---|---|\n'
printf '%s\n' "${results[@]}"
exit "$failed"
