"""The AMP engine with the optimizer offloaded (launcher/engines/offload_opt.py) against plain AMP, on the CPU.

In fp32 both compute the same thing: the offload engine keeps the model and its fp32 masters apart, sends each
gradient to the master as backward completes it, clips by the global norm of all of them and steps AdamW on the
master. Over 20 steps (gradient accumulation 2, clipping active, weight decay on the matrices) the losses and the
weights agree within 1e-5 (measured: printed by the test). An engine whose update is moved before the last gradient
of the step has arrived (each parameter stepped in its hook, clipped by the norm seen so far) leaves the curve:
the test checks that the same comparison then fails, so the parity test can tell.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from helpers import _Amplify, compare, losses, overflow_at, run_inprocess
from launcher.engines.amp import AmpEngine
from launcher.engines.base import Levers
from launcher.engines.offload_opt import OffloadOptEngine
from launcher.model.build import param_groups

STEPS, ACC, MICRO, SEQ, VOCAB = 20, 2, 2, 16, 128
TOL = 1e-5
CLIP = 0.5  # below the tiny model's gradient norm at these settings (the test checks that clipping acted)


def scale_cfg(initial_power=16, window=1000, hysteresis=2, min_scale=1):
    return types.SimpleNamespace(initial_power=initial_power, window=window, hysteresis=hysteresis,
                                 min_scale=min_scale)


def tiny_model(seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    m = LlamaForCausalLM(cfg).to(dtype)
    m.config.use_cache = False
    return m


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def make(kind, precision="fp32", clip=CLIP, loss_scale=None, seed=0, engine_cls=None):
    model = tiny_model(seed)
    kw = dict(precision=precision, device=torch.device("cpu"), param_groups=param_groups(model, 0.1), lr=1e-3,
              betas=(0.9, 0.95), eps=1e-8, grad_clip=clip, loss_scale=loss_scale or scale_cfg(), levers=Levers())
    if kind == "amp":
        return AmpEngine(model, **kw)
    return (engine_cls or OffloadOptEngine)(model, **kw)


def train(engine, steps=STEPS, start=0, data=None):
    data = data or batches(STEPS * ACC)
    out = []
    for s in range(start, start + steps):
        lr = 1e-3 * (1 + s) / STEPS  # a schedule, so that a wrong lr per parameter would show
        engine.lr_now = lr
        ls = [engine.forward_backward(b, ACC) for b in data[s * ACC:(s + 1) * ACC]]
        r = engine.step(lr)
        out.append((float(torch.stack(ls).mean()), float(r.grad_norm), bool(r.skipped)))
    return out


def weights(engine) -> dict:
    if isinstance(engine, OffloadOptEngine):
        return {n: m.detach().clone() for n, m in zip(engine.names, engine.masters)}
    return {n: p.detach().clone() for n, p in engine.module().named_parameters()}


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def parity(ref, other) -> tuple[float, float, float]:
    """(max relative loss difference, max absolute weight difference, max relative grad-norm difference)."""
    a, b = train(ref), train(other)
    mx, _mean = compare([x[0] for x in b], [x[0] for x in a], "offload-opt vs amp (fp32) loss")
    norms = max(abs(x[1] - y[1]) / y[1] for x, y in zip(b, a))
    w = max_weight_diff(weights(other), weights(ref))
    print(f"max weight diff {w:.3e}, max grad-norm rel diff {norms:.3e}")
    return mx, w, norms


def test_fp32_parity_with_amp_over_20_steps():
    amp, off = make("amp"), make("offload")
    a = train(amp)
    assert min(x[1] for x in a) > CLIP, "clipping must act in this test"
    amp = make("amp")
    mx, w, norms = parity(amp, off)
    assert mx < TOL and w < TOL and norms < TOL, (mx, w, norms)


class EarlyStep(OffloadOptEngine):
    """The update moved into backward: each parameter stepped as its gradient arrives, clipped by the norm of the
    gradients seen so far (the mistake the engine's design avoids)."""

    def _on_grad(self, p):
        super()._on_grad(p)
        if self._arrived:
            i = self._arrived.pop()
            norm = math.sqrt(float(self._sumsq))
            self._update(i, min(1.0, self.grad_clip / (norm + 1e-6)), self.lr_now)


def test_parity_fails_when_the_step_goes_before_the_last_gradient():
    mx, w, _ = parity(make("amp"), make("offload", engine_cls=EarlyStep))
    assert mx > TOL or w > TOL, (mx, w)


def test_clipping_uses_the_global_norm():
    """With a tiny clip every step is clipped: the global norm and the weights still match AMP's
    clip_grad_norm_."""
    mx, w, norms = parity(make("amp", clip=1e-3), make("offload", clip=1e-3))
    assert mx < TOL and w < TOL and norms < TOL, (mx, w, norms)


def test_checkpoint_round_trip(tmp_path):
    """10 steps, save, a fresh engine loads and goes on for 10: the same weights as 20 without a stop."""
    data = batches(STEPS * ACC)
    whole = make("offload")
    train(whole, STEPS, data=data)
    first = make("offload")
    train(first, 10, data=data)
    first.save(str(tmp_path), {"step": 10})
    second = make("offload", seed=7)  # other weights: all of them must come from the checkpoint
    assert second.load(str(tmp_path)) == {"step": 10}
    train(second, 10, start=10, data=data)
    assert max_weight_diff(weights(second), weights(whole)) == 0.0
    for a, b in zip(second.params, whole.params):
        assert torch.equal(a, b)


def test_portable_state_moves_to_amp_and_back():
    off = make("offload")
    train(off, 5)
    state = off.portable_state()
    amp = make("amp", seed=3)
    with torch.no_grad():
        for n, p in amp.module().named_parameters():
            p.copy_(state[n]["param"])
    amp.load_portable_state(state, 5)
    back = make("offload", seed=4)
    back.load_portable_state(amp.portable_state(), 5)
    assert max_weight_diff(weights(back), weights(off)) == 0.0


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    """An inf injected into the backward: no weight or Adam moment moves, the scale halves (hysteresis 1);
    the next clean step updates and keeps the scale."""
    eng = make("offload", precision="fp16", loss_scale=scale_cfg(initial_power=8, window=1000, hysteresis=1),
               clip=1.0)
    data = batches(4)
    eng.forward_backward(data[0], 1)
    eng.step(1e-3)  # a clean first step: the moments exist
    before = weights(eng)
    moments = [dict(o.state[m]) for o, m in zip(eng.optimizers, eng.masters)]
    moments = [{k: v.clone() for k, v in st.items()} for st in moments]
    head = eng.module().get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda _m, args: (_Amplify.apply(args[0], 1e30), *args[1:]))
    eng.forward_backward(data[1], 1)
    handle.remove()
    r = eng.step(1e-3)
    assert r.skipped is True and r.loss_scale == 128.0 and not math.isfinite(r.grad_norm)
    assert eng.nonfinite, "the overflowing gradients are named for the diagnosis"
    assert max_weight_diff(weights(eng), before) == 0.0
    for o, m, st in zip(eng.optimizers, eng.masters, moments):
        assert all(torch.equal(o.state[m][k], v) for k, v in st.items())
    assert all(p.grad is None for p in eng.params)
    eng.forward_backward(data[2], 1)
    r = eng.step(1e-3)
    assert r.skipped is False and r.loss_scale == 128.0 and math.isfinite(r.grad_norm)
    assert max_weight_diff(weights(eng), before) > 0


