"""Bounds on the shape of the code, read from its syntax tree (ast): they fail when a change breaks them."""

from __future__ import annotations

import ast
import functools
import graphlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "components", ROOT / "middleware")
# The one home of retry numbers (named BackoffProfile profiles) and of Redis error classification.
POLICY_MODULE = ROOT / "middleware" / "delayed_middleware" / "backoff.py"
CLASSIFIER_MODULE = ROOT / "middleware" / "delayed_middleware" / "redis_errors.py"
# Every way this code or redis-py builds a retry delay.
BACKOFF_BUILDERS = frozenset(
    {
        "Backoff",
        "BackoffProfile",
        "ExponentialBackoff",
        "ExponentialWithJitterBackoff",
        "EqualJitterBackoff",
        "FullJitterBackoff",
        "DecorrelatedJitterBackoff",
        "ConstantBackoff",
    }
)


@functools.cache
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of the packages, parsed (once for all the guards)."""
    return tuple(
        (path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for package in PACKAGES
        for path in sorted(package.rglob("*.py"))
        if ".venv" not in path.parts and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    )


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _has_number(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
        for n in ast.walk(node)
    )


def _where(path: Path, node: ast.expr) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"


def literal_backoffs() -> list[str]:
    """Backoffs built with numbers written where they are used (or with the defaults' hidden ones)."""
    found = []
    for path, tree in _modules():
        if path == POLICY_MODULE:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _name(node.func) not in BACKOFF_BUILDERS:
                continue
            values = [*node.args, *(k.value for k in node.keywords)]
            if not values or any(_has_number(v) for v in values):
                found.append(_where(path, node))
    return found


def _is_str_call(node: ast.expr) -> bool:
    """`str(e)`: the text of a variable (an error, where matching it is the pattern guarded)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "str"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Name)
    )


def error_text_matches() -> list[str]:
    """`"CODE" in str(e)`, `str(e).startswith(...)`: errors told apart by their text."""
    found = []
    for path, tree in _modules():
        if path == CLASSIFIER_MODULE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                if any(
                    isinstance(op, (ast.In, ast.NotIn)) and _is_str_call(right)
                    for op, right in zip(node.ops, node.comparators, strict=True)
                ):
                    found.append(_where(path, node))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "endswith")
                and _is_str_call(node.func.value)
            ):
                found.append(_where(path, node))
    return found


def test_the_guards_see_what_they_guard() -> None:
    """Each guard finds its pattern: a guard that cannot fail proves nothing."""
    assert POLICY_MODULE.exists()
    assert CLASSIFIER_MODULE.exists()
    sample = ast.parse(
        "Backoff(base_s=0.05, cap_s=2.0)\nBackoff(base_s=P.base_s, cap_s=P.cap_s)\n"
        'if "NOGROUP" in str(e): pass\nstr(e).startswith("X")\nstr(d.get("t")).startswith("pubsub.")'
    )
    calls = [n for n in ast.walk(sample) if isinstance(n, ast.Call) and _name(n.func) in BACKOFF_BUILDERS]
    assert [_has_number(c.keywords[0].value) for c in calls] == [True, False]
    compares = [n for n in ast.walk(sample) if isinstance(n, ast.Compare)]
    assert _is_str_call(compares[0].comparators[0])
    starts = [
        n.func.value
        for n in ast.walk(sample)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "startswith"
    ]
    assert [_is_str_call(s) for s in starts] == [True, False]


def test_retry_numbers_live_in_the_policy_module_only() -> None:
    """Every retry loop takes a named BackoffProfile (backoff.py), whose comment says why its numbers."""
    assert literal_backoffs() == []


def test_redis_errors_are_classified_by_their_reply_code_only() -> None:
    """Redis errors are told apart by redis_errors (the reply's code), never by searching their text."""
    assert error_text_matches() == []


# No import cycle in middleware/: every import counts, under TYPE_CHECKING and inside functions too.
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


def test_middleware_never_imports_the_component() -> None:
    """Imports go one way, components -> middleware: the delay logic runs without gRPC or daprd."""
    back = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in _modules()
        if path.is_relative_to(MIDDLEWARE)
        for node in ast.walk(tree)
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "delayed_pubsub")
        or (
            isinstance(node, ast.Import) and any(a.name.split(".")[0] == "delayed_pubsub" for a in node.names)
        )
    ]
    assert back == []


# A class a reader can hold in mind: past either bound, it is split by concern.
MAX_METHODS = 25
MAX_CLASS_LINES = 450


def oversized_classes() -> list[str]:
    """`<file>:<line>: <class>: <n> methods, <m> lines` for each class over either bound."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if methods > MAX_METHODS or lines > MAX_CLASS_LINES:
                found.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}: {methods} methods, {lines} lines"
                )
    return found


def test_no_class_has_more_than_25_methods_or_450_lines() -> None:
    assert len(_modules()) > 100  # the walk found both packages
    assert oversized_classes() == []


def test_ruff_bounds_every_function_at_mccabe_15() -> None:
    """ruff (scripts/lint.sh, CI) checks C90 at 15 over the whole tree; an exception is a
    `# noqa: C901` with its reason beside it."""
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["lint"]
    assert "C90" in lint["select"]
    assert lint["mccabe"]["max-complexity"] == 15
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for path, _ in _modules()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "noqa: C901" in line and not line.split("noqa: C901", 1)[1].strip(" -—:")
    ]
    assert bare == [], "each C901 exception says why"
