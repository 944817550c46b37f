#!/usr/bin/env bash
# The benchmark set for a GPU host, in under 8 minutes, ordered by what it answers (issue 43: where does offload
# pay?), each measurement beside the planner's prediction (bytes, step time where the host is calibrated):
#  same_mb    llama-1b, seq 512, micro-batch 8, on the whole card: no offload (amp) against the two optimizer
#             offloads (torch's amp-*-offload-opt and ZeRO-2's), tokens/s as ratios to no offload;
#  card       llama-125m on the whole card: amp, its optimizer offload, ZeRO-2 and ZeRO-2's offload;
#  find_mb    llama-350m under a 16 GB cap: each of those at its largest micro-batch (a global batch of 64, so the
#             search is not capped by it), and equal_mb: the offloads at no offload's largest micro-batch;
#  find_model the largest model preset that trains under a 16 GB cap, per profile;
#  card_24gb  a 1B full fine-tune under an RTX 3090's 24 GB; lora_16gb / qlora_16gb: llama-1b LoRA and QLoRA
#             under 16 GB;
#  then the step-time validation, the GPU tests, the memory planner's validation and the monitor's cost.
# Everything goes to one folder ($OUT, else bench-out/gpu-DATE); a short table is printed last.
#
#   bash scripts/gpu_wheels.sh                # first, where packages can be downloaded: .whl/ for an offline host
#   bash scripts/gpu_bench.sh                 # on the GPU host
#   bash scripts/gpu_bench.sh --cpu-smoke     # or DEVICE=cpu: the same stages, shrunk, on a CPU (proves the script)
#   STAGES="find_mb find_model" bash scripts/gpu_bench.sh   # a subset (names below); TOTAL_S=470: the time box
#   STAGES="doctor ops steptime" bash scripts/gpu_bench.sh  # the step-time validation alone
#
# Every stage runs under `timeout`, and a deadline for the whole script (TOTAL_S, default 470 s) shortens
# or skips the later stages, so a hung stage cannot eat the budget; `vramfit bench` rewrites its results
# after every run, so a stage cut short keeps what it measured. Budgets are the cards' usable memory as
# torch reports it (T4 14.75 GiB, RTX 3090 23.69 GiB), through memory.gpu_budget (the run's allocator is
# capped at that). Stages are ordered by priority: what does not fit in the time box is reported skipped.
cd "$(dirname "$0")/.." || exit
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # the offline host's wheelhouse (../shared/offline-gpu/wheelhouse.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD || exit
fi
set -uo pipefail  # not -e: a stage that fails is recorded and the next one runs

SMOKE=0
[ "${DEVICE:-}" = "cpu" ] && SMOKE=1
for a in "$@"; do
  case "$a" in
    --cpu-smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "gpu_bench: unknown argument $a (try --help)"; exit 2 ;;
  esac
done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -d .whl ]; then PY=python3
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STAMP=$(date +%Y%m%d-%H%M%S)
if [ "$SMOKE" = 1 ]; then OUT=${OUT:-bench-out/cpu-smoke-$STAMP}; else OUT=${OUT:-bench-out/gpu-$STAMP}; fi
mkdir -p "$OUT"
# the time box; a CPU smoke run on a small shared box is slower, so its stage caps stretch (CAPX)
if [ "$SMOKE" = 1 ]; then TOTAL_S=${TOTAL_S:-1500}; CAPX=${CAPX:-3}; else TOTAL_S=${TOTAL_S:-470}; CAPX=${CAPX:-1}; fi
STAGES=${STAGES:-"doctor ops same_mb card find_mb equal_mb find_model card_24gb lora_16gb qlora_16gb steptime tests validate monitor"}
DEADLINE=$TOTAL_S  # bash's SECONDS counts from the script's start: the wheel install above is inside the box
RESERVE=15  # seconds kept for the final table
printf 'stage\tstatus\tseconds\tcap\n' > "$OUT/stages.tsv"

