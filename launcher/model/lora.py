"""LoRA through ``peft``: the targets checked before anything is loaded, and the adapter applied.

Which layers ``lora.target_modules`` names is :mod:`launcher.model.targets`' rule (the planner counts the same
ones). Only adapter parameters require grad, so only they get gradients and optimizer state
(``models.param_groups`` takes ``requires_grad`` parameters only). Quantized bases: :mod:`launcher.model.quantize`.
"""

from __future__ import annotations

import os
import warnings

import torch

from launcher.config.schema import Config, ConfigError
from launcher.log import logger
from launcher.model import quantize, targets


def resolve_targets(cfg: Config, model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """``lora.target_modules`` and ``lora.experts`` -> (module names for peft's ``target_modules``, parameter names
    for its ``target_parameters``); a ConfigError for names that match no linear layer, or experts asked of a
    model without them."""
    wanted = list(cfg.lora.target_modules)
    problems = targets.problems(model, cfg.model.name, wanted, cfg.lora.experts, cfg.lora.dropout)
    if problems:
        raise ConfigError(problems)
    experts = targets.expert_parameters(model)
    chosen = targets.with_experts(wanted, cfg.lora.experts, bool(experts))
    if targets.EXPERTS in chosen and not _peft_adapts_parameters():
        import peft

        raise ConfigError([f"lora.experts: {cfg.model.name!r} keeps its experts' weights as parameters, and peft "
                           f"{peft.__version__} cannot adapt a parameter; rule: LoRA on the experts needs peft 0.17 or "
                           "newer (target_parameters); fix: pip install -U peft, or lora.experts=false"])
    return targets.for_peft(model, wanted), targets.parameter_targets(targets.adapted_parameters(model, chosen))


def _peft_adapts_parameters() -> bool:
    """peft's LoraConfig takes ``target_parameters`` (LoRA on an nn.Parameter: peft 0.17 and newer)."""
    import dataclasses

    from peft import LoraConfig

    return "target_parameters" in {f.name for f in dataclasses.fields(LoraConfig)}


def check(cfg: Config, hf_config) -> tuple[list[str], list[str]] | None:
    """Before the run directory is made: bitsandbytes present when needed; LoRA targets exist (on a meta
    model: no memory, no weights). Returns the resolved (module, parameter) targets (None without LoRA)."""
    if cfg.model.quantize != "none" or cfg.train.optimizer in ("adamw8bit", "paged_adamw8bit"):
        quantize.require_bitsandbytes(cfg)
    if not cfg.lora.r:
        return None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=cfg.model.trust_remote_code)
    return resolve_targets(cfg, meta)


# ----------------------------------------------------------------------------------------------
# The adapter


def apply_lora(cfg: Config, model: torch.nn.Module, base_name: str | None = None):
    """Wrap ``model`` (on the meta device, or made) in a peft LoRA model: base frozen, adapters trainable. The
    adapters are made on the meta device (peft's ``low_cpu_mem_usage``), for
    :class:`launcher.model.materialize.Materializer` to make and initialise the same way on every path."""
    from peft import LoraConfig, get_peft_model

    names, params = resolve_targets(cfg, model)
    experts = len(targets.expert_parameters(model))
    on_params = {"target_parameters": params} if params else {}  # peft 0.17+ (resolve_targets refused older)
    lc = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, target_modules=names,
                    bias="none", task_type="CAUSAL_LM", **on_params)
    # autocast_adapter_dtype: adapters of a 16-bit base are made fp32, as the optimizer and GradScaler need.
    with warnings.catch_warnings():  # peft asks a deprecated transformers property; nothing for the user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, lc, autocast_adapter_dtype=True, low_cpu_mem_usage=True)
    peft_model.peft_config["default"].base_model_name_or_path = base_name or cfg.model.name
    n = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    what = ", ".join(names) + (f" + the experts' {', '.join(p.split('.')[-1] for p in params)} ({experts} expert "
                               "weights; the router stays frozen)" if params else "")
    logger.info(f"LoRA r={cfg.lora.r} alpha={cfg.lora.alpha:g} dropout={cfg.lora.dropout:g} on {what}: "
                f"{n / 1e6:.3f}M trainable parameters"
                + (f"; the experts are left out (lora.experts={cfg.lora.experts})" if experts and not params else ""))
    return peft_model


def base_name_for(cfg: Config) -> str:
    """What an adapter records as its base: the absolute path of a local directory, else the name."""
    path = os.path.abspath(os.path.expanduser(cfg.model.name))
    return path if os.path.isdir(path) else cfg.model.name


def adapter_weights(cfg: Config, model: torch.nn.Module) -> dict:
    """``model.adapter``'s tensors as {parameter name of ``model`` (the peft model): {"param": tensor}}: what
    :class:`launcher.model.materialize.Materializer` puts in instead of initialising the adapter (on every engine,
    sharded or not). A ConfigError when the file lacks one of the model's adapter tensors or holds another shape."""
    from safetensors import safe_open

    path = os.path.join(os.path.expanduser(cfg.model.adapter), "adapter_model.safetensors")
    out, problems = {}, []
    with safe_open(path, framework="pt") as fh:
        keys = set(fh.keys())
        for name, p in model.named_parameters():
            if ".lora_A." not in name and ".lora_B." not in name:
                continue
            key = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            if key not in keys:
                problems.append(name)
                continue
            t = fh.get_tensor(key)
            if tuple(t.shape) != tuple(p.shape):
                problems.append(f"{name} (shape {tuple(t.shape)} in the file, {tuple(p.shape)} here)")
                continue
            out[name] = {"param": t}
    if problems or not out:
        raise ConfigError([f"model.adapter: {path} does not fit this model's LoRA ({len(problems)} adapter tensors "
                           f"missing or of another shape, first: {', '.join(problems[:3]) or 'none found'}); rule: an "
                           "adapter trained on this base with the same lora.r and target_modules; fix: model.name= the "
                           "adapter's base, and drop lora.r / lora.target_modules (read from the adapter)"])
    logger.info(f"model.adapter: {len(out)} adapter tensors from {path} (the starting point; nothing initialised)")
    return out
