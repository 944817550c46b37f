#!/usr/bin/env python
"""How long ``vramfit doctor --calibrate`` takes on this machine, part by part.

    python scripts/bench_calibration.py [--runs 3] [--vs OTHER_CHECKOUT] [--quick] [--out DIR]

Each run is its own process (``python -m launcher doctor --calibrate --json``) with ``XDG_CACHE_HOME`` and
``VRAMFIT_CACHE`` pointing at a fresh folder, so it measures from nothing and leaves this machine's own
calibration alone. The seconds are the calibration's own (``measured.seconds`` and ``measured.parts_s`` of the
file it writes) and the process's wall time (imports included). ``--vs``: another checkout of vramfit (a git
worktree of an older commit), run with this Python in turns with this one, so a drift of the machine's speed
falls on both. ``--quick``: the calibration's quick sizes (``VRAMFIT_CALIBRATE_QUICK=1``, a few seconds) instead
of the full ones this script otherwise times. Writes OUT/calibration_time.json and OUT/calibration_time.md.
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


def calibrate_once(checkout: str, quick: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="vramfit-calibration-") as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache, VRAMFIT_CACHE=os.path.join(cache, "vramfit"))
        env.pop("VRAMFIT_CALIBRATE_QUICK", None)
        if quick:
            env["VRAMFIT_CALIBRATE_QUICK"] = "1"
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "launcher", "doctor", "--calibrate", "--json"], cwd=checkout,
                           env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"calibration in {checkout} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    measured = json.loads(p.stdout)["calibration"]["machine"]["measured"]
    return {"wall_s": round(wall, 1), "seconds": measured["seconds"], "parts_s": measured["parts_s"],
            "load_average_before": measured["load_average_before"]}


def commit_of(checkout: str) -> str:
    p = subprocess.run(["git", "-C", checkout, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return p.stdout.strip()[:100] if p.returncode == 0 else checkout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="calibrations of each checkout")
    ap.add_argument("--vs", default=None, help="another vramfit checkout to calibrate in turns with this one")
    ap.add_argument("--quick", action="store_true", help="time the quick calibration (VRAMFIT_CALIBRATE_QUICK=1)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    checkouts = [ROOT] + ([os.path.abspath(a.vs)] if a.vs else [])
    runs: dict = {c: [] for c in checkouts}
    for i in range(a.runs):
        for c in checkouts:
            r = calibrate_once(c, a.quick)
            runs[c].append(r)
            print(f"run {i + 1}, {commit_of(c)[:40]}: {r['seconds']} s ({r['wall_s']} s wall)", flush=True)
    parts = sorted({k for rs in runs.values() for r in rs for k in r["parts_s"]},
                   key=lambda k: -statistics.median(r["parts_s"].get(k, 0) for r in runs[ROOT]))
    lines = ["| code | calibration s (each run) | median | process wall s (median) | "
             + " | ".join(f"{p} s (median)" for p in parts) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in parts) + " |"]
    result = {"cpus": os.cpu_count(), "runs": a.runs, "quick": a.quick, "checkouts": {}}
    for c in checkouts:
        rs = runs[c]
        med = statistics.median(r["seconds"] for r in rs)
        wall = statistics.median(r["wall_s"] for r in rs)
        part_meds = {p: round(statistics.median(r["parts_s"].get(p, 0.0) for r in rs), 1) for p in parts}
        lines.append(f"| {commit_of(c)[:60]} | {', '.join(str(r['seconds']) for r in rs)} | {med:.1f} | {wall:.1f} | "
                     + " | ".join(str(part_meds[p]) for p in parts) + " |")
        result["checkouts"][commit_of(c)] = {"runs": rs, "median_s": med, "median_wall_s": wall,
                                             "parts_median_s": part_meds}
    table = "\n".join(lines)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "calibration_time.json"), "w") as fh:
            json.dump(result, fh, indent=1)
        with open(os.path.join(a.out, "calibration_time.md"), "w") as fh:
            fh.write(f"`vramfit doctor --calibrate`, {os.cpu_count()} CPUs, each run its own process, in turns\n\n"
                     + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
