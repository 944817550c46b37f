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


def supports_bf16(capability: tuple[int, int]) -> bool:
    return capability[0] >= 8


def supports_fp16(capability: tuple[int, int]) -> bool:
    return capability[0] >= 6