def test_fp16_hysteresis_two_overflows_halve_once():
    eng = make("offload", precision="fp16", loss_scale=scale_cfg(initial_power=8, hysteresis=2))
    head = eng.module().get_output_embeddings()
    scales = []
    for b in batches(2):
        handle = head.register_forward_pre_hook(lambda _m, args: (_Amplify.apply(args[0], 1e30), *args[1:]))
        eng.forward_backward(b, 1)
        handle.remove()
        scales.append(eng.step(1e-3).loss_scale)
    assert scales == [256.0, 128.0]


def test_the_gradients_leave_during_backward():
    """With accumulation 1 no gradient is left on the model after backward (each was sent and freed in its hook);
    with accumulation 2 they stay through the first micro-batch and leave in the second."""
    eng = make("offload")
    data = batches(3)
    eng.forward_backward(data[0], 1)
    assert all(p.grad is None for p in eng.params)
    eng.step(1e-3)
    eng.forward_backward(data[1], 2)
    assert all(p.grad is not None for p in eng.params)
    eng.forward_backward(data[2], 2)
    assert all(p.grad is None for p in eng.params) and len(eng._arrived) == len(eng.params)
    eng.step(1e-3)


FP16 = ["precision=fp16", "train.max_steps=12", "train.warmup_steps=2", "loss_scale.initial_power=4",
        "loss_scale.window=3", "checkpoint.every_steps=4"]


def test_train_fp16_offload_opt_follows_the_scale_rule(tmp_path):
    """A whole run of the fp16 profile with overflows injected at the steps of tests/test_fp16.py: the same
    skipped steps and loss scales as every other engine."""
    from test_fp16 import EXPECTED_SCALES, EXPECTED_SKIPPED, OVERFLOWS

    summary, rows = run_inprocess(tmp_path, "profile=amp-fp16-offload-opt", *FP16, hooks=overflow_at(OVERFLOWS))
    assert summary["status"] == "completed" and summary["profile"] == "amp-fp16-offload-opt"
    assert [r["loss_scale"] for r in rows] == EXPECTED_SCALES
    assert [r["skipped"] for r in rows] == EXPECTED_SKIPPED


@pytest.mark.slow
def test_train_bf16_offload_opt_resumes_as_uninterrupted(tmp_path):
    """The bf16 profile through the CLI's loop: 8 steps in one go, and 4 + 4 with a resume, give the same losses."""
    common = ["profile=amp-bf16-offload-opt", "train.max_steps=8", "checkpoint.every_steps=4"]
    whole, rows = run_inprocess(tmp_path / "a", *common, "run_name=whole")
    run_inprocess(tmp_path / "b", *common, "run_name=split", "train.max_steps=4")
    resumed, rows2 = run_inprocess(tmp_path / "b", *common, "run_name=split")
    assert resumed["status"] == "completed" and resumed["resumed_from"]
    assert losses(rows)[4:] == losses(rows2)[-4:]
