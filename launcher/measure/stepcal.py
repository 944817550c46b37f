"""The prices of a training step's ops on the CPU, measured inside real forward + backward passes.

A matmul timed alone in a loop runs with hot caches and with threads that never sleep. Inside a training
step the same op reads operands other ops just wrote, backward reads them transposed, and every parallel
region first wakes threads the Python between ops let sleep: on a 2-core Xeon the matmuls of a tiny Llama's
step ran at 1.5-3.5x their looped time, and the fused attention kernel in bf16 at a tenth of the rate a
looped call reached. Priced by the looped rates, every CPU step was predicted 20-60% short. So on a CPU
(the GPU keeps the looped rates: its host runs ahead of the kernels) the step-time model's rates come from
steps:

* a Llama at four sizes (:data:`REFERENCE`: hidden 64 at 1 and 4 layers, where nothing but the fixed costs
  counts, then hidden 128 to 1024, the largest with a 16k vocabulary so the head's matmul is priced too),
  forward + backward as the AMP engine runs it (``torch.autocast`` for bf16), per precision the CPU runs;
* ``torch.profiler`` attributes the step's time: each matmul shape's self time gives a (FLOPs, FLOP/s) point
  of the **matmul curve**; the fused attention kernels' self time over the FLOPs the planner's trace counts
  for them gives the **attention rate**;
* what is left of the step's wall time (elementwise ops, casts, views, autograd, transformers' Python) is
  split (:func:`fit_step_costs`) into a **fixed cost per kernel op** and a **cost paid once per forward +
  backward** (from the smallest model at its two depths) and an **elementwise rate** (bytes per second, the
  median over the larger steps), with the kernel ops, view ops and bytes counted
  by the planner's own trace of the same models: the same records the step-time model prices, so nothing is
  counted twice or left out. The engines' own passes over gradients and weights are priced at that
  elementwise rate too (they run between the step's ops).

These are machine constants measured on models of their own, as the looped ones were; nothing is fitted to
the runs that validate the model (``scripts/validate_steptime.py``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from launcher.log import logger

# The steps measured (hidden, intermediate, heads, kv heads, vocabulary, decoder layers, batch, sequence). The
# smallest, at 1 and 4 layers, does almost no work: its two steps tell the cost of an op from what a step
# pays once (the loss, the mask, the call into the model); the three larger ones then tell the bytes' cost.
_OPS = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            batch=1, seq=8)
REFERENCE = (
    {**_OPS, "layers": 1},
    {**_OPS, "layers": 4},
    dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
         layers=2, batch=2, seq=128),
    dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
         layers=2, batch=2, seq=128),
    dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
         vocab_size=16384, layers=2, batch=1, seq=256),
)
MATMULS = {"aten::mm": "mm", "aten::addmm": "addmm", "aten::bmm": "bmm", "aten::baddbmm": "baddbmm"}
MIN_TIME_S = 0.3  # each step is timed for at least this long (and at least ``steps`` times)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _config(ref: dict):
    from transformers import LlamaConfig

    c = {k: v for k, v in ref.items() if k not in ("batch", "seq", "layers")}
    return LlamaConfig(num_hidden_layers=ref["layers"], max_position_embeddings=ref["seq"], tie_word_embeddings=False, **c)


def _matmul_flops(kind: str, shapes: list) -> int:
    """FLOPs of one matmul call from the input shapes torch's profiler records."""
    a, b = (shapes[1], shapes[2]) if kind in ("addmm", "baddbmm") else (shapes[0], shapes[1])
    if kind in ("bmm", "baddbmm"):
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[0] * a[1] * b[1]


def run_shape(config, precision: str, batch: int, seq: int, device: str = "cpu", capability: tuple = (0, 0)):
    """The planner's view of a plain full fine-tune of ``config`` (one rank, no checkpointing, sdpa): what the
    calibration's own models are traced and priced as."""
    from launcher.plan.memory.shape import count_params
    from launcher.plan.memory.states import RunShape

    return RunShape(config=config, counts=count_params(config), device=device, capability=capability,
                    precision=precision, seq_len=seq, global_batch=batch, world=1, checkpointing=False,
                    attn_implementation="sdpa", lora_r=0, lora_targets=("all-linear",), lora_dropout=0.0,
                    quantize="none", optimizer="adamw", trust_remote_code=False)


