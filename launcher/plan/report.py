"""The plan as a text table for people (``vramfit plan``); ``--json`` prints :meth:`Plan.to_json` instead."""

from __future__ import annotations

from launcher.plan.rows import Plan
from launcher.units import GiB, gib


def format_table(plan: Plan) -> str:
    dev = plan.settings.get("device", "cuda")
    m = plan.model
    s = plan.settings
    ck = s.get("gradient_checkpointing")
    ck = ("searched" if ck == "auto" else "on" if ck is True else "off") + (
        f" (every {s.get('checkpoint_every')} layers)" if ck is True and (s.get("checkpoint_every") or 1) > 1 else "")
    lines = [f"model {m.get('name')} ({m.get('architecture')}): {_count(m.get('params', 0))} parameters, "
             f"{_count(m.get('trainable_params', 0))} trainable; {s.get('precision')} on {dev}, seq {s.get('seq_len')}, "
             f"checkpointing {ck}, LoRA r={s.get('lora_r')}, quantize {s.get('quantize')}, optimizer {s.get('optimizer')}",
             f"budget: GPU {gib(plan.budget['gpu_bytes'])} ({plan.budget['gpu_source']}); "
             f"CPU {gib(plan.budget['cpu_bytes'])} ({plan.budget['cpu_source']})",
             f"step times: {plan.machine or plan.assumptions.get('step_time', 'not priced')}"]
    if plan.activations_counted:
        lines.append(f"ESTIMATE: {plan.activations_counted}; activations are counted from the config's sizes "
                     "(docs/planner.md, when no trace can be made), weights and optimizer states exactly; steps are not "
                     "priced")
    lines.append("")
    priced = any(r.step_s is not None for r in plan.profiles)
    head = ["profile", "GPU peak GiB", "CPU peak GiB", "fits", "micro-batch", "checkpointing",
            "s/step" if priced else "speed rank", "tokens/s" if priced else "", "note"]
    body = []
    for r in plan.profiles:
        ckpt = "off" if not r.checkpointing else ("all" if r.checkpoint_every == 1 else f"every {r.checkpoint_every}")
        ckpt += " + act. offload" if r.offload_activations else ""
        body.append([r.profile + (" *" if r.profile == plan.chosen else ""),
                     "-" if r.device == "cpu" else (">=" if r.lower_bound else "") + f"{r.gpu_bytes / GiB:.2f}",
                     (">=" if r.lower_bound else "") + f"{r.cpu_bytes / GiB:.2f}",
                     "yes" if r.fits else "no", str(r.micro_batch), ckpt,
                     (f"{r.step_s:.3g}" if r.step_s is not None else "-") if priced else str(r.speed_rank),
                     (f"{r.tokens_per_s:.0f}" if r.tokens_per_s is not None else "-") if priced else "",
                     r.why_not or ""])
    if not priced:  # no tokens/s column
        head, body = head[:7] + head[8:], [row[:7] + row[8:] for row in body]
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
                lines.append(f"  {side.upper()} GiB: {parts}" + (f" (the {c.host_peak_phase} phase)" if side == "cpu"
                                                                   and c.host_phases else ""))
        if c.host_phases:
            lines.append("  host GiB by phase: " + ", ".join(f"{ph} {sum(p.values()) / GiB:.2f}"
                                                           for ph, p in c.host_phases.items())
                         + (f"; pinned {c.pinned_bytes / GiB:.2f} as torch's allocator holds it" if c.pin_memory
                            else "") + (f"; export --merge later {c.export_bytes / GiB:.2f}" if c.export_bytes else ""))
        if c.time_parts:
            lines.append("  step s: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(c.time_parts.items(),
                                                                                     key=lambda kv: -kv[1])))
        if plan.runner_up:
            ru = plan.runner_up
            lines.append(f"runner-up: {ru['profile']}, {ru['setting']} -- {ru['why']}")
    else:
        lines.append(f"chosen: none -- {plan.reason}")
    if plan.alternatives_tried and not plan.suggestions:
        lines.append("other ways, re-planned: none is predicted faster")
    if plan.suggestions:
        lines.append(("other ways, re-planned" if plan.chosen else "would fit, re-planned")
                     + (", fastest first:" if plan.alternatives and all(a["tokens_per_s"] for a in plan.alternatives)
                        else ":"))
        lines += [f"  {x}" for x in plan.suggestions]
    return "\n".join(lines)


def _count(n: float) -> str:
    """'6.74B', '124M', '0.92M'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
