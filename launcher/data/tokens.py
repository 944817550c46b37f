"""Token samples and the batches cut from them: :class:`TokenData`.

Three kinds of samples, all read on demand (nothing is held whole in RAM but the synthetic task):

- :class:`FixedRows`: the synthetic task, a ``[N, seq_len]`` tensor;
- :class:`Stream`: text, every record + eos back to back in the mixture's order, cut into ``seq_len`` blocks at
  batch time from the memory-mapped cache (a block may join the end of one record to the next, as text packing
  does; every token is in the loss);
- :class:`Records`: one sample per record (instruction records, or text with ``data.packing=false``), cut at
  ``seq_len``, with its loss mask.

Batches: fixed-length samples stack as they are; records are padded to ``seq_len`` one per row, or, for
instruction records with ``data.packing``, packed padding-free (:mod:`.pack`): several samples per row, position
ids restarting at each sample (transformers turns them into a block-diagonal causal mask, so no sample attends
to another), the first token of each sample out of the loss (in the padded layout it has nothing before it to be
predicted from). Where samples differ in their tokens in the loss, each micro-batch carries
``num_items_in_batch`` so the step's loss is the mean over the step's tokens in the loss, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from launcher.data import pack
from launcher.data.order import micro_batches

IGNORE = -100
_VIEW_LIMIT = 1 << 24  # positions: input_ids/labels of a whole split are for inspection of small data only


class FixedRows:
    """Samples that are the rows of a ``[N, seq_len]`` tensor, every token in the loss (the synthetic task)."""

    uniform = True

    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self) -> int:
        return self.x.shape[0]

    def get(self, i: int):
        return self.x[i], None

    def length(self, i: int) -> int:
        return self.x.shape[1]


class Stream:
    """Text records back to back in mixture order, cut into ``seq_len`` blocks (the short tail is left out, unless
    it is all there is)."""

    def __init__(self, stores: list, src: np.ndarray, rows: np.ndarray, seq_len: int):
        self.stores, self.src, self.rows, self.seq_len = stores, src, rows, seq_len
        lens = np.empty(len(rows), dtype=np.int64)
        for k, st in enumerate(stores):
            sel = src == k
            lens[sel] = st.lengths[rows[sel]]
        self.cum = np.concatenate([[0], np.cumsum(lens)])
        self.total = int(self.cum[-1])
        self.n = max(1, self.total // seq_len) if self.total else 0
        self.uniform = self.total >= seq_len

    def __len__(self) -> int:
        return self.n

    def length(self, i: int) -> int:
        return min(self.seq_len, self.total - i * self.seq_len)

    def get(self, i: int):
        start, stop = i * self.seq_len, min((i + 1) * self.seq_len, self.total)
        e = int(np.searchsorted(self.cum, start, side="right")) - 1
        pieces, pos = [], start
        while pos < stop:
            a, b = int(self.cum[e]), int(self.cum[e + 1])
            if b > pos:
                pieces.append(self.stores[self.src[e]].ids(int(self.rows[e]), pos - a, min(stop, b) - a))
                pos = min(stop, b)
            e += 1
        return torch.from_numpy(np.concatenate(pieces).astype(np.int64)), None


class Records:
    """One sample per record (source, row), cut at ``seq_len``; its loss mask (None: every token)."""

    uniform = False

    def __init__(self, stores: list, src: np.ndarray, rows: np.ndarray, seq_len: int):
        self.stores, self.src, self.rows, self.seq_len = stores, src, rows, seq_len
        self.lengths = np.empty(len(rows), dtype=np.int32)
        for k, st in enumerate(stores):
            sel = src == k
            self.lengths[sel] = np.minimum(st.lengths[rows[sel]], seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def length(self, i: int) -> int:
        return int(self.lengths[i])

    def get(self, i: int):
        st, row = self.stores[self.src[i]], int(self.rows[i])
        ids = torch.from_numpy(st.ids(row, 0, self.seq_len).astype(np.int64))
        return ids, (torch.from_numpy(st.trained(row, self.seq_len)) if st.instruction else None)


@dataclass
class Step:
    """One optimizer step on one rank: its micro-batches, and the step's tokens over all ranks (padding left out):
    processed, and in the loss (the positions a next token is predicted for)."""

    batches: list[dict]
    tokens: int
    tokens_in_loss: int


@dataclass
class TokenData:
    samples: object  # FixedRows | Stream | Records
    seq_len: int
    pad_id: int = 0
    packed: bool = False  # instruction records packed padding-free into seq_len rows at batch time
    description: str = ""
    tokenizer: object | None = None
    rows: np.ndarray | None = field(default=None, repr=False)  # this split's sample ids (None: every sample)

    def __len__(self) -> int:
        return len(self.samples) if self.rows is None else len(self.rows)

    def _sample(self, i: int) -> int:
        return i if self.rows is None else int(self.rows[i])

    def _labelled(self, i: int):
        ids, mask = self.samples.get(self._sample(i))
        labels = ids.clone() if mask is None else torch.where(mask, ids, torch.full_like(ids, IGNORE))
        return ids, labels

    # ---- batches
    def _stacked(self, indices: list[int]) -> dict:
        x = torch.stack([self.samples.get(self._sample(i))[0] for i in indices]).long()
        return {"input_ids": x, "labels": x.clone()}

    def _padded(self, indices: list[int], got: dict | None = None) -> dict:
        x = torch.full((len(indices), self.seq_len), self.pad_id, dtype=torch.long)
        y = torch.full((len(indices), self.seq_len), IGNORE, dtype=torch.long)
        for r, i in enumerate(indices):
            ids, labels = got[i] if got else self._labelled(i)
            x[r, :len(ids)], y[r, :len(ids)] = ids, labels
        return {"input_ids": x, "labels": y}

    def _packed(self, indices: list[int], count: int, got: dict | None = None) -> list[dict]:
        lengths = [self.samples.length(self._sample(i)) for i in indices]
        out = []
        for blocks in pack.plan_step(lengths, self.seq_len, count):
            width = max(sum(lengths[p] for p in b) for b in blocks)
            width = min(self.seq_len, -(-width // 8) * 8)  # rows as long as the longest, in whole 8-token units
            x = torch.full((len(blocks), width), self.pad_id, dtype=torch.long)
            y = torch.full((len(blocks), width), IGNORE, dtype=torch.long)
            pos = torch.zeros((len(blocks), width), dtype=torch.long)
            for r, b in enumerate(blocks):
                o = 0
                for p in b:
                    ids, labels = got[indices[p]] if got else self._labelled(indices[p])
                    n = len(ids)
                    x[r, o:o + n], y[r, o:o + n] = ids, labels
                    y[r, o] = IGNORE  # nothing before a sample's first token predicts it
                    pos[r, o:o + n] = torch.arange(n)
                    o += n
                pos[r, o:] = torch.arange(width - o)  # the padding is a sequence of its own
            # use_cache=False: transformers looks for packed position ids only when no KV cache is being built
            out.append({"input_ids": x, "labels": y, "position_ids": pos, "use_cache": False})
        return out

    def batch(self, indices: list[int]) -> dict:
        """One micro-batch of these samples (eval, diagnosis)."""
        if self.samples.uniform:
            return self._stacked(indices)
        return self._packed(indices, 1)[0] if self.packed else self._padded(indices)


    def step(self, step: int, global_batch: int, micro_batch: int, rank: int, world: int, seed: int) -> Step:
        """The micro-batches this rank runs for optimizer step ``step``: the samples :func:`micro_batches` gives it,
        stacked, padded, or packed."""
        n = len(self)
        groups = micro_batches(step, global_batch, micro_batch, rank, world, n, seed)
        if self.samples.uniform:
            return Step([self._stacked(g) for g in groups], global_batch * self.seq_len,
                        global_batch * (self.seq_len - 1))
        everyone = micro_batches(step, global_batch, global_batch, 0, 1, n, seed)[0]
        got = {i: self._labelled(i) for i in dict.fromkeys(everyone)}  # each sample read once
        tokens = sum(len(got[i][0]) for i in everyone)  # a sample twice in a step (an epoch ends) counts twice
        in_loss = sum(int((got[i][1][1:] != IGNORE).sum()) for i in everyone)
        if self.packed:
            batches = self._packed([i for g in groups for i in g], len(groups), got)
        else:
            batches = [self._padded(g, got) for g in groups]
        # Each rank's loss is sum / (in_loss / world); the engines divide it by the accumulation and average the
        # ranks' gradients, so the step minimises the mean over all of the step's tokens in the loss.
        items = max(1, in_loss) / (world * len(groups))
        for b in batches:
            b["num_items_in_batch"] = items
        return Step(batches, tokens, in_loss)

    # ---- inspection
    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i`` as (input ids, labels), unpadded."""
        return self._labelled(i)

    def _view(self) -> dict:
        if len(self) * self.seq_len > _VIEW_LIMIT:
            raise RuntimeError(f"{len(self)} samples x {self.seq_len} positions is too many to view at once; use "
                               "batch() or example()")
        idx = list(range(len(self)))
        return self._stacked(idx) if self.samples.uniform else self._padded(idx)

    @property
    def input_ids(self) -> torch.Tensor:
        """Every sample padded to seq_len, ``[N, seq_len]`` (small data; training never builds this)."""
        return self._view()["input_ids"]

    @property
    def labels(self) -> torch.Tensor:
        return self._view()["labels"]

    def split(self, eval_fraction: float, seed: int) -> tuple[TokenData, TokenData | None]:
        if eval_fraction <= 0 or len(self) < 2:
            return self, None
        n_eval = max(1, int(round(len(self) * eval_fraction)))
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + 7)).numpy()
        base = np.arange(len(self)) if self.rows is None else self.rows

        def part(ix, what):
            return TokenData(self.samples, self.seq_len, self.pad_id, self.packed, f"{self.description} ({what})",
                             self.tokenizer, base[ix])

        return part(perm[n_eval:], "train"), part(perm[:n_eval], "eval")


def pad_id(tokenizer) -> int:
    """The pad token (eos where the tokenizer has none: padded positions are never in the loss)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
