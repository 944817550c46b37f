"""Preference tuning (task=dpo|orpo|simpo): the losses against the papers' formulas and TRL's own functions, the
prompt masked, the adapter-off reference against a frozen copy, a loaded adapter kept, the built-in task learnt,
the precomputed reference against the live one, resume, config refusals, pairs from files, and the plan."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import types

import pytest
import torch

from helpers import THREADS, compare, losses, needs_deepspeed, run_cli, run_inprocess
from helpers.hf import make_model_dir, write_jsonl
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.data.preference import synthetic_preferences
from launcher.model import preference as P
from launcher.training.faults import Hooks

# a short LoRA DPO run on the synthetic pairs (global batch 16 of 256 pairs, sequences of 32 tokens)
PREF = ["task=dpo", "lora.r=8", "train.max_steps=16", "train.warmup_steps=2", "train.micro_batch_size=8",
        "train.global_batch_size=16", "data.seq_len=32", "data.num_samples=256", "log.every_steps=1000",
        "sample_tokens=0", "log.report_to=none", "memory.cpu_budget=4"]


def _logps(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    # summed log-probs of completions of 5-40 tokens, and their counts
    counts = torch.randint(5, 40, (4, n), generator=g).float()
    per_token = -torch.rand(4, n, generator=g) * 3 - 0.05
    return per_token * counts, counts


def _max_diff(a, b):
    """The largest difference, relative to the value where it is above 1 (fp32 holds about 7 digits: a loss of 30
    is exact to 3e-6), printed with the mean."""
    d = (a.double() - b.double()).abs() / b.double().abs().clamp(min=1)
    print(f"max diff {d.max().item():.3e}, mean {d.mean().item():.3e} (relative above 1)")
    return d.max().item()


# ---------------------------------------------------------------------------------------------------- losses
def test_losses_equal_the_papers_formulas():
    """DPO (eq. 7 of arXiv:2305.18290), IPO (eq. 17 of arXiv:2310.12036, on per-token log-ratios), hinge (SLiC),
    ORPO (eqs. 4-7 of arXiv:2403.07691), SimPO (eq. 6 of arXiv:2405.14734), written out here in float64 and
    compared with vramfit's fp32 functions to 1e-6."""
    (pc, pr, rc, rr), (nc, nr, _, _) = _logps()
    beta = 0.1
    d = (pc.double() - rc.double()) - (pr.double() - rr.double())
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    want = -torch.log(sig(beta * d))
    assert _max_diff(P.dpo_losses(pc, pr, rc, rr, beta), want) < 1e-6
    assert _max_diff(P.dpo_losses(pc, pr, rc, rr, beta, "hinge"), torch.clamp(1 - beta * d, min=0)) < 1e-6
    h = (pc.double() - rc.double()) / nc.double() - (pr.double() - rr.double()) / nr.double()
    assert _max_diff(P.dpo_losses(pc, pr, rc, rr, beta, "ipo", nc, nr), (h - 1 / (2 * beta)) ** 2) < 1e-6
    ac, ar = pc / nc, pr / nr
    odds = lambda a: a.double() - torch.log(1 - torch.exp(a.double()))  # noqa: E731
    assert _max_diff(P.orpo_odds_term(ac, ar, beta), beta * torch.log(sig(odds(ac) - odds(ar)))) < 1e-6
    b, gamma = 2.0, 0.5
    assert _max_diff(P.simpo_losses(ac, ar, b, gamma), -torch.log(sig(b * (ac.double() - ar.double()) - gamma))) < 1e-6


