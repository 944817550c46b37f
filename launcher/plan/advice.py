"""Other ways to run the job, each re-planned and priced: what would make it fit when nothing does, and what would
be faster when something does.

The changes tried: LoRA for a full fine-tune, a 4-bit or 8-bit frozen base for LoRA, checkpointing and micro-batch 1
where the config fixes them, a shorter sequence, every engine or profile where the config names one, a smaller
preset, and (when the plan is for a card of the catalogue) the next bigger cards. Single changes first; when none
fits, cumulative combinations of them. Each is planned like the run itself and listed with its predicted tokens/s,
the fastest first (by speed rank where the machine is not priced), and with what it changes about the training:
a 4-bit base changes the numerics, a shorter sequence the data, LoRA what is trained; a micro-batch, checkpointing
or an engine changes only memory and time (the global batch is kept).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from launcher.config.load import with_overrides
from launcher.config.schema import AUTO, Config, ConfigError
from launcher.machine.hardware import Hardware
from launcher.machine.speeds import Machine
from launcher.model.presets import PRESETS
from launcher.plan import gpus, planner
from launcher.plan.rows import Plan, ProfilePlan
from launcher.units import gib

SHOWN = 5  # alternatives listed at most

# What each change does to the training, beyond memory and time.
SAME = "same training (memory and time only)"


def _changes(overrides: list[str], cfg: Config) -> str:
    out = []
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key == "lora.r":
            out.append(f"trains LoRA adapters (r={value}) instead of every weight")
        elif key == "model.quantize":
            out.append(f"changes numerics: the frozen base quantized to {value.replace('bit', '-bit')} (bitsandbytes), "
                       "the adapters trained as before")
        elif key == "data.seq_len":
            out.append(f"changes the data: samples cut to {value} tokens (from {cfg.data.seq_len})")
        elif key == "model.name":
            out.append(f"another model: {value}")
        elif key == "gpu":
            out.append(f"another card: {value}")
    return "; ".join(out) or SAME


@dataclass
class Alternative:
    overrides: list[str]  # key=value changes (``gpu=NAME``: plan for that card of the catalogue instead)
    profile: str
    setting: str
    gpu_bytes: int
    cpu_bytes: int
    gpu_budget: int
    cpu_budget: int
    device: str
    speed_rank: int
    micro_batch: int
    step_s: float | None
    tokens_per_s: float | None
    changes: str  # what it changes about the training (SAME: memory and time only)

    def text(self, chosen: ProfilePlan | None = None) -> str:
        where = f"GPU {gib(self.gpu_bytes)} of {gib(self.gpu_budget)}, " if self.device == "cuda" else ""
        speed = (f"{self.tokens_per_s:.0f} tokens/s" + (f", {self.tokens_per_s / chosen.tokens_per_s:.2f}x the chosen"
                                                         if chosen is not None and chosen.tokens_per_s else "")
                 if self.tokens_per_s else f"speed rank {self.speed_rank}")
        return (f"{' '.join(self.overrides)}: {self.profile} fits ({where}CPU {gib(self.cpu_bytes)} of "
                f"{gib(self.cpu_budget)}, micro-batch {self.micro_batch}), {speed} -- {self.changes}")

    def to_dict(self) -> dict:
        return asdict(self)


def add_suggestions(plan: Plan, cfg: Config, hw: Hardware, profiles=None, world: int = 1,
                    machine: Machine | None = None, card: gpus.GPUSpec | None = None, host: Machine | None = None,
                    when_fits: bool = False, nodes: int = 1, links: dict | None = None) -> Plan:
    """``plan`` with its alternatives filled in: when nothing fits (what would), and with ``when_fits`` also when
    something does (what else fits, faster or not). ``machine`` prices them as it priced the plan; ``card`` and
    ``host``: the plan is for that catalogue card, priced from ``host``'s calibration, and bigger cards are tried."""
    if plan.suggestions or (plan.chosen is not None and not when_fits):
        return plan
    alts = alternatives(cfg, hw, profiles, world, machine, card, host, fits_already=plan.chosen is not None,
                        nodes=nodes, links=links)
    chosen = plan.chosen_plan
    if chosen is not None:  # something fits: only what is predicted faster is worth a change
        alts = [a for a in alts if a.tokens_per_s and chosen.tokens_per_s and a.tokens_per_s > chosen.tokens_per_s]
        plan.alternatives_tried = True
    plan.suggestions = [a.text(chosen) for a in alts]
    plan.suggested_overrides = [list(a.overrides) for a in alts]
    plan.alternatives = [a.to_dict() for a in alts]
    return plan


def _singles(cfg: Config, hw: Hardware, fits_already: bool) -> list[list[str]]:
    out: list[list[str]] = []
    if cfg.lora.r == 0:
        out.append(["lora.r=16"])
    if cfg.model.quantize == "none" and hw.bitsandbytes:  # 4-bit runs on the AMP path: let the engine follow
        lora = [] if cfg.lora.r else ["lora.r=16"]
        out.append([*lora, "model.quantize=4bit", "engine=auto", "profile=auto"])
        out.append([*lora, "model.quantize=8bit", "engine=auto", "profile=auto"])
    if cfg.model.gradient_checkpointing is False:  # auto: the planner has tried it already
        out.append(["model.gradient_checkpointing=true"])
    if cfg.train.micro_batch_size not in (1, AUTO):
        out.append(["train.micro_batch_size=1"])
    if cfg.data.seq_len >= 16:
        out.append([f"data.seq_len={cfg.data.seq_len // 2}"])
    if cfg.engine != AUTO:
        out.append(["engine=auto"])
    if cfg.profile != AUTO:
        out.append(["profile=auto"])
    names = list(PRESETS)
    if not fits_already and cfg.model.name in PRESETS and names.index(cfg.model.name) > 0:
        out.append([f"model.name={names[names.index(cfg.model.name) - 1]}"])
    return out


