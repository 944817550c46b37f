"""LoRA through ``peft``, target discovery, and bitsandbytes 4-bit/8-bit base weights (QLoRA).

``lora.target_modules=all-linear`` means every linear layer of the decoder, found by walking the
model (``nn.Linear``, bitsandbytes' quantized linears, GPT-2 style ``Conv1D``), minus the output
head: the same rule as peft's ``all-linear``, but resolved here so the names can be printed and
checked before anything is loaded. Only adapter parameters require grad, so only they get gradients
and optimizer state (``models.param_groups`` takes ``requires_grad`` parameters only).
"""

from __future__ import annotations

import os
import warnings

import torch

from launcher.config import Config, ConfigError

ALL_LINEAR = "all-linear"


def _log(msg: str) -> None:
    from launcher.train import log  # late: train imports models, which imports this module

    log(msg)


def is_linear(module: torch.nn.Module) -> bool:
    """nn.Linear and its subclasses (bitsandbytes Linear4bit/Linear8bitLt), or transformers' Conv1D."""
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def linear_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the linear layers, the output head excluded."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if n and is_linear(m) and m is not head]


def leaf_names(names: list[str]) -> list[str]:
    """Distinct last components (``q_proj``, ``down_proj``...) in first-seen order."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


def matches(target: str, name: str) -> bool:
    """peft's rule for a string in target_modules: the full name, or its dotted suffix."""
    return name == target or name.endswith("." + target)


def resolve_targets(cfg: Config, model: torch.nn.Module) -> list[str]:
    """``lora.target_modules`` -> module names for peft; a ConfigError for names that match no linear layer."""
    linears = linear_modules(model)
    wanted = list(cfg.lora.target_modules)
    if wanted == [ALL_LINEAR] or not wanted:
        if not linears:
            raise ConfigError([f"lora.target_modules: {cfg.model.name!r} has no linear layers besides its output "
                               "head; rule: LoRA adapts linear layers; fix: lora.r=0 (full fine-tune)"])
        return leaf_names(linears)
    every = [n for n, m in model.named_modules() if n and is_linear(m)]  # the head may be named explicitly
    unknown = [t for t in wanted if not any(matches(t, n) for n in every)]
    if unknown:
        verb = "matches" if len(unknown) == 1 else "match"
        raise ConfigError([f"lora.target_modules: {', '.join(map(repr, unknown))} {verb} no linear layer of "
                           f"{cfg.model.name!r}; rule: names of linear modules (or a dotted suffix of one); the "
                           f"model's linear layers are: {', '.join(leaf_names(every))}; fix: "
                           f"lora.target_modules=all-linear, or a subset of those names"])
    return wanted


def check(cfg: Config, hf_config) -> list[str] | None:
    """Before the run directory is made: bitsandbytes present when needed; LoRA targets exist (on a meta
    model: no memory, no weights). Returns the resolved target names (None without LoRA)."""
    if cfg.model.quantize != "none" or cfg.train.optimizer == "adamw8bit":
        require_bitsandbytes(cfg)
    if not cfg.lora.r:
        return None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=cfg.model.trust_remote_code)
    return resolve_targets(cfg, meta)


def require_bitsandbytes(cfg: Config) -> None:
    what = (f"model.quantize={cfg.model.quantize}" if cfg.model.quantize != "none" else "train.optimizer=adamw8bit")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ConfigError([f"{what}: needs bitsandbytes, which does not import here ({e}); fix: "
                           "pip install 'vramfit[quant]'"]) from None


# ----------------------------------------------------------------------------------------------
# Quantized base weights


def compute_dtype(precision: str) -> torch.dtype:
    """What bitsandbytes' 4-bit matmuls compute in: the autocast dtype (fp32 on the CPU)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def bnb_config(kind: str, precision: str):
    """transformers' BitsAndBytesConfig: NF4 with double quantization (QLoRA), or LLM.int8()."""
    from transformers import BitsAndBytesConfig

    if kind == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype(precision))
    return BitsAndBytesConfig(load_in_8bit=True)


def quantize_in_place(model: torch.nn.Module, kind: str, precision: str, device: torch.device) -> int:
    """Replace the decoder's nn.Linear layers of a model already in memory (a preset) by bitsandbytes ones,
    quantized on ``device``; one layer at a time, so the full-precision copy is freed as it goes."""
    import bitsandbytes as bnb

    count = 0
    for name in linear_modules(model):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        if type(old) is not torch.nn.Linear:
            continue
        bias = old.bias is not None
        if kind == "4bit":
            new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=bias, compute_dtype=compute_dtype(precision),
                                    compress_statistics=True, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(old.weight.data.float(), requires_grad=False, compress_statistics=True,
                                           quant_type="nf4", module=new)
        else:
            new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=bias, has_fp16_weights=False,
                                      threshold=6.0, device="meta")
            new.weight = bnb.nn.Int8Params(old.weight.data.float(), requires_grad=False, has_fp16_weights=False)
        if bias:
            new.bias = torch.nn.Parameter(old.bias.data.clone(), requires_grad=False)
        setattr(parent, leaf, new.to(device))  # .to() quantizes
        count += 1
    return count


def keep_4bit_weights_trainable(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU inference layout for every 4-bit layer; returns how many layers.

    On CPUs with AVX512-BF16, bitsandbytes repacks a Linear4bit's weight for a fused bf16 kernel at its
    first forward in eval mode without gradients (our eval loss and the sample after training). The
    repacked layer is not differentiable: training after an eval silently stops gradients at every
    4-bit layer (tested with bitsandbytes 0.50). The repacking also needs in_features in whole 64-weight
    blocks, or it raises. vramfit trains, so it keeps the plain layout everywhere: results then do not
    depend on which CPU runs them (the eval and the sample are a few forwards)."""
    n = 0
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def describe_quantization(model: torch.nn.Module) -> str:
    """'12 Linear4bit layers (Params4bit, uint8 storage)' and the like, for the log."""
    kinds: dict[str, int] = {}
    for m in model.modules():
        t = type(m).__name__
        if t in ("Linear4bit", "Linear8bitLt"):
            w = m.weight
            key = f"{t} ({type(w).__name__}, {str(w.dtype).replace('torch.', '')} storage)"
            kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in kinds.items()) or "no quantized layers"


# ----------------------------------------------------------------------------------------------
# The adapter


def apply_lora(cfg: Config, model: torch.nn.Module, base_name: str | None = None):
    """Wrap ``model`` in a peft LoRA model: base frozen, adapters (fp32) trainable."""
    from peft import LoraConfig, get_peft_model

    targets = resolve_targets(cfg, model)
    lc = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, target_modules=targets,
                    bias="none", task_type="CAUSAL_LM")
    # autocast_adapter_dtype: adapters of a 16-bit base are made fp32, as the optimizer and GradScaler need.
    with warnings.catch_warnings():  # peft asks a deprecated transformers property; nothing for the user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, lc, autocast_adapter_dtype=True)
    peft_model.peft_config["default"].base_model_name_or_path = base_name or cfg.model.name
    n = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    _log(f"LoRA r={cfg.lora.r} alpha={cfg.lora.alpha:g} dropout={cfg.lora.dropout:g} on {', '.join(targets)}: "
         f"{n / 1e6:.3f}M trainable parameters")
    return peft_model


def base_name_for(cfg: Config) -> str:
    """What an adapter records as its base: the absolute path of a local directory, else the name."""
    path = os.path.abspath(os.path.expanduser(cfg.model.name))
    return path if os.path.isdir(path) else cfg.model.name
