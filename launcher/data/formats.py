"""Record formats -> token ids and a loss mask, one batch of records at a time (the function ``Dataset.map`` runs).

Formats (``data.format``, or a source's ``format``; ``auto`` picks from the fields):

- ``text``: plain text in the text field; every token is in the loss. Each record becomes bos + text + eos.
- ``prompt_response``: the prompt field + the response field, joined as written (put your own separator in the
  prompt); the prompt is masked out of the loss unless ``data.train_on_prompt``.
- ``alpaca``: ``instruction``, optional ``input``, ``output``, in the Alpaca prompt template.
- ``messages``: a chat, ``[{"role": ..., "content": ...}, ...]``, rendered with the chat template
  (``data.chat_template``: the tokenizer's, a built-in one by name, or a Jinja file; with none, ``role: content``
  lines); only assistant turns are trained unless ``data.train_on_prompt``.

A record that cannot give a sample is kept as an empty row with a drop code (:data:`DROP_REASONS`), so row ``i``
of the tokenized data is record ``i`` of the files and a dropped record can be located (file, line) later.
Nothing here depends on ``seq_len``: samples are cut at batch time, so one tokenization serves every length.
"""

from __future__ import annotations

import os

import numpy as np

from launcher.config.schema import ConfigError

ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

INSTRUCTION = ("prompt_response", "alpaca", "messages")

# Chat templates by name, for tokenizers without one (data.chat_template). Their markers are tokenized as plain
# text unless the tokenizer has them as tokens; the template used is saved with the final weights.
CHAT_TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "zephyr": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
}

# Why a record gave no sample (code -> reason). 0 = kept. TOO_LONG is decided at load time, for the run's seq_len.
DROP_REASONS = {1: "empty text", 2: "prompt missing", 3: "response missing or empty",
                4: "not a chat (messages must be a list of {role, content} strings)", 5: "no assistant turn",
                6: "the chat template renders this chat's turns inconsistently", 7: "the prompt alone fills seq_len"}
TOO_LONG = 7


def id_dtype(vocab: int) -> str:
    """The smallest unsigned integer type that holds every id of a ``vocab``-sized vocabulary."""
    return "uint8" if vocab <= 2 ** 8 else "uint16" if vocab <= 2 ** 16 else "uint32"


def fields_needed(fmt: str, text_field: str, prompt_field: str, response_field: str) -> list[str]:
    return {"text": [text_field], "prompt_response": [prompt_field, response_field],
            "alpaca": ["instruction", "output"], "messages": ["messages"]}[fmt]


def detect_format(fmt: str, fields: list[str], label: str, text_field: str, prompt_field: str,
                  response_field: str) -> str:
    """The record format of records with ``fields`` (``fmt`` when not auto, checked); a ConfigError if none."""
    bom = [f for f in fields if f.startswith("\ufeff")]
    if bom:
        raise ConfigError([f"{label}: the first field name {bom[0]!r} starts with a UTF-8 byte-order mark; rule: field "
                           "names as written; fix: data.encoding=utf-8-sig"], "data")
    need = {f: fields_needed(f, text_field, prompt_field, response_field) for f in INSTRUCTION + ("text",)}
    if fmt != "auto":
        missing = [f for f in need[fmt] if f not in fields]
        if missing:
            fix = {"text": "data.text_field=<your field>",
                   "prompt_response": "data.prompt_field=<field> data.response_field=<field>"}.get(fmt, "another format")
            raise ConfigError([f"{label} records have fields {fields}, but format={fmt} needs {need[fmt]} (missing "
                               f"{missing}); fix: rename the fields in the file, set {fix}, or format auto"], "data")
        return fmt
    for f in ("messages", "alpaca", "prompt_response", "text"):
        if all(x in fields for x in need[f]):
            return f
    wants = "; ".join(f"{k}: {', '.join(v)}" for k, v in need.items())
    raise ConfigError([f"{label} records have fields {fields}; rule: one record format's fields must be there "
                       f"({wants}); fix: rename the fields in the file, or point data.text_field / data.prompt_field / "
                       f"data.response_field at yours (e.g. data.text_field={fields[0] if fields else 'text'})"], "data")


def template_text(name: str, tokenizer) -> tuple[str | None, str]:
    """(Jinja template or None for plain 'role: content' lines, how it was chosen) for ``data.chat_template``."""
    own = getattr(tokenizer, "chat_template", None)
    if name == "auto":
        return (own, "the tokenizer's chat template") if own else (None, "no chat template: 'role: content' lines")
    if name == "plain":
        return None, "'role: content' lines (data.chat_template=plain)"
    if name in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name], f"the built-in {name} template"
    with open(os.path.expanduser(name), encoding="utf-8") as fh:
        return fh.read(), f"the template in {name}"


# ----------------------------------------------------------------------------------------------
# Chats


def _render_plain_chat(messages: list[dict], upto: int, generation_prompt: bool) -> str:
    out = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:upto])
    return out + ("assistant: " if generation_prompt else "")


