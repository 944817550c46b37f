#!/usr/bin/env python
"""Plans a user would make before renting a card: current models (examples/configs/: their published configs,
no weights) with LoRA and QLoRA on the cards people rent, through ``vramfit plan --gpu NAME --json``.

    python scripts/big_model_plans.py --out bench/results/DATE-MACHINE/big-plans    # writes plans.md and one JSON each
    python scripts/big_model_plans.py --out /tmp/bp --models llama-3.1-8b --gpus T4 --methods lora   # one plan

Every plan is priced with this machine's calibration as the host (``vramfit doctor --calibrate``) and the card's
data sheet; ``memory.cpu_budget`` is the host RAM stated below, since the card's box is not this one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("qwen3-30b-a3b", "gpt-oss-20b", "gemma-3-12b", "qwen2.5-14b", "llama-3.1-8b")
GPUS = ("RTX3090", "T4", "L4")
METHODS = {"LoRA r16": ["lora.r=16"], "QLoRA r16": ["lora.r=16", "model.quantize=4bit"]}
KEYS = tuple(name.split()[0].lower() for name in METHODS)  # --methods: lora, qlora (also the JSON files' suffix)
COMMON = ["data.seq_len=2048", "train.global_batch_size=16", "memory.cpu_budget=64"]


def plan(model: str, gpu: str, method: list[str]) -> tuple[dict | None, str, float]:
    args = [sys.executable, "-m", "launcher", "plan", "--gpu", gpu, f"model.name={os.path.join(ROOT, 'examples', 'configs', model)}",
            *COMMON, *method, "--json"]
    t = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.perf_counter() - t
    try:
        return json.loads(p.stdout), " ".join(args[3:]), seconds
    except json.JSONDecodeError:
        return None, (p.stderr.strip().splitlines() or ["no output"])[-1], seconds


def row(model: str, gpu: str, name: str, doc: dict | None, why: str) -> str:
    if doc is None:
        return f"| {model} | {gpu} | {name} | refused | | | | {why} |"
    chosen = next((r for r in doc["profiles"] if r["profile"] == doc["chosen"]), None)
    if chosen is None:
        tips = "; ".join(doc.get("suggestions") or []) or doc["reason"]
        return f"| {model} | {gpu} | {name} | nothing fits | | | | {tips} |"
    gib = 2 ** 30
    tps = f"{chosen['tokens_per_s']:.0f}" if chosen.get("tokens_per_s") else "-"
    setting = f"micro-batch {chosen['micro_batch']}, checkpointing {'on' if chosen['checkpointing'] else 'off'}"
    return (f"| {model} | {gpu} | {name} | {doc['chosen']} ({setting}) | {chosen['gpu_bytes'] / gib:.1f} | "
            f"{chosen['cpu_bytes'] / gib:.1f} | {tps} | {doc['reason'].split(': ', 1)[0]} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    # subsets of the grid (default: all of it, 30 plans of seconds each); one plan is a check that the script runs
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    ap.add_argument("--gpus", default=",".join(GPUS), help="comma-separated, of: " + ", ".join(GPUS))
    ap.add_argument("--methods", default=",".join(KEYS), help="comma-separated, of: " + ", ".join(KEYS))
    a = ap.parse_args()
    models, gpus, methods = a.models.split(","), a.gpus.split(","), a.methods.split(",")
    for flag, got, known in (("--models", models, MODELS), ("--gpus", gpus, GPUS), ("--methods", methods, KEYS)):
        if set(got) - set(known):
            ap.error(f"{flag}: got {sorted(set(got) - set(known))}; rule: of {', '.join(known)}")
    os.makedirs(a.out, exist_ok=True)
    lines = [f"Common settings: `{' '.join(COMMON)}`.", "",
             "| model | card | method | chosen | GPU GiB | CPU GiB | tokens/s | why |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for model in (m for m in MODELS if m in models):
        for gpu in (g for g in GPUS if g in gpus):
            for name, method in METHODS.items():
                if name.split()[0].lower() not in methods:
                    continue
                doc, how, seconds = plan(model, gpu, method)
                with open(os.path.join(a.out, f"{model}-{gpu}-{name.split()[0].lower()}.json"), "w") as f:
                    json.dump({"command": how, "seconds": round(seconds, 1), "plan": doc}, f, indent=1)
                lines.append(row(model, gpu, name, doc, how))
                print(lines[-1], flush=True)
    with open(os.path.join(a.out, "plans.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
