"""The training loss of a causal LM, plain or chunked: one function every engine and the planner's trace call.

Plain: ``model(**batch).loss`` -- transformers applies the output head to every position and
``ForCausalLMLoss`` upcasts the whole ``micro x seq x vocab`` logits to fp32 before the cross-entropy, so
a Llama-3 vocabulary (128256) at seq 2048 holds 0.5 GiB of 16-bit logits, 1 GiB of fp32 logits and as much
again for their gradient, for each sample of the micro-batch.

Chunked (``loss.chunked``): the model runs with ``labels`` removed, and its output head, for that one call,
returns the loss instead of logits (its forward is swapped on the instance, so the module, its parameter
names and whatever engine hooks wrap it -- ZeRO-3's gather, FSDP2's unshard -- stay as they are). The head
and the cross-entropy run over chunks of rows (:class:`_ChunkedLinearCrossEntropy`): the forward keeps only
the hidden states (which the plain head saves too) and the labels; the backward recomputes each chunk's
logits, takes the cross-entropy's gradient in fp32 and multiplies it back through the head, accumulating
the weight gradient in place. One chunk's logits exist at a time. It costs one extra head matmul per step
(the recompute; about 2% of a Llama-3-8B step), and no bytes. Semantics are ``ForCausalLMLoss``'s exactly:
labels padded with -100 and shifted by one, -100 ignored, the mean over the tokens in the loss (or the sum
over ``num_items_in_batch``), logits computed in the compute dtype and upcast to fp32 for the
cross-entropy.

On CUDA, with Liger installed (``pip install 'vramfit[kernels]'``), Liger's fused linear cross-entropy does
the same in Triton (it computes the gradients in the forward, so no recompute). Not for fp16: Liger's
gradients are formed before the loss scale multiplies them, and at a 128k vocabulary the probabilities of
most tokens divided by the tokens in the batch fall below fp16's smallest number; the torch path scales
first, as the plain one does.

A model whose head is not a plain linear layer, or whose forward changes the head's output before the loss
(logit soft-capping, scaling), cannot be chunked this way: :func:`head_problem` says so before anything
runs, and the first forward checks that the model returned the head's output untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math

import torch
from torch import nn

IGNORE_INDEX = -100
# Config attributes of transformers models that change the logits after the head (Gemma 2 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling, MiniCPM/muP output scaling): such a head is not plain.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping",
                     "output_multiplier", "mup_width_multiplier")


# Makes the weight-gradient buffer of the chunked backward (it becomes the head's .grad): the planner's trace
# files it under parameter gradients, where autograd's own weight gradients go (torch.zeros_like outside a trace).
GRAD_BUFFER = torch.zeros_like


class HeadNotPlain(ValueError):
    """The model's output head cannot be chunked (the message says why and what to do)."""


