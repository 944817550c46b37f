"""torch with the optimizer offloaded to the CPU (``amp-*-offload-opt``): the model in 16 bits on the GPU, the fp32
master weights, their gradients and AdamW's moments in CPU memory, the update by the CPU.

For a model whose weights and activations fit the GPU but whose 12 B per parameter of fp32 master and Adam states
do not. It is what DeepSpeed's ZeRO-2 optimizer offload does on one GPU, without its buckets, its fp32 gradient
copies on the GPU and its per-micro-batch trips of every gradient to the CPU and back (issue 43 measured a ZeRO-2
offload run holding more GPU memory than ZeRO-2 without offload). The design is torchao's ``CPUOffloadOptimizer``
(torchao/optim/cpu_offload.py), with the loss scaling, clipping and fp32 masters a mixed-precision run needs:

- **gradients leave as they are made**: a ``register_post_accumulate_grad_hook`` on every trainable parameter copies
  its gradient, once complete, to a page-locked CPU buffer on a side stream and frees it on the GPU, so backward holds
  a parameter's gradient or two at a time, not all of them. With gradient accumulation the gradients of the earlier
  micro-batches add up on the GPU in the model's dtype (as DeepSpeed's 16-bit gradients do) and leave once, in the
  last micro-batch's backward: one trip over PCIe per optimizer step, never one per micro-batch.
- **the norm is exact**: each gradient's squared norm is added on the GPU as it leaves (fp32), so the global norm of
  every gradient is known before the first update; clipping scales all of them by the same factor, as
  ``torch.nn.utils.clip_grad_norm_`` would. The update waits for the last gradient (an update that went ahead of it
  would clip with part of the norm: tests/test_offload_opt.py shows its curve leaving AMP's).
- **fp16**: the loss is multiplied by the scale of :class:`launcher.engines.base.ScaleRule` (DeepSpeed's rule, the
  numbers every engine shares); a non-finite norm is an overflow: the update is skipped and the scale moves, as
  ``GradScaler`` skips and backs off. The unscale is folded into the clipping factor (one multiply per gradient).
- **the update**: per parameter, the 16-bit gradient is widened into the fp32 master's gradient on the CPU, AdamW
  steps the master, and the master is narrowed back into the same page-locked buffer and copied to the GPU weight on
  a second side stream, so the copy of one parameter overlaps the update of the next. The CPU AdamW is torch's
  fused one (``torch.optim.AdamW(fused=True)``, one per parameter so that each can step on its own): the optimizer
  vramfit's other CPU updates run (FSDP2 offload, ZeRO's client optimizer), measured against DeepSpeedCPUAdam by
  scripts/bench_optimizers.py, and it needs no compiled op. Its threads are torch's intra-op threads, set by
  ``train.threads`` (launcher.machine.threads: the cores other processes leave free; the loop has no data-loader
  workers to leave cores to).

The page-locked buffer is one flat block registered where it lies (``cudaHostRegister``: exactly its bytes, where
torch's pinned allocator would round it up to a power of two), only when the plan pins; pageable otherwise. On a CPU
(tests) the same code runs without streams: the "GPU" model is a second copy in host memory.

Checkpoints hold the fp32 masters and the moments by parameter name (``engine.pt``, as the AMP engine writes), so a
run resumes on this profile or another torch one from the same numbers.
"""

from __future__ import annotations

import math
import os

import torch

from launcher.engines.base import Levers, ScaleRule, StepResult, batch_to, forward_loss, move_in_place
from launcher.model.build import save_final
from launcher.precision import DTYPES


