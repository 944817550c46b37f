"""The memory plan: for every profile, the GPU and CPU peak of one training run, by named part.

Pure: no GPU, no weights. The model's shape comes from its config on the meta device
(:mod:`launcher.memory.shape`), its activations from a traced forward + backward
(:mod:`launcher.memory.trace`), and the model states from the arithmetic below, which follows what
each engine allocates (DeepSpeed 0.19 ``stage_1_and_2.py``/``stage3.py``, torch fused AdamW, FSDP2).

Per trainable parameter with Adam in mixed precision (the ZeRO paper): 2 B 16-bit weights + 2 B 16-bit
gradients + 12 B fp32 master, m and v = 16 B, placed on the GPU or the CPU by the profile.

A GPU peak is the larger of two phases: forward + backward (model states that live through the
step, activations and logits at their traced peak, gradient buckets) and the optimizer step (model
states plus the gradients in the form the update reads them, e.g. DeepSpeed's fp32 copy of the flat
gradient partition). Parts named: ``weights``, ``gradients``, ``master_weights``, ``optimizer_states``,
``activations``, ``logits``, ``autocast_weight_cache``, ``buffers``, ``cuda_context``,
``allocator_slack`` (GPU) and ``runtime``, ``model_load`` (CPU).

Assumptions, each a named constant and a line of every plan:
``CUDA_CONTEXT_BYTES`` -- CUDA context, lazily loaded kernel images and the cuBLAS workspace, none of
which ``torch.cuda.max_memory_allocated`` sees; ``ALLOCATOR_SLACK`` -- the caching allocator's
reserved-but-unallocated memory (fragmentation, rounding), as a fraction of tensor bytes;
``CPU_RUNTIME_BYTES`` -- resident size of Python, torch, the CUDA libraries and DeepSpeed before any
model tensor. The loop is assumed to keep only the loss of a forward (not the logits) through backward.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import time
from dataclasses import dataclass, field

import torch

from launcher import user_ds_config
from launcher.config import AUTO, Config, ConfigError
from launcher.hardware import GiB, Hardware
from launcher.memory.shape import ParamCounts, count_params, lora_target_names, resolve_model_config  # noqa: F401
from launcher.memory.trace import ActivationEstimate, TraceSettings, estimate_activations
from launcher.profiles import PROFILES, Profile, bucket_sizes

MiB = 1024**2

CUDA_CONTEXT_BYTES = 512 * MiB
ALLOCATOR_SLACK = 0.10
CPU_RUNTIME_BYTES = {"cuda": 2 * GiB, "cpu": GiB // 2}
# NF4 with double quantization (8-bit absmax per 64 weights, fp32 per 256 blocks); int8 + fp32 row scale
QUANT_BYTES_PER_PARAM = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0 + 4 / 4096}
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 8, "adamw8bit": 2}  # m and v
AMP_OPTIMIZER_WORKSPACE = 0  # torch AdamW(fused=True) updates in place; foreach would add 4 B/param
ZERO3_SUB_GROUP = 1_000_000_000  # DeepSpeed sub_group_size default: fp32 gradient buffer size cap
BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ENGINE_PREFERENCE = ("deepspeed", "amp", "fsdp")  # speed-rank ties
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


# ------------------------------------------------------------------------------------------------
# Budgets and settings


def budgets(cfg: Config, hw: Hardware) -> tuple[int, int, dict]:
    """(gpu_bytes, cpu_bytes, {"gpu": source, "cpu": source}).

    GPU: ``memory.gpu_budget`` GiB, else the free memory of the GPU now minus ``memory.margin``; 0 when
    training runs on the CPU. CPU: ``memory.cpu_budget`` GiB, else available RAM minus the margin.
    """
    m = cfg.memory
    margin = float(m.margin)
    device = _device(cfg, hw)
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


def _device(cfg: Config, hw: Hardware) -> str:
    return "cuda" if hw.has_cuda and cfg.device != "cpu" else "cpu"


def resolve_precision(cfg: Config, hw: Hardware) -> tuple[str, str]:
    """(precision, why): explicit profile, explicit precision, else bf16 on capability >= 8, fp16 below, fp32 on CPU;
    a ``deepspeed_config`` whose fp16/bf16 blocks are explicit decides instead (user_ds_config.decide_precision)."""
    found = _vramfit_precision(cfg, hw)
    if cfg.deepspeed_config:
        cuda = _device(cfg, hw) == "cuda"
        return user_ds_config.precision_for(cfg, found, "cuda" if cuda else "cpu",
                                            bf16_ok=not cuda or hw.gpu(0).capability[0] >= 8)
    return found


def _vramfit_precision(cfg: Config, hw: Hardware) -> tuple[str, str]:
    if cfg.profile != AUTO and cfg.profile in PROFILES:
        p = PROFILES[cfg.profile].precision
        return p, f"precision {p} from profile {cfg.profile}"
    if cfg.precision != AUTO:
        return cfg.precision, f"precision {cfg.precision} as asked"
    if _device(cfg, hw) == "cpu":
        return "fp32", "precision fp32: training on the CPU"
    g = hw.gpu(0)
    if g.capability[0] >= 8:
        return "bf16", f"precision bf16: {g.name} has compute capability {g.capability[0]}.{g.capability[1]} >= 8.0"
    return "fp16", f"precision fp16: {g.name} has compute capability {g.capability[0]}.{g.capability[1]} < 8.0 (no bf16)"


def default_engines(hw: Hardware) -> set[str]:
    engines = {"amp"}
    if importlib.util.find_spec("launcher.engines.fsdp") is not None:
        engines.add("fsdp")
    if hw.deepspeed:
        engines.add("deepspeed")
    return engines


@dataclass(frozen=True)
class _Run:
    """Everything about the run the memory depends on (one per plan; a suggestion changes a copy)."""

    config: object
    counts: ParamCounts
    device: str
    capability: tuple
    precision: str
    seq_len: int
    global_batch: int
    world: int
    checkpointing: bool
    attn_implementation: str
    lora_r: int
    lora_targets: tuple
    lora_dropout: float
    quantize: str
    optimizer: str
    trust_remote_code: bool

    @property
    def hidden(self) -> int:
        return int(getattr(self.config, "hidden_size"))


# ------------------------------------------------------------------------------------------------
# Activations of a run, per trace family


def _attention_kernel(run: _Run, dtype: torch.dtype) -> str:
    """The SDPA kernel the target runs: flash for 16-bit on capability >= 8, memory-efficient otherwise
    (CUDA); CPU's flash kernel (without dropout; the trace falls back to math when dropout is on)."""
    if run.attn_implementation != "sdpa":
        return "math"
    if run.device == "cpu":
        return "flash"
    if dtype in (torch.float16, torch.bfloat16) and run.capability[0] >= 8:
        return "flash"
    return "efficient"


