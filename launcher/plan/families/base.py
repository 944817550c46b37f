"""What the cost model asks of an engine, and the run's sizes every answer is computed from.

A :class:`Family` is one way an engine holds and moves a model's states (AMP, AMP with the optimizer on the CPU,
ZeRO-1/2, ZeRO-3, FSDP2). It answers: where its states live per rank (:meth:`Family.states`), what it copies
between GPU and CPU and passes over on each device per micro-batch and per step (:meth:`Family.moves`), which copies
overlap compute, what its ranks send each other (:meth:`Family.collectives`), which optimizer steps it, and which
activation trace it runs. :mod:`launcher.plan.memory.states` and :mod:`launcher.plan.steptime` sum the answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config.profiles import Profile


@dataclass(frozen=True)
class Sizes:
    """The run's sizes in elements and bytes, as :func:`launcher.plan.memory.states.model_states` derives them."""

    counts: object  # launcher.plan.memory.shape.ParamCounts
    cd: int  # bytes of the compute dtype
    lora: bool
    base: int  # base-model parameters (frozen under LoRA)
    trainable: int
    opt: int  # the optimizer's state bytes per trainable parameter
    workspace: int  # the optimizer's scratch bytes per trainable parameter (AMP's update)
    largest_trainable: int
    hidden: int
    world: int  # ranks the states are partitioned over (at least 1)
    reduce_bucket: int  # ZeRO's reduce bucket in elements, as the engine resolves it
    accumulation: int
    quant: float | None  # bytes per linear weight of a quantized base (None: not quantized)

    def frozen_bytes(self, dtype_bytes: int) -> float:
        """Bytes of the base model in ``dtype_bytes`` per parameter, its linear weights quantized where they are."""
        c = self.counts
        if self.quant is not None:
            return (self.base - c.linear_weights) * dtype_bytes + c.linear_weights * self.quant
        return self.base * dtype_bytes


def add_part(d: dict, part: str, n: float):
    """Add ``n`` bytes of ``part`` to the part dict ``d``, rounded; nothing for zero."""
    if n:
        d[part] = d.get(part, 0) + int(round(n))


@dataclass
class States:
    """Model-state bytes by part: on the compute device in forward/backward (``fb``) and in the step, on the CPU,
    and on the disk (ZeRO-Infinity's swap files under memory.nvme_path)."""

    fb: dict = field(default_factory=dict)
    step: dict = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)
    disk: dict = field(default_factory=dict)

    def add(self, where: str, part: str, n: float):
        """Add ``n`` bytes of ``part`` to ``where`` ('fb', 'step', 'cpu', 'disk'), rounded; nothing for zero."""
        add_part(getattr(self, where), part, n)

    def both(self, part: str, n: float):
        """Add ``n`` bytes of ``part`` to the device in forward/backward and in the step."""
        self.add("fb", part, n)
        self.add("step", part, n)

    def to_dict(self) -> dict:
        return {"gpu_fb": self.fb, "gpu_step": self.step, "cpu": self.cpu, "disk": self.disk}


@dataclass
class Moves:
    """Bytes a family moves: between GPU and CPU (``grads_down`` per micro-batch, ``weights_up_micro`` per
    micro-batch, ``weights_up_step`` per step), over the compute device's memory in its own passes
    (``traffic_micro``, ``traffic_step``) and the host's (``host_traffic_step``); ``tail_share``: the share of
    ``grads_down`` that leaves after backward with nothing to hide behind; ``bucket_flushes``: gradient buckets
    flushed per micro-batch, each a few ops of its own."""

    grads_down: float = 0.0
    weights_up_micro: float = 0.0
    weights_up_step: float = 0.0
    tail_share: float = 0.0
    traffic_micro: float = 0.0
    traffic_step: float = 0.0
    host_traffic_step: float = 0.0
    bucket_flushes: int = 0


