"""The order samples are consumed in: a pure function of (seed, sample counter).

Sample ``k`` of the run is ``perm(epoch=k // N)[k % N]``, so a resumed run, another engine, another
micro-batch size or another number of ranks sees the same global batches.
"""

from __future__ import annotations

import torch


def sample_index(k: int, n: int, seed: int) -> int:
    """Sample ``k`` of the run (0-based, over all epochs) -> row of the dataset."""
    epoch, pos = divmod(k, n)
    perm = _perm(n, seed + 1000 * epoch)
    return int(perm[pos])


_PERM_CACHE: dict[tuple[int, int], torch.Tensor] = {}


def _perm(n: int, seed: int) -> torch.Tensor:
    key = (n, seed)
    if key not in _PERM_CACHE:
        if len(_PERM_CACHE) > 8:
            _PERM_CACHE.clear()
        _PERM_CACHE[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return _PERM_CACHE[key]


def micro_batches(step: int, global_batch: int, micro_batch: int, rank: int, world: int, n: int,
                  seed: int) -> list[list[int]]:
    """The dataset rows of each micro-batch this rank runs for optimizer step ``step`` (0-based).

    The global batch of step s is samples [s*G, (s+1)*G); rank r takes the r-th contiguous slice of
    G/world and cuts it into micro-batches. The set of rows per step does not depend on micro or world.
    """
    per_rank = global_batch // world
    start = step * global_batch + rank * per_rank
    rows = [sample_index(k, n, seed) for k in range(start, start + per_rank)]
    return [rows[i:i + micro_batch] for i in range(0, per_rank, micro_batch)]