def _top(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper, a DeepSpeed engine or both."""
    m = getattr(model, "module", model)  # DeepSpeed engine
    get = getattr(m, "get_base_model", None)
    return get() if callable(get) else m


def head_problem(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be chunked (None when it can): the head must be a plain ``nn.Linear``
    (or an engine's wrapper class of one) and the config must not transform logits after it."""
    top = _top(model)
    head = top.get_output_embeddings() if hasattr(top, "get_output_embeddings") else None
    name = type(top).__name__
    if head is None:
        return f"{name} has no output head (get_output_embeddings() is None)"
    if not isinstance(head, nn.Linear) or hasattr(head, "base_layer"):
        return f"the output head of {name} is a {type(head).__name__}, not a plain torch.nn.Linear"
    cfg = getattr(top, "config", None)
    for key in _LOGIT_TRANSFORMS:
        value = getattr(cfg, key, None) if cfg is not None else None
        if value not in (None, 0, 0.0, 1, 1.0, False):
            return f"{name} transforms the logits after the head ({key}={value})"
    return None


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: a chunk's logits about as large as the hidden states of the whole micro-batch (the
    rule Liger uses: ceil(vocab / hidden) chunks, rounded to a power of two)."""
    chunks = max(1, math.ceil(vocab / max(1, hidden)))
    per = max(1, math.ceil(rows / chunks))
    return 1 << (per - 1).bit_length()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T + bias, labels) / denom, one chunk of rows at a time.

    ``dtype``: what the head computes in (autocast's dtype on the AMP path; None: the tensors' own). The
    logits of a chunk are upcast to fp32 for the cross-entropy, as transformers does."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denom, rows: int, dtype):
        w = weight if dtype is None else weight.to(dtype)
        b = None if bias is None else (bias if dtype is None else bias.to(dtype))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows]
            logits = h.to(w.dtype) @ w.t()
            if b is not None:
                logits = logits + b
            total = total + nn.functional.cross_entropy(logits.float(), labels[s:s + rows],
                                                        ignore_index=IGNORE_INDEX, reduction="sum")
            del logits
        del w, b
        ctx.save_for_backward(hidden, weight, bias, labels, denom)
        ctx.rows, ctx.dtype = rows, dtype
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, denom = ctx.saved_tensors
        rows, dtype = ctx.rows, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        w = weight if dtype is None else weight.to(dtype)
        b = None if bias is None else (bias if dtype is None else bias.to(dtype))
        scale = (grad_out.float() / denom).reshape(())
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = GRAD_BUFFER(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows].to(w.dtype)
            logits = h @ w.t()
            if b is not None:
                logits = logits + b
            # d(sum of cross-entropies)/d(logits) = softmax - one-hot on the rows in the loss, 0 elsewhere; by
            # hand rather than through autograd, so the backward saves nothing of its own
            lab = labels[s:s + rows]
            grad = torch.softmax(logits.float(), dim=-1)
            keep = lab != IGNORE_INDEX
            grad.scatter_add_(1, lab.clamp(min=0).unsqueeze(1), -keep.to(grad.dtype).unsqueeze(1))
            grad.mul_((keep.to(grad.dtype) * scale).unsqueeze(1))
            g = grad.to(logits.dtype)
            del grad, logits
            if need_h:
                grad_h[s:s + rows] = g @ w
            if need_w:
                # In place: one weight-sized gradient, whatever the number of chunks; an fp32 master weight
                # (AMP) gets the chunk's product in the compute dtype added, as autograd's cast would.
                if grad_w.dtype == g.dtype:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w.add_(g.t() @ h)
            if need_b:
                grad_b.add_(g.sum(0).to(grad_b.dtype))
            del g, h
        return grad_h, grad_w, grad_b, None, None, None, None


def _liger(hidden, weight, bias, labels, denom):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=IGNORE_INDEX,
                                           reduction="sum")
    loss = out if torch.is_tensor(out) else out[0]
    return loss.float() / denom


class _Result:
    """The loss the armed head computed, to check it is what the model returned as its logits."""

    value: torch.Tensor | None = None


@contextlib.contextmanager
def _armed_head(model: nn.Module, labels: torch.Tensor, denom, dtype, use_liger: bool):
    top = _top(model)
    problem = head_problem(model)
    if problem:
        raise HeadNotPlain(f"loss.chunked: {problem}; rule: chunking applies the output head itself, so it must be "
                           "a plain linear layer whose output the model returns untouched; fix: loss.chunked=off "
                           "(or auto, which plans the plain loss for this model)")
    head = top.get_output_embeddings()
    result = _Result()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] != labels.shape[0]:
            raise RuntimeError(f"chunked loss: the head saw {flat.shape[0]} positions, the labels have "
                               f"{labels.shape[0]} (logits_to_keep must be 0)")
        if use_liger:
            out = _liger(flat, head.weight, head.bias, labels, denom)
        else:
            rows = chunk_rows(flat.shape[0], flat.shape[1], head.weight.shape[0])
            out = _ChunkedLinearCrossEntropy.apply(flat, head.weight, head.bias, labels, denom, rows, dtype)
        result.value = out
        return out

    head.forward = forward  # the instance attribute wins over the class's forward; hooks still run around it
    try:
        yield result
    finally:
        del head.forward


def causal_lm_loss(model: nn.Module, batch: dict, *, chunked: bool = False, autocast_dtype=None,
                   liger: bool = False) -> torch.Tensor:
    """The loss of ``model`` on ``batch`` (``input_ids``, ``labels``, maybe ``attention_mask``,
    ``position_ids``, ``num_items_in_batch``, ``shift_labels``), as transformers' ``ForCausalLMLoss``
    computes it. ``model``: what the engine calls (a DeepSpeed engine, an FSDP module, a peft model).
    ``chunked``: without the full logits (module docstring); ``autocast_dtype``: the dtype autocast computes
    the head in on this path (None: no autocast); ``liger``: Liger's kernel (CUDA, not fp16)."""
    if not chunked:
        return model(**batch).loss
    rest = dict(batch)
    labels = rest.pop("labels")
    shift = rest.pop("shift_labels", None)
    items = rest.pop("num_items_in_batch", None)
    if shift is None:
        shift = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    shift = shift.reshape(-1)
    denom = (items if torch.is_tensor(items) else torch.tensor(float(items))) if items is not None else \
        (shift != IGNORE_INDEX).sum()
    denom = denom.to(device=shift.device, dtype=torch.float32)
    with _armed_head(model, shift.contiguous(), denom, autocast_dtype, liger) as result:
        out = model(**rest)
    got = out.logits
    # ZeRO-3 hands each module's output back through an autograd function of its own (its pre-backward
    # gather), so there the loss arrives as another 0-d tensor of the same dtype; elsewhere it is the same one.
    if got is not result.value and not (torch.is_tensor(got) and got.dim() == 0 and result.value is not None
                                        and got.dtype == result.value.dtype and hasattr(model, "module")):
        raise HeadNotPlain(f"loss.chunked: {type(_top(model)).__name__} changed the output head's result before "
                           "returning it; rule: chunking applies the head itself, so the model must return the "
                           "head's output untouched; fix: loss.chunked=off")
    return got
