"""Host memory by phase: what a run holds in CPU RAM while it sets up, trains, saves a checkpoint and writes
``final/``, and what ``vramfit export --merge`` needs afterwards; pinned memory as torch's pinned allocator holds it.

Arithmetic on top of :mod:`launcher.plan.memory.states` (the training phase's model states), following what each
engine allocates and when (vramfit's own :mod:`launcher.model.materialize` and engines; DeepSpeed 0.19
``runtime/zero/stage_1_and_2.py``, ``stage3.py``, ``partition_parameters.py``; torch's FSDP2 and its
``CachingHostAllocator``):

- **set-up**: the weights that live on the CPU (offloading engines, or a CPU run), the optimizer buffers the engine
  makes at its start (DeepSpeed's fp32 partitions and gradient buffers; Adam's moments only appear at the first
  step), and what is made one unit at a time: a unit (the embeddings, one decoder layer or the head) whole on the CPU
  before it goes to the GPU or is sharded (FSDP2 then copies it into its shards: twice, for a moment).
- **training**: the states of :func:`launcher.plan.memory.states.model_states` (and on a CPU run the device side).
- **checkpoint**: the training states without the step's transients, plus what saving copies (``torch.save`` copies a
  GPU tensor to the CPU one storage at a time; CPU tensors are written where they are).
- **final**: the same, plus what writing ``final/`` gathers: the adapter alone for LoRA; a full fine-tune's
  weights copied from the GPU one safetensors shard at a time (:data:`FINAL_SHARD_BYTES`), or gathered whole on
  rank 0 where they are sharded over several ranks.
- **export**: ``vramfit export --merge`` in its own process: the base in its dtype on the CPU, the adapter merged into
  it in place.

Pinned memory: torch's pinned allocator (``CachingHostAllocator``) rounds every block up to a power of two and keeps
freed blocks cached, so a 172 MiB weight pinned alone holds 256 MiB. :func:`pinned_blocks` lists the blocks each
engine asks it for with ``pin_memory`` on; FSDP2's CPU shards are not among them (vramfit pins them where they lie,
:func:`launcher.engines.fsdp.pin_in_place`: exactly their bytes).
"""

from __future__ import annotations

from launcher.config.profiles import Profile
from launcher.model.weights import FINAL_SHARD_BYTES
from launcher.plan.families import family_of
from launcher.plan.memory.states import QUANT_BYTES_PER_PARAM, RunShape, sizes
from launcher.precision import BYTES, trainable_dtype, weight_dtype

PHASES = ("setup", "train", "checkpoint", "final")
# parts of the training phase that live only during a step (activations and what backward makes of them)
STEP_TRANSIENT = ("activations", "logits", "autocast_weight_cache", "allocator_slack", "offloaded_activations")


def pow2(n: float) -> int:
    """The block torch's pinned allocator holds for ``n`` bytes: the next power of two."""
    n = int(n)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def held(blocks: list[tuple[int, int]]) -> int:
    """Bytes the pinned allocator holds for ``blocks`` ((bytes of one block, how many))."""
    return sum(pow2(b) * k for b, k in blocks)


def raw(blocks: list[tuple[int, int]]) -> int:
    return sum(int(b) * k for b, k in blocks)


def _trainable_sizes(run: RunShape) -> list[tuple[int, int, bool]]:
    c = run.counts
    return list(c.adapter_sizes) if run.lora_r > 0 else list(c.tensor_sizes)


def _groups(run: RunShape) -> list[int]:
    """Elements of the optimizer's parameter groups (launcher.model.build.param_groups: matrices decay, the rest
    does not)."""
    sizes = _trainable_sizes(run)
    decay = sum(n * k for n, k, matrix in sizes if matrix)
    rest = sum(n * k for n, k, matrix in sizes if not matrix)
    return [g for g in (decay, rest) if g]


def pinned_blocks(p: Profile, run: RunShape, accumulation: int) -> list[tuple[int, int]]:
    """Every block the engine of ``p`` pins through torch's allocator with ``pin_memory`` on (per rank), as its
    family lists them (:meth:`launcher.plan.families.base.Family.pinned_blocks`)."""
    frozen = [] if run.lora_r == 0 else list(run.counts.tensor_sizes)
    return family_of(p).pinned_blocks(p, sizes(p, run, accumulation), _trainable_sizes(run), _groups(run), frozen)


def pinned_total(p: Profile, run: RunShape, st: dict, accumulation: int) -> int:
    """Every byte page-locked with ``pin_memory`` on: the pinned allocator's blocks as it holds them, and the CPU
    states pinned where they lie (FSDP2's shards, the AMP offload's transfer block; what ``ulimit -l`` must
    allow)."""
    return held(pinned_blocks(p, run, accumulation)) + family_of(p).pinned_in_place(st["cpu"])


