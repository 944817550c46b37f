"""The memory planner: traced activations against real CPU runs, model-state arithmetic, the plan contract.

Exact comparisons use fp32 and eager attention (the meta trace and the CPU kernels then run the same
ops); bf16 LayerNorm differs on purpose (the CPU kernel keeps mean/rstd in bf16, CUDA and meta in fp32).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from launcher.config.load import load_config
from launcher.machine.hardware import GPUInfo, Hardware
from launcher.model.targets import adapted as lora_target_names
from launcher.plan import advice, planner, report
from launcher.plan.memory.estimate import estimate_activations
from launcher.plan.memory.shape import build_meta_model, count_params
from launcher.plan.memory.trace import TraceSettings, enable_checkpointing, measure_step, trace_depth
from launcher.units import GiB


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny real CPU runs are dominated by thread hand-offs on a busy 2-core machine; one thread is faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_configs():
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    return {
        "llama": LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        "gpt2": GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        "qwen2": Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2),
        "neox": GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                              num_attention_heads=4),
    }


def real_and_meta(cfg, attn="eager", dtype=torch.float32, checkpointing=False, every=1):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    meta = build_meta_model(cfg, attn_implementation=attn, dtype=dtype)
    if checkpointing:
        enable_checkpointing(real, every)
        enable_checkpointing(meta, every)
    real.train()
    meta.train()
    return real, meta


def fake_hw(gpu_gib=16.0, ram_gib=32.0, capability=(7, 5), deepspeed="0.19.8", bnb=None) -> Hardware:
    gpus = [GPUInfo(0, "Test GPU", int(gpu_gib * GiB), int(gpu_gib * GiB), capability, True, capability[0] >= 8)] \
        if gpu_gib else []
    return Hardware(gpus=gpus, ram_total_bytes=int(ram_gib * GiB), ram_available_bytes=int(ram_gib * GiB),
                    deepspeed=deepspeed, bitsandbytes=bnb)


# ------------------------------------------------------------------------------------------------
# Activations: meta trace == real CPU run


@pytest.mark.parametrize("arch", ["llama", "gpt2", "neox"])
@pytest.mark.parametrize("checkpointing,every", [(False, 1), (True, 1), (True, 2)],
                         ids=["plain", "checkpointing", "every-2nd-layer"])
def test_meta_trace_equals_real_cpu_run(arch, checkpointing, every):
    cfg = tiny_configs()[arch]
    real, meta = real_and_meta(cfg, checkpointing=checkpointing, every=every)
    if every > 1:
        from launcher.model.checkpointing import checkpointed_layers

        assert checkpointed_layers(real) == checkpointed_layers(meta) == [True, False]
    for seq in (16, 48):
        ids = torch.randint(0, cfg.vocab_size, (2, seq))
        r = measure_step(real, ids, target="cpu")
        m = measure_step(meta, ids.to("meta"), target="cpu")
        # bytes saved for backward, by region (checkpointed layers keep only what runs outside the checkpoint)
        assert m.saved == r.saved, seq
        assert r.saved_total > 0
        # the live-bytes peak of the step, without and with parameter gradients, in every segment
        assert m.peak == r.peak and m.peak_parts == r.peak_parts, seq
        assert m.peak_with_grads == r.peak_with_grads, seq
        assert m.segments == r.segments, seq


def test_checkpointing_keeps_layer_inputs_only():
    cfg = tiny_configs()["llama"]
    plain = measure_step(real_and_meta(cfg)[1], torch.zeros(2, 48, dtype=torch.long, device="meta"))
    ckpt = measure_step(real_and_meta(cfg, checkpointing=True)[1], torch.zeros(2, 48, dtype=torch.long, device="meta"))
    per_input = 2 * 48 * cfg.hidden_size * 4
    assert ckpt.saved["layer1"] == per_input  # the layer's input hidden states, nothing else
    assert plain.saved["layer1"] > 5 * per_input
    assert ckpt.peak < plain.peak


@pytest.mark.parametrize("every", [1, 2])
def test_plain_trace_after_checkpointed_one_is_plain(every):
    """The planner traces one cached meta model at every setting: a step without checkpointing after a
    checkpointed one is the step of a model never checkpointed (no leftover flag or input-grad hook)."""
    from launcher.model.checkpointing import disable

    cfg = tiny_configs()["llama"]
    ids = torch.zeros(2, 48, dtype=torch.long, device="meta")
    fresh = measure_step(build_meta_model(cfg, lora_r=4).train(), ids)  # LoRA: the embeddings are frozen
    meta = build_meta_model(cfg, lora_r=4).train()
    for _ in range(2):  # two checkpointed traces in a row, as the planner makes them
        enable_checkpointing(meta, every)
        measure_step(meta, ids)
        for p in meta.parameters():
            p.grad = None
    disable(meta)
    for p in meta.parameters():  # as the planner does before each trace
        p.grad = None
    again = measure_step(meta, ids)
    assert again.ops == fresh.ops and again.segments == fresh.segments and again.saved == fresh.saved


@pytest.mark.parametrize("arch,checkpointing", [("llama", False), ("gpt2", False), ("llama", True)])
def test_autocast_emulation_matches_torch_autocast(arch, checkpointing):
    """On meta, autocast is emulated; with the CPU op lists it must match a real torch.autocast('cpu') run."""
    cfg = tiny_configs()[arch]
    real, meta = real_and_meta(cfg, checkpointing=checkpointing)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    kw = dict(autocast_dtype=torch.bfloat16, autocast_policy="cpu", target="cpu")
    r = measure_step(real, ids, real_autocast=True, **kw)
    m = measure_step(meta, ids.to("meta"), **kw)
    assert m.peak == r.peak
    assert m.peak_with_grads == r.peak_with_grads
    assert m.autocast_cache > 0  # weight copies are counted on their own line


def test_fused_attention_emulation_matches_cpu_sdpa():
    """The fused-kernel stand-in saves what torch's fused CPU kernel saves (out + log-sum-exp, GQA too)."""
    cfg = tiny_configs()["llama"]
    real, meta = real_and_meta(cfg, attn="sdpa")
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    r = measure_step(real, ids, target="cpu")
    m = measure_step(meta, ids.to("meta"), target="cpu", attention_kernel="flash")
    math = measure_step(meta, ids.to("meta"), target="cpu", attention_kernel="math")
    assert m.saved == r.saved and m.peak == r.peak
    assert math.saved_total > m.saved_total  # the math fallback keeps the attention matrix


