"""Fine-tuning a local HF model directory (a tiny random Llama + a word-level tokenizer, made on the spot)
on instruction records: LoRA on AMP and DeepSpeed (ZeRO-2, ZeRO-3 with offload), QLoRA, 8-bit AdamW,
the saved adapter, the merged export, and the sample after training."""

import os

import pytest
import torch

from helpers import compare, losses, needs_deepspeed, run_inprocess
from helpers.hf import make_model_dir, qa_records, write_jsonl
from launcher.config.schema import ConfigError
from launcher.training.faults import Hooks


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    model = make_model_dir(str(root / "model"))
    data = write_jsonl(str(root / "qa.jsonl"), qa_records("prompt_response"))
    return model, data


def lora_args(hf, *extra, steps=12):
    model, data = hf
    return [f"model.name={model}", f"data.source={data}", "lora.r=8", "lora.alpha=16", "data.seq_len=32",
            f"train.max_steps={steps}", "train.warmup_steps=2", "train.lr=2e-2", "train.micro_batch_size=4",
            "train.global_batch_size=8", "log.every_steps=1000", "sample_tokens=4", *extra]


class Capture:
    """Keeps the engine and a copy of every parameter as it was before the first update."""

    def __init__(self):
        self.engine, self.before = None, {}

    def hooks(self) -> Hooks:
        def before_step(step, engine):
            if self.engine is None:
                self.engine = engine
                self.before = {n: p.detach().clone() for n, p in engine.module().named_parameters()}
        return Hooks(before_step=before_step)


def falls(rows, by=0.3):
    ls = losses(rows)
    tail = sum(ls[-3:]) / 3
    assert tail < ls[0] - by, f"loss did not fall: first {ls[0]:.4f}, last three {ls[-3:]}"


def check_base_frozen(cap: Capture):
    after = dict(cap.engine.module().named_parameters())
    base = [n for n in cap.before if "lora_" not in n]
    assert base and all(torch.equal(cap.before[n], after[n].detach()) for n in base), "a base weight changed"
    assert all(not after[n].requires_grad for n in base)
    moved = [n for n in cap.before if "lora_B" in n and not torch.equal(cap.before[n], after[n].detach())]
    assert moved, "no adapter weight was trained"


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


IDS = torch.tensor([[2, 30, 31, 7, 32, 33, 7, 34, 67, 40, 65]])


def reload_adapter(model_dir, final):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), final)


@pytest.fixture(scope="module")
def amp_lora(hf, tmp_path_factory):
    """One LoRA run on AMP with gradient checkpointing: (summary, metrics rows, Capture)."""
    cap = Capture()
    a, ra = run_inprocess(tmp_path_factory.mktemp("amp"), *lora_args(hf, "engine=amp", "run_name=amp",
                                                                      "model.gradient_checkpointing=true"),
                          hooks=cap.hooks(), fast=False)
    return a, ra, cap


