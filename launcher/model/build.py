"""Models: presets built from configs, local HF directories or hub ids; the tokenizer; checkpointing; the
final weights.

Each weight is made once, in the dtype it trains in and where it lives (:mod:`launcher.model.materialize`,
placed by :func:`launcher.precision.weight_dtype` and the engine): a LoRA base in 16 bits, trainable weights in
fp32 for AMP and FSDP (autocast and MixedPrecisionPolicy compute in 16 bits from fp32 masters) or in 16 bits for
DeepSpeed's fp16/bf16 profiles (DeepSpeed keeps the fp32 master copy in its optimizer).
"""

from __future__ import annotations

import os

import torch

from launcher.config.schema import Config, ConfigError
from launcher.log import logger
from launcher.model import checkpointing, hfconfig, lora, quantize
from launcher.model.hfconfig import is_local
from launcher.model.materialize import Materializer, Placement, meta_model, tensor_keys
from launcher.model.presets import PRESETS
from launcher.model.weights import FINAL_SHARD_BYTES, Checkpoint, has_safetensors


def model_config(cfg: Config):
    """The transformers config of ``cfg.model.name`` (no weights)."""
    return hfconfig.load(cfg.model.name, cfg.model.trust_remote_code)


def attn_impl(cfg: Config, hf_config=None) -> str:
    """``auto``: sdpa (fused kernels) where the architecture supports it, else eager."""
    if cfg.model.attn_implementation != "auto":
        return cfg.model.attn_implementation
    if hf_config is None:
        return "sdpa"
    try:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping[type(hf_config)]
        return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    except (KeyError, AttributeError):  # custom code models: let transformers pick
        return "sdpa"


