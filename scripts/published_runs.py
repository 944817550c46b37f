#!/usr/bin/env python
"""GPU plans checked against published single-GPU fine-tuning measurements of other frameworks: each row of
ROWS is one measurement whose settings its source states (model, method, LoRA rank and targets, sequence length,
micro-batch, checkpointing, precision, which memory measure), planned here with ``vramfit plan --gpu NAME --json``
on the same card of the catalogue with the same settings (no ``auto``), and compared.

    python scripts/published_runs.py --out bench/results/DATE-published-runs    # writes results.json, results.csv, results.md

Memory is compared measure for measure: a peak of allocated (or active) tensor bytes against the plan's tensor
peak (``gpu_tensor_bytes``: no CUDA context, no allocator slack); nvidia-smi's used memory against the plan's whole
``gpu_bytes`` (tensors + CUDA context + allocator slack). Tokens/s of a card that is not here is a data-sheet
number (every matmul at the card's dense peak) and is expected to be optimistic. Nothing is fitted to these rows.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB, GiB, MiB = 10 ** 9, 2 ** 30, 2 ** 20
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

FMS = ("https://github.com/foundation-model-stack/fms-acceleration/blob/24bdadb228e2d55bc0c69deec034b86a73da6917/"
       "scripts/benchmarks/")
FMS_SETTINGS = (FMS + "scenarios.yaml (standard-peft, baseline-peft-bnb), " + FMS + "defaults.yaml (gradient_checkpointing: "
                "True, use_flash_attn: True, gradient_accumulation_steps: 1, max_steps: 100), " + FMS + "benchmark.py "
                "(--packing_matrix default [True], --max_seq_len_matrix default [4096]), " + FMS + "refs/requirements.txt "
                "(torch 2.4.1, transformers 4.48.1, peft 0.13.2, bitsandbytes 0.43.3); HF Trainer, alpaca-cleaned packed")
TT = "https://github.com/pytorch/torchtune/blob/"
TT_2024_05 = TT + "0217d44c2e1e372b34628767745c1f6538086a81/"
TT_2024_11 = TT + "1814feb17a9038e1a8053ce93111bd26774a8db6/"
LIT = "https://github.com/Lightning-AI/litgpt/blob/fd71063ce749008f77a991e07879d35d8d4ba4ed/"
LIT_MEASURE = (LIT + "litgpt/finetune/lora.py (prints torch.cuda.max_memory_allocated() / 1e9 after training, "
               "so the peak of the whole run, validation and a sample generation included)")

# Each row: what the source ran and measured (quoted), and the vramfit settings that match it.
ROWS = [
    *[dict(
        id=f"fms-mistral7b-{m}-b{b}",
        source="fms-acceleration benchmark reference (IBM), A100 80GB",
        url=FMS + "refs/a100_80gb.csv",
        settings_url=FMS_SETTINGS,
        quote=quote,
        gpu="A100-80GB-SXM", gpu_note="the file names an A100 80GB, not its form factor; SXM4 taken",
        model="mistral-7b-v0.1", method=m, lora_r=16, lora_targets=ATTN, seq_len=4096, micro_batch=b,
        checkpointing=True, precision=prec, loss="plain cross-entropy (HF)", levers="flash-attention 2",
        published_alloc_bytes=alloc, alloc_measure="peak torch.cuda.max_memory_allocated (HF Trainer memory metrics)",
        published_smi_bytes=smi * MiB, published_tokens_per_s=tps,
        overrides=["model.gradient_checkpointing=true", "loss.chunked=off", "memory.offload_activations=off",
                   *(["model.quantize=4bit"] if m == "QLoRA" else [])],
        not_modelled="flash-attention 2 (planned with the fused SDPA kernel, which saves the same tensors)",
    ) for m, b, prec, alloc, smi, tps, quote in [
        ("LoRA", 4, "bf16 weights (torch_dtype bfloat16), no autocast", 26704571904, 29576, 3324.155,
         "line 34: ,0.15,,none,2.00E-04,16,0.1,29576,26704571904,14664493056,mistralai/Mistral-7B-v0.1,1,lora,4,16,"
         "q_proj k_proj v_proj o_proj,bfloat16,0.862205324,492.8771,0.812,0.203,3324.155"),
        ("LoRA", 8, "bf16 weights (torch_dtype bfloat16), no autocast", 38742912512, 43232, 3353.809,
         "line 36: ,0.29,,none,2.00E-04,16,0.1,43232,38742912512,14664886272,mistralai/Mistral-7B-v0.1,1,lora,8,16,"
         "q_proj k_proj v_proj o_proj,bfloat16,0.858190823,977.0384,0.819,0.102,3353.809"),
        ("QLoRA", 4, "bnb 4-bit base, bf16 autocast (bf16: True)", 20669338112, 26056, 2903.78,
         "line 58: TRUE,0.15,,baseline-peft-bnb,2.00E-04,16,0.1,26056,20669338112,4307028992,mistralai/Mistral-7B-v0.1,"
         "1,lora,4,16,q_proj k_proj v_proj o_proj,bfloat16,0.876798363,564.2301,0.709,0.177,2903.78"),
        ("QLoRA", 8, "bnb 4-bit base, bf16 autocast (bf16: True)", 37002646016, 46050, 2987.456,
         "line 60: TRUE,0.29,,baseline-peft-bnb,2.00E-04,16,0.1,46050,37002646016,4307422208,mistralai/Mistral-7B-v0.1,"
         "1,lora,8,16,q_proj k_proj v_proj o_proj,bfloat16,0.87258399,1096.8531,0.729,0.091,2987.456"),
    ]],
    dict(
        id="torchtune-llama2-7b-lora-4090",
        source="torchtune README table (May 2024), 1x RTX 4090",
        url=TT_2024_05 + "README.md",
        settings_url=(TT_2024_05 + "recipes/configs/llama2/7B_lora_single_device.yaml (lora_attn_modules q_proj, v_proj; "
                      "rank 8; dtype bf16; enable_activation_checkpointing True); "
                      "https://github.com/meta-pytorch/torchtune/pull/955 (BS 4, Seq Length 2048)"),
        quote="| 1 x RTX 4090 |     LoRA          |  Llama2-7B      |    Batch Size = 4, Seq Length = 2048   | 21.3 GB | 2582  |",
        gpu="RTX4090", gpu_note="",
        model="llama-2-7b", method="LoRA", lora_r=8, lora_targets=["q_proj", "v_proj"], seq_len=2048, micro_batch=4,
        checkpointing=True, precision="bf16 (everything, no fp32 master)", loss="plain cross-entropy",
        levers="", published_alloc_bytes=int(21.3 * GB),
        alloc_measure="'Peak Memory per GPU': which peak is not stated (torchtune then logged active, allocated and "
                      "reserved peaks, in units of 1e9 bytes); compared as a tensor peak",
        published_smi_bytes=None, published_tokens_per_s=2582,
        overrides=["model.gradient_checkpointing=true", "loss.chunked=off", "memory.offload_activations=off"],
        not_modelled="",
    ),
    dict(
        id="torchtune-llama2-7b-qlora-4090",
        source="torchtune README table (May 2024), 1x RTX 4090",
        url=TT_2024_05 + "README.md",
        settings_url=(TT_2024_05 + "recipes/configs/llama2/7B_qlora_single_device.yaml (lora_attn_modules q_proj, v_proj, "
                      "k_proj, output_proj; apply_lora_to_mlp True; rank 8; dtype bf16; enable_activation_checkpointing "
                      "True); https://github.com/meta-pytorch/torchtune/pull/955 (BS 4, Seq Length 2048)"),
        quote="| 1 x RTX 4090 |     QLoRA **         |  Llama2-7B      |    Batch Size = 4, Seq Length = 2048   | "
              "12.3 GB | 3155  |  (**= Uses torch compile)",
        gpu="RTX4090", gpu_note="",
        model="llama-2-7b", method="QLoRA", lora_r=8, lora_targets=ATTN + MLP, seq_len=2048, micro_batch=4,
        checkpointing=True, precision="torchao NF4 base, bf16", loss="plain cross-entropy", levers="torch.compile",
        published_alloc_bytes=int(12.3 * GB),
        alloc_measure="'Peak Memory per GPU': which peak is not stated (torchtune then logged active, allocated and "
                      "reserved peaks, in units of 1e9 bytes); compared as a tensor peak",
        published_smi_bytes=None, published_tokens_per_s=3155,
        overrides=["model.gradient_checkpointing=true", "loss.chunked=off", "memory.offload_activations=off",
                   "model.quantize=4bit"],
        not_modelled="torch.compile",
    ),
    *[dict(
        id=f"torchtune-llama3.2-3b-{m.lower()}-a100",
        source="torchtune README, optimization flags table (Nov 2024), A100",
        url=TT_2024_11 + "README.md",
        settings_url=(TT_2024_11 + "README.md ('Baseline uses ... Batch size=2, Max sequence length=4096, Precision=bf16, "
                      "Hardware=A100'; each technique added on top of the previous, LoRA and QLoRA without "
                      "optimizer_in_bwd and 8-bit AdamW); " + TT_2024_11 + f"recipes/configs/llama3_2/3B_{m.lower()}_single_device.yaml "
                      "(lora_attn_modules q_proj, v_proj, output_proj; apply_lora_to_mlp True; rank 64; "
                      "gradient_accumulation_steps 8)"),
        quote=quote,
        gpu="A100-80GB-SXM", gpu_note="the README says 'A100'; the packed full fine-tune row's 60.0 GiB needs the 80GB card; SXM4 taken",
        model="llama-3.2-3b", method=m, lora_r=64, lora_targets=["q_proj", "v_proj", "o_proj"] + MLP, seq_len=4096,
        micro_batch=2, checkpointing=True, precision="bf16 (everything)" if m == "LoRA" else "torchao NF4 base, bf16",
        loss="chunked cross-entropy (CEWithChunkedOutputLoss)",
        levers="packed dataset, torch.compile, chunked cross-entropy, activation checkpointing, activation offloading",
        published_alloc_bytes=int(gib * GiB), alloc_measure="Peak Memory Active (GiB): torch 'active_bytes.all.peak'",
        published_smi_bytes=None, published_tokens_per_s=tps, accumulation=8,
        overrides=["model.gradient_checkpointing=true", "loss.chunked=on", "memory.offload_activations=on",
                   *(["model.quantize=4bit"] if m == "QLoRA" else [])],
        not_modelled="torch.compile",
    ) for m, gib, tps, quote in [
        ("LoRA", 8.5, 8210, "| [LoRA](https://pytorch.org/torchtune/main/tutorials/memory_optimizations.html#glossary-lora) "
                            "| 8.5 | -51.61% | 8210 | +17.96% |"),
        ("QLoRA", 4.6, 8035, "| [QLoRA](https://pytorch.org/torchtune/main/tutorials/memory_optimizations.html"
                             "#quantized-low-rank-adaptation-qlora) | 4.6 | -45.71% | 8035 | -2.13% |"),
    ]],
    *[dict(
        id=f"litgpt-{model}-{m.lower()}-a10g",
        source="LitGPT config_hub/finetune README (Jul 2024), 1x A10G",
        url=LIT + "config_hub/finetune/README.md",
        settings_url=(LIT + f"config_hub/finetune/{model}/{m.lower()}.yaml (precision bf16-true; lora_r 32; lora_query and "
                      "lora_value only; max_seq_length 512; no activation checkpointing in litgpt's LoRA script); " + LIT_MEASURE),
        quote=quote,
        gpu="A10G", gpu_note="",
        model=model, method=m, lora_r=32, lora_targets=["q_proj", "v_proj"], seq_len=512, micro_batch=b,
        checkpointing=False, precision="bf16-true" + (", bnb nf4 base" if m == "QLoRA" else ""),
        loss="chunked cross-entropy (lm_head_chunk_size=128)", levers="",
        published_alloc_bytes=int(gb * GB),
        alloc_measure="torch.cuda.max_memory_allocated over the whole run (validation and generation included); "
                      "batches are padded to their longest sample, at most max_seq_length 512 (assumed reached)",
        published_smi_bytes=None, published_tokens_per_s=None, accumulation=8 // b,
        overrides=["model.gradient_checkpointing=false", "loss.chunked=on", "memory.offload_activations=off",
                   *(["model.quantize=4bit"] if m == "QLoRA" else [])],
        not_modelled="validation and sample generation after training; throughput not published per token",
    ) for model, m, b, gb, quote in [
        ("llama-3.1-8b", "LoRA", 1, 19.73,
         "| llama-3.1-8b/lora.yaml            | llama-3.1-8b           | 2      | 512            | 1                | "
         "1xA10G  | 13.36 min        | $1.1 | 19.73 GB    | 0.878           | 2.406                 | xx.xx           |"),
        ("llama-3.1-8b", "QLoRA", 2, 17.41,
         "| llama-3.1-8b/qlora.yaml           | llama-3.1-8b           | 2      | 512            | 2                | "
         "1xA10G  | 21.81 min        | $0.7 | 17.41 GB    | 0.928           | 2.529                 | xx.xx           |"),
        ("llama-2-7b", "LoRA", 2, 19.77,
         "| llama-2-7b/lora.yaml              | llama-2-7b             | 4      | 512            | 2                | "
         "1xA10G  | 32.82 min        | $1.0 | 19.77 GB    | 0.802           | 2.230                 | 40.3%           |"),
        ("llama-2-7b", "QLoRA", 2, 13.68,
         "| llama-2-7b/qlora.yaml             | llama-2-7b             | 4      | 512            | 2                | "
         "1xA10G  | 45.67 min        | $1.4 | 13.68 GB    | 0.814           | 2.258                 | 38.6%           |"),
    ]],
]

# Found, and left out: the settings are not stated well enough to plan the same run, or no vramfit profile runs it.
DROPPED = [
    ("torchtune README (Sep 2024): Llama 3.1 8B full / LoRA / QLoRA on 1x 4090 and 1x A6000",
     TT + "30b8519e8/README.md", "alpaca unpacked (sequence length varies per batch) and no batch size or sequence "
     "length stated next to the numbers; the A6000 is not in the catalogue"),
    ("torchtune README (May 2024): Llama2-7B full fine-tune on 1x RTX 4090, 24.1 GB, 702 tokens/s",
     TT_2024_05 + "README.md", "PagedAdamW with bf16 states and no fp32 master: no vramfit profile keeps 8 B per "
     "trained parameter; and the number was disputed upstream (meta-pytorch/torchtune#961 measured 20.2)"),
    ("torchtune README (Nov 2024): Llama 3.2 3B full fine-tune rows (baseline ... 8-bit AdamW)",
     TT_2024_11 + "README.md", "pure bf16 AdamW (optionally fused into backward): no fp32 master, as above; the "
     "baseline row is unpacked alpaca, its sequence length varies"),
    ("fms-acceleration: full fine-tunes (Mistral-7B 72.4 GB allocated)", FMS + "refs/a100_80gb.csv",
     "bf16 weights with bf16 AdamW states and no fp32 master: no matching vramfit profile"),
    ("fms-acceleration: Mixtral-8x7B baseline-peft-bnb, batch 4 (42.8 GB allocated, 1528 tokens/s)",
     FMS + "refs/a100_80gb.csv", "not the same run under this transformers: with transformers 4.48 the experts were "
     "nn.Linear and bitsandbytes quantized them (24.7 GB allocated before training); transformers 5 keeps a MoE's "
     "experts as 3-D parameters, which bitsandbytes leaves in 16 bits, so the plan counts 91.5 GB of weights"),
    ("fms-acceleration: accelerated-peft-bnb / -foak / GPTQ rows", FMS + "refs/a100_80gb.csv",
     "the plugin's own fused kernels and GPTQ weights: no vramfit equivalent"),
    ("PEFT vs torchtune comparison, Llama3 8B QLoRA on an RTX 4090 ('~20GiB', '~2300' tokens/s)",
     "https://github.com/huggingface/peft (examples, torchtune comparison notes)",
     "batch size and sequence length not stated; numbers given as approximations"),
    ("Unsloth README: context length that fits per VRAM size, Llama 3.1 8B QLoRA r32 (HF + FA2 column)",
     "https://github.com/unslothai/unsloth (README)", "a maximum context per card size, not a measured peak; the "
     "card sizes (8-80 GB) name no card of the catalogue"),
    ("LitGPT: full fine-tunes (llama-3.2-1b 8.70 GB, llama-3.2-3b 16.51 GB, 1x A10G) and every 'Training runtime'",
     LIT + "config_hub/finetune/README.md", "bf16-true AdamW has no fp32 master (no matching profile); runtimes are "
     "per epoch of variable-length samples with validation, not a per-token rate"),
]


def plan(row: dict) -> tuple[dict | None, str, float]:
    targets = "[" + ",".join(row["lora_targets"]) + "]"
    args = [sys.executable, "-m", "launcher", "plan", "--gpu", row["gpu"],
            f"model.name={os.path.join(ROOT, 'examples', 'configs', row['model'])}", "profile=amp-bf16",
            f"lora.r={row['lora_r']}", f"lora.target_modules={targets}", f"data.seq_len={row['seq_len']}",
            f"train.micro_batch_size={row['micro_batch']}",
            f"train.global_batch_size={row['micro_batch'] * row.get('accumulation', 1)}",
            "memory.cpu_budget=128", *row["overrides"], "--json"]
    t = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.perf_counter() - t
    how = " ".join(["vramfit", *args[3:]]).replace(ROOT + os.sep, "")
    try:
        return json.loads(p.stdout), how, seconds
    except json.JSONDecodeError:
        return None, (p.stderr.strip().splitlines() or ["no output"])[-1], seconds


def compare(row: dict, doc: dict | None) -> dict:
    out = {k: v for k, v in row.items() if k != "overrides"}
    r = next((p for p in (doc or {}).get("profiles", []) if p["profile"] == "amp-bf16"), None)
    if r is None:
        return {**out, "planned": None}
    out["planned"] = {"profile": r["profile"], "micro_batch": r["micro_batch"], "checkpointing": r["checkpointing"],
                      "chunked_loss": r["chunked_loss"], "offload_activations": r["offload_activations"],
                      "gpu_tensor_bytes": r["gpu_tensor_bytes"], "gpu_bytes": r["gpu_bytes"],
                      "gpu_parts": r["parts"]["gpu"], "tokens_per_s": r.get("tokens_per_s"), "step_s": r.get("step_s")}
    pub_a, pub_s, pub_t = row["published_alloc_bytes"], row["published_smi_bytes"], row["published_tokens_per_s"]
    out["ratio_alloc"] = r["gpu_tensor_bytes"] / pub_a if pub_a else None
    out["ratio_smi"] = r["gpu_bytes"] / pub_s if pub_s else None
    out["ratio_tokens_per_s"] = r["tokens_per_s"] / pub_t if pub_t and r.get("tokens_per_s") else None
    return out


def spread(values: list[float]) -> dict | None:
    """Median and range of planned / published, and of the absolute error |ratio - 1|."""
    if not values:
        return None
    errs = [abs(v - 1) for v in values]
    return {"n": len(values), "median_ratio": statistics.median(values), "min_ratio": min(values),
            "max_ratio": max(values), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}


def fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def markdown(results: list[dict], summary: dict) -> str:
    lines = ["| row | card | model, method | micro-batch x seq, checkpointing | published tensor peak GB | planned "
             "tensor peak GB | ratio | published nvidia-smi GB | planned total GB | ratio | published tokens/s | "
             "planned tokens/s | ratio |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for r in results:
        p = r["planned"] or {}
        smi = r["published_smi_bytes"]
        lines.append(
            f"| {r['id']} | {r['gpu']} | {r['model']} {r['method']} r{r['lora_r']} | {r['micro_batch']} x "
            f"{r['seq_len']}, {'on' if r['checkpointing'] else 'off'} | {r['published_alloc_bytes'] / GB:.2f} | "
            f"{fmt(p.get('gpu_tensor_bytes', 0) / GB)} | {fmt(r.get('ratio_alloc'))} | {fmt(smi / GB if smi else None)} | "
            f"{fmt(p.get('gpu_bytes', 0) / GB) if smi else ''} | {fmt(r.get('ratio_smi'))} | "
            f"{fmt(r['published_tokens_per_s'], '.0f')} | {fmt(p.get('tokens_per_s'), '.0f')} | "
            f"{fmt(r.get('ratio_tokens_per_s'))} |")
    lines += ["", "| compared | n | median planned / published | range | median abs. error | worst |",
              "| --- | ---: | ---: | --- | ---: | ---: |"]
    for name, s in summary.items():
        if s:
            lines.append(f"| {name} | {s['n']} | {s['median_ratio']:.3f} | {s['min_ratio']:.3f} - {s['max_ratio']:.3f} | "
                         f"{100 * s['median_abs_error']:.1f}% | {100 * s['max_abs_error']:.1f}% |")
    return "\n".join(lines) + "\n"


CSV_FIELDS = ["id", "source", "url", "gpu", "model", "method", "lora_r", "lora_targets", "seq_len", "micro_batch",
              "checkpointing", "precision", "alloc_measure", "published_alloc_bytes", "published_smi_bytes",
              "published_tokens_per_s", "planned_gpu_tensor_bytes", "planned_gpu_bytes", "planned_tokens_per_s",
              "ratio_alloc", "ratio_smi", "ratio_tokens_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", help="plan only the row with this id (prints it; writes nothing)")
    a = ap.parse_args()
    rows = [r for r in ROWS if not a.only or r["id"] == a.only]
    results = []
    for row in rows:
        doc, how, seconds = plan(row)
        res = compare(row, doc)
        res["command"], res["seconds"] = how, round(seconds, 1)
        results.append(res)
        print(row["id"], fmt(res.get("ratio_alloc"), ".3f"), fmt(res.get("ratio_smi"), ".3f"),
              fmt(res.get("ratio_tokens_per_s"), ".3f"), f"{seconds:.0f}s", flush=True)
    if a.only:
        print(json.dumps(results, indent=1))
        return 0
    summary = {
        "tensor peak (planned gpu_tensor_bytes / published allocated or active peak)":
            spread([r["ratio_alloc"] for r in results if r.get("ratio_alloc")]),
        "whole card (planned gpu_bytes / published nvidia-smi)":
            spread([r["ratio_smi"] for r in results if r.get("ratio_smi")]),
        "tokens/s (planned, data sheet / published)":
            spread([r["ratio_tokens_per_s"] for r in results if r.get("ratio_tokens_per_s")]),
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"rows": results, "dropped": [dict(zip(("what", "url", "why"), d)) for d in DROPPED],
                   "summary": summary}, f, indent=1)
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            p = r["planned"] or {}
            w.writerow({**{k: r.get(k) for k in CSV_FIELDS}, "lora_targets": " ".join(r["lora_targets"]),
                        "planned_gpu_tensor_bytes": p.get("gpu_tensor_bytes"), "planned_gpu_bytes": p.get("gpu_bytes"),
                        "planned_tokens_per_s": p.get("tokens_per_s")})
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(markdown(results, summary))
    print(markdown(results, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
