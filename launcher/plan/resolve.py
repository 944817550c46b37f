"""Decide once, before anything is loaded, how the run goes, into a frozen :class:`RunSpec`.

:mod:`launcher.plan.availability` says what can run here (device, precision, profiles) and the planner which
profile and micro-batch fit; this module combines them, checks the batch arithmetic and the host-RAM
refusal, and keeps the reasons. The loop receives the RunSpec and never reads those decisions from the
user's config again; the OOM ladder moves to a new RunSpec (:meth:`RunSpec.at`), never edits one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from launcher.config import user_ds_config
from launcher.config.checks import accumulation_steps
from launcher.config.profiles import PROFILES, Profile
from launcher.config.schema import AUTO, Config, ConfigError
from launcher.machine.hardware import Hardware
from launcher.machine.speeds import Machine
from launcher.plan import advice, availability, planner
from launcher.plan.ladder import Rung
from launcher.plan.rows import Plan
from launcher.plan.setting import CHUNK_SHARE
from launcher.units import gib


@dataclass(frozen=True)
class RunSpec:
    device: torch.device
    precision: str
    profile: Profile
    micro_batch: int
    accumulation: int
    world: int
    checkpointing: bool
    checkpoint_every: int = 1  # with checkpointing: every k-th decoder layer recomputes
    reasons: tuple[str, ...] = ()
    plan: Plan | None = field(default=None, compare=False)
    usable: tuple[Profile, ...] = ()  # profiles the OOM ladder may move to, fastest first
    user_ds: user_ds_config.UserDsConfig | None = None  # deepspeed_config: the user's JSON, "auto" still open
    chunked_loss: bool = False  # head + cross-entropy in chunks (loss.chunked; launcher.model.loss)
    offload_activations: bool = False  # saved activations in CPU memory (memory.offload_activations)

    @property
    def engine(self) -> str:
        return self.profile.engine

    @property
    def rung(self) -> Rung:
        return Rung(self.micro_batch, self.accumulation, self.checkpointing, self.profile.name, self.checkpoint_every)

    def at(self, rung: Rung) -> RunSpec:
        """The same run at another rung of the OOM ladder (or a resumed run's rung)."""
        p = self.profile if rung.profile == self.profile.name else _with_buckets(
            PROFILES[rung.profile], self.plan.get(rung.profile) if self.plan is not None else None)
        return replace(self, profile=p, precision=p.precision, micro_batch=rung.micro_batch,
                       accumulation=rung.accumulation, checkpointing=rung.checkpointing,
                       checkpoint_every=rung.checkpoint_every)

    def moved(self, rung: Rung, saved: int, resume_from: str, global_batch: int) -> tuple[RunSpec, str]:
        """This run at the rung of a checkpoint written by ``saved`` ranks, on this run's ``world``, and the line
        that says so. See :func:`rung_on_ranks`."""
        here = self.at(rung)
        moved, note = rung_on_ranks(rung, here.profile, saved, self.world, resume_from, global_batch)
        return here.at(moved), note

    def predicted(self, key: str):
        """A number of the plan's row for the profile in use (None without a plan)."""
        row = self.plan.get(self.profile.name) if self.plan is not None else None
        return getattr(row, key) if row is not None else None


def rung_on_ranks(rung: Rung, profile: Profile, saved: int, world: int, resume_from: str,
                  global_batch: int) -> tuple[Rung, str]:
    """The rung a checkpoint written by ``saved`` ranks goes on with on ``world`` ranks, and a line that says so:
    the global batch kept, the micro-batch the largest that divides each rank's share up to the one it had,
    accumulation to match. AMP (DDP) moves as it is, FSDP2 through torch's distributed checkpoint (it reshards
    on load), DeepSpeed ZeRO through its universal checkpoint (launcher.engines.deepspeed.universal_checkpoint);
    ZeRO with the optimizer on NVMe is refused (its states are per-rank swap files the conversion does not read)."""
    if profile.nvme_optimizer:
        raise ConfigError([f"checkpoint {resume_from}: written by {saved} rank(s) with {profile.name}, this run has "
                           f"{world}; rule: its fp32 weights and Adam moments are each rank's NVMe swap files, which "
                           "DeepSpeed's universal checkpoint conversion (how ZeRO moves to another number of ranks) "
                           f"does not read; fix: resume on {saved} rank(s) (torchrun --nproc_per_node {saved} or "
                           f"deepspeed --num_gpus {saved}), or start another run_name on {world}"])
    per_rank = global_batch // world
    if per_rank * world != global_batch:
        raise ConfigError([f"checkpoint {resume_from}: train.global_batch_size={global_batch} does not split over "
                           f"{world} ranks; rule: the global batch is kept on resume, so it must divide by the ranks; "
                           f"fix: resume on a number of ranks that divides {global_batch}"])
    micro = max(d for d in range(1, min(rung.micro_batch, per_rank) + 1) if per_rank % d == 0)
    how = {"deepspeed": ", DeepSpeed's universal checkpoint made beside it once (the checkpoint itself unchanged)",
           "fsdp": ", its shards resharded by torch's distributed checkpoint"}.get(profile.engine, "")
    return replace(rung, micro_batch=micro, accumulation=per_rank // micro), (
        f"checkpoint {resume_from} was written by {saved} rank(s); going on with {world}: micro-batch {micro} x "
        f"accumulation {per_rank // micro} x {world} = {global_batch} (the global batch kept){how}")


def resolve(cfg: Config, hw: Hardware, world: int = 1, local_rank: int = 0, machine: Machine | None = None) -> RunSpec:
    """The run, decided. ``machine``: this machine's calibration (:mod:`launcher.measure.calibrate`), so that the
    planner chooses by predicted step time; without it, by speed ranks."""
    avail = availability.assess(cfg, hw, local_rank)
    reasons = [f"device {avail.device}", avail.precision_reason]
    if cfg.memory.nvme_path and hw.nvme and hw.nvme.get("tmpfs"):
        reasons.append(f"warning: memory.nvme_path={cfg.memory.nvme_path} is on {hw.nvme['fs_type']}, which is RAM in "
                       "disguise: NVMe offload there takes the RAM it was meant to spare; fix: a folder on a real disk")
    user = avail.user
    if user is not None or cfg.profile != AUTO:
        plan, chosen = _plan_asked(cfg, hw, avail, world, machine, reasons)
    else:
        plan, chosen = _plan_searched(cfg, hw, avail, world, machine, reasons)
    _plan_warnings(plan, user, reasons)
    micro = _micro_batch(cfg, user, plan, reasons)
    accumulation = accumulation_steps(cfg.train.global_batch_size, micro, world)
    if user is not None:
        # Every explicit value against the run's, and DeepSpeed's verdict on the filled config, before anything
        # loads; pin_memory is decided with the model (engines.build) and does not change the verdict. Then the
        # batch keys are opened, so the OOM ladder may halve the micro-batch (the global batch stays).
        user_ds_config.resolve(user, user_ds_config.run_values(cfg, avail.precision, micro, accumulation, world,
                                                               plan.model["hidden_size"], False, cfg.train.lr))
        user, ladder = user.with_batch_auto(), ()  # a custom profile never moves to a catalogue one
    else:
        # The OOM ladder may move to any profile of this precision and engine that can run, offload included.
        ladder = tuple(p for p in avail.widened(replace(cfg, profile=AUTO), chosen.precision).usable(allow_offload=True)
                       if not availability.rank_problem(p, world))
    row = plan.get(chosen.name) if plan is not None else None
    chosen = _with_buckets(chosen, row)
    ckpt, every, chunked, offload = _planned_setting(cfg, row, micro, reasons)
    return RunSpec(avail.device, avail.precision, chosen, micro, accumulation, world, ckpt, every if ckpt else 1,
                   tuple(reasons), plan, tuple(ladder), user, chunked, offload)


def _plan_asked(cfg: Config, hw: Hardware, avail: availability.Availability, world: int, machine: Machine | None,
                reasons: list[str]) -> tuple[Plan, Profile]:
    """The plan of the one profile asked (``profile=NAME``, or a deepspeed_config's custom row) and the profile,
    refused where its engine cannot run here or its host memory does not fit; what it decided added to
    ``reasons``."""
    user = avail.user
    chosen = user.profile if user is not None else PROFILES[cfg.profile]
    problem = avail.problems.get(chosen.name) or availability.rank_problem(chosen, world)
    if problem:
        alt = avail.widened(replace(cfg, profile=AUTO, engine=AUTO), chosen.precision).usable()
        fix = f"profile={alt[0].name}" if alt else "profile=auto"
        raise ConfigError([f"profile: got {cfg.profile!r}; rule: its engine must be usable here, but {problem}; "
                           f"fix: {fix}" + (" or pip install 'vramfit[deepspeed]'" if "not installed" in problem
                                            else "")])
    plan = planner.plan(cfg, hw, [chosen.name], world=world, machine=machine, avail=avail)
    if user is not None:
        reasons.append(f"profile {chosen.name} from deepspeed_config {cfg.deepspeed_config}")
        reasons += list(user.notices)
    else:
        reasons.append(f"profile {chosen.name} as asked")
    row = plan.get(chosen.name)
    if row is not None and not row.fits:
        if row.cpu_bytes > plan.budget["cpu_bytes"]:  # a host OOM kill loses the run: refuse before loading
            advice.add_suggestions(plan, cfg, hw, [chosen.name], world, machine)
            raise ConfigError([f"memory: profile {chosen.name} needs {gib(row.cpu_bytes)} of CPU RAM, the "
                               f"budget is {gib(plan.budget['cpu_bytes'])} ({plan.budget['cpu_source']}); "
                               "rule: planned host memory must fit, or the kernel kills the run; fix: "
                               + ("; ".join(plan.suggestions) if plan.suggestions else
                                  "a profile that offloads less, LoRA (lora.r=16), or memory.cpu_budget=GiB "
                                  "if RAM will be free")], "memory plan")
        reasons.append(f"warning: the plan puts {chosen.name} over the GPU budget ({row.why_not}); the OOM ladder "
                       "will step in if it runs out")
    return plan, chosen


def _plan_searched(cfg: Config, hw: Hardware, avail: availability.Availability, world: int,
                   machine: Machine | None, reasons: list[str]) -> tuple[Plan, Profile]:
    """The plan of every profile that can run here and the one it chose, refused when none fits; why it was chosen
    added to ``reasons``."""
    order = [p for p in avail.usable() if not availability.rank_problem(p, world)]
    if not order:
        raise availability.engine_error(cfg, avail)
    plan = planner.plan(cfg, hw, [p.name for p in order], world=world, machine=machine, avail=avail)
    if plan.chosen is None:
        advice.add_suggestions(plan, cfg, hw, [p.name for p in order], world, machine)
        tips = "; ".join(plan.suggestions) or "a smaller model or more memory"
        raise ConfigError([f"memory: no profile fits; {plan.reason}; fix: {tips}"], "memory plan")
    chosen = PROFILES[plan.chosen]
    reasons.append(f"profile {plan.chosen}: {plan.reason}")
    why_engine = avail.engine_reason(chosen) if cfg.engine == AUTO else None
    if why_engine:
        reasons.append(why_engine)
    return plan, chosen


def _plan_warnings(plan: Plan | None, user, reasons: list[str]) -> None:
    """What the plan's numbers are worth, added to ``reasons``: step times not priced, activations counted."""
    if plan is not None and plan.machine is None and user is None:
        reasons.append("step times not priced: this machine has no calibration, so the catalogue's speed ranks chose ("
                       + "torch's AMP first on a tie"
                       + "); `vramfit doctor --calibrate` measures it (about a minute, once)")
    if plan is not None and plan.activations_counted:
        reasons.append(f"warning: the plan is an estimate: {plan.activations_counted}; activations counted from the "
                       "config's sizes, weights and optimizer states exact (the OOM ladder steps in if it is short)")


def _micro_batch(cfg: Config, user, plan: Plan | None, reasons: list[str]) -> int:
    """The micro-batch: as asked, else a deepspeed_config's, else the planner's; where it came from added to
    ``reasons``."""
    micro = cfg.train.micro_batch_size
    if micro == AUTO and user is not None and user.micro_batch:
        micro = user.micro_batch
        reasons.append(f"micro-batch {micro} from deepspeed_config")
    elif micro == AUTO:
        micro = plan.micro_batch or 1
        reasons.append(f"micro-batch {micro} from the planner")
    return micro


def _planned_setting(cfg: Config, row, micro: int, reasons: list[str]) -> tuple[bool, int, bool, bool]:
    """(checkpointing, every k-th layer, chunked loss, activation offload): the planner's setting where the run has
    its micro-batch, else as asked; what the planner decided added to ``reasons``."""
    if row is not None and row.micro_batch == micro:  # the setting the planner chose (auto checkpointing included)
        ckpt, every = row.checkpointing, row.checkpoint_every
        chunked, offload = row.chunked_loss, row.offload_activations
    else:
        ckpt, every = cfg.model.gradient_checkpointing is True, int(cfg.model.checkpoint_every)
        chunked, offload = cfg.loss.chunked == "on", cfg.memory.offload_activations == "on"
    if cfg.loss.chunked == AUTO:
        reasons.append(f"loss {'chunked' if chunked else 'not chunked'} from the planner"
                       + ("" if chunked else f" (the logits stay under {CHUNK_SHARE:.0%} of the budget)"))
    if cfg.memory.offload_activations == AUTO and offload:
        reasons.append("activations offloaded to CPU memory: the planner found nothing faster that fits")
    if cfg.model.gradient_checkpointing == AUTO:
        reasons.append(f"gradient checkpointing {'on' if ckpt else 'off'}"
                       + (f" (every {every} layers)" if ckpt and every > 1 else "") + " from the planner")
    return ckpt, every, chunked, offload


def _with_buckets(p: Profile, row) -> Profile:
    """``p`` with the gradient bucket its plan row chose (DeepSpeed on one rank), so the engine gets it."""
    size = getattr(row, "reduce_bucket_size", None)
    return replace(p, reduce_bucket_size=size) if size and p.is_deepspeed and p.reduce_bucket_size is None else p
