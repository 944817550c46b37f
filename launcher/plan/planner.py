"""The memory plan: for every profile, the GPU and CPU peak of one training run, by named part, and the
choice of the fastest profile that fits.

Pure: no GPU, no weights, no printing, no environment (the hardware comes in as data). The model's shape
comes from its config on the meta device (:mod:`launcher.plan.memory.shape`), its activations from a traced
forward + backward (:mod:`launcher.plan.memory.trace`), the model states from the arithmetic of
:mod:`launcher.plan.memory.states`, and what can run here from :mod:`launcher.plan.availability`.

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

from launcher.config import user_ds_config
from launcher.config.profiles import PROFILES, Profile, bucket_sizes, in_catalogue
from launcher.config.schema import (
    AUTO,
    Config,
    ConfigError,
    packs_samples,
    reference_mode,
    synthetic_vocab_problem,
)
from launcher.machine.hardware import Hardware
from launcher.machine.speeds import Machine
from launcher.model import hfconfig
from launcher.model.loss import HeadNotPlain, head_problem
from launcher.model.targets import ALL_LINEAR, with_experts
from launcher.model.targets import problems as lora_problems
from launcher.plan import availability, steptime
from launcher.plan.availability import Availability
from launcher.plan.memory.estimate import ActivationEstimate, compose_every, counted_activations, estimate_activations
from launcher.plan.memory.host import PHASES as HOST_PHASES
from launcher.plan.memory.host import export_bytes, host_phases, pinned_total
from launcher.plan.memory.shape import count_params
from launcher.plan.memory.states import (
    ALLOCATOR_SLACK,
    AMP_OPTIMIZER_WORKSPACE,
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    QUANT_BYTES_PER_PARAM,
    RunShape,
    add_part,
    files_on_disk,
    model_states,
)
from launcher.plan.memory.trace import TraceSettings
from launcher.precision import DTYPES, weight_dtype
from launcher.units import GiB, gib

PHASES = ("forward_backward", "optimizer_step")
# loss.chunked=auto chunks the loss when the plain logits would take more than this share of the budget (the
# GPU's, or the CPU's on a CPU run). Chunking costs one more head matmul per step (about 2% of a Llama-3-8B
# step at seq 2048) and frees the logits; at a tenth of the budget that is worth more than a micro-batch step.
CHUNK_SHARE = 0.10


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


def trace_family(p: Profile) -> str:
    """Which trace a profile's activations come from: 'amp' (fp32 weights under autocast), '16bit' (the
    whole model in fp16/bf16: DeepSpeed, FSDP's param dtype, AMP with the optimizer offloaded) or 'fp32'."""
    if p.precision == "fp32":
        return "fp32"
    return "amp" if p.engine == "amp" and not p.offload_optimizer else "16bit"


def _trace_settings(run: RunShape, family: str, micro_batch: int) -> TraceSettings:
    # fp16 is traced as bf16: the same sizes, the same autocast lists, one trace for both (the op record is
    # relabelled in activations()), which halves the traces of a plan across GPUs (vramfit plan --compare-gpus)
    cd = DTYPES["bf16" if run.precision == "fp16" else run.precision]
    if family == "fp32":
        pdt, adt, ac = torch.float32, torch.float32, None
    elif family == "16bit":
        pdt, adt, ac = cd, cd, None
    else:  # amp: fp32 master weights under autocast; a LoRA base is frozen in 16 bits, adapters fp32
        pdt, adt, ac = (cd if weight_dtype("amp", run.precision, run.lora_r > 0) != torch.float32 else torch.float32,
                        torch.float32, cd)
    kernel = _attention_kernel(run, cd if ac is not None or family == "16bit" else torch.float32)
    # a preference pair is two rows (chosen and rejected) of one forward: traced as a micro-batch of twice the rows
    return TraceSettings(batch_size=micro_batch * run.rows_per_sample, seq_len=run.seq_len, param_dtype=pdt, adapter_dtype=adt,
                         autocast_dtype=ac, target=run.device, attn_implementation=run.attn_implementation,
                         attention_kernel=kernel, gradient_checkpointing=run.checkpointing,
                         checkpoint_every=run.checkpoint_every if run.checkpointing else 1, lora_r=run.lora_r,
                         lora_targets=run.lora_targets, lora_dropout=run.lora_dropout, chunked_loss=run.chunked_loss,
                         offload_activations=run.offload_activations, packed=run.packed)


