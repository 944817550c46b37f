"""Run configuration's schema: one dataclass per section, every key with its default and its rule.

Every field carries a one-line ``help`` (used by ``vramfit config-reference`` and docs/reference/config.md), and
optionally ``choices`` or bounds. :mod:`.load` reads a YAML file plus ``key=value`` overrides against these
dataclasses and :mod:`.checks` holds the rules between fields; every problem (unknown key, bad type, out-of-range
value, impossible batch arithmetic) is collected and raised as one :class:`ConfigError` listing them, each with the
value, the rule and the fix. Also here: what an ``auto`` setting comes to once the rest of the config is known, and
the config written out (YAML, a dict, the reference table).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

AUTO = "auto"


class ConfigError(ValueError):
    """A bad setting. ``problems`` holds one line per problem: value, rule, fix."""

    def __init__(self, problems: list[str], source: str = "configuration"):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the {source}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


def _f(default, help: str, choices=None, min=None, max=None, auto: bool = False, number=None, above=None,
       below=None, items=None, **kw):
    """A schema field: default, one-line help, allowed values, bounds (``min``/``max`` inclusive,
    ``above``/``below`` exclusive, for values where the bound itself cannot train: Adam's beta of 1, an
    epsilon of 0), whether 'auto' is allowed, for 'auto' fields the number type of the other values, and for a
    list of sections the section's dataclass (``items``)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "auto": auto, "number": number,
            "above": above, "below": below, "items": items}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


ENGINES = ("auto", "deepspeed", "amp", "fsdp")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")


@dataclass
class ModelConfig:
    name: str = _f("tiny", "Preset name (tiny, llama-125m ... llama-13b), a local HF model directory, or a hub id.")
    gradient_checkpointing: Any = _f(AUTO, "Recompute layers' activations in backward (~30% slower, keeps only layer "
                                     "inputs): true, false, or auto (the planner picks off, every k-th layer or all: "
                                     "the fastest that fits).", auto=True, number=bool)
    checkpoint_every: int = _f(1, "With gradient_checkpointing=true: checkpoint every N-th decoder layer (1 = all); the "
                               "layers in between keep their activations and skip the recompute.", min=1)
    attn_implementation: str = _f("auto", "Attention kernel: auto (sdpa where available), eager or sdpa.",
                                  choices=("auto", "eager", "sdpa"))
    quantize: str = _f("none", "Base weights in 4-bit NF4 (QLoRA) or 8-bit; needs bitsandbytes and LoRA.",
                       choices=("none", "4bit", "8bit"))
    trust_remote_code: bool = _f(False, "Allow custom modelling code from a model directory or hub repo.")
    compile: bool = _f(False, "torch.compile each decoder layer (AMP and FSDP paths); the first steps pay the "
                       "compilation.")
    liger: bool = _f(False, "Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (CUDA only; needs liger-kernel).")
    adapter: str = _f("", "A LoRA adapter folder to start from (an SFT run's RUN/final): its weights replace the new "
                      "adapter's initial ones; lora.r, alpha, dropout and target_modules come from its "
                      "adapter_config.json unless given (and must then agree).")


@dataclass
class LoraConfig:
    r: int = _f(0, "LoRA rank; 0 turns LoRA off (full fine-tune).", min=0)
    alpha: float = _f(16.0, "LoRA scaling numerator (scale = alpha / r).", min=0)
    dropout: float = _f(0.0, "Dropout on the LoRA input.", min=0.0, below=1.0)  # 1: the adapters see only zeros
    target_modules: list = _f(["all-linear"], "Module names to adapt; 'all-linear' = every linear layer of the decoder.")
    experts: str = _f("auto", "A mixture-of-experts model's expert weights (3-D parameters, not linear layers): "
                      "true adapts them, false leaves them out, auto adapts them with target_modules=all-linear. "
                      "The router stays frozen.", choices=("auto", "true", "false"))


RECORD_FORMATS = ("auto", "text", "prompt_response", "alpaca", "messages")
CHAT_TEMPLATES = ("auto", "plain", "chatml", "zephyr", "llama3")


@dataclass
class SourceConfig:
    """One entry of ``data.sources``: where records come from, how much of the mixture they make, how to read them."""

    path: str = _f("", "A data file, a folder or glob of shards, or a hub dataset id.")
    weight: float = _f(1.0, "Share of the mixture (weights are normalised over the sources; 0 leaves the source out).",
                       min=0.0)
    format: str = _f("auto", "Record format of this source (auto: from the fields).", choices=RECORD_FORMATS)
    text_field: str = _f("", "Field of plain text records (empty: data.text_field).")
    prompt_field: str = _f("", "Prompt field of prompt_response records (empty: data.prompt_field).")
    response_field: str = _f("", "Response field of prompt_response records (empty: data.response_field).")
    name: str = _f("", "Hub datasets only: the configuration name.")
    split: str = _f("train", "Hub datasets only: the split.")


