"""The planner's view of the AMP optimizer-offload profiles (launcher/plan/memory/states.py, host.py, steptime.py):
their bytes by part on the GPU and the host, their step priced with the CPU AdamW and the copies, and the choice: they
win where plain AMP (and ZeRO-2) do not fit the GPU, and lose to plain AMP where it does.
"""

from __future__ import annotations

from test_planner import fake_hw
from test_steptime import machine

from launcher.config.load import load_config
from launcher.plan import planner
from launcher.units import GiB

BASE = ["model.name=llama-125m", "data.seq_len=128", "train.micro_batch_size=1", "train.global_batch_size=1",
        "model.gradient_checkpointing=true", "memory.cpu_budget=32"]


def plan(*extra, **kw):
    return planner.plan(load_config(None, [*BASE, *extra]), fake_hw(gpu_gib=80, ram_gib=64, capability=(8, 0)), **kw)


def test_model_states_by_part():
    p = plan("memory.gpu_budget=40")
    n = p.model["params"]
    row = p.get("amp-bf16-offload-opt")
    gpu, fb = row.phases["optimizer_step"], row.phases["forward_backward"]
    assert gpu["weights"] == 2 * n and "optimizer_states" not in gpu and "master_weights" not in gpu
    assert "gradients" not in gpu  # every gradient left during backward
    largest = p.model["counts"]["largest_param"]
    assert fb["gradients"] == 2 * 2 * largest < n  # two parameters' gradients in flight, not the model's
    cpu = row.host_phases["train"]
    assert cpu["master_weights"] == 4 * n and cpu["gradients"] == 4 * n and cpu["optimizer_states"] == 8 * n
    assert cpu["buffers"] == 2 * n and row.pinned_bytes == 2 * n  # the one transfer block, registered exactly
    acc = plan("memory.gpu_budget=40", "train.global_batch_size=4").get("amp-bf16-offload-opt")
    assert acc.phases["forward_backward"]["gradients"] == 2 * n  # accumulating: 16-bit gradients on the GPU
    assert row.gpu_bytes < min(p.get("zero2-bf16").gpu_bytes, p.get("amp-bf16").gpu_bytes)


def test_chosen_where_plain_amp_does_not_fit_and_not_where_it_does():
    roomy = plan("memory.gpu_budget=40")
    assert roomy.chosen == "amp-bf16"  # everything fits: no offload
    amp, off = roomy.get("amp-bf16").gpu_bytes, roomy.get("amp-bf16-offload-opt").gpu_bytes
    budget = (amp + off) / 2 / GiB
    tight = plan(f"memory.gpu_budget={budget}")
    assert not tight.get("amp-bf16").fits and not tight.get("zero2-bf16").fits
    assert tight.chosen == "amp-bf16-offload-opt", tight.reason
    assert tight.get("zero2-bf16-offload-opt").fits  # both offloads fit: AMP's goes first on the tie


def test_priced_with_the_cpu_optimizer_and_the_copies():
    """Priced on a machine: the CPU AdamW's measured speed, gradients down during backward, weights up beside the
    update; slower than plain AMP where both fit, so the priced plan keeps AMP."""
    p = plan("memory.gpu_budget=40", machine=machine())
    off, amp = p.get("amp-bf16-offload-opt"), p.get("amp-bf16")
    assert off.step_s is not None and off.time_parts["optimizer"] > 10 * amp.time_parts["optimizer"]
    assert off.step_s > amp.step_s and p.chosen == "amp-bf16"
    budget = (amp.gpu_bytes + off.gpu_bytes) / 2 / GiB
    tight = plan(f"memory.gpu_budget={budget}", machine=machine())
    assert tight.chosen == "amp-bf16-offload-opt", tight.reason


