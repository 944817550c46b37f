"""What scripts/gpu_bench.sh reads back from its own stages: the largest micro-batch a profile reached, and the
short summary table printed last (also written to OUT/summary.md).

    python scripts/gpu_bench_report.py best-micro-batch OUT/find_mb_16gb/results.json zero2-bf16
    python scripts/gpu_bench_report.py summary OUT amp-bf16 amp-bf16-offload-opt [zero2-bf16-offload-opt]

Each measured row is shown beside the planner's prediction for it: GPU bytes always, the step time where the host
was calibrated (``predicted_step_s``; "-" where the plan was not priced).
"""

from __future__ import annotations

import json
import os
import sys

G = 2**30


def load(out: str, name: str) -> list[dict]:
    p = os.path.join(out, name, "results.json")
    return json.load(open(p))["results"] if os.path.exists(p) else []


def best_micro_batch(results_json: str, profile: str) -> str:
    rows = json.load(open(results_json))["results"]
    return str(next((r.get("best_micro_batch") or "" for r in rows if r["profile"] == profile), ""))


def _gib(x) -> str:
    return "-" if not x else f"{x / G:.2f}"


def _tps(x) -> str:
    return "-" if not x else f"{x:.0f}"


def _step(r: dict) -> str:
    """'measured / planned' seconds per step."""
    m, p = r.get("step_s"), r.get("predicted_step_s")
    return f"{m:.3g} / {p:.3g}" if m and p else (f"{m:.3g} / -" if m else "-")


def _same(out: str, name: str, nooff: str, title: str) -> list[str]:
    """A stage that ran several profiles at one setting: tokens/s as ratios to ``nooff``'s."""
    rows = load(out, name)
    if not rows:
        return []
    base = next((r.get("tokens_per_s") for r in rows if r["profile"] == nooff), None)
    lines = ["", f"{title}: profile | status | tokens/s | vs {nooff} | step s measured / planned | peak GPU GiB | "
                 "planned GPU GiB | peak CPU GiB"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base and r.get("tokens_per_s") else "-"
        lines.append(f"  {r['profile']} | {r['status']} | {_tps(r.get('tokens_per_s'))} | {ratio} | {_step(r)} | "
                     f"{_gib(r.get('peak_gpu_bytes'))} | {_gib(r.get('predicted_gpu_bytes'))} | "
                     f"{_gib(r.get('peak_cpu_rss_bytes'))}")
    return lines


def summary(out: str, nooff: str, off: str, zoff: str | None = None) -> str:
    stages = open(os.path.join(out, "stages.tsv")).read().splitlines()[1:]
    lines = ["", f"# gpu_bench summary ({out})", "",
             "stages: " + "; ".join("{} {}".format(*row.split("\t")[:2]) for row in stages), ""]
    lines += _same(out, "same_mb", nooff, "same setting, whole card (llama-1b, micro-batch 8 on a GPU)")
    card = load(out, "card")
    if card:
        lines += ["", "card: profile | status | tokens/s | ratio | peak GPU GiB | planned GPU GiB | peak CPU GiB | "
                  "step s measured / planned"]
        lines += [f"  {r['profile']} | {r['status']} | {_tps(r.get('tokens_per_s'))} | {r.get('ratio_to_fastest') or '-'} | "
                  f"{_gib(r.get('peak_gpu_bytes'))} | {_gib(r.get('predicted_gpu_bytes'))} | {_gib(r.get('peak_cpu_rss_bytes'))}"
                  f" | {_step(r)}" for r in card]
    fa = {r["profile"]: r for r in load(out, "find_mb_16gb")}
    if fa:
        a, b = fa.get(nooff, {}), fa.get(off, {})
        lines += ["", "(a) 16 GB cap, largest micro-batch (measured / planner) and tokens/s there:"]
        for name, r in ((nooff, a), (off, b), *(((zoff, fa[zoff]),) if zoff in fa else ())):
            lines.append(f"  {name}: mb {r.get('best_micro_batch') or '-'} / {r.get('planned_best_micro_batch') or '-'}, "
                         f"{_tps(r.get('tokens_per_s'))} tokens/s, peak GPU {_gib(r.get('peak_gpu_bytes'))} GiB")
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            lines.append(f"  offload / no offload, each at its best: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x")
        if zoff in fa and a.get("tokens_per_s") and fa[zoff].get("tokens_per_s"):
            lines.append(f"  {zoff} / no offload, each at its best: {fa[zoff]['tokens_per_s'] / a['tokens_per_s']:.2f}x")
        for e in load(out, "equal_mb_16gb"):
            if e.get("tokens_per_s") and a.get("tokens_per_s"):
                lines.append(f"  {e['profile']} / no offload at micro-batch {e.get('micro_batch')}: "
                             f"{e['tokens_per_s'] / a['tokens_per_s']:.2f}x")
    fb = load(out, "find_model_16gb")
    if fb:
        lines += ["", "(b) 16 GB cap, largest model that trains (measured / planner):"]
        lines += [f"  {r['profile']}: {r.get('best_model') or '-'} / {r.get('planned_best_model') or '-'}  (tried: "
                  + ", ".join(f"{c['candidate']} {c['status']}" for c in r.get("candidates", [])) + ")" for r in fb]
    lines += _same(out, "card_24gb", nooff, "24 GB cap (llama-1b, micro-batch 4 on a GPU)")
    lines += _same(out, "lora_16gb", nooff, "16 GB cap, LoRA r=16")
    lines += _same(out, "qlora_16gb", nooff, "16 GB cap, QLoRA r=16 (4-bit base)")
    mon = os.path.join(out, "monitor", "bench_monitor.json")
    if os.path.exists(mon):
        m = json.load(open(mon))
        lines += ["", f"monitor overhead: {m['overhead_pct']:+.2f}% tokens/s (median paired ratio "
                      f"{m['median_paired_ratio']:.3f}); direct {m['direct']['loop_calls_us_per_step']:.0f} us/step"]
    vp = os.path.join(out, "validate_planner", "validate_planner.json")
    if os.path.exists(vp):
        v = json.load(open(vp))
        lines += ["", f"planner validation ({v.get('part')}): max |error| {v.get('max_abs_err_pct')}%"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "best-micro-batch":
        print(best_micro_batch(argv[1], argv[2]))
        return 0
    if len(argv) in (4, 5) and argv[0] == "summary":
        text = summary(*argv[1:])
        with open(os.path.join(argv[1], "summary.md"), "w") as fh:
            fh.write(text + "\n")
        print(text)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