class OffloadOptEngine:
    name = "amp"
    optimizer_name = "torch.optim.AdamW(fused=True) on the CPU, per parameter"
    resets_in_place = True

    def __init__(self, model: torch.nn.Module, *, precision: str, device: torch.device, param_groups: list[dict],
                 lr: float, betas, eps: float, grad_clip: float, loss_scale, pin_memory: bool = False,
                 levers: Levers | None = None):
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise RuntimeError("the amp-*-offload-opt profiles run on one rank (no gradient all-reduce)")
        self.device = device
        self.precision = precision
        self.dtype = DTYPES[precision]  # the model's dtype on the device: it computes without autocast
        self.levers = levers
        self.grad_clip = grad_clip
        self.cuda = device.type == "cuda"
        self.scale_rule = (ScaleRule(2.0 ** loss_scale.initial_power, loss_scale.window, loss_scale.hysteresis,
                                     float(loss_scale.min_scale)) if precision == "fp16" else None)
        group_of = {id(p): g for g in param_groups for p in g["params"]}
        self.model = model
        self.names: list[str] = []  # trainable parameters, in the model's order
        self.params: list[torch.nn.Parameter] = []  # ... on the device, in the model's dtype
        self.masters: list[torch.Tensor] = []  # ... their fp32 masters on the CPU
        self.optimizers: list[torch.optim.Optimizer] = []
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        total = sum(p.numel() for _, p in trainable)
        # one flat CPU block for every gradient on its way down and every weight on its way up (model dtype)
        self.flat = torch.empty(total, dtype=self.dtype)
        self.pinned_ptr = _register(self.flat) if pin_memory and self.cuda else None
        self.buffers: list[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for name, p in trainable:
                master = p.detach().to("cpu", torch.float32)  # the materialised fp32 weight itself, where it is one
                master.grad = torch.zeros_like(master)
                buf = self.flat[offset:offset + p.numel()].view_as(master)
                offset += p.numel()
                p.data = p.data.to(device, self.dtype, copy=True)  # never the master's storage
                g = group_of.get(id(p), {"weight_decay": 0.0})
                self.optimizers.append(torch.optim.AdamW([master], lr=lr, betas=betas, eps=eps,
                                                         weight_decay=g.get("weight_decay", 0.0), fused=True))
                self.names.append(name)
                self.params.append(p)
                self.masters.append(master)
                self.buffers.append(buf)
            model.to(device)  # frozen weights (a LoRA base) and buffers
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.model.train()
        self._micro = 0
        self._send = True  # this backward sends the gradients (the accumulation's last micro-batch)
        self._arrived: list[int] = []  # parameters whose gradients are in their buffers, in arrival order
        self._sumsq = torch.zeros((), dtype=torch.float32, device=device)
        self.nonfinite: list[str] = []

    # -- backward: each gradient leaves as it is complete -----------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._send or p.grad is None:
            return  # an earlier micro-batch of the accumulation: the gradient adds up where it is
        i = self.index[id(p)]
        g = p.grad
        self._sumsq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                self.buffers[i].copy_(g, non_blocking=True)
            g.record_stream(self.d2h)  # its memory is reused only once the copy is done
        else:
            self.buffers[i].copy_(g)
        p.grad = None
        self._arrived.append(i)

    def _loss(self, batch: dict) -> torch.Tensor:
        return forward_loss(self.model, batch_to(batch, self.device), self.levers)

    def forward_backward(self, batch: dict, accumulation: int) -> torch.Tensor:
        self._micro += 1
        self._send = self._micro >= accumulation
        loss = self._loss(batch)
        scaled = loss / accumulation
        if self.scale_rule is not None:
            scaled = scaled * self.scale_rule.scale
        scaled.backward()
        return loss.detach().float()

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self, lr: float) -> StepResult:
        self._send = True
        for p in self.params:  # a gradient the last backward did not reach (unused there): sent now
            if p.grad is not None:
                self._on_grad(p)
        if self.cuda:
            self.d2h.synchronize()  # every gradient is in its buffer
        scale = self.scale_rule.scale if self.scale_rule is not None else 1.0
        norm = math.sqrt(float(self._sumsq)) / scale  # the one read of the step: the global norm, unscaled
        arrived, self._arrived = self._arrived, []
        self._sumsq.zero_()
        self._micro = 0
        if not math.isfinite(norm):  # fp16 overflow, or inf/nan gradients: no update
            if self.scale_rule is not None:
                self.nonfinite = [self.names[i] for i in arrived
                                  if not torch.isfinite(self.buffers[i]).all()] or self.nonfinite
                self.scale_rule.update(True)
            return StepResult(skipped=True, loss_scale=self._scale(), grad_norm=norm)
        coef = min(1.0, self.grad_clip / (norm + 1e-6)) if self.grad_clip > 0 else 1.0  # clip_grad_norm_'s factor
        factor = coef / scale
        for i in arrived:
            self._update(i, factor, lr)
        if self.cuda:  # the next forward reads the new weights
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
        if self.scale_rule is not None:
            self.scale_rule.update(False)
        return StepResult(skipped=False, loss_scale=self._scale(), grad_norm=norm)

    def _update(self, i: int, factor: float, lr: float) -> None:
        """Parameter ``i``'s update from its gradient in the buffer times ``factor``, and its upload."""
        master = self.masters[i]
        master.grad.copy_(self.buffers[i])
        if factor != 1.0:
            master.grad.mul_(factor)
        opt = self.optimizers[i]
        opt.param_groups[0]["lr"] = lr
        opt.step()
        self.buffers[i].copy_(master)  # the buffer's gradient is used: it takes the new 16-bit weight up
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                self.params[i].data.copy_(self.buffers[i], non_blocking=True)
        else:
            self.params[i].data.copy_(self.buffers[i])

    def _scale(self) -> float | None:
        return self.scale_rule.scale if self.scale_rule is not None else None

    # -- the rest of the protocol -----------------------------------------------------------------------------
    def reset_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        for p in self.params:
            p.grad = None
        if self.cuda:
            self.d2h.synchronize()
        self._arrived, self._micro, self._send = [], 0, True
        self._sumsq.zero_()

    def apply_move(self, move, offload_activations: bool) -> None:
        move_in_place(self, move, offload_activations)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.pinned_ptr is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            _unregister(self.pinned_ptr)
            self.pinned_ptr = None

    def _state(self, i: int) -> dict:
        return self.optimizers[i].state.get(self.masters[i], {})

    def portable_state(self) -> dict:
        out = {}
        for i, name in enumerate(self.names):
            st = self._state(i)
            out[name] = {"param": self.masters[i].detach().clone(),
                         **{k: st[k].detach().float().clone() for k in ("exp_avg", "exp_avg_sq") if k in st}}
        return out

    def loss_scale_state(self) -> dict | None:
        return self.scale_rule.state_dict() if self.scale_rule is not None else None

    def load_portable_state(self, state: dict, step: int, loss_scale: dict | None = None) -> None:
        if loss_scale is not None and self.scale_rule is not None:
            self.scale_rule.load_state_dict(loss_scale)
        with torch.no_grad():
            for i, name in enumerate(self.names):
                if name not in state:
                    continue
                self.masters[i].copy_(state[name]["param"])
                self.params[i].data.copy_(self.masters[i].to(self.dtype))
                if "exp_avg" in state[name]:
                    self.optimizers[i].state[self.masters[i]] = {
                        "step": torch.tensor(float(step)),
                        **{k: state[name][k].to(torch.float32).clone() for k in ("exp_avg", "exp_avg_sq")}}

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        self.model.eval()
        try:
            return float(self._loss(batch))
        finally:
            self.model.train()

    def save(self, directory: str, client_state: dict) -> None:
        torch.save({"model": dict(zip(self.names, self.masters)),
                    "optimizer": {n: self._state(i) for i, n in enumerate(self.names)},
                    "scaler": {"rule": self.loss_scale_state()}, "client_state": client_state},
                   os.path.join(directory, "engine.pt"))

    def load(self, directory: str) -> dict:
        blob = torch.load(os.path.join(directory, "engine.pt"), map_location="cpu", weights_only=False)
        if "param_groups" in blob["optimizer"]:  # one torch optimizer's state (the AMP engine's): not ours
            raise RuntimeError(f"{directory}: written by another engine (its optimizer state is not by parameter name)")
        with torch.no_grad():
            for i, name in enumerate(self.names):
                if name in blob["model"]:
                    self.masters[i].copy_(blob["model"][name])
                    self.params[i].data.copy_(self.masters[i].to(self.dtype))
                st = blob["optimizer"].get(name)
                if st:
                    self.optimizers[i].state[self.masters[i]] = {k: v.clone() for k, v in st.items()}
        rule = (blob.get("scaler") or {}).get("rule")
        if rule is not None and self.scale_rule is not None:
            self.scale_rule.load_state_dict(rule)
        return blob["client_state"]

    def save_final(self, directory: str) -> None:
        """The fp32 masters where they train, the frozen weights as they are (as the AMP engine writes them)."""
        masters = {id(p): m for p, m in zip(self.params, self.masters)}
        state = {k: masters.get(id(v), v) for k, v in self.model.state_dict(keep_vars=True).items()}
        save_final(self.model, directory, state_dict={k: v.detach() for k, v in state.items()})

    def module(self) -> torch.nn.Module:
        return self.model


def _register(t: torch.Tensor) -> int | None:
    """Page-lock ``t``'s memory where it lies; its pointer, or None where the host refuses (then pageable)."""
    ptr = t.untyped_storage().data_ptr()
    if t.numel() == 0 or int(torch.cuda.cudart().cudaHostRegister(ptr, t.untyped_storage().nbytes(), 0)) != 0:
        return None
    return ptr


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