def test_lora_amp_then_reload_and_merge(hf, amp_lora, tmp_path):
    """LoRA on AMP (with gradient checkpointing), with or without DeepSpeed installed: the loss falls, base
    weights stay bit-identical, the saved adapter reloads to the same logits, and the merged export loads with
    plain transformers and gives base + adapter's logits."""
    from launcher.model.export import export

    a, ra, cap = amp_lora
    assert a["status"] == "completed" and a["engine"] == "amp"
    falls(ra)
    check_base_frozen(cap)
    final = os.path.join(a["run_dir"], "final")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(final))
    reloaded = reload_adapter(hf[0], final)
    trained = logits(cap.engine.module(), IDS)
    assert (logits(reloaded, IDS) - trained).abs().max() < 1e-5

    # the sample after training: the first record's prompt, greedy, in the summary and in sample.txt
    assert a["sample"]["prompt"] == "what is the color of the sky ?"
    assert "completion (" in open(os.path.join(a["run_dir"], "sample.txt")).read()

    out = str(tmp_path / "merged")
    msg = export(a["run_dir"], out, merge=True)
    assert "merged the LoRA adapter" in msg and "adapter_config.json" not in os.listdir(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(out)
    diff = (logits(merged, IDS) - trained).abs()
    print(f"merged vs base + adapter logits: max abs diff {diff.max():.2e}, mean {diff.mean():.2e}")
    assert diff.max() < 1e-4
    assert AutoTokenizer.from_pretrained(out).eos_token == "<eos>"
    with pytest.raises(ConfigError, match="already exists"):
        export(a["run_dir"], out, merge=True)
    assert "copied the LoRA adapter" in export(a["run_dir"], str(tmp_path / "adapter"))


@needs_deepspeed
def test_lora_deepspeed_follows_amp_and_reloads(hf, amp_lora, tmp_path):
    """LoRA on DeepSpeed ZeRO-2 fp32: the AMP run's loss curve, the base frozen, the adapter reloads."""
    _, ra, _ = amp_lora
    cap_ds = Capture()
    d, rd = run_inprocess(tmp_path, *lora_args(hf, "profile=zero2-fp32", "run_name=ds"), hooks=cap_ds.hooks(),
                          fast=False)
    assert d["engine"] == "deepspeed"
    mx, _ = compare(losses(rd), losses(ra), "LoRA zero2-fp32 vs amp-fp32 (+ checkpointing)")
    assert mx < 1e-4
    check_base_frozen(cap_ds)
    ds_final = os.path.join(d["run_dir"], "final")
    assert (logits(reload_adapter(hf[0], ds_final), IDS) - logits(cap_ds.engine.module(), IDS)).abs().max() < 1e-5


@needs_deepspeed
def test_lora_zero3_offload_saves_the_gathered_adapter(hf, tmp_path):
    """ZeRO-3 partitions every parameter; the adapter in final/ must hold full tensors, trained."""
    from safetensors.torch import load_file

    s, rows = run_inprocess(tmp_path, *lora_args(hf, "profile=zero3-bf16-offload-all", "run_name=z3", steps=10),
                            fast=False)
    assert s["status"] == "completed" and s["optimizer"] == "torch.optim.AdamW(fused=True)"  # offload without an op build
    falls(rows)
    final = os.path.join(s["run_dir"], "final")
    sd = load_file(os.path.join(final, "adapter_model.safetensors"))
    q = [k for k in sd if k.endswith("layers.0.self_attn.q_proj.lora_B.weight")]
    assert q and sd[q[0]].shape == (64, 8) and sd[q[0]].abs().sum() > 0
    assert len(sd) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers in 2 decoder layers, nothing else
    reload_adapter(hf[0], final)


QLORA_KINDS = {"avx512bf16-cpu": True, "plain-cpu": False}


@pytest.fixture(scope="module")
def qlora_runs(hf, tmp_path_factory):
    """The same QLoRA run with bitsandbytes' 4-bit layers built as on a CPU with AVX512-BF16 (where bitsandbytes
    repacks a layer for its fused kernel at the first eval forward) and as on one without, whatever CPU runs
    the test: kind -> (summary, metrics rows, Capture)."""
    import bitsandbytes.nn.modules as bnb_modules

    runs = {}
    for kind, avx in QLORA_KINDS.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bnb_modules, "has_avx512bf16", lambda avx=avx: avx)
            cap = Capture()
            s, rows = run_inprocess(tmp_path_factory.mktemp(kind), *lora_args(
                hf, "model.quantize=4bit", "run_name=q4", "data.eval_fraction=0.2", "train.eval_every=3", steps=10),
                hooks=cap.hooks(), fast=False)
            runs[kind] = (s, rows, cap)
    return runs


@pytest.mark.parametrize("kind", list(QLORA_KINDS))
def test_qlora_4bit(hf, qlora_runs, kind):
    """QLoRA: NF4 base (Params4bit, uint8 storage) that stays unchanged, fp32 adapters that train. engine=auto
    picks AMP and says why. Evals in the middle of the run and the sample at the end run in eval mode without
    gradients, where bitsandbytes on an AVX512-BF16 CPU would repack the weights into a layout that has no
    backward; vramfit keeps the plain layout."""
    s, rows, cap = qlora_runs[kind]
    assert s["status"] == "completed" and s["sample"] is not None and s["sample_error"] is None
    assert s["engine"] == "amp" and any("AMP path only" in r for r in s["reasons"]), s["reasons"]
    falls(rows, by=0.2)
    import bitsandbytes as bnb

    model = cap.engine.module()
    q4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(q4) == 14 and all(isinstance(m.weight, bnb.nn.Params4bit) and m.weight.dtype == torch.uint8
                                 and m.weight.quant_type == "nf4" for m in q4)
    assert not any(m.support_avx512bf16_for_cpu for m in q4)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in q4)
    check_base_frozen(cap)
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert all(p.dtype == torch.float32 for p in adapters)
    reload_adapter(hf[0], os.path.join(s["run_dir"], "final"))


