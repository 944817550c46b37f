"""Which linear layers LoRA adapts: one matcher for the planner (meta models) and for training (peft).

``all-linear`` means every linear layer of the decoder (``nn.Linear`` and its bitsandbytes subclasses,
transformers' GPT-2 style ``Conv1D``), the output head left out: peft's own rule, resolved here so the
names can be printed and checked before anything is loaded. Any other target matches a module whose full
name equals it or ends with ``.<target>`` (peft's rule for strings), among all linear layers, head included.

Mixture-of-experts models keep their experts' weights as 3-D parameters (experts x out x in), not linear layers;
``lora.experts`` adapts them through peft's ``target_parameters``. In a target list the planner and the trace
share, :data:`EXPERTS` stands for "and the experts' weights". The router is never adapted (it stays frozen).
"""

from __future__ import annotations

from torch import nn

ALL_LINEAR = "all-linear"
EXPERTS = "+experts"  # in a target list: the experts' stacked weights too (peft's target_parameters)


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
    targets = [t for t in ([targets] if isinstance(targets, str) else list(targets)) if t != EXPERTS]
    return not targets or any(t.lower() == ALL_LINEAR for t in targets)


def expert_parameters(model: nn.Module) -> list[str]:
    """Full names of the experts' stacked weights (3-D parameters: one matrix per expert)."""
    return [n for n, p in model.named_parameters() if p.dim() == 3]


def adapted_parameters(model: nn.Module, targets) -> list[str]:
    """Full names of the parameters LoRA adapts under ``targets`` (the experts' weights with :data:`EXPERTS`)."""
    return expert_parameters(model) if EXPERTS in targets else []


def parameter_targets(names: list[str]) -> list[str]:
    """What to hand peft's ``target_parameters``: each weight's module and name (``experts.gate_up_proj``), once."""
    return list(dict.fromkeys(".".join(n.split(".")[-2:]) for n in names))


def experts_problem(targets, dropout: float) -> str | None:
    """Why LoRA cannot run with ``targets`` (with :data:`EXPERTS`) at this dropout, None when it can: peft's LoRA on
    a parameter has no dropout (it refuses to build)."""
    if EXPERTS in targets and dropout > 0:
        return (f"lora.dropout: got {dropout:g} with the experts' weights adapted (lora.experts); rule: peft's LoRA on "
                "a parameter (the experts' stacked weights) has no dropout; fix: lora.dropout=0, or lora.experts=false "
                "to adapt the attention alone")
    return None


def with_experts(targets, experts: str, has_experts: bool) -> tuple:
    """``targets`` plus :data:`EXPERTS` where ``lora.experts`` adapts the experts: ``true``, or ``auto`` with
    all-linear; only for a model that has experts."""
    targets = tuple(t for t in targets if t != EXPERTS)
    adapt = experts == "true" or (experts == "auto" and is_all_linear(targets))
    return targets + (EXPERTS,) if adapt and has_experts else targets


def unknown(model: nn.Module, targets) -> list[str]:
    """Targets that match no linear layer (empty for all-linear)."""
    if is_all_linear(targets):
        return []
    every = linear_modules(model, head=True)
    return [t for t in targets if t != EXPERTS and not any(matches(t, n) for n in every)]


def adapted(model: nn.Module, targets=(ALL_LINEAR,)) -> list[str]:
    """Full names of the modules LoRA adapts under ``targets``."""
    if is_all_linear(targets):
        return linear_modules(model)
    return [n for n in linear_modules(model, head=True) if any(matches(t, n) for t in targets if t != EXPERTS)]


def for_peft(model: nn.Module, targets) -> list[str]:
    """What to hand peft's ``target_modules``: the leaf names of every adapted layer for all-linear, else the
    targets as written."""
    return leaf_names(linear_modules(model)) if is_all_linear(targets) else [t for t in targets if t != EXPERTS]


def problems(model: nn.Module, model_name: str, target_modules, experts: str, dropout: float) -> list[str]:
    """Why LoRA with ``lora.target_modules``, ``lora.experts`` and ``lora.dropout`` cannot run on ``model`` (each
    with value, rule and fix; empty when it can): one rule for the plan (a meta model) and the run."""
    wanted = list(target_modules)
    has_experts = bool(expert_parameters(model))
    out = []
    if experts == "true" and not has_experts:
        out.append(f"lora.experts: got 'true', but {model_name!r} has no expert weights (3-D parameters of a "
                   "mixture-of-experts layer); rule: only a mixture-of-experts model has experts to adapt; fix: "
                   "lora.experts=auto")
    if is_all_linear(wanted) and not linear_modules(model):
        out.append(f"lora.target_modules: {model_name!r} has no linear layers besides its output head; rule: LoRA "
                   "adapts linear layers; fix: lora.r=0 (full fine-tune)")
    wrong = unknown(model, wanted)
    if wrong:
        every = linear_modules(model, head=True)
        verb = "matches" if len(wrong) == 1 else "match"
        out.append(f"lora.target_modules: {', '.join(map(repr, wrong))} {verb} no linear layer of {model_name!r}; "
                   f"rule: names of linear modules (or a dotted suffix of one); the model's linear layers are: "
                   f"{', '.join(leaf_names(every))}; fix: lora.target_modules=all-linear, or a subset of those names")
    problem = experts_problem(with_experts(wanted, experts, has_experts), dropout)
    return out + ([problem] if problem else [])
