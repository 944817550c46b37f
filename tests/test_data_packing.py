"""Padding-free instruction batches: samples packed back to back without attending to each other, the same loss
as the padded run's step by step (fp32), tokens in the loss counted, the packed shape planned."""

import json
import os
import random
import signal

import pytest
import torch

from helpers import compare, losses, needs_deepspeed, run_inprocess
from helpers.hf import WORDS, make_model_dir, write_jsonl
from launcher.config.load import load_config
from launcher.data import load_data
from launcher.data.pack import deal, pack_blocks, plan_step, split_to
from launcher.model.build import load_tokenizer

TOL = 1e-5  # relative, per step, fp32 (issue 17)


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path / "cache"))


def qa(n: int, seed: int = 0, long: int = 12) -> list[dict]:
    """Prompt/response records of random lengths (mean well under half of seq_len 64)."""
    rnd = random.Random(seed)
    return [{"prompt": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, long))) + " ?",
             "response": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 10))) + " ."} for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 with the test tokenizer (made from a config, nothing downloaded)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    d = make_model_dir(str(tmp_path_factory.mktemp("qwen2")))
    tok = AutoTokenizer.from_pretrained(d)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


# ---- the packing plan (pure)


def test_pack_blocks_first_fit_decreasing_and_micro_batches():
    lengths = [30, 10, 25, 40, 5, 60, 12, 8]
    blocks = pack_blocks(lengths, 64)
    assert sorted(i for b in blocks for i in b) == list(range(8))  # every sample once
    assert all(sum(lengths[i] for i in b) <= 64 for b in blocks)
    assert len(blocks) == 4  # 190 tokens need at least 3; first-fit decreasing gives 4 here
    assert pack_blocks(lengths, 64) == blocks  # deterministic
    mbs = plan_step(lengths, 64, 2)
    assert len(mbs) == 2 and [len(m) for m in mbs] == [2, 2]
    # every micro-batch needs a row: blocks are split until there are enough
    more = split_to(pack_blocks([5] * 8, 64), [5] * 8, 4)
    assert len(more) == 4 and sorted(i for b in more for i in b) == list(range(8))
    assert [len(m) for m in deal(more, [5] * 8, 4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        split_to([[0]], [5], 2)


def test_packed_batch_layout(llama, tmp_path):
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa(16))
    cfg = load_config(None, [f"model.name={llama}", f"data.source={src}", "data.seq_len=64"])
    tok = load_tokenizer(cfg)
    data = load_data(cfg, len(tok), tok)
    assert data.packed and "packed padding-free" in data.description
    step = data.step(0, 16, 16, 0, 1, cfg.seed)
    (b,) = step.batches
    assert b["input_ids"].shape[0] < 16 and b["input_ids"].shape[1] <= 64  # fewer rows than samples
    assert b["use_cache"] is False and b["num_items_in_batch"] == step.tokens_in_loss
    pos, labels, ids = b["position_ids"], b["labels"], b["input_ids"]
    starts = (pos == 0).nonzero().tolist()
    # every sample (and the padding tail) starts at position 0; its first token is never a target
    assert all(labels[r, c] == -100 for r, c in starts)
    # the padded layout of the same step holds the same tokens and the same targets
    padded = data._padded(list(range(16)))
    assert step.tokens == sum(len(data.example(i)[0]) for i in range(16))
    assert int((ids != data.pad_id).sum()) == step.tokens == int((padded["input_ids"] != data.pad_id).sum())
    targets = padded["labels"][:, 1:]
    assert sorted(labels[labels != -100].tolist()) == sorted(targets[targets != -100].tolist())
    assert int((labels != -100).sum()) == step.tokens_in_loss


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_rows_do_not_attend_across_samples(arch, request, tmp_path):
    """One packed row gives each sample exactly the loss it has alone (the block-diagonal mask and restarting
    positions), on the model itself."""
    from transformers import AutoModelForCausalLM

    d = request.getfixturevalue(arch)
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa(6, seed=3))
    cfg = load_config(None, [f"model.name={d}", f"data.source={src}", "data.seq_len=64"])
    tok = load_tokenizer(cfg)
    data = load_data(cfg, len(tok), tok)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").float().train()
    rows = list(range(6))
    packed = {**data._packed(rows, 1)[0], "num_items_in_batch": 1.0}  # loss summed over tokens
    with torch.no_grad():
        alone = sum(float(model(input_ids=data.example(i)[0][None], labels=data.example(i)[1][None],
                                num_items_in_batch=1.0, use_cache=False).loss) for i in rows)
        together = float(model(**packed).loss)
        leaky = float(model(**{k: v for k, v in packed.items() if k != "position_ids"}).loss)  # attends across
    assert packed["input_ids"].shape[0] < 6
    assert abs(together - alone) / alone < 1e-5
    assert abs(leaky - alone) / alone > 1e-4


