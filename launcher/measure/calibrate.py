"""This machine's speeds for the step-time model (:class:`launcher.machine.speeds.Machine`), measured in under a
minute by ``vramfit doctor --calibrate`` and cached per machine.

What is measured, on the training device (the GPU when torch sees one, else the CPU) and, on a GPU host,
again on the CPU (``host``; on a CPU-only machine ``host`` is ``compute``, measured once):

* **matmul**: ``a @ b``, square m = n = k from 64 to 2048 (CPU) or 256 to 8192 (GPU), per dtype that runs
  (float32, bfloat16, float16): the (FLOPs, FLOP/s) curve :meth:`Rates.matmul_rate` interpolates. A size whose
  one call would take over ``max_call_s`` at the rate of the size below is left out (fp16 on CPUs without
  fp16 arithmetic runs at a few GFLOP/s: its curve stops early rather than spend the minute there).
* **attention**: ``scaled_dot_product_attention``, causal, forward + backward of a realistic shape, FLOPs
  counted as the trace counts them (``2 b h s_q s_k (d + d_v)``, halved for causal, times 3.5 for forward +
  backward), so the rate prices the trace's attention ops directly.
* **memory**: ``torch.add(a, b, out=c)`` on tensors far larger than the caches: bytes read + written per second.
* **view_s**: the fixed cost of a view op: a chain of K views of a tensor that requires grad, forward and
  backward (each view dispatches one view op forward and one backward), timed at two K; the difference over
  the ops it adds. **op_s**: the fixed cost of a kernel op *inside a training step* (dispatch, autograd,
  Python, transformers' modules, kernel launch), from a real forward + backward of a 1- and a 3-layer Llama
  of hidden 64 at batch 1, sequence 8, where FLOPs and bytes cost almost nothing: per added layer, the time
  minus the roofline's price of its work (``steptime.op_seconds`` with the rates above) minus its view ops
  at ``view_s``, over its kernel ops, counted by :func:`launcher.plan.memory.trace.measure_step` on the same
  models. The difference of depths leaves out what a step pays once (the loss, the mask, the call into the
  model), which a deep model spreads over many layers; the whole-model figure is kept in ``measured``.
* **in-step prices** (a CPU only; :mod:`launcher.measure.stepcal`): the matmul curve, attention rate, op cost and
  elementwise rate measured again inside real forward + backward passes under torch's profiler, per precision;
  they replace the looped ones above for steps of that precision (``Rates.step_costs``), since on a CPU the same
  ops run 1.5-3.5x slower inside a step than looped alone.
* **copies**: GPU <-> CPU, both ways, pinned (when ``ulimit -l`` allows pinning) and pageable; on a CPU-only
  machine a large host tensor copy (DeepSpeed's offload still copies gradients into CPU buffers there):
  bytes copied per second.
* **optimizers**: one AdamW step, fp32 parameters with gradients, for each kind :func:`steptime.optimizer_kind`
  names (torch fused AdamW on each device that can run it, DeepSpeedCPUAdam, DeepSpeed's FusedAdam), at the
  thread count training uses: one tensor of 16M parameters (per-parameter cost; its 256 MiB of state do not
  fit in a cache) and 512 tensors of 1024 (per-tensor cost), the two solved for [seconds per parameter,
  seconds per tensor]. The approach of ``scripts/bench_optimizers.py``: fp32 parameters with fp32 gradients,
  warm-up steps that allocate the moments, then timed steps.
* **engines**: each engine family's own fixed cost per micro-batch and per optimizer step, fixed, per
  parameter tensor and per parameter: real engines (``launcher.engines.build``) around tiny Llamas of two
  depths (different tensor counts) and a wider one (``engine_wide``: many more parameters per tensor),
  accumulation 2, several steps timed call by call, in two rounds over all the families (each model keeps
  its fastest step of both, see :func:`_engines`): the non-boundary micro-batch is the micro-batch cost;
  the boundary micro-batch plus ``step()`` minus it is the step's cost. From each is
  subtracted what :func:`steptime.predict` already prices for that model (its compute from the planner's own
  trace of it, memory traffic, copies, the optimizer at the rates just measured); the rest, over the three
  models, is solved for ``micro_s + micro_tensor_s * tensors + micro_param_s * parameters`` and the same per
  step (least squares, coefficients >= 0). CPU: ``amp-fp32``, ``zero2-fp32`` (and ``zero2-bf16``, kept as
  ``zero2@bf16``: DeepSpeed's bf16 path costs more), and the bf16 offload and FSDP profiles of the catalogue;
  GPU: the bf16 (or fp16 below compute capability 8) profiles. A family that cannot run here
  (DeepSpeed missing, its ops not built) is left out with the reason in ``measured["skipped"]``.
* **disk**: write and fsync a file of 128 MiB in the output directory's file system, then remove it.

Every timing is the fastest of several repeats (``torch.utils.benchmark``: it synchronizes the GPU and runs
at the thread count training uses): other processes only ever add time, so the fastest is the machine's
speed; the median is kept in ``measured``, with the load average before and after, so a calibration taken on
a busy machine says so. On a busy CPU the fastest repeat does not help much: every parallel op waits for
threads the scheduler has put aside (a 256 x 256 matmul took 0.3 ms on one thread and 20 ms on two, 2-core
EPYC at load average 9), so a 256 x 256 matmul is timed on one thread and on all of them first, and a
contended CPU is warned about. It costs 43-46 s on a 2-core Xeon at two threads
(``scripts/bench_calibration.py``), over half of it the CPU's rates (most of those the in-step reference
steps), and about 400 MiB of RAM (2 GiB of GPU memory).

What is measured is cached per machine by :mod:`launcher.machine.speeds`, which a training start reads
without importing anything here; :func:`calibration` measures again when the cache is absent or unusable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from launcher import engines
from launcher.config.profiles import PROFILES
from launcher.config.schema import load_config
from launcher.log import logger
from launcher.machine import speeds
from launcher.machine.hardware import deepspeed_status, op_state, pin_memory_ok, probe, remember_cpu_info, use_env_ninja
from launcher.machine.speeds import Machine, Rates
from launcher.measure import stepcal
from launcher.plan import planner
from launcher.plan.availability import profile_problem
from launcher.plan.memory.trace import measure_step
from launcher.plan.resolve import RunSpec
from launcher.plan.steptime import op_seconds, predict
from launcher.precision import supports_bf16, supports_fp16, weight_dtype

MiB = 1 << 20
FAMILIES = ("amp", "zero2", "zero2_offload", "zero3_offload", "fsdp")  # steptime.family names measured here
# Measured again at another precision on a CPU, kept as 'family@precision': DeepSpeed's bf16 path (16-bit
# weights, its fp32 partitions and the copy back) costs another engine time than its fp32 one (tiny Llama,
# batch 8: zero2-bf16 ran 140 ms a step where zero2-fp32's numbers priced it at 84).
CPU_EXTRA = ("zero2@bf16",)
# The tiny Llama of the per-op and engine measurements: everything but the fixed costs is negligible.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
TINY_SEQ = 8
LR = 1e-4


@dataclass(frozen=True)
class Sizes:
    """What is measured and how big; :meth:`quick` is for tests and a first look (seconds, not accurate)."""

    matmul: tuple = (64, 128, 256, 512, 1024, 2048)  # m = n = k on the CPU
    matmul_gpu: tuple = (256, 512, 1024, 2048, 4096, 8192)
    max_call_s: float = 0.5  # a matmul or attention call predicted slower than this is not run
    min_time_s: float = 0.1  # each timing repeats for at least this long
    attention: tuple = (1, 8, 512, 64)  # batch, heads, sequence, head dim
    attention_gpu: tuple = (4, 16, 2048, 128)
    memory_bytes: int = 64 * MiB  # per tensor of the elementwise op (far above a CPU's caches)
    memory_bytes_gpu: int = 256 * MiB
    copy_bytes: int = 256 * MiB
    view_chain: int = 64  # views in the chain that prices a view op
    step_depths: tuple = (1, 3)  # tiny models that price a kernel op
    # One tensor: the per-parameter cost. 16M parameters hold 256 MiB of state (parameter, gradient, two moments),
    # far above the caches; at 4M a 2-core EPYC stepped at 31 GB/s, above its 23 GB/s of memory bandwidth.
    optimizer_params: int = 16 * MiB
    optimizer_params_gpu: int = 64 * MiB
    optimizer_tensors: tuple = (512, 1024)  # how many, and elements each: the per-tensor cost
    optimizer_steps: int = 3  # warm-up steps before timing (the first allocates the moments)
    engine_depths: tuple = (1, 4)  # decoder layers: 12 and 39 parameter tensors
    # (layers, hidden) of a wider model, 44x the parameters of the deeper one for about half its tensors: the
    # engines' cost per parameter (their passes over weights and gradients: casts, copies to fp32 partitions,
    # shards). Wide enough that a flat fp32 buffer of it (41 MB) is above glibc's largest mmap threshold (32 MiB),
    # as a real model's are: such a buffer, made again every step (ZeRO-2's gradient partition, its flattened
    # copies), comes from fresh pages, each first touch a page fault (llama-125m on zero2-fp32: 8.2M minor faults in
    # an 8-step run, amp-fp32 1.7M), which a model 256 wide (1.7M parameters, its buffers reused from the heap)
    # never pays: its fits put ZeRO-2's cost per parameter at 0-1.4 ns a micro-batch where llama-125m pays several.
    engine_wide: tuple | None = (2, 640)
    engine_steps: int = 3  # timed optimizer steps per model and round, after one warm-up
    engine_rounds: int = 2  # every family's models timed once per round (see _engines)
    families: tuple = FAMILIES
    deepspeed: bool = True  # its optimizers and engines (importing it and loading its ops: seconds)
    disk_bytes: int = 128 * MiB
    in_step: bool = True  # a CPU's rates measured inside training steps (launcher.measure.stepcal)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(matmul=(32, 64, 128), matmul_gpu=(256, 512), min_time_s=0.01, attention=(1, 2, 64, 16),
                   attention_gpu=(1, 4, 256, 64), memory_bytes=4 * MiB, memory_bytes_gpu=16 * MiB, copy_bytes=4 * MiB,
                   view_chain=16, step_depths=(1, 2), optimizer_params=256 * 1024, optimizer_params_gpu=1 * MiB,
                   optimizer_tensors=(32, 256), optimizer_steps=1, engine_depths=(1, 2), engine_wide=None,
                   engine_steps=2, engine_rounds=1, families=("amp",), deepspeed=False, disk_bytes=1 * MiB,
                   in_step=False)


def nonneg_lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the best over the subsets of unknowns whose solution is >= 0."""
    import itertools

    best, best_err = [0.0] * len(rows[0]), float("inf")
    n = len(rows[0])
    for keep in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(1, n + 1)):
        a = torch.tensor([[r[i] for i in keep] for r in rows], dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        x = torch.linalg.lstsq(a, y).solution.squeeze(1).tolist()
        if any(v < 0 for v in x):
            continue
        coef = [0.0] * n
        for i, v in zip(keep, x):
            coef[i] = v
        err = sum((sum(c * r[i] for i, c in enumerate(coef)) - yy) ** 2 for r, yy in zip(rows, ys))
        if err < best_err:
            best, best_err = coef, err
    return best

def calibration(measure: bool = True, *, stale_days: float = 30, force: bool = False, directory: str | None = None,
                sizes: Sizes | None = None, output_dir: str | None = None) -> Machine | None:
    """This machine's :class:`Machine`: the cached one when it is usable, else measured now and cached
    (``measure=True``) or None (``measure=False``: :func:`launcher.machine.speeds.cached`). ``force``: measure now."""
    if not measure:
        if force:
            return None
        machine, why = speeds.cached(stale_days, directory)
        if why:
            logger.warning(why)
        return machine
    if not force:
        found = speeds.read(stale_days, directory)
        if found.problem is None:
            return found.machine
        if found.machine is None and not os.path.exists(found.path):
            logger.info("no calibration of this machine yet: measuring it now (about a minute, once)")
        else:
            logger.warning(f"calibration not used: {found.problem}; measuring this machine again")
    machine = calibrate(sizes, output_dir=output_dir)
    path = speeds.write(machine, directory)
    logger.info(f"calibration cached in {path}")
    return machine


def load_or_calibrate(stale_days: float = 30, force: bool = False, **kw) -> Machine:
    """The cached calibration, measured first (under a minute) when there is none to use."""
    return calibration(True, stale_days=stale_days, force=force, **kw)


# ------------------------------------------------------------------------------------------------
# Timing


def _sync() -> None:
    if torch.cuda.is_available():  # as torch.utils.benchmark does: the GPU's work is part of the time
        torch.cuda.synchronize()


def _once(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _time(fn, min_time: float, threads: int | None = None) -> tuple[float, float]:
    """(fastest, median) seconds of one call of ``fn`` at ``threads`` (default: the training's), repeated for
    ``min_time``. Calls under 100 us run in blocks (torch.utils.benchmark sizes them so its own cost does not
    count); longer ones one by one, so a call another process interrupted does not spoil its neighbours."""
    threads = threads or torch.get_num_threads()
    with _threads(threads):
        # Warm-up for half of min_time: on a busy CPU the first parallel ops after a pause wait ~20 ms each for
        # their threads (seen for the first 6 calls of a 64 x 64 matmul that then took 7 us), and the fastest
        # warm-up call decides how to time.
        warm, until = [], time.perf_counter() + min_time / 2
        while not warm or (min(warm) >= 1e-4 and len(warm) < 20 and time.perf_counter() < until):
            warm.append(_once(fn))
        if min(warm) < 1e-4:
            from torch.utils.benchmark import Timer

            m = Timer("fn()", globals={"fn": fn}, num_threads=threads).blocked_autorange(min_run_time=min_time)
            return min(m.times), m.median
        times = list(warm) if min(warm) > min_time / 4 else []  # long calls: a warm-up call is a sample too
        deadline = time.perf_counter() + min_time
        while len(times) < 3 or time.perf_counter() < deadline:
            times.append(_once(fn))
    return min(times), statistics.median(times)


def _time_guarded(fn, s: Sizes) -> tuple[float, float]:
    """:func:`_time`, unless a call takes over ``max_call_s``: then the faster of two calls is the sample
    (the first of a shape may include generating its kernel, as oneDNN does for bf16)."""
    first = _once(fn)
    if first > s.max_call_s:
        best = min(first, _once(fn))
        return best, best
    return _time(fn, s.min_time_s)


# ------------------------------------------------------------------------------------------------
# One device's rates


def _dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":

        cap = torch.cuda.get_device_capability(device)
        return [torch.float32] + ([torch.bfloat16] if supports_bf16(cap) else []) + (
            [torch.float16] if supports_fp16(cap) else [])
    return [torch.float32, torch.bfloat16, torch.float16]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _matmul(device: torch.device, s: Sizes, raw: dict, skipped: dict) -> dict:
    """Per dtype, the (FLOPs, FLOP/s) curve of the matmul kernel itself: each call's time less that of a
    1 x 1 matmul (the dispatch and launch one call costs; inside a training step that is ``op_s``, which
    the step-time model adds to every op, so it must not be in the rate too). A size whose time is under
    twice that overhead says nothing about the kernel (a GPU runs it while the host launches the next): left
    out, so the smallest size measured stands for those below it."""
    curves = {}
    sizes = s.matmul_gpu if device.type == "cuda" else s.matmul
    for dt in _dtypes(device):
        curve, rate, name = [], None, f"{_name(dt)}@{device.type}"
        try:
            one = torch.ones(1, 1, device=device, dtype=dt)
            call_s, _ = _time(lambda one=one: torch.mm(one, one), s.min_time_s)
        except RuntimeError as e:  # a dtype this device does not multiply
            skipped[f"matmul {name}"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            continue
        samples = raw.setdefault("matmul", {}).setdefault(name, {"call_s": call_s, "sizes": []})["sizes"]
        for n in sizes:
            flops = 2 * n ** 3
            if rate and flops / rate > s.max_call_s:
                skipped[f"matmul {name} n>={n}"] = (f"one call would take ~{flops / rate:.2g} s at "
                                                     f"{rate / 1e9:.3g} GFLOP/s (over {s.max_call_s} s)")
                break
            a = torch.randn(n, n, device=device).to(dt)
            b = torch.randn(n, n, device=device).to(dt)
            best, median = _time_guarded(lambda a=a, b=b: torch.mm(a, b), s)
            samples.append({"n": n, "best_s": best, "median_s": median})
            if best < 2 * call_s:
                continue
            rate = flops / (best - call_s)
            curve.append([float(flops), rate])
        if curve:
            curves[_name(dt)] = sorted(curve)
        else:
            skipped[f"matmul {name}"] = f"no size measurable above the {call_s * 1e6:.3g} us of a call"
    return curves


def _attention(device: torch.device, dtypes: list[str], s: Sizes, raw: dict, skipped: dict) -> dict:
    import torch.nn.functional as F

    b, h, n, d = s.attention_gpu if device.type == "cuda" else s.attention
    forward = 2 * b * h * n * n * (d + d) * (n + 1) // (2 * n)  # as memory.trace counts a causal fused kernel
    flops = forward + int(2.5 * forward)  # forward and backward
    out = {}
    for name in dtypes:
        dt = getattr(torch, name)
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, n, d, device=device, dtype=dt)

        def step(q=q, k=k, v=v, g=g):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), g)

        try:
            best, median = _time_guarded(step, s)
        except RuntimeError as e:
            skipped[f"attention {name}@{device.type}"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            continue
        out[name] = flops / best
        raw.setdefault("attention", {})[f"{name}@{device.type}"] = {"shape": [b, h, n, d], "flops": flops,
                                                                    "best_s": best, "median_s": median}
    return out


def _memory(device: torch.device, s: Sizes, raw: dict) -> float:
    n = (s.memory_bytes_gpu if device.type == "cuda" else s.memory_bytes) // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    best, median = _time(lambda: torch.add(a, b, out=c), s.min_time_s)
    raw.setdefault("memory", {})[device.type] = {"bytes": 12 * n, "best_s": best, "median_s": median}
    return 12 * n / best  # two read, one written


def _tiny_config(depth: int, hidden: int | None = None):
    from transformers import LlamaConfig

    wide = {"hidden_size": hidden, "intermediate_size": 3 * hidden} if hidden else {}
    return LlamaConfig(num_hidden_layers=depth, **{**TINY, **wide})


def _tiny_model(depth: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                hidden: int | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(depth, hidden), attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    return model.to(device) if device is not None else model


def _view_cost(device: torch.device, s: Sizes, raw: dict) -> float:
    x = torch.zeros(4, 4, device=device, requires_grad=True)

    def chain(k: int):
        def run():
            y = x
            for i in range(k):
                y = y.view(16) if i % 2 == 0 else y.view(4, 4)
            torch.autograd.grad(y.sum(), x)
        return run

    t0, _ = _time(chain(0), s.min_time_s)
    t1, _ = _time(chain(s.view_chain), s.min_time_s)
    view_s = max(0.0, (t1 - t0) / (2 * s.view_chain))  # each view: one view op forward, one backward
    raw.setdefault("view", {})[device.type] = {"chain": s.view_chain, "without_s": t0, "with_s": t1}
    return view_s


def _op_cost(device: torch.device, work_rates: Rates, view_s: float, s: Sizes, raw: dict, skipped: dict) -> float:

    rows = []
    for depth in s.step_depths:
        model = _tiny_model(depth, device=device)
        model.train()
        ids = torch.randint(0, TINY["vocab_size"], (1, TINY_SEQ), device=device)
        ops = measure_step(model, ids, target=device.type).ops

        def step(model=model, ids=ids):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

        best, median = _time(step, s.min_time_s)
        work = op_seconds(ops, work_rates, host_bound=False)[0]
        kernels = sum(c for k, c in ops.items() if k[0] != "view")
        views = sum(c for k, c in ops.items() if k[0] == "view")
        rows.append({"depth": depth, "best_s": best, "median_s": median, "work_s": work, "kernel_ops": kernels,
                     "view_ops": views})
        del model, step
    lo, hi = rows[0], rows[-1]
    if any(r["work_s"] > r["best_s"] for r in rows):
        skipped[f"op_s@{device.type}"] = ("the roofline prices the tiny model's work above its measured time (small "
                                          "matmuls measured slow: a contended CPU?); op_s is then too low")
    fixed = (hi["best_s"] - hi["work_s"]) - (lo["best_s"] - lo["work_s"])
    op_s = max(0.0, (fixed - (hi["view_ops"] - lo["view_ops"]) * view_s) / max(1, hi["kernel_ops"] - lo["kernel_ops"]))
    whole = max(0.0, (lo["best_s"] - lo["work_s"] - lo["view_ops"] * view_s) / max(1, lo["kernel_ops"]))
    raw.setdefault("op", {})[device.type] = {"steps": rows, "op_s_per_layer": op_s, "op_s_whole_model": whole}
    return op_s


def _contention(s: Sizes, raw: dict) -> None:
    """Warn when other processes keep the CPU busy: then every parallel op waits for a thread the scheduler has
    put aside, and a 256 x 256 matmul that takes 0.3 ms on one thread took 20 ms on two (2-core EPYC, load
    average 9). Training at those threads would be slowed as much, so the numbers are not this machine's."""
    threads = torch.get_num_threads()
    if threads == 1:
        return
    a = torch.randn(256, 256)
    many, _ = _time(lambda: torch.mm(a, a), s.min_time_s)
    one, _ = _time(lambda: torch.mm(a, a), s.min_time_s, threads=1)
    raw["contention"] = {"matmul_256_s": {str(threads): many, "1": one}}
    if many > one:
        logger.warning(f"the CPU is contended: a 256 x 256 matmul takes {many * 1e3:.3g} ms on {threads} threads and "
                       f"{one * 1e3:.3g} ms on one; the speeds measured now are a busy machine's (training at "
                       f"{threads} threads would be as slow); calibrate when it is idle, or train with fewer threads "
                       "(OMP_NUM_THREADS)")


def measure_rates(device: torch.device, s: Sizes, raw: dict, skipped: dict) -> Rates:
    """Every rate of :class:`Rates` for ``device`` (see the module docstring)."""
    if device.type == "cpu":
        _contention(s, raw)
    matmul = _matmul(device, s, raw, skipped)
    attention = _attention(device, list(matmul), s, raw, skipped)
    memory = _memory(device, s, raw)
    work = Rates(device=device.type, matmul=matmul, attention=attention, memory_bytes_per_s=memory)
    view_s = _view_cost(device, s, raw)
    op_s = _op_cost(device, work, view_s, s, raw, skipped)
    rates = dataclasses.replace(work, op_s=op_s, view_s=view_s)
    if device.type != "cpu" or not s.in_step:
        return rates
    found = stepcal.measure(rates, view_s, raw, skipped)
    return dataclasses.replace(rates, matmul={**rates.matmul, **found["matmul"]},
                               attention={**rates.attention, **found["attention"]}, step_costs=found["step_costs"])


# ------------------------------------------------------------------------------------------------
# Copies, optimizers, disk


def _copies(gpu: bool, s: Sizes, raw: dict, skipped: dict) -> tuple[dict, dict]:
    n = s.copy_bytes // 4
    if not gpu:  # DeepSpeed's offload on the CPU: gradients into CPU buffers, a host memcpy; pinning needs CUDA
        src, dst = torch.rand(n), torch.empty(n)
        best, median = _time(lambda: dst.copy_(src), s.min_time_s)
        raw["copy"] = {"host": {"bytes": 4 * n, "best_s": best, "median_s": median}}
        rate = 4 * n / best
        return {"pinned": rate, "pageable": rate}, {"pinned": rate, "pageable": rate}

    dev = torch.empty(n, device="cuda")
    h2d, d2h = {}, {}
    pin, why = pin_memory_ok(probe(), 2 * 4 * n)
    for link in ("pinned", "pageable"):
        if link == "pinned" and not pin:
            skipped["copy pinned"] = why
            continue
        pinned = link == "pinned"  # a pinned copy is asynchronous; the timer synchronizes after each block
        host = torch.rand(n, pin_memory=pinned)
        up, _ = _time(lambda host=host, nb=pinned: dev.copy_(host, non_blocking=nb), s.min_time_s)
        down, _ = _time(lambda host=host, nb=pinned: host.copy_(dev, non_blocking=nb), s.min_time_s)
        h2d[link], d2h[link] = 4 * n / up, 4 * n / down
        raw.setdefault("copy", {})[link] = {"bytes": 4 * n, "h2d_s": up, "d2h_s": down}
    return h2d, d2h


def _op_built(name: str) -> str | None:
    """None when DeepSpeed's op ``name`` loads without compiling (installed with DeepSpeed, or JIT-built and up
    to date for the ninja runs use); else why not. Loading an unbuilt op compiles it, minutes: calibration
    never does that."""

    try:
        st = op_state(name, use_env_ninja())
    except Exception as e:  # noqa: BLE001 -- DeepSpeed not importable: the caller asked deepspeed_status first
        return f"{type(e).__name__}: {e}"
    if not st.compiles:
        return None
    return (f"DeepSpeed's {name} op is {st.state}{': ' + st.detail if st.state == 'stale' else ''} (vramfit doctor "
            "--build-ops builds it, minutes once)")


def optimizer_factories(gpu: bool, deepspeed: bool = True) -> list[tuple[str, str, object, str | None]]:
    """(key in Machine.optimizers, device, factory(params) or None, why not) for each optimizer a profile
    can step with here (keys as :func:`launcher.plan.steptime.optimizer_kind` names them)."""

    kw = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    out = [("torch_fused_adamw@cpu", "cpu", lambda ps: torch.optim.AdamW(ps, fused=True, **kw), None)]
    if gpu:
        out.insert(0, ("torch_fused_adamw@cuda", "cuda", lambda ps: torch.optim.AdamW(ps, fused=True, **kw), None))
    _ver, err = deepspeed_status() if deepspeed else (None, "left out (a quick calibration)")
    if err:
        why = f"DeepSpeed {err}" if deepspeed else err
        out += [("deepspeed_cpu_adam@cpu", "cpu", None, why),
                (f"deepspeed_fused_adam@{'cuda' if gpu else 'cpu'}", "cuda" if gpu else "cpu", None, why)]
        return out
    remember_cpu_info()  # each DeepSpeed optimizer and op load would probe the CPU again: seconds each
    why = _op_built("cpu_adam")

    def cpu_adam(ps):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(ps, adamw_mode=True, **kw)

    def fused_adam(ps):
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(ps, adam_w_mode=True, **kw)

    out.append(("deepspeed_cpu_adam@cpu", "cpu", None if why else cpu_adam, why))
    # FusedAdam steps where DeepSpeed's accelerator is: its CUDA kernel on a GPU host, its CPU build without one
    why = _op_built("fused_adam")
    where = "cuda" if gpu else "cpu"
    out.append((f"deepspeed_fused_adam@{where}", where, None if why else fused_adam, why))
    return out


def _optimizer_params(sizes: list[int], where: str) -> list[torch.nn.Parameter]:
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=where) * 0.02)
        p.grad = torch.randn(n, device=where) * 1e-3
        params.append(p)
    return params


