"""Which GPU to rent for a job: the same plan for every card of the catalogue, with hours and cost.

``vramfit plan --compare-gpus [--price T4=0.35,L4=0.80,...]``: for each GPU of :mod:`launcher.plan.gpus`, the plan
of this config on that card (its memory, its precision, its data-sheet speeds; the host's CPU, RAM budget,
optimizers and engine costs from this machine's calibration) and the fastest setting that fits, its
predicted tokens/s, the hours of the whole run (``train.max_steps`` steps) and, with a price per hour, its
cost. Pure: the host calibration comes in as data.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.schema import Config, ConfigError
from launcher.machine.hardware import Hardware
from launcher.machine.speeds import Machine
from launcher.plan import gpus, planner


@dataclass
class GpuRow:
    gpu: str
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
        if price < 0 or price != price:
            problems.append(f"--price: got {value} for {name}; rule: a price is zero or more; fix: --price {name}=0.35")
            continue
        out[spec.name] = price
    if problems:
        raise ConfigError(problems, "command line")
    return out


def compare(cfg: Config, host_hw: Hardware, host: Machine, prices: dict[str, float] | None = None,
            ram_gib: float | None = None, world: int = 1) -> list[GpuRow]:
    """One row per catalogue GPU, fastest first (those where nothing fits last)."""
    prices = prices or {}
    rows = []
    for name in gpus.names():
        spec = gpus.find(name)
        p = planner.plan(cfg, gpus.hardware(spec, host_hw, ram_gib), world=world, machine=gpus.machine(spec, host),
                         exact_rows=False)  # only each GPU's chosen row from exact traces
        c = p.chosen_plan
        price = prices.get(spec.name)
        hours = c.step_s * cfg.train.max_steps / 3600 if c is not None and c.step_s else None
        rows.append(GpuRow(gpu=spec.name, memory_gib=spec.memory_bytes / 2**30, precision=p.settings.get("precision"),
                           fits=c is not None, profile=c.profile if c else None, setting=c.setting if c else None,
                           step_s=c.step_s if c else None, tokens_per_s=c.tokens_per_s if c else None, hours=hours,
                           price_per_hour=price, cost=price * hours if price is not None and hours is not None else None,
                           why_not=None if c else p.reason))
    return sorted(rows, key=lambda r: (not r.fits, r.step_s or 0.0))


def table(rows: list[GpuRow], max_steps: int) -> str:
    head = ["GPU", "GiB", "fits", "setup", "tokens/s", f"hours ({max_steps} steps)", "USD/h", "cost USD"]
    body = []
    for r in rows:
        body.append([r.gpu, f"{r.memory_gib:.1f}", "yes" if r.fits else "no",
                     f"{r.profile}, {r.precision}, {r.setting}" if r.fits else (r.why_not or "")[:90],
                     f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-", f"{r.hours:.2f}" if r.hours else "-",
                     "-" if r.price_per_hour is None else f"{r.price_per_hour:.2f}",
                     "-" if r.cost is None else f"{r.cost:.2f}"])
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
