"""The plan's rows and the plan itself: what a row is (one profile at the setting planned for it, its peaks by
named part, its step time), how its setting reads, and how rows rank against each other."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from launcher.machine.speeds import Machine
from launcher.plan import availability, steptime
from launcher.plan.availability import Availability


@dataclass
class ProfilePlan:
    profile: str
    engine: str
    precision: str
    device: str  # 'cuda' | 'cpu' (where the "gpu" side runs; on 'cpu' everything is CPU)
    gpu_bytes: int
    cpu_bytes: int
    fits: bool  # memory only: both peaks inside their budgets
    parts: dict  # {"gpu": {part: bytes}, "cpu": {part: bytes}} at the peak; sums to gpu_bytes / cpu_bytes
    speed_rank: int
    micro_batch: int
    accumulation: int
    why_not: str | None = None  # why it cannot be chosen (memory, engine, settings); None when it can
    available: bool = True  # engine and settings allow it here
    gpu_tensor_bytes: int = 0  # gpu_bytes without cuda_context and allocator_slack: compare with max_memory_allocated
    peak_phase: str = "forward_backward"
    phases: dict = field(default_factory=dict)  # {"forward_backward": {part: bytes}, "optimizer_step": {...}}
    lower_bound: bool = False  # model states alone exceed a budget, so activations were not traced
    checkpointing: bool = False  # activation checkpointing in this row's setting
    checkpoint_every: int = 1  # with checkpointing: every k-th decoder layer recomputes
    chunked_loss: bool = False  # head + cross-entropy in chunks (loss.chunked)
    offload_activations: bool = False  # saved activations in CPU memory (memory.offload_activations)
    activations_counted: str | None = None  # no trace could be made (why): activations counted from the config
    step_s: float | None = None  # predicted seconds per optimizer step (None: no machine speeds to price it)
    tokens_per_s: float | None = None
    eta_s: float | None = None  # the whole run (train.max_steps steps)
    time_parts: dict = field(default_factory=dict)  # part -> seconds per step (launcher.plan.steptime)
    time_notes: list = field(default_factory=list)
    reduce_bucket_size: int | None = None  # DeepSpeed on one rank: the gradient bucket the run gets (elements)
    checkpoint_bytes: int = 0  # one checkpoint on disk (trainable weights, optimizer state, loop state)
    final_bytes: int = 0  # final/ on disk (the adapter, or the whole model)
    host_phases: dict = field(default_factory=dict)  # {setup|train|checkpoint|final: {part: bytes}} of the host
    host_peak_phase: str = "train"  # the host phase whose total is cpu_bytes
    pin_memory: bool = False  # the engine's CPU buffers page-locked (a GPU run where they fit the host's budget)
    pinned_bytes: int = 0  # what torch's pinned allocator holds for them (blocks rounded up to powers of two)
    export_bytes: int = 0  # host peak of `vramfit export --merge` afterwards (0: nothing to merge)

    @property
    def setting(self) -> str:
        """'micro-batch 8, checkpointing every 2nd layer' and the like."""
        ck = "off" if not self.checkpointing else ("every layer" if self.checkpoint_every == 1
                                                    else f"every {_nth(self.checkpoint_every)} layer")
        extra = (", chunked loss" if self.chunked_loss else "") + (", activations offloaded" if self.offload_activations
                                                                    else "")
        return f"micro-batch {self.micro_batch}, checkpointing {ck}{extra}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Plan:
    profiles: list[ProfilePlan]
    chosen: str | None
    reason: str
    budget: dict  # gpu_bytes, cpu_bytes, gpu_source, cpu_source
    suggestions: list[str] = field(default_factory=list)
    suggested_overrides: list[list[str]] = field(default_factory=list)  # key=value lists behind suggestions
    alternatives: list = field(default_factory=list)  # the same, as records (launcher.plan.advice.Alternative)
    alternatives_tried: bool = False  # alternatives were looked for although something fits
    model: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    assumptions: dict = field(default_factory=dict)
    activations: dict = field(default_factory=dict)  # trace summaries by family
    seconds: float = 0.0
    machine: str | None = None  # whose speeds priced the steps (None: not priced, speed ranks decide)
    candidates: list = field(default_factory=list)  # every setting that fits, fastest first (profile, setting, step_s)
    runner_up: dict | None = None  # the second best, and why it lost

    def get(self, name: str) -> ProfilePlan | None:
        return next((p for p in self.profiles if p.profile == name), None)

    @property
    def chosen_plan(self) -> ProfilePlan | None:
        return self.get(self.chosen) if self.chosen else None

    @property
    def micro_batch(self) -> int | None:
        p = self.chosen_plan
        return p.micro_batch if p else None

    def to_json(self) -> dict:
        """The ``vramfit plan --json`` document (a dict; ``json.dumps`` it)."""
        return {"profiles": [p.to_dict() for p in self.profiles], "chosen": self.chosen, "reason": self.reason,
                "budget": dict(self.budget), "suggestions": list(self.suggestions),
                "suggested_overrides": [list(o) for o in self.suggested_overrides],
                "alternatives": list(self.alternatives), "model": self.model,
                "settings": self.settings, "assumptions": self.assumptions, "activations": self.activations,
                "seconds": round(self.seconds, 3), "machine": self.machine, "candidates": list(self.candidates),
                "runner_up": self.runner_up, "activations_counted": self.activations_counted}

    @property
    def activations_counted(self) -> str | None:
        """Why the activations are counted from the config rather than traced (None: traced, as usual)."""
        return next((r.activations_counted for r in self.profiles if r.activations_counted), None)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def rank_key(r: ProfilePlan, avail: Availability, machine: Machine | None) -> tuple:
    """How rows rank, best first: priced, by predicted step time (the catalogue's order on a tie); not priced, by the
    catalogue's order, checkpointing off before on."""
    tie = availability.rank_key(avail.profile(r.profile), avail.device.type)
    return (r.step_s, tie) if machine is not None and r.step_s is not None else (tie, not r.checkpointing)


def simplest_within_error(fitting: list[ProfilePlan], avail: Availability) -> tuple[ProfilePlan, str | None]:
    """The row to choose of ``fitting`` (priced, fastest first): the fastest, unless a setting with less offload or
    fewer moving parts (:func:`launcher.plan.steptime.moving_parts`) is predicted within the model's measured error
    of it (:func:`launcher.plan.steptime.model_error`, the larger of the two families'): then the simplest of those,
    and why. A prediction closer than the model's error is not a reason to move every weight over PCIe."""
    fastest = fitting[0]
    f_prof = avail.profile(fastest.profile)

    def parts(r: ProfilePlan) -> tuple:
        return steptime.moving_parts(avail.profile(r.profile), r.offload_activations)

    close = [r for r in fitting if r.step_s is not None and parts(r) < parts(fastest)
             and r.step_s <= fastest.step_s * (1 + max(steptime.model_error(f_prof), steptime.model_error(avail.profile(r.profile))))]
    if not close:
        return fastest, None
    pick = min(close, key=lambda r: (parts(r), r.step_s))
    err = max(steptime.model_error(f_prof), steptime.model_error(avail.profile(pick.profile)))
    return pick, (f"{fastest.profile} is predicted {pick.step_s / fastest.step_s:.2f}x faster ({fastest.step_s:.3g} "
                  f"s/step), within the model's measured error ({err:.0%}): chose the simpler, with less offload or "
                  "fewer moving parts")


def _nth(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")
