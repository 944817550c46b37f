"""A quick check, before a plan is priced, that the cached calibration still describes this machine.

A calibration is a minute of measurements taken once (:mod:`launcher.measure.calibrate`); a plan made hours later
prices its steps with it. Two things make those numbers wrong while the cache key stays the same: the calibration
was made while other processes kept the cores busy (then it reads too slow, and is flagged at the time when the
load was seen), or other processes keep the cores busy now (then the run will be slower than priced). The check
times two of the calibration's own probes again, the way it timed them (the fastest call of those repeated over
0.1 s): the largest fp32 matmul of its samples that takes a millisecond or more, and the elementwise add over its
three tensors; and it samples the CPU time other processes use meanwhile (:class:`launcher.machine.threads.Watch`).

One kernel is not trusted alone: a single probe's time is noisy, and a shared CPU switches between two speeds about
1.7x apart over seconds (``bench/results/2026-12-01-cpu-xeon/process-spread/``). So the calibration is called out
only when both probes are off by more than :data:`FACTOR` the same way, or when other processes use more than
:data:`BUSY_CORES` of a core now. Nothing is measured again by itself: the plan says so and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from launcher.machine import timer
from launcher.machine.speeds import Machine
from launcher.machine.threads import Watch

FACTOR = 2.0  # both probes this many times faster (or slower) than calibrated: the calibration is not this machine's
BUSY_CORES = 0.5  # other processes' cores during the check that make "busy now"
MIN_TIME_S = 0.1  # each probe repeated this long, the fastest call kept (as the calibration times them)
MIN_CALL_S = 1e-3  # the matmul probe: the largest calibrated size whose call takes at least this long (noise below)
MAX_CALL_S = 0.05  # ... and at most this long (the check stays well under a second)
ENV = "VRAMFIT_RECHECK"  # "off": no check (a calibration of another machine on purpose: the docs' examples, tests)


@dataclass(frozen=True)
class Recheck:
    """What the check measured: per probe, the calibrated time over the time now (above 1: faster now), the
    other processes' cores meanwhile, and the verdict with its message (None when the calibration holds)."""

    ratios: dict
    others_busy_cores: float
    seconds: float
    verdict: str | None = None  # 'calibrated_busy' | 'busy_now'
    message: str | None = None


def judge(ratios: dict, others_busy_cores: float) -> tuple[str | None, str | None]:
    """(verdict, message) from the probes' ratios (calibrated time / time now) and the cores other processes
    used: both probes over :data:`FACTOR` faster now means the calibration read a busy machine; both slower, or
    more than :data:`BUSY_CORES` cores busy elsewhere, means the machine is busy now."""
    said = ", ".join(f"{name} {r:.2g}x" for name, r in ratios.items())
    if len(ratios) == 2 and all(r > FACTOR for r in ratios.values()):
        return "calibrated_busy", (f"this machine runs its calibration's probes faster now than when it was "
                                   f"calibrated ({said} the calibrated speed): the calibration read a busy machine")
    slow = len(ratios) == 2 and all(r < 1 / FACTOR for r in ratios.values())
    if slow or others_busy_cores > BUSY_CORES:
        return "busy_now", (f"other processes keep {others_busy_cores:.1f} cores busy now"
                            + (f" and the calibration's probes run at {said} the calibrated speed" if slow else "")
                            + ": steps will be slower than priced until it is idle")
    return None, None


def _probes(machine: Machine) -> dict:
    """name -> (calibrated seconds, a function that runs the same call now), from the calibration's samples."""
    samples = machine.measured.get("samples") or {}
    dev = machine.compute.device
    out = {}
    sizes = ((samples.get("matmul") or {}).get(f"float32@{dev}") or {}).get("sizes") or []
    fit = [s for s in sizes if MIN_CALL_S <= s.get("best_s", 0) <= MAX_CALL_S]
    if fit:
        n, best = fit[-1]["n"], fit[-1]["best_s"]
        a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
        out[f"a {n} x {n} fp32 matmul"] = (best, lambda: torch.mm(a, b))
    memory = (samples.get("memory") or {}).get(dev)
    if memory and memory.get("best_s", 1) <= MAX_CALL_S:
        k = int(memory["bytes"]) // 12  # three fp32 tensors, two read and one written
        x, y, z = (torch.rand(k, device=dev) for _ in range(3))
        out["the elementwise add"] = (memory["best_s"], lambda: torch.add(x, y, out=z))
    return out


def recheck(machine: Machine | None) -> Recheck | None:
    """Time the probes again (well under a second) and judge; None when there is nothing to compare: no
    calibration, one without samples (a card on paper), one measured at another thread count (its rates are
    scaled from another, see :func:`launcher.machine.speeds.read`), or ``VRAMFIT_RECHECK=off``."""
    if (machine is None or machine.threads != torch.get_num_threads() or "threads_scaled" in machine.measured
            or os.environ.get(ENV, "on") == "off"):
        return None
    probes = _probes(machine)
    if not probes:
        return None
    t0 = time.perf_counter()
    watch = Watch()
    # each probe's fastest call over MIN_TIME_S, timed one by one as launcher.measure.timing.best_of times calls of
    # 100 us and more (its warm-up and its blocks of shorter calls are for sizes this check never times: 1-50 ms)
    ratios = {name: calibrated / max(min(timer.repeat(fn, MIN_TIME_S)), 1e-9)
              for name, (calibrated, fn) in probes.items()}
    busy = watch.stop().others_busy_cores
    verdict, message = judge(ratios, busy)
    return Recheck(ratios=ratios, others_busy_cores=busy, seconds=time.perf_counter() - t0, verdict=verdict,
                   message=message)


def checked(machine: Machine | None) -> Machine | None:
    """``machine`` with the check's verdict in it, for the plan and the run to say: a calibration that read a busy
    machine is doubtful (``measured['doubtful']``, as one flagged when it was made), a machine busy now is
    ``measured['busy_now']``; unchanged when it holds (or when there is nothing to check)."""
    found = recheck(machine)
    if found is None or found.verdict is None:
        return machine
    key = "doubtful" if found.verdict == "calibrated_busy" else "busy_now"
    if key == "doubtful" and machine.doubtful:
        return machine  # flagged when it was made already
    return dataclasses.replace(machine, measured={**machine.measured, key: found.message,
                                                  "recheck": dataclasses.asdict(found)})
