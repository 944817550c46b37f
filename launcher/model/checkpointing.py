"""Activation (gradient) checkpointing on Hugging Face decoder models: all layers, or every k-th layer.

Non-reentrant: it works with frozen bases and LoRA without the trick the reentrant variant needs (inputs
that require grad). Every k-th layer spends leftover memory on speed: the layers in between keep their
activations and skip the recompute (torchtune's ``ac_option``). transformers >= 5.24 does it itself
(``every_n_layers``); on older versions the same flags are set here, layer by layer: layer ``i`` is
checkpointed when ``i % k == 0``, as transformers counts.
"""

from __future__ import annotations

import inspect
import warnings

from torch import nn

from launcher.model import actoffload


def enable(model: nn.Module, every: int = 1, offload: bool = False, pin_memory: bool = False) -> None:
    """Checkpoint every ``every``-th decoder layer of ``model`` (a transformers or peft model); ``offload``: the
    checkpointed layers' inputs go to CPU memory (:mod:`launcher.model.actoffload`)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    _drop_input_grad_hooks(base)  # transformers registers one more at each enable and keeps only the last
    kw = {"use_reentrant": False}
    new = getattr(base, "activation_checkpointing_enable", None)  # transformers 5.x; the old name warns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if new is not None and "every_n_layers" in inspect.signature(new).parameters:
            new(activation_checkpointing_kwargs=kw, every_n_layers=every)
        else:
            (new or base.gradient_checkpointing_enable)(kw)
            if every > 1:
                for i, layer in enumerate(_layers(base)):
                    layer.gradient_checkpointing = i % every == 0
    base.config.use_cache = False
    if offload:
        actoffload.offload_checkpointed_layers(_layers(base), pin_memory)


def disable(model: nn.Module) -> None:
    """No layer recomputes: undo :func:`enable` entirely, so the model steps as if it had never been checkpointed
    (the planner reuses one meta model for every setting it traces). transformers' own disable leaves the flag
    of the inner model and the hook that makes the embeddings' output require grad (which makes backward
    carry a gradient down to the first layer's input: more ops and more memory than a plain step)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    for m in base.modules():
        if hasattr(m, "gradient_checkpointing"):
            m.gradient_checkpointing = False
    _drop_input_grad_hooks(base)


def _drop_input_grad_hooks(base: nn.Module) -> None:
    if getattr(base, "_require_grads_hooks", None) or getattr(base, "_require_grads_hook", None) is not None:
        base.disable_input_require_grads()


def checkpointed_layers(model: nn.Module) -> list[bool]:
    """Which decoder layers recompute in backward (for tests and the log)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return [bool(getattr(layer, "gradient_checkpointing", False)) for layer in _layers(base)]


def _layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