@pytest.mark.parametrize("checkpointing,autocast,every,layers", [(False, None, 1, 6), (True, torch.bfloat16, 1, 6),
                                                                   (True, None, 2, 6), (True, None, 3, 7)])
def test_depth_extrapolation_is_exact(checkpointing, autocast, every, layers):
    """Memory and the op record of the full depth, from two shallow traces (every k-th layer checkpointed:
    linear per k layers)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    s = TraceSettings(batch_size=2, seq_len=64, autocast_dtype=autocast, gradient_checkpointing=checkpointing,
                      checkpoint_every=every, attention_kernel="flash")
    est = estimate_activations(cfg, s)
    full = trace_depth(cfg, layers, s)
    assert est.peak == full.peak
    assert est.peak_with_grads == full.peak_with_grads
    assert est.saved["layers"] == full.saved_layers
    assert est.ops == full.ops


@pytest.mark.parametrize("layers,every", [(6, 2), (7, 3), (7, 2)], ids=["top-plain", "top-checkpointed", "odd"])
@pytest.mark.parametrize("lora,autocast", [(0, None), (4, torch.bfloat16)], ids=["full", "lora-autocast"])
def test_every_kth_layer_composed_from_none_and_all(layers, every, lora, autocast):
    """The search's every-k-th-layer settings come from the traces with no and with every layer checkpointed:
    the op record exactly, the peaks within the tolerance the planner checks once per model."""
    from transformers import LlamaConfig

    from launcher.plan.memory.estimate import COMPOSE_TOLERANCE, compose_every

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    for batch in (2, 5):
        s = TraceSettings(batch_size=batch, seq_len=64, lora_r=lora, autocast_dtype=autocast, target="cpu",
                          attention_kernel="flash", gradient_checkpointing=True, checkpoint_every=every)
        made, traced = compose_every(cfg, s), estimate_activations(cfg, s, exact=False)
        assert made is not None and made.composed
        assert made.ops == traced.ops
        for f in ("peak", "peak_with_grads"):
            assert abs(getattr(made, f) - getattr(traced, f)) <= COMPOSE_TOLERANCE * getattr(traced, f), f


def test_composition_refused_where_it_does_not_hold():
    """GPT-2 with its top layer not checkpointed composes 6-8% high: the once-per-model check refuses it, so
    those settings are traced."""
    from transformers import GPT2Config

    from launcher.plan.memory.estimate import compose_every

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=6, n_head=4, n_positions=256)
    s = TraceSettings(batch_size=2, seq_len=64, lora_r=4, target="cpu", attention_kernel="flash",
                      gradient_checkpointing=True, checkpoint_every=2)
    assert compose_every(cfg, s) is None


def test_op_record_counts_the_work():
    """The time model's input: forward + backward matmul FLOPs are 6 x parameters x tokens for the linear
    layers (plus the attention kernel's); recompute adds the checkpointed layers' forward once more."""
    from launcher.model.presets import preset_config

    cfg = preset_config("tiny")
    s = TraceSettings(batch_size=2, seq_len=64, target="cpu", attention_kernel="flash")
    plain = estimate_activations(cfg, s)
    ckpt = estimate_activations(cfg, TraceSettings(**{**s.__dict__, "gradient_checkpointing": True}))

    def flops(ops, kind):
        return sum(c * f for (k, _d, f, _b), c in ops.items() if k == kind)

    tokens = 2 * 64
    linear = sum(p.numel() for n, p in build_meta_model(cfg).named_parameters() if n.endswith("proj.weight")
                 or n == "lm_head.weight")
    assert flops(plain.ops, "matmul") == 6 * linear * tokens
    # Recompute runs each checkpointed layer's forward again, up to the last tensor backward needs:
    # non-reentrant checkpointing stops early (torch.utils.checkpoint), so down_proj, whose output no
    # backward reads, is not run again: q, k, v, o, gate and up are.
    h, i = cfg.hidden_size, cfg.intermediate_size
    recomputed = 2 * tokens * cfg.num_hidden_layers * (4 * h * h + 2 * h * i)
    assert flops(ckpt.ops, "matmul") - flops(plain.ops, "matmul") == recomputed
    assert flops(ckpt.ops, "attention") > flops(plain.ops, "attention") > 0


def test_other_architectures_trace_on_meta():
    """No formula per family: learned positions (OPT), no SDPA support (Gemma 2 runs eager), mixture of
    experts (Mixtral's grouped matmuls under autocast)."""
    import transformers as T

    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    for cfg in (T.OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **common),
                T.Gemma2Config(intermediate_size=128, num_key_value_heads=2, head_dim=16, **common),
                T.MixtralConfig(intermediate_size=128, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, **common)):
        est = estimate_activations(cfg, TraceSettings(batch_size=2, seq_len=32, autocast_dtype=torch.bfloat16,
                                                      attention_kernel="flash"))
        assert est.peak > est.saved["layers"] > 0, type(cfg).__name__


def test_seven_b_traces_in_seconds():
    from launcher.model.presets import preset_config

    trace_depth(preset_config("tiny"), 1, TraceSettings(batch_size=1, seq_len=8))  # imports, out of the timing
    t = time.perf_counter()
    est = estimate_activations(preset_config("llama-7b"),
                               TraceSettings(batch_size=1, seq_len=2048, param_dtype=torch.bfloat16,
                                             attention_kernel="flash"))
    assert time.perf_counter() - t < 10
    # fused attention: no s x s matrix per layer (32 heads x 2048^2 x 2 B = 256 MiB would dominate)
    assert est.saved_per_layer < 512 * 2**20


# ------------------------------------------------------------------------------------------------
# Parameter counts


def test_param_counts_match_real_models():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for name, cfg in tiny_configs().items():
        if name == "qwen2":  # same shape as llama here
            continue
        real = AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in real.parameters())
        c = count_params(cfg, lora_r=4)
        assert c.total == n, name
        assert c.embeddings + c.layers + c.head + c.other == n
        peft = get_peft_model(real, LoraConfig(r=4, target_modules=lora_target_names(real)))
        assert c.adapters == sum(p.numel() for p in peft.parameters() if p.requires_grad), name
        assert "lm_head" not in " ".join(lora_target_names(real))
    assert count_params(tiny_configs()["gpt2"]).tied_embeddings


