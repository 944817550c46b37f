"""The activation estimate of a full-depth model, from traces of copies cut to a few decoder layers.

Tracing a whole 7B or 70B model is not needed: :func:`estimate_activations` traces copies of the config cut to
2 and 3 decoder layers (:func:`launcher.plan.memory.trace.trace_depth`) and extrapolates every measured number
linearly in depth (layers are identical). The peak is taken per segment of the step (forward, loss backward,
top layer, bottom layer, embeddings), each linear in depth, and the largest extrapolated one wins.

Around that: traces are cached in this process and, where the command line installs one, in a store on disk
(:func:`set_store`, :mod:`launcher.plan.tracestore`); the planner's search prices micro-batches from two traces
each (:func:`trace_at` with ``exact=False``); and ``vramfit plan`` makes the traces one estimate needs in
forked worker processes (:func:`parallel`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import signal
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from launcher.model import loss as lossmod
from launcher.model.structure import num_layers
from launcher.plan.memory import tracker
from launcher.plan.memory.shape import config_key
from launcher.plan.memory.trace import StepTrace, TraceSettings, trace_depth


@dataclass
class ActivationEstimate:
    """Activation-side bytes of one training step of the full-depth model (see :class:`StepTrace`)."""

    settings: TraceSettings
    num_layers: int
    saved: dict[str, int]  # saved for backward: embeddings, layers, head, other
    saved_per_layer: int
    autocast_cache: int
    peak: int  # parameter gradients left out
    peak_parts: dict[str, int]
    peak_segment: str
    peak_with_grads: int  # parameter gradients counted as autograd makes them
    peak_with_grads_parts: dict[str, int]
    peak_with_grads_segment: str
    param_grads: int
    trace_seconds: float
    ops: dict = field(default_factory=dict)  # OpKey -> count at full depth (counts extrapolated, may be fractional)
    offloaded: int = 0  # activation offload: CPU bytes held at once (pinned copies of saved tensors)
    offload_copied: int = 0  # activation offload: bytes copied to the CPU per micro-batch (and back again)
    composed: bool = False  # from the traces with no and with every layer checkpointed (compose_every)
    counted: str | None = None  # no trace could be made (why): counted from the config (counted_activations)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("ops")
        s = d["settings"]
        for k in ("param_dtype", "adapter_dtype", "autocast_dtype"):
            s[k] = None if s[k] is None else str(s[k]).replace("torch.", "")
        return d


def _group_saved(saved: dict[str, int]) -> dict[str, int]:
    out = {"embeddings": 0, "layers": 0, "head": 0, "other": 0}
    for k, v in saved.items():
        out["layers" if k.startswith("layer") else (k if k in out else "other")] += v
    return out


_TRACES: dict = {}
# A store that keeps traces between processes (``get(key)``, ``put(key, trace)``; :mod:`launcher.plan.tracestore`),
# set by the command line; None: this module does no I/O, as the planner's tests and library callers expect.
_STORE = None


def set_store(store) -> None:
    """Keep :func:`trace_at`'s traces in ``store`` too (None: in this process only)."""
    global _STORE
    _STORE = store


def trace_at(config, depth: int, s: TraceSettings, trust_remote_code: bool = False, exact: bool = True) -> StepTrace:
    """:func:`trace_depth`, cached; with ``exact=False``, micro-batches above 3 from the traces of 2 and 3 (of
    two others with the chunked loss: :func:`_batch_bases`).

    The ops of a decoder step are the same for any micro-batch above 1 and the FLOPs and bytes of each are
    linear in it (nothing mixes samples), so the step's op record at micro-batch ``b`` is the one at 2 plus
    ``b - 2`` times the difference to 3, op by op, exactly. So are the bytes saved for backward. The peak of
    live bytes is a maximum over the moments of a segment, each linear in ``b``: where the moment of the peak
    moves with ``b`` (weight casts under autocast with checkpointing), the extrapolation is low by a percent
    or two. The planner's search prices and sizes candidates with ``exact=False`` (two traces for every
    micro-batch), then traces the setting it keeps exactly (tests compare both with direct traces)."""
    key = _trace_key(config, depth, s, trust_remote_code, exact)
    if (kept := _kept(key)) is not None:
        return kept
    bases = _extrapolated_from(config, s, exact)
    if bases is not None:
        one, two = (trace_at(config, depth, dataclasses.replace(s, batch_size=x), trust_remote_code, exact)
                    for x in bases)
        out, traced = _batch_extrapolate(one, two, s.batch_size, bases), False
        if out is None:  # the op sequences differ: trace it
            out, traced = trace_depth(config, depth, s, trust_remote_code), True
    else:
        out, traced = trace_depth(config, depth, s, trust_remote_code), True
    _keep(key, out, traced)
    return out


