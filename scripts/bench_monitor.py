#!/usr/bin/env python
"""What the memory monitor costs: the same training with the monitor on and off, alternating.

    python scripts/bench_monitor.py [--repeats 4] [--steps 40] [--warmup 5] [--out DIR] [key=value ...]

Each repeat trains twice in this process, once with ``log.memory_interval_s=0.5`` (the default: sampler
thread, per-phase peaks, leak check, memory.png) and once with ``log.memory_interval_s=0`` (monitor off),
the order alternating between repeats (on/off, off/on, ...) so that a busy machine slows both alike.
tokens/s is taken over the steps after the warm-up from each run's metrics.jsonl (wall time, so it
includes everything the loop does). Reported: the median tokens/s of each, the overhead
``1 - median(on) / median(off)``, the median of the paired ratios, and the monitor's own time measured
directly (the loop's calls into it per step, and the sampler thread's time per sample), which a noisy
machine does not blur. Target: under 2% of tokens/s.

Writes ``DIR/bench_monitor.json`` and ``DIR/bench_monitor.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from launcher.config.load import load_config  # noqa: E402
from launcher.measure.bench import cpu_model, timing  # noqa: E402
from launcher.training import monitor as monitor_mod  # noqa: E402


class CallTimer:
    """Wrap MemoryMonitor methods to add up the time spent in them: the loop's calls (``mark``,
    ``end_step``), the phase switches the model hooks make (``_close_phase`` outside those), and the
    sampler thread's ``sample``."""

    def __init__(self):
        self.seconds = {"mark": 0.0, "end_step": 0.0, "_close_phase": 0.0, "sample": 0.0}
        self.calls = dict.fromkeys(self.seconds, 0)
        self._orig = {}
        self._depth = 0  # inside mark/end_step: their phase switches are already counted

    def install(self):
        for name in self.seconds:
            orig = getattr(monitor_mod.MemoryMonitor, name)
            self._orig[name] = orig

            def wrapped(*a, _orig=orig, _name=name, **kw):
                outer = _name in ("mark", "end_step")
                if _name == "_close_phase" and self._depth:
                    return _orig(*a, **kw)
                self._depth += outer
                t = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    self.seconds[_name] += time.perf_counter() - t
                    self.calls[_name] += 1
                    self._depth -= outer

            setattr(monitor_mod.MemoryMonitor, name, wrapped)

    def remove(self):
        for name, orig in self._orig.items():
            setattr(monitor_mod.MemoryMonitor, name, orig)


