"""A training process's heap: where glibc would keep much of what is freed, freed CPU blocks go back to the system.

torch allocates CPU tensors with the C library's allocator. glibc serves a request of at least its mmap
threshold with pages of its own, given back when freed, and a smaller one from its heaps, which keep what is
freed for later requests. By default the threshold rises to the size of each large block freed (up to 32
MiB), and the heap is trimmed only past twice that: once a step's tensors have been freed, anything up to 32
MiB comes from heaps that keep their freed memory, in as many heaps (arenas) as threads that allocated at once
(the loop, gloo's and the engines' worker threads). Reuse is what makes the next step's allocations cheap, but
what a process holds then depends on its history, not on the moment the plan counts. Measured with
``scripts/validate_ranks.py`` on 2 and 4 CPU ranks (45M-parameter Llama, bench/results/2026-12-04-cpu-epyc/
per-rank/): FSDP2 and ZeRO-3 offload peaked 17-25% above their plans per rank; with the threshold fixed at 4 MiB
(per-rank-heap/ there) within 1-15% of them.

``memory.mmap_threshold_mib`` fixes it (glibc's ``mallopt(M_MMAP_THRESHOLD)``, what its
``MALLOC_MMAP_THRESHOLD_`` variable does before a process starts; fixing it also stops its rise). ``auto``
fixes it at 4 MiB where the heap would keep most:
- several ranks train: each rank's heap is held once per rank on a host's RAM;
- the CPU computes the step of an engine that gathers each layer's weights and frees them again at every step
  (FSDP2, ZeRO-3): the gathered layers, the activations and the kernels' scratch all come from glibc, and what
  its heap kept varied from run to run of the same job (llama-1b LoRA on ``fsdp-bf16-offload``: 4.14 and 4.87
  GiB against a plan of 3.25, bench/results/2026-12-05-cpu-epyc/host-memory/ and 2026-12-06-cpu-epyc/heap-sharded/;
  3.21 with the threshold fixed, 2026-12-06-cpu-epyc/host-memory-sharded/);
  a GPU computes these on its own memory, so a GPU run keeps glibc's default;
- a single process whose planned host peak takes more than :data:`TIGHT_SHARE` of the host budget (what the
  heap would keep on top may not fit).
Otherwise ``auto`` leaves glibc's default, because a fixed threshold costs time where the CPU computes the step:
blocks of 4 MiB and more come from fresh pages at every step (``scripts/bench_heap.py``, one rank: FSDP2's step
18% and 37% longer in two rounds on a 45M-parameter model; the other engines' differences were within this 2-core
box's noise). 0 leaves glibc's default; a ``MALLOC_MMAP_THRESHOLD_`` in the environment is the user's choice and
wins. Nothing is done where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
FIXED_MIB = 4.0  # memory.mmap_threshold_mib=auto where it fixes the threshold (the module's list)
# auto with one process: the planned host peak's share of the host budget above which the threshold is fixed (the
# heap kept 8-50% more than the plan with FSDP2 and ZeRO-3 on one process, bench/results/2026-12-05-cpu-epyc/
# host-memory/ and 2026-12-06-cpu-epyc/heap-sharded/: past this share that may not fit)
TIGHT_SHARE = 0.7
ENV = "MALLOC_MMAP_THRESHOLD_"


def threshold_mib(setting, world: int, host_share: float | None = None, gathers_on_cpu: bool = False) -> float:
    """The threshold ``memory.mmap_threshold_mib`` asks for with ``world`` ranks (0: glibc's default);
    ``host_share``: the planned host peak over the host budget, where a plan was made; ``gathers_on_cpu``: the
    CPU computes the step of an engine that gathers the weights layer by layer."""
    if setting == "auto":
        tight = host_share is not None and host_share > TIGHT_SHARE
        return FIXED_MIB if world > 1 or tight or gathers_on_cpu else 0.0
    return float(setting)


def fix_mmap_threshold(mib: float) -> str:
    """Fix glibc's mmap threshold at ``mib`` MiB for this process (0: leave glibc's); what was done, in words."""
    if os.environ.get(ENV):
        return f"{ENV}={os.environ[ENV]} from the environment"
    if mib <= 0:
        return "glibc's default mmap threshold"
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "the C library's own allocator (not glibc)"
    try:
        ok = ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(mib * 2**20))
    except (OSError, AttributeError):
        ok = 0
    if not ok:
        return f"glibc's default mmap threshold (mallopt refused {mib:g} MiB)"
    return f"CPU blocks of {mib:g} MiB and more go back to the system when freed (memory.mmap_threshold_mib)"
