#!/usr/bin/env bash
# Set up from nothing: a virtual environment in .venv, torch, vramfit with its extras, and DeepSpeed's
# JIT-compiled ops built once (a few minutes the first time, cached in .venv/var/torch_extensions).
# Every version comes from requirements/lock.txt, the versions CI tested (scripts/lock.sh writes it).
#   EXTRAS        which extras to install (default: deepspeed,quant,test)
#   PYTHON        the interpreter that makes the venv (default: python3; 3.11 or 3.12)
#   VENV          where the venv goes (default: .venv)
#   VRAMFIT_LOCK  the constraints file (default: requirements/lock.txt); `none` installs the newest versions
#                 pyproject.toml allows instead (to try an upgrade, then rerun the tests and scripts/lock.sh);
#                 requirements/floors.txt gives the oldest allowed (scripts/test_floors.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-deepspeed,quant,test}
VENV=${VENV:-.venv}
LOCK=${VRAMFIT_LOCK:-requirements/lock.txt}
[ "$LOCK" = none ] || [ -f "$LOCK" ] || { echo "setup: VRAMFIT_LOCK=$LOCK: no such file (or none)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
[ -e "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"  # git ignores the venv wherever it is (as Python 3.13's venv does)
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, at the lock's pin even with VRAMFIT_LOCK=none: the same pin gives the CPU build here and the
# CUDA build on a CUDA machine, and any other version is a multi-GB download that DeepSpeed's ops must match.
TORCH_PINS=$LOCK
[ "$LOCK" != none ] || TORCH_PINS=requirements/lock.txt
"$VENV/bin/python" -m pip install -q -c "$TORCH_PINS" torch
if [ "$LOCK" = none ]; then
  pins=$(mktemp)
  grep '^torch==' requirements/lock.txt > "$pins"
  "$VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -c "$pins" -e ".[${EXTRAS}]"
  rm -f "$pins"
else
  # pip moves anything already installed to the pinned version, so an old venv ends up like a new one; the
  # build constraint (pip >= 25.3, upgraded above) holds the setuptools that builds vramfit and DeepSpeed at
  # the lock's version too
  "$VENV/bin/python" -m pip install -q -c "$LOCK" --build-constraint "$LOCK" -e ".[${EXTRAS}]"
fi
echo "$LOCK" > "$VENV/vramfit-lock"  # what the tests compare the environment with (tests/test_install.py)
# NVMe offload (ZeRO-Infinity) needs libaio for DeepSpeed's async_io op: installed when we can (root with apt),
# never a reason to fail set-up (`vramfit doctor` says when async_io cannot build)
if [[ ",${EXTRAS}," == *",deepspeed,"* ]] && [ ! -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libaio-dev (NVMe offload)"; apt-get install -y -q libaio-dev >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libaio-dev >/dev/null 2>&1; } ||
      echo "setup: libaio-dev did not install; NVMe offload profiles stay off (vramfit doctor)"
  else echo "setup: no libaio (not root with apt): NVMe offload profiles stay off; apt-get install libaio-dev"; fi
fi
if [[ ",${EXTRAS}," == *",deepspeed,"* ]]; then "$VENV/bin/vramfit" doctor --build-ops; fi
