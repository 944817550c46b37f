"""What a tensor made from fresh pages costs to fill, in a process that holds little memory and in one that holds
several GiB, as a training process does.

DeepSpeed's ZeRO-2 with optimizer offload takes each gradient's norm at the accumulation boundary from a new
fp64 copy of it (``set_norm_for_param_grad_in_gpu`` in deepspeed/runtime/zero/stage_1_and_2.py:
``accumulated_grad.data.to(get_norm_dtype()).norm(2)``, fp64 wherever the accelerator has it, the CPU included).
A copy above glibc's mmap threshold (32 MiB at most) comes from fresh pages every step, each 4 KiB page a fault
on first touch; below it, it may come from freed heap memory or not, as the heap's history decides. The default
sizes are those copies for llama-125m: an MLP weight (768 x 2048, 12.6 MB) and the embedding (32000 x 768,
197 MB). Each case runs in its own process, so one case's freed pages are not the next one's.

    .venv/bin/python scripts/bench_fresh_pages.py --out bench/results/DATE-cpu-NAME/fresh-pages
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {"mlp_fp64_copy": 768 * 2048, "embedding_fp64_copy": 32000 * 768}  # fp64 elements


def child(hold_gib: float, reps: int) -> dict:
    import torch

    held = [torch.ones(1 << 27) for _ in range(int(hold_gib * 2))]  # 512 MiB each, touched
    out = {}
    for name, n in SIZES.items():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            x = torch.empty(n, dtype=torch.float64)
            x.fill_(0.0)  # every page touched once, as the copy's write does
            times.append(time.perf_counter() - t)
            del x
        out[name] = {"bytes": n * 8, "seconds": times, "best_s": min(times),
                     "us_per_page": 1e6 * min(times) / (n * 8 / 4096)}
    del held
    return {"hold_gib": hold_gib, "threads": torch.get_num_threads(), "sizes": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hold", type=float, nargs="+", default=[0.0, 4.0], help="GiB held while filling, per case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="every case run this many times, in turns")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.reps)))
        return 0
    from launcher.measure.bench import cpu_model

    runs = []
    for _ in range(a.rounds):
        for h in a.hold:
            p = subprocess.run([sys.executable, __file__, "--child", str(h), "--reps", str(a.reps)],
                               capture_output=True, text=True, check=True)
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    lines = [f"# Fresh pages: filling a new tensor ({cpu_model()}, "
             f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')})", "",
             f"| held GiB | tensor | MB | best ms of {a.reps} | us per 4 KiB page |", "| ---: | --- | ---: | ---: | ---: |"]
    for r in runs:
        for name, s in r["sizes"].items():
            lines.append(f"| {r['hold_gib']:g} | {name} | {s['bytes'] / 1e6:.1f} | {1e3 * s['best_s']:.1f} | "
                         f"{s['us_per_page']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fresh_pages.json"), "w") as fh:
            json.dump({"runs": runs, "argv": sys.argv[1:]}, fh, indent=1)
        with open(os.path.join(a.out, "fresh_pages.md"), "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
