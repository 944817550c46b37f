"""``model.name`` -> its transformers config: a preset, a local model directory or a hub id (one set of errors).

Both the planner (which builds the model on the meta device) and the loop (which loads the weights) read
the config through :func:`load`, so a bad name fails the same way before anything is planned or loaded.
"""

from __future__ import annotations

import json
import os

from launcher.config.schema import ConfigError
from launcher.model.presets import PRESETS, preset_config


def is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _below_with_config(path: str) -> list[str]:
    """Directories up to two levels below ``path`` that hold a config.json (a hub snapshot, an unpacked archive)."""
    found = []
    for d, dirs, files in os.walk(path):
        depth = os.path.relpath(d, path).count(os.sep) + (d != path)
        if depth > 2:
            dirs[:] = []
            continue
        if d != path and "config.json" in files:
            found.append(d)
    return sorted(found)[:3]


def check_local_dir(name: str) -> None:
    """A local model directory has a config.json that is JSON with a model_type (transformers' own errors
    for these name a hub lookup or a missing key, never the file)."""
    path = os.path.expanduser(name)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        below = _below_with_config(path)
        fix = (f"model.name={below[0]}" + (f" (also: {', '.join(below[1:])})" if below[1:] else "") if below
               else "model.name=DIR where DIR holds config.json (as save_pretrained writes it), or a preset "
                    f"({', '.join(PRESETS)})")
        raise ConfigError([f"model.name: {name!r} is a directory without config.json; rule: a model directory as "
                           f"save_pretrained writes it (config.json beside the weights); fix: {fix}"])
    try:
        with open(cfg_file, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError([f"model.name: {cfg_file} is not valid JSON ({str(e).splitlines()[0]}); rule: config.json as "
                           "save_pretrained writes it; fix: restore the file from where the model came from"]) from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ConfigError([f"model.name: {cfg_file} has no \"model_type\"; rule: transformers picks the architecture "
                           "from it; fix: add it (e.g. \"model_type\": \"llama\") or restore the file"])


def check_weights(name: str) -> None:
    """Before training from a local directory: its weights are there (every shard of a sharded checkpoint)."""
    if name in PRESETS or not is_local(name):
        return
    path = os.path.expanduser(name)
    present = [w for w in WEIGHTS if os.path.isfile(os.path.join(path, w))]
    if not present:
        raise ConfigError([f"model.name: {name!r} has a config.json but no weights ({', '.join(WEIGHTS)}); rule: "
                           "training starts from saved weights; fix: copy the weights beside config.json, or use a "
                           "preset for random initialization"])
    index = next((w for w in present if w.endswith(".index.json")), None)
    if index and not any(w in present for w in WEIGHTS if not w.endswith(".index.json")):
        try:
            with open(os.path.join(path, index), encoding="utf-8") as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError([f"model.name: {os.path.join(path, index)} is unreadable ({type(e).__name__}); rule: "
                               "the shard index as save_pretrained writes it; fix: restore the file"]) from None
        missing = [sh for sh in shards if not os.path.isfile(os.path.join(path, sh))]
        if missing:
            raise ConfigError([f"model.name: {name!r} lacks {len(missing)} of the {len(shards)} weight shards its "
                               f"{index} lists (first: {missing[0]}); rule: every shard present; fix: finish copying "
                               "or downloading the model"])


def load(name: str, trust_remote_code: bool = False):
    """The transformers config of ``name`` (no weights), or a ConfigError saying what is wrong."""
    if name in PRESETS:
        return preset_config(name)
    path = os.path.expanduser(name)
    if is_local(name):
        check_local_dir(name)
    if not is_local(name) and (name.startswith((".", "/", "~")) or os.sep in name and name.count("/") > 1):
        raise ConfigError([f"model.name: {name!r} is not a directory; rule: a preset ({', '.join(PRESETS)}), a "
                           "local model directory, or a hub id; fix: check the path"])
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- the config classes validate their values with errors of many kinds
        why = _first_line(e)
        if is_local(name):  # a config.json that transformers rejects: say which file and what it said
            raise ConfigError([f"model.name: {os.path.join(path, 'config.json')} is rejected by transformers "
                               f"{transformers.__version__} ({why}); rule: a config.json this transformers accepts, as "
                               "save_pretrained writes it; fix: correct that value in config.json, or restore the file "
                               "from where the model came from"]) from None
        if not isinstance(e, (OSError, ValueError)):
            raise
        raise ConfigError([f"model.name: {name!r} has no loadable config ({why}); rule: a preset "
                           f"({', '.join(PRESETS)}), a local model directory with config.json, or a hub id "
                           "reachable from here; fix: pass a local directory or a preset"]) from None
    check_sizes(config, os.path.join(path, "config.json") if is_local(name) else name)
    return config


# The sizes a decoder is built from, under the names transformers' configs use (GPT-2 and GPT-NeoX spell some
# their own way); each must be a positive integer where a config has it. transformers checks some of them (a
# hidden size that the heads do not divide) and builds the rest as given: a negative size then fails deep in
# torch ("Trying to create tensor with negative dimension"), zero layers in the planner's trace.
SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
         "vocab_size", "head_dim", "max_position_embeddings", "n_embd", "n_head", "n_layer", "n_positions")


def check_sizes(config, where: str) -> None:
    """Every size of ``config`` (from ``where``) a positive integer, before anything is planned or built."""
    configs = [config] + [c for c in (getattr(config, "text_config", None),) if c is not None and c is not config]
    problems = []
    for c in configs:
        for key in SIZES:
            value = getattr(c, key, None)
            if value is None or isinstance(value, bool) or (isinstance(value, int) and value > 0):
                continue
            problems.append(f"model.name: {where} has {key}={value!r}; rule: a model size, a positive integer; fix: "
                            f"correct {key} in that config.json (or restore the file from where the model came from)")
    if problems:
        raise ConfigError(problems)


def _first_line(e: BaseException) -> str:
    """The line of ``e`` that says what is wrong: the cause's when ``e`` only wraps it (huggingface_hub's
    validation errors say "Class validation error for validator ..." and carry the ValueError as the cause)."""
    inner = e.__cause__ if isinstance(e.__cause__, Exception) and str(e.__cause__).strip() else e
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text.splitlines()[0]}" if text else type(inner).__name__


def check_seq_len(config, seq_len: int) -> None:
    """``data.seq_len`` within the model's positions: one rule for ``plan`` and ``train``."""
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos and seq_len > max_pos:
        raise ConfigError([f"data.seq_len: got {seq_len}; rule: at most the model's maximum of {max_pos} positions; "
                           f"fix: data.seq_len={max_pos}"])


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def has_experts(config) -> bool:
    """A mixture-of-experts model, told by its config's count of routed experts (the key differs by family)."""
    return any(int(getattr(config, k, 0) or 0) > 1 for k in EXPERT_COUNT_KEYS)
