#!/usr/bin/env bash
# Set up from nothing, then train the built-in demo (GPU if there is one, else CPU).
#   VRAMFIT_SETUP=skip   train with .venv as it is: no set-up, so no package index is asked and .venv is left alone
#                        (scripts/setup.sh reinstalls vramfit into it even when everything is there)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${VRAMFIT_SETUP:-}" = skip ] || EXTRAS=${EXTRAS:-deepspeed} bash scripts/setup.sh
.venv/bin/vramfit train "$@"