# ------------------------------------------------------------------------------------------------
# Model states: the per-parameter arithmetic


def tiny_plan(*overrides, hw=None, **kw):
    cfg = load_config(None, ["model.name=tiny", "data.seq_len=64", "train.micro_batch_size=2",
                             "train.global_batch_size=8", *overrides])
    return planner.plan(cfg, hw or fake_hw(capability=(8, 0)), **kw)


def test_model_state_lines_are_parameter_arithmetic():
    p = tiny_plan("precision=bf16")
    n = p.model["params"]
    z2 = p.get("zero2-bf16").phases
    assert z2["optimizer_step"]["weights"] == 2 * n
    assert z2["optimizer_step"]["master_weights"] == 4 * n
    assert z2["optimizer_step"]["optimizer_states"] == 8 * n
    assert z2["optimizer_step"]["gradients"] == (2 + 4) * n  # 16-bit partition + its fp32 copy in the step
    amp = p.get("amp-bf16").phases["optimizer_step"]
    assert amp["weights"] == 4 * n and amp["gradients"] == 4 * n and amp["optimizer_states"] == 8 * n
    assert p.get("amp-bf16").phases["forward_backward"]["autocast_weight_cache"] > 0
    off = p.get("zero2-bf16-offload-opt")
    assert off.parts["gpu"]["weights"] == 2 * n and "optimizer_states" not in off.parts["gpu"]
    assert off.parts["cpu"]["master_weights"] == 4 * n and off.parts["cpu"]["optimizer_states"] == 8 * n
    for r in p.profiles:  # the named parts add up to the peaks
        assert sum(r.parts["gpu"].values()) == r.gpu_bytes and sum(r.parts["cpu"].values()) == r.cpu_bytes
        assert r.parts["gpu"]["cuda_context"] == planner.CUDA_CONTEXT_BYTES


