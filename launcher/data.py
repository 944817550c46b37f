"""Training data: fixed-length token samples and the deterministic order they are consumed in.

A :class:`TokenData` holds ``input_ids`` and ``labels`` (``-100`` = not in the loss) as two
``[N, seq_len]`` tensors. The order is a pure function of (seed, sample counter): sample ``k`` of the
run is ``perm(epoch=k // N)[k % N]``, so a resumed run, another engine, another micro-batch size or
another number of ranks sees the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from launcher.config import Config


@dataclass
class TokenData:
    input_ids: torch.Tensor  # [N, seq_len] int64
    labels: torch.Tensor  # [N, seq_len] int64, -100 where masked
    description: str = ""
    tokenizer: object | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices: list[int]) -> dict:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx]}

    def split(self, eval_fraction: float, seed: int) -> tuple["TokenData", "TokenData | None"]:
        if eval_fraction <= 0 or len(self) < 2:
            return self, None
        n_eval = max(1, int(round(len(self) * eval_fraction)))
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + 7))
        ev, tr = perm[:n_eval], perm[n_eval:]
        mk = lambda ix, what: TokenData(self.input_ids[ix], self.labels[ix], f"{self.description} ({what})", self.tokenizer)  # noqa: E731
        return mk(tr, "train"), mk(ev, "eval")


def synthetic_task(num_samples: int, seq_len: int, vocab_size: int, seed: int) -> TokenData:
    """A learnable task: a sparse random Markov chain over ``vocab_size`` tokens.

    Each token has two successors, taken with probability 0.8 and 0.2, so the best possible loss is
    the chain's entropy, 0.50 nats/token, against ln(vocab_size) (5.55 for 256) for a model that knows
    nothing. The chain is fixed by ``seed``; a model that learns it lowers the loss by ~5 nats.
    """
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab_size, generator=g)[:2] for _ in range(vocab_size)])  # [V, 2]
    x = torch.empty(num_samples, seq_len, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=g)
    for t in range(1, seq_len):
        pick = (torch.rand(num_samples, generator=g) < 0.2).long()
        x[:, t] = succ[x[:, t - 1], pick]
    return TokenData(x, x.clone(), f"synthetic Markov chain (vocab {vocab_size}, entropy 0.50 nats/token)")


SYNTHETIC_ENTROPY = 0.5004024235381879  # -(0.8 ln 0.8 + 0.2 ln 0.2)


def load_data(cfg: Config, vocab_size: int, tokenizer=None) -> TokenData:
    if cfg.data.source == "synthetic":
        if cfg.data.vocab_size > vocab_size:
            from launcher.config import ConfigError

            raise ConfigError([f"data.vocab_size: got {cfg.data.vocab_size}; rule: the synthetic task's vocabulary "
                               f"must fit the model's ({vocab_size}); fix: data.vocab_size={min(256, vocab_size)}"])
        return synthetic_task(cfg.data.num_samples, cfg.data.seq_len, cfg.data.vocab_size, cfg.seed)
    from launcher.datasets_io import load_file_data

    return load_file_data(cfg, tokenizer, vocab_size)


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
