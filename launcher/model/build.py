"""Models: presets built from configs, local HF directories or hub ids; the tokenizer; checkpointing; the
final weights.

Weights load in the dtype the profile needs: fp32 for the AMP and FSDP paths (autocast and
MixedPrecisionPolicy compute in 16 bits from fp32 masters), 16 bits for DeepSpeed fp16/bf16
profiles (DeepSpeed keeps the fp32 master copy in its optimizer).
"""

from __future__ import annotations

import os

import torch

from launcher.config.schema import Config, ConfigError
from launcher.log import logger
from launcher.model import checkpointing, hfconfig, lora, quantize
from launcher.model.hfconfig import is_local
from launcher.model.presets import PRESETS


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


def build_model(cfg: Config, dtype: torch.dtype = torch.float32, hf_config=None, *,
                device: torch.device | None = None, precision: str = "fp32", checkpointing: bool = False,
                checkpoint_every: int = 1, offload_activations: bool = False, pin_memory: bool = False):
    """Instantiate the model in ``dtype``: random init for presets, weights from a directory/hub; then
    bitsandbytes quantization (``model.quantize``, done on ``device``), activation checkpointing and LoRA
    (``lora.r > 0``)."""
    from transformers import AutoModelForCausalLM

    hf_config = hf_config if hf_config is not None else model_config(cfg)
    quant = cfg.model.quantize
    device = device or torch.device("cpu")
    if cfg.model.name in PRESETS:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_impl(cfg, hf_config), dtype=dtype)
        if quant != "none":
            quantize.quantize_in_place(model, quant, precision, device)
    else:
        kw = {}
        if quant != "none":  # quantized while loading, shard by shard, on the training device
            kw = {"quantization_config": quantize.bnb_config(quant, precision), "device_map": {"": device}}
        model = AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(cfg.model.name), config=hf_config, dtype=dtype, attn_implementation=attn_impl(cfg, hf_config),
            trust_remote_code=cfg.model.trust_remote_code, **kw)
    model.config.use_cache = False
    kernel = experts_kernel(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
                            dtype) if hfconfig.has_experts(hf_config) else None
    if kernel and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(kernel)
        logger.info(f"experts: transformers' {kernel} implementation (torch's grouped_mm on this GPU takes bf16 only; "
                    f"the weights are {str(dtype).replace('torch.', '')})")
    if quant != "none":
        quantize.keep_4bit_weights_trainable(model)
        logger.info(f"model.quantize={quant}: {quantize.describe(model)}")
    if checkpointing:
        enable_checkpointing(model, checkpoint_every, offload_activations, pin_memory)
    if cfg.lora.r > 0:
        model = lora.apply_lora(cfg, model, lora.base_name_for(cfg))
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
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True, **kw)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
