#!/usr/bin/env bash
# ruff (lint rules of pyproject.toml) and mypy --strict over the whole project.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

status=0
say "ruff check"
"$venv/bin/ruff" check . || status=1
say "mypy"
"$venv/bin/mypy" proto middleware components tests examples bench scripts || status=1
exit "$status"
