"""Activation memory, measured: one forward + backward traced on the meta device.

What is measured, for one concrete model (meta or real, :func:`measure_step`):

* **saved bytes**: every tensor autograd saves for backward (``saved_tensors_hooks``), de-duplicated by
  storage (``untyped_storage()._cdata``: on meta every ``data_ptr()`` is 0), parameters left out, and
  attributed to the region that saved it: ``embeddings``, ``layer<i>``, ``head`` (final norm, lm_head,
  logits, loss) or ``other`` (rotary tables, masks).
* **the live-bytes timeline**: a ``TorchDispatchMode`` sees every storage the step creates (forward,
  backward, gradient-checkpointing recompute) and drops it when its weakref dies, so the peak of live
  bytes -- what ``torch.cuda.max_memory_allocated`` sees on top of the model states -- is measured, not
  summed. Each storage keeps the category it was born in, so the peak splits into activations, logits and
  loss, autocast weight copies and parameter gradients.

Two things the meta device does not do the way the GPU will, emulated here on purpose:

* **Attention kernel.** On meta, ``scaled_dot_product_attention`` runs the math fallback and saves the
  whole ``b x heads x s x s`` probability matrix. A CUDA GPU runs a fused kernel (flash, memory-efficient
  or cuDNN) that keeps only the output and a float32 log-sum-exp. With ``fused_attention`` the call is
  replaced by an autograd function that allocates and saves exactly that (plus the fp32 ``dq``
  accumulator flash allocates in backward). We chose emulating the kernel over subtracting the matrix
  after the fact because the subtraction would have to know every tensor the math path creates
  (scores, probabilities, dropout mask) for every dtype; the emulation is right by construction, and a
  CPU test checks it against torch's own fused CPU kernel.
* **Autocast.** ``torch.autocast`` does nothing to meta tensors. :class:`_FunctionMode` applies the
  autocast policy itself at the ``torch.*`` function level, above autograd as the real thing is: ops on
  the lower-precision list cast floating inputs to the autocast dtype, ops on the fp32 list cast
  16-bit inputs up, and casts of leaf tensors that require grad (the weights) are cached until the end
  of the forward, as autocast's weight cache is. The CUDA and CPU lists differ; the target device picks.
  A CPU test checks the emulation against a real ``torch.autocast("cpu")`` run.

A whole model is never traced here: :mod:`launcher.plan.memory.estimate` traces copies of its config cut to a few
decoder layers (:func:`trace_depth`) and extrapolates.

Gradient checkpointing is traced directly: the meta trace only failed in transformers' packed-sequence
detection (``Tensor.item()`` on the position ids, reached because checkpointing turns the KV cache off),
which :func:`_no_packed_sequence_probe` stubs out for meta tensors (plain ``arange`` positions are never packed).
Packed batches (``packed``: padding-free instruction samples) are traced with the boolean ``[b, 1, s, s]`` mask
that probe would have made on real tensors, and the fused kernels' per-layer bias made from it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
import weakref
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from launcher.model import checkpointing
from launcher.model import loss as lossmod
from launcher.model.actoffload import stays
from launcher.model.loss import causal_lm_loss
from launcher.model.structure import base_model, decoder_layers
from launcher.model.targets import ALL_LINEAR
from launcher.plan.memory.shape import build_meta_model, config_key, peft_on_meta, with_depth

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
        _record_attention(q, k, v, ctx.causal, backward=False)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors[:5]
        _record_attention(q, k, v, ctx.causal, backward=True)
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


class _FunctionMode(TorchFunctionMode):
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
# The live-storage timeline


# An op of the traced step, for the step-time model (launcher/plan/steptime.py): (kind, dtype, FLOPs, bytes).
# kind: 'matmul' (ops torch's FLOP counter has a formula for), 'attention' (a fused SDPA kernel, emulated
# below), 'view' (returns an alias of an input: no kernel, no bytes) or 'memory' (everything else:
# elementwise, reductions, copies, casts, priced by the bytes its tensors hold: read inputs, written outputs).
OpKey = tuple
_aten = torch.ops.aten
# Allocations without a kernel of their own (the kernels that fill them are counted).
_NO_KERNEL = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided}


def _tensors(x, acc: list | None = None) -> list:
    """The tensors in ``x`` (tensors, lists, tuples and dicts of them, nested), in order: what
    ``tree_leaves`` filtered to tensors gives for an op's arguments and results, without pytree's generic
    node handling, which was a fifth of a trace's time (every op of the step passes through it twice)."""
    if acc is None:
        acc = []
    if isinstance(x, torch.Tensor):
        acc.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, acc)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, acc)
    return acc


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


