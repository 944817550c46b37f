"""Where the time to a run's first step goes: the set-up's laps, counted from the process's start.

A user on a rented card pays for every second before the first step; ``summary.json`` keeps ``startup_s`` (the
process's start to the first step) and its parts, and the log says them when the first step starts.
"""

from __future__ import annotations

import time

import psutil


class Startup:
    def __init__(self):
        try:
            self.process_start = psutil.Process().create_time()
        except psutil.Error:  # no /proc: counted from here
            self.process_start = time.time()
        self._t = time.time()
        # the interpreter, the imports and the command line, before the run's own set-up began
        self.laps: dict[str, float] = {"start": self._t - self.process_start}
        self.notes: dict[str, str] = {}

    def lap(self, name: str, note: str | None = None) -> None:
        """Count the time since the last lap as ``name`` (added to an earlier lap of that name)."""
        now = time.time()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._t
        self._t = now
        if note:
            self.notes[name] = note

    @property
    def total_s(self) -> float:
        return self._t - self.process_start

    def describe(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
                          for name, s in self.laps.items())
        return f"first step {self.total_s:.1f} s after the process started: {parts}"

    def to_dict(self) -> dict:
        return {"startup_s": round(self.total_s, 2), "startup_parts": {k: round(v, 2) for k, v in self.laps.items()}}