def test_losses_equal_trls():
    """The same log-probs through TRL's own loss functions (CPO's, which holds SimPO and the sigmoid, hinge and
    IPO forms, and ORPO's odds-ratio loss), called unbound with their settings: equal to 1e-6 in fp32. DPO's
    forms are TRL's with the log-ratios (policy - reference) as input, as its DPO trainer forms them."""
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    (pc, pr, rc, rr), (nc, nr, _, _) = _logps(seed=1)
    dev = types.SimpleNamespace(device=torch.device("cpu"))

    def trl_cpo(loss_type, beta, c, r, gamma=0.0):
        me = types.SimpleNamespace(alpha=0.0, beta=beta, loss_type=loss_type, simpo_gamma=gamma, label_smoothing=0.0,
                                   accelerator=dev)
        return cpo.CPOTrainer.cpo_loss(me, c, r)[0]

    beta = 0.1
    assert _max_diff(P.dpo_losses(pc, pr, rc, rr, beta), trl_cpo("sigmoid", beta, pc - rc, pr - rr)) < 1e-6
    assert _max_diff(P.dpo_losses(pc, pr, rc, rr, beta, "hinge"), trl_cpo("hinge", beta, pc - rc, pr - rr)) < 1e-6
    assert _max_diff(P.dpo_losses(pc, pr, rc, rr, beta, "ipo", nc, nr),
                     trl_cpo("ipo", beta, (pc - rc) / nc, (pr - rr) / nr)) < 1e-6
    ac, ar = pc / nc, pr / nr
    assert _max_diff(P.simpo_losses(ac, ar, 2.0, 0.5), trl_cpo("simpo", 2.0, ac, ar, gamma=0.5)) < 1e-6
    me = types.SimpleNamespace(beta=beta, accelerator=dev)
    theirs = orpo.ORPOTrainer.odds_ratio_loss(me, ac, ar)[0]
    assert _max_diff(P.orpo_odds_term(ac, ar, beta), theirs) < 1e-6


def test_sequence_logps_masks_the_prompt_and_padding():
    """Only completion tokens count: the sum equals log_softmax gathered over the completion positions, and
    changing the logits at prompt and padding positions changes nothing."""
    data = synthetic_preferences(4, 16, 32, seed=3)
    b = data.batch([0, 1])
    assert b["input_ids"].shape[0] == 4  # 2 pairs: chosen, chosen, rejected, rejected
    p, c, r = data.pair(1)
    assert (b["labels"][1, :len(p)] == -100).all() and (b["labels"][1, len(p):] == torch.tensor(c)).all()
    assert (b["input_ids"][3, len(p):len(p) + len(r)] == torch.tensor(r)).all()
    logits = torch.randn(4, b["input_ids"].shape[1], 32)
    got, counts = P.sequence_logps(logits, b["labels"])
    lp = torch.log_softmax(logits, -1)
    for row in range(4):
        want = sum(lp[row, t - 1, b["labels"][row, t]] for t in range(1, b["labels"].shape[1])
                   if b["labels"][row, t] != -100)
        assert abs(got[row] - want) < 1e-5
    assert counts.tolist() == [len(c)] * 2 + [len(r)] * 2
    prompt_pos = torch.zeros_like(logits)
    prompt_pos[:, : len(p) - 1] = 100.0  # positions that predict prompt tokens
    assert torch.allclose(P.sequence_logps(logits + prompt_pos, b["labels"])[0], got)


def _lora_model(r=4, seed=0):
    from launcher.model.build import make_model

    cfg = load_config(None, [f"lora.r={r}", f"seed={seed}"])
    model = make_model(cfg)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.2)
    return model


def test_adapter_off_reference_equals_a_frozen_copy_of_the_base():
    """The reference with peft's adapter switched off equals the base alone (the peft model's copy with its
    LoRA layers removed); the policy with its adapter on does not."""
    model = _lora_model()
    frozen = copy.deepcopy(model).unload()
    b = synthetic_preferences(4, 32, 256, seed=0).batch([0, 1, 2])
    ref = P.reference_logps(model, b, adapter=True)
    want = P.sequence_logps(frozen(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])[0]
    assert _max_diff(ref, want.detach()) < 1e-6
    on = P.reference_logps(model, b, adapter=False)
    assert (on - want).abs().max() > 1e-3
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- training
def test_a_preference_eval_reports_its_loss_and_no_perplexity(tmp_path):
    summary, _ = run_inprocess(tmp_path, *PREF, "run_name=ev", "train.max_steps=2", "data.eval_fraction=0.1")
    assert summary["eval_loss"] is not None and summary["eval_perplexity"] is None  # exp of a DPO loss means nothing


def test_lora_dpo_learns_the_synthetic_preferences(tmp_path):
    """LoRA DPO on the built-in pairs: loss from ln 2 down, preference accuracy and margin up; accuracy >= 0.9
    at the end (16 steps of 16 pairs, a few seconds on 2 CPU cores)."""
    summary, rows = run_inprocess(tmp_path, *PREF, "run_name=dpo", fast=False)
    assert summary["status"] == "completed" and summary["task"] == "dpo" and summary["reference"] == "adapter_off"
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-6  # a new adapter adds 0: the policy is its reference
    acc = [r["preference_accuracy"] for r in rows]
    print(f"accuracy by step: {[round(a, 2) for a in acc]}; margin {rows[-1]['reward_margin']:.3f}; "
          f"{summary['elapsed_s']:.1f} s")
    assert summary["final_preference_accuracy"] >= 0.9 and min(acc[-4:]) >= 0.9
    assert rows[-1]["reward_margin"] > rows[1]["reward_margin"] > 0
    assert rows[-1]["loss"] < 0.6


