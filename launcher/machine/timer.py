"""Timing one call on this machine: a call timed with the GPU's queued work counted (:func:`once`), and calls
repeated until a minimum time has passed (:func:`repeat`). Here, low in the layers, so that the plan-time check of
a calibration (:mod:`launcher.machine.recheck`) times its probes as the calibration does
(:func:`launcher.measure.timing.best_of`)."""

from __future__ import annotations

import time

import torch


def sync() -> None:
    if torch.cuda.is_available():  # as torch.utils.benchmark does: the GPU's work is part of the time
        torch.cuda.synchronize()


def once(fn) -> float:
    """Seconds of one call of ``fn``, the GPU's work included."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def repeat(fn, min_time: float, times: list[float] | tuple = ()) -> list[float]:
    """``times`` and then the seconds of each further call of ``fn`` (:func:`once`), called one by one for
    ``min_time`` and three times at least, so a call another process interrupted does not spoil its neighbours."""
    times = list(times)
    deadline = time.perf_counter() + min_time
    while len(times) < 3 or time.perf_counter() < deadline:
        times.append(once(fn))
    return times
