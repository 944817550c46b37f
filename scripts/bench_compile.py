#!/usr/bin/env python
"""``model.compile=true`` against false, on the AMP and FSDP paths, the built-in demo on the CPU.

    python scripts/bench_compile.py [--steps 40] [--repeats 2] [--engines amp,fsdp] [--compile false,true] [--json OUT]

Each run is ``python -m launcher train`` in its own process; runs alternate (off, on, off, on, ...). Reported per
run: the median step time of steps 11..N (compilation happens in the first steps), the first step's time (it
holds most of the compilation) and the process's wall time (start-up and compilation included). Both at
``train.threads=1``, so that a busy shared machine slows them alike (scripts/bench_threads.py). ``--compile false``
runs the uncompiled side only (a first compilation, with inductor's cache empty, takes 35-45 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(engine: str, compiled: bool, steps: int, out: str, name: str) -> dict:
    cmd = [sys.executable, "-m", "launcher", "train", f"engine={engine}", "device=cpu", f"train.max_steps={steps}",
           "train.warmup_steps=2", "checkpoint.save=false", "sample_tokens=0", "log.progress=off", "train.threads=1",
           f"model.compile={str(compiled).lower()}", f"output_dir={out}", f"run_name={name}"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    rows = [json.loads(ln) for ln in open(os.path.join(out, name, "metrics.jsonl"))]
    t = [r["time_s"] for r in rows]
    return {"step_s": statistics.median(b - a for a, b in zip(t[10:], t[11:])), "first_step_s": t[0],
            "wall_s": wall, "final_loss": rows[-1]["loss"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", default="amp,fsdp")
    ap.add_argument("--compile", default="false,true", help="the model.compile settings run, in turns")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    settings = [{"false": False, "true": True}[x] for x in a.compile.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as out:
        for engine in a.engines.split(","):
            for rep in range(a.repeats):
                for compiled in settings:
                    load = os.getloadavg()[0]
                    r = run(engine, compiled, a.steps, out, f"{engine}-{rep}-{compiled}")
                    r.update(engine=engine, compiled=compiled, repeat=rep, load_average=load)
                    runs.append(r)
                    print(f"{engine} compile={compiled!s:5} step {r['step_s'] * 1000:6.1f} ms, first step "
                          f"{r['first_step_s']:5.1f} s, wall {r['wall_s']:5.1f} s (load {load:.2f})", flush=True)
    print("\n| engine | model.compile | step (ms, steps 11..N) | first step (s) | wall (s) | step vs off |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    table = []
    for engine in a.engines.split(","):
        offs = [r["step_s"] for r in runs if r["engine"] == engine and not r["compiled"]]
        off = statistics.median(offs) if offs else None
        for compiled in settings:
            rs = [r for r in runs if r["engine"] == engine and r["compiled"] is compiled]
            row = {"engine": engine, "compiled": compiled, "step_ms": 1000 * statistics.median(r["step_s"] for r in rs),
                   "first_step_s": statistics.median(r["first_step_s"] for r in rs),
                   "wall_s": statistics.median(r["wall_s"] for r in rs)}
            row["vs_off"] = row["step_ms"] / 1000 / off if off else None
            table.append(row)
            vs = f"{row['vs_off']:.2f}x" if off else "-"
            print(f"| {engine} | {str(compiled).lower()} | {row['step_ms']:.1f} | {row['first_step_s']:.1f} | "
                  f"{row['wall_s']:.1f} | {vs} |")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"runs": runs, "table": table}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