def test_qlora_gives_the_same_losses_on_both_kinds_of_cpu(qlora_runs):
    a, b = (losses(qlora_runs[k][1]) for k in QLORA_KINDS)
    assert len(a) == 10 and a == b  # step for step


def test_4bit_cpu_packed_layout_fits_the_test_models(hf):
    """bitsandbytes' AVX512-BF16 path repacks a 4-bit weight (pure torch, so it runs on any CPU): the test
    model's and the stand-in's layers have the shapes it needs (whole 64-weight blocks), and the round trip
    gives the weight back bit for bit (the packed forward: the next test, on CPUs that have AVX512-BF16)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    from launcher.model.presets import PRESETS
    from launcher.model.quantize import quantize_in_place

    models = [AutoModelForCausalLM.from_pretrained(hf[0]),
              AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS["tiny"]))]
    for model in models:
        assert quantize_in_place(model, "4bit", "fp32", torch.device("cpu")) > 0
        for m in model.modules():
            if not isinstance(m, bnb.nn.Linear4bit):
                continue
            data, state = m.weight.data.clone(), m.weight.quant_state
            packed, state = F._convert_weight_packed_for_cpu(data, state)
            back, _ = F._convert_weight_packed_for_cpu_inverse(packed, state)
            assert torch.equal(back, data), f"{type(model).__name__}: the packed layout does not round-trip"


def _has_avx512bf16() -> bool:
    try:
        import bitsandbytes.functional as F
    except ImportError:
        return False
    return bool(F.has_avx512bf16())


@pytest.mark.skipif(not _has_avx512bf16(), reason="this CPU has no AVX512-BF16: bitsandbytes' packed 4-bit kernel "
                    "does not run here")
def test_4bit_packed_forward_agrees_with_the_plain_one(hf):
    """On a CPU with AVX512-BF16, a 4-bit layer repacked for bitsandbytes' fused kernel gives the plain layer's
    output within bf16 rounding."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM

    from launcher.model.quantize import quantize_in_place

    model = AutoModelForCausalLM.from_pretrained(hf[0])
    assert quantize_in_place(model, "4bit", "fp32", torch.device("cpu")) > 0
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers
    for m in layers:
        x = torch.randn(2, 3, m.in_features)
        plain = m(x).detach()
        m.weight.data, m.weight.quant_state = F._convert_weight_packed_for_cpu(m.weight.data.clone(),
                                                                               m.weight.quant_state)
        with torch.no_grad():
            torch.testing.assert_close(m.eval()(x), plain, atol=0.05, rtol=0.05)


def test_a_failing_sample_does_not_fail_the_run(hf, tmp_path, monkeypatch):
    """The sample after training is a courtesy: when it raises, the run is still completed, with final/, the
    last checkpoint and summary.json, and the summary says what went wrong."""
    from launcher.training import generate

    def boom(*a, **k):
        raise RuntimeError("shape '[64, 2]' is invalid for input of size 160")

    monkeypatch.setattr(generate, "greedy", boom)
    s, _ = run_inprocess(tmp_path, *lora_args(hf, "run_name=sample-fails", steps=2), fast=False)
    assert s["status"] == "completed" and s["sample"] is None
    assert s["sample_error"] == "RuntimeError: shape '[64, 2]' is invalid for input of size 160"
    assert os.path.isfile(os.path.join(s["run_dir"], "final", "adapter_model.safetensors")) and s["checkpoint"]
    import json

    on_disk = json.load(open(os.path.join(s["run_dir"], "summary.json")))
    assert on_disk["status"] == "completed" and on_disk["sample_error"] == s["sample_error"]