def activations(run: RunShape, family: str, micro_batch: int, exact: bool = True,
                 compose: bool = False) -> ActivationEstimate:
    """The activation estimate of ``run`` at ``micro_batch``; ``compose``: every k-th layer checkpointed composed
    from the traces with none and with all (:func:`launcher.plan.memory.estimate.compose_every`) where it applies."""
    s = _trace_settings(run, family, micro_batch)
    try:
        if compose and (est := compose_every(run.config, s, run.trust_remote_code)) is not None:
            return est
        return estimate_activations(run.config, s, run.trust_remote_code, exact)
    except HeadNotPlain as e:
        raise ConfigError([str(e)]) from None
    except Exception as e:  # noqa: BLE001 -- whatever a model's forward raises on meta: the plan goes on, estimated
        arch = type(run.config).__name__.replace("Config", "")
        why = (f"the activation trace of {arch} failed on the meta device ({type(e).__name__}: "
               f"{str(e).splitlines()[0] if str(e) else ''})")
        return counted_activations(run.config, s, run.counts.trainable, why)


def ops_of(est: ActivationEstimate, run: RunShape) -> dict:
    """The op record of a trace, in the run's dtype names (fp16 runs are traced as bf16)."""
    if run.precision != "fp16":
        return est.ops
    return {(k, "float16" if d == "bfloat16" else d, f, b): c for (k, d, f, b), c in est.ops.items()}


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


# The search's settings with every k-th layer checkpointed are composed from the traces with none and with every
# layer where that holds for the model (compose_every, checked within 0.5% once per model); one whose memory lies
# within this share of its activations of a budget is planned again from its own traces, so only clear verdicts
# come from a composition.
COMPOSE_MARGIN = 0.01


