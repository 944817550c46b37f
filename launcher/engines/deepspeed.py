"""DeepSpeed ZeRO (stage 2 and 3, optimizer and parameter offload) behind the engine protocol.

The config DeepSpeed receives is fully resolved by :func:`launcher.config.profiles.fill_auto` (no ``"auto"``), from
a catalogue profile or a user's ``deepspeed_config``; the loop owns the schedule and sets the lr on the
optimizer's param groups each step.
DeepSpeed wants ``engine.step()`` after every micro-batch; it only updates at the accumulation
boundary, so ``forward_backward`` calls it for the non-boundary micro-batches.
"""

from __future__ import annotations

import os

import torch

from launcher.engines import swap
from launcher.engines.base import Levers, StepResult, batch_to, forward_loss, forward_reference
from launcher.log import logger
from launcher.machine import dist
from launcher.machine.deepspeed_ops import clear_stale_op_locks, op_state, remember_cpu_info, use_env_ninja
from launcher.model.build import save_final


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


def _number_parameters_from_zero() -> None:
    """Number the next model's ZeRO-3 parameters from 0, as in a new process. DeepSpeed gives each parameter a
    ``ds_id`` from a process-wide counter, and names its NVMe swap files after them (``0_38.tensor.swp``,
    ``exp_avg-0_38.tensor.swp``); a checkpoint copies those files and a resume copies them back by name. An
    engine built after another in one process (the OOM ladder's rebuild) would count on, write files that a
    resume in a new process never reads, and train on from freshly initialized states without a word. The
    counter is DeepSpeed's ``Init.param_id`` (deepspeed/runtime/zero/partition_parameters.py); the engine
    before is closed by then, and ds_ids are only compared within one engine."""
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0


def _partition_as_made(model: torch.nn.Module, materializer, ds_config: dict) -> None:
    """ZeRO-3 without a whole copy of the model anywhere: each unit is made on the CPU
    (:class:`launcher.model.materialize.Materializer`) and partitioned at once, so a rank holds its partitions and one
    unit whole, never the model (several ranks on one host hold one copy between them). What
    ``deepspeed.zero.Init(module=...)`` does for a whole module, done unit by unit with one ``Init``: its
    ``_convert_to_zero_parameters`` copies each parameter to the GPU, broadcasts rank 0's values and keeps this
    rank's partition where the config's ``offload_param`` says. Without it ``deepspeed.initialize`` first moves
    the whole model to the GPU (``module.to(device)``: 12.6 GiB for a 7B model in 16 bits). Then the buffers go to
    the GPU, and ZeRO-3's memory-efficient linear replaces ``torch.nn.functional.linear``, as ``Init(module=...)``
    does (undone by :func:`restore_torch_functions`). DeepSpeed 0.19's own names, read in its
    ``runtime/zero/partition_parameters.py``."""
    from deepspeed.runtime.zero.partition_parameters import Init

    init = Init(config_dict_or_path=ds_config)
    for unit in materializer.units():
        materializer.fill(unit)
        init._convert_to_zero_parameters(unit.parameters(recurse=True))
    materializer.fill(model)
    init._convert_to_zero_parameters(model.parameters(recurse=True))  # the rest: converted ones are skipped
    for m in model.modules():
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = b.to(init.local_device)
    init._keep_in_fp32(model)
    if init.mem_efficient_linear:
        init._enable_mem_efficient_linear()


def optimizer_name(opt) -> str:
    inner = getattr(opt, "optimizer", opt)
    return type(inner).__name__