def _combos(cfg: Config, hw: Hardware) -> list[list[str]]:
    """Cumulative: checkpointing, then micro-batch 1, then LoRA, then a 4-bit base, then a shorter sequence."""
    combo: list[str] = []
    out: list[list[str]] = []
    for step in (["model.gradient_checkpointing=true"] if cfg.model.gradient_checkpointing is False else [],
                 ["train.micro_batch_size=1"] if cfg.train.micro_batch_size not in (1, AUTO) else [],
                 ["lora.r=16"] if cfg.lora.r == 0 else [],
                 ["model.quantize=4bit", "engine=auto", "profile=auto"]
                 if cfg.model.quantize == "none" and hw.bitsandbytes else [],
                 [f"data.seq_len={cfg.data.seq_len // 2}"] if cfg.data.seq_len >= 16 else []):
        if step:
            combo = combo + step
            out.append(list(combo))
    return out


def _bigger_cards(card: gpus.GPUSpec | None, count: int = 3) -> list[gpus.GPUSpec]:
    """The next ``count`` cards of the catalogue by memory, bigger than ``card``."""
    if card is None:
        return []
    # the smallest memory first, and of equal memory the slower card first (as a rule the cheaper one)
    specs = sorted((gpus.find(n) for n in gpus.names()), key=lambda s: (s.memory_bytes, s.bandwidth_gb_s))
    return [s for s in specs if s.memory_bytes > card.memory_bytes * 1.05][:count]


def _try(cfg: Config, hw: Hardware, overrides: list[str], profiles, world: int,
         machine: Machine | None, nodes: int = 1, links: dict | None = None) -> Alternative | None:
    trial = with_overrides(cfg, overrides)
    if trial.model.quantize != "none" and trial.lora.r == 0:
        return None
    try:
        p = planner.plan(trial, hw, profiles=None if "engine=auto" in overrides or "profile=auto" in overrides
                         else profiles, world=world, machine=machine, exact_rows=False, nodes=nodes, links=links)
    except ConfigError:  # e.g. a micro-batch a deepspeed_config's explicit one disagrees with
        return None
    c = p.chosen_plan
    if c is None:
        return None
    return Alternative(overrides=list(overrides), profile=c.profile, setting=c.setting, gpu_bytes=c.gpu_bytes,
                       cpu_bytes=c.cpu_bytes, gpu_budget=p.budget["gpu_bytes"], cpu_budget=p.budget["cpu_bytes"],
                       device=c.device, speed_rank=c.speed_rank, micro_batch=c.micro_batch, step_s=c.step_s,
                       tokens_per_s=c.tokens_per_s, changes=_changes(overrides, cfg))


def alternatives(cfg: Config, hw: Hardware, profiles=None, world: int = 1, machine: Machine | None = None,
                 card: gpus.GPUSpec | None = None, host: Machine | None = None,
                 fits_already: bool = False, nodes: int = 1, links: dict | None = None) -> list[Alternative]:
    """Up to :data:`SHOWN` changes that fit, each re-planned, the fastest first: single changes, then (when no
    single change fits and the run does not) cumulative combinations, then bigger cards of the catalogue."""
    found: list[Alternative] = []
    seen: set = set()
    groups = [_singles(cfg, hw, fits_already)] + ([] if fits_already else [_combos(cfg, hw)])
    for group in groups:
        for ov in group:
            if tuple(ov) in seen:
                continue
            seen.add(tuple(ov))
            alt = _try(cfg, hw, ov, profiles, world, machine, nodes, links)
            if alt is not None:
                found.append(alt)
        if found:  # combinations only when no single change is enough
            break
    if card is not None and host is not None:
        for spec in _bigger_cards(card):
            p = planner.plan(cfg, gpus.hardware(spec, hw), profiles=profiles, world=world,
                             machine=gpus.machine(spec, host), exact_rows=False, nodes=nodes,
                             links=gpus.links(spec, links["inter"] * 8 / 1e9) if links else None)
            c = p.chosen_plan
            if c is not None:
                found.append(Alternative(overrides=[f"--gpu {spec.name}"], profile=c.profile, setting=c.setting,
                                         gpu_bytes=c.gpu_bytes, cpu_bytes=c.cpu_bytes, gpu_budget=p.budget["gpu_bytes"],
                                         cpu_budget=p.budget["cpu_bytes"], device=c.device, speed_rank=c.speed_rank,
                                         micro_batch=c.micro_batch, step_s=c.step_s, tokens_per_s=c.tokens_per_s,
                                         changes=f"another card: {spec.title}, same training"))
                break  # the smallest bigger card that fits
    priced = all(a.tokens_per_s for a in found)
    found.sort(key=lambda a: -a.tokens_per_s if priced else a.speed_rank)
    return found[:SHOWN]
