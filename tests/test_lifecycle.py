"""A run left alone on a rented box: LoRA checkpoints that hold what trains (never the frozen base) and
resume exactly, on every engine; the disk planned before the first step; a checkpoint that would not fit
skipped with a warning."""

import os

import pytest

from helpers import compare, losses, needs_deepspeed, run_inprocess
from launcher.config.profiles import PROFILES, Profile
from launcher.machine.files import tree_bytes
from launcher.training.faults import Hooks

FSDP32 = "fsdp-fp32-offload"  # test-only fp32 FSDP profile, as tests/test_fsdp.py: exact resume needs fp32
FSDP32_PROFILE = Profile(FSDP32, "fsdp", "fp32", offload_optimizer=True, offload_param=True, speed_rank=3)
LORA = ["lora.r=8", "lora.alpha=16", "train.lr=1e-2"]
SHORT = ["train.max_steps=8", "train.warmup_steps=2", "train.global_batch_size=4", "checkpoint.every_steps=4"]


def stop_after(step_to_stop):
    import signal

    return Hooks(after_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == step_to_stop else None)


def weights_in(directory: str) -> set[str]:
    """Names of the tensors a checkpoint holds (whatever the engine wrote)."""
    import torch

    names = set()
    for d, _, files in os.walk(directory):
        for f in files:
            full = os.path.join(d, f)
            if f.endswith(".pt"):
                blob = torch.load(full, map_location="cpu", weights_only=False)
                for part in ("model", "module"):
                    if isinstance(blob, dict) and isinstance(blob.get(part), dict):
                        names |= set(blob[part])
            elif f == ".metadata":
                import pickle

                with open(full, "rb") as fh:
                    meta = pickle.load(fh)
                names |= {k for k in meta.state_dict_metadata if k.startswith("model.")}
    return names


@pytest.mark.parametrize("profile", ["amp-fp32", pytest.param("zero2-fp32", marks=needs_deepspeed), FSDP32])
def test_lora_checkpoint_holds_only_adapters_and_resumes_exactly(tmp_path, monkeypatch, profile):
    """LoRA on each engine: the checkpoint holds no base weight (only lora_ tensors), it is a fraction of the
    base's size, and a run stopped at step 4 and resumed gives the uninterrupted fp32 curve bit for bit."""
    monkeypatch.setitem(PROFILES, FSDP32, FSDP32_PROFILE)
    args = [f"profile={profile}", *LORA, *SHORT]
    full, rows_full = run_inprocess(tmp_path, "run_name=full", *args)
    cut, _ = run_inprocess(tmp_path, "run_name=cut", *args, hooks=stop_after(4))
    assert cut["status"] == "interrupted" and cut["steps"] == 4
    names = weights_in(cut["checkpoint"])
    assert names and all("lora_" in n for n in names), sorted(n for n in names if "lora_" not in n)[:5]
    from launcher.model.presets import preset_config
    from launcher.plan.memory.shape import count_params

    counts = count_params(preset_config("tiny"), 8)  # the default model, which these runs train
    ckpt = tree_bytes(cut["checkpoint"])
    base = 4 * counts.total  # the base's fp32 weights alone; a full fine-tune's checkpoint adds 12 B per weight
    # the adapters, their Adam moments (and DeepSpeed's fp32 master), the loop's state, and no base weight
    assert ckpt < base / 2, f"{profile}: a LoRA checkpoint of {ckpt} bytes against {base} bytes of base weights"
    assert ckpt > 12 * counts.adapters  # and every adapter with its two moments
    again, rows = run_inprocess(tmp_path, "run_name=cut", *args)
    assert again["status"] == "completed" and again["resumed_from"] == cut["checkpoint"]
    mx, _ = compare(losses(rows), losses(rows_full), f"{profile} LoRA resumed vs uninterrupted")
    assert mx == 0.0