def test_precomputed_reference_gives_the_same_curve_without_a_reference_pass(tmp_path, monkeypatch):
    """reference=precompute: the same loss curve as the live adapter-off reference within 1e-5 (fp32), and no
    reference pass while training (switching the adapter off would raise)."""
    _, live = run_inprocess(tmp_path, *PREF, "run_name=live", "train.max_steps=5", fast=False)

    def no(_model):
        raise AssertionError("a reference pass ran while training")

    monkeypatch.setattr(P, "adapter_off", no)
    summary, pre = run_inprocess(tmp_path, *PREF, "run_name=pre", "train.max_steps=5",
                                 "preference.reference=precompute", fast=False)
    assert summary["reference"] == "precompute"
    assert os.path.isfile(os.path.join(summary["run_dir"], "reference_logps.pt"))
    mx, _ = compare(losses(pre), losses(live), "precompute vs adapter_off")
    assert mx <= 1e-5


def test_dpo_from_a_loaded_adapter_starts_from_it(tmp_path):
    """model.adapter: the adapter's weights are the starting point on the meta-device build (the materializer
    does not initialise them again): the policy's log-probs equal peft's own loading of the same folder."""
    from peft import PeftModel

    from launcher.model.build import make_model

    src = _lora_model(r=4, seed=5)
    src.save_pretrained(str(tmp_path / "sft"), save_embedding_layers=False)
    cfg = load_config(None, [f"model.adapter={tmp_path / 'sft'}", "seed=5"])
    assert cfg.lora.r == 4  # from the adapter's config
    mine = make_model(cfg)
    base = make_model(load_config(None, ["seed=5"]))
    theirs = PeftModel.from_pretrained(base, str(tmp_path / "sft"))
    b = synthetic_preferences(4, 32, 256, seed=0).batch([0, 1])
    a = P.reference_logps(mine, b, adapter=False)
    assert _max_diff(a, P.reference_logps(theirs, b, adapter=False)) < 1e-5
    assert (a - P.reference_logps(mine, b, adapter=True)).abs().max() > 1e-3  # the adapter is not the fresh zero one


@pytest.mark.slow
def test_resume_after_sigterm_is_exact(tmp_path):
    """A DPO run stopped by SIGTERM after step 4 and resumed gives every step's loss of an uninterrupted run
    (fp32: bit for bit), with precomputed reference log-probs read back from the run directory."""
    steps = ["train.max_steps=8", "checkpoint.every_steps=4", "preference.reference=precompute"]
    _, full = run_inprocess(tmp_path, *PREF, *steps, "run_name=full", fast=False)
    stop = Hooks(after_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 4 else None)
    part, _ = run_inprocess(tmp_path, *PREF, *steps, "run_name=cut", hooks=stop, fast=False)
    assert part["status"] == "interrupted"
    again, rows = run_inprocess(tmp_path, *PREF, *steps, "run_name=cut", fast=False)
    assert again["resumed_from"].endswith("step-000004")
    mx, _ = compare(losses(rows), losses(full), "resumed vs uninterrupted")
    assert mx == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("task,extra", [("orpo", []), ("simpo", []), ("dpo", ["lora.r=0"])])
def test_orpo_simpo_and_full_dpo_learn(tmp_path, task, extra):
    """ORPO and SimPO (no reference) and full fine-tuning DPO (reference precomputed, no second model) reach
    preference accuracy >= 0.9 on the built-in pairs."""
    summary, rows = run_inprocess(tmp_path, *PREF, f"task={task}", *extra, "train.max_steps=24", fast=False)
    print(task, [round(r["preference_accuracy"], 2) for r in rows])
    assert summary["final_preference_accuracy"] >= 0.9
    if task == "dpo":
        assert summary["reference"] == "precompute"


@pytest.mark.slow
@pytest.mark.parametrize("profile,tol", [pytest.param("zero2-fp32", 1e-5, marks=needs_deepspeed),
                                         pytest.param("zero2-bf16", 2e-3, marks=needs_deepspeed),
                                         pytest.param("zero3-bf16-offload-all", 2e-3, marks=needs_deepspeed),
                                         ("fsdp-bf16-offload", 2e-3)])