def test_lora_quantize_and_8bit_adam_arithmetic():
    p = tiny_plan("precision=bf16", "lora.r=8")
    c = p.model["counts"]
    n, a = c["total"], c["adapters"]
    assert p.model["trainable_params"] == a
    assert p.get("zero2-bf16").phases["optimizer_step"]["weights"] == 2 * (n + a)
    assert p.get("zero2-bf16").phases["optimizer_step"]["optimizer_states"] == 8 * a
    assert p.get("amp-bf16").phases["optimizer_step"]["weights"] == 2 * n + 4 * a  # 16-bit frozen base, fp32 adapters
    q = tiny_plan("precision=bf16", "lora.r=8", "model.quantize=4bit", "train.optimizer=adamw8bit")
    amp = q.get("amp-bf16").phases["optimizer_step"]
    lin = c["linear_weights"]
    assert amp["weights"] == round(2 * (n - lin) + lin * planner.QUANT_BYTES_PER_PARAM["4bit"] + 4 * a)
    assert amp["optimizer_states"] == 2 * a
    assert q.get("zero2-bf16").available is False and "AMP path only" in q.get("zero2-bf16").why_not


# ------------------------------------------------------------------------------------------------
# The plan: contract, choice, budgets, suggestions


def test_plan_json_contract():
    p = tiny_plan()
    doc = json.loads(json.dumps(p.to_json()))
    assert {"profiles", "chosen", "reason", "budget"} <= set(doc)
    assert set(doc["budget"]) >= {"gpu_bytes", "cpu_bytes", "gpu_source", "cpu_source"}
    for row in doc["profiles"]:
        assert {"profile", "gpu_bytes", "cpu_bytes", "fits", "parts", "speed_rank", "micro_batch", "why_not"} <= set(row)
        # NVMe offload rows add what goes to memory.nvme_path (docs/more-room.md)
        assert set(row["parts"]) == {"gpu", "cpu"} | ({"disk"} if "nvme" in row["profile"] else set())
    assert doc["chosen"] in [r["profile"] for r in doc["profiles"]]
    text = report.format_table(p)
    assert "chosen: " + doc["chosen"] in text and "GPU peak GiB" in text


