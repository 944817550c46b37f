"""Torch AMP, on one rank or as DDP (launcher/engines/amp.py), and AMP with AdamW on the CPU
(launcher/engines/offload_opt.py): what each keeps where and moves, for the cost model."""

from __future__ import annotations

from launcher.config.profiles import Profile
from launcher.plan.families.base import Family, Moves, Sizes, States
from launcher.precision import weight_dtype


class Amp(Family):
    """fp32 weights (a LoRA base in 16 bits), fp32 gradients and torch's fused AdamW on the GPU; on several ranks,
    DDP."""

    name = "amp"
    machinery = 0
    trace = "amp"
    torch_amp = True
    bitsandbytes_refusal = None
    grads_in_trace = True

    def states(self, p: Profile, s: Sizes) -> States:
        c, st = s.counts, States()
        wb = weight_dtype(p.module_in_compute_dtype, p.precision, s.lora).itemsize
        w = s.frozen_bytes(wb) + 4 * c.adapters if s.lora else wb * s.base
        st.add("fb", "weights", w)
        st.add("fb", "optimizer_states", s.opt * s.trainable)
        st.add("step", "weights", w)
        st.add("step", "optimizer_states", s.opt * s.trainable)
        if s.accumulation > 1:  # earlier micro-batches' gradients live through this one's backward
            st.add("fb", "gradients", 4 * s.trainable)
        st.add("step", "gradients", 4 * s.trainable)
        st.add("step", "buffers", s.workspace * s.trainable)
        if s.world > 1:  # DDP's gradient buckets: a copy of every trainable gradient (gradient_as_bucket_view=False)
            st.both("buffers", 4 * s.trainable)
        if s.quant is not None:  # bitsandbytes dequantizes one weight at a time
            st.add("fb", "buffers", c.largest_module * s.cd)
        return st

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        m = Moves(traffic_step=(4 + 8) * trainable)  # clip_grad_norm_: the norm, then the scale
        if accumulation > 1:
            m.traffic_micro = 12 * trainable * (accumulation - 1) / accumulation  # grad += (after the first)
        if p.precision == "fp16":
            m.traffic_step += 8 * trainable  # GradScaler.unscale_
        return m

    def collectives(self, share: float, cd: int, trainable: int, full: int) -> tuple[float, float, float]:
        # one all-reduce of the fp32 gradients per step (no_sync while accumulating), in buckets during the last
        # micro-batch's backward (torch/nn/parallel/distributed.py, the reducer's hooks)
        return 0.0, 2 * share * 4 * trainable, 0.0


class AmpOffload(Family):
    """The model in the compute dtype on the GPU; fp32 masters, their gradients and AdamW on the CPU
    (launcher/engines/offload_opt.py). One rank only (launcher.plan.availability.rank_problem): a row for several
    ranks keeps the base's collectives."""

    name = "amp_offload"
    machinery = 0
    torch_amp = True
    one_rank = True  # torch's optimizer offload has no gradient all-reduce
    bitsandbytes_refusal = ("runs on the AMP path without optimizer offload", "is not a CPU optimizer")
    # each gradient is copied down on a side stream as backward completes it (post-accumulate-grad hooks), in the
    # last micro-batch of a step; the updated weights go up on another side stream while the CPU updates the next
    # parameter, so their copy hides behind the optimizer's time, not the compute's (priced as the larger of the two)
    overlap_grads = True
    weights_behind_optimizer = True

    def states(self, p: Profile, s: Sizes) -> States:
        # the model in the compute dtype on the GPU (a LoRA base as it is, the adapters in 16 bits); each gradient
        # leaves in the last micro-batch's backward as it is complete, so the GPU holds the gradients of the earlier
        # micro-batches in 16 bits while accumulating, else about two in flight (one copying down, one being made)
        # and the fp32 temporary of one gradient's norm.
        c, cd, st = s.counts, s.cd, States()
        st.both("weights", s.frozen_bytes(cd) + cd * c.adapters if s.lora else cd * s.base)
        st.add("fb", "gradients", cd * s.trainable if s.accumulation > 1 else 2 * cd * s.largest_trainable)
        st.add("fb", "buffers", 4 * s.largest_trainable)
        # the CPU: fp32 masters, their fp32 gradients, AdamW's moments, one flat 16-bit block the gradients come
        # down to and the updated weights go up from (page-locked where it lies when the run pins)
        st.add("cpu", "master_weights", 4 * s.trainable)
        st.add("cpu", "gradients", 4 * s.trainable)
        st.add("cpu", "optimizer_states", s.opt * s.trainable)
        st.add("cpu", "buffers", cd * s.trainable)
        return st

    def moves(self, p: Profile, *, cd: int, trainable: int, full: int, accumulation: int, on_gpu: bool) -> Moves:
        m = Moves(grads_down=cd * trainable / accumulation,  # once per step: spread here over the micro-batches
                  traffic_micro=(cd + 4) * trainable / accumulation)  # each gradient's norm, in fp32, as it leaves
        if accumulation > 1:
            m.traffic_micro += 3 * cd * trainable * (accumulation - 1) / accumulation  # grad += (after the first)
        # on the CPU: widen into the fp32 gradient, the clip/unscale factor, narrow the master back to 16 bits
        m.host_traffic_step = (cd + 4 + 8 + 4 + cd) * trainable
        m.weights_up_step = cd * trainable
        return m

    def setup_parts(self, p: Profile) -> tuple[str, ...]:
        return ("master_weights", "gradients", "buffers")  # the fp32 masters as made, their gradients, the block

    def pinned_in_place(self, cpu: dict) -> int:
        return int(cpu.get("buffers", 0))  # its one transfer block, registered where it lies (exact bytes)

    def optimizer_kind(self, p: Profile, device: str) -> str:
        return "torch_fused_adamw@cpu"
