#!/usr/bin/env python
"""What each step of `vramfit train` pays besides the model's and the optimizer's work, part by part.

    python scripts/bench_loop_parts.py [--steps 300] [--json OUT] [key=value ...]

Trains the demo's tiny Llama (AMP fp32 on the CPU, as ``scripts/bench_overhead.py`` does) with the loop's
bookkeeping calls wrapped in timers: the micro-batches' cut, the monitor's phase marks, the one host read of
the step's numbers, the RSS read, the ``metrics.jsonl`` line, the trackers (TensorBoard by default), the
progress bar or log line, and the stop check. Prints each part's microseconds per step and its share of the
mean step, over the steps after the first 5. An alternating A/B of whole runs cannot resolve parts this small
on a shared machine (its runs drift by 10-30%); timing them inside one run can.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from launcher.config.load import load_config  # noqa: E402
from launcher.data.tokens import TokenData  # noqa: E402
from launcher.machine import dist  # noqa: E402
from launcher.training import loop as train
from launcher.training import progress
from launcher.training.monitor import MemoryMonitor  # noqa: E402
from launcher.training.rundir import RunDir  # noqa: E402
from launcher.training.tracking import Trackers  # noqa: E402

WARMUP = 5
# (label, owner, attribute): what the loop calls once (or a few times) per step, outside the engine
PARTS = [
    ("cut the micro-batches", TokenData, "step"),
    ("monitor phase marks", MemoryMonitor, "mark"),
    ("monitor step end (peaks, leak check)", MemoryMonitor, "end_step"),
    ("host read of loss, flags, norm", train, "host_values"),
    ("RSS read", train, "memory_now"),
    ("metrics.jsonl line", RunDir, "append_metrics"),
    ("trackers (log.report_to)", Trackers, "log"),
    ("progress bar / log line", progress.Progress, "update"),
    ("stop check across ranks", dist.Dist, "any"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    spent: dict = defaultdict(list)  # label -> [(step, seconds)]
    step_now = [0]

    def timed(label, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[label].append((step_now[0], time.perf_counter() - t0))
        return wrapper

    for label, owner, name in PARTS:
        setattr(owner, name, timed(label, getattr(owner, name)))
    original_log = RunDir.append_metrics

    def count(self, row):  # the step that ends: the row's step
        step_now[0] = row["step"]
        return original_log(self, row)

    RunDir.append_metrics = count
    n = torch.get_num_threads()
    overrides = ["engine=amp", "device=cpu", f"train.max_steps={a.steps}", "train.warmup_steps=5", "sample_tokens=0",
                 "log.progress=off", f"train.threads={n}", *a.overrides]
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [*overrides, f"output_dir={d}", "run_name=parts"])
        s = train.train(cfg)
        rows = [json.loads(x) for x in open(os.path.join(s["run_dir"], "metrics.jsonl"))]
    timed_rows = rows[WARMUP:]
    steps = len(timed_rows)
    step_s = (timed_rows[-1]["time_s"] - rows[WARMUP - 1]["time_s"]) / steps
    out = {"steps": steps, "mean_step_s": step_s, "overrides": overrides, "threads": n, "torch": torch.__version__,
           "parts_us_per_step": {}}
    print(f"\n| part | us per step | share of the step ({step_s * 1e3:.1f} ms) |\n| --- | ---: | ---: |")
    total = 0.0
    for label, _, _ in PARTS:
        # a part timed at step k's end counts for step k (step_now moves when the row is written)
        s_ = sum(t for k, t in spent[label] if k >= WARMUP)
        per = s_ / steps
        total += per
        out["parts_us_per_step"][label] = per * 1e6
        print(f"| {label} | {per * 1e6:.0f} | {per / step_s:.2%} |")
    out["total_us_per_step"] = total * 1e6
    print(f"| **all of them** | **{total * 1e6:.0f}** | **{total / step_s:.2%}** |")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        json.dump(out, open(a.json, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
