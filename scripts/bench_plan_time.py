#!/usr/bin/env python
"""How long ``vramfit plan --compare-gpus`` takes, with the trace cache empty and then filled.

    python scripts/bench_plan_time.py [--repeats 2] [--workers 0,2] [--quick-calibration] [--out DIR] [-- key=value ...]

Default job: llama-7b, LoRA r=16, sequence 512, 32 GiB of host RAM, every GPU of the catalogue. Each run is
its own process (``python -m launcher plan ... --compare-gpus``) with ``VRAMFIT_CACHE`` pointing at a fresh
folder that holds this machine's calibration (copied, so nothing is measured again) and, for the warm runs,
the traces the cold run kept. ``--workers``: the trace worker processes (``VRAMFIT_TRACE_WORKERS``) to compare,
run in turns within each repeat (default: the plan's own choice). Prints the wall times, the number of traces
kept and their size; writes OUT/plan_time.json and OUT/plan_time.md. ``--quick-calibration``: instead of this
machine's cached calibration, a quick one (``launcher.measure.timing.Sizes.quick``: seconds, rough) measured first
into a temporary folder, for a machine that has none (``--compare-gpus`` would otherwise measure one in the cold
run, about a minute); with ``--repeats 1 -- model.name=tiny`` a quick check that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launcher.paths import cache_root  # noqa: E402

JOB = ["model.name=llama-7b", "lora.r=16", "data.seq_len=512", "memory.cpu_budget=32"]


def run(cache: str, job: list[str], workers: str | None) -> tuple[float, str]:
    env = dict(os.environ, VRAMFIT_CACHE=cache)
    env.pop("VRAMFIT_TRACE_CACHE", None)
    env.pop("VRAMFIT_TRACE_WORKERS", None)
    if workers is not None:
        env["VRAMFIT_TRACE_WORKERS"] = workers
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "launcher", "plan", *job, "--compare-gpus"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    dt = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"plan failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return dt, p.stdout


def kept_kinds(files: list[str]) -> dict[str, int]:
    """Kept traces counted by micro-batch; above 3, 'exact' (a setting kept, traced exactly) apart from
    'direct' (the search's, traced because extrapolating from micro-batches 2 and 3 did not apply). The key
    kept in each file ends with the micro-batch (in its TraceSettings) and whether it was asked exactly."""
    out: dict[str, int] = {}
    for f in files:
        key = json.load(gzip.open(f))["key"]
        found = re.search(r"batch_size=(\d+)", key)
        if found is None:  # not a trace: a value the plan keeps with them (parameter counts, the loss check)
            out["values"] = out.get("values", 0) + 1
            continue
        batch = int(found.group(1))
        kind = str(batch) if batch <= 3 else f"{batch} {'exact' if key.rstrip(')').endswith('True') else 'direct'}"
        out[kind] = out.get(kind, 0) + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="cold and warm runs each (cold: an empty trace cache)")
    ap.add_argument("--workers", default=None, help="comma-separated VRAMFIT_TRACE_WORKERS values to run in turns")
    ap.add_argument("--quick-calibration", action="store_true",
                    help="measure a quick, rough calibration first and plan with it instead of this machine's own")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    job = a.overrides or JOB
    quick = tempfile.TemporaryDirectory() if a.quick_calibration else None
    if quick is not None:
        from launcher.measure import calibrate, timing

        calibrate.calibration(True, directory=quick.name, sizes=timing.Sizes.quick(), output_dir=quick.name)
    machines = glob.glob(os.path.join(quick.name if quick else cache_root(), "machine-*.json"))
    if not machines:
        raise SystemExit("no calibration of this machine: run `vramfit doctor --calibrate` first")
    variants = a.workers.split(",") if a.workers else [None]
    got = {w: {"cold_s": [], "warm_s": []} for w in variants}
    traces, size, table, kinds = 0, 0, None, {}
    for _ in range(a.repeats):
        for w in variants:
            with tempfile.TemporaryDirectory() as cache:
                for m in machines:
                    shutil.copy(m, cache)
                dt, cold_table = run(cache, job, w)
                got[w]["cold_s"].append(dt)
                files = glob.glob(os.path.join(cache, "traces", "*.json.gz"))
                traces, size = len(files), sum(os.path.getsize(f) for f in files)
                kinds = kept_kinds(files)
                dt, again = run(cache, job, w)
                got[w]["warm_s"].append(dt)
                if again != cold_table:
                    raise SystemExit("the plan read from kept traces differs from the traced one")
                if table is not None and cold_table != table:
                    raise SystemExit(f"the plan with VRAMFIT_TRACE_WORKERS={w} differs from the one before")
                table = cold_table
    rows = {("default" if w is None else w): {**v, "cold_median_s": statistics.median(v["cold_s"]),
                                              "warm_median_s": statistics.median(v["warm_s"])} for w, v in got.items()}
    if quick is not None:
        quick.cleanup()
    result = {"job": job, "quick_calibration": a.quick_calibration, "by_workers": rows, "traces_kept": traces,
              "trace_bytes": size, "traces_by_kind": kinds, "cpus": os.cpu_count(),
              "load_average": list(os.getloadavg())}
    md = (f"`vramfit plan {' '.join(job)} --compare-gpus`, {os.cpu_count()} CPUs, each run its own process"
          + (", priced by a quick calibration (rough)" if a.quick_calibration else "")
          + (", the worker counts in turns" if a.workers else "") + "\n\n"
          "| trace workers | trace cache | wall s (each run) | median |\n| --- | --- | --- | --- |\n"
          + "".join(f"| {w} | empty | {', '.join(f'{x:.1f}' for x in v['cold_s'])} | {v['cold_median_s']:.1f} |\n"
                    f"| {w} | filled by the run before | {', '.join(f'{x:.1f}' for x in v['warm_s'])} | "
                    f"{v['warm_median_s']:.1f} |\n" for w, v in rows.items())
          + f"\ntraces kept: {traces} files, {size / 2**20:.2f} MiB; by micro-batch: "
          + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + f"\n\n```\n{table}```\n")
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump(result, open(os.path.join(a.out, "plan_time.json"), "w"), indent=2)
        open(os.path.join(a.out, "plan_time.md"), "w").write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
