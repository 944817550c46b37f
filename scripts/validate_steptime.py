"""Predicted against measured step time, over a grid of runs on this machine, and whether the planner's pick
is the measured fastest where the grid holds a choice.

Each grid point is one training run in its own process (``vramfit bench``'s runner: warm-up steps, then
the timed ones), with the setting fixed (profile, micro-batch, checkpointing); its prediction is the step-time
model's for exactly that setting, priced with this machine's calibration (``vramfit doctor --calibrate``,
measured once and cached; nothing is fitted to this grid). The choice groups are workloads where several
settings fit: each of their settings is measured, and the planner's first choice is compared with the
fastest measured.

    .venv/bin/python scripts/validate_steptime.py --out bench/results/DATE-cpu-epyc/steptime
    .venv/bin/python scripts/validate_steptime.py --quick --out /tmp/st     # 4 points, for a smoke check

Writes OUT/validate_steptime.json and OUT/validate_steptime.md (the table printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher import bench, calibrate, planner  # noqa: E402
from launcher.config import load_config  # noqa: E402
from launcher.hardware import probe  # noqa: E402
from launcher.profiles import PROFILES  # noqa: E402

# (name, model, seq_len, global batch, micro-batch, checkpointing: off | every2 | all, profile)
GRID = [
    ("tiny-amp32-mb1", "tiny", 128, 8, 1, "off", "amp-fp32"),
    ("tiny-amp32-mb8", "tiny", 128, 8, 8, "off", "amp-fp32"),
    ("tiny-amp32-mb4-all", "tiny", 128, 8, 4, "all", "amp-fp32"),
    ("tiny-ampbf16-mb4", "tiny", 128, 8, 4, "off", "amp-bf16"),
    ("tiny-z2-32-mb2", "tiny", 128, 8, 2, "off", "zero2-fp32"),
    ("tiny-z2-32-mb8-every2", "tiny", 128, 8, 8, "every2", "zero2-fp32"),
    ("tiny-z2off-mb4", "tiny", 128, 8, 4, "off", "zero2-bf16-offload-opt"),
    ("tiny-fsdp-mb4", "tiny", 128, 8, 4, "off", "fsdp-bf16-offload"),
    ("tiny-fsdp-mb8-all", "tiny", 128, 8, 8, "all", "fsdp-bf16-offload"),
    ("125m-amp32-mb1", "llama-125m", 128, 4, 1, "off", "amp-fp32"),
    ("125m-amp32-mb4", "llama-125m", 128, 4, 4, "off", "amp-fp32"),
    ("125m-amp32-mb2-every2", "llama-125m", 128, 4, 2, "every2", "amp-fp32"),
    ("125m-ampbf16-mb2", "llama-125m", 128, 4, 2, "off", "amp-bf16"),
    ("125m-z2-32-mb2", "llama-125m", 128, 4, 2, "off", "zero2-fp32"),
    ("125m-z2-32-mb4-all", "llama-125m", 128, 4, 4, "all", "zero2-fp32"),
    ("125m-z2off-mb2", "llama-125m", 128, 4, 2, "off", "zero2-bf16-offload-opt"),
    ("125m-fsdp-mb2", "llama-125m", 128, 4, 2, "off", "fsdp-bf16-offload"),
    ("125m-fsdp-mb4-every2", "llama-125m", 128, 4, 4, "every2", "fsdp-bf16-offload"),
]
QUICK = ["tiny-amp32-mb8", "tiny-z2-32-mb2", "tiny-fsdp-mb4", "125m-amp32-mb2-every2"]
# Workloads where the planner chooses: every fitting setting of the listed profiles is measured.
CHOICES = [
    ("tiny fp32", "tiny", 128, 8, ["amp-fp32", "zero2-fp32"]),
    ("llama-125m fp32", "llama-125m", 128, 4, ["amp-fp32", "zero2-fp32"]),
    ("tiny bf16", "tiny", 128, 8, ["amp-bf16", "zero2-bf16"]),
    ("llama-125m bf16", "llama-125m", 128, 4, ["amp-bf16", "zero2-bf16"]),
    ("tiny fp32, checkpointing searched", "tiny", 256, 8, ["amp-fp32"]),
]
CKPT = {"off": ["model.gradient_checkpointing=false"],
        "every2": ["model.gradient_checkpointing=true", "model.checkpoint_every=2"],
        "all": ["model.gradient_checkpointing=true", "model.checkpoint_every=1"]}


def overrides(model: str, seq: int, gbs: int, micro: int, ckpt: str) -> list[str]:
    return [f"model.name={model}", f"data.seq_len={seq}", f"train.global_batch_size={gbs}",
            f"train.micro_batch_size={micro}", "data.num_samples=256", "device=cpu", "log.memory_interval_s=0",
            *CKPT[ckpt]]


def predicted(ov: list[str], profile: str, machine, hw) -> float | None:
    cfg = load_config(None, [*ov, f"profile={profile}"])
    row = planner.plan(cfg, hw, [profile], machine=machine).get(profile)
    return row.step_s if row is not None and row.fits else None


def run_grid(points, out: str, steps: int, warmup: int, machine, hw) -> list[dict]:
    rows = []
    for name, model, seq, gbs, micro, ckpt, profile in points:
        ov = overrides(model, seq, gbs, micro, ckpt)
        pred = predicted(ov, profile, machine, hw)
        r = bench.run_one(None, ov, profile, name, out, steps, warmup, 1800, hw)
        meas = r.get("step_s")
        err = (pred - meas) / meas * 100 if pred and meas else None
        rows.append({"name": name, "model": model, "seq_len": seq, "global_batch": gbs, "micro_batch": micro,
                     "checkpointing": ckpt, "profile": profile, "status": r.get("status"), "predicted_s": pred,
                     "measured_s": meas, "error_pct": err, "load_average": os.getloadavg()[0]})
        print(f"{name}: predicted {pred}, measured {meas}, error {err}", flush=True)
    return rows


def run_choices(out: str, steps: int, warmup: int, machine, hw) -> list[dict]:
    res = []
    for label, model, seq, gbs, profiles in CHOICES:
        precision = PROFILES[profiles[0]].precision  # the workload's precision: the plan offers only its profiles
        cfg = load_config(None, [f"model.name={model}", f"data.seq_len={seq}", f"train.global_batch_size={gbs}",
                                 "train.micro_batch_size=auto", "device=cpu", f"precision={precision}"])
        plan = planner.plan(cfg, hw, profiles, machine=machine)
        cands = plan.candidates
        measured = []
        for i, c in enumerate(cands):
            ck = "off" if not c["checkpointing"] else ("all" if c["checkpoint_every"] == 1 else "every2")
            if ck == "every2" and c["checkpoint_every"] != 2:
                ck = "all"
            ov = overrides(model, seq, gbs, c["micro_batch"], ck)
            if c["checkpointing"] and c["checkpoint_every"] not in (1, 2):
                ov = [*ov[:-2], "model.gradient_checkpointing=true", f"model.checkpoint_every={c['checkpoint_every']}"]
            r = bench.run_one(None, ov, c["profile"], f"choice-{len(res)}-{i}", out, steps, warmup, 1800, hw)
            measured.append({**c, "measured_s": r.get("step_s"), "status": r.get("status")})
        ok = [m for m in measured if m["measured_s"]]
        fastest = min(ok, key=lambda m: m["measured_s"]) if ok else None
        pick = measured[0] if measured else None
        res.append({"workload": label, "candidates": measured, "planner_pick": pick, "measured_fastest": fastest,
                    "pick_is_fastest": bool(pick and fastest and pick["profile"] == fastest["profile"]
                                            and pick["setting"] == fastest["setting"]),
                    "pick_within_5pct": bool(pick and fastest and pick.get("measured_s")
                                             and pick["measured_s"] <= 1.05 * fastest["measured_s"])})
        print(f"choice {label}: pick {pick and pick['profile']} {pick and pick['setting']}, fastest "
              f"{fastest and fastest['profile']} {fastest and fastest['setting']}", flush=True)
    return res


def markdown(doc: dict) -> str:
    lines = [f"# Step time: predicted against measured ({doc['date']})", "",
             f"Machine: {doc['machine']} ({doc['calibration_source']}); {doc['steps']} timed steps after "
             f"{doc['warmup']} warm-up, each run in its own process.", "",
             "| run | profile | micro-batch | checkpointing | predicted s | measured s | error |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in doc["grid"]:
        e = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        p = "-" if r["predicted_s"] is None else f"{r['predicted_s']:.4f}"
        m = "-" if r["measured_s"] is None else f"{r['measured_s']:.4f}"
        lines.append(f"| {r['name']} | `{r['profile']}` | {r['micro_batch']} | {r['checkpointing']} | {p} | {m} | {e} |")
    s = doc["summary"]
    lines += ["", f"Median |error| {s['median_abs_error_pct']:.1f}%, worst {s['max_abs_error_pct']:.1f}% over "
                  f"{s['points']} runs (targets: median <= 15%, worst <= 35%)."]
    if doc.get("choices"):
        lines += ["", "| workload | planner's pick | measured fastest | pick is fastest | within 5% |", "| --- | --- | --- | --- | --- |"]
        for c in doc["choices"]:
            pick, fast = c["planner_pick"] or {}, c["measured_fastest"] or {}
            lines.append(f"| {c['workload']} | {pick.get('profile')}, {pick.get('setting')} | {fast.get('profile')}, "
                         f"{fast.get('setting')} | {'yes' if c['pick_is_fastest'] else 'no'} | "
                         f"{'yes' if c['pick_within_5pct'] else 'no'} |")
        lines += ["", f"The planner's pick was the measured fastest in {s['picks_fastest']} of {len(doc['choices'])} "
                      "workloads (target >= 80%)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="four grid points, no choice groups")
    ap.add_argument("--no-choices", action="store_true")
    a = ap.parse_args()
    if os.path.exists(a.out) and os.listdir(a.out):
        print(f"validate_steptime: {a.out} holds earlier results; choose another --out", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    hw = probe()
    machine = calibrate.load_or_calibrate()
    t0 = time.perf_counter()
    points = [g for g in GRID if g[0] in QUICK] if a.quick else GRID
    grid = run_grid(points, a.out, a.steps, a.warmup, machine, hw)
    choices = [] if a.quick or a.no_choices else run_choices(a.out, a.steps, a.warmup, machine, hw)
    errs = [abs(r["error_pct"]) for r in grid if r["error_pct"] is not None]
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.name, "calibration_source": machine.source,
           "steps": a.steps, "warmup": a.warmup, "grid": grid, "choices": choices, "seconds": round(time.perf_counter() - t0),
           "summary": {"points": len(errs), "median_abs_error_pct": statistics.median(errs) if errs else float("nan"),
                       "max_abs_error_pct": max(errs) if errs else float("nan"),
                       "picks_fastest": sum(c["pick_is_fastest"] for c in choices)}}
    with open(os.path.join(a.out, "validate_steptime.json"), "w") as fh:
        json.dump(doc, fh, indent=2)
    text = markdown(doc)
    with open(os.path.join(a.out, "validate_steptime.md"), "w") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
