#!/usr/bin/env bash
# Every benchmark in bench/ (each a standalone script with its own private Redis and component).
# Figures go to stdout; the curated ones are kept in bench/RESULTS.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

"$root/scripts/setup.sh"
# Each takes its own options (see its docstring); run one by hand to pass them.
for bench in bench/publish.py bench/grpc_ceiling.py bench/delay.py bench/chaos.py bench/fastpath.py bench/spark_stats.py; do
    say "$bench"
    "$py" "$bench"
done
