"""``vramfit export RUN_DIR --out DIR [--merge [--base DIR]]``: a standalone model from a finished run.

A LoRA run's ``final/`` holds the adapter (``adapter_config.json``, ``adapter_model.safetensors``)
and the tokenizer. ``--merge`` loads the base the run started from (the model directory, or a
preset rebuilt from the run's seed), applies the adapter, folds it into the weights
(``merge_and_unload``) and writes a model that ``AutoModelForCausalLM.from_pretrained`` loads with
no peft; it is saved in the base checkpoint's dtype. A QLoRA adapter merges into the
full-precision base (the usual QLoRA practice; the 4-bit base it trained against differs by the
quantization error). Without ``--merge`` the adapter is copied. A full fine-tune's ``final/`` is
already standalone and is copied either way. ``--out`` must not exist: nothing is overwritten. ``--base`` names the
base to merge into where the run's ``model.name`` has moved; problems are said in export's own terms (RUN_DIR,
``--out``, ``--base``), all of them before anything is read or written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import torch

from launcher.config.checks import folder_problem
from launcher.config.load import load_recorded
from launcher.config.profiles import MODULE_IN_COMPUTE_DTYPE
from launcher.config.schema import ConfigError
from launcher.model import hfconfig
from launcher.model.build import load_tokenizer, make_model, model_config
from launcher.model.materialize import Placement
from launcher.model.presets import PRESETS
from launcher.precision import weight_dtype


def _run_config(run_dir: str):
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError([f"RUN_DIR {run_dir!r}: no config.yaml; rule: a directory that vramfit train made; "
                           "fix: pass runs/<run_name>"], "export")
    # the names and types of the schema only: what a new run would check (output_dir, data, trackers, a
    # checkpoint.resume path) may have moved since, and export needs none of it
    return load_recorded(path)


def _read_json(path: str) -> dict:
    """A JSON object the run wrote, {} where it is missing; a damaged one is a ConfigError naming it."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: JSON and decoding errors
        raise ConfigError([f"RUN_DIR: {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                           "rule: the JSON vramfit train wrote; fix: restore it from a copy of the run"], "export") from None
    if not isinstance(doc, dict):
        raise ConfigError([f"RUN_DIR: {path} holds a JSON {type(doc).__name__}; rule: the JSON object vramfit train "
                           "wrote; fix: restore it from a copy of the run"], "export")
    return doc


def _base_name(cfg, run_dir: str, final: str, base: str | None) -> str:
    """The model an adapter merges into: ``--base``, else the run's model.name, else where the adapter says its
    base was (a run started with a relative path from another working directory); a ConfigError in export's words
    (``--base``) when none of them is there."""
    if base is not None:
        where, set_as = "--base", "--base "
        name = base
        if name not in PRESETS and not hfconfig.is_local(name):
            raise ConfigError([f"--base: got {base!r}, which is not a folder here; rule: a size preset "
                               f"({', '.join(PRESETS)}) or the folder of the model the run trained on; fix: --base DIR, "
                               "the folder with its config.json and weights"], "export")
    else:
        where, set_as = f"the run's base model (model.name in {run_dir}/config.yaml)", "--base "
        name = cfg.model.name
        adapter_base = _read_json(os.path.join(final, "adapter_config.json")).get("base_model_name_or_path")
        if name not in PRESETS and not hfconfig.is_local(name) and isinstance(adapter_base, str) \
                and hfconfig.is_local(adapter_base):
            name = adapter_base
        if name not in PRESETS and not hfconfig.is_local(name) and hfconfig.looks_like_path(name):
            raise ConfigError([f"{where}: {name!r} is not a folder here (moved or deleted since the run); rule: "
                               "--merge folds the adapter into the weights the run trained on; fix: --base DIR, the "
                               "folder those weights are in now"], "export")
    if hfconfig.is_local(name):  # what a run would check of it, said of --base
        hfconfig.check_local_dir(name, key=where, set_as=set_as)
        hfconfig.check_weights(name, hfconfig.load(name, cfg.model.trust_remote_code), key=where,
                               trust_remote_code=cfg.model.trust_remote_code)
    return name


def _base_dtype(cfg, summary: dict) -> torch.dtype:
    if cfg.model.name in PRESETS:  # rebuilt from the seed in the dtype the run built it in
        cast = MODULE_IN_COMPUTE_DTYPE.get(summary.get("engine"), False)
        return weight_dtype(cast, summary.get("precision", "fp32"), cfg.lora.r > 0)
    dt = getattr(model_config(cfg), "dtype", None) or getattr(model_config(cfg), "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def export(run_dir: str, out: str, merge: bool = False, base: str | None = None) -> str:
    """Write ``out`` from ``run_dir/final``; returns a one-paragraph message for the user. Every problem of the
    arguments is refused before anything is read or written."""
    final = os.path.join(run_dir, "final")
    problems = []
    if os.path.lexists(out):
        problems.append(f"--out: got {out!r}, which already exists; rule: export never overwrites; fix: --out <a new "
                        "directory>, or remove it yourself")
    else:
        problems += filter(None, [folder_problem("--out", out, "a new folder, made in a folder this user can write",
                                                 "--out DIR where you can write")])
    if base is not None and not merge:
        problems.append(f"--base: got {base!r} without --merge; rule: --base is the model a LoRA adapter merges into; "
                        "fix: add --merge, or drop --base")
    if not os.path.isdir(run_dir):
        problems.append(f"RUN_DIR: got {run_dir!r}, {'a file' if os.path.exists(run_dir) else 'no such folder'}; rule: "
                        "a run directory vramfit train made; fix: vramfit export runs/<run_name> --out DIR")
    elif not os.path.isdir(final):
        try:
            status = _read_json(os.path.join(run_dir, "summary.json")).get("status")
        except ConfigError:
            status = "unreadable"
        why = f"the run's status is {status!r}" if status else "no finished run there"
        problems.append(f"RUN_DIR: {run_dir!r} has no final/ ({why}); rule: export needs a completed run; fix: "
                        "finish or resume the run (vramfit train with the same run_name), then export")
    if problems:
        raise ConfigError(problems, "export")
    is_adapter = os.path.isfile(os.path.join(final, "adapter_config.json"))
    if not is_adapter:
        shutil.copytree(final, out)
        note = " (--merge has nothing to merge: the run was a full fine-tune)" if merge else ""
        return f"copied the full model in {final} to {out}{note}; load it with AutoModelForCausalLM.from_pretrained({out!r})"
    if not merge:
        shutil.copytree(final, out)
        return (f"copied the LoRA adapter in {final} to {out}; load it with PeftModel.from_pretrained(base, {out!r}), "
                f"or run with --merge for a standalone model")
    return _merge(run_dir, final, out, base)


def _merge(run_dir: str, final: str, out: str, base: str | None = None) -> str:
    from peft import PeftModel  # imported when merging only: it pulls in much of transformers

    cfg = _run_config(run_dir)
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    cfg.model.name = _base_name(cfg, run_dir, final, base)
    dtype = _base_dtype(cfg, summary)
    base_cfg = replace(cfg, model=replace(cfg.model, quantize="none", gradient_checkpointing=False),
                       lora=replace(cfg.lora, r=0))
    base_model = make_model(base_cfg, Placement(torch.device("cpu"), dtype, dtype))
    model = PeftModel.from_pretrained(base_model, final)
    merged = model.merge_and_unload()
    merged.config.use_cache = True
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok = load_tokenizer(base_cfg)
        if os.path.isfile(os.path.join(final, "tokenizer_config.json")) or os.path.isfile(os.path.join(final, "tokenizer.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(final)
        if tok is not None:
            tok.save_pretrained(tmp)
        os.rename(tmp, out)  # a complete directory or none at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed write left (after the rename there is nothing)
    n = sum(p.numel() for p in merged.parameters())
    where = "preset rebuilt from the run's seed" if cfg.model.name in PRESETS else cfg.model.name
    qnote = (f"; the adapter trained against the {cfg.model.quantize} base and is merged into its full-precision "
             "weights") if cfg.model.quantize != "none" else ""
    return (f"merged the LoRA adapter in {final} into {where} ({n / 1e6:.2f}M parameters, "
            f"{str(dtype).replace('torch.', '')}){qnote}; wrote {out}; load it with "
            f"AutoModelForCausalLM.from_pretrained({out!r})")