_OP_KINDS: dict = {}  # op -> (torch's FLOP counter has a formula for it, it returns views of its inputs)


def _op_kind(func) -> tuple[bool, bool]:
    kind = _OP_KINDS.get(func)
    if kind is None:
        returns = func._schema.returns
        kind = _OP_KINDS[func] = (func.overloadpacket in flop_registry, bool(returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in returns))
    return kind


def _op_key(func, args, kwargs, out, outs) -> OpKey:
    formula, view = _op_kind(func)
    if view and not formula and args and isinstance(args[0], torch.Tensor):  # most ops of a step that always run
        return ("view", _dtype_name(args[0].dtype), 0, 0)
    ins = _tensors((args, kwargs))
    dtype = _dtype_name((ins or outs)[0].dtype) if (ins or outs) else ""
    if formula:
        try:
            flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 -- a formula that does not take these arguments: price it by bytes
            flops = 0
        if flops:
            return ("matmul", dtype, flops, _nbytes(ins) + _nbytes(outs))
    if "grouped_mm" in func._schema.name and args and isinstance(args[0], torch.Tensor):
        return ("matmul", dtype, _grouped_mm_flops(func._schema.name, args, out), _nbytes(ins) + _nbytes(outs))
    if view:
        return ("view", dtype, 0, 0)
    return ("memory", dtype, 0, _nbytes(ins) + _nbytes(outs))


def _grouped_mm_flops(name: str, args, out) -> int:
    """A mixture-of-experts layer's grouped matmul (torch's ``_grouped_mm``, transformers' fallback op and its
    backward), which torch's FLOP counter has no formula for: each routed token's row meets one expert's matrix,
    2 x rows x in x out, whatever the grouping (the backward makes the input's and the weight's gradients: twice)."""
    if "backward" in name:  # transformers' (input, weight, offs, grad_output)
        return 4 * args[0].numel() * args[3].shape[-1]
    first = out[0] if isinstance(out, (tuple, list)) else out
    return 2 * args[0].numel() * first.shape[-1]


_ATTENTION_OPS: list = []  # the op list of the step being traced, for the emulated attention kernel


def _record_attention(q, k, v, causal: bool, backward: bool) -> None:
    """A fused SDPA kernel's work: QK^T and PV in forward, 2.5x that in backward (five matmuls to two),
    as torch's ``sdpa_flop_count``/``sdpa_backward_flop_count`` count it, computed here for grouped-query
    attention too (k and v may have fewer heads); a causal kernel skips the masked half of the blocks."""
    if not _ATTENTION_OPS:
        return
    b, h, s_q, d = q.shape[0], q.shape[-3] if q.dim() == 4 else 1, q.shape[-2], q.shape[-1]
    s_k, d_v = k.shape[-2], v.shape[-1]
    flops = 2 * b * h * s_q * s_k * (d + d_v)
    if causal:
        flops = flops * (s_k + 1) // (2 * s_k)
    qkv = _nbytes((q, k, v))
    out = b * h * s_q * d_v * q.element_size()
    lse = b * h * s_q * 4
    if backward:
        flops, nbytes = int(2.5 * flops), qkv + 2 * out + lse + qkv  # read q, k, v, out, dout, lse; write dq, dk, dv
    else:
        nbytes = qkv + out + lse
    _ATTENTION_OPS[-1].append(("attention", _dtype_name(q.dtype), int(flops), int(nbytes)))


OFFLOADED = "offloaded"  # the tracker's category for CPU copies of saved activations


