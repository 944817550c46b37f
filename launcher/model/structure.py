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


def most_module_params(model: nn.Module) -> int:
    """The most parameters one module holds directly (elements): what ZeRO-3 gathers at once."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


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


def units(model: nn.Module) -> list[nn.Module]:
    """The model's parts that are made, sharded and gathered one at a time, in forward order: the input embeddings,
    each decoder layer, the output head. Tied input and output embeddings share one weight, which can only belong
    to one part: then both stay with the rest of the model (the root), which comes after these."""
    base = base_model(model)
    layers = list(decoder_layers(model))
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    tied = emb is not None and head is not None and emb.weight is head.weight
    out = [] if tied or emb is None else [emb]
    out += layers
    if head is not None and not tied:
        out.append(head)
    return out
