"""The three engines behind one protocol (:mod:`.base`): DeepSpeed ZeRO, torch AMP and torch FSDP2 offload.

:func:`build` wraps a model in the engine of a resolved run; the engine modules never import each other.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from launcher.config import user_ds_config
from launcher.config.profiles import resolve_ds_config
from launcher.engines.amp import AmpEngine
from launcher.engines.base import Levers, make_optimizer
from launcher.engines.deepspeed import DeepSpeedEngine, restore_torch_functions
from launcher.engines.fsdp import FsdpEngine
from launcher.engines.offload_opt import OffloadOptEngine
from launcher.engines.swap import nvme_folder
from launcher.log import logger
from launcher.machine.hardware import Hardware, pin_memory_ok
from launcher.model.build import param_groups
from launcher.model.loss import liger_available
from launcher.model.materialize import Placement
from launcher.model.structure import most_module_params
from launcher.model.targets import expert_parameters
from launcher.precision import BYTES, trainable_dtype, weight_dtype


def restore_globals() -> None:
    """Undo what an engine changed for the whole process (ZeRO-3's ``torch.nn.functional.linear``), also where the
    engine failed to build or was never closed: later work in the process (a trace, another run) sees plain torch."""
    restore_torch_functions()


def placement(spec, adapters: bool) -> Placement:
    """Where the weights of ``spec``'s engine live and in what dtype: on the training device for AMP and ZeRO-1/2;
    on the CPU for FSDP2 offload and ZeRO-3 (which take them from there unit by unit, sharded); the base in
    :func:`launcher.precision.weight_dtype`, what trains in :func:`launcher.precision.trainable_dtype`."""
    on_cpu = spec.engine == "fsdp" or (spec.engine == "deepspeed" and spec.profile.zero_stage == 3)
    on_cpu = on_cpu or (spec.engine == "amp" and spec.profile.offload_optimizer)  # the fp32 masters stay there
    cast = spec.profile.module_in_compute_dtype
    return Placement(torch.device("cpu") if on_cpu else spec.device, weight_dtype(cast, spec.precision, adapters),
                     trainable_dtype(cast, spec.precision))


def build(cfg, spec, model, hw: Hardware, hidden_size: int, lr: float, materializer=None, objective=None):
    """(engine, ds_config or None) for ``spec`` (a :class:`launcher.plan.resolve.RunSpec`), optimizer at ``lr``;
    ``objective``: a preference task's loss (:class:`launcher.model.preference.Objective`), None for the causal LM's.

    ``model`` may still be on the meta device with its ``materializer`` (:mod:`launcher.model.materialize`): the
    engines that shard (FSDP2, ZeRO-3) make it one unit at a time as they shard it; the others make it whole here.
    """
    sharded = spec.engine == "fsdp" or (spec.engine == "deepspeed" and spec.profile.zero_stage == 3)
    if materializer is not None and not sharded:
        materializer.fill_all()
    groups = param_groups(model, cfg.train.weight_decay)
    t = cfg.train
    betas = (t.beta1, t.beta2)
    n_train = sum(p.numel() for g in groups for p in g["params"])
    levers = replace(make_levers(spec, hw), objective=objective)
    if spec.engine == "deepspeed":
        pin, why = engine_pinning(spec, hw, 16 * n_train) if spec.profile.offloads else (False, "")
        if spec.profile.offloads:
            logger.info(f"pin_memory {'on' if pin else 'off'}: {why}")
        swap = ""  # a swap folder of vramfit's (catalogue NVMe profiles); a user's deepspeed_config names its own
        if spec.user_ds is not None:  # deepspeed_config: the user's JSON, its "auto" filled like a profile's
            ds_config = user_ds_config.resolve(spec.user_ds, user_ds_config.run_values(
                cfg, spec.precision, spec.micro_batch, spec.accumulation, spec.world, hidden_size, pin, lr,
                largest_module=_zero3_bound(model)))
            zero = ds_config.get("zero_optimization", {})
            for k in ("offload_optimizer", "offload_param"):
                asked = spec.user_ds.template.get("zero_optimization", {}).get(k, {}).get("pin_memory")
                if isinstance(asked, bool) and asked != pin and isinstance(zero.get(k), dict):
                    logger.info(f"{k}.pin_memory {str(asked).lower()} as deepspeed_config asks (vramfit would choose "
                                f"{'on' if pin else 'off'}: {why})")
        else:
            swap = nvme_folder(cfg, spec)
            ds_config = resolve_ds_config(spec.profile, micro_batch=spec.micro_batch, accumulation=spec.accumulation,
                                          world=spec.world, grad_clip=t.grad_clip, lr=lr, betas=betas, eps=t.eps,
                                          weight_decay=t.weight_decay, hidden_size=hidden_size, pin_memory=pin,
                                          loss_scale=vars(cfg.loss_scale), trainable=n_train,
                                          nvme_path=swap,
                                          largest_param=max((p.numel() for p in model.parameters()), default=0),
                                          largest_module=_zero3_bound(model))
        # No optimizer section: torch's fused AdamW as DeepSpeed's client optimizer (no op to compile)
        # made once the weights are (ZeRO-3 makes them as it partitions them): the groups hold the made parameters
        def groups_of() -> list[dict]:
            return param_groups(model, cfg.train.weight_decay)

        client = None if "optimizer" in ds_config else (lambda groups: make_optimizer(
            groups, lr=lr, betas=betas, eps=t.eps, device=spec.device))
        return DeepSpeedEngine(model, ds_config=ds_config, param_groups=groups_of, device=spec.device,
                               optimizer=client, levers=levers, swap_folder=swap,
                               materializer=materializer if sharded else None), ds_config
    if spec.engine == "fsdp":
        pin, why = engine_pinning(spec, hw, 8 * n_train)
        logger.info(f"pin_memory {'on' if pin else 'off'}: {why}")
        return FsdpEngine(model, precision=spec.precision, device=spec.device, lr=lr, betas=betas, eps=t.eps,
                          weight_decay=t.weight_decay, grad_clip=t.grad_clip, loss_scale=cfg.loss_scale,
                          pin_memory=pin, levers=levers, materializer=materializer), None
    if spec.profile.offload_optimizer:  # amp-*-offload-opt: the 16-bit model on the device, the update on the CPU
        pin, why = engine_pinning(spec, hw, BYTES[spec.precision] * n_train)
        logger.info(f"pin_memory {'on' if pin else 'off'}: {why}")
        return OffloadOptEngine(model, precision=spec.precision, device=spec.device, param_groups=groups, lr=lr,
                                betas=betas, eps=t.eps, grad_clip=t.grad_clip, loss_scale=cfg.loss_scale,
                                pin_memory=pin, levers=levers), None
    return AmpEngine(model, precision=spec.precision, device=spec.device, param_groups=groups, lr=lr, betas=betas,
                     eps=t.eps, grad_clip=t.grad_clip, loss_scale=cfg.loss_scale, optimizer=t.optimizer,
                     levers=levers), None


def engine_pinning(spec, hw: Hardware, unplanned_bytes: int) -> tuple[bool, str]:
    """Whether the engine page-locks its CPU buffers: as the plan's row decided (it pins only where what the
    pinned allocator holds fits the host's budget) and where ``ulimit -l`` and free RAM allow the bytes it pins;
    ``unplanned_bytes`` where the run has no plan row for its profile."""
    row = spec.plan.get(spec.profile.name) if spec.plan is not None else None
    if row is None:
        return pin_memory_ok(hw, unplanned_bytes)
    if not row.pin_memory:
        return False, ("no CUDA device: pinned memory brings nothing" if spec.device.type != "cuda" else
                       "the plan pins nothing: what torch's pinned allocator would hold does not fit the host's budget "
                       "beside the rest (the copies are priced as pageable)")
    return pin_memory_ok(hw, row.pinned_bytes)


def offload_pinning(spec, hw: Hardware) -> tuple[bool, str]:
    """Whether activation offload pins its CPU copies: only on CUDA, and when ``ulimit -l`` and free RAM allow
    the planned bytes (as for DeepSpeed's and FSDP's pinned buffers)."""
    row = spec.plan.get(spec.profile.name) if spec.plan is not None else None
    planned = int(row.parts.get("cpu", {}).get("offloaded_activations", 0)) if row is not None else 0
    return pin_memory_ok(hw, planned) if spec.device.type == "cuda" else (False, "no CUDA device")


def make_levers(spec, hw: Hardware) -> Levers:
    """The loss and activation levers of ``spec`` as the engines run them (launcher.engines.base.Levers)."""
    liger = (spec.chunked_loss and spec.device.type == "cuda" and spec.precision != "fp16" and liger_available())
    pin = False
    if spec.offload_activations:
        pin, why = offload_pinning(spec, hw)
        logger.info(f"activation offload: {'pinned' if pin else 'pageable'} CPU copies ({why})")
    if spec.chunked_loss:
        logger.info("loss: " + ("Liger's fused linear cross-entropy" if liger else "chunked head + cross-entropy (torch)"))
    return Levers(chunked_loss=spec.chunked_loss, liger=liger, offload_activations=spec.offload_activations,
                  pin_memory=pin, checkpointing=spec.checkpointing)


def _zero3_bound(model: torch.nn.Module) -> int:
    """The module size ZeRO-3's gathered parameters are bounded by (launcher.config.profiles.zero3_residency), or
    0 for a mixture of experts, which keeps DeepSpeed's own bound: the experts a batch routes to change DeepSpeed's
    module order from the one it recorded, which it follows only while it prefetches without a bound ("tracing
    error at step N" on an OLMoE LoRA with the bound, also with its blocks made ZeRO-3 leaves)."""
    return 0 if expert_parameters(model) else most_module_params(model)
