"""DeepSpeed ZeRO stages 0-2, with and without the optimizer on the CPU (DeepSpeed 0.19
deepspeed/runtime/zero/stage_1_and_2.py): what they keep where and move, for the cost model."""

from __future__ import annotations

from launcher.config.profiles import DS_DEFAULT_BUCKET, Profile
from launcher.plan.families.base import Family, Moves, Sizes, States


def deepspeed_optimizer(p: Profile, device: str) -> str:
    """The optimizer a DeepSpeed profile steps with: DeepSpeed's own ops for a user's JSON with an optimizer section,
    else torch's fused AdamW as DeepSpeed's client optimizer, on the offloaded partitions where they are."""
    if p.ds_optimizer:
        return "deepspeed_cpu_adam@cpu" if p.offload_optimizer else f"deepspeed_fused_adam@{device}"
    return "torch_fused_adamw@cpu" if p.offload_optimizer else f"torch_fused_adamw@{device}"


class Zero(Family):
    """ZeRO-1/2 on the GPU. The module is cast to the compute dtype; trainable params are views into one flat
    16-bit buffer. Stages 0 and 1 (only from a user's deepspeed_config) are planned with this stage-2 arithmetic: on
    one rank no stage partitions anything, and each keeps 16-bit weights, a gradient copy and fp32 master + Adam
    moments (stage 1 in DeepSpeed's ZeRO-1/2 optimizer itself; stage 0 in its bf16/fp16 optimizer). Several ranks
    partition the fp32 master and the optimizer states (stage 1 and up) and the gradients (2 and up)."""

    name = "zero2"
    machinery = 1
    deepspeed = True
    module_in_checkpoint = True

    def states(self, p: Profile, s: Sizes) -> States:
        c, cd, st = s.counts, s.cd, States()
        shard_opt = s.world if p.zero_stage >= 1 else 1
        shard_grads = s.world if p.zero_stage >= 2 else 1
        bucket_bytes = 2 * s.reduce_bucket * cd  # ipg double buffer (overlap_comm)
        st.both("weights", (s.base + c.adapters) * cd if s.lora else s.base * cd)
        st.add("fb", "buffers", bucket_bytes + s.largest_trainable * cd)  # + autograd's grad before it is bucketed
        part_opt, part_grads = s.trainable / shard_opt, s.trainable / shard_grads  # this rank's partition
        self.place_optimizer(st, cd, bucket_bytes, part_opt, part_grads, s)
        return st

    def place_optimizer(self, st: States, cd: int, bucket_bytes: int, part_opt: float, part_grads: float, s: Sizes):
        for where in ("fb", "step"):
            st.add(where, "master_weights", 4 * part_opt)
            st.add(where, "optimizer_states", 8 * part_opt)
            st.add(where, "gradients", cd * part_grads)  # grads_in_partition, allocated at the first reduction
        if cd != 4:
            st.add("step", "gradients", 4 * part_opt)  # the fp32 copy of the flat partition the update reads
        st.add("step", "buffers", bucket_bytes)

    def pinned_blocks(self, p: Profile, s: Sizes, trainable_sizes: list, groups: list,
                      frozen_sizes: list) -> list[tuple[int, int]]:
        if not p.offloads:
            return []
        out: list[tuple[int, int]] = []
        for g in groups:  # per group its fp32 partition, a 16-bit copy and the fp32 gradients
            part = -(-g // s.world)
            out += [(4 * part, 1), (s.cd * part, 1), (4 * part, 1)]
        out.append((s.cd * s.largest_trainable, 1))  # temp_grad_buffer_for_cpu_offload
        if s.accumulation > 1:  # accumulated_grads_in_cpu: one per parameter, in its dtype
            out += [(s.cd * size, k) for size, k, _m in trainable_sizes]
        return out

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        # contiguous_gradients: each gradient is copied into the bucket and from it into the partition; in the step
        # the fp32 copy of the flat gradient, its norm, unscale/clip, and the fp32 master copied back to 16 bits
        return Moves(traffic_micro=4 * cd * trainable, traffic_step=(cd + 4 + 4 + 8 + 4 + cd) * trainable)

    def collectives(self, share: float, cd: int, trainable: int, full: int) -> tuple[float, float, float]:
        # a reduce-scatter of the 16-bit gradients every micro-batch, during backward (overlap_comm), and an
        # all-gather of the updated 16-bit partitions after the step, not overlapped (reduce_ipg_grads, then
        # all_gather_dp_groups in step())
        return share * cd * trainable, 0.0, share * cd * trainable

    def setup_parts(self, p: Profile) -> tuple[str, ...]:
        # the partitions and DeepSpeed's buffers, before Adam's moments exist
        return ("weights", "master_weights", "gradients", "buffers") if p.offloads else ()

    def optimizer_kind(self, p: Profile, device: str) -> str:
        return deepspeed_optimizer(p, device)


class ZeroOffload(Zero):
    """ZeRO-2 with the optimizer on the CPU: fp32 master, its gradients and Adam's moments there."""

    name = "zero2_offload"
    # with overlap_comm, gradients are reduced and copied to pinned CPU buffers on a side stream as each bucket
    # fills during backward (reduce_independent_p_g_buckets_and_remove_grads /
    # async_inplace_copy_grad_to_fp32_buffer_from_gpu); the updated 16-bit weights are copied back after the
    # optimizer step, outside backward, so that copy does not overlap
    overlap_grads = True

    def place_optimizer(self, st: States, cd: int, bucket_bytes: int, part_opt: float, part_grads: float, s: Sizes):
        st.add("fb", "buffers", s.largest_trainable * cd)  # temp_grad_buffer_for_gpu_offload
        st.add("step", "buffers", bucket_bytes + s.largest_trainable * cd)
        st.add("cpu", "master_weights", 4 * part_opt)
        st.add("cpu", "gradients", 4 * part_opt)
        st.add("cpu", "optimizer_states", 8 * part_opt)
        st.add("cpu", "buffers", cd * part_opt + s.largest_trainable * cd)  # 16-bit update staging, grad staging
        if s.accumulation > 1:
            st.add("cpu", "gradients", cd * part_grads)  # accumulated_grads_in_cpu

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        # with overlap_comm a bucket leaves for the CPU once it is full: the last one only after backward, so its
        # share of the gradients is copied with nothing to hide behind; each bucket costs a few ops of its own
        # (the flatten into the bucket, the copy, the event, the hook's bookkeeping)
        bucket = p.reduce_bucket_size or min(DS_DEFAULT_BUCKET, trainable)
        return Moves(grads_down=cd * trainable, tail_share=min(1.0, bucket / max(1, trainable)),
                     bucket_flushes=-(-trainable // max(1, bucket)), traffic_micro=2 * cd * trainable,
                     host_traffic_step=(4 + 8) * trainable,  # norm and clip of the fp32 gradients on the CPU
                     weights_up_step=cd * trainable)