def _family(p: Profile) -> str:
    """Which trace a profile's activations come from: 'amp' (fp32 weights under autocast), '16bit' (the
    whole model in fp16/bf16: DeepSpeed, FSDP's param dtype) or 'fp32'."""
    if p.precision == "fp32":
        return "fp32"
    return "amp" if p.engine == "amp" else "16bit"


def _trace_settings(run: _Run, family: str, micro_batch: int) -> TraceSettings:
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
                         lora_targets=run.lora_targets, lora_dropout=run.lora_dropout)


class PlanError(RuntimeError):
    """The model could not be measured (its forward does not run on the meta device)."""


def _activations(run: _Run, family: str, micro_batch: int) -> ActivationEstimate:
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


def _add(d: dict, part: str, n: float):
    if n:
        d[part] = d.get(part, 0) + int(round(n))


def _states(p: Profile, run: _Run, accumulation: int) -> dict:
    """Model-state bytes of profile ``p``: {"gpu_fb", "gpu_step", "cpu", "cpu_load"} part dicts (no activations).

    "gpu_*" is the device the model computes on (the CPU itself when there is no GPU).
    """
    c = run.counts
    cd = BYTES[p.precision]
    lora = run.lora_r > 0
    base = c.total  # base-model parameters (frozen under LoRA)
    trainable = c.adapters if lora else base
    opt = OPTIMIZER_BYTES_PER_PARAM[run.optimizer]
    largest_trainable = c.largest_adapter if lora else c.largest_param
    h = run.hidden
    rb = p.reduce_bucket_size or bucket_sizes(h)["reduce_bucket_size"]
    fb: dict = {}
    step: dict = {}
    cpu: dict = {}

    def frozen_bytes(dtype_bytes: int) -> float:
        if run.quantize in QUANT_BYTES_PER_PARAM:
            return (base - c.linear_weights) * dtype_bytes + c.linear_weights * QUANT_BYTES_PER_PARAM[run.quantize]
        return base * dtype_bytes

    if p.engine == "amp":
        w = frozen_bytes(4 if p.precision == "fp32" else cd) + 4 * c.adapters if lora else 4 * base
        load = w
        for d in (fb, step):
            _add(d, "weights", w)
            _add(d, "optimizer_states", opt * trainable)
        if accumulation > 1:  # earlier micro-batches' gradients live through this one's backward
            _add(fb, "gradients", 4 * trainable)
        _add(step, "gradients", 4 * trainable)
        _add(step, "buffers", AMP_OPTIMIZER_WORKSPACE * trainable)
        if run.quantize in QUANT_BYTES_PER_PARAM:  # bitsandbytes dequantizes one weight at a time
            _add(fb, "buffers", c.largest_module * cd)
    elif p.engine == "deepspeed" and p.zero_stage in (0, 1, 2):
        # The module is cast to the compute dtype; trainable params are views into one flat 16-bit buffer.
        # Stages 0 and 1 (only from a user's deepspeed_config) are planned with this stage-2 arithmetic: on one
        # rank no stage partitions anything, and each keeps 16-bit weights, a gradient copy and fp32 master +
        # Adam moments (stage 1 in DeepSpeed's ZeRO-1/2 optimizer itself; stage 0 in its bf16/fp16 optimizer).
        w = (base + c.adapters) * cd if lora else base * cd
        load = w
        bucket_bytes = 2 * rb * cd  # ipg double buffer (overlap_comm)
        for d in (fb, step):
            _add(d, "weights", w)
        _add(fb, "buffers", bucket_bytes + largest_trainable * cd)  # + autograd's grad before it is bucketed
        if not p.offload_optimizer:
            for d in (fb, step):
                _add(d, "master_weights", 4 * trainable)
                _add(d, "optimizer_states", 8 * trainable)
                _add(d, "gradients", cd * trainable)  # grads_in_partition, allocated at the first reduction
            if cd != 4:
                _add(step, "gradients", 4 * trainable)  # the fp32 copy of the flat partition the update reads
            _add(step, "buffers", bucket_bytes)
        else:
            _add(fb, "buffers", largest_trainable * cd)  # temp_grad_buffer_for_gpu_offload
            _add(step, "buffers", bucket_bytes + largest_trainable * cd)
            _add(cpu, "master_weights", 4 * trainable)
            _add(cpu, "gradients", 4 * trainable)
            _add(cpu, "optimizer_states", 8 * trainable)
            _add(cpu, "buffers", cd * trainable + largest_trainable * cd)  # 16-bit update staging, grad staging
            if accumulation > 1:
                _add(cpu, "gradients", cd * trainable)  # accumulated_grads_in_cpu
    elif p.engine == "deepspeed" and p.zero_stage == 3:
        # Parameters live partitioned on the CPU; the GPU gathers the module in use plus the prefetch bucket.
        b = bucket_sizes(h)
        prefetch = p.prefetch_bucket_size if p.prefetch_bucket_size is not None else b["stage3_prefetch_bucket_size"]
        small = c.small_params
        live = (c.largest_module + prefetch) * cd + small * cd
        load = (base + c.adapters) * cd
        for d in (fb, step):
            _add(d, "weights", live)
        _add(fb, "gradients", min(c.largest_module, trainable) * cd)
        _add(fb, "buffers", rb * cd)
        _add(cpu, "weights", (base + c.adapters) * cd)
        _add(cpu, "gradients", cd * trainable + 4 * min(trainable, ZERO3_SUB_GROUP))
        _add(cpu, "master_weights", 4 * trainable)
        _add(cpu, "optimizer_states", 8 * trainable)
    elif p.engine == "fsdp":
        # FSDP2 + CPUOffloadPolicy (launcher/engines/fsdp.py): fp32 sharded params, fp32 grads and AdamW on
        # the CPU. Units: input embeddings, each layer, the head (tied embeddings stay in the root with the
        # final norm). The GPU holds the root and two neighbouring units (the running one and the
        # prefetched one) in the compute dtype, and one unit's gradients in the compute dtype plus the fp32
        # copy that is reduced and offloaded.
        layer = c.per_layer + (c.adapters_per_layer if lora else 0)
        if c.tied_embeddings:
            root, pair = c.embeddings + c.other, 2 * layer
            units = [layer]
        else:
            root, pair = c.other, max(2 * layer, c.embeddings + layer, c.head + layer)
            units = [c.embeddings, layer, c.head]
        for d in (fb, step):
            _add(d, "weights", (root + pair) * cd)
        largest_trainable_unit = c.adapters_per_layer if lora else max(units)
        _add(fb, "gradients", largest_trainable_unit * (cd + 4))
        load = 4 * (base + c.adapters)
        _add(cpu, "weights", 4 * (base + c.adapters))
        _add(cpu, "gradients", 4 * trainable)
        _add(cpu, "optimizer_states", 8 * trainable)
    else:
        raise ValueError(f"no memory model for profile {p.name}")
    return {"gpu_fb": fb, "gpu_step": step, "cpu": cpu, "cpu_load": int(load)}


