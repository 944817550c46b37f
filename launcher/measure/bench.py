"""``vramfit bench``: the same workload under several profiles, each in its own process.

Every profile runs ``python -m launcher train [CONFIG] [key=value ...] profile=P
train.max_steps=WARMUP+STEPS output_dir=OUT/runs run_name=...`` with the OOM ladder off
(``train.oom_fallback=false``, so a result is the asked settings or an honest failure) and no
checkpoints (``checkpoint.save=false``). Timing comes from the run's ``metrics.jsonl``: the rows after the
warm-up steps (tokens and wall time between the end of the last warm-up step and the end of the last
step). Peaks come from ``summary.json`` (GPU: ``max_memory_allocated`` over training; CPU: the process's
RSS high-water mark) and ``memory.csv`` (the process tree's RSS, the whole device's used memory); the
planner's prediction is computed here for the same settings, so a run that failed still has one. A
profile that fails (out of memory, unsupported here, refused by the plan, timed out) is a row with its
``status`` and ``error``, never a crash of the benchmark.

``--find micro-batch|model``: per profile, the largest micro-batch (powers of two that divide the
global batch, so every candidate trains the same global batch) or model size preset (``presets.py``)
that fits, found by running a few steps per candidate. The search starts at the planner's answer and
walks up while runs fit and down while they do not, so it usually takes two or three runs. Fits means:
completed (no OOM) and inside the budgets. ``memory.gpu_budget`` is enforced in the run itself (torch's
allocator is capped, so a bigger card stands in for a smaller one); ``memory.cpu_budget`` cannot be
enforced on a host, so it is not passed to the runs (they keep their host-RAM safety check) and the
measured RSS peak is compared with it instead -- this is also what makes ``--find`` meaningful on a CPU.

Writes ``OUT/results.json`` (``{"results": [...], "hardware": {...}}``), ``OUT/results.md`` and
``OUT/results.png``, rewritten after every run, so a benchmark stopped by a time limit keeps what it has.
``OUT`` must be new or empty: the results of an earlier benchmark there are never replaced.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from launcher.config.checks import folder_problem
from launcher.config.load import load_config
from launcher.config.profiles import PROFILES
from launcher.config.schema import AUTO, Config, ConfigError
from launcher.log import logger
from launcher.machine import speeds
from launcher.machine.files import write_atomic
from launcher.machine.hardware import probe
from launcher.model.presets import PRESETS
from launcher.plan import availability, decide
from launcher.training.monitor import read_csv
from launcher.training.plots import plot_bench
from launcher.units import GiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# keys the benchmark sets on every run; a user's value for them would be overridden, so say so up front
OWN_KEYS = ("profile", "engine", "precision", "run_name", "output_dir", "train.max_steps", "checkpoint.resume",
            "checkpoint.save", "train.oom_fallback")
STATUS_OK = "ok"


# ------------------------------------------------------------------------------------------------
# What to run


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (for the hardware record)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import platform

    return platform.processor() or platform.machine()


def hardware_record(hw) -> dict:
    d = hw.to_dict()
    d["cpu_model"] = cpu_model()
    d["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return d


def default_profiles(cfg: Config, hw) -> tuple[list[str], str, str]:
    """Every profile that can run here for the resolved precision (fastest family first), the precision, the device."""
    avail = availability.assess(cfg, hw)
    return [p.name for p in avail.usable(allow_offload=True)], avail.precision, avail.device.type


def _flat(raw: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in raw.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _override_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def child_overrides(overrides: list[str], drop: tuple[str, ...]) -> list[str]:
    """The user's overrides minus the keys the benchmark sets itself."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        if key not in drop:
            out.append(o)
    return out


# ------------------------------------------------------------------------------------------------
# One run


def timing(rows: list[dict], warmup: int) -> dict:
    """tokens/s and seconds per step over the rows after ``warmup`` steps (metrics.jsonl rows)."""
    if not rows:
        return {"tokens_per_s": None, "step_s": None, "steps_timed": 0}
    rows = sorted(rows, key=lambda r: r["step"])
    base = next((r for r in reversed(rows) if r["step"] <= warmup), None)
    timed = [r for r in rows if r["step"] > warmup]
    if not timed:
        return {"tokens_per_s": None, "step_s": None, "steps_timed": 0}
    t0, tok0, s0 = (base["time_s"], base["tokens"], base["step"]) if base else (0.0, 0, 0)
    last = timed[-1]
    dt = last["time_s"] - t0
    steps = last["step"] - s0
    if dt <= 0 or steps <= 0:
        return {"tokens_per_s": None, "step_s": None, "steps_timed": 0}
    return {"tokens_per_s": (last["tokens"] - tok0) / dt, "step_s": dt / steps, "steps_timed": steps}


