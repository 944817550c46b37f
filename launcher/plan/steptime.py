"""The step-time model: how long one optimizer step of a planned run takes, by named part. Pure.

A step is ``accumulation`` micro-batches of forward + backward, then the optimizer step. Its parts:

- ``compute``: every op of one traced forward + backward (:mod:`launcher.plan.memory.tracker` records each
  dispatched ATen op with its FLOPs -- torch's own FLOP formulas, ``torch.utils.flop_counter`` -- and the
  bytes it reads and writes), recompute of checkpointed layers included, priced by a roofline per op:
  ``max(flops / matmul or attention rate, bytes / memory bandwidth)``, plus the fixed cost of an op in a
  training step (dispatch, autograd, kernel launch; a view op costs its own smaller fixed cost). On a
  CPU the fixed costs and the work add up (one thread of control does both); on a GPU the host runs
  ahead of the device, so each op costs ``max(device time, host cost)``.
- ``optimizer``: AdamW's update of every trainable parameter, priced per parameter and per tensor
  by the measured speed of the optimizer the profile runs (torch fused AdamW, DeepSpeed's FusedAdam or
  DeepSpeedCPUAdam), on the device the profile runs it on.
- ``grad_copies`` / ``weight_copies``: what each profile moves between GPU and CPU (ZeRO-2 optimizer
  offload: gradients down every micro-batch, the updated 16-bit weights up after the step; ZeRO-3
  offload-all: 16-bit weights up for every forward and again for every backward, gradients down; FSDP2
  CPU offload: each unit's fp32 shard up for forward and for backward, its fp32 gradient down), over
  the measured host-device bandwidth (pinned or pageable, as the run pins). Which of them overlap
  compute follows each engine's source (each family's ``overlap_*``, :mod:`launcher.plan.families`).
- ``engine``: each engine's own fixed cost per micro-batch and per step (hooks, bucketing, bookkeeping),
  measured on this machine by ``vramfit doctor --calibrate`` on models so small that nothing else costs.
- ``memory_traffic``: the engine's own passes over gradients and weights on the compute device (ZeRO's
  fp32 gradient copy, clipping, the copy of the fp32 master back to 16 bits; FSDP's per-unit casts).

Every rate comes from :class:`Machine`: measured by ``vramfit doctor --calibrate`` (:mod:`launcher.measure.calibrate`)
or, for a GPU that is not here, a data sheet (:mod:`launcher.plan.gpus`). Nothing is fitted to measured steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from launcher.config.profiles import Profile
from launcher.machine.speeds import Machine, Rates
from launcher.plan.families import family_of, optimizer_kind
from launcher.plan.families.base import Family

# ------------------------------------------------------------------------------------------------
# Which engine does what: each family's answers (launcher.plan.families), and what the model makes of them


# The model's measured error per engine family: the median |predicted - measured| / measured step time of the
# family's points in the committed validation grid (scripts/validate_steptime.py, 18 settings of tiny and
# llama-125m on a 2-core Xeon: bench/results/2026-12-02-cpu-xeon/steptime-wide-engine/fastest-pass/;
# tests/test_steptime.py recomputes it from that file). A family the grid has no point of takes the largest of
# them. No GPU measurement is committed, so a plan for a card priced on paper uses the same figures as the
# least it can be off by. Two settings whose predictions are closer than this are a tie the planner breaks
# towards less offload and fewer moving parts (:func:`moving_parts`).
MODEL_ERROR = {"amp": 0.083, "zero2": 0.071, "zero2_offload": 0.245, "fsdp": 0.032}
MODEL_ERROR_SOURCE = "bench/results/2026-12-02-cpu-xeon/steptime-wide-engine/fastest-pass/validate_steptime.json"


def model_error(p: Profile) -> float:
    """The step-time model's measured relative error for ``p``'s engine family (see :data:`MODEL_ERROR`)."""
    return MODEL_ERROR.get(family_of(p).name, max(MODEL_ERROR.values()))


def moving_parts(p: Profile, offload_activations: bool = False) -> tuple[int, int]:
    """How much a setting moves and how many parts it runs, smaller is simpler: (offload, engine). Offload counts
    what crosses to the CPU or the disk every step (optimizer states 1, parameters 2, activations 1, NVMe 2 more);
    the engine, its machinery over plain torch (AMP 0, ZeRO-2 1, FSDP2 2, ZeRO-3 3)."""
    offload = (int(p.offload_optimizer) + 2 * int(p.offload_param) + int(offload_activations)
               + 2 * (int(getattr(p, "nvme_optimizer", False)) + int(getattr(p, "nvme_param", False))))
    return offload, family_of(p).machinery


# ZeRO's gradient buckets: the ops each flush of a bucket costs besides its bytes (flatten, copy, event, the hook's
# bookkeeping), priced at the machine's measured per-op cost; what makes a smaller bucket slower.
BUCKET_OPS = 4


# ------------------------------------------------------------------------------------------------
# The prediction


@dataclass
class StepTime:
    step_s: float
    parts: dict  # part -> seconds per optimizer step (sums to step_s)
    tokens_per_s: float
    micro_batch_s: float  # one forward + backward, copies and fixed costs included
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def op_seconds(ops: dict, rates: Rates, host_bound: bool, precision: str | None = None) -> tuple[float, float]:
    """(seconds, of which fixed per-op costs) for a traced op record (see ``memory.tracker.OpKey``) of a step in
    ``precision`` (its in-step costs where the rates have them)."""
    total = fixed = 0.0
    costs = rates.step_costs.get(precision) if precision else None
    op_s = costs["op_s"] if costs else rates.op_s
    bandwidth = costs["bytes_per_s"] if costs else rates.memory_bytes_per_s
    for (kind, dtype, flops, nbytes), count in ops.items():
        if kind == "view":
            t, f = rates.view_s, rates.view_s
        else:
            if kind == "matmul":
                work = max(flops / rates.matmul_rate(dtype, flops), nbytes / bandwidth)
            elif kind == "attention":
                work = max(flops / rates.attention_rate(dtype), nbytes / bandwidth)
            else:
                work = nbytes / bandwidth
            f = op_s
            t = max(work, f) if host_bound else work + f
        total += count * t
        fixed += count * f
    if costs:
        total += costs.get("micro_s", 0.0)
        fixed += costs.get("micro_s", 0.0)
    return total, fixed


def collectives(p: Profile, counts, lora: bool, world: int) -> tuple[float, float, float]:
    """Bytes each rank sends over the ranks' links, as (per micro-batch overlapped with its compute, per step
    overlapped with one micro-batch's compute, per step not overlapped), for a ring collective: an all-reduce of S
    bytes sends 2 (N-1)/N S per rank, a reduce-scatter or an all-gather (N-1)/N S (NCCL's own accounting of bus
    bandwidth, nccl-tests' PERFORMANCE.md). Which collectives run when is the family's
    (:meth:`launcher.plan.families.base.Family.collectives`): DDP's all-reduce per step for AMP, ZeRO-1/2's
    reduce-scatter per micro-batch and all-gather per step, ZeRO-3's and FSDP2's gathers for forward and backward.
    """
    if world <= 1:
        return 0.0, 0.0, 0.0
    share = (world - 1) / world
    cd = 4 if p.precision == "fp32" else 2
    trainable = counts.adapters if lora else counts.total
    full = counts.total + (counts.adapters if lora else 0)
    return family_of(p).collectives(share, cd, trainable, full)


def _fixed_costs(fam: Family, p: Profile, machine: Machine, n_tensors: int, full: int, trainable: int,
                 notes: list) -> tuple[float, float]:
    """The engine's own fixed seconds per micro-batch and per step, as measured for its family."""
    # a family measured at this precision (a CPU's DeepSpeed bf16, see launcher.measure.timing.CPU_EXTRA), else at its own
    eng = (machine.engines.get(f"{fam.name}@{p.precision}") or machine.engines.get(fam.name)
           or machine.engines.get("amp") or {})
    if fam.name not in machine.engines:
        notes.append(f"no measured fixed costs for {fam.name}: those of amp stand in")
    # per parameter: a micro-batch's passes touch every weight (casts, shards, hooks), the step's the trainable ones
    micro_fixed = (eng.get("micro_s", 0.0) + eng.get("micro_tensor_s", 0.0) * n_tensors
                   + eng.get("micro_param_s", 0.0) * full)
    step_fixed = eng.get("step_s", 0.0) + eng.get("step_tensor_s", 0.0) * n_tensors + eng.get("step_param_s", 0.0) * trainable
    return micro_fixed, step_fixed


def _overlapped(fam: Family, on_gpu: bool, fb: float, t_grads: float, t_weights: float,
                tail_share: float) -> tuple[float, float]:
    """(a micro-batch's seconds, of which copies not hidden) with the copies overlapping compute where the family's
    do (:attr:`launcher.plan.families.base.Family.overlap_grads`, ``overlap_weights``)."""
    if on_gpu and fam.overlap_weights and fam.overlap_grads:
        micro = max(fb, t_weights + t_grads)
        return micro, max(0.0, micro - fb)
    if on_gpu and fam.overlap_grads:
        micro = max(fb, t_grads * (1 - tail_share)) + t_grads * tail_share + t_weights
        return micro, micro - fb
    return fb + t_grads + t_weights, t_grads + t_weights


def _communication(p: Profile, counts, lora: bool, world: int, nodes: int, links: dict | None, compute: float,
                   notes: list) -> tuple[float, float, float]:
    """Seconds of the collectives left over by the compute they run beside: per micro-batch, per step overlapped
    with one micro-batch, per step."""
    comm_micro, comm_step_overlapped, comm_step = collectives(p, counts, lora, world)
    if world > 1 and links:
        bw = min(links["intra"], links["inter"]) if nodes > 1 else links["intra"]
        notes.append(f"communication over {links['inter_source'] if nodes > 1 else links['intra_source']} "
                     f"({bw / 1e9:.3g} GB/s)")
        return max(0.0, comm_micro / bw - compute), max(0.0, comm_step_overlapped / bw - compute), comm_step / bw
    if world > 1:
        notes.append("communication between ranks not priced (no link speeds)")
    return 0.0, 0.0, 0.0


def _optimizer(p: Profile, machine: Machine, optimizer: str, trainable: int, n_tensors: int, notes: list) -> float:
    """Seconds of the optimizer's update at the measured speed of the one the profile steps with."""
    kind = optimizer_kind(p, machine.compute.device, optimizer)
    stand_in = f"torch_fused_adamw@{kind.split('@')[1]}"
    per_param, per_tensor = machine.optimizers.get(kind) or machine.optimizers.get(stand_in) or (0.0, 0.0)
    if kind not in machine.optimizers:
        notes.append(f"no measured speed for {kind}: {stand_in} stands in")
    return trainable * per_param + n_tensors * per_tensor


def _disk(p: Profile, machine: Machine, disk: dict | None, cd: int, trainable: int, full: int) -> tuple[float, float]:
    """ZeRO-Infinity's swap seconds (per micro-batch, per step), the disk priced as if alone."""
    t_disk_micro = t_disk_step = 0.0
    if disk and getattr(p, "nvme", False):
        wr = disk.get("write_bytes_per_s") or machine.disk_write_bytes_per_s or 1e9
        rd = disk.get("read_bytes_per_s") or wr
        if p.nvme_optimizer:
            t_disk_step += 12 * trainable / rd + 12 * trainable / wr
        if p.nvme_param:
            t_disk_micro = 2 * cd * full / rd
            t_disk_step += cd * full / wr
    return t_disk_micro, t_disk_step


def predict(p: Profile, machine: Machine, *, ops: dict, counts, micro_batch: int, accumulation: int,
            seq_len: int, world: int = 1, pinned: bool = False, optimizer: str = "adamw",
            lora: bool = False, activation_copy_bytes: int = 0, disk: dict | None = None, nodes: int = 1,
            links: dict | None = None, reference_share: float = 0.0) -> StepTime:
    """Seconds per optimizer step of profile ``p`` on ``machine``. ``ops``: the traced op record of one
    micro-batch's forward + backward at this micro-batch, checkpointing and precision; ``counts``: the
    model's :class:`launcher.plan.memory.shape.ParamCounts`. ``activation_copy_bytes``: activation offload's bytes
    copied to the CPU per micro-batch (the trace counts them); they come back in backward, and both copies
    run on the compute stream (launcher.model.actoffload), so none of it overlaps compute. ``disk``: the swap
    folder's measured speeds (``write_bytes_per_s``, ``read_bytes_per_s``; launcher.machine.hardware.probe_disk) for
    ZeRO-Infinity profiles: the optimizer step reads and writes back the fp32 master, m and v (12 bytes per
    trainable parameter), and with parameters on NVMe every forward and backward reads the 16-bit weights
    and the step writes them back; DeepSpeed overlaps the swaps of one sub-group with the update of another,
    which is not counted (the disk is priced as if alone). Several ranks: ``links`` holds the bytes/s of the link
    between ranks in one machine (``intra``) and between machines (``inter``); a ring over ``nodes`` > 1 machines
    runs at the slower of the two. The engine's collectives (:func:`collectives`) overlap the compute where the
    engine overlaps them, and what is left over is the ``communication`` part. ``reference_share``: DPO's live
    reference, one more forward of each micro-batch without gradients, as this share of the traced compute (and,
    where an engine brings the weights up for each pass, one more copy of them: ZeRO-3 and FSDP2 offload)."""
    on_gpu = machine.compute.device == "cuda"
    cd = 4 if p.precision == "fp32" else 2
    trainable = counts.adapters if lora else counts.total
    full = counts.total + (counts.adapters if lora else 0)
    n_tensors = counts.trainable_tensors if hasattr(counts, "trainable_tensors") else 0
    notes = []
    compute, _fixed = op_seconds(ops, machine.compute, host_bound=on_gpu, precision=p.precision)
    fam = family_of(p)
    micro_fixed, step_fixed = _fixed_costs(fam, p, machine, n_tensors, full, trainable, notes)
    mv = fam.moves(p, cd=cd, trainable=trainable, full=full, accumulation=accumulation, on_gpu=on_gpu)
    if mv.bucket_flushes:
        micro_fixed += BUCKET_OPS * machine.compute.op_s * mv.bucket_flushes
    # Copies between the GPU and the CPU (on a CPU-only machine the same bytes move in host memory).
    link = "pinned" if pinned else "pageable"
    h2d = machine.h2d_bytes_per_s.get(link) or machine.host.memory_bytes_per_s
    d2h = machine.d2h_bytes_per_s.get(link) or machine.host.memory_bytes_per_s
    # The engine's passes run between the step's own ops: at the elementwise rate measured inside steps where
    # there is one (a CPU), else at the looped memory bandwidth.
    mem = (machine.compute.step_costs.get(p.precision) or {}).get("bytes_per_s") or machine.compute.memory_bytes_per_s
    host_mem = (machine.host.step_costs.get(p.precision) or {}).get("bytes_per_s") or machine.host.memory_bytes_per_s
    t_activations = activation_copy_bytes / d2h + activation_copy_bytes / h2d
    fb = compute + mv.traffic_micro / mem + micro_fixed
    micro, exposed_copies = _overlapped(fam, on_gpu, fb, mv.grads_down / d2h, mv.weights_up_micro / h2d,
                                        mv.tail_share)
    micro += t_activations
    t_reference = 0.0
    if reference_share:
        t_reference = reference_share * fb + mv.weights_up_micro / 2 / h2d
        micro += t_reference
    t_comm_micro, t_comm_step_overlapped, t_comm_step = _communication(p, counts, lora, world, nodes, links,
                                                                       compute, notes)
    micro += t_comm_micro
    opt = _optimizer(p, machine, optimizer, trainable, n_tensors, notes)
    t_weights_step = mv.weights_up_step / h2d
    if fam.weights_behind_optimizer and on_gpu:  # the upload of one parameter runs beside the update of the next
        t_weights_step = max(0.0, t_weights_step - opt)
    t_disk_micro, t_disk_step = _disk(p, machine, disk, cd, trainable, full)
    micro += t_disk_micro
    t_weights_step += t_disk_step
    step_extra = (mv.traffic_step / mem + mv.host_traffic_step / host_mem + t_weights_step + step_fixed
                  + t_comm_step_overlapped + t_comm_step)
    parts = {"compute": compute * accumulation, "engine": (micro_fixed * accumulation + step_fixed),
             "memory_traffic": (mv.traffic_micro / mem * accumulation + mv.traffic_step / mem
                                + mv.host_traffic_step / host_mem),
             "copies": exposed_copies * accumulation + t_weights_step, "optimizer": opt,
             "activation_copies": t_activations * accumulation, "disk": (t_disk_micro * accumulation + t_disk_step),
             "communication": t_comm_micro * accumulation + t_comm_step_overlapped + t_comm_step,
             "reference_forward": t_reference * accumulation}
    parts["copies"] -= t_disk_step
    step = micro * accumulation + opt + step_extra
    correction = machine.corrections.get(fam.name)
    if correction:  # measured by `vramfit tune` on this machine: the model's error for this engine family
        parts["tune_correction"] = step * (correction - 1)
        step *= correction
        notes.append(f"x{correction:.3g} from vramfit tune's measurements of {fam.name} on this machine")
    parts = {k: v for k, v in parts.items() if v}  # they add up to the step: micro = fb + exposed copies
    tokens = micro_batch * accumulation * world * seq_len
    return StepTime(step_s=step, parts=parts, tokens_per_s=tokens / step, micro_batch_s=micro, notes=notes)
