"""More room on a small card: the chunked loss, activation offload and the paged optimizer, each against the
plain path (loss and gradients), the planner's parts, and the real CPU run's bytes against the plan."""

from __future__ import annotations

import pytest
import torch

from helpers import FAST, compare, losses, needs_deepspeed, run_cli, run_inprocess
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.machine.hardware import GPUInfo, Hardware
from launcher.model.loss import HeadNotPlain, causal_lm_loss, chunk_rows, head_problem
from launcher.plan import planner, setting
from launcher.plan.memory.trace import measure_step
from launcher.plan.report import format_table
from launcher.units import GiB

QUIET = ["log.memory_interval_s=0", "checkpoint.save=false"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def llama(vocab=1000, hidden=64, layers=2, tie=False, positions=4096, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                       max_position_embeddings=positions, **kw)


def real(cfg, dtype=torch.float32, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype).train()


def grads_of(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def fake_hw(gpu_gib=8.0, ram_gib=32.0, capability=(8, 0)) -> Hardware:
    gpus = [GPUInfo(0, "Test GPU", int(gpu_gib * GiB), int(gpu_gib * GiB), capability, True, capability[0] >= 8)]
    return Hardware(gpus=gpus, ram_total_bytes=int(ram_gib * GiB), ram_available_bytes=int(ram_gib * GiB),
                    deepspeed="0.19.8")


# ------------------------------------------------------------------------------------------------
# The chunked loss: the plain loss and gradients, to the rounding of fp32


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_chunked_loss_and_gradients_equal_the_plain_path_in_fp32(tie):
    cfg = llama(tie=tie)
    model = real(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 40))
    labels = ids.clone()
    labels[0, :11] = -100  # a masked prompt
    labels[2, 30:] = -100  # padding
    for extra in ({}, {"num_items_in_batch": torch.tensor(57.0)}):
        batch = {"input_ids": ids, "labels": labels, **extra}
        ref_loss, ref = grads_of(model, batch)
        loss, got = grads_of(model, batch, chunked=True)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert set(got) == set(ref)
        worst = max(rel(got[n], ref[n]) for n in ref)
        print(f"tied={tie} {extra and 'num_items' or 'mean'}: loss rel {abs(float(loss) / float(ref_loss) - 1):.2e}, "
              f"worst gradient rel {worst:.2e}")
        assert worst <= 1e-5


def test_chunked_loss_under_bf16_autocast_and_with_lora():
    from peft import LoraConfig, get_peft_model

    cfg = llama()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    model = real(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = grads_of(model, batch)
        loss, got = grads_of(model, batch, chunked=True, autocast_dtype=torch.bfloat16)
    assert abs(float(loss) / float(ref_loss) - 1) < 1e-2
    assert max(rel(got[n], ref[n]) for n in ref) < 5e-2  # bf16: the same products, rounded in another order
    lora = get_peft_model(real(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ref_loss, ref = grads_of(lora, batch)
    loss, got = grads_of(lora, batch, chunked=True)
    assert all("lora_" in n for n in got) and set(got) == set(ref)
    assert abs(float(loss) / float(ref_loss) - 1) < 1e-5 and max(rel(got[n], ref[n]) for n in ref) < 1e-5


def test_chunk_rows_follow_the_vocabulary():
    assert chunk_rows(2048, 4096, 128256) == 64  # Llama-3-8B: 32 chunks of 64 rows
    assert chunk_rows(64, 128, 256) == 32
    assert chunk_rows(5, 64, 128256) == 1


def test_a_head_that_is_not_plain_gets_a_clear_message(tmp_path):
    from transformers import AutoModelForCausalLM, Gemma2Config

    gemma = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma)
    assert "final_logit_softcapping=30.0" in head_problem(model)
    with pytest.raises(HeadNotPlain, match="loss.chunked=off"):
        causal_lm_loss(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long, device="meta"),
                               "labels": torch.zeros(1, 4, dtype=torch.long, device="meta")}, chunked=True)
    # a model that changes the head's output without saying so in its config: caught at the first forward
    plain = real(llama())
    original = type(plain).forward

    def scaled(self, *a, **k):
        out = original(self, *a, **k)
        out.logits = out.logits * 2
        return out

    type(plain).forward = scaled
    try:
        with pytest.raises(HeadNotPlain, match="changed the output head's result"):
            causal_lm_loss(plain, {"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                   "labels": torch.zeros(1, 4, dtype=torch.long)}, chunked=True)
    finally:
        type(plain).forward = original
    # on the command line, before anything runs
    d = tmp_path / "gemma"
    gemma.save_pretrained(d)
    r = run_cli("plan", f"model.name={d}", "loss.chunked=on", "data.seq_len=32")
    assert r.returncode == 2 and "loss.chunked: got 'on'" in r.stderr and "final_logit_softcapping" in r.stderr
    assert "fix: loss.chunked=off" in r.stderr


# ------------------------------------------------------------------------------------------------
# The plan follows the setting


def plan_of(model_dir, *overrides, hw=None):
    cfg = load_config(None, [f"model.name={model_dir}", "data.seq_len=2048", "train.micro_batch_size=1",
                             "train.global_batch_size=1", "lora.r=16", "model.gradient_checkpointing=true",
                             *overrides])
    return planner.plan(cfg, hw or fake_hw(gpu_gib=80), ["amp-bf16"])


def test_llama3_8b_logits_drop_eightfold_with_chunking(tmp_path):
    d = tmp_path / "llama3-8b"
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                tie_word_embeddings=False).save_pretrained(d)
    plain = plan_of(d, "loss.chunked=off").get("amp-bf16")
    chunked = plan_of(d, "loss.chunked=on").get("amp-bf16")
    before, after = plain.parts["gpu"]["logits"], chunked.parts["gpu"].get("logits", 0)
    print(f"Llama-3-8B shape, seq 2048, micro-batch 1, QLoRA-style LoRA: logits {before / GiB:.2f} GiB -> "
          f"{after / GiB:.3f} GiB ({before / after:.1f}x)")
    assert before >= 8 * after and chunked.chunked_loss and not plain.chunked_loss
    assert "chunked loss" in chunked.setting
    # auto: on when the plain logits would take more than a tenth of the budget (a 24 GiB card here)
    auto = plan_of(d, "loss.chunked=auto", hw=fake_hw(gpu_gib=24)).get("amp-bf16")
    assert before > setting.CHUNK_SHARE * 24 * GiB and auto.chunked_loss
    small = plan_of("tiny", "loss.chunked=auto", "data.seq_len=64").get("amp-bf16")
    assert not small.chunked_loss


def test_real_cpu_run_saves_what_the_plan_says_at_a_128k_vocabulary():
    """A scaled-down model with Llama 3's vocabulary: the real CPU step's saved bytes and live-bytes peaks equal
    the meta trace's, chunked and plain; chunking cuts the head's peak by far more than 8x."""
    cfg = llama(vocab=128256, hidden=64, layers=2)
    model = real(cfg)
    from launcher.plan.memory.shape import build_meta_model

    meta = build_meta_model(cfg, attn_implementation="eager").train()
    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    peaks = {}
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        meta.zero_grad(set_to_none=True)
        r = measure_step(model, ids, target="cpu", chunked_loss=chunked)
        m = measure_step(meta, ids.to("meta"), target="cpu", chunked_loss=chunked)
        assert m.saved == r.saved and m.segments == r.segments, chunked
        peaks[chunked] = max(v["parts"].get("head_bwd", 0) + v["parts"].get("head", 0) for v in r.segments.values())
    print(f"head + loss peak, real CPU: {peaks[False]} B plain, {peaks[True]} B chunked")
    assert peaks[False] >= 8 * peaks[True]


# ------------------------------------------------------------------------------------------------
# Training: every engine, the plain curve


def count_chunked(monkeypatch) -> list:
    """A list that grows by one each time a real loss is taken in chunks (launcher.model.loss arms the head for it;
    the planner's traces on the meta device are not counted): the chunked and the plain loss agree to rounding,
    so only this tells that a run chunked."""
    from launcher.model import loss

    calls, armed = [], loss._armed_head

    def counted(model, labels, *args, **kwargs):
        if not labels.is_meta:
            calls.append(1)
        return armed(model, labels, *args, **kwargs)

    monkeypatch.setattr(loss, "_armed_head", counted)
    return calls


def run_plain_and_chunked(tmp_path, monkeypatch, *overrides, name=""):
    """(summary, rows) of a run with ``loss.chunked=off`` and of one with ``=on``; each checked to have taken its
    loss as asked."""
    calls = count_chunked(monkeypatch)
    s_ref, ref = run_inprocess(tmp_path, *overrides, "loss.chunked=off", f"run_name={name}plain")
    assert not calls, "loss.chunked=off took a loss in chunks"
    s, got = run_inprocess(tmp_path, *overrides, "loss.chunked=on", f"run_name={name}chunked")
    assert len(calls) >= s["steps"], f"loss.chunked=on chunked {len(calls)} losses in {s['steps']} steps"
    return (s_ref, ref), (s, got)


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["amp-fp32", pytest.param("zero2-fp32", marks=needs_deepspeed)])
def test_chunked_loss_trains_like_the_plain_loss_amp_and_zero2(tmp_path, monkeypatch, profile):
    (_, ref), (_, got) = run_plain_and_chunked(tmp_path, monkeypatch, *QUIET, f"profile={profile}", name=f"{profile}-")
    mx, _ = compare(losses(got), losses(ref), f"{profile} chunked vs plain")
    assert mx < 1e-5


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("profile,tol", [
    pytest.param("zero3-bf16-offload-all", 2e-2, marks=pytest.mark.extended),  # the longest: out of CI's box
    ("fsdp-bf16-offload", 2e-2)])
def test_chunked_loss_trains_like_the_plain_loss_zero3_and_fsdp(tmp_path, monkeypatch, profile, tol):
    (_, ref), (_, got) = run_plain_and_chunked(tmp_path, monkeypatch, *QUIET, f"profile={profile}")
    mx, _ = compare(losses(got), losses(ref), f"{profile} chunked vs plain")
    assert mx < tol


@pytest.mark.slow
@pytest.mark.extended
def test_chunked_loss_with_qlora(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    base = [*QUIET, "lora.r=8", "model.quantize=4bit", "precision=bf16", "engine=amp"]
    (_, ref), (_, got) = run_plain_and_chunked(tmp_path, monkeypatch, *base)
    mx, _ = compare(losses(got), losses(ref), "QLoRA chunked vs plain")
    assert mx < 2e-2


# ------------------------------------------------------------------------------------------------
# Activation offload


@pytest.mark.parametrize("ckpt", ["false", "true"])
def test_activation_offload_trains_exactly_like_the_plain_run(tmp_path, ckpt, monkeypatch):
    from launcher.model import actoffload

    packed = {"offloaded": 0, "stayed": 0}  # every saved tensor the offload hook saw, by what it did with it
    stays = actoffload.stays

    def counted(t):
        kept = stays(t)
        packed["stayed" if kept else "offloaded"] += 1
        return kept

    monkeypatch.setattr(actoffload, "stays", counted)
    common = [*QUIET, "profile=amp-fp32", f"model.gradient_checkpointing={ckpt}", "train.max_steps=8"]
    _, ref = run_inprocess(tmp_path, *common, "memory.offload_activations=off", "run_name=plain")
    assert packed == {"offloaded": 0, "stayed": 0}  # the plain run has no hook
    s, got = run_inprocess(tmp_path, *common, "memory.offload_activations=on", "run_name=offload")
    assert packed["offloaded"] > 0  # on the CPU the copies are exact, so only this tells the run offloaded
    if ckpt == "false":  # each linear's weight is saved for the input gradient, and stays
        assert packed["stayed"] > 0
    assert losses(got) == losses(ref)  # the same bytes, copied there and back
    assert s["gradient_checkpointing"] is (ckpt == "true")


@pytest.mark.parametrize("ckpt", [False, True])
def test_offloaded_bytes_traced_on_meta_equal_a_real_run(ckpt):
    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import enable_checkpointing

    cfg = llama(vocab=256)
    model = real(cfg)
    meta = build_meta_model(cfg, attn_implementation="eager").train()
    if ckpt:
        enable_checkpointing(model)
        enable_checkpointing(meta)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    plain = measure_step(model, ids, target="cpu")
    model.zero_grad(set_to_none=True)
    r = measure_step(model, ids, target="cpu", offload_activations=True)
    m = measure_step(meta, ids.to("meta"), target="cpu", offload_activations=True)
    assert (m.offloaded, m.offload_copied, m.segments) == (r.offloaded, r.offload_copied, r.segments)
    assert r.offloaded > 0 and r.peak < plain.peak
    if ckpt:  # what the checkpointed layers keep, their inputs, is what goes to the CPU
        assert r.offloaded >= plain.saved["layer0"] + plain.saved["layer1"]


def test_planner_moves_offloaded_activations_to_the_cpu_and_picks_offload_last(tmp_path):
    d = tmp_path / "long"
    llama(vocab=1000, hidden=512, layers=8, positions=16384).save_pretrained(d)
    base = [f"model.name={d}", "data.seq_len=16384", "train.micro_batch_size=1", "train.global_batch_size=1",
            "lora.r=16", "loss.chunked=on"]
    off = planner.plan(load_config(None, [*base, "model.gradient_checkpointing=true",
                                          "memory.offload_activations=off"]), fake_hw(gpu_gib=80), ["amp-bf16"])
    on = planner.plan(load_config(None, [*base, "model.gradient_checkpointing=true",
                                         "memory.offload_activations=on"]), fake_hw(gpu_gib=80), ["amp-bf16"])
    a, b = off.get("amp-bf16"), on.get("amp-bf16")
    moved = b.parts["cpu"]["offloaded_activations"]
    assert b.offload_activations and moved >= 8 * 16384 * 512 * 2  # every layer's bf16 input at least
    # the GPU peak (in backward, when the top layers' inputs are consumed already) falls by most of what moved
    assert a.gpu_bytes - b.gpu_bytes >= 0.5 * moved and b.cpu_bytes > a.cpu_bytes
    # auto: only when nothing else fits; find the GPU budget between the two peaks
    budget = (a.gpu_bytes + b.gpu_bytes) / 2 / GiB
    auto = planner.plan(load_config(None, [*base, f"memory.gpu_budget={budget:.3f}"]), fake_hw(gpu_gib=80),
                        ["amp-bf16"])
    row = auto.get("amp-bf16")
    assert row.fits and row.offload_activations and row.checkpointing and "activations offloaded" in row.setting
    roomy = planner.plan(load_config(None, base), fake_hw(gpu_gib=80), ["amp-bf16"]).get("amp-bf16")
    assert roomy.fits and not roomy.offload_activations
    # the offload variant fails on the host budget: the setting without it is still tried, and fits
    host = (a.cpu_bytes + b.cpu_bytes) / 2 / GiB
    tight = planner.plan(load_config(None, [*base, "model.gradient_checkpointing=true", f"memory.cpu_budget={host:.3f}",
                                            f"memory.gpu_budget={a.gpu_bytes / GiB + 1:.3f}"]),
                         fake_hw(gpu_gib=80), ["amp-bf16"]).get("amp-bf16")
    assert tight.fits and not tight.offload_activations and tight.cpu_bytes == a.cpu_bytes
    assert "+ act. offload" in format_table(on) and "+ act. offload" not in format_table(off)


# ------------------------------------------------------------------------------------------------
# Paged 8-bit AdamW


@pytest.mark.slow
def test_paged_adamw8bit_needs_cuda_and_says_so(tmp_path):
    with pytest.raises(ConfigError, match="paged_adamw8bit.*CUDA.*fix: train.optimizer=adamw8bit"):
        run_inprocess(tmp_path, "train.optimizer=paged_adamw8bit", "lora.r=8")
    r = run_cli("train", *FAST, f"output_dir={tmp_path}", "device=cpu", "train.optimizer=paged_adamw8bit", "lora.r=8")
    assert r.returncode == 2 and "train.optimizer=adamw8bit" in r.stderr
    assert not list(tmp_path.iterdir())  # refused before a run directory was made


@pytest.mark.gpu
def test_paged_adamw8bit_trains_qlora_on_cuda(tmp_path):
    pytest.importorskip("bitsandbytes")
    s, rows = run_inprocess(tmp_path, "device=cuda", "lora.r=8", "model.quantize=4bit", "engine=amp",
                            "train.optimizer=paged_adamw8bit")
    assert s["status"] == "completed" and "PagedAdamW8bit" in s["optimizer"]
    assert rows[-1]["loss"] < rows[0]["loss"]
