#!/usr/bin/env python
"""How fast a preset's 16-bit weights are initialised: torch's ``normal_`` on a bf16 tensor against
:func:`launcher.model.materialize.normal_16bit` (drawn in fp32 blocks, rounded into the tensor), in turns.

    python scripts/bench_init.py [--gib 1] [--rounds 3] [--json OUT]

Prints seconds per GiB of bf16 for each (the median of the rounds) and the fraction of elements on which the two
give the same value for the same seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from launcher.model.materialize import normal_16bit  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the bf16 tensor (GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t = torch.empty(int(a.gib * 2 ** 30) // 2, dtype=torch.bfloat16)
    gib = t.numel() * 2 / 2 ** 30
    times: dict[str, list[float]] = {"torch normal_ (bf16)": [], "normal_16bit": []}
    for _ in range(a.rounds):
        for name in times:
            torch.manual_seed(0)
            t0 = time.perf_counter()
            if name == "normal_16bit":
                normal_16bit(t, 0.0, 0.02)
            else:
                t.normal_(0.0, 0.02)
            times[name].append((time.perf_counter() - t0) / gib)
    torch.manual_seed(0)
    ref = torch.empty_like(t).normal_(0.0, 0.02)
    torch.manual_seed(0)
    same = (normal_16bit(torch.empty_like(t), 0.0, 0.02) == ref).float().mean().item()
    out = {"gib": round(gib, 3), "threads": torch.get_num_threads(),
           "s_per_gib": {k: round(statistics.median(v), 3) for k, v in times.items()},
           "same_values": round(same, 4), "std": round(t.float().std().item(), 5)}
    for k, v in out["s_per_gib"].items():
        print(f"{k:22s} {v:6.2f} s/GiB")
    print(f"same value for the same seed: {100 * same:.1f}% of elements; std of the last draw {out['std']}")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=2)
    return out


if __name__ == "__main__":
    main()
