"""What can run here, and why not: the device, the precision and every profile (one source).

The planner and :mod:`launcher.plan.resolve` both ask this module; nothing else decides whether DeepSpeed,
FSDP or AMP can run a profile on this machine with these settings.

- ``device=auto``: the GPU of this rank when torch sees one, else the CPU.
- ``precision=auto``: bf16 on GPUs of compute capability >= 8.0, fp16 with dynamic loss scaling below
  (T4, V100), fp32 on the CPU -- or the precision of the asked profile, or, for an engine that has no
  profile of that precision (FSDP has no fp32 one), the first precision it has.
- A profile cannot run (a *problem*) when its engine is missing or refuses the settings: DeepSpeed not
  importable, fp16 on a CPU (DeepSpeed refuses it), ``model.compile`` on DeepSpeed, bitsandbytes quantization or 8-bit AdamW off the AMP
  path, no FSDP2 in this torch. It is *not wanted* when another engine, profile or precision was asked,
  or when it offloads to the CPU from a CPU (nothing to gain) and was not asked for by name.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field, replace

import torch

from launcher.config import user_ds_config
from launcher.config.profiles import PROFILES, Profile
from launcher.config.schema import AUTO, Config, ConfigError
from launcher.machine.hardware import Hardware
from launcher.plan.families import family_of
from launcher.precision import PRECISIONS, deepspeed_runs_fp16

# Equal speed rank and no step times: torch's AMP path first, on a GPU as on a CPU. On one H200 (issue 43, llama-125m,
# seq 512, micro-batch 8) ZeRO-2 without offload held the memory AMP held and ran at 0.56x its tokens/s, ZeRO-2
# optimizer offload at 0.32x; on a CPU DeepSpeed has no fused ops to offer and adds its engine's work to every step
# (docs/calibration.md: its per-step and per-parameter terms). A ZeRO profile of the same rank is chosen only where
# it is priced faster (a calibrated machine) or the AMP one cannot run.
ENGINE_PREFERENCE = ("amp", "deepspeed", "fsdp")
ENGINE_PREFERENCE_CPU = ("amp", "deepspeed", "fsdp")


def device_for(cfg: Config, hw: Hardware, local_rank: int = 0) -> torch.device:
    if cfg.device == "cuda" and not hw.has_cuda:
        raise ConfigError(["device: got 'cuda'; rule: needs a CUDA GPU and a CUDA build of torch, and none was "
                           f"found (torch {hw.torch}, CUDA {hw.cuda}); fix: device=auto or device=cpu"])
    if cfg.device == "cpu" or not hw.has_cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def precision_for(cfg: Config, hw: Hardware, device: torch.device) -> tuple[str, str]:
    """(precision, why); with ``deepspeed_config`` its explicit fp16/bf16 blocks decide (checked against these)."""
    found = _precision_for(cfg, hw, device)
    if cfg.deepspeed_config:
        bf16_ok = device.type != "cuda" or hw.gpu(device.index or 0).bf16
        return user_ds_config.precision_for(cfg, found, device.type, bf16_ok)
    return found


def _precision_for(cfg: Config, hw: Hardware, device: torch.device) -> tuple[str, str]:
    if cfg.profile != AUTO and cfg.profile in PROFILES:
        p = PROFILES[cfg.profile].precision
        return p, f"precision {p} from profile {cfg.profile}"
    g = hw.gpu(device.index or 0) if device.type == "cuda" else None
    if cfg.precision != AUTO:
        prec = cfg.precision
        if prec == "bf16" and g is not None and not g.bf16:
            raise ConfigError([f"precision: got 'bf16' on {g.name} (compute capability {g.capability[0]}.{g.capability[1]}); "
                               "rule: bf16 needs compute capability >= 8.0 (Ampere or newer); torch would emulate it "
                               "slowly; fix: precision=fp16 (dynamic loss scaling) or precision=auto"])
        return prec, f"precision {prec} as asked"
    if g is not None:
        cap = f"{g.capability[0]}.{g.capability[1]}"
        prec, why = (("bf16", f"precision bf16: {g.name} has compute capability {cap} >= 8.0") if g.bf16 else
                     ("fp16", f"precision fp16 with dynamic loss scaling: {g.name} has compute capability {cap} < 8.0, "
                              "so no native bf16"))
    else:
        prec, why = "fp32", "precision fp32: training on the CPU, where 16-bit autocast brings no speed"
    if cfg.engine != AUTO:
        has = [q for q in PRECISIONS if any(p.engine == cfg.engine and p.precision == q for p in PROFILES.values())]
        if has and prec not in has:
            alt = "bf16" if "bf16" in has and (g is None or g.bf16) else has[0]
            return alt, f"precision {alt}: engine {cfg.engine} has no {prec} profile"
    return prec, why


def profile_problem(p: Profile, cfg: Config, hw: Hardware, device: torch.device) -> str | None:
    """Why profile ``p`` cannot run here at all (None when it can)."""
    fam = family_of(p)
    if fam.deepspeed:
        if hw.deepspeed is None:
            return f"DeepSpeed {hw.deepspeed_error or 'is not installed'}"
        if cfg.model.compile:  # DeepSpeed wraps the module and hooks every parameter; its engine.compile() is not wired
            return "model.compile=true compiles the model on the AMP and FSDP paths only"
        if p.precision == "fp16" and not deepspeed_runs_fp16(device.type):
            return f"DeepSpeed refuses fp16 on the {device.type.upper()}"
    if fam.bitsandbytes_refusal:  # bitsandbytes' layers and optimizers on the AMP path only, and not on the CPU's
        on_quantized, on_optimizer = fam.bitsandbytes_refusal
        if cfg.model.quantize != "none":
            return f"model.quantize={cfg.model.quantize} (bitsandbytes) {on_quantized}"
        if cfg.train.optimizer in ("adamw8bit", "paged_adamw8bit"):
            return f"train.optimizer={cfg.train.optimizer} (bitsandbytes) {on_optimizer}"
    if p.nvme:
        status = hw.async_io if hw.async_io != "not checked" else None
        if status is None and cfg.memory.nvme_path and hw.deepspeed is not None:
            from launcher.machine.deepspeed_ops import async_io_status

            status = hw.async_io = async_io_status()
        if status and status != "usable":
            return f"DeepSpeed's async_io op, which NVMe offload needs, is {status}"
    if fam.fully_shard and not fsdp_available():
        return "torch.distributed.fsdp.fully_shard is not available in this torch (2.6 or newer has it)"
    return None


@functools.cache
def fsdp_available() -> bool:
    """torch.distributed.fsdp.fully_shard is there (torch 2.6 or newer, built with distributed), told by its
    package's folder: importing torch.distributed.fsdp costs about a second, which every plan would pay for
    a profile it may not choose (the engine imports it when it runs)."""
    if not torch.distributed.is_available():
        return False
    spec = importlib.util.find_spec("torch.distributed")
    return spec is not None and any(os.path.isdir(os.path.join(d, "fsdp", "_fully_shard"))
                                    for d in spec.submodule_search_locations or ())


def _asked_for(p: Profile, cfg: Config) -> bool:
    """The profile by name, or its engine when all that engine's profiles of this precision offload (FSDP):
    on a CPU-only machine offloading changes nothing, but the user may want that engine's code path."""
    if cfg.profile == p.name:
        return True
    return cfg.engine == p.engine and all(q.offloads for q in PROFILES.values()
                                          if q.engine == p.engine and q.precision == p.precision)


