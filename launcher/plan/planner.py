"""The memory plan: for every profile, the GPU and CPU peak of one training run, by named part, and the
choice of the fastest profile that fits.

Pure: no GPU, no weights, no printing, no environment (the hardware comes in as data). The model's shape
comes from its config on the meta device (:mod:`launcher.plan.memory.shape`, :mod:`launcher.plan.runshape`), its
activations from a traced forward + backward (:mod:`launcher.plan.run_activations`), the model states from the
arithmetic of :mod:`launcher.plan.memory.states`, and what can run here from :mod:`launcher.plan.availability`.
One profile at one setting is planned by :mod:`launcher.plan.setting`, its settings searched by
:mod:`launcher.plan.search` (DeepSpeed's buckets sized by :mod:`launcher.plan.buckets`); this module plans every
profile and chooses (:mod:`launcher.plan.rows` ranks the rows, :mod:`launcher.plan.reasons` says why).
"""

from __future__ import annotations

import time

from launcher.config import user_ds_config
from launcher.config.profiles import PROFILES
from launcher.config.schema import AUTO, Config, ConfigError
from launcher.machine.hardware import Hardware
from launcher.machine.speeds import Machine
from launcher.plan import availability, reasons
from launcher.plan.availability import Availability
from launcher.plan.buckets import grow_buckets, smallest_buckets
from launcher.plan.families import family_of
from launcher.plan.memory.states import (
    ALLOCATOR_SLACK,
    AMP_OPTIMIZER_WORKSPACE,
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    QUANT_BYTES_PER_PARAM,
    RunShape,
)
from launcher.plan.rows import Plan, ProfilePlan, rank_key, simplest_within_error
from launcher.plan.run_activations import activations
from launcher.plan.runshape import make_shape
from launcher.plan.search import best_setting, settle
from launcher.units import GiB, gib


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
    gpu_budget, cpu_budget, sources = _rank_budgets(cfg, hw, run)
    names, asked = _profile_names(cfg, avail, profiles)
    # pinning allowed here (a CUDA host); each setting pins where what it pins fits the host's budget (plan_profile),
    # and the engine checks `ulimit -l` against the bytes (launcher.engines.engine_pinning)
    pinned = run.device == "cuda" and hw.has_cuda
    searched = _search(names, avail, run, cfg, asked, gpu_budget, cpu_budget, world, machine, pinned, exact_rows)
    rows = [row for row, _ in searched]
    if avail.user is not None:  # its explicit batch sizes, clipping and optimizer params against the run's
        r = rows[0]
        user_ds_config.resolve(avail.user, user_ds_config.run_values(cfg, avail.precision, r.micro_batch,
                                                                     r.accumulation, run.world, run.hidden, False,
                                                                     cfg.train.lr))
    pool = [r for r in rows if r.available]
    chosen, tie, every = _choose(pool, searched, avail, machine)
    reason = reasons.reason(chosen, pool, rows, cfg, gpu_budget, cpu_budget, run) + (f"; {tie}" if tie else "")
    if chosen is not None and cfg.task == "dpo":
        reason += "; " + reasons.reference_line(cfg, chosen)
    out = Plan(profiles=rows, chosen=chosen.profile if chosen else None, reason=reason,
               budget={"gpu_bytes": gpu_budget, "cpu_bytes": cpu_budget, "gpu_source": sources["gpu"],
                       "cpu_source": sources["cpu"]},
               model=_model_summary(cfg, run), settings=_settings(cfg, run, avail.precision_reason),
               assumptions=_assumptions(run, machine), activations=_activation_summary(run, rows, avail, exact_rows),
               machine=reasons.machine_line(machine) if machine is not None else None,
               candidates=[{"profile": c.profile, "setting": c.setting, "micro_batch": c.micro_batch,
                            "checkpointing": c.checkpointing, "checkpoint_every": c.checkpoint_every,
                            "step_s": c.step_s, "tokens_per_s": c.tokens_per_s} for c in every])
    out.runner_up = reasons.runner_up(chosen, every, machine)
    out.seconds = time.perf_counter() - t0
    return out