@dataclass
class DataConfig:
    source: str = _f("synthetic", "'synthetic' (built-in learnable task), a data file, a folder or glob of shards "
                     "(jsonl, json, csv, parquet, txt, arrow), or a hub dataset id where the network allows.")
    sources: list = _f([], "Several sources mixed by weight, [{path, weight, format, ...}] (docs/data.md); replaces "
                       "data.source.", items=SourceConfig)
    eval_source: str = _f("", "A separate eval source (a file, folder, glob or hub id); empty: data.eval_fraction.")
    format: str = _f("auto", "Record format: auto (from the fields), text, prompt_response, alpaca, messages.",
                     choices=RECORD_FORMATS)
    text_field: str = _f("text", "Field holding plain text records.")
    prompt_field: str = _f("prompt", "Field holding the prompt of prompt_response records (masked out of the loss).")
    response_field: str = _f("response", "Field holding the response of prompt_response records (in the loss).")
    seq_len: int = _f(128, "Tokens per sample.", min=8)
    packing: bool = _f(True, "Pack samples back to back into seq_len blocks: text as one stream, instruction and chat "
                       "samples padding-free (each attends only to itself); false: one sample per row, padded.")
    train_on_prompt: bool = _f(False, "Train on prompt, system and user tokens too (padding never is).")
    chat_template: str = _f("auto", "Template of messages records: auto (the tokenizer's, else plain 'role: content' "
                            f"lines), {', '.join(CHAT_TEMPLATES[1:])}, or a Jinja file.")
    encoding: str = _f("utf-8", "Text encoding of jsonl, json, csv and txt files (e.g. latin-1, cp1252, utf-16).")
    max_invalid_fraction: float = _f(0.05, "Stop when more than this fraction of records is dropped as invalid (the "
                                     "first ones are named with file, line and reason).", min=0.0, max=1.0)
    cache_dir: str = _f("auto", "Tokenized-data cache, reused by later starts and resumes; auto: $VRAMFIT_CACHE/data "
                        "or ~/.cache/vramfit/data.")
    num_proc: Any = _f("auto", "Processes that tokenize a new source: auto (the CPU cores for large data, 1 for small) "
                       "or a number.", min=1, auto=True, number=int)
    eval_fraction: float = _f(0.0, "Fraction of samples held out for eval loss (0 = no eval).", min=0.0, max=0.5)
    num_samples: int = _f(4096, "Samples the synthetic task generates.", min=16)
    vocab_size: int = _f(256, "Vocabulary of the synthetic task (must fit the model's).", min=8)


LR_SCHEDULES = ("auto", "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr",
                "cosine_with_restarts", "polynomial", "inverse_sqrt")


@dataclass
class EvalConfig:
    max_batches: int = _f(0, "Micro-batches per rank one eval runs at most (0 = the whole eval split, every sample "
                          "once).", min=0)