# ------------------------------------------------------------------------------------------------
# Meta results, remembered
#
# On the meta device an op computes only its outputs' shapes, strides and dtypes, and for most ops it does so
# in Python (torch._refs and torch._meta_registrations): over half of a trace's time. Those outputs depend
# on nothing but the op and its arguments' metadata, and a traced step repeats the same few dozen
# (op, shapes) pairs layer after layer, in recompute, and across the planner's traces of one model. So a
# functional op's outputs are remembered per (op, argument metadata) and made again as fresh meta storages
# of the same layout; FakeTensorMode keeps a cache of the same kind (torch/_subclasses/fake_tensor.py,
# ``_cache_key``) and bypasses it for the same ops: views, in-place and ``out=`` ops, anything not on meta.

class _Uncacheable(Exception):
    pass


_SIG_TAG = object()  # marks a tensor's metadata in a key (a tuple of ints could look like a shape)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _sig(x):
    kind = type(x)  # the exact types first: every functional op of a step passes here
    if kind is torch.Tensor or kind is nn.Parameter or isinstance(x, torch.Tensor):
        if not x.is_meta or kind is not torch.Tensor and not isinstance(x, nn.Parameter):
            raise _Uncacheable
        return (_SIG_TAG, tuple(x.shape), x.stride(), x.dtype)
    if kind is tuple or kind is list or isinstance(x, (list, tuple)):
        return tuple([_sig(y) for y in x])
    if isinstance(x, _PLAIN):
        return (kind, x)  # 1, 1.0 and True hash alike: the type keeps them apart
    raise _Uncacheable


def _functional(func) -> bool:
    """No output aliases an input and nothing is written in place (views, ``add_``, ``out=`` variants)."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def _meta_nbytes(shape, stride, dtype) -> int:
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * dtype.itemsize


def _out_spec(out, ins: set[int]):
    """How to make ``out`` again, or _Uncacheable when it is not a set of fresh, distinct, dense meta storages."""
    if isinstance(out, torch.Tensor):
        st = out.untyped_storage()
        shape, stride = tuple(out.shape), out.stride()
        if (not out.is_meta or type(out) is not torch.Tensor or out.storage_offset() or st._cdata in ins
                or st.nbytes() != _meta_nbytes(shape, stride, out.dtype)):
            raise _Uncacheable
        ins.add(st._cdata)  # two outputs sharing a storage are not fresh either
        return (_SIG_TAG, shape, stride, out.dtype)
    if isinstance(out, (list, tuple)):
        return type(out), tuple(_out_spec(y, ins) for y in out)
    if isinstance(out, (int, float, bool, type(None))):
        return out
    raise _Uncacheable


def _make(spec):
    if type(spec) is tuple and len(spec) == 4 and spec[0] is _SIG_TAG:
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] in (list, tuple):
        return spec[0](_make(s) for s in spec[1])
    return spec


_META_RESULTS: dict = {}  # (op, argument metadata) -> (output spec, OpKey); None: not cacheable
_FUNCTIONAL: dict = {}  # op -> _functional(op)


class _Tracker(TorchDispatchMode):
    """Live bytes of every storage created while active, by the category current at its creation."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore = ignore
        self.live: dict[int, list] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.by_cat: dict[str, int] = defaultdict(int)
        self.all = 0  # sum(by_cat.values()), kept as it changes
        self.category = "other"
        self.segment = "forward"
        # per segment (forward, head_bwd, body_bwd): [peak, parts at it, peak with grads, parts at it]
        self.segments: dict[str, list] = {}
        self.op_list: list = []  # OpKey of every op dispatched, in order (the time model's input)
        self.offloaded_peak = 0  # most bytes held at once in CPU copies of saved activations (activation offload)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says no: two more Python
        # calls per op of the step, for nothing, as a trace never runs under torch.compile
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        functional = _FUNCTIONAL.get(func)
        if functional is None:
            functional = _FUNCTIONAL[func] = _functional(func)
        key = None
        if functional:
            try:
                key = (func, _sig(args), _sig(tuple(kwargs.items())))
            except _Uncacheable:
                pass
        hit = _META_RESULTS.get(key) if key is not None else None
        out = _make(hit[0]) if hit is not None else func(*args, **kwargs)
        outs = [out] if type(out) is torch.Tensor else _tensors(out)  # one output, most often: no walk
        if hit is not None:
            op = hit[1]
        else:
            op = _op_key(func, args, kwargs, out, outs) if func.overloadpacket not in _NO_KERNEL else None
            if key is not None and key not in _META_RESULTS:
                try:
                    _META_RESULTS[key] = (_out_spec(out, {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}),
                                          op)
                except _Uncacheable:
                    _META_RESULTS[key] = None
                if len(_META_RESULTS) > 200_000:
                    _META_RESULTS.clear()
        for t in outs:
            self.track(t)
        if op is not None:
            self.op_list.append(op)
        return out

    def track(self, t: torch.Tensor, category: str | None = None):
        st = t.untyped_storage()
        key = st._cdata
        if key in self.ignore:
            return
        if key in self.live:
            if category is not None:
                self.reclassify_key(key, category)
            return
        n = st.nbytes()
        cat = category or self.category
        self.live[key] = [n, cat]
        self.by_cat[cat] += n
        self.all += n
        self.refs[key] = weakref.ref(st, functools.partial(self._freed, key))
        self._update()

    def reclassify(self, t: torch.Tensor, category: str):
        self.track(t, category)

    def reclassify_key(self, key: int, category: str):
        n, old = self.live[key]
        if old != category:
            self.by_cat[old] -= n
            self.by_cat[category] += n
            self.live[key][1] = category
            self._update()

    def _freed(self, key, _ref):
        entry = self.live.pop(key, None)
        self.refs.pop(key, None)
        if entry is not None:
            self.by_cat[entry[1]] -= entry[0]
            self.all -= entry[0]

    def _update(self):
        off = self.by_cat.get(OFFLOADED, 0)  # CPU copies of saved activations: not on the device
        self.offloaded_peak = max(self.offloaded_peak, off)
        total = self.all - off
        act = total - self.by_cat.get("param_grad", 0)
        seg = self.segments.setdefault(self.segment, [0, {}, 0, {}])
        if act > seg[0]:
            seg[0] = act
            seg[1] = {k: v for k, v in self.by_cat.items() if v and k not in ("param_grad", OFFLOADED)}
        if total > seg[2]:
            seg[2] = total
            seg[3] = {k: v for k, v in self.by_cat.items() if v and k != OFFLOADED}