def _extrapolated_from(config, s: TraceSettings, exact: bool) -> tuple[int, int] | None:
    """The micro-batches :func:`trace_at` builds ``s`` from, or None when it traces ``s`` itself."""
    return _batch_bases(config, s) if s.batch_size > 3 and not exact else None


def _trace_key(config, depth: int, s: TraceSettings, trust_remote_code: bool, exact: bool) -> tuple:
    return (config_key(config), depth, s, trust_remote_code, exact or s.batch_size <= 3)


def _kept(key) -> StepTrace | None:
    if key in _TRACES:
        return _TRACES[key]
    if _STORE is not None and (kept := _STORE.get(key)) is not None:
        _TRACES[key] = kept
        return kept
    return None


def _keep(key, out: StepTrace, traced: bool) -> None:
    if len(_TRACES) > 256:
        _TRACES.clear()
    _TRACES[key] = out
    if traced and _STORE is not None:  # an extrapolation is cheap: only traces are kept
        _STORE.put(key, out)


# ------------------------------------------------------------------------------------------------
# Traces in parallel

_WORKERS = 0  # parallel(): worker processes to trace in (0: every trace in this process)
_POOL = None  # the pool of them, started on first use


@contextlib.contextmanager
def parallel(workers: int):
    """Within: the traces an estimate needs at once (two depths, each at up to two micro-batches) are made in
    up to ``workers`` processes, forked on the first estimate that needs two or more, so each starts with this
    process's imports and caches and re-imports nothing. Linux only (fork; where processes are spawned each would
    import torch and transformers again, seconds that a plan's traces do not repay); elsewhere, with ``workers``
    below 2, or inside another ``parallel``, every trace is made here. A worker that fails leaves its trace to be
    made here (with the error, if it fails again, raised where it belongs)."""
    global _WORKERS, _POOL
    if workers < 2 or sys.platform != "linux" or _WORKERS:
        yield
        return
    _WORKERS = workers
    try:
        yield
    finally:
        pool, _POOL, _WORKERS = _POOL, None, 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _trace_job(config, depth: int, s: TraceSettings, trust_remote_code: bool) -> StepTrace:
    return trace_depth(config, depth, s, trust_remote_code)


def _leaves(config, depth: int, s: TraceSettings, exact: bool) -> list[tuple[int, TraceSettings]]:
    """The traces :func:`trace_at` makes for ``(depth, s)``: itself, or those it is extrapolated from."""
    bases = _extrapolated_from(config, s, exact)
    if bases is None:
        return [(depth, s)]
    return [leaf for x in bases for leaf in _leaves(config, depth, dataclasses.replace(s, batch_size=x), exact)]


def _prefetch(config, wanted: list[tuple[int, TraceSettings]], trust_remote_code: bool, exact: bool) -> None:
    """Make the missing traces behind ``wanted`` ((depth, settings) as :func:`trace_at` is asked) in the pool."""
    global _POOL, _WORKERS
    if not _WORKERS:
        return
    missing = {}
    for depth, s in wanted:
        for d, leaf in _leaves(config, depth, s, exact):
            key = _trace_key(config, d, leaf, trust_remote_code, exact)
            if key not in missing and _kept(key) is None:
                missing[key] = (d, leaf)
    if len(missing) < 2:
        return
    if _POOL is None and not tracker.op_results_known():
        return  # the first traces are made here, so the workers start with the op results they share
    if _POOL is None:
        _POOL = concurrent.futures.ProcessPoolExecutor(
            _WORKERS, mp_context=multiprocessing.get_context("fork"),
            initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))  # Ctrl-C: this process stops them
    jobs = {key: _POOL.submit(_trace_job, config, d, leaf, trust_remote_code) for key, (d, leaf) in missing.items()}
    for key, job in jobs.items():
        try:
            _keep(key, job.result(), True)
        except concurrent.futures.BrokenExecutor:
            _WORKERS = 0  # a worker died (out of memory, a signal): the rest of this run traces here
            return
        except Exception:  # noqa: BLE001 -- made again here by trace_at, which raises it where it belongs
            continue