def _plan_profile(p: Profile, run: RunShape, micro_batch: int, gpu_budget: int, cpu_budget: int,
                  skip_trace_over_budget: bool = True, machine: Machine | None = None, pinned: bool = False,
                  max_steps: int = 0, exact: bool = True, compose: bool | None = None) -> ProfilePlan:
    """One profile at one setting (``run``'s checkpointing, ``micro_batch``): its GPU, CPU and disk bytes against
    the budgets, and with ``machine`` its step time. ``exact=False``: micro-batches above 3 extrapolated, and
    (``compose``, by default ``not exact``) every k-th layer composed where the verdict is clear."""
    if compose is None:
        compose = not exact
    accumulation = max(1, run.global_batch // (micro_batch * run.world))
    st = model_states(p, run, accumulation)
    runtime = CPU_RUNTIME_BYTES[run.device]
    on_gpu = run.device == "cuda"
    # Model states alone over a budget: report that lower bound without tracing activations.
    states_gpu = max(_phase_total(st["gpu_fb"]), _phase_total(st["gpu_step"]))
    states_cpu = runtime + _phase_total(st["cpu"])
    if not on_gpu:
        states_cpu = runtime + _phase_total(st["cpu"]) + states_gpu
    over = (on_gpu and states_gpu > gpu_budget) or states_cpu > cpu_budget
    fb = dict(st["gpu_fb"])
    lower_bound = False
    est = None
    if over and skip_trace_over_budget:
        lower_bound = True
    else:
        if run.chunked_mode == AUTO and run.head_problem is None and not run.chunked_loss:
            # The plain loss's logits are sized from micro-batch 2 (each row's logits are its own, so they grow
            # in proportion): where the run then chunks, the plain loss costs no traces at its own micro-batch.
            small = 2 if micro_batch > 3 else micro_batch
            plain = activations(run, trace_family(p), small, exact, compose)
            logits = _activation_parts(plain, with_grads=False).get("logits", 0) * micro_batch // small
            if logits > CHUNK_SHARE * (gpu_budget if on_gpu else cpu_budget):
                run = dataclasses.replace(run, chunked_loss=True)
        est = activations(run, trace_family(p), micro_batch, exact, compose)
        grads_from_trace = p.engine == "amp" and accumulation == 1 and not p.offload_optimizer  # (they leave)
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
    if est is not None and est.offloaded:  # CPU copies of saved activations (pinned when the run pins)
        add_part(cpu_states, "offloaded_activations", est.offloaded)
    # The host's phases (set-up, training, checkpoint, final/): the plan's CPU peak is the largest. Pinned memory as
    # torch's pinned allocator holds it; where that does not fit the budget and pageable memory would, the setting
    # pins nothing and its copies are priced as pageable (launcher.plan.memory.host).
    pin = pinned and on_gpu
    host = host_phases(p, run, st, cpu_states, runtime=runtime, pin=pin, accumulation=accumulation)
    if pin and max(map(_phase_total, host.values())) > cpu_budget:
        unpinned = host_phases(p, run, st, cpu_states, runtime=runtime, pin=False, accumulation=accumulation)
        if max(map(_phase_total, unpinned.values())) <= cpu_budget:
            pin, host = False, unpinned
    host_peak = max(HOST_PHASES, key=lambda ph: _phase_total(host[ph]))
    cpu_parts = dict(host[host_peak])
    gpu_bytes, cpu_bytes = _phase_total(gpu_parts), _phase_total(cpu_parts)
    disk_parts = dict(st["disk"])
    disk_bytes = _phase_total(disk_parts)
    disk_free = int(run.nvme["free_bytes"]) if run.nvme else 0
    fits = (gpu_bytes <= gpu_budget or not on_gpu) and cpu_bytes <= cpu_budget and disk_bytes <= disk_free
    if est is not None and est.composed:  # near a budget: planned from its own traces instead
        used, budget = (gpu_bytes, gpu_budget) if on_gpu else (cpu_bytes, cpu_budget)
        if abs(used - budget) <= COMPOSE_MARGIN * max(est.peak, est.peak_with_grads):
            return _plan_profile(p, run, micro_batch, gpu_budget, cpu_budget, skip_trace_over_budget, machine,
                                 pinned, max_steps, exact, compose=False)
    why = None
    if not fits:
        bits = []
        if disk_bytes > disk_free:
            bits.append(f"disk {gib(disk_bytes)} > {gib(disk_free)} free at memory.nvme_path" if run.nvme else
                        "memory.nvme_path was not measured (set it to an existing folder)")
        if on_gpu and gpu_bytes > gpu_budget:
            bits.append(f"GPU {'>= ' if lower_bound else ''}{gib(gpu_bytes)} > budget {gib(gpu_budget)}")
        if cpu_bytes > cpu_budget:
            bits.append(f"CPU {'>= ' if lower_bound else ''}{gib(cpu_bytes)} > budget {gib(cpu_budget)}")
        why = "; ".join(bits)
    row = ProfilePlan(profile=p.name, engine=p.engine, precision=p.precision, device=run.device,
                      gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, fits=fits,
                      parts={"gpu": gpu_parts, "cpu": cpu_parts, **({"disk": disk_parts} if disk_parts else {})},
                      speed_rank=p.speed_rank, micro_batch=micro_batch,
                      accumulation=accumulation, why_not=why, gpu_tensor_bytes=tensor_peak if on_gpu else 0,
                      peak_phase=peak_phase, phases=phases if on_gpu else {}, lower_bound=lower_bound,
                      checkpointing=run.checkpointing, checkpoint_every=run.checkpoint_every if run.checkpointing else 1,
                      chunked_loss=run.chunked_loss, offload_activations=run.offload_activations,
                      host_phases=host, host_peak_phase=host_peak, pin_memory=pin,
                      pinned_bytes=pinned_total(p, run, st, accumulation) if pin else 0,
                      export_bytes=_phase_total(export_bytes(p, run, CPU_RUNTIME_BYTES["cpu"])))
    on_disk = files_on_disk(p, run.counts, run.lora_r, run.optimizer)
    row.checkpoint_bytes, row.final_bytes = on_disk["checkpoint"], on_disk["final"]
    row.activations_counted = est.counted if est is not None else None
    if machine is not None and est is not None and not est.counted:  # no trace, no ops to price
        t = steptime.predict(p, machine, ops=ops_of(est, run), counts=run.counts,
                             micro_batch=micro_batch * run.rows_per_sample,
                             reference_share=reference_share(run) if run.reference_pass else 0.0,
                             accumulation=accumulation, seq_len=run.seq_len, world=run.world, pinned=pin,
                             optimizer=run.optimizer, lora=run.lora_r > 0,
                             activation_copy_bytes=est.offload_copied if est.offloaded else 0,
                             disk=run.nvme if p.nvme else None, nodes=run.nodes, links=run.links)
        row.step_s, row.tokens_per_s, row.time_parts, row.time_notes = t.step_s, t.tokens_per_s, t.parts, t.notes
        row.eta_s = t.step_s * max_steps if max_steps else None
    return row


def reference_share(run: RunShape) -> float:
    """DPO's live reference is one more forward of the micro-batch, without gradients (launcher.model.preference),
    priced as a share of the traced compute. The trace prices forward + backward (+ the recompute of checkpointed
    layers); with LoRA the backward runs the frozen base's input gradients (one forward's matmuls again) and only
    the adapters' small weight gradients (the 2N / 4N FLOPs per token of a full backward, Kaplan et al. 2020,
    shrink to 2N / 2N), so a forward is 1/2 of it, and 1/3 with every layer recomputed."""
    recomputed = 1.0 / run.checkpoint_every if run.checkpointing else 0.0
    return 1.0 / (2.0 + recomputed)


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


def make_shape(cfg: Config, hw: Hardware, avail: Availability, world: int = 1, nodes: int = 1,
               links: dict | None = None) -> RunShape:
    config = hfconfig.load(cfg.model.name, cfg.model.trust_remote_code)
    hfconfig.check_seq_len(config, cfg.data.seq_len)  # plan refuses what train would
    vocab = synthetic_vocab_problem(cfg.data, config.vocab_size) if getattr(config, "vocab_size", None) else None
    if vocab:
        raise ConfigError([vocab])
    # damaged weights too (a plan for another machine may have config.json alone: absent weights are not refused)
    hfconfig.check_weights(cfg.model.name, config, required=False, trust_remote_code=cfg.model.trust_remote_code)
    targets = with_experts(tuple(cfg.lora.target_modules) or (ALL_LINEAR,), cfg.lora.experts,
                           hfconfig.has_experts(config))
    problems = _lora_problems(cfg, config) if cfg.lora.r else []
    if problems:
        raise ConfigError(problems)
    counts = count_params(config, cfg.lora.r, targets, cfg.model.trust_remote_code)
    device = avail.device.type
    pairs = cfg.task != "causal_lm"  # preference pairs: two sequences per sample, never a chunked loss
    return RunShape(config=config, counts=counts, device=device,
                    capability=hw.gpu(avail.device.index or 0).capability if device == "cuda" else (0, 0),
                    precision=avail.precision, seq_len=int(cfg.data.seq_len),
                    global_batch=int(cfg.train.global_batch_size), world=world,
                    checkpointing=cfg.model.gradient_checkpointing is True,
                    checkpoint_every=int(cfg.model.checkpoint_every),
                    attn_implementation="sdpa" if cfg.model.attn_implementation == AUTO else cfg.model.attn_implementation,
                    lora_r=int(cfg.lora.r), lora_targets=targets, lora_dropout=float(cfg.lora.dropout),
                    quantize=cfg.model.quantize, optimizer=cfg.train.optimizer,
                    trust_remote_code=bool(cfg.model.trust_remote_code),
                    chunked_loss=cfg.loss.chunked == "on" and not pairs,
                    chunked_mode=cfg.loss.chunked if not pairs else "off",
                    head_problem=_head_problem(config, cfg.model.trust_remote_code),
                    offload_activations=cfg.memory.offload_activations == "on",
                    offload_mode=cfg.memory.offload_activations,
                    nvme=hw.nvme if cfg.memory.nvme_path and hw.nvme else None, packed=packs_samples(cfg.data),
                    nodes=nodes, links=links, rows_per_sample=2 if pairs else 1,
                    reference_pass=reference_mode(cfg) == "adapter_off")


def _lora_problems(cfg: Config, config) -> list[str]:
    """The run's LoRA rule (launcher.model.targets.problems: targets that exist, experts only where there are
    some) on the model's meta copy, so a plan refuses what the run would; kept per model and settings."""
    from launcher.plan.memory.shape import build_meta_model, config_key, remembered

    lo = cfg.lora
    key = ("lora_problems", config_key(config), cfg.model.name, tuple(lo.target_modules), lo.experts,
           float(lo.dropout), bool(cfg.model.trust_remote_code))
    return remembered(key, lambda: lora_problems(build_meta_model(config, trust_remote_code=cfg.model.trust_remote_code),
                                                 cfg.model.name, lo.target_modules, lo.experts, lo.dropout),
                      lambda ps: {"problems": ps}, lambda d: list(d["problems"]))


_HEAD_PROBLEMS: dict = {}


def _head_problem(config, trust_remote_code: bool) -> str | None:
    """Why this architecture's loss cannot be chunked, from a one-layer meta model (None: it can); once per config
    (``--compare-gpus`` plans one model for every card)."""
    from launcher.plan.memory.shape import build_meta_model, config_key, remembered, with_depth

    key = (config_key(config), trust_remote_code)
    if key not in _HEAD_PROBLEMS:
        _HEAD_PROBLEMS[key] = remembered(
            ("head_problem", *key),
            lambda: head_problem(build_meta_model(with_depth(config, 1), trust_remote_code=trust_remote_code)),
            lambda problem: {"problem": problem}, lambda d: d["problem"])
    return _HEAD_PROBLEMS[key]


def plan(cfg: Config, hw: Hardware, profiles: list[str] | None = None, *, world: int = 1,
         machine: Machine | None = None, exact_rows: bool = True, avail: availability.Availability | None = None,
         nodes: int = 1, links: dict | None = None) -> Plan:
    """Plan every profile of the run's precision and choose the fastest one that fits.

    ``profiles``: plan only these; default: every profile of the run's precision (and the asked one).
    When nothing fits, :func:`launcher.plan.advice.add_suggestions` says what would. ``cfg.engine`` restricts
    the choice to one engine, ``cfg.profile`` to one profile; every listed profile is still planned and
    reported, with why it cannot be chosen. ``world``: ranks of the run. ``machine``: the speeds that price
    each setting's step (:mod:`launcher.plan.steptime`): then the fastest predicted setting that fits wins, over
    profiles, micro-batches and checkpointing; without it, speed ranks decide (as the catalogue orders them).
    ``exact_rows=False`` (a plan per GPU of the catalogue): only the chosen row is planned from exact traces, the
    others as the search sized them (micro-batches above 3 extrapolated from 2 and 3: their peaks can be low by
    a percent or two), which saves most of the traces of a plan.

    Several ranks (``world``, on ``nodes`` machines): every number is per rank (ZeRO and FSDP partition what they
    partition, DDP replicates), the CPU budget is the host's RAM shared by its ``world / nodes`` ranks, and with
    ``links`` (bytes/s between ranks in a machine and between machines, :func:`launcher.plan.gpus.links`) the step
    time prices the engine's collectives.
    """
    t0 = time.perf_counter()
    avail = avail or availability.assess(cfg, hw)  # a caller that assessed ``cfg`` already passes its answer
    run = make_shape(cfg, hw, avail, world, nodes, links)
    if cfg.loss.chunked == "on" and run.head_problem:
        raise ConfigError([f"loss.chunked: got 'on', but {run.head_problem}; rule: chunking applies the output head "
                           "itself, so it must be a plain linear layer whose output the model returns untouched; fix: "
                           "loss.chunked=off (or auto, which plans the plain loss for this model)"])
    gpu_budget, cpu_budget, sources = budgets(cfg, hw, run.device)
    if run.ranks_per_node > 1:  # the ranks of one machine share its RAM
        cpu_budget //= run.ranks_per_node
        sources["cpu"] += f", shared by {run.ranks_per_node} ranks: {gib(cpu_budget)} each"
    names = (list(profiles) if profiles is not None else
             [n for n, p in PROFILES.items() if p.precision == avail.precision])
    if cfg.profile != AUTO and cfg.profile not in names:
        names.insert(0, cfg.profile)
    asked = cfg.train.micro_batch_size
    if avail.user is not None:  # the run is the JSON's custom row and nothing else
        names = [avail.user.profile.name]
        if asked == AUTO and avail.user.micro_batch:
            asked = avail.user.micro_batch
    # pinning allowed here (a CUDA host); each setting pins where what it pins fits the host's budget (_plan_profile),
    # and the engine checks `ulimit -l` against the bytes (launcher.engines.engine_pinning)
    pinned = run.device == "cuda" and hw.has_cuda
    searched = []
    for n in names:
        p = avail.profile(n)
        row, cands = _best_setting(_smallest_buckets(p, run), run, cfg, asked, gpu_budget, cpu_budget,
                                   avail.why_not(n) or availability.rank_problem(p, world), machine, pinned,
                                   exact=exact_rows)
        searched.append((_grow_buckets(p, run, row, gpu_budget, cpu_budget, machine, pinned, cfg.train.max_steps,
                                       exact=exact_rows), cands))
    if not exact_rows:
        searched = _settle_chosen(searched, avail, run, gpu_budget, cpu_budget, machine, pinned, cfg.train.max_steps)
    rows = [row for row, _ in searched]
    if avail.user is not None:  # its explicit batch sizes, clipping and optimizer params against the run's
        r = rows[0]
        user_ds_config.resolve(avail.user, user_ds_config.run_values(cfg, avail.precision, r.micro_batch,
                                                                     r.accumulation, run.world, run.hidden, False,
                                                                     cfg.train.lr))
    pool = [r for r in rows if r.available]

    def order(r: ProfilePlan):
        tie = availability.rank_key(avail.profile(r.profile), avail.device.type)
        return (r.step_s, tie) if machine is not None and r.step_s is not None else (tie, not r.checkpointing)

    fitting = sorted((r for r in pool if r.fits), key=order)
    chosen = fitting[0] if fitting else None
    tie = None
    if chosen is not None and machine is not None and chosen.step_s is not None:
        chosen, tie = simplest_within_error(fitting, avail)
    every = sorted((c for row, cands in searched if row.available for c in cands), key=order)
    reason = _reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run) + (f"; {tie}" if tie else "")
    if chosen is not None and cfg.task == "dpo":
        reason += "; " + _reference_line(cfg, chosen)
    out = Plan(profiles=rows, chosen=chosen.profile if chosen else None, reason=reason,
               budget={"gpu_bytes": gpu_budget, "cpu_bytes": cpu_budget, "gpu_source": sources["gpu"],
                       "cpu_source": sources["cpu"]},
               model=_model_summary(cfg, run), settings=_settings(cfg, run, avail.precision_reason),
               assumptions=_assumptions(run, machine), activations=_activation_summary(run, rows, avail, exact_rows),
               machine=_machine_line(machine) if machine is not None else None,
               candidates=[{"profile": c.profile, "setting": c.setting, "micro_batch": c.micro_batch,
                            "checkpointing": c.checkpointing, "checkpoint_every": c.checkpoint_every,
                            "step_s": c.step_s, "tokens_per_s": c.tokens_per_s} for c in every])
    # the runner-up is another setting: the chosen row may be a new object (its buckets grown) of a candidate
    second = next((c for c in every if (c.profile, c.setting) != (chosen.profile, chosen.setting)), None) \
        if chosen is not None else None
    if second is not None:
        if machine is not None and second.step_s and chosen.step_s and second.step_s < chosen.step_s:
            why = (f"predicted {second.step_s:.3g} s/step against {chosen.step_s:.3g} "
                   f"({chosen.step_s / second.step_s:.2f}x faster, within the model's error: the simpler was chosen)")
        elif machine is not None and second.step_s and chosen.step_s:
            why = (f"predicted {second.step_s:.3g} s/step against {chosen.step_s:.3g} "
                   f"({second.step_s / chosen.step_s:.2f}x slower)")
        else:
            why = "slower by the speed ranks (no machine speeds to price steps)"
        out.runner_up = {"profile": second.profile, "setting": second.setting, "step_s": second.step_s, "why": why}
    out.seconds = time.perf_counter() - t0
    return out


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