def test_choice_precision_engines_and_ties():
    p = tiny_plan()  # capability 8.0: bf16; everything fits; rank 1 tie between amp and zero2 -> AMP (issue 43)
    assert p.settings["precision"] == "bf16" and p.chosen == "amp-bf16"
    assert {r.precision for r in p.profiles} == {"bf16"}
    assert tiny_plan(hw=fake_hw(capability=(7, 5))).chosen == "amp-fp16"
    assert tiny_plan("engine=deepspeed").chosen == "zero2-bf16"
    assert tiny_plan(hw=fake_hw(capability=(8, 0), deepspeed=None)).chosen == "amp-bf16"
    assert tiny_plan("engine=amp").chosen == "amp-bf16"
    assert tiny_plan("profile=zero3-bf16-offload-all").chosen == "zero3-bf16-offload-all"
    assert tiny_plan(hw=fake_hw(capability=(8, 0), deepspeed=None)).get("zero2-bf16").available is False


def test_cpu_target_puts_everything_on_the_cpu():
    p = tiny_plan(hw=fake_hw(gpu_gib=0))
    assert p.settings["device"] == "cpu" and p.settings["precision"] == "fp32"
    assert p.budget["gpu_bytes"] == 0
    chosen = p.chosen_plan
    assert chosen is not None and chosen.gpu_bytes == 0 and chosen.parts["gpu"] == {}
    assert chosen.parts["cpu"]["weights"] > 0 and chosen.parts["cpu"]["activations"] > 0
    assert all(not r.available for r in p.profiles if "offload" in r.profile)
    # ... unless that engine is asked for and all its profiles offload (FSDP), or the profile by name
    f = tiny_plan("engine=fsdp", "precision=bf16", hw=fake_hw(gpu_gib=0))
    assert f.chosen == "fsdp-bf16-offload" and not f.get("zero2-bf16-offload-opt").available
    assert tiny_plan("profile=zero2-bf16-offload-opt", hw=fake_hw(gpu_gib=0)).chosen == "zero2-bf16-offload-opt"


def test_budgets():
    hw = fake_hw(gpu_gib=10, ram_gib=20)
    cfg = load_config(None, ["memory.margin=0.2"])
    g, c, src = planner.budgets(cfg, hw, "cuda")
    assert g == int(10 * GiB * 0.8) and c == int(20 * GiB * 0.8) and "free" in src["gpu"]
    g, c, src = planner.budgets(load_config(None, ["memory.gpu_budget=6", "memory.cpu_budget=12"]), hw, "cuda")
    assert (g, c) == (6 * GiB, 12 * GiB) and "memory.gpu_budget" in src["gpu"]
    assert planner.budgets(cfg, fake_hw(gpu_gib=0), "cpu")[0] == 0


