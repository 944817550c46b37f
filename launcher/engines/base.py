"""The engine protocol: what differs between DeepSpeed, torch AMP and FSDP, and nothing else; plus the
optimizer and loss-scaler helpers the torch engines share.

The training loop owns accumulation, the schedule (it passes the lr to ``step``), logging,
checkpoint cadence, signals and the OOM ladder. An engine owns the model wrapper, the optimizer,
mixed precision and loss scaling.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from launcher.model.actoffload import offload_saved_tensors
from launcher.model.build import enable_checkpointing
from launcher.model.loss import causal_lm_loss
from launcher.model.preference import reference_logps
from launcher.plan.ladder import Move
from launcher.precision import autocast_dtype  # noqa: F401 (engines take it from here)


@dataclass
class StepResult:
    """What an optimizer step did. An engine may leave a number on the device (a 0-dim tensor): the loop reads
    a step's numbers together, in one host transfer (:func:`host_values`), after the update is queued."""

    skipped: bool | torch.Tensor  # the update was not applied: fp16 overflow, or inf/nan gradients
    loss_scale: float | torch.Tensor | None  # None when no loss scaling (bf16, fp32)
    grad_norm: float | torch.Tensor | None  # global norm before clipping (None where the engine cannot tell)


def host_values(values: list) -> list:
    """``values`` with every tensor read to a Python number, in one transfer per device (the tensors of a device
    are stacked and read with one ``tolist``): each read of a GPU tensor waits for the queue to drain, so a
    step that reads its loss, norm and flags one by one waits three times."""
    out = list(values)
    by_device: dict = {}
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            by_device.setdefault(v.device, []).append(i)
    for idxs in by_device.values():
        read = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in idxs]).tolist()
        for i, x in zip(idxs, read):
            out[i] = bool(x) if values[i].dtype == torch.bool else x
    return out


def skip_nonfinite(optimizer, norm: torch.Tensor) -> torch.Tensor | None:
    """Make ``optimizer``'s next step skip the update on the device when ``norm`` is inf/nan, without reading it
    on the host: torch's fused AdamW takes a ``found_inf`` tensor (as GradScaler uses it) and leaves weights,
    moments and step count alone where it is 1. Returns the flag (a bool tensor), or None for an optimizer
    that cannot (the caller reads the norm and skips the step itself)."""
    if not getattr(optimizer, "defaults", {}).get("fused"):
        return None
    bad = ~torch.isfinite(norm.detach()).reshape(())
    optimizer.found_inf = bad.to(torch.float32)
    return bad


class Engine(Protocol):
    name: str  # 'amp' | 'deepspeed' | 'fsdp'
    optimizer_name: str  # e.g. 'torch.optim.AdamW(fused)', 'DeepSpeedCPUAdam'
    device: torch.device
    resets_in_place: bool  # apply_move goes on in place (else the OOM ladder rebuilds the engine)

    def forward_backward(self, batch: dict, accumulation: int) -> torch.Tensor:
        """Forward and backward one micro-batch; the loss is divided by ``accumulation``. Returns the
        micro-batch loss (undivided, detached)."""

    def step(self, lr: float) -> StepResult:
        """Apply the accumulated gradients with learning rate ``lr`` (clip, unscale, update, zero)."""

    def eval_loss(self, batch: dict) -> float: ...

    def reference_logps(self, batch: dict) -> torch.Tensor:
        """A preference micro-batch's reference log-probs per row (no gradients, eval mode), on the CPU."""

    def save(self, directory: str, client_state: dict) -> None:
        """Model + optimizer + scaler state, and ``client_state`` (step, data position, RNG)."""

    def load(self, directory: str) -> dict:
        """Restore what ``save`` wrote; returns the client state."""

    def save_final(self, directory: str) -> None:
        """HF ``save_pretrained`` weights (16-bit gathered under ZeRO-3), or the adapter."""

    def module(self) -> torch.nn.Module:
        """The underlying (unwrapped) HF model, for generation and inspection."""

    def apply_move(self, move: Move, offload_activations: bool) -> None:
        """Go on in place one rung down the OOM ladder (a smaller micro-batch, checkpointing on every layer); only
        where ``resets_in_place`` (the others are rebuilt from :meth:`portable_state`). ``offload_activations``: the
        run's; the checkpointed layers then keep their inputs in CPU memory."""

    def portable_state(self) -> dict:
        """{parameter name: {'param', 'exp_avg', 'exp_avg_sq'}} as full fp32 CPU tensors, to rebuild an engine."""

    def close(self) -> None:
        """Release what would outlive the object (library hooks, buffers, what it changed for the whole process)
        before it is replaced."""

    def loss_scale_state(self) -> dict | None:
        """The fp16 loss scale and where its rule stands (:class:`ScaleRule`'s fields), None without fp16."""

    def load_portable_state(self, state: dict, step: int, loss_scale: dict | None = None) -> None:
        """Put ``portable_state`` into a fresh engine (whose model already holds the weights); ``step``
        is the number of optimizer updates done (Adam's bias correction); ``loss_scale``: the replaced engine's
        :meth:`loss_scale_state`, so the new one goes on from the same scale, hysteresis and growth window
        instead of starting again at 2**initial_power and skipping steps to find it."""