def checkpoint_options(cfg: Config, layers: int) -> list[tuple[bool, int]]:
    """(checkpointing, every k-th layer) settings to try, least recompute first. ``auto``: off, every 4th
    and every 2nd layer (where the model has more layers than that), every layer: each step of that ladder
    roughly halves what the last one recomputes, and every setting costs the planner its own traces."""
    asked = cfg.model.gradient_checkpointing
    if asked is True:
        return [(True, int(cfg.model.checkpoint_every))]
    if asked is False:
        return [(False, 1)]
    return [(False, 1)] + [(True, k) for k in (4, 2) if k < layers] + [(True, 1)]


def _best_setting(p: Profile, run: RunShape, cfg: Config, asked, gpu_budget: int, cpu_budget: int,
                  blocked: str | None, machine: Machine | None, pinned: bool,
                  exact: bool = True) -> tuple[ProfilePlan, list]:
    """The fastest setting of profile ``p`` that fits (micro-batch x checkpointing), and every fitting setting
    tried. A profile that cannot run is shown at its first setting.

    Memory falls with checkpointing and rises with the micro-batch, so per micro-batch (largest first) the
    setting with the least recompute that fits is the only candidate worth pricing, found by planning few of
    them (``lowest``: the most recompute, which if it does not fit means nothing does at this micro-batch, then
    none, then halving between the two). Smaller micro-batches are tried while their least-recompute setting
    still recomputes less; without machine speeds the least recompute wins, at the largest micro-batch that
    allows it (as before checkpointing was searched: checkpointing costs about a third of a step).

    Activation offload (``memory.offload_activations``): ``on`` offloads in every setting; ``auto`` adds one
    setting after the one with the most recompute, the same with what it saves offloaded (the least GPU
    memory, and copies over PCIe that cost more than checkpointing's recompute), where there is a GPU to
    offload from.

    ``exact=False``: the row is the best candidate as the search priced it (micro-batches above 3 extrapolated,
    see :func:`launcher.plan.memory.estimate.trace_at`), with the candidates fastest first for :func:`_settle`."""
    options = [(ck, k, run.offload_mode == "on") for ck, k in checkpoint_options(cfg, run.counts.num_layers)]
    if run.offload_mode == AUTO and run.device == "cuda":
        options.append((*options[-1][:2], True))  # the least GPU memory: offload on top of the most recompute
    micros = _micro_batch_candidates(run, asked)
    kw = dict(machine=machine, pinned=pinned, max_steps=cfg.train.max_steps)

    def at(ck: tuple, b: int, exact: bool = False) -> ProfilePlan:
        shape = dataclasses.replace(run, checkpointing=ck[0], checkpoint_every=ck[1], offload_activations=ck[2])
        return _plan_profile(p, shape, b, gpu_budget, cpu_budget, exact=exact, **kw)

    def key(r: ProfilePlan) -> tuple:
        return (r.checkpointing, r.checkpoint_every if r.checkpointing else 1, r.offload_activations)

    def exactly(r: ProfilePlan) -> ProfilePlan:
        return at(key(r), r.micro_batch, exact=exact)

    if blocked:
        row = at(options[0], micros[0], exact=True)
        row.available = False
        row.why_not = blocked if row.why_not is None else f"{blocked}; {row.why_not}"
        return row, []

    def lowest(b: int, upto: int) -> tuple[int | None, ProfilePlan]:
        # The least recompute of options[:upto] that fits at micro-batch b, and its row (None, and the row of the
        # most recompute, when none fits). Memory falls along the options: the most recompute first (if that
        # does not fit, nothing does), then none, then halving in between (every 2nd layer before every 4th,
        # whose traces are twice as deep, and every 4th only where every 2nd fits).
        rows: dict[int, ProfilePlan] = {}

        def fits(i: int) -> bool:
            if i not in rows:
                rows[i] = at(options[i], b)
            return rows[i].fits

        hi = upto - 1
        if not fits(hi) and hi > 0 and options[hi][2] and not options[hi - 1][2]:
            # activation offload added on top of the most recompute: the least GPU memory, but host memory more
            # (the offloaded activations), so when it fails the settings without it may still fit
            hi -= 1
            if not fits(hi):
                return None, rows[upto - 1]
        elif not fits(hi):
            return None, rows[hi]
        if hi == 0 or fits(0):
            return 0, rows[0]
        lo = 1
        while lo < hi:  # options[hi] fits, options[lo - 1] does not
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi, rows[hi]

    first, fitting, least = None, [], len(options)
    for b in micros:
        if least == 0:
            break  # no recompute at a larger micro-batch: smaller ones are not faster
        rank, row = lowest(b, least)
        first = first or row
        if rank is not None:
            fitting.append(row)
            least = rank
    if not fitting:
        return exactly(first), []
    # Priced: the fastest. Not priced: the least recompute, at the largest micro-batch that allows it. The
    # setting kept is planned again from exact traces; should it no longer fit, the next one is.
    ranked = sorted(fitting, key=lambda r: r.step_s) if machine is not None else fitting[::-1]
    if not exact:
        return ranked[0], ranked
    best, r = _settle(p, run, ranked, gpu_budget, cpu_budget, **kw)
    return best, ([best if c is r else c for c in fitting] if best.fits else [])


