#!/usr/bin/env bash
# The quick set of benchmarks: exactly what `python -m bench` runs (the registry in
# bench/__main__.py says which are quick and which are opt-in; `python -m bench --list`).
# Figures go to stdout; the curated ones are kept in bench/RESULTS.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

"$root/scripts/setup.sh"
exec "$py" -m bench
