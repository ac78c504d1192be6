"""The broker's subscription side stays split by concern: bounds that later work keeps.

A subscription is a handful of parts (window, fetch loop, ack batcher, nacks, claims,
retries), each a class in a file of its own; these tests fail when one grows back into
a class that does everything, or a function nobody can follow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "components" / "delayed_pubsub"
# The broker and every module a subscription is made of.
MODULES = (
    "broker.py",
    "subscription.py",
    "window.py",
    "fetch.py",
    "acks.py",
    "nacks.py",
    "calls.py",
    "claims.py",
    "redelivery.py",
    "retry_notices.py",
    "lua/__init__.py",
)
MAX_METHODS = 25
MAX_CLASS_LINES = 450
MAX_COMPLEXITY = 15


def _classes(path: Path) -> list[tuple[str, int, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            found.append((node.name, methods, lines))
    return found


@pytest.mark.parametrize("module", MODULES)
def test_no_class_of_the_subscription_side_exceeds_25_methods_or_450_lines(module: str) -> None:
    path = PACKAGE / module
    assert path.is_file(), f"{module} is gone: update MODULES with where its code went"
    too_big = [
        f"{name}: {methods} methods, {lines} lines"
        for name, methods, lines in _classes(path)
        if methods > MAX_METHODS or lines > MAX_CLASS_LINES
    ]
    assert not too_big, f"{module}: split by concern: {too_big}"


def test_no_function_of_the_subscription_side_exceeds_mccabe_15() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "C90",
            "--config",
            f"lint.mccabe.max-complexity={MAX_COMPLEXITY}",
            "--output-format",
            "concise",
            *(str(PACKAGE / m) for m in MODULES),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
