"""The meta device made to act as the GPU will, for the trace: a fused attention kernel, autocast, and what
transformers asks of tensor values.

Two things the meta device does not do the way the GPU will, emulated here on purpose:

* **Attention kernel.** On meta, ``scaled_dot_product_attention`` runs the math fallback and saves the
  whole ``b x heads x s x s`` probability matrix. A CUDA GPU runs a fused kernel (flash, memory-efficient
  or cuDNN) that keeps only the output and a float32 log-sum-exp. With ``fused_attention`` the call is
  replaced by an autograd function that allocates and saves exactly that (plus the fp32 ``dq``
  accumulator flash allocates in backward). We chose emulating the kernel over subtracting the matrix
  after the fact because the subtraction would have to know every tensor the math path creates
  (scores, probabilities, dropout mask) for every dtype; the emulation is right by construction, and a
  CPU test checks it against torch's own fused CPU kernel.
* **Autocast.** ``torch.autocast`` does nothing to meta tensors. :class:`FunctionMode` applies the
  autocast policy itself at the ``torch.*`` function level, above autograd as the real thing is: ops on
  the lower-precision list cast floating inputs to the autocast dtype, ops on the fp32 list cast
  16-bit inputs up, and casts of leaf tensors that require grad (the weights) are cached until the end
  of the forward, as autocast's weight cache is. The CUDA and CPU lists differ; the target device picks.
  A CPU test checks the emulation against a real ``torch.autocast("cpu")`` run.

And where transformers asks a tensor for its values (an ``.item()``), which a meta tensor cannot answer, the
answer a real run of the trace's batch would get is given for meta tensors only (:func:`no_packed_sequence_probe`,
:func:`no_padding_probe`, :func:`grouped_experts_on_meta`). :mod:`launcher.plan.memory.trace` puts all of
this around one step.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from launcher.plan.memory.tracker import record_attention

# ------------------------------------------------------------------------------------------------
# Autocast policy (names of torch functions), after torch's autocast_mode.cpp op lists.

_MATMULS = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "conv1d",
            "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
            "scaled_dot_product_attention", "grouped_mm", "_grouped_mm"}  # grouped_mm: mixture-of-experts
AUTOCAST_POLICY = {
    "cuda": {
        "lower": _MATMULS | {"addmv", "addr", "mv", "einsum", "chain_matmul", "multi_dot", "lstm_cell", "gru_cell",
                             "rnn_tanh_cell", "rnn_relu_cell"},
        "fp32": {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                 "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm",
                 "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
                 "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
                 "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
                 "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
                 "logsumexp", "cross_entropy"},
        "fp32_opt_dtype": {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum"},
        "promote": {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put", "scatter_add",
                    "tensordot", "cat", "stack"},
    },
    "cpu": {
        "lower": _MATMULS,
        "fp32": {"avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile",
                 "stft", "cdist", "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve",
                 "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
                 "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
                 "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss",
                 "multilabel_margin_loss", "ctc_loss", "kl_div", "multi_margin_loss", "smooth_l1_loss",
                 "huber_loss", "soft_margin_loss", "triplet_margin_loss", "poisson_nll_loss", "fft_fft", "fft_ifft",
                 "fft_rfft", "fft_irfft", "linalg_cond", "linalg_matrix_rank", "linalg_solve", "linalg_cholesky",
                 "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product",
                 "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf",
                 "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d",
                 "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr",
                 "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
                 "linalg_inv_ex"},
        "fp32_opt_dtype": set(),
        "promote": {"stack", "cat", "index_copy"},
    },
}
_16BIT = (torch.float16, torch.bfloat16)


def _is_castable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _FusedAttention(torch.autograd.Function):
    """What a fused SDPA kernel keeps for backward: q, k, v (already alive), the output and an fp32
    log-sum-exp per query row. Values are not computed (this is for meta tensors and measurement)."""

    @staticmethod
    def forward(ctx, q, k, v, lse_len: int, accum_dq: bool, causal: bool = False, bias=None):
        if q.dim() == 4:  # the kernels write (batch, seq, heads, dim) and return it transposed
            b, h, s, _ = q.shape
            out = q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)
        else:
            out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-2] + (lse_len,), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([bias] if bias is not None else []))
        ctx.accum_dq = accum_dq
        ctx.causal = causal
        record_attention(q, k, v, ctx.causal, backward=False)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors[:5]
        record_attention(q, k, v, ctx.causal, backward=True)
        delta = torch.empty_like(lse)  # rowsum(dO * O), fp32, both kernels
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device) if ctx.accum_dq else None
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta, dq_accum
        return dq, dk, dv, None, None, None, None  # one per forward input (bias included)


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, *, target: str, kernel: str):
    s = query.shape[-2]
    lse_len = -(-s // 32) * 32 if kernel == "efficient" else s
    bias = None
    if attn_mask is not None and not attn_mask.requires_grad:
        # A boolean mask (packed samples) is turned into an additive bias in the query's dtype on every call and
        # kept for backward, one per layer; CUDA's memory-efficient kernel pads its last dimension to 16.
        last = attn_mask.shape[-1] if kernel != "efficient" else -(-attn_mask.shape[-1] // 16) * 16
        bias = (attn_mask.new_empty(attn_mask.shape[:-1] + (last,), dtype=query.dtype)
                if attn_mask.dtype == torch.bool else attn_mask)
    out = _FusedAttention.apply(query, key, value, lse_len, kernel == "flash" and target == "cuda", bool(is_causal),
                                bias)
    if attn_mask is not None and attn_mask.requires_grad:  # a learned bias keeps its own gradient path
        out = out + 0 * attn_mask.sum()
    return out


class FunctionMode(TorchFunctionMode):
    """Autocast emulation and fused-attention substitution at the torch-function level."""

    def __init__(self, autocast_dtype: torch.dtype | None, policy: str, attention_kernel: str, target: str,
                 on_cast=None):
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.lists = AUTOCAST_POLICY[policy]
        self.attention_kernel = attention_kernel  # 'math' | 'flash' | 'efficient'
        self.target = target
        self.enabled = autocast_dtype is not None
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.on_cast = on_cast

    def clear_cache(self):
        self.cache.clear()

    def _cast(self, t, dtype):
        if not _is_castable(t) or t.dtype == dtype:
            return t
        if t.is_leaf and t.requires_grad:
            hit = self.cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            out = t.to(dtype)
            self.cache[id(t)] = (t, out)
            if self.on_cast is not None:
                self.on_cast(out)
            return out
        return t.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if self.enabled:
            lists = self.lists
            if name in lists["lower"]:
                args, kwargs = tree_map(lambda t: self._cast(t, self.autocast_dtype), (args, kwargs))
            elif name in lists["fp32"]:
                args, kwargs = tree_map(
                    lambda t: self._cast(t, torch.float32) if _is_castable(t) and t.dtype in _16BIT else t,
                    (args, kwargs))
            elif name in lists["fp32_opt_dtype"]:
                first = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
                has_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
                if first is not None and _is_castable(first) and not has_dtype:
                    kwargs["dtype"] = torch.float32
            elif name in lists["promote"]:
                floats = [t for t in tree_leaves((args, kwargs)) if _is_castable(t)]
                if floats:
                    widest = functools.reduce(torch.promote_types, [t.dtype for t in floats])
                    args, kwargs = tree_map(lambda t: self._cast(t, widest), (args, kwargs))
        if name == "scaled_dot_product_attention" and self.attention_kernel != "math":
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if not (self.target == "cpu" and dropout and dropout > 0):  # CPU's fused kernel has no dropout
                return _fused_attention(*args, **kwargs, target=self.target, kernel=self.attention_kernel)
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# What transformers asks of tensor values, answered for meta tensors


@contextlib.contextmanager
def no_packed_sequence_probe():
    """transformers probes position ids for packed sequences with ``.all()`` (an ``.item()``), which meta
    tensors cannot answer; plain ``arange`` positions are never packed, so answer that for the trace."""
    try:
        import transformers.masking_utils as mu
    except ImportError:  # older transformers: nothing to patch
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda position_ids, *a, **k: (
        None if position_ids.is_meta else original(position_ids, *a, **k))
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


@contextlib.contextmanager
def no_padding_probe():
    """transformers warns when a batch holds the pad token and no attention mask, asking ``pad_token_id in
    input_ids`` (an ``.item()``), which meta tensors cannot answer; the trace's batch has no mask by design."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.warn_if_padding_and_no_attention_mask

    def warn(self, input_ids, attention_mask):
        if input_ids is not None and input_ids.is_meta:
            return None
        return original(self, input_ids, attention_mask)

    PreTrainedModel.warn_if_padding_and_no_attention_mask = warn
    try:
        yield
    finally:
        PreTrainedModel.warn_if_padding_and_no_attention_mask = original


@contextlib.contextmanager
def grouped_experts_on_meta():
    """transformers' grouped experts (``experts_implementation="grouped_mm"``, its default for mixture-of-experts
    models) call torch's ``grouped_mm`` wherever it exists, and on meta tensors its meta kernel takes bf16 only (the
    CUDA kernel's rule), where the CPU kernel a CPU run calls takes fp32 and fp16 too. On meta, any other dtype goes
    through transformers' own fallback op instead, which keeps for backward what ``grouped_mm`` keeps (the routed
    tokens' input, the weight, the offsets): the trace counts the bytes the real run saves (tests/test_zoo.py)."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:  # a transformers without grouped experts: nothing to follow
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    # the fallback op's backward is an op of its own (transformers 5.2x): an older one loops over the offsets' values
    if original is None or not hasattr(torch.ops.transformers, "grouped_mm_fallback_backward"):
        yield
        return
    moe._can_use_grouped_mm = lambda input, weight, offs: (
        weight.dtype == torch.bfloat16 and original(input, weight, offs) if weight.is_meta else
        original(input, weight, offs))
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
