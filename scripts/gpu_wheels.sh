#!/usr/bin/env bash
# Wheels for an offline GPU host, into .whl/ (what scripts/gpu_bench.sh installs first): the shared wheelhouse
# (omegaconf, datasets, DeepSpeed and theirs; ../shared/offline-gpu/wheelhouse.sh, when it is there) and the
# packages vramfit imports that such a host lacks although it has torch, transformers, peft and accelerate:
#   - DeepSpeed's own imports: einops and msgpack at `import deepspeed` (without them DeepSpeed fails to import,
#     so vramfit treats it as absent and no ZeRO profile runs), py-cpuinfo when it loads an op;
#   - TensorBoard's writer (log.report_to's default tracker): tensorboard, protobuf, absl-py;
#   - datasets' xxhash (real data sources), and pytest with its own (the GPU tests stage).
# Versions are the lock's (requirements/lock.txt), for CPython 3.12 on x86-64 Linux. It needs the package index
# (the shared wheelhouse builds DeepSpeed's wheel from its source archive too); --dry-run needs neither.
#
#   bash scripts/gpu_wheels.sh            # then carry .whl to the host and run scripts/gpu_bench.sh there
#   bash scripts/gpu_wheels.sh --dry-run  # print what it would fetch, at the lock's pins; download and write nothing
#                                         # (exit 1 when a package has no pin in the lock)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(einops msgpack py-cpuinfo tensorboard protobuf absl-py xxhash pytest pluggy iniconfig pygments)
if [ "${1:-}" = "--dry-run" ]; then
  # the lock alone says what would come: no index is asked, so this runs offline
  if [ -f ../shared/offline-gpu/wheelhouse.sh ]; then
    echo "would run: PYTHON=$PY bash ../shared/offline-gpu/wheelhouse.sh  (the shared wheelhouse, into .whl)"
  else
    echo "no ../shared/offline-gpu/wheelhouse.sh: only the wheels below would be fetched"
  fi
  echo "would run: $PY -m pip download -q --no-deps ${plat[*]} -c requirements/lock.txt -d .whl ${pkgs[*]}"
  unpinned=()
  for p in "${pkgs[@]}"; do
    # a lock line spells the name as the package does (Pygments, py_cpuinfo or py-cpuinfo): matched as pip would
    pin=$(grep -i -m1 -E "^${p//-/[-_.]}==" requirements/lock.txt || true)
    if [ -n "$pin" ]; then echo "  ${pin%% *}"; else echo "  $p: NOT in requirements/lock.txt"; unpinned+=("$p"); fi
  done
  if [ ${#unpinned[@]} -gt 0 ]; then
    echo "gpu_wheels: no pin for ${unpinned[*]} in requirements/lock.txt: a download would take the newest" >&2
    exit 1
  fi
  exit 0
fi
if [ -f ../shared/offline-gpu/wheelhouse.sh ]; then
  PYTHON=$PY bash ../shared/offline-gpu/wheelhouse.sh >/dev/null
else
  mkdir -p .whl
fi
"$PY" -m pip download -q --no-deps "${plat[@]}" -c requirements/lock.txt -d .whl "${pkgs[@]}"
ls .whl
du -sh .whl
