"""The bench registry (bench/__main__.py): every script of bench/ is a registered benchmark or
named as not one; `make bench` runs exactly what `python -m bench` runs; the quick set's
arguments are options its scripts really take."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import BENCHES, NOT_BENCHMARKS, Bench, listing

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def script(name: str) -> ast.Module:
    return ast.parse((BENCH / f"{name}.py").read_text())


def options(tree: ast.Module) -> set[str]:
    """Every `--option` an argparse parser of the script declares."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                    found.add(a.value)
    return found


def test_every_script_of_bench_is_registered_or_excluded_once() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py")}
    registered = [b.name for b in BENCHES]
    assert len(registered) == len(set(registered)), "a benchmark registered twice"
    assert not set(registered) & set(NOT_BENCHMARKS), "registered and excluded at once"
    assert sorted(scripts) == sorted([*registered, *NOT_BENCHMARKS])


@pytest.mark.parametrize("bench", BENCHES, ids=lambda b: b.name)
def test_each_benchmark_runs_as_a_script_and_says_what_it_measures_and_why_it_is_opt_in(bench: Bench) -> None:
    tree = script(bench.name)
    assert any(
        isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == "main" for n in tree.body
    ), "no top-level main()"
    assert '\nif __name__ == "__main__":\n' in (BENCH / f"{bench.name}.py").read_text(), "no __main__ block"
    assert bench.description
    assert "\n" not in bench.description
    assert (bench.quick is None) == bool(bench.why_opt_in), "opt-in exactly when a reason is given"


@pytest.mark.parametrize("bench", [b for b in BENCHES if b.quick], ids=lambda b: b.name)
def test_the_quick_sets_arguments_are_options_of_the_script(bench: Bench) -> None:
    assert bench.quick is not None
    given = {a for a in bench.quick if a.startswith("--")}
    assert given <= options(script(bench.name))


def test_make_bench_runs_python_m_bench_and_nothing_else() -> None:
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", make, re.M)
    assert recipe is not None
    assert recipe.group(1).strip() == "@scripts/bench.sh"
    commands = [
        line
        for line in (ROOT / "scripts" / "bench.sh").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "source "))
    ]
    assert commands == ['"$root/scripts/setup.sh"', 'exec "$py" -m bench']


def test_list_names_every_benchmark_and_whether_it_is_quick() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == listing()
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert rows == {b.name: "quick" if b.quick is not None else "opt-in" for b in BENCHES}


def test_an_unknown_name_is_refused_naming_the_list() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench", "no-such-bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode != 0
    assert "no benchmark 'no-such-bench'" in run.stderr


def test_a_benchmark_whose_main_is_a_coroutine_really_runs() -> None:
    """bench/delay.py's main is `async def`: called as a plain function it returned a coroutine
    that nobody awaited, so `python -m bench delay` ran nothing and exited 0."""
    run = subprocess.run(
        [sys.executable, "-m", "bench", "delay", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "--steady-seconds" in run.stdout
