"""Local data files -> :class:`launcher.data.tokens.TokenData`, through ``datasets``.

Files: ``.jsonl``, ``.json`` (an array of records, or JSON lines), ``.csv``, ``.parquet``, ``.txt``
(one record per paragraph: blocks separated by blank lines). Record formats (``data.format``,
``auto`` picks from the fields):

- ``text``: plain text in ``data.text_field``; every token is in the loss. With ``data.packing``
  the records are joined (each ends with eos) and cut into ``seq_len`` blocks, so no padding is
  wasted; without it each record is one sample, cut or padded to ``seq_len``.
- ``prompt_response``: ``data.prompt_field`` + ``data.response_field``, joined as written (put
  your own separator in the prompt); the prompt is masked out of the loss (labels -100).
- ``alpaca``: ``instruction``, optional ``input``, ``output``, in the Alpaca prompt template.
- ``messages``: a chat, ``[{"role": ..., "content": ...}, ...]``, rendered with the tokenizer's
  chat template when it has one (else ``role: content`` lines); only assistant turns are trained.

Instruction records are one sample each (cut at ``seq_len``, padded with the pad token, which is
never in the loss). Every problem is a :class:`ConfigError` naming the file, the line or field,
and the fix, raised before the run directory is made.
"""

from __future__ import annotations

import json
import os

from launcher.config import Config, ConfigError
from launcher.data.tokens import IGNORE, TokenData, pad_id, pad_rows, tokenize_chats, tokenize_pairs, tokenize_text
from launcher.log import logger

EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}

ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

# ----------------------------------------------------------------------------------------------
# Reading the file


def resolve_path(cfg: Config) -> tuple[str, str]:
    """(absolute path, datasets builder) of ``data.source``, or a ConfigError saying what is wrong."""
    src = cfg.data.source
    path = os.path.abspath(os.path.expanduser(src))
    if not os.path.exists(path):
        raise ConfigError([f"data.source: {src!r} not found (looked for {path}); rule: 'synthetic' or an existing "
                           f"{'/'.join(e[1:] for e in EXTENSIONS)} file; fix: check the path (relative paths start "
                           f"from {os.getcwd()})"], "data")
    if os.path.isdir(path):
        raise ConfigError([f"data.source: {src!r} is a directory; rule: one data file; fix: data.source=<a "
                           f"{'/'.join(e[1:] for e in EXTENSIONS)} file inside it>"], "data")
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ConfigError([f"data.source: {src!r} has extension {ext or '(none)'!r}; rule: one of "
                           f"{', '.join(EXTENSIONS)}; fix: convert the file or rename it to the extension of its format"], "data")
    return path, EXTENSIONS[ext]


def _first_bad_json_line(path: str) -> str | None:
    """'line N: <error>' for the first line of a JSON-lines file that does not parse (None if all do)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n}: {e.msg} at column {e.colno} ({line.strip()[:60]!r})"
            if not isinstance(rec, dict):
                return f"line {n}: a {type(rec).__name__}, not a JSON object ({line.strip()[:60]!r})"
    return None


def _json_problem(path: str, src: str) -> str | None:
    """A precise description of why a .json/.jsonl file does not load, or None if it parses."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            recs = json.loads(text)
        except json.JSONDecodeError as e:
            return (f"data.source: {src!r} line {e.lineno}: {e.msg} at column {e.colno}; rule: a JSON array of "
                    "objects, or one JSON object per line; fix: correct that line")
        bad = next((i for i, r in enumerate(recs) if not isinstance(r, dict)), None)
        if bad is not None:
            return (f"data.source: {src!r} element {bad} of the array is a {type(recs[bad]).__name__}; rule: every "
                    "record is a JSON object; fix: wrap it as {\"text\": ...} or remove it")
        return None
    if path.endswith(".json") and text.lstrip().startswith("{") and "\n" in text.strip():
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines: checked line by line below
        if isinstance(whole, dict):
            lists = [k for k, v in whole.items() if isinstance(v, list)]
            where = f"the list under {lists[0]!r} " if lists else "the records "
            return (f"data.source: {src!r} holds one JSON object spread over several lines (keys: "
                    f"{', '.join(list(whole)[:8])}); rule: a JSON array of records, or one record per line; fix: "
                    f"save {where}as a top-level array [...] or as JSON lines")
    bad = _first_bad_json_line(path)
    if bad:
        return (f"data.source: {src!r} {bad}; rule: JSON lines hold one JSON object per line; fix: correct that line "
                "(or delete it)")
    return None