class DeepSpeedEngine:
    name = "deepspeed"
    beside = (".universal",)  # what a resume on another number of ranks makes beside a checkpoint (UNIVERSAL)
    resets_in_place = False  # ZeRO keeps a half-accumulated step in its own buffers: the OOM ladder rebuilds

    def __init__(self, model: torch.nn.Module, *, ds_config: dict, param_groups, device: torch.device,
                 optimizer=None, levers: Levers | None = None, swap_folder: str = "", materializer=None):
        """``param_groups``: a function returning the optimizer's parameter groups, called once the weights are
        made. ``optimizer``: a function of those groups returning (a torch optimizer, its name), DeepSpeed's
        client optimizer (the catalogue's profiles: torch's fused AdamW, no compiler needed); None: DeepSpeed
        builds the one the config's ``optimizer`` section names (its FusedAdam or DeepSpeedCPUAdam ops).
        ``swap_folder``: the NVMe swap folder made for this engine (launcher.engines.swap.nvme_folder), removed
        when it closes or, failing that, when the process exits.
        ``materializer``: ZeRO-3 with ``model`` on the meta device: made and partitioned one unit at a time
        (:func:`_partition_as_made`)."""
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
        # always: where the process group was made before (launcher.machine.dist), this only hands it to
        # DeepSpeed's comm layer, which zero.Init below reads the world size from (it says 1 without it)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        self.ds_config = ds_config
        self.device = device
        self.levers = levers
        if materializer is not None:
            _partition_as_made(model, materializer, ds_config)
        param_groups = param_groups()
        client, client_name = optimizer(param_groups) if optimizer is not None else (None, None)
        self.swap_folder = swap_folder
        zero = ds_config.get("zero_optimization", {})
        if zero.get("stage") == 3 and (zero.get("offload_optimizer") or {}).get("device") == "nvme":
            _number_parameters_from_zero()
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

    def apply_move(self, move, offload_activations: bool) -> None:
        raise NotImplementedError("a DeepSpeed engine is rebuilt down the OOM ladder (resets_in_place is False)")

    def close(self) -> None:
        """Release what DeepSpeed keeps beyond this object (hooks, optimizer buffers), so that the memory of
        an engine being replaced (OOM ladder) is free before the next one is built; its NVMe swap files; and
        ZeRO-3's replacement of torch.nn.functional.linear."""
        self.engine.destroy()
        restore_torch_functions()
        swap.release(self.swap_folder)

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

    def loss_scale_state(self) -> dict | None:
        """DeepSpeed's DynamicLossScaler as :class:`launcher.engines.base.ScaleRule`'s fields (the same rule)."""
        ls = getattr(self.optimizer, "loss_scaler", None)
        if not self.fp16 or not getattr(ls, "dynamic", False):
            return None
        return {"scale": float(ls.cur_scale), "iteration": ls.cur_iter, "last_overflow": ls.last_overflow_iter,
                "hysteresis_left": ls.cur_hysteresis}

    def load_portable_state(self, state: dict, step: int, loss_scale: dict | None = None) -> None:
        """The inverse of :meth:`portable_state` on a fresh engine (the loop has already put the weights in
        the model before ``deepspeed.initialize``, so the 16-bit copies match; here the fp32 master copies
        and Adam's moments are set exactly), and the loss scaler where the replaced engine's stood."""
        self._set_loss_scale(loss_scale)
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
    def reference_logps(self, batch: dict) -> torch.Tensor:
        self.engine.eval()
        try:
            return forward_reference(self.engine, batch_to(batch, self.engine.device))
        finally:
            self.engine.train()

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
        # the loss scaler rides in the client state too: DeepSpeed's universal load (another number of ranks)
        # restores weights and moments only
        extra = {"vramfit": client_state, "vramfit_loss_scale": self.loss_scale_state()}
        if self.engine.zero_nvme_offload_optimizer():
            extra["vramfit_nvme"] = _resident_optimizer_state(self.optimizer)
        self.engine.save_checkpoint(directory, tag="ds", client_state=extra, exclude_frozen_parameters=True)

    def load(self, directory: str) -> dict:
        written_by = len(_optimizer_files(directory))
        if written_by and written_by != self.engine.dp_world_size:
            return self._load_universal(directory, written_by)
        if self.engine.zero_nvme_offload_optimizer():
            self._check_swapped_state(directory)
            # Adam's state made now, swap-aware, so that DeepSpeed's swapper knows its files: the load below
            # copies the checkpoint's over them and reads them back (a fresh engine makes its state only at its
            # first step, which would write zero moments over the restored files)
            _materialize_adam_state(self.optimizer)
        # not strict: the frozen base is not in the checkpoint, it is already in the model
        _path, client = self.engine.load_checkpoint(directory, tag="ds", load_optimizer_states=True,
                                                    load_lr_scheduler_states=False,
                                                    load_module_strict=not self._has_frozen())
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
        if self.engine.zero_nvme_offload_optimizer():
            if "vramfit_nvme" not in client:
                raise RuntimeError("it lacks the optimizer state that DeepSpeed's NVMe checkpoint leaves out (the "
                                   "sub-groups kept in memory and Adam's step count): it was written by an older "
                                   "vramfit, and resuming would train on from freshly initialized states")
            _restore_resident_optimizer_state(self.optimizer, client["vramfit_nvme"])
        return client["vramfit"]

    def _load_universal(self, directory: str, written_by: int) -> dict:
        """A checkpoint written on another number of ranks: converted by rank 0 into DeepSpeed's universal
        checkpoint (whole fp32 weights and Adam moments per parameter) beside it, once, then loaded by every rank
        with the config's ``load_universal_checkpoint`` switched on for this load only."""
        if self.engine.zero_nvme_offload_optimizer():  # refused before loading (loop's resume rules); a guard
            raise RuntimeError(f"it was written on {written_by} rank(s) with the optimizer on NVMe, whose states "
                               "DeepSpeed's universal checkpoint conversion does not read")
        folder = universal_checkpoint(directory, is_main=torch.distributed.get_rank() == 0)
        torch.distributed.barrier()
        config = self.engine._config
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        hyper = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in inner.param_groups]
        config.load_universal_checkpoint = True
        try:
            _path, client = self.engine.load_checkpoint(folder, tag="ds", load_optimizer_states=True,
                                                        load_lr_scheduler_states=False,
                                                        load_module_strict=not self._has_frozen())
        finally:
            config.load_universal_checkpoint = False
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load the universal checkpoint in {folder}")
        # What DeepSpeed's ZeRO-3 universal load gets wrong (0.19.8, stage3.py
        # load_hp_checkpoint_state_from_checkpoint_dir_stage3): every parameter group is given the first group's
        # hyperparameters (the no-weight-decay group would decay), and every sub-group one shared step tensor,
        # which torch's AdamW then advances once per sub-group and step (Adam's bias correction drifts).
        for g, h in zip(inner.param_groups, hyper):
            g.update(h)
        for st in inner.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        self._set_loss_scale(client.get("vramfit_loss_scale"))
        return client["vramfit"]

    def _set_loss_scale(self, state: dict | None) -> None:
        ls = getattr(self.optimizer, "loss_scaler", None)
        if state is not None and self.fp16 and getattr(ls, "dynamic", False):
            ls.cur_scale, ls.cur_iter = float(state["scale"]), state["iteration"]
            ls.last_overflow_iter, ls.cur_hysteresis = state["last_overflow"], state["hysteresis_left"]

    def _check_swapped_state(self, directory: str) -> None:
        """With the optimizer on NVMe, a checkpoint's fp32 master and Adam moments are DeepSpeed's swap files,
        copied back into the swap folder by name at load, and read from there by the names of this engine's
        parameter groups: a file missing under this engine's name would leave that group as freshly
        initialized, silently. Refuse such a checkpoint instead."""
        rank = dist.current().local_rank if self.engine.use_node_local_storage() else self.engine.global_rank
        folder = os.path.join(directory, "ds", "offloaded_tensors", f"rank{rank:02d}")
        have = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        flat = self.optimizer.fp32_partitioned_groups_flat
        groups = [t.ds_id for i, t in enumerate(flat) if self.optimizer._swappable_optimizer_subgroup(i)]
        want = {f"{prefix}{g}.tensor.swp" for g in groups for prefix in ("", "exp_avg-", "exp_avg_sq-")}
        missing = sorted(want - have)
        if missing:
            raise RuntimeError(f"its NVMe optimizer state ({folder}) lacks {', '.join(missing[:3])}"
                               f"{' ...' if len(missing) > 3 else ''} of the {len(want)} files this engine reads "
                               f"(it holds {len(have)}: {', '.join(sorted(have)[:3])}); resuming would train on from "
                               "freshly initialized weights and moments")

    def _has_frozen(self) -> bool:
        return any(not p.requires_grad for p in self.engine.module.parameters())

    def save_final(self, directory: str) -> None:
        # Under ZeRO-3 the 16-bit weights are gathered onto rank 0 (stage3_gather_16bit_weights_on_model_save).
        # A LoRA run's final/ is its adapter: the frozen base is left out of the gathering (it would be a whole
        # 16-bit copy of the model on rank 0's CPU).
        state = self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=self._has_frozen()) \
            if self.engine.zero_optimization_stage() == 3 else None
        if torch.distributed.get_rank() == 0:
            save_final(self.engine.module, directory, state_dict=state)

    def module(self) -> torch.nn.Module:
        return self.engine.module