def test_disk_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """The planned checkpoints (keep_last + 1) and final/ do not fit in what the disk has free: exit 2 with the
    numbers and the fixes, and output_dir is not even made."""
    import shutil

    from launcher.cli import main

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=2 * 2**20))
    out = tmp_path / "out"
    rc = main(["train", "train.max_steps=2", "device=cpu", "engine=amp", "sample_tokens=0", f"output_dir={out}",
               "run_name=r", "checkpoint.keep_last=3"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    line = next(ln for ln in err.splitlines() if "rule:" in ln)
    assert "output_dir:" in line and "2.0 MiB free" in line and "checkpoint.keep_last + 1 = 4 checkpoints" in line
    assert "fix:" in line and "output_dir=DIR" in line and "lora.r=16" in line
    assert not out.exists()


def test_plan_predicts_checkpoint_and_final_bytes():
    """The plan's bytes on disk per profile: a LoRA checkpoint is the adapters with Adam (12 B per trainable
    parameter; DeepSpeed 16-bit adds its 2-byte module copy and the fp32 master), never the base."""
    from launcher.model.presets import preset_config
    from launcher.plan.memory.shape import count_params
    from launcher.plan.memory.states import CHECKPOINT_EXTRA_BYTES, FINAL_EXTRA_BYTES, files_on_disk

    counts = count_params(preset_config("llama-125m"), 16, ("all-linear",))
    t = counts.adapters
    amp = files_on_disk(PROFILES["amp-bf16"], counts, 16)
    ds = files_on_disk(PROFILES["zero2-bf16"], counts, 16)
    full = files_on_disk(PROFILES["zero2-bf16"], counts, 0)
    assert amp["checkpoint"] == 12 * t + CHECKPOINT_EXTRA_BYTES and amp["final"] == 4 * t + FINAL_EXTRA_BYTES
    assert ds["checkpoint"] == 14 * t + CHECKPOINT_EXTRA_BYTES and ds["final"] == 2 * t + FINAL_EXTRA_BYTES
    assert full["checkpoint"] == 14 * counts.total + CHECKPOINT_EXTRA_BYTES


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    """The default tracker writes event files in the run directory: TensorBoard's EventAccumulator reads every
    step's loss, lr, grad norm and tokens/s, the memory, and the plan as text; the values are metrics.jsonl's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s, rows = run_inprocess(tmp_path, "run_name=tb", "engine=amp", "train.max_steps=6", "train.warmup_steps=1")
    acc = EventAccumulator(os.path.join(s["run_dir"], "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "memory/cpu_rss_bytes"):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows]
    assert max(abs(e.value - r["loss"]) for e, r in zip(loss, rows)) < 1e-5
    assert "plan/text_summary" in tags["tensors"]
    plan = acc.Tensors("plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "chosen:" in plan


def test_a_tracker_whose_writes_fail_is_switched_off_and_the_run_goes_on(tmp_path, vramfit_log, monkeypatch):
    """TensorBoard's writer thread meets a full disk from step 3 on (its error is kept by the thread and raised
    again by every later call, the close included): the tracker is switched off with one warning, the run
    completes with every step in metrics.jsonl, and summary.json says which tracker failed and why."""
    import errno

    from tensorboard.summary.writer import record_writer

    real, full = record_writer.RecordWriter.write, {"now": False}

    def write(self, data):
        if full["now"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    hooks = Hooks(after_step=lambda step: full.__setitem__("now", step >= 3))
    s, rows = run_inprocess(tmp_path, "run_name=tb", "engine=amp", "train.max_steps=8", "train.warmup_steps=1",
                            hooks=hooks)
    assert s["status"] == "completed" and [r["step"] for r in rows] == list(range(1, 9))
    assert s["tracker_errors"] == ["tensorboard: OSError: [Errno 28] No space left on device"]
    warned = [r.getMessage() for r in vramfit_log.records if "tracker tensorboard switched off" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0] and "the run goes on" in warned[0]


def test_report_to_a_tracker_that_is_not_installed_is_refused(monkeypatch):
    import importlib.util

    from launcher.config.load import load_config
    from launcher.config.schema import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, ["log.report_to=[tensorboard,wandb]"])
    assert "log.report_to: got 'wandb', which is not installed" in str(e.value)
    assert "pip install 'vramfit[wandb]'" in str(e.value)
    with pytest.raises(ConfigError, match="rule: tensorboard, wandb, mlflow or none"):
        load_config(None, ["log.report_to=[tensorbored]"])


# ------------------------------------------------------------------------------------------------
# Evaluation that decides


def test_eval_covers_the_split_once_and_reports_perplexity(tmp_path):
    """The eval split is evaluated in full (every sample once, weighted by samples), or at most eval.max_batches
    micro-batches; the summary and TensorBoard carry the loss and its perplexity."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launcher.training import evaluation

    seen = []
    real = evaluation.evaluate

    def counting(engine, data, micro_batch, ranks, max_batches=0):
        calls = []
        orig = engine.eval_loss
        engine.eval_loss = lambda b: calls.append(b["input_ids"].shape[0]) or orig(b)
        try:
            return real(engine, data, micro_batch, ranks, max_batches)
        finally:
            engine.eval_loss = orig
            seen.append((len(data), calls))

    evaluation.evaluate, saved = counting, real
    try:
        s, _ = run_inprocess(tmp_path, "run_name=ev", "engine=amp", "train.max_steps=4", "train.warmup_steps=1",
                             "data.eval_fraction=0.1", "train.eval_every=2", "eval.max_batches=0")
    finally:
        evaluation.evaluate = saved
    n, calls = seen[0]
    assert sum(calls) == n and len(calls) == -(-n // 2)  # micro-batch 2: every sample once, the last batch smaller
    assert s["eval_perplexity"] == pytest.approx(math.exp(s["eval_loss"]))
    acc = EventAccumulator(os.path.join(s["run_dir"], "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 4, 4]
    assert "eval/perplexity" in acc.Tags()["scalars"]


def test_keep_best_and_early_stopping_write_final_from_the_best(tmp_path, monkeypatch):
    """Scripted eval losses (3, 2, 2.5, 2.6 at steps 2, 4, 6, 8) with patience 2: the run stops early at step 8,
    status stopped_early; the checkpoint of step 4 (the best) is kept beside the last one, and final/ holds its
    weights."""
    import torch
    from safetensors.torch import load_file

    from launcher.training import evaluation

    script = iter([3.0, 2.0, 2.5, 2.6])
    monkeypatch.setattr(evaluation, "evaluate", lambda *a, **k: next(script))
    s, rows = run_inprocess(tmp_path, "run_name=best", "engine=amp", "train.max_steps=20", "train.warmup_steps=1",
                            "data.eval_fraction=0.1", "train.eval_every=2", "train.early_stopping_patience=2",
                            "checkpoint.keep_best=true", "checkpoint.keep_last=1")
    assert s["status"] == "stopped_early" and s["steps"] == 8 and len(rows) == 8
    assert s["best_eval_loss"] == 2.0 and s["best_checkpoint"].endswith("step-000004") and s["eval_loss"] == 2.0
    ck = os.path.join(s["run_dir"], "checkpoints")
    assert sorted(os.listdir(ck)) == ["step-000004", "step-000008"]
    best = torch.load(os.path.join(ck, "step-000004", "engine.pt"), weights_only=False)["model"]
    final = load_file(os.path.join(s["run_dir"], "final", "model.safetensors"))
    assert max(float((final[k] - best[k]).abs().max()) for k in final) == 0.0


@pytest.mark.parametrize("args,words", [
    (["checkpoint.keep_best=true", "train.eval_every=2"], ["checkpoint.keep_best", "without an eval split"]),
    (["train.early_stopping_patience=2", "data.eval_fraction=0.1"], ["train.early_stopping_patience",
                                                                     "train.eval_every=0"]),
    (["train.epochs=2", "train.max_steps=10"], ["train.epochs", "one of them sets the run's length"]),
])
def test_bad_evaluation_settings_are_refused(args, words):
    from launcher.config.load import load_config
    from launcher.config.schema import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "fix:" in str(e.value)


def test_eval_split_that_leaves_too_little_training_data_is_refused(tmp_path):
    from launcher.config.schema import ConfigError

    with pytest.raises(ConfigError, match="fewer than one global batch"):
        run_inprocess(tmp_path, "run_name=small", "engine=amp", "data.num_samples=16", "data.eval_fraction=0.5",
                      "train.global_batch_size=16", "train.micro_batch_size=2")
    assert not os.path.exists(tmp_path / "small")


def test_epochs_set_the_steps_and_schedules_come_by_name(tmp_path):
    """train.epochs=0.25 over 256 samples of global batch 8 is 8 steps (auto warmup: 10% of them); a named
    schedule is transformers.get_scheduler's, and the lr the loop sets follows it."""
    from launcher.config.load import load_config
    from launcher.config.schema import with_epochs
    from launcher.training.schedule import lr_at

    cfg = with_epochs(load_config(None, ["train.epochs=0.25", "train.global_batch_size=8"]), 256)
    assert cfg.train.max_steps == 8 and cfg.train.warmup_steps == 0
    base = ["train.warmup_steps=1", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=32",
            "data.num_samples=256", "log.every_steps=1000", "sample_tokens=0", "engine=amp"]
    s, rows = run_inprocess(tmp_path, "run_name=ep", *base, "train.epochs=0.25", "train.lr_schedule=linear",
                            "train.lr=1e-3", fast=False)
    assert s["steps"] == 8 and s["status"] == "completed"
    assert [r["lr"] for r in rows] == pytest.approx([0.0, 1e-3 * 7 / 7, 1e-3 * 6 / 7, 1e-3 * 5 / 7, 1e-3 * 4 / 7,
                                                     1e-3 * 3 / 7, 1e-3 * 2 / 7, 1e-3 * 1 / 7])
    const = load_config(None, ["train.lr_schedule=constant", "train.lr=2e-3"]).train
    assert {lr_at(i, const) for i in range(50)} == {2e-3}


def test_a_checkpoint_from_before_lora_experts_resumes_with_the_default():
    """lora.experts decides which weights train, so a checkpoint records it; one made before it was recorded was
    made with 'auto' and resumes under it, and under nothing else."""
    from launcher.config.load import load_config
    from launcher.training import checkpoint as ckpt

    now = ckpt.fixed_settings(load_config(None, []))
    old = {k: v for k, v in now.items() if k != "lora.experts"}
    assert now["lora.experts"] == "auto" and ckpt.diff_settings(old, now) == []
    off = ckpt.fixed_settings(load_config(None, ["lora.experts=false"]))
    assert ckpt.diff_settings(old, off) == ["lora.experts: checkpoint has 'auto', now 'false'"]
