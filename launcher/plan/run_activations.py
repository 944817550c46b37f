"""A run's activations, per trace family (which traced forward + backward a profile's activations come from is
its engine family's answer, :meth:`launcher.plan.families.base.Family.trace_family`): the trace's settings for a
run at a micro-batch, the estimate (:mod:`launcher.plan.memory.estimate`; counted from the config where a model's
forward cannot run on meta), and its parts under the names a plan gives them."""

from __future__ import annotations

import torch

from launcher.config.schema import ConfigError
from launcher.model.loss import HeadNotPlain
from launcher.plan.memory.estimate import ActivationEstimate, compose_every, counted_activations, estimate_activations
from launcher.plan.memory.states import RunShape
from launcher.plan.memory.trace import TraceSettings
from launcher.precision import DTYPES, weight_dtype


def _attention_kernel(run: RunShape, dtype: torch.dtype) -> str:
    """The SDPA kernel the target runs: flash for 16-bit on capability >= 8, memory-efficient otherwise
    (CUDA); CPU's flash kernel (without dropout; the trace falls back to math when dropout is on). Packed samples
    bring a mask, which CUDA's flash kernel does not take: the memory-efficient one runs."""
    if run.attn_implementation != "sdpa":
        return "math"
    if run.device == "cpu":
        return "flash"
    if run.packed:
        return "efficient"
    if dtype in (torch.float16, torch.bfloat16) and run.capability[0] >= 8:
        return "flash"
    return "efficient"


def _trace_settings(run: RunShape, family: str, micro_batch: int) -> TraceSettings:
    # fp16 is traced as bf16: the same sizes, the same autocast lists, one trace for both (the op record is
    # relabelled in activations()), which halves the traces of a plan across GPUs (vramfit plan --compare-gpus)
    cd = DTYPES["bf16" if run.precision == "fp16" else run.precision]
    if family == "fp32":
        pdt, adt, ac = torch.float32, torch.float32, None
    elif family == "16bit":
        pdt, adt, ac = cd, cd, None
    else:  # amp: fp32 master weights under autocast; a LoRA base is frozen in 16 bits, adapters fp32
        pdt, adt, ac = (cd if weight_dtype(False, run.precision, run.lora_r > 0) != torch.float32 else torch.float32,
                        torch.float32, cd)
    kernel = _attention_kernel(run, cd if ac is not None or family == "16bit" else torch.float32)
    # a preference pair is two rows (chosen and rejected) of one forward: traced as a micro-batch of twice the rows
    return TraceSettings(batch_size=micro_batch * run.rows_per_sample, seq_len=run.seq_len, param_dtype=pdt, adapter_dtype=adt,
                         autocast_dtype=ac, target=run.device, attn_implementation=run.attn_implementation,
                         attention_kernel=kernel, gradient_checkpointing=run.checkpointing,
                         checkpoint_every=run.checkpoint_every if run.checkpointing else 1, lora_r=run.lora_r,
                         lora_targets=run.lora_targets, lora_dropout=run.lora_dropout, chunked_loss=run.chunked_loss,
                         offload_activations=run.offload_activations, packed=run.packed)


def activations(run: RunShape, family: str, micro_batch: int, exact: bool = True,
                 compose: bool = False) -> ActivationEstimate:
    """The activation estimate of ``run`` at ``micro_batch``; ``compose``: every k-th layer checkpointed composed
    from the traces with none and with all (:func:`launcher.plan.memory.estimate.compose_every`) where it applies."""
    s = _trace_settings(run, family, micro_batch)
    try:
        if compose and (est := compose_every(run.config, s, run.trust_remote_code)) is not None:
            return est
        return estimate_activations(run.config, s, run.trust_remote_code, exact)
    except HeadNotPlain as e:
        raise ConfigError([str(e)]) from None
    except Exception as e:  # noqa: BLE001 -- whatever a model's forward raises on meta: the plan goes on, estimated
        arch = type(run.config).__name__.replace("Config", "")
        why = (f"the activation trace of {arch} failed on the meta device ({type(e).__name__}: "
               f"{str(e).splitlines()[0] if str(e) else ''})")
        return counted_activations(run.config, s, run.counts.trainable, why)


def ops_of(est: ActivationEstimate, run: RunShape) -> dict:
    """The op record of a trace, in the run's dtype names (fp16 runs are traced as bf16)."""
    if run.precision != "fp16":
        return est.ops
    return {(k, "float16" if d == "bfloat16" else d, f, b): c for (k, d, f, b), c in est.ops.items()}


_ACT_PARTS = {"embeddings": "activations", "layer": "activations", "other": "activations",
              "body_bwd": "activations", "head": "logits", "head_bwd": "logits",
              "autocast_cache": "autocast_weight_cache", "param_grad": "gradients"}


def activation_parts(est: ActivationEstimate, with_grads: bool) -> dict[str, int]:
    src = est.peak_with_grads_parts if with_grads else est.peak_parts
    out: dict[str, int] = {}
    for cat, n in src.items():
        part = _ACT_PARTS.get(cat, "activations")
        out[part] = out.get(part, 0) + n
    return out