if [ "$SMOKE" = 1 ]; then
  # the same stages on a CPU: tiny model, short sequences; fp32 no-offload and ZeRO-2 profiles, the bf16 torch
  # offload profile (asked by name: on a CPU it offloads nothing); memory.cpu_budget stands in for the GPU caps
  # (bench compares the measured RSS with it)
  PREC=fp32
  NOOFF=amp-fp32; OFF=amp-bf16-offload-opt; ZERO=zero2-fp32; ZOFF=zero2-fp32; FULL=zero2-fp32
  MODEL_A=tiny; MODEL_24=tiny; MODEL_SAME=tiny; SEQ=32; GB_A=4; MB_EQ=2; MB_SAME=2; GB_SAME=4
  FIND_MB_CANDIDATES=1,2,4
  CAP16=memory.cpu_budget=1.5; CAP24=memory.cpu_budget=3
  MODELS_B=tiny,llama-125m; PROFILES_B=$NOOFF,$OFF
  STEPS="--steps 2 --warmup 1"; SMALL="data.num_samples=64 train.warmup_steps=1"
  TESTS_ARGS="-m gpu"; VALIDATE_ARGS="--cpu --quick"; RUN_TIMEOUT=240
  STEPTIME_ARGS="--quick --steps 2 --warmup 1 --timeout $RUN_TIMEOUT"  # without a CUDA device: a line saying so
  QLORA=""  # bitsandbytes' 4-bit kernels are the GPU's
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # a shared 2-core box: no thread oversubscription
else
  PREC=$($PY -c 'import torch; print("bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp16")' 2>/dev/null) \
    || { echo "gpu_bench: no CUDA GPU here (torch.cuda); use --cpu-smoke"; exit 2; }
  NOOFF=amp-$PREC; OFF=amp-$PREC-offload-opt; ZERO=zero2-$PREC; ZOFF=zero2-$PREC-offload-opt; FULL=zero3-$PREC-offload-all
  MODEL_A=llama-350m; MODEL_24=llama-1b; MODEL_SAME=llama-1b; SEQ=512; GB_A=64; MB_EQ=""; MB_SAME=8; GB_SAME=16
  FIND_MB_CANDIDATES=4,8,16,32,64  # up to the global batch: the search is not capped by it below 64
  CAP16=memory.gpu_budget=14.75; CAP24=memory.gpu_budget=23.69
  MODELS_B=llama-350m,llama-1b,llama-3b,llama-7b; PROFILES_B=$OFF,$ZOFF,$NOOFF,$FULL
  STEPS="--steps 3 --warmup 2"; SMALL="data.num_samples=256 train.warmup_steps=1"
  TESTS_ARGS="-m gpu"; VALIDATE_ARGS="--models llama-125m --profiles amp-$PREC,$OFF,$ZOFF --micro-batches 4 --seq-lens 512 --checkpointing off --steps 3 --timeout 60 checkpoint.save=false"
  RUN_TIMEOUT=120
  STEPTIME_ARGS="--steps 4 --warmup 2 --timeout $RUN_TIMEOUT"
  QLORA="model.quantize=4bit"
fi
CARD_PROFILES="--profiles=$NOOFF,$OFF,$ZERO"
[ "$ZOFF" = "$ZERO" ] || CARD_PROFILES="$CARD_PROFILES,$ZOFF"  # (the CPU smoke has one ZeRO-2 profile for both)
echo "gpu_bench: $([ "$SMOKE" = 1 ] && echo 'CPU smoke' || echo GPU) run, precision $PREC, python $PY, output $OUT, time box ${TOTAL_S}s"

