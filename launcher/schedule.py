"""The learning-rate schedule the loop sets at every optimizer step (the engines never own one)."""

from __future__ import annotations

import math


def lr_at(step: int, t) -> float:
    """Linear warmup to ``train.lr``, then cosine down to ``lr x min_lr_ratio`` at ``max_steps``; ``t`` is
    the config's ``train`` section and ``step`` counts optimizer steps from 0."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
