"""Faster kernels for the model's layers: ``model.compile`` (torch.compile) and ``model.liger`` (Liger's Triton
kernels for RMSNorm, RoPE and SwiGLU).

``model.compile=true`` compiles each decoder layer in place (``nn.Module.compile``): parameter names and the
module tree stay as they are (checkpoints, LoRA, FSDP units and the memory monitor's hooks see the same
model), and a layer is the unit FSDP2 shards, so the AMP and FSDP paths compile the same way. The first
steps pay the compilation (inductor; on a CPU it needs a C++ compiler). DeepSpeed's profiles cannot run with
it (DeepSpeed wraps the module and hooks every parameter, and its own ``engine.compile()`` is not wired here):
:mod:`launcher.plan.availability` rules them out, so ``engine=auto`` picks the AMP path and ``engine=deepspeed``
is refused before anything loads.

``model.liger=true`` needs a CUDA GPU (the kernels are Triton's) and the ``liger-kernel`` package; both are
checked before anything loads, each refusal says value, rule and fix. Liger patches the model instance by its
architecture (``liger_kernel.transformers._apply_liger_kernel_to_instance``); the fused linear + cross-entropy
is left off, because the planner counts the logits the plain loss keeps.
"""

from __future__ import annotations

import importlib.util

from launcher.config.schema import ConfigError


def problems(cfg, device_type: str) -> list[str]:
    """What keeps ``model.liger`` from working on this device (empty: nothing). Whether ``model.compile`` can run
    is the engine's question, answered with every other one in :func:`launcher.plan.availability.profile_problem`."""
    out = []
    if cfg.model.liger:
        if device_type != "cuda":
            out.append(f"model.liger: got true on device {device_type}; rule: Liger's kernels are Triton kernels for "
                       "CUDA GPUs; fix: model.liger=false (or train on a GPU)")
        elif importlib.util.find_spec("liger_kernel") is None:
            out.append("model.liger: got true but liger-kernel is not installed; rule: the kernels come from the "
                       "liger-kernel package; fix: pip install liger-kernel, or model.liger=false")
    return out


def check(cfg, device_type: str) -> None:
    found = problems(cfg, device_type)
    if found:
        raise ConfigError(found)


def apply_liger(model) -> None:
    """Liger's RMSNorm, RoPE and SwiGLU kernels in ``model`` (an HF model instance), on CUDA."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def compile_layers(model) -> int:
    """``torch.compile`` every decoder layer in place; returns how many."""
    from launcher.model.structure import decoder_layers

    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)
