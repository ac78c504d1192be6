"""The code's shape, measured: class sizes (methods, lines) and McCabe complexity (ruff's C90).

For the guards that keep classes and functions within the bounds a reader can hold
(no class over 25 methods or 450 lines; no function over complexity 15 without a
`# noqa: C901` and its reason).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_METHODS = 25
MAX_CLASS_LINES = 450
MAX_COMPLEXITY = 15


def oversized_classes(paths: list[Path]) -> list[str]:
    """`<file>:<class>: <n> methods, <m> lines` for each class over MAX_METHODS or MAX_CLASS_LINES."""
    out: list[str] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if methods > MAX_METHODS or lines > MAX_CLASS_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.name}: {methods} methods, {lines} lines")
    return out


def too_complex(paths: list[Path]) -> list[str]:
    """ruff's C90 findings over `paths` at MAX_COMPLEXITY (a `# noqa: C901` is honoured), one per line."""
    ruff = Path(sys.executable).parent / "ruff"
    result = subprocess.run(
        [
            str(ruff),
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "C90",
            "--config",
            f"lint.mccabe.max-complexity={MAX_COMPLEXITY}",
            "--output-format",
            "concise",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode not in (0, 1):
        raise AssertionError(f"ruff failed ({result.returncode}): {result.stderr}")
    return [line for line in result.stdout.splitlines() if "C901" in line]
