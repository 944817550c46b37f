"""bitsandbytes base weights: 4-bit NF4 with double quantization (QLoRA) or LLM.int8(), on the AMP path.

Loaded models are quantized by transformers while loading (``quantization_config``); presets, built in
memory, are quantized here one layer at a time. Only LoRA adapters train on top (config.py refuses a
quantized full fine-tune).
"""

from __future__ import annotations

import torch

from launcher.config.schema import Config, ConfigError
from launcher.model.targets import linear_modules
from launcher.precision import compute_dtype


def require_bitsandbytes(cfg: Config) -> None:
    what = (f"model.quantize={cfg.model.quantize}" if cfg.model.quantize != "none" else f"train.optimizer={cfg.train.optimizer}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ConfigError([f"{what}: needs bitsandbytes, which does not import here ({e}); fix: "
                           "pip install 'vramfit[quant]'"]) from None



def bnb_config(kind: str, precision: str):
    """transformers' BitsAndBytesConfig: NF4 with double quantization (QLoRA), or LLM.int8()."""
    from transformers import BitsAndBytesConfig

    if kind == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype(precision))
    return BitsAndBytesConfig(load_in_8bit=True)


def quantize_in_place(model: torch.nn.Module, kind: str, precision: str, device: torch.device,
                      within: torch.nn.Module | None = None) -> int:
    """Replace the decoder's nn.Linear layers of a model already in memory (a preset) by bitsandbytes ones,
    quantized on ``device``; one layer at a time, so the full-precision copy is freed as it goes. ``within``: only
    the layers inside that module (the part of the model just made, :mod:`launcher.model.materialize`)."""
    import bitsandbytes as bnb

    inside = None if within is None else {id(m) for m in within.modules()}
    count = 0
    for name in linear_modules(model):
        if inside is not None and id(model.get_submodule(name)) not in inside:
            continue
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


def describe(model: torch.nn.Module) -> str:
    """'12 Linear4bit layers (Params4bit, uint8 storage)' and the like, for the log."""
    kinds: dict[str, int] = {}
    for m in model.modules():
        t = type(m).__name__
        if t in ("Linear4bit", "Linear8bitLt"):
            w = m.weight
            key = f"{t} ({type(w).__name__}, {str(w.dtype).replace('torch.', '')} storage)"
            kinds[key] = kinds.get(key, 0) + 1
    experts = [p for p in model.parameters() if p.dim() == 3]  # a mixture-of-experts layer's stacked weights
    stays = (f"; the experts' {len(experts)} stacked weights ({sum(p.numel() for p in experts) / 1e6:.1f}M parameters) "
             f"stay {str(experts[0].dtype).replace('torch.', '')}: bitsandbytes quantizes linear layers only"
             if experts else "")
    return (", ".join(f"{n} {k}" for k, n in kinds.items()) or "no quantized layers") + stays
