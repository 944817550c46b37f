#!/usr/bin/env bash
# The floors job: a second environment (.venv-floors) with the oldest versions pyproject.toml allows
# (requirements/floors.txt) and the tests that reach every floored library: the config schema (omegaconf),
# the planner's meta-device traces (transformers' models and checkpointing, peft's LoRA), data files
# (datasets, tokenizers), the progress bar (tqdm), a results plot (matplotlib), an AMP run with a resume
# (psutil, numpy's RNG state), a LoRA fine-tune and export, and hadolint. No DeepSpeed and no bitsandbytes
# here: their floors are the lock's versions, which the main run tests. Measured on 2 shared cores: 4 minutes
# (2.5 minutes of CPU), a minute of it the installs.
#   bash scripts/test_floors.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-floors VRAMFIT_LOCK=requirements/floors.txt EXTRAS=test bash scripts/setup.sh
.venv-floors/bin/python -m pytest -q \
  tests/test_config.py tests/test_planner.py tests/test_data.py tests/test_install.py tests/test_dockerfile.py \
  tests/test_bench.py tests/test_monitor.py::test_progress_bar_when_on \
  tests/test_train.py::test_engine_fallback_without_deepspeed \
  "tests/test_reliability.py::test_sigterm_then_resume_matches_uninterrupted[amp-fp32-0.0]" "$@"