UNIVERSAL = DeepSpeedEngine.beside[0]  # checkpoints/step-NNNNNN.universal: its DeepSpeed universal checkpoint
_SOURCE = "source.json"  # in a conversion: the sizes and times of the files it was made from, to tell a stale one


def _optimizer_files(directory: str) -> list[str]:
    """The ZeRO optimizer partitions of a checkpoint written by :meth:`DeepSpeedEngine.save`, one per rank that
    wrote it (``zero_pp_rank_R_mp_rank_00_optim_states.pt``, with ``bf16_`` before it under ZeRO-1 bf16)."""
    import glob

    return sorted(glob.glob(os.path.join(directory, "ds", "*zero_pp_rank_*_mp_rank_*_optim_states.pt")))


def _source_of(directory: str) -> dict:
    ds = os.path.join(directory, "ds")
    return {n: [os.path.getsize(os.path.join(ds, n)), os.stat(os.path.join(ds, n)).st_mtime_ns]
            for n in sorted(os.listdir(ds))}


def universal_checkpoint(directory: str, *, is_main: bool = True) -> str:
    """The universal checkpoint of the ZeRO checkpoint ``directory``, made by DeepSpeed's own converter
    (``deepspeed.checkpoint.ds_to_universal``; ZeRO-1/2 and 3) into ``directory + '.universal'``: under a ``.tmp``
    name, renamed when complete, so a killed conversion leaves nothing that looks finished; the checkpoint
    itself is only read. Made once and reused while the checkpoint's files are those it was made from. Returns
    its path on every rank; only ``is_main`` converts."""
    import argparse
    import contextlib
    import io
    import json
    import shutil

    out = os.path.normpath(directory) + UNIVERSAL
    if not is_main:
        return out
    source = _source_of(directory)
    try:
        with open(os.path.join(out, _SOURCE)) as f:
            if json.load(f) == source:
                return out
    except (OSError, ValueError):
        pass
    from deepspeed.checkpoint import ds_to_universal

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        args = argparse.Namespace(input_folder=os.path.join(directory, "ds"), output_folder=os.path.join(tmp, "ds"),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  # a plain Hugging Face model records no universal-checkpoint layout (tensor or
                                  # pipeline parallel): DeepSpeed's default for a missing one is the one that fits
                                  inject_missing_state=True)
        printed = io.StringIO()
        try:  # the converter prints progress (stdout may be --json's) and tqdm bars: kept to show on a failure
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                ds_to_universal.main(args)
        except Exception:
            logger.warning(f"DeepSpeed's universal checkpoint conversion of {directory} failed; it printed:\n"
                           + printed.getvalue()[-3000:])
            raise
        with open(os.path.join(tmp, _SOURCE), "w") as f:
            json.dump(source, f)
        if os.path.exists(out):  # a conversion of an earlier checkpoint of the same name
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(f"converted {directory} to DeepSpeed's universal checkpoint in {out} (for {dist.current().world} "
                "rank(s); the checkpoint itself is unchanged)")
    return out


