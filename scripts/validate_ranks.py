"""The planner's per-rank CPU peak against each rank's measured peak, on CPU ranks over gloo (torchrun).

For each engine and number of ranks, a short run of the same small model (45M parameters, so that the model's
states are larger than the process's own runtime), then each rank's RSS high-water mark (``summary.json``:
``peak_cpu_rss_hwm_bytes_per_rank``) against the plan's per-rank CPU peak (``plan.json``) and the error of each.

    python scripts/validate_ranks.py --out bench/results/DATE-MACHINE/per-rank [--ranks 1,2,4] [--profiles ...] \
        [--heap-mib 0]   # memory.mmap_threshold_mib for every run (0: glibc's own heap, as before it was set)
    python scripts/validate_ranks.py --out ... --model llama-1b --lora 16 --ranks 1,2   # one box, one copy

The last columns are what the ranks of a run hold together against one rank alone on the same profile (a box that
held a whole copy of the model per rank would show about the number of ranks): over the whole run, and at the end of
set-up (``peak_rss_by_phase``'s ``setup``: the model made and sharded, nothing computed yet). On CPU ranks the whole
run's peak also holds what each rank's step computes on (its gathered layers, activations and logits), which a GPU
box keeps on its cards; the set-up's is what every box holds on its host.

Writes ``per_rank.json`` and ``per_rank.md`` (a table) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

PROFILES = ("zero2-fp32", "fsdp-bf16-offload", "zero3-bf16-offload-all")
MiB = 2**20


def make_model(path: str) -> str:
    """A Llama of 45.4M parameters (a 32000-token vocabulary, 4 layers 512 wide), saved with its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                             tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def run(out: str, model: str, profile: str, ranks: int, timeout: float = 900, heap_mib: str | None = None,
        lora: int = 0) -> dict:
    from helpers.procs import torchrun

    name = f"{profile}-{ranks}"
    args = [f"model.name={model}", f"profile={profile}", "train.max_steps=3", "train.warmup_steps=1",
            "train.micro_batch_size=1", "train.global_batch_size=4", "data.seq_len=64", "data.num_samples=64",
            "sample_tokens=0", "device=cpu", f"output_dir={out}", f"run_name={name}", "checkpoint.save=false",
            "log.memory_interval_s=0", *([f"memory.mmap_threshold_mib={heap_mib}"] if heap_mib is not None else []),
            *([f"lora.r={lora}"] if lora else [])]
    t = time.perf_counter()
    r = torchrun(ranks, os.path.join(ROOT, "launcher", "run.py"), *args, timeout=timeout)
    if r.returncode:
        return {"profile": profile, "ranks": ranks, "status": "failed", "error": r.stderr[-2000:]}
    s = json.load(open(os.path.join(out, name, "summary.json")))
    measured = s.get("peak_cpu_rss_hwm_bytes_per_rank") or [s["peak_cpu_rss_hwm_bytes"]]
    setup = [p.get("setup") for p in s.get("peak_rss_by_phase_per_rank") or [s.get("peak_rss_by_phase") or {}]]
    planned = s["predicted_cpu_bytes"]
    return {"profile": profile, "ranks": ranks, "status": "ok", "planned_bytes": planned, "measured_bytes": measured,
            "setup_bytes": setup, "errors": [planned / m - 1 for m in measured],
            "wall_s": round(time.perf_counter() - t, 1)}


def together(rows: list[dict]) -> None:
    """Each row's ranks' measured peaks together over one rank's alone on the same profile (where it ran)."""
    ones = [r for r in rows if r["status"] == "ok" and r["ranks"] == 1]
    alone = {r["profile"]: r["measured_bytes"][0] for r in ones}
    alone_setup = {r["profile"]: r["setup_bytes"][0] for r in ones if all(r.get("setup_bytes") or [None])}
    for r in rows:
        if r["status"] == "ok" and r["profile"] in alone:
            r["together_over_one"] = sum(r["measured_bytes"]) / alone[r["profile"]]
        if r["status"] == "ok" and r["profile"] in alone_setup and all(r.get("setup_bytes") or [None]):
            r["setup_together_over_one"] = sum(r["setup_bytes"]) / alone_setup[r["profile"]]


def markdown(rows: list[dict]) -> str:
    lines = ["| profile | ranks | planned per rank MiB | measured per rank MiB | error (planned / measured - 1) | "
             "ranks together / one rank alone | set-up peaks per rank MiB | set-up together / one rank alone |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['profile']} | {r['ranks']} | - | failed | - | - | - | - |")
            continue
        ratio, setup_ratio = r.get("together_over_one"), r.get("setup_together_over_one")
        setup = r.get("setup_bytes") or []
        lines.append(f"| {r['profile']} | {r['ranks']} | {r['planned_bytes'] / MiB:.0f} | "
                     + ", ".join(f"{m / MiB:.0f}" for m in r["measured_bytes"]) + " | "
                     + ", ".join(f"{e:+.1%}" for e in r["errors"]) + " | "
                     + (f"{ratio:.2f}" if ratio is not None else "-") + " | "
                     + (", ".join(f"{m / MiB:.0f}" if m else "-" for m in setup) or "-") + " | "
                     + (f"{setup_ratio:.2f}" if setup_ratio is not None else "-") + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--model", default=None, help="a preset or model directory (default: a 45M Llama made here)")
    ap.add_argument("--lora", type=int, default=0, help="lora.r for every run (0: full fine-tuning)")
    ap.add_argument("--heap-mib", default=None,
                    help="memory.mmap_threshold_mib for the runs (0: glibc's default heap); default: the setting's")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="validate-ranks-")  # the model and the run directories: not results
    model = a.model or make_model(os.path.join(work, "model"))
    rows = []
    for profile in a.profiles.split(","):
        for n in (int(x) for x in a.ranks.split(",")):
            rows.append(run(work, model, profile, n, heap_mib=a.heap_mib, lora=a.lora))
            together(rows)
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    with open(os.path.join(a.out, "per_rank.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "mmap_threshold_mib": a.heap_mib or "auto",
                   "model": a.model or "llama-45m (made here)", "lora_r": a.lora, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out, "per_rank.md"), "w") as f:
        f.write(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