def test_adamw8bit_states_are_uint8(hf, tmp_path):
    """8-bit AdamW (full fine-tune): Adam's m and v of every tensor of >= 4096 elements are uint8 (blockwise
    quantized; bitsandbytes keeps smaller tensors' states in fp32), and the loss falls."""
    cap = Capture()
    s, rows = run_inprocess(tmp_path, *lora_args(hf, "lora.r=0", "train.optimizer=adamw8bit", "train.lr=5e-3",
                                                 "run_name=o8", steps=10), hooks=cap.hooks(), fast=False)
    assert s["optimizer"] == "bitsandbytes.optim.AdamW8bit"
    falls(rows)
    opt = cap.engine.optimizer
    big = [p for g in opt.param_groups for p in g["params"] if p.numel() >= 4096]
    assert big and all(opt.state[p]["state1"].dtype == torch.uint8 and opt.state[p]["state2"].dtype == torch.uint8
                       for p in big)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(os.path.join(s["run_dir"], "final")))


def test_preset_int8_lora_and_token_id_sample(tmp_path):
    """A preset has no tokenizer: 8-bit base weights quantized in place, LoRA on top, synthetic data, and the
    sample printed as token ids."""
    cap = Capture()
    # LLM.int8() runs its matmuls in fp16 on the CPU, slowly: one small step is enough to check the wiring
    s, _ = run_inprocess(tmp_path, "model.quantize=8bit", "lora.r=4", "run_name=p8", "train.max_steps=1",
                         "train.warmup_steps=0", "train.global_batch_size=2", "data.seq_len=16", "sample_tokens=2",
                         hooks=cap.hooks())
    import bitsandbytes as bnb

    q8 = [m for m in cap.engine.module().modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(q8) == 4 * 7 and all(m.weight.dtype == torch.int8 for m in q8)
    check_base_frozen(cap)
    assert len(s["sample"]["prompt"].split()) == 8 and len(s["sample"]["completion"].split()) == 2
    assert "prompt ids:" in open(os.path.join(s["run_dir"], "sample.txt")).read()


def test_bitsandbytes_options_refuse_deepspeed_and_auto_picks_amp():
    from launcher.config.load import load_config
    from launcher.machine.hardware import probe
    from launcher.plan.resolve import resolve

    with pytest.raises(ConfigError, match="train on the AMP path only"):
        load_config(None, ["engine=deepspeed", "model.quantize=4bit", "lora.r=8"])
    with pytest.raises(ConfigError, match="8-bit AdamW runs on the AMP path only"):
        load_config(None, ["engine=fsdp", "train.optimizer=adamw8bit"])
    hw = probe()
    if hw.deepspeed is not None:
        with pytest.raises(ConfigError, match="runs on the AMP path only; fix: profile=amp-fp32"):
            resolve(load_config(None, ["profile=zero2-fp32", "model.quantize=4bit", "lora.r=8", "device=cpu"]), hw)
    res = resolve(load_config(None, ["train.optimizer=adamw8bit", "device=cpu"]), hw)
    assert res.engine == "amp"
    assert hw.deepspeed is None or any("not DeepSpeed: train.optimizer=adamw8bit" in r for r in res.reasons)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [16, 1024, (1 << 22) + 48, (1 << 22) + 5])
def test_normal_16bit_draws_torch_values(dtype, n):
    """A preset's 16-bit weights drawn in fp32 blocks (the faster way) hold torch's own normal_ values for the same
    seed, but for the last 16 of a size that is not a multiple of 16, and the requested spread."""
    from launcher.model.materialize import normal_16bit

    torch.manual_seed(3)
    ref = torch.empty(n, dtype=dtype).normal_(0.0, 0.02)
    torch.manual_seed(3)
    got = normal_16bit(torch.empty(n, dtype=dtype), 0.0, 0.02)
    body = n - (n % 16 and 16)
    assert torch.equal(got[:body], ref[:body])
    if n >= 1024:
        assert abs(got.float().std().item() - 0.02) < 2e-3 and abs(got.float().mean().item()) < 2e-3
