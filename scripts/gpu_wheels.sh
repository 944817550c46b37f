#!/usr/bin/env bash
# Wheels for an offline GPU host, into .whl/ (what scripts/gpu_bench.sh installs first): the shared wheelhouse
# (omegaconf, datasets, DeepSpeed and theirs; ../shared/offline-gpu/wheelhouse.sh, when it is there) and the
# packages vramfit imports that such a host lacks although it has torch, transformers, peft and accelerate:
#   - DeepSpeed's own imports: einops and msgpack at `import deepspeed` (without them DeepSpeed fails to import,
#     so vramfit treats it as absent and no ZeRO profile runs), py-cpuinfo when it loads an op;
#   - TensorBoard's writer (log.report_to's default tracker): tensorboard, protobuf, absl-py;
#   - datasets' xxhash (real data sources), and pytest with its own (the GPU tests stage).
# Versions are the lock's (requirements/lock.txt), for CPython 3.12 on x86-64 Linux.
#
#   bash scripts/gpu_wheels.sh            # then carry .whl to the host and run scripts/gpu_bench.sh there
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -f ../shared/offline-gpu/wheelhouse.sh ]; then
  PYTHON=$PY bash ../shared/offline-gpu/wheelhouse.sh >/dev/null
else
  mkdir -p .whl
fi
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps "${plat[@]}" -c requirements/lock.txt -d .whl \
  einops msgpack py-cpuinfo tensorboard protobuf absl-py xxhash pytest pluggy iniconfig pygments
ls .whl
du -sh .whl
