#!/usr/bin/env python
"""The planner against published single-GPU fine-tuning measurements whose settings are fully stated.

    python scripts/published_plans.py --out bench/results/DATE-published

Each row of :data:`ROWS` is a measurement someone else published (the source, the quoted number, every setting
it states); the script plans the same settings for the same card of the catalogue with ``vramfit plan --gpu``
(the profile nearest to what the source ran, the micro-batch and checkpointing fixed to the source's) and writes
``published.json`` and ``published.md``: published against planned, and the error. Nothing here corrects the
planner: the table is evidence, read in the folder's README.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LITGPT = "https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md"
LITGPT_SETUP = ("LitGPT resource tables (last updated 10/20/2023, LitGPT commit 8641822): NVIDIA A100-SXM4-40GB, "
                "PyTorch 2.1.0+cu121, bitsandbytes 0.41.1, --precision bf16-true, finetune/lora.py, Alpaca at its "
                "default length (longest training example: Llama 2 1304 tokens, phi-1.5 1044), minibatch 128")

# phi-1.5's published sizes (microsoft/phi-1_5 config.json): its LoRA on q and v at r=8 gives the 1,572,864
# trainable parameters the table states, as Llama 2 7B's and 13B's give 4,194,304 and 6,553,600.
PHI_15 = {"architectures": ["PhiForCausalLM"], "model_type": "phi", "vocab_size": 51200, "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
          "partial_rotary_factor": 0.5, "max_position_embeddings": 2048, "hidden_act": "gelu_new",
          "layer_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16"}

# (model label, model.name, quantize, micro-batch, seq_len, published max GPU RAM in GB, trainable parameters stated)
ROWS = [
    ("Llama 2 7B", "llama-7b", "none", 1, 1304, 21.30, 4_194_304),
    ("Llama 2 7B", "llama-7b", "4bit", 1, 1304, 14.14, 4_194_304),
    ("Llama 2 7B", "llama-7b", "none", 2, 1304, 29.07, 4_194_304),
    ("Llama 2 13B", "llama-13b", "none", 1, 1304, 38.12, 6_553_600),
    ("Llama 2 13B", "llama-13b", "4bit", 1, 1304, 23.14, 6_553_600),
    ("phi-1.5", "configs/phi-1_5", "none", 1, 1044, 4.82, 1_572_864),
    ("phi-1.5", "configs/phi-1_5", "4bit", 1, 1044, 3.78, 1_572_864),
    ("phi-1.5", "configs/phi-1_5", "none", 2, 1044, 6.76, 1_572_864),
    ("phi-1.5", "configs/phi-1_5", "none", 4, 1044, 10.68, 1_572_864),
]
GPU = "A100-40GB-SXM"


def nearest_profile(quantize: str) -> str:
    """``--precision bf16-true`` keeps weights and activations in bf16 with no autocast: DeepSpeed's bf16 path
    does the same (the module cast to bf16); a 4-bit base runs on the AMP path only (autocast to bf16 over a
    bf16 base, as the source's 4-bit layers compute)."""
    return "amp-bf16" if quantize != "none" else "zero2-bf16"


def overrides(model: str, quantize: str, micro: int, seq: int, out: str, profile: str) -> list[str]:
    name = os.path.join(out, model) if model.startswith("configs/") else model
    return [f"model.name={name}", f"profile={profile}", "lora.r=8", "lora.alpha=16", "lora.dropout=0.05",
            "lora.target_modules=[q_proj,v_proj]", f"model.quantize={quantize}", f"data.seq_len={seq}",
            f"train.micro_batch_size={micro}", "train.global_batch_size=128", "model.gradient_checkpointing=false",
            "loss.chunked=off", "memory.offload_activations=off", "memory.cpu_budget=64"]


def plan(args: list[str], profile: str) -> dict:
    cmd = [sys.executable, "-m", "launcher", "plan", "--gpu", GPU, *args, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    doc = json.loads(p.stdout)
    return next(r for r in doc["profiles"] if r["profile"] == profile) | {"model_counts": doc["model"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "configs", "phi-1_5"), exist_ok=True)
    with open(os.path.join(a.out, "configs", "phi-1_5", "config.json"), "w") as f:
        json.dump(PHI_15, f, indent=1)
    rows = []
    for label, model, quantize, micro, seq, published_gb, trainable in ROWS:
        t = time.perf_counter()
        profile = nearest_profile(quantize)
        args = overrides(model, quantize, micro, seq, a.out, profile)
        r = plan(args, profile)
        planned = r["gpu_tensor_bytes"] / 1e9
        amp = r if profile == "amp-bf16" else plan(overrides(model, quantize, micro, seq, a.out, "amp-bf16"), "amp-bf16")
        rows.append({"model": label, "quantize": {"none": "None", "4bit": "bnb.nf4"}[quantize], "micro_batch": micro,
                     "seq_len": seq, "gpu": GPU, "source": LITGPT, "setup": LITGPT_SETUP,
                     "published_trainable": trainable, "planned_trainable": r["model_counts"].get("trainable_params"),
                     "published_max_allocated_gb": published_gb, "planned_tensor_gb": round(planned, 2),
                     "profile": profile, "planned_total_gb": round(r["gpu_bytes"] / 1e9, 2),
                     "error": round(planned / published_gb - 1, 4),
                     "planned_amp_bf16_tensor_gb": round(amp["gpu_tensor_bytes"] / 1e9, 2),
                     "command": "vramfit plan --gpu " + GPU + " " + " ".join(x.replace(a.out + "/", "") for x in args),
                     "seconds": round(time.perf_counter() - t, 1)})
        print(f"{label} {quantize} mb{micro}: published {published_gb} GB, planned {planned:.2f} GB "
              f"({rows[-1]['error']:+.1%})", flush=True)
    errors = [abs(r["error"]) for r in rows]
    summary = {"rows": len(rows), "median_abs_error": round(statistics.median(errors), 4),
               "max_abs_error": round(max(errors), 4), "mean_error": round(statistics.mean(r["error"] for r in rows), 4)}
    with open(os.path.join(a.out, "published.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "summary": summary, "rows": rows}, f, indent=1)
    lines = ["| model | quantization | micro-batch | sequence | published max allocated GB | planned GB (profile) | "
             "error | planned on amp-bf16 GB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['quantize']} | {r['micro_batch']} | {r['seq_len']} | "
              f"{r['published_max_allocated_gb']:.2f} | {r['planned_tensor_gb']:.2f} ({r['profile']}) | {r['error']:+.1%} | "
              f"{r['planned_amp_bf16_tensor_gb']:.2f} |" for r in rows]
    with open(os.path.join(a.out, "published.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