def timeline_peaks(path: str) -> dict:
    """Peaks of memory.csv: process-tree RSS and the whole device's used memory."""
    cols = read_csv(path) if os.path.exists(path) else {}
    out = {}
    for col, key in (("cpu_tree_rss_bytes", "peak_cpu_tree_rss_bytes"),
                     ("gpu_device_used_bytes", "peak_gpu_device_used_bytes")):
        seen = [v for v in cols.get(col, []) if v]
        out[key] = int(max(seen)) if seen else None
    return out


def classify_failure(returncode: int, stderr: str, timed_out: bool) -> tuple[str, str]:
    """(status, one-line error) of a run that did not complete."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if timed_out:
        return "timeout", "the run exceeded the benchmark's time limit"
    oom = [ln for ln in lines if "OutOfMemoryError" in ln or "out of memory" in ln.lower()]
    if oom:
        return "oom", oom[-1].strip()[:300]
    if returncode == 2:  # a configuration problem: the profile cannot run here, or the plan refuses it
        msg = " ".join(ln.strip() for ln in lines[-3:])
        return ("refused" if "memory" in msg.lower() else "unsupported"), msg[:400]
    err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return "failed", f"exit {returncode}: {err.strip()[:300]}"


def predict(path: str | None, overrides: list[str], profile: str, hw, machine=None) -> dict:
    """The planner's peaks for these settings and profile, whether they fit the budgets, and (``machine``: this
    machine's cached speeds) the step time it predicts."""
    try:
        # the decision a run makes (data formats, memory.nvme_path, the speeds rechecked)
        plan = decide.decide(load_config(path, [*overrides, f"profile={profile}"]), hw=hw, machine=machine, run=False,
                             profiles=[profile], advise=False).plan
        row = plan.get(profile)
        return {"predicted_gpu_bytes": row.gpu_bytes if row.gpu_bytes else None, "predicted_cpu_bytes": row.cpu_bytes,
                "planned_fits": bool(row.fits), "planned_micro_batch": row.micro_batch,
                "budget_gpu_bytes": plan.budget.get("gpu_bytes") or None, "budget_cpu_bytes": plan.budget.get("cpu_bytes"),
                **({"predicted_step_s": row.step_s} if getattr(row, "step_s", None) else {})}
    except Exception as e:  # a model the planner cannot measure: the run still happens
        return {"predicted_gpu_bytes": None, "predicted_cpu_bytes": None, "planned_fits": None,
                "plan_error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def run_one(path: str | None, overrides: list[str], profile: str, name: str, out: str, steps: int, warmup: int,
            timeout: float, hw, machine=None) -> dict:
    """One training run in its own process; its row (status, timing, peaks, prediction)."""
    runs = os.path.join(out, "runs")
    total = warmup + steps
    cfg = load_config(path, overrides)
    extra = [f"profile={profile}", f"train.max_steps={total}", f"output_dir={runs}", f"run_name={name}",
             "checkpoint.resume=never", "checkpoint.save=false", "train.oom_fallback=false", "sample_tokens=0",
             "log.progress=off"]
    if cfg.train.warmup_steps > total:
        extra.append(f"train.warmup_steps={total}")
    cmd = [sys.executable, "-m", "launcher", "train", *([path] if path else []), *overrides, *extra]
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    row: dict = {"profile": profile, "run": name, "status": None, "error": None}
    row.update(predict(path, overrides, profile, hw, machine))
    t = time.perf_counter()
    timed_out = False
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        rc, stderr, stdout = proc.returncode, proc.stderr, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        stdout = ""
    row["wall_s"] = round(time.perf_counter() - t, 1)
    run_dir = os.path.join(runs, name)
    row["run_dir"] = run_dir
    with open(os.path.join(out, "logs", f"{name}.log"), "w") as fh:
        fh.write(" ".join(cmd) + "\n\n" + (stdout or "") + "\n--- stderr ---\n" + (stderr or ""))
    summary_path = os.path.join(run_dir, "summary.json")
    s = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    if s is not None and s.get("status") == "completed":
        row["status"] = STATUS_OK
    elif s is not None:
        row["status"], row["error"] = s.get("status"), s.get("diagnosis")
    else:
        row["status"], row["error"] = classify_failure(rc if rc is not None else -1, stderr or "", timed_out)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(ln) for ln in open(metrics) if ln.strip()] if os.path.exists(metrics) else []
    row.update(timing(rows, warmup))
    if s is not None:
        hwm = s.get("peak_cpu_rss_hwm_bytes")
        row.update(engine=s.get("engine"), precision=s.get("precision"), micro_batch=s.get("micro_batch"),
                   accumulation=s.get("accumulation"), seq_len=s.get("seq_len"), final_loss=s.get("final_loss"),
                   peak_gpu_bytes=s.get("peak_gpu_bytes"), peak_gpu_reserved_bytes=s.get("peak_gpu_reserved_bytes"),
                   peak_cpu_rss_bytes=max(x for x in (hwm, s.get("peak_cpu_rss_bytes"), 0) if x is not None) or None,
                   memory_warnings=s.get("memory_warnings") or [])
        # the run's own prediction, when it has one, is the one for exactly what ran
        for k in ("predicted_gpu_bytes", "predicted_cpu_bytes", "predicted_step_s"):
            if s.get(k):
                row[k] = s[k]
        row.update(profile_run=s.get("profile"), gradient_checkpointing=s.get("gradient_checkpointing"),
                   checkpoint_every=s.get("checkpoint_every"))
    else:
        row.update(peak_gpu_bytes=None, peak_cpu_rss_bytes=None)
    row.update(timeline_peaks(os.path.join(run_dir, "memory.csv")))
    return row


