#!/usr/bin/env python
"""The host memory a run holds, phase by phase, against the plan: set-up, training, checkpoint, final/.

Each case is a real run in a process of its own (``python -m launcher train ... train.max_steps=2``): its
``summary.json`` gives the measured RSS high-water mark of every host phase (``peak_rss_by_phase``, the kernel's
VmHWM reset at each phase) and of the whole run; its ``plan.json`` the planner's host phases for the profile it ran
(``host_phases``) and the planned peak (``cpu_bytes``). A case whose plan says it does not fit the budget is
listed and not run. Also: how long the run took to its first step (``startup_s``) and on what.

Writes ``DIR/host_memory.json`` and ``DIR/host_memory.md`` (``--out DIR``) and prints the table.

    python scripts/validate_host_memory.py --out runs/host            # llama-1b and llama-3b, LoRA and full
    python scripts/validate_host_memory.py --models llama-125m --profiles amp-fp32 --kinds lora --out runs/x  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = ("setup", "train", "checkpoint", "final")
# Every profile a CPU can run (DeepSpeed's CPU accelerator refuses fp16); full fine-tunes and LoRA
PROFILES = ("amp-fp32", "amp-bf16", "zero2-bf16", "zero2-bf16-offload-opt", "fsdp-bf16-offload",
            "zero3-bf16-offload-all")
GiB = 2 ** 30


def refused(error: str) -> bool:
    """The run was refused before it started because its plan does not fit (a result, not a failure)."""
    return any(s in error for s in ("does not fit", "nothing fits", "rule: planned host memory must fit"))


def run_case(model: str, kind: str, profile: str, out: str, extra: list[str]) -> dict:
    name = f"{model}-{kind}-{profile}"
    args = [f"model.name={model}", f"profile={profile}", "data.seq_len=128", "train.max_steps=2",
            "train.warmup_steps=0", "train.micro_batch_size=1", "train.global_batch_size=2", "sample_tokens=0",
            "data.num_samples=64", "checkpoint.keep_last=1", f"output_dir={out}", f"run_name={name}", "log.memory_interval_s=0.5",
            *(["lora.r=16"] if kind == "lora" else []), *extra]
    if profile.endswith("bf16") or "bf16-" in profile:
        args.append("precision=bf16")
    env = dict(os.environ, VRAMFIT_RECHECK=os.environ.get("VRAMFIT_RECHECK", "off"))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "launcher", "train", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    wall = time.time() - t0
    rd = os.path.join(out, name)
    row = {"model": model, "kind": kind, "profile": profile, "rc": p.returncode, "wall_s": round(wall, 1)}
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        row["error"] = " | ".join(tail)
        # a case the plan refuses (nothing fits) is a result too: say so
        row["refused"] = refused(row["error"])
        return row
    summary = json.load(open(os.path.join(rd, "summary.json")))
    plan = json.load(open(os.path.join(rd, "plan.json")))
    prow = next(r for r in plan["profiles"] if r["profile"] == profile)
    row.update({
        "measured": summary.get("peak_rss_by_phase") or {},
        "measured_peak": summary.get("peak_cpu_rss_hwm_bytes"),
        "planned": {ph: sum(parts.values()) for ph, parts in (prow.get("host_phases") or {}).items()},
        "planned_parts": prow.get("host_phases"),
        "planned_peak": prow.get("cpu_bytes"), "planned_peak_phase": prow.get("host_peak_phase"),
        "micro_batch": summary.get("micro_batch"), "checkpointing": summary.get("gradient_checkpointing"),
        "startup_s": summary.get("startup_s"), "startup_parts": summary.get("startup_parts"),
        "status": summary.get("status"),
    })
    if row["measured_peak"] and row["planned_peak"]:
        row["error_pct"] = round(100.0 * (row["planned_peak"] - row["measured_peak"]) / row["measured_peak"], 1)
    return row


def table(rows: list[dict]) -> str:
    head = ("| model | kind | profile | measured peak GiB | planned GiB | error | phase peaks measured / planned "
            "(setup, train, checkpoint, final) GiB | first step s |")
    lines = [head, "| --- | --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        if r["rc"] != 0:
            error = r.get("error", "")
            why = "the plan says it does not fit here" if r.get("refused") or refused(error) else f"failed: {error[-160:]}"
            lines.append(f"| {r['model']} | {r['kind']} | {r['profile']} | - | - | - | {why} | - |")
            continue
        phases = ", ".join(
            f"{(r['measured'].get(ph) or 0) / GiB:.2f} / {(r['planned'].get(ph) or 0) / GiB:.2f}" for ph in PHASES)
        lines.append(f"| {r['model']} | {r['kind']} | {r['profile']} | {r['measured_peak'] / GiB:.2f} | "
                     f"{r['planned_peak'] / GiB:.2f} ({r['planned_peak_phase']}) | {r.get('error_pct', 0):+.1f}% | "
                     f"{phases} | {r['startup_s']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-1b,llama-3b")
    ap.add_argument("--kinds", default="lora,full")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--out", default=None, help="where the JSON and Markdown results go (default: print only)")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            for kind in a.kinds.split(","):
                for profile in a.profiles.split(","):
                    r = run_case(model, kind, profile, tmp, a.extra)
                    rows.append(r)
                    print(table([r]).splitlines()[-1], flush=True)
    md = table(rows)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump({"rows": rows, "argv": sys.argv[1:]}, open(os.path.join(a.out, "host_memory.json"), "w"), indent=2)
        open(os.path.join(a.out, "host_memory.md"), "w").write(md + "\n")
    ran = [r for r in rows if r["rc"] == 0]
    return 0 if ran and all(abs(r.get("error_pct", 100)) <= 10 for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