want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# stage NAME CAP_SECONDS COMMAND...: run under timeout (capped by the deadline), log to OUT/NAME.log
stage() {
  local name=$1 cap=$(($2 * CAPX)); shift 2
  want "$name" || return 0
  local left=$((DEADLINE - SECONDS - RESERVE - 15))  # timeout -k 15 may take 15 s more than the cap
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 20 ]; then
    printf '%s\tskipped (time box)\t0\t%s\n' "$name" "$cap" >> "$OUT/stages.tsv"
    echo "== $name: skipped, the time box is spent"; return 0
  fi
  echo "== $name (at most ${cap}s): $*"
  local t0=$SECONDS rc
  timeout -k 15 "$cap" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local st=ok
  if [ $rc = 124 ] || [ $rc = 137 ]; then st="timeout"; elif [ $rc != 0 ]; then st="exit $rc"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$st" "$((SECONDS - t0))" "$cap" >> "$OUT/stages.tsv"
  echo "   $st in $((SECONDS - t0))s; last lines:"; tail -n 4 "$OUT/$name.log" | sed 's/^/   | /'
}

VF="$PY -m launcher"
# what this host lacks of vramfit's imports (an offline host needs them in .whl/: scripts/gpu_wheels.sh)
MISSING='import importlib.util as u; m = [n for n in ("deepspeed", "einops", "msgpack", "cpuinfo", "tensorboard",
"omegaconf", "datasets", "xxhash", "pytest", "matplotlib", "bitsandbytes") if u.find_spec(n) is None];
print("missing modules:", ", ".join(m) or "none"); import transformers; print("transformers", transformers.__version__)'
stage doctor 45 bash -c "$PY -c '$MISSING' && $VF doctor && $VF doctor --json > '$OUT/doctor.json'"
# DeepSpeed's ops, once and time-boxed before timing anything (the catalogue's ZeRO profiles step torch's AdamW, so
# a build cut short here costs a ZeRO run its first seconds, not a result)
stage ops 60 $VF doctor --build-ops
# the headline: the same setting with and without offload, on the whole card (no cap: every profile fits)
stage same_mb 150 $VF bench model.name=$MODEL_SAME data.seq_len=$SEQ train.micro_batch_size=$MB_SAME \
  train.global_batch_size=$GB_SAME $SMALL --profiles $NOOFF,$OFF,$ZOFF $STEPS --timeout $RUN_TIMEOUT --out "$OUT/same_mb"
# the real card, no offload and the two optimizer offloads, with ZeRO-2 beside AMP
if [ "$SMOKE" = 1 ]; then CARD_MODEL="model.name=tiny data.seq_len=$SEQ train.micro_batch_size=2 train.global_batch_size=4"
else CARD_MODEL="model.name=llama-125m data.seq_len=512 train.micro_batch_size=8 train.global_batch_size=16"; fi
stage card 120 $VF bench $CARD_MODEL $SMALL $CARD_PROFILES $STEPS --timeout $RUN_TIMEOUT --out "$OUT/card"
# (a) offload vs not, each at its largest micro-batch, under the 16 GB cap
stage find_mb 150 $VF bench model.name=$MODEL_A data.seq_len=$SEQ train.micro_batch_size=1 \
  train.global_batch_size=$GB_A $SMALL $CAP16 --profiles $NOOFF,$OFF,$ZOFF --find micro-batch \
  --candidates $FIND_MB_CANDIDATES $STEPS --timeout $RUN_TIMEOUT --out "$OUT/find_mb_16gb"
# ... and at the same micro-batch: the no-offload profile's largest
if want equal_mb; then
  MB=$($PY scripts/gpu_bench_report.py best-micro-batch "$OUT/find_mb_16gb/results.json" "$NOOFF" 2>/dev/null)
  MB=${MB:-$MB_EQ}
  if [ -n "$MB" ]; then
    stage equal_mb 60 $VF bench model.name=$MODEL_A data.seq_len=$SEQ train.micro_batch_size=$MB \
      train.global_batch_size=$GB_A $SMALL $CAP16 --profiles $OFF,$ZOFF $STEPS --timeout $RUN_TIMEOUT --out "$OUT/equal_mb_16gb"
  else
    printf 'equal_mb\tskipped (no micro-batch fits without offload)\t0\t0\n' >> "$OUT/stages.tsv"
  fi
fi
# (b) the largest model that trains under the 16 GB cap, per profile
stage find_model 170 $VF bench data.seq_len=$SEQ train.micro_batch_size=1 train.global_batch_size=1 $SMALL $CAP16 \
  --profiles $PROFILES_B --find model --candidates $MODELS_B $STEPS --timeout $RUN_TIMEOUT --out "$OUT/find_model_16gb"
