"""The learning-rate schedule the loop sets at every optimizer step (the engines never own one).

``train.lr_schedule=auto``: linear warmup, then cosine down to ``lr x min_lr_ratio`` (vramfit's own, unchanged
since the first release). Any other name is ``transformers.get_scheduler``'s schedule of that name, read as a
multiplier of ``train.lr`` per step (its LambdaLR's lambda, on a one-parameter optimizer that never steps), so
the loop still passes the lr to the engine itself.
"""

from __future__ import annotations

import functools
import math


def lr_at(step: int, t) -> float:
    """The lr of optimizer step ``step`` (counted from 0); ``t`` is the config's ``train`` section."""
    if getattr(t, "lr_schedule", "auto") != "auto":
        return t.lr * _multiplier(t.lr_schedule, int(t.warmup_steps), int(t.max_steps), float(t.min_lr_ratio))(step)
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@functools.lru_cache(maxsize=8)
def _multiplier(name: str, warmup: int, total: int, min_lr_ratio: float):
    import torch
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    kwargs = {"min_lr_rate": min_lr_ratio} if name == "cosine_with_min_lr" else None
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=kwargs)
    return sched.lr_lambdas[0]
