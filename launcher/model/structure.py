"""The structure of a Hugging Face causal LM that the engines, the kernels and the planner's trace all walk:
the model under a peft wrapper and its list of decoder layers."""

from __future__ import annotations

from torch import nn


def num_layers(config) -> int:
    return int(config.num_hidden_layers)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers: the one whose length is ``config.num_hidden_layers``."""
    base = base_model(model)
    n = num_layers(base.config)
    best = None
    for _name, mod in base.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            size = sum(p.numel() for p in mod.parameters())
            if best is None or size > best[0]:
                best = (size, mod)
    if best is None:
        raise ValueError(f"cannot find the decoder layers of {type(base).__name__} "
                         f"(no ModuleList of {n} = num_hidden_layers modules)")
    return best[1]
