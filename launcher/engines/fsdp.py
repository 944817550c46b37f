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
    forward_reference,
    make_optimizer,
    move_in_place,
    torch_step,
)
from launcher.machine import dist as ranks
from launcher.model.build import param_groups, save_final
from launcher.model.structure import units


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
    """The modules that become their own FSDP unit, in forward order (:func:`launcher.model.structure.units`)."""
    return units(model)


def pin_in_place(model: torch.nn.Module) -> list[int]:
    """Page-lock every CPU shard of ``model`` where it lies (``cudaHostRegister``): exactly its bytes, where a copy
    into torch's pinned allocator would round each block up to a power of two. FSDP copies a pinned shard to the GPU
    asynchronously (``all_gather_inputs`` copies with ``non_blocking=True``), and ``Tensor.is_pinned`` is true of
    registered memory, so FSDP takes these shards as pinned. The trainable shards' gradients are then sent to pinned
    blocks of FSDP's own, as with ``CPUOffloadPolicy(pin_memory=True)`` (its ``FSDPParam.pin_memory``, set where this
    torch has it). Returns the pointers registered, for :func:`unpin`."""
    cudart = torch.cuda.cudart()
    done: list[int] = []
    for p in model.parameters():
        local = _local(p.data)
        if local.device.type != "cpu" or local.numel() == 0:
            continue
        st = local.untyped_storage()
        ptr = st.data_ptr()
        if ptr in done:
            continue
        err = cudart.cudaHostRegister(ptr, st.nbytes(), 0)
        if int(err) != 0:  # not pinned: FSDP copies it like pageable memory, slower but right
            continue
        done.append(ptr)
    for fp in _fsdp_params(model):
        data = getattr(fp, "_sharded_param_data", None)
        if fp.sharded_param.requires_grad and data is not None and data.untyped_storage().data_ptr() in done:
            fp.pin_memory = True
    return done


def unpin(pointers: list[int]) -> None:
    if pointers:
        cudart = torch.cuda.cudart()
        for ptr in pointers:
            cudart.cudaHostUnregister(ptr)


def _fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's per-parameter records (private: ``_get_fsdp_state()._fsdp_param_groups``, or the one
    ``_fsdp_param_group`` of older torch); [] where this torch names them otherwise."""
    out = []
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", lambda: None)()
        if state is None:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for g in groups:
            out += list(getattr(g, "fsdp_params", []))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FsdpEngine:
    name = "fsdp"
    resets_in_place = True  # reset_micro_batch drops a half-accumulated step exactly

    def __init__(self, model: torch.nn.Module, *, precision: str, device: torch.device, lr: float, betas,
                 eps: float, weight_decay: float, grad_clip: float, loss_scale, offload: bool = True,
                 pin_memory: bool = False, levers: Levers | None = None, materializer=None):
        """``materializer``: ``model`` is on the meta device, and each unit is made
        (:class:`launcher.model.materialize.Materializer`) just before it is sharded, so a rank never holds more
        than its shards and one unit whole. ``pin_memory``: page-lock the CPU shards where they are
        (:func:`pin_in_place`)."""
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
        # FSDP's own pinning (CPUOffloadPolicy(pin_memory=True)) copies every shard into a block of torch's pinned
        # allocator, which rounds each up to a power of two (a 172 MiB weight takes 256 MiB): the shards are pinned
        # where they are instead, after sharding (pin_in_place)
        off = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        self.offload = offload
        # fully_shard moves each unit's parameters to the device, shards them and (offload) copies the shard
        # back to the CPU, one unit at a time: the whole model is never on the GPU at once.
        for unit in shard_units(model):
            if materializer is not None:
                materializer.fill(unit)
            fully_shard(unit, mesh=self.mesh, mp_policy=mp, offload_policy=off)
        if materializer is not None:
            materializer.fill(model)
        fully_shard(model, mesh=self.mesh, mp_policy=mp, offload_policy=off)
        self.pinned = pin_in_place(model) if pin_memory and offload and device.type == "cuda" else []
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
    def reference_logps(self, batch: dict) -> torch.Tensor:
        self.model.eval()
        try:
            return forward_reference(self.model, batch_to(batch, self.device))
        finally:
            self.model.train()

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
        """Full (unsharded) weights on the CPU of rank 0 ({} on the others): what trains only when a frozen base is
        there (a LoRA run's final/ is its adapter: gathering the base would copy it whole). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        frozen = any(not p.requires_grad for p in self.model.parameters())
        if self.world == 1 and self.offload and not frozen:  # the CPU shards are the whole tensors: no gathered copy
            return {k: _local(v).detach() for k, v in self.model.state_dict().items()}
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                         ignore_frozen_params=frozen))

    def save_final(self, directory: str) -> None:
        state = self.full_state_dict()
        if self.rank == 0:
            save_final(self.model, directory, state_dict=state)  # transformers drops the FSDP class prefix
        dist.barrier(group=self.group)

    def module(self) -> torch.nn.Module:
        return self.model

    # ---- moving to another engine (OOM ladder) and back
    def close(self) -> None:
        """Unpin the shards pinned in place (their memory goes back to the allocator with the model)."""
        unpin(self.pinned)
        self.pinned = []

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

