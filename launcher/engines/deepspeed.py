"""DeepSpeed ZeRO (stage 2 and 3, optimizer and parameter offload) behind the engine protocol.

The config DeepSpeed receives is fully resolved by :func:`launcher.profiles.fill_auto` (no ``"auto"``), from
a catalogue profile or a user's ``deepspeed_config``; the loop owns the schedule and sets the lr on the
optimizer's param groups each step.
DeepSpeed wants ``engine.step()`` after every micro-batch; it only updates at the accumulation
boundary, so ``forward_backward`` calls it for the non-boundary micro-batches.
"""

from __future__ import annotations

import torch

from launcher import dist
from launcher.engines.base import Levers, StepResult, batch_to, forward_loss
from launcher.hardware import clear_stale_op_locks, op_state, remember_cpu_info, use_env_ninja
from launcher.log import logger
from launcher.models import save_final


def restore_torch_functions() -> None:
    """Put back what ZeRO-3 replaced for the whole process: ``torch.nn.functional.linear`` (its memory
    efficient linear, which DeepSpeed says "will persist unless manually reset"). Called when a run ends,
    so later work in the same process (the planner's traces, another run) sees plain torch."""
    import sys

    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(pp, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def ops_loaded(ds_config: dict, device: torch.device) -> list[str]:
    """DeepSpeed's JIT ops an engine of ``ds_config`` loads: the shared-memory comm op on DeepSpeed's CPU
    accelerator (with the process group), and the Adam op the config's ``optimizer`` section makes DeepSpeed
    build (none with a client optimizer)."""
    ops = ["deepspeed_shm_comm"] if device.type == "cpu" else []
    if "optimizer" in ds_config:
        offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}) or {}
        ops.append("cpu_adam" if offload.get("device") in ("cpu", "nvme") else "fused_adam")
    return ops


def optimizer_name(opt) -> str:
    inner = getattr(opt, "optimizer", opt)
    return type(inner).__name__


