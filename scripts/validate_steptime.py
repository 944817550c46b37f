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
    python scripts/validate_steptime.py --points tiny-amp32-mb8 --steps 1 --warmup 1 --out /tmp/st  # one point
    python scripts/validate_steptime.py --gpu --out OUT/steptime            # the GPU grid (scripts/gpu_bench.sh)
    python scripts/validate_steptime.py --gpu --list                        # print the grid, run nothing

``--gpu``: a small grid on the CUDA device (``device=cuda``, seq 512, llama-125m to llama-1b, the 16-bit
profiles), on the card as it is and with ``memory.gpu_budget`` capped at a T4's and an RTX 3090's usable memory,
for the prediction and the run alike; no choice groups. Without a CUDA device it runs nothing, says why and
exits 0. ``--set KEY=VALUE`` adds an override to every point, prediction and run (``--set
memory.gpu_budget=14.75``: every point under that cap). A point whose profile cannot run here (DeepSpeed not
importable) is skipped with the reason.

Writes OUT/validate_steptime.json, OUT/validate_steptime.md (the table printed last), OUT/summary.txt (one line:
median and worst error) and OUT/calibration.json (the speeds the predictions used), rewritten after every point,
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.config.load import load_config  # noqa: E402
from launcher.config.profiles import PROFILES  # noqa: E402
from launcher.config.schema import ConfigError  # noqa: E402
from launcher.machine import speeds
from launcher.machine.hardware import probe  # noqa: E402
from launcher.measure import bench, calibrate
from launcher.plan import (
    availability,  # noqa: E402
    planner,
)

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

# The GPU grid (--gpu): seq 512, on the card as it is and capped at the usable memory of a T4 and of an RTX 3090 as
# torch reports them (launcher/plan/gpus.py; the caps of scripts/gpu_bench.sh). "{p}": bf16 on compute capability >= 8,
# else fp16. Cheapest first, so a run cut short by a time box keeps the most points. A point's wall time is mostly
# process start and engine set-up (plus, once, the calibration of a fresh host); llama-1b's CPU Adam is the longest.
T4_GIB, RTX3090_GIB = 14.75, 23.69
# (name, model, seq_len, global batch, micro-batch, checkpointing, profile, memory.gpu_budget or None)
GPU_GRID = [
    ("125m-amp-mb8-card", "llama-125m", 512, 8, 8, "off", "amp-{p}", None),
    ("125m-z2-mb2-every2-card", "llama-125m", 512, 8, 2, "every2", "zero2-{p}", None),
    ("350m-amp-mb8-all-16gb", "llama-350m", 512, 8, 8, "all", "amp-{p}", T4_GIB),
    ("350m-z2off-mb4-16gb", "llama-350m", 512, 8, 4, "off", "zero2-{p}-offload-opt", T4_GIB),
    ("125m-fsdp-mb4-card", "llama-125m", 512, 8, 4, "off", "fsdp-{p}-offload", None),
    ("350m-fsdp-mb1-all-16gb", "llama-350m", 512, 8, 1, "all", "fsdp-{p}-offload", T4_GIB),
    ("1b-z2off-mb4-every2-24gb", "llama-1b", 512, 8, 4, "every2", "zero2-{p}-offload-opt", RTX3090_GIB),
]
GPU_QUICK = ["125m-amp-mb8-card", "125m-z2-mb2-every2-card", "350m-amp-mb8-all-16gb"]
WITHIN_PCT = 20  # the GPU grid's target: every point within this |error|


def overrides(model: str, seq: int, gbs: int, micro: int, ckpt: str, device: str = "cpu") -> list[str]:
    return [f"model.name={model}", f"data.seq_len={seq}", f"train.global_batch_size={gbs}",
            f"train.micro_batch_size={micro}", "data.num_samples=256", f"device={device}", "log.memory_interval_s=0",
            *CKPT[ckpt]]


def gpu_points(hw) -> tuple[list[tuple], str]:
    """The GPU grid at this card's 16-bit precision (bf16 from compute capability 8.0, as launcher.machine.hardware decides),
    and that precision; bf16 where no GPU is seen (for --list)."""
    g = hw.gpu(0) if hw.has_cuda else None
    prec = "bf16" if g is None or g.bf16 else "fp16"
    return [(name, *rest, profile.format(p=prec), budget) for name, *rest, profile, budget in GPU_GRID], prec


