"""``model.name`` -> its transformers config: a preset, a local model directory or a hub id (one set of errors).

Both the planner (which builds the model on the meta device) and the loop (which loads the weights) read
the config through :func:`load`, so a bad name fails the same way before anything is planned or loaded.
"""

from __future__ import annotations

import json
import os
import zipfile

from launcher.config.schema import ConfigError
from launcher.model.presets import PRESETS, preset_config
from launcher.model.weights import CheckpointError, read_header


def is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def looks_like_path(name: str) -> bool:
    """A name meant as a folder, not a hub id (``org/model``): it starts like a path or has more than one '/'."""
    return name.startswith((".", "/", "~")) or (os.sep in name and name.count("/") > 1)


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


def check_local_dir(name: str, key: str = "model.name", set_as: str = "model.name=") -> None:
    """A local model directory has a config.json that is JSON with a model_type (transformers' own errors
    for these name a hub lookup or a missing key, never the file). ``key`` names the setting in the messages and
    ``set_as`` how a fix sets it (``vramfit export --base`` checks its folder the same way)."""
    path = os.path.expanduser(name)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        below = _below_with_config(path)
        fix = (f"{set_as}{below[0]}" + (f" (also: {', '.join(below[1:])})" if below[1:] else "") if below
               else f"{set_as}DIR where DIR holds config.json (as save_pretrained writes it), or a preset "
                    f"({', '.join(PRESETS)})")
        raise ConfigError([f"{key}: {name!r} is a directory without config.json; rule: a model directory as "
                           f"save_pretrained writes it (config.json beside the weights); fix: {fix}"])
    try:
        with open(cfg_file, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: JSON errors and UnicodeDecodeError
        why = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
        raise ConfigError([f"{key}: {cfg_file} is not valid JSON ({why}); rule: config.json as "
                           "save_pretrained writes it; fix: restore the file from where the model came from"]) from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ConfigError([f"{key}: {cfg_file} has no \"model_type\"; rule: transformers picks the architecture "
                           "from it; fix: add it (e.g. \"model_type\": \"llama\") or restore the file"])


def check_weights(name: str, config=None, *, required: bool = True, trust_remote_code: bool = False,
                  key: str = "model.name") -> None:
    """Before anything is written: a local directory's weights are there (every shard of a sharded checkpoint;
    ``required=False``: only the ones present are checked, as a plan for another machine may have config.json
    alone), whole (no file cut short), and of the shapes ``config`` describes (read from the safetensors headers
    and compared with a model built on the meta device: no tensor is loaded). One ConfigError for every problem."""
    if name in PRESETS or not is_local(name):
        return
    path = os.path.expanduser(name)
    present = [w for w in WEIGHTS if os.path.isfile(os.path.join(path, w))]
    if not present:
        if required:
            raise ConfigError([f"{key}: {name!r} has a config.json but no weights ({', '.join(WEIGHTS)}); rule: "
                               "training starts from saved weights; fix: copy the weights beside config.json, or use "
                               "a preset for random initialization"])
        return
    files = [w for w in present if not w.endswith(".index.json")]
    index = next((w for w in present if w.endswith(".index.json")), None)
    if index and not files:
        try:
            with open(os.path.join(path, index), encoding="utf-8") as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError([f"{key}: {os.path.join(path, index)} is unreadable ({type(e).__name__}); rule: "
                               "the shard index as save_pretrained writes it; fix: restore the file"]) from None
        missing = [sh for sh in shards if not isinstance(sh, str) or not os.path.isfile(os.path.join(path, sh))]
        if missing:
            raise ConfigError([f"{key}: {name!r} lacks {len(missing)} of the {len(shards)} weight shards its "
                               f"{index} lists (first: {missing[0]}); rule: every shard present; fix: finish copying "
                               "or downloading the model"])
        files = shards
    problems, shapes = [], {}
    for f in files:
        full = os.path.join(path, f)
        try:
            header, problem = safetensors_header(full) if f.endswith(".safetensors") else ({}, _torch_file_problem(full))
        except OSError as e:
            header, problem = {}, f"cannot be read ({e.strerror})"
        if problem:
            problems.append(f"{key}: {full} {problem}; rule: weights as save_pretrained wrote them, whole and "
                            "readable; fix: copy or download that file again (or make it readable: ls -l)")
        shapes.update(header)
    if problems:
        raise ConfigError(problems)
    if config is not None and shapes and getattr(config, "quantization_config", None) is None:
        # a pre-quantized checkpoint stores packed weights under the same names: its shapes are not the model's
        problems = _shape_problems(shapes, config, trust_remote_code, os.path.join(path, "config.json"), key)
        if problems:
            raise ConfigError(problems)


def safetensors_header(path: str) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """({tensor name: shape}, None), or ({}, what is wrong) for a file that is not whole safetensors (its header
    read by :func:`launcher.model.weights.read_header`; no tensor is read)."""
    try:
        entries = read_header(path)
    except CheckpointError as e:
        return {}, e.problem
    return {k: e.shape for k, e in entries.items()}, None


def _torch_file_problem(path: str) -> str | None:
    """What is wrong with a torch.save file that is a zip archive (the format since torch 1.6) whose directory, at
    its end, cannot be read: it was cut short. Older pickles are not checked."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":
            return None
    try:
        with zipfile.ZipFile(path):
            return None
    except zipfile.BadZipFile as e:
        return f"is not a whole zip archive ({e}; cut short?)"


_MODEL_SHAPES: dict[tuple[str, bool], dict[str, tuple[int, ...]]] = {}  # a plan and its run ask for one config twice


def _model_shapes(config, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """{state_dict name: shape} of the model ``config`` builds, on the meta device."""
    key = (config.to_json_string(), trust_remote_code)
    if key not in _MODEL_SHAPES:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        _MODEL_SHAPES.clear()
        _MODEL_SHAPES[key] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return _MODEL_SHAPES[key]


def _shape_problems(shapes: dict, config, trust_remote_code: bool, cfg_file: str, key: str) -> list[str]:
    """Weights whose shape differs from the model ``config`` builds (a model on the meta device, no memory); names
    the model does not have are left to transformers, which renames some on loading."""
    want = _model_shapes(config, trust_remote_code)
    wrong = [(k, shapes[k], want[k]) for k in shapes if k in want and shapes[k] != want[k]]
    if not wrong:
        return []
    k, got, expected = wrong[0]
    return [f"{key}: {len(wrong)} weight(s) differ in shape from what {cfg_file} describes (first: {k} is "
            f"{list(got)} in the file, {list(expected)} by config.json); rule: config.json describes the weights beside "
            "it (transformers would stop, or start those weights from random values); fix: restore config.json from "
            "where the weights came from (or the weights from where config.json came from)"]


def load(name: str, trust_remote_code: bool = False):
    """The transformers config of ``name`` (no weights), or a ConfigError saying what is wrong."""
    if name in PRESETS:
        return preset_config(name)
    path = os.path.expanduser(name)
    if is_local(name):
        check_local_dir(name)
    if not is_local(name) and looks_like_path(name):
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