def _batch_bases(config, s: TraceSettings) -> tuple[int, int] | None:
    """The two micro-batches the trace at ``s.batch_size`` comes from: 2 and 3, whose op sequence is that of
    every micro-batch above 1. The chunked loss cuts the batch's rows into chunks (:func:`launcher.model.loss.chunk_rows`),
    so its ops change with the micro-batch; it takes the two smallest micro-batches whose chunks are those of
    ``s.batch_size`` scaled down (rows per chunk in proportion to the micro-batch: the same ops, each linear),
    e.g. 2 and 4 for 8. None: there are no two (it is traced)."""
    b = s.batch_size
    if not s.chunked_loss:
        return (2, 3)
    hidden, vocab = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
    if not hidden or not vocab:
        return None
    per = lossmod.chunk_rows(b * s.seq_len, hidden, vocab)
    same = [x for x in range(2, b) if lossmod.chunk_rows(x * s.seq_len, hidden, vocab) * b == per * x]
    return (same[0], same[1]) if len(same) >= 2 else None


def _batch_extrapolate(one: StepTrace, two: StepTrace, b: int, bases: tuple[int, int] = (2, 3)) -> StepTrace | None:
    """The trace at micro-batch ``b`` from those at ``bases`` (``one`` and ``two``), every number linear in the
    micro-batch. None when their op sequences differ (a micro-batch of 1 takes shortcuts in places: broadcasts
    that need no copy)."""
    if len(one.op_list) != len(two.op_list) or set(one.segments) != set(two.segments):
        return None
    base, step = bases[0], bases[1] - bases[0]

    def lin(x1: int, x2: int) -> int:
        return x1 + (b - base) * (x2 - x1) // step

    def lin_dict(a: dict, c: dict) -> dict:
        return {k: v for k in sorted(set(a) | set(c)) if (v := lin(a.get(k, 0), c.get(k, 0)))}

    ops = []
    for o1, o2 in zip(one.op_list, two.op_list):
        if o1[:2] != o2[:2]:
            return None
        ops.append((o1[0], o1[1], lin(o1[2], o2[2]), lin(o1[3], o2[3])))
    segments = {name: {"peak": lin(v["peak"], two.segments[name]["peak"]),
                       "parts": lin_dict(v["parts"], two.segments[name]["parts"]),
                       "peak_with_grads": lin(v["peak_with_grads"], two.segments[name]["peak_with_grads"]),
                       "parts_with_grads": lin_dict(v["parts_with_grads"], two.segments[name]["parts_with_grads"])}
                for name, v in one.segments.items()}
    return StepTrace(saved=lin_dict(one.saved, two.saved), autocast_cache=lin(one.autocast_cache, two.autocast_cache),
                     segments=segments, param_grads=lin(one.param_grads, two.param_grads),
                     seconds=one.seconds + two.seconds, ops=dict(Counter(ops)), op_list=ops,
                     offloaded=lin(one.offloaded, two.offloaded), offload_copied=lin(one.offload_copied, two.offload_copied))


def compose_every(config, settings: TraceSettings, trust_remote_code: bool = False) -> ActivationEstimate | None:
    """Every k-th layer checkpointed (``settings.checkpoint_every`` > 1, ``exact=False``), composed from the traces
    with no layer and with every layer checkpointed at the same micro-batch (depths 2 and 3 of each, which the
    planner's search has made before it asks for this) instead of traces of its own (depths ``lo`` and
    ``lo + k``: 4 and 8 for every 4th layer of 32). None where it does not apply (activation offload, a model of
    fewer than 3 layers).

    Layer ``i`` is checkpointed when ``i % k == 0``: the bottom layer always, the top one when ``(L - 1) % k == 0``;
    ``c = ceil(L / k)`` of the ``L`` layers. The traces give what one more middle layer adds with and without
    checkpointing (depth 3 minus depth 2), so each number of the step, segment by segment, is that of every layer
    checkpointed plus ``L - c`` times the difference between a plain and a checkpointed layer: exact where the
    layers are alike (the bottom layer is checkpointed in both, with what transformers' input-grad hook adds to
    it). Where the top layer is not checkpointed its backward segment recomputes nothing, and is taken from the
    plain step less ``c`` times that difference instead. The planner traces exactly a setting whose memory lies
    near its budget, and the setting it keeps; each model's compositions are checked once against a trace
    (:func:`_composes`; tests compare more)."""
    k = settings.checkpoint_every
    full = num_layers(config)
    if not settings.gradient_checkpointing or k <= 1 or settings.offload_activations or full < 3:
        return None
    if not _composes(config, settings, trust_remote_code):
        return None
    return _compose(config, settings, trust_remote_code)