@dataclass(frozen=True)
class Levers:
    """How an engine computes a micro-batch's loss and keeps its activations (the RunSpec decides them)."""

    chunked_loss: bool = False  # head + cross-entropy in chunks of rows (launcher.model.loss)
    liger: bool = False  # ... by Liger's fused kernel (CUDA, bf16/fp32, vramfit[kernels] installed)
    offload_activations: bool = False  # saved activations to CPU memory during the forward
    pin_memory: bool = False  # page-locked CPU copies (only on CUDA, when ulimit -l and RAM allow)
    checkpointing: bool = False  # with checkpointing transformers offloads the layer inputs itself
    # a preference task's loss (launcher.model.preference.Objective), None for the causal LM loss; its stats are the
    # loop's, so the same object goes to every engine the OOM ladder builds
    objective: object = field(default=None, compare=False)


def move_in_place(engine, move: Move, offload_activations: bool) -> None:
    """:meth:`Engine.apply_move` of the engines that reset in place (AMP, FSDP): drop the half-accumulated step
    (each engine's own ``reset_micro_batch``, not the loop's business); with checkpointing newly on, wrap the
    model's layers, and activation offload rides on them from now on."""
    engine.reset_micro_batch(move.to.micro_batch, move.to.accumulation)
    if move.kind == "checkpointing":
        levers = engine.levers
        enable_checkpointing(engine.module(), move.to.checkpoint_every, offload_activations,
                             levers is not None and levers.pin_memory)
        if levers is not None:
            engine.levers = replace(levers, checkpointing=True)


def forward_loss(model, batch: dict, levers: Levers | None, autocast: torch.dtype | None = None) -> torch.Tensor:
    """The micro-batch's loss through ``model`` (whatever the engine calls), by one function for every engine.

    Activation offload without checkpointing: :func:`launcher.model.actoffload.offload_saved_tensors` around the
    forward, so every activation autograd saves is copied to CPU memory as it is saved and back when backward
    needs it (the unpack hook is kept with each saved tensor, so backward needs no context). With
    checkpointing, the model's checkpointed layers do the same for their inputs (launcher.model.checkpointing),
    which is all those layers keep. Both copy on the compute stream: each offloaded byte crosses PCIe twice
    per micro-batch, priced by launcher.plan.steptime."""
    lv = levers or Levers()
    offload = lv.offload_activations and not lv.checkpointing
    ctx = offload_saved_tensors(lv.pin_memory) if offload else contextlib.nullcontext()
    with ctx:
        if lv.objective is not None:
            return lv.objective.loss(model, batch)
        return causal_lm_loss(model, batch, chunked=lv.chunked_loss, autocast_dtype=autocast, liger=lv.liger)


def forward_reference(model, batch: dict) -> torch.Tensor:
    """The log-probs of a preference micro-batch's rows (chosen, then rejected) through ``model`` as it is now, on
    the CPU: ``preference.reference=precompute`` runs it over the data before the first step, when the policy is
    its own reference (a new adapter adds exactly 0; a loaded one is the starting point)."""
    return reference_logps(model, batch, adapter=False).detach().float().cpu()


