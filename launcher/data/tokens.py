"""Token samples: :class:`TokenData` (fixed-length ``input_ids`` and ``labels``, ``-100`` = not in the loss)
and the tokenization of text, prompt/response pairs and chats into it.

Text is packed back to back into ``seq_len`` blocks (or one sample per record); instruction records are
one sample each, cut at ``seq_len`` and padded with the pad token, which is never in the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


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

    def split(self, eval_fraction: float, seed: int) -> tuple[TokenData, TokenData | None]:
        if eval_fraction <= 0 or len(self) < 2:
            return self, None
        n_eval = max(1, int(round(len(self) * eval_fraction)))
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + 7))
        ev, tr = perm[:n_eval], perm[n_eval:]
        mk = lambda ix, what: TokenData(self.input_ids[ix], self.labels[ix], f"{self.description} ({what})", self.tokenizer)  # noqa: E731
        return mk(tr, "train"), mk(ev, "eval")


def _ids(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=special, verbose=False)["input_ids"]


def pad_id(tokenizer) -> int:
    """The pad token (eos where the tokenizer has none: padded positions are never in the loss)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pad_rows(rows: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> TokenData:
    n = len(rows)
    x = torch.full((n, seq_len), pad_id, dtype=torch.long)
    y = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        x[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        y[i, :len(labels)] = torch.as_tensor(labels, dtype=torch.long)
    return TokenData(x, y)


def tokenize_text(texts: list[str], tokenizer, seq_len: int, packing: bool) -> tuple[TokenData, str]:
    eos = tokenizer.eos_token_id
    docs = [ids + [eos] for ids in _ids(tokenizer, texts, True)]
    if packing:
        stream = [t for d in docs for t in d]
        rows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
        if len(rows) > 1 and len(rows[-1]) < seq_len:
            rows.pop()  # a short tail would be mostly padding
        note = f"{len(stream)} tokens packed into {len(rows)} blocks"
        return pad_rows([(r, r) for r in rows], seq_len, pad_id(tokenizer)), note
    cut = sum(len(d) > seq_len for d in docs)
    rows = [(d[:seq_len], d[:seq_len]) for d in docs]
    return pad_rows(rows, seq_len, pad_id(tokenizer)), f"one sample per record, {cut} cut at {seq_len} tokens"


def tokenize_pairs(prompts: list[str], responses: list[str], tokenizer, seq_len: int,
                   special_prompt: bool = True, eos_after: bool = True) -> tuple[list, int, int]:
    """(rows, cut, dropped): prompt tokens masked, response tokens (+ eos) trained, cut at seq_len."""
    eos = [tokenizer.eos_token_id] if eos_after else []
    rows, cut, dropped = [], 0, 0
    for p, r in zip(_ids(tokenizer, prompts, special_prompt), _ids(tokenizer, responses, False)):
        ids, labels = p + r + eos, [IGNORE] * len(p) + r + eos
        if len(ids) > seq_len:
            cut += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        if all(lab == IGNORE for lab in labels):
            dropped += 1  # the prompt alone fills seq_len: nothing left to learn from
            continue
        rows.append((ids, labels))
    return rows, cut, dropped


def tokenize_chats(chats: list[list[tuple[str, bool]]], tokenizer, seq_len: int) -> tuple[list, int, int]:
    pieces = [(i, text, trained) for i, chat in enumerate(chats) for text, trained in chat]
    ids = _ids(tokenizer, [t for _, t, _ in pieces], False)
    per: list[tuple[list[int], list[int]]] = [([], []) for _ in chats]
    for (i, _t, trained), toks in zip(pieces, ids):
        per[i][0].extend(toks)
        per[i][1].extend(toks if trained else [IGNORE] * len(toks))
    rows, cut, dropped = [], 0, 0
    for x, y in per:
        if len(x) > seq_len:
            cut += 1
            x, y = x[:seq_len], y[:seq_len]
        if all(lab == IGNORE for lab in y):
            dropped += 1
            continue
        rows.append((x, y))
    return rows, cut, dropped
