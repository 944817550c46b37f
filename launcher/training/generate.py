"""A short greedy sample after training, so a user sees what the model learned.

The prompt is ``sample_prompt``, or one from the data: for instruction data the prompt part of the
first eval sample (else the first training sample), i.e. every token before the first one in the
loss; for text and synthetic data the first 8 tokens of that sample. Presets have no tokenizer: the
prompt and the completion are token ids (and ``sample_prompt`` is given as ids, "5 17 42").
"""

from __future__ import annotations

import os

import torch

from launcher.config.schema import Config, ConfigError
from launcher.log import logger
from launcher.precision import autocast_dtype

TEXT_PROMPT_TOKENS = 8


def prompt_ids(cfg: Config, tokenizer, data) -> list[int] | None:
    """The prompt as token ids (None when ``sample_tokens`` is 0). ``data`` is the eval split when there
    is one, else the training split. Checked before the run directory is made."""
    if cfg.sample_tokens == 0:
        return None
    if cfg.sample_prompt:
        if tokenizer is not None:
            return list(tokenizer(cfg.sample_prompt)["input_ids"])
        try:
            return [int(t) for t in cfg.sample_prompt.replace(",", " ").split()]
        except ValueError:
            raise ConfigError([f"sample_prompt: got {cfg.sample_prompt!r}; rule: model.name={cfg.model.name} has no "
                               "tokenizer, so the prompt is token ids; fix: sample_prompt='5 17 42', or empty to "
                               "take one from the data"]) from None
    if data is None or len(data) == 0:
        return None
    ids, labels = data.example(0)  # one sample, read on its own
    trained = (labels != -100).nonzero()
    first = int(trained[0]) if len(trained) else len(ids)
    if first == 0:  # text: every token is trained
        first = min(TEXT_PROMPT_TOKENS, len(ids))
    return ids[:first].tolist()


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: list[int], new_tokens: int, device: torch.device, precision: str,
           eos_id: int | None = None, max_positions: int | None = None) -> list[int]:
    """Greedy decoding without a KV cache: a plain forward per token, so it works unchanged under
    DeepSpeed ZeRO-3 and FSDP (their hooks gather each layer) and with peft and bitsandbytes layers.
    Every rank must call it when parameters are sharded."""
    dtype = autocast_dtype(precision)
    was_training = model.training
    model.eval()
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out: list[int] = []
    try:
        for _ in range(new_tokens):
            window = x[:, -max_positions:] if max_positions else x
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                logits = model(input_ids=window).logits[0, -1]
            nxt = int(logits.float().argmax())
            out.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
            x = torch.cat([x, torch.tensor([[nxt]], device=device)], dim=1)
    finally:
        model.train(was_training)
    return out


def format_sample(prompt: list[int], completion: list[int], tokenizer) -> dict:
    if tokenizer is None:
        return {"prompt": " ".join(map(str, prompt)), "completion": " ".join(map(str, completion)),
                "prompt_ids": prompt, "completion_ids": completion}
    return {"prompt": tokenizer.decode(prompt, skip_special_tokens=True),
            "completion": tokenizer.decode(completion, skip_special_tokens=True),
            "prompt_ids": prompt, "completion_ids": completion}


def run_sample(engine, prompt: list[int] | None, cfg: Config, tokenizer, precision: str, run_dir: str,
               is_main: bool) -> dict | None:
    """Generate ``sample_tokens`` greedily from ``prompt``, print it and write ``<run_dir>/sample.txt``.
    Returns ``{prompt, completion}`` for the summary (None when there is no prompt)."""
    if not prompt or cfg.sample_tokens == 0:
        return None
    model = engine.module()
    conf = getattr(model, "config", None)
    max_pos = getattr(conf, "max_position_embeddings", None) or getattr(conf, "n_positions", None)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    device = getattr(engine, "device", None) or next(model.parameters()).device
    completion = greedy(model, prompt, cfg.sample_tokens, device, precision, eos, max_pos)
    s = format_sample(prompt, completion, tokenizer)
    if is_main:
        kind = "token ids" if tokenizer is None else "text"
        text = (f"prompt ({kind}):\n{s['prompt']}\n\ncompletion ({len(completion)} tokens, greedy):\n{s['completion']}\n"
                f"\nprompt ids: {prompt}\ncompletion ids: {completion}\n")
        with open(os.path.join(run_dir, "sample.txt"), "w") as fh:
            fh.write(text)
        shown = s["prompt"] if len(s["prompt"]) <= 100 else "..." + s["prompt"][-97:]  # the whole prompt is in sample.txt
        logger.info(f"sample: {shown!r} -> {s['completion']!r} (sample.txt)")
    return {"prompt": s["prompt"], "completion": s["completion"]}