@dataclass
class TrainConfig:
    max_steps: int = _f(200, "Optimizer steps to run.", min=1)
    # auto by default: the micro-batch is a memory and speed knob the planner chooses (the fastest that fits, up to
    # the global batch per rank); the global batch is the training choice and stays the user's
    micro_batch_size: Any = _f(AUTO, "Samples per forward/backward per rank (int, or 'auto': the planner's fastest "
                                     "that fits).", min=1, auto=True, number=int)
    global_batch_size: int = _f(16, "Samples per optimizer step over all ranks = micro x accumulation x world.", min=1)
    lr: float = _f(3e-3, "Peak learning rate.", above=0.0)
    min_lr_ratio: float = _f(0.1, "Cosine schedule ends at lr x this.", min=0.0, max=1.0)
    warmup_steps: Any = _f(AUTO, "Linear warmup steps before the cosine decay; auto = 10% of train.max_steps.", min=0,
                           auto=True, number=int)
    weight_decay: float = _f(0.0, "AdamW weight decay, applied to matrices only (not norms and biases).", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1.", min=0.0, below=1.0)  # 1: bias correction m / (1 - 1**t) = 0/0
    beta2: float = _f(0.95, "AdamW beta2.", min=0.0, below=1.0)  # 1: v / (1 - 1**t) = 0/0: NaN at step 1
    eps: float = _f(1e-8, "AdamW epsilon.", above=0.0)  # 0: a parameter whose gradient is 0 divides 0 by 0
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 = off).", min=0.0)
    eval_every: int = _f(0, "Eval loss and perplexity every N steps (0 = only at the end when an eval split exists).",
                         min=0)
    epochs: float = _f(0.0, "Passes over the training data, instead of train.max_steps (0 = train.max_steps decides); "
                       "max_steps = ceil(epochs x training samples / global_batch_size).", min=0.0)
    lr_schedule: str = _f("auto", "Learning-rate schedule after the warmup: auto (cosine down to lr x min_lr_ratio), or "
                          "a name of transformers.get_scheduler (constant keeps no warmup).", choices=LR_SCHEDULES)
    early_stopping_patience: int = _f(0, "Stop after this many evals in a row without a lower eval loss (status "
                                      "stopped_early, final/ from the best checkpoint); 0 = never.", min=0)
    optimizer: str = _f("adamw", "adamw, adamw8bit (bitsandbytes, AMP path only), or paged_adamw8bit (bitsandbytes' "
                        "paged 8-bit AdamW: states in CUDA unified memory that pages to the CPU under pressure; CUDA "
                        "and the AMP path only).", choices=("adamw", "adamw8bit", "paged_adamw8bit"))
    threads: Any = _f(AUTO, "Intra-op CPU threads of the training process (matmuls, the optimizer step): auto = the "
                      "cores other processes leave free (measured at start), or a number.", min=1, auto=True,
                      number=int)
    oom_fallback: bool = _f(True, "On out-of-memory step down the ladder (smaller micro-batch, checkpointing, more "
                            "offload); false = fail at once (benchmarks, so a result is the asked settings).")


@dataclass
class LossScaleConfig:
    initial_power: int = _f(16, "fp16 dynamic loss scale starts at 2**initial_power.", min=0, max=32)
    window: int = _f(1000, "Overflow-free steps (after the one following an overflow) before the scale doubles.", min=1)
    hysteresis: int = _f(2, "Overflows that only skip the step before the scale halves (refilled when it grows); "
                         "DeepSpeed's rule, on every engine.", min=1)
    min_scale: float = _f(1.0, "The scale never goes below this.", above=0.0)  # 0: a loss scaled to 0 trains nothing
    patience: int = _f(10, "Overflowing steps in a row at min_scale before the run stops (checkpoint + diagnosis).", min=1)


@dataclass
class MemoryConfig:
    # at most 1 PiB: GiB x a budget beyond ~1e299 is a float overflow, and no machine has that much
    gpu_budget: Any = _f("auto", "GPU memory budget in GiB, or 'auto' (free memory now minus margin).", min=0.1,
                         max=2.0 ** 20, auto=True)
    cpu_budget: Any = _f("auto", "CPU RAM budget in GiB, or 'auto' (available RAM minus margin).", min=0.1,
                         max=2.0 ** 20, auto=True)
    margin: float = _f(0.1, "Safety margin taken off auto budgets (fraction).", min=0.0, max=0.9)
    offload_activations: str = _f("auto", "Activations saved for backward go to CPU memory in the forward and come "
                                  "back in the backward (with checkpointing: only the checkpointed layers' inputs); "
                                  "on, off, or auto (the planner turns it on when nothing fits without it). Exact; "
                                  "costs two copies of those bytes per micro-batch.", choices=("auto", "on", "off"))
    mmap_threshold_mib: Any = _f(AUTO, "CPU blocks of this many MiB and more go back to the system when freed "
                                 "(glibc's mmap threshold, fixed for the run; glibc's own rises to 32 MiB and "
                                 "keeps what is freed in its heaps); auto = 4 with several ranks, where each rank's "
                                 "heap is held on the host (measured: 17-25% more per rank than planned without), "
                                 "when the CPU computes an FSDP2 or ZeRO-3 step (8-50% more than planned without), "
                                 "or with one rank whose planned host peak takes over 70% of the host budget; else "
                                 "glibc's own (fresh pages cost a CPU-computed step time); 0 = glibc's own.",
                                 min=0, max=32, auto=True)  # 32: glibc's ceiling on 64-bit (mallopt refuses more)
    nvme_path: str = _f("", "A folder on a fast local disk for ZeRO-Infinity's NVMe offload profiles "
                        "(zero3-*-offload-nvme-*); empty = those profiles are off.")


