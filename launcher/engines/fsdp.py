"""torch FSDP2 with CPU offload: the third engine, for when the model does not fit on the GPU and
DeepSpeed is missing (or the user asks for it).

Each decoder layer, the input embeddings and the output head are their own ``fully_shard`` unit, and the
model is the root unit. With ``CPUOffloadPolicy`` the fp32 parameters, their gradients and the AdamW
moments live in CPU RAM; a unit's parameters are copied to the GPU (and cast to 16 bits by
``MixedPrecisionPolicy``) just before its forward or backward and freed after, so the GPU holds about
two units' 16-bit weights (FSDP prefetches the next one), one unit's gradients and the activations.
Gradients are reduced in fp32 and land on the CPU; the optimizer step runs there with
``torch.optim.AdamW(fused=True)`` (scripts/bench_optimizers.py measures it against DeepSpeedCPUAdam).

fp16 uses ``torch.amp.GradScaler`` with the numbers and the scale rule of the other paths
(:class:`launcher.engines.base.LossScaler`). ``ShardedGradScaler`` is FSDP1's:
FSDP2 gradients are DTensors, and DTensor runs the scaler's inf/nan check on each rank's shard and then
all-reduces ``found_inf`` over the mesh, so every rank skips the same steps with the plain scaler.

One GPU or CPU: a process group of one is made when there is none (as DeepSpeed does). Offloaded
tensors live on the CPU, so the clip-norm and inf/nan reductions run on CPU tensors: on CUDA the process
group must carry a CPU backend, which is why it is ``cuda:nccl,cpu:gloo`` (a group of that kind is made
for FSDP when the default one has only NCCL).

On a CPU-only host (CI) the same code runs with the mesh on the CPU: the offload policy then copies
nothing (``pin_memory`` off), MixedPrecisionPolicy computes in bf16/fp16, and the optimizer, scaler and
checkpoint paths are those a GPU run takes.

Checkpoints are torch distributed checkpoints (DCP): every rank writes its own shards of the model and
optimizer, so they resume on the same or another number of ranks; the scaler and the loop's client
state go beside them, one small file per rank. ``save_final`` gathers the full fp32 weights onto rank 0
and writes them with ``save_pretrained``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from launcher.engines.base import (
    Levers,
    LossScaler,
    StepResult,
    autocast_dtype,
    batch_to,
    forward_loss,
    make_optimizer,
    move_in_place,
    torch_step,
)
from launcher.machine import dist as ranks
from launcher.model.build import param_groups, save_final
from launcher.model.structure import base_model, decoder_layers


def _mesh(device: torch.device):
    """(DeviceMesh, ProcessGroup) over all ranks, with a backend for both ``device`` and the CPU."""
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        ranks.ensure_env()
        dist.init_process_group(ranks.backend(device))
    group = dist.group.WORLD
    have = dist.get_backend_config()  # e.g. 'cuda:nccl', 'cpu:gloo,cuda:gloo', 'cuda:nccl,cpu:gloo'
    if "cpu:" not in have or f"{device.type}:" not in have:
        group = dist.new_group(backend=ranks.backend(device))  # collective: every rank gets here
    return DeviceMesh.from_group(group, device.type), group


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that become their own FSDP unit, in forward order: embeddings, each decoder layer, head.

    Tied input and output embeddings share one weight, which can only belong to one unit: then both
    stay in the root unit.
    """
    base = base_model(model)
    layers = list(decoder_layers(model))
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    tied = emb is not None and head is not None and emb.weight is head.weight
    units = [] if tied or emb is None else [emb]
    units += layers
    if head is not None and not tied:
        units.append(head)
    return units


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FsdpEngine:
    name = "fsdp"
    resets_in_place = True  # reset_micro_batch drops a half-accumulated step exactly

    def __init__(self, model: torch.nn.Module, *, precision: str, device: torch.device, lr: float, betas,
                 eps: float, weight_decay: float, grad_clip: float, loss_scale, offload: bool = True,
                 pin_memory: bool = False, levers: Levers | None = None):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.device = device
        self.precision = precision
        self.grad_clip = grad_clip
        self.levers = levers
        self.mesh, self.group = _mesh(device)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        dtype = autocast_dtype(precision)
        # Gradients are reduced and accumulated in fp32 whatever the compute dtype: on one GPU the
        # reduce-scatter is a copy, and fp32 keeps accumulation over micro-batches as exact as AMP's.
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=pin_memory and device.type == "cuda") if offload else OffloadPolicy()
        self.offload = offload
        # fully_shard moves each unit's parameters to the device, shards them and (offload) copies the shard
        # back to the CPU, one unit at a time: the whole model is never on the GPU at once.
        for unit in shard_units(model):
            fully_shard(unit, mesh=self.mesh, mp_policy=mp, offload_policy=off)
        fully_shard(model, mesh=self.mesh, mp_policy=mp, offload_policy=off)
        self.model = model
        self.model.train()
        groups = param_groups(model, weight_decay)  # after sharding: the parameters are now DTensors
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer, opt_name = make_optimizer(groups, lr=lr, betas=betas, eps=eps, device=device)
        where = self.params[0].device.type if self.params else device.type
        self.optimizer_name = f"{opt_name} on {where}"
        self.scaler = LossScaler(device, precision, loss_scale)
        self.nonfinite: list[str] = []  # parameters whose gradients held inf/nan at the last overflow

    # ---- training
    def forward_backward(self, batch: dict, accumulation: int) -> torch.Tensor:
        loss = forward_loss(self.model, batch_to(batch, self.device), self.levers)
        # Each backward reduce-scatters this micro-batch's gradients and adds them to the (CPU) shards.
        self.scaler.scale(loss / accumulation).backward()
        return loss.detach().float()

    def _clip(self) -> torch.Tensor:
        """Global gradient norm over every rank's shards, then clip to ``grad_clip`` (as torch's clip_grad_norm_)."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        sq = (torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum() if grads
              else torch.zeros((), device=self.params[0].device if self.params else "cpu"))
        if self.world > 1:  # every rank joins, even one without gradients
            dist.all_reduce(sq, group=self.group)  # offloaded: a CPU tensor, the group's gloo backend
        norm = sq.sqrt()
        if self.grad_clip > 0 and grads:
            coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        return norm

    def step(self, lr: float) -> StepResult:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.scaler.unscale_(self.optimizer)  # inf/nan check per shard; found_inf is all-reduced by DTensor
        norm = self._clip()  # the same on every rank (all-reduced): every rank skips the same steps
        result, bad = torch_step(self.optimizer, self.scaler, norm, lambda: [
            n for n, p in self.model.named_parameters() if p.grad is not None and not torch.isfinite(_local(p.grad)).all()])
        self.nonfinite = bad or self.nonfinite
        return result

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        self.model.eval()
        try:
            return float(forward_loss(self.model, batch_to(batch, self.device), self.levers))
        finally:
            self.model.train()

    def reset_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        """Drop a partly accumulated step (after an OOM); the micro-batch size is the loop's business.

        An OOM inside backward leaves FSDP mid-iteration: its end-of-backward callback was queued but never
        ran, so it would not be queued again and units whose inputs need no gradient (the embeddings) would
        never reduce their gradients. Run that callback now, reshard every unit, then drop the gradients.
        (FSDP2 has no public reset; the private names are looked up and skipped when absent.)
        """
        from torch.distributed.fsdp import FSDPModule

        state = getattr(self.model, "_get_fsdp_state", lambda: None)()
        ctx = getattr(state, "_state_ctx", None)
        if getattr(ctx, "post_backward_final_callback_queued", False) and hasattr(
                state, "_root_post_backward_final_callback"):
            state._root_post_backward_final_callback()
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- checkpoints
    @staticmethod
    def _sd_options():
        """Frozen parameters (a LoRA run's base) are neither saved nor loaded: the model is rebuilt from the same
        base before a resume, so a checkpoint holds the adapters' shards and their AdamW moments only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True)

    def save(self, directory: str, client_state: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._sd_options())
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory, process_group=self.group)
        torch.save({"scaler": self.scaler.state_dict(), "client_state": client_state, "world": self.world},
                   os.path.join(directory, f"engine-rank{self.rank:05d}.pt"))

    def load(self, directory: str) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._sd_options())  # shapes to fill
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=directory, process_group=self.group)  # reshards when the world changed
        # not strict: the frozen base is not in the checkpoint, it is already in the model
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))
        mine = os.path.join(directory, f"engine-rank{self.rank:05d}.pt")
        extra = torch.load(mine if os.path.exists(mine) else os.path.join(directory, "engine-rank00000.pt"),
                           map_location="cpu", weights_only=False)
        self.scaler.load_state_dict(extra["scaler"])
        return extra["client_state"]

    def full_state_dict(self) -> dict:
        """Full (unsharded) fp32 weights on the CPU of rank 0 ({} on the others). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_final(self, directory: str) -> None:
        state = self.full_state_dict()
        if self.rank == 0:
            save_final(self.model, directory, state_dict=state)  # transformers drops the FSDP class prefix
        dist.barrier(group=self.group)

    def module(self) -> torch.nn.Module:
        return self.model

    # ---- moving to another engine (OOM ladder) and back
    def close(self) -> None:
        """Nothing outlives this engine but what the loop drops."""

    def apply_move(self, move, offload_activations: bool) -> None:
        move_in_place(self, move, offload_activations)

    def portable_state(self) -> dict:
        """fp32 weights and Adam moments by parameter name, full and on the CPU of every rank. Collective."""
        out = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            st = self.optimizer.state.get(p, {})
            out[name] = {"param": p.detach().full_tensor().float().cpu(),
                         **{k: st[k].full_tensor().float().cpu() for k in ("exp_avg", "exp_avg_sq") if k in st}}
        return out

    def loss_scale_state(self) -> dict | None:
        return self.scaler.portable()

    @torch.no_grad()
    def load_portable_state(self, state: dict, step: int, loss_scale: dict | None = None) -> None:
        self.scaler.load_portable(loss_scale)
        for name, p in self.model.named_parameters():
            if name not in state:
                continue
            _local(p).copy_(self._my_shard(state[name]["param"], p))
            if "exp_avg" in state[name]:
                st = {"step": torch.tensor(float(step), dtype=torch.float32,
                                           device=p.device if self.optimizer.defaults.get("fused") else "cpu")}
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = torch.zeros_like(p)
                    _local(st[k]).copy_(self._my_shard(state[name][k], p))
                self.optimizer.state[p] = st

    def _my_shard(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` under FSDP's dim-0 sharding (chunks of ceil(rows / world))."""
        local = _local(like)
        rows = -(-full.shape[0] // self.world)
        start = min(self.rank * rows, full.shape[0])
        return full.narrow(0, start, local.shape[0]).to(local.device, local.dtype)

