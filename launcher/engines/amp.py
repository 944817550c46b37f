"""The plain torch path: fp32 master weights, ``torch.autocast`` in fp16/bf16, ``GradScaler`` for fp16.

One mixed-precision branch: the loss scaler is enabled only for fp16, and its scale moves by the DeepSpeed fp16
profiles' rule from the same ``loss_scale.*`` keys (init 2**16, window 1000, hysteresis 2, halved on overflow:
:class:`launcher.engines.base.LossScaler`).
"""

from __future__ import annotations

import contextlib
import os

import torch

from launcher.engines.base import (
    Levers,
    LossScaler,
    StepResult,
    autocast_dtype,
    batch_to,
    forward_loss,
    forward_reference,
    make_optimizer,
    move_in_place,
    torch_step,
)
from launcher.model.build import save_final


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
        self.scaler = LossScaler(device, precision, loss_scale)
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
        result, bad = torch_step(self.optimizer, self.scaler, norm, lambda: [
            n for n, p in self.model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()])
        self.nonfinite = bad or self.nonfinite
        self._micro = 0
        return result

    def reset_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        """Drop a partly accumulated step (after an OOM); micro-batch size is the loop's business here."""
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0

    def close(self) -> None:
        """Nothing outlives this engine but what the loop drops."""

    def apply_move(self, move, offload_activations: bool) -> None:
        move_in_place(self, move, offload_activations)

    def portable_state(self) -> dict:
        out = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                st = self.optimizer.state.get(p, {})
                out[name] = {"param": p.detach().float().cpu(),
                             **{k: st[k].detach().float().cpu() for k in ("exp_avg", "exp_avg_sq") if k in st}}
        return out

    def loss_scale_state(self) -> dict | None:
        return self.scaler.portable()

    def load_portable_state(self, state: dict, step: int, loss_scale: dict | None = None) -> None:
        self.scaler.load_portable(loss_scale)
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
    def reference_logps(self, batch: dict) -> torch.Tensor:
        self.model.eval()
        try:
            with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
                return forward_reference(self.model, batch_to(batch, self.device))
        finally:
            self.model.train()

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
