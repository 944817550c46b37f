"""The memory plan: for every profile, the GPU and CPU peak of one training run, by named part, and the
choice of the fastest profile that fits.

Pure: no GPU, no weights, no printing, no environment (the hardware comes in as data). The model's shape
comes from its config on the meta device (:mod:`launcher.memory.shape`), its activations from a traced
forward + backward (:mod:`launcher.memory.trace`), the model states from the arithmetic of
:mod:`launcher.memory.states`, and what can run here from :mod:`launcher.availability`.

A GPU peak is the larger of two phases: forward + backward (model states that live through the
step, activations and logits at their traced peak, gradient buckets) and the optimizer step (model
states plus the gradients in the form the update reads them, e.g. DeepSpeed's fp32 copy of the flat
gradient partition). Parts named: ``weights``, ``gradients``, ``master_weights``, ``optimizer_states``,
``activations``, ``logits``, ``autocast_weight_cache``, ``buffers``, ``cuda_context``,
``allocator_slack`` (GPU) and ``runtime``, ``model_load`` (CPU). The loop is assumed to keep only the
loss of a forward (not the logits) through backward.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch

from launcher import availability, hfconfig
from launcher.availability import Availability
from launcher.config import AUTO, Config, packs_samples
from launcher.hardware import Hardware
from launcher.memory.shape import count_params
from launcher.memory.states import (
    ALLOCATOR_SLACK,
    AMP_OPTIMIZER_WORKSPACE,
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    QUANT_BYTES_PER_PARAM,
    RunShape,
    add_part,
    model_states,
)
from launcher.memory.trace import ActivationEstimate, TraceSettings, estimate_activations
from launcher.precision import DTYPES
from launcher.profiles import PROFILES, Profile
from launcher.units import GiB, gib

PHASES = ("forward_backward", "optimizer_step")


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
    model: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    assumptions: dict = field(default_factory=dict)
    activations: dict = field(default_factory=dict)  # trace summaries by family
    seconds: float = 0.0

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
                "suggested_overrides": [list(o) for o in self.suggested_overrides], "model": self.model,
                "settings": self.settings, "assumptions": self.assumptions, "activations": self.activations,
                "seconds": round(self.seconds, 3)}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# Activations of a run, per trace family


# ------------------------------------------------------------------------------------------------
# Budgets


def budgets(cfg: Config, hw: Hardware, device: str) -> tuple[int, int, dict]:
    """(gpu_bytes, cpu_bytes, {"gpu": source, "cpu": source}).

    GPU: ``memory.gpu_budget`` GiB, else the free memory of the GPU now minus ``memory.margin``; 0 when
    training runs on the CPU. CPU: ``memory.cpu_budget`` GiB, else available RAM minus the margin.
    """
    m = cfg.memory
    margin = float(m.margin)
    if device == "cpu":
        gpu, gsrc = 0, "no GPU: training runs on the CPU" if not hw.has_cuda else "device=cpu: the GPU is not used"
    elif m.gpu_budget != AUTO:
        gpu, gsrc = int(float(m.gpu_budget) * GiB), f"memory.gpu_budget={m.gpu_budget} GiB"
    else:
        g = hw.gpu(0)
        gpu = int(g.free_bytes * (1 - margin))
        gsrc = f"{g.name}: {g.free_bytes / GiB:.1f} GiB free now minus {margin:.0%} margin (memory.margin)"
    if m.cpu_budget != AUTO:
        cpu, csrc = int(float(m.cpu_budget) * GiB), f"memory.cpu_budget={m.cpu_budget} GiB"
    else:
        cpu = int(hw.ram_available_bytes * (1 - margin))
        csrc = f"RAM: {hw.ram_available_bytes / GiB:.1f} GiB available now minus {margin:.0%} margin (memory.margin)"
    return gpu, cpu, {"gpu": gsrc, "cpu": csrc}


# ------------------------------------------------------------------------------------------------
# Activations of a run, per trace family


def _attention_kernel(run: RunShape, dtype: torch.dtype) -> str:
    """The SDPA kernel the target runs: flash for 16-bit on capability >= 8, memory-efficient otherwise
    (CUDA); CPU's flash kernel (without dropout; the trace falls back to math when dropout is on). Packed samples
    bring a mask, which CUDA's flash kernel does not take: the memory-efficient one runs."""
    if run.attn_implementation != "sdpa":
        return "math"
    if run.device == "cpu":
        return "flash"
    if run.packed:
        return "efficient"
    if dtype in (torch.float16, torch.bfloat16) and run.capability[0] >= 8:
        return "flash"
    return "efficient"


