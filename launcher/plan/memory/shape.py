"""Model shape without weights: build any transformers causal LM on the meta device and count its parameters.

Counting is done on copies of the config cut to 1 and 2 decoder layers and extrapolated to the real depth
(``q(L) = q(1) + (L - 1) * (q(2) - q(1))``), because decoder layers are identical. That keeps a 70B shape
at a fraction of a second, where building all 80 meta layers costs seconds and wrapping them in peft
another ten. Models whose layers differ (mixture-of-experts every other layer, ...) would need a longer
period; none of the presets does.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch import nn

from launcher.model.structure import decoder_layers, most_module_params, num_layers
from launcher.model.targets import ALL_LINEAR, adapted, adapted_parameters, is_linear, linear_in_out, parameter_targets


def with_depth(config, n: int):
    """A copy of ``config`` with ``n`` decoder layers (per-layer lists such as ``layer_types`` cut too)."""
    cfg = copy.deepcopy(config)
    full = num_layers(config)
    cfg.num_hidden_layers = n
    for key in ("layer_types",):
        val = getattr(cfg, key, None)
        if isinstance(val, (list, tuple)) and len(val) == full:
            setattr(cfg, key, type(val)(val[:n]))
    return cfg


@contextlib.contextmanager
def peft_on_meta():
    """peft's LoRA on a parameter (an expert stack) folds ``W + scaling * lhs @ rhs`` with autocast switched off
    for ``W``'s device, which torch cannot do for the meta device: on meta the same fold runs without that switch
    (there is no autocast on meta to switch off). Around building a meta model with expert LoRA and tracing it."""
    try:
        from peft.tuners.lora.layer import _LoraFactorsProxy as proxy
    except ImportError:  # a peft without LoRA on parameters: nothing on meta to help
        yield
        return
    original = proxy.forward

    def forward(self, W):
        return torch.baddbmm(W, self.lhs, self.rhs, alpha=self.scaling) if W.is_meta else original(self, W)

    proxy.forward = forward
    try:
        yield
    finally:
        proxy.forward = original


def build_meta_model(config, *, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32,
                     lora_r: int = 0, lora_targets=(ALL_LINEAR,), lora_dropout: float = 0.0,
                     adapter_dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The model of ``config`` on the meta device, parameters in ``dtype``; LoRA adapters (peft) when ``lora_r``.

    ``adapter_dtype``: dtype of the adapter weights (default: fp32, what peft does over a 16-bit base).
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    except ValueError as e:  # an architecture without SDPA support runs eager attention
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
            raise
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        names = adapted(model, lora_targets)
        if not names:
            raise ValueError(f"lora.target_modules={list(lora_targets)} matches no linear module of "
                             f"{type(model).__name__}")
        params = parameter_targets(adapted_parameters(model, lora_targets))
        # low_cpu_mem_usage: adapters are made on meta without an init pass (10x faster, same shapes)
        with peft_on_meta():
            on_params = {"target_parameters": params} if params else {}  # peft 0.17+; older ones never get here
            model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_r, lora_dropout=lora_dropout,
                                                     target_modules=names, **on_params), low_cpu_mem_usage=True)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(adapter_dtype or torch.float32)
    return model


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements, not bytes) of the full-depth model."""

    total: int  # every parameter, tied ones once
    embeddings: int  # input embeddings (and learned position embeddings)
    layers: int  # all decoder layers together
    per_layer: int  # one decoder layer
    head: int  # output embedding (0 when tied to the input embedding)
    other: int  # final norm and anything else outside the layers
    linear_weights: int  # weights of the layers' linear modules (what 4-bit/8-bit quantization shrinks)
    trainable: int  # total for a full fine-tune; the adapters with LoRA
    adapters: int  # LoRA parameters (0 without LoRA)
    adapters_per_layer: int
    largest_param: int  # elements of the largest single tensor (DeepSpeed sizes a buffer by it)
    largest_module: int  # most direct parameters of one module (ZeRO-3 gathers per module)
    largest_adapter: int  # elements of the largest LoRA tensor (0 without LoRA)
    small_params: int  # parameters in tensors of <= 10 x hidden elements (ZeRO-3 keeps them on the GPU)
    num_layers: int
    tied_embeddings: bool
    tensors: int = 0  # parameter tensors of the model (optimizers, clipping and engines pay per tensor)
    adapter_tensors: int = 0  # LoRA tensors (two per adapted layer)
    # (elements, how many, a matrix) of every parameter tensor of the base, and of the adapters: what a block per
    # tensor costs in an allocator that rounds (torch's pinned memory), and how the optimizer groups them
    tensor_sizes: tuple = ()
    adapter_sizes: tuple = ()

    @property
    def trainable_tensors(self) -> int:
        return self.adapter_tensors if self.adapters else self.tensors

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def to_dict(self) -> dict:
        return asdict(self)


