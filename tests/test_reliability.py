"""Faults a rented GPU meets, injected on CPU: preemption (SIGTERM/SIGINT/SIGKILL), OOM, fp16 overflow, NaN."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

from helpers import FAST, ROOT, compare, losses, needs_deepspeed, oom_hook, run_inprocess
from helpers.procs import metrics_steps, started, vramfit
from launcher.config.profiles import PROFILES
from launcher.config.schema import ConfigError
from launcher.plan.ladder import Rung, next_move
from launcher.training.faults import Hooks

STEPS = ["train.max_steps=12", "train.warmup_steps=2", "checkpoint.every_steps=4"]


def sigterm_at(step_to_stop):
    return Hooks(after_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == step_to_stop else None)


@pytest.mark.parametrize("profile,tol", [("amp-fp32", 0.0), ("amp-bf16", 1e-6),
                                         pytest.param("zero2-fp32", 0.0, marks=needs_deepspeed),
                                         pytest.param("zero2-bf16", 1e-6, marks=needs_deepspeed),
                                         # the offloading families, whose state lives on the CPU
                                         pytest.param("zero2-bf16-offload-opt", 1e-6,
                                                      marks=[needs_deepspeed, pytest.mark.slow]),
                                         pytest.param("zero3-bf16-offload-all", 1e-6,
                                                      marks=[needs_deepspeed, pytest.mark.slow]),
                                         pytest.param("fsdp-bf16-offload", 1e-6, marks=pytest.mark.slow)])
def test_sigterm_then_resume_matches_uninterrupted(tmp_path, profile, tol):
    """Stop with SIGTERM after step 6 (between checkpoints), resume, and compare every step's loss with an
    uninterrupted run: bit-identical in fp32; bf16 allowed 1e-6 relative. NVMe
    offload: tests/test_nvme.py."""
    full, rows_full = run_inprocess(tmp_path, f"profile={profile}", "run_name=full", *STEPS)
    part, _ = run_inprocess(tmp_path, f"profile={profile}", "run_name=cut", *STEPS, hooks=sigterm_at(6))
    assert part["status"] == "interrupted" and part["steps"] == 6
    assert part["checkpoint"].endswith("step-000006")
    again, rows = run_inprocess(tmp_path, f"profile={profile}", "run_name=cut", *STEPS)
    assert again["status"] == "completed" and again["resumed_from"].endswith("step-000006")
    assert [r["step"] for r in rows] == list(range(1, 13))
    mx, _ = compare(losses(rows), losses(rows_full), f"{profile} resumed vs uninterrupted")
    assert mx <= tol


def test_cli_sigterm_saves_and_exits_130(tmp_path):
    """From the command line: SIGTERM -> finish the step, checkpoint, summary 'interrupted', exit code 130."""
    args = vramfit("train", *FAST, "engine=amp", "train.max_steps=100000", f"output_dir={tmp_path}", "run_name=one")
    with started(args, str(tmp_path / "run.log")) as p:
        p.wait_until(lambda: metrics_steps(tmp_path / "one") > 0, "first step")
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 130, p.output()[-2000:]
        out = p.output()
    s = json.load(open(tmp_path / "one" / "summary.json"))
    assert s["status"] == "interrupted" and os.path.isdir(s["checkpoint"]) and "SIGTERM" in out


SLOW_SAVE_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from launcher.config.load import load_config
from launcher.training.faults import Hooks
from launcher.training.loop import train
cfg = load_config(None, {overrides!r})
train(cfg, hooks=Hooks(during_save=lambda path: (print("SAVING", flush=True), time.sleep(60))))
"""


