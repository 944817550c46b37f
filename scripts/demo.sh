#!/usr/bin/env bash
# Set up from nothing, then train the built-in demo (GPU if there is one, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-deepspeed} bash scripts/setup.sh
.venv/bin/vramfit train "$@"