def _settle(p: Profile, run: RunShape, ranked: list[ProfilePlan], gpu_budget: int, cpu_budget: int,
            **kw) -> tuple[ProfilePlan, ProfilePlan]:
    """The first of ``ranked`` (one profile's candidates, best first) that still fits when planned from exact
    traces, and the candidate it was; the last one tried when none does. The planner's search sizes
    candidates from extrapolated traces; only what it keeps is traced exactly."""
    for r in ranked:
        shape = dataclasses.replace(run, checkpointing=r.checkpointing, checkpoint_every=r.checkpoint_every,
                                    offload_activations=r.offload_activations)
        best = _plan_profile(p, shape, r.micro_batch, gpu_budget, cpu_budget, exact=True, **kw)
        if best.fits:
            return best, r
    return best, r


def _bucket_choice(p: Profile, run: RunShape) -> bool:
    """The planner sizes the buckets: a catalogue DeepSpeed profile on one rank (several ranks keep hidden**2,
    a user's deepspeed_config its own or Accelerate's rule)."""
    return p.is_deepspeed and in_catalogue(p) and run.world == 1 and p.reduce_bucket_size is None


def _smallest_buckets(p: Profile, run: RunShape) -> Profile:
    """``p`` with hidden**2 buckets, the size the micro-batch and checkpointing search plans with: a bucket
    only ever takes the memory the chosen setting leaves (:func:`_grow_buckets`), never makes it slower."""
    return dataclasses.replace(p, reduce_bucket_size=run.hidden ** 2) if _bucket_choice(p, run) else p