@dataclass
class LossConfig:
    chunked: str = _f("auto", "Output head + cross-entropy in chunks of the sequence, so the micro x seq x vocab "
                      "logits never exist (same loss and gradients; one extra head matmul per step): on, off, or "
                      "auto (on when the plain logits would take over 10% of the memory budget).",
                      choices=("auto", "on", "off"))


TASKS = ("causal_lm", "dpo", "orpo", "simpo")
PREFERENCE_TASKS = TASKS[1:]
REFERENCES = ("auto", "adapter_off", "precompute")
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}  # TRL's DPO and ORPO defaults; SimPO paper's smallest tuned


@dataclass
class PreferenceConfig:
    """Preference tuning (``task=dpo|orpo|simpo``): the loss's settings and DPO's reference."""

    beta: Any = _f(AUTO, "Strength of the preference term: DPO's KL weight, ORPO's odds-ratio weight (lambda), "
                   "SimPO's reward scale; auto = 0.1 for dpo and orpo, 2.0 for simpo.", above=0.0, max=1e4,
                   auto=True, number=float)
    loss_type: str = _f("sigmoid", "DPO's loss: sigmoid (the DPO paper), ipo (squared, per-token averaged log-ratios, "
                        "as TRL), hinge (SLiC).", choices=("sigmoid", "ipo", "hinge"))
    gamma: float = _f(0.5, "SimPO's target reward margin (TRL's simpo_gamma; the paper's gamma/beta ratio x beta).",
                      min=0.0, max=100.0)
    reference: str = _f("auto", "DPO's reference log-probs: adapter_off (the LoRA base with the adapter switched off, "
                        "one no-grad forward per step, no second model), precompute (computed once before training "
                        "from the starting weights and kept in the run directory; no reference pass while training), "
                        "auto (adapter_off for a new LoRA adapter, else precompute).", choices=REFERENCES)
    max_prompt_len: Any = _f(AUTO, "Prompt tokens kept (the end of the prompt, as TRL); the completion is cut to "
                             "data.seq_len minus the prompt; auto = half of data.seq_len.", min=1, auto=True, number=int)


@dataclass
class CheckpointConfig:
    every_steps: int = _f(0, "Save a checkpoint every N steps (0 = only at the end).", min=0)
    keep_last: int = _f(2, "Complete checkpoints kept; older ones are deleted.", min=1)
    resume: str = _f("auto", "auto (newest complete checkpoint of this run), never, or a checkpoint path.")
    save: bool = _f(True, "Write checkpoints and the final weights; false only for measurements (nothing to "
                    "resume or export; vramfit bench).")
    keep_best: bool = _f(False, "Keep the checkpoint with the lowest eval loss beside the last keep_last (a checkpoint "
                         "is written at every eval that improves); needs an eval split and train.eval_every.")


@dataclass
class LogConfig:
    level: str = _f("info", "How much vramfit says (on stderr, rank 0): debug, info, warning or error.",
                    choices=("debug", "info", "warning", "error"))
    every_steps: int = _f(10, "Print a log line every N steps.", min=1)
    progress: str = _f("auto", "Progress bar: auto (when stderr is a terminal), on, off.", choices=("auto", "on", "off"))
    memory_interval_s: float = _f(0.5, "Seconds between memory samples in memory.csv (0 = memory monitor off: no "
                                  "memory.csv/png, per-phase peaks or leak check).", min=0.0)
    leak_steps: int = _f(20, "Warn when memory after each step only grows over this many steps, after as many "
                         "warm-up steps (0 = no leak check).", min=0)
    leak_mib: float = _f(64.0, "Growth over log.leak_steps steps, in MiB, that counts as a leak.", min=0.0)
    report_to: list = _f(["tensorboard"], "Trackers that get the metrics, eval results and the plan: tensorboard "
                         "(event files in <run>/tensorboard), wandb, mlflow (optional extras; offline unless their "
                         "environment says otherwise), or none.")
    tracker_dir: str = _f("", "Where the trackers write, one folder per run (tensorboard --logdir DIR shows them all); "
                          "empty = in the run directory.")