def point_overrides(point: tuple, device: str, sets: list[str]) -> list[str]:
    """A grid point's overrides, its memory.gpu_budget, then --set (last, so they win)."""
    name, model, seq, gbs, micro, ckpt, profile, budget = point
    budget_ov = [f"memory.gpu_budget={budget}"] if budget is not None else []
    return [*overrides(model, seq, gbs, micro, ckpt, device), *budget_ov, *sets]


def cannot_run(ov: list[str], profile: str, hw) -> str | None:
    """Why ``profile`` cannot run here at all (DeepSpeed not importable, no FSDP2), from launcher.plan.availability."""
    cfg = load_config(None, [*ov, f"profile={profile}"])
    return availability.assess(cfg, hw).problems.get(profile)


def predicted(ov: list[str], profile: str, machine, hw) -> float | None:
    cfg = load_config(None, [*ov, f"profile={profile}"])
    row = planner.plan(cfg, hw, [profile], machine=machine).get(profile)
    return row.step_s if row is not None and row.fits else None


def keep_fastest(entry: dict, r: dict) -> None:
    """One more measurement ``r`` (bench.run_one's result) of a point or candidate: the fastest of them is kept."""
    entry["measured_passes"].append(r.get("step_s"))
    fastest_pass(entry)
    entry["status"] = "ok" if entry["measured_s"] else r.get("status")


def fastest_pass(entry: dict) -> None:
    """``measured_s``: the fastest of a point's or candidate's ``measured_passes`` (None: none measured)."""
    done = [x for x in entry["measured_passes"] if x]
    entry["measured_s"] = min(done) if done else None


def error_pct(pred: float | None, meas: float | None) -> float | None:
    return (pred - meas) / meas * 100 if pred and meas else None


def rescore(doc: dict) -> dict:
    """A finished grid's results with every point and candidate keeping the fastest of its passes (``--rescore``:
    a grid measured by a version of this script that kept another pass; nothing is measured again)."""
    for row in doc["grid"]:
        if row.get("measured_passes"):  # a skipped point has none
            fastest_pass(row)
            row["error_pct"] = error_pct(row["predicted_s"], row["measured_s"])
    for i, c in enumerate(doc.get("choices") or []):
        for m in c["candidates"]:
            fastest_pass(m)
        doc["choices"][i] = choice_result(c["workload"], c["candidates"])
    for r in doc["grid"]:
        r.pop("speed", None)  # an earlier version's pick of a pass; every pass's probes stay in speed_passes
    planned = doc.get("summary", {}).get("planned_points", len(doc["grid"]))
    doc["summary"] = summarize(doc["grid"], planned, doc.get("choices") or [])
    doc["rescored"] = "each point and candidate: the fastest of its passes"
    return doc


def run_grid(points, out: str, steps: int, warmup: int, machine, hw, *, device: str = "cpu", sets=(),
             timeout: float = 1800, save=None, passes: int = 1) -> list[dict]:
    """Each point: predicted, then measured in its own process, in ``passes`` passes over the whole grid; a point
    keeps its fastest measurement (each pass's is in ``measured_passes``), as the calibration keeps the fastest of
    its rounds: a machine that slows for a stretch slows one pass of a point, not its result. ``save(rows)``
    after every run."""
    rows: list[dict] = []
    for n in range(passes):
        for i, point in enumerate(points):
            name, model, seq, gbs, micro, ckpt, profile, budget = point
            if n == 0:
                ov = point_overrides(point, device, list(sets))
                row = {"name": name, "model": model, "seq_len": seq, "global_batch": gbs, "micro_batch": micro,
                       "checkpointing": ckpt, "profile": profile, "gpu_budget": budget, "overrides": ov}
                why = cannot_run(ov, profile, hw)
                if why:
                    rows.append({**row, "status": "skipped", "error": why, "predicted_s": None, "measured_s": None,
                                 "error_pct": None})
                    print(f"{name}: skipped, {profile} cannot run here: {why}", flush=True)
                    if save is not None:
                        save(rows)
                    continue
                try:  # a planner failure costs this point's prediction, not the points after it (a time-boxed GPU host)
                    pred, pred_error = predicted(ov, profile, machine, hw), None
                except Exception as e:
                    pred, pred_error = None, f"{type(e).__name__}: {e}"
                    print(f"{name}: no prediction, {pred_error}", flush=True)
                row.update(predicted_s=pred, prediction_error=pred_error, measured_passes=[])
                rows.append(row)
            row = rows[i]
            if n and row.get("status") == "skipped":
                continue
            r = bench.run_one(None, row["overrides"], profile, name if n == 0 else f"{name}-pass{n + 1}", out, steps,
                              warmup, timeout, hw)
            keep_fastest(row, r)
            meas, pred = row["measured_s"], row["predicted_s"]
            err = error_pct(pred, meas)
            row.update(error=None if meas else r.get("error"), error_pct=err,
                       wall_s=round(row.get("wall_s", 0) + (r.get("wall_s") or 0), 1), load_average=os.getloadavg()[0])
            print(f"{name} (pass {n + 1} of {passes}): predicted {pred}, measured {r.get('step_s')}, kept {meas}, "
                  f"error {err}", flush=True)
            if save is not None:
                save(rows)
    return rows