def _grow_buckets(p: Profile, run: RunShape, row: ProfilePlan, gpu_budget: int, cpu_budget: int,
                  machine: Machine | None, pinned: bool, max_steps: int, exact: bool = True) -> ProfilePlan:
    """The chosen setting of ``p`` with its gradient bucket sized for the budget: the sizes tried are all trainable
    gradients in one bucket up to DeepSpeed's 5e8 (:func:`launcher.config.profiles.bucket_sizes`) and its halvings
    down to hidden**2, each planned (two buffers of the bucket size in the compute dtype on the GPU).

    Without optimizer offload a bucket on one rank is a fixed cost per reduction with nothing to overlap (fewer is
    never slower): the largest that fits. With optimizer offload each full bucket is copied to the CPU while backward
    goes on, and the last one only after it: a bucket as large as the gradients overlaps nothing and holds a second
    copy of them on the GPU (issue 43: the offload profile held more GPU memory than ZeRO-2 without offload). Priced
    (``machine``), the fastest that fits (the larger on a tie: ZeRO-3's step-time model does not price its buckets,
    so it keeps the largest that fits); unpriced, the largest that fits of at most 1/:data:`OFFLOAD_BUCKETS` of the
    gradients."""
    if not _bucket_choice(p, run) or not row.available or not row.fits or row.lower_bound:
        return row
    h2 = run.hidden ** 2
    trainable = run.counts.adapters if run.lora_r else run.counts.total
    size = bucket_sizes(run.hidden, 1, trainable)["reduce_bucket_size"]
    shape = dataclasses.replace(run, checkpointing=row.checkpointing, checkpoint_every=row.checkpoint_every,
                                offload_activations=row.offload_activations)
    sizes = []
    while size > h2:
        sizes.append(size)
        size //= 2
    if p.offload_optimizer and machine is None:
        sizes = [s for s in sizes if s <= trainable // OFFLOAD_BUCKETS] or sizes[-1:]
    best = None
    for size in sizes:
        bigger = _plan_profile(dataclasses.replace(p, reduce_bucket_size=size), shape, row.micro_batch, gpu_budget,
                               cpu_budget, machine=machine, pinned=pinned, max_steps=max_steps, exact=exact)
        if not bigger.fits:
            continue
        bigger.reduce_bucket_size = size
        if not (p.offload_optimizer and machine is not None and bigger.step_s is not None):
            return bigger  # the largest that fits
        if best is None or bigger.step_s < best.step_s * (1 - 1e-9):
            best = bigger
    if best is not None and (row.step_s is None or best.step_s <= row.step_s):
        return best
    row.reduce_bucket_size = h2  # the row was planned with hidden**2 buckets (_smallest_buckets)
    return row


# Unpriced, ZeRO's optimizer offload gets buckets of at most this share of the gradients, so that all but the last
# are copied to the CPU while backward goes on.
OFFLOAD_BUCKETS = 8


def _settle_chosen(searched: list, avail: Availability, run: RunShape, gpu_budget: int, cpu_budget: int,
                   machine: Machine | None, pinned: bool, max_steps: int) -> list:
    """``searched`` (row, candidates fastest first) per profile, as :func:`_best_setting` leaves them with
    ``exact=False``, with the row that wins planned again from exact traces; should it no longer fit, that
    profile's next candidate, then the next profile's."""
    kw = dict(machine=machine, pinned=pinned, max_steps=max_steps)

    def order(i: int) -> tuple:
        r = searched[i][0]
        tie = availability.rank_key(avail.profile(r.profile), avail.device.type)
        return (r.step_s, tie) if machine is not None and r.step_s is not None else (tie, not r.checkpointing)

    out = list(searched)
    for i in sorted((i for i, (r, _) in enumerate(searched) if r.available and r.fits), key=order):
        row, cands = searched[i]
        p = avail.profile(row.profile)
        best, _ = _settle(_smallest_buckets(p, run), run, cands, gpu_budget, cpu_budget, **kw)
        best = _grow_buckets(p, run, best, gpu_budget, cpu_budget, exact=True, **kw)
        out[i] = (best, cands if best.fits else [])
        if best.fits:
            break
    return out


def _nth(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def _machine_line(machine) -> str:
    """The machine that priced the plan, and what the plan's step times are worth when its speeds are in doubt."""
    line = machine.name
    if machine.doubtful:
        line += (f" -- DOUBTFUL calibration: {machine.doubtful}; step times are a busy machine's "
                 "(`vramfit doctor --calibrate` when idle)")
    if machine.busy_now:
        line += f" -- BUSY NOW: {machine.busy_now}"
    return line


def _reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run) -> str:
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


def _reference_line(cfg: Config, row) -> str:
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


def _model_summary(cfg: Config, run: RunShape) -> dict:
    c = run.counts
    return {"name": cfg.model.name, "architecture": type(run.config).__name__.replace("Config", ""),
            "params": c.total, "trainable_params": c.trainable,
            "lora_params": c.adapters, "layers": c.num_layers, "hidden_size": run.hidden,
            "vocab_size": int(getattr(run.config, "vocab_size", 0)), "counts": c.to_dict()}


def _settings(cfg: Config, run: RunShape, why_precision: str) -> dict:
    return {"device": run.device, "precision": run.precision, "precision_reason": why_precision,
            "seq_len": run.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": run.global_batch, "world_size": run.world, "nodes": run.nodes,
            "gradient_checkpointing": cfg.model.gradient_checkpointing, "checkpoint_every": cfg.model.checkpoint_every,
            "max_steps": cfg.train.max_steps, "keep_last": cfg.checkpoint.keep_last, "output_dir": cfg.output_dir,
            "attn_implementation": run.attn_implementation, "lora_r": run.lora_r,
            "lora_target_modules": list(run.lora_targets), "quantize": run.quantize, "optimizer": run.optimizer,
            "packed": run.packed}


def _assumptions(run: RunShape, machine: Machine | None = None) -> dict:
    return {"step_time": machine.source if machine is not None else "not priced: no machine speeds "
            "(vramfit doctor --calibrate measures this machine; vramfit plan --gpu NAME prices a data sheet's)",
            "cuda_context_bytes": CUDA_CONTEXT_BYTES if run.device == "cuda" else 0,
            "allocator_slack_fraction": ALLOCATOR_SLACK, "cpu_runtime_bytes": CPU_RUNTIME_BYTES[run.device],
            "optimizer_workspace_bytes_per_param_amp": AMP_OPTIMIZER_WORKSPACE,
            "quantized_bytes_per_param": QUANT_BYTES_PER_PARAM,
            "loop_keeps_only_the_loss_through_backward": True}


def _activation_summary(run: RunShape, rows: list[ProfilePlan], avail: Availability, exact: bool = True) -> dict:
    out = {}
    for r in rows:
        if r.lower_bound:
            continue
        fam = trace_family(avail.profile(r.profile))
        key = f"{fam}@{r.micro_batch}"
        if key in out:
            continue
        est = activations(run, fam, r.micro_batch, exact)
        s = est.settings
        out[key] = {"micro_batch": r.micro_batch, "seq_len": run.seq_len, "attention_kernel": s.attention_kernel,
                    "autocast": None if s.autocast_dtype is None else str(s.autocast_dtype).replace("torch.", ""),
                    "saved_per_layer_bytes": est.saved_per_layer, "saved_bytes": est.saved, "peak_bytes": est.peak,
                    "peak_segment": est.peak_segment, "trace_seconds": round(est.trace_seconds, 3)}
    return out
