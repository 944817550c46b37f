"""Which linear layers LoRA adapts: one matcher for the planner (meta models) and for training (peft).

``all-linear`` means every linear layer of the decoder (``nn.Linear`` and its bitsandbytes subclasses,
transformers' GPT-2 style ``Conv1D``), the output head left out: peft's own rule, resolved here so the
names can be printed and checked before anything is loaded. Any other target matches a module whose full
name equals it or ends with ``.<target>`` (peft's rule for strings), among all linear layers, head included.
"""

from __future__ import annotations

from torch import nn

ALL_LINEAR = "all-linear"


def is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def linear_in_out(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a ``Conv1D`` (whose weight is in x out)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    w = module.weight
    return int(w.shape[0]), int(w.shape[1])


def linear_modules(model: nn.Module, head: bool = False) -> list[str]:
    """Full names of the linear layers (the output head only with ``head``)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if n and is_linear(m) and (head or m is not out_emb)]


def leaf_names(names: list[str]) -> list[str]:
    """Distinct last components (``q_proj``, ``down_proj``...) in first-seen order."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


def matches(target: str, name: str) -> bool:
    return name == target or name.endswith("." + target)


def is_all_linear(targets) -> bool:
    targets = [targets] if isinstance(targets, str) else list(targets)
    return not targets or any(t.lower() == ALL_LINEAR for t in targets)


def unknown(model: nn.Module, targets) -> list[str]:
    """Targets that match no linear layer (empty for all-linear)."""
    if is_all_linear(targets):
        return []
    every = linear_modules(model, head=True)
    return [t for t in targets if not any(matches(t, n) for n in every)]


def adapted(model: nn.Module, targets=(ALL_LINEAR,)) -> list[str]:
    """Full names of the modules LoRA adapts under ``targets``."""
    if is_all_linear(targets):
        return linear_modules(model)
    return [n for n in linear_modules(model, head=True) if any(matches(t, n) for t in targets)]


def for_peft(model: nn.Module, targets) -> list[str]:
    """What to hand peft's ``target_modules``: the leaf names of every adapted layer for all-linear, else the
    targets as written."""
    return leaf_names(linear_modules(model)) if is_all_linear(targets) else list(targets)