@dataclass
class Config:
    seed: int = _f(1234, "Seed for model init, data order and dropout.", min=0, max=2**32 - 1)  # numpy's range
    run_name: str = _f("", "Run directory name under output_dir; empty = <model>-<timestamp>.")
    output_dir: str = _f("runs", "Where run directories are made.")
    engine: str = _f("auto", "auto (the fastest that fits; torch's AMP before DeepSpeed on a tie), deepspeed, amp, fsdp.",
                     choices=ENGINES)
    profile: str = _f("auto", "auto (fastest profile that fits the budget) or a profile name (vramfit profiles).")
    deepspeed_config: str = _f("", "Path to your own DeepSpeed JSON (HF Trainer/Accelerate style, \"auto\" allowed): "
                               "the run uses it as a custom profile; empty = vramfit's profiles.")
    precision: str = _f("auto", "auto (bf16 on GPUs with compute capability >= 8, fp16 on older GPUs, fp32 on CPU), fp16, bf16, fp32.",
                        choices=PRECISIONS)
    device: str = _f("auto", "auto (cuda when available), cuda or cpu.", choices=("auto", "cuda", "cpu"))
    sample_prompt: str = _f("", "Text to generate from after training (empty = a prompt from the data).")
    sample_tokens: int = _f(32, "Tokens generated for the sample after training (0 = none).", min=0)
    task: str = _f("causal_lm", "What is trained: causal_lm (next-token loss), or preference tuning on prompt/chosen/"
                   "rejected pairs: dpo, orpo, simpo (docs/preference.md).", choices=TASKS)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ----------------------------------------------------------------------------------------------
# What a setting comes to


def reference_mode(cfg: Config) -> str:
    """Where a run's reference log-probs come from: ``none`` (causal LM, ORPO, SimPO: no reference), ``adapter_off``
    (the LoRA policy with its adapter switched off, each step) or ``precompute`` (once, before training).
    ``auto``: adapter_off for a new LoRA adapter; precompute for full fine-tuning (no second model is ever built)
    and from a loaded adapter (whose starting point, not the bare base, is the reference)."""
    if cfg.task != "dpo":
        return "none"
    if cfg.preference.reference != AUTO:
        return cfg.preference.reference
    return "adapter_off" if cfg.lora.r > 0 and not cfg.model.adapter else "precompute"


def preference_beta(cfg: Config) -> float:
    """``preference.beta``, auto resolved per task."""
    b = cfg.preference.beta
    return float(DEFAULT_BETA.get(cfg.task, 0.1) if b == AUTO else b)


def prompt_budget(cfg: Config) -> int:
    """Prompt tokens a preference sample keeps (``preference.max_prompt_len``, auto = half of seq_len)."""
    m = cfg.preference.max_prompt_len
    return max(1, cfg.data.seq_len // 2 if m == AUTO else min(int(m), cfg.data.seq_len - 1))


INSTRUCTION_FORMATS = RECORD_FORMATS[2:]


def packs_samples(d: DataConfig) -> bool:
    """Whether batches hold instruction samples packed padding-free (a block-diagonal attention mask): what the
    planner plans. A format still ``auto`` counts as text; ``launcher.data.settle_formats`` reads the records and
    resolves it before a run or a plan."""
    if not d.packing:
        return False
    if d.sources:
        formats = [s.format if s.format != "auto" else d.format for s in d.sources if s.weight > 0]
    else:
        formats = [] if d.source == "synthetic" else [d.format]
    return bool(formats) and all(f in INSTRUCTION_FORMATS for f in formats)


def auto_warmup_steps(max_steps: int) -> int:
    """``train.warmup_steps=auto``: 10% of the run (20 of the default 200 steps)."""
    return max_steps // 10


def with_epochs(cfg: Config, train_samples: int) -> Config:
    """``train.epochs`` turned into ``train.max_steps`` once the training samples are counted (and an auto warmup
    into 10% of those steps); the config unchanged without epochs."""
    t = cfg.train
    if not t.epochs:
        return cfg
    steps = max(1, math.ceil(t.epochs * train_samples / t.global_batch_size))
    warmup = auto_warmup_steps(steps) if t.warmup_steps == AUTO else min(int(t.warmup_steps), steps)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps, warmup_steps=warmup))


# ----------------------------------------------------------------------------------------------
# The config written out


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def reference_markdown() -> str:
    """The config reference table, generated from the schema (docs/reference/config.md; a test keeps them equal)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(cls, prefix):
        obj = cls()
        for f in dataclasses.fields(cls):
            val = getattr(obj, f.name)
            if dataclasses.is_dataclass(val):
                walk(type(val), f"{prefix}{f.name}.")
                continue
            meta = f.metadata
            extra = f" One of: {', '.join(meta['choices'])}." if meta.get("choices") else ""
            default = ",".join(val) if isinstance(val, list) else val
            default = '""' if default == "" else default
            lines.append(f"| `{prefix}{f.name}` | `{default}` | {meta.get('help', '')}{extra} |")

    walk(Config, "")
    return "\n".join(lines)