def _optimizers(gpu: bool, s: Sizes, raw: dict, skipped: dict) -> dict:
    out = {}
    count, size = s.optimizer_tensors
    made: dict = {}  # where -> [(label, params)], made once and stepped by every optimizer there
    for key, where, factory, why in optimizer_factories(gpu, s.deepspeed):
        if factory is None:
            skipped[key] = why
            continue
        big_n = s.optimizer_params_gpu if where == "cuda" else s.optimizer_params
        if where not in made:
            made[where] = [(label, _optimizer_params(sizes, where))
                           for label, sizes in (("one_tensor", [big_n]), ("small_tensors", [size] * count))]
        rows, ys, samples, opt = [], [], {}, None
        try:
            for label, params in made[where]:
                if opt is None:
                    opt = factory(params)
                else:
                    # One optimizer steps both sets in turn: its group takes the next set, its state (the moments)
                    # starts empty. DeepSpeed's optimizers load their op and probe the CPU (py-cpuinfo) on every
                    # construction: 2.4 s for each of them on a 2-core Xeon.
                    opt.param_groups[0]["params"] = params
                    opt.state.clear()
                for _ in range(s.optimizer_steps):  # the first steps allocate the moments
                    opt.step()
                best, median = _time(opt.step, s.min_time_s)
                rows.append([float(sum(p.numel() for p in params)), float(len(params))])
                ys.append(best)
                samples[label] = {"params": int(rows[-1][0]), "tensors": len(params), "best_s": best,
                                  "median_s": median}
        except Exception as e:  # noqa: BLE001 -- an optimizer that fails here is reported, not fatal to the rest
            skipped[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        finally:
            del opt
        out[key] = nonneg_lstsq(rows, ys)
        raw.setdefault("optimizers", {})[key] = samples
    return out


def _disk(output_dir: str, s: Sizes, raw: dict, skipped: dict) -> float | None:
    folder = os.path.abspath(output_dir)
    while not os.path.isdir(folder):  # the run directory may not exist yet: its nearest existing parent
        folder = os.path.dirname(folder)
    chunk = os.urandom(min(8 * MiB, s.disk_bytes))
    try:
        fd, path = tempfile.mkstemp(dir=folder, prefix=".vramfit-disk-")
    except OSError as e:
        skipped["disk"] = f"cannot write in {folder}: {e}"
        return None
    try:
        t = time.perf_counter()
        with os.fdopen(fd, "wb") as fh:
            for _ in range(max(1, s.disk_bytes // len(chunk))):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        took = time.perf_counter() - t
        written = max(1, s.disk_bytes // len(chunk)) * len(chunk)
    finally:
        os.remove(path)
    raw["disk"] = {"folder": folder, "bytes": written, "seconds": took}
    return written / took


# ------------------------------------------------------------------------------------------------
# Engines


def profile_for(fam: str, gpu_bf16: bool | None):
    """The catalogue profile that stands for engine family ``fam``: fp32 where the CPU has one, else bf16
    (fp16 on a GPU without bf16). ``gpu_bf16``: None on a CPU-only machine."""

    cpu = gpu_bf16 is None
    p16 = "bf16" if cpu or gpu_bf16 else "fp16"
    exact = "fp32" if cpu else p16
    if "@" in fam:  # 'family@precision': that family at that precision
        fam, exact = fam.split("@")
        p16 = exact
    return PROFILES[{"amp": f"amp-{exact}", "zero2": f"zero2-{exact}", "zero2_offload": f"zero2-{p16}-offload-opt",
                     "zero3_offload": f"zero3-{p16}-offload-all", "fsdp": f"fsdp-{p16}-offload"}[fam]]


def _engine_problem(p, cfg, hw, device) -> str | None:

    problem = profile_problem(p, cfg, hw, device)
    if problem or p.engine != "deepspeed":
        return problem
    needed = []  # the catalogue's profiles step with torch's fused AdamW: no Adam op
    if device.type == "cpu":
        needed.append("deepspeed_shm_comm")  # DeepSpeed's CPU accelerator loads it with the process group
    for op in needed:
        why = _op_built(op)
        if why:
            return why
    return None


def _predicted(p, machine: Machine, depth: int, device: torch.device, pinned: bool, hidden: int | None = None):
    """(per micro-batch, per step) seconds the step-time model gives the tiny model at ``depth`` (and ``hidden``)
    without any engine fixed cost, from the planner's own trace of it, its parameter tensors and parameters."""

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    run = stepcal.run_shape(_tiny_config(depth, hidden), p.precision, 2, TINY_SEQ, device.type, cap)
    counts = run.counts
    est = planner._activations(run, planner._family(p), 1)
    t = predict(p, machine, ops=planner._ops(est, run), counts=counts, micro_batch=1, accumulation=2,
                seq_len=TINY_SEQ, pinned=pinned)
    return t.micro_batch_s, t.step_s - 2 * t.micro_batch_s, counts.trainable_tensors, counts.total


def _time_engine(p, cfg, hw, device: torch.device, depth: int, s: Sizes, hidden: int | None = None) -> dict:
    """Build the engine of ``p`` around the tiny model once and time ``s.engine_steps`` optimizer steps of
    two micro-batches each, call by call, after one warm-up step."""

    spec = RunSpec(device=device, precision=p.precision, profile=p, micro_batch=1, accumulation=2, world=1,
                   checkpointing=False)
    model = _tiny_model(depth, weight_dtype(p.engine, p.precision, cfg.lora.r > 0), hidden=hidden)
    n = sum(q.numel() for q in model.parameters())
    t = time.perf_counter()
    engine, _ = engines.build(cfg, spec, model, hw, hidden or TINY["hidden_size"], LR)
    built = time.perf_counter() - t
    ids = torch.randint(0, TINY["vocab_size"], (1, TINY_SEQ))
    batch = {"input_ids": ids, "labels": ids}
    micro, rest = [], []
    try:
        for i in range(1 + s.engine_steps):
            _sync()
            t0 = time.perf_counter()
            engine.forward_backward(batch, 2)
            _sync()
            t1 = time.perf_counter()
            engine.forward_backward(batch, 2)
            engine.step(LR)
            _sync()
            t2 = time.perf_counter()
            if i:  # the first step allocates the optimizer's state
                micro.append(t1 - t0)
                rest.append(t2 - t1)
    finally:
        engine.close()
        del engine, model
        gc.collect()
    pinned = p.offloads and pin_memory_ok(hw, 16 * n)[0]
    return {"depth": depth, "hidden": hidden or TINY["hidden_size"], "build_s": built, "micro_s": micro,
            "boundary_and_step_s": rest, "pinned": pinned}


@contextlib.contextmanager
def _frozen_heap():
    """Within: ``gc.collect()`` walks only the objects made inside. Each engine timed is freed with a full
    collection (DeepSpeed's engines hold reference cycles), and with torch, transformers and DeepSpeed loaded a
    full collection walks about 390,000 objects: 0.28 s each on a 2-core Xeon, 36 of them 10 s of the engines'
    part. ``gc.freeze`` sets aside every object made before (none of the engines' garbage) until the end."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _engines(machine: Machine, device: torch.device, s: Sizes, raw: dict, skipped: dict) -> dict:
    """Each family's fixed costs. The families are timed in ``s.engine_rounds`` rounds, each round timing every
    family's models once, and each model keeps its fastest step over all rounds: a stretch of seconds in which
    the machine is slowed (a neighbour, the hypervisor) slows every step of the model timed then, and its
    fastest step with them. On a 2-core box one such stretch made the FSDP family's wide model 2.3-2.9x slower
    than in the two calibrations before, and its cost per parameter, carried to a 125M-parameter model, priced
    3.6 s a micro-batch that were never paid."""
    cfg = load_config(None, [f"device={device.type}"])
    hw = probe()
    gpu = hw.gpu(device.index or 0) if device.type == "cuda" else None
    extra = [f for f in CPU_EXTRA if f.split("@")[0] in s.families] if gpu is None else []
    models = [(d, None) for d in s.engine_depths] + ([s.engine_wide] if s.engine_wide else [])
    families, runs, seconds = {}, {}, {}
    for fam in (*s.families, *extra):
        p = profile_for(fam, gpu.bf16 if gpu else None)
        problem = _engine_problem(p, cfg, hw, device) if s.deepspeed or p.engine != "deepspeed" else (
            "left out (a quick calibration)")
        if problem:
            skipped[f"engine {fam}"] = f"{p.name}: {problem}"
        else:
            families[fam], runs[fam], seconds[fam] = p, [None] * len(models), 0.0
    with _frozen_heap():  # each _time_engine ends in gc.collect()
        for _ in range(s.engine_rounds):
            for fam, p in list(families.items()):
                t = time.perf_counter()
                try:
                    for i, (depth, hidden) in enumerate(models):
                        run = _time_engine(p, cfg, hw, device, depth, s, hidden)
                        if runs[fam][i] is None:
                            runs[fam][i] = {**run, "build_s": [run["build_s"]]}
                        else:
                            kept = runs[fam][i]
                            kept["build_s"].append(run["build_s"])
                            kept["micro_s"] += run["micro_s"]
                            kept["boundary_and_step_s"] += run["boundary_and_step_s"]
                except Exception as e:  # noqa: BLE001 -- one engine that fails here is reported, the others still measured
                    skipped[f"engine {fam}"] = f"{p.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    del families[fam]
                finally:
                    engines.restore_globals()  # ZeRO-3 replaces torch.nn.functional.linear for the whole process
                    seconds[fam] += time.perf_counter() - t
    out = {}
    for fam, p in families.items():
        micro_rows, step_rows = [], []
        for (depth, hidden), run in zip(models, runs[fam]):
            pred_micro, pred_step, tensors, params = _predicted(p, machine, depth, device, run["pinned"], hidden)
            m = min(run["micro_s"])
            st = min(run["boundary_and_step_s"]) - m
            run.update(tensors=tensors, params=params, predicted_micro_s=pred_micro, predicted_step_s=pred_step)
            micro_rows.append(([1.0, float(tensors), float(params)], m - pred_micro))
            step_rows.append(([1.0, float(tensors), float(params)], st - pred_step))
        if not s.engine_wide:  # two models: no per-parameter term
            micro_rows = [(r[:2], y) for r, y in micro_rows]
            step_rows = [(r[:2], y) for r, y in step_rows]
        micro = nonneg_lstsq([r for r, _ in micro_rows], [y for _, y in micro_rows]) + [0.0]
        step = nonneg_lstsq([r for r, _ in step_rows], [y for _, y in step_rows]) + [0.0]
        out[fam] = {"micro_s": micro[0], "micro_tensor_s": micro[1], "micro_param_s": micro[2], "step_s": step[0],
                    "step_tensor_s": step[1], "step_param_s": step[2]}
        raw.setdefault("engines", {})[fam] = {"profile": p.name, "runs": runs[fam], "seconds": seconds[fam],
                                              "rounds": s.engine_rounds}
        logger.info(f"calibrate: engine {fam} ({p.name}) in {seconds[fam]:.1f} s")
    return out


# ------------------------------------------------------------------------------------------------
# The whole calibration


def calibrate(sizes: Sizes | None = None, output_dir: str | None = None) -> Machine:
    """Measure this machine now (see the module docstring); nothing is cached here."""

    s = sizes or (Sizes.quick() if os.environ.get("VRAMFIT_CALIBRATE_QUICK") else Sizes())
    start = time.perf_counter()
    load_before = os.getloadavg()
    cores = os.cpu_count() or 1
    if load_before[0] > 0.5 * cores:
        logger.warning(f"load average {load_before[0]:.1f} on {cores} cores: other processes are using the CPU, so "
                       "the speeds measured now are lower than this machine's; calibrate again when it is idle")
    raw: dict = {}
    skipped: dict = {}
    seconds: dict = {}
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")

    def part(name, fn):
        t = time.perf_counter()
        value = fn()
        seconds[name] = round(time.perf_counter() - t, 3)
        logger.info(f"calibrate: {name} in {seconds[name]:.1f} s")
        return value

    compute = part(f"{device.type} rates", lambda: measure_rates(device, s, raw, skipped))
    # a GPU host's CPU steps no forward or backward: its looped rates price what it does (optimizer, copies)
    host = part("cpu rates", lambda: measure_rates(torch.device("cpu"), dataclasses.replace(s, in_step=False), raw,
                                                   skipped)) if gpu else compute
    h2d, d2h = part("copies", lambda: _copies(gpu, s, raw, skipped))
    optimizers = part("optimizers", lambda: _optimizers(gpu, s, raw, skipped))
    threads = torch.get_num_threads()
    cpu = f"cpu: {speeds.cpu_model()} ({threads} threads)"
    name = f"{torch.cuda.get_device_name(0)}, host {cpu}" if gpu else cpu
    machine = Machine(name=name, source="", compute=compute, host=host, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                      optimizers=optimizers, threads=threads)
    engine_costs = part("engines", lambda: _engines(machine, device, s, raw, skipped))
    out_dir = output_dir or load_config(None, []).output_dir
    disk = part("disk", lambda: _disk(out_dir, s, raw, skipped))
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for mod in ("deepspeed", "transformers"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod)
        except Exception:  # noqa: BLE001 -- not installed
            versions[mod] = None
    now = time.time()
    measured = {"date": speeds.date_text(now), "seconds": round(time.perf_counter() - start, 1), "parts_s": seconds,
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()], "cores": cores, "versions": versions,
                "key": speeds.machine_key(), "sizes": dataclasses.asdict(s), "skipped": skipped, "samples": raw}
    logger.info(f"calibrate: {name} measured in {measured['seconds']:.0f} s")
    return dataclasses.replace(machine, engines=engine_costs, disk_write_bytes_per_s=disk, measured=measured,
                               source=f"calibrated {speeds.date_text(now)} on {name}")
