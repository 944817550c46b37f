"""What would make a run fit when nothing does: single changes first (LoRA, checkpointing, micro-batch 1, a
shorter sequence, another engine, a smaller preset), then cumulative combinations, each re-planned."""

from __future__ import annotations

from launcher.config.schema import AUTO, Config, ConfigError, with_overrides
from launcher.machine.hardware import Hardware
from launcher.model.presets import PRESETS
from launcher.plan import planner
from launcher.units import gib


def add_suggestions(plan: planner.Plan, cfg: Config, hw: Hardware, profiles=None, world: int = 1) -> planner.Plan:
    """``plan`` with its suggestions filled in when nothing fits (it is returned as it is otherwise)."""
    if plan.chosen is None and not plan.suggestions:
        plan.suggestions, plan.suggested_overrides = suggestions(cfg, hw, profiles, world)
    return plan



def suggestions(cfg: Config, hw: Hardware, profiles=None, world: int = 1) -> tuple[list[str], list[list[str]]]:
    """Up to five ``key=value`` changes that make the run fit, each re-planned: single changes first,
    cumulative combinations only when no single change is enough."""

    singles: list[list[str]] = []
    if cfg.lora.r == 0:
        singles.append(["lora.r=16"])
    if cfg.model.gradient_checkpointing is False:  # auto: the planner has tried it already
        singles.append(["model.gradient_checkpointing=true"])
    if cfg.train.micro_batch_size not in (1,):
        singles.append(["train.micro_batch_size=1"])
    if cfg.data.seq_len >= 16:
        singles.append([f"data.seq_len={cfg.data.seq_len // 2}"])
    if cfg.engine != AUTO:
        singles.append(["engine=auto"])
    if cfg.profile != AUTO:
        singles.append(["profile=auto"])
    # cumulative: checkpointing, then micro-batch 1, then LoRA, then 4-bit base, then shorter sequences
    combo: list[str] = []
    combos: list[list[str]] = []
    for step in (["model.gradient_checkpointing=true"] if cfg.model.gradient_checkpointing is False else [],
                 ["train.micro_batch_size=1"] if cfg.train.micro_batch_size != 1 else [],
                 ["lora.r=16"] if cfg.lora.r == 0 else [],
                 ["model.quantize=4bit", "engine=auto", "profile=auto"]
                 if cfg.model.quantize == "none" and hw.bitsandbytes else [],
                 [f"data.seq_len={cfg.data.seq_len // 2}"] if cfg.data.seq_len >= 16 else []):
        if step:
            combo = combo + step
            combos.append(list(combo))
    names = list(PRESETS)
    if cfg.model.name in PRESETS and names.index(cfg.model.name) > 0:
        smaller = names[names.index(cfg.model.name) - 1]
        singles.append([f"model.name={smaller}"])
    out, outs = [], []
    seen = set()
    for group in (singles, combos):
        for ov in group:
            key = tuple(ov)
            if key in seen:
                continue
            seen.add(key)
            trial = with_overrides(cfg, ov)
            if trial.model.quantize != "none" and trial.lora.r == 0:
                continue
            try:
                p = planner.plan(trial, hw, profiles=None if "engine=auto" in ov or "profile=auto" in ov else profiles,
                                 world=world)
            except ConfigError:  # e.g. a micro-batch a deepspeed_config's explicit one disagrees with
                continue
            if p.chosen is None:
                continue
            c = p.chosen_plan
            where = (f"GPU {gib(c.gpu_bytes)} of {gib(p.budget['gpu_bytes'])}, " if c.device == "cuda" else "")
            out.append(f"{' '.join(ov)}: {c.profile} fits ({where}CPU {gib(c.cpu_bytes)} of "
                       f"{gib(p.budget['cpu_bytes'])}, micro-batch {c.micro_batch}, speed rank {c.speed_rank})")
            outs.append(ov)
        if out:  # single changes first; combinations only when no single change is enough
            break
    return out[:5], outs[:5]