@dataclass(frozen=True)
class Availability:
    """The answer for one config on one machine."""

    device: torch.device
    precision: str
    precision_reason: str
    problems: dict = field(default_factory=dict)  # profile -> why it cannot run here at all
    unwanted: dict = field(default_factory=dict)  # profile -> why the settings rule it out
    user: user_ds_config.UserDsConfig | None = None  # deepspeed_config: the JSON, checked; its custom profile

    def profile(self, name: str) -> Profile:
        """A catalogue profile, or the custom one of a deepspeed_config."""
        if self.user is not None and name == self.user.profile.name:
            return self.user.profile
        return PROFILES[name]

    def why_not(self, name: str) -> str | None:
        return self.problems.get(name) or self.unwanted.get(name)

    def usable(self, allow_offload: bool = False) -> list[Profile]:
        """Profiles of the run's precision that can run and are wanted, fastest first (AMP first on a tie).
        ``allow_offload``: also offload profiles on a CPU (the OOM ladder's further rungs). With a
        deepspeed_config, its custom profile alone (the OOM ladder never swaps it for a catalogue one)."""
        if self.user is not None:
            return [] if self.user.profile.name in self.problems else [self.user.profile]
        out = []
        for p in PROFILES.values():
            if p.precision != self.precision or p.name in self.problems:
                continue
            why = self.unwanted.get(p.name)
            if why and not (allow_offload and why == NO_GPU_TO_OFFLOAD):
                continue
            out.append(p)
        return sorted(out, key=lambda p: rank_key(p, self.device.type))

    def widened(self, cfg: Config, precision: str) -> Availability:
        """This answer for ``cfg`` at ``precision`` (a profile and engine left to choose): what cannot run here
        does not depend on which profile was asked, so only the settings' exclusions are worked out again."""
        return replace(self, precision=precision, unwanted=_unwanted(cfg, precision, self.device, self.user))

    def engine_reason(self, chosen: Profile) -> str | None:
        """Why a torch engine was chosen over DeepSpeed (None when DeepSpeed was chosen or never possible)."""
        if family_of(chosen).deepspeed:
            return None
        for p in PROFILES.values():
            if family_of(p).deepspeed and p.precision == self.precision and p.name in self.problems:
                return f"engine {chosen.engine}, not DeepSpeed: {self.problems[p.name]}"
        return None


