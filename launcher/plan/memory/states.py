"""Model-state bytes per profile: weights, gradients, fp32 master copies, optimizer states and buffers,
on the GPU and the CPU, by phase -- the sum over what each engine family allocates (:mod:`launcher.plan.families`,
each citing the engine source it follows). Activations are traced
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

from launcher.config.profiles import Profile, bucket_sizes, in_catalogue
from launcher.plan.families import family_of
from launcher.plan.families.base import Sizes
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
    weights = weight_dtype(p.module_in_compute_dtype, p.precision, False).itemsize
    if family_of(p).module_in_checkpoint:
        ckpt = trainable * (weights + 4 + opt)
    else:
        ckpt = trainable * (4 + opt)
    return {"checkpoint": int(ckpt + CHECKPOINT_EXTRA_BYTES), "final": int(trainable * weights + FINAL_EXTRA_BYTES)}


def sizes(p: Profile, run: RunShape, accumulation: int) -> Sizes:
    """The sizes the engine families answer from, for profile ``p`` on ``run``."""
    c = run.counts
    lora = run.lora_r > 0
    trainable = c.adapters if lora else c.total
    # buckets as the engine resolves them: the planner's choice, else the rule for this many ranks (a user's
    # deepspeed_config with "auto" keeps Accelerate's hidden**2, as the HF Trainer would)
    rb = p.reduce_bucket_size or bucket_sizes(run.hidden, run.world, trainable if in_catalogue(p) else None)[
        "reduce_bucket_size"]
    return Sizes(counts=c, cd=BYTES[p.precision], lora=lora, base=c.total, trainable=trainable,
                 opt=OPTIMIZER_BYTES_PER_PARAM[run.optimizer], workspace=AMP_OPTIMIZER_WORKSPACE,
                 largest_trainable=c.largest_adapter if lora else c.largest_param, hidden=run.hidden,
                 world=max(1, run.world), reduce_bucket=rb, accumulation=accumulation,
                 quant=QUANT_BYTES_PER_PARAM.get(run.quantize))


def model_states(p: Profile, run: RunShape, accumulation: int) -> dict:
    """Model-state bytes of profile ``p``: {"gpu_fb", "gpu_step", "cpu", "disk"} part dicts (no activations), as
    its engine family places them (:meth:`launcher.plan.families.base.Family.states`).

    "gpu_*" is the device the model computes on (the CPU itself when there is no GPU).
    """
    fam, s = family_of(p), sizes(p, run, accumulation)
    st = fam.states(p, s)
    if run.device == "cpu" and s.world > 1:
        # CPU ranks talk over gloo, whose all-gather holds a copy of its output beside the output itself (2.0x the
        # gathered bytes from 32 to 256 MiB: scripts/bench_gloo_gather.py, bench/results/2026-12-06-cpu-epyc/
        # gloo-gather/); a GPU's NCCL gathers into the output alone
        st.add("fb", "buffers", fam.gathered_at_once(p, s) * s.cd)
    return st.to_dict()