def test_auto_micro_batch_is_the_largest_power_of_two_that_fits():
    base = ["data.seq_len=512", "train.global_batch_size=4", "memory.cpu_budget=32"]
    amp = {"profiles": ["amp-bf16"]}
    big = tiny_plan(*base, "train.micro_batch_size=auto", "memory.gpu_budget=40", **amp)
    assert big.chosen_plan.micro_batch == 4
    one = tiny_plan(*base, "train.micro_batch_size=1", "memory.gpu_budget=40", **amp).chosen_plan
    two = tiny_plan(*base, "train.micro_batch_size=2", "memory.gpu_budget=40", **amp).chosen_plan
    budget = (one.gpu_bytes + two.gpu_bytes) / 2 / GiB  # room for micro-batch 1, not 2
    small = tiny_plan(*base, "train.micro_batch_size=auto", f"memory.gpu_budget={budget}", **amp)
    assert small.chosen_plan.micro_batch == 1 and small.micro_batch == 1


def test_nothing_fits_gives_suggestions_that_fit():
    base = ["model.name=tiny", "data.seq_len=1024", "train.micro_batch_size=8", "train.global_batch_size=8",
            "memory.cpu_budget=16", "model.gradient_checkpointing=false", "memory.offload_activations=off"]
    hw, amp = fake_hw(capability=(7, 5)), ["amp-fp16"]  # one profile: one trace family, a faster test
    roomy = planner.plan(load_config(None, base), hw, profiles=amp)
    least = min(r.gpu_bytes for r in roomy.profiles if r.available)
    base.append(f"memory.gpu_budget={(least - 2**20) / GiB}")  # just short of the smallest profile
    p = advice.add_suggestions(planner.plan(load_config(None, base), hw, profiles=amp), load_config(None, base), hw,
                               amp)
    assert p.chosen is None and "nothing fits" in p.reason
    assert p.suggestions and len(p.suggestions) == len(p.suggested_overrides)
    for text, ov in zip(p.suggestions, p.suggested_overrides):
        again = planner.plan(load_config(None, base + ov), hw, profiles=amp)
        assert again.chosen is not None, text
        assert f"{again.chosen_plan.gpu_bytes / GiB:.1f} GiB" in text  # the numbers said are the re-plan's


def test_seventy_b_plans_in_seconds(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name={tmp_path}", "data.seq_len=1024", "train.micro_batch_size=1",
                             "lora.r=16", "model.gradient_checkpointing=true"])
    t = time.perf_counter()
    p = planner.plan(cfg, fake_hw(gpu_gib=80, ram_gib=1024, capability=(9, 0)))
    assert time.perf_counter() - t < 20
    assert 70e9 < p.model["params"] < 71e9
    assert p.chosen is not None and not p.chosen_plan.lower_bound
    # 70.6B frozen bf16 parameters do not fit 80 GB next to anything else; ZeRO-3 parameter offload does
    assert p.get("zero2-bf16").fits is False


@pytest.mark.parametrize("checkpointing,autocast,attn", [(False, None, "flash"), (True, torch.bfloat16, "flash"),
                                                          (False, torch.bfloat16, "math")])
def test_micro_batch_extrapolation(checkpointing, autocast, attn):
    """The search prices every micro-batch from the traces of 2 and 3: the op record and the bytes saved for
    backward are exact; a segment's peak is exact unless its moment moves with the micro-batch (weight casts
    under autocast), and then a little low, which is why the planner re-traces the setting it keeps (the
    last assertion)."""
    from launcher.plan.memory.estimate import _batch_extrapolate

    cfg = tiny_configs()["llama"]
    s = TraceSettings(batch_size=2, seq_len=48, autocast_dtype=autocast, gradient_checkpointing=checkpointing,
                      attention_kernel=attn, attn_implementation="sdpa")
    one, two = trace_depth(cfg, 2, s), trace_depth(cfg, 2, TraceSettings(**{**s.__dict__, "batch_size": 3}))
    for b in (4, 8):
        direct = trace_depth(cfg, 2, TraceSettings(**{**s.__dict__, "batch_size": b}))
        ext = _batch_extrapolate(one, two, b)
        assert ext.ops == direct.ops and ext.saved == direct.saved, b
        for name, seg in direct.segments.items():
            got = ext.segments[name]["peak"]
            assert got == seg["peak"] if autocast is None else 0.97 * seg["peak"] <= got <= seg["peak"]
    est = estimate_activations(cfg, TraceSettings(**{**s.__dict__, "batch_size": 8}), exact=True)
    assert est.peak == trace_depth(cfg, 2, TraceSettings(**{**s.__dict__, "batch_size": 8})).peak