# ------------------------------------------------------------------------------------------------
# One step on one model


@dataclass
class StepTrace:
    """What one forward + backward of one concrete model keeps alive (bytes)."""

    saved: dict[str, int] = field(default_factory=dict)  # saved for backward, by region (see module doc)
    autocast_cache: int = 0  # autocast copies of weights (created in the forward)
    # Peak live bytes per segment of the step (forward, head_bwd, body_bwd): {"peak", "parts",
    # "peak_with_grads", "parts_with_grads"}; "peak" leaves parameter gradients out, "peak_with_grads"
    # counts them as autograd makes them.
    segments: dict[str, dict] = field(default_factory=dict)
    param_grads: int = 0  # bytes of all parameter gradients after backward
    seconds: float = 0.0
    ops: dict = field(default_factory=dict)  # OpKey -> count: every op of the forward + backward (recompute too)
    op_list: list = field(default_factory=list, repr=False)  # the same ops in dispatch order
    offloaded: int = 0  # activation offload: most bytes held in CPU memory at once
    offload_copied: int = 0  # activation offload: bytes copied to the CPU in the forward (as many come back)

    @property
    def peak(self) -> int:
        return max((v["peak"] for v in self.segments.values()), default=0)

    @property
    def peak_parts(self) -> dict[str, int]:
        return max(self.segments.values(), key=lambda v: v["peak"])["parts"] if self.segments else {}

    @property
    def peak_with_grads(self) -> int:
        return max((v["peak_with_grads"] for v in self.segments.values()), default=0)

    @property
    def peak_with_grads_parts(self) -> dict[str, int]:
        return max(self.segments.values(), key=lambda v: v["peak_with_grads"])["parts_with_grads"] \
            if self.segments else {}

    @property
    def saved_layers(self) -> int:
        return sum(v for k, v in self.saved.items() if k.startswith("layer"))

    @property
    def saved_total(self) -> int:
        return sum(self.saved.values())

    def to_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def _no_packed_sequence_probe():
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
def _no_padding_probe():
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
def _grouped_experts_on_meta():
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


