"""One profile at one setting (micro-batch, checkpointing, chunked loss, activation offload): its GPU, CPU and disk
bytes by named part against the budgets, and with machine speeds its step time.

A GPU peak is the larger of two phases: forward + backward (model states that live through the
step, activations and logits at their traced peak, gradient buckets) and the optimizer step (model
states plus the gradients in the form the update reads them, e.g. DeepSpeed's fp32 copy of the flat
gradient partition). Parts named: ``weights``, ``gradients``, ``master_weights``, ``optimizer_states``,
``activations``, ``logits``, ``autocast_weight_cache``, ``buffers``, ``cuda_context``,
``allocator_slack`` (GPU) and ``runtime``, ``model_load`` (CPU). The loop is assumed to keep only the
loss of a forward (not the logits) through backward.
"""

from __future__ import annotations

import dataclasses

from launcher.config.profiles import Profile
from launcher.config.schema import AUTO
from launcher.machine.speeds import Machine
from launcher.plan import steptime
from launcher.plan.families import family_of
from launcher.plan.families.base import add_part
from launcher.plan.memory.estimate import ActivationEstimate
from launcher.plan.memory.host import PHASES as HOST_PHASES
from launcher.plan.memory.host import export_bytes, host_phases, pinned_total
from launcher.plan.memory.states import (
    ALLOCATOR_SLACK,
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    RunShape,
    files_on_disk,
    model_states,
)
from launcher.plan.rows import ProfilePlan
from launcher.plan.run_activations import activation_parts, activations, ops_of
from launcher.units import gib

PHASES = ("forward_backward", "optimizer_step")
# loss.chunked=auto chunks the loss when the plain logits would take more than this share of the budget (the
# GPU's, or the CPU's on a CPU run). Chunking costs one more head matmul per step (about 2% of a Llama-3-8B
# step at seq 2048) and frees the logits; at a tenth of the budget that is worth more than a micro-batch step.
CHUNK_SHARE = 0.10


def phase_total(parts: dict) -> int:
    return sum(parts.values())


# The search's settings with every k-th layer checkpointed are composed from the traces with none and with every
# layer where that holds for the model (compose_every, checked within 0.5% once per model); one whose memory lies
# within this share of its activations of a budget is planned again from its own traces, so only clear verdicts
# come from a composition.
COMPOSE_MARGIN = 0.01