def has_tokenizer_files(path: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    return any(os.path.isfile(os.path.join(path, n)) for n in names)


def load_tokenizer(cfg: Config):
    """The tokenizer of ``model.name`` (None for presets and model directories without one). A tokenizer
    without a pad token pads with eos (padded positions are never in the loss), and says so."""
    name = cfg.model.name
    if name in PRESETS:
        return None
    path = os.path.expanduser(name)
    if is_local(name) and not has_tokenizer_files(path):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        if is_local(name):
            raise ConfigError([f"model.name: the tokenizer in {name!r} does not load ({str(e).splitlines()[0]}); "
                               "rule: tokenizer files as tokenizer.save_pretrained writes them; fix: re-save them"]) from None
        return None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
        logger.info(f"the tokenizer of {name} has no pad token: padding with eos {tok.eos_token!r} (id {tok.eos_token_id}); "
            "padded positions are masked out of the loss")
    return tok


def experts_kernel(device_type: str, capability: tuple | None, dtype: torch.dtype) -> str | None:
    """The experts implementation a mixture-of-experts model needs on this device, None for transformers' default
    (``grouped_mm``). Its CUDA kernel takes bf16 only, and transformers calls it on any GPU of compute capability
    8.0 or newer whatever the dtype (an fp32 master on the AMP path, fp16): there the experts run ``eager`` (a loop
    over the experts that tokens were routed to). Older GPUs and CPUs are served by the default: transformers
    itself takes its fallback kernel below 8.0, and the CPU kernel takes every float dtype."""
    if device_type == "cuda" and capability is not None and tuple(capability) >= (8, 0) and dtype != torch.bfloat16:
        return "eager"
    return None


def build_model(cfg: Config, placement: Placement, hf_config=None, *, precision: str = "fp32",
                checkpointing: bool = False, checkpoint_every: int = 1, offload_activations: bool = False,
                pin_memory: bool = False, overrides: dict | None = None) -> tuple[torch.nn.Module, Materializer]:
    """The run's model and the :class:`Materializer` that makes its weights (:mod:`launcher.model.materialize`).

    The model comes back on the meta device, with activation checkpointing and LoRA (``lora.r > 0``) applied, for
    the engine to fill (all at once, or one unit at a time as it shards), except where the weights have to be made
    here: a bitsandbytes-quantised base (``model.quantize``; quantised unit by unit as it is made, before peft
    wraps it) and a checkpoint that cannot be read tensor by tensor (not safetensors, or keys transformers
    converts while loading: loaded by ``from_pretrained`` onto ``placement.device``). LoRA adapters get the same
    initial values in every case. ``overrides``: {parameter name: {"param": tensor}} put in instead."""
    hf_config = hf_config if hf_config is not None else model_config(cfg)
    quant = cfg.model.quantize
    adapters = cfg.lora.r > 0
    attn = attn_impl(cfg, hf_config)
    model = meta_model(hf_config, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code,
                       dtype=placement.frozen_dtype if adapters else placement.trainable_dtype)  # config.dtype
    hf_keys = tensor_keys(model)
    checkpoint, made = None, False
    if cfg.model.name not in PRESETS:
        path = os.path.expanduser(cfg.model.name)
        checkpoint = readable_checkpoint(path, model) if quant == "none" else None
        if checkpoint is None:
            model = _from_pretrained(cfg, path, hf_config, attn, placement, precision)
            hf_keys, made = tensor_keys(model), True
    if adapters:
        model.requires_grad_(False)  # the base: made in the frozen dtype
    if quant != "none" and not made:  # a preset: quantised one unit at a time as it is made
        Materializer(model, placement, seed=cfg.seed, hf_keys=hf_keys, after_fill=lambda unit: quantize.quantize_in_place(
            model, quant, precision, placement.device, within=unit)).fill_all()
        made = True
    base_dtype = placement.frozen_dtype if adapters else placement.trainable_dtype
    kernel = experts_kernel(placement.device.type, torch.cuda.get_device_capability(placement.device)
                            if placement.device.type == "cuda" else None, base_dtype) \
        if hfconfig.has_experts(hf_config) else None
    if kernel and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(kernel)
        logger.info(f"experts: transformers' {kernel} implementation (torch's grouped_mm on this GPU takes bf16 only; "
                    f"the weights are {str(base_dtype).replace('torch.', '')})")
    if quant != "none":
        quantize.keep_4bit_weights_trainable(model)
        logger.info(f"model.quantize={quant}: {quantize.describe(model)}")
    if checkpointing:
        enable_checkpointing(model, checkpoint_every, offload_activations, pin_memory)
    if adapters:
        model = lora.apply_lora(cfg, model, lora.base_name_for(cfg))
        if cfg.model.adapter:  # the loaded adapter goes in where the new one's initial values would (a rebuild's own
            overrides = {**lora.adapter_weights(cfg, model), **(overrides or {})}  # state, handed on, wins)
    mat = Materializer(model, placement, seed=cfg.seed, hf_keys=hf_keys, checkpoint=checkpoint, overrides=overrides)
    if made:  # nothing left on the meta device but what peft added: the adapters, made and initialised as always
        mat.fill(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in (overrides or {}):
                    p.copy_(overrides[name]["param"])
    return model, mat


def make_model(cfg: Config, placement: Placement | None = None, hf_config=None, **kw) -> torch.nn.Module:
    """:func:`build_model` made whole at once (a script, the export, a test): by default fp32 on the CPU, a LoRA
    base in fp32 too."""
    placement = placement or Placement(torch.device("cpu"), torch.float32, torch.float32)
    model, materializer = build_model(cfg, placement, hf_config, **kw)
    materializer.fill_all()
    if materializer.checkpoint is not None:
        materializer.checkpoint.close()
    return model


def readable_checkpoint(path: str, meta) -> Checkpoint | None:
    """The directory's safetensors when they hold every tensor of the model's state dict under its own name (read
    tensor by tensor, :mod:`launcher.model.weights`); None when transformers must load it (``.bin`` weights, or
    keys it renames or converts while loading)."""
    if not has_safetensors(path):
        return None
    ckpt = Checkpoint(path)
    keys = tensor_keys(meta)
    if all(keys.get(id(t), name) in ckpt and ckpt.entries[keys.get(id(t), name)].dtype is not None
           for name, t in meta.state_dict(keep_vars=True).items()):
        return ckpt
    ckpt.close()
    return None


def _from_pretrained(cfg: Config, path: str, hf_config, attn: str, placement: Placement, precision: str):
    from transformers import AutoModelForCausalLM

    kw = {"device_map": {"": placement.device}}
    if cfg.model.quantize != "none":  # quantized while loading, shard by shard, on the training device
        kw["quantization_config"] = quantize.bnb_config(cfg.model.quantize, precision)
    dtype = placement.frozen_dtype if cfg.lora.r > 0 else placement.trainable_dtype
    model = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=dtype, attn_implementation=attn,
                                                 trust_remote_code=cfg.model.trust_remote_code, **kw)
    model.config.use_cache = False
    return model


def enable_checkpointing(model, every: int = 1, offload: bool = False, pin_memory: bool = False) -> None:
    """Activation checkpointing on every ``every``-th decoder layer (:mod:`launcher.model.checkpointing`); ``offload``:
    the checkpointed layers' inputs in CPU memory."""
    checkpointing.enable(model, every, offload, pin_memory)


def _numel(p) -> int:
    """Elements of the full parameter: ZeRO-3 keeps only a partition (``ds_numel`` is the whole), and a
    bitsandbytes 4-bit weight packs two values per byte (``quant_state.shape`` is the real shape)."""
    if hasattr(p, "ds_numel"):
        return int(p.ds_numel)
    qs = getattr(p, "quant_state", None)
    if qs is not None and getattr(qs, "shape", None) is not None:
        return int(torch.Size(qs.shape).numel())
    return p.numel()


def count_params(model) -> tuple[int, int]:
    total = sum(_numel(p) for p in model.parameters())
    trainable = sum(_numel(p) for p in model.parameters() if p.requires_grad)
    return total, trainable


def param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices only (not norms and biases), as nanoGPT and most recipes do."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def save_final(model, out_dir: str, tokenizer=None, state_dict=None) -> None:
    """HF ``save_pretrained`` weights (or the adapter for a peft model) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    kw = {}
    if hasattr(model, "peft_config"):
        # Only linear layers carry adapters (launcher.model.lora), never the embeddings; saying so spares peft a hub
        # lookup of the base's config.json that it makes to find out (and that fails offline).
        kw["save_embedding_layers"] = False
    # shards of FINAL_SHARD_BYTES: safetensors copies a shard's GPU tensors to the CPU before writing it, so the
    # shard size is what writing a full model adds to the host's memory (the plan's final phase counts it)
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True, max_shard_size=FINAL_SHARD_BYTES,
                          **kw)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
