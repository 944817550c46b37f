"""Model-state bytes per profile: weights, gradients, fp32 master copies, optimizer states and buffers,
on the GPU and the CPU, by phase -- the arithmetic, following what each engine allocates (DeepSpeed 0.19
``stage_1_and_2.py``/``stage3.py``, torch fused AdamW, FSDP2). Activations are traced
(:mod:`launcher.plan.memory.trace`); :mod:`launcher.plan.planner` adds them and the fixed costs below.

Per trainable parameter with Adam in mixed precision (the ZeRO paper): 2 B 16-bit weights + 2 B 16-bit
gradients + 12 B fp32 master, m and v = 16 B, placed on the GPU or the CPU by the profile.

Assumptions, each a named constant and a line of every plan:
``CUDA_CONTEXT_BYTES`` -- CUDA context, lazily loaded kernel images and the cuBLAS workspace, none of
which ``torch.cuda.max_memory_allocated`` sees; ``ALLOCATOR_SLACK`` -- the caching allocator's
reserved-but-unallocated memory (fragmentation, rounding), as a fraction of tensor bytes;
``CPU_RUNTIME_BYTES`` -- resident size of Python, torch, the CUDA libraries and DeepSpeed before any
model tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.profiles import (
    NVME_OPT_BUFFERS,
    NVME_PARAM_BUFFER_SIZE,
    NVME_PARAM_BUFFERS,
    NVME_SUB_GROUP,
    Profile,
    bucket_sizes,
    in_catalogue,
)
from launcher.plan.memory.shape import ParamCounts
from launcher.precision import BYTES, weight_dtype
from launcher.units import GiB, MiB

CUDA_CONTEXT_BYTES = 512 * MiB
ALLOCATOR_SLACK = 0.10
CPU_RUNTIME_BYTES = {"cuda": 2 * GiB, "cpu": GiB // 2}
# NF4 with double quantization (8-bit absmax per 64 weights, fp32 per 256 blocks); int8 + fp32 row scale
QUANT_BYTES_PER_PARAM = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0 + 4 / 4096}
# m and v; paged 8-bit AdamW keeps the same bytes, in CUDA unified memory: planned on the GPU (where they live
# while there is room), so paging is a safety net for spikes, not a saving the plan counts on
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 8, "adamw8bit": 2, "paged_adamw8bit": 2}
AMP_OPTIMIZER_WORKSPACE = 0  # torch AdamW(fused=True) updates in place; foreach would add 4 B/param
ZERO3_SUB_GROUP = 1_000_000_000  # DeepSpeed sub_group_size default: fp32 gradient buffer size cap


@dataclass(frozen=True)
class RunShape:
    """Everything about the run the memory depends on (one per plan; a suggestion changes a copy)."""

    config: object
    counts: ParamCounts
    device: str
    capability: tuple
    precision: str
    seq_len: int
    global_batch: int
    world: int
    checkpointing: bool
    attn_implementation: str
    lora_r: int
    lora_targets: tuple
    lora_dropout: float
    quantize: str
    optimizer: str
    trust_remote_code: bool
    checkpoint_every: int = 1  # with checkpointing: every k-th decoder layer recomputes
    chunked_loss: bool = False  # this setting's loss is chunked (launcher.model.loss)
    chunked_mode: str = "off"  # loss.chunked: auto | on | off
    head_problem: str | None = None  # why this model's loss cannot be chunked (None: it can)
    offload_activations: bool = False  # this setting offloads saved activations (launcher.model.actoffload)
    offload_mode: str = "off"  # memory.offload_activations: auto | on | off
    nvme: dict | None = None  # memory.nvme_path measured (launcher.machine.hardware.probe_disk): free bytes, speeds
    packed: bool = False  # instruction samples packed padding-free: a block-diagonal attention mask per layer
    nodes: int = 1  # machines the ``world`` ranks run on (ranks per node = world / nodes share a host's RAM)
    links: dict | None = None  # bytes/s between ranks: {"intra": ..., "inter": ..., "intra_source", "inter_source"}
    rows_per_sample: int = 1  # sequences one sample makes: 2 for a preference pair (chosen and rejected)
    reference_pass: bool = False  # DPO's live reference: one more no-grad forward of each micro-batch (adapter off)

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world // max(1, self.nodes))

    @property
    def hidden(self) -> int:
        return int(self.config.hidden_size)


# Beside the tensors: the loop state (RNG of every library, counters), the marker with its checksums, DCP's
# metadata; final/ adds the config, generation config and the tokenizer (a few MiB for a 32k vocabulary).
CHECKPOINT_EXTRA_BYTES = MiB
FINAL_EXTRA_BYTES = 8 * MiB


def files_on_disk(p: Profile, counts: ParamCounts, lora_r: int, optimizer: str = "adamw") -> dict:
    """Bytes one checkpoint and ``final/`` take on disk with profile ``p``: {"checkpoint", "final"}.

    A checkpoint holds what trains and never the frozen base (launcher.engines: DeepSpeed's
    ``exclude_frozen_parameters``, DCP without frozen parameters, AMP's trainable state dict): AMP and FSDP
    write the fp32 weights and Adam's moments (12 B per trainable parameter with AdamW); DeepSpeed writes the
    module's copy in the compute dtype beside its fp32 master and moments (2 + 12 B in 16 bits, 16 B in fp32).
    ``final/`` is the adapter (LoRA) or the whole model, in the dtype the engine keeps the weights in."""
    trainable = counts.adapters if lora_r > 0 else counts.total
    opt = OPTIMIZER_BYTES_PER_PARAM.get(optimizer, 8)
    weights = BYTES[p.precision] if p.engine == "deepspeed" else 4
    if p.engine == "deepspeed":
        ckpt = trainable * (weights + 4 + opt)
    else:
        ckpt = trainable * (4 + opt)
    return {"checkpoint": int(ckpt + CHECKPOINT_EXTRA_BYTES), "final": int(trainable * weights + FINAL_EXTRA_BYTES)}


def add_part(d: dict, part: str, n: float):
    if n:
        d[part] = d.get(part, 0) + int(round(n))


def model_states(p: Profile, run: RunShape, accumulation: int) -> dict:
    """Model-state bytes of profile ``p``: {"gpu_fb", "gpu_step", "cpu", "disk"} part dicts (no activations).

    "gpu_*" is the device the model computes on (the CPU itself when there is no GPU).
    """
    c = run.counts
    cd = BYTES[p.precision]
    lora = run.lora_r > 0
    base = c.total  # base-model parameters (frozen under LoRA)
    trainable = c.adapters if lora else base
    opt = OPTIMIZER_BYTES_PER_PARAM[run.optimizer]
    largest_trainable = c.largest_adapter if lora else c.largest_param
    h = run.hidden
    # Several ranks: ZeRO partitions the fp32 master and the optimizer states (stage 1 and up), the gradients (2 and
    # up) and the parameters (3) over the ranks; FSDP2 shards parameters, gradients and states; DDP replicates all.
    n = max(1, run.world)
    shard_opt = n if (p.engine == "fsdp" or (p.engine == "deepspeed" and p.zero_stage >= 1)) else 1
    shard_grads = n if (p.engine == "fsdp" or (p.engine == "deepspeed" and p.zero_stage >= 2)) else 1
    shard_params = n if (p.engine == "fsdp" or (p.engine == "deepspeed" and p.zero_stage >= 3)) else 1
    # buckets as the engine resolves them: the planner's choice, else the rule for this many ranks (a user's
    # deepspeed_config with "auto" keeps Accelerate's hidden**2, as the HF Trainer would)
    rb = p.reduce_bucket_size or bucket_sizes(h, run.world, trainable if in_catalogue(p) else None)["reduce_bucket_size"]
    fb: dict = {}
    step: dict = {}
    cpu: dict = {}
    disk: dict = {}  # ZeRO-Infinity's swap files under memory.nvme_path

    def frozen_bytes(dtype_bytes: int) -> float:
        if run.quantize in QUANT_BYTES_PER_PARAM:
            return (base - c.linear_weights) * dtype_bytes + c.linear_weights * QUANT_BYTES_PER_PARAM[run.quantize]
        return base * dtype_bytes

    if p.engine == "amp" and p.offload_optimizer:
        # launcher/engines/offload_opt.py: the model in the compute dtype on the GPU (a LoRA base as it is, the
        # adapters in 16 bits); each gradient leaves in the last micro-batch's backward as it is complete, so the GPU
        # holds the gradients of the earlier micro-batches in 16 bits while accumulating, else about two in flight
        # (one copying down, one being made) and the fp32 temporary of one gradient's norm.
        w = frozen_bytes(cd) + cd * c.adapters if lora else cd * base
        for d in (fb, step):
            add_part(d, "weights", w)
        add_part(fb, "gradients", cd * trainable if accumulation > 1 else 2 * cd * largest_trainable)
        add_part(fb, "buffers", 4 * largest_trainable)
        # the CPU: fp32 masters, their fp32 gradients, AdamW's moments, one flat 16-bit block the gradients come
        # down to and the updated weights go up from (page-locked where it lies when the run pins)
        add_part(cpu, "master_weights", 4 * trainable)
        add_part(cpu, "gradients", 4 * trainable)
        add_part(cpu, "optimizer_states", opt * trainable)
        add_part(cpu, "buffers", cd * trainable)
    elif p.engine == "amp":
        wb = weight_dtype(p.engine, p.precision, lora).itemsize
        w = frozen_bytes(wb) + 4 * c.adapters if lora else wb * base
        for d in (fb, step):
            add_part(d, "weights", w)
            add_part(d, "optimizer_states", opt * trainable)
        if accumulation > 1:  # earlier micro-batches' gradients live through this one's backward
            add_part(fb, "gradients", 4 * trainable)
        add_part(step, "gradients", 4 * trainable)
        add_part(step, "buffers", AMP_OPTIMIZER_WORKSPACE * trainable)
        if n > 1:  # DDP's gradient buckets: a copy of every trainable gradient (gradient_as_bucket_view=False)
            for d in (fb, step):
                add_part(d, "buffers", 4 * trainable)
        if run.quantize in QUANT_BYTES_PER_PARAM:  # bitsandbytes dequantizes one weight at a time
            add_part(fb, "buffers", c.largest_module * cd)
    elif p.engine == "deepspeed" and p.zero_stage in (0, 1, 2):
        # The module is cast to the compute dtype; trainable params are views into one flat 16-bit buffer.
        # Stages 0 and 1 (only from a user's deepspeed_config) are planned with this stage-2 arithmetic: on one
        # rank no stage partitions anything, and each keeps 16-bit weights, a gradient copy and fp32 master +
        # Adam moments (stage 1 in DeepSpeed's ZeRO-1/2 optimizer itself; stage 0 in its bf16/fp16 optimizer).
        w = (base + c.adapters) * cd if lora else base * cd
        bucket_bytes = 2 * rb * cd  # ipg double buffer (overlap_comm)
        for d in (fb, step):
            add_part(d, "weights", w)
        add_part(fb, "buffers", bucket_bytes + largest_trainable * cd)  # + autograd's grad before it is bucketed
        part_opt, part_grads = trainable / shard_opt, trainable / shard_grads  # this rank's partition
        if not p.offload_optimizer:
            for d in (fb, step):
                add_part(d, "master_weights", 4 * part_opt)
                add_part(d, "optimizer_states", 8 * part_opt)
                add_part(d, "gradients", cd * part_grads)  # grads_in_partition, allocated at the first reduction
            if cd != 4:
                add_part(step, "gradients", 4 * part_opt)  # the fp32 copy of the flat partition the update reads
            add_part(step, "buffers", bucket_bytes)
        else:
            add_part(fb, "buffers", largest_trainable * cd)  # temp_grad_buffer_for_gpu_offload
            add_part(step, "buffers", bucket_bytes + largest_trainable * cd)
            add_part(cpu, "master_weights", 4 * part_opt)
            add_part(cpu, "gradients", 4 * part_opt)
            add_part(cpu, "optimizer_states", 8 * part_opt)
            add_part(cpu, "buffers", cd * part_opt + largest_trainable * cd)  # 16-bit update staging, grad staging
            if accumulation > 1:
                add_part(cpu, "gradients", cd * part_grads)  # accumulated_grads_in_cpu
    elif p.engine == "deepspeed" and p.zero_stage == 3:
        # Parameters live partitioned on the CPU; the GPU gathers the module in use plus the prefetch bucket.
        b = bucket_sizes(h)
        prefetch = p.prefetch_bucket_size if p.prefetch_bucket_size is not None else b["stage3_prefetch_bucket_size"]
        small = c.small_params
        live = (c.largest_module + prefetch) * cd + small * cd
        for d in (fb, step):
            add_part(d, "weights", live)
        add_part(fb, "gradients", min(c.largest_module, trainable) * cd)
        add_part(fb, "buffers", rb * cd)
        sub_group = NVME_SUB_GROUP if p.nvme_optimizer else ZERO3_SUB_GROUP
        part = trainable / n  # this rank's partition of what trains, and of the parameters
        if p.nvme_param:  # ZeRO-Infinity: 16-bit parameters on the disk, read through pinned swap buffers
            add_part(disk, "weights", (base + c.adapters) * cd / n)
            add_part(cpu, "buffers", NVME_PARAM_BUFFERS * max(NVME_PARAM_BUFFER_SIZE, c.largest_param) * cd)
        else:
            add_part(cpu, "weights", (base + c.adapters) * cd / n)
        add_part(cpu, "gradients", cd * part + 4 * min(part, sub_group))
        if p.nvme_optimizer:  # fp32 master, Adam m and v swapped per sub-group through pinned fp32 buffers
            add_part(disk, "master_weights", 4 * part)
            add_part(disk, "optimizer_states", 8 * part)
            add_part(cpu, "buffers", NVME_OPT_BUFFERS * min(part, sub_group) * 4)
        else:
            add_part(cpu, "master_weights", 4 * part)
            add_part(cpu, "optimizer_states", 8 * part)
    elif p.engine == "fsdp":
        # FSDP2 + CPUOffloadPolicy (launcher/engines/fsdp.py): fp32 sharded params, fp32 grads and AdamW on
        # the CPU. Units: input embeddings, each layer, the head (tied embeddings stay in the root with the
        # final norm). The GPU holds the root and two neighbouring units (the running one and the
        # prefetched one) in the compute dtype, and one unit's gradients in the compute dtype plus the fp32
        # copy that is reduced and offloaded.
        layer = c.per_layer + (c.adapters_per_layer if lora else 0)
        if c.tied_embeddings:
            root, pair = c.embeddings + c.other, 2 * layer
            units = [layer]
        else:
            root, pair = c.other, max(2 * layer, c.embeddings + layer, c.head + layer)
            units = [c.embeddings, layer, c.head]
        for d in (fb, step):
            add_part(d, "weights", (root + pair) * cd)
        largest_trainable_unit = c.adapters_per_layer if lora else max(units)
        add_part(fb, "gradients", largest_trainable_unit * (cd + 4))
        # a LoRA base in 16 bits (launcher.precision.weight_dtype), the trainable weights fp32 masters
        params = frozen_bytes(weight_dtype(p.engine, p.precision, True).itemsize) + 4 * c.adapters if lora else 4 * base
        add_part(cpu, "weights", params / shard_params)
        add_part(cpu, "gradients", 4 * trainable / shard_grads)
        add_part(cpu, "optimizer_states", 8 * trainable / shard_opt)
    else:
        raise ValueError(f"no memory model for profile {p.name}")
    return {"gpu_fb": fb, "gpu_step": step, "cpu": cpu, "disk": disk}