def _traced_ops(config, precision: str, batch: int, seq: int) -> dict:
    """The planner's op record of this model's micro-batch (what the step-time model will price)."""
    from launcher.plan import run_activations

    run = run_shape(config, precision, batch, seq)
    return run_activations.ops_of(run_activations.activations(run, "amp", batch), run)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (what C++ code writes there too), restored after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def reference_model(ref: dict):
    """The Llama ``ref`` in fp32, in training mode (seeded: the same weights every time)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(ref), attn_implementation="sdpa")
    model.config.use_cache = False
    return model.train()


def step_fn(ref: dict, precision: str, model=None):
    """A forward + backward of the Llama ``ref`` as the AMP engine runs it (``torch.autocast`` for bf16), as a
    function of no arguments (also timed by ``scripts/bench_process_spread.py``). ``model``: that of
    :func:`reference_model`, made already (the largest takes a second to make)."""
    model = model if model is not None else reference_model(ref)
    config = model.config
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (ref["batch"], ref["seq"]))
    dtype = PRECISIONS[precision]

    def step():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _priced(name: str) -> bool:
    return name in MATMULS or ("scaled_dot_product" in name and "flash_attention" in name)


def self_times(prof, wanted) -> list[tuple[str, list, float]]:
    """(name, input shapes, self seconds) of each CPU op call ``wanted(name)`` accepts in a stopped
    ``torch.profiler`` run: its time less that of the calls nested directly in it on its thread, what
    ``prof.events()`` gives as ``self_cpu_time_total``. Read from the profiler's raw records: ``events()`` builds a
    Python object and a tree of every call first, 0.1-1 s for each profiled reference step here (3000-8000
    calls), about 5 s of a calibration, for the two hundred calls priced."""
    from torch.autograd import DeviceType

    threads: dict = defaultdict(list)
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CPU:
            threads[e.start_thread_id()].append(e)
    out = []
    for events in threads.values():
        events.sort(key=lambda e: (e.start_ns(), -e.end_ns()))
        stack: list = []  # [event, nanoseconds of its direct children]

        def close(item):
            e, children = item
            if wanted(e.name()):
                out.append((e.name(), e.shapes(), (e.duration_ns() - children) / 1e9))

        for e in events:
            while stack and stack[-1][0].end_ns() <= e.start_ns():
                close(stack.pop())
            if stack:
                stack[-1][1] += e.duration_ns()
            stack.append([e, 0])
        while stack:
            close(stack.pop())
    return out


def _measure(ref: dict, precision: str, steps: int, profiled: int, model=None) -> dict:
    """Wall time of a step (median of ``steps``) and its profiler attribution over ``profiled`` steps (each op
    shape priced at the median of its calls)."""
    from torch.profiler import ProfilerActivity, profile

    step = step_fn(ref, precision, model)
    for _ in range(2):
        step()
    times, until = [], time.perf_counter() + MIN_TIME_S
    while len(times) < steps or time.perf_counter() < until:  # a step of milliseconds is timed many times
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with _quiet_stderr():  # its C++ side prints a line at start and at stop, for every profile (torch 2.13)
        prof.start()
    try:
        for _ in range(profiled):
            step()
    finally:
        with _quiet_stderr():
            prof.stop()
    # Each call's self time, by op and input shapes. A call's price is the median over the calls of its shape:
    # on a shared machine one call the scheduler preempted can take longer than the whole step, and a sum or
    # mean over the profiled steps would hand that to every call of the shape.
    calls: dict = defaultdict(list)
    for name, shapes, self_s in self_times(prof, _priced):
        calls[(name, str(shapes))].append((self_s, shapes))
    matmuls: list = []  # [flops, seconds per call]
    mm_s = attention_s = 0.0
    for (name, _), timed in calls.items():
        per_call = statistics.median(s for s, _ in timed)
        per_step = per_call * len(timed) / profiled
        if name in MATMULS:
            try:
                flops = _matmul_flops(MATMULS[name], timed[0][1])
            except (IndexError, TypeError):
                continue
            matmuls.append([flops, per_call])
            mm_s += per_step
        else:
            attention_s += per_step
    return {"config": {k: v for k, v in ref.items()}, "precision": precision, "step_s": statistics.median(times),
            "step_best_s": min(times), "matmul_s": mm_s, "attention_s": attention_s,
            "matmul_calls": matmuls}


def fit_step_costs(rows: list, floor_per_byte: float) -> tuple[float, float, float]:
    """(seconds per kernel op, seconds per byte, seconds once per step) from ``rows`` of ([kernel ops, bytes,
    1], seconds left of the step), each unknown from the steps it dominates (a joint least-squares fit of the
    three was ill-conditioned: the per-op cost came out at 0 in one calibration and 16 us in the next):

    * the two steps that touch the fewest bytes (the smallest model at two depths) differ almost only in their
      op count: their difference is the cost of an op, and what the shallower one has left the cost paid once
      (the bytes of both priced at ``floor_per_byte``, the looped streaming rate, then again at the per-byte
      cost found); where that leaves the shallower step less than its ops' cost, one of the two was slowed
      by noise, and both are fitted by an op cost alone;
    * every other step then gives a cost per byte for what it has left; the median is kept, never below the
      floor (an elementwise op does not run faster than memory streams)."""
    by_bytes = sorted(rows, key=lambda r: r[0][1])
    (k1, b1, _), y1 = by_bytes[0]
    (k2, b2, _), y2 = by_bytes[1]
    per_byte = floor_per_byte
    for _ in range(2):  # then once more, with the small steps' few bytes at the per-byte cost found
        r1, r2 = y1 - b1 * per_byte, y2 - b2 * per_byte  # what the ops and the once-paid cost are left
        op_s = max(0.0, (r2 - r1) / (k2 - k1)) if k2 != k1 else 0.0
        once = r1 - k1 * op_s
        if once < 0:
            # The deeper step grew more than its ops did: noise in one of the two medians (a shared machine
            # slowed one of them). Their difference would price every op above what the shallower step cost
            # in all, so nothing is paid once and the cost of an op is the least-squares one of both steps.
            op_s, once = max(0.0, (k1 * r1 + k2 * r2) / (k1 * k1 + k2 * k2)), 0.0
        per = [(y - k * op_s - once) / b for (k, b, _), y in by_bytes[2:] if b > 0]
        per_byte = max(floor_per_byte, statistics.median(per)) if per else floor_per_byte
    return op_s, per_byte, once


def _curve(points: list[list[float]], looped: list[list[float]]) -> list[list[float]]:
    """The in-step (FLOPs, FLOP/s) points, one per FLOP count (median rate), then the looped curve's
    points above the largest in-step one, scaled to meet it (a bigger matmul than any step here ran gains
    over the largest as a looped one does)."""
    by: dict = defaultdict(list)
    for f, r in points:
        by[f].append(r)
    curve = sorted([float(f), statistics.median(rs)] for f, rs in by.items())
    if not curve or not looped:
        return curve
    from launcher.machine.speeds import Rates

    top_f, top_r = curve[-1]
    ref = Rates(device="cpu", matmul={"x": looped}).matmul_rate("x", top_f)
    curve += [[f, r * top_r / ref] for f, r in looped if f > top_f]
    return curve


def measure(work, view_s: float, raw: dict, skipped: dict, *, steps: int = 6, profiled: int = 2,
            references: tuple = REFERENCE, precisions: tuple = ("fp32", "bf16")) -> dict:
    """In-step rates for :class:`launcher.machine.speeds.Rates` of the CPU, given the looped ones (``work``): a dict
    with ``matmul`` (dtype -> curve), ``attention`` (dtype -> FLOP/s) and ``step_costs`` (precision ->
    ``{"op_s", "bytes_per_s", "micro_s"}``); what could not be measured is left out and said in ``skipped``."""
    out: dict = {"matmul": {}, "attention": {}, "step_costs": {}}
    samples = raw.setdefault("in_step", {})
    models: dict = {}  # each reference made once, stepped in every precision
    for precision in precisions:
        dtype_name = "float32" if precision == "fp32" else "bfloat16"
        if dtype_name not in work.matmul:
            skipped[f"in-step {precision}"] = f"no looped {dtype_name} matmul rate (the CPU does not run it)"
            continue
        rows, points, att_flops, att_s = [], [], 0.0, 0.0
        try:
            for i, ref in enumerate(references):
                if i not in models:
                    models[i] = reference_model(ref)
                m = _measure(ref, precision, steps, profiled, models[i])
                ops = _traced_ops(_config(ref), precision, ref["batch"], ref["seq"])
                mm_ops = {k: c for k, c in ops.items() if k[0] == "matmul"}
                at_ops = {k: c for k, c in ops.items() if k[0] == "attention"}
                kernels = sum(c for k, c in ops.items() if k[0] != "view")
                views = sum(c for k, c in ops.items() if k[0] == "view")
                mem_bytes = sum(k[3] * c for k, c in ops.items() if k[0] == "memory")
                m.update(kernel_ops=kernels, view_ops=views, memory_bytes=mem_bytes,
                         traced_matmul_flops=sum(k[2] * c for k, c in mm_ops.items()),
                         traced_attention_flops=sum(k[2] * c for k, c in at_ops.items()))
                samples.setdefault(precision, []).append(m)
                points += [[f, f / s] for f, s in m["matmul_calls"] if s > 0 and f > 0]
                att_flops += m["traced_attention_flops"]
                att_s += m["attention_s"]
                # What the step spends besides its matmul and attention kernels: per op and per byte.
                rest = m["step_s"] - m["matmul_s"] - m["attention_s"] - views * view_s
                rows.append(([float(kernels), float(mem_bytes), 1.0], rest))
        except Exception as e:  # noqa: BLE001 -- the looped rates stand; say why
            skipped[f"in-step {precision}"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        out["matmul"][dtype_name] = _curve(points, work.matmul.get(dtype_name, []))
        if att_s > 0 and att_flops > 0:
            out["attention"][dtype_name] = att_flops / att_s
        op_s, per_byte, once = fit_step_costs(rows, 1 / work.memory_bytes_per_s)
        out["step_costs"][precision] = {"op_s": op_s, "bytes_per_s": 1 / per_byte, "micro_s": once}
        samples[f"{precision}_fit"] = out["step_costs"][precision]
        logger.info(f"calibrate: in-step {precision}: {len(points)} matmul shapes, op {op_s * 1e6:.3g} us, "
                    f"elementwise {1 / per_byte / 1e9:.3g} GB/s, {once * 1e3:.3g} ms once per micro-batch")
    return out
