"""Activation memory, measured: one forward + backward traced on the meta device.

What is measured, for one concrete model (meta or real, :func:`measure_step`):

* **saved bytes**: every tensor autograd saves for backward (``saved_tensors_hooks``), de-duplicated by
  storage (``untyped_storage()._cdata``: on meta every ``data_ptr()`` is 0), parameters left out, and
  attributed to the region that saved it: ``embeddings``, ``layer<i>``, ``head`` (final norm, lm_head,
  logits, loss) or ``other`` (rotary tables, masks).
* **the live-bytes timeline**: a ``TorchDispatchMode`` (:class:`launcher.plan.memory.tracker.Tracker`) sees every
  storage the step creates (forward, backward, gradient-checkpointing recompute) and drops it when its weakref
  dies, so the peak of live bytes -- what ``torch.cuda.max_memory_allocated`` sees on top of the model states --
  is measured, not summed. Each storage keeps the category it was born in, so the peak splits into activations,
  logits and loss, autocast weight copies and parameter gradients.

What the meta device does not do the way the GPU will (the fused attention kernel, autocast) is emulated on
purpose, in :mod:`launcher.plan.memory.emulation`.

A whole model is never traced here: :mod:`launcher.plan.memory.estimate` traces copies of its config cut to a few
decoder layers (:func:`trace_depth`) and extrapolates.

Gradient checkpointing is traced directly: the meta trace only failed in transformers' packed-sequence
detection (``Tensor.item()`` on the position ids, reached because checkpointing turns the KV cache off),
which :func:`launcher.plan.memory.emulation.no_packed_sequence_probe` stubs out for meta tensors (plain ``arange``
positions are never packed). Packed batches (``packed``: padding-free instruction samples) are traced with the
boolean ``[b, 1, s, s]`` mask that probe would have made on real tensors, and the fused kernels' per-layer bias
made from it.
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
from torch.utils._pytree import tree_leaves

from launcher.model import checkpointing
from launcher.model import loss as lossmod
from launcher.model.actoffload import stays
from launcher.model.loss import causal_lm_loss
from launcher.model.structure import base_model, decoder_layers
from launcher.model.targets import ALL_LINEAR
from launcher.plan.memory.emulation import FunctionMode, grouped_experts_on_meta, no_packed_sequence_probe, no_padding_probe
from launcher.plan.memory.shape import build_meta_model, config_key, peft_on_meta, with_depth
from launcher.plan.memory.tracker import ATTENTION_OPS, OFFLOADED, Tracker

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


def _first_tensor(out):
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _checkpoint_with_mode(checkpoint, fmode: FunctionMode, state: dict, enter, function, *args, **kwargs):
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

    def __init__(self, tracker: Tracker, ignore: set[int]):
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


def _install_hooks(rec: _Recorder, emb: nn.Module, layers: list, params: list, fmode: FunctionMode):
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
def _step_globals(tracker: Tracker):
    """The two module-level seams a trace fills for its duration: the emulated attention kernel's op list, and
    the chunked loss's weight-gradient buffer, filed under parameter gradients (launcher.model.loss)."""
    def grad_buffer(w):
        cat, tracker.category = tracker.category, "param_grad"
        try:
            return torch.zeros_like(w)
        finally:
            tracker.category = cat

    ATTENTION_OPS.append(tracker.op_list)
    lossmod.GRAD_BUFFER = grad_buffer
    try:
        yield
    finally:
        lossmod.GRAD_BUFFER = torch.zeros_like
        ATTENTION_OPS.pop()


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
    tracker = Tracker(ignore)
    rec = _Recorder(tracker, ignore)
    fmode = FunctionMode(None if real_autocast else autocast_dtype, autocast_policy, attention_kernel, target,
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
        with _step_globals(tracker), no_packed_sequence_probe(), no_padding_probe(), grouped_experts_on_meta(), \
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
