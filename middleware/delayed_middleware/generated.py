"""Files generated from a table (the docs' key tables, the settings reference): written, or checked."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path


def write_or_check(root: Path, files: Mapping[Path, str], *, write: bool) -> int:
    """Write each of `files` (paths relative to `root`) whose text differs, or with `write` off list
    them as out of date; returns the exit status (1: some file is out of date and was not written)."""
    stale = []
    for relative, text in files.items():
        path = root / relative
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        if write:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {relative}")
        else:
            stale.append(str(relative))
    if stale:
        print(f"out of date (run with --write): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0
