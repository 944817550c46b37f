"""A run's model with no weight made twice: built on the meta device, each tensor then made once, in the dtype it
trains in, where it lives.

:func:`meta_model` builds the architecture on the meta device (as transformers' own ``from_pretrained`` does:
no memory, no initialisation; ``from_config`` on a real device initialises every linear layer twice, once in
torch's constructor and once in transformers' ``_init_weights``). A :class:`Materializer` then makes the tensors
of one module subtree at a time (:meth:`Materializer.fill`): a frozen base in 16 bits (never fp32), trainable
weights in the dtype the engine updates (fp32 masters for AMP and FSDP, 16 bits for DeepSpeed, which keeps its
own fp32 master), on the device the :class:`Placement` names. Values come from, in this order:

- ``overrides`` (the weights an engine being replaced down the OOM ladder hands on, by parameter name);
- the model directory's safetensors, read tensor by tensor into their destination (:mod:`.weights`);
- initialisation: LoRA adapters from a generator seeded per tensor name (so every engine and every order of
  filling gives the same adapter), everything else by the model's own ``_init_weights`` module by module, in a
  fixed order (the units of :func:`launcher.model.structure.units`, then the rest), with the CPU's generator:
  initialised on the CPU in the target dtype and moved to the GPU unit by unit, so the same seed gives the same
  weights on every engine, device and number of ranks, and a rank that shards (FSDP2, ZeRO-3) holds one unit
  whole at a time, never the model.

An engine that shards fills a unit and shards it before filling the next (:meth:`Materializer.units`); the others
fill the whole model (:meth:`Materializer.fill_all`).
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from launcher.model.structure import units as model_units
from launcher.model.weights import Checkpoint


@dataclass(frozen=True)
class Placement:
    """Where the weights of a run live, and in what dtype."""

    device: torch.device  # where the weights live: the GPU, or the CPU (a CPU run, or an offloading engine)
    frozen_dtype: torch.dtype  # parameters that do not train (a LoRA base): 16 bits in every mixed-precision run
    trainable_dtype: torch.dtype  # parameters that train: fp32 masters (AMP, FSDP) or 16 bits (DeepSpeed)

    def dtype_of(self, t: torch.Tensor) -> torch.dtype:
        return self.trainable_dtype if t.requires_grad else self.frozen_dtype


def meta_model(hf_config, *, attn_implementation: str, dtype: torch.dtype, trust_remote_code: bool = False):
    """The model of ``hf_config`` on the meta device: every parameter and buffer without storage, nothing
    initialised (``post_init`` skips initialisation on the meta device)."""
    from transformers import AutoModelForCausalLM

    with _meta_context():
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    model.config.use_cache = False
    return model


def _meta_context() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    try:
        from transformers import initialization

        stack.enter_context(initialization.meta_device_safe_creation_ops())
    except (ImportError, AttributeError):  # older transformers: remote code that reads a meta value fails instead
        pass
    return stack


def tensor_keys(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> its name in ``model``'s state dict (parameters, then buffers), the first name of a tied one."""
    keys: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        keys.setdefault(id(t), name)
    return keys


