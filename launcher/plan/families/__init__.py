"""The engine families of the cost model, one module per engine as in :mod:`launcher.engines`: :func:`family_of`
says which one a profile runs, and the family answers what :mod:`launcher.plan.memory.states` and
:mod:`launcher.plan.steptime` ask of an engine (:class:`.base.Family`). Nothing here imports the engines: the
planner stays pure, and each family cites the engine source it follows."""

from __future__ import annotations

from launcher.config.profiles import Profile
from launcher.plan.families.amp import Amp, AmpOffload
from launcher.plan.families.base import Family
from launcher.plan.families.fsdp import Fsdp
from launcher.plan.families.zero import Zero, ZeroOffload
from launcher.plan.families.zero3 import Zero3, Zero3Offload

FAMILIES: tuple[Family, ...] = (Amp(), AmpOffload(), Zero(), ZeroOffload(), Zero3(), Zero3Offload(), Fsdp())
_BY_NAME = {f.name: f for f in FAMILIES}


def family_of(p: Profile) -> Family:
    """The family profile ``p`` runs: its engine, and for DeepSpeed its stage and what it offloads."""
    if p.engine == "deepspeed":
        if p.zero_stage >= 3:
            return _BY_NAME["zero3_offload" if p.offload_param else "zero3"]
        return _BY_NAME["zero2_offload" if p.offload_optimizer else "zero2"]
    if p.engine == "amp":
        return _BY_NAME["amp_offload" if p.offload_optimizer else "amp"]
    if p.engine == "fsdp":
        return _BY_NAME["fsdp"]
    raise ValueError(f"no engine family for profile {p.name} (engine {p.engine})")


def optimizer_kind(p: Profile, device: str, optimizer: str = "adamw") -> str:
    """The key in :attr:`launcher.machine.speeds.Machine.optimizers`: ``<optimizer>@<device it steps on>``, e.g.
    ``torch_fused_adamw@cpu``, ``deepspeed_cpu_adam@cpu``, ``deepspeed_fused_adam@cuda``."""
    if optimizer in ("adamw8bit", "paged_adamw8bit"):  # paging moves nothing while the GPU has room
        return f"bnb_adamw8bit@{device}"
    return family_of(p).optimizer_kind(p, device)