def test_dpo_on_the_other_engines_follows_amp(tmp_path, profile, tol):
    """The preference loss goes through the engines' one forward_loss: DeepSpeed ZeRO-2 and ZeRO-3 with offload (CPU
    accelerator) and FSDP2 give AMP's DPO curve (fp32 within 1e-5 relative; bf16 within 2e-3)."""
    _, ref = run_inprocess(tmp_path, *PREF, "profile=amp-fp32", "run_name=amp", "train.max_steps=8", fast=False)
    summary, rows = run_inprocess(tmp_path, *PREF, f"profile={profile}", "run_name=other", "train.max_steps=8",
                                  fast=False)
    assert summary["status"] == "completed"
    mx, _ = compare(losses(rows), losses(ref), f"{profile} vs amp-fp32")
    assert mx <= tol


@pytest.mark.slow
def test_the_oom_ladder_keeps_the_dpo_curve(tmp_path):
    """An OOM injected in step 3 halves the micro-batch (8 -> 4 pairs, accumulation 2 -> 4): the run goes on, the
    step's half-accumulated work (and its preference statistics) is dropped, and the curve is the one without the
    OOM (fp32, within 1e-5 relative: only the order of the sums changes)."""
    from helpers import oom_hook

    _, plain = run_inprocess(tmp_path, *PREF, "run_name=plain", "train.max_steps=6", fast=False)
    summary, rows = run_inprocess(tmp_path, *PREF, "run_name=oom", "train.max_steps=6", hooks=oom_hook([2]),
                                  fast=False)
    assert [f["to"]["micro_batch"] for f in summary["fallbacks"]] == [4]
    mx, _ = compare(losses(rows), losses(plain), "DPO after an OOM vs without")
    assert mx <= 1e-5
    assert [r["preference_accuracy"] for r in rows] == pytest.approx([r["preference_accuracy"] for r in plain])


@pytest.mark.slow
def test_sft_then_dpo_from_the_command_line(tmp_path):
    """vramfit train (SFT, LoRA) then vramfit train task=dpo model.adapter=RUN/final: both complete, the DPO run
    starts from the SFT adapter (its reference precomputed from it: the first loss is ln 2)."""
    common = [f"output_dir={tmp_path}", "data.num_samples=256", "data.seq_len=32", "train.global_batch_size=16",
              "sample_tokens=0", "log.report_to=none", f"train.threads={THREADS}", "memory.cpu_budget=4"]
    sft = run_cli("train", *common, "run_name=sft", "lora.r=8", "train.max_steps=10")
    assert sft.returncode == 0, sft.stderr[-2000:]
    dpo = run_cli("train", *common, "run_name=dpo", "task=dpo", f"model.adapter={tmp_path}/sft/final",
                  "train.max_steps=10")
    assert dpo.returncode == 0, dpo.stderr[-2000:]
    s = json.load(open(tmp_path / "dpo" / "summary.json"))
    assert s["reference"] == "precompute" and abs(s["first_loss"] - math.log(2)) < 1e-5


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides,needle", [
    (["task=dpo", "preference.beta=0"], "preference.beta: got 0.0; rule: must be > 0.0"),
    (["task=dpo", "preference.beta=inf"], "preference.beta: got 'inf'; rule: a finite number"),
    (["task=simpo", "preference.gamma=-1"], "preference.gamma: got -1.0; rule: must be >= 0.0"),
    (["task=kto"], "task: got 'kto'; rule: one of causal_lm, dpo, orpo, simpo"),
    (["task=dpo", "preference.reference=adapter_off"], "fix: preference.reference=precompute"),
    (["task=orpo", "preference.reference=precompute"], "rule: orpo has no reference model"),
    (["task=simpo", "preference.loss_type=ipo"], "rule: the loss variants are DPO's"),
    (["task=dpo", "loss.chunked=on"], "loss.chunked: got 'on' with task=dpo"),
    (["task=dpo", "preference.max_prompt_len=64", "data.seq_len=64"], "fix: preference.max_prompt_len=32"),
    (["model.adapter=/nonexistent"], "model.adapter: got '/nonexistent'"),
])
def test_config_refusals_name_value_rule_and_fix(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)
    assert all("rule:" in p and "fix:" in p for p in e.value.problems)