class DeepSpeedEngine:
    name = "deepspeed"
    resets_in_place = False  # ZeRO keeps a half-accumulated step in its own buffers: the OOM ladder rebuilds

    def __init__(self, model: torch.nn.Module, *, ds_config: dict, param_groups: list[dict], device: torch.device,
                 optimizer=None, levers: Levers | None = None):
        """``optimizer``: (a torch optimizer over ``param_groups``, its name), DeepSpeed's client optimizer
        (the catalogue's profiles: torch's fused AdamW, no compiler needed); None: DeepSpeed builds the one
        the config's ``optimizer`` section names (its FusedAdam or DeepSpeedCPUAdam ops)."""
        import deepspeed

        dist.ensure_env()
        ninja = use_env_ninja()  # the same ninja at every entry point, so an op built once is reused
        remember_cpu_info()  # DeepSpeed probes the CPU anew for every op it loads
        if dist.current().local_rank == 0:
            for path in clear_stale_op_locks():
                logger.info(f"removed a stale DeepSpeed op build lock left by a killed run: {path}")
            for name in ops_loaded(ds_config, device):
                st = op_state(name, ninja)
                if st.compiles:  # a JIT build is never silent: minutes on a small machine
                    logger.info(st.notice())
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        self.ds_config = ds_config
        self.device = device
        self.levers = levers
        client, client_name = optimizer if optimizer is not None else (None, None)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=None if client is not None else param_groups, optimizer=client,
            config=ds_config)
        self.optimizer_name = client_name or optimizer_name(self.optimizer)
        self.fp16 = bool(ds_config.get("fp16", {}).get("enabled"))
        self._micro = 0
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "raise_error_at_min_scale"):
            # DeepSpeed ends the run with a bare Exception at the minimum scale; the loop decides instead
            # (checkpoint, diagnosis, status 'failed').
            scaler.raise_error_at_min_scale = False

    def forward_backward(self, batch: dict, accumulation: int) -> torch.Tensor:
        loss = forward_loss(self.engine, batch_to(batch, self.engine.device), self.levers)  # logits not kept
        self.engine.backward(loss)
        self._micro += 1
        if self._micro < accumulation:
            self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        return loss.detach().float()

    def step(self, lr: float) -> StepResult:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.engine.step()
        self._micro = 0
        # DeepSpeed skips an update with inf/nan gradients itself (its overflow check, bf16 included), reading
        # the norm on the host inside step(); the norm may stay a tensor for the loop's one read
        norm = self.engine.get_global_grad_norm()
        norm = norm.detach() if torch.is_tensor(norm) else float(norm) if norm is not None else None
        scale = self.optimizer.cur_scale if self.fp16 and hasattr(self.optimizer, "cur_scale") else None
        scale = scale.detach() if torch.is_tensor(scale) else float(scale) if scale is not None else None
        return StepResult(skipped=not self.engine.was_step_applied(), loss_scale=scale, grad_norm=norm)

    def reset_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        """Drop a partly accumulated step's parameter gradients (a NaN loss: that update is never applied).

        ZeRO keeps a half-accumulated step in its own partition buffers as well (which ones depends on the
        stage, offload and the DeepSpeed version), so this is not enough to continue training: the OOM
        ladder rebuilds a DeepSpeed engine from :meth:`portable_state` instead (``resets_in_place``)."""
        self.engine.zero_grad()
        self._micro = 0

    def close(self) -> None:
        """Release what DeepSpeed keeps beyond this object (hooks, optimizer buffers), so that the memory of
        an engine being replaced (OOM ladder) is free before the next one is built."""
        self.engine.destroy()

    def portable_state(self) -> dict:
        """fp32 master weights and Adam moments by parameter name, on the CPU (to rebuild another engine)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        _link_optimizer_state(self.optimizer)
        out = {}
        for name, p in self.engine.module.named_parameters():
            if not p.requires_grad:
                continue
            entry = {"param": safe_get_full_fp32_param(p).detach().float().cpu()}
            for key in ("exp_avg", "exp_avg_sq"):
                try:  # no state yet: an OOM in the first step, possibly after some groups were stepped
                    v = safe_get_full_optimizer_state(p, key) if _has_optimizer_state(self.optimizer) else None
                except (ValueError, KeyError):
                    v = None
                if v is not None:
                    entry[key] = v.detach().float().cpu()
            out[name] = entry
        return out

    def load_portable_state(self, state: dict, step: int) -> None:
        """The inverse of :meth:`portable_state` on a fresh engine (the loop has already put the weights in
        the model before ``deepspeed.initialize``, so the 16-bit copies match; here the fp32 master copies
        and Adam's moments are set exactly)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        moments = any("exp_avg" in v for v in state.values())
        if moments:  # else DeepSpeed creates and links the state at the first step, as usual
            _materialize_adam_state(self.optimizer)
            _link_optimizer_state(self.optimizer)
        for name, p in self.engine.module.named_parameters():
            if name in state:
                safe_set_full_fp32_param(p, state[name]["param"])
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state[name]:  # else zero moments, as a fresh Adam has
                        safe_set_full_optimizer_state(p, state[name][key], key)
        _set_adam_step(self.optimizer, step)

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        self.engine.eval()
        try:
            return float(forward_loss(self.engine, batch_to(batch, self.engine.device), self.levers))
        finally:
            self.engine.train()

    def save(self, directory: str, client_state: dict) -> None:
        # Frozen parameters (a LoRA run's base) are left out: the model is rebuilt from the same base before a
        # resume, so the checkpoint holds the adapters, their fp32 master copies and Adam moments only.
        self.engine.save_checkpoint(directory, tag="ds", client_state={"vramfit": client_state},
                                    exclude_frozen_parameters=True)

    def load(self, directory: str) -> dict:
        # not strict: the frozen base is not in the checkpoint, it is already in the model
        _path, client = self.engine.load_checkpoint(directory, tag="ds", load_optimizer_states=True,
                                                    load_lr_scheduler_states=False,
                                                    load_module_strict=not self._has_frozen())
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
        return client["vramfit"]

    def _has_frozen(self) -> bool:
        return any(not p.requires_grad for p in self.engine.module.parameters())

    def save_final(self, directory: str) -> None:
        # Under ZeRO-3 the 16-bit weights are gathered onto rank 0 (stage3_gather_16bit_weights_on_model_save).
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.engine.zero_optimization_stage() == 3 else None
        if torch.distributed.get_rank() == 0:
            save_final(self.engine.module, directory, state_dict=state)

    def module(self) -> torch.nn.Module:
        return self.engine.module


def _has_optimizer_state(zero_optimizer) -> bool:
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    return any(len(st) > 0 for st in inner.state.values())


def _materialize_adam_state(zero_optimizer) -> None:
    """Create Adam's state (zero moments) for every fp32 partition of a fresh engine, as its first step
    would: DeepSpeed creates optimizer state lazily, and a state that does not exist cannot be set."""
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    # ZeRO-3 empties the inner optimizer's param groups between steps (it puts one fp32 partition in for
    # each sub-group's step); its state is keyed by those partitions. ZeRO-1/2 keep theirs in the groups.
    flat = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None)
    tensors = list(flat) if flat is not None else [p for g in inner.param_groups for p in g["params"]]
    for p in tensors:
        if len(inner.state.get(p, {})) == 0:
            # torch's AdamW counts steps in a tensor (on the parameter's device when fused); DeepSpeed's in an int
            step = (torch.zeros((), dtype=torch.float32, device=p.device if inner.defaults.get("fused") else "cpu")
                    if isinstance(inner, torch.optim.AdamW) else 0)
            inner.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _link_optimizer_state(zero_optimizer) -> None:
    """(Re)point each ZeRO-1/2 parameter's optimizer-state fragments at the optimizer's state.

    DeepSpeed links them once, after the first step, from inside the step of the first parameter group,
    when the state of the other groups (the no-weight-decay group) does not exist yet, so those
    parameters stay unlinked and ``safe_get_full_optimizer_state`` fails for them (0.19)."""
    if hasattr(zero_optimizer, "_hp_optimizer_states_linked") and hasattr(
            zero_optimizer, "_lazy_init_hp_params_optimizer_state"):
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def _set_adam_step(optimizer, step: int) -> None:
    """Adam's bias correction needs the number of updates done; DeepSpeed keeps it per group or per state."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for g in inner.param_groups:
        if "step" in g:
            g["step"] = step
    for st in inner.state.values():
        if "step" in st:
            st["step"] = torch.full_like(st["step"], float(step)) if torch.is_tensor(st["step"]) else step
