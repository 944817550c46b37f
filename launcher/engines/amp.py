"""The plain torch path: fp32 master weights, ``torch.autocast`` in fp16/bf16, ``GradScaler`` for fp16.

One mixed-precision branch: the scaler is enabled only for fp16 and uses the same numbers as the
DeepSpeed fp16 profiles (init 2**16, growth interval 1000, backoff 0.5).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from launcher.engines.base import (
    Levers,
    StepResult,
    autocast_dtype,
    batch_to,
    forward_loss,
    make_optimizer,
    make_scaler,
    skip_nonfinite,
)
from launcher.models import save_final


class AmpEngine:
    name = "amp"
    resets_in_place = True  # reset_micro_batch drops a half-accumulated step exactly

    def __init__(self, model: torch.nn.Module, *, precision: str, device: torch.device, param_groups: list[dict],
                 lr: float, betas, eps: float, grad_clip: float, loss_scale, optimizer: str = "adamw",
                 levers: Levers | None = None):
        self.device = device
        self.precision = precision
        self.dtype = autocast_dtype(precision)
        self.levers = levers
        self.model = model.to(device)
        self.model.train()
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        # Several ranks: DDP all-reduces gradients, once per optimizer step (no_sync while accumulating).
        self.wrapped = (torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[device.index] if
                                                                  device.type == "cuda" else None)
                        if self.world > 1 else self.model)
        self._micro = 0
        self.params = [p for g in param_groups for p in g["params"]]
        self.optimizer, self.optimizer_name = make_optimizer(param_groups, lr=lr, betas=betas, eps=eps, device=device,
                                                             kind=optimizer)
        self.scaler = make_scaler(device, precision, loss_scale)
        self.min_scale = float(loss_scale.min_scale)
        self.grad_clip = grad_clip
        self.nonfinite: list[str] = []  # parameters whose gradients held inf/nan at the last overflow

    def _loss(self, batch: dict, model=None) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            return forward_loss(model or self.wrapped, batch_to(batch, self.device), self.levers, self.dtype)

    def forward_backward(self, batch: dict, accumulation: int) -> torch.Tensor:
        self._micro += 1
        sync = self.world == 1 or self._micro >= accumulation
        with contextlib.nullcontext() if sync else self.wrapped.no_sync():
            loss = self._loss(batch)
            self.scaler.scale(loss / accumulation).backward()
        return loss.detach().float()

    def step(self, lr: float) -> StepResult:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        if not self.scaler.is_enabled():  # bf16/fp32: inf/nan gradients skip the update, on the device
            bad = skip_nonfinite(self.optimizer, norm)
            if bad is None:  # an optimizer without found_inf (8-bit AdamW): read the norm here
                bad = not math.isfinite(float(norm))
                if not bad:
                    self.optimizer.step()
            else:
                self.optimizer.step()
                self.optimizer.found_inf = None
            self.optimizer.zero_grad(set_to_none=True)
            self._micro = 0
            return StepResult(skipped=bad, loss_scale=None, grad_norm=norm.detach())
        norm = float(norm)  # fp16: the scaler reads its overflow flag and scale on the host anyway
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        if not math.isfinite(norm):
            self.nonfinite = [n for n, p in self.model.named_parameters()
                              if p.grad is not None and not torch.isfinite(p.grad).all()]
        self.scaler.step(self.optimizer)  # skipped by the scaler when grads hold inf/nan
        self.scaler.update()
        if self.scaler.is_enabled() and self.scaler.get_scale() < self.min_scale:
            self.scaler.update(self.min_scale)  # same floor as DeepSpeed's min_loss_scale
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        skipped = scale is not None and not math.isfinite(norm)
        return StepResult(skipped=skipped, loss_scale=self.scaler.get_scale() if scale is not None else None,
                          grad_norm=norm)

    def reset_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        """Drop a partly accumulated step (after an OOM); micro-batch size is the loop's business here."""
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0

    def close(self) -> None:
        """Nothing outlives this engine but what the loop drops."""

    def portable_state(self) -> dict:
        out = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                st = self.optimizer.state.get(p, {})
                out[name] = {"param": p.detach().float().cpu(),
                             **{k: st[k].detach().float().cpu() for k in ("exp_avg", "exp_avg_sq") if k in st}}
        return out

    def load_portable_state(self, state: dict, step: int) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in state:
                    p.copy_(state[name]["param"])
                    if "exp_avg" in state[name]:
                        fused = bool(self.optimizer.defaults.get("fused"))
                        self.optimizer.state[p] = {
                            "step": torch.tensor(float(step), device=p.device if fused else "cpu"),
                            **{k: state[name][k].to(p.device) for k in ("exp_avg", "exp_avg_sq")}}

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        self.model.eval()
        try:
            return float(self._loss(batch, self.model))
        finally:
            self.model.train()

    def save(self, directory: str, client_state: dict) -> None:
        if self.world > 1 and torch.distributed.get_rank() != 0:
            return  # DDP replicas are identical: rank 0 writes
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in self.model.state_dict().items() if k in trainable} if len(trainable) < sum(
            1 for _ in self.model.parameters()) else self.model.state_dict()
        torch.save({"model": state, "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                    "client_state": client_state}, os.path.join(directory, "engine.pt"))

    def load(self, directory: str) -> dict:
        blob = torch.load(os.path.join(directory, "engine.pt"), map_location="cpu", weights_only=False)
        self.model.load_state_dict(blob["model"], strict=False)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scaler.load_state_dict(blob["scaler"])
        return blob["client_state"]

    def save_final(self, directory: str) -> None:
        if self.world == 1 or torch.distributed.get_rank() == 0:
            save_final(self.model, directory)

    def module(self) -> torch.nn.Module:
        return self.model