# Whether compositions hold for a model, per (config, dtypes, kernel, LoRA): checked once against a trace
_COMPOSES: dict = {}
COMPOSE_TOLERANCE = 0.005  # of the peak; the op record must match exactly


def _composes(config, s: TraceSettings, trust_remote_code: bool) -> bool:
    """Whether :func:`compose_every` may answer for this model: the first time, every 2nd layer at micro-batch 2
    (plain loss) is both composed and traced, and they must agree (ops exactly, peaks within
    ``COMPOSE_TOLERANCE``). Llama-like decoders do (0.2% at most on llama-7b); GPT-2 with its top layer not
    checkpointed does not (8% high), and is then traced like any other setting."""
    probe = dataclasses.replace(s, batch_size=2, gradient_checkpointing=True, checkpoint_every=2,
                                chunked_loss=False, offload_activations=False)
    key = (config_key(config), dataclasses.replace(probe, seq_len=0), trust_remote_code)
    if key not in _COMPOSES:
        made, traced = _compose(config, probe, trust_remote_code), estimate_activations(
            config, probe, trust_remote_code, exact=False)
        _COMPOSES[key] = made is not None and made.ops == traced.ops and all(
            abs(getattr(made, f) - getattr(traced, f)) <= COMPOSE_TOLERANCE * getattr(traced, f)
            for f in ("peak", "peak_with_grads"))
    return _COMPOSES[key]


