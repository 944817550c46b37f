#!/usr/bin/env bash
# Write requirements/lock.txt: the exact version of everything vramfit and all its extras need, read from an
# environment that passed the tests (the closure of pyproject.toml's dependencies through the installed
# packages' metadata; tools installed by hand are left out). scripts/setup.sh installs with it, so CI and
# every machine get the versions CI tested. torch is written without its local label (2.13.0, not
# 2.13.0+cpu): the same line gives the CPU build here and the CUDA build on a CUDA machine, whose nvidia-*
# packages torch's own metadata pins.
#   bash scripts/lock.sh            # rewrite the lock from .venv
#   bash scripts/lock.sh --check    # exit 1 when the lock and the environment differ (a test runs this)
#   PYTHON=/path/to/python bash scripts/lock.sh   # read another environment
# To move to newer versions: VRAMFIT_LOCK=none bash scripts/setup.sh, run the tests, then this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOCK=requirements/lock.txt
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$PY" - >"$tmp" <<'PYEOF'
import importlib.metadata as md
import platform
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
top = [Requirement(r) for r in project["dependencies"]]
GPU_ONLY = {"kernels"}  # Triton kernels: installable only with CUDA, so neither locked nor checked here
TRACKERS = {"wandb", "mlflow"}  # optional trackers, the user's choice of version: not locked either
PARITY = {"parity"}  # TRL, installed by hand for the preference-loss parity tests: not locked
for extra, reqs in project.get("optional-dependencies", {}).items():
    if extra not in GPU_ONLY | TRACKERS | PARITY:
        top += [Requirement(r) for r in reqs]

pins, missing = {}, []
todo = [(r, str(r.marker) if r.marker else "") for r in top]  # a marker in pyproject travels to the pin
while todo:
    req, marker = todo.pop()
    if req.marker and not req.marker.evaluate({"extra": ""}) and not marker:
        continue
    key = canonicalize_name(req.name)
    if key in pins:
        continue
    try:
        dist = md.distribution(req.name)
    except md.PackageNotFoundError:
        missing.append(req.name)
        continue
    pins[key] = (dist.metadata["Name"], dist.version.split("+")[0], marker)
    for sub in (Requirement(s) for s in dist.requires or []):
        extras = [""] + sorted(req.extras)
        if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
            todo.append((sub, ""))
if missing:
    sys.exit(f"lock: not installed here: {', '.join(sorted(set(missing)))}; install every extra first "
             "(EXTRAS=deepspeed,quant,test bash scripts/setup.sh)")
bad = sorted(n for n in pins if n.startswith("nvidia-") or n == "triton")
if bad:
    sys.exit(f"lock: CUDA packages in the environment ({', '.join(bad)}): write the lock from the CPU build of torch")
print("# The versions CI tested, written by scripts/lock.sh from the environment the tests passed in")
print(f"# (Python {platform.python_version_tuple()[0]}.{platform.python_version_tuple()[1]}, "
      f"{platform.machine()} {platform.system()}). scripts/setup.sh and the Dockerfile install with it:")
print("#   pip install -c requirements/lock.txt -e '.[deepspeed,quant,test]'")
print("# A constraints file: only what vramfit needs is installed from it, at these versions.")
for key in sorted(pins):
    name, version, marker = pins[key]
    print(f"{name}=={version}" + (f" ; {marker}" if marker else ""))
PYEOF
if [ "${1:-}" = "--check" ]; then
  if ! diff -u "$LOCK" "$tmp"; then
    echo "lock: $LOCK differs from $PY's environment (above: - lock, + environment);" \
         "install with the lock (bash scripts/setup.sh) or rewrite it (bash scripts/lock.sh)" >&2
    exit 1
  fi
  exit 0
fi
cp "$tmp" "$LOCK"
echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") pins) from $PY"
