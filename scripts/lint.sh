#!/usr/bin/env bash
# ruff (lint rules of pyproject.toml) and mypy --strict over the whole project.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

status=0
say "ruff check"
"$venv/bin/ruff" check . || status=1
say "mypy"
# The paths and the excludes (generated stubs, .venv) come from pyproject.toml.
"$venv/bin/mypy" . || status=1
exit "$status"