def read_records(cfg: Config):
    """The file as a ``datasets.Dataset`` (one row per record)."""
    import datasets

    path, builder = resolve_path(cfg)
    src = cfg.data.source
    if builder == "json":
        problem = _json_problem(path, src)
        if problem:
            raise ConfigError([problem], "data")
    datasets.disable_progress_bars()
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error lines would repeat ours
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train", **kwargs)
    except Exception as e:  # noqa: BLE001 (pyarrow/pandas raise many types; the cause is named in the message)
        cause = e.__cause__ or e.__context__ or e
        if "corresponds to no data" in str(e) or "corresponds to no data" in str(cause):
            raise ConfigError([f"data.source: {src!r} holds no records; rule: at least one; fix: check the file"],
                              "data") from None
        raise ConfigError([f"data.source: {src!r} could not be read as {builder} ({type(cause).__name__}: "
                           f"{str(cause).splitlines()[0][:300] if str(cause) else ''}); rule: a well-formed "
                           f"{os.path.splitext(path)[1]} file; fix: correct the file"], "data") from None
    finally:
        datasets.logging.set_verbosity(level)
    return ds, path


# ----------------------------------------------------------------------------------------------
# Record formats


def detect_format(cfg: Config, fields: list[str], src: str) -> str:
    d = cfg.data
    need = {"text": [d.text_field], "prompt_response": [d.prompt_field, d.response_field],
            "alpaca": ["instruction", "output"], "messages": ["messages"]}
    if d.format != "auto":
        missing = [f for f in need[d.format] if f not in fields]
        if missing:
            raise ConfigError([f"data.source: {src!r} records have fields {fields}, but data.format={d.format} needs "
                               f"{need[d.format]} (missing {missing}); fix: rename the fields in the file, set "
                               f"{_field_fix(d.format)}, or data.format=auto"], "data")
        return d.format
    for fmt in ("messages", "alpaca", "prompt_response", "text"):
        if all(f in fields for f in need[fmt]):
            return fmt
    wants = "; ".join(f"{k}: {', '.join(v)}" for k, v in need.items())
    raise ConfigError([f"data.source: {src!r} records have fields {fields}; rule: one record format's fields must be "
                       f"there ({wants}); fix: rename the fields in the file, or point data.text_field / "
                       f"data.prompt_field / data.response_field at yours (e.g. data.text_field={fields[0] if fields else 'text'})"],
                      "data")


def _field_fix(fmt: str) -> str:
    return {"text": "data.text_field=<your field>",
            "prompt_response": "data.prompt_field=<field> data.response_field=<field>"}.get(fmt, "another data.format")


def _str(x) -> str | None:
    return x if isinstance(x, str) else (None if x is None else str(x))


def _render_plain_chat(messages: list[dict], upto: int, generation_prompt: bool) -> str:
    out = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:upto])
    return out + ("assistant: " if generation_prompt else "")