def _asked_for(p: Profile, cfg: Config) -> bool:
    """The profile by name, or the engine when all its profiles of this precision offload (FSDP): on a
    CPU-only machine offloading changes nothing, but the user may want that engine's code path."""
    if cfg.profile == p.name or (cfg.deepspeed_config and p.name not in PROFILES):  # the custom row is asked for
        return True
    return cfg.engine == p.engine and all(q.offloads for q in PROFILES.values()
                                          if q.engine == p.engine and q.precision == p.precision)


def _not_available(p: Profile, run: _Run, cfg: Config, engines: set[str], hw: Hardware) -> str | None:
    if cfg.engine != AUTO and p.engine != cfg.engine:
        return f"engine={cfg.engine} was asked"
    if run.device == "cpu" and p.offloads and not _asked_for(p, cfg):
        return "offloads from a GPU to the CPU; there is no GPU"
    if run.device == "cpu" and p.engine == "deepspeed" and p.precision == "fp16":
        return "DeepSpeed refuses fp16 on the CPU"
    if p.engine != "amp" and run.quantize != "none":
        return f"model.quantize={run.quantize} (bitsandbytes) trains on the AMP path only"
    if p.engine != "amp" and run.optimizer == "adamw8bit":
        return "train.optimizer=adamw8bit (bitsandbytes) runs on the AMP path only"
    if p.engine not in engines:
        if p.engine == "deepspeed" and not hw.deepspeed:
            return f"DeepSpeed is not usable here ({hw.deepspeed_error or 'not installed'})"
        return f"the {p.engine} engine is not available here"
    return None


