"""Decide device, precision, engine and profile before anything is loaded, and say why.

``precision=auto``: bf16 on GPUs of compute capability >= 8.0, fp16 on older GPUs (T4, V100), fp32 on
the CPU. ``engine=auto``: DeepSpeed when it imports and can run the profile, else the torch paths.
``profile=auto``: the fastest profile that fits the memory budget (the planner decides).
``deepspeed_config=PATH``: the JSON is the profile (a custom row, :mod:`launcher.user_ds_config`); its explicit
fp16/bf16 blocks decide the precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from launcher import user_ds_config
from launcher.config import AUTO, Config, ConfigError
from launcher.hardware import Hardware
from launcher.profiles import PROFILES, Profile
from launcher.user_ds_config import UserDsConfig


@dataclass
class Resolved:
    device: torch.device
    precision: str
    profile: Profile
    micro_batch: int
    accumulation: int
    world: int
    reasons: list[str] = field(default_factory=list)
    plan: object | None = None  # launcher.planner.Plan when the planner ran
    user_ds: UserDsConfig | None = None  # deepspeed_config: the user's JSON, checked, "auto" still open

    @property
    def engine(self) -> str:
        return self.profile.engine


def resolve_device(cfg: Config, hw: Hardware) -> torch.device:
    if cfg.device == "cuda" and not hw.has_cuda:
        raise ConfigError(["device: got 'cuda'; rule: needs a CUDA GPU and a CUDA build of torch, and none was "
                           f"found (torch {hw.torch}, CUDA {hw.cuda}); fix: device=auto or device=cpu"])
    if cfg.device == "cpu" or not hw.has_cuda:
        return torch.device("cpu")
    import os

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def resolve_precision(cfg: Config, hw: Hardware, device: torch.device) -> tuple[str, str]:
    found = _vramfit_precision(cfg, hw, device)
    if cfg.deepspeed_config:
        bf16_ok = device.type != "cuda" or hw.gpu(device.index or 0).bf16
        return user_ds_config.precision_for(cfg, found, device.type, bf16_ok)
    return found


def _vramfit_precision(cfg: Config, hw: Hardware, device: torch.device) -> tuple[str, str]:
    if cfg.profile != AUTO:
        return PROFILES[cfg.profile].precision, f"precision {PROFILES[cfg.profile].precision} from profile {cfg.profile}"
    if cfg.precision != AUTO:
        prec = cfg.precision
        if prec == "bf16" and device.type == "cuda" and not hw.gpu(device.index or 0).bf16:
            g = hw.gpu(device.index or 0)
            raise ConfigError([f"precision: got 'bf16' on {g.name} (compute capability {g.capability[0]}.{g.capability[1]}); "
                               "rule: bf16 needs compute capability >= 8.0 (Ampere or newer); torch would emulate it "
                               "slowly; fix: precision=fp16 (dynamic loss scaling) or precision=auto"])
        return prec, f"precision {prec} as asked"
    if device.type == "cuda":
        g = hw.gpu(device.index or 0)
        if g.bf16:
            return "bf16", f"precision bf16: {g.name} has compute capability {g.capability[0]}.{g.capability[1]} >= 8.0"
        return "fp16", (f"precision fp16 with dynamic loss scaling: {g.name} has compute capability "
                        f"{g.capability[0]}.{g.capability[1]} < 8.0, so no native bf16")
    return "fp32", "precision fp32: training on the CPU, where 16-bit autocast brings no speed"


def engine_problems(p: Profile, cfg: Config, hw: Hardware, device: torch.device) -> str | None:
    """Why profile ``p`` cannot run here (None when it can)."""
    if p.engine == "deepspeed":
        if hw.deepspeed is None:
            return f"DeepSpeed is {hw.deepspeed_error}"
        if device.type == "cpu" and p.precision == "fp16":
            return "DeepSpeed refuses fp16 on the CPU"
        if cfg.model.quantize != "none":
            return f"model.quantize={cfg.model.quantize} (bitsandbytes) runs on the AMP path only"
        if cfg.train.optimizer == "adamw8bit":
            return "train.optimizer=adamw8bit (bitsandbytes) runs on the AMP path only"
    if p.engine == "fsdp":
        if cfg.model.quantize != "none" or cfg.train.optimizer == "adamw8bit":
            return "bitsandbytes quantization and 8-bit AdamW run on the AMP path only"
        if not _fsdp_available():
            return "torch.distributed.fsdp.fully_shard is not available in this torch"
    return None


def _fsdp_available() -> bool:
    try:
        from launcher.engines import fsdp  # noqa: F401

        from torch.distributed.fsdp import fully_shard  # noqa: F401

        return True
    except ImportError:
        return False


def candidate_order(cfg: Config, hw: Hardware, precision: str, device: torch.device,
                    allow_offload: bool = False) -> tuple[list[Profile], list[str]]:
    """Profiles to try for this precision, fastest first, DeepSpeed first when it can run; plus why others were dropped."""
    dropped = []
    pool = [p for p in PROFILES.values() if p.precision == precision]
    if cfg.engine != AUTO:
        pool = [p for p in pool if p.engine == cfg.engine]
    ok = []
    for p in pool:
        why = engine_problems(p, cfg, hw, device)
        if why:
            dropped.append(f"{p.name}: {why}")
        else:
            ok.append(p)
    # Offload profiles need a GPU to offload from; on the CPU they only add copies.
    if device.type == "cpu" and not allow_offload:
        no_off = [p for p in ok if not p.offloads]
        if no_off:
            ok = no_off
    ds_first = lambda p: (p.speed_rank, 0 if p.engine == "deepspeed" else 1)  # noqa: E731
    return sorted(ok, key=ds_first), dropped


def resolve(cfg: Config, hw: Hardware, world: int = 1) -> Resolved:
    device = resolve_device(cfg, hw)
    precision, why_prec = resolve_precision(cfg, hw, device)
    reasons = [f"device {device}", why_prec]
    user = user_ds_config.load(cfg, precision) if cfg.deepspeed_config else None
    if user is not None or cfg.profile != AUTO:
        p = user.profile if user is not None else PROFILES[cfg.profile]
        why = engine_problems(p, cfg, hw, device)
        if why and user is not None:
            raise ConfigError([f"deepspeed_config: got {cfg.deepspeed_config!r}; rule: it runs on DeepSpeed, but {why}; "
                               "fix: deepspeed_config=\"\" (vramfit's profiles, the AMP path among them), or drop "
                               "that setting"])
        if why:
            alt, _ = candidate_order(replace(cfg, engine=AUTO), hw, precision, device)
            fix = f"profile={alt[0].name}" if alt else "profile=auto"
            raise ConfigError([f"profile: got {cfg.profile!r}; rule: its engine must be usable here, but {why}; "
                               f"fix: {fix}" + (" or pip install 'vramfit[deepspeed]'" if "not installed" in why else "")])
        chosen, plan = p, _plan_one(cfg, hw, p)
        if user is not None:
            reasons.append(f"profile {p.name} from deepspeed_config {cfg.deepspeed_config}")
            reasons += list(user.notices)
        else:
            reasons.append(f"profile {p.name} as asked")
        row = plan.get(p.name) if plan is not None else None
        if row is not None and not row.fits:
            over_cpu = row.cpu_bytes > plan.budget["cpu_bytes"]
            if over_cpu:  # a host OOM kill loses the run: refuse before anything is loaded
                raise ConfigError([f"memory: profile {p.name} needs {row.cpu_bytes / 2**30:.1f} GiB of CPU RAM, the "
                                   f"budget is {plan.budget['cpu_bytes'] / 2**30:.1f} GiB ({plan.budget['cpu_source']}); "
                                   "rule: planned host memory must fit, or the kernel kills the run; fix: "
                                   + ("; ".join(plan.suggestions) if plan.suggestions else
                                      "a profile that offloads less, LoRA (lora.r=16), or memory.cpu_budget=GiB "
                                      "if RAM will be free")], "memory plan")
            reasons.append(f"warning: the plan puts {p.name} over the GPU budget ({row.why_not}); the OOM ladder "
                           "will step in if it runs out")
    else:
        order, dropped = candidate_order(cfg, hw, precision, device)
        if not order:
            raise ConfigError([f"engine: got {cfg.engine!r} with precision {precision}; rule: the engine must be able "
                               f"to run here, but: {'; '.join(dropped)}; fix: engine=auto"])
        chosen, plan, why_profile = _choose(cfg, hw, order, device)
        if chosen is None:
            tips = "; ".join(getattr(plan, "suggestions", []) or []) or "a smaller model or more memory"
            raise ConfigError([f"memory: no profile fits; {plan.reason}; fix: {tips}"], "memory plan")
        reasons.append(why_profile)
        if cfg.engine == AUTO and dropped and chosen.engine != "deepspeed":
            ds_drop = [d for d in dropped if d.startswith("zero")]
            if ds_drop:
                reasons.append(f"engine {chosen.engine}, not DeepSpeed: {ds_drop[0].split(': ', 1)[1]}")
    micro = cfg.train.micro_batch_size
    if micro == AUTO and user is not None and user.micro_batch:
        micro = user.micro_batch
        reasons.append(f"micro-batch {micro} from deepspeed_config")
    elif micro == AUTO:
        micro = getattr(plan, "micro_batch", None) or 1 if plan is not None else 1
        reasons.append(f"micro-batch {micro} from the planner")
    per_step = micro * world
    if cfg.train.global_batch_size % per_step:
        raise ConfigError([f"train.global_batch_size: got {cfg.train.global_batch_size}; rule: a multiple of "
                           f"micro-batch {micro} x {world} rank(s) = {per_step}; fix: "
                           f"train.global_batch_size={max(per_step, cfg.train.global_batch_size // per_step * per_step)}"])
    accumulation = cfg.train.global_batch_size // per_step
    if user is not None:
        # Every explicit value against the run's, and DeepSpeed's verdict on the filled config, before anything
        # loads; pin_memory is decided with the model (train.build_engine) and does not change the verdict.
        hidden = plan.model["hidden_size"]
        user_ds_config.resolve(user, user_ds_config.run_values(cfg, precision, micro, accumulation, world, hidden,
                                                               False, cfg.train.lr))
        user = user.with_batch_auto()
    return Resolved(device, precision, chosen, micro, accumulation, world, reasons, plan, user)


def _plan_one(cfg: Config, hw: Hardware, p: Profile):
    """The planner's view of one profile asked for by name (for the prediction and the host-RAM check)."""
    from launcher import planner

    plan = planner.plan(cfg, hw, profiles=[p.name], available_engines={p.engine}, suggest=False)
    row = plan.get(p.name)
    if row is not None and row.cpu_bytes > plan.budget["cpu_bytes"]:  # the refusal lists them; they cost seconds
        plan = planner.plan(cfg, hw, profiles=[p.name], available_engines={p.engine}, suggest=True)
    return plan


def _choose(cfg: Config, hw: Hardware, order: list[Profile], device: torch.device):
    """The planner's choice among ``order`` when it is present, else the first of ``order``."""
    try:
        from launcher import planner
    except ImportError:
        planner = None
    if planner is None or not hasattr(planner, "plan"):
        return order[0], None, f"profile {order[0].name}: the fastest that can run here"
    plan = planner.plan(cfg, hw, profiles=[p.name for p in order], available_engines={p.engine for p in order})
    if plan.chosen is None:
        return None, plan, ""  # the caller turns this into the "nothing fits" error
    return PROFILES[plan.chosen], plan, f"profile {plan.chosen}: {plan.reason}"
