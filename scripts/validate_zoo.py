#!/usr/bin/env python
"""The planner across the architecture zoo (tests/helpers/zoo.py): for each family, the bytes its meta-device trace
counts against the bytes a real CPU step saves for backward (and the step's live-bytes peak), in fp32 and under
bf16 autocast; and the counted estimate the planner falls back to when no trace can be made, against the trace.

    python scripts/validate_zoo.py --out bench/results/DATE-MACHINE/zoo     # writes zoo.json and zoo.md, prints zoo.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def pct(pred: float, real: float) -> float:
    return 100.0 * (pred - real) / real


def row(family: str, config, autocast) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.plan.memory.estimate import counted_activations
    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import TraceSettings, measure_step

    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    meta = build_meta_model(config, attn_implementation="eager", dtype=torch.float32)
    real.train()
    meta.train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    kw = dict(target="cpu", autocast_policy="cpu", autocast_dtype=autocast)
    got = measure_step(real, ids, real_autocast=autocast is not None, **kw)
    pred = measure_step(meta, ids.to("meta"), **kw)
    planned = pred.saved_total + (pred.autocast_cache if autocast is not None else 0)
    counted = counted_activations(config, TraceSettings(batch_size=2, seq_len=64, autocast_dtype=autocast, target="cpu",
                                                        attn_implementation="eager"), 0, "for comparison")
    return {"family": family, "autocast": str(autocast).replace("torch.", "") if autocast else "none",
            "saved_real": got.saved_total, "saved_trace": planned, "saved_err_pct": pct(planned, got.saved_total),
            "peak_real": got.peak, "peak_trace": pred.peak, "peak_err_pct": pct(pred.peak, got.peak),
            "counted_peak": counted.peak, "counted_vs_trace": counted.peak / pred.peak}


def markdown(rows: list[dict]) -> str:
    out = ["| family | autocast | saved, real step (KiB) | saved, trace | error | peak error | counted estimate / trace peak |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['family']} | {r['autocast']} | {r['saved_real'] / 1024:.1f} | {r['saved_trace'] / 1024:.1f} | "
                   f"{r['saved_err_pct']:+.3f}% | {r['peak_err_pct']:+.3f}% | {r['counted_vs_trace']:.2f}x |")
    return "\n".join(out) + "\n"


def main() -> int:
    import torch

    from helpers.zoo import MOE, ZOO

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [row(f, ZOO[f](), None) for f in ZOO] + [row(f, ZOO[f](), torch.bfloat16) for f in MOE]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "zoo.json"), "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__, "transformers": __import__("transformers").__version__},
                  f, indent=1)
    md = markdown(rows)
    with open(os.path.join(a.out, "zoo.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