# the 3090 stand-in: offload or not for a 1B full fine-tune at a fixed micro-batch
stage card_24gb 90 $VF bench model.name=$MODEL_24 data.seq_len=$SEQ train.micro_batch_size=4 train.global_batch_size=8 \
  $SMALL $CAP24 --profiles $NOOFF,$OFF,$ZOFF $STEPS --timeout $RUN_TIMEOUT --out "$OUT/card_24gb"
# LoRA and QLoRA of a 1B model under the 16 GB cap (the torch path: the adapters' optimizer is small, nothing offloads)
stage lora_16gb 60 $VF bench model.name=$MODEL_24 data.seq_len=$SEQ train.micro_batch_size=4 train.global_batch_size=8 \
  lora.r=16 $SMALL $CAP16 --profiles $NOOFF $STEPS --timeout $RUN_TIMEOUT --out "$OUT/lora_16gb"
if [ -n "$QLORA" ]; then
  stage qlora_16gb 60 $VF bench model.name=$MODEL_24 data.seq_len=$SEQ train.micro_batch_size=4 \
    train.global_batch_size=8 lora.r=16 $QLORA $SMALL $CAP16 --profiles $NOOFF $STEPS --timeout $RUN_TIMEOUT \
    --out "$OUT/qlora_16gb"
fi
# the step-time model against measured steps: scripts/validate_steptime.py's GPU grid (7 points, seq 512, llama-125m
# to llama-1b, amp / zero2 / zero2 offload-opt / fsdp offload, checkpointing off, every 2nd layer and all; on the card
# and at the caps above; DeepSpeed points skipped with the reason when it does not import), cheapest first and its
# results rewritten after every point, so a stage cut short keeps what it measured. It calibrates this host first
# (about a minute) into a cache of its own, so the stages after it run as before, unpriced; the calibration is kept
# in OUT/steptime/calibration.json. Without a CUDA device it runs nothing and says why.
ST_CACHE=$(mktemp -d "${TMPDIR:-/tmp}/vramfit-steptime.XXXXXX")
stage steptime 200 env VRAMFIT_CACHE="$ST_CACHE" $PY scripts/validate_steptime.py --gpu --out "$OUT/steptime" $STEPTIME_ARGS
rm -rf "$ST_CACHE"
stage tests 90 $PY -m pytest -q $TESTS_ARGS tests -p no:cacheprovider --basetemp="$OUT/pytest-tmp"
# the memory planner against real peaks
stage validate 90 $PY scripts/validate_planner.py --out "$OUT/validate_planner" $VALIDATE_ARGS
# what the memory monitor costs on this device
if [ "$SMOKE" = 1 ]; then MON="--repeats 1 --steps 6 --warmup 2 data.seq_len=32 train.micro_batch_size=2 train.global_batch_size=4"
else MON="--repeats 2 --steps 30 --warmup 5 model.name=llama-125m data.seq_len=512 train.micro_batch_size=4 train.global_batch_size=8 profile=amp-$PREC"; fi
stage monitor 90 $PY scripts/bench_monitor.py --out "$OUT/monitor" $MON

# ---- the short table, last
$PY scripts/gpu_bench_report.py summary "$OUT" "$NOOFF" "$OFF" "$ZOFF"
if want steptime; then  # its one line (OUT/steptime/summary.txt), also into OUT/summary.md
  if [ -s "$OUT/steptime/summary.txt" ]; then ST_LINE=$(cat "$OUT/steptime/summary.txt")
  else ST_LINE="step time, predicted vs measured: no result (stage steptime: $(awk -F'\t' '$1 == "steptime" {print $2}' "$OUT/stages.tsv"))"; fi
  printf '\n%s\n' "$ST_LINE" | tee -a "$OUT/summary.md"
fi
echo "gpu_bench: done in ${SECONDS}s; everything is in $OUT"
