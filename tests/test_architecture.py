"""The package structure held to its rules: no import cycle among the modules under middleware/.

An import cycle makes a module's meaning depend on which side of the cycle was imported first, and
hides which part depends on which. Every import counts, including those under `if TYPE_CHECKING:`
and those inside functions: each is a dependency a reader must follow.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIDDLEWARE = ROOT / "middleware"


def module_name(path: Path, root: Path) -> str:
    """`a/b/c.py` -> `a.b.c`, `a/b/__init__.py` -> `a.b` (paths relative to `root`)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its body.

    Relative imports are resolved against `name`'s package; `from pkg import x` is an import
    of the submodule `pkg.x` when there is one, else of `pkg` itself.
    """
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                # `import a.b.c` names a.b.c; credit the longest known module on that path.
                target = alias.name
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module under `root` and the modules under `root` it imports."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = imported_modules(tree, name, path.name == "__init__.py", known)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        # graphlib lists each module before the one that imports it: reversed, each imports the next.
        cycle: list[str] = exc.args[1]
        return cycle[::-1]
    return None


def test_the_graph_sees_type_checking_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The guard below must count the imports that hide a cycle: one under TYPE_CHECKING, one
    inside a function, one relative, and `from pkg import submodule`."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nclass A: ...\n"
    )
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from pkg import a\nimport pkg.b\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.b"},
    }
    cycle = find_cycle(graph)
    assert cycle is not None
    assert set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.c"}


def test_middleware_has_no_import_cycle() -> None:
    graph = import_graph(MIDDLEWARE)
    assert "delayed_middleware.engine.delay_engine" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in middleware/: " + " -> ".join(cycle or [])
