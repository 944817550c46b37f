#!/usr/bin/env python
"""Step time with and without a busy neighbour process, per thread setting: what ``train.threads=auto`` decides.

    python scripts/bench_threads.py [--steps 30] [--repeats 2] [--profiles amp-fp32,zero2-fp32]
                                    [--settings 1,2,2-passive,auto] [--json OUT]

Each run is ``python -m launcher train`` of the built-in demo (tiny Llama, synthetic task) on the CPU, its
step time the median of ``time_s`` differences over steps 3..N of metrics.jsonl. Settings: ``train.threads``
1, 2 (as many as cores, torch's default), 2 with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads sleep at once
after a parallel region instead of spinning first), and ``auto``. The neighbour is one process spinning in
a busy loop (``while True: pass``), started before the run and killed after it, not pinned: the scheduler
places it, as on a shared VPS. Runs alternate, alone and beside the neighbour, setting by setting, so a load
change on a shared machine hits all alike; the load average before each run is recorded. The figure that
matters: a setting's step beside the neighbour over the best step alone (a fair share of 2 cores is 2x).
``--settings``: only these of the settings (default all; e.g. ``--settings auto --profiles amp-fp32 --repeats 1
--steps 3`` is a quick check that the benchmark still runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = [("1", {}), ("2", {}), ("2-passive", {"OMP_WAIT_POLICY": "PASSIVE"}), ("auto", {})]


def run(profile: str, threads: str, env_extra: dict, steps: int, out: str, name: str) -> dict:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, "-m", "launcher", "train", "device=cpu", f"profile={profile}", f"train.max_steps={steps}",
           "train.warmup_steps=2", "checkpoint.save=false", "sample_tokens=0", "log.progress=off",
           f"train.threads={threads.split('-')[0]}", f"output_dir={out}", f"run_name={name}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    rows = [json.loads(ln) for ln in open(os.path.join(out, name, "metrics.jsonl"))]
    t = [r["time_s"] for r in rows]
    summary = json.load(open(os.path.join(out, name, "summary.json")))
    return {"step_s": statistics.median(b - a for a, b in zip(t[1:], t[2:])),
            "intra_op": summary["threads"]["intra_op"], "reason": summary["threads"]["reason"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profiles", default="amp-fp32,zero2-fp32")
    ap.add_argument("--settings", default=",".join(label for label, _ in SETTINGS),
                    help="comma-separated settings to run (default: all of them)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    known = dict(SETTINGS)
    unknown = [s for s in a.settings.split(",") if s not in known]
    if unknown:
        ap.error(f"--settings: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    settings = [(s, known[s]) for s in a.settings.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as out:
        n = 0
        for profile in a.profiles.split(","):
            for rep in range(a.repeats):
                for label, env in settings:
                    for busy in (False, True):
                        load = os.getloadavg()[0]
                        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                        try:
                            r = run(profile, label, env, a.steps, out, f"r{n}")
                        finally:
                            if hog is not None:
                                hog.kill()
                                hog.wait()
                        n += 1
                        r.update(profile=profile, setting=label, neighbour=busy, repeat=rep, load_average=load)
                        results.append(r)
                        print(f"{profile} threads={label:9s} {'neighbour' if busy else 'alone    '} "
                              f"{r['step_s'] * 1000:7.1f} ms/step (intra-op {r['intra_op']}; load {load:.2f})",
                              flush=True)
    table = []
    for profile in a.profiles.split(","):
        rows = [r for r in results if r["profile"] == profile]
        best_alone = min(statistics.median(r["step_s"] for r in rows if r["setting"] == s and not r["neighbour"])
                         for s, _ in settings)
        for s, _ in settings:
            alone = statistics.median(r["step_s"] for r in rows if r["setting"] == s and not r["neighbour"])
            beside = statistics.median(r["step_s"] for r in rows if r["setting"] == s and r["neighbour"])
            table.append({"profile": profile, "setting": s, "alone_ms": alone * 1000, "neighbour_ms": beside * 1000,
                          "neighbour_vs_best_alone": beside / best_alone, "neighbour_vs_own_alone": beside / alone})
    print("\n| profile | train.threads | alone (ms/step) | with a busy neighbour | vs best alone | vs own alone |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for t in table:
        print(f"| {t['profile']} | {t['setting']} | {t['alone_ms']:.1f} | {t['neighbour_ms']:.1f} | "
              f"{t['neighbour_vs_best_alone']:.2f}x | {t['neighbour_vs_own_alone']:.2f}x |")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"runs": results, "table": table, "cores": os.cpu_count()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
