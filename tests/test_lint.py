"""The house's shape, checked: import layering (import-linter's contracts in pyproject.toml: imports go down,
the engines are independent, the planner imports no engine, loop or logging) and ruff's rules (print() only
in the CLI and scripts, among others)."""

import os
import subprocess
import sys

from helpers import ROOT

BIN = os.path.dirname(sys.executable)


def test_import_layers_hold():
    r = subprocess.run([os.path.join(BIN, "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_ruff_is_clean():
    r = subprocess.run([os.path.join(BIN, "ruff"), "check", "launcher", "tests", "scripts"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_no_function_of_the_loop_or_engines_is_longer_than_a_screenful_and_a_half():
    """The loop reads as prepare -> fit -> finish; a function past ~130 lines is a sign of two ideas in one."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "launcher"
    long = []
    for folder in ("training", "engines"):
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 130:
                        long.append(f"{path.relative_to(root)}:{node.name} ({lines} lines)")
    assert not long, long


def _functions(path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_planner_function_is_longer_than_80_lines():
    """The cost model reads as sums over the engine families' answers (launcher/plan/families/): a planner function
    past 80 lines holds a second idea that wants its own name."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "launcher"
    long = [f"{path.relative_to(root)}:{name} ({n} lines)" for path in sorted((root / "plan").rglob("*.py"))
            for name, n in _functions(path) if n > 80]
    assert not long, long


def test_no_module_is_longer_than_600_lines():
    """One idea per file: a module past 600 lines has split along a seam before (the schema from its loading and
    checks, the trace from the meta emulation and the dispatch tracker, the planner's rows, settings and search)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "launcher"
    long = [f"{path.relative_to(root)} ({n} lines)" for path in sorted(root.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 600]
    assert not long, long
