"""``vramfit export RUN_DIR --out DIR [--merge]``: a standalone model from a finished run.

A LoRA run's ``final/`` holds the adapter (``adapter_config.json``, ``adapter_model.safetensors``)
and the tokenizer. ``--merge`` loads the base the run started from (the model directory, or a
preset rebuilt from the run's seed), applies the adapter, folds it into the weights
(``merge_and_unload``) and writes a model that ``AutoModelForCausalLM.from_pretrained`` loads with
no peft; it is saved in the base checkpoint's dtype. A QLoRA adapter merges into the
full-precision base (the usual QLoRA practice; the 4-bit base it trained against differs by the
quantization error). Without ``--merge`` the adapter is copied. A full fine-tune's ``final/`` is
already standalone and is copied either way. ``--out`` must not exist: nothing is overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import torch

from launcher.config.schema import ConfigError, load_config
from launcher.model.build import load_tokenizer, make_model, model_config
from launcher.model.materialize import Placement
from launcher.model.presets import PRESETS
from launcher.precision import weight_dtype


def _run_config(run_dir: str):
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError([f"RUN_DIR {run_dir!r}: no config.yaml; rule: a directory that vramfit train made; "
                           "fix: pass runs/<run_name>"], "export")
    # the run's own checkpoint.resume may point at a path that has since moved: it does not matter here
    return load_config(path, ["checkpoint.resume=auto"])


def _base_dtype(cfg, summary: dict) -> torch.dtype:
    if cfg.model.name in PRESETS:  # rebuilt from the seed in the dtype the run built it in
        return weight_dtype(summary.get("engine", "amp"), summary.get("precision", "fp32"), cfg.lora.r > 0)
    dt = getattr(model_config(cfg), "dtype", None) or getattr(model_config(cfg), "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def export(run_dir: str, out: str, merge: bool = False) -> str:
    """Write ``out`` from ``run_dir/final``; returns a one-paragraph message for the user."""
    final = os.path.join(run_dir, "final")
    if os.path.exists(out):
        raise ConfigError([f"--out {out!r} already exists; rule: export never overwrites; fix: --out <a new "
                           "directory>, or remove it yourself"], "export")
    if not os.path.isdir(final):
        summary_path = os.path.join(run_dir, "summary.json")
        status = json.load(open(summary_path)).get("status") if os.path.isfile(summary_path) else None
        why = f"the run's status is {status!r}" if status else "no run there"
        raise ConfigError([f"RUN_DIR {run_dir!r}: no final/ ({why}); rule: export needs a completed run; fix: "
                           "finish or resume the run (vramfit train with the same run_name), then export"], "export")
    is_adapter = os.path.isfile(os.path.join(final, "adapter_config.json"))
    if not is_adapter:
        shutil.copytree(final, out)
        note = " (--merge has nothing to merge: the run was a full fine-tune)" if merge else ""
        return f"copied the full model in {final} to {out}{note}; load it with AutoModelForCausalLM.from_pretrained({out!r})"
    if not merge:
        shutil.copytree(final, out)
        return (f"copied the LoRA adapter in {final} to {out}; load it with PeftModel.from_pretrained(base, {out!r}), "
                f"or run with --merge for a standalone model")
    return _merge(run_dir, final, out)


def _merge(run_dir: str, final: str, out: str) -> str:
    from peft import PeftModel  # imported when merging only: it pulls in much of transformers

    cfg = _run_config(run_dir)
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    adapter_base = json.load(open(os.path.join(final, "adapter_config.json"))).get("base_model_name_or_path")
    if cfg.model.name not in PRESETS and not os.path.isdir(os.path.expanduser(cfg.model.name)) and adapter_base \
            and os.path.isdir(adapter_base):
        cfg.model.name = adapter_base  # the run used a relative path from another working directory
    dtype = _base_dtype(cfg, summary)
    base_cfg = replace(cfg, model=replace(cfg.model, quantize="none", gradient_checkpointing=False),
                       lora=replace(cfg.lora, r=0))
    base = make_model(base_cfg, Placement(torch.device("cpu"), dtype, dtype))
    model = PeftModel.from_pretrained(base, final)
    merged = model.merge_and_unload()
    merged.config.use_cache = True
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    merged.save_pretrained(tmp, safe_serialization=True)
    tok = load_tokenizer(base_cfg)
    if os.path.isfile(os.path.join(final, "tokenizer_config.json")) or os.path.isfile(os.path.join(final, "tokenizer.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(final)
    if tok is not None:
        tok.save_pretrained(tmp)
    os.rename(tmp, out)  # a complete directory or none at all
    n = sum(p.numel() for p in merged.parameters())
    where = "preset rebuilt from the run's seed" if cfg.model.name in PRESETS else cfg.model.name
    qnote = (f"; the adapter trained against the {cfg.model.quantize} base and is merged into its full-precision "
             "weights") if cfg.model.quantize != "none" else ""
    return (f"merged the LoRA adapter in {final} into {where} ({n / 1e6:.2f}M parameters, "
            f"{str(dtype).replace('torch.', '')}){qnote}; wrote {out}; load it with "
            f"AutoModelForCausalLM.from_pretrained({out!r})")