def _family(p: Profile) -> str:
    """Which trace a profile's activations come from: 'amp' (fp32 weights under autocast), '16bit' (the
    whole model in fp16/bf16: DeepSpeed, FSDP's param dtype) or 'fp32'."""
    if p.precision == "fp32":
        return "fp32"
    return "amp" if p.engine == "amp" else "16bit"


def _trace_settings(run: RunShape, family: str, micro_batch: int) -> TraceSettings:
    cd = DTYPES[run.precision]
    if family == "fp32":
        pdt, adt, ac = torch.float32, torch.float32, None
    elif family == "16bit":
        pdt, adt, ac = cd, cd, None
    else:  # amp: fp32 master weights under autocast; a LoRA base is frozen in 16 bits, adapters fp32
        pdt, adt, ac = (cd if run.lora_r else torch.float32), torch.float32, cd
    kernel = _attention_kernel(run, cd if ac is not None or family == "16bit" else torch.float32)
    return TraceSettings(batch_size=micro_batch, seq_len=run.seq_len, param_dtype=pdt, adapter_dtype=adt,
                         autocast_dtype=ac, target=run.device, attn_implementation=run.attn_implementation,
                         attention_kernel=kernel, gradient_checkpointing=run.checkpointing, lora_r=run.lora_r,
                         lora_targets=run.lora_targets, lora_dropout=run.lora_dropout, packed=run.packed)


class PlanError(RuntimeError):
    """The model could not be measured (its forward does not run on the meta device)."""


def _activations(run: RunShape, family: str, micro_batch: int) -> ActivationEstimate:
    try:
        return estimate_activations(run.config, _trace_settings(run, family, micro_batch), run.trust_remote_code)
    except Exception as e:
        arch = type(run.config).__name__.replace("Config", "")
        raise PlanError(f"the activation trace of {arch} failed on the meta device ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); the memory plan needs it. Fix: name a "
                        "profile (profile=NAME) to train without the plan, and report the model") from e


_ACT_PARTS = {"embeddings": "activations", "layer": "activations", "other": "activations",
              "body_bwd": "activations", "head": "logits", "head_bwd": "logits",
              "autocast_cache": "autocast_weight_cache", "param_grad": "gradients"}


def _activation_parts(est: ActivationEstimate, with_grads: bool) -> dict[str, int]:
    src = est.peak_with_grads_parts if with_grads else est.peak_parts
    out: dict[str, int] = {}
    for cat, n in src.items():
        part = _ACT_PARTS.get(cat, "activations")
        out[part] = out.get(part, 0) + n
    return out


# ------------------------------------------------------------------------------------------------
# Model states per profile


def _phase_total(parts: dict) -> int:
    return sum(parts.values())


