"""Run helpers for the tests: tiny runs in a temporary output directory, CLI runs in a subprocess, loss curves
compared with a stated tolerance (the max and mean relative difference are printed and returned)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A smaller tiny model and short runs keep the suite inside its time budget on 2 CPU cores.
# In-process runs use the thread count the test process started with: train.threads=auto would take fewer
# when other processes keep cores busy, and runs whose curves are compared exactly must not differ in that.
THREADS = torch.get_num_threads()
FAST = ["train.max_steps=24", "train.warmup_steps=4", "train.micro_batch_size=2", "train.global_batch_size=8",
        "data.seq_len=32", "data.num_samples=256", "log.every_steps=1000", "sample_tokens=0"]


def has_deepspeed() -> bool:
    from launcher.machine.deepspeed_ops import deepspeed_status

    return deepspeed_status()[1] is None


needs_deepspeed = pytest.mark.skipif(not has_deepspeed(), reason="DeepSpeed is not installed")


def run_inprocess(tmp_path, *overrides, hooks=None, fast=True):
    """Train in this process; returns (summary, metrics rows)."""
    from launcher.config.load import load_config
    from launcher.training.loop import train

    # memory.mmap_threshold_mib=0: a run's mallopt would stay with this process, and the tests after it
    cfg = load_config(None, [*(FAST if fast else []), f"train.threads={THREADS}", f"output_dir={tmp_path}", "device=cpu",
                             "memory.mmap_threshold_mib=0", *overrides])
    summary = train(cfg, hooks=hooks)
    rows = [json.loads(ln) for ln in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    return summary, rows


def run_cli(*args, env=None, timeout=600, cwd=None):
    """``python -m launcher ARGS`` in a subprocess; returns CompletedProcess (text)."""
    e = dict(os.environ)
    e.pop("RANK", None), e.pop("WORLD_SIZE", None), e.pop("LOCAL_RANK", None), e.pop("MASTER_PORT", None)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "launcher", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=cwd or ROOT)


def losses(rows):
    return [r["loss"] for r in rows]


def compare(a, b, name=""):
    """Max and mean relative difference of two loss curves, printed (the test asserts on them)."""
    assert len(a) == len(b), f"{name}: {len(a)} vs {len(b)} steps"
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    mx, mean = max(rel), sum(rel) / len(rel)
    print(f"{name}: max rel diff {mx:.3e}, mean rel diff {mean:.3e} over {len(rel)} steps")
    return mx, mean


def oom_hook(at_steps):
    """Raise a fake CUDA OOM in the second micro-batch's forward of each step in ``at_steps`` (one per entry),
    so that a half-accumulated step must be thrown away."""
    pending = list(at_steps)

    def before_step(step, engine):
        if pending and pending[0] == step:
            pending.pop(0)
            calls = {"n": 0}

            def pre(_mod, _args):
                calls["n"] += 1
                if calls["n"] == 2:
                    handle.remove()
                    raise torch.OutOfMemoryError("CUDA out of memory (injected by test)")

            handle = engine.module().register_forward_pre_hook(pre)
    from launcher.training.faults import Hooks

    return Hooks(before_step=before_step)


class _Amplify(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor`` (an fp16 overflow, injected)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def overflow_at(steps, factor=1e30):
    """Make the gradients of the steps in ``steps`` (0-based, as hooks count) overflow fp16 on any engine: the
    output head's input is multiplied by ``factor`` in the backward of the step's first micro-batch, so
    every gradient below the head is far beyond fp16's 65504 and the step must be skipped. The forward, and so
    the loss, is unchanged (the loss curves of two engines stay comparable at those steps)."""
    from launcher.training.faults import Hooks

    def before_step(step, engine):
        if step in steps:
            head = engine.module().get_output_embeddings()

            def once(_mod, args):
                handle.remove()
                return (_Amplify.apply(args[0], factor), *args[1:])

            handle = head.register_forward_pre_hook(once)

    return Hooks(before_step=before_step)