def test_chunked_loss_extrapolates_from_micro_batches_chunked_alike():
    """The chunked loss's ops change with the micro-batch (its chunks are rows of the batch): micro-batch 8 comes
    from 2 and 4, whose chunks are 8's scaled down, exactly; 6 has no two such below it and is traced."""
    from launcher.plan.memory.estimate import _batch_bases, _batch_extrapolate

    cfg = tiny_configs()["llama"]
    s = TraceSettings(batch_size=8, seq_len=48, gradient_checkpointing=True, attention_kernel="flash",
                      attn_implementation="sdpa", chunked_loss=True)
    assert _batch_bases(cfg, s) == (2, 4)
    assert _batch_bases(cfg, TraceSettings(**{**s.__dict__, "batch_size": 6})) is None
    assert _batch_bases(cfg, TraceSettings(**{**s.__dict__, "chunked_loss": False})) == (2, 3)
    at = {b: trace_depth(cfg, 2, TraceSettings(**{**s.__dict__, "batch_size": b})) for b in (2, 3, 4, 8)}
    wrong = _batch_extrapolate(at[2], at[3], 8)  # 2 and 3 cut their rows differently (here into as many chunks)
    assert wrong is None or wrong.ops != at[8].ops
    ext = _batch_extrapolate(at[2], at[4], 8, (2, 4))
    assert ext.ops == at[8].ops and ext.saved == at[8].saved
    assert all(ext.segments[k]["peak"] == v["peak"] for k, v in at[8].segments.items())


def test_alternatives_are_re_planned_priced_and_say_what_they_change(tmp_path):
    """A model whose 16-bit weights do not fit the card: 4-bit is among the alternatives with its tokens/s, the
    fastest first, each saying what it changes about the training; with something fitting, only faster ones."""
    from test_steptime import machine
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    base = [f"model.name={tmp_path}", "data.seq_len=256", "lora.r=16", "train.global_batch_size=4",
            "train.micro_batch_size=4", "memory.cpu_budget=32", "model.gradient_checkpointing=false"]
    hw, m, kept = fake_hw(gpu_gib=1.5, capability=(8, 0), bnb="0.50.2"), machine(), ["amp-bf16", "zero2-bf16"]
    cfg = load_config(None, base)
    p = advice.add_suggestions(planner.plan(cfg, hw, kept, machine=m), cfg, hw, kept, machine=m)
    assert p.chosen is None
    alts = p.alternatives
    assert alts and [a["tokens_per_s"] for a in alts] == sorted((a["tokens_per_s"] for a in alts), reverse=True)
    four = next(a for a in alts if "model.quantize=4bit" in a["overrides"])
    assert four["gpu_bytes"] <= four["gpu_budget"] and four["tokens_per_s"] > 0
    assert "changes numerics" in four["changes"]
    text = next(t for t in p.suggestions if t.startswith("model.quantize=4bit"))
    assert f"{four['tokens_per_s']:.0f} tokens/s" in text and "changes numerics" in text
    for a in alts:  # each is what planning the change gives
        again = planner.plan(load_config(None, base + a["overrides"]), hw, None if "profile=auto" in a["overrides"]
                             else kept, machine=m, exact_rows=False)
        assert again.chosen == a["profile"] and again.chosen_plan.tokens_per_s == pytest.approx(a["tokens_per_s"])
    # something fits: only alternatives predicted faster are listed, and the plan says it looked
    roomy = fake_hw(gpu_gib=40.0, capability=(8, 0), bnb="0.50.2")
    p = advice.add_suggestions(planner.plan(cfg, roomy, machine=m), cfg, roomy, machine=m, when_fits=True)
    assert p.chosen is not None and p.alternatives_tried
    assert all(a["tokens_per_s"] > p.chosen_plan.tokens_per_s for a in p.alternatives)
    assert "other ways, re-planned" in report.format_table(p)