def plan_profile(p: Profile, run: RunShape, micro_batch: int, gpu_budget: int, cpu_budget: int,
                 skip_trace_over_budget: bool = True, machine: Machine | None = None, pinned: bool = False,
                 max_steps: int = 0, exact: bool = True, compose: bool | None = None) -> ProfilePlan:
    """One profile at one setting (``run``'s checkpointing, ``micro_batch``): its GPU, CPU and disk bytes against
    the budgets, and with ``machine`` its step time. ``exact=False``: micro-batches above 3 extrapolated, and
    (``compose``, by default ``not exact``) every k-th layer composed where the verdict is clear."""
    if compose is None:
        compose = not exact
    accumulation = max(1, run.global_batch // (micro_batch * run.world))
    st = model_states(p, run, accumulation)
    runtime = CPU_RUNTIME_BYTES[run.device]
    on_gpu = run.device == "cuda"
    fb = dict(st["gpu_fb"])
    est = None
    # Model states alone over a budget: report that lower bound without tracing activations.
    lower_bound = _states_over(st, runtime, on_gpu, gpu_budget, cpu_budget) and skip_trace_over_budget
    if not lower_bound:
        run, est = _add_activations(p, run, micro_batch, accumulation, fb, gpu_budget if on_gpu else cpu_budget,
                                    exact, compose)
    phases = {"forward_backward": fb, "optimizer_step": dict(st["gpu_step"])}
    peak_phase = max(PHASES, key=lambda k: phase_total(phases[k]))
    tensor_peak = phase_total(phases[peak_phase])
    gpu_parts, cpu_states = _peak_parts(st, phases[peak_phase], tensor_peak, on_gpu, est)
    pin, host = _host_by_phase(p, run, st, cpu_states, runtime, pinned and on_gpu, accumulation, cpu_budget)
    host_peak = max(HOST_PHASES, key=lambda ph: phase_total(host[ph]))
    cpu_parts = dict(host[host_peak])
    gpu_bytes, cpu_bytes = phase_total(gpu_parts), phase_total(cpu_parts)
    disk_parts = dict(st["disk"])
    disk_bytes = phase_total(disk_parts)
    disk_free = int(run.nvme["free_bytes"]) if run.nvme else 0
    fits = (gpu_bytes <= gpu_budget or not on_gpu) and cpu_bytes <= cpu_budget and disk_bytes <= disk_free
    if est is not None and est.composed:  # near a budget: planned from its own traces instead
        used, budget = (gpu_bytes, gpu_budget) if on_gpu else (cpu_bytes, cpu_budget)
        if abs(used - budget) <= COMPOSE_MARGIN * max(est.peak, est.peak_with_grads):
            return plan_profile(p, run, micro_batch, gpu_budget, cpu_budget, skip_trace_over_budget, machine,
                                pinned, max_steps, exact, compose=False)
    why = None if fits else _why_not(run, on_gpu, lower_bound, (gpu_bytes, gpu_budget), (cpu_bytes, cpu_budget),
                                     (disk_bytes, disk_free))
    row = ProfilePlan(profile=p.name, engine=p.engine, precision=p.precision, device=run.device,
                      gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, fits=fits,
                      parts={"gpu": gpu_parts, "cpu": cpu_parts, **({"disk": disk_parts} if disk_parts else {})},
                      speed_rank=p.speed_rank, micro_batch=micro_batch,
                      accumulation=accumulation, why_not=why, gpu_tensor_bytes=tensor_peak if on_gpu else 0,
                      peak_phase=peak_phase, phases=phases if on_gpu else {}, lower_bound=lower_bound,
                      checkpointing=run.checkpointing, checkpoint_every=run.checkpoint_every if run.checkpointing else 1,
                      chunked_loss=run.chunked_loss, offload_activations=run.offload_activations,
                      host_phases=host, host_peak_phase=host_peak, pin_memory=pin,
                      pinned_bytes=pinned_total(p, run, st, accumulation) if pin else 0,
                      export_bytes=phase_total(export_bytes(p, run, CPU_RUNTIME_BYTES["cpu"])))
    on_disk = files_on_disk(p, run.counts, run.lora_r, run.optimizer)
    row.checkpoint_bytes, row.final_bytes = on_disk["checkpoint"], on_disk["final"]
    row.activations_counted = est.counted if est is not None else None
    if machine is not None and est is not None and not est.counted:  # no trace, no ops to price
        _price(row, p, run, est, machine, accumulation, max_steps)
    return row


def _states_over(st: dict, runtime: int, on_gpu: bool, gpu_budget: int, cpu_budget: int) -> bool:
    """Whether the model states alone (``st``, :func:`launcher.plan.memory.states.model_states`) exceed a budget."""
    states_gpu = max(phase_total(st["gpu_fb"]), phase_total(st["gpu_step"]))
    states_cpu = runtime + phase_total(st["cpu"])
    if not on_gpu:
        states_cpu = runtime + phase_total(st["cpu"]) + states_gpu
    return (on_gpu and states_gpu > gpu_budget) or states_cpu > cpu_budget


def _add_activations(p: Profile, run: RunShape, micro_batch: int, accumulation: int, fb: dict, budget: int,
                     exact: bool, compose: bool) -> tuple[RunShape, ActivationEstimate]:
    """The activations of ``run`` at ``micro_batch`` added to ``fb`` (the forward + backward phase's parts), their
    estimate, and the run with ``loss.chunked=auto`` decided against ``budget`` (the GPU's, or the CPU's on a CPU
    run)."""
    if run.chunked_mode == AUTO and run.head_problem is None and not run.chunked_loss:
        # The plain loss's logits are sized from micro-batch 2 (each row's logits are its own, so they grow
        # in proportion): where the run then chunks, the plain loss costs no traces at its own micro-batch.
        small = 2 if micro_batch > 3 else micro_batch
        plain = activations(run, family_of(p).trace_family(p), small, exact, compose)
        logits = activation_parts(plain, with_grads=False).get("logits", 0) * micro_batch // small
        if logits > CHUNK_SHARE * budget:
            run = dataclasses.replace(run, chunked_loss=True)
    est = activations(run, family_of(p).trace_family(p), micro_batch, exact, compose)
    grads_from_trace = family_of(p).grads_in_trace and accumulation == 1  # (with accumulation, they leave)
    for part, n in activation_parts(est, with_grads=grads_from_trace).items():
        add_part(fb, part, n)
    return run, est


def _peak_parts(st: dict, peak: dict, tensor_peak: int, on_gpu: bool,
                est: ActivationEstimate | None) -> tuple[dict, dict]:
    """The GPU's parts at the peak phase (``peak``, with the CUDA context and the allocator's slack), and the CPU's
    model states (on a CPU run everything is there, the peak phase included)."""
    gpu_parts: dict = {}
    if on_gpu:
        gpu_parts = dict(peak)
        add_part(gpu_parts, "cuda_context", CUDA_CONTEXT_BYTES)
        add_part(gpu_parts, "allocator_slack", ALLOCATOR_SLACK * tensor_peak)
        cpu_states = st["cpu"]
    else:  # everything on the CPU
        cpu_states = dict(st["cpu"])
        for part, n in peak.items():
            add_part(cpu_states, part, n)
        add_part(cpu_states, "allocator_slack", ALLOCATOR_SLACK * tensor_peak)
    if est is not None and est.offloaded:  # CPU copies of saved activations (pinned when the run pins)
        add_part(cpu_states, "offloaded_activations", est.offloaded)
    return gpu_parts, cpu_states


def _host_by_phase(p: Profile, run: RunShape, st: dict, cpu_states: dict, runtime: int, pin: bool,
                   accumulation: int, cpu_budget: int) -> tuple[bool, dict]:
    """Whether the setting pins, and the host's phases (set-up, training, checkpoint, final/): the plan's CPU peak is
    the largest. Pinned memory as torch's pinned allocator holds it; where that does not fit the budget and pageable
    memory would, the setting pins nothing and its copies are priced as pageable (launcher.plan.memory.host)."""
    host = host_phases(p, run, st, cpu_states, runtime=runtime, pin=pin, accumulation=accumulation)
    if pin and max(map(phase_total, host.values())) > cpu_budget:
        unpinned = host_phases(p, run, st, cpu_states, runtime=runtime, pin=False, accumulation=accumulation)
        if max(map(phase_total, unpinned.values())) <= cpu_budget:
            pin, host = False, unpinned
    return pin, host


def _why_not(run: RunShape, on_gpu: bool, lower_bound: bool, gpu: tuple[int, int], cpu: tuple[int, int],
             disk: tuple[int, int]) -> str:
    """Why a setting does not fit: each (bytes, budget) over its budget, the disk's against what is free at
    ``memory.nvme_path``."""
    (gpu_bytes, gpu_budget), (cpu_bytes, cpu_budget), (disk_bytes, disk_free) = gpu, cpu, disk
    bits = []
    if disk_bytes > disk_free:
        bits.append(f"disk {gib(disk_bytes)} > {gib(disk_free)} free at memory.nvme_path" if run.nvme else
                    "memory.nvme_path was not measured (set it to an existing folder)")
    if on_gpu and gpu_bytes > gpu_budget:
        bits.append(f"GPU {'>= ' if lower_bound else ''}{gib(gpu_bytes)} > budget {gib(gpu_budget)}")
    if cpu_bytes > cpu_budget:
        bits.append(f"CPU {'>= ' if lower_bound else ''}{gib(cpu_bytes)} > budget {gib(cpu_budget)}")
    return "; ".join(bits)


def _price(row: ProfilePlan, p: Profile, run: RunShape, est: ActivationEstimate, machine: Machine,
           accumulation: int, max_steps: int) -> None:
    """``row``'s step time on ``machine`` (:func:`launcher.plan.steptime.predict` of the traced ops), tokens/s and
    the whole run's seconds (``max_steps`` steps; 0: not said)."""
    t = steptime.predict(p, machine, ops=ops_of(est, run), counts=run.counts,
                         micro_batch=row.micro_batch * run.rows_per_sample,
                         reference_share=reference_share(run) if run.reference_pass else 0.0,
                         accumulation=accumulation, seq_len=run.seq_len, world=run.world, pinned=row.pin_memory,
                         optimizer=run.optimizer, lora=run.lora_r > 0,
                         activation_copy_bytes=est.offload_copied if est.offloaded else 0,
                         disk=run.nvme if p.nvme else None, nodes=run.nodes, links=run.links)
    row.step_s, row.tokens_per_s, row.time_parts, row.time_notes = t.step_s, t.tokens_per_s, t.parts, t.notes
    row.eta_s = t.step_s * max_steps if max_steps else None


def reference_share(run: RunShape) -> float:
    """DPO's live reference is one more forward of the micro-batch, without gradients (launcher.model.preference),
    priced as a share of the traced compute. The trace prices forward + backward (+ the recompute of checkpointed
    layers); with LoRA the backward runs the frozen base's input gradients (one forward's matmuls again) and only
    the adapters' small weight gradients (the 2N / 4N FLOPs per token of a full backward, Kaplan et al. 2020,
    shrink to 2N / 2N), so a forward is 1/2 of it, and 1/3 with every layer recomputed."""
    recomputed = 1.0 / run.checkpoint_every if run.checkpointing else 0.0
    return 1.0 / (2.0 + recomputed)
