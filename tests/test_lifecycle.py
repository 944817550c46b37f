"""A run left alone on a rented box: LoRA checkpoints that hold what trains (never the frozen base) and
resume exactly, on every engine; the disk planned before the first step; a checkpoint that would not fit
skipped with a warning."""

import os

import pytest

from helpers import compare, losses, needs_deepspeed, run_inprocess
from launcher.faults import Hooks
from launcher.profiles import PROFILES, Profile
from launcher.rundir import tree_bytes

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
    adapter = tree_bytes(os.path.join(full["run_dir"], "final"))
    ckpt = tree_bytes(cut["checkpoint"])
    print(f"{profile}: checkpoint {ckpt} bytes, final adapter dir {adapter} bytes")
    again, rows = run_inprocess(tmp_path, "run_name=cut", *args)
    assert again["status"] == "completed" and again["resumed_from"] == cut["checkpoint"]
    mx, _ = compare(losses(rows), losses(rows_full), f"{profile} LoRA resumed vs uninterrupted")
    assert mx == 0.0