# ---- whole runs: packed and padded give the same loss curve


def runs(tmp_path, model, *extra, engine="amp", records=None):
    src = write_jsonl(str(tmp_path / "d.jsonl"), records or qa(96))
    common = [f"model.name={model}", f"data.source={src}", "data.seq_len=64", "train.max_steps=6",
              "train.warmup_steps=1", "train.micro_batch_size=4", "train.global_batch_size=8", "precision=fp32",
              f"engine={engine}", "sample_tokens=0", "checkpoint.save=false", *extra]
    from launcher.data.tokens import TokenData

    out = {}
    for mode in ("true", "false"):
        calls = []  # batches laid out packed: equal losses say nothing of whether the run packed
        packed = TokenData._packed
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TokenData, "_packed",
                       lambda self, *a, calls=calls, packed=packed, **k: calls.append(1) or packed(self, *a, **k))
            out[mode] = run_inprocess(tmp_path / "runs", *common, f"run_name={mode}", f"data.packing={mode}",
                                      fast=False)
        assert bool(calls) is (mode == "true"), f"data.packing={mode}: {len(calls)} packed layouts"
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_and_padded_runs_have_the_same_losses(arch, request, tmp_path):
    r = runs(tmp_path, request.getfixturevalue(arch))
    (sp, rp), (su, ru) = r["true"], r["false"]
    mx, _ = compare(losses(rp), losses(ru), f"{arch} packed vs padded")
    assert mx < TOL
    # the same samples per step: the same tokens in the loss and tokens processed, padding left out
    assert [x["tokens_in_loss"] for x in rp] == [x["tokens_in_loss"] for x in ru]
    assert [x["tokens"] for x in rp] == [x["tokens"] for x in ru]
    assert rp[-1]["tokens"] < 6 * 8 * 64  # padding is not counted
    for s in (sp, su):
        assert s["tokens_in_loss_per_s"] > 0 and s["tokens_in_loss_per_s"] < s["tokens_per_s"]
    assert all("tokens_in_loss_per_s" in x for x in rp)


BOTH = ["llama", pytest.param("qwen2", marks=pytest.mark.slow)]  # one architecture per engine in the default run


@needs_deepspeed
@pytest.mark.parametrize("arch", BOTH)
def test_packed_equals_padded_on_deepspeed(arch, request, tmp_path):
    r = runs(tmp_path, request.getfixturevalue(arch), "profile=zero2-fp32", engine="deepspeed")
    assert r["true"][0]["engine"] == "deepspeed"
    mx, _ = compare(losses(r["true"][1]), losses(r["false"][1]), "deepspeed packed vs padded")
    assert mx < TOL


@pytest.mark.parametrize("arch", BOTH)
def test_packed_equals_padded_on_fsdp(arch, request, tmp_path, monkeypatch):
    from launcher.config.profiles import PROFILES, Profile

    # fp32 FSDP exists for CPU tests only (tests/test_fsdp.py): bf16 is emulated and slow on most CPUs
    monkeypatch.setitem(PROFILES, "fsdp-fp32-offload", Profile("fsdp-fp32-offload", "fsdp", "fp32",
                                                               offload_optimizer=True, offload_param=True, speed_rank=3))
    r = runs(tmp_path, request.getfixturevalue(arch), "profile=fsdp-fp32-offload", engine="fsdp")
    assert r["true"][0]["engine"] == "fsdp"
    mx, _ = compare(losses(r["true"][1]), losses(r["false"][1]), "fsdp packed vs padded")
    assert mx < TOL


def test_packed_run_does_not_depend_on_micro_batch(llama, tmp_path):
    """A step takes the same samples whatever the micro-batch; packing lays them out differently only."""
    src = write_jsonl(str(tmp_path / "d.jsonl"), qa(64))
    common = [f"model.name={llama}", f"data.source={src}", "data.seq_len=64", "train.max_steps=4",
              "train.warmup_steps=1", "train.global_batch_size=8", "precision=fp32", "engine=amp", "sample_tokens=0",
              "checkpoint.save=false"]
    _, a = run_inprocess(tmp_path / "r", *common, "run_name=m8", "train.micro_batch_size=8", fast=False)
    _, b = run_inprocess(tmp_path / "r", *common, "run_name=m2", "train.micro_batch_size=2", fast=False)
    assert compare(losses(a), losses(b), "micro-batch 8 vs 2")[0] < TOL


# ---- planning the packed shape


