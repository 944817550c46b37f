#!/usr/bin/env python
"""How big a LoRA run's checkpoint is on each engine, against the adapter it trains.

    python scripts/bench_checkpoint_size.py [--model llama-125m] [--r 16] [--out DIR] [key=value ...]

For each profile (AMP, DeepSpeed ZeRO-2, FSDP2 offload) one short LoRA run (2 steps, a checkpoint at the
end) is made on the CPU; reported per engine: the bytes of the checkpoint directory, of final/ (the
adapter), the adapter's fp32 weights plus its two Adam moments (12 bytes per trainable parameter: what a
checkpoint has to hold), and the frozen base in fp32 (what a checkpoint held before frozen parameters were
left out). Target (llama-125m, r=16, ZeRO-2 and FSDP): checkpoint <= 3 x (adapter + Adam state).

Writes ``DIR/checkpoint_size.json`` and ``DIR/checkpoint_size.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.config.load import load_config  # noqa: E402
from launcher.machine.files import tree_bytes  # noqa: E402
from launcher.measure.bench import cpu_model  # noqa: E402
from launcher.training.loop import train  # noqa: E402
from launcher.units import MiB  # noqa: E402

PROFILES = ["amp-fp32", "zero2-fp32", "fsdp-bf16-offload"]


def measure(profile: str, model: str, r: int, out_dir: str, extra: list[str]) -> dict:
    cfg = load_config(None, [f"model.name={model}", f"lora.r={r}", f"lora.alpha={2 * r}", f"profile={profile}",
                             "device=cpu", "train.max_steps=2", "train.warmup_steps=0", "train.micro_batch_size=1",
                             "train.global_batch_size=1", "data.seq_len=64", "data.num_samples=64",
                             "sample_tokens=0", "log.memory_interval_s=0", f"output_dir={out_dir}",
                             f"run_name={profile}", *extra])
    s = train(cfg)
    ckpt = s["checkpoint"]
    import torch

    from launcher.model.build import build_model, count_params
    from launcher.model.materialize import Placement

    m, _ = build_model(cfg, Placement(torch.device("cpu"), torch.float32, torch.float32))  # meta: counted, not made
    total, trainable = count_params(m)
    return {"profile": profile, "engine": s["engine"], "status": s["status"], "checkpoint_bytes": tree_bytes(ckpt),
            "final_bytes": tree_bytes(os.path.join(s["run_dir"], "final")), "trainable_params": trainable,
            "total_params": total, "adapter_adam_bytes": 12 * trainable, "base_fp32_bytes": 4 * (total - trainable),
            "files": sorted(os.listdir(ckpt))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-125m")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in a.profiles.split(","):
            rows.append(measure(p, a.model, a.r, tmp, a.overrides))
    for row in rows:
        row["ratio"] = row["checkpoint_bytes"] / row["adapter_adam_bytes"]
    lines = [f"LoRA r={a.r} on {a.model} ({rows[0]['trainable_params'] / 1e6:.2f}M trainable of "
             f"{rows[0]['total_params'] / 1e6:.1f}M parameters), CPU: {cpu_model()}", "",
             "| profile | engine | checkpoint MiB | final/ (adapter) MiB | adapter + Adam state MiB | checkpoint / "
             "(adapter + Adam) | frozen base fp32 MiB (left out) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['profile']} | {row['engine']} | {row['checkpoint_bytes'] / MiB:.1f} | "
                     f"{row['final_bytes'] / MiB:.1f} | {row['adapter_adam_bytes'] / MiB:.1f} | {row['ratio']:.2f} | "
                     f"{row['base_fp32_bytes'] / MiB:.0f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "checkpoint_size.json"), "w") as fh:
            json.dump({"model": a.model, "r": a.r, "cpu": cpu_model(), "results": rows}, fh, indent=1)
        with open(os.path.join(a.out, "checkpoint_size.md"), "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
