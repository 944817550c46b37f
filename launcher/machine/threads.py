"""The training process's threads, set on purpose rather than left at "one per core".

What a step runs on: torch's intra-op threads (OpenMP: matmuls, elementwise kernels, torch's fused AdamW --
the optimizer of every profile, also under DeepSpeed), and nothing else: vramfit prepares batches in the
loop's own thread from tokens already in memory (no data-loader workers), and its memory sampler sleeps
between samples.

torch starts one intra-op thread per core. On a machine whose cores other processes also want (a VPS with
noisy neighbours, another run, a compiler) every parallel region then waits for its slowest thread, and a
thread the scheduler has put aside holds the whole step: measured on 2 cores with one busy-loop process
beside the run, a step took 2.9-3.1x as long as alone where a fair share would be 2x, and a 256 x 256
matmul 17-20 ms on 2 threads against 0.33 ms on 1. ``train.threads=auto`` therefore counts the cores other
processes keep busy (their CPU time over a quarter of a second before the run starts, this process's own
left out) and takes the rest, at least one: a whole core to itself beats a share of two. A number sets the
threads outright. The choice, and why, is logged and kept in ``summary.json`` (``threads``).

Measured by ``scripts/bench_threads.py`` (demo model, 2-core EPYC, load average 1.7-2.4 from other work
besides the test's own neighbour): beside one busy-loop process, ``auto`` (1 thread there, 2 alone) ran a step
1.78x (AMP) and 1.68x (ZeRO-2) as long as the best setting alone; 2 threads 3.33x and 3.50x.

OpenMP's wait policy (``OMP_WAIT_POLICY``) stays at the runtime's default (threads spin a little after a
parallel region before sleeping): PASSIVE (sleep at once) helped 2 threads beside the neighbour (1.90x / 1.84x)
but cost 30-45% alone (173 against 133 ms, 182 against 140 ms), where fewer threads cost nothing. It can
only be set before the OpenMP runtime starts, so it is reported here, not changed.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

SAMPLE_S = 0.25  # how long the neighbours' CPU use is watched before the run (costs the start this much)


@dataclass(frozen=True)
class Threads:
    intra_op: int  # torch.set_num_threads (OpenMP and MKL)
    cores: int  # cores this process may run on (its CPU affinity)
    others_busy_cores: float | None  # cores other processes kept busy while sampled (None: not sampled)
    wait_policy: str  # OMP_WAIT_POLICY as the OpenMP runtime read it at start ('default' when unset)
    data_workers: int  # processes or threads preparing batches besides the loop (vramfit's: none)
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuUse:
    """What the machine's CPUs did while watched, besides this process (and its children)."""

    seconds: float
    others_busy_cores: float  # other processes' CPU time over the wall time
    steal_share: float  # CPU time the hypervisor gave to other guests, of all CPU time (a VPS's noisy neighbours)

    def to_dict(self) -> dict:
        return asdict(self)


class Watch:
    """The CPU time of the whole machine and of this process, from now until :meth:`stop` (psutil's counters,
    /proc/stat and /proc/self/stat on Linux)."""

    def __init__(self):
        import psutil

        self._me = psutil.Process()
        self._start = self._sample()

    def _sample(self):
        import psutil

        t, own = psutil.cpu_times(), self._me.cpu_times()
        steal = getattr(t, "steal", 0.0)
        busy = t.user + t.nice + t.system + t.irq + t.softirq + steal
        mine = own.user + own.system + own.children_user + own.children_system
        return time.monotonic(), busy, mine, steal, busy + t.idle + getattr(t, "iowait", 0.0)

    def stop(self) -> CpuUse:
        (w0, b0, m0, s0, a0), (w1, b1, m1, s1, a1) = self._start, self._sample()
        wall = max(w1 - w0, 1e-6)
        return CpuUse(seconds=wall, others_busy_cores=max(0.0, ((b1 - b0) - (m1 - m0)) / wall),
                      steal_share=max(0.0, (s1 - s0) / max(a1 - a0, 1e-6)))


def others_busy(sample_s: float = SAMPLE_S) -> float:
    """Cores kept busy by other processes over ``sample_s`` seconds (system CPU time less this process's)."""
    watch = Watch()
    time.sleep(sample_s)
    return watch.stop().others_busy_cores


def decide(asked, n_cores: int | None = None, busy: float | None = None) -> Threads:
    """The intra-op threads for ``train.threads`` (``'auto'`` or a number). ``busy``: the neighbours' cores,
    sampled here when None and ``asked`` is auto."""
    n = n_cores or cores()
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    if asked != "auto":
        k = int(asked)
        why = f"train.threads={k}" + (f" (more than the {n} cores this process may use)" if k > n else "")
        return Threads(k, n, busy, policy, 0, why)
    if busy is None:
        busy = others_busy()
    k = max(1, n - round(busy))
    if k == n:
        why = f"auto: all {n} cores (other processes kept {busy:.1f} cores busy)"
    else:
        why = (f"auto: {k} of {n} cores, because other processes kept {busy:.1f} cores busy; a parallel region "
               "waits for its slowest thread, and a thread sharing a core with them is the slowest")
    return Threads(k, n, busy, policy, 0, why)


def apply(t: Threads) -> None:
    import torch

    if torch.get_num_threads() != t.intra_op:
        torch.set_num_threads(t.intra_op)


def current() -> dict:
    """What the process runs with now (for ``vramfit doctor``)."""
    import torch

    return {"intra_op": torch.get_num_threads(), "interop": torch.get_num_interop_threads(), "cores": cores(),
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "parallel_backend": _backend(torch)}


def _backend(torch) -> str:
    info = torch.__config__.parallel_info()
    line = next((ln for ln in info.splitlines() if "parallel backend" in ln), "")
    return line.split(":", 1)[1].strip() if ":" in line else "unknown"