def test_zero_offload_buckets_sized_by_the_plan_not_the_model():
    """ZeRO-2 optimizer offload: unpriced, a bucket of at most 1/8 of the gradients (the others leave while backward
    goes on); priced, the fastest that fits, smaller than the model; ZeRO-2 without offload keeps them all in one.
    The run's ds_config.json takes the row's bucket (launcher.plan.resolve)."""
    from dataclasses import replace

    from launcher.config.profiles import PROFILES, resolve_ds_config
    from launcher.plan.buckets import OFFLOAD_BUCKETS

    p = plan("memory.gpu_budget=40")
    n = p.model["params"]
    assert p.get("zero2-bf16").reduce_bucket_size == n
    off = p.get("zero2-bf16-offload-opt")
    assert p.model["hidden_size"] ** 2 <= off.reduce_bucket_size <= n // OFFLOAD_BUCKETS
    priced = plan("memory.gpu_budget=40", machine=machine()).get("zero2-bf16-offload-opt")
    assert priced.reduce_bucket_size < n and priced.fits
    ds = resolve_ds_config(replace(PROFILES["zero2-bf16-offload-opt"], reduce_bucket_size=off.reduce_bucket_size),
                           micro_batch=1, accumulation=1, world=1, grad_clip=1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.0, hidden_size=p.model["hidden_size"], pin_memory=True, trainable=n)
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == off.reduce_bucket_size


def test_a_bucket_as_large_as_the_gradients_overlaps_nothing():
    """The step-time model: with ZeRO-2 offload, the share of the gradients in the last bucket is copied after
    backward; one bucket for everything exposes the whole copy."""
    from dataclasses import replace

    from test_steptime import ops

    from launcher.config.profiles import PROFILES
    from launcher.plan import steptime

    counts = plan("memory.gpu_budget=40").model["counts"]
    c = type("C", (), {**counts, "trainable_tensors": counts.get("trainable_tensors", 0)})

    p = PROFILES["zero2-bf16-offload-opt"]
    kw = dict(ops=ops(), counts=c, micro_batch=2, accumulation=1, seq_len=64, pinned=True)
    whole = steptime.predict(replace(p, reduce_bucket_size=c.total), machine(), **kw)
    eighth = steptime.predict(replace(p, reduce_bucket_size=c.total // 8), machine(), **kw)
    assert whole.parts["copies"] > eighth.parts["copies"]


def test_refused_with_bitsandbytes_and_next_on_the_oom_ladder():
    """bitsandbytes' quantization and 8-bit optimizers are refused with the reason (not a CPU optimizer); an AMP run
    out of memory with checkpointing on moves to its optimizer offload first (the same engine, the next rank)."""
    from launcher.config.profiles import PROFILES
    from launcher.plan import availability
    from launcher.plan.ladder import Rung, next_move

    hw = fake_hw(gpu_gib=80, ram_gib=64, capability=(8, 0), bnb="0.49.0")
    for extra, why in (("model.quantize=4bit", "without optimizer offload"), ("train.optimizer=adamw8bit", "CPU")):
        avail = availability.assess(load_config(None, [*BASE, "lora.r=8" if "quantize" in extra else "lora.r=0",
                                                       extra]), hw)
        assert why in avail.problems["amp-bf16-offload-opt"]
    avail = availability.assess(load_config(None, BASE), hw)
    usable = avail.usable()
    move = next_move(Rung(1, 1, True, "amp-bf16"), usable)
    assert move.kind == "profile" and move.to.profile == "amp-bf16-offload-opt"
    assert PROFILES[move.to.profile].offload_optimizer


def test_without_step_times_the_amp_family_goes_before_zero():
    """Unpriced on a GPU: plain AMP, then its optimizer offload, then ZeRO-2, its offload, FSDP2, ZeRO-3 (a ZeRO-1/2
    profile is chosen over the AMP family only where it is priced faster or AMP cannot run)."""
    from launcher.plan import availability

    names = [p.name for p in availability.assess(load_config(None, BASE), fake_hw(capability=(8, 0))).usable()]
    assert names[:5] == ["amp-bf16", "amp-bf16-offload-opt", "zero2-bf16", "zero2-bf16-offload-opt",
                         "fsdp-bf16-offload"], names


def test_several_ranks_never_get_it():
    """It has no gradient all-reduce: planned for two ranks it is shown, not chosen, with the reason; asked by
    name for two ranks it is refused before anything loads."""
    import pytest

    from launcher.config.schema import ConfigError
    from launcher.plan import availability, resolve

    hw = fake_hw(gpu_gib=80, ram_gib=64, capability=(8, 0))
    cfg = load_config(None, [*BASE, "train.global_batch_size=2"])
    p = planner.plan(cfg, hw, world=2)
    row = p.get("amp-bf16-offload-opt")
    assert not row.available and availability.ONE_RANK in row.why_not
    with pytest.raises(ConfigError, match="one rank"):
        resolve.resolve(load_config(None, [*BASE, "train.global_batch_size=2", "profile=amp-bf16-offload-opt"]), hw,
                        world=2)
