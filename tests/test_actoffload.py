"""Activation offload leaves every parameter's storage where it is (the weights, the transposes linear layers save,
autocast's casts and their views), in the runtime (launcher.model.actoffload) and in the planner's emulation alike,
and copies a tensor that several ops save once."""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from launcher.engines.base import Levers, forward_loss
from launcher.model import actoffload
from launcher.plan.memory.shape import build_meta_model
from launcher.plan.memory.trace import measure_step

CFG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
MODES = {"lora-bf16": dict(dtype=torch.bfloat16, lora=True, autocast=None),
         "full-fp32": dict(dtype=torch.float32, lora=False, autocast=None),
         "full-fp32-autocast-bf16": dict(dtype=torch.float32, lora=False, autocast=torch.bfloat16)}


def real_model(mode):
    m = MODES[mode]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CFG, dtype=m["dtype"], attn_implementation="eager")
    if m["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    return model.train()


def offloaded_step(model, mode, monkeypatch) -> dict:
    """One forward + backward under the runtime's offload; what it copied, told apart by whether the storage is a
    parameter's (a spy on the rule that decides: a saved tensor is copied exactly when it does not stay)."""
    storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, copied = {}, {"parameter": 0, "activation": 0}
    rule = actoffload.stays

    def spy(t):
        stays = rule(t)
        known = seen.get(id(t))
        if not stays and (known is None or known() is not t):  # the runtime copies a tensor saved twice once
            seen[id(t)] = weakref.ref(t)
            copied["parameter" if t.untyped_storage()._cdata in storages else "activation"] += t.numel() * t.element_size()
        return stays

    monkeypatch.setattr(actoffload, "stays", spy)
    ids = torch.randint(0, CFG.vocab_size, (2, 64))
    # the engines' own path: forward_loss with the activation-offload lever, under autocast as the AMP engine runs it
    dtype = MODES[mode]["autocast"]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = forward_loss(model, {"input_ids": ids, "labels": ids}, Levers(offload_activations=True), dtype)
    loss.backward()
    return copied


@pytest.mark.parametrize("mode", list(MODES))
def test_no_byte_of_a_parameter_is_copied_and_the_plan_copies_what_the_run_does(mode, monkeypatch):
    copied = offloaded_step(real_model(mode), mode, monkeypatch)
    assert copied["parameter"] == 0, copied
    assert copied["activation"] > 0
    m = MODES[mode]
    meta = build_meta_model(CFG, dtype=m["dtype"], lora_r=8 if m["lora"] else 0, lora_targets=("q_proj", "v_proj"))
    meta.train()
    monkeypatch.undo()
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    kw = dict(target="cpu", autocast_policy="cpu", autocast_dtype=m["autocast"])
    planned = measure_step(meta, ids, offload_activations=True, **kw)
    assert planned.offload_copied == copied["activation"], (planned.offload_copied, copied)
    # what crosses to the CPU is the activations the plan holds without offload (views of one activation, such as
    # the attention's reshaped queries, are copied apiece: up to a fifth more in fp32)
    plain = measure_step(meta, ids, **kw)
    assert plain.saved_total <= planned.offload_copied <= 1.25 * plain.saved_total, (planned.offload_copied,
                                                                                       plain.saved_total)


def test_a_tensor_saved_by_several_ops_is_copied_once():
    x = torch.randn(4, 8, requires_grad=True)
    made = []
    real_empty = torch.empty

    def counting_empty(*a, **k):
        out = real_empty(*a, **k)
        made.append(out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(actoffload.torch, "empty", counting_empty)
        with actoffload.offload_saved_tensors():
            h = x * 2  # one activation ...
            y = (h.sin() + h.cos() + h.pow(2)).sum()  # ... saved by three ops
    y.backward()
    assert len(made) == 1, len(made)
    assert torch.allclose(x.grad, 2 * ((2 * x).cos() - (2 * x).sin() + 2 * (2 * x)))