def _plan_profile(p: Profile, run: RunShape, micro_batch: int, gpu_budget: int, cpu_budget: int,
                  skip_trace_over_budget: bool = True) -> ProfilePlan:
    accumulation = max(1, run.global_batch // (micro_batch * run.world))
    st = model_states(p, run, accumulation)
    runtime = CPU_RUNTIME_BYTES[run.device]
    on_gpu = run.device == "cuda"
    # Model states alone over a budget: report that lower bound without tracing activations.
    states_gpu = max(_phase_total(st["gpu_fb"]), _phase_total(st["gpu_step"]))
    states_cpu = runtime + max(st["cpu_load"], _phase_total(st["cpu"]))
    if not on_gpu:
        states_cpu = runtime + max(st["cpu_load"], _phase_total(st["cpu"]) + states_gpu)
    over = (on_gpu and states_gpu > gpu_budget) or states_cpu > cpu_budget
    fb = dict(st["gpu_fb"])
    lower_bound = False
    if over and skip_trace_over_budget:
        lower_bound = True
    else:
        est = _activations(run, _family(p), micro_batch)
        grads_from_trace = p.engine == "amp" and accumulation == 1
        for part, n in _activation_parts(est, with_grads=grads_from_trace).items():
            add_part(fb, part, n)
    phases = {"forward_backward": fb, "optimizer_step": dict(st["gpu_step"])}
    peak_phase = max(PHASES, key=lambda k: _phase_total(phases[k]))
    tensor_peak = _phase_total(phases[peak_phase])
    gpu_parts: dict = {}
    cpu_parts: dict = {}
    if on_gpu:
        gpu_parts = dict(phases[peak_phase])
        add_part(gpu_parts, "cuda_context", CUDA_CONTEXT_BYTES)
        add_part(gpu_parts, "allocator_slack", ALLOCATOR_SLACK * tensor_peak)
        cpu_states = st["cpu"]
    else:  # everything on the CPU
        cpu_states = dict(st["cpu"])
        for part, n in phases[peak_phase].items():
            add_part(cpu_states, part, n)
        add_part(cpu_states, "allocator_slack", ALLOCATOR_SLACK * tensor_peak)
    add_part(cpu_parts, "runtime", runtime)
    if st["cpu_load"] > _phase_total(cpu_states):  # loading the model on the CPU is the larger moment
        add_part(cpu_parts, "model_load", st["cpu_load"])
    else:
        for part, n in cpu_states.items():
            add_part(cpu_parts, part, n)
    gpu_bytes, cpu_bytes = _phase_total(gpu_parts), _phase_total(cpu_parts)
    fits = (gpu_bytes <= gpu_budget or not on_gpu) and cpu_bytes <= cpu_budget
    why = None
    if not fits:
        bits = []
        if on_gpu and gpu_bytes > gpu_budget:
            bits.append(f"GPU {'>= ' if lower_bound else ''}{gib(gpu_bytes)} > budget {gib(gpu_budget)}")
        if cpu_bytes > cpu_budget:
            bits.append(f"CPU {'>= ' if lower_bound else ''}{gib(cpu_bytes)} > budget {gib(cpu_budget)}")
        why = "; ".join(bits)
    return ProfilePlan(profile=p.name, engine=p.engine, precision=p.precision, device=run.device,
                       gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, fits=fits,
                       parts={"gpu": gpu_parts, "cpu": cpu_parts}, speed_rank=p.speed_rank, micro_batch=micro_batch,
                       accumulation=accumulation, why_not=why, gpu_tensor_bytes=tensor_peak if on_gpu else 0,
                       peak_phase=peak_phase, phases=phases if on_gpu else {}, lower_bound=lower_bound)


def _micro_batch_candidates(run: RunShape, asked) -> list[int]:
    if asked != AUTO:
        return [int(asked)]
    per_rank = max(1, run.global_batch // run.world)
    out, b = [], 1
    while b <= per_rank:
        if per_rank % b == 0:
            out.append(b)
        b *= 2
    return sorted(out, reverse=True)


# ------------------------------------------------------------------------------------------------
# The plan


def make_shape(cfg: Config, hw: Hardware, avail: Availability, world: int = 1) -> RunShape:
    config = hfconfig.load(cfg.model.name, cfg.model.trust_remote_code)
    targets = tuple(cfg.lora.target_modules) or ("all-linear",)
    counts = count_params(config, cfg.lora.r, targets, cfg.model.trust_remote_code)
    device = avail.device.type
    return RunShape(config=config, counts=counts, device=device,
                    capability=hw.gpu(avail.device.index or 0).capability if device == "cuda" else (0, 0),
                    precision=avail.precision, seq_len=int(cfg.data.seq_len),
                    global_batch=int(cfg.train.global_batch_size), world=world,
                    checkpointing=bool(cfg.model.gradient_checkpointing),
                    attn_implementation="sdpa" if cfg.model.attn_implementation == AUTO else cfg.model.attn_implementation,
                    lora_r=int(cfg.lora.r), lora_targets=targets, lora_dropout=float(cfg.lora.dropout),
                    quantize=cfg.model.quantize, optimizer=cfg.train.optimizer,
                    trust_remote_code=bool(cfg.model.trust_remote_code), packed=packs_samples(cfg.data))


def plan(cfg: Config, hw: Hardware, profiles: list[str] | None = None, *, world: int = 1) -> Plan:
    """Plan every profile of the run's precision and choose the fastest one that fits.

    ``profiles``: plan only these; default: every profile of the run's precision (and the asked one).
    When nothing fits, :func:`launcher.advice.add_suggestions` says what would. ``cfg.engine`` restricts
    the choice to one engine, ``cfg.profile`` to one profile; every listed profile is still planned and
    reported, with why it cannot be chosen. ``world``: ranks of the run.
    """
    t0 = time.perf_counter()
    avail = availability.assess(cfg, hw)
    run = make_shape(cfg, hw, avail, world)
    gpu_budget, cpu_budget, sources = budgets(cfg, hw, run.device)
    names = (list(profiles) if profiles is not None else
             [n for n, p in PROFILES.items() if p.precision == avail.precision])
    if cfg.profile != AUTO and cfg.profile not in names:
        names.insert(0, cfg.profile)
    rows = [_best_micro_batch(PROFILES[n], run, cfg.train.micro_batch_size, gpu_budget, cpu_budget,
                              avail.why_not(n)) for n in names]
    pool = [r for r in rows if r.available]
    fitting = sorted((r for r in pool if r.fits), key=lambda r: availability.rank_key(PROFILES[r.profile]))
    chosen = fitting[0] if fitting else None
    reason = _reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run)
    out = Plan(profiles=rows, chosen=chosen.profile if chosen else None, reason=reason,
               budget={"gpu_bytes": gpu_budget, "cpu_bytes": cpu_budget, "gpu_source": sources["gpu"],
                       "cpu_source": sources["cpu"]},
               model=_model_summary(cfg, run), settings=_settings(cfg, run, avail.precision_reason),
               assumptions=_assumptions(run), activations=_activation_summary(run, rows))
    out.seconds = time.perf_counter() - t0
    return out


def _best_micro_batch(p: Profile, run: RunShape, asked, gpu_budget: int, cpu_budget: int,
                      blocked: str | None) -> ProfilePlan:
    """The largest candidate micro-batch that fits (a profile that cannot run is shown at the largest)."""
    best = None
    candidates = _micro_batch_candidates(run, asked)
    for b in candidates[:1] if blocked else candidates:
        row = _plan_profile(p, run, b, gpu_budget, cpu_budget)
        best = row
        if row.fits:
            break
    if blocked:
        best.available = False
        best.why_not = blocked if best.why_not is None else f"{blocked}; {best.why_not}"
    return best


def _reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run) -> str:
    where = "GPU" if run.device == "cuda" else "CPU"
    if chosen is None:
        if not pool:
            return "no profile can run here: " + "; ".join(f"{r.profile}: {r.why_not}" for r in rows)
        if cfg.profile != AUTO:
            return f"profile {cfg.profile} as asked does not fit: {pool[0].why_not}"
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
    text += f", micro-batch {chosen.micro_batch}"
    if faster:
        text += "; faster ones do not fit: " + "; ".join(f"{r.profile} ({r.why_not})" for r in faster)
    if cfg.profile != AUTO:
        text = f"profile {cfg.profile} as asked fits: " + text.split(": ", 1)[1]
    return text