def chat_segments(messages, tokenizer, template: str | None, train_on_prompt: bool = False):
    """The chat as (text, trained) pieces, or a drop code.

    With a template each assistant reply is the text the template adds between the prompt rendered with
    ``add_generation_prompt=True`` and the chat including that reply (end-of-turn tokens included, so the model
    learns to stop). Templates that do not render prefixes consistently (some add text only to the last turn)
    fall back to training the last reply only.
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return 4
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return 5
    eos = tokenizer.eos_token or ""

    def render(upto: int, gen: bool) -> str:
        if upto == 0:
            return ""
        if template:
            return tokenizer.apply_chat_template(messages[:upto], chat_template=template, tokenize=False,
                                                 add_generation_prompt=gen)
        text = _render_plain_chat(messages, upto, gen)
        if not gen and messages[upto - 1]["role"] == "assistant":  # end the reply with eos
            text = text[:-1] + eos + "\n"
        return text

    def pieces(which: list[int]):
        out, done = [], ""
        for i in which:
            head, full = render(i, True), render(i + 1, False)
            if not (head.startswith(done) and full.startswith(head)):
                return None
            out += [(head[len(done):], train_on_prompt), (full[len(head):], True)]
            done = full
        rest = render(len(messages), False)
        if not rest.startswith(done):
            return None
        out.append((rest[len(done):], train_on_prompt))
        return out

    return pieces(turns) or pieces(turns[-1:]) or 6


# ----------------------------------------------------------------------------------------------
# The batched map function


def _str(x) -> str | None:
    return x if isinstance(x, str) else (None if x is None else str(x))


def _ids(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=special, verbose=False)["input_ids"]


def tokenize_batch(batch: dict, *, fmt: str, tokenizer, text_field: str, prompt_field: str, response_field: str,
                   template: str | None, train_on_prompt: bool) -> dict:
    """Records -> ``input_ids``, ``trained`` (instruction formats), ``drop`` (0 = kept), ``first_trained`` (first
    position >= 1 whose token is in the loss), ``max_id``. Every record gives exactly one row."""
    eos = tokenizer.eos_token_id
    n = len(next(iter(batch.values())))
    rows: list[list[int]] = [[] for _ in range(n)]
    masks: list[list[bool]] = [[] for _ in range(n)]
    drop = [0] * n
    if fmt == "text":
        texts = [_str(t) for t in batch[text_field]]
        keep = [i for i, t in enumerate(texts) if t and t.strip()]
        for i in set(range(n)) - set(keep):
            drop[i] = 1
        for i, ids in zip(keep, _ids(tokenizer, [texts[i] for i in keep], True)):
            rows[i] = ids + [eos]
        return {"input_ids": rows, "drop": drop, "max_id": [max(r, default=0) for r in rows]}
    if fmt == "messages":
        chats = [chat_segments(m, tokenizer, template, train_on_prompt) for m in batch["messages"]]
        pieces = [(i, text, trained) for i, c in enumerate(chats) if not isinstance(c, int) for text, trained in c]
        for i, c in enumerate(chats):
            if isinstance(c, int):
                drop[i] = c
        for (i, _t, trained), toks in zip(pieces, _ids(tokenizer, [t for _, t, _ in pieces], False)):
            rows[i].extend(toks)
            masks[i].extend([trained] * len(toks))
    else:
        if fmt == "prompt_response":
            pairs = [(_str(p), _str(r)) for p, r in zip(batch[prompt_field], batch[response_field])]
        else:  # alpaca
            inputs = batch["input"] if "input" in batch else [None] * n
            pairs = [((ALPACA_WITH_INPUT if _str(x) else ALPACA_NO_INPUT).format(instruction=_str(i), input=_str(x))
                      if _str(i) is not None else None, _str(o))
                     for i, x, o in zip(batch["instruction"], inputs, batch["output"])]
        keep = []
        for i, (p, r) in enumerate(pairs):
            if p is None:
                drop[i] = 2
            elif r is None or not r.strip():
                drop[i] = 3
            else:
                keep.append(i)
        prompts = _ids(tokenizer, [pairs[i][0] for i in keep], True)
        responses = _ids(tokenizer, [pairs[i][1] for i in keep], False)
        for i, p, r in zip(keep, prompts, responses):
            rows[i] = p + r + [eos]
            masks[i] = [train_on_prompt] * len(p) + [True] * (len(r) + 1)
    first = []
    for i, m in enumerate(masks):
        f = next((j for j in range(1, len(m)) if m[j]), len(m))
        if not drop[i] and f >= len(m):
            drop[i] = 3 if fmt != "messages" else 5  # nothing left to learn from
        first.append(f)
    return {"input_ids": rows, "trained": masks, "drop": drop, "first_trained": first,
            "max_id": [max(r, default=0) for r in rows]}


def drop_counts(drop: np.ndarray) -> dict[int, int]:
    codes, counts = np.unique(drop[drop != 0], return_counts=True)
    return {int(c): int(k) for c, k in zip(codes, counts)}
