#!/usr/bin/env bash
# The host side of the plans that showed the host gap: 7B LoRA on a T4's budget, Qwen2.5-14B LoRA on an RTX 3090 box
# with 32 GB of RAM, and 7B LoRA on 1, 2 and 4 cards of each kind with this machine's RAM. Each plan's table (with
# its host phases and pinned bytes) goes to OUT/NAME.txt. NAMEs after OUT: only those plans (each takes seconds to
# tens of seconds; one is a quick check that the script still runs).
#     bash scripts/host_plans.sh bench/results/DATE-MACHINE/host-plans
#     bash scripts/host_plans.sh /tmp/hp llama-7b-t4       # one plan
set -euo pipefail
out=${1:?usage: scripts/host_plans.sh OUT [NAME...]}
shift
only=" $* "
for name in "$@"; do  # a misspelt name would otherwise plan nothing and say nothing
  case $name in llama-7b-t4|qwen2.5-14b-3090-32gb|llama-7b-compare-gpus) ;;
    *) echo "host_plans: no plan named $name (llama-7b-t4, qwen2.5-14b-3090-32gb, llama-7b-compare-gpus)" >&2; exit 2;;
  esac
done
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-python}
plan() {
  name=$1; shift
  [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 0
  echo "\$ vramfit plan $*" > "$out/$name.txt"; "$py" -m launcher plan "$@" 2>/dev/null >> "$out/$name.txt"
}
plan llama-7b-t4 --gpu T4 model.name=llama-7b lora.r=16 data.seq_len=2048 precision=fp16 memory.gpu_budget=14.75 \
    train.global_batch_size=4 memory.cpu_budget=32
plan qwen2.5-14b-3090-32gb --gpu RTX3090 model.name=examples/configs/qwen2.5-14b lora.r=16 data.seq_len=2048 \
    train.global_batch_size=16 memory.cpu_budget=32
plan llama-7b-compare-gpus model.name=llama-7b lora.r=16 data.seq_len=2048 --compare-gpus --gpus 1,2,4
echo "wrote $out"