def test_meta_trace_of_packed_batch_equals_real_cpu_run():
    """The block-diagonal mask costs a bias per layer (CPU's fused kernel keeps one for backward): the meta trace
    of a packed batch counts exactly what a real CPU run with packed position ids saves."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from launcher.plan.memory.shape import build_meta_model
    from launcher.plan.memory.trace import measure_step

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
    meta = build_meta_model(cfg, attn_implementation="sdpa").train()
    ids = torch.randint(0, 128, (2, 48))
    r = measure_step(real, ids, target="cpu", packed=True)
    m = measure_step(meta, ids.to("meta"), target="cpu", attention_kernel="flash", packed=True)
    plain = measure_step(meta, ids.to("meta"), target="cpu", attention_kernel="flash")
    assert m.saved == r.saved and m.peak == r.peak and m.peak_with_grads == r.peak_with_grads
    # the meta mask is held until the head's forward ends, the real one until the decoder's: an overestimate of at
    # most one boolean mask in the forward segment
    assert 0 <= m.segments["forward"]["peak"] - r.segments["forward"]["peak"] <= 2 * 48 * 48
    per_layer_bias = 2 * 48 * 48 * 4  # [b, 1, s, s] fp32
    assert m.saved["layer1"] - plain.saved["layer1"] >= per_layer_bias


def test_plan_counts_the_packed_mask(llama, tmp_path):
    from launcher.data import settle_formats
    from launcher.machine.hardware import Hardware
    from launcher.plan import planner

    src = write_jsonl(str(tmp_path / "d.jsonl"), qa(8))
    hw = Hardware(gpus=[], ram_total_bytes=32 << 30, ram_available_bytes=32 << 30, deepspeed=None, bitsandbytes=None)
    base = [f"model.name={llama}", f"data.source={src}", "data.seq_len=128", "device=cpu", "engine=amp",
            "precision=fp32", "train.micro_batch_size=8", "train.global_batch_size=8"]
    packed = planner.plan(settle_formats(load_config(None, base)), hw)
    padded = planner.plan(settle_formats(load_config(None, [*base, "data.packing=false"])), hw)
    assert packed.settings["packed"] and not padded.settings["packed"]
    a, b = packed.chosen_plan.parts["cpu"]["activations"], padded.chosen_plan.parts["cpu"]["activations"]
    assert a > b  # a bias per layer and the mask itself
    assert json.loads(json.dumps(packed.to_json()))["settings"]["packed"] is True


def test_resumed_packed_run_matches_uninterrupted(llama, tmp_path):
    from launcher.training.faults import Hooks

    src = write_jsonl(str(tmp_path / "d.jsonl"), qa(64))
    common = [f"model.name={llama}", f"data.source={src}", "data.seq_len=64", "train.max_steps=6",
              "train.warmup_steps=1", "train.micro_batch_size=4", "train.global_batch_size=8", "precision=fp32",
              "engine=amp", "sample_tokens=0", "checkpoint.every_steps=3"]
    _, full = run_inprocess(tmp_path / "a", *common, "run_name=full", fast=False)

    stop = Hooks(after_step=lambda step: os.kill(os.getpid(), signal.SIGTERM) if step == 3 else None)
    s1, _ = run_inprocess(tmp_path / "b", *common, "run_name=cut", hooks=stop, fast=False)
    assert s1["status"] == "interrupted"
    s2, resumed = run_inprocess(tmp_path / "b", *common, "run_name=cut", fast=False)
    assert s2["resumed_from"] and compare(losses(resumed), losses(full), "resumed vs full")[0] < TOL
    assert resumed[-1]["tokens_in_loss"] == full[-1]["tokens_in_loss"]


@pytest.mark.slow
@pytest.mark.extended
def test_two_ranks_packed_match_one_rank(llama, tmp_path):
    """Each rank packs its half of a step; the loss is still the mean over the whole step's tokens in the loss."""
    from test_multirank import torchrun

    src = write_jsonl(str(tmp_path / "d.jsonl"), qa(64))
    common = [f"model.name={llama}", f"data.source={src}", "data.seq_len=64", "train.max_steps=4",
              "train.warmup_steps=1", "train.micro_batch_size=2", "train.global_batch_size=8", "precision=fp32",
              "profile=amp-fp32", "sample_tokens=0", "checkpoint.save=false", f"output_dir={tmp_path}", "device=cpu"]
    r = torchrun(2, *common, "run_name=two")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    two = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    _, one = run_inprocess(tmp_path, *common, "run_name=one", fast=False)
    assert compare(losses(two), losses(one), "2 ranks vs 1, packed")[0] < TOL
    assert [x["tokens_in_loss"] for x in two] == [x["tokens_in_loss"] for x in one]