# ------------------------------------------------------------------------------------------------
# --find


def micro_batch_candidates(cfg: Config) -> list[int]:
    """Powers of two that divide the global batch (per rank), so every candidate trains the same global batch."""
    g = cfg.train.global_batch_size
    out, m = [], 1
    while m <= g:
        if g % m == 0:
            out.append(m)
        m *= 2
    return out


def fits(row: dict, cpu_budget_bytes: int | None) -> bool:
    if row["status"] != STATUS_OK:
        return False
    if cpu_budget_bytes and row.get("peak_cpu_rss_bytes") and row["peak_cpu_rss_bytes"] > cpu_budget_bytes:
        return False
    return True


def search(candidates: list, start: int, try_fit) -> tuple[int | None, list[int]]:
    """Largest index whose candidate fits, assuming fitting is monotone (a bigger one never fits when a
    smaller one does not). Starts at ``start``; returns (index or None, indices tried in order)."""
    tried: list[int] = []
    known: dict[int, bool] = {}

    def check(i):
        if i not in known:
            tried.append(i)
            known[i] = try_fit(i)
        return known[i]

    i = max(0, min(start, len(candidates) - 1))
    if check(i):
        while i + 1 < len(candidates) and check(i + 1):
            i += 1
        return i, tried
    while i > 0:
        i -= 1
        if check(i):
            return i, tried
    return None, tried


def find_for_profile(kind: str, path, overrides, plan_overrides, profile, candidates, out, steps, warmup, timeout, hw,
                     cpu_budget_bytes, on_row, machine=None) -> dict:
    """Run the search for one profile; the summary row with every candidate tried. ``plan_overrides`` are
    the user's (with memory.cpu_budget), ``overrides`` what the runs get."""
    def cand_overrides(c, base=overrides):
        if kind == "micro-batch":
            return [*base, f"train.micro_batch_size={c}"]
        return [*base, f"model.name={c}"]

    planned = [predict(path, cand_overrides(c, plan_overrides), profile, hw, machine) for c in candidates]
    planned_ok = [i for i, p in enumerate(planned) if p.get("planned_fits")]
    planned_best = max(planned_ok) if planned_ok else None
    tried_rows: dict[int, dict] = {}

    def try_fit(i):
        c = candidates[i]
        tag = f"mb{c}" if kind == "micro-batch" else str(c)
        row = run_one(path, cand_overrides(c), profile, f"{profile}-{tag}", out, steps, warmup, timeout, hw, machine)
        row["candidate"] = c
        row["fits"] = fits(row, cpu_budget_bytes)
        if row["status"] == STATUS_OK and not row["fits"]:
            row["status"], row["error"] = "over_budget", (
                f"peak CPU RSS {row['peak_cpu_rss_bytes'] / GiB:.2f} GiB > memory.cpu_budget "
                f"{cpu_budget_bytes / GiB:.2f} GiB")
        tried_rows[i] = row
        on_row(row)
        return row["fits"]

    best, order = search(candidates, planned_best if planned_best is not None else 0, try_fit)
    key = "micro_batch" if kind == "micro-batch" else "model"
    summary = {"profile": profile, "find": kind, f"best_{key}": candidates[best] if best is not None else None,
               f"planned_best_{key}": candidates[planned_best] if planned_best is not None else None,
               "candidates": [dict(tried_rows[i], planned_fits=planned[i].get("planned_fits")) for i in order]}
    chosen = tried_rows[best] if best is not None else (tried_rows[order[0]] if order else {})
    for k in ("status", "error", "tokens_per_s", "step_s", "peak_gpu_bytes", "peak_cpu_rss_bytes",
              "peak_cpu_tree_rss_bytes", "peak_gpu_device_used_bytes", "predicted_gpu_bytes", "predicted_cpu_bytes",
              "micro_batch", "engine", "precision"):
        summary[k] = chosen.get(k)
    if best is None:
        summary["status"] = "nothing_fits"
    return summary


