"""The step-time model: how long one optimizer step of a planned run takes, by named part. Pure.

A step is ``accumulation`` micro-batches of forward + backward, then the optimizer step. Its parts:

- ``compute``: every op of one traced forward + backward (:mod:`launcher.plan.memory.trace` records each
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
  compute follows each engine's source (rules at :data:`OVERLAP`).
- ``engine``: each engine's own fixed cost per micro-batch and per step (hooks, bucketing, bookkeeping),
  measured on this machine by ``vramfit doctor --calibrate`` on models so small that nothing else costs.
- ``memory_traffic``: the engine's own passes over gradients and weights on the compute device (ZeRO's
  fp32 gradient copy, clipping, the copy of the fp32 master back to 16 bits; FSDP's per-unit casts).

Every rate comes from :class:`Machine`: measured by ``vramfit doctor --calibrate`` (:mod:`launcher.measure.calibrate`)
or, for a GPU that is not here, a data sheet (:mod:`launcher.plan.gpus`). Nothing is fitted to measured steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from launcher.config.profiles import DS_DEFAULT_BUCKET, Profile
from launcher.machine.speeds import Machine, Rates

# ------------------------------------------------------------------------------------------------
# Which engine does what


# Engine families for fixed costs and optimizer kinds.
def family(p: Profile) -> str:
    if p.engine == "deepspeed":
        if p.zero_stage >= 3:
            return "zero3_offload" if p.offload_param else "zero3"
        return "zero2_offload" if p.offload_optimizer else "zero2"
    if p.engine == "amp" and p.offload_optimizer:
        return "amp_offload"
    return p.engine  # 'amp' | 'fsdp'


def optimizer_kind(p: Profile, device: str, optimizer: str = "adamw") -> str:
    """The key in :attr:`Machine.optimizers`: ``<optimizer>@<device it steps on>``, e.g.
    ``torch_fused_adamw@cpu``, ``deepspeed_cpu_adam@cpu``, ``deepspeed_fused_adam@cuda``."""
    if optimizer in ("adamw8bit", "paged_adamw8bit"):  # paging moves nothing while the GPU has room
        return f"bnb_adamw8bit@{device}"
    if p.engine == "deepspeed" and p.ds_optimizer:  # a user's JSON with an optimizer section: DeepSpeed's ops
        if p.offload_optimizer:
            return "deepspeed_cpu_adam@cpu"
        return f"deepspeed_fused_adam@{device}"
    if p.engine == "deepspeed":  # torch's fused AdamW as DeepSpeed's client optimizer, on the offloaded partitions
        return "torch_fused_adamw@cpu" if p.offload_optimizer else f"torch_fused_adamw@{device}"
    if p.engine == "fsdp" or p.offload_optimizer:  # FSDP2's CPU offload policy; AMP's offloaded update: on the CPU
        return "torch_fused_adamw@cpu"
    return f"torch_fused_adamw@{device}"


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
    return MODEL_ERROR.get(family(p), max(MODEL_ERROR.values()))


def moving_parts(p: Profile, offload_activations: bool = False) -> tuple[int, int]:
    """How much a setting moves and how many parts it runs, smaller is simpler: (offload, engine). Offload counts
    what crosses to the CPU or the disk every step (optimizer states 1, parameters 2, activations 1, NVMe 2 more);
    the engine, its machinery over plain torch (AMP 0, ZeRO-2 1, FSDP2 2, ZeRO-3 3)."""
    offload = (int(p.offload_optimizer) + 2 * int(p.offload_param) + int(offload_activations)
               + 2 * (int(getattr(p, "nvme_optimizer", False)) + int(getattr(p, "nvme_param", False))))
    engine = {"amp": 0, "fsdp": 2}.get(p.engine, 3 if p.zero_stage >= 3 else 1)
    return offload, engine


# ZeRO's gradient buckets: the ops each flush of a bucket costs besides its bytes (flatten, copy, event, the hook's
# bookkeeping), priced at the machine's measured per-op cost; what makes a smaller bucket slower.
BUCKET_OPS = 4


# Which copies overlap compute, per engine (True: they run on a side stream while layers compute).
OVERLAP = {
    # DeepSpeed ZeRO-2 with overlap_comm (our profiles set it): gradients are reduced and, with optimizer
    # offload, copied to pinned CPU buffers on a side stream as each bucket fills during backward
    # (deepspeed/runtime/zero/stage_1_and_2.py, reduce_independent_p_g_buckets_and_remove_grads /
    # async_inplace_copy_grad_to_fp32_buffer_from_gpu); the updated 16-bit weights are copied back after
    # the optimizer step, outside backward, so that copy does not overlap.
    "zero2_offload": {"grads": True, "weights": False},
    # ZeRO-3 prefetches the next modules' parameters (stage3_prefetch_bucket_size) on a side stream while
    # the current one computes, in forward and backward (deepspeed/runtime/zero/partitioned_param_coordinator.py);
    # gradients leave on the reduction stream (stage3.py, overlap_comm).
    "zero3_offload": {"grads": True, "weights": True},
    # AMP with the optimizer offloaded (launcher/engines/offload_opt.py): each gradient is copied down on a side
    # stream as backward completes it (post-accumulate-grad hooks), in the last micro-batch of a step; the updated
    # weights go up on another side stream while the CPU updates the next parameter, so their copy hides behind the
    # optimizer's time, not the compute's (priced as the larger of the two).
    "amp_offload": {"grads": True, "weights": False},
    # FSDP2 prefetches the next unit's all-gather (the H2D copy of its CPU shard) during the current
    # unit's compute, forward and backward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
    # implicit prefetching), and offloads reduced gradients with non_blocking copies.
    "fsdp": {"grads": True, "weights": True},
}


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
    """(seconds, of which fixed per-op costs) for a traced op record (see ``memory.trace.OpKey``) of a step in
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
    bandwidth, nccl-tests' PERFORMANCE.md).

    - AMP on several ranks is DDP: one all-reduce of the fp32 gradients per step (``no_sync`` while accumulating),
      in buckets during the last micro-batch's backward (torch/nn/parallel/distributed.py, the reducer's hooks).
    - ZeRO-1/2: a reduce-scatter of the 16-bit gradients every micro-batch, during backward (``overlap_comm``), and
      an all-gather of the updated 16-bit partitions after the step, not overlapped
      (deepspeed/runtime/zero/stage_1_and_2.py: reduce_ipg_grads, then all_gather_dp_groups in step()).
    - ZeRO-3 and FSDP2: every micro-batch gathers each layer's 16-bit parameters for forward and again for
      backward, prefetched while the previous layer computes, and reduce-scatters the gradients
      (partitioned_param_coordinator.py; torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).
    """
    if world <= 1:
        return 0.0, 0.0, 0.0
    share = (world - 1) / world
    cd = 4 if p.precision == "fp32" else 2
    trainable = counts.adapters if lora else counts.total
    full = counts.total + (counts.adapters if lora else 0)
    fam = family(p)
    if fam == "amp":
        return 0.0, 2 * share * 4 * trainable, 0.0
    if fam in ("zero2", "zero2_offload"):
        return share * cd * trainable, 0.0, share * cd * trainable
    return 2 * share * cd * full + share * cd * trainable, 0.0, 0.0  # zero3, zero3_offload, fsdp


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
    base = counts.total
    n_tensors = counts.trainable_tensors if hasattr(counts, "trainable_tensors") else 0
    notes = []
    compute, _fixed = op_seconds(ops, machine.compute, host_bound=on_gpu, precision=p.precision)
    fam = family(p)
    # a family measured at this precision (a CPU's DeepSpeed bf16, see launcher.measure.timing.CPU_EXTRA), else at its own
    eng = machine.engines.get(f"{fam}@{p.precision}") or machine.engines.get(fam) or machine.engines.get("amp") or {}
    if fam not in machine.engines:
        notes.append(f"no measured fixed costs for {fam}: those of amp stand in")
    # per parameter: a micro-batch's passes touch every weight (casts, shards, hooks), the step's the trainable ones
    full = base + (counts.adapters if lora else 0)
    micro_fixed = (eng.get("micro_s", 0.0) + eng.get("micro_tensor_s", 0.0) * n_tensors
                   + eng.get("micro_param_s", 0.0) * full)
    step_fixed = eng.get("step_s", 0.0) + eng.get("step_tensor_s", 0.0) * n_tensors + eng.get("step_param_s", 0.0) * trainable
    # Copies between the GPU and the CPU (on a CPU-only machine the same bytes move in host memory).
    link = "pinned" if pinned else "pageable"
    h2d = machine.h2d_bytes_per_s.get(link) or machine.host.memory_bytes_per_s
    d2h = machine.d2h_bytes_per_s.get(link) or machine.host.memory_bytes_per_s
    grads_down = weights_up_micro = weights_up_step = 0.0
    tail_share = 0.0  # the share of grads_down that leaves after the backward (nothing left to overlap it)
    traffic_micro = traffic_step = 0.0  # bytes of the engine's own passes on the compute device
    host_traffic_step = 0.0
    if fam == "zero2":
        # contiguous_gradients: each gradient is copied into the bucket and from it into the partition
        traffic_micro = 4 * cd * trainable
        # fp32 copy of the flat gradient, its norm, unscale/clip, and the fp32 master copied back to 16 bits
        traffic_step = (cd + 4 + 4 + 8 + 4 + cd) * trainable
    elif fam == "zero2_offload":
        grads_down = cd * trainable
        # with overlap_comm a bucket leaves for the CPU once it is full: the last one only after backward, so its
        # share of the gradients is copied with nothing to hide behind; each bucket costs a few ops of its own
        # (the flatten into the bucket, the copy, the event, the hook's bookkeeping)
        bucket = p.reduce_bucket_size or min(DS_DEFAULT_BUCKET, trainable)
        tail_share = min(1.0, bucket / max(1, trainable))
        micro_fixed += BUCKET_OPS * machine.compute.op_s * -(-trainable // max(1, bucket))
        traffic_micro = 2 * cd * trainable
        host_traffic_step = (4 + 8) * trainable  # norm and clip of the fp32 gradients on the CPU
        weights_up_step = cd * trainable
    elif fam == "zero3_offload":
        weights_up_micro = 2 * cd * (base + (counts.adapters if lora else 0))  # forward, and again in backward
        grads_down = cd * trainable
        host_traffic_step = (4 + 8 + 4 + cd) * trainable  # norm, clip, master -> 16-bit partition on the CPU
    elif fam == "fsdp":
        if on_gpu:
            weights_up_micro = 2 * 4 * full  # each unit's fp32 shard for forward and for backward
            grads_down = 4 * trainable
            traffic_micro = 2 * (4 + cd) * full  # the cast to the compute dtype after each copy
        else:  # the CPU mesh: nothing to copy, the casts remain
            traffic_micro = 2 * (4 + cd) * full + (cd + 4) * trainable
        host_traffic_step = (4 + 8) * trainable
    elif fam == "amp_offload":
        grads_down = cd * trainable / accumulation  # once per step: spread here over the micro-batches
        traffic_micro = (cd + 4) * trainable / accumulation  # each gradient's norm, in fp32, as it leaves
        if accumulation > 1:
            traffic_micro += 3 * cd * trainable * (accumulation - 1) / accumulation  # grad += (after the first)
        # on the CPU: widen into the fp32 gradient, the clip/unscale factor, narrow the master back to 16 bits
        host_traffic_step = (cd + 4 + 8 + 4 + cd) * trainable
        weights_up_step = cd * trainable
    elif fam == "amp":
        traffic_step = (4 + 8) * trainable  # clip_grad_norm_: the norm, then the scale
        if accumulation > 1:
            traffic_micro = 12 * trainable * (accumulation - 1) / accumulation  # grad += (after the first)
        if p.precision == "fp16":
            traffic_step += 8 * trainable  # GradScaler.unscale_
    # The engine's passes run between the step's own ops: at the elementwise rate measured inside steps where
    # there is one (a CPU), else at the looped memory bandwidth.
    mem = (machine.compute.step_costs.get(p.precision) or {}).get("bytes_per_s") or machine.compute.memory_bytes_per_s
    host_mem = (machine.host.step_costs.get(p.precision) or {}).get("bytes_per_s") or machine.host.memory_bytes_per_s
    t_grads = grads_down / d2h
    t_weights_micro = weights_up_micro / h2d
    t_activations = activation_copy_bytes / d2h + activation_copy_bytes / h2d
    overlap = OVERLAP.get(fam, {})
    fb = compute + traffic_micro / mem + micro_fixed
    if on_gpu and overlap.get("weights") and overlap.get("grads"):
        micro = max(fb, t_weights_micro + t_grads)
        exposed_copies = max(0.0, micro - fb)
    elif on_gpu and overlap.get("grads"):
        micro = max(fb, t_grads * (1 - tail_share)) + t_grads * tail_share + t_weights_micro
        exposed_copies = micro - fb
    else:
        micro = fb + t_grads + t_weights_micro
        exposed_copies = t_grads + t_weights_micro
    micro += t_activations
    t_reference = 0.0
    if reference_share:
        t_reference = reference_share * (compute + traffic_micro / mem + micro_fixed) + weights_up_micro / 2 / h2d
        micro += t_reference
    comm_micro, comm_step_overlapped, comm_step = collectives(p, counts, lora, world)
    t_comm_micro = t_comm_step_overlapped = t_comm_step = 0.0
    if world > 1 and links:
        bw = min(links["intra"], links["inter"]) if nodes > 1 else links["intra"]
        t_comm_micro = max(0.0, comm_micro / bw - compute)  # the collectives run beside the compute
        t_comm_step_overlapped = max(0.0, comm_step_overlapped / bw - compute)
        t_comm_step = comm_step / bw
        notes.append(f"communication over {links['inter_source'] if nodes > 1 else links['intra_source']} "
                     f"({bw / 1e9:.3g} GB/s)")
    elif world > 1:
        notes.append("communication between ranks not priced (no link speeds)")
    micro += t_comm_micro
    kind = optimizer_kind(p, machine.compute.device, optimizer)
    stand_in = f"torch_fused_adamw@{kind.split('@')[1]}"
    per_param, per_tensor = machine.optimizers.get(kind) or machine.optimizers.get(stand_in) or (0.0, 0.0)
    if kind not in machine.optimizers:
        notes.append(f"no measured speed for {kind}: {stand_in} stands in")
    opt = trainable * per_param + n_tensors * per_tensor
    t_weights_step = weights_up_step / h2d
    if fam == "amp_offload" and on_gpu:  # the upload of one parameter runs beside the update of the next
        t_weights_step = max(0.0, t_weights_step - opt)
    t_disk_micro = t_disk_step = 0.0
    if disk and getattr(p, "nvme", False):
        wr = disk.get("write_bytes_per_s") or machine.disk_write_bytes_per_s or 1e9
        rd = disk.get("read_bytes_per_s") or wr
        if p.nvme_optimizer:
            t_disk_step += 12 * trainable / rd + 12 * trainable / wr
        if p.nvme_param:
            t_disk_micro = 2 * cd * full / rd
            t_disk_step += cd * full / wr
        micro += t_disk_micro
    t_weights_step += t_disk_step
    step_extra = (traffic_step / mem + host_traffic_step / host_mem + t_weights_step + step_fixed
                  + t_comm_step_overlapped + t_comm_step)
    parts = {"compute": compute * accumulation, "engine": (micro_fixed * accumulation + step_fixed),
             "memory_traffic": traffic_micro / mem * accumulation + traffic_step / mem + host_traffic_step / host_mem,
             "copies": exposed_copies * accumulation + t_weights_step, "optimizer": opt,
             "activation_copies": t_activations * accumulation, "disk": (t_disk_micro * accumulation + t_disk_step),
             "communication": t_comm_micro * accumulation + t_comm_step_overlapped + t_comm_step,
             "reference_forward": t_reference * accumulation}
    parts["copies"] -= t_disk_step
    step = micro * accumulation + opt + step_extra
    correction = machine.corrections.get(fam)
    if correction:  # measured by `vramfit tune` on this machine: the model's error for this engine family
        parts["tune_correction"] = step * (correction - 1)
        step *= correction
        notes.append(f"x{correction:.3g} from vramfit tune's measurements of {fam} on this machine")
    parts = {k: v for k, v in parts.items() if v}  # they add up to the step: micro = fb + exposed copies
    tokens = micro_batch * accumulation * world * seq_len
    return StepTime(step_s=step, parts=parts, tokens_per_s=tokens / step, micro_batch_s=micro, notes=notes)
