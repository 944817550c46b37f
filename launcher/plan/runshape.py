"""The run's shape (:class:`launcher.plan.memory.states.RunShape`) from its config: the model's config and
parameter counts, the settings every profile is planned with, and the refusals the run would make (a sequence
longer than the model's, a vocabulary the synthetic task does not fit, LoRA targets that do not exist, damaged
weights), made here so that a plan refuses what train would."""

from __future__ import annotations

from launcher.config.checks import synthetic_vocab_problem
from launcher.config.schema import AUTO, Config, ConfigError, packs_samples, reference_mode
from launcher.machine.hardware import Hardware
from launcher.model import hfconfig
from launcher.model.loss import head_problem
from launcher.model.targets import ALL_LINEAR, with_experts
from launcher.model.targets import problems as lora_problems
from launcher.plan.availability import Availability
from launcher.plan.memory.shape import count_params
from launcher.plan.memory.states import RunShape


def make_shape(cfg: Config, hw: Hardware, avail: Availability, world: int = 1, nodes: int = 1,
               links: dict | None = None) -> RunShape:
    config = hfconfig.load(cfg.model.name, cfg.model.trust_remote_code)
    hfconfig.check_seq_len(config, cfg.data.seq_len)  # plan refuses what train would
    vocab = synthetic_vocab_problem(cfg.data, config.vocab_size) if getattr(config, "vocab_size", None) else None
    if vocab:
        raise ConfigError([vocab])
    # damaged weights too (a plan for another machine may have config.json alone: absent weights are not refused)
    hfconfig.check_weights(cfg.model.name, config, required=False, trust_remote_code=cfg.model.trust_remote_code)
    targets = with_experts(tuple(cfg.lora.target_modules) or (ALL_LINEAR,), cfg.lora.experts,
                           hfconfig.has_experts(config))
    problems = _lora_problems(cfg, config) if cfg.lora.r else []
    if problems:
        raise ConfigError(problems)
    counts = count_params(config, cfg.lora.r, targets, cfg.model.trust_remote_code)
    device = avail.device.type
    pairs = cfg.task != "causal_lm"  # preference pairs: two sequences per sample, never a chunked loss
    return RunShape(config=config, counts=counts, device=device,
                    capability=hw.gpu(avail.device.index or 0).capability if device == "cuda" else (0, 0),
                    precision=avail.precision, seq_len=int(cfg.data.seq_len),
                    global_batch=int(cfg.train.global_batch_size), world=world,
                    checkpointing=cfg.model.gradient_checkpointing is True,
                    checkpoint_every=int(cfg.model.checkpoint_every),
                    attn_implementation="sdpa" if cfg.model.attn_implementation == AUTO else cfg.model.attn_implementation,
                    lora_r=int(cfg.lora.r), lora_targets=targets, lora_dropout=float(cfg.lora.dropout),
                    quantize=cfg.model.quantize, optimizer=cfg.train.optimizer,
                    trust_remote_code=bool(cfg.model.trust_remote_code),
                    chunked_loss=cfg.loss.chunked == "on" and not pairs,
                    chunked_mode=cfg.loss.chunked if not pairs else "off",
                    head_problem=_head_problem(config, cfg.model.trust_remote_code),
                    offload_activations=cfg.memory.offload_activations == "on",
                    offload_mode=cfg.memory.offload_activations,
                    nvme=hw.nvme if cfg.memory.nvme_path and hw.nvme else None, packed=packs_samples(cfg.data),
                    nodes=nodes, links=links, rows_per_sample=2 if pairs else 1,
                    reference_pass=reference_mode(cfg) == "adapter_off")


def _lora_problems(cfg: Config, config) -> list[str]:
    """The run's LoRA rule (launcher.model.targets.problems: targets that exist, experts only where there are
    some) on the model's meta copy, so a plan refuses what the run would; kept per model and settings."""
    from launcher.plan.memory.shape import build_meta_model, config_key, remembered

    lo = cfg.lora
    key = ("lora_problems", config_key(config), cfg.model.name, tuple(lo.target_modules), lo.experts,
           float(lo.dropout), bool(cfg.model.trust_remote_code))
    return remembered(key, lambda: lora_problems(build_meta_model(config, trust_remote_code=cfg.model.trust_remote_code),
                                                 cfg.model.name, lo.target_modules, lo.experts, lo.dropout),
                      lambda ps: {"problems": ps}, lambda d: list(d["problems"]))


_HEAD_PROBLEMS: dict = {}


def _head_problem(config, trust_remote_code: bool) -> str | None:
    """Why this architecture's loss cannot be chunked, from a one-layer meta model (None: it can); once per config
    (``--compare-gpus`` plans one model for every card)."""
    from launcher.plan.memory.shape import build_meta_model, config_key, remembered, with_depth

    key = (config_key(config), trust_remote_code)
    if key not in _HEAD_PROBLEMS:
        _HEAD_PROBLEMS[key] = remembered(
            ("head_problem", *key),
            lambda: head_problem(build_meta_model(with_depth(config, 1), trust_remote_code=trust_remote_code)),
            lambda problem: {"problem": problem}, lambda d: d["problem"])
    return _HEAD_PROBLEMS[key]
