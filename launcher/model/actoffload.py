"""Activation offload: the tensors autograd saves for backward go to CPU memory in the forward and come back in
the backward, exactly (a copy each way).

Two forms, one per checkpointing setting:

- **checkpointing on**: each checkpointed layer's checkpoint call runs inside :func:`offload_saved_tensors`, which
  then holds only what the layer keeps for its recompute: its inputs. That is what transformers 5.24's
  ``activation_checkpointing_enable(offload=True)`` does with torch's ``save_on_cpu``; it is not used because it
  always pins (``pin_memory=True``), and vramfit pins only when ``ulimit -l`` and free RAM allow it.
- **checkpointing off**: :func:`offload_saved_tensors` around the forward. Not torch's ``save_on_cpu`` itself:
  that copies *every* saved tensor, the weights included (each linear saves its weight for the input
  gradient, and under autocast its 16-bit copy), so a 7B model's 14 GB of weights would cross PCIe twice per
  micro-batch and sit in RAM once more. Here parameters, autocast's copies of them and views of either (the
  transposes linear layers save) stay where they are;
  everything else is copied as ``save_on_cpu`` copies it (pinned when asked, a new device tensor per unpack).

Both copy on the compute stream (torch and transformers do; neither overlaps them with compute), so every
offloaded byte costs a device-to-host and a host-to-device copy per micro-batch: :mod:`launcher.plan.steptime`
prices them, and :mod:`launcher.plan.memory.trace` emulates both forms on the meta device with :func:`stays`, the
same rule.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn


def stays(t: torch.Tensor) -> bool:
    """Whether a saved tensor is left where it is: a parameter or a view of one (a linear layer saves its weight's
    transpose, trainable or frozen), or autocast's cast of a weight (a copy whose input is a leaf that accumulates a
    gradient) or a view of that cast. Everything else is an activation."""
    base = t._base if t._base is not None else t
    if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
        return True
    fn = base.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        nxt = fn.next_functions[0][0] if fn.next_functions else None
        if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
            return True
    return False


def offload_saved_tensors(pin_memory: bool = False):
    """A ``saved_tensors_hooks`` context: saved activations copied to CPU memory (pinned with ``pin_memory``).

    A tensor that several ops save (a norm's output feeds the query, key and value projections, each of which
    saves its input) is copied once: torch's ``save_on_cpu`` copies it per op, three times the bytes in RAM and
    over PCIe for that one tensor."""
    copies: dict[int, tuple] = {}  # id of a tensor copied in this forward -> (a weak reference to it, its copy)

    def pack(t: torch.Tensor):
        if stays(t):
            return (None, t)
        known = copies.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory and t.is_cuda)
        packed.copy_(t)
        out = (t.device, packed)
        copies[id(t)] = (weakref.ref(t), out)
        return out

    def unpack(packed):
        device, t = packed
        # copy=True: a CPU-only run copies too, so it takes the path (and the memory) a GPU run takes
        return t if device is None else t.to(device, non_blocking=pin_memory, copy=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _offloaded_checkpoint(checkpoint, pin_memory: bool, *args, **kwargs):
    with offload_saved_tensors(pin_memory):
        return checkpoint(*args, **kwargs)


def offload_checkpointed_layers(layers, pin_memory: bool = False) -> int:
    """Wrap the checkpoint function of every checkpointed layer (``layers``: transformers'
    GradientCheckpointingLayer modules) so that what it saves -- its inputs -- goes to CPU memory."""
    n = 0
    for layer in layers:
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if fn is None or not getattr(layer, "gradient_checkpointing", False):
            continue
        if getattr(fn, "func", None) is _offloaded_checkpoint:
            fn = fn.args[0]
        layer._gradient_checkpointing_func = functools.partial(_offloaded_checkpoint, fn, pin_memory)
        n += 1
    return n