def unit_bytes(p: Profile, run: RunShape) -> int:
    """The largest unit (input embeddings, one decoder layer with its adapters, the output head) in the dtypes it is
    made in (:func:`launcher.engines.placement`)."""
    c = run.counts
    lora = run.lora_r > 0
    frozen = BYTES_OF(weight_dtype(p.module_in_compute_dtype, p.precision, lora))
    train = BYTES_OF(trainable_dtype(p.module_in_compute_dtype, p.precision))
    if lora:
        layer = c.per_layer * frozen + c.adapters_per_layer * train
        if run.quantize in QUANT_BYTES_PER_PARAM:  # made in 16 bits, then quantised layer by layer
            layer = max(layer, c.per_layer * frozen)
        return int(max(c.embeddings * frozen, layer, c.head * frozen))
    return int(max(c.embeddings, c.per_layer, c.head) * train)


def BYTES_OF(dtype) -> int:  # noqa: N802 -- a table lookup named like the tables it reads
    return dtype.itemsize


def host_phases(p: Profile, run: RunShape, st: dict, train: dict, *, runtime: int, pin: bool,
                accumulation: int) -> dict[str, dict[str, int]]:
    """{phase: {part: bytes}} for :data:`PHASES`, each summing to the phase's host peak (per rank). ``train``: the
    training phase's CPU parts (:func:`launcher.plan.setting.plan_profile`'s, the runtime left out); ``st``:
    :func:`launcher.plan.memory.states.model_states`."""
    on_gpu = run.device == "cuda"
    lora = run.lora_r > 0
    c = run.counts
    n = max(1, run.world)
    blocks = pinned_blocks(p, run, accumulation) if pin and on_gpu else []
    excess = held(blocks) - raw(blocks)
    resident = {k: v for k, v in train.items() if k not in STEP_TRANSIENT}
    if pin and on_gpu and excess > 0:
        resident["pinned_rounding"] = excess
    fam = family_of(p)

    # set-up: the weights on the CPU and the engine's first buffers, and one unit made whole
    cpu, device_side = st["cpu"], st["gpu_step"]
    setup: dict[str, int] = {}
    for part in fam.setup_parts(p):
        setup[part] = _sum(cpu, part)
    if not on_gpu and not fam.units_into_shards:  # a CPU run: the model made where it trains, and ZeRO's fp32 partition
        setup["weights"] = setup.get("weights", 0) + _sum(device_side, "weights")
        if p.is_deepspeed and not p.offloads:
            setup["master_weights"] = _sum(device_side, "master_weights")
    # one unit whole on the CPU as it is made: before it goes to the GPU, or is sharded (FSDP2 copies it into its
    # shards: on a CPU run both copies are in RAM for a moment); a CPU run makes the others where they train
    unit = unit_bytes(p, run)
    copies = (2 if not on_gpu else 1) if fam.units_into_shards else (1 if on_gpu or fam.shards_params else 0)
    setup["unit_being_made"] = unit * copies
    if pin and on_gpu and excess > 0:
        setup["pinned_rounding"] = excess

    # checkpoint: what stays between steps, and GPU tensors copied out one storage at a time
    save = 0
    if on_gpu and not p.offloads:
        largest = c.largest_adapter if lora else c.largest_param
        save = 4 * largest if not p.is_deepspeed else 4 * max(_groups(run) or [0]) // n  # a flat fp32 partition
    checkpoint = dict(resident)
    if save:
        checkpoint["save_copy"] = save

    # final/: the adapter, or the whole model gathered or copied out shard by shard
    final = dict(resident)
    if lora:
        final["final_weights"] = c.adapters * 4  # gathered (or copied from the GPU) in fp32
    else:
        model = c.total * BYTES_OF(weight_dtype(p.module_in_compute_dtype, p.precision, False))
        gathered = fam.final_gathered(model, c.total, n, BYTES[p.precision])
        if gathered is not None:
            final["final_weights"] = gathered
        elif on_gpu:
            final["final_weights"] = min(model, FINAL_SHARD_BYTES)
    out = {"setup": setup, "train": dict(train), "checkpoint": checkpoint, "final": final}
    if pin and on_gpu and excess > 0:
        out["train"]["pinned_rounding"] = excess
    return {ph: {"runtime": runtime, **{k: int(v) for k, v in parts.items() if v}} for ph, parts in out.items()}


def export_bytes(p: Profile, run: RunShape, runtime_cpu: int) -> dict[str, int]:
    """``vramfit export --merge`` of this run's adapter: the base on the CPU in the dtype the run kept it in (a
    quantised base merges into its 16-bit weights), the adapter merged in place. {} without LoRA (nothing merges:
    final/ is copied)."""
    if run.lora_r <= 0:
        return {}
    base = run.counts.total * BYTES_OF(weight_dtype(p.module_in_compute_dtype, p.precision, True))
    return {"runtime": runtime_cpu, "weights": int(base), "adapter": int(run.counts.adapters * 4)}


def _sum(parts: dict, key: str) -> int:
    return int(parts.get(key, 0))
