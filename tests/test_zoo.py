"""The architecture zoo: every family a VPS user fine-tunes (tests/helpers/zoo.py), mixture-of-experts included,
planned and trained as the command line does.

- the planner's activation bytes (its meta-device trace) against the bytes a real CPU step saves for backward,
  and the step's live-bytes peak: within 0.1% (MoE: the routed tokens' offsets, a few bytes a layer, are the
  difference), fp32 and, for the MoE families, under bf16 autocast;
- every family trains a few steps on AMP fp32 from a saved model directory (plan, load, loss finite);
- LoRA with ``all-linear`` adapts the experts of a MoE model (the plan's trainable count is the run's), and
  ``vramfit export --merge`` reloads and generates;
- slow tests: every family on DeepSpeed ZeRO-2, the MoE ones on FSDP and ZeRO-3 offload.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from helpers import FAST, THREADS, needs_deepspeed, run_cli
from helpers.zoo import MOE, ZOO

TOLERANCE = 0.001  # relative, on saved bytes and on the peak


def saved_bytes(config, autocast=None):
    """(real CPU trace, meta trace) of one training step at batch 2, sequence 64."""
    from transformers import AutoModelForCausalLM

    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import measure_step

    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    meta = build_meta_model(config, attn_implementation="eager", dtype=torch.float32)
    real.train()
    meta.train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    kw = dict(target="cpu", autocast_policy="cpu", autocast_dtype=autocast)
    return measure_step(real, ids, real_autocast=autocast is not None, **kw), measure_step(meta, ids.to("meta"), **kw)


@pytest.mark.parametrize("family", list(ZOO))
def test_the_plans_activations_are_what_a_real_step_saves(family):
    real, meta = saved_bytes(ZOO[family]())
    assert abs(meta.saved_total - real.saved_total) <= TOLERANCE * real.saved_total, (meta.saved, real.saved)
    assert abs(meta.peak - real.peak) <= TOLERANCE * real.peak, (meta.peak, real.peak)


@pytest.mark.parametrize("family", MOE)
def test_a_moe_traces_under_bf16_autocast_as_it_runs(family):
    real, meta = saved_bytes(ZOO[family](), torch.bfloat16)
    # autocast's weight copies are their own line in the meta trace; a real run saves them with the activations
    planned = meta.saved_total + meta.autocast_cache
    assert abs(planned - real.saved_total) <= 0.02 * real.saved_total, (planned, real.saved_total)


def model_dir(tmp_path, family) -> str:
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / family)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(ZOO[family]()).save_pretrained(path)
    return path


def train_family(tmp_path, family, *overrides):
    from launcher.config.load import load_config
    from launcher.training.loop import train

    cfg = load_config(None, [*FAST, "train.max_steps=3", "train.warmup_steps=1", f"train.threads={THREADS}",
                             "model.gradient_checkpointing=false", "loss.chunked=off", "memory.offload_activations=off",
                             f"output_dir={tmp_path / 'runs'}", "device=cpu", f"model.name={model_dir(tmp_path, family)}",
                             *overrides])
    return train(cfg)


# the default run trains one family of each kind (Llama-like, Gemma-like, GPT-2-like, every MoE); the slow run all
EVERY_RUN = ("llama3", "gemma3", "gpt2", *MOE)


@pytest.mark.parametrize("family", [f if f in EVERY_RUN else pytest.param(f, marks=pytest.mark.slow) for f in ZOO])
def test_every_family_trains_on_amp(tmp_path, family):
    s = train_family(tmp_path, family, "profile=amp-fp32", "checkpoint.save=false")
    assert s["status"] == "completed" and s["steps"] == 3 and math.isfinite(s["final_loss"]), s


def test_lora_on_a_moe_adapts_its_experts_and_the_merged_model_reloads_and_generates(tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    from launcher.config.load import load_config
    from launcher.model.hfconfig import load
    from launcher.model.targets import with_experts
    from launcher.plan.memory.shape import count_params

    s = train_family(tmp_path, "qwen3_moe", "profile=amp-fp32", "lora.r=4", "sample_tokens=4")
    assert s["status"] == "completed", s
    said = [ln.split("] ", 1)[-1] for ln in capfd.readouterr().err.splitlines() if "] LoRA r=4" in ln]
    assert said and "+ the experts' gate_up_proj, down_proj" in said[0] and "router stays frozen" in said[0], said
    # the plan counts what the run trains: attention adapters plus r x experts x (out + in) per expert weight
    path = str(tmp_path / "qwen3_moe")
    config = load(path)
    planned = count_params(config, 4, with_experts(("all-linear",), "auto", True)).trainable
    attention_only = count_params(config, 4, ("all-linear",)).trainable
    assert planned == attention_only + 2 * 4 * 8 * ((64 + 64) + (64 + 32)), (planned, attention_only)
    assert f"{planned / 1e6:.3f}M trainable" in said[0]
    merged = tmp_path / "merged"
    r = run_cli("export", s["run_dir"], "--merge", "--out", str(merged))
    assert r.returncode == 0, r.stderr
    model = AutoModelForCausalLM.from_pretrained(str(merged))
    base = AutoModelForCausalLM.from_pretrained(path)
    moved = [n for n, p in model.named_parameters() if "experts" in n and not torch.equal(p, base.get_parameter(n))]
    assert moved, "the merged experts are the base's: the adapter on them was lost"
    out = model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    assert load_config(None, ["lora.experts=false"]).lora.experts == "false"


@pytest.mark.parametrize("family", list(ZOO))  # about a second each
def test_every_family_takes_lora_on_all_linear_layers_and_its_merged_export_reloads_and_generates(tmp_path, family):
    """LoRA with the default targets (all linear layers, a MoE's experts too) trains, the adapter merges into the
    base (vramfit export --merge), and the merged folder loads with transformers alone and generates; the merged
    weights moved from the base's where adapters were (every adapted module's weight)."""
    from transformers import AutoModelForCausalLM

    from launcher.model.export import export

    s = train_family(tmp_path, family, "profile=amp-fp32", "lora.r=4", "train.lr=1e-2")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"]), s
    merged = str(tmp_path / "merged")
    export(s["run_dir"], merged, merge=True)
    model = AutoModelForCausalLM.from_pretrained(merged)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / family))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, base.get_parameter(n))}
    assert moved and all("norm" not in n and "embed" not in n for n in moved), sorted(moved)
    if family in MOE:
        assert any("experts" in n for n in moved), sorted(moved)
    out = model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_lora_experts_false_leaves_them_out_and_true_on_a_dense_model_is_refused(tmp_path):
    from launcher.config.load import load_config
    from launcher.config.schema import ConfigError

    s = train_family(tmp_path, "mixtral", "profile=amp-fp32", "lora.r=4", "lora.experts=false", "checkpoint.save=false")
    assert s["status"] == "completed"
    with pytest.raises(ConfigError, match=r"lora\.experts: got 'true'.*no expert weights.*fix: lora\.experts=auto"):
        train_family(tmp_path, "llama3", "lora.r=4", "lora.experts=true")
    with pytest.raises(ConfigError, match=r"lora\.experts"):
        load_config(None, ["lora.experts=maybe"])


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("family", list(ZOO))
def test_every_family_trains_on_zero2(tmp_path, family):
    s = train_family(tmp_path, family, "profile=zero2-fp32", "checkpoint.save=false")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"]), s


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["fsdp-bf16-offload", pytest.param("zero3-bf16-offload-all", marks=needs_deepspeed)])
@pytest.mark.parametrize("family", MOE)
def test_moe_with_lora_on_its_experts_trains_on_the_sharded_engines(tmp_path, family, profile):
    s = train_family(tmp_path, family, f"profile={profile}", "lora.r=4", "checkpoint.save=false")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"]), s
    plan = json.load(open(os.path.join(s["run_dir"], "plan.json")))
    assert plan is not None


def test_a_model_whose_trace_fails_is_planned_from_a_counted_estimate_and_trains(tmp_path, monkeypatch, capfd):
    """The planner degrades instead of blocking: a trace that raises (a model whose forward cannot run on meta)
    leaves weights and states exact, activations counted from the config, the table marked, and the run goes on."""
    from launcher.config.load import load_config
    from launcher.machine.hardware import probe
    from launcher.plan import planner, report, run_activations

    def broken(*a, **k):
        raise RuntimeError("this forward cannot run on the meta device")

    path = model_dir(tmp_path, "qwen3_moe")
    traced = planner.plan(load_config(None, [f"model.name={path}", "data.seq_len=64", "lora.r=4"]), probe())
    monkeypatch.setattr(run_activations, "estimate_activations", broken)
    monkeypatch.setattr(run_activations, "compose_every", lambda *a, **k: None)
    cfg = load_config(None, [f"model.name={path}", "data.seq_len=64", "lora.r=4"])
    counted = planner.plan(cfg, probe())
    assert counted.chosen is not None and "this forward cannot run" in counted.activations_counted
    table = report.format_table(counted)
    assert "ESTIMATE: the activation trace of Qwen3Moe failed on the meta device" in table, table
    assert counted.to_json()["activations_counted"] == counted.activations_counted
    a, b = traced.chosen_plan, counted.chosen_plan
    states = ("weights", "optimizer_states", "master_weights")
    assert {k: a.parts["cpu"].get(k) for k in states} == {k: b.parts["cpu"].get(k) for k in states}
    # the count is a bound of the same size as the trace: within a factor of two of it here
    assert 0.5 < b.parts["cpu"]["activations"] / a.parts["cpu"]["activations"] < 2.0, (a.parts, b.parts)
    s = train_family(tmp_path, "qwen3_moe", "lora.r=4", "checkpoint.save=false")
    assert s["status"] == "completed"
    assert "warning: the plan is an estimate: the activation trace of Qwen3Moe failed" in capfd.readouterr().err


@pytest.mark.parametrize("family", list(ZOO))
def test_the_counted_estimate_is_a_bound_over_the_trace(family):
    from launcher.plan.memory.estimate import counted_activations
    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import TraceSettings, measure_step

    config = ZOO[family]()
    meta = build_meta_model(config, attn_implementation="eager")
    meta.train()
    traced = measure_step(meta, torch.zeros(2, 64, dtype=torch.long, device="meta"), target="cpu", autocast_policy="cpu")
    counted = counted_activations(config, TraceSettings(batch_size=2, seq_len=64, target="cpu",
                                                        attn_implementation="eager"), 0, "test")
    assert traced.peak <= counted.peak <= 2.5 * traced.peak, (counted.peak, traced.peak)


@pytest.mark.parametrize("device,capability,dtype,kernel", [
    ("cuda", (8, 0), torch.float32, "eager"), ("cuda", (9, 0), torch.float16, "eager"),
    ("cuda", (8, 6), torch.bfloat16, None), ("cuda", (7, 5), torch.float16, None), ("cpu", None, torch.float32, None)])
def test_the_experts_run_a_kernel_that_takes_their_dtype(device, capability, dtype, kernel):
    from launcher.model.build import experts_kernel

    assert experts_kernel(device, capability, dtype) == kernel


def test_qlora_of_a_moe_quantizes_the_linear_layers_and_says_the_experts_stay_16_bit(tmp_path, capfd):
    pytest.importorskip("bitsandbytes")
    s = train_family(tmp_path, "qwen3_moe", "model.quantize=4bit", "lora.r=4", "checkpoint.save=false")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"]), s
    err = capfd.readouterr().err
    assert "Linear4bit" in err and "the experts' 4 stacked weights" in err and "bitsandbytes quantizes linear layers only" in err


def test_dropout_with_the_experts_adapted_is_refused_before_loading_by_plan_and_train(tmp_path):
    from launcher.config.load import load_config
    from launcher.config.schema import ConfigError
    from launcher.machine.hardware import probe
    from launcher.plan import planner

    path = model_dir(tmp_path, "qwen3_moe")
    cfg = load_config(None, [f"model.name={path}", "lora.r=4", "lora.dropout=0.05"])
    with pytest.raises(ConfigError, match=r"lora\.dropout: got 0\.05 .*no dropout; fix: lora\.dropout=0, or lora\.experts=false"):
        planner.plan(cfg, probe())
    with pytest.raises(ConfigError, match=r"lora\.dropout: got 0\.05"):
        train_family(tmp_path, "qwen3_moe", "lora.r=4", "lora.dropout=0.05")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "nothing written"
    s = train_family(tmp_path, "qwen3_moe", "lora.r=4", "lora.dropout=0.05", "lora.experts=false", "checkpoint.save=false")
    assert s["status"] == "completed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_moe_step_is_priced_by_the_experts_each_token_is_routed_to(dtype):
    """The experts' grouped matmuls (no formula in torch's FLOP counter) count 2 x routed rows x in x out forward and
    twice that backward: the step is priced by active parameters, not by all the experts."""
    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import measure_step

    def matmul_flops(config):
        meta = build_meta_model(config, dtype=dtype)
        meta.train()
        t = measure_step(meta, torch.zeros(2, 64, dtype=torch.long, device="meta"), target="cpu", autocast_policy="cpu")
        return sum(k[2] * c for k, c in t.ops.items() if k[0] == "matmul")

    moe = ZOO["qwen3_moe"]()
    rows = 2 * 64 * moe.num_experts_per_tok
    h, i = moe.hidden_size, moe.moe_intermediate_size
    experts = 3 * 2 * rows * (h * 2 * i + i * h) * moe.num_hidden_layers  # forward + backward (2x)
    dense_part = matmul_flops(moe) - experts
    assert dense_part > 0
    four = ZOO["qwen3_moe"]()
    four.num_experts_per_tok = 4  # twice the routed rows: the experts' share doubles, the rest stays
    assert matmul_flops(four) - dense_part == 2 * experts


def test_a_peft_without_lora_on_parameters_is_refused_for_the_experts_with_the_fix(tmp_path, monkeypatch):
    from launcher.config.schema import ConfigError
    from launcher.model import lora

    monkeypatch.setattr(lora, "_peft_adapts_parameters", lambda: False)
    with pytest.raises(ConfigError, match=r"lora\.experts: .*needs peft 0\.17 or newer.*fix: pip install -U peft, or "
                                          r"lora\.experts=false"):
        train_family(tmp_path, "qwen3_moe", "lora.r=4")
    s = train_family(tmp_path, "qwen3_moe", "lora.r=4", "lora.experts=false", "checkpoint.save=false")
    assert s["status"] == "completed"
