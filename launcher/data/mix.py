"""Several sources, one sequence of samples: ``interleave_datasets`` with the sources' weights and the run's seed.

Only the samples' addresses (source, row) are interleaved, never their tokens: the mixture is a small integer
array, so changing weights costs no tokenizing and no copy of the corpus. ``all_exhausted``: every sample of
every source is in the mixture at least once, and sources with a larger share than their size are repeated
(oversampled) to keep the weights. :mod:`.order` then shuffles the mixture anew each epoch.
"""

from __future__ import annotations

import numpy as np

from launcher.config.schema import ConfigError

MAX_MIXTURE = 200_000_000  # samples; beyond that the weights ask to repeat a small source absurdly often


def mixture(kept: list[np.ndarray], weights: list[float], seed: int, labels: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(source index, row) of every sample of the mixture, in interleaved order."""
    if len(kept) == 1:
        return np.zeros(len(kept[0]), dtype=np.int16), kept[0].astype(np.int64, copy=False)
    import datasets

    total = sum(weights)
    probs = [w / total for w in weights]
    expected = max(len(k) / p for k, p in zip(kept, probs))
    if expected > MAX_MIXTURE:
        i = max(range(len(kept)), key=lambda j: len(kept[j]) / probs[j])
        raise ConfigError([f"{labels[i]}: weight {weights[i]:g} against its {len(kept[i]):,} samples would make a "
                           f"mixture of about {expected:,.0f} samples (the others repeated to keep the shares); rule: at "
                           f"most {MAX_MIXTURE:,}; fix: raise that source's weight, or lower the weight of the small "
                           "sources"], "data")
    offsets = np.cumsum([0] + [len(k) for k in kept])
    parts = [datasets.Dataset.from_dict({"i": np.arange(offsets[j], offsets[j + 1], dtype=np.int64)})
             for j in range(len(kept))]
    mixed = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    ids = np.asarray(mixed.with_format("numpy")["i"], dtype=np.int64)
    src = (np.searchsorted(offsets, ids, side="right") - 1).astype(np.int16)
    rows = np.concatenate(kept).astype(np.int64, copy=False)[ids]
    return src, rows
