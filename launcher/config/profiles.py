"""The profile catalogue: the one source of truth for every engine/precision/offload combination.

``vramfit profiles`` writes ``ds_configs/NAME.json`` for every DeepSpeed profile from this table;
``vramfit profiles --check`` fails when the files and the code disagree. The JSON files keep
``"auto"`` where the value depends on the run (batch sizes, clipping, lr, bucket sizes); at launch
:func:`resolve_ds_config` replaces every one of them, and the resolved config is written to the
run directory. DeepSpeed itself never sees ``"auto"``. A user's own DeepSpeed JSON (``deepspeed_config``,
:mod:`launcher.config.user_ds_config`) is filled by the same function, :func:`fill_auto`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

AUTO = "auto"
DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_configs")

# fp16 dynamic loss scaling, shared by DeepSpeed profiles and torch.amp.GradScaler.
LOSS_SCALE = {"initial_power": 16, "window": 1000, "hysteresis": 2, "min_scale": 1}


@dataclass(frozen=True)
class Profile:
    name: str
    engine: str  # 'amp' | 'fsdp' | 'deepspeed'
    precision: str  # 'fp16' | 'bf16' | 'fp32'
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    speed_rank: int = 0  # 1 = fastest family; used to pick "the fastest profile that fits"
    gpu_holds: str = ""
    cpu_holds: str = ""
    # A user's DeepSpeed JSON (launcher.config.user_ds_config) may fix its bucket sizes; None: from the hidden size.
    reduce_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    # DeepSpeed builds its own Adam from the config (a user's JSON with an "optimizer" section: FusedAdam or
    # DeepSpeedCPUAdam); False: torch's fused AdamW as DeepSpeed's client optimizer, as every catalogue profile
    ds_optimizer: bool = False
    nvme_optimizer: bool = False  # ZeRO-Infinity: fp32 master and Adam states swapped to memory.nvme_path
    nvme_param: bool = False  # ... and the 16-bit parameters too

    @property
    def nvme(self) -> bool:
        return self.nvme_optimizer or self.nvme_param

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer or self.offload_param

    @property
    def is_deepspeed(self) -> bool:
        return self.engine == "deepspeed"

    @property
    def module_in_compute_dtype(self) -> bool:
        return MODULE_IN_COMPUTE_DTYPE[self.engine]


# What each engine is, for the layers below the planner (the config's checks, the weight dtypes of
# launcher.precision); the cost model asks an engine family instead (launcher/plan/families/).
# DeepSpeed casts the module to the compute dtype and keeps the fp32 master in its optimizer; AMP and FSDP2 keep
# fp32 masters in the module (launcher/engines/).
MODULE_IN_COMPUTE_DTYPE = {"amp": False, "deepspeed": True, "fsdp": False}
# bitsandbytes' quantized layers and 8-bit optimizers run on the AMP path only (launcher/engines/amp.py)
TAKES_BITSANDBYTES = {"amp": True, "deepspeed": False, "fsdp": False}
# a user's deepspeed_config becomes a custom profile of this engine (launcher/config/user_ds_config.py)
USER_JSON_ENGINE = "deepspeed"


def _catalogue() -> dict[str, Profile]:
    out: dict[str, Profile] = {}

    def add(p: Profile):
        out[p.name] = p

    # Order within the table is the order `vramfit profiles` prints; speed_rank orders the families.
    for prec in ("fp16", "bf16", "fp32"):
        add(Profile(f"amp-{prec}", "amp", prec, speed_rank=1,
                    gpu_holds="everything (fp32 weights, grads, Adam states, activations)", cpu_holds="nothing"))
    # the optimizer on the CPU with torch alone (launcher/engines/offload_opt.py): gradients leave during backward,
    # once per step; the CPU updates the fp32 masters and the new 16-bit weights come back
    for prec in ("fp16", "bf16"):
        add(Profile(f"amp-{prec}-offload-opt", "amp", prec, offload_optimizer=True, speed_rank=2,
                    gpu_holds="16-bit weights, activations, one parameter's gradient at a time (all of them while "
                              "accumulating)",
                    cpu_holds="fp32 master, its gradients, Adam m and v, a 16-bit copy for the transfers"))
    for prec in ("fp16", "bf16", "fp32"):
        add(Profile(f"zero2-{prec}", "deepspeed", prec, zero_stage=2, speed_rank=1,
                    gpu_holds="everything", cpu_holds="nothing"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"zero2-{prec}-offload-opt", "deepspeed", prec, zero_stage=2, offload_optimizer=True, speed_rank=2,
                    gpu_holds="16-bit weights, buckets, activations", cpu_holds="fp32 master, Adam m and v, grads"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"fsdp-{prec}-offload", "fsdp", prec, offload_optimizer=True, offload_param=True, speed_rank=3,
                    gpu_holds="one layer's params, activations", cpu_holds="params, grads, optimizer"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"zero3-{prec}-offload-all", "deepspeed", prec, zero_stage=3, offload_optimizer=True,
                    offload_param=True, speed_rank=4, gpu_holds="live layers, activations",
                    cpu_holds="everything else"))
    # ZeRO-Infinity, for hosts whose RAM cannot hold the offload: the last rungs (memory.nvme_path must be set)
    for prec in ("fp16", "bf16"):
        add(Profile(f"zero3-{prec}-offload-nvme-opt", "deepspeed", prec, zero_stage=3, offload_optimizer=True,
                    offload_param=True, nvme_optimizer=True, speed_rank=5, gpu_holds="live layers, activations",
                    cpu_holds="16-bit params, gradients, swap buffers (fp32 master, Adam m and v on NVMe)"))
    for prec in ("fp16", "bf16"):
        add(Profile(f"zero3-{prec}-offload-nvme-all", "deepspeed", prec, zero_stage=3, offload_optimizer=True,
                    offload_param=True, nvme_optimizer=True, nvme_param=True, speed_rank=6,
                    gpu_holds="live layers, activations",
                    cpu_holds="gradients, swap buffers (params, fp32 master, Adam m and v on NVMe)"))
    return out


# ZeRO-Infinity's swap settings (DeepSpeed's defaults unless said): the optimizer swapper pins buffer_count
# buffers of the largest sub-group (fp32), so sub_group_size bounds them: 1e8 elements = 4 x 400 MB, where
# DeepSpeed's default 1e9 would pin 16 GB on a 7B model -- the RAM NVMe offload is there to spare.
NVME_SUB_GROUP = 100_000_000
NVME_OPT_BUFFERS = 4
NVME_PARAM_BUFFERS = 5
NVME_PARAM_BUFFER_SIZE = 100_000_000  # elements per parameter swap buffer (at least the largest parameter)
NVME_AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True}


PROFILES: dict[str, Profile] = _catalogue()


def get(name: str) -> Profile:
    return PROFILES[name]


def in_catalogue(p: Profile) -> bool:
    """A catalogue profile (possibly with the planner's bucket sizes), not a user's deepspeed_config row."""
    return p.name in PROFILES


def ds_config_template(p: Profile) -> dict:
    """The DeepSpeed config of a profile, with ``"auto"`` where the run decides."""
    if not p.is_deepspeed:
        raise ValueError(f"{p.name} is not a DeepSpeed profile")
    zero: dict = {"stage": p.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": AUTO}
    if p.zero_stage == 2:
        zero["allgather_bucket_size"] = AUTO
        zero["reduce_scatter"] = True
    if p.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": AUTO, "stage3_param_persistence_threshold": AUTO,
                     "stage3_max_live_parameters": AUTO, "stage3_max_reuse_distance": AUTO,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": AUTO}
        if p.nvme_optimizer:
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": AUTO, "pin_memory": AUTO,
                                         "buffer_count": NVME_OPT_BUFFERS}
            zero["sub_group_size"] = NVME_SUB_GROUP
    if p.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": AUTO}
        if p.nvme_param:
            zero["offload_param"] = {"device": "nvme", "nvme_path": AUTO, "pin_memory": AUTO,
                                     "buffer_count": NVME_PARAM_BUFFERS, "buffer_size": AUTO}
    cfg: dict = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "steps_per_print": 1_000_000_000,  # vramfit logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # No "optimizer" section: vramfit passes torch's fused AdamW as DeepSpeed's client optimizer (as fast as
        # DeepSpeed's FusedAdam and DeepSpeedCPUAdam in scripts/bench_optimizers.py, and no compiler needed);
        # with optimizer offload DeepSpeed steps it on the CPU partitions once told it may.
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": zero,
        "fp16": {"enabled": p.precision == "fp16"},
        "bf16": {"enabled": p.precision == "bf16"},
    }
    if p.nvme:
        cfg["aio"] = dict(NVME_AIO)
    if p.precision == "fp16":
        cfg["fp16"].update({"loss_scale": 0, "initial_scale_power": LOSS_SCALE["initial_power"],
                            "loss_scale_window": LOSS_SCALE["window"], "hysteresis": LOSS_SCALE["hysteresis"],
                            "min_loss_scale": LOSS_SCALE["min_scale"]})
    return cfg


DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's own reduce_bucket_size and allgather_bucket_size (elements)
DS_DEFAULT_LIVE = 1_000_000_000  # DeepSpeed's own stage3_max_live_parameters and stage3_max_reuse_distance
DS_DEFAULT_PREFETCH = 50_000_000  # DeepSpeed's own stage3_prefetch_bucket_size


def zero3_residency(prefetch: int, largest_module: int) -> dict:
    """How many gathered parameters ZeRO-3 keeps, in elements, as the plan counts and prices them
    (:class:`launcher.plan.families.zero3.Zero3`): the module that computes plus one prefetch bucket
    (``stage3_max_live_parameters``, which caps DeepSpeed's prefetching), and a module's parameters released once it
    ran (``stage3_max_reuse_distance`` 0: the backward gathers them again, which the plan prices as a second move).
    DeepSpeed's defaults (1e9 each) let a billion elements stay gathered: two CPU ranks of llama-1b LoRA on
    ``zero3-bf16-offload-all`` held 3997 and 4002 MiB each with them, 2258 and 2287 with these
    (``scripts/validate_ranks.py``: bench/results/2026-12-05-cpu-epyc/two-ranks-llama-1b-lora-zero3-heap-4mib/,
    2026-12-06-cpu-epyc/two-ranks-llama-1b-lora/). ``largest_module`` 0: DeepSpeed's bound (not known yet,
    or a mixture of experts: launcher/engines/__init__.py::_zero3_bound)."""
    live = largest_module + prefetch if largest_module else DS_DEFAULT_LIVE
    return {"stage3_max_live_parameters": live, "stage3_max_reuse_distance": 0}


def bucket_sizes(hidden_size: int, world: int = 1, trainable: int | None = None) -> dict:
    """Bucket sizes for ``world`` ranks, in elements.

    Several ranks: ``hidden_size**2``, as Accelerate's DeepSpeed plugin resolves "auto": buckets small enough
    that the reduction of one overlaps the backward of the next layers. One rank has nothing to overlap:
    every bucket is only a fixed cost (hooks, a flatten, a reduce call, a copy into the partition), dozens
    per step for a small model at hidden**2 (4096 elements at hidden 64). There the bucket holds all
    ``trainable`` gradients at once, up to DeepSpeed's default of 5e8 -- a buffer larger than every gradient
    would only cost memory (ZeRO-2 allocates two of them). The memory plan counts the buffers, and the
    planner shrinks them when the run would not fit otherwise (:func:`launcher.plan.planner.plan`)."""
    h2 = hidden_size * hidden_size
    big = max(h2, min(DS_DEFAULT_BUCKET, int(trainable))) if world == 1 and trainable else h2
    return {"reduce_bucket_size": big, "allgather_bucket_size": big,
            "stage3_prefetch_bucket_size": int(0.9 * h2), "stage3_param_persistence_threshold": 10 * hidden_size}


@dataclass(frozen=True)
class RunValues:
    """What vramfit decides for a DeepSpeed config: the values behind every ``"auto"``, for the catalogue's
    templates and a user's own JSON alike (:func:`fill_auto`)."""

    precision: str
    micro_batch: int
    accumulation: int
    world: int
    grad_clip: float
    lr: float  # the optimizer's lr at construction (the loop sets every step's lr from its schedule)
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    hidden_size: int
    pin_memory: bool
    loss_scale: dict = field(default_factory=lambda: dict(LOSS_SCALE))  # initial_power, window, hysteresis, min_scale
    peak_lr: float | None = None  # train.lr, what an explicit optimizer lr is compared with (default: lr)
    nvme_path: str = ""  # memory.nvme_path (ZeRO-Infinity profiles)
    largest_param: int = 0  # elements of the largest parameter (the parameter swap buffers must hold it)
    largest_module: int = 0  # most direct parameters of one module (what ZeRO-3 gathers at once)


# fp16 dynamic loss scaling: DeepSpeed key -> loss_scale.* key (loss_scale 0 = dynamic)
_FP16_SCALING = (("initial_scale_power", "initial_power"), ("loss_scale_window", "window"),
                 ("hysteresis", "hysteresis"), ("min_loss_scale", "min_scale"))
# Where an "auto" can be filled (a user's JSON with "auto" anywhere else is refused before launch).
AUTO_PATHS = frozenset(
    ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
     "fp16.enabled", "fp16.loss_scale", "bf16.enabled"]
    + [f"optimizer.params.{k}" for k in ("lr", "betas", "eps", "weight_decay")] + [f"fp16.{k}" for k, _ in _FP16_SCALING]
    + [f"zero_optimization.{k}" for k in ("reduce_bucket_size", "allgather_bucket_size",
                                          "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                          "stage3_max_live_parameters", "stage3_max_reuse_distance")]
    + [f"zero_optimization.{k}.pin_memory" for k in ("offload_optimizer", "offload_param")]
    + [f"zero_optimization.{k}.nvme_path" for k in ("offload_optimizer", "offload_param")]
    + ["zero_optimization.offload_param.buffer_size"])


def _same(have, want) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return math.isclose(have, want, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(want, list) and isinstance(have, (list, tuple)):
        return len(have) == len(want) and all(_same(h, w) for h, w in zip(have, want))
    return have == want


def fill_auto(template: dict, v: RunValues, source: str = "DeepSpeed config") -> tuple[dict, list[str]]:
    """The config DeepSpeed receives: every ``"auto"`` of ``template`` filled from ``v``, plus the problems.

    A key vramfit decides (batch sizes, clipping, optimizer params, precision, fp16 loss scaling) takes
    vramfit's value when it is ``"auto"`` or absent, and must equal it when explicit: each disagreement is
    a problem (value, rule, fix), as the HF Trainer refuses mismatches. Bucket sizes follow the hidden size
    when ``"auto"`` (explicit ones stay); ``pin_memory`` follows vramfit's decision when ``"auto"`` or absent
    (DeepSpeed would pin by default, which DESIGN.md allows only when ``ulimit -l`` and free RAM do). The
    catalogue's templates (:func:`resolve_ds_config`) and a user's JSON (:mod:`launcher.config.user_ds_config`)
    both come through here."""
    cfg = json.loads(json.dumps(template))
    problems: list[str] = []

    def settle(obj: dict, key: str, path: str, want, setting: str, fix, compare=None):
        """``obj[key]`` = ``want`` unless an explicit value disagrees with ``compare`` (default ``want``)."""
        have, ref = obj.get(key, AUTO), want if compare is None else compare
        if have != AUTO and not _same(have, ref):
            problems.append(f"{source} {path}: got {have!r}, but {setting} is {ref!r}; rule: a value vramfit also "
                            f"sets must agree with it; fix: {fix(have)}, or \"{AUTO}\" in the JSON")
        else:
            obj[key] = want

    per_step = v.micro_batch * v.world
    settle(cfg, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", v.micro_batch,
           "train.micro_batch_size", lambda g: f"train.micro_batch_size={g}")
    settle(cfg, "gradient_accumulation_steps", "gradient_accumulation_steps", v.accumulation,
           f"train.global_batch_size / (micro-batch {v.micro_batch} x {v.world} rank(s))",
           lambda g: f"train.global_batch_size={g * per_step}" if isinstance(g, int) else "a whole number")
    settle(cfg, "train_batch_size", "train_batch_size", per_step * v.accumulation, "train.global_batch_size",
           lambda g: f"train.global_batch_size={g}")
    settle(cfg, "gradient_clipping", "gradient_clipping", v.grad_clip, "train.grad_clip",
           lambda g: f"train.grad_clip={g}")
    opt = cfg.get("optimizer")
    if opt is None:  # none given: vramfit's AdamW from train.*, torch's fused one as a client optimizer
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)  # DeepSpeed refuses it with offload otherwise
    else:
        params = opt.setdefault("params", {})
        settle(params, "lr", "optimizer.params.lr", v.lr, "train.lr", lambda g: f"train.lr={g}",
               compare=v.peak_lr if v.peak_lr is not None else v.lr)  # explicit: the peak; written: the first step's
        settle(params, "betas", "optimizer.params.betas", list(v.betas), "[train.beta1, train.beta2]",
               lambda g: f"train.beta1={g[0]} train.beta2={g[1]}" if isinstance(g, list) and len(g) == 2 else "[B1, B2]")
        settle(params, "eps", "optimizer.params.eps", v.eps, "train.eps", lambda g: f"train.eps={g}")
        settle(params, "weight_decay", "optimizer.params.weight_decay", v.weight_decay, "train.weight_decay",
               lambda g: f"train.weight_decay={g}")
    for name in ("fp16", "bf16"):
        on = v.precision == name
        if on or name in cfg:
            settle(cfg.setdefault(name, {}), "enabled", f"{name}.enabled", on, f"precision {v.precision}: {name}",
                   lambda g, name=name: f"precision={name}" if g is True else f"{name}.enabled true")
    fp16 = cfg.get("fp16")
    if fp16 is not None:  # the scaling numbers must agree only when fp16 runs; "auto" is filled either way
        for key, ours in (("loss_scale", None), *_FP16_SCALING):
            want = 0 if ours is None else v.loss_scale[ours]
            if fp16.get("enabled") is True:
                settle(fp16, key, f"fp16.{key}", want, "dynamic loss scaling" if ours is None else f"loss_scale.{ours}",
                       lambda g, ours=ours: "fp16.loss_scale 0" if ours is None else f"loss_scale.{ours}={g}")
            elif fp16.get(key) == AUTO:
                fp16[key] = want
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        for key, want in bucket_sizes(v.hidden_size).items():
            if zero.get(key) == AUTO:
                zero[key] = want
        prefetch = zero.get("stage3_prefetch_bucket_size", DS_DEFAULT_PREFETCH)
        prefetch = prefetch if isinstance(prefetch, (int, float)) and not isinstance(prefetch, bool) else 0
        for key, want in zero3_residency(int(prefetch), v.largest_module).items():
            if zero.get(key) == AUTO:
                zero[key] = want
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(key), dict) and zero[key].get("pin_memory", AUTO) == AUTO:  # DeepSpeed: True
                zero[key]["pin_memory"] = bool(v.pin_memory)
            if isinstance(zero.get(key), dict) and zero[key].get("nvme_path") == AUTO and v.nvme_path:
                zero[key]["nvme_path"] = v.nvme_path
        param = zero.get("offload_param")
        if isinstance(param, dict) and param.get("buffer_size") == AUTO:
            param["buffer_size"] = max(NVME_PARAM_BUFFER_SIZE, int(v.largest_param))
    return cfg, problems


def resolve_ds_config(p: Profile, *, micro_batch: int, accumulation: int, world: int, grad_clip: float, lr: float,
                      betas: tuple[float, float], eps: float, weight_decay: float, hidden_size: int,
                      pin_memory: bool, loss_scale: dict | None = None, trainable: int | None = None,
                      nvme_path: str = "", largest_param: int = 0, largest_module: int = 0) -> dict:
    """Fill every ``"auto"`` of the profile's config. Raises if one would survive. Bucket sizes: the
    profile's own (the planner's choice) or :func:`bucket_sizes` for ``world`` ranks and ``trainable``
    parameters."""
    scaling = dict(LOSS_SCALE, **(loss_scale or {}))
    template = ds_config_template(p)
    zero = template["zero_optimization"]
    buckets = bucket_sizes(hidden_size, world, trainable)
    if p.reduce_bucket_size:
        buckets.update(reduce_bucket_size=p.reduce_bucket_size, allgather_bucket_size=p.reduce_bucket_size)
    if p.prefetch_bucket_size:
        buckets["stage3_prefetch_bucket_size"] = p.prefetch_bucket_size
    for key in [k for k, v in zero.items() if v == AUTO and k in buckets]:
        zero[key] = buckets[key]
    if p.precision == "fp16":  # the catalogue's fp16 numbers are vramfit's loss_scale.* settings
        template["fp16"].update({ds: scaling[ours] for ds, ours in _FP16_SCALING})
    v = RunValues(p.precision, micro_batch, accumulation, world, grad_clip, lr, tuple(betas), eps, weight_decay,
                  hidden_size, pin_memory, scaling, nvme_path=nvme_path, largest_param=largest_param,
                  largest_module=largest_module)
    cfg, problems = fill_auto(template, v, f"profile {p.name}")
    left = find_auto(cfg)
    if problems or left:
        raise RuntimeError(f"the DeepSpeed config of {p.name} does not resolve: {problems or left}")
    return cfg


def find_auto(obj, path: str = "") -> list[str]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in find_auto(v, f"{path}[{i}]")]
    return [path] if obj == AUTO else []


