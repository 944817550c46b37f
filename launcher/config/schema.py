"""Run configuration: one dataclass per section, a YAML file plus ``key=value`` overrides.

Every field carries a one-line ``help`` (used by ``vramfit config-reference`` and docs/reference/config.md), and
optionally ``choices`` or bounds. :func:`load_config` walks the user's keys against the schema,
collects *every* problem (unknown key, bad type, out-of-range value, impossible batch arithmetic)
and raises one :class:`ConfigError` listing them, each with the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, get_origin

from omegaconf import OmegaConf

from launcher.config.profiles import PROFILES
from launcher.machine import dist

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
                                 "or with one whose planned host peak takes over 70% of the host budget; else "
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
# Loading and validation


def _is_section(f: dataclasses.Field) -> bool:
    return dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config"))


def _section_type(owner, f: dataclasses.Field):
    return type(getattr(owner(), f.name))


def _coerce(key: str, value: Any, f: dataclasses.Field, problems: list[str]):
    """Convert one user value to the field's type, or record a problem and return None."""
    meta = f.metadata
    typ = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # noqa: S307 (our own annotations)
    if meta.get("auto") and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    want = typ
    if typ is Any:  # 'auto' or a number
        want = meta.get("number") or (int if isinstance(f.default, int) else float)
    ok, out = True, value
    if want is bool:
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            out = value.lower() in ("true", "yes", "on", "1")
        else:
            ok = False
    elif want is int:
        if isinstance(value, bool):
            ok = False
        elif isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        elif isinstance(value, str):
            try:
                out = int(value)
            except ValueError:
                ok = False
        else:
            ok = False
    elif want is float:
        if isinstance(value, bool):
            ok = False
        elif isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value)
            except ValueError:
                ok = False
        else:
            ok = False
    elif want is str:
        if isinstance(value, (dict, list)):
            ok = False
        elif isinstance(value, bool):  # YAML reads on/off/yes/no as booleans
            choices = meta.get("choices") or ()
            out = ("on" if value else "off") if "on" in choices else str(value).lower()
        else:
            out = "" if value is None else str(value)
    elif want is list or get_origin(want) is list:
        if isinstance(value, str):
            out = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            out = [str(v) for v in value]
        else:
            ok = False
    if ok and want is str and "\0" in out:  # a path with a NUL byte fails in every os call
        problems.append(f"{key}: got {value!r}; rule: text without NUL characters; fix: {key}={out.replace(chr(0), '')!r}")
        return None
    if ok and want is float and not math.isfinite(out):
        problems.append(f"{key}: got {value!r}; rule: a finite number (NaN and infinity are not settings: every "
                        f"sum, bound and budget that meets one is NaN or infinite too); fix: {key}={_fix_value(f)}")
        return None
    if not ok:
        kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
                list: "a list of names"}.get(want if want in (bool, int, float, str) else list, str(want))
        if meta.get("auto"):
            kind += " or 'auto'"
        problems.append(f"{key}: got {value!r} ({type(value).__name__}); rule: must be {kind}; "
                        f"fix: {key}=<{kind}>")
        return None
    choices = meta.get("choices")
    if choices and out not in choices:
        close = difflib.get_close_matches(str(out), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{key}: got {out!r}; rule: one of {', '.join(choices)}; fix: {key}={close[0] if close else choices[0]}{hint}")
        return None
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        if lo is not None and out < lo:
            problems.append(f"{key}: got {out!r}; rule: must be >= {lo}; fix: {key}={lo}")
            return None
        if hi is not None and out > hi:
            problems.append(f"{key}: got {out!r}; rule: must be <= {hi}; fix: {key}={hi}")
            return None
        # an open bound cannot be offered as the fix: the default is (for lr, betas, eps, dropout, scale)
        if meta.get("above") is not None and out <= meta["above"]:
            problems.append(f"{key}: got {out!r}; rule: must be > {meta['above']}; fix: {key}={f.default}")
            return None
        if meta.get("below") is not None and out >= meta["below"]:
            problems.append(f"{key}: got {out!r}; rule: must be < {meta['below']}; fix: {key}={f.default}")
            return None
        if isinstance(out, int) and not -INT64 <= out < INT64:
            problems.append(f"{key}: got {value!r}; rule: a whole number that fits 64 bits (what torch and the data "
                            f"order take), below 2**63; fix: {key}={_fix_value(f)}")
            return None
    return out


INT64 = 2**63


def _fix_value(f: dataclasses.Field):
    """A value to offer as the fix for a number that cannot be one: the default, else 'auto', else the lower bound."""
    default = f.default
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default
    if f.metadata.get("auto"):
        return AUTO
    return f.metadata.get("min") or 0


def _build(cls, raw: dict, prefix: str, problems: list[str]):
    """Walk ``raw`` against dataclass ``cls``; unknown keys and bad values go to ``problems``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys here: {', '.join(fields)}"
            problems.append(f"{full}: unknown key; rule: only schema keys are accepted; fix: {hint}")
            continue
        f = fields[key]
        if f.metadata.get("items") is not None:  # a list of sections (data.sources)
            kwargs[key] = _build_list(f.metadata["items"], value, full, problems)
            continue
        sub = _section_type(cls, f) if dataclasses.is_dataclass(getattr(cls(), f.name)) else None
        if sub is not None:
            if not isinstance(value, dict):
                problems.append(f"{full}: got {value!r}; rule: a section of keys ({', '.join(x.name for x in dataclasses.fields(sub))}); "
                                f"fix: write {full}.KEY=VALUE")
                continue
            kwargs[key] = _build(sub, value, f"{full}.", problems)
        else:
            out = _coerce(full, value, f, problems)
            if out is not None:
                kwargs[key] = out
    return cls(**kwargs)


def _build_list(cls, value, full: str, problems: list[str]) -> list:
    keys = ", ".join(x.name for x in dataclasses.fields(cls))
    if not isinstance(value, (list, tuple)):
        problems.append(f"{full}: got {value!r}; rule: a list of sections ({keys}); fix: {full}='[{{path: a.jsonl, "
                        "weight: 1}]' or a YAML list")
        return []
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            problems.append(f"{full}[{i}]: got {item!r}; rule: a section of keys ({keys}); fix: write {{path: {item}}}")
            continue
        out.append(_build(cls, item, f"{full}[{i}].", problems))
    return out


def parse_overrides(overrides: list[str]) -> dict:
    """``['a.b=1', 'c=x']`` -> nested dict, values parsed as YAML scalars (as OmegaConf does)."""
    problems = []
    good = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            problems.append(f"{item!r}: not a key=value override; rule: overrides look like train.lr=1e-4; "
                            "fix: write KEY=VALUE (see `vramfit train --help`)")
        else:
            good.append(item)
    parsed = []
    for item in good:  # one at a time, so a value YAML cannot read is named
        try:
            parsed.append(OmegaConf.to_container(OmegaConf.from_dotlist([item])))
        except Exception as e:  # noqa: BLE001 -- yaml's and OmegaConf's grammar errors have no common base
            key, value = item.split("=", 1)
            problems.append(f"{key}: got {value!r}, which YAML cannot read ({str(e).splitlines()[0]}); rule: a value "
                            f"as YAML writes it; fix: {key}='\"{value}\"' for a string, or close the bracket or "
                            "quote that is open")
            continue
        bad_key = _bad_key(parsed[-1])
        if bad_key:
            problems.append(f"{item.split('=', 1)[0]}: not a key; rule: dotted names of the schema (train.lr, "
                            "data.sources); fix: remove the empty part of the name (`vramfit config-reference` "
                            "lists every key)")
            parsed.pop()
    if problems:
        raise ConfigError(problems, "command line")
    out: dict = {}
    for p in parsed:
        out = _merge(out, p)
    return out


def _bad_key(d) -> bool:
    """A dotted name with an empty part (``train..lr``, ``.lr``) reads as a key ''."""
    return isinstance(d, dict) and any(k == "" or _bad_key(v) for k, v in d.items())


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with ``key=value`` overrides applied, parsed and converted as the command line's are
    (the one parser; the whole config is not checked again). Raises ConfigError on an unknown key or bad value."""
    problems: list[str] = []
    out = _build(Config, _merge(to_dict(cfg), parse_overrides(overrides)), "", problems)
    if problems:
        raise ConfigError(problems, "overrides")
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_raw(path: str | None, overrides: list[str] | None = None) -> dict:
    raw: dict = {}
    if path:
        if not os.path.isfile(path):
            what = "a folder" if os.path.isdir(path) else "not found"
            raise ConfigError([f"config file {path!r}: {what}; rule: CONFIG must be a YAML file; "
                               "fix: give an existing path, or no CONFIG for the built-in demo"])
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text: {e.reason} at byte {e.start}"
            raise ConfigError([f"config file {path!r}: cannot be read ({why}); rule: CONFIG is a YAML text file this "
                               "user can read; fix: check the path and its permissions (ls -l)"]) from None
        # empty, or only comments (YAML reads both as no document): most likely a file not yet written, or cut short
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if all(ln in ("---", "...", "null", "~") for ln in lines):
            raise ConfigError([f"config file {path!r}: empty (no keys); rule: a YAML mapping of keys, at least one; "
                               "fix: write `key: value` lines (`vramfit config-reference` lists them), write `{}` "
                               "for the defaults, or give no CONFIG for the built-in demo"])
        try:
            loaded = OmegaConf.to_container(OmegaConf.create(text))
        except Exception as e:  # noqa: BLE001 -- yaml syntax errors (with line numbers) and OmegaConf's own
            why = " ".join(str(e).split()) or type(e).__name__  # yaml's messages span lines; one line here
            raise ConfigError([f"config file {path!r}: not valid YAML ({why}); rule: a YAML mapping of keys; fix: "
                               "correct the file"]) from None
        if not isinstance(loaded, dict):
            raise ConfigError([f"config file {path!r}: top level is a {type(loaded).__name__}; "
                               "rule: a mapping of keys; fix: write `key: value` lines"])
        raw = loaded
    return _merge(raw, parse_overrides(overrides or []))


def read_deepspeed_json(path: str) -> tuple[dict | None, str | None]:
    """(the JSON object, None), or (None, the problem: value, rule, fix). Duplicate keys are refused, as
    DeepSpeed's own reader does (one of them would be dropped silently)."""
    where = f"deepspeed_config: got {path!r}"
    if not os.path.isfile(path):
        return None, (f"{where}, no such file; rule: a path to a DeepSpeed JSON file; fix: an existing path, or "
                      "deepspeed_config=\"\" for vramfit's profiles")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"duplicate key(s) {', '.join(dup)}")
        return dict(pairs)

    try:
        with open(path) as fh:
            obj = json.load(fh, object_pairs_hook=no_duplicates)
    except OSError as e:
        return None, (f"{where}, which cannot be read ({e.strerror}); rule: a JSON file this user can read; fix: check "
                      "its permissions (ls -l), or deepspeed_config=\"\" for vramfit's profiles")
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError and carries line and column
        return None, f"{where}, not valid JSON ({e}); rule: a DeepSpeed config is a JSON object; fix: correct the file"
    if not isinstance(obj, dict):
        return None, (f"{where}, its top level is a {type(obj).__name__}; rule: a DeepSpeed config is a JSON object "
                      "({\"zero_optimization\": {...}, ...}); fix: correct the file")
    return obj, None