def _compose(config, settings: TraceSettings, trust_remote_code: bool) -> ActivationEstimate | None:
    k, full = settings.checkpoint_every, num_layers(config)
    plain = dataclasses.replace(settings, gradient_checkpointing=False, checkpoint_every=1)
    every = dataclasses.replace(settings, checkpoint_every=1)
    a2, a3, o2, o3 = (trace_at(config, d, x, trust_remote_code, exact=False)
                      for x in (every, plain) for d in (2, 3))
    c = -(-full // k)
    plain_layers = full - c

    def one(a_lo, a_hi, o_lo, o_hi) -> int:  # one number: every layer checkpointed, L - c of them made plain
        return round(a_lo + (full - 2) * (a_hi - a_lo) + plain_layers * ((o_hi - o_lo) - (a_hi - a_lo)))

    def top_plain(a_lo, a_hi, o_lo, o_hi) -> int:  # the plain step, c of its layers checkpointed
        return round(o_lo + (full - 2) * (o_hi - o_lo) - c * ((o_hi - o_lo) - (a_hi - a_lo)))

    def each(a_lo: dict, a_hi: dict, o_lo: dict, o_hi: dict, f=one) -> dict:  # key by key
        return {key: v for key in set(a_lo) | set(a_hi) | set(o_lo) | set(o_hi)
                if (v := f(a_lo.get(key, 0), a_hi.get(key, 0), o_lo.get(key, 0), o_hi.get(key, 0)))}

    def seg(name: str, field: str) -> dict:  # where the top layer is plain, its backward recomputes nothing
        plain_top = name == "top_bwd" and (full - 1) % k
        return each(*(t.segments[name][field] for t in (a2, a3, o2, o3)), f=top_plain if plain_top else one)

    names = sorted(set(a2.segments) & set(a3.segments) & set(o2.segments) & set(o3.segments))
    if not names:
        return None
    parts = {name: seg(name, "parts") for name in names}
    parts_g = {name: seg(name, "parts_with_grads") for name in names}
    top = max(names, key=lambda n: sum(parts[n].values()))
    top_g = max(names, key=lambda n: sum(parts_g[n].values()))
    sa2, sa3, so2, so3 = (_group_saved(t.saved) for t in (a2, a3, o2, o3))
    per_plain, per_ckpt = so3["layers"] - so2["layers"], sa3["layers"] - sa2["layers"]
    return ActivationEstimate(
        settings=settings, num_layers=full, saved=each(sa2, sa3, so2, so3),
        saved_per_layer=(plain_layers * per_plain + c * per_ckpt) // full,
        autocast_cache=one(a2.autocast_cache, a3.autocast_cache, o2.autocast_cache, o3.autocast_cache),
        peak=sum(parts[top].values()), peak_parts=parts[top], peak_segment=top,
        peak_with_grads=sum(parts_g[top_g].values()), peak_with_grads_parts=parts_g[top_g],
        peak_with_grads_segment=top_g,
        param_grads=one(a2.param_grads, a3.param_grads, o2.param_grads, o3.param_grads), trace_seconds=0.0,
        ops=each(a2.ops, a3.ops, o2.ops, o3.ops), composed=True)


_ESTIMATES: dict = {}


def estimate_activations(config, settings: TraceSettings, trust_remote_code: bool = False,
                         exact: bool = True) -> ActivationEstimate:
    """Trace 2 and 3 layers of ``config`` and extrapolate to its depth. Cached per (config, settings).
    ``exact=False``: micro-batches above 3 from the traces of 2 and 3 (see :func:`trace_at`)."""
    key = (config_key(config), settings, trust_remote_code, exact)
    if key in _ESTIMATES:
        return _ESTIMATES[key]
    full = num_layers(config)
    # Depths 2 and 3 (not 1 and 2): from 2 layers on, the top and the bottom layer are different layers,
    # so every segment means the same thing in both traces and each part is linear in depth. With every
    # k-th layer checkpointed the step is linear per k layers: the depths are then lo and lo + k, lo >= 2
    # and congruent to the full depth modulo k, so the top layer is checkpointed or not as in the model.
    period = settings.checkpoint_every if settings.gradient_checkpointing and settings.checkpoint_every > 1 else 1
    lo = 2 + (full - 2) % period if full > 2 else full
    _prefetch(config, [(lo, settings)] + ([(lo + period, settings)] if full > lo else []), trust_remote_code, exact)
    one = trace_at(config, lo, settings, trust_remote_code, exact)
    two = trace_at(config, lo + period, settings, trust_remote_code, exact) if full > lo else one
    reps = (full - lo) // period

    def ext(a: int, b: int) -> int:
        return a + reps * (b - a)

    def ext_dict(a: dict, b: dict) -> dict:
        return {k: v for k in sorted(set(a) | set(b)) if (v := ext(a.get(k, 0), b.get(k, 0)))}

    # Each segment's peak is extrapolated on its own, then the largest taken: the step's peak can move
    # from one segment to another with depth (e.g. with checkpointing under autocast, the end of the
    # forward, where every layer's weight casts are still cached, overtakes the loss backward).
    segs = {}
    # Middle layers (only in the deeper trace) are skipped: their peaks lie between the top and bottom ones.
    for name in sorted(set(one.segments) & set(two.segments)):
        a, b = one.segments[name], two.segments[name]
        parts, parts_g = ext_dict(a["parts"], b["parts"]), ext_dict(a["parts_with_grads"], b["parts_with_grads"])
        segs[name] = (sum(parts.values()), parts, sum(parts_g.values()), parts_g)
    top = max(segs, key=lambda k: segs[k][0])
    top_g = max(segs, key=lambda k: segs[k][2])
    s1, s2 = _group_saved(one.saved), _group_saved(two.saved)
    est = ActivationEstimate(
        settings=settings, num_layers=full, saved=ext_dict(s1, s2),
        saved_per_layer=(s2["layers"] - s1["layers"]) // period if full > lo else s1["layers"] // full,
        autocast_cache=ext(one.autocast_cache, two.autocast_cache),
        peak=segs[top][0], peak_parts=segs[top][1], peak_segment=top,
        peak_with_grads=segs[top_g][2], peak_with_grads_parts=segs[top_g][3], peak_with_grads_segment=top_g,
        param_grads=ext(one.param_grads, two.param_grads), trace_seconds=one.seconds + two.seconds,
        ops={k: c for k in set(one.ops) | set(two.ops) if (c := one.ops.get(k, 0) + reps * (two.ops.get(k, 0)
                                                                                            - one.ops.get(k, 0)))},
        offloaded=ext(one.offloaded, two.offloaded), offload_copied=ext(one.offload_copied, two.offload_copied))
    _ESTIMATES[key] = est
    return est


# ------------------------------------------------------------------------------------------------
# When no trace can be made: activations counted from the config


def _size(config, *names, default: int = 0) -> int:
    for n in names:
        v = getattr(config, n, None)
        if v:
            return int(v)
    return default


# The count is scaled by this so that it lies above what the trace counts for every family of the architecture zoo
# (scripts/validate_zoo.py: the unscaled count was 0.71x-1.35x of the traced peak): a bound, not a guess.
COUNTED_MARGIN = 1.45


def counted_activations(config, settings: TraceSettings, trainable: int, why: str) -> ActivationEstimate:
    """The activation bytes of one step counted from the config's sizes, for a model whose trace cannot be made
    (``why``). Per decoder layer and token, 4 bytes an element (2 where the whole model is 16-bit; under autocast
    the norms, residuals and losses stay fp32), times :data:`COUNTED_MARGIN`: the
    layer's input and its two norms' outputs (3 x hidden), queries and keys before and after the rotary embedding
    and the values (2 x hidden + 3 x kv width), the attention's output and the output projection's input
    (2 x hidden), the residual sum (hidden), and the MLP's gate, up, activation and product (4 x intermediate) --
    for a mixture-of-experts layer the routed ones (top-k x the expert's intermediate, plus any shared expert's) and
    the router's logits in fp32; eager attention adds its probabilities (2 x heads x sequence, saved and dropped
    out). With checkpointing a layer keeps its input alone, and one layer is recomputed at a time. The head keeps
    its fp32 logits and their gradient (2 x vocabulary x 4 bytes a token, none chunked). Weights and optimizer
    states are counted exactly elsewhere; this bound leaves out what a model does beyond that shape."""
    s = settings
    tokens = s.batch_size * s.seq_len
    e = 2 if s.autocast_dtype is None and s.param_dtype in (torch.float16, torch.bfloat16) else 4
    h = _size(config, "hidden_size", "n_embd", "d_model")
    heads = _size(config, "num_attention_heads", "n_head", default=1)
    head_dim = _size(config, "head_dim", default=h // max(1, heads))
    kv = _size(config, "num_key_value_heads", default=heads) * head_dim
    q = heads * head_dim
    experts = max((int(getattr(config, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")),
                  default=0)
    if experts > 1:
        top_k = _size(config, "num_experts_per_tok", "moe_topk", "top_k", default=2)
        inter = top_k * _size(config, "moe_intermediate_size", "intermediate_size", default=4 * h)
        inter += _size(config, "shared_expert_intermediate_size", default=0)
        router = experts * 4 + top_k * 8  # fp32 logits, the routing weights and indices
    else:
        inter, router = _size(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * h), 0
    per_token = e * (3 * h + 2 * q + 3 * kv + 2 * h + h + 4 * inter) + router
    if s.attn_implementation == "eager" or s.attention_kernel == "math":
        per_token += e * 2 * heads * s.seq_len
    layer = int(tokens * per_token * COUNTED_MARGIN)
    n = num_layers(config)
    kept = tokens * h * e * n + layer if s.gradient_checkpointing else layer * n
    vocab = _size(config, "vocab_size", default=32000)
    logits = 0 if s.chunked_loss else 2 * tokens * vocab * 4
    grads = trainable * 4
    saved = {"embeddings": tokens * h * e, "layers": kept - (layer if s.gradient_checkpointing else 0),
             "head": logits // 2, "other": 0}
    parts = {"layer": kept, "head": logits}
    return ActivationEstimate(
        settings=s, num_layers=n, saved=saved, saved_per_layer=layer if not s.gradient_checkpointing else tokens * h * e,
        autocast_cache=0, peak=kept + logits, peak_parts=parts, peak_segment="counted",
        peak_with_grads=kept + logits + grads, peak_with_grads_parts={**parts, "param_grad": grads},
        peak_with_grads_segment="counted", param_grads=grads, trace_seconds=0.0, counted=why)