def _first_tensor(out):
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _checkpoint_with_mode(checkpoint, fmode: _FunctionMode, state: dict, enter, function, *args, **kwargs):
    """A layer's checkpoint function whose recompute (in backward) runs under our function mode, the way
    torch's checkpoint re-enters autocast for it; the recompute's weight casts die with it."""

    def run(*a, **k):
        if state["phase"] == "forward":
            return function(*a, **k)
        enabled, fmode.enabled = fmode.enabled, fmode.autocast_dtype is not None
        active = fmode in torch.overrides._get_current_function_mode_stack()
        try:
            if active:
                return function(*a, **k)
            with fmode:
                return function(*a, **k)
        finally:
            fmode.clear_cache()
            fmode.enabled = enabled

    if state["phase"] == "forward":
        enter()  # transformers < 5.23 checkpoints the layer's __call__, so its forward pre-hook runs inside
    offload = state.get("offload_hooks")
    with offload() if offload is not None else contextlib.nullcontext():  # transformers' offload=True does this
        return checkpoint(run, *args, **kwargs)


class _Recorder:
    """What one traced step saves for backward, copies off the device (activation offload) and casts for
    autocast, by storage, and which part of the model the forward is in (``state``, shared with
    :func:`_checkpoint_with_mode`).

    Storages are told apart by address (``_cdata``), which a later storage can reuse once one dies (an
    offloaded activation, a recompute's weight cast): each key is dropped when its storage dies, so a reused
    address counts again and the totals do not depend on the allocator."""

    def __init__(self, tracker: _Tracker, ignore: set[int]):
        self.tracker, self.ignore = tracker, ignore
        self.refs: dict[tuple, weakref.ref] = {}
        self.cast_keys: set[int] = set()
        self.cast_bytes = 0
        self.saved: dict[str, int] = defaultdict(int)
        self.saved_keys: set[int] = set()
        self.copied = 0
        self.copies: dict[int, tuple] = {}  # a tensor saved by several ops is copied once (launcher.model.actoffload)
        self.state = {"phase": "forward", "region": "other"}

    def _remember(self, keys: set[int], st) -> None:
        key = st._cdata

        def dead(_ref):
            self.refs.pop((id(keys), key), None)
            keys.discard(key)

        self.refs[id(keys), key] = weakref.ref(st, dead)  # one ref per set: a ref replaced would never call back
        keys.add(key)

    def on_cast(self, t) -> None:
        st = t.untyped_storage()
        if st._cdata not in self.cast_keys:
            self.cast_bytes += st.nbytes()
            self._remember(self.cast_keys, st)
        self.tracker.reclassify(t, "autocast_cache")

    def set_region(self, region: str) -> None:
        self.state["region"] = region
        self.tracker.category = {"embeddings": "embeddings", "other": "other", "head": "head"}.get(
            region, "layer" if region.startswith("layer") else region)

    def pack(self, t):
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.ignore and key not in self.cast_keys and key not in self.saved_keys:
            self._remember(self.saved_keys, st)
            self.saved[self.state["region"] if self.state["phase"] == "forward" else "backward"] += st.nbytes()
        return t

    def pack_offload(self, t):
        self.pack(t)
        if stays(t):  # parameters, autocast's weight copies and views of either stay (launcher.model.actoffload)
            return t
        known = self.copies.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        cat, self.tracker.category = self.tracker.category, OFFLOADED
        try:
            cpu = torch.empty_like(t)
            if not t.is_meta:  # a real run (the tests compare): the values go there and back too
                cpu.copy_(t)
        finally:
            self.tracker.category = cat
        self.copied += t.numel() * t.element_size()
        self.copies[id(t)] = (weakref.ref(t), cpu)
        return cpu

    def unpack_offload(self, cpu):
        if self.tracker.live.get(cpu.untyped_storage()._cdata, [0, None])[1] != OFFLOADED:
            return cpu  # stayed
        back = torch.empty_like(cpu)  # the copy back: a new device tensor, of the category current now
        return back if cpu.is_meta else back.copy_(cpu)

    def offload_hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack_offload, self.unpack_offload)

    def saving(self, offload: bool):
        """The saved-tensor hooks around the step: each saved tensor counted, and copied off with ``offload``."""
        return self.offload_hooks() if offload else torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _install_hooks(rec: _Recorder, emb: nn.Module, layers: list, params: list, fmode: _FunctionMode):
    """Hooks that tell the recorder where the forward is and the tracker which backward segment runs, and that put
    each checkpointed layer's recompute under ``fmode``: (hook handles, layers whose checkpoint function was
    replaced). Backward segments are marked by the gradient of a forward output arriving: the loss and head first
    (head_bwd), then the last layer (top_bwd), the middle ones, the first layer (bottom_bwd) and the embeddings
    (embed_bwd). Activations fall and gradients grow through the layers, so within the layers the peak sits in
    the top or the bottom layer's segment."""
    tracker, state = rec.tracker, rec.state

    def segment_hook(name):
        def hook(_grad):
            tracker.segment = name
            if name == "top_bwd":
                tracker.category = "body_bwd"
        return hook

    def emb_post(m, a, o):
        if state["phase"] == "forward":
            rec.set_region("other")
            t = _first_tensor(o)
            if t is not None:
                t.register_hook(segment_hook("embed_bwd"))

    hooks = [emb.register_forward_pre_hook(lambda m, a: rec.set_region("embeddings") if state["phase"] == "forward"
                                           else None),
             emb.register_forward_hook(emb_post)]
    restore: list[nn.Module] = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        seg = "top_bwd" if last else ("bottom_bwd" if i == 0 else "middle_bwd")

        def pre(m, a, i=i):
            if state["phase"] == "forward":
                rec.set_region(f"layer{i}")

        def post(m, a, o, last=last, seg=seg):
            if state["phase"] == "forward":
                rec.set_region("head" if last else "other")
                t = _first_tensor(o)
                if t is not None:
                    t.register_hook(segment_hook(seg))

        hooks.append(layer.register_forward_pre_hook(pre))
        hooks.append(layer.register_forward_hook(post))
        ckpt = getattr(layer, "_gradient_checkpointing_func", None)
        if ckpt is not None and getattr(layer, "gradient_checkpointing", False):
            layer._gradient_checkpointing_func = functools.partial(_checkpoint_with_mode, ckpt, fmode, state,
                                                                   functools.partial(rec.set_region, f"layer{i}"))
            restore.append(layer)

    def on_grad(p):
        if p.grad is not None:
            tracker.reclassify(p.grad, "param_grad")

    hooks += [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
    return hooks, restore


@contextlib.contextmanager
def _step_globals(tracker: _Tracker):
    """The two module-level seams a trace fills for its duration: the emulated attention kernel's op list, and
    the chunked loss's weight-gradient buffer, filed under parameter gradients (launcher.model.loss)."""
    def grad_buffer(w):
        cat, tracker.category = tracker.category, "param_grad"
        try:
            return torch.zeros_like(w)
        finally:
            tracker.category = cat

    _ATTENTION_OPS.append(tracker.op_list)
    lossmod.GRAD_BUFFER = grad_buffer
    try:
        yield
    finally:
        lossmod.GRAD_BUFFER = torch.zeros_like
        _ATTENTION_OPS.pop()


def _packed_inputs(input_ids: torch.Tensor) -> dict:
    """Two packed samples per row: position ids restarting mid-row (so rotary tables per row too); on meta, the
    block-diagonal mask the packed-sequence probe would make from them (it cannot run on meta)."""
    b, s = input_ids.shape
    dev = input_ids.device
    extra = {"position_ids": torch.cat([torch.arange(s // 2, device=dev),
                                        torch.arange(s - s // 2, device=dev)]).expand(b, s)}
    if input_ids.is_meta:
        extra["attention_mask"] = torch.ones(b, 1, s, s, dtype=torch.bool, device="meta")
    return extra


def measure_step(model: nn.Module, input_ids: torch.Tensor, *, autocast_dtype: torch.dtype | None = None,
                 autocast_policy: str = "cuda", attention_kernel: str = "math", target: str = "cuda",
                 real_autocast: bool = False, chunked_loss: bool = False,
                 offload_activations: bool = False, packed: bool = False, parts: tuple | None = None) -> StepTrace:
    """Trace ``loss = model(input_ids, labels=input_ids).loss; loss.backward()`` and measure it.

    Works on meta and on real tensors (the tests compare the two). Only the loss outlives the forward,
    as in the training loop. ``attention_kernel``: ``math`` (what runs), ``flash`` or ``efficient``
    (emulate that fused kernel for ``scaled_dot_product_attention``). ``real_autocast``: run the forward
    under ``torch.autocast(autocast_policy)`` instead of the emulation (real tensors only; for the tests).
    ``chunked_loss``: the loss as :func:`launcher.model.loss.causal_lm_loss` chunks it (the same code the engines
    run). ``offload_activations``: every saved tensor copied to CPU memory as torch's ``save_on_cpu`` does
    (with checkpointing: around each checkpointed layer, as transformers' ``offload=True`` does), emulated
    on meta: the copy is a tensor of the tracker's ``offloaded`` category (off the device), and backward
    gets a new device tensor back for each unpack.
    ``packed``: a batch of packed samples (padding-free), whose attention mask is block-diagonal: real tensors get
    position ids restarting mid-row (transformers builds the mask from them), meta tensors the ``[b, 1, s, s]``
    boolean mask that this makes, created inside the measured region as the real one is.
    ``parts``: :func:`model_parts` of ``model``, when the caller keeps them (walking a model's modules is
    not free, and a planner traces the same cut model many times).
    """
    t0 = time.perf_counter()
    layers, params, buffers = parts or model_parts(model)
    ignore = {p.untyped_storage()._cdata for p in params} | {b.untyped_storage()._cdata for b in buffers}
    tracker = _Tracker(ignore)
    rec = _Recorder(tracker, ignore)
    fmode = _FunctionMode(None if real_autocast else autocast_dtype, autocast_policy, attention_kernel, target,
                          rec.on_cast)
    checkpointed = any(getattr(layer, "gradient_checkpointing", False) for layer in layers)
    if offload_activations and checkpointed:  # around each checkpointed layer, as transformers' offload=True does
        rec.state["offload_hooks"] = rec.offload_hooks
    hooks, restore = _install_hooks(rec, base_model(model).get_input_embeddings(), layers, params, fmode)
    # No cyclic collection inside the step: torch's non-reentrant checkpoint follows its recompute through weak
    # references, so a collection landing mid-trace could change the ops recorded, making a trace depend on the
    # garbage earlier work left. (A trace compared with the op cache on and off differed once, late in a long test
    # run, and never alone; this takes the collector's timing out of a trace.)
    collecting = gc.isenabled()
    gc.disable()
    try:
        # without checkpointing, save_on_cpu goes around the whole forward (launcher.engines.base)
        with _step_globals(tracker), _no_packed_sequence_probe(), _no_padding_probe(), _grouped_experts_on_meta(), \
                peft_on_meta(), tracker, rec.saving(offload_activations and not checkpointed):
            autocast = (torch.autocast(autocast_policy, dtype=autocast_dtype) if real_autocast and autocast_dtype
                        else contextlib.nullcontext())
            extra = _packed_inputs(input_ids) if packed else {}  # made inside the measured region, as a run's are
            with fmode, autocast:
                loss = causal_lm_loss(model, {"input_ids": input_ids, "labels": input_ids, "use_cache": False, **extra},
                                      chunked=chunked_loss, autocast_dtype=autocast_dtype)
            extra.clear()
            # The mode is left before backward (a mode is switched off while it handles a call, so a
            # backward it intercepted would recompute checkpointed layers without it); the layer hooks
            # re-enter it for each recomputed layer.
            rec.state["phase"] = "backward"
            fmode.clear_cache()
            fmode.enabled = False
            tracker.category = tracker.segment = "head_bwd"
            loss.backward()
            del loss
    finally:
        if collecting:
            gc.enable()
        for h in hooks:
            h.remove()
        for layer in restore:
            layer._gradient_checkpointing_func = layer._gradient_checkpointing_func.args[0]
    grads = {p.grad.untyped_storage()._cdata: p.grad.untyped_storage().nbytes()
             for p in params if p.grad is not None}
    segments = {k: {"peak": v[0], "parts": v[1], "peak_with_grads": v[2], "parts_with_grads": v[3]}
                for k, v in tracker.segments.items()}
    return StepTrace(saved=dict(rec.saved), autocast_cache=rec.cast_bytes, segments=segments,
                     param_grads=sum(grads.values()), seconds=time.perf_counter() - t0,
                     ops=dict(Counter(tracker.op_list)), op_list=tracker.op_list, offloaded=tracker.offloaded_peak,
                     offload_copied=rec.copied)


# ------------------------------------------------------------------------------------------------
# One step of a model cut to a few layers


@dataclass(frozen=True)
class TraceSettings:
    """Everything a trace depends on besides the model config."""

    batch_size: int
    seq_len: int
    param_dtype: torch.dtype = torch.float32  # dtype of the (base) weights
    adapter_dtype: torch.dtype | None = None  # LoRA adapter weights (None = same as param_dtype)
    autocast_dtype: torch.dtype | None = None  # emulate torch.autocast with this dtype
    target: str = "cuda"  # 'cuda' | 'cpu': autocast policy and attention kernels of that device
    attn_implementation: str = "sdpa"
    attention_kernel: str = "math"  # 'math' | 'flash' | 'efficient' (for sdpa)
    gradient_checkpointing: bool = False
    checkpoint_every: int = 1  # with checkpointing: every k-th decoder layer recomputes (1 = all)
    lora_r: int = 0
    lora_targets: tuple = (ALL_LINEAR,)
    lora_dropout: float = 0.0
    chunked_loss: bool = False  # head + cross-entropy in chunks (launcher.model.loss)
    offload_activations: bool = False  # saved activations to CPU memory (save_on_cpu / transformers' offload)
    packed: bool = False  # packed samples: a block-diagonal attention mask (launcher.data.pack)


def enable_checkpointing(model: nn.Module, every: int = 1):
    """Gradient checkpointing as the run does it (non-reentrant; every ``every``-th layer)."""
    checkpointing.enable(model, every)


def model_parts(model: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter], list[torch.Tensor]]:
    """What :func:`measure_step` needs of ``model``'s structure: its decoder layers, parameters and buffers."""
    return list(decoder_layers(model)), list(model.parameters()), list(model.buffers())


_META_MODELS: dict = {}


def _meta_model(config, depth: int, s: TraceSettings, trust_remote_code: bool) -> tuple[nn.Module, tuple]:
    """``config`` cut to ``depth`` layers on meta, with LoRA as ``s`` says, and its :func:`model_parts`; built once
    per shape and reused (building and wrapping in peft costs more than a trace). Gradients and checkpointing
    flags are reset."""
    key = (config_key(config), depth, s.attn_implementation, s.param_dtype, s.lora_r, s.lora_targets, s.lora_dropout,
           s.adapter_dtype, trust_remote_code)
    hit = _META_MODELS.get(key)
    if hit is None:
        if len(_META_MODELS) > 16:
            _META_MODELS.clear()
        model = build_meta_model(
            with_depth(config, depth), attn_implementation=s.attn_implementation, dtype=s.param_dtype,
            lora_r=s.lora_r, lora_targets=s.lora_targets, lora_dropout=s.lora_dropout,
            adapter_dtype=s.adapter_dtype or s.param_dtype, trust_remote_code=trust_remote_code)
        hit = _META_MODELS[key] = (model, model_parts(model))
    model, parts = hit
    for p in parts[1]:
        p.grad = None
    if s.gradient_checkpointing:
        enable_checkpointing(model, s.checkpoint_every)
    else:
        checkpointing.disable(model)
    model.train()
    return model, parts


def trace_depth(config, depth: int, s: TraceSettings, trust_remote_code: bool = False) -> StepTrace:
    """Build ``config`` cut to ``depth`` layers on meta and measure one step with settings ``s``."""
    model, parts = _meta_model(config, depth, s, trust_remote_code)
    ids = torch.zeros(s.batch_size, s.seq_len, dtype=torch.long, device="meta")
    return measure_step(model, ids, autocast_dtype=s.autocast_dtype, autocast_policy=s.target,
                        attention_kernel=s.attention_kernel if s.attn_implementation == "sdpa" else "math",
                        target=s.target, chunked_loss=s.chunked_loss, offload_activations=s.offload_activations,
                        packed=s.packed, parts=parts)


def op_results_known() -> bool:
    """Whether this process has remembered any meta op results (see "Meta results, remembered")."""
    return bool(_META_RESULTS)
