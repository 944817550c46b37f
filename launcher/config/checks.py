"""Checks of a loaded run configuration: the rules between fields, and the single values that need more than the
schema (names, folders, files). Each problem is one line, value, rule and fix; :mod:`.load` collects them into one
:class:`.schema.ConfigError`, and the planner and the data loader call the rules they share (the batch equation,
the synthetic vocabulary) from here.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re

from launcher.config.profiles import PROFILES, TAKES_BITSANDBYTES, USER_JSON_ENGINE
from launcher.config.schema import AUTO, CHAT_TEMPLATES, Config, ConfigError, DataConfig
from launcher.machine import dist


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
    world = world or dist.current().world
    problems = _train_problems(cfg, world)
    problems += _engine_problems(cfg)
    problems += _scale_problems(cfg)
    problems += _file_problems(cfg)
    problems += check_data(cfg.data)
    problems += preference_problems(cfg)
    problems += tracker_problems(cfg.log.report_to)
    if cfg.checkpoint.resume not in ("auto", "never") and not os.path.exists(cfg.checkpoint.resume):
        problems.append(f"checkpoint.resume: got {cfg.checkpoint.resume!r}; rule: auto, never, or an existing "
                        "checkpoint directory; fix: checkpoint.resume=auto")
    return problems


def _train_problems(cfg: Config, world: int) -> list[str]:
    """The run's arithmetic and its evals: the batch equation, what needs an eval split, the warmup inside the run."""
    problems = []
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
    return problems


def _engine_problems(cfg: Config) -> list[str]:
    """Settings that need an engine, or a profile that must agree with the engine, precision and NVMe folder."""
    problems = []
    t = cfg.train
    if cfg.model.quantize != "none" and cfg.lora.r == 0:
        problems.append(f"model.quantize: got {cfg.model.quantize!r} with lora.r=0; rule: quantized base weights "
                        "cannot be trained, only adapters on top (QLoRA); fix: lora.r=16, or model.quantize=none")
    if cfg.model.quantize != "none" and not TAKES_BITSANDBYTES.get(cfg.engine, True):
        problems.append(f"model.quantize: got {cfg.model.quantize!r} with engine={cfg.engine}; rule: bitsandbytes "
                        "quantized weights train on the AMP path only; fix: engine=auto or engine=amp")
    if t.optimizer in ("adamw8bit", "paged_adamw8bit") and not TAKES_BITSANDBYTES.get(cfg.engine, True):
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
    return problems


def _scale_problems(cfg: Config) -> list[str]:
    """Numbers that are each in bounds but together train nothing: LoRA's scale, AdamW's decay, the loss scale."""
    problems = []
    t = cfg.train
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
    return problems


def _file_problems(cfg: Config) -> list[str]:
    """The user's DeepSpeed JSON (read here) and the NVMe folder."""
    problems = []
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
        if cfg.engine not in (AUTO, USER_JSON_ENGINE):
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


def synthetic_vocab_problem(d: DataConfig, vocab_size: int) -> str | None:
    """The synthetic task's vocabulary within the model's ``vocab_size`` (one rule for plan and train)."""
    if d.source == "synthetic" and not d.sources and d.vocab_size > vocab_size:
        return (f"data.vocab_size: got {d.vocab_size}; rule: the synthetic task's vocabulary must fit the model's "
                f"({vocab_size}); fix: data.vocab_size={min(256, vocab_size)}")
    return None


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
