"""Where the samples come from: the synthetic task, or the sources tokenized through the cache, checked, mixed.

Checks, each a ConfigError with value, rule and fix, raised before the run directory is made: a tokenizer that
the data needs, token ids beyond the model's embeddings, too many records dropped as invalid
(``data.max_invalid_fraction``; the first ones located by file and line), no sample left, and fewer training
samples than one global batch.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import replace

import numpy as np
import psutil

from launcher.config.checks import synthetic_vocab_problem
from launcher.config.schema import Config, ConfigError
from launcher.data.cache import Settings, tokenized
from launcher.data.files import locate
from launcher.data.formats import DROP_REASONS, TOO_LONG, template_text
from launcher.data.mix import mixture
from launcher.data.preference import load_preferences
from launcher.data.sources import Source, eval_sources, kind_of, settle, train_sources
from launcher.data.synthetic import synthetic_task
from launcher.data.tokens import FixedRows, Records, Stream, TokenData, pad_id
from launcher.log import logger

SHOWN = 5  # dropped records named in a message


def check_tokenizer(cfg: Config, tokenizer, label: str) -> None:
    if tokenizer is None:
        raise ConfigError([f"{label} needs a tokenizer, and model.name={cfg.model.name!r} has none (presets are random "
                           "models without one); rule: text data is tokenized with the model's tokenizer; fix: "
                           "model.name=<a model directory with tokenizer files>, or data.source=synthetic"], "data")
    if tokenizer.eos_token_id is None:
        raise ConfigError([f"model.name: the tokenizer of {cfg.model.name!r} has no eos token; rule: records end with "
                           "eos so the model learns to stop; fix: set \"eos_token\" in tokenizer_config.json"], "data")


def packing_unsupported(model_config) -> str | None:
    """Why this architecture cannot take padding-free batches (None when it can): packing relies on transformers'
    masking utilities, which turn restarting position ids into a block-diagonal mask."""
    if model_config is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:
        return f"{type(model_config).__name__} is not a transformers architecture (remote code)"
    module = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
    if "create_causal_mask" not in vars(module):
        return f"{cls.__name__} builds its own attention mask, which would let packed samples see each other"
    return None


def load_data(cfg: Config, vocab_size: int, tokenizer=None, model_config=None) -> TokenData:
    """Every training sample: the synthetic task, or the training sources tokenized (cached) and mixed."""
    if cfg.data.source == "synthetic" and not cfg.data.sources:
        problem = synthetic_vocab_problem(cfg.data, vocab_size)
        if problem:
            raise ConfigError([problem])
        n, s = cfg.data.num_samples, cfg.data.seq_len
        room = psutil.virtual_memory().available // 2
        if n * s * 8 > room:  # int64 token ids, all in memory
            raise ConfigError([f"data.num_samples: got {n} (x data.seq_len {s} = {n * s * 8 / 2**30:.1f} GiB of token "
                               f"ids); rule: the synthetic task is held in memory, at most half of the "
                               f"{2 * room / 2**30:.1f} GiB available now; fix: data.num_samples={max(16, room // (s * 8))}"])
        return synthetic_task(n, s, cfg.data.vocab_size, cfg.seed)
    return load_sources(cfg, train_sources(cfg), vocab_size, tokenizer, model_config)


def load_splits(cfg: Config, vocab_size: int, tokenizer=None, model_config=None) -> tuple[TokenData, TokenData | None]:
    """(training samples, eval samples or None): ``data.eval_source``, else ``data.eval_fraction`` held out."""
    if cfg.task != "causal_lm":  # preference pairs (launcher.data.preference)
        train, ev = load_preferences(cfg, vocab_size, tokenizer)
    elif cfg.data.eval_source:
        train = load_data(cfg, vocab_size, tokenizer, model_config)
        ev = load_sources(cfg, eval_sources(cfg), vocab_size, tokenizer, model_config)
    else:
        train, ev = load_data(cfg, vocab_size, tokenizer, model_config).split(cfg.data.eval_fraction, cfg.seed)
    g = cfg.train.global_batch_size
    if len(train) < g:
        what = "blocks of seq_len tokens" if isinstance(train.samples, (Stream, FixedRows)) else "samples"
        fix = f"train.global_batch_size={max(1, len(train))} (with a micro-batch that divides it), more data"
        if isinstance(train.samples, Stream):
            fix += f", or a shorter data.seq_len (now {cfg.data.seq_len})"
        raise ConfigError([f"data: {len(train)} training {what} ({train.description}), fewer than one global batch of "
                           f"{g}; rule: every optimizer step takes train.global_batch_size distinct samples; fix: {fix}"],
                          "data")
    return train, ev


def _dropped_line(src: Source, counts: dict[int, int], at: list, read: int, n: int) -> str:
    reasons = ", ".join(f"{k} {DROP_REASONS[c]}" for c, k in sorted(counts.items(), key=lambda x: -x[1]))
    first = "; ".join(f"{where}: {DROP_REASONS[c]}" for _i, c, where in at[:SHOWN])
    return f"{src.label}: {n} of {read} records dropped ({reasons}); first: {first}"


def load_sources(cfg: Config, sources: list[Source], vocab_size: int, tokenizer, model_config=None) -> TokenData:
    """Tokenize (or reuse) each source, drop what cannot train, mix by weight, and view it as samples."""
    d, seq_len = cfg.data, cfg.data.seq_len
    check_tokenizer(cfg, tokenizer, sources[0].label)
    sources = settle(sources, d.encoding)
    template, how = template_text(d.chat_template, tokenizer)
    stores = []
    for s in sources:
        chat = s.format in ("messages", "auto")
        st = Settings(format=s.format, text_field=s.text_field, prompt_field=s.prompt_field,
                      response_field=s.response_field, template=template if chat else None,
                      train_on_prompt=d.train_on_prompt, encoding=d.encoding)
        stores.append(tokenized(s, st, tokenizer, d.cache_dir, d.num_proc))
    formats = [st.marker["format"] for st in stores]
    sources = [replace(s, format=f) for s, f in zip(sources, formats)]
    settle(sources, d.encoding)  # formats found only when tokenizing (unreadable first record): one kind still
    instruction = kind_of(formats[0]) == "instruction"
    if "messages" in formats:
        logger.info(f"chats rendered with {how}" + ("; chats end each assistant reply with eos" if template is None
                                                    else ""))
        if template is not None and template != getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template  # saved with the final weights, so inference renders chats the same
    # ---- what each source keeps, and what it drops (and why)
    kept, total_read, total_dropped, lines = [], 0, 0, []
    for s, st in zip(sources, stores):
        m = st.marker
        keep = st.drop == 0
        counts = {int(k): v for k, v in m["dropped"].items()}
        at = list(m["dropped_at"])
        if st.instruction:
            long = keep & (st.first_trained >= seq_len)
            if long.any():
                keep &= ~long
                counts[TOO_LONG] = int(long.sum())
                idx = np.flatnonzero(long)[:SHOWN].tolist()
                where = locate(s, idx, d.encoding)
                at = sorted(at + [[i, TOO_LONG, where[i]] for i in idx])[:SHOWN]
        read = m["records"] - m.get("blank_paragraphs", 0)
        n_drop = sum(counts.values())
        total_read += read
        total_dropped += n_drop
        if n_drop:
            lines.append(_dropped_line(s, counts, at, read, n_drop))
        kept.append(np.flatnonzero(keep))
    n_kept = sum(len(k) for k in kept)
    if n_kept == 0:
        why = ("every record lacks a non-empty response, or has a prompt longer than seq_len" if instruction else
               "every text is empty")
        raise ConfigError([f"{sources[0].label} is empty after filtering ({total_read} records read, {total_dropped} "
                           f"skipped: {why}); rule: at least one trainable sample; fix: check the fields and the "
                           f"format, or raise data.seq_len" + ("" if not lines else "; " + " | ".join(lines))], "data")
    if total_read and total_dropped / total_read > d.max_invalid_fraction:
        share = total_dropped / total_read
        raise ConfigError([f"{' | '.join(lines)}; rule: at most data.max_invalid_fraction={d.max_invalid_fraction:g} "
                           f"of the records dropped, here {share:.1%}; fix: correct those records, check the format "
                           f"and field names (data.format, data.*_field) or data.seq_len, or data.max_invalid_fraction="
                           f"{math.ceil(share * 100) / 100:g} to train on the rest"], "data")
    for line in lines:
        logger.warning(line)
    # ---- token ids must fit the model's embeddings
    top = max(st.marker["max_id"] for st in stores)
    if vocab_size is not None and top >= vocab_size:
        raise ConfigError([f"model.name: the tokenizer of {cfg.model.name!r} produced token id {top}, but the model "
                           f"embeds only {vocab_size} ids; rule: tokenizer and model must belong together; fix: save the "
                           "model's own tokenizer into its directory (or resize the embeddings before fine-tuning)"])
    # ---- the mixture, and the samples
    src, rows = mixture(kept, [s.weight for s in sources], cfg.seed, [s.label for s in sources])
    packed = False
    if instruction and d.packing:
        why = packing_unsupported(model_config)
        if why:
            logger.info(f"data.packing: instruction samples padded one per row instead: {why}")
        packed = why is None
    if not instruction and d.packing:
        samples = Stream(stores, src, rows, seq_len)
        how_cut = f"{samples.total:,} tokens packed into {len(samples):,} blocks of {seq_len}"
    else:
        samples = Records(stores, src, rows, seq_len)
        cut = int((np.concatenate([st.lengths[k] for st, k in zip(stores, kept)]) > seq_len).sum())
        layout = ("packed padding-free into rows of seq_len at each step" if packed else "padded to seq_len")
        how_cut = f"one sample per record, {cut} cut at {seq_len} tokens, {layout}"
    skipped = f" ({total_dropped} skipped)" if total_dropped else ""
    masked = ("all tokens in the loss" if not instruction else
              "prompt tokens in the loss too (data.train_on_prompt)" if d.train_on_prompt else
              "prompt tokens masked out of the loss")
    if len(sources) == 1:
        what = f"{sources[0].short}: {n_kept:,} {formats[0]} records{skipped}"
    else:
        what = " + ".join(f"{s.short} ({formats[i]}, {len(kept[i]):,} records, weight {s.weight:g})"
                          for i, s in enumerate(sources)) + f": {len(rows):,} samples in the mixture{skipped}"
    description = f"{what}, {how_cut}; {masked}"
    if len(sources) > 1:
        counts = np.bincount(src.astype(np.int64), minlength=len(sources))
        logger.info("data mixture: " + ", ".join(
            f"{s.short} {counts[i]:,} samples ({counts[i] / max(1, len(kept[i])):.2f}x its records)"
            for i, s in enumerate(sources)))
    return TokenData(samples, seq_len, pad_id(tokenizer), packed, description, tokenizer)