def _count_one(model: nn.Module, lora_r: int, lora_targets) -> dict:
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    emb_mod = model.get_input_embeddings()
    emb_ids = {id(p) for p in emb_mod.parameters()}
    layers = decoder_layers(model)
    layer_ids = {id(p) for p in layers.parameters()}
    # learned absolute position embeddings (GPT-2 wpe, OPT) count with the embeddings
    for mod in model.modules():
        if isinstance(mod, nn.Embedding) and mod is not emb_mod and not any(id(p) in layer_ids for p in mod.parameters()):
            emb_ids |= {id(p) for p in mod.parameters()}
    out_mod = model.get_output_embeddings()
    head_ids = {id(p) for p in out_mod.parameters()} - emb_ids if out_mod is not None else set()
    tied = out_mod is not None and any(id(p) in emb_ids for p in out_mod.parameters())
    n = lambda ids: sum(params[i].numel() for i in ids if i in params)  # noqa: E731
    linear = 0
    for mod in layers.modules():
        if is_linear(mod):
            linear += mod.weight.numel()
    adapters = largest_adapter = adapter_tensors = 0
    sizes: Counter = Counter()  # adapter tensors: (elements, a matrix) -> how many
    if lora_r:
        for name in adapted(model, lora_targets):
            mod = model.get_submodule(name)
            i, o = linear_in_out(mod)
            sizes.update([(lora_r * i, True), (o * lora_r, True)])
            adapters += lora_r * (i + o)
            adapter_tensors += 2  # lora_A and lora_B
            largest_adapter = max(largest_adapter, lora_r * max(i, o))
        for name in adapted_parameters(model, lora_targets):  # experts x (out, in): lora_A r*E x in, lora_B out x r*E
            e, a, b = model.get_parameter(name).shape
            adapters += lora_r * e * (a + b)
            adapter_tensors += 2
            sizes.update([(lora_r * e * a, True), (lora_r * e * b, True)])
            largest_adapter = max(largest_adapter, lora_r * e * max(a, b))
    largest_module = most_module_params(model)
    threshold = 10 * int(getattr(model.config, "hidden_size", 0) or 0)
    return dict(total=total, embeddings=n(emb_ids), layers=n(layer_ids), head=n(head_ids),
                other=total - n(emb_ids) - n(layer_ids) - n(head_ids), linear_weights=linear,
                adapters=adapters, largest_param=max(p.numel() for p in params.values()),
                largest_module=largest_module, largest_adapter=largest_adapter,
                small_params=sum(p.numel() for p in params.values() if p.numel() <= threshold), tied=tied,
                tensors=len(params), adapter_tensors=adapter_tensors,
                layer_sizes=Counter((p.numel(), p.dim() >= 2) for i, p in params.items() if i in layer_ids),
                other_sizes=Counter((p.numel(), p.dim() >= 2) for i, p in params.items() if i not in layer_ids),
                adapter_sizes=sizes)


_COUNT_CACHE: dict = {}


_KEYS: dict[int, tuple] = {}  # id(config) -> (config, its attributes when keyed, key)


def config_key(config) -> str:
    """A hashable identity of a transformers config (class and full JSON), for caches. Remembered per config
    object while its attributes stay equal: a plan asks for it hundreds of times, and the JSON costs a
    millisecond each."""
    hit = _KEYS.get(id(config))
    if hit is not None and hit[0] is config and hit[1] == config.__dict__:
        return hit[2]
    cls = type(config)
    key = f"{cls.__module__}.{cls.__qualname__}:" + config.to_json_string(use_diff=False)
    if len(_KEYS) > 256:
        _KEYS.clear()
    _KEYS[id(config)] = (config, copy.deepcopy(config.__dict__), key)
    return key