def batch_problem(global_batch: int, micro: int, world: int) -> str | None:
    """The batch equation, global batch = micro-batch x accumulation x world size (the one place it is checked):
    what is wrong when ``global_batch`` is not a multiple of ``micro`` x ``world`` (value, rule, fix), else None."""
    per_step = micro * world
    if global_batch % per_step == 0:
        return None
    lo = (global_batch // per_step) * per_step or per_step
    return (f"train.global_batch_size: got {global_batch} with micro-batch {micro} and {world} rank(s); rule: global "
            f"batch = micro-batch x accumulation x world size, so it must be a multiple of {per_step}; fix: "
            f"train.global_batch_size={lo} or {lo + per_step}, or a micro-batch that divides "
            f"{global_batch // world if global_batch % world == 0 else global_batch}")


def accumulation_steps(global_batch: int, micro: int, world: int) -> int:
    """Micro-batches per optimizer step on each rank; a global batch that does not divide is refused."""
    problem = batch_problem(global_batch, micro, world)
    if problem:
        raise ConfigError([problem])
    return global_batch // (micro * world)


def check(cfg: Config, world: int | None = None) -> list[str]:
    """Cross-field rules. Returns problems (empty when fine)."""
    problems = []
    world = world or dist.current().world
    t = cfg.train
    if t.micro_batch_size != AUTO and batch_problem(t.global_batch_size, t.micro_batch_size, world):
        problems.append(batch_problem(t.global_batch_size, t.micro_batch_size, world))
    has_eval = bool(cfg.data.eval_source) or cfg.data.eval_fraction > 0
    for key, on in (("checkpoint.keep_best", cfg.checkpoint.keep_best),
                    ("train.early_stopping_patience", t.early_stopping_patience > 0)):
        if on and not has_eval:
            problems.append(f"{key}: set without an eval split; rule: it acts on the eval loss, so data.eval_source or "
                            f"data.eval_fraction must give eval samples; fix: data.eval_fraction=0.05 (or "
                            f"data.eval_source=FILE), or drop {key}")
        elif on and not t.eval_every:
            problems.append(f"{key}: set with train.eval_every=0; rule: it acts on evals during the run; fix: "
                            f"train.eval_every={max(1, t.max_steps // 10)}")
    if cfg.checkpoint.keep_best and not cfg.checkpoint.save:
        problems.append("checkpoint.keep_best: set with checkpoint.save=false; rule: the best is a checkpoint; fix: "
                        "checkpoint.save=true, or drop checkpoint.keep_best")
    if isinstance(t.warmup_steps, int) and t.warmup_steps > t.max_steps and not t.epochs:
        problems.append(f"train.warmup_steps: got {t.warmup_steps} > train.max_steps={t.max_steps}; "
                        f"rule: warmup must end inside the run; fix: train.warmup_steps={max(0, t.max_steps // 10)}")
    if cfg.model.quantize != "none" and cfg.lora.r == 0:
        problems.append(f"model.quantize: got {cfg.model.quantize!r} with lora.r=0; rule: quantized base weights "
                        "cannot be trained, only adapters on top (QLoRA); fix: lora.r=16, or model.quantize=none")
    if cfg.model.quantize != "none" and cfg.engine in ("deepspeed", "fsdp"):
        problems.append(f"model.quantize: got {cfg.model.quantize!r} with engine={cfg.engine}; rule: bitsandbytes "
                        "quantized weights train on the AMP path only; fix: engine=auto or engine=amp")
    if t.optimizer in ("adamw8bit", "paged_adamw8bit") and cfg.engine in ("deepspeed", "fsdp"):
        problems.append(f"train.optimizer: got {t.optimizer!r} with engine={cfg.engine}; rule: 8-bit AdamW runs on the "
                        "AMP path only; fix: engine=auto or engine=amp, or train.optimizer=adamw")
    if cfg.profile in PROFILES:  # an unknown name is reported by names_and_paths
        p = PROFILES[cfg.profile]
        if cfg.engine not in (AUTO, p.engine):
            problems.append(f"engine: got {cfg.engine!r} with profile={cfg.profile} (a {p.engine} profile); "
                            f"rule: they must agree; fix: engine=auto or engine={p.engine}")
        if p.nvme and not cfg.memory.nvme_path:
            problems.append(f"profile: got {cfg.profile!r} without memory.nvme_path; rule: an NVMe offload profile "
                            "swaps into a folder on a fast disk; fix: memory.nvme_path=/path/on/nvme, or "
                            f"profile={cfg.profile.replace('-nvme-opt', '-all').replace('-nvme-all', '-all')}")
        if cfg.precision not in (AUTO, p.precision):
            problems.append(f"precision: got {cfg.precision!r} with profile={cfg.profile} ({p.precision}); "
                            f"rule: they must agree; fix: precision=auto or precision={p.precision}")
    if cfg.lora.r > 0 and cfg.lora.alpha == 0:
        problems.append(f"lora.alpha: got 0 with lora.r={cfg.lora.r}; rule: the adapters' output is scaled by "
                        f"alpha / r, so 0 trains nothing; fix: lora.alpha={2 * cfg.lora.r}")
    if t.lr * t.weight_decay >= 1:
        problems.append(f"train.weight_decay: got {t.weight_decay:g} with train.lr={t.lr:g}; rule: AdamW multiplies "
                        f"every weight by 1 - lr x weight_decay each step, which must stay above 0; fix: "
                        f"train.weight_decay={min(0.1, 0.5 / t.lr):g}")
    ls = cfg.loss_scale
    if ls.min_scale > 2.0 ** ls.initial_power:
        problems.append(f"loss_scale.min_scale: got {ls.min_scale:g} above the initial scale 2**{ls.initial_power} = "
                        f"{2.0 ** ls.initial_power:g}; rule: the floor cannot be above the start; fix: "
                        f"loss_scale.min_scale=1 or loss_scale.initial_power={min(32, math.ceil(math.log2(ls.min_scale)))}")
    if cfg.deepspeed_config:
        # The file is read here; what DeepSpeed's config models and vramfit's settings say about it is checked
        # by launcher.config.user_ds_config before the plan (it needs DeepSpeed and the resolved precision).
        _obj, problem = read_deepspeed_json(cfg.deepspeed_config)
        if problem:
            problems.append(problem)
        if cfg.profile != AUTO:
            problems.append(f"profile: got {cfg.profile!r} with deepspeed_config={cfg.deepspeed_config}; rule: the "
                            "DeepSpeed JSON is the run's profile (a custom row), so profile must be auto; fix: "
                            f"profile=auto, or deepspeed_config=\"\" to run {cfg.profile}")
        if cfg.engine not in (AUTO, "deepspeed"):
            problems.append(f"engine: got {cfg.engine!r} with deepspeed_config={cfg.deepspeed_config}; rule: a DeepSpeed "
                            "config runs on the DeepSpeed engine; fix: engine=auto or engine=deepspeed, or "
                            "deepspeed_config=\"\"")
    nvme = cfg.memory.nvme_path
    if nvme:
        where = os.path.expanduser(nvme)
        if not os.path.isdir(where):
            problems.append(f"memory.nvme_path: got {nvme!r}, no such folder; rule: an existing folder on a fast local "
                            f"disk (ZeRO-Infinity swaps optimizer states and parameters into it); fix: mkdir -p {nvme}, "
                            "or memory.nvme_path=\"\" to leave NVMe offload off")
        elif not os.access(where, os.W_OK | os.X_OK):
            problems.append(f"memory.nvme_path: got {nvme!r}, not writable by this user; rule: the swap files are "
                            f"written there; fix: a folder you can write (chmod u+w {nvme}), or memory.nvme_path=\"\"")
    problems += check_data(cfg.data)
    problems += preference_problems(cfg)
    problems += tracker_problems(cfg.log.report_to)
    if cfg.checkpoint.resume not in ("auto", "never") and not os.path.exists(cfg.checkpoint.resume):
        problems.append(f"checkpoint.resume: got {cfg.checkpoint.resume!r}; rule: auto, never, or an existing "
                        "checkpoint directory; fix: checkpoint.resume=auto")
    return problems


def names_and_paths(cfg: Config) -> list[str]:
    """Problems of single values that need more than the schema: the profile's name (checked with the other
    names, so every wrong one is reported at once), run_name (one directory name), and the folders a run writes
    (output_dir, log.tracker_dir, data.cache_dir: folders this user can make and write). Checked before planning,
    by every command."""
    problems = []
    if cfg.profile != AUTO and cfg.profile not in PROFILES:
        close = difflib.get_close_matches(cfg.profile, list(PROFILES), n=1)
        problems.append(f"profile: got {cfg.profile!r}; rule: auto or one of {', '.join(PROFILES)}; "
                        f"fix: profile={close[0] if close else 'auto'}")
    name = cfg.run_name
    parts = [p for p in re.split(r"[/\\]", name) if p not in ("", ".", "..")]
    if name and (name in (".", "..") or "/" in name or os.sep in name or "\0" in name or len(name.encode()) > 255):
        problems.append(f"run_name: got {name!r}; rule: one directory name under output_dir (no '/', not '.' or "
                        f"'..', at most 255 bytes), so a run never lands outside it; fix: run_name="
                        f"{'-'.join(parts)[:255] or 'run'} (and output_dir=DIR to choose where runs go)")
    problems += filter(None, [
        folder_problem("output_dir", cfg.output_dir or ".", "output_dir is a folder this user can write, that holds "
                       "one folder per run", "output_dir=DIR, a folder you can write (e.g. ~/runs)"),
        cfg.log.tracker_dir and folder_problem("log.tracker_dir", cfg.log.tracker_dir, "a folder this user can write, "
                                               "where the trackers write one folder per run",
                                               "log.tracker_dir=DIR that you can write, or empty for the run directory"),
        cfg.data.cache_dir != AUTO and folder_problem("data.cache_dir", cfg.data.cache_dir, "a folder this user can "
                                                      "write (the tokenized data is kept there)",
                                                      "data.cache_dir=DIR that you can write, or auto")])
    return problems


def folder_problem(key: str, given: str, rule: str, fix: str) -> str | None:
    """Why a folder to be made or written into at ``given`` cannot be (value, rule, fix), None when it can: the
    nearest existing path on the way is not a folder, or this user may not write there. ``os.access`` asks the
    kernel with this user's rights, a read-only mount included, and writes nothing (a probe file would change a
    folder a refused command must leave as it was)."""
    out = os.path.abspath(os.path.expanduser(given))
    there = out
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        what = "which is a file" if there == out else f"which cannot be made: {there} is a file"
        return f"{key}: got {given!r}, {what}; rule: {rule}; fix: {fix}"
    if not os.access(there, os.W_OK | os.X_OK):
        where = "which" if there == out else f"and {there}, the folder it would be made in,"
        return f"{key}: got {given!r}, {where} is not writable by this user; rule: {rule}; fix: {fix}"
    return None


def check_data(d: DataConfig) -> list[str]:
    """The data section's cross-field rules (files themselves are checked when they are read)."""
    import codecs

    problems = []
    if d.sources and d.source != "synthetic":
        problems.append(f"data.sources: given together with data.source={d.source!r}; rule: one or the other; fix: "
                        "move data.source into data.sources as {path: ...}, or drop data.sources")
    for i, s in enumerate(d.sources):
        if not s.path:
            problems.append(f"data.sources[{i}].path: empty; rule: every source names a file, folder, glob or hub "
                            f"dataset id; fix: data.sources[{i}].path=<where the records are>")
    if d.sources and not any(s.weight > 0 for s in d.sources):
        problems.append(f"data.sources: every weight is 0 ({', '.join(f'{s.weight:g}' for s in d.sources)}); rule: "
                        "at least one source with weight > 0; fix: weight: 1 on the sources to train on")
    if d.eval_source and d.eval_fraction > 0:
        problems.append(f"data.eval_fraction: got {d.eval_fraction:g} with data.eval_source={d.eval_source!r}; rule: "
                        "eval samples come from one or the other; fix: data.eval_fraction=0")
    try:
        codecs.lookup(d.encoding)
    except LookupError:
        problems.append(f"data.encoding: got {d.encoding!r}; rule: a Python codec name; fix: data.encoding=utf-8 (or "
                        "latin-1, cp1252, utf-16: what the files were written in)")
    if d.chat_template not in CHAT_TEMPLATES and not os.path.isfile(os.path.expanduser(d.chat_template)):
        close = difflib.get_close_matches(d.chat_template, CHAT_TEMPLATES, n=1)
        problems.append(f"data.chat_template: got {d.chat_template!r}; rule: {', '.join(CHAT_TEMPLATES)} or an existing "
                        f"Jinja file; fix: data.chat_template={close[0] if close else 'auto'}")
    return problems


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


def preference_problems(cfg: Config) -> list[str]:
    """The rules of ``task`` and ``preference.*`` against the rest of the config (value, rule, fix)."""
    p, out = cfg.preference, []
    if cfg.task == "causal_lm":
        return out
    if cfg.loss.chunked == "on":
        out.append(f"loss.chunked: got 'on' with task={cfg.task}; rule: a preference loss needs each sequence's "
                   "per-token log-probs, which the chunked loss never forms; fix: loss.chunked=auto (off for "
                   "preference tasks)")
    if cfg.data.sources:
        out.append(f"data.sources: given with task={cfg.task}; rule: preference pairs come from one source "
                   "(data.source: a JSONL/JSON/parquet file or folder with prompt, chosen and rejected, a hub id, or "
                   "synthetic); fix: data.source=<your pairs>")
    if cfg.data.format not in ("auto",):
        out.append(f"data.format: got {cfg.data.format!r} with task={cfg.task}; rule: preference records are read "
                   "by their prompt/chosen/rejected fields; fix: data.format=auto")
    if cfg.task != "dpo":
        if p.reference != AUTO:
            out.append(f"preference.reference: got {p.reference!r} with task={cfg.task}; rule: {cfg.task} has no "
                       "reference model; fix: preference.reference=auto, or task=dpo")
        if p.loss_type != "sigmoid":
            out.append(f"preference.loss_type: got {p.loss_type!r} with task={cfg.task}; rule: the loss variants "
                       "are DPO's; fix: preference.loss_type=sigmoid, or task=dpo")
    if cfg.task == "dpo" and p.reference == "adapter_off":
        if cfg.lora.r == 0:
            out.append("preference.reference: got 'adapter_off' with lora.r=0; rule: switching the adapter off "
                       "gives the reference only when a LoRA adapter is trained on a frozen base; fix: "
                       "preference.reference=precompute (full fine-tuning: computed once, no second model), or "
                       "lora.r=16")
        elif cfg.model.adapter:
            out.append(f"preference.reference: got 'adapter_off' with model.adapter={cfg.model.adapter}; rule: with "
                       "the adapter off the reference would be the bare base, not the model you start from; fix: "
                       "preference.reference=precompute (the loaded adapter's log-probs, computed once)")
    if isinstance(p.max_prompt_len, int) and p.max_prompt_len >= cfg.data.seq_len:
        out.append(f"preference.max_prompt_len: got {p.max_prompt_len} with data.seq_len={cfg.data.seq_len}; rule: "
                   "the completion needs room after the prompt; fix: preference.max_prompt_len="
                   f"{cfg.data.seq_len // 2}")
    return out


ADAPTER_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules"}


def with_adapter(cfg: Config, given: dict, problems: list[str]) -> None:
    """``model.adapter``: its adapter_config.json fills the ``lora.*`` keys the user did not give (``given``: the
    raw lora section) and must agree with the ones given; problems go to ``problems``."""
    path = os.path.expanduser(cfg.model.adapter)
    conf = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(conf) or not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        problems.append(f"model.adapter: got {cfg.model.adapter!r}, which holds no adapter_config.json and "
                        "adapter_model.safetensors; rule: a peft LoRA adapter folder (a LoRA run's final/); fix: "
                        "model.adapter=RUN_DIR/final")
        return
    try:
        with open(conf) as fh:
            ac = json.load(fh)
    except (OSError, ValueError) as e:
        problems.append(f"model.adapter: {conf} does not read as JSON ({e}); rule: peft's adapter_config.json; "
                        "fix: the final/ folder of a LoRA run")
        return
    if ac.get("peft_type", "LORA") != "LORA" or not isinstance(ac.get("r"), int):
        problems.append(f"model.adapter: {conf} is not a LoRA adapter (peft_type {ac.get('peft_type')!r}); rule: a "
                        "LoRA adapter; fix: the final/ folder of a LoRA run")
        return
    theirs = {"r": int(ac["r"]), "alpha": float(ac.get("lora_alpha", 8)), "dropout": float(ac.get("lora_dropout", 0.0)),
              "target_modules": sorted(ac["target_modules"]) if isinstance(ac.get("target_modules"), list) else None}
    for key, value in theirs.items():
        if value is None:
            continue
        if key in given:
            mine = getattr(cfg.lora, key)
            if key == "target_modules":
                continue  # names or all-linear: peft matches them against the adapter's keys when it loads
            if key in ("r", "alpha") and float(mine) != float(value):
                problems.append(f"lora.{key}: got {mine} with model.adapter={cfg.model.adapter} (whose "
                                f"{ADAPTER_KEYS[key]} is {value:g}); rule: the loaded adapter's shape and scale; "
                                f"fix: drop lora.{key} (it is read from the adapter)")
        else:
            setattr(cfg.lora, key, value)


def synthetic_vocab_problem(d: DataConfig, vocab_size: int) -> str | None:
    """The synthetic task's vocabulary within the model's ``vocab_size`` (one rule for plan and train)."""
    if d.source == "synthetic" and not d.sources and d.vocab_size > vocab_size:
        return (f"data.vocab_size: got {d.vocab_size}; rule: the synthetic task's vocabulary must fit the model's "
                f"({vocab_size}); fix: data.vocab_size={min(256, vocab_size)}")
    return None


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


def load_config(path: str | None = None, overrides: list[str] | None = None, world: int | None = None) -> Config:
    """YAML file + overrides -> validated :class:`Config`. Raises one ConfigError listing every problem."""
    raw = load_raw(path, overrides)
    problems: list[str] = []
    cfg = _build(Config, raw, "", problems)
    train_raw = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    if cfg.train.epochs and "max_steps" in train_raw:
        problems.append(f"train.epochs: got {cfg.train.epochs:g} with train.max_steps={train_raw['max_steps']}; rule: "
                        "one of them sets the run's length; fix: drop train.max_steps, or train.epochs=0")
    # follows the run's length, so a short smoke run works with the defaults; with epochs, once the data is counted
    if cfg.train.warmup_steps == AUTO and not cfg.train.epochs:
        cfg.train.warmup_steps = auto_warmup_steps(cfg.train.max_steps)
    if cfg.model.adapter:  # before the checks, which then see the adapter's rank
        with_adapter(cfg, raw.get("lora") if isinstance(raw.get("lora"), dict) else {}, problems)
    problems += names_and_paths(cfg)
    if not problems:
        problems += check(cfg, world)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_recorded(path: str) -> Config:
    """A run's own config.yaml, as ``vramfit export`` reads it: the schema's names and types only, not the checks of
    a new run (its output_dir, data files, trackers or DeepSpeed JSON may have moved since, and export needs none
    of them). Raises one ConfigError naming the file."""
    problems: list[str] = []
    cfg = _build(Config, load_raw(path), "", problems)
    if problems:
        raise ConfigError(problems, f"run's {os.path.basename(path)} ({path})")
    return cfg


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


# ------------------------------------------------------------------------------------------------
# log.report_to

TRACKERS = {  # name -> (module that must import, install line)
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'vramfit[wandb]'"),
    "mlflow": ("mlflow", "pip install 'vramfit[mlflow]'"),
}

def tracker_problems(report_to: list) -> list[str]:
    """Config problems of ``log.report_to`` (value, rule, fix): unknown names and trackers not installed."""
    out = []
    for name in report_to:
        if name == "none":
            continue
        if name not in TRACKERS:
            out.append(f"log.report_to: got {name!r}; rule: tensorboard, wandb, mlflow or none; fix: "
                       "log.report_to=[tensorboard]")
        elif importlib.util.find_spec(TRACKERS[name][0]) is None:
            out.append(f"log.report_to: got {name!r}, which is not installed here; rule: a tracker must import; fix: "
                       f"{TRACKERS[name][1]}, or log.report_to=[tensorboard] (or none)")
    return out
