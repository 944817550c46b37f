#!/usr/bin/env python
"""How right is the memory planner? Predicted against measured, with the error of every line.

On a CUDA machine (default there): real training runs, ``python -m launcher train ... train.max_steps=3``,
for a grid of model presets x profiles x micro-batches x sequence lengths x checkpointing. Each run's
``summary.json`` gives the measured ``peak_gpu_bytes`` (``torch.cuda.max_memory_allocated``), and
``gpu_reserved`` / ``peak_cpu_rss_bytes`` where present; the prediction is the planner's for the same
settings, computed here for the profile the run used: its tensor bytes (``gpu_tensor_bytes``, what
max_memory_allocated measures) and its total (with CUDA context and allocator slack, what the budget
is held against).

Without CUDA (or with ``--cpu``): the part a CPU can check. For a grid of tiny models (Llama, GPT-2,
GPT-NeoX, Qwen2) x sequence lengths x checkpointing x attention/autocast, the bytes the meta-device
trace counts against the same hooks on a real CPU run: bytes saved for backward and the live-bytes peak
of the step, with and without parameter gradients. Plus the depth extrapolation (2 and 3 layers traced,
6 predicted) against a 6-layer trace.

Writes ``DIR/validate_planner.json`` and ``DIR/validate_planner.md`` (``--out DIR``) and prints the table.

    python scripts/validate_planner.py --out runs/validate           # CPU part without a GPU (< 1 min)
    python scripts/validate_planner.py --out runs/validate --models llama-125m,llama-350m \\
        --profiles amp-bf16,zero2-bf16,zero2-bf16-offload-opt --micro-batches 1,4 --seq-lens 512,1024
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pct(pred, real) -> float | None:
    if pred is None or real in (None, 0):
        return None
    return 100.0 * (pred - real) / real


def fmt_pct(x) -> str:
    return "n/a" if x is None else f"{x:+.2f}%"


def mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


# ------------------------------------------------------------------------------------------------
# CPU part: meta trace vs real CPU run


def cpu_grid(quick: bool) -> list[dict]:
    import torch

    rows = []
    for arch in ("llama", "gpt2", "neox", "qwen2"):
        for seq in ((32, 128) if quick else (32, 128, 256)):
            for ckpt in (False, True):
                rows.append(dict(arch=arch, seq=seq, ckpt=ckpt, attn="eager", dtype=torch.float32, autocast=None))
    # fused attention (CPU flash kernel vs the stand-in) and autocast (torch.autocast vs the emulation)
    for seq in (32, 128):
        rows.append(dict(arch="llama", seq=seq, ckpt=False, attn="sdpa", dtype=torch.float32, autocast=None))
        rows.append(dict(arch="llama", seq=seq, ckpt=False, attn="eager", dtype=torch.float32, autocast=torch.bfloat16))
        rows.append(dict(arch="gpt2", seq=seq, ckpt=True, attn="eager", dtype=torch.float32, autocast=torch.bfloat16))
    return rows


def tiny_config(arch: str, layers: int = 2):
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=256, num_attention_heads=4)
    if arch == "llama":
        return LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=layers, num_key_value_heads=2,
                           **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=layers, num_key_value_heads=2,
                           **common)
    if arch == "neox":
        return GPTNeoXConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=layers, **common)
    return GPT2Config(n_embd=128, n_layer=layers, n_positions=1024, vocab_size=256, n_head=4)


def run_cpu(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.plan.memory.estimate import estimate_activations
    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import TraceSettings, enable_checkpointing, measure_step, trace_depth

    torch.set_num_threads(1)
    out = []
    for r in cpu_grid(args.quick):
        cfg = tiny_config(r["arch"])
        torch.manual_seed(0)
        real = AutoModelForCausalLM.from_config(cfg, attn_implementation=r["attn"], dtype=r["dtype"])
        meta = build_meta_model(cfg, attn_implementation=r["attn"], dtype=r["dtype"])
        if r["ckpt"]:
            enable_checkpointing(real)
            enable_checkpointing(meta)
        real.train()
        meta.train()
        ids = torch.randint(0, cfg.vocab_size, (2, r["seq"]))
        kw = dict(target="cpu", autocast_dtype=r["autocast"], autocast_policy="cpu")
        t = time.perf_counter()
        got = measure_step(real, ids, real_autocast=r["autocast"] is not None, **kw)
        real_s = time.perf_counter() - t
        pred = measure_step(meta, ids.to("meta"), attention_kernel="flash" if r["attn"] == "sdpa" else "math", **kw)
        what = f"{r['arch']} s={r['seq']} b=2 {r['attn']}" + (" ckpt" if r["ckpt"] else "") + \
               (" autocast-bf16" if r["autocast"] else "")
        # with autocast the real run's saved bytes include the weight casts, which the meta trace puts on
        # their own line; the peaks compare like for like either way
        saved_real = got.saved_total
        saved_pred = pred.saved_total + (pred.autocast_cache if r["autocast"] and not r["ckpt"] else 0)
        out.append({"case": what, "saved_real": saved_real, "saved_meta": saved_pred,
                    "saved_err_pct": pct(saved_pred, saved_real) if not (r["autocast"] and r["ckpt"]) else None,
                    "peak_real": got.peak, "peak_meta": pred.peak, "peak_err_pct": pct(pred.peak, got.peak),
                    "peak_grads_real": got.peak_with_grads, "peak_grads_meta": pred.peak_with_grads,
                    "peak_grads_err_pct": pct(pred.peak_with_grads, got.peak_with_grads),
                    "meta_s": round(pred.seconds, 3), "real_s": round(real_s, 3)})
    # depth extrapolation: traces of 2 and 3 layers predict 6
    for arch, ckpt, ac in (("llama", False, None), ("llama", True, torch.bfloat16), ("gpt2", True, None)):
        cfg = tiny_config(arch, layers=6)
        s = TraceSettings(batch_size=2, seq_len=128, autocast_dtype=ac, gradient_checkpointing=ckpt,
                          attention_kernel="flash", target="cuda")
        est = estimate_activations(cfg, s)
        full = trace_depth(cfg, 6, s)
        out.append({"case": f"{arch} 6 layers from 2+3" + (" ckpt" if ckpt else "") + (" autocast" if ac else ""),
                    "saved_real": full.saved_total, "saved_meta": sum(est.saved.values()),
                    "saved_err_pct": pct(sum(est.saved.values()), full.saved_total),
                    "peak_real": full.peak, "peak_meta": est.peak, "peak_err_pct": pct(est.peak, full.peak),
                    "peak_grads_real": full.peak_with_grads, "peak_grads_meta": est.peak_with_grads,
                    "peak_grads_err_pct": pct(est.peak_with_grads, full.peak_with_grads),
                    "meta_s": round(est.trace_seconds, 3), "real_s": None})
    errs = [abs(v) for row in out for k, v in row.items() if k.endswith("err_pct") and v is not None]
    return {"part": "cpu", "rows": out, "max_abs_err_pct": max(errs) if errs else None}


def cpu_markdown(res: dict) -> str:
    lines = ["| case | saved real MiB | saved meta MiB | err | peak real MiB | peak meta MiB | err | "
             "peak+grads real | peak+grads meta | err | meta s |", "|" + " --- |" * 11]
    for r in res["rows"]:
        lines.append(f"| {r['case']} | {mib(r['saved_real'])} | {mib(r['saved_meta'])} | {fmt_pct(r['saved_err_pct'])} | "
                     f"{mib(r['peak_real'])} | {mib(r['peak_meta'])} | {fmt_pct(r['peak_err_pct'])} | "
                     f"{mib(r['peak_grads_real'])} | {mib(r['peak_grads_meta'])} | {fmt_pct(r['peak_grads_err_pct'])} | "
                     f"{r['meta_s']} |")
    lines.append("")
    lines.append(f"max |error|: {fmt_pct(res['max_abs_err_pct'])} (real = the same hooks on a real CPU run, or for "
                 "the depth rows a full-depth meta trace)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# GPU part: real training runs


def run_gpu(args) -> dict:
    from launcher.config.load import load_config
    from launcher.machine.hardware import probe
    from launcher.plan import planner

    hw = probe()
    rows = []
    grid = itertools.product(args.models.split(","), args.profiles.split(","),
                             [int(x) for x in args.micro_batches.split(",")],
                             [int(x) for x in args.seq_lens.split(",")],
                             [c == "on" for c in args.checkpointing.split(",")])
    runs_dir = os.path.join(args.out, "runs")
    for model, profile, mb, seq, ckpt in grid:
        name = f"{model}-{profile}-b{mb}-s{seq}-{'ckpt' if ckpt else 'nockpt'}"
        overrides = [f"model.name={model}", f"profile={profile}", f"train.micro_batch_size={mb}",
                     f"train.global_batch_size={mb}", f"data.seq_len={seq}", f"model.gradient_checkpointing={ckpt}",
                     f"train.max_steps={args.steps}", "train.warmup_steps=0", f"output_dir={runs_dir}",
                     f"run_name={name}", "log.every_steps=1", "sample_tokens=0", "checkpoint.resume=never",
                     f"data.num_samples={max(64, mb * args.steps * 2)}", *args.extra]
        row = {"run": name, "model": model, "profile": profile, "micro_batch": mb, "seq_len": seq,
               "checkpointing": ckpt}
        try:
            cfg = load_config(None, overrides)
            p = planner.plan(cfg, hw, [profile])
            pp = p.get(profile)
            row.update(pred_tensor_bytes=pp.gpu_tensor_bytes, pred_gpu_bytes=pp.gpu_bytes, pred_cpu_bytes=pp.cpu_bytes,
                       pred_fits=pp.fits, pred_parts=pp.parts, pred_phase=pp.peak_phase)
        except Exception as e:  # report, keep going
            row["plan_error"] = f"{type(e).__name__}: {e}"
        t = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run([sys.executable, "-m", "launcher", "train", *overrides], capture_output=True,
                                  text=True, cwd=ROOT, env=env, timeout=args.timeout)
            row["returncode"], stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:  # one slow run is a row, not the end of the grid
            row["returncode"] = None
            stderr = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr) or ""
            row["timeout_s"] = args.timeout
        row["train_s"] = round(time.perf_counter() - t, 1)
        summary_path = os.path.join(runs_dir, name, "summary.json")
        if os.path.isfile(summary_path):
            s = json.load(open(summary_path))
            row.update(status=s.get("status"), peak_gpu_bytes=s.get("peak_gpu_bytes"),
                       gpu_reserved=s.get("gpu_reserved") or s.get("peak_gpu_reserved_bytes"),
                       peak_cpu_rss_bytes=s.get("peak_cpu_rss_bytes"), summary_predicted_gpu_bytes=s.get("predicted_gpu_bytes"),
                       fallbacks=s.get("fallbacks"))
        else:
            row["status"] = "timeout" if row.get("timeout_s") else "no summary"
            row["stderr_tail"] = stderr[-2000:]
        row["tensor_err_pct"] = pct(row.get("pred_tensor_bytes"), row.get("peak_gpu_bytes"))
        if row.get("gpu_reserved"):
            from launcher.plan.planner import CUDA_CONTEXT_BYTES

            row["total_err_pct"] = pct(row.get("pred_gpu_bytes"), row["gpu_reserved"] + CUDA_CONTEXT_BYTES)
        row["cpu_err_pct"] = pct(row.get("pred_cpu_bytes"), row.get("peak_cpu_rss_bytes"))
        rows.append(row)
        with open(os.path.join(args.out, "validate_planner.partial.json"), "w") as fh:  # what a stage cut short keeps
            json.dump({"part": "gpu", "rows": rows}, fh, indent=2, default=str)
        print(f"{name}: predicted {mib(row.get('pred_tensor_bytes'))} MiB tensors, measured "
              f"{mib(row.get('peak_gpu_bytes'))} MiB ({fmt_pct(row['tensor_err_pct'])}), status {row.get('status')}",
              flush=True)
    errs = [abs(r["tensor_err_pct"]) for r in rows if r.get("tensor_err_pct") is not None and not r.get("fallbacks")]
    return {"part": "gpu", "rows": rows, "max_abs_err_pct": max(errs) if errs else None,
            "hardware": hw.to_dict()}


def gpu_markdown(res: dict) -> str:
    lines = ["| run | status | predicted tensors MiB | max allocated MiB | err | predicted total MiB | "
             "reserved + context MiB | err | predicted CPU MiB | CPU RSS MiB | err |", "|" + " --- |" * 11]
    from launcher.plan.planner import CUDA_CONTEXT_BYTES

    for r in res["rows"]:
        res_ctx = r["gpu_reserved"] + CUDA_CONTEXT_BYTES if r.get("gpu_reserved") else None
        lines.append(f"| {r['run']} | {r.get('status')}{' (fallback)' if r.get('fallbacks') else ''} | "
                     f"{mib(r.get('pred_tensor_bytes'))} | {mib(r.get('peak_gpu_bytes'))} | {fmt_pct(r.get('tensor_err_pct'))} | "
                     f"{mib(r.get('pred_gpu_bytes'))} | {mib(res_ctx)} | {fmt_pct(r.get('total_err_pct'))} | "
                     f"{mib(r.get('pred_cpu_bytes'))} | {mib(r.get('peak_cpu_rss_bytes'))} | {fmt_pct(r.get('cpu_err_pct'))} |")
    lines.append("")
    lines.append(f"max |error| of predicted tensor bytes vs max_memory_allocated (runs without fallback): "
                 f"{fmt_pct(res['max_abs_err_pct'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/validate_planner", help="directory for the JSON and markdown tables")
    ap.add_argument("--cpu", action="store_true", help="run the CPU part even when CUDA is available")
    ap.add_argument("--quick", action="store_true", help="CPU part: fewer sequence lengths")
    ap.add_argument("--models", default="llama-125m,llama-350m", help="GPU grid: presets or model directories")
    ap.add_argument("--profiles", default="amp-bf16,zero2-bf16,zero2-bf16-offload-opt,fsdp-bf16-offload,zero3-bf16-offload-all",
                    help="GPU grid: profile names (use the fp16 ones on GPUs below compute capability 8.0)")
    ap.add_argument("--micro-batches", default="1,4")
    ap.add_argument("--seq-lens", default="512,1024")
    ap.add_argument("--checkpointing", default="off,on", help="comma list of on/off")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every GPU run (e.g. lora.r=16)")
    args = ap.parse_args(argv)
    import torch

    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.is_available() and not args.cpu
    t = time.perf_counter()
    res = run_gpu(args) if gpu else run_cpu(args)
    res["seconds"] = round(time.perf_counter() - t, 1)
    md = gpu_markdown(res) if gpu else cpu_markdown(res)
    with open(os.path.join(args.out, "validate_planner.json"), "w") as fh:
        json.dump(res, fh, indent=2, default=str)
    with open(os.path.join(args.out, "validate_planner.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    print(f"\n{res['seconds']} s; wrote {args.out}/validate_planner.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