def chat_segments(messages: list[dict], tokenizer) -> list[tuple[str, bool]] | None:
    """The chat as (text, trained) pieces: assistant replies trained, everything else masked.

    With a chat template each assistant reply is the text the template adds between the prompt
    rendered with ``add_generation_prompt=True`` and the chat including that reply (end-of-turn
    tokens included, so the model learns to stop). Templates that do not render prefixes
    consistently (some add text only to the last turn) fall back to training the last reply only.
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return None
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return None
    template = getattr(tokenizer, "chat_template", None)
    eos = tokenizer.eos_token or ""

    def render(upto: int, gen: bool) -> str:
        if upto == 0:
            return ""
        if template:
            return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=gen)
        text = _render_plain_chat(messages, upto, gen)
        if not gen and messages[upto - 1]["role"] == "assistant":  # end the reply with eos
            text = text[:-1] + eos + "\n"
        return text

    def pieces(which: list[int]) -> list[tuple[str, bool]] | None:
        out, done = [], ""
        for i in which:
            head, full = render(i, True), render(i + 1, False)
            if not (head.startswith(done) and full.startswith(head)):
                return None
            out += [(head[len(done):], False), (full[len(head):], True)]
            done = full
        rest = render(len(messages), False)
        if not rest.startswith(done):
            return None
        out.append((rest[len(done):], False))
        return out

    return pieces(turns) or pieces(turns[-1:])


# ----------------------------------------------------------------------------------------------
# Tokenizing


# ----------------------------------------------------------------------------------------------
# The entry point


def check_tokenizer(cfg: Config, tokenizer, src: str) -> None:
    if tokenizer is None:
        raise ConfigError([f"data.source: {src!r} needs a tokenizer, and model.name={cfg.model.name!r} has none "
                           "(presets are random models without one); rule: text data is tokenized with the model's "
                           "tokenizer; fix: model.name=<a model directory with tokenizer files>, or "
                           "data.source=synthetic"], "data")
    if tokenizer.eos_token_id is None:
        raise ConfigError([f"model.name: the tokenizer of {cfg.model.name!r} has no eos token; rule: records end with "
                           "eos so the model learns to stop; fix: set \"eos_token\" in tokenizer_config.json"], "data")


def load_file_data(cfg: Config, tokenizer, vocab_size: int | None = None) -> TokenData:
    """Read, check, format and tokenize ``data.source``; every problem is a ConfigError."""
    src = cfg.data.source
    ds, path = read_records(cfg)  # missing file, bad JSON line: named before anything else
    check_tokenizer(cfg, tokenizer, src)
    fields = list(ds.column_names)
    fmt = detect_format(cfg, fields, src) if len(ds) else None
    if fmt is None:
        raise ConfigError([f"data.source: {src!r} holds no records; rule: at least one; fix: check the file"], "data")
    d, seq_len = cfg.data, cfg.data.seq_len
    skipped = 0
    if fmt == "text":
        texts = [t for t in (_str(x) for x in ds[d.text_field]) if t and t.strip()]
        skipped = len(ds) - len(texts)
        data, how = tokenize_text(texts, tokenizer, seq_len, d.packing) if texts else (None, "")
        n_records, masked_note = len(texts), "all tokens in the loss"
    else:
        if fmt == "messages":
            if not getattr(tokenizer, "chat_template", None):
                logger.info(f"the tokenizer of {cfg.model.name} has no chat template: chats are rendered as 'role: content' "
                     "lines, each assistant reply ending with eos")
            chats = [chat_segments(m, tokenizer) for m in ds["messages"]]
            skipped = sum(c is None for c in chats)
            rows, cut, dropped = tokenize_chats([c for c in chats if c is not None], tokenizer, seq_len)
        else:
            if fmt == "prompt_response":
                pairs = [(_str(p), _str(r)) for p, r in zip(ds[d.prompt_field], ds[d.response_field])]
            else:
                inputs = ds["input"] if "input" in fields else [None] * len(ds)
                pairs = [((ALPACA_WITH_INPUT if _str(x) else ALPACA_NO_INPUT).format(instruction=_str(i), input=_str(x))
                          if _str(i) is not None else None, _str(o))
                         for i, x, o in zip(ds["instruction"], inputs, ds["output"])]
            keep = [(p, r) for p, r in pairs if p is not None and r is not None and r.strip()]
            skipped = len(pairs) - len(keep)
            rows, cut, dropped = tokenize_pairs([p for p, _ in keep], [r for _, r in keep], tokenizer, seq_len)
        n_records = len(ds) - skipped
        data = pad_rows(rows, seq_len, pad_id(tokenizer)) if rows else None
        how = f"one sample per record, {cut} cut at {seq_len} tokens"
        if dropped:
            how += f", {dropped} dropped (prompt alone fills seq_len {seq_len})"
        skipped_all = skipped + dropped
        masked_note = "prompt tokens masked out of the loss"
        skipped = skipped_all
    if data is None or len(data) == 0:
        why = {"text": f"every {d.text_field!r} is empty",
               "prompt_response": f"every record lacks a non-empty {d.response_field!r} or has prompts longer than "
                                  f"seq_len {seq_len}",
               "alpaca": f"every record lacks a non-empty 'output' or has prompts longer than seq_len {seq_len}",
               "messages": "no record holds a valid chat (a list of {role, content} with an assistant turn) that "
                           f"fits seq_len {seq_len}"}[fmt]
        raise ConfigError([f"data.source: {src!r} is empty after filtering ({len(ds)} records read, {skipped} "
                           f"skipped: {why}); rule: at least one trainable sample; fix: check the fields "
                           f"({fields}) and data.format, or raise data.seq_len"], "data")
    top = int(data.input_ids.max())
    if vocab_size is not None and top >= vocab_size:
        raise ConfigError([f"model.name: the tokenizer of {cfg.model.name!r} produced token id {top}, but the model "
                           f"embeds only {vocab_size} ids; rule: tokenizer and model must belong together; fix: save the "
                           "model's own tokenizer into its directory (or resize the embeddings before fine-tuning)"])
    share = float((data.labels != IGNORE).float().mean())
    data.description = (f"{os.path.basename(path)}: {n_records} {fmt} records"
                        + (f" ({skipped} skipped)" if skipped else "")
                        + f", {how}; {masked_note}, {100 * share:.0f}% of positions trained")
    data.tokenizer = tokenizer
    return data
