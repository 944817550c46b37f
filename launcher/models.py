"""Models: presets built from configs, local HF directories or hub ids; checkpointing; LoRA.

Weights load in the dtype the profile needs: fp32 for the AMP and FSDP paths (autocast and
MixedPrecisionPolicy compute in 16 bits from fp32 masters), 16 bits for DeepSpeed fp16/bf16
profiles (DeepSpeed keeps the fp32 master copy in its optimizer).
"""

from __future__ import annotations

import os

import torch

from launcher.config import Config, ConfigError
from launcher.presets import PRESETS, preset_config

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def model_config(cfg: Config):
    """The transformers config of ``cfg.model.name`` (no weights)."""
    name = cfg.model.name
    if name in PRESETS:
        return preset_config(name)
    from transformers import AutoConfig

    path = os.path.expanduser(name)
    if not is_local(name) and (name.startswith((".", "/", "~")) or os.sep in name and name.count("/") > 1):
        raise ConfigError([f"model.name: {name!r} is not a directory; rule: a preset ({', '.join(PRESETS)}), a "
                           "local model directory, or a hub id; fix: check the path"])
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:
        raise ConfigError([f"model.name: {name!r} could not be loaded ({str(e).splitlines()[0]}); rule: a preset "
                           f"({', '.join(PRESETS)}), a local model directory with config.json, or a hub id "
                           "reachable from here; fix: pass a local directory or a preset"]) from None


def attn_impl(cfg: Config) -> str:
    return "sdpa" if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation


def build_model(cfg: Config, dtype: torch.dtype = torch.float32, hf_config=None):
    """Instantiate the model on the CPU in ``dtype``: random init for presets, weights from a directory/hub."""
    from transformers import AutoModelForCausalLM

    hf_config = hf_config if hf_config is not None else model_config(cfg)
    if cfg.model.name in PRESETS:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_impl(cfg), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(cfg.model.name), config=hf_config, dtype=dtype, attn_implementation=attn_impl(cfg),
            trust_remote_code=cfg.model.trust_remote_code)
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)
    return model


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing (works with frozen bases and LoRA, no input grads needed)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def count_params(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices only (not norms and biases), as nanoGPT and most recipes do."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def save_final(model, out_dir: str, tokenizer=None, state_dict=None) -> None:
    """HF ``save_pretrained`` weights (or the adapter for a peft model) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
