"""The three precisions: their torch dtypes, bytes per element, and which cards compute in them natively.

bf16 is native from compute capability 8.0 (Ampere) on. ``torch.cuda.is_bf16_supported()`` answers yes on a
T4 (7.5) through slow emulation, so the capability is checked here instead.
"""

from __future__ import annotations

import torch

PRECISIONS = ("fp16", "bf16", "fp32")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def autocast_dtype(precision: str) -> torch.dtype | None:
    """What autocast computes in (None for fp32: no autocast)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def compute_dtype(precision: str) -> torch.dtype:
    """What a matmul computes in under this precision (fp32 when there is no autocast)."""
    return autocast_dtype(precision) or torch.float32


def weight_dtype(module_in_compute_dtype: bool, precision: str, adapters: bool) -> torch.dtype:
    """The dtype a run keeps its model's base weights in (the one rule the loader, the export and the memory plan
    share). An engine that casts the module to the compute dtype (``module_in_compute_dtype``, the catalogue's
    :data:`launcher.config.profiles.MODULE_IN_COMPUTE_DTYPE`: DeepSpeed, which keeps fp32 masters in its optimizer),
    in fp16/bf16: 16 bits. A LoRA or QLoRA base (``adapters``) on any engine: 16 bits too (it is frozen, and every
    engine computes in 16 bits anyway; only the adapters train). Otherwise fp32 masters (AMP, and FSDP, which casts
    to 16 bits per layer as it computes)."""
    if precision in ("fp16", "bf16") and (module_in_compute_dtype or adapters):
        return DTYPES[precision]
    return torch.float32


def trainable_dtype(module_in_compute_dtype: bool, precision: str) -> torch.dtype:
    """The dtype of the weights that train: fp32 masters for the torch engines (AMP, FSDP), the compute dtype for
    an engine that casts the module (DeepSpeed: its optimizer keeps the fp32 master)."""
    return DTYPES[precision] if module_in_compute_dtype else torch.float32


def supports_bf16(capability: tuple[int, int]) -> bool:
    return capability[0] >= 8


def supports_fp16(capability: tuple[int, int]) -> bool:
    return capability[0] >= 6


# Device types whose DeepSpeed accelerator trains in fp16. Its CPU accelerator refuses fp16
# (``is_fp16_supported()`` is False in 0.19), so the fp16 profiles run on a GPU only. The tests that run them on
# the CPU widen this together with the accelerator's check (tests/conftest.py, ``deepspeed_fp16_on_cpu``); it
# says nothing of speed: a CPU computes fp16 no faster than fp32.
DEEPSPEED_FP16_DEVICES = ("cuda",)


def deepspeed_runs_fp16(device_type: str) -> bool:
    """Whether DeepSpeed trains in fp16 on this kind of device (the one rule availability and a user's
    deepspeed_config are checked by)."""
    return device_type in DEEPSPEED_FP16_DEVICES
