"""The search over one profile's settings (micro-batch x checkpointing x activation offload): the fastest that
fits, found by planning few of them (:func:`launcher.plan.setting.plan_profile` each), and every fitting setting
tried."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from launcher.config.profiles import Profile
from launcher.config.schema import AUTO, Config
from launcher.machine.speeds import Machine
from launcher.plan.memory.states import RunShape
from launcher.plan.rows import ProfilePlan
from launcher.plan.setting import plan_profile


def micro_batch_candidates(run: RunShape, asked) -> list[int]:
    if asked != AUTO:
        return [int(asked)]
    per_rank = max(1, run.global_batch // run.world)
    out, b = [], 1
    while b <= per_rank:
        if per_rank % b == 0:
            out.append(b)
        b *= 2
    return sorted(out, reverse=True)


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


def _options(cfg: Config, run: RunShape) -> list[tuple[bool, int, bool]]:
    """(checkpointing, every k-th layer, activation offload) settings to try, least recompute first."""
    options = [(ck, k, run.offload_mode == "on") for ck, k in checkpoint_options(cfg, run.counts.num_layers)]
    if run.offload_mode == AUTO and run.device == "cuda":
        options.append((*options[-1][:2], True))  # the least GPU memory: offload on top of the most recompute
    return options


def _setting_of(r: ProfilePlan) -> tuple:
    """A row's (checkpointing, every k-th layer, activation offload), as :func:`_options` lists them."""
    return (r.checkpointing, r.checkpoint_every if r.checkpointing else 1, r.offload_activations)


def best_setting(p: Profile, run: RunShape, cfg: Config, asked, gpu_budget: int, cpu_budget: int,
                 blocked: str | None, machine: Machine | None, pinned: bool,
                 exact: bool = True) -> tuple[ProfilePlan, list]:
    """The fastest setting of profile ``p`` that fits (micro-batch x checkpointing), and every fitting setting
    tried. A profile that cannot run is shown at its first setting.

    Memory falls with checkpointing and rises with the micro-batch, so per micro-batch (largest first) the
    setting with the least recompute that fits is the only candidate worth pricing, found by planning few of
    them (:func:`_lowest`: the most recompute, which if it does not fit means nothing does at this micro-batch,
    then none, then halving between the two). Smaller micro-batches are tried while their least-recompute setting
    still recomputes less; without machine speeds the least recompute wins, at the largest micro-batch that
    allows it (as before checkpointing was searched: checkpointing costs about a third of a step).

    Activation offload (``memory.offload_activations``): ``on`` offloads in every setting; ``auto`` adds one
    setting after the one with the most recompute, the same with what it saves offloaded (the least GPU
    memory, and copies over PCIe that cost more than checkpointing's recompute), where there is a GPU to
    offload from.

    ``exact=False``: the row is the best candidate as the search priced it (micro-batches above 3 extrapolated,
    see :func:`launcher.plan.memory.estimate.trace_at`), with the candidates fastest first for :func:`settle`."""
    options = _options(cfg, run)
    micros = micro_batch_candidates(run, asked)
    kw = dict(machine=machine, pinned=pinned, max_steps=cfg.train.max_steps)

    def at(ck: tuple, b: int, exact: bool = False) -> ProfilePlan:
        shape = dataclasses.replace(run, checkpointing=ck[0], checkpoint_every=ck[1], offload_activations=ck[2])
        return plan_profile(p, shape, b, gpu_budget, cpu_budget, exact=exact, **kw)

    if blocked:
        row = at(options[0], micros[0], exact=True)
        row.available = False
        row.why_not = blocked if row.why_not is None else f"{blocked}; {row.why_not}"
        return row, []
    first, fitting, least = None, [], len(options)
    for b in micros:
        if least == 0:
            break  # no recompute at a larger micro-batch: smaller ones are not faster
        rank, row = _lowest(at, options, b, least)
        first = first or row
        if rank is not None:
            fitting.append(row)
            least = rank
    if not fitting:
        return at(_setting_of(first), first.micro_batch, exact=exact), []
    # Priced: the fastest. Not priced: the least recompute, at the largest micro-batch that allows it. The
    # setting kept is planned again from exact traces; should it no longer fit, the next one is.
    ranked = sorted(fitting, key=lambda r: r.step_s) if machine is not None else fitting[::-1]
    if not exact:
        return ranked[0], ranked
    best, r = settle(p, run, ranked, gpu_budget, cpu_budget, **kw)
    return best, ([best if c is r else c for c in fitting] if best.fits else [])


def _lowest(at: Callable[[tuple, int], ProfilePlan], options: list[tuple], b: int,
            upto: int) -> tuple[int | None, ProfilePlan]:
    """The least recompute of ``options[:upto]`` that fits at micro-batch ``b`` (each planned by ``at``), and its
    row (None, and the row of the most recompute, when none fits)."""
    # Memory falls along the options: the most recompute first (if that does not fit, nothing does), then none,
    # then halving in between (every 2nd layer before every 4th, whose traces are twice as deep, and every 4th
    # only where every 2nd fits).
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


def settle(p: Profile, run: RunShape, ranked: list[ProfilePlan], gpu_budget: int, cpu_budget: int,
           **kw) -> tuple[ProfilePlan, ProfilePlan]:
    """The first of ``ranked`` (one profile's candidates, best first) that still fits when planned from exact
    traces, and the candidate it was; the last one tried when none does. The planner's search sizes
    candidates from extrapolated traces; only what it keeps is traced exactly."""
    for r in ranked:
        shape = dataclasses.replace(run, checkpointing=r.checkpointing, checkpoint_every=r.checkpoint_every,
                                    offload_activations=r.offload_activations)
        best = plan_profile(p, shape, r.micro_batch, gpu_budget, cpu_budget, exact=True, **kw)
        if best.fits:
            return best, r
    return best, r