def _model_summary(cfg: Config, run: RunShape) -> dict:
    c = run.counts
    return {"name": cfg.model.name, "architecture": type(run.config).__name__.replace("Config", ""),
            "params": c.total, "trainable_params": c.trainable,
            "lora_params": c.adapters, "layers": c.num_layers, "hidden_size": run.hidden,
            "vocab_size": int(getattr(run.config, "vocab_size", 0)), "counts": c.to_dict()}


def _settings(cfg: Config, run: RunShape, why_precision: str) -> dict:
    return {"device": run.device, "precision": run.precision, "precision_reason": why_precision,
            "seq_len": run.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": run.global_batch, "world_size": run.world, "gradient_checkpointing": run.checkpointing,
            "attn_implementation": run.attn_implementation, "lora_r": run.lora_r,
            "lora_target_modules": list(run.lora_targets), "quantize": run.quantize, "optimizer": run.optimizer,
            "packed": run.packed}


def _assumptions(run: RunShape) -> dict:
    return {"cuda_context_bytes": CUDA_CONTEXT_BYTES if run.device == "cuda" else 0,
            "allocator_slack_fraction": ALLOCATOR_SLACK, "cpu_runtime_bytes": CPU_RUNTIME_BYTES[run.device],
            "optimizer_workspace_bytes_per_param_amp": AMP_OPTIMIZER_WORKSPACE,
            "quantized_bytes_per_param": QUANT_BYTES_PER_PARAM,
            "loop_keeps_only_the_loss_through_backward": True}


def _activation_summary(run: RunShape, rows: list[ProfilePlan]) -> dict:
    out = {}
    for r in rows:
        if r.lower_bound:
            continue
        fam = _family(PROFILES[r.profile])
        key = f"{fam}@{r.micro_batch}"
        if key in out:
            continue
        est = _activations(run, fam, r.micro_batch)
        s = est.settings
        out[key] = {"micro_batch": r.micro_batch, "seq_len": run.seq_len, "attention_kernel": s.attention_kernel,
                    "autocast": None if s.autocast_dtype is None else str(s.autocast_dtype).replace("torch.", ""),
                    "saved_per_layer_bytes": est.saved_per_layer, "saved_bytes": est.saved, "peak_bytes": est.peak,
                    "peak_segment": est.peak_segment, "trace_seconds": round(est.trace_seconds, 3)}
    return out
