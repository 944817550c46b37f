"""The trace's dispatch tracker: every storage a traced step creates, its live bytes by category over time, and
the op record the step-time model prices.

:class:`Tracker` is a ``TorchDispatchMode`` that sees every storage the step creates (forward, backward,
gradient-checkpointing recompute) and drops it when its weakref dies, so the peak of live bytes -- what
``torch.cuda.max_memory_allocated`` sees on top of the model states -- is measured, not summed. Each storage
keeps the category it was born in, so the peak splits into activations, logits and loss, autocast weight copies
and parameter gradients. On its way it records every dispatched op (:data:`OpKey`) and remembers meta ops'
results (below). :mod:`launcher.plan.memory.trace` drives it through one step.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# ------------------------------------------------------------------------------------------------
# The op record

# An op of the traced step, for the step-time model (launcher/plan/steptime.py): (kind, dtype, FLOPs, bytes).
# kind: 'matmul' (ops torch's FLOP counter has a formula for), 'attention' (a fused SDPA kernel, emulated
# in launcher/plan/memory/emulation.py), 'view' (returns an alias of an input: no kernel, no bytes) or 'memory' (everything else:
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


ATTENTION_OPS: list = []  # the op list of the step being traced, for the emulated attention kernel


def record_attention(q, k, v, causal: bool, backward: bool) -> None:
    """A fused SDPA kernel's work: QK^T and PV in forward, 2.5x that in backward (five matmuls to two),
    as torch's ``sdpa_flop_count``/``sdpa_backward_flop_count`` count it, computed here for grouped-query
    attention too (k and v may have fewer heads); a causal kernel skips the masked half of the blocks."""
    if not ATTENTION_OPS:
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
    ATTENTION_OPS[-1].append(("attention", _dtype_name(q.dtype), int(flops), int(nbytes)))


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


# ------------------------------------------------------------------------------------------------
# The live-storage timeline


class Tracker(TorchDispatchMode):
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



def op_results_known() -> bool:
    """Whether this process has remembered any meta op results (see "Meta results, remembered")."""
    return bool(_META_RESULTS)
