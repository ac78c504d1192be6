#!/usr/bin/env bash
# Every benchmark in bench/ (each a standalone script with its own private Redis and component).
# Figures go to stdout; the curated ones are kept in bench/RESULTS.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

"$root/scripts/setup.sh"
shopt -s nullglob
for bench in bench/*.py; do
    say "$bench"
    "$py" "$bench" "$@"
done