def _count(config, lora_r: int, lora_targets: tuple, trust_remote_code: bool) -> ParamCounts:
    full = num_layers(config)
    one = _count_one(build_meta_model(with_depth(config, 1), trust_remote_code=trust_remote_code), lora_r, lora_targets)
    two = _count_one(build_meta_model(with_depth(config, 2), trust_remote_code=trust_remote_code), lora_r,
                     lora_targets) if full > 1 else one

    def ext(key):
        return one[key] + (full - 1) * (two[key] - one[key])

    total = ext("total")
    adapters = ext("adapters")
    layer = two["layer_sizes"] - one["layer_sizes"] if full > 1 else one["layer_sizes"]
    base_sizes = one["other_sizes"] + Counter({k: n * full for k, n in layer.items()})
    per_layer_adapters = two["adapter_sizes"] - one["adapter_sizes"] if full > 1 else one["adapter_sizes"]
    adapter_sizes = one["adapter_sizes"] + Counter({k: n * (full - 1) for k, n in per_layer_adapters.items()})
    return ParamCounts(total=total, embeddings=ext("embeddings"), layers=ext("layers"),
                       per_layer=two["layers"] - one["layers"] if full > 1 else one["layers"],
                       head=ext("head"), other=ext("other"), linear_weights=ext("linear_weights"),
                       trainable=adapters if lora_r else total, adapters=adapters,
                       adapters_per_layer=(two["adapters"] - one["adapters"]) if full > 1 else one["adapters"],
                       largest_param=max(one["largest_param"], two["largest_param"]),
                       largest_module=max(one["largest_module"], two["largest_module"]),
                       largest_adapter=max(one["largest_adapter"], two["largest_adapter"]),
                       small_params=ext("small_params"), num_layers=full, tied_embeddings=bool(one["tied"]),
                       tensors=ext("tensors"), adapter_tensors=ext("adapter_tensors"),
                       tensor_sizes=_sizes(base_sizes), adapter_sizes=_sizes(adapter_sizes) if lora_r else ())


def _sizes(counts: Counter) -> tuple:
    return tuple(sorted((int(n), int(c), bool(m)) for (n, m), c in counts.items() if c > 0))


def _counts_from_json(d: dict) -> ParamCounts:
    d = dict(d)
    for k in ("tensor_sizes", "adapter_sizes"):
        d[k] = tuple(tuple(x) for x in d.get(k, ()))
    return ParamCounts(**d)


# A store that keeps values between processes (``get_value(key)``, ``put_value(key, dict)``;
# :mod:`launcher.plan.tracestore`), set by the command line; None: this module does no I/O.
_STORE = None


def set_store(store) -> None:
    """Keep :func:`remembered` values in ``store`` too (None: in this process only)."""
    global _STORE
    _STORE = store


def remembered(key: tuple, make, to_json, from_json):
    """``make()``, or what it returned for ``key`` in an earlier process (through the store, as JSON). Building a
    model's meta copy costs a second and more with the import of its modeling code: a plan whose traces are all
    kept needs nothing else of the model. A kept value that does not read back is made again."""
    if _STORE is not None and (kept := _STORE.get_value(key)) is not None:
        try:
            return from_json(kept)
        except (KeyError, TypeError, ValueError):
            pass
    value = make()
    if _STORE is not None:
        _STORE.put_value(key, to_json(value))
    return value


def count_params(config, lora_r: int = 0, lora_targets=(ALL_LINEAR,), trust_remote_code: bool = False) -> ParamCounts:
    """Parameter counts of ``config`` at full depth, with LoRA adapters of rank ``lora_r`` when > 0."""
    targets = (lora_targets,) if isinstance(lora_targets, str) else tuple(lora_targets)
    key = (config_key(config), int(lora_r), targets if lora_r else (), bool(trust_remote_code))
    if key not in _COUNT_CACHE:
        _COUNT_CACHE[key] = remembered(("param_counts_v2", *key),  # v2: with the tensor sizes
                                       lambda: _count(config, int(lora_r), targets, bool(trust_remote_code)),
                                       asdict, _counts_from_json)
    return _COUNT_CACHE[key]