NO_GPU_TO_OFFLOAD = "offloads from a GPU to the CPU; there is no GPU"
NO_NVME_PATH = "offloads to NVMe; memory.nvme_path is not set"


def rank_key(p: Profile, device: str = "cuda") -> tuple:
    """The order without step times: the AMP family first (plain, then its optimizer offload: issue 43 measured
    ZeRO-2 at 0.56x AMP with the same memory on one GPU), then the others by speed rank and engine (DeepSpeed,
    FSDP). ZeRO-1/2 without offload is chosen over the AMP family only where it is priced faster or AMP cannot run."""
    return (0 if family_of(p).torch_amp else 1, p.speed_rank,
            (ENGINE_PREFERENCE_CPU if device == "cpu" else ENGINE_PREFERENCE).index(p.engine))


ONE_RANK = "runs on one rank (torch's optimizer offload has no gradient all-reduce: ZeRO or FSDP2 for several)"


def rank_problem(p: Profile, world: int) -> str | None:
    """Why ``p`` cannot run on ``world`` ranks (None when it can): the AMP optimizer offload is one rank's."""
    return ONE_RANK if world > 1 and family_of(p).one_rank else None


def assess(cfg: Config, hw: Hardware, local_rank: int = 0) -> Availability:
    device = device_for(cfg, hw, local_rank)
    if cfg.train.optimizer == "paged_adamw8bit" and device.type != "cuda":
        # bitsandbytes pages optimizer states through CUDA unified memory; a CPU has nothing to page from, and
        # falling back silently would change the optimizer the user asked for
        raise ConfigError([f"train.optimizer: got 'paged_adamw8bit' on {device.type}; rule: paged optimizers keep "
                           "their states in CUDA unified memory and need a CUDA GPU; fix: train.optimizer=adamw8bit "
                           "(the same 8-bit AdamW, not paged), or train on a GPU"])
    precision, why = precision_for(cfg, hw, device)
    problems = {}
    user = user_ds_config.load(cfg, precision) if cfg.deepspeed_config else None
    if user is not None:
        problem = profile_problem(user.profile, cfg, hw, device)
        if problem:
            raise ConfigError([f"deepspeed_config: got {cfg.deepspeed_config!r}; rule: it runs on DeepSpeed, but "
                               f"{problem}; fix: deepspeed_config=\"\" (vramfit's profiles, the AMP path among them), or "
                               "drop that setting"])
    for p in PROFILES.values():
        problem = profile_problem(p, cfg, hw, device)
        if problem:
            problems[p.name] = problem
    return Availability(device, precision, why, problems, _unwanted(cfg, precision, device, user), user)


def _unwanted(cfg: Config, precision: str, device: torch.device, user) -> dict:
    """Profile -> why the settings rule it out (it could run here)."""
    unwanted = {}
    for p in PROFILES.values():
        if user is not None:
            unwanted[p.name] = f"deepspeed_config={cfg.deepspeed_config} is the run's profile"
        elif cfg.profile != AUTO and p.name != cfg.profile:
            unwanted[p.name] = f"profile={cfg.profile} was asked"
        elif cfg.engine != AUTO and p.engine != cfg.engine:
            unwanted[p.name] = f"engine={cfg.engine} was asked"
        elif p.precision != precision:
            unwanted[p.name] = f"precision {p.precision}, the run is {precision}"
        elif p.nvme and not cfg.memory.nvme_path:
            unwanted[p.name] = NO_NVME_PATH
        elif device.type == "cpu" and p.offloads and not _asked_for(p, cfg):
            unwanted[p.name] = NO_GPU_TO_OFFLOAD
    return unwanted


def engine_error(cfg: Config, avail: Availability) -> ConfigError:
    """Nothing of the asked engine can run: which rule, and the fix."""
    same = [p for p in PROFILES.values() if p.engine == cfg.engine]
    of_precision = [p for p in same if p.precision == avail.precision]
    if not of_precision:
        reason = (f"engine {cfg.engine} has no {avail.precision} profile (its profiles: "
                  f"{', '.join(p.name for p in same)})")
    else:
        reason = "; ".join(f"{p.name}: {avail.why_not(p.name)}" for p in of_precision)
    other = sorted({p.precision for p in same} - {avail.precision})
    fix = "engine=auto" + (f", or precision={other[0]}" if other and cfg.precision != AUTO else "")
    return ConfigError([f"engine: got {cfg.engine!r} with precision {avail.precision}; rule: the engine must be able "
                        f"to run here, but: {reason}; fix: {fix}"])
