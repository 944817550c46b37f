"""What fixing glibc's mmap threshold at 4 MiB (``memory.mmap_threshold_mib``, launcher/machine/heap.py; what ``auto``
does with several ranks) costs and saves on one rank: the step time and the peak RSS of the same short run with
it and with glibc's own heap (``memory.mmap_threshold_mib=0``, what ``auto`` does on one rank), taken in turns so
that a slower stretch of the machine falls on both.

The model is scripts/validate_ranks.py's (a 45.4M-parameter Llama whose embedding and head, 62.5 MiB each in
fp32, are above glibc's largest mmap threshold and whose layers' tensors, 1-2.7 MiB, are below it), micro-batch 4 of 128
tokens; each run takes ``--steps`` optimizer steps and its step time is the median of the steps after the
second. Each run is its own process, as a training run is.

    python scripts/bench_heap.py --out bench/results/DATE-cpu-NAME/heap [--rounds 2] [--profiles ...]

Writes ``heap.json`` and ``heap.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

PROFILES = ("amp-fp32", "zero2-fp32", "fsdp-bf16-offload", "zero3-bf16-offload-all")
SETTINGS = (4, 0)  # memory.mmap_threshold_mib: fixed at 4 MiB, glibc's own
MiB = 2**20


def one(model: str, profile: str, threshold_mib: int, steps: int, out: str) -> dict:
    name = f"{profile}-{threshold_mib:g}-{time.monotonic_ns()}"
    args = [f"model.name={model}", f"profile={profile}", f"train.max_steps={steps}", "train.warmup_steps=1",
            "train.micro_batch_size=4", "train.global_batch_size=4", "data.seq_len=128", "data.num_samples=256",
            "sample_tokens=0", "device=cpu", f"output_dir={out}", f"run_name={name}", "checkpoint.save=false",
            "log.memory_interval_s=0", f"memory.mmap_threshold_mib={threshold_mib}"]
    r = subprocess.run([sys.executable, "-m", "launcher", "train", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"{profile} with memory.mmap_threshold_mib={threshold_mib} failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, name, "metrics.jsonl"))]
    s = json.load(open(os.path.join(out, name, "summary.json")))
    times = {r["step"]: r["time_s"] for r in rows}  # since the loop started, at each step's end
    step_s = statistics.median(times[k] - times[k - 1] for k in times if k > 2 and k - 1 in times)
    return {"step_s": step_s, "peak_rss_bytes": s["peak_cpu_rss_hwm_bytes"], "planned_cpu_bytes": s["predicted_cpu_bytes"]}


def markdown(rows: list[dict]) -> str:
    lines = ["| profile | heap | step s (each run) | peak RSS MiB (each run) | planned MiB | step time / glibc's | "
             "peak / glibc's |", "| --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["profile"], r["threshold_mib"]): r for r in rows}
    for r in rows:
        base = by.get((r["profile"], 0))
        heap = "glibc's default" if r["threshold_mib"] == 0 else f"fixed at {r['threshold_mib']} MiB"
        ratio_t = statistics.median(r["step_s"]) / statistics.median(base["step_s"]) if base else None
        ratio_m = statistics.median(r["peak_rss_bytes"]) / statistics.median(base["peak_rss_bytes"]) if base else None
        lines.append(f"| {r['profile']} | {heap} | " + ", ".join(f"{t:.3f}" for t in r["step_s"]) + " | "
                     + ", ".join(f"{m / MiB:.0f}" for m in r["peak_rss_bytes"]) + f" | {r['planned_cpu_bytes'] / MiB:.0f} | "
                     + (f"{ratio_t:.3f}" if ratio_t else "-") + " | " + (f"{ratio_m:.3f}" if ratio_m else "-") + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    import validate_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-heap-")  # run directories and the model: not results
    model = validate_ranks.make_model(os.path.join(work, "model"))
    rows = {(p, h): {"profile": p, "threshold_mib": h, "step_s": [], "peak_rss_bytes": []}
            for p in a.profiles.split(",") for h in SETTINGS}
    for rnd in range(a.rounds):
        for p in a.profiles.split(","):
            for h in (SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]):  # in turns, each first in one round
                m = one(model, p, h, a.steps, work)
                rows[p, h]["step_s"].append(m["step_s"])
                rows[p, h]["peak_rss_bytes"].append(m["peak_rss_bytes"])
                rows[p, h]["planned_cpu_bytes"] = m["planned_cpu_bytes"]
                print(f"round {rnd + 1} {p} threshold {h} MiB: {m['step_s']:.3f} s/step, peak {m['peak_rss_bytes'] / MiB:.0f} MiB",
                      flush=True)
    out = list(rows.values())
    with open(os.path.join(a.out, "heap.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "rows": out}, f, indent=1)
    with open(os.path.join(a.out, "heap.md"), "w") as f:
        f.write(markdown(out))
    print(markdown(out))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