def test_reference_choice():
    from launcher.config.schema import preference_beta, reference_mode

    assert reference_mode(load_config(None, ["task=dpo", "lora.r=8"])) == "adapter_off"
    assert reference_mode(load_config(None, ["task=dpo"])) == "precompute"  # full fine-tuning: no second model
    assert reference_mode(load_config(None, ["task=orpo", "lora.r=8"])) == "none"
    assert preference_beta(load_config(None, ["task=simpo"])) == 2.0
    assert preference_beta(load_config(None, ["task=dpo", "preference.beta=0.3"])) == 0.3


# ---------------------------------------------------------------------------------------------------- files
def test_pairs_from_jsonl_text_and_chat_with_bad_records_named(tmp_path):
    """prompt/chosen/rejected records as text and as messages: tokenized (prompt with bos, completions ending in
    eos), cached (the second load reuses it), and a bad record named by its line."""
    from launcher.data.load import load_splits
    from launcher.model.build import load_tokenizer

    model = make_model_dir(str(tmp_path / "m"))
    recs = [{"prompt": "what is the color of the sky ?", "chosen": "blue .", "rejected": "red ."}] * 20
    recs += [{"prompt": [{"role": "user", "content": "say hello ."}],
              "chosen": [{"role": "assistant", "content": "hello hello ."}],
              "rejected": [{"role": "assistant", "content": "no ."}]}] * 20
    path = write_jsonl(str(tmp_path / "pairs.jsonl"), recs)
    over = ["task=dpo", f"model.name={model}", f"data.source={path}", "train.global_batch_size=4",
            f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    cfg = load_config(None, over)
    tok = load_tokenizer(cfg)
    train, ev = load_splits(cfg, len(tok), tok)
    assert len(train) == 40 and ev is None
    p, c, r = train.pair(0)
    assert p[0] == tok.bos_token_id and c[-1] == tok.eos_token_id and r[-1] == tok.eos_token_id
    assert tok.decode(c[:-1]) == "blue ." and tok.decode(p[1:]) == "what is the color of the sky ?"
    p, c, _ = train.pair(25)
    assert "say hello ." in tok.decode(p) and tok.decode(c).startswith("hello hello .")
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), recs[:5] + [{"prompt": "x", "chosen": "", "rejected": "no ."}])
    with pytest.raises(ConfigError) as e:
        load_splits(load_config(None, [*over, f"data.source={bad}"]), len(tok), tok)
    assert "bad.jsonl line 6" in str(e.value) and "a missing or empty prompt, chosen or rejected" in str(e.value)


# ---------------------------------------------------------------------------------------------------- plan
def test_plan_prices_two_sequences_and_the_reference_pass():
    """A preference step is planned as two sequences per pair, and DPO's live reference as one more no-grad
    forward: the activations of a DPO plan are those of the causal LM's at twice the micro-batch (the reference
    runs before the policy's forward and frees what it made, so it adds no peak), and its predicted step time
    grows by the reference forward, which precompute drops."""
    from test_steptime import fake_hw, machine

    from launcher.plan import planner

    hw = fake_hw(capability=(8, 0))
    base = ["model.name=tiny", "lora.r=8", "train.micro_batch_size=2", "train.global_batch_size=4", "data.seq_len=64",
            "memory.gpu_budget=40", "memory.cpu_budget=32", "profile=amp-bf16", "model.gradient_checkpointing=false"]

    def row(*extra):
        return planner.plan(load_config(None, [*base, *extra]), hw, machine=machine(matmul=1e11)).chosen_plan

    lm, lm2 = row(), row("train.micro_batch_size=4", "train.global_batch_size=8")
    dpo, pre = row("task=dpo"), row("task=dpo", "preference.reference=precompute")
    gpu = lambda r: {k: r.parts["gpu"].get(k, 0) for k in ("activations", "logits")}  # noqa: E731
    print(f"activations, logits: lm {gpu(lm)}, lm at 2x micro {gpu(lm2)}, dpo {gpu(dpo)}; step s: lm "
          f"{lm.step_s:.5f}, dpo {dpo.step_s:.5f} (reference {dpo.time_parts.get('reference_forward', 0):.5f}), "
          f"dpo precompute {pre.step_s:.5f}")
    assert gpu(dpo) == gpu(lm2) == gpu(pre) and gpu(dpo)["activations"] > gpu(lm)["activations"]
    assert dpo.gpu_bytes == pre.gpu_bytes > lm.gpu_bytes
    assert dpo.time_parts["reference_forward"] > 0 and "reference_forward" not in pre.time_parts
    assert dpo.step_s > pre.step_s > lm.step_s
    assert abs(dpo.step_s - pre.step_s - dpo.time_parts["reference_forward"]) < 1e-9
