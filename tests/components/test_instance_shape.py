"""The instance, its forwarder and the servicer stay readable: no class past 25 methods or 450 lines.

A class past either bound is split by concern (a bound later work keeps; the functions'
McCabe bound is ruff's C90 check).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

MODULES = ("delayed_pubsub.instance", "delayed_pubsub.forwarder", "delayed_pubsub.servicer")
MAX_METHODS = 25
MAX_LINES = 450


def source_files(module: str) -> list[Path]:
    """The files of `module`: its own, or every one of its package."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    origin = Path(spec.origin)
    return sorted(origin.parent.glob("*.py")) if spec.submodule_search_locations else [origin]


def oversized_classes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if methods > MAX_METHODS or lines > MAX_LINES:
                found.append(f"{path.name}: {node.name} has {methods} methods in {lines} lines")
    return found


def test_no_class_of_the_instance_forwarder_or_servicer_exceeds_25_methods_or_450_lines() -> None:
    files = [f for m in MODULES for f in source_files(m)]
    assert [f for path in files for f in oversized_classes(path)] == []