def _phase_total(parts: dict) -> int:
    return sum(parts.values())


def _plan_profile(p: Profile, run: _Run, micro_batch: int, gpu_budget: int, cpu_budget: int,
                  skip_trace_over_budget: bool = True) -> ProfilePlan:
    accumulation = max(1, run.global_batch // (micro_batch * run.world))
    st = _states(p, run, accumulation)
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
            _add(fb, part, n)
    phases = {"forward_backward": fb, "optimizer_step": dict(st["gpu_step"])}
    peak_phase = max(PHASES, key=lambda k: _phase_total(phases[k]))
    tensor_peak = _phase_total(phases[peak_phase])
    gpu_parts: dict = {}
    cpu_parts: dict = {}
    if on_gpu:
        gpu_parts = dict(phases[peak_phase])
        _add(gpu_parts, "cuda_context", CUDA_CONTEXT_BYTES)
        _add(gpu_parts, "allocator_slack", ALLOCATOR_SLACK * tensor_peak)
        cpu_states = st["cpu"]
    else:  # everything on the CPU
        cpu_states = dict(st["cpu"])
        for part, n in phases[peak_phase].items():
            _add(cpu_states, part, n)
        _add(cpu_states, "allocator_slack", ALLOCATOR_SLACK * tensor_peak)
    _add(cpu_parts, "runtime", runtime)
    if st["cpu_load"] > _phase_total(cpu_states):  # loading the model on the CPU is the larger moment
        _add(cpu_parts, "model_load", st["cpu_load"])
    else:
        for part, n in cpu_states.items():
            _add(cpu_parts, part, n)
    gpu_bytes, cpu_bytes = _phase_total(gpu_parts), _phase_total(cpu_parts)
    fits = (gpu_bytes <= gpu_budget or not on_gpu) and cpu_bytes <= cpu_budget
    why = None
    if not fits:
        bits = []
        if on_gpu and gpu_bytes > gpu_budget:
            bits.append(f"GPU {'>= ' if lower_bound else ''}{_gib(gpu_bytes)} > budget {_gib(gpu_budget)}")
        if cpu_bytes > cpu_budget:
            bits.append(f"CPU {'>= ' if lower_bound else ''}{_gib(cpu_bytes)} > budget {_gib(cpu_budget)}")
        why = "; ".join(bits)
    return ProfilePlan(profile=p.name, engine=p.engine, precision=p.precision, device=run.device,
                       gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, fits=fits,
                       parts={"gpu": gpu_parts, "cpu": cpu_parts}, speed_rank=p.speed_rank, micro_batch=micro_batch,
                       accumulation=accumulation, why_not=why, gpu_tensor_bytes=tensor_peak if on_gpu else 0,
                       peak_phase=peak_phase, phases=phases if on_gpu else {}, lower_bound=lower_bound)


def _micro_batch_candidates(run: _Run, asked) -> list[int]:
    if asked != AUTO:
        return [int(asked)]
    per_rank = max(1, run.global_batch // run.world)
    out, b = [], 1
    while b <= per_rank:
        if per_rank % b == 0:
            out.append(b)
        b *= 2
    return sorted(out, reverse=True)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# ------------------------------------------------------------------------------------------------
# The plan


def _make_run(cfg: Config, hw: Hardware, precision: str) -> _Run:
    config = resolve_model_config(cfg.model.name, cfg.model.trust_remote_code)
    targets = tuple(cfg.lora.target_modules) or ("all-linear",)
    counts = count_params(config, cfg.lora.r, targets, cfg.model.trust_remote_code)
    device = _device(cfg, hw)
    from launcher.config import world_size

    return _Run(config=config, counts=counts, device=device,
                capability=hw.gpu(0).capability if device == "cuda" else (0, 0), precision=precision,
                seq_len=int(cfg.data.seq_len), global_batch=int(cfg.train.global_batch_size), world=world_size(),
                checkpointing=bool(cfg.model.gradient_checkpointing),
                attn_implementation="sdpa" if cfg.model.attn_implementation == AUTO else cfg.model.attn_implementation,
                lora_r=int(cfg.lora.r), lora_targets=targets, lora_dropout=float(cfg.lora.dropout),
                quantize=cfg.model.quantize, optimizer=cfg.train.optimizer,
                trust_remote_code=bool(cfg.model.trust_remote_code))


def plan(cfg: Config, hw: Hardware | None = None, profiles: list[str] | None = None,
         available_engines: set[str] | None = None, *, suggest: bool = True) -> Plan:
    """Plan every profile of the run's precision and choose the fastest one that fits.

    ``profiles``: plan only these (their order breaks speed-rank ties); default: every profile of the
    resolved precision. ``available_engines``: engines that can run here (default: amp, fsdp when its
    engine module exists, deepspeed when it imports). ``cfg.engine`` restricts the choice to one engine,
    ``cfg.profile`` to one profile; all listed profiles are still planned and reported.
    """
    t0 = time.perf_counter()
    if hw is None:
        from launcher.hardware import probe

        hw = probe()
    engines = set(available_engines) if available_engines is not None else default_engines(hw)
    precision, why_precision = resolve_precision(cfg, hw)
    run = _make_run(cfg, hw, precision)
    gpu_budget, cpu_budget, sources = budgets(cfg, hw)
    names = list(profiles) if profiles is not None else [n for n, p in PROFILES.items() if p.precision == precision]
    if cfg.profile != AUTO and cfg.profile not in names:
        names.insert(0, cfg.profile)
    lookup, asked = PROFILES, cfg.train.micro_batch_size
    custom = None
    if cfg.deepspeed_config:  # the run is the JSON's custom row and nothing else (ConfigError when it cannot be)
        custom = user_ds_config.load(cfg, precision)
        names, lookup = [custom.profile.name], {custom.profile.name: custom.profile}
        if asked == AUTO and custom.micro_batch:
            asked = custom.micro_batch
    rows: list[ProfilePlan] = []
    for name in names:
        p = lookup[name]
        blocked = _not_available(p, run, cfg, engines, hw)
        if p.precision != precision:
            blocked = blocked or f"precision {p.precision}, the run is {precision}"
        rows.append(_best_micro_batch(p, run, asked, gpu_budget, cpu_budget, blocked))
    if custom is not None:  # its explicit batch sizes, clipping and optimizer params against the run's
        r = rows[0]
        user_ds_config.resolve(custom, user_ds_config.run_values(cfg, precision, r.micro_batch, r.accumulation,
                                                                 run.world, run.hidden, False, cfg.train.lr))
    order = {n: i for i, n in enumerate(names)}
    pref = {e: i for i, e in enumerate(ENGINE_PREFERENCE)}

    def rank(r: ProfilePlan):
        tie = order[r.profile] if profiles is not None else pref.get(r.engine, 9)
        return (r.speed_rank, tie)

    pool = [r for r in rows if r.available and (cfg.profile == AUTO or r.profile == cfg.profile)]
    fitting = sorted((r for r in pool if r.fits), key=rank)
    chosen = fitting[0] if fitting else None
    reason = _reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run)
    out = Plan(profiles=rows, chosen=chosen.profile if chosen else None, reason=reason,
               budget={"gpu_bytes": gpu_budget, "cpu_bytes": cpu_budget, "gpu_source": sources["gpu"],
                       "cpu_source": sources["cpu"]},
               model=_model_summary(cfg, run), settings=_settings(cfg, run, why_precision),
               assumptions=_assumptions(run), activations=_activation_summary(run, rows, lookup))
    if chosen is None and suggest:
        out.suggestions, out.suggested_overrides = _suggestions(cfg, hw, engines, profiles)
    out.seconds = time.perf_counter() - t0
    return out


def _best_micro_batch(p: Profile, run: _Run, asked, gpu_budget: int, cpu_budget: int,
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
        if cfg.deepspeed_config:
            return f"{pool[0].profile} from deepspeed_config {cfg.deepspeed_config} does not fit: {pool[0].why_not}"
        blocked_fits = [r for r in rows if r.fits and not r.available]
        if blocked_fits:
            r = min(blocked_fits, key=lambda r: r.speed_rank)
            return (f"nothing that can run here fits the budget ({_gib(gpu_budget)} GPU, {_gib(cpu_budget)} CPU); "
                    f"{r.profile} would fit, but {r.why_not}")
        best = min(pool, key=lambda r: (r.gpu_bytes - gpu_budget if run.device == "cuda" else 0)
                   + max(0, r.cpu_bytes - cpu_budget))
        return (f"nothing fits the budget ({_gib(gpu_budget)} GPU, {_gib(cpu_budget)} CPU); closest: "
                f"{best.profile} ({best.why_not})")
    faster = [r for r in pool if r.speed_rank < chosen.speed_rank]
    text = (f"fastest profile that fits: {where} peak {_gib(chosen.gpu_bytes if run.device == 'cuda' else chosen.cpu_bytes)}"
            f" of {_gib(gpu_budget if run.device == 'cuda' else cpu_budget)}")
    if run.device == "cuda":
        text += f", CPU {_gib(chosen.cpu_bytes)} of {_gib(cpu_budget)}"
    text += f", micro-batch {chosen.micro_batch}"
    if faster:
        text += "; faster ones do not fit: " + "; ".join(f"{r.profile} ({r.why_not})" for r in faster)
    if cfg.profile != AUTO:
        text = f"profile {cfg.profile} as asked fits: " + text.split(": ", 1)[1]
    if cfg.deepspeed_config:
        text = f"{chosen.profile} from deepspeed_config {cfg.deepspeed_config} fits: " + text.split(": ", 1)[1]
    return text


def _model_summary(cfg: Config, run: _Run) -> dict:
    c = run.counts
    return {"name": cfg.model.name, "architecture": type(run.config).__name__.replace("Config", ""),
            "params": c.total, "trainable_params": c.trainable,
            "lora_params": c.adapters, "layers": c.num_layers, "hidden_size": run.hidden,
            "vocab_size": int(getattr(run.config, "vocab_size", 0)), "counts": c.to_dict()}


def _settings(cfg: Config, run: _Run, why_precision: str) -> dict:
    return {"device": run.device, "precision": run.precision, "precision_reason": why_precision,
            "seq_len": run.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": run.global_batch, "world_size": run.world, "gradient_checkpointing": run.checkpointing,
            "attn_implementation": run.attn_implementation, "lora_r": run.lora_r,
            "lora_target_modules": list(run.lora_targets), "quantize": run.quantize, "optimizer": run.optimizer}


def _assumptions(run: _Run) -> dict:
    return {"cuda_context_bytes": CUDA_CONTEXT_BYTES if run.device == "cuda" else 0,
            "allocator_slack_fraction": ALLOCATOR_SLACK, "cpu_runtime_bytes": CPU_RUNTIME_BYTES[run.device],
            "optimizer_workspace_bytes_per_param_amp": AMP_OPTIMIZER_WORKSPACE,
            "quantized_bytes_per_param": QUANT_BYTES_PER_PARAM,
            "loop_keeps_only_the_loss_through_backward": True}


def _activation_summary(run: _Run, rows: list[ProfilePlan], lookup: dict) -> dict:
    out = {}
    for r in rows:
        if r.lower_bound:
            continue
        fam = _family(lookup[r.profile])
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


# ------------------------------------------------------------------------------------------------
# Suggestions when nothing fits


def _with(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with this module's own ``key=value`` suggestions applied."""
    new = copy.deepcopy(cfg)
    for item in overrides:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        obj = new
        for part in path:
            obj = getattr(obj, part)
        if value.lower() in ("true", "false"):
            val: object = value.lower() == "true"
        else:
            try:
                val = int(value)
            except ValueError:
                val = value
        setattr(obj, last, val)
    return new


def _suggestions(cfg: Config, hw: Hardware, engines: set[str], profiles) -> tuple[list[str], list[list[str]]]:
    from launcher.presets import PRESETS

    singles: list[list[str]] = []
    if cfg.lora.r == 0:
        singles.append(["lora.r=16"])
    if not cfg.model.gradient_checkpointing:
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
    for step in (["model.gradient_checkpointing=true"] if not cfg.model.gradient_checkpointing else [],
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
            trial = _with(cfg, ov)
            if trial.model.quantize != "none" and trial.lora.r == 0:
                continue
            try:
                p = plan(trial, hw, profiles=None if "engine=auto" in ov or "profile=auto" in ov else profiles,
                         available_engines=engines, suggest=False)
            except ConfigError:  # e.g. a micro-batch a deepspeed_config's explicit one disagrees with
                continue
            if p.chosen is None:
                continue
            c = p.chosen_plan
            where = (f"GPU {_gib(c.gpu_bytes)} of {_gib(p.budget['gpu_bytes'])}, " if c.device == "cuda" else "")
            out.append(f"{' '.join(ov)}: {c.profile} fits ({where}CPU {_gib(c.cpu_bytes)} of "
                       f"{_gib(p.budget['cpu_bytes'])}, micro-batch {c.micro_batch}, speed rank {c.speed_rank})")
            outs.append(ov)
        if out:  # single changes first; combinations only when no single change is enough
            break
    return out[:5], outs[:5]


# ------------------------------------------------------------------------------------------------
# The printed table


def format_table(plan: Plan) -> str:
    dev = plan.settings.get("device", "cuda")
    m = plan.model
    s = plan.settings
    lines = [f"model {m.get('name')} ({m.get('architecture')}): {m.get('params', 0) / 1e9:.2f}B parameters, "
             f"{m.get('trainable_params', 0) / 1e6:.1f}M trainable; {s.get('precision')} on {dev}, seq {s.get('seq_len')}, "
             f"checkpointing {'on' if s.get('gradient_checkpointing') else 'off'}, LoRA r={s.get('lora_r')}, "
             f"quantize {s.get('quantize')}, optimizer {s.get('optimizer')}",
             f"budget: GPU {_gib(plan.budget['gpu_bytes'])} ({plan.budget['gpu_source']}); "
             f"CPU {_gib(plan.budget['cpu_bytes'])} ({plan.budget['cpu_source']})", ""]
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