def _pretrained_owner(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the transformers model whose ``_init_weights`` initialises it (the nearest above it)."""
    from transformers import PreTrainedModel

    owner: dict[int, nn.Module] = {}

    def walk(m: nn.Module, current):
        current = m if isinstance(m, PreTrainedModel) else current
        if current is not None:
            owner[id(m)] = current
        for child in m.children():
            walk(child, current)

    walk(model, None)
    return owner


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Children before their parent, as transformers' ``initialize_weights`` visits them."""
    out: list[nn.Module] = []

    def walk(m):
        for c in m.children():
            walk(c)
        out.append(m)

    walk(module)
    return out


def is_adapter(name: str) -> bool:
    """A LoRA adapter's tensor, by the names peft gives them."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_init(name: str, t: torch.Tensor, seed: int) -> None:
    """peft's default LoRA initialisation (A: Kaiming-uniform with a = sqrt(5), B: zeros) from a generator
    seeded by the seed and the tensor's name: the same adapter whatever engine, device or order fills it."""
    with torch.no_grad():
        if ".lora_B." in name:
            t.zero_()
            return
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        a = torch.empty(t.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        t.copy_(a)


_SCRATCH = 1 << 22  # elements of the fp32 block a 16-bit tensor's normal values are drawn in (16 MiB)


def normal_16bit(t: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator=None) -> torch.Tensor:
    """``t.normal_(mean, std)`` for a 16-bit CPU tensor, drawn in fp32 blocks and rounded into it.

    torch draws a bf16 tensor's normal values one element at a time (its vectorised Box-Muller is fp32's): 2.8 s per
    GiB of bf16 on a 2-core EPYC against 1.9 drawn as fp32 and rounded (scripts/bench_init.py), and the 12.7 GiB of a
    7B base are most of the wait before the first step. The values are torch's for the same seed but for the last 16
    of a tensor whose size is not a multiple of 16 (torch fills that tail in another order for 16-bit tensors), and
    the same on every engine, device and number of ranks (all initialise here, on the CPU)."""
    flat = t.view(-1)
    block = torch.empty(min(_SCRATCH, flat.numel()), dtype=torch.float32)
    for start in range(0, flat.numel(), block.numel()):
        part = flat[start:start + block.numel()]
        b = block[:part.numel()]
        b.normal_(mean, std, generator=generator)
        part.copy_(b)
    return t


@contextlib.contextmanager
def _fast_normal(table: dict):
    """transformers' guarded ``init.normal_`` (which calls ``table["normal_"]``) with :func:`normal_16bit` for the
    16-bit contiguous CPU tensors, torch's own for the rest."""
    original = table["normal_"]

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        if tensor.device.type == "cpu" and tensor.dtype in (torch.bfloat16, torch.float16) and tensor.is_contiguous():
            with torch.no_grad():
                return normal_16bit(tensor, mean, std, generator)
        return original(tensor, mean=mean, std=std, generator=generator)

    table["normal_"] = normal_
    try:
        yield
    finally:
        table["normal_"] = original


class Materializer:
    """Makes the tensors of a meta model, one module subtree at a time (see the module docstring).

    ``hf_keys``: id(tensor) -> its key in the checkpoint (:func:`tensor_keys` of the transformers model before
    peft wrapped it); ``checkpoint``: the model directory's weights, or None for a preset (initialised from
    ``seed``); ``overrides``: {parameter name: {"param": tensor}} to put in instead; ``after_fill``: called with
    each filled subtree (bitsandbytes quantisation of a preset's layers, as they are made)."""

    def __init__(self, model: nn.Module, placement: Placement, *, seed: int, hf_keys: dict[int, str] | None = None,
                 checkpoint: Checkpoint | None = None, overrides: dict | None = None, after_fill=None):
        self.model = model
        self.placement = placement
        self.seed = seed
        self.checkpoint = checkpoint
        self.overrides = overrides or {}
        self.after_fill = after_fill
        self.hf_keys = hf_keys if hf_keys is not None else tensor_keys(model)
        self.names = tensor_keys(model)
        self.owner = _pretrained_owner(model)
        self.loaded = 0  # bytes read from the checkpoint
        self.initialised = 0  # bytes initialised
        self._seeded = False
        self.made_s = 0.0  # seconds spent making tensors (reading, initialising, moving)

    def units(self) -> list[nn.Module]:
        """The subtrees filled one at a time, in the order initialisation uses: the input embeddings, each decoder
        layer, the output head (tied embeddings stay with the rest, filled last by :meth:`fill` of the model)."""
        return model_units(self.model)

    def fill_all(self) -> nn.Module:
        for unit in self.units():
            self.fill(unit)
        self.fill(self.model)
        return self.model

    @torch.no_grad()
    def fill(self, module: nn.Module) -> None:
        """Make every tensor of ``module`` still on the meta device: read, handed on or initialised; on
        ``placement.device`` afterwards."""
        t0 = time.perf_counter()
        try:
            self._fill(module)
        finally:
            self.made_s += time.perf_counter() - t0

    def _fill(self, module: nn.Module) -> None:
        target = self.placement.device
        made, on_cpu = [], []
        if not self._seeded:  # the CPU generator from the seed at the first fill, whatever ran since the build
            torch.manual_seed(self.seed)
            self._seeded = True
        replaced: dict[int, nn.Parameter] = {}
        for attr, t, is_param in self._meta_tensors(module):
            name = self.names.get(id(t), attr)
            dtype = self.placement.dtype_of(t) if is_param else t.dtype
            key = self.hf_keys.get(id(t))
            source = ("override" if name in self.overrides else
                      "checkpoint" if self.checkpoint is not None and key in self.checkpoint else "init")
            device = target if source != "init" else torch.device("cpu")
            new = torch.empty(t.shape, dtype=dtype, device=device)
            if is_param:  # a meta tensor's storage cannot be swapped in place: a new Parameter, put wherever the old was
                new = nn.Parameter(new, requires_grad=t.requires_grad)
                replaced[id(t)] = new
                self.names[id(new)] = name
                if key is not None:
                    self.hf_keys[id(new)] = key
            else:
                replaced[id(t)] = new
            if source == "override":
                new.copy_(self.overrides[name]["param"])
                new._is_hf_initialized = True
            elif source == "checkpoint":
                self.checkpoint.read_into(key, new)
                new._is_hf_initialized = True
                self.loaded += new.numel() * new.element_size()
            elif is_param and is_adapter(name):
                adapter_init(name, new, self.seed)
                new._is_hf_initialized = True
            if source == "init":
                self.initialised += new.numel() * new.element_size()
                if device != target:
                    on_cpu.append((new, is_param))
            made.append(new)
        if replaced:  # every reference: a tied weight is held by two modules
            for m in self.model.modules():
                for table in (m._parameters, m._buffers):
                    for k, v in table.items():
                        if v is not None and id(v) in replaced:
                            table[k] = replaced[id(v)]
        if made:
            self._init_rest(module)
        for t, is_param in on_cpu:
            if is_param:
                t.data = t.data.to(target)
            else:
                for m in self.model.modules():
                    for k, v in m._buffers.items():
                        if v is t:
                            m._buffers[k] = t.to(target)
        if self.after_fill is not None:
            self.after_fill(module)
        for m in module.modules():  # done: a later fill of an enclosing module (the root) leaves it as it is
            m._is_hf_initialized = True

    def _meta_tensors(self, module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
        out, seen = [], set()
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None and p.is_meta and id(p) not in seen:
                    seen.add(id(p))
                    out.append((attr, p, True))
            for attr, b in m._buffers.items():
                if b is not None and b.is_meta and id(b) not in seen:
                    seen.add(id(b))
                    out.append((attr, b, False))
        return out

    def _init_rest(self, module: nn.Module) -> None:
        """The model's own initialisation of what was neither read nor handed on, module by module (transformers'
        ``_initialize_weights``, which skips a module already done and, under its guard, a tensor already read)."""
        try:
            from transformers import initialization

            guard = contextlib.ExitStack()
            guard.enter_context(initialization.guard_torch_init_functions())
            guard.enter_context(_fast_normal(initialization.TORCH_INIT_FUNCTIONS))
        except (ImportError, AttributeError):
            guard = contextlib.nullcontext()
        with guard:
            for m in _post_order(module):
                owner = self.owner.get(id(m))
                if owner is None or any(is_adapter(self.names.get(id(p), "")) for p in m._parameters.values()
                                        if p is not None):
                    continue
                owner._initialize_weights(m)
