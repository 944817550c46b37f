"""The plan's sentences: why a row was chosen (or why nothing was), why the runner-up lost, what the machine's
step times are worth, and what DPO's reference costs in the chosen setting."""

from __future__ import annotations

from launcher.config.schema import AUTO, Config, reference_mode
from launcher.machine.speeds import Machine
from launcher.plan.rows import ProfilePlan
from launcher.units import gib


def machine_line(machine) -> str:
    """The machine that priced the plan, and what the plan's step times are worth when its speeds are in doubt."""
    line = machine.name
    if machine.doubtful:
        line += (f" -- DOUBTFUL calibration: {machine.doubtful}; step times are a busy machine's "
                 "(`vramfit doctor --calibrate` when idle)")
    if machine.busy_now:
        line += f" -- BUSY NOW: {machine.busy_now}"
    return line


def reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run) -> str:
    """Why ``chosen`` (a row of ``pool``, the rows that can run here) was chosen, or why nothing was."""
    where = "GPU" if run.device == "cuda" else "CPU"
    if chosen is None:
        if not pool:
            return "no profile can run here: " + "; ".join(f"{r.profile}: {r.why_not}" for r in rows)
        if cfg.profile != AUTO:
            return f"profile {cfg.profile} as asked does not fit: {pool[0].why_not}"
        if cfg.deepspeed_config:
            return f"{pool[0].profile} from deepspeed_config {cfg.deepspeed_config} does not fit: {pool[0].why_not}"
        blocked_fits = [r for r in rows if r.fits and not r.available]
        if blocked_fits:
            r = min(blocked_fits, key=lambda r: r.speed_rank)
            return (f"nothing that can run here fits the budget ({gib(gpu_budget)} GPU, {gib(cpu_budget)} CPU); "
                    f"{r.profile} would fit, but {r.why_not}")
        best = min(pool, key=lambda r: (r.gpu_bytes - gpu_budget if run.device == "cuda" else 0)
                   + max(0, r.cpu_bytes - cpu_budget))
        return (f"nothing fits the budget ({gib(gpu_budget)} GPU, {gib(cpu_budget)} CPU); closest: "
                f"{best.profile} ({best.why_not})")
    faster = [r for r in pool if r.speed_rank < chosen.speed_rank]
    text = (f"fastest profile that fits: {where} peak {gib(chosen.gpu_bytes if run.device == 'cuda' else chosen.cpu_bytes)}"
            f" of {gib(gpu_budget if run.device == 'cuda' else cpu_budget)}")
    if run.device == "cuda":
        text += f", CPU {gib(chosen.cpu_bytes)} of {gib(cpu_budget)}"
    text += f", {chosen.setting}"
    if chosen.step_s is not None:
        text = text.replace("fastest profile that fits:", "fastest predicted setting that fits:", 1)
        text += f", {chosen.step_s:.3g} s/step ({chosen.tokens_per_s:.0f} tokens/s)"
    elif faster:
        text += "; faster ones do not fit: " + "; ".join(f"{r.profile} ({r.why_not})" for r in faster)
    if cfg.profile != AUTO:
        text = f"profile {cfg.profile} as asked fits: " + text.split(": ", 1)[1]
    if cfg.deepspeed_config:
        text = f"{chosen.profile} from deepspeed_config {cfg.deepspeed_config} fits: " + text.split(": ", 1)[1]
    return text


def reference_line(cfg: Config, row) -> str:
    """What DPO's reference costs in the chosen setting, and what the other choice would (neither adds memory: the
    reference pass runs before the policy's forward and frees what it made; precompute keeps 8 bytes per pair)."""
    ref = (row.time_parts or {}).get("reference_forward")
    if reference_mode(cfg) == "precompute":
        return ("DPO reference: precomputed before training (one no-grad forward over the pairs, 8 bytes each in the "
                "run directory), no reference pass per step")
    if ref is None:
        return ("DPO reference: the adapter switched off, one more no-grad forward per micro-batch (no second model); "
                "preference.reference=precompute runs it once per pair before training instead")
    per_pair = ref / max(1, cfg.train.global_batch_size)
    return (f"DPO reference: the adapter switched off, {ref:.3g} s of each step ({ref * cfg.train.max_steps:.0f} s "
            f"over {cfg.train.max_steps} steps, no second model); preference.reference=precompute: about "
            f"{per_pair:.3g} s per pair once before training, then none")


def runner_up(chosen: ProfilePlan | None, every: list[ProfilePlan], machine: Machine | None) -> dict | None:
    """The second best of ``every`` (the fitting settings, best first), and why it lost (None: there is none)."""
    # the runner-up is another setting: the chosen row may be a new object (its buckets grown) of a candidate
    second = next((c for c in every if (c.profile, c.setting) != (chosen.profile, chosen.setting)), None) \
        if chosen is not None else None
    if second is None:
        return None
    if machine is not None and second.step_s and chosen.step_s and second.step_s < chosen.step_s:
        why = (f"predicted {second.step_s:.3g} s/step against {chosen.step_s:.3g} "
               f"({chosen.step_s / second.step_s:.2f}x faster, within the model's error: the simpler was chosen)")
    elif machine is not None and second.step_s and chosen.step_s:
        why = (f"predicted {second.step_s:.3g} s/step against {chosen.step_s:.3g} "
               f"({second.step_s / chosen.step_s:.2f}x slower)")
    else:
        why = "slower by the speed ranks (no machine speeds to price steps)"
    return {"profile": second.profile, "setting": second.setting, "step_s": second.step_s, "why": why}
