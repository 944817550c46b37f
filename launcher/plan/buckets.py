"""DeepSpeed's gradient bucket on one rank, sized by the planner: the search plans each profile with the smallest
(hidden**2), and the setting it keeps gets the bucket the budget leaves room for (fewer reductions, or with
optimizer offload the copies that overlap backward best)."""

from __future__ import annotations

import dataclasses

from launcher.config.profiles import Profile, bucket_sizes, in_catalogue
from launcher.machine.speeds import Machine
from launcher.plan.memory.states import RunShape
from launcher.plan.rows import ProfilePlan
from launcher.plan.setting import plan_profile

# Unpriced, ZeRO's optimizer offload gets buckets of at most this share of the gradients, so that all but the last
# are copied to the CPU while backward goes on.
OFFLOAD_BUCKETS = 8


def _bucket_choice(p: Profile, run: RunShape) -> bool:
    """The planner sizes the buckets: a catalogue DeepSpeed profile on one rank (several ranks keep hidden**2,
    a user's deepspeed_config its own or Accelerate's rule)."""
    return p.is_deepspeed and in_catalogue(p) and run.world == 1 and p.reduce_bucket_size is None


def smallest_buckets(p: Profile, run: RunShape) -> Profile:
    """``p`` with hidden**2 buckets, the size the micro-batch and checkpointing search plans with: a bucket
    only ever takes the memory the chosen setting leaves (:func:`grow_buckets`), never makes it slower."""
    return dataclasses.replace(p, reduce_bucket_size=run.hidden ** 2) if _bucket_choice(p, run) else p


def grow_buckets(p: Profile, run: RunShape, row: ProfilePlan, gpu_budget: int, cpu_budget: int,
                 machine: Machine | None, pinned: bool, max_steps: int, exact: bool = True) -> ProfilePlan:
    """The chosen setting of ``p`` with its gradient bucket sized for the budget: the sizes tried are all trainable
    gradients in one bucket up to DeepSpeed's 5e8 (:func:`launcher.config.profiles.bucket_sizes`) and its halvings
    down to hidden**2, each planned (two buffers of the bucket size in the compute dtype on the GPU).

    Without optimizer offload a bucket on one rank is a fixed cost per reduction with nothing to overlap (fewer is
    never slower): the largest that fits. With optimizer offload each full bucket is copied to the CPU while backward
    goes on, and the last one only after it: a bucket as large as the gradients overlaps nothing and holds a second
    copy of them on the GPU (issue 43: the offload profile held more GPU memory than ZeRO-2 without offload). Priced
    (``machine``), the fastest that fits (the larger on a tie: ZeRO-3's step-time model does not price its buckets,
    so it keeps the largest that fits); unpriced, the largest that fits of at most 1/:data:`OFFLOAD_BUCKETS` of the
    gradients."""
    if not _bucket_choice(p, run) or not row.available or not row.fits or row.lower_bound:
        return row
    h2 = run.hidden ** 2
    trainable = run.counts.adapters if run.lora_r else run.counts.total
    size = bucket_sizes(run.hidden, 1, trainable)["reduce_bucket_size"]
    shape = dataclasses.replace(run, checkpointing=row.checkpointing, checkpoint_every=row.checkpoint_every,
                                offload_activations=row.offload_activations)
    sizes = []
    while size > h2:
        sizes.append(size)
        size //= 2
    if p.offload_optimizer and machine is None:
        sizes = [s for s in sizes if s <= trainable // OFFLOAD_BUCKETS] or sizes[-1:]
    best = None
    for size in sizes:
        bigger = plan_profile(dataclasses.replace(p, reduce_bucket_size=size), shape, row.micro_batch, gpu_budget,
                              cpu_budget, machine=machine, pinned=pinned, max_steps=max_steps, exact=exact)
        if not bigger.fits:
            continue
        bigger.reduce_bucket_size = size
        if not (p.offload_optimizer and machine is not None and bigger.step_s is not None):
            return bigger  # the largest that fits
        if best is None or bigger.step_s < best.step_s * (1 - 1e-9):
            best = bigger
    if best is not None and (row.step_s is None or best.step_s <= row.step_s):
        return best
    row.reduce_bucket_size = h2  # the row was planned with hidden**2 buckets (smallest_buckets)
    return row