# ------------------------------------------------------------------------------------------------
# Outputs


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _num(x, fmt="{:.0f}") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def add_ratios(results: list[dict]) -> None:
    speeds = [r["tokens_per_s"] for r in results if r.get("tokens_per_s") and r.get("status") in (STATUS_OK, None)]
    fastest = max(speeds) if speeds else None
    for r in results:
        ok = r.get("tokens_per_s") and r.get("status") == STATUS_OK
        r["ratio_to_fastest"] = round(r["tokens_per_s"] / fastest, 3) if ok and fastest else None


def markdown(doc: dict) -> str:
    hw = doc["hardware"]
    gpus = ", ".join(f"{g['name']} ({g['total_bytes'] / GiB:.0f} GiB)" for g in hw.get("gpus", [])) or "no GPU"
    lines = [f"# vramfit bench, {hw.get('date', '')}", "",
             f"{gpus}; CPU {hw.get('cpu_model')} x {hw.get('cpu_count')}; RAM {hw.get('ram_total_bytes', 0) / GiB:.0f} GiB; "
             f"torch {hw.get('torch')}, DeepSpeed {hw.get('deepspeed') or 'none'}", "",
             f"Workload: `{' '.join(doc['settings']['overrides']) or '(defaults)'}`"
             + (f" from {doc['settings']['config']}" if doc["settings"].get("config") else "")
             + f"; {doc['settings']['warmup']} warm-up + {doc['settings']['steps']} timed steps per run.", ""]
    find = doc["settings"].get("find")
    if find:
        key = "micro_batch" if find == "micro-batch" else "model"
        lines += [f"Largest {find} that fits (budgets: GPU {_gib(doc['settings'].get('gpu_budget_bytes'))} GiB, "
                  f"CPU {_gib(doc['settings'].get('cpu_budget_bytes'))} GiB):", "",
                  f"| profile | largest {find} (measured) | planner's | tokens/s there | ratio | peak GPU GiB | "
                  "planned GPU GiB | peak CPU RSS GiB | planned CPU GiB | tried |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in doc["results"]:
            tried = ", ".join(f"{c['candidate']}: {c['status']}" for c in r.get("candidates", []))
            lines.append(f"| `{r['profile']}` | {r.get(f'best_{key}') or '-'} | {r.get(f'planned_best_{key}') or '-'} | "
                         f"{_num(r.get('tokens_per_s'))} | {_num(r.get('ratio_to_fastest'), '{:.2f}')} | "
                         f"{_gib(r.get('peak_gpu_bytes'))} | {_gib(r.get('predicted_gpu_bytes'))} | "
                         f"{_gib(r.get('peak_cpu_rss_bytes'))} | {_gib(r.get('predicted_cpu_bytes'))} | {tried} |")
    else:
        lines += ["| profile | status | tokens/s | step s | ratio to fastest | peak GPU GiB | planned GPU GiB | "
                  "peak CPU RSS GiB | planned CPU GiB | note |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in doc["results"]:
            note = (r.get("error") or "")[:160].replace("|", "/")
            lines.append(f"| `{r['profile']}` | {r['status']} | {_num(r.get('tokens_per_s'))} | "
                         f"{_num(r.get('step_s'), '{:.3f}')} | {_num(r.get('ratio_to_fastest'), '{:.2f}')} | "
                         f"{_gib(r.get('peak_gpu_bytes'))} | {_gib(r.get('predicted_gpu_bytes'))} | "
                         f"{_gib(r.get('peak_cpu_rss_bytes'))} | {_gib(r.get('predicted_cpu_bytes'))} | {note} |")
    lines += ["", "Peak GPU: `torch.cuda.max_memory_allocated` over training; peak CPU RSS: the training process's RSS "
              "high-water mark; planned: the memory planner for the same settings (GPU includes CUDA context and "
              "allocator slack)."]
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict, out: str, with_png: bool = True) -> None:
    add_ratios(doc["results"])
    write_atomic(os.path.join(out, "results.json"), json.dumps(doc, indent=2, default=str))
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(markdown(doc))
    if with_png and doc["results"]:
        plot_bench(doc, os.path.join(out, "results.png"))


# ------------------------------------------------------------------------------------------------
# Entry

OUTPUTS = ("results.json", "results.md", "results.png", "runs", "logs")


def out_problems(out: str) -> list[str]:
    """``--out`` must be a new or empty directory: earlier results are never replaced without a word."""
    if not os.path.exists(out):
        return list(filter(None, [folder_problem("--out", out, "a new folder for the results, in a folder this user "
                                                 "can write", "--out DIR where you can write")]))
    n = 2
    while os.path.exists(f"{out}-{n}"):
        n += 1
    fix = f"fix: --out {out}-{n}, or move {out} away first"
    if not os.path.isdir(out):
        return [f"--out: got {out!r}, which is a file; rule: a directory for the results; {fix}"]
    if not os.access(out, os.W_OK | os.X_OK):
        return [f"--out: got {out!r}, which is not writable by this user; rule: a folder this user can write; fix: "
                "--out DIR where you can write"]
    earlier = [n for n in OUTPUTS if os.path.exists(os.path.join(out, n))]
    if earlier:
        when = ""
        try:
            with open(os.path.join(out, "results.json")) as fh:
                when = f" (started {json.load(fh)['settings']['started']})"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return [f"--out: {out!r} already holds the results of an earlier bench{when}: {', '.join(earlier)}; rule: a "
                f"benchmark never replaces earlier results; {fix}"]
    return []


def profile_names(text: str) -> list[str]:
    """The items of a comma-separated option (--profiles, --candidates), spaces and empty items dropped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def option_problems(steps: int, warmup: int, timeout: float, out: str, profiles: str | None, find: str | None,
                    candidates: str | None) -> list[str]:
    """The bench options' problems (value, rule, fix), for callers that did not come through the command line's
    parser too (which refuses the same numbers)."""
    problems = []
    if not isinstance(steps, int) or steps < 1:
        problems.append(f"--steps: got {steps!r}; rule: a whole number of timed steps, at least 1; fix: --steps 10")
    if not isinstance(warmup, int) or warmup < 0:
        problems.append(f"--warmup: got {warmup!r}; rule: a whole number, 0 or more; fix: --warmup 3")
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        problems.append(f"--timeout: got {timeout!r}; rule: a finite number of seconds > 0; fix: --timeout 1800")
    problems += out_problems(out)
    if profiles is not None:
        names = profile_names(profiles)
        bad = [p for p in names if p not in PROFILES]
        if bad or not names:
            problems.append(f"--profiles: got {profiles!r}" + (f", unknown: {', '.join(bad)}" if bad else "") + "; rule: "
                            "comma-separated names from `vramfit profiles`; fix: --profiles "
                            f"{','.join(p for p in names if p in PROFILES) or 'amp-fp32'}")
    if candidates is not None and not find:
        problems.append(f"--candidates: got {candidates!r} without --find; rule: candidates are what --find tries; "
                        "fix: add --find micro-batch or --find model, or drop --candidates")
    return problems


def candidate_problems(find: str, candidates: str, cfg: Config) -> list[str]:
    """``--candidates`` of ``--find``: micro-batches that split the global batch, or size presets and local model
    folders (hub ids are not searched: each would be a download), all named before any run or lookup."""
    items = profile_names(candidates)
    if not items:
        return [f"--candidates: got {candidates!r}; rule: comma-separated {find} values; fix: drop --candidates for the "
                "default ones"]
    if find == "micro-batch":
        g = cfg.train.global_batch_size
        bad = [c for c in items if not c.isdigit() or int(c) < 1 or g % int(c)]
        if bad:
            return [f"--candidates: got {', '.join(bad)}; rule: micro-batches, whole numbers that divide "
                    f"train.global_batch_size={g}; fix: --candidates {','.join(map(str, micro_batch_candidates(cfg)))}"]
        return []
    bad = [c for c in items if c not in PRESETS and not os.path.isfile(os.path.join(os.path.expanduser(c), "config.json"))]
    if bad:
        return [f"--candidates: got {', '.join(bad)}; rule: size presets ({', '.join(PRESETS)}) or local model "
                "folders with config.json (hub ids are not searched); fix: --candidates "
                f"{','.join(c for c in items if c not in bad) or ','.join(list(PRESETS)[:3])}"]
    return []


def main(path: str | None, overrides: list[str], profiles: str | None = None, out: str = "bench-out", steps: int = 10,
         warmup: int = 3, find: str | None = None, timeout: float = 1800.0, candidates: str | None = None) -> int:
    """Exit 0 when at least one profile ran (or fit), 1 when none did; ConfigError (exit 2) for bad input."""
    # every problem of the options and of the workload, at once, before anything runs or is looked up
    problems = option_problems(steps, warmup, timeout, out, profiles, find, candidates)
    ignored = [o for o in overrides if o.split("=", 1)[0].strip() in OWN_KEYS[3:]]
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        raise ConfigError(problems + e.problems, "bench options and configuration" if problems else "configuration") \
            from None
    if find and candidates:
        problems += candidate_problems(find, candidates, cfg)
    if problems:
        raise ConfigError(problems, "bench options")
    hw = probe()
    machine, why = speeds.cached()  # priced as a training start prices its plan (never measured here)
    if why:
        logger.warning(why)
    base = child_overrides(overrides, OWN_KEYS)
    if profiles:
        names = profile_names(profiles)
        precision, device = None, None
    elif cfg.profile != AUTO:  # profile=NAME among the overrides: that one
        names, precision, device = [cfg.profile], None, None
    else:
        names, precision, device = default_profiles(cfg, hw)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    gpu_budget = None if cfg.memory.gpu_budget == AUTO else int(float(cfg.memory.gpu_budget) * GiB)
    cpu_budget = None if cfg.memory.cpu_budget == AUTO else int(float(cfg.memory.cpu_budget) * GiB)
    doc = {"results": [], "hardware": hardware_record(hw),
           "settings": {"config": path, "overrides": list(overrides), "profiles": names, "steps": steps,
                        "warmup": warmup, "find": find, "precision": precision, "device": device,
                        "gpu_budget_bytes": gpu_budget, "cpu_budget_bytes": cpu_budget,
                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}}
    if ignored:
        logger.warning(f"bench: ignoring {', '.join(ignored)}: the benchmark sets these itself")
    logger.info(f"bench: {len(names)} profile(s): {', '.join(names)}; {warmup} warm-up + {steps} timed steps each; "
                f"output {out}")

    def progress_line(r):
        extra = f", {r['tokens_per_s']:.0f} tokens/s" if r.get("tokens_per_s") else ""
        err = f" ({r['error'][:120]})" if r.get("error") else ""
        logger.info(f"bench: {r['run']}: {r['status']}{extra}, {r.get('wall_s')} s{err}")

    t0 = time.perf_counter()
    if find:
        if find == "micro-batch":
            cands = [int(c) for c in profile_names(candidates)] if candidates else micro_batch_candidates(cfg)
        else:
            cands = profile_names(candidates) if candidates else list(PRESETS)
        doc["settings"]["candidates"] = cands
        # memory.cpu_budget is the fit criterion, compared with the measured RSS; the runs keep the host's own check
        run_overrides = child_overrides(base, ("memory.cpu_budget",))
        for name in names:
            def on_row(r):
                progress_line(r)
                write_outputs(dict(doc, partial=True, results=doc["results"] + [r]), out, with_png=False)

            row = find_for_profile(find, path, run_overrides, base, name, cands, out, steps, warmup, timeout, hw,
                                   cpu_budget, on_row, machine)
            doc["results"].append(row)
            write_outputs(doc, out, with_png=False)
    else:
        for name in names:
            row = run_one(path, base, name, name, out, steps, warmup, timeout, hw, machine)
            doc["results"].append(row)
            progress_line(row)
            write_outputs(doc, out, with_png=False)
    doc["settings"]["seconds"] = round(time.perf_counter() - t0, 1)
    write_outputs(doc, out)
    logger.info(f"bench: wrote {out}/results.json, results.md, results.png ({doc['settings']['seconds']} s)")
    return doc