def batch_to(batch: dict, device: torch.device) -> dict:
    """Tensors to ``device``; other values (``num_items_in_batch``, ``use_cache``) go to the model as they are."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def make_optimizer(params_or_groups, *, lr: float, betas, eps: float, device: torch.device, kind: str = "adamw"):
    """(optimizer, name): fused AdamW where torch has it for this device, else foreach; or bitsandbytes 8-bit."""
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params_or_groups, lr=lr, betas=betas, eps=eps), "bitsandbytes.optim.AdamW8bit"
    if kind == "paged_adamw8bit":  # CUDA only: refused on a CPU before anything loads (launcher.plan.availability)
        import bitsandbytes as bnb

        return (bnb.optim.PagedAdamW8bit(params_or_groups, lr=lr, betas=betas, eps=eps),
                "bitsandbytes.optim.PagedAdamW8bit")
    try:
        opt = torch.optim.AdamW(params_or_groups, lr=lr, betas=betas, eps=eps, fused=True)
        return opt, "torch.optim.AdamW(fused=True)"
    except (RuntimeError, TypeError):  # device without a fused kernel
        return torch.optim.AdamW(params_or_groups, lr=lr, betas=betas, eps=eps, foreach=True), "torch.optim.AdamW(foreach=True)"


class LossScaler:
    """fp16 dynamic loss scaling for the torch engines (AMP, FSDP), with the scale moving by DeepSpeed's rule.

    ``torch.amp.GradScaler`` does the work (scale the loss, unscale the gradients with its fused inf/nan check,
    skip the update when one held inf/nan); the scale it uses next is set here after every step, by the rule
    of DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py, 0.19), so that
    the same ``loss_scale.*`` keys give the same scale, step by step, on every engine (tests/test_fp16.py):

    - an overflow skips the update; the scale halves (never below ``min_scale``) only once the hysteresis is
      used up: with ``hysteresis`` h, the first h - 1 overflows after a start or a growth only count down;
    - the scale doubles after ``window`` + 1 steps in a row without an overflow (counted from the last overflow,
      or from the start), then every ``window`` steps; each growth refills the hysteresis.

    GradScaler's own rule differs on both: it halves at every overflow and doubles after ``growth_interval``
    clean steps, one step earlier than DeepSpeed. Disabled (bf16, fp32) it scales nothing and reports no scale.
    """

    def __init__(self, device: torch.device, precision: str, loss_scale):
        self.enabled = precision == "fp16"
        self.device_type = device.type
        self.torch = torch.amp.GradScaler(device.type, init_scale=2.0 ** loss_scale.initial_power,
                                          enabled=self.enabled)
        self.rule = ScaleRule(2.0 ** loss_scale.initial_power, loss_scale.window, loss_scale.hysteresis,
                              float(loss_scale.min_scale))

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.torch.scale(loss)

    def unscale_(self, optimizer) -> None:
        self.torch.unscale_(optimizer)

    def step(self, optimizer, overflow: bool) -> None:
        """The update (GradScaler skips it when the unscaled gradients held inf/nan), then the next scale."""
        self.torch.step(optimizer)
        self.torch.update(self.rule.update(overflow))

    def get_scale(self) -> float | None:
        """The scale GradScaler multiplies the next loss by (read from it, not from the rule, so that a rule
        not handed on shows; the fp16 step reads its overflow flag on the host already)."""
        return float(self.torch.get_scale()) if self.enabled else None

    def portable(self) -> dict | None:
        """The rule's state for another engine (the OOM ladder), None when not scaling."""
        return self.rule.state_dict() if self.enabled else None

    def load_portable(self, state: dict | None) -> None:
        """Go on from another engine's scale (before this engine's first step)."""
        if state is not None and self.enabled:
            self.rule.load_state_dict(state)
            self.torch = torch.amp.GradScaler(self.device_type, init_scale=self.rule.scale, enabled=True)

    def state_dict(self) -> dict:
        return {"torch": self.torch.state_dict(), "rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Also GradScaler's own state alone (checkpoints written before the rule was kept): the rule then
        goes on from that scale with a full hysteresis and a new window."""
        if "rule" not in state:
            self.torch.load_state_dict(state)
            if self.enabled:
                self.rule = ScaleRule(float(state.get("scale", self.rule.scale)), self.rule.window,
                                      self.rule.hysteresis, self.rule.min_scale)
            return
        self.torch.load_state_dict(state["torch"])
        self.rule.load_state_dict(state["rule"])


@dataclass
class ScaleRule:
    """DeepSpeed's dynamic loss-scale rule (see :class:`LossScaler`) as plain numbers: no tensors, no torch."""

    scale: float
    window: int
    hysteresis: int
    min_scale: float
    iteration: int = 0  # DeepSpeed's cur_iter: steps taken
    last_overflow: int = -1  # DeepSpeed's last_overflow_iter
    hysteresis_left: int | None = None  # DeepSpeed's cur_hysteresis

    def __post_init__(self):
        if self.hysteresis_left is None:
            self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> float:
        """The scale after a step that did (or did not) overflow."""
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1
        return self.scale

    def state_dict(self) -> dict:
        return {"scale": self.scale, "iteration": self.iteration, "last_overflow": self.last_overflow,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        for k in ("scale", "iteration", "last_overflow", "hysteresis_left"):
            setattr(self, k, state[k])


def torch_step(optimizer, scaler: LossScaler, norm: torch.Tensor, nonfinite_grads) -> tuple[StepResult, list[str]]:
    """The update of the torch engines after ``scaler.unscale_`` and clipping gave ``norm``: (what the step did,
    the gradients that held inf/nan when an fp16 step overflowed, named by ``nonfinite_grads()``).

    bf16/fp32: inf/nan gradients skip the update on the device (fused AdamW's ``found_inf``) and nothing is read
    on the host; an optimizer without that flag (8-bit AdamW) reads the norm. fp16: the scaler reads its overflow
    flag and scale on the host anyway, so the norm is read too, and an overflow skips the update and moves the
    scale (:class:`LossScaler`)."""
    if not scaler.enabled:
        bad = skip_nonfinite(optimizer, norm)
        if bad is None:
            bad = not math.isfinite(float(norm))
            if not bad:
                optimizer.step()
        else:
            optimizer.step()
            optimizer.found_inf = None
        optimizer.zero_grad(set_to_none=True)
        return StepResult(skipped=bad, loss_scale=None, grad_norm=norm.detach()), []
    norm = float(norm)
    overflow = not math.isfinite(norm)  # unscaled gradients with an inf/nan have a non-finite norm
    bad_grads = nonfinite_grads() if overflow else []
    scaler.step(optimizer, overflow)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(skipped=overflow, loss_scale=scaler.get_scale(), grad_norm=norm), bad_grads
