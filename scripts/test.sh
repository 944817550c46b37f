#!/usr/bin/env bash
# Set up from nothing, then run the test suite (GPU tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
