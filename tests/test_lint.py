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