def _has_optimizer_state(zero_optimizer) -> bool:
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    return any(len(st) > 0 for st in inner.state.values())


def _resident_optimizer_state(zero3) -> dict:
    """What a ZeRO-3 checkpoint with the optimizer on NVMe leaves out, by sub-group: DeepSpeed saves the swap
    files (the fp32 master and Adam moments of each sub-group large enough to swap) and at load skips its own
    optimizer state file, so the sub-groups too small to swap (norm weights, biases), which stay in memory,
    and Adam's step count of every sub-group, would come back as freshly initialized (0.19.8:
    ``DeepSpeedEngine.load_checkpoint`` loads the ZeRO checkpoint only ``if not
    self.zero_nvme_offload_optimizer()``). A few kB for a model of billions: kept in vramfit's client state."""
    inner = zero3.optimizer
    out = {}
    for i, flat in enumerate(zero3.fp32_partitioned_groups_flat):
        st = inner.state.get(flat, {})
        step = st.get("step")
        entry = {"step": step.detach().clone() if torch.is_tensor(step) else step}
        if not zero3._swappable_optimizer_subgroup(i):
            entry["fp32"] = flat.detach().clone()
            entry.update({k: st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq") if k in st})
        out[i] = entry
    return out


def _restore_resident_optimizer_state(zero3, saved: dict) -> None:
    """The inverse of :func:`_resident_optimizer_state`, after DeepSpeed's load has copied the swap files back;
    then each resident sub-group's 16-bit weights are made from its fp32 master again, as DeepSpeed's load
    does for the swapped ones (``reset_swap_buffers``)."""
    flats = zero3.fp32_partitioned_groups_flat
    if len(saved) != len(flats):
        raise RuntimeError(f"its NVMe optimizer state has {len(saved)} sub-groups, this engine {len(flats)}")
    inner = zero3.optimizer
    for i, entry in saved.items():
        flat, st = flats[i], inner.state[flats[i]]
        if entry["step"] is not None:
            st["step"] = entry["step"].to(st["step"].device) if torch.is_tensor(st.get("step")) else entry["step"]
        if "fp32" in entry:
            if entry["fp32"].shape != flat.shape:
                raise RuntimeError(f"its sub-group {i} holds {entry['fp32'].numel()} values, this engine's "
                                   f"{flat.numel()}")
            flat.data.copy_(entry["fp32"])
            for k in ("exp_avg", "exp_avg_sq"):
                if k in entry:
                    st[k].copy_(entry[k])
            zero3._reassign_or_swap_out_partitioned_parameters(i)  # the 16-bit partition from the fp32 master


def _materialize_adam_state(zero_optimizer) -> None:
    """Create Adam's state (zero moments) for every fp32 partition of a fresh engine, as its first step
    would: DeepSpeed creates optimizer state lazily, and a state that does not exist cannot be set."""
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    # ZeRO-3 empties the inner optimizer's param groups between steps (it puts one fp32 partition in for
    # each sub-group's step); its state is keyed by those partitions. ZeRO-1/2 keep theirs in the groups.
    flat = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None)
    tensors = list(flat) if flat is not None else [p for g in inner.param_groups for p in g["params"]]
    # A sub-group whose state is swapped to NVMe holds no values between steps: it is swapped in around the
    # state's making and out again, as a step does, which gives the swapper the state's files.
    swapped = getattr(zero_optimizer, "_swappable_optimizer_subgroup", lambda i: False)
    for i, p in enumerate(tensors):
        if len(inner.state.get(p, {})) == 0:
            if flat is not None and swapped(i):
                zero_optimizer._optimizer_states_and_gradient_swap_in(i)
            # torch's AdamW counts steps in a tensor (on the parameter's device when fused); DeepSpeed's in an int
            step = (torch.zeros((), dtype=torch.float32, device=p.device if inner.defaults.get("fused") else "cpu")
                    if isinstance(inner, torch.optim.AdamW) else 0)
            inner.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            if flat is not None and swapped(i):
                zero_optimizer._optimizer_states_and_gradient_swap_out(i)


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
