"""Preference pairs (``task=dpo|orpo|simpo``): records with a prompt, a chosen and a rejected completion -> token ids,
cached on disk -> micro-batches of chosen and rejected rows.

Records (JSONL, JSON, CSV, parquet, arrow, or a hub dataset): ``prompt``, ``chosen``, ``rejected`` as text (TRL's
standard form), or as lists of ``{role, content}`` messages (TRL's conversational form: the prompt's messages, then
the assistant's reply in each of chosen and rejected), rendered with the chat template (``data.chat_template``).
Tokenized as TRL does: the prompt with the tokenizer's special tokens, each completion without them and ending in
eos; the prompt keeps its last ``preference.max_prompt_len`` tokens, the completions are cut at ``data.seq_len``
minus the prompt. A record with a missing, empty or non-text field is dropped and named by file and line, and
too many dropped stop the run (``data.max_invalid_fraction``), as for SFT data.

The token ids are made once with ``Dataset.map`` and kept under ``<data.cache_dir>/preference/<key>`` (the key
hashes the files' contents, the settings and the tokenizer), memory-mapped by later starts and resumes.

A micro-batch of ``m`` pairs is ``2m`` rows, the chosen ones first (:mod:`launcher.model.preference`), padded on
the right to the longest row (in whole 8-token units), the prompt and the padding out of the loss; with
precomputed reference log-probs it carries them as ``ref_logps``. Pairs are never packed.

:func:`synthetic_preferences` is the built-in task with a known answer.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from launcher.config.schema import Config, ConfigError, prompt_budget
from launcher.data.cache import cache_root, content_id, tokenizer_id
from launcher.data.files import locate, read_records
from launcher.data.formats import _render_plain_chat, template_text
from launcher.data.order import micro_batches
from launcher.data.sources import Source, eval_sources, train_sources
from launcher.data.tokens import IGNORE, Step, pad_id
from launcher.log import logger

VERSION = 1
SHOWN = 5
DROP_REASONS = {1: "a missing or empty prompt, chosen or rejected", 2: "a field that is neither text nor a list of "
                "{role, content} messages", 3: "chosen and rejected in different forms (text and messages)"}


@dataclass
class Pairs:
    """Token ids of each pair: the prompt, the chosen and the rejected completion (lists or a ``datasets.Dataset``
    with those three columns)."""

    prompt: object
    chosen: object
    rejected: object

    def __len__(self) -> int:
        return len(self.prompt)

    def get(self, i: int) -> tuple[list[int], list[int], list[int]]:
        return list(self.prompt[i]), list(self.chosen[i]), list(self.rejected[i])


@dataclass
class PreferenceData:
    """Preference pairs and the micro-batches cut from them; the loop uses it as it uses
    :class:`launcher.data.tokens.TokenData` (``step``, ``batch``, ``split``, ``len``)."""

    samples: Pairs
    seq_len: int
    pad_id: int = 0
    description: str = ""
    tokenizer: object | None = None
    rows: np.ndarray | None = field(default=None, repr=False)  # this split's pair ids (None: every pair)
    ref: torch.Tensor | None = field(default=None, repr=False)  # [pairs, 2] reference log-probs (precompute)
    packed: bool = False

    def __len__(self) -> int:
        return len(self.samples) if self.rows is None else len(self.rows)

    def _pair(self, i: int) -> int:
        return i if self.rows is None else int(self.rows[i])

    def pair_ids(self) -> np.ndarray:
        """The ids of this split's pairs in the whole set (the rows of :attr:`ref`)."""
        return np.arange(len(self.samples)) if self.rows is None else self.rows

    def with_reference(self, ref: torch.Tensor) -> PreferenceData:
        """These pairs, batches carrying ``ref`` ([pairs of the whole set, 2]: chosen, rejected log-probs)."""
        return replace(self, ref=ref)

    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair ``i``'s chosen row as (input ids, labels): the prompt masked, as the causal LM data gives a sample."""
        p, c, _ = self.samples.get(self._pair(i))
        ids = torch.tensor(p + c, dtype=torch.long)
        return ids, torch.cat([torch.full((len(p),), IGNORE, dtype=torch.long), ids[len(p):]])

    def pair(self, i: int) -> tuple[list[int], list[int], list[int]]:
        """Pair ``i`` as (prompt, chosen, rejected) token ids."""
        return self.samples.get(self._pair(i))

    def batch(self, indices: list[int], with_ref: bool = True) -> dict:
        """One micro-batch: ``2 x len(indices)`` rows, chosen then rejected."""
        pairs = [self.samples.get(self._pair(i)) for i in indices]
        rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
        width = max(len(p) + len(c) for p, c in rows)
        width = min(self.seq_len, -(-width // 8) * 8)
        n = len(rows)
        x = torch.full((n, width), self.pad_id, dtype=torch.long)
        y = torch.full((n, width), IGNORE, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for r, (p, c) in enumerate(rows):
            ids = (p + c)[:width]
            x[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            y[r, len(p):len(ids)] = x[r, len(p):len(ids)]
            mask[r, :len(ids)] = 1
        out = {"input_ids": x, "attention_mask": mask, "labels": y}
        if with_ref and self.ref is not None:
            ids = [self._pair(i) for i in indices]
            out["ref_logps"] = torch.cat([self.ref[ids, 0], self.ref[ids, 1]])
        return out

    def step(self, step: int, global_batch: int, micro_batch: int, rank: int, world: int, seed: int) -> Step:
        """The micro-batches of pairs this rank runs for optimizer step ``step`` (:func:`micro_batches` decides
        which); the step's tokens over all ranks: processed (both rows of a pair) and in the loss (completions)."""
        n = len(self)
        groups = micro_batches(step, global_batch, micro_batch, rank, world, n, seed)
        everyone = micro_batches(step, global_batch, global_batch, 0, 1, n, seed)[0]
        tokens = in_loss = 0
        for i in everyone:
            p, c, r = self.samples.get(self._pair(i))
            tokens += 2 * len(p) + len(c) + len(r)
            in_loss += len(c) + len(r)
        return Step([self.batch(g) for g in groups], tokens, in_loss)

    def split(self, eval_fraction: float, seed: int) -> tuple[PreferenceData, PreferenceData | None]:
        if eval_fraction <= 0 or len(self) < 2:
            return self, None
        n_eval = max(1, int(round(len(self) * eval_fraction)))
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + 7)).numpy()
        base = self.pair_ids()

        def part(ix, what):
            return replace(self, rows=base[ix], description=f"{self.description} ({what})")

        return part(perm[n_eval:], "train"), part(perm[:n_eval], "eval")


# ----------------------------------------------------------------------------------------------
# The built-in task


def synthetic_preferences(num_pairs: int, seq_len: int, vocab_size: int, seed: int) -> PreferenceData:
    """Pairs with a known answer, on the demo's Markov chain (:func:`launcher.data.synthetic.synthetic_task`'s rule,
    the same chain for the same seed): a prompt of ``seq_len // 2`` tokens from the chain, the chosen completion
    continuing it on the chain (successors taken with probability 0.8 and 0.2), the rejected one on a perturbed
    chain (every token's successors drawn again). A policy that prefers the chain's transitions ranks every pair
    right; one that knows nothing, half of them."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab_size, generator=g)[:2] for _ in range(vocab_size)])  # [V, 2]
    wrong = torch.stack([torch.randperm(vocab_size, generator=g)[:2] for _ in range(vocab_size)])
    p_len = seq_len // 2
    c_len = seq_len - p_len

    def walk(start: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        out = torch.empty(len(start), n, dtype=torch.long)
        prev = start
        for t in range(n):
            pick = (torch.rand(len(start), generator=g) < 0.2).long()
            prev = out[:, t] = table[prev, pick]
        return out

    first = torch.randint(0, vocab_size, (num_pairs,), generator=g)
    prompt = torch.cat([first[:, None], walk(first, succ, p_len - 1)], 1)
    chosen = walk(prompt[:, -1], succ, c_len)
    rejected = walk(prompt[:, -1], wrong, c_len)
    pairs = Pairs(prompt.tolist(), chosen.tolist(), rejected.tolist())
    return PreferenceData(pairs, seq_len, description=f"synthetic preference pairs ({num_pairs}, vocab {vocab_size}: "
                          f"prompt {p_len} tokens of the Markov chain, chosen continues the chain, rejected a "
                          "perturbed one)")


# ----------------------------------------------------------------------------------------------
# Files


def _kind(x) -> str | None:
    """'text', 'messages' or None (missing, empty, or neither)."""
    if isinstance(x, str):
        return "text" if x.strip() else None
    if isinstance(x, list) and x and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in x):
        return "messages"
    return "bad" if x is not None and x != [] else None


def _texts(prompt, chosen, rejected, tokenizer, template: str | None):
    """(prompt text, chosen text, rejected text) of one record in either form, or a drop code."""
    kinds = [_kind(prompt), _kind(chosen), _kind(rejected)]
    if None in kinds:
        return 1
    if "bad" in kinds:
        return 2
    if kinds[1] != kinds[2] or (kinds[1] == "messages") != (kinds[0] == "messages"):
        return 3
    if kinds[1] == "text":
        return prompt, chosen, rejected

    def render(messages, gen: bool) -> str:
        if template:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=gen)
        return _render_plain_chat(messages, len(messages), gen)

    head = render(prompt, True)
    out = [head]
    for reply in (chosen, rejected):
        full = render(prompt + reply, False)
        out.append(full[len(head):] if full.startswith(head) else full)
    return tuple(out)


def tokenize_pairs(batch: dict, *, tokenizer, template: str | None, prompt_field: str, max_prompt: int,
                   seq_len: int) -> dict:
    """The batched map function: prompt, chosen and rejected token ids, and a drop code (0 = kept)."""
    eos = tokenizer.eos_token_id
    out = {"prompt": [], "chosen": [], "rejected": [], "drop": []}
    n = len(batch[prompt_field])
    for i in range(n):
        got = _texts(batch[prompt_field][i], batch["chosen"][i], batch["rejected"][i], tokenizer, template)
        if isinstance(got, int):
            for k in ("prompt", "chosen", "rejected"):
                out[k].append([])
            out["drop"].append(got)
            continue
        p_text, c_text, r_text = got
        p = tokenizer(p_text, add_special_tokens=True, verbose=False)["input_ids"][-max_prompt:]
        room = max(1, seq_len - len(p))
        c = (tokenizer(c_text, add_special_tokens=False, verbose=False)["input_ids"] + [eos])[:room]
        r = (tokenizer(r_text, add_special_tokens=False, verbose=False)["input_ids"] + [eos])[:room]
        out["prompt"].append(p)
        out["chosen"].append(c)
        out["rejected"].append(r)
        out["drop"].append(0)
    return out


def _key(src: Source, cfg: Config, template: str | None, tokenizer, root: str) -> str:
    what = {"v": VERSION, "content": content_id(src, root), "prompt_field": src.prompt_field,
            "template": template, "seq_len": cfg.data.seq_len, "max_prompt": prompt_budget(cfg),
            "encoding": cfg.data.encoding, "tokenizer": tokenizer_id(tokenizer)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def tokenized_pairs(src: Source, cfg: Config, tokenizer):
    """The source's pairs as a ``datasets.Dataset`` (prompt, chosen, rejected, drop): from the cache, else made."""
    import datasets

    root = cache_root(cfg.data.cache_dir)
    template, how = template_text(cfg.data.chat_template, tokenizer)
    final = os.path.join(root, "preference", _key(src, cfg, template, tokenizer, root))
    if os.path.isfile(os.path.join(final, "vramfit.json")):
        logger.info(f"data: {src.short}: reusing the tokenized pairs in {final}")
        return datasets.load_from_disk(final)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    datasets.disable_progress_bars()  # vramfit's own line says what was made
    try:
        raw = read_records(src, cfg.data.encoding, os.path.join(tmp, "hf"))
        missing = [f for f in (src.prompt_field, "chosen", "rejected") if f not in raw.column_names]
        if missing:
            raise ConfigError([f"{src.label}: records have no {', '.join(missing)} field (they have "
                               f"{', '.join(raw.column_names)}); rule: preference records hold {src.prompt_field}, "
                               "chosen and rejected (text, or lists of {role, content} messages); fix: rename the "
                               "fields, or data.prompt_field=<the prompt's field>"], "data")
        seq = getattr(datasets, "List", None) or datasets.Sequence
        ids = seq(datasets.Value("int64"))
        feats = datasets.Features({"prompt": ids, "chosen": ids, "rejected": ids, "drop": datasets.Value("int8")})
        out = raw.map(tokenize_pairs, batched=True, batch_size=500, remove_columns=list(raw.column_names),
                      features=feats, fn_kwargs={"tokenizer": tokenizer, "template": template,
                                                 "prompt_field": src.prompt_field, "max_prompt": prompt_budget(cfg),
                                                 "seq_len": cfg.data.seq_len}, load_from_cache_file=False)
        out.save_to_disk(os.path.join(tmp, "pairs"))
        del raw, out
        shutil.rmtree(os.path.join(tmp, "hf"), ignore_errors=True)
        for name in os.listdir(os.path.join(tmp, "pairs")):
            os.rename(os.path.join(tmp, "pairs", name), os.path.join(tmp, name))
        os.rmdir(os.path.join(tmp, "pairs"))
        with open(os.path.join(tmp, "vramfit.json"), "w") as fh:
            json.dump({"source": src.path, "files": list(src.files), "chat": how,
                       "created": datetime.datetime.now().isoformat(timespec="seconds")}, fh)
        if os.path.isdir(final):  # another process made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(f"data: {src.short}: tokenized the pairs into {final}")
    return datasets.load_from_disk(final)


def load_pairs(cfg: Config, src: Source, vocab_size: int, tokenizer) -> PreferenceData:
    """A source's pairs, checked: dropped records named by file and line, too many stop the run, token ids within
    the model's embeddings."""
    ds = tokenized_pairs(src, cfg, tokenizer)
    drop = np.asarray(ds["drop"], dtype=np.int64)
    bad = np.flatnonzero(drop)
    keep = np.flatnonzero(drop == 0)
    if len(bad):
        where = locate(src, bad[:SHOWN].tolist(), cfg.data.encoding)
        first = "; ".join(f"{where.get(int(i), f'record {int(i) + 1}')}: {DROP_REASONS[int(drop[i])]}"
                          for i in bad[:SHOWN])
        line = f"{src.label}: {len(bad)} of {len(drop)} records dropped; first: {first}"
        share = len(bad) / max(1, len(drop))
        if not len(keep) or share > cfg.data.max_invalid_fraction:
            raise ConfigError([f"{line}; rule: at most data.max_invalid_fraction={cfg.data.max_invalid_fraction:g} "
                               f"of the records dropped, here {share:.1%}; fix: correct those records (prompt, chosen "
                               "and rejected: text, or lists of {role, content} messages), or data.max_invalid_"
                               f"fraction={min(1.0, np.ceil(share * 100) / 100):g} to train on the rest"], "data")
        logger.warning(line)
    kept = ds.select(keep) if len(bad) else ds
    pairs = Pairs(kept["prompt"], kept["chosen"], kept["rejected"])
    top = max((max(max(x, default=0) for x in col) for col in (pairs.prompt, pairs.chosen, pairs.rejected)
               if len(col)), default=0)
    if vocab_size is not None and top >= vocab_size:
        raise ConfigError([f"model.name: the tokenizer of {cfg.model.name!r} produced token id {top}, but the model "
                           f"embeds only {vocab_size} ids; rule: tokenizer and model must belong together; fix: the "
                           "model's own tokenizer in its directory"])
    return PreferenceData(pairs, cfg.data.seq_len, pad_id(tokenizer), f"{src.short}: {len(pairs):,} preference pairs "
                          f"(prompt up to {prompt_budget(cfg)} tokens, its end kept; completions cut at seq_len "
                          f"{cfg.data.seq_len}; the prompt masked out of the loss)", tokenizer)


def load_preferences(cfg: Config, vocab_size: int, tokenizer) -> tuple[PreferenceData, PreferenceData | None]:
    """(training pairs, eval pairs or None) of a preference task."""
    d = cfg.data
    if d.source == "synthetic":
        if d.vocab_size > vocab_size:
            raise ConfigError([f"data.vocab_size: got {d.vocab_size}; rule: the synthetic task's vocabulary must fit "
                               f"the model's ({vocab_size}); fix: data.vocab_size={min(256, vocab_size)}"])
        data = synthetic_preferences(d.num_samples, d.seq_len, d.vocab_size, cfg.seed)
    else:
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ConfigError([f"data.source: {d.source!r} needs a tokenizer with an eos token, and model.name="
                               f"{cfg.model.name!r} has none; rule: preference text is tokenized with the model's "
                               "tokenizer; fix: model.name=<a model directory with tokenizer files>, or "
                               "data.source=synthetic"], "data")
        (src,) = train_sources(cfg)
        data = load_pairs(cfg, src, vocab_size, tokenizer)
    if d.eval_source:
        (src,) = eval_sources(cfg)
        return data, load_pairs(cfg, src, vocab_size, tokenizer)
    return data.split(d.eval_fraction, cfg.seed)
