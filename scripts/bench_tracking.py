#!/usr/bin/env python
"""What tracking costs: the same training with ``log.report_to=[tensorboard]`` and ``[none]``, alternating.

    python scripts/bench_tracking.py [--repeats 4] [--steps 40] [--warmup 5] [--out DIR] [key=value ...]

Each repeat trains twice in this process, once with TensorBoard event files and once without, the order
alternating between repeats so that a busy machine slows both alike. tokens/s is taken over the steps after
the warm-up from each run's metrics.jsonl (wall time: everything the loop does). Reported: the median tokens/s
of each, the overhead ``1 - median(on) / median(off)``, and the tracker's own time per step measured directly
(the loop's calls into :class:`launcher.training.tracking.Trackers`), which a noisy machine does not blur.
Target: under 1% of tokens/s.

Writes ``DIR/bench_tracking.json`` and ``DIR/bench_tracking.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.config.load import load_config  # noqa: E402
from launcher.measure.bench import cpu_model  # noqa: E402
from launcher.training import tracking  # noqa: E402
from launcher.training.loop import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    spent = {"s": 0.0, "calls": 0}
    real_log = tracking.Trackers.log

    def timed(self, row, step):
        t = time.perf_counter()
        try:
            return real_log(self, row, step)
        finally:
            if self.names:
                spent["s"] += time.perf_counter() - t
                spent["calls"] += 1

    tracking.Trackers.log = timed
    base = ["device=cpu", "engine=amp", f"train.max_steps={a.steps}", "train.warmup_steps=2", "sample_tokens=0",
            "log.every_steps=1000", "log.memory_interval_s=0", "checkpoint.save=false", *a.overrides]
    tps = {"tensorboard": [], "none": []}
    step_s = {"tensorboard": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            order = ["tensorboard", "none"] if i % 2 == 0 else ["none", "tensorboard"]
            for which in order:
                s = train(load_config(None, [*base, f"log.report_to=[{which}]", f"output_dir={tmp}",
                                             f"run_name={which}-{i}"]))
                rows = [json.loads(ln) for ln in open(os.path.join(s["run_dir"], "metrics.jsonl"))][a.warmup:]
                tokens = rows[-1]["tokens"] - rows[0]["tokens"]
                seconds = rows[-1]["time_s"] - rows[0]["time_s"]
                tps[which].append(tokens / seconds)
                step_s[which].append(seconds / (len(rows) - 1))
    on, off = statistics.median(tps["tensorboard"]), statistics.median(tps["none"])
    per_call = spent["s"] / max(1, spent["calls"])
    res = {"cpu": cpu_model(), "repeats": a.repeats, "steps": a.steps, "warmup": a.warmup, "overrides": a.overrides,
           "tokens_per_s": tps, "median_on": on, "median_off": off, "overhead": 1 - on / off,
           "tracker_s_per_step": per_call, "tracker_share_of_step": per_call / statistics.median(step_s["none"])}
    text = "\n".join([
        f"Tracking cost (TensorBoard event files vs none), {a.repeats} alternating pairs of {a.steps} steps, "
        f"{a.warmup} warm-up steps left out; CPU: {res['cpu']}; overrides: {' '.join(a.overrides) or 'none'}", "",
        "| | tokens/s (median) |", "| --- | --- |",
        f"| report_to=[none] | {off:.0f} |", f"| report_to=[tensorboard] | {on:.0f} |", "",
        f"overhead from tokens/s: {res['overhead']:.2%} (noise of this machine included)",
        f"tracker time measured in the loop: {per_call * 1e3:.3f} ms per step = {res['tracker_share_of_step']:.3%} "
        "of a step"])
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_tracking.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        with open(os.path.join(a.out, "bench_tracking.md"), "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