class Family:
    """One engine family; subclasses answer for theirs. ``name`` keys the machine's measured fixed costs and
    corrections (:class:`launcher.machine.speeds.Machine`), ``machinery`` is the engine's machinery over plain
    torch (smaller is simpler), ``overlap_grads``/``overlap_weights`` say whether its gradient and weight copies run on
    a side stream while layers compute, ``weights_behind_optimizer`` whether the weights' upload after the step hides
    behind the optimizer's update, ``trace`` which activation trace a 16-bit run takes ('amp': fp32 weights under
    autocast, '16bit': the whole model in the compute dtype), ``module_in_checkpoint`` whether a checkpoint holds the
    module's copy of what trains beside the fp32 master (DeepSpeed's, in the compute dtype), ``shards_params`` whether
    the parameters are sharded over the ranks (FSDP2, ZeRO-3), ``units_into_shards`` whether each unit, made whole on
    the CPU, is copied into the engine's shards (FSDP2: on a CPU run both copies are in RAM for a moment).

What it asks of the machine and the settings (:mod:`launcher.plan.availability`): ``deepspeed`` whether it is one
of DeepSpeed's (the package must import, no ``model.compile``, fp16 where DeepSpeed allows it), ``fully_shard``
whether it needs torch's FSDP2, ``torch_amp`` whether it is the AMP path (ranked first without step times),
``one_rank`` whether it runs on one rank only, ``bitsandbytes_refusal`` why a quantized base and an 8-bit
optimizer cannot run on it (None: they can), ``grads_in_trace`` whether the run's gradients are the trace's, where
the backward makes them (with no accumulation)."""

    name = ""
    machinery = 0
    overlap_grads = False
    overlap_weights = False
    weights_behind_optimizer = False
    trace = "16bit"
    module_in_checkpoint = False
    shards_params = False
    units_into_shards = False
    deepspeed = False
    fully_shard = False
    torch_amp = False
    one_rank = False
    bitsandbytes_refusal: tuple[str, str] | None = ("runs on the AMP path only", "runs on the AMP path only")
    grads_in_trace = False

    def states(self, p: Profile, s: Sizes) -> States:
        """Where its model states live per rank, by part, on the device and the CPU (and the disk)."""
        raise NotImplementedError

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        """What crosses between GPU and CPU and what the engine passes over, for ``trainable`` parameters that
        train of ``full`` the forward touches."""
        return Moves()

    def collectives(self, share: float, cd: int, trainable: int, full: int) -> tuple[float, float, float]:
        """Bytes each rank sends per micro-batch overlapped, per step overlapped with a micro-batch, per step not
        overlapped (``share``: (N-1)/N of a ring). The sharded engines' (ZeRO-3, FSDP2): every micro-batch gathers
        each layer's 16-bit parameters for forward and again for backward, prefetched while the previous layer
        computes, and reduce-scatters the gradients."""
        return 2 * share * cd * full + share * cd * trainable, 0.0, 0.0

    def gathered_at_once(self, p: Profile, s: Sizes) -> int:
        """Elements of the largest all-gather the engine makes in a step (0: it gathers no weights)."""
        return 0

    def pinned_blocks(self, p: Profile, s: Sizes, trainable_sizes: list, groups: list,
                      frozen_sizes: list) -> list[tuple[int, int]]:
        """Every block (bytes of one, how many) the engine asks torch's pinned allocator for with ``pin_memory`` on,
        per rank. ``trainable_sizes``/``frozen_sizes``: (elements, how many, a matrix) of the tensors that train and
        of the frozen ones; ``groups``: elements of each optimizer parameter group."""
        return []

    def pinned_in_place(self, cpu: dict) -> int:
        """Bytes of the CPU states (``cpu``: part -> bytes) the run pins where they lie, outside the allocator."""
        return 0

    def setup_parts(self, p: Profile) -> tuple[str, ...]:
        """The CPU state parts the engine makes at its start, before the first step."""
        return ()

    def final_gathered(self, model: int, total: int, world: int, cd: int) -> int | None:
        """Bytes of a full fine-tune's weights gathered whole for ``final/`` (``model``: the whole model in the
        weights' dtype, ``total`` parameters); None where they are copied out one shard at a time."""
        return None

    def optimizer_kind(self, p: Profile, device: str) -> str:
        """The AdamW it steps with, ``<kind>@<device>``."""
        return f"torch_fused_adamw@{device}"

    def trace_family(self, p: Profile) -> str:
        """Which trace a profile's activations come from: :attr:`trace`, or 'fp32' for an fp32 run."""
        return "fp32" if p.precision == "fp32" else self.trace
