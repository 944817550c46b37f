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
* **optimizers**: one AdamW step, fp32 parameters with gradients, for each kind :func:`launcher.plan.families.optimizer_kind`
  names (torch fused AdamW on each device that can run it, DeepSpeedCPUAdam, DeepSpeed's FusedAdam), at the
  thread count training uses: one tensor of 16M parameters (per-parameter cost; its 256 MiB of state do not
  fit in a cache) and 512 tensors of 1024 (per-tensor cost), the two solved for [seconds per parameter,
  seconds per tensor]. The approach of ``scripts/bench_optimizers.py``: fp32 parameters with fp32 gradients,
  warm-up steps that allocate the moments, then timed steps.
* **engines**: each engine family's own fixed cost per micro-batch and per optimizer step, fixed, per
  parameter tensor and per parameter: real engines (``launcher.engines.build``) around tiny Llamas of two
  depths (different tensor counts) and a wider one (``engine_wide``: many more parameters per tensor),
  accumulation 2, several steps timed call by call, in two rounds over all the families (each model keeps
  its fastest step of both, see :func:`launcher.measure.engine_costs.measure`): the non-boundary micro-batch is the micro-batch cost;
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

import dataclasses
import os
import platform
import tempfile
import time

import torch

from launcher.config.load import load_config
from launcher.log import logger
from launcher.machine import speeds, threads
from launcher.machine.deepspeed_ops import deepspeed_status, remember_cpu_info
from launcher.machine.hardware import pin_memory_ok, probe
from launcher.machine.speeds import Machine, Rates
from launcher.measure import engine_costs, stepcal, timing
from launcher.measure.timing import LR, TINY, TINY_SEQ, MiB, Sizes, nonneg_lstsq
from launcher.plan.memory.trace import measure_step
from launcher.plan.steptime import op_seconds
from launcher.precision import supports_bf16, supports_fp16


def calibration(measure: bool = True, *, stale_days: float = 30, force: bool = False, directory: str | None = None,
                sizes: Sizes | None = None, output_dir: str | None = None) -> Machine | None:
    """This machine's :class:`Machine`: the cached one when it is usable, else measured now and cached
    (``measure=True``) or None (``measure=False``: :func:`launcher.machine.speeds.cached`). ``force`` (``vramfit
    doctor --calibrate``): measure now, and once more when other processes made the first doubtful; the less
    doubtful of the two is kept, flagged if it still is (doctor, plans and summaries say so)."""
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
    if force and machine.doubtful:
        logger.info("calibrating once more, the machine was busy")
        again = calibrate(sizes, output_dir=output_dir)
        busy = lambda m: m.measured["cpu_use"]["others_busy_cores"] + m.measured["cpu_use"]["steal_share"]  # noqa: E731
        machine = min((machine, again), key=lambda m: (m.doubtful is not None, busy(m)))
    path = speeds.write(machine, directory)
    logger.info(f"calibration cached in {path}")
    return machine


def load_or_calibrate(stale_days: float = 30, force: bool = False, **kw) -> Machine:
    """The cached calibration, measured first (under a minute) when there is none to use."""
    return calibration(True, stale_days=stale_days, force=force, **kw)


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
            call_s, _ = timing.best_of(lambda one=one: torch.mm(one, one), s.min_time_s)
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
            best, median = timing.best_of_guarded(lambda a=a, b=b: torch.mm(a, b), s)
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
    forward = 2 * b * h * n * n * (d + d) * (n + 1) // (2 * n)  # as memory.tracker counts a causal fused kernel
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
            best, median = timing.best_of_guarded(step, s)
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
    best, median = timing.best_of(lambda: torch.add(a, b, out=c), s.min_time_s)
    raw.setdefault("memory", {})[device.type] = {"bytes": 12 * n, "best_s": best, "median_s": median}
    return 12 * n / best  # two read, one written


def _view_cost(device: torch.device, s: Sizes, raw: dict) -> float:
    x = torch.zeros(4, 4, device=device, requires_grad=True)

    def chain(k: int):
        def run():
            y = x
            for i in range(k):
                y = y.view(16) if i % 2 == 0 else y.view(4, 4)
            torch.autograd.grad(y.sum(), x)
        return run

    t0, _ = timing.best_of(chain(0), s.min_time_s)
    t1, _ = timing.best_of(chain(s.view_chain), s.min_time_s)
    view_s = max(0.0, (t1 - t0) / (2 * s.view_chain))  # each view: one view op forward, one backward
    raw.setdefault("view", {})[device.type] = {"chain": s.view_chain, "without_s": t0, "with_s": t1}
    return view_s


def _op_cost(device: torch.device, work_rates: Rates, view_s: float, s: Sizes, raw: dict, skipped: dict) -> float:

    rows = []
    for depth in s.step_depths:
        model = timing.tiny_model(depth, device=device)
        model.train()
        ids = torch.randint(0, TINY["vocab_size"], (1, TINY_SEQ), device=device)
        ops = measure_step(model, ids, target=device.type).ops

        def step(model=model, ids=ids):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

        best, median = timing.best_of(step, s.min_time_s)
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
    n_threads = torch.get_num_threads()
    if n_threads == 1:
        return
    a = torch.randn(256, 256)
    many, _ = timing.best_of(lambda: torch.mm(a, a), s.min_time_s)
    one, _ = timing.best_of(lambda: torch.mm(a, a), s.min_time_s, threads=1)
    raw["contention"] = {"matmul_256_s": {str(n_threads): many, "1": one}}
    if many > one:
        logger.warning(f"the CPU is contended: a 256 x 256 matmul takes {many * 1e3:.3g} ms on {n_threads} threads and "
                       f"{one * 1e3:.3g} ms on one; the speeds measured now are a busy machine's (training at "
                       f"{n_threads} threads would be as slow); calibrate when it is idle, or train with fewer threads "
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
        best, median = timing.best_of(lambda: dst.copy_(src), s.min_time_s)
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
        up, _ = timing.best_of(lambda host=host, nb=pinned: dev.copy_(host, non_blocking=nb), s.min_time_s)
        down, _ = timing.best_of(lambda host=host, nb=pinned: host.copy_(dev, non_blocking=nb), s.min_time_s)
        h2d[link], d2h[link] = 4 * n / up, 4 * n / down
        raw.setdefault("copy", {})[link] = {"bytes": 4 * n, "h2d_s": up, "d2h_s": down}
    return h2d, d2h


def optimizer_factories(gpu: bool, deepspeed: bool = True) -> list[tuple[str, str, object, str | None]]:
    """(key in Machine.optimizers, device, factory(params) or None, why not) for each optimizer a profile
    can step with here (keys as :func:`launcher.plan.families.optimizer_kind` names them)."""

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
    why = timing.op_built("cpu_adam")

    def cpu_adam(ps):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(ps, adamw_mode=True, **kw)

    def fused_adam(ps):
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(ps, adam_w_mode=True, **kw)

    out.append(("deepspeed_cpu_adam@cpu", "cpu", None if why else cpu_adam, why))
    # FusedAdam steps where DeepSpeed's accelerator is: its CUDA kernel on a GPU host, its CPU build without one
    why = timing.op_built("fused_adam")
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
                best, median = timing.best_of(opt.step, s.min_time_s)
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
# The whole calibration


def calibrate(sizes: Sizes | None = None, output_dir: str | None = None) -> Machine:
    """Measure this machine now (see the module docstring); nothing is cached here."""

    s = sizes or (Sizes.quick() if os.environ.get("VRAMFIT_CALIBRATE_QUICK") else Sizes())
    start = time.perf_counter()
    watch = threads.Watch()  # other processes' CPU use while measuring: a busy machine's speeds are not its own
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
    n_threads = torch.get_num_threads()
    cpu = f"cpu: {speeds.cpu_model()} ({n_threads} threads)"
    name = f"{torch.cuda.get_device_name(0)}, host {cpu}" if gpu else cpu
    machine = Machine(name=name, source="", compute=compute, host=host, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                      optimizers=optimizers, threads=n_threads)
    fixed_costs = part("engines", lambda: engine_costs.measure(machine, device, s, raw, skipped))
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
    use = watch.stop()
    contended = any(v["matmul_256_s"][k] > v["matmul_256_s"]["1"] for v in [raw.get("contention")] if v
                    for k in v["matmul_256_s"] if k != "1")
    doubtful = speeds.doubt(use.others_busy_cores, use.steal_share, cores, contended)
    if doubtful:
        logger.warning(f"calibration doubtful: {doubtful}; its speeds are lower than this machine's when idle")
    measured = {"date": speeds.date_text(now), "doubtful": doubtful, "cpu_use": use.to_dict(),
                "seconds": round(time.perf_counter() - start, 1), "parts_s": seconds,
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()], "cores": cores, "versions": versions,
                "key": speeds.machine_key(), "sizes": dataclasses.asdict(s), "skipped": skipped, "samples": raw}
    logger.info(f"calibrate: {name} measured in {measured['seconds']:.0f} s")
    return dataclasses.replace(machine, engines=fixed_costs, disk_write_bytes_per_s=disk, measured=measured,
                               source=f"calibrated {speeds.date_text(now)} on {name}")
