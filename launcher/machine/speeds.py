"""This machine's speeds, as the step-time model reads them (:class:`Machine`, one :class:`Rates` per device),
and the cache they are kept in: one JSON per machine key (device name, driver and CUDA versions, CPU model,
threads, torch and DeepSpeed versions) under :func:`launcher.paths.cache_root` (``~/.cache/vramfit`` by default),
written atomically. ``vramfit doctor --calibrate`` measures them (:mod:`launcher.measure.calibrate`); a training
start only reads them (:func:`cached`), so nothing here measures anything. A stale, corrupt, truncated or
mismatched file is said so and not used.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from launcher.machine.deepspeed_ops import deepspeed_status
from launcher.machine.files import write_atomic
from launcher.paths import cache_root

FORMAT = 2  # of the cache file; another value is measured again


@dataclass(frozen=True)
class Rates:
    """One device's speeds. ``matmul``: per dtype, (FLOPs of one matmul, FLOP/s reached), ascending in
    FLOPs (small matmuls reach less of the peak; between points the rate is interpolated log-log)."""

    device: str  # 'cpu' | 'cuda'
    matmul: dict = field(default_factory=dict)  # dtype name -> [[flops, flop_per_s], ...]
    attention: dict = field(default_factory=dict)  # dtype name -> flop/s of the fused attention kernel
    memory_bytes_per_s: float = 1e10  # elementwise: bytes read + written per second
    op_s: float = 0.0  # fixed cost of one kernel op inside a training step
    view_s: float = 0.0  # fixed cost of one view op (no kernel)
    # Measured inside training steps (a CPU, launcher.measure.stepcal), per precision of the step: {'op_s': fixed cost
    # of a kernel op, 'bytes_per_s': elementwise rate, 'micro_s': what a forward + backward pays once}; where
    # present they replace op_s and memory_bytes_per_s.
    step_costs: dict = field(default_factory=dict)

    def matmul_rate(self, dtype: str, flops: float) -> float:
        curve = self.matmul.get(dtype) or self.matmul.get("float32") or [[1.0, 1e11]]
        xs = [c[0] for c in curve]
        i = bisect.bisect_left(xs, flops)
        if i == 0:
            return curve[0][1]
        if i == len(curve):
            return curve[-1][1]
        (f0, r0), (f1, r1) = curve[i - 1], curve[i]
        t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
        return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))

    def attention_rate(self, dtype: str) -> float:
        if dtype in self.attention:
            return self.attention[dtype]
        return self.matmul_rate(dtype, float("inf"))


@dataclass(frozen=True)
class Machine:
    """The speeds the step-time model needs, for the machine that trains (or the GPU one would rent)."""

    name: str  # e.g. 'cpu: AMD EPYC (2 threads)' or 'NVIDIA T4 (data sheet)'
    source: str  # how the numbers were obtained, for the plan's assumptions
    compute: Rates  # where forward and backward run
    host: Rates  # the CPU (offloaded optimizer steps, host copies)
    h2d_bytes_per_s: dict = field(default_factory=dict)  # {'pinned': B/s, 'pageable': B/s}
    d2h_bytes_per_s: dict = field(default_factory=dict)
    optimizers: dict = field(default_factory=dict)  # 'kind@device' -> [seconds per parameter, seconds per tensor]
    # family -> {'micro_s', 'micro_tensor_s', 'micro_param_s', 'step_s', 'step_tensor_s', 'step_param_s'}
    engines: dict = field(default_factory=dict)
    disk_write_bytes_per_s: float | None = None
    threads: int = 1
    measured: dict = field(default_factory=dict)  # anything else recorded (dates, versions, raw samples)
    # family -> measured / predicted step time, from `vramfit tune` on this machine (applied to later predictions)
    corrections: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def doubtful(self) -> str | None:
        """Why these speeds are not this machine's when idle (measured while it was busy), None when they are."""
        return self.measured.get("doubtful")

    @property
    def busy_now(self) -> str | None:
        """Why a run now will be slower than these speeds price it (other processes busy at the plan's check,
        :mod:`launcher.machine.recheck`), None when nothing said so."""
        return self.measured.get("busy_now")

    @classmethod
    def from_dict(cls, d: dict) -> Machine:
        d = dict(d)
        d["compute"], d["host"] = Rates(**d["compute"]), Rates(**d["host"])
        return cls(**d)


