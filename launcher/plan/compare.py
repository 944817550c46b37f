"""Which GPU to rent for a job: the same plan for every card of the catalogue, with hours and cost.

``vramfit plan --compare-gpus [--gpus 1,2,4] [--price T4=0.35,L4=0.80,...]``: for each GPU of :mod:`launcher.plan.gpus`
(and each count of cards), the plan
of this config on that card (its memory, its precision, its data-sheet speeds; the host's CPU, RAM budget,
optimizers and engine costs from this machine's calibration) and the fastest setting that fits, its
predicted tokens/s, the hours of the whole run (``train.max_steps`` steps) and, with a price per hour, its
cost. Pure: the host calibration comes in as data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.config.schema import Config, ConfigError
from launcher.machine.hardware import Hardware
from launcher.machine.speeds import Machine
from launcher.plan import gpus, planner
from launcher.plan.rows import Plan


@dataclass
class GpuRow:
    gpu: str
    count: int  # cards per machine
    nodes: int  # machines
    memory_gib: float
    precision: str | None
    fits: bool
    profile: str | None
    setting: str | None
    step_s: float | None
    tokens_per_s: float | None
    hours: float | None
    price_per_hour: float | None
    cost: float | None
    why_not: str | None
    note: str = ""  # e.g. more cards that are slower or dearer than one
    host_gib: float | None = None  # host RAM the machine's ranks need together (each rank's planned peak x cards)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse_prices(text: str | None) -> dict[str, float]:
    """``T4=0.35,L4=0.80`` -> {catalogue name: USD per hour}; every problem at once, as a ConfigError."""
    if not text:
        return {}
    out, problems = {}, []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, value = item.partition("=")
        if not sep:
            problems.append(f"--price: got {item!r}; rule: NAME=USD_PER_HOUR items separated by commas; fix: "
                            f"--price {name or 'T4'}=0.35")
            continue
        try:
            spec = gpus.find(name, flag="--price", value=value)
        except ConfigError as e:
            problems += e.problems
            continue
        try:
            price = float(value)
        except ValueError:
            problems.append(f"--price: got {value!r} for {name}; rule: a number of dollars per hour; fix: "
                            f"--price {name}=0.35")
            continue
        if not math.isfinite(price) or price < 0:
            problems.append(f"--price: got {value} for {name}; rule: a price is zero or more, and finite; fix: "
                            f"--price {name}=0.35")
            continue
        out[spec.name] = price
    if problems:
        raise ConfigError(problems, "command line")
    return out


def parse_counts(text: str | int | None) -> list[int]:
    """``--gpus``: ``2`` or ``1,2,4`` -> [1, 2, 4]; a bad value is a ConfigError."""
    if text is None or text == "":
        return [1]
    out = []
    for item in str(text).split(","):
        try:
            n = int(item)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError([f"--gpus: got {item!r}; rule: whole numbers of cards per machine, 1 or more, separated "
                               "by commas; fix: --gpus 2 (or --gpus 1,2,4 with --compare-gpus)"], "command line")
        out.append(n)
    return sorted(set(out))


def check_counts(cfg: Config, counts: list[int], nodes: int) -> None:
    """Every count of cards x ``nodes`` must split the global batch: refused with the numbers before planning."""
    if nodes < 1:
        raise ConfigError([f"--nodes: got {nodes}; rule: 1 or more machines; fix: --nodes 1"], "command line")
    bad = [n for n in counts if cfg.train.global_batch_size % (n * nodes)]
    if bad:
        ok = [n for n in (1, 2, 4, 8) if cfg.train.global_batch_size % (n * nodes) == 0]
        raise ConfigError([f"--gpus: got {','.join(map(str, bad))} with --nodes {nodes}; rule: "
                           f"train.global_batch_size={cfg.train.global_batch_size} must split evenly over the "
                           f"{'/'.join(str(n * nodes) for n in bad)} ranks; fix: --gpus "
                           f"{','.join(map(str, ok)) or 1}, or a train.global_batch_size divisible by them"],
                          "command line")


def plan_on(cfg: Config, spec: gpus.GPUSpec, host_hw: Hardware, host: Machine, count: int = 1, nodes: int = 1,
            network_gbps: float = gpus.DEFAULT_NETWORK_GBPS, ram_gib: float | None = None,
            exact_rows: bool = True) -> Plan:
    """The plan of ``cfg`` on ``count`` x ``spec`` per machine, ``nodes`` machines like this host."""
    return planner.plan(cfg, gpus.hardware(spec, host_hw, ram_gib), world=count * nodes,
                        machine=gpus.machine(spec, host), exact_rows=exact_rows, nodes=nodes,
                        links=gpus.links(spec, network_gbps))


def compare(cfg: Config, host_hw: Hardware, host: Machine, prices: dict[str, float] | None = None,
            ram_gib: float | None = None, world: int = 1, counts: list[int] | None = None, nodes: int = 1,
            network_gbps: float = gpus.DEFAULT_NETWORK_GBPS) -> list[GpuRow]:
    """One row per catalogue GPU and count of cards, fastest first (those where nothing fits last). A price is per
    card-hour; a row of several cards costs them all. ``world`` (the launcher's ranks) is used when no ``counts``
    are given."""
    prices = prices or {}
    rows = []
    for name in gpus.names():
        spec = gpus.find(name)
        mine = []
        for count in (counts or [world]):
            p = plan_on(cfg, spec, host_hw, host, count, nodes, network_gbps, ram_gib,
                        exact_rows=False)  # only each GPU's chosen row from exact traces
            c = p.chosen_plan
            price = prices.get(spec.name)
            hours = c.step_s * cfg.train.max_steps / 3600 if c is not None and c.step_s else None
            cards = count * nodes
            mine.append(GpuRow(gpu=spec.name, count=count, nodes=nodes, memory_gib=spec.memory_bytes / 2**30,
                               precision=p.settings.get("precision"), fits=c is not None,
                               profile=c.profile if c else None, setting=c.setting if c else None,
                               step_s=c.step_s if c else None, tokens_per_s=c.tokens_per_s if c else None, hours=hours,
                               price_per_hour=price * cards if price is not None else None,
                               cost=price * cards * hours if price is not None and hours is not None else None,
                               why_not=None if c else p.reason,
                               host_gib=c.cpu_bytes * count / 2**30 if c is not None else None))
        fewest = next((r for r in mine if r.fits), None)
        for r in mine:
            if r is fewest or not r.fits or fewest is None:
                continue
            if r.tokens_per_s <= fewest.tokens_per_s:
                r.note = f"slower than {fewest.count} card{'s' * (fewest.count > 1)}"
            elif r.cost is not None and fewest.cost is not None and r.cost > fewest.cost:
                r.note = f"{r.cost / fewest.cost:.2f}x the cost of {fewest.count}"
        rows += mine
    return sorted(rows, key=lambda r: (not r.fits, r.step_s or 0.0))


def table(rows: list[GpuRow], max_steps: int) -> str:
    several = any(r.count * r.nodes > 1 for r in rows)
    head = ["GPU"] + (["cards"] if several else []) + ["GiB", "host GiB", "fits", "setup", "tokens/s",
                                                       f"hours ({max_steps} steps)", "USD/h", "cost USD"]
    if any(r.note for r in rows):
        head.append("note")
    body = []
    for r in rows:
        cards = [f"{r.count}" + (f" x {r.nodes} nodes" if r.nodes > 1 else "")] if several else []
        line = [r.gpu, *cards, f"{r.memory_gib:.1f}", f"{r.host_gib:.1f}" if r.host_gib is not None else "-",
                "yes" if r.fits else "no",
                f"{r.profile}, {r.precision}, {r.setting}" if r.fits else (r.why_not or "")[:90],
                f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-", f"{r.hours:.2f}" if r.hours else "-",
                "-" if r.price_per_hour is None else f"{r.price_per_hour:.2f}",
                "-" if r.cost is None else f"{r.cost:.2f}"]
        body.append(line + ([r.note] if "note" in head else []))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
