"""The eval loss of a run's eval split, and its perplexity: used between steps (train.eval_every) and at the end."""

from __future__ import annotations

import math

import torch

from launcher.machine import dist


def perplexity(loss: float | None, task: str) -> float | None:
    """exp(loss) of a language model's eval loss; None without a loss or for a preference task (the exponential of
    a DPO loss means nothing)."""
    if loss is None or task != "causal_lm":
        return None
    return math.exp(loss) if loss < 700 else float("inf")


@torch.no_grad()
def evaluate(engine, data, micro_batch: int, ranks: dist.Dist, max_batches: int = 0) -> float:
    """Mean eval loss over the eval split, every sample once (``max_batches`` > 0: at most that many micro-batches
    per rank), weighted by the samples of each micro-batch. Every rank runs the same number of batches (ZeRO-3 and
    FSDP forwards are collective); a rank past the end repeats the last samples with weight 0."""
    n = len(data)
    per_round = micro_batch * ranks.world
    batches = max(1, -(-n // per_round))
    if max_batches:
        batches = min(batches, max_batches)
    total, weight = 0.0, 0
    for i in range(batches):
        start = (i * ranks.world + ranks.rank) * micro_batch
        idx = [j for j in range(start, start + micro_batch) if j < n]
        loss = engine.eval_loss(data.batch(idx or [n - 1]))
        total, weight = total + loss * len(idx), weight + len(idx)
    # sums over ranks (mean x world), so each sample weighs the same wherever it was evaluated
    return ranks.mean(total) / max(1e-12, ranks.mean(float(weight)))
