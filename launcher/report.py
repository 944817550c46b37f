"""The plan as a text table for people (``vramfit plan``); ``--json`` prints :meth:`Plan.to_json` instead."""

from __future__ import annotations

from launcher.planner import Plan
from launcher.units import GiB, gib


def format_table(plan: Plan) -> str:
    dev = plan.settings.get("device", "cuda")
    m = plan.model
    s = plan.settings
    lines = [f"model {m.get('name')} ({m.get('architecture')}): {m.get('params', 0) / 1e9:.2f}B parameters, "
             f"{m.get('trainable_params', 0) / 1e6:.1f}M trainable; {s.get('precision')} on {dev}, seq {s.get('seq_len')}, "
             f"checkpointing {'on' if s.get('gradient_checkpointing') else 'off'}, LoRA r={s.get('lora_r')}, "
             f"quantize {s.get('quantize')}, optimizer {s.get('optimizer')}",
             f"budget: GPU {gib(plan.budget['gpu_bytes'])} ({plan.budget['gpu_source']}); "
             f"CPU {gib(plan.budget['cpu_bytes'])} ({plan.budget['cpu_source']})", ""]
    head = ["profile", "GPU peak GiB", "CPU peak GiB", "fits", "speed rank", "micro-batch", "note"]
    body = []
    for r in plan.profiles:
        body.append([r.profile + (" *" if r.profile == plan.chosen else ""),
                     "-" if r.device == "cpu" else (">=" if r.lower_bound else "") + f"{r.gpu_bytes / GiB:.2f}",
                     (">=" if r.lower_bound else "") + f"{r.cpu_bytes / GiB:.2f}",
                     "yes" if r.fits else "no", str(r.speed_rank), str(r.micro_batch), r.why_not or ""])
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head) - 1)]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + ("  " + row[-1] if row[-1] else "")  # noqa: E731
    lines.append(fmt(head))
    lines.append("  ".join("-" * w for w in widths) + "  ----")
    lines += [fmt(r) for r in body]
    lines.append("")
    if plan.chosen:
        c = plan.chosen_plan
        lines.append(f"chosen: {plan.chosen} -- {plan.reason}")
        for side in ("gpu", "cpu"):
            if c.parts.get(side):
                parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(c.parts[side].items(), key=lambda kv: -kv[1]))
                lines.append(f"  {side.upper()} GiB: {parts}")
    else:
        lines.append(f"chosen: none -- {plan.reason}")
    if plan.suggestions:
        lines.append("would fit:")
        lines += [f"  {x}" for x in plan.suggestions]
    return "\n".join(lines)
