"""``vramfit tune``: measure the planner's best few settings, keep the fastest, and learn from the error.

The plan prices every setting that fits (profile x micro-batch x checkpointing) with the step-time model;
``tune`` runs the ``--top`` fastest predicted ones for a few steps each, each in its own process as ``vramfit
bench`` does (same timing: the steps after the warm-up), prints predicted against measured, and writes the
fastest measured setting as a YAML to train with. The measured / predicted ratio of each engine family is
kept with this machine's calibration (``corrections``), so later plans on this machine are priced with it.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace

from launcher.config.checks import folder_problem
from launcher.config.load import load_config
from launcher.config.profiles import PROFILES
from launcher.config.schema import ConfigError, to_yaml
from launcher.log import logger
from launcher.machine import speeds
from launcher.machine.hardware import probe
from launcher.measure import bench, calibrate
from launcher.plan import decide
from launcher.plan.families import family_of


def candidate_overrides(c: dict) -> list[str]:
    """The key=value settings that make a training run take candidate ``c`` of a plan."""
    return [f"profile={c['profile']}", f"train.micro_batch_size={c['micro_batch']}",
            f"model.gradient_checkpointing={'true' if c['checkpointing'] else 'false'}",
            f"model.checkpoint_every={c['checkpoint_every']}"]


def tune(path: str | None, overrides: list[str], *, top: int = 3, out_yaml: str | None = None, out_dir: str = "tune-out",
         steps: int = 6, warmup: int = 2, timeout: float = 1800) -> dict:
    # the command line's problems and the configuration's, all at once and before anything is measured (minutes),
    # looked up or written
    problems = option_problems(top, out_yaml, out_dir, steps, warmup, timeout)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems, "command line")
    # the same decision as `vramfit plan` and `train`: data formats read, memory.nvme_path measured, speeds rechecked
    d = decide.decide(cfg, hw=probe(), machine=calibrate.load_or_calibrate(), run=False)
    for line in d.notes:
        logger.warning(line)
    cfg, hw, machine, plan = d.cfg, d.hw, d.machine, d.plan
    if plan.chosen is None:
        raise ConfigError([f"memory: nothing fits to tune; {plan.reason}; fix: `vramfit plan` shows what would"],
                          "memory plan")
    cands = plan.candidates[:top]
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    logger.info(f"tune: measuring {len(cands)} of {len(plan.candidates)} settings that fit, {warmup} warm-up + "
                f"{steps} timed steps each")
    results = []
    for i, c in enumerate(cands):
        row = bench.run_one(path, [*overrides, *candidate_overrides(c)[1:]], c["profile"], f"tune-{i}", out_dir, steps,
                            warmup, timeout, hw, machine)
        row.update(setting=c["setting"], predicted_step_s=row.get("predicted_step_s") or c["step_s"],
                   candidate=c)
        results.append(row)
        logger.info(f"tune: {c['profile']}, {c['setting']}: {row['status']}, predicted {c['step_s']:.3g} s/step, "
                    f"measured {row['step_s']:.3g} s/step" if row.get("step_s") else
                    f"tune: {c['profile']}, {c['setting']}: {row['status']} {row.get('error') or ''}")
    ok = [r for r in results if r.get("status") == bench.STATUS_OK and r.get("step_s")]
    if not ok:
        raise ConfigError([f"tune: none of the {len(results)} settings ran ({'; '.join(str(r.get('error')) for r in results)}); "
                           f"rule: at least one must train; fix: see the logs in {out_dir}/logs"], "tune")
    best = min(ok, key=lambda r: r["step_s"])
    # What the model got wrong on this machine, per engine family (median of the ratios measured)
    ratios: dict[str, list[float]] = {}
    for r in ok:
        if r.get("predicted_step_s"):
            fam = family_of(PROFILES[r["profile"]]).name
            base = r["predicted_step_s"] / machine.corrections.get(fam, 1.0)  # the model's own prediction
            ratios.setdefault(fam, []).append(r["step_s"] / base)
    corrections = {fam: statistics.median(v) for fam, v in ratios.items()}
    speeds.save_corrections(machine, corrections)
    doc = {"results": results, "best": best["candidate"], "corrections": corrections, "machine": machine.name,
           "plan_choice": plan.candidates[0], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if out_yaml:
        c = best["candidate"]
        tuned = replace(cfg, profile=c["profile"], train=replace(cfg.train, micro_batch_size=c["micro_batch"]),
                        model=replace(cfg.model, gradient_checkpointing=c["checkpointing"],
                                      checkpoint_every=c["checkpoint_every"]))
        with open(out_yaml, "w") as fh:
            fh.write(f"# vramfit tune {time.strftime('%Y-%m-%d')}: fastest measured of {len(ok)} settings on "
                     f"{machine.name}: {best['step_s']:.3g} s/step\n" + to_yaml(tuned))
        doc["yaml"] = out_yaml
    return doc


def option_problems(top, out_yaml: str | None, out_dir: str, steps, warmup, timeout) -> list[str]:
    """tune's options (value, rule, fix), also for callers that did not come through the command line's parser."""
    problems = []
    for flag, value, lo, fix in (("--top", top, 1, 3), ("--steps", steps, 1, 6), ("--warmup", warmup, 0, 2)):
        if not isinstance(value, int) or value < lo:
            problems.append(f"{flag}: got {value!r}; rule: a whole number >= {lo}; fix: {flag} {fix}")
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        problems.append(f"--timeout: got {timeout!r}; rule: a finite number of seconds > 0; fix: --timeout 1800")
    if out_yaml:
        problems += _out_yaml_problems(out_yaml)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        problems.append(f"--dir: got {out_dir!r}, which is a file; rule: a folder for the measurements' logs; fix: "
                        f"--dir {out_dir}-runs")
        return problems
    unwritable = folder_problem("--dir", out_dir, "a folder this user can write, for the measurements' runs and logs",
                                "--dir DIR where you can write")
    if unwritable:
        problems.append(unwritable)
    elif os.path.isdir(out_dir) and os.listdir(out_dir):
        problems.append(f"--dir: {out_dir!r} holds earlier results; rule: tune never overwrites them; fix: another "
                        "--dir, or remove it yourself")
    return problems


def _out_yaml_problems(out_yaml: str) -> list[str]:
    """``--out``: a new file in an existing folder this user can write."""
    path = os.path.abspath(os.path.expanduser(out_yaml))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        return [f"--out: got {out_yaml!r}, which is a folder; rule: the YAML file to write; fix: --out "
                f"{os.path.join(out_yaml, 'tuned.yaml')}"]
    if os.path.exists(path):
        return [f"--out: {out_yaml!r} exists; rule: tune never overwrites a file; fix: another path"]
    if not os.path.isdir(folder):
        return [f"--out: got {out_yaml!r}; rule: the file goes in an existing folder, and {folder} does not exist; "
                f"fix: mkdir -p {folder}, or --out {os.path.basename(path)}"]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [f"--out: got {out_yaml!r}; rule: a folder this user can write, and {folder} is not writable here; "
                f"fix: --out in a folder you can write"]
    return []


def table(doc: dict) -> str:
    lines = ["| profile | setting | predicted s/step | measured s/step | measured / predicted | status |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in doc["results"]:
        p, m = r.get("predicted_step_s"), r.get("step_s")
        mark = " *" if r["candidate"] == doc["best"] else ""
        lines.append(f"| `{r['profile']}`{mark} | {r['setting']} | {p:.3g} | "
                     + (f"{m:.3g} | {m / p:.2f} |" if m and p else "- | - |") + f" {r['status']} |")
    lines.append("")
    lines.append("* fastest measured" + (f"; settings written to {doc['yaml']}" if doc.get("yaml") else ""))
    if doc["corrections"]:
        lines.append("corrections kept for later plans on this machine: "
                     + ", ".join(f"{k} x{v:.2f}" for k, v in doc["corrections"].items()))
    return "\n".join(lines)