# ------------------------------------------------------------------------------------------------
# The cache


def cache_dir() -> str:
    return cache_root()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_key() -> dict:
    """What the numbers depend on: a calibration taken with another value of any of these is not used."""

    key = {"device": "cpu", "driver": None, "cuda": torch.version.cuda, "cpu": cpu_model(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "deepspeed": deepspeed_status()[0]}  # its engines' fixed costs change with its version
    if torch.cuda.is_available():
        key["device"] = torch.cuda.get_device_name(0)
        get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # the driver's CUDA version, e.g. 12040
        key["driver"] = get_driver() if get_driver else None
    return key


def cache_path(key: dict | None = None, directory: str | None = None) -> str:
    key = key or machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(directory or cache_dir(), f"machine-{digest}.json")


@dataclass
class Cached:
    """A cache file read back: the machine, or why there is none to use (``problem``)."""

    path: str
    machine: Machine | None = None
    created: float | None = None  # unix time of the measurement
    problem: str | None = None  # absent, corrupt, truncated, another machine's, stale
    key: dict = field(default_factory=dict)

    @property
    def age_days(self) -> float | None:
        return None if self.created is None else (time.time() - self.created) / 86400

    def to_dict(self) -> dict:
        return {"path": self.path, "created": date_text(self.created) if self.created else None,
                "age_days": None if self.age_days is None else round(self.age_days, 2), "problem": self.problem,
                "summary": summary(self.machine) if self.machine else None,
                "machine": self.machine.to_dict() if self.machine else None}


def date_text(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def read(stale_days: float = 30, directory: str | None = None) -> Cached:
    """The cached calibration of this machine, or why there is none to use (nothing is logged here). Made at
    another thread count (``train.threads=auto`` took fewer because a neighbour was busy), the nearest one is
    used with its CPU rates scaled (:func:`at_threads`)."""
    key = machine_key()
    path = cache_path(key, directory)
    if not os.path.exists(path):
        for n in sorted(range(1, 4 * (os.cpu_count() or 1) + 1), key=lambda n: (abs(n - key["threads"]), -n)):
            other = cache_path({**key, "threads": n}, directory)
            if n != key["threads"] and os.path.exists(other):
                found = _read_file(other, {**key, "threads": n}, stale_days)
                if found.machine is not None:
                    found.machine = at_threads(found.machine, key["threads"])
                found.key = key
                return found
    return _read_file(path, key, stale_days)


def at_threads(m: Machine, threads: int) -> Machine:
    """``m``, measured at ``m.threads`` threads, for a run at ``threads``. Fewer: the CPU's work rates (matmul,
    attention, elementwise, in-step elementwise) and its optimizers' per-parameter speed scaled by threads / measured
    threads, a bound (a parallel kernel speeds up at most in proportion, so one thread of two runs at least half as
    fast); per-op and engine fixed costs, which one thread of control pays, kept. More: kept as measured (no gain is
    assumed). A GPU's own rates are never scaled."""
    if threads >= m.threads:
        return dataclasses.replace(m, measured={**m.measured, "threads_scaled": None})
    f = threads / m.threads

    def cpu(r: Rates) -> Rates:
        if r.device != "cpu":
            return r
        return dataclasses.replace(
            r, matmul={k: [[x, y * f] for x, y in c] for k, c in r.matmul.items()},
            attention={k: v * f for k, v in r.attention.items()}, memory_bytes_per_s=r.memory_bytes_per_s * f,
            step_costs={k: {**v, "bytes_per_s": v["bytes_per_s"] * f} for k, v in r.step_costs.items()})

    optimizers = {k: ([v[0] / f, v[1]] if k.endswith("@cpu") else v) for k, v in m.optimizers.items()}
    return dataclasses.replace(m, compute=cpu(m.compute), host=cpu(m.host), optimizers=optimizers, threads=threads,
                               name=f"{m.name}, scaled to {threads} thread(s)",
                               measured={**m.measured, "threads_scaled": {"measured": m.threads, "used": threads}})


def _read_file(path: str, key: dict, stale_days: float) -> Cached:
    out = Cached(path=path, key=key)
    if not os.path.exists(path):
        out.problem = f"no calibration of this machine in {os.path.dirname(path)}"
        return out
    try:
        with open(path) as fh:
            doc = json.load(fh)
        if doc.get("format") != FORMAT:
            out.problem = f"{path} is of format {doc.get('format')!r}, this vramfit writes {FORMAT}"
            return out
        if doc.get("key") != key:
            diff = {k: (doc.get("key", {}).get(k), v) for k, v in key.items() if doc.get("key", {}).get(k) != v}
            out.problem = f"{path} was measured on another machine or setup (file, now: {diff})"
            return out
        machine = Machine.from_dict(doc["machine"])
        created = float(doc["created"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        out.problem = f"{path} is corrupt or truncated ({type(e).__name__}: {e})"
        return out
    out.machine, out.created = machine, created
    if out.age_days > stale_days:
        out.problem = f"{path} is {out.age_days:.0f} days old (stale after {stale_days:g})"
    return out


def write(machine: Machine, directory: str | None = None, created: float | None = None) -> str:
    """Cache ``machine`` as this machine's calibration: a temporary file in the same folder, then a rename,
    so a reader never sees half a file."""
    key = machine_key()
    path = cache_path(key, directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"format": FORMAT, "key": key, "created": created or time.time(), "machine": machine.to_dict()}
    write_atomic(path, json.dumps(doc, indent=1))
    return path


# Other processes' CPU use during a calibration above which its speeds are a busy machine's, not this one's: half a
# core (a 2-core box at load average 2.3-2.7 gave rates 5-20x off and step times +409% to +1306%); and the share of
# CPU time a hypervisor may give to other guests (steal) before the same holds.
BUSY_CORES = 0.5
STEAL_SHARE = 0.10


def doubt(others_busy_cores: float, steal_share: float, cores: int, contended: bool = False) -> str | None:
    """Why a calibration measured under these conditions does not describe this machine, None when it does."""
    why = []
    if others_busy_cores > BUSY_CORES:
        why.append(f"other processes kept {others_busy_cores:.1f} of {cores} cores busy while it was measured")
    if steal_share > STEAL_SHARE:
        why.append(f"the hypervisor gave {steal_share:.0%} of the CPU time to other guests (steal)")
    if contended:
        why.append("a small matmul ran slower on all threads than on one (a contended CPU)")
    return "; ".join(why) or None


def cached(stale_days: float = 30, directory: str | None = None) -> tuple[Machine | None, str | None]:
    """(the cached speeds of this machine when they are usable, else None; why a file that is there was not used,
    for the caller to warn about). Without speeds the caller goes on unpriced."""
    found = read(stale_days, directory)
    if found.problem is None:
        return found.machine, None
    if found.machine is None and not os.path.exists(found.path):
        return None, None
    return None, f"calibration not used: {found.problem}; `vramfit doctor --calibrate` measures this machine"


def save_corrections(machine: Machine, corrections: dict, directory: str | None = None) -> Machine:
    """Keep ``vramfit tune``'s measured / predicted ratios (family -> factor) with this machine's calibration,
    merged over earlier ones; a new calibration starts without them (its model is a new one)."""
    found = read(float("inf"), directory)
    base = found.machine or machine
    merged = {**getattr(base, "corrections", {}), **corrections}
    out = dataclasses.replace(base, corrections=merged)
    write(out, directory, created=found.created)
    return out


# ------------------------------------------------------------------------------------------------
# What doctor shows


def summary(m: Machine) -> dict:
    """The headline numbers: matmul TFLOPS per dtype at the largest size measured, memory GB/s, op and view
    cost in microseconds, the costs measured inside steps per precision (a CPU), copy GB/s, optimizer seconds
    per 100M parameters, engine fixed costs in ms."""
    def rates(r: Rates) -> dict:
        return {"matmul_tflops": {k: _sig(c[-1][1] / 1e12) for k, c in r.matmul.items() if c},
                "matmul_largest_flops": {k: c[-1][0] for k, c in r.matmul.items() if c},
                "attention_tflops": {k: _sig(v / 1e12) for k, v in r.attention.items()},
                "memory_gb_s": _sig(r.memory_bytes_per_s / 1e9), "op_us": _sig(r.op_s * 1e6),
                "view_us": _sig(r.view_s * 1e6),
                "in_step": {k: {"op_us": _sig(v["op_s"] * 1e6), "elementwise_gb_s": _sig(v["bytes_per_s"] / 1e9),
                                "once_per_micro_batch_ms": _sig(v.get("micro_s", 0.0) * 1e3)}
                            for k, v in r.step_costs.items()}}

    out = {"name": m.name, "source": m.source, "threads": m.threads, m.compute.device: rates(m.compute)}
    if m.host.device != m.compute.device:
        out["cpu"] = rates(m.host)
    out["copy_gb_s"] = {f"{d}_{k}": _sig(v / 1e9) for d, links in (("h2d", m.h2d_bytes_per_s), ("d2h", m.d2h_bytes_per_s))
                        for k, v in links.items()}
    out["optimizer_s_per_100m_params"] = {k: _sig(v[0] * 1e8) for k, v in m.optimizers.items()}
    out["engines_ms"] = {k: {f: _sig(x * 1e3) for f, x in v.items()} for k, v in m.engines.items()}
    out["disk_write_gb_s"] = _sig(m.disk_write_bytes_per_s / 1e9) if m.disk_write_bytes_per_s else None
    if getattr(m, "corrections", None):
        out["corrections"] = dict(m.corrections)
    return out


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def format_report(found: Cached) -> str:
    if found.machine is None:
        return f"calibration: none to use ({found.problem}); `vramfit doctor --calibrate` measures it, about a minute"
    m, sm = found.machine, summary(found.machine)
    head = f"calibration: {m.name}, {date_text(found.created)} ({found.age_days:.1f} days old), {found.path}"
    lines = [head + (f"\n  NOT USED: {found.problem}" if found.problem else "")
             + (f"\n  DOUBTFUL: {m.doubtful}; its speeds are a busy machine's, and plans priced with them say so; fix: "
                "`vramfit doctor --calibrate` when the machine is idle" if m.doubtful else "")]
    for dev in ("cuda", "cpu"):
        r = sm.get(dev)
        if not r:
            continue
        mm = ", ".join(f"{k} {v:.3g}" for k, v in r["matmul_tflops"].items())
        att = ", ".join(f"{k} {v:.3g}" for k, v in r["attention_tflops"].items())
        lines.append(f"  {dev}: matmul TFLOPS at the largest size: {mm}; attention TFLOPS: {att or 'n/a'}")
        lines.append(f"  {dev}: memory {r['memory_gb_s']:.3g} GB/s; per kernel op {r['op_us']:.3g} us, per view "
                     f"{r['view_us']:.3g} us")
        for prec, c in r["in_step"].items():
            lines.append(f"  {dev} inside {prec} steps: per kernel op {c['op_us']:.3g} us, elementwise "
                         f"{c['elementwise_gb_s']:.3g} GB/s, {c['once_per_micro_batch_ms']:.3g} ms once per micro-batch")
    lines.append("  copies GB/s: " + ", ".join(f"{k} {v:.3g}" for k, v in sm["copy_gb_s"].items()))
    lines.append("  optimizer s per 100M params: " + (", ".join(
        f"{k} {v:.3g}" for k, v in sm["optimizer_s_per_100m_params"].items()) or "none measured"))
    for fam, e in m.engines.items():
        lines.append(f"  engine {fam}: {e['micro_s'] * 1e3:.3g} ms + {e['micro_tensor_s'] * 1e6:.3g} us/tensor + "
                     f"{e.get('micro_param_s', 0) * 1e9:.3g} ns/parameter per micro-batch, {e['step_s'] * 1e3:.3g} ms + "
                     f"{e['step_tensor_s'] * 1e6:.3g} us/tensor + {e.get('step_param_s', 0) * 1e9:.3g} ns/parameter per step")
    if sm["disk_write_gb_s"] is not None:
        lines.append(f"  disk write {sm['disk_write_gb_s']:.3g} GB/s")
    skipped = m.measured.get("skipped") or {}
    if skipped:
        lines.append("  left out or doubtful: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    load = m.measured.get("load_average_before")
    if load:
        lines.append(f"  load average while measuring: {load[0]:.2f} before, "
                     f"{m.measured.get('load_average_after', [0])[0]:.2f} after, on {m.measured.get('cores')} cores")
    return "\n".join(lines)