def _rank_budgets(cfg: Config, hw: Hardware, run: RunShape) -> tuple[int, int, dict]:
    """:func:`budgets` for one rank of ``run``."""
    gpu_budget, cpu_budget, sources = budgets(cfg, hw, run.device)
    if run.ranks_per_node > 1:  # the ranks of one machine share its RAM
        cpu_budget //= run.ranks_per_node
        sources["cpu"] += f", shared by {run.ranks_per_node} ranks: {gib(cpu_budget)} each"
    return gpu_budget, cpu_budget, sources


def _profile_names(cfg: Config, avail: Availability, profiles: list[str] | None) -> tuple[list[str], object]:
    """The profiles to plan (``profiles``, else every profile of the run's precision; the asked one first where it
    is not among them) and the micro-batch asked; a deepspeed_config's custom row alone, with its micro-batch."""
    names = (list(profiles) if profiles is not None else
             [n for n, p in PROFILES.items() if p.precision == avail.precision])
    if cfg.profile != AUTO and cfg.profile not in names:
        names.insert(0, cfg.profile)
    asked = cfg.train.micro_batch_size
    if avail.user is not None:  # the run is the JSON's custom row and nothing else
        names = [avail.user.profile.name]
        if asked == AUTO and avail.user.micro_batch:
            asked = avail.user.micro_batch
    return names, asked


def _search(names: list[str], avail: Availability, run: RunShape, cfg: Config, asked, gpu_budget: int,
            cpu_budget: int, world: int, machine: Machine | None, pinned: bool, exact_rows: bool) -> list:
    """(row, candidates fastest first) per profile of ``names``: its best setting (:func:`best_setting`, a profile
    that cannot run here at its first setting, with why), its buckets grown; with ``exact_rows=False`` the row that
    wins planned again from exact traces (:func:`_settle_chosen`)."""
    searched = []
    for n in names:
        p = avail.profile(n)
        row, cands = best_setting(smallest_buckets(p, run), run, cfg, asked, gpu_budget, cpu_budget,
                                  avail.why_not(n) or availability.rank_problem(p, world), machine, pinned,
                                  exact=exact_rows)
        searched.append((grow_buckets(p, run, row, gpu_budget, cpu_budget, machine, pinned, cfg.train.max_steps,
                                      exact=exact_rows), cands))
    if not exact_rows:
        searched = _settle_chosen(searched, avail, run, gpu_budget, cpu_budget, machine, pinned, cfg.train.max_steps)
    return searched


def _choose(pool: list[ProfilePlan], searched: list, avail: Availability,
            machine: Machine | None) -> tuple[ProfilePlan | None, str | None, list[ProfilePlan]]:
    """The row chosen of ``pool`` (the rows that can run here): the best that fits (:func:`rank_key`), priced the
    simplest within the model's error (:func:`simplest_within_error`, and why); and every fitting setting of
    ``searched``, best first."""
    fitting = sorted((r for r in pool if r.fits), key=lambda r: rank_key(r, avail, machine))
    chosen = fitting[0] if fitting else None
    tie = None
    if chosen is not None and machine is not None and chosen.step_s is not None:
        chosen, tie = simplest_within_error(fitting, avail)
    every = sorted((c for row, cands in searched if row.available for c in cands),
                   key=lambda r: rank_key(r, avail, machine))
    return chosen, tie, every


def _settle_chosen(searched: list, avail: Availability, run: RunShape, gpu_budget: int, cpu_budget: int,
                   machine: Machine | None, pinned: bool, max_steps: int) -> list:
    """``searched`` (row, candidates fastest first) per profile, as :func:`best_setting` leaves them with
    ``exact=False``, with the row that wins planned again from exact traces; should it no longer fit, that
    profile's next candidate, then the next profile's."""
    kw = dict(machine=machine, pinned=pinned, max_steps=max_steps)
    out = list(searched)
    for i in sorted((i for i, (r, _) in enumerate(searched) if r.available and r.fits),
                    key=lambda i: rank_key(searched[i][0], avail, machine)):
        row, cands = searched[i]
        p = avail.profile(row.profile)
        best, _ = settle(smallest_buckets(p, run), run, cands, gpu_budget, cpu_budget, **kw)
        best = grow_buckets(p, run, best, gpu_budget, cpu_budget, exact=True, **kw)
        out[i] = (best, cands if best.fits else [])
        if best.fits:
            break
    return out


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
        p = avail.profile(r.profile)
        fam = family_of(p).trace_family(p)
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