def run_choices(out: str, steps: int, warmup: int, machine, hw, *, sets=(), timeout: float = 1800,
                passes: int = 1) -> list[dict]:
    """Each workload's candidates measured in turns, ``passes`` times; each keeps its fastest (as the grid)."""
    res = []
    for label, model, seq, gbs, profiles in CHOICES:
        precision = PROFILES[profiles[0]].precision  # the workload's precision: the plan offers only its profiles
        cfg = load_config(None, [f"model.name={model}", f"data.seq_len={seq}", f"train.global_batch_size={gbs}",
                                 "train.micro_batch_size=auto", "device=cpu", f"precision={precision}", *sets])
        plan = planner.plan(cfg, hw, profiles, machine=machine)
        cands = plan.candidates
        measured = [{**c, "measured_s": None, "status": None, "measured_passes": []} for c in cands]
        for n in range(passes):
            for i, (c, m) in enumerate(zip(cands, measured)):
                ck = "off" if not c["checkpointing"] else ("all" if c["checkpoint_every"] == 1 else "every2")
                if ck == "every2" and c["checkpoint_every"] != 2:
                    ck = "all"
                ov = overrides(model, seq, gbs, c["micro_batch"], ck)
                if c["checkpointing"] and c["checkpoint_every"] not in (1, 2):
                    ov = [*ov[:-2], "model.gradient_checkpointing=true", f"model.checkpoint_every={c['checkpoint_every']}"]
                r = bench.run_one(None, [*ov, *sets], c["profile"], f"choice-{len(res)}-{i}" + (f"-pass{n + 1}" if n else ""),
                                  out, steps, warmup, timeout, hw)
                keep_fastest(m, r)
        res.append(choice_result(label, measured))
        pick, fastest = res[-1]["planner_pick"], res[-1]["measured_fastest"]
        print(f"choice {label}: pick {pick and pick['profile']} {pick and pick['setting']}, fastest "
              f"{fastest and fastest['profile']} {fastest and fastest['setting']}", flush=True)
    return res


def choice_result(label: str, measured: list[dict]) -> dict:
    """A workload's candidates as measured (the planner's first choice first): its pick against the fastest."""
    ok = [m for m in measured if m["measured_s"]]
    fastest = min(ok, key=lambda m: m["measured_s"]) if ok else None
    pick = measured[0] if measured else None
    return {"workload": label, "candidates": measured, "planner_pick": pick, "measured_fastest": fastest,
            "pick_is_fastest": bool(pick and fastest and pick["profile"] == fastest["profile"]
                                    and pick["setting"] == fastest["setting"]),
            "pick_within_5pct": bool(pick and fastest and pick.get("measured_s")
                                     and pick["measured_s"] <= 1.05 * fastest["measured_s"])}


def summarize(rows: list[dict], planned: int, choices: list[dict]) -> dict:
    errs = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    return {"points": len(errs), "planned_points": planned, "done_points": len(rows),
            "median_abs_error_pct": statistics.median(errs) if errs else float("nan"),
            "max_abs_error_pct": max(errs) if errs else float("nan"),
            f"within_{WITHIN_PCT}pct": sum(e <= WITHIN_PCT for e in errs),
            "skipped": [r["name"] for r in rows if r["status"] == "skipped"],
            "no_error": [f"{r['name']} ({why_no_error(r)})" for r in rows
                         if r["status"] != "skipped" and r["error_pct"] is None],
            "picks_fastest": sum(c["pick_is_fastest"] for c in choices)}


def why_no_error(r: dict) -> str:
    if r["measured_s"] is None:
        return f"run {r['status']}"
    return "prediction failed" if r.get("prediction_error") else "the planner says it does not fit"


def targets(doc: dict) -> str:
    return f"target: within {WITHIN_PCT}%" if doc["device"] == "cuda" else "targets: median <= 15%, worst <= 35%"


