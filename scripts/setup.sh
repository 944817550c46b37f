#!/usr/bin/env bash
# Set up from nothing: a virtual environment in .venv, torch, vramfit with its extras, and DeepSpeed's
# JIT-compiled ops built once (a few minutes the first time, cached in .venv/var/torch_extensions).
#   EXTRAS   which extras to install (default: deepspeed,quant,test)
#   PYTHON   the interpreter that makes the venv (default: python3, 3.10 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-deepspeed,quant,test}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The same pin gives the CPU build here and the CUDA build on a CUDA machine; pyproject asks torch>=2.4.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",deepspeed,"* ]]; then .venv/bin/vramfit doctor --build-ops; fi
