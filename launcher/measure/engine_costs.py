"""Each engine family's own fixed costs (per micro-batch and per optimizer step: fixed, per parameter tensor, per
parameter), timed on real engines (``launcher.engines.build``) around tiny Llamas and solved against what the
step-time model already prices for them. The ``engines`` part of a calibration (:mod:`launcher.measure.calibrate`)."""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from launcher import engines
from launcher.config.load import load_config
from launcher.config.profiles import PROFILES
from launcher.log import logger
from launcher.machine.hardware import pin_memory_ok, probe
from launcher.machine.speeds import Machine
from launcher.machine.timer import sync
from launcher.measure import stepcal
from launcher.measure.timing import CPU_EXTRA, LR, TINY, TINY_SEQ, Sizes, nonneg_lstsq, op_built, tiny_config, tiny_model
from launcher.plan import run_activations
from launcher.plan.availability import profile_problem
from launcher.plan.families import family_of
from launcher.plan.resolve import RunSpec
from launcher.plan.steptime import predict
from launcher.precision import weight_dtype


def profile_for(fam: str, gpu_bf16: bool | None):
    """The catalogue profile that stands for engine family ``fam``: fp32 where the CPU has one, else bf16
    (fp16 on a GPU without bf16). ``gpu_bf16``: None on a CPU-only machine."""

    cpu = gpu_bf16 is None
    p16 = "bf16" if cpu or gpu_bf16 else "fp16"
    exact = "fp32" if cpu else p16
    if "@" in fam:  # 'family@precision': that family at that precision
        fam, exact = fam.split("@")
        p16 = exact
    return PROFILES[{"amp": f"amp-{exact}", "amp_offload": f"amp-{p16}-offload-opt", "zero2": f"zero2-{exact}",
                     "zero2_offload": f"zero2-{p16}-offload-opt", "zero3_offload": f"zero3-{p16}-offload-all",
                     "fsdp": f"fsdp-{p16}-offload"}[fam]]


def _engine_problem(p, cfg, hw, device) -> str | None:

    problem = profile_problem(p, cfg, hw, device)
    if problem or not family_of(p).deepspeed:
        return problem
    needed = []  # the catalogue's profiles step with torch's fused AdamW: no Adam op
    if device.type == "cpu":
        needed.append("deepspeed_shm_comm")  # DeepSpeed's CPU accelerator loads it with the process group
    for op in needed:
        why = op_built(op)
        if why:
            return why
    return None


def _predicted(p, machine: Machine, depth: int, device: torch.device, pinned: bool, hidden: int | None = None):
    """(per micro-batch, per step) seconds the step-time model gives the tiny model at ``depth`` (and ``hidden``)
    without any engine fixed cost, from the planner's own trace of it, its parameter tensors and parameters."""

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    run = stepcal.run_shape(tiny_config(depth, hidden), p.precision, 2, TINY_SEQ, device.type, cap)
    counts = run.counts
    est = run_activations.activations(run, family_of(p).trace_family(p), 1)
    t = predict(p, machine, ops=run_activations.ops_of(est, run), counts=counts, micro_batch=1, accumulation=2,
                seq_len=TINY_SEQ, pinned=pinned)
    return t.micro_batch_s, t.step_s - 2 * t.micro_batch_s, counts.trainable_tensors, counts.total


def _time_engine(p, cfg, hw, device: torch.device, depth: int, s: Sizes, hidden: int | None = None) -> dict:
    """Build the engine of ``p`` around the tiny model once and time ``s.engine_steps`` optimizer steps of
    two micro-batches each, call by call, after one warm-up step."""

    spec = RunSpec(device=device, precision=p.precision, profile=p, micro_batch=1, accumulation=2, world=1,
                   checkpointing=False)
    model = tiny_model(depth, weight_dtype(p.module_in_compute_dtype, p.precision, cfg.lora.r > 0), hidden=hidden)
    n = sum(q.numel() for q in model.parameters())
    t = time.perf_counter()
    engine, _ = engines.build(cfg, spec, model, hw, hidden or TINY["hidden_size"], LR)
    built = time.perf_counter() - t
    ids = torch.randint(0, TINY["vocab_size"], (1, TINY_SEQ))
    batch = {"input_ids": ids, "labels": ids}
    micro, rest = [], []
    try:
        for i in range(1 + s.engine_steps):
            sync()
            t0 = time.perf_counter()
            engine.forward_backward(batch, 2)
            sync()
            t1 = time.perf_counter()
            engine.forward_backward(batch, 2)
            engine.step(LR)
            sync()
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


def measure(machine: Machine, device: torch.device, s: Sizes, raw: dict, skipped: dict) -> dict:
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
        problem = _engine_problem(p, cfg, hw, device) if s.deepspeed or not family_of(p).deepspeed else (
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
