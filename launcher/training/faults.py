"""Faults the loop survives on purpose: signals (save, then exit), non-finite numbers (a diagnosis), and the
test-only hooks that inject them (OOM, inf/nan, signals, a kill while saving) into a real run.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

from launcher.data import micro_batches
from launcher.log import logger
from launcher.plan.ladder import Rung

EXIT_INTERRUPTED = 130  # documented: the run saved a checkpoint and can be resumed
EXIT_FAILED = 1


@dataclass
class Hooks:
    """Test-only fault injection (never a user option): called with the step number."""
    before_step: object | None = None  # fn(step, engine): may raise (a fake OOM)
    after_backward: object | None = None  # fn(step, engine): may poison gradients (inf/nan injection)
    after_step: object | None = None  # fn(step): e.g. send SIGTERM
    during_save: object | None = None  # fn(path): e.g. SIGKILL while a checkpoint is written


class StopRequested:
    """SIGTERM/SIGINT: finish the optimizer step, checkpoint, exit. A second signal exits at once."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.signum is not None:
            os._exit(EXIT_INTERRUPTED)
        self.signum = signum
        logger.info(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint (send again to exit "
                    "at once)", extra={"all_ranks": False})

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)

    def __bool__(self):
        return self.signum is not None


def diagnose(engine, data, rung: Rung, step: int, cfg, lr: float, what: str) -> str:
    """Why the numbers went non-finite: which parameters' gradients and which modules' outputs."""
    parts = [what, f"lr {lr:.3g}"]
    bad_grads = getattr(engine, "nonfinite", None)
    if bad_grads:
        parts.append(f"inf/nan gradients in {len(bad_grads)} tensors, first: {', '.join(bad_grads[:4])}")
    rows = micro_batches(max(step - 1, 0), cfg.train.global_batch_size, rung.micro_batch, 0, 1, len(data), cfg.seed)[0]
    found = nonfinite_outputs(engine, data.batch(rows))
    if found:
        parts.append(f"first modules with inf/nan or fp16-overflowing outputs: {', '.join(found[:4])}")
    tips = ["a lower train.lr", "train.grad_clip=1.0" if not cfg.train.grad_clip else "a longer train.warmup_steps"]
    if engine.name and getattr(engine, "precision", None) == "fp16" or "fp16" in rung.profile:
        tips.insert(0, "precision=bf16 where the card has it (compute capability >= 8.0), or precision=fp32")
    parts.append("try: " + "; ".join(tips))
    return "; ".join(parts)


def nonfinite_outputs(engine, batch: dict, limit: float = 65504.0) -> list[str]:
    """Run one forward with hooks; name modules whose output is non-finite or beyond fp16's range."""
    found: list[str] = []
    handles = []

    def hook(name):
        def fn(_mod, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
            if torch.is_tensor(t) and t.is_floating_point() and t.numel():
                if not torch.isfinite(t).all() or t.detach().abs().max() > limit:
                    found.append(name)
        return fn

    for name, mod in engine.module().named_modules():
        if name:
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        engine.eval_loss(batch)
    except Exception as e:  # a diagnosis must not hide the run's real state
        found.append(f"(diagnostic forward failed: {type(e).__name__})")
    finally:
        for h in handles:
            h.remove()
    return found
