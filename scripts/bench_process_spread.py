#!/usr/bin/env python
"""How much the same training step's speed moves on this machine, from block to block of one process and between processes.

    python scripts/bench_process_spread.py [--processes 8] [--blocks 3] [--steps 60] [--precision bf16] [--threads N]
                                           [--json OUT]

Each process builds the smallest model the step-time calibration measures (``launcher.measure.stepcal.REFERENCE[1]``:
a Llama of hidden 64 and 4 layers, batch 1, sequence 8), runs 5 untimed forward + backward passes as the AMP
engine runs them, then ``--blocks`` blocks of ``--steps`` timed ones, and reports each block's median step.
The processes run one after another. How far apart the blocks are, within one process and between
processes, says how far a calibration and the runs it prices, each timed at its own moment, can disagree on
this machine, whatever the step-time model does.
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


def child(precision: str, blocks: int, steps: int, threads: int) -> list[float]:
    sys.path.insert(0, ROOT)
    import torch

    from launcher.measure import stepcal

    if threads:
        torch.set_num_threads(threads)

    step = stepcal.step_fn(stepcal.REFERENCE[1], precision)
    for _ in range(5):
        step()
    medians = []
    for _ in range(blocks):
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=3, help="timed blocks per process")
    ap.add_argument("--steps", type=int, default=60, help="steps per block")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (default: torch's own)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.precision, a.blocks, a.steps, a.threads)))
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--precision", a.precision, "--blocks",
           str(a.blocks), "--steps", str(a.steps), "--threads", str(a.threads)]
    rows = []
    for i in range(a.processes):
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"process {i} failed:\n{p.stderr[-3000:]}")
        blocks = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(blocks)
        print(f"process {i}: " + " ".join(f"{b * 1e3:.2f}" for b in blocks) + " ms", flush=True)
    per_process = [statistics.median(r) for r in rows]
    within = max(max(r) / min(r) for r in rows)
    between = max(per_process) / min(per_process)
    threads = a.threads or "default"
    summary = (f"{a.precision} step of stepcal.REFERENCE[1] at {threads} threads, median per process "
               f"{min(per_process) * 1e3:.2f} to {max(per_process) * 1e3:.2f} ms ({between:.2f}x) over "
               f"{a.processes} processes; within one process the blocks differ by {within:.2f}x at most")
    print(summary)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: v for k, v in vars(a).items()
                                                                        if k != "child"},
                       "block_medians_s": rows, "between_processes": between, "within_process": within,
                       "summary": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