def test_second_signal_exits_at_once(tmp_path):
    """A second SIGINT while the first one's checkpoint is being written exits at once (130), leaving no
    summary and no checkpoint marked complete."""
    overrides = [*FAST, "engine=amp", "train.max_steps=100000", "device=cpu", f"output_dir={tmp_path}", "run_name=two"]
    with started([sys.executable, "-c", SLOW_SAVE_SCRIPT.format(root=ROOT, overrides=overrides)],
                 str(tmp_path / "run.log")) as p:
        p.wait_until(lambda: metrics_steps(tmp_path / "two") > 0, "first step")
        p.send_signal(signal.SIGINT)
        p.wait_until(lambda: "SAVING" in p.output(), "the first signal's checkpoint write")
        t = time.time()
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130 and time.time() - t < 10, p.output()[-2000:]
    assert not (tmp_path / "two" / "summary.json").exists()
    left = os.listdir(tmp_path / "two" / "checkpoints")
    assert left and all(n.endswith(".tmp") for n in left), left  # the interrupted write, never marked complete


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from launcher.config.load import load_config
from launcher.training.faults import Hooks
from launcher.training.loop import train
cfg = load_config(None, {overrides!r})
def during_save(path):
    if path.endswith("step-000008.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
train(cfg, hooks=Hooks(during_save=during_save))
"""


@pytest.mark.slow
def test_sigkill_while_writing_checkpoint_resumes_from_previous(tmp_path):
    overrides = [*FAST, *STEPS, "engine=amp", "device=cpu", f"output_dir={tmp_path}", "run_name=k"]
    r = subprocess.run([sys.executable, "-c", KILL_SCRIPT.format(root=ROOT, overrides=overrides)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    ck = tmp_path / "k" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["step-000004", "step-000008.tmp"]  # the half-written one has no marker
    s, rows = run_inprocess(tmp_path, *STEPS, "engine=amp", "run_name=k")
    assert s["resumed_from"].endswith("step-000004") and s["status"] == "completed" and s["steps"] == 12
    assert not any(n.endswith(".tmp") for n in os.listdir(ck))
    ref, ref_rows = run_inprocess(tmp_path, *STEPS, "engine=amp", "run_name=ref")
    assert losses(rows) == losses(ref_rows)


def test_changed_setting_refused_with_diff_allowed_one_continues(tmp_path):
    run_inprocess(tmp_path, "engine=amp", "run_name=x", "train.max_steps=4", "train.warmup_steps=1")
    with pytest.raises(ConfigError) as e:
        run_inprocess(tmp_path, "engine=amp", "run_name=x", "train.max_steps=8", "train.warmup_steps=1",
                      "data.seq_len=64")
    assert "data.seq_len: checkpoint has 32, now 64" in str(e.value)
    s, rows = run_inprocess(tmp_path, "engine=amp", "run_name=x", "train.max_steps=8", "train.warmup_steps=1",
                            "log.every_steps=2")
    assert s["resumed_from"].endswith("step-000004") and s["steps"] == 8 and len(rows) == 8




def test_ladder_sequence_is_pure_and_complete():
    usable = [p for p in PROFILES.values() if p.engine == "deepspeed" and p.precision == "bf16"]
    r, seen = Rung(8, 1, False, "zero2-bf16"), []
    while (m := next_move(r, usable)) is not None:
        seen.append((m.kind, m.to.micro_batch, m.to.accumulation, m.to.checkpointing, m.to.profile))
        r = m.to
    assert seen == [("micro_batch", 4, 2, False, "zero2-bf16"), ("micro_batch", 2, 4, False, "zero2-bf16"),
                    ("micro_batch", 1, 8, False, "zero2-bf16"), ("checkpointing", 1, 8, True, "zero2-bf16"),
                    ("profile", 1, 8, True, "zero2-bf16-offload-opt"), ("profile", 1, 8, True, "zero3-bf16-offload-all"),
                    # NVMe last (availability offers them only with memory.nvme_path set)
                    ("profile", 1, 8, True, "zero3-bf16-offload-nvme-opt"),
                    ("profile", 1, 8, True, "zero3-bf16-offload-nvme-all")]
    assert next_move(Rung(6, 2, True, "amp-fp32"), []).to.micro_batch == 3


@pytest.mark.parametrize("profile", ["amp-fp32", pytest.param("zero2-fp32", marks=needs_deepspeed)])
def test_oom_halves_micro_batch_and_matches_run_that_started_there(tmp_path, profile):
    base = [f"profile={profile}", "train.micro_batch_size=4", "train.global_batch_size=8", "train.max_steps=10",
            "train.warmup_steps=2"]
    inject, first = oom_hook([2, 5]), {}

    def before_step(step, engine):
        if step == 0:
            first["model"] = weakref.ref(engine.module())
        if step == 2 and "freed" not in first and engine.module() is not first["model"]():
            # the retry right after a rebuild (DeepSpeed): the replaced engine is gone, not held in memory
            gc.collect()
            first["freed"] = first["model"]() is None
        inject.before_step(step, engine)

    s, rows = run_inprocess(tmp_path, *base, "run_name=oom", hooks=Hooks(before_step=before_step))
    assert first.get("freed", True)  # AMP resets in place: same model
    assert s["status"] == "completed" and s["steps"] == 10
    assert [r["micro_batch"] for r in rows] == [4, 4, 2, 2, 2, 1, 1, 1, 1, 1]
    assert (s["micro_batch"], s["accumulation"], s["global_batch_size"]) == (1, 8, 8)
    assert [(f["from"]["micro_batch"], f["to"]["micro_batch"], f["to"]["accumulation"], f["step"])
            for f in s["fallbacks"]] == [(4, 2, 4, 3), (2, 1, 8, 6)]
    ref, ref_rows = run_inprocess(tmp_path, *base[:1], "train.micro_batch_size=1", *base[2:], "run_name=ref")
    mx, _ = compare(losses(rows), losses(ref_rows), f"{profile} OOM ladder vs micro-batch 1 from the start")
    assert mx < 1e-5


@pytest.mark.slow
@needs_deepspeed
def test_oom_ladder_on_zero3_carries_the_partitioned_state(tmp_path):
    """ZeRO-3 keeps Adam's state per fp32 partition (its param groups are empty between steps): a rebuilt
    ZeRO-3 engine gets it back, so an OOM at step 3 follows a run at the smaller micro-batch from the start."""
    base = ["profile=zero3-bf16-offload-all", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.max_steps=6", "train.warmup_steps=2"]
    s, rows = run_inprocess(tmp_path, *base, "run_name=oom", hooks=oom_hook([2]))
    assert s["status"] == "completed" and [r["micro_batch"] for r in rows] == [4, 4, 2, 2, 2, 2]
    ref, ref_rows = run_inprocess(tmp_path, base[0], "train.micro_batch_size=2", *base[2:], "run_name=ref")
    mx, _ = compare(losses(rows), losses(ref_rows), "zero3 bf16 OOM ladder vs micro-batch 2 from the start")
    assert mx < 1e-3  # bf16, micro-batch 4 x 2 vs 2 x 4: 1.0e-4 measured


@needs_deepspeed
def test_oom_ladder_runs_to_checkpointing_and_more_offload(tmp_path):
    base = ["profile=zero2-bf16", "train.micro_batch_size=2", "train.global_batch_size=8", "train.max_steps=8",
            "train.warmup_steps=2"]
    s, rows = run_inprocess(tmp_path, *base, "run_name=ladder", hooks=oom_hook([2, 2, 2]))
    assert s["status"] == "completed" and s["profile"] == "zero2-bf16-offload-opt"
    assert s["optimizer"] == "torch.optim.AdamW(fused=True)" and s["gradient_checkpointing"] is True
    assert [f["to"]["profile"] for f in s["fallbacks"]] == ["zero2-bf16", "zero2-bf16", "zero2-bf16-offload-opt"]
    ref, ref_rows = run_inprocess(tmp_path, *base, "run_name=ref")
    mx, _ = compare(losses(rows), losses(ref_rows), "bf16 after moving to offload vs no OOM")
    assert mx < 1e-3  # the moved state (fp32 master, Adam m, v, 16-bit weights) carries over exactly: 2.6e-5 measured


def test_non_oom_error_is_not_swallowed(tmp_path):
    def boom(step, engine):
        if step == 2:
            raise ValueError("not an OOM")
    with pytest.raises(ValueError, match="not an OOM"):
        run_inprocess(tmp_path, "engine=amp", "run_name=e", hooks=Hooks(before_step=boom))


def poison_grads_from(step0, name="model.layers.1.mlp.down_proj.weight"):
    def after_backward(step, engine):
        if step >= step0:
            p = dict(engine.module().named_parameters())[name]
            p.grad.view(-1)[0] = float("inf")
    return Hooks(after_backward=after_backward)


def test_fp16_overflow_trajectory_then_stop_with_diagnosis(tmp_path):
    """AMP fp16 + GradScaler on CPU. Scale starts at 2**4 = 16; from step 3 on every step overflows: the first
    overflow uses up the hysteresis (2), then the scale halves each step to the floor of 1 and stays; after 3
    overflows at the floor (patience) the run stops: status failed, a checkpoint, and a diagnosis naming the
    poisoned parameter. (DeepSpeed fp16 does the same: tests/test_fp16.py.)"""
    s, rows = run_inprocess(tmp_path, "profile=amp-fp16", "run_name=of", "loss_scale.initial_power=4",
                            "loss_scale.patience=3", "train.max_steps=50", hooks=poison_grads_from(2))
    assert [r["loss_scale"] for r in rows] == [16, 16, 16, 8, 4, 2, 1, 1, 1]
    assert [r["skipped"] for r in rows] == [False, False] + [True] * 7
    assert s["status"] == "failed" and s["skipped_steps"] == 7 and s["steps"] == 9
    assert os.path.isdir(s["checkpoint"])
    assert "minimum loss scale" in s["diagnosis"] and "model.layers.1.mlp.down_proj.weight" in s["diagnosis"]
    assert "bf16" in s["diagnosis"] and "lr" in s["diagnosis"]
    assert not os.path.exists(os.path.join(s["run_dir"], "final"))


def test_fp16_isolated_overflow_skips_and_recovers(tmp_path):
    hooks = Hooks(after_backward=lambda step, eng: step == 3 and dict(eng.module().named_parameters())[
        "lm_head.weight"].grad.view(-1).__setitem__(0, float("nan")))
    s, rows = run_inprocess(tmp_path, "profile=amp-fp16", "run_name=one", "loss_scale.initial_power=8",
                            "loss_scale.hysteresis=1", "train.max_steps=8", hooks=hooks)
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    assert [r["loss_scale"] for r in rows] == [256, 256, 256, 128, 128, 128, 128, 128]


def test_nan_loss_in_bf16_stops_with_checkpoint(tmp_path):
    def before_step(step, engine):
        if step == 3:
            with torch.no_grad():
                engine.module().model.norm.weight.fill_(float("nan"))
    s, rows = run_inprocess(tmp_path, "profile=amp-bf16", "run_name=nan", hooks=Hooks(before_step=before_step))
    assert s["status"] == "failed" and s["steps"] == 3 and len(rows) == 3
    assert "loss became nan at step 4" in s["diagnosis"] and os.path.isdir(s["checkpoint"])
