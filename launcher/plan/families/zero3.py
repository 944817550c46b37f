"""DeepSpeed ZeRO-3, its parameters and optimizer on the CPU or on NVMe (ZeRO-Infinity) (DeepSpeed 0.19
deepspeed/runtime/zero/stage3.py and partitioned_param_coordinator.py): what it keeps where and moves, for the
cost model."""

from __future__ import annotations

from launcher.config.profiles import (
    NVME_OPT_BUFFERS,
    NVME_PARAM_BUFFER_SIZE,
    NVME_PARAM_BUFFERS,
    NVME_SUB_GROUP,
    Profile,
    bucket_sizes,
)
from launcher.plan.families.base import Family, Moves, Sizes, States
from launcher.plan.families.zero import deepspeed_optimizer

ZERO3_SUB_GROUP = 1_000_000_000  # DeepSpeed sub_group_size default: fp32 gradient buffer size cap


class Zero3(Family):
    """Parameters live partitioned on the CPU; the GPU gathers the module in use plus the prefetch bucket. Every
    micro-batch gathers each layer's 16-bit parameters for forward and again for backward, prefetched while the
    previous layer computes, and reduce-scatters the gradients (the base's collectives)."""

    name = "zero3"
    machinery = 3
    deepspeed = True
    module_in_checkpoint = True
    shards_params = True

    def states(self, p: Profile, s: Sizes) -> States:
        c, cd, st, n = s.counts, s.cd, States(), s.world
        b = bucket_sizes(s.hidden)
        prefetch = p.prefetch_bucket_size if p.prefetch_bucket_size is not None else b["stage3_prefetch_bucket_size"]
        st.both("weights", (c.largest_module + prefetch) * cd + c.small_params * cd)
        st.add("fb", "gradients", min(c.largest_module, s.trainable) * cd)
        st.add("fb", "buffers", s.reduce_bucket * cd)
        sub_group = NVME_SUB_GROUP if p.nvme_optimizer else ZERO3_SUB_GROUP
        part = s.trainable / n  # this rank's partition of what trains, and of the parameters
        if p.nvme_param:  # ZeRO-Infinity: 16-bit parameters on the disk, read through pinned swap buffers
            st.add("disk", "weights", (s.base + c.adapters) * cd / n)
            st.add("cpu", "buffers", NVME_PARAM_BUFFERS * max(NVME_PARAM_BUFFER_SIZE, c.largest_param) * cd)
        else:
            st.add("cpu", "weights", (s.base + c.adapters) * cd / n)
        st.add("cpu", "gradients", cd * part + 4 * min(part, sub_group))
        if p.nvme_optimizer:  # fp32 master, Adam m and v swapped per sub-group through pinned fp32 buffers
            st.add("disk", "master_weights", 4 * part)
            st.add("disk", "optimizer_states", 8 * part)
            st.add("cpu", "buffers", NVME_OPT_BUFFERS * min(part, sub_group) * 4)
        else:
            st.add("cpu", "master_weights", 4 * part)
            st.add("cpu", "optimizer_states", 8 * part)
        return st

    def gathered_at_once(self, p: Profile, s: Sizes) -> int:
        return s.counts.largest_module  # a module's parameters in one coalesced all-gather

    def pinned_blocks(self, p: Profile, s: Sizes, trainable_sizes: list, groups: list,
                      frozen_sizes: list) -> list[tuple[int, int]]:
        # every parameter's partition pinned on its own (partition_parameters.py); the trainable ones then move into
        # one flat block per group, their own blocks staying cached by the allocator; the gradient partitions in one
        # flat block; an fp32 gradient block per optimizer sub-group
        if not p.offloads:
            return []
        out: list[tuple[int, int]] = []
        n, cd = s.world, s.cd
        if p.offload_param and not p.nvme_param:
            for size, k, _m in frozen_sizes + trainable_sizes:
                out.append((cd * -(-size // n), k))
            out += [(cd * -(-g // n), 1) for g in groups]
        part = -(-s.trainable // n)
        out.append((cd * part, 1))  # grad_partitions_flat_buffer (gradient accumulation dtype: the model's)
        if not p.nvme_optimizer:  # (NVMe's fp32 sub-groups go through its swap buffers instead)
            full, rest = divmod(part, ZERO3_SUB_GROUP)
            out += [(4 * ZERO3_SUB_GROUP, full)] if full else []
            out += [(4 * rest, 1)] if rest else []
        return out

    def setup_parts(self, p: Profile) -> tuple[str, ...]:
        # the partitions and DeepSpeed's buffers, before Adam's moments exist
        return ("weights", "master_weights", "gradients", "buffers") if p.offloads else ()

    def final_gathered(self, model: int, total: int, world: int, cd: int) -> int | None:
        return total * cd  # the consolidated 16-bit state dict, on rank 0

    def optimizer_kind(self, p: Profile, device: str) -> str:
        return deepspeed_optimizer(p, device)


class Zero3Offload(Zero3):
    """ZeRO-3 with parameters and optimizer offloaded: 16-bit weights up for every forward and again for every
    backward, gradients down, the step on the CPU."""

    name = "zero3_offload"
    # it prefetches the next modules' parameters (stage3_prefetch_bucket_size) on a side stream while the current
    # one computes, in forward and backward; gradients leave on the reduction stream (overlap_comm)
    overlap_grads = True
    overlap_weights = True

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        return Moves(weights_up_micro=2 * cd * full,  # forward, and again in backward
                     grads_down=cd * trainable,
                     host_traffic_step=(4 + 8 + 4 + cd) * trainable)  # norm, clip, master -> 16-bit partition