def render(p: Profile) -> str:
    return json.dumps(ds_config_template(p), indent=2, sort_keys=False) + "\n"


def write_all(directory: str = DS_CONFIG_DIR) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    written = []
    for p in PROFILES.values():
        if p.is_deepspeed:
            path = os.path.join(directory, f"{p.name}.json")
            with open(path, "w") as fh:
                fh.write(render(p))
            written.append(path)
    return written


def check_all(directory: str = DS_CONFIG_DIR) -> list[str]:
    """Differences between ``directory`` and the code (empty when they agree)."""
    problems = []
    want = {f"{p.name}.json": render(p) for p in PROFILES.values() if p.is_deepspeed}
    have = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    for fname, text in want.items():
        path = os.path.join(directory, fname)
        if fname not in have:
            problems.append(f"{path}: missing")
        elif open(path).read() != text:
            problems.append(f"{path}: differs from the code")
    for fname in sorted(have - set(want)):
        if fname.endswith(".json"):
            problems.append(f"{os.path.join(directory, fname)}: no such profile in the code")
    return problems


def table_markdown() -> str:
    lines = ["| profile | engine | precision | GPU holds | CPU holds |", "| --- | --- | --- | --- | --- |"]
    for p in PROFILES.values():
        engine = {"amp": "torch autocast + GradScaler", "fsdp": "torch FSDP2 + CPUOffloadPolicy",
                  "deepspeed": f"DeepSpeed ZeRO-{p.zero_stage}"}[p.engine]
        if p.engine == "amp" and p.offload_optimizer:
            engine = "torch, 16-bit model + CPU AdamW on fp32 masters (gradients sent during backward)"
        if p.offload_optimizer and p.is_deepspeed:
            engine += (f" + offload_optimizer {'nvme' if p.nvme_optimizer else 'cpu'}"
                       + (f" + offload_param {'nvme' if p.nvme_param else 'cpu'}" if p.offload_param else ""))
        lines.append(f"| `{p.name}` | {engine} | {p.precision} | {p.gpu_holds} | {p.cpu_holds} |")
    return "\n".join(lines)
