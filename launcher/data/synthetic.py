"""The built-in learnable task of the demo and the tests: no files, no tokenizer."""

from __future__ import annotations

import torch

from launcher.data.tokens import FixedRows, TokenData


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
    return TokenData(FixedRows(x), seq_len, description=f"synthetic Markov chain (vocab {vocab_size}, entropy 0.50 "
                     "nats/token)")


SYNTHETIC_ENTROPY = 0.5004024235381879  # -(0.8 ln 0.8 + 0.2 ln 0.2)
