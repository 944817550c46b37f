"""The front door: one configuration to one :class:`Decision`, the same for ``vramfit plan``, ``train``, ``tune`` and
``bench``.

Each entrance brings what is its own (the machine's speeds: cached for a training start, measured first for ``tune``;
a card of the catalogue for ``plan --gpu``) and calls :func:`decide`, which does the rest in one order: the data
formats settled from one record (strict for a run on this machine; a plan may be made for another machine's files,
which are then planned as text), ``memory.nvme_path`` measured, the speeds rechecked against the machine as it is now
(one rank: other ranks would read each other as a busy neighbour), then the plan, and for a run its
:class:`~launcher.plan.resolve.RunSpec`. What the caller should say (a doubtful calibration, a busy machine, data
not read) comes back as notes: this package does not log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config.schema import Config, ConfigError
from launcher.data.sources import settle_formats
from launcher.machine import recheck
from launcher.machine.hardware import Hardware, with_nvme
from launcher.machine.speeds import Machine
from launcher.plan import advice, gpus, planner
from launcher.plan.resolve import RunSpec, resolve
from launcher.plan.rows import Plan


@dataclass(frozen=True)
class Decision:
    cfg: Config  # as settled: every data format read from its records
    hw: Hardware  # memory.nvme_path measured; a card of the catalogue in place of this machine's GPU
    machine: Machine | None  # the speeds that priced the plan, rechecked (a card's: its data sheet over this host)
    plan: Plan | None = field(compare=False)
    spec: RunSpec | None = field(compare=False)  # the run decided (None for a plan only)
    notes: tuple[str, ...] = ()  # for the caller to log, in order

    @property
    def key(self) -> dict:
        """What every entrance must agree on for the same configuration (the test of the four entrances)."""
        return {"cfg": self.cfg, "nvme": self.hw.nvme, "gpus": [g.name for g in self.hw.gpus],
                "machine": None if self.machine is None else self.machine.name,
                "doubtful": None if self.machine is None else self.machine.doubtful,
                "chosen": None if self.plan is None else self.plan.chosen}


def settled(cfg: Config, *, strict: bool = True) -> tuple[Config, str | None]:
    """``cfg`` with its data formats read from one record each (the planner then knows whether samples are packed),
    and a note when ``strict`` is off and the data cannot be read here (planned as text batches)."""
    try:
        return settle_formats(cfg), None
    except ConfigError as e:
        if strict:
            raise
        return cfg, (f"data not read here ({e.problems[0]}); planned as text batches: set data.format to plan "
                     "instruction batches")


def checked(machine: Machine | None, world: int = 1) -> tuple[Machine | None, list[str]]:
    """``machine`` rechecked against this machine as it is now (on one rank: several ranks starting together would
    each read the others as a busy neighbour), and what the check found, as notes."""
    if world == 1:
        machine = recheck.checked(machine)
    notes = []
    if machine is not None and machine.doubtful:
        notes.append(f"the calibration that prices this plan is doubtful: {machine.doubtful}; its step times are a "
                     "busy machine's; fix: `vramfit doctor --calibrate` when the machine is idle")
    if machine is not None and machine.busy_now:
        notes.append(f"the machine is busy: {machine.busy_now}")
    return machine, notes


def decide(cfg: Config, *, hw: Hardware, machine: Machine | None, world: int = 1, local_rank: int = 0,
           card: gpus.GPUSpec | None = None, run: bool = True, profiles: list[str] | None = None,
           alternatives: bool = False, advise: bool = True, nodes: int = 1, links: dict | None = None,
           lenient_data: bool = False) -> Decision:
    """The decision for ``cfg`` (see the module's docstring).

    ``machine``: this machine's speeds (None: unpriced); with ``card``, the host the card's speeds are built over.
    ``run``: a run on this machine (the :class:`RunSpec`, which refuses what cannot run); else a plan only, of
    ``profiles`` (default: every profile of the precision), with its alternatives filled in (also when something
    fits, with ``alternatives``; none with ``advise`` off). ``lenient_data``: data that cannot be read here is planned as text (``vramfit
    plan``, which may plan for another machine's files; a card of the catalogue is always another machine)."""
    cfg, data_note = settled(cfg, strict=not lenient_data and card is None)
    notes = [data_note] if data_note else []
    hw = with_nvme(hw, cfg.memory.nvme_path)
    machine, more = checked(machine, 1 if card is not None else world)  # a card's ranks are not started here
    notes += more
    host = None
    if card is not None:  # a card that is not here: its data sheet, this machine as its host
        host, machine, hw = machine, gpus.machine(card, machine), gpus.hardware(card, hw)
    if run:
        spec = resolve(cfg, hw, world, local_rank, machine=machine)
        return Decision(cfg, hw, machine, spec.plan, spec, tuple(notes))
    plan = planner.plan(cfg, hw, profiles, world=world, machine=machine, nodes=nodes, links=links)
    if advise:
        plan = advice.add_suggestions(plan, cfg, hw, profiles, world=world, machine=machine, card=card, host=host,
                                      when_fits=alternatives, nodes=nodes, links=links)
    return Decision(cfg, hw, machine, plan, None, tuple(notes))