def summary_line(doc: dict) -> str:
    """One line for scripts/gpu_bench.sh's last table (OUT/summary.txt)."""
    head = f"step time, predicted vs measured ({doc['grid_name']} grid)"
    if doc.get("skipped"):
        return f"{head}: skipped, {doc['skipped']}"
    s = doc["summary"]
    if s["points"]:
        text = (f"{head}: median |error| {s['median_abs_error_pct']:.1f}%, worst {s['max_abs_error_pct']:.1f}%, "
                f"{s[f'within_{WITHIN_PCT}pct']} of {s['points']} within {WITHIN_PCT}% ({targets(doc)})")
    else:
        text = f"{head}: no point has both a prediction and a measurement"
    if s["no_error"]:
        text += f"; no error for {', '.join(s['no_error'])}"
    if s["skipped"]:
        text += f"; skipped {', '.join(s['skipped'])} (cannot run here)"
    if not doc["finished"]:
        text += f"; cut short after {s['done_points']} of {s['planned_points']} points"
    return text


def markdown(doc: dict) -> str:
    if doc.get("skipped"):
        return f"# Step time: predicted against measured ({doc['date']})\n\n{summary_line(doc)}\n"
    budgets = any(r.get("gpu_budget") is not None for r in doc["grid"])
    lines = [f"# Step time: predicted against measured ({doc['date']})", "",
             f"Machine: {doc['machine']} ({doc['calibration_source']}); {doc['steps']} timed steps after "
             f"{doc['warmup']} warm-up, each run in its own process"
             + (f"; each point the fastest of {doc['passes']} passes over the grid (every pass: `measured_passes` in "
                "the JSON)." if doc.get("passes", 1) > 1 else "."), "",
             "| run | profile | micro-batch | checkpointing |" + (" GPU budget GiB |" if budgets else "")
             + " predicted s | measured s | error |",
             "| --- | --- | ---: | --- |" + (" ---: |" if budgets else "") + " ---: | ---: | ---: |"]
    for r in doc["grid"]:
        e = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        p = "-" if r["predicted_s"] is None else f"{r['predicted_s']:.4f}"
        m = (r["status"] or "-") if r["measured_s"] is None else f"{r['measured_s']:.4f}"
        b = f" {'card' if r.get('gpu_budget') is None else r['gpu_budget']} |" if budgets else ""
        lines.append(f"| {r['name']} | `{r['profile']}` | {r['micro_batch']} | {r['checkpointing']} |{b} {p} | {m} | {e} |")
    s = doc["summary"]
    lines += ["", f"Median |error| {s['median_abs_error_pct']:.1f}%, worst {s['max_abs_error_pct']:.1f}% over "
                  f"{s['points']} runs, {s[f'within_{WITHIN_PCT}pct']} within {WITHIN_PCT}% ({targets(doc)})."
              if s["points"] else "No run has both a prediction and a measurement."]
    if not doc["finished"]:
        lines += ["", f"Cut short: {s['done_points']} of {s['planned_points']} points done."]
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


