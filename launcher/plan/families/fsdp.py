"""Torch FSDP2 with its CPU offload policy (launcher/engines/fsdp.py;
torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): what it keeps where and moves, for the cost model."""

from __future__ import annotations

from launcher.config.profiles import Profile
from launcher.plan.families.base import Family, Moves, Sizes, States
from launcher.precision import weight_dtype


class Fsdp(Family):
    """fp32 sharded params, fp32 grads and AdamW on the CPU. Units: input embeddings, each layer, the head (tied
    embeddings stay in the root with the final norm). The GPU holds the root and two neighbouring units (the running
    one and the prefetched one) in the compute dtype, and one unit's gradients in the compute dtype plus the fp32
    copy that is reduced and offloaded. Parameters, gradients and states are sharded over the ranks; each
    micro-batch all-gathers every unit for forward and backward and reduce-scatters the gradients (the base's
    collectives)."""

    name = "fsdp"
    machinery = 2
    fully_shard = True
    # the next unit's all-gather (the H2D copy of its CPU shard) is prefetched during the current unit's compute,
    # forward and backward (implicit prefetching), and reduced gradients are offloaded with non_blocking copies
    overlap_grads = True
    overlap_weights = True
    shards_params = True
    units_into_shards = True

    @staticmethod
    def _units(s: Sizes) -> tuple[int, int, list[int]]:
        """Elements of the root unit, of a layer, and of every unit but the root (the embeddings and the head are
        units of their own when untied)."""
        c = s.counts
        layer = c.per_layer + (c.adapters_per_layer if s.lora else 0)
        if c.tied_embeddings:
            return c.embeddings + c.other, layer, [layer]
        return c.other, layer, [c.embeddings, layer, c.head]

    def states(self, p: Profile, s: Sizes) -> States:
        c, cd, st, n = s.counts, s.cd, States(), s.world
        root, layer, units = self._units(s)
        pair = 2 * layer if c.tied_embeddings else max(2 * layer, c.embeddings + layer, c.head + layer)
        st.both("weights", (root + pair) * cd)
        largest_trainable_unit = c.adapters_per_layer if s.lora else max(units)
        st.add("fb", "gradients", largest_trainable_unit * (cd + 4))
        # a LoRA base in 16 bits (launcher.precision.weight_dtype), the trainable weights fp32 masters
        params = (s.frozen_bytes(weight_dtype(p.module_in_compute_dtype, p.precision, True).itemsize) + 4 * c.adapters if s.lora
                  else 4 * s.base)
        st.add("cpu", "weights", params / n)
        st.add("cpu", "gradients", 4 * s.trainable / n)
        st.add("cpu", "optimizer_states", 8 * s.trainable / n)
        return st

    def gathered_at_once(self, p: Profile, s: Sizes) -> int:
        root, _, units = self._units(s)
        return max(root, *units)  # fully_shard all-gathers one unit at a time

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        if on_gpu:
            return Moves(weights_up_micro=2 * 4 * full,  # each unit's fp32 shard for forward and for backward
                         grads_down=4 * trainable,
                         traffic_micro=2 * (4 + cd) * full,  # the cast to the compute dtype after each copy
                         host_traffic_step=(4 + 8) * trainable)
        # the CPU mesh: nothing to copy, the casts remain
        return Moves(traffic_micro=2 * (4 + cd) * full + (cd + 4) * trainable, host_traffic_step=(4 + 8) * trainable)

    def pinned_blocks(self, p: Profile, s: Sizes, trainable_sizes: list, groups: list,
                      frozen_sizes: list) -> list[tuple[int, int]]:
        # the trainable shards' gradients, sent to pinned blocks of FSDP's own (post_backward)
        return [(4 * -(-size // s.world), k) for size, k, _m in trainable_sizes]

    def setup_parts(self, p: Profile) -> tuple[str, ...]:
        return ("weights",)  # the shards; gradients and Adam's moments come with the first step

    def final_gathered(self, model: int, total: int, world: int, cd: int) -> int | None:
        return 0 if world == 1 else model  # gathered on rank 0 (one rank: the shards are it)

    def pinned_in_place(self, cpu: dict) -> int:
        return int(cpu.get("weights", 0))  # the CPU shards (launcher.engines.fsdp.pin_in_place)

    def optimizer_kind(self, p: Profile, device: str) -> str:
        return "torch_fused_adamw@cpu"  # FSDP2's CPU offload policy steps on the CPU