def one_run(overrides: list[str], on: bool, out_dir: str, name: str, warmup: int, timer: CallTimer | None) -> dict:
    from launcher.training.loop import train

    interval = "0.5" if on else "0"
    cfg = load_config(None, [*overrides, f"log.memory_interval_s={interval}", f"output_dir={out_dir}",
                             f"run_name={name}", "checkpoint.save=false", "sample_tokens=0", "log.progress=off",
                             "log.every_steps=1000000"])
    if timer:
        timer.install()
    try:
        s = train(cfg)
    finally:
        if timer:
            timer.remove()
    rows = [json.loads(ln) for ln in open(os.path.join(s["run_dir"], "metrics.jsonl")) if ln.strip()]
    t = timing(rows, warmup)
    return {"monitor": on, "tokens_per_s": t["tokens_per_s"], "step_s": t["step_s"], "steps": len(rows),
            "samples": s.get("memory_samples")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=4, help="pairs of runs (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default: %(default)s)")
    ap.add_argument("--out", default=None, help="directory for bench_monitor.json and .md")
    ap.add_argument("overrides", nargs="*", help="key=value settings of the workload (default: the demo's tiny model)")
    a = ap.parse_args(argv)
    overrides = [f"train.max_steps={a.steps}", f"train.warmup_steps={min(5, a.steps)}", *a.overrides]
    runs = []
    timer = CallTimer()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-monitor-") as tmp:
        for i in range(a.repeats):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                r = one_run(overrides, on, tmp, f"r{i}-{'on' if on else 'off'}", a.warmup, timer if on else None)
                r["repeat"] = i
                runs.append(r)
                print(f"repeat {i} monitor {'on ' if on else 'off'}: {r['tokens_per_s']:.1f} tokens/s "
                      f"({r['step_s'] * 1000:.1f} ms/step)", flush=True)
    on = [r["tokens_per_s"] for r in runs if r["monitor"]]
    off = [r["tokens_per_s"] for r in runs if not r["monitor"]]
    pairs = [a_["tokens_per_s"] / b_["tokens_per_s"] for a_, b_ in
             zip([r for r in runs if r["monitor"]], [r for r in runs if not r["monitor"]])]
    steps_on = sum(r["steps"] for r in runs if r["monitor"])
    step_s_on = statistics.median(r["step_s"] for r in runs if r["monitor"])
    loop_us = (timer.seconds["mark"] + timer.seconds["end_step"] + timer.seconds["_close_phase"]) / max(1, steps_on) * 1e6
    sample_us = timer.seconds["sample"] / max(1, timer.calls["sample"]) * 1e6
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "workload": overrides, "repeats": a.repeats, "warmup": a.warmup,
        "runs": runs, "median_tokens_per_s_on": statistics.median(on), "median_tokens_per_s_off": statistics.median(off),
        "overhead_pct": 100 * (1 - statistics.median(on) / statistics.median(off)),
        "median_paired_ratio": statistics.median(pairs), "paired_ratios": pairs,
        "mean_paired_ratio": statistics.fmean(pairs),
        "paired_ratio_stderr": statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else None,
        "direct": {"loop_calls_us_per_step": loop_us, "sample_us": sample_us,
                   "loop_calls_pct_of_step": 100 * loop_us / 1e6 / step_s_on,
                   "sampler_pct_at_0.5s": 100 * sample_us / 1e6 / 0.5},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    md = "\n".join([
        f"Memory monitor overhead, {res['date']}, {res['cpu']} x {res['cpus']} (load average at the end "
        f"{', '.join(f'{x:.1f}' for x in res['load_average'])})",
        f"workload: `{' '.join(overrides)}` (torch threads {res['torch_threads']}), {a.repeats} alternating pairs, "
        f"first {a.warmup} steps of each run untimed",
        "",
        "| monitor | median tokens/s | runs (tokens/s) |", "| --- | ---: | --- |",
        f"| on (interval 0.5 s) | {res['median_tokens_per_s_on']:.1f} | {', '.join(f'{x:.1f}' for x in on)} |",
        f"| off | {res['median_tokens_per_s_off']:.1f} | {', '.join(f'{x:.1f}' for x in off)} |",
        "",
        f"overhead (1 - median on / median off): {res['overhead_pct']:+.2f}%; paired ratios on/off: median "
        f"{res['median_paired_ratio']:.4f}, mean {res['mean_paired_ratio']:.4f}"
        + (f" +- {res['paired_ratio_stderr']:.4f} (standard error)" if res["paired_ratio_stderr"] else "")
        + f" (pairs: {', '.join(f'{x:.3f}' for x in pairs)})",
        f"measured directly: the monitor's work in the training thread (loop calls and hook phase switches) "
        f"{loop_us:.0f} us per step "
        f"({res['direct']['loop_calls_pct_of_step']:.3f}% of a {step_s_on * 1000:.0f} ms step); one sample "
        f"{sample_us:.0f} us, every 0.5 s = {res['direct']['sampler_pct_at_0.5s']:.3f}% of one core",
    ])
    print()
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_monitor.json"), "w") as fh:
            json.dump(res, fh, indent=2)
        with open(os.path.join(a.out, "bench_monitor.md"), "w") as fh:
            fh.write(md + "\n")
        print(f"\nwrote {a.out}/bench_monitor.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