def write_results(out: str, doc: dict) -> None:
    """The JSON, the table and the one-line summary, each replaced whole (a reader never sees half a file)."""
    for name, text in (("validate_steptime.json", json.dumps(doc, indent=2)), ("validate_steptime.md", markdown(doc)),
                       ("summary.txt", summary_line(doc) + "\n")):
        path = os.path.join(out, name)
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the results, new or empty (not needed with --list)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--quick", action="store_true", help="four grid points (three with --gpu), no choice groups")
    ap.add_argument("--no-choices", action="store_true")
    ap.add_argument("--points", default=None, metavar="NAME,...",
                    help="only these grid points (names as --list prints them), no choice groups: a check that the "
                         "script still runs, in seconds rather than the grid's minutes")
    ap.add_argument("--gpu", action="store_true",
                    help=f"the GPU grid instead: {len(GPU_GRID)} points, device=cuda, seq 512, on the card and with "
                         f"memory.gpu_budget={T4_GIB} and {RTX3090_GIB} (a T4's and an RTX 3090's usable GiB); no choice "
                         "groups; without a CUDA device it runs nothing, says why and exits 0")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="an override for every point, its prediction and its run (repeat for more; last wins), "
                         "e.g. --set memory.gpu_budget=14.75")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds per training run before it is stopped and recorded as timed out (default 1800, "
                         "for a slow CPU; scripts/gpu_bench.sh gives a GPU point 120)")
    ap.add_argument("--passes", type=int, default=1,
                    help="measure every point (and choice candidate) this many times, in passes over the whole grid, "
                         "and keep each one's fastest (default 1; 2 on a CPU whose speed switches over seconds)")
    ap.add_argument("--list", action="store_true", help="print the grid points and their overrides, run nothing")
    ap.add_argument("--rescore", metavar="DIR",
                    help="measure nothing: read DIR/validate_steptime.json, keep each point's fastest pass, and write "
                         "the results to --out")
    ap.add_argument("--recalibrate", action="store_true",
                    help="measure this machine now rather than use the cached calibration (a shared CPU's speed "
                         "drifts over hours: its bf16 matmuls ran at 1.16 and at 0.5 TFLOP/s on one 2-core Xeon "
                         "the same day)")
    a = ap.parse_args()
    if a.passes < 1:
        ap.error(f"--passes: got {a.passes}; rule: at least one measurement per point; fix: --passes 2")
    bad = [s for s in a.sets if "=" not in s]
    if bad:
        ap.error(f"--set: got {bad}; rule: KEY=VALUE, as on vramfit's command line; fix: e.g. --set memory.gpu_budget=14.75")
    if a.rescore:
        if not a.out or (os.path.exists(a.out) and os.listdir(a.out)):
            ap.error("--out: a new or empty folder for the rescored results")
        with open(os.path.join(a.rescore, "validate_steptime.json")) as fh:
            doc = rescore(json.load(fh))
        os.makedirs(a.out, exist_ok=True)
        write_results(a.out, doc)
        print(markdown(doc))
        return 0
    if not a.list and not a.out:
        ap.error("--out: required (a new or empty folder for the results), except with --list")
    hw = probe()
    if a.gpu:
        points, prec = gpu_points(hw)
        points = [g for g in points if g[0] in GPU_QUICK] if a.quick else points
        device, grid_name = "cuda", f"GPU {prec}" if hw.has_cuda else "GPU"
    else:
        points = [(*g, None) for g in GRID if not a.quick or g[0] in QUICK]  # no memory.gpu_budget
        device, grid_name = "cpu", "CPU"
    if a.points:
        wanted = a.points.split(",")
        unknown = [w for w in wanted if w not in {p[0] for p in points}]
        if unknown:
            ap.error(f"--points: got {unknown}; rule: names of this grid's points; fix: one of "
                     f"{', '.join(p[0] for p in points)} (--list shows them)")
        points = [p for p in points if p[0] in wanted]
    no_cuda = None if hw.has_cuda else "no CUDA device here (torch sees none)"
    if a.list:  # like the runs, a bad --set fails here with the config's own message
        print(f"{grid_name} grid, {len(points)} points" + (f"; {no_cuda}, so --gpu would run nothing" if a.gpu and no_cuda else ""))
        for point in points:
            ov = point_overrides(point, device, a.sets)
            why = None if a.gpu and no_cuda else cannot_run(ov, point[6], hw)
            print(f"  {point[0]}: profile={point[6]} {' '.join(ov)}" + (f"  [skipped: {why}]" if why else ""))
        return 0
    if os.path.exists(a.out) and os.listdir(a.out):
        print(f"validate_steptime: {a.out} holds earlier results; choose another --out", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "grid_name": grid_name, "device": device, "sets": a.sets,
           "steps": a.steps, "warmup": a.warmup, "passes": a.passes, "timeout_s": a.timeout, "finished": False}
    if a.gpu and no_cuda:
        doc.update(skipped=no_cuda, finished=True)
        write_results(a.out, doc)
        print(summary_line(doc))
        return 0
    try:  # every point's config, --set included, is checked before the calibration and the first run
        for point in points:
            cannot_run(point_overrides(point, device, a.sets), point[6], hw)
    except ConfigError as e:
        print(f"validate_steptime: {e}", file=sys.stderr)
        return 2
    machine = calibrate.load_or_calibrate(force=a.recalibrate)
    if os.path.exists(speeds.cache_path()):  # the speeds every prediction here used, kept with the results
        shutil.copyfile(speeds.cache_path(), os.path.join(a.out, "calibration.json"))
    doc.update(machine=machine.name, calibration_source=machine.source)
    t0 = time.perf_counter()

    def save(grid: list[dict], choices: list[dict] = ()) -> None:
        doc.update(grid=grid, choices=list(choices), seconds=round(time.perf_counter() - t0),
                   summary=summarize(grid, len(points), list(choices)))
        write_results(a.out, doc)

    grid = run_grid(points, a.out, a.steps, a.warmup, machine, hw, device=device, sets=a.sets, timeout=a.timeout,
                    save=save, passes=a.passes)
    choices = ([] if a.gpu or a.quick or a.no_choices or a.points else
               run_choices(a.out, a.steps, a.warmup, machine, hw, sets=a.sets, timeout=a.timeout, passes=a.passes))
    doc["finished"] = True
    save(grid, choices)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
