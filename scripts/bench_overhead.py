"""vramfit's AMP path against a minimal hand-written torch loop: same model, batches, optimizer, schedule.

    python scripts/bench_overhead.py [--steps 60] [--repeats 3] [--variant K=V,K=V ...] [key=value ...] [--json OUT]

Both train the demo's tiny Llama on the synthetic task for the same steps; the first 5 steps of each
are warm-up and not timed. Runs alternate (bare, vramfit, bare, ...) so that a busy machine slows both
alike; the median tokens/s of each is compared. Target: vramfit >= 0.99x the bare loop.

``--variant``: one more vramfit loop per use, with these overrides on top, in the same alternation: what a
part of the loop costs (e.g. ``--variant log.memory_interval_s=0`` runs without the memory monitor's thread).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from launcher.config.load import load_config  # noqa: E402
from launcher.data.order import micro_batches  # noqa: E402
from launcher.data.synthetic import synthetic_task  # noqa: E402
from launcher.machine import speeds  # noqa: E402
from launcher.machine.hardware import probe  # noqa: E402
from launcher.model.build import make_model, model_config, param_groups  # noqa: E402
from launcher.plan import decide  # noqa: E402

WARMUP = 5


def bare_loop(cfg) -> float:
    """The loop a user would write by hand: tokens/s over the timed steps."""
    model = make_model(cfg, hf_config=model_config(cfg))
    model.train()
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            fused=True)
    data = synthetic_task(cfg.data.num_samples, cfg.data.seq_len, cfg.data.vocab_size, cfg.seed)
    # train.micro_batch_size may be "auto": take the micro-batch and accumulation a training run decides (the same
    # front door, with this machine's cached calibration), so both loops do the same work per step
    spec = decide.decide(cfg, hw=probe(), machine=speeds.cached()[0]).spec
    micro, accum = spec.micro_batch, spec.accumulation
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(t.max_steps):
        if step == WARMUP:
            t0 = time.perf_counter()
        lr = t.lr * min(1.0, (step + 1) / max(1, t.warmup_steps))
        if step >= t.warmup_steps:
            p = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
            lr = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr
        for rows in micro_batches(step, t.global_batch_size, micro, 0, 1, len(data), cfg.seed):
            b = data.batch(rows)
            loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # the bare loop also reads the loss each step
    dt = time.perf_counter() - t0
    return (t.max_steps - WARMUP) * t.global_batch_size * cfg.data.seq_len / dt


def vramfit_loop(overrides: list[str]) -> float:
    from launcher.training.loop import train

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [*overrides, f"output_dir={d}", "run_name=bench"])
        s = train(cfg)
        rows = [json.loads(x) for x in open(os.path.join(s["run_dir"], "metrics.jsonl"))]
    timed = rows[WARMUP:]
    elapsed = timed[-1]["time_s"] - rows[WARMUP - 1]["time_s"]
    return len(timed) * cfg.train.global_batch_size * cfg.data.seq_len / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads of both loops (default: torch's)")
    ap.add_argument("--variant", action="append", default=[],
                    help="comma-separated overrides for one more vramfit loop (repeat for more)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    # Both loops at the same thread count (torch's default, one per core, unless --threads): this measures the
    # loop's own cost, not train.threads=auto's choice on a busy machine (scripts/bench_threads.py does that).
    n = a.threads or torch.get_num_threads()
    torch.set_num_threads(n)
    overrides = ["engine=amp", "device=cpu", f"train.max_steps={a.steps}", "train.warmup_steps=5",
                 "log.every_steps=1000000", "sample_tokens=0", "log.progress=off", f"train.threads={n}", *a.overrides]
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    bare, ours = [], []
    variants = {v: [] for v in a.variant}
    for i in range(a.repeats):
        bare.append(bare_loop(cfg))
        ours.append(vramfit_loop(overrides))
        for v, got in variants.items():
            got.append(vramfit_loop([*overrides, *v.split(",")]))
        more = "".join(f", {v} {got[-1]:.0f}" for v, got in variants.items())
        print(f"repeat {i + 1}: bare {bare[-1]:.0f} tok/s, vramfit {ours[-1]:.0f} tok/s{more}", flush=True)
    b, v = statistics.median(bare), statistics.median(ours)
    result = {"bare_tokens_per_s": b, "vramfit_tokens_per_s": v, "ratio": v / b, "repeats": a.repeats,
              "steps": a.steps, "timed_steps": a.steps - WARMUP, "overrides": overrides,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "all_bare": bare, "all_vramfit": ours,
              "variants": {k: {"tokens_per_s": statistics.median(got), "ratio": statistics.median(got) / b,
                               "all": got} for k, got in variants.items()},
              "load_average": list(os.getloadavg())}
    rows = "".join(f"| vramfit AMP, {k} | {statistics.median(got):.0f} | {statistics.median(got) / b:.3f} |\n"
                   for k, got in variants.items())
    print(f"\n| loop | tokens/s (median of {a.repeats}) | / bare |\n| --- | --- | --- |\n| bare torch | {b:.0f} | 1 |\n"
          f"| vramfit AMP | {v:.0f} | {v / b:.3f} |\n{rows}\nratio vramfit / bare = {v / b:.3f} (target >= 0.99)")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        json.dump(result, open(a.json, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
