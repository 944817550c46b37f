"""A user's own DeepSpeed JSON (from the HF Trainer, Accelerate, Axolotl, LLaMA-Factory) as a custom profile.

``deepspeed_config=PATH`` replaces the catalogue: the run is planned and trained as one custom row built
from the JSON (:func:`profile_of`), named ``custom-zero<stage>-<precision>[-offload-opt|-offload-all]``.
Before anything loads, the JSON is checked three ways, and every problem is reported at once in
vramfit's shape (value, rule, fix):

1. top-level keys against the set DeepSpeed's config parser reads (:func:`known_top_level_keys`), since
   DeepSpeed ignores unknown ones silently (a typo drops a setting);
2. every block against DeepSpeed's own config models (``DeepSpeedConfig`` and its pydantic models, which
   run without a process group), one top-level key at a time so each error names its block;
3. vramfit's rules (below). Its ``"auto"`` values are then filled by the same function as the catalogue's
   (:func:`launcher.config.profiles.fill_auto`): explicit values vramfit also sets must agree with vramfit's.

What vramfit cannot honour, and what each does:
- ``scheduler``: the loop owns the learning-rate schedule (warmup, cosine to ``train.min_lr_ratio``) and sets
  the lr of every step. A scheduler whose params are all ``"auto"`` (the HF examples) is dropped with a
  notice; one with explicit values is an error (remove it, set ``train.lr/warmup_steps/min_lr_ratio``).
- ``optimizer``: absent = vramfit's AdamW from ``train.*``. Adam and AdamW are accepted (DeepSpeed's Adam is
  AdamW unless ``adam_w_mode`` is false). Other optimizers DeepSpeed knows (Lamb, Lion, Adagrad, torch's)
  are refused: the planner counts Adam's two moments and the OOM ladder and resume carry them. A name
  DeepSpeed does not know is refused with a did-you-mean.
- batch sizes, ``gradient_clipping``, optimizer params, fp16 loss scaling: absent or ``"auto"`` = vramfit's
  value; explicit = must equal it (``gradient_accumulation_steps`` 4 with an accumulation of 2 is an
  error naming both), because the loop feeds the batches, clips and schedules.
- precision: an explicit ``fp16``/``bf16`` ``enabled: true`` decides it (both false: fp32); ``"auto"`` or no
  block follows vramfit's resolution. A conflict with ``precision=`` is an error; fp16 on the CPU is refused
  (DeepSpeed refuses it).
- ``zero_optimization``: stages 0-3. Offload to ``nvme`` is not supported yet (error, fix: device cpu).
  ``offload_param`` needs stage 3; stage 3 needs both ``offload_param`` and ``offload_optimizer`` on the CPU
  (the layout the planner models: on one GPU, ZeRO-3 without offload keeps what ZeRO-2 keeps and gathers
  weights every layer); offload needs a stage >= 1. Bucket sizes: explicit ones stay, ``"auto"`` = from
  the hidden size. ``pin_memory``: explicit stays (with a notice when vramfit would not pin), ``"auto"`` or
  absent = vramfit's decision (ulimit -l and free RAM).
- ``activation_checkpointing``: Hugging Face models never call DeepSpeed's checkpointing, so the block would
  do nothing: error, fix ``model.gradient_checkpointing=true``. ``torch_autocast`` enabled: error (vramfit runs
  DeepSpeed's fp16/bf16 modes, the ones it plans). ``bfloat16`` (the old name of ``bf16``): error, rename it.
- ``"auto"`` anywhere else (e.g. ``sub_group_size``): error, nothing defines it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import logging
import typing
from collections.abc import KeysView
from dataclasses import dataclass

from launcher.config.checks import read_deepspeed_json
from launcher.config.profiles import AUTO_PATHS, USER_JSON_ENGINE, Profile, RunValues, fill_auto, find_auto
from launcher.config.schema import AUTO, Config, ConfigError
from launcher.machine import dist
from launcher.precision import deepspeed_runs_fp16

SOURCE = "deepspeed_config"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OFFLOADS = ("offload_optimizer", "offload_param")
CONFIG_DOCS = "https://www.deepspeed.ai/docs/config-json/"


@dataclass(frozen=True)
class UserDsConfig:
    path: str
    template: dict  # the JSON as DeepSpeed will get it, "auto" still open (the dropped scheduler taken out)
    profile: Profile
    micro_batch: int | None  # the JSON's explicit train_micro_batch_size_per_gpu (or one its batch keys imply)
    notices: tuple[str, ...] = ()

    def with_batch_auto(self) -> UserDsConfig:
        """The same config with its batch keys open: once its explicit values were found equal to the run's,
        the OOM ladder may halve the micro-batch (accumulation doubles, the global batch stays)."""
        t = copy.deepcopy(self.template)
        for k in BATCH_KEYS:
            t[k] = AUTO
        return dataclasses.replace(self, template=t)


# ------------------------------------------------------------------------------------------------
# What DeepSpeed reads


class _ReadKeys(KeysView):
    def __contains__(self, key):
        self._mapping.seen.add(key)
        return dict.__contains__(self._mapping, key)


class _Recorder(dict):
    """A dict that remembers which keys were asked for (``copy.copy`` keeps the same ``seen`` set)."""

    seen: set

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return _ReadKeys(self)


@functools.lru_cache(maxsize=1)
def known_top_level_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed's config parser reads, recorded by letting ``DeepSpeedConfig`` parse a
    minimal config that remembers every key asked for.

    Not taken from ``deepspeed.runtime.constants``: that module also names nested keys (``enabled``,
    ``params``, ``type``, ``stage``...), which would pass as top-level keys, and misses top-level keys
    defined elsewhere (``zero_optimization`` in ``runtime/zero/config.py``; ``compile`` and
    ``weight_quantization`` are literals in ``runtime/config.py``). Two keys are read outside the parser,
    by ``deepspeed.initialize`` itself (``deepspeed/__init__.py``: the sequence-parallel mesh), and are
    added by name. Keys DeepSpeed has removed are in the set: DeepSpeed refuses them itself, with its
    own message."""
    from deepspeed.runtime.config import DeepSpeedConfig

    rec = _Recorder({"train_micro_batch_size_per_gpu": 1})
    rec.seen = set()
    with _quiet_deepspeed():
        DeepSpeedConfig(rec)
    return frozenset(rec.seen | {"sequence_parallel_size", "data_parallel_size"})


def optimizer_names() -> list[str]:
    """Optimizer types DeepSpeed builds: its own (case-insensitive) and any ``torch.optim`` class by name
    (``DeepSpeedEngine._configure_basic_optimizer``)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    torch_names = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                   and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]
    return list(DEEPSPEED_OPTIMIZERS) + torch_names


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeed logs its config parsing to stdout; ``vramfit plan --json`` prints JSON alone."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------------------------------------
# DeepSpeed's verdict


def _drop_auto(obj):
    if isinstance(obj, dict):
        return {k: _drop_auto(v) for k, v in obj.items() if v != AUTO}
    return obj


def _model_fields(title: str, loc: tuple) -> list[str]:
    """Field names (and aliases) of the DeepSpeed model an error at ``loc`` inside model ``title`` is in."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    cls = next((c for c in subclasses(DeepSpeedConfigModel) if c.__name__ == title), None)
    for part in loc[:-1]:
        if cls is None:
            return []
        f = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        ann = f.annotation if f is not None else None
        cls = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type)
                    and issubclass(a, DeepSpeedConfigModel)), None)
    if cls is None:
        return []
    return sorted({n for n in cls.model_fields} | {f.alias for f in cls.model_fields.values() if f.alias})


def deepspeed_problems(cfg: dict, where: str = SOURCE) -> list[str]:
    """What DeepSpeed's config models say about ``cfg`` (one problem per error; empty when it accepts it).

    Each top-level key is parsed on its own first, so that an error names its block; then the whole, for
    rules across blocks (fp16 and bf16 both on). Runs without a process group (DeepSpeedConfig then
    assumes one rank, so the batch keys are checked by vramfit, not here)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    def verdict(probe: dict, block: str | None) -> list[str]:
        try:
            with _quiet_deepspeed():
                DeepSpeedConfig(copy.deepcopy(probe))
            return []
        except ValidationError as e:
            out = []
            for err in e.errors():
                loc = tuple(str(x) for x in err["loc"])
                path = ".".join(((block,) if block else ()) + loc)
                fix = f"set {path} as the rule says, or remove it for DeepSpeed's default ({CONFIG_DOCS})"
                if err["type"] == "extra_forbidden":
                    close = difflib.get_close_matches(loc[-1], _model_fields(e.title, loc), n=1, cutoff=0.6)
                    fix = (f"did you mean {'.'.join(((block,) if block else ()) + loc[:-1] + (close[0],))}?" if close
                           else f"remove {path} (DeepSpeed's keys: {CONFIG_DOCS})")
                out.append(f"{where} {path}: got {err.get('input')!r}; rule: DeepSpeed's {e.title}: {err['msg']}; "
                           f"fix: {fix}")
            return out
        except Exception as e:  # DeepSpeedConfigError, AssertionError, ValueError: DeepSpeed's own words
            name = block or "the config"
            return [f"{where} {name}: refused by DeepSpeed; rule: {type(e).__name__}: {e}; fix: correct or remove "
                    f"{name} ({CONFIG_DOCS})"]

    base = {"train_micro_batch_size_per_gpu": 1}
    probe = {k: v for k, v in _drop_auto(cfg).items() if k not in BATCH_KEYS}
    found = [p for k, v in probe.items() for p in verdict({**base, k: v}, k)]
    return found or verdict({**base, **probe}, None)


# ------------------------------------------------------------------------------------------------
# vramfit's rules


def _offload_device(zero: dict, key: str) -> str:
    blk = zero.get(key)
    return str(blk.get("device", "none")) if isinstance(blk, dict) else "none"


def vramfit_problems(raw: dict, cfg: Config) -> tuple[list[str], list[str]]:
    """(problems, notices): what vramfit cannot honour (module docstring), each with value, rule and fix."""
    problems: list[str] = []
    notices: list[str] = []
    known = known_top_level_keys()
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            problems.append(f"{SOURCE} {key}: unknown key; rule: only keys DeepSpeed reads (DeepSpeed ignores any other "
                            "silently, so a typo would drop that setting); fix: "
                            + (f"did you mean {close[0]}?" if close else f"remove it ({CONFIG_DOCS})"))
    sched = raw.get("scheduler")
    if sched is not None:
        params = sched.get("params", {}) if isinstance(sched, dict) else sched
        kind = sched.get("type", "?") if isinstance(sched, dict) else "?"
        explicit = {k: v for k, v in params.items() if v != AUTO} if isinstance(params, dict) else params
        t = cfg.train
        if explicit:
            warm = explicit.get("warmup_num_steps") if isinstance(explicit, dict) else None
            problems.append(f"{SOURCE} scheduler: got {kind} with {explicit!r}; rule: vramfit's loop owns the learning-rate "
                            "schedule (linear warmup, then cosine to lr x train.min_lr_ratio) and sets every step's "
                            "lr, so a DeepSpeed scheduler cannot run; fix: remove the scheduler block and set "
                            f"train.lr, train.warmup_steps{f'={warm}' if isinstance(warm, int) else ''}, "
                            "train.min_lr_ratio")
        else:
            notices.append(f"{SOURCE}: scheduler {kind} dropped (its params are all \"auto\"); the schedule comes from "
                           f"train.lr={t.lr:g}, train.warmup_steps={t.warmup_steps}, train.min_lr_ratio={t.min_lr_ratio:g} "
                           "(linear warmup, cosine decay)")
    opt = raw.get("optimizer")
    if opt is not None:
        kind = opt.get("type") if isinstance(opt, dict) else None
        names = optimizer_names()
        if not isinstance(kind, str):
            problems.append(f"{SOURCE} optimizer: got {opt!r}; rule: an object with a \"type\" (and \"params\"); "
                            "fix: {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\", ...}}, or no optimizer block "
                            "(vramfit's AdamW from train.*)")
        elif kind.lower() not in ("adam", "adamw"):
            known_opt = kind.lower() in names or kind in names
            close = difflib.get_close_matches(kind, names, n=1, cutoff=0.6)
            rule = ("vramfit plans memory for Adam's two moments and carries them across the OOM ladder and resume"
                    if known_opt else f"a type DeepSpeed builds ({', '.join(names[:9])} or a torch.optim class)")
            fix = "optimizer.type AdamW (or no optimizer block)" + (
                "" if known_opt or not close else f"; did you mean {close[0]}?")
            problems.append(f"{SOURCE} optimizer.type: got {kind!r}; rule: {rule}; fix: {fix}")
        if isinstance(opt, dict) and not isinstance(opt.get("params", {}), dict):
            problems.append(f"{SOURCE} optimizer.params: got {opt['params']!r}; rule: an object of parameters; "
                            "fix: {\"lr\": \"auto\", \"betas\": \"auto\", \"eps\": \"auto\", \"weight_decay\": \"auto\"}")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        problems.append(f"{SOURCE} zero_optimization: got {zero!r}; rule: an object (the old boolean form is not "
                        "read); fix: {\"stage\": 2}")
        zero = {}
    stage = zero.get("stage", 0)
    devices = {k: _offload_device(zero, k) for k in OFFLOADS}
    for k, dev in devices.items():
        if dev == "nvme":
            problems.append(f"{SOURCE} zero_optimization.{k}.device: got 'nvme'; rule: offload to NVMe is not supported "
                            "by vramfit yet (the planner has no disk model); fix: \"device\": \"cpu\"")
    on = {k: dev == "cpu" for k, dev in devices.items()}
    if isinstance(stage, int) and stage in (0, 1, 2, 3):
        if on["offload_param"] and stage != 3:
            problems.append(f"{SOURCE} zero_optimization.offload_param: got device cpu with stage {stage}; rule: "
                            "DeepSpeed offloads parameters at stage 3 only (below it the block does nothing); fix: "
                            "\"stage\": 3 with offload_optimizer too, or remove offload_param")
        if stage == 3 and not (on["offload_param"] and on["offload_optimizer"]):
            have = " and ".join(k for k in OFFLOADS if on[k]) or "no offload"
            problems.append(f"{SOURCE} zero_optimization: got stage 3 with {have}; rule: vramfit plans ZeRO-3 with both "
                            "offload_param and offload_optimizer on the CPU (on one GPU, ZeRO-3 without them keeps what "
                            "ZeRO-2 keeps and gathers weights every layer); fix: add \"offload_optimizer\" and "
                            "\"offload_param\" {\"device\": \"cpu\"}, or \"stage\": 2 (with offload_optimizer to "
                            "offload the optimizer)")
        if stage == 0 and on["offload_optimizer"]:
            problems.append(f"{SOURCE} zero_optimization.offload_optimizer: got device cpu with stage 0; rule: optimizer "
                            "offload is a ZeRO feature (stage 1-3); fix: \"stage\": 2")
    if "activation_checkpointing" in raw:
        problems.append(f"{SOURCE} activation_checkpointing: got {raw['activation_checkpointing']!r}; rule: Hugging Face "
                        "models never call DeepSpeed's activation checkpointing, so the block would do nothing; fix: "
                        "remove it and set model.gradient_checkpointing=true")
    ta = raw.get("torch_autocast")
    if isinstance(ta, dict) and ta.get("enabled"):
        problems.append(f"{SOURCE} torch_autocast: got {ta!r}; rule: vramfit runs (and plans) DeepSpeed's fp16/bf16 "
                        "modes; fix: remove torch_autocast and use \"bf16\": {\"enabled\": \"auto\"}")
    if "bfloat16" in raw:
        problems.append(f"{SOURCE} bfloat16: got {raw['bfloat16']!r}; rule: the old name of the bf16 block, which "
                        "vramfit reads; fix: rename the key to bf16")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        v = raw.get(key, AUTO)
        if v != AUTO and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            problems.append(f"{SOURCE} {key}: got {v!r}; rule: a whole number >= 1 or \"auto\"; fix: \"{key}\": \"auto\"")
    for path in find_auto(raw):
        if path not in AUTO_PATHS and not path.startswith("scheduler."):
            problems.append(f"{SOURCE} {path}: got \"auto\"; rule: vramfit fills \"auto\" only in "
                            f"{', '.join(sorted(AUTO_PATHS))}; fix: give {path} a value, or remove it for DeepSpeed's "
                            "default")
    return problems, notices


def _enabled(raw: dict, block: str):
    blk = raw.get(block)
    return blk.get("enabled", AUTO) if isinstance(blk, dict) else None  # None: no block


def decide_precision(raw: dict, cfg: Config, vramfit: tuple[str, str], device_type: str,
                     bf16_ok: bool = True) -> tuple[str, str]:
    """(precision, why). An explicit ``enabled: true`` in fp16 or bf16 decides it (both false: fp32);
    ``"auto"`` or no block follows vramfit's resolution ``vramfit`` (precision, why). Conflicts raise."""
    fp16, bf16 = _enabled(raw, "fp16"), _enabled(raw, "bf16")
    if fp16 is True and bf16 is True:
        raise ConfigError([f"{SOURCE} fp16.enabled and bf16.enabled: both true; rule: one 16-bit mode at a time "
                           "(DeepSpeed refuses both); fix: \"enabled\": \"auto\" in one of them"])
    problems = []
    explicit = fp16 is True or bf16 is True or (fp16 is False and bf16 is False)
    if explicit:
        block = "bf16" if bf16 is True else "fp16"
        prec = "fp16" if fp16 is True else "bf16" if bf16 is True else "fp32"
        why = f"{block}.enabled true" if prec != "fp32" else "fp16.enabled and bf16.enabled false"
        if cfg.precision not in (AUTO, prec):
            problems.append(f"{SOURCE} {block}.enabled: got {prec == block}, so the JSON runs {prec} ({why}), but "
                            f"precision={cfg.precision}; rule: they must agree; fix: precision=auto or "
                            f"precision={prec}, or \"enabled\": \"auto\" in the JSON to follow precision")
        if prec == "bf16" and device_type == "cuda" and not bf16_ok:
            problems.append(f"{SOURCE} bf16.enabled: got true on a GPU without native bf16 (compute capability < 8.0); "
                            "rule: bf16 needs Ampere or newer; fix: \"bf16\": {\"enabled\": \"auto\"} (fp16 with "
                            "dynamic loss scaling there)")
    else:
        prec, why = vramfit
        if {"fp16": fp16, "bf16": bf16}.get(prec) is False:
            problems.append(f"{SOURCE} {prec}.enabled: got false, but vramfit resolves precision {prec} ({why}); rule: "
                            "the JSON may not switch off the precision the run uses; fix: \"enabled\": \"auto\", "
                            f"or precision={'fp32' if prec != 'fp32' else 'bf16'}")
    if prec == "fp16" and not deepspeed_runs_fp16(device_type):
        problems.append(f"{SOURCE} fp16.enabled: got true on the CPU; rule: DeepSpeed refuses fp16 on the CPU; fix: "
                        "\"fp16\": {\"enabled\": \"auto\"}, or \"bf16\": {\"enabled\": true} (bf16 runs on the CPU)"
                        if explicit else
                        "precision: got fp16 with deepspeed_config on the CPU; rule: DeepSpeed refuses fp16 on the CPU; "
                        "fix: precision=bf16 or precision=fp32")
    if problems:
        raise ConfigError(problems)
    if explicit:
        return prec, f"precision {prec} from deepspeed_config ({why})"
    return prec, f"{why} (deepspeed_config leaves precision \"auto\")"


# ------------------------------------------------------------------------------------------------
# The custom profile


def profile_of(raw: dict, precision: str) -> Profile:
    """The custom row of the plan. Bucket sizes: explicit ones, DeepSpeed's defaults when absent, None (from
    the hidden size, as the catalogue) when ``"auto"``."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = raw.get("zero_optimization", {}) if isinstance(raw.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0)
    opt, par = (_offload_device(zero, k) == "cpu" for k in OFFLOADS)
    with _quiet_deepspeed():
        model = DeepSpeedZeroConfig(**{k: v for k, v in _drop_auto(zero).items() if k not in OFFLOADS})
    reduce = None if zero.get("reduce_bucket_size") == AUTO else int(model.reduce_bucket_size)
    prefetch = None if zero.get("stage3_prefetch_bucket_size") == AUTO else int(model.prefetch_bucket_size)
    name = f"custom-zero{stage}-{precision}" + ("-offload-all" if par else "-offload-opt" if opt else "")
    rank = 4 if par else 2 if opt else 1  # the catalogue's speed ranks of the same layouts
    return Profile(name, USER_JSON_ENGINE, precision, zero_stage=int(stage), offload_optimizer=opt, offload_param=par,
                   speed_rank=rank, gpu_holds="as the JSON's zero_optimization says",
                   cpu_holds="offloaded states" if opt or par else "nothing",
                   reduce_bucket_size=reduce, prefetch_bucket_size=prefetch,
                   ds_optimizer=isinstance(raw.get("optimizer"), dict))


def load(cfg: Config, precision: str) -> UserDsConfig:
    """Read and check ``cfg.deepspeed_config`` for a run of ``precision`` (from :func:`decide_precision`).
    Raises one ConfigError listing every problem."""
    raw, problem = read_deepspeed_json(cfg.deepspeed_config)
    if problem:
        raise ConfigError([problem])
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        raise ConfigError([f"{SOURCE}: got {cfg.deepspeed_config!r}, but DeepSpeed does not import ({type(e).__name__}: "
                           f"{e}); rule: a DeepSpeed config needs DeepSpeed; fix: pip install 'vramfit[deepspeed]', or "
                           "deepspeed_config=\"\""]) from None
    problems, notices = vramfit_problems(raw, cfg)
    problems += deepspeed_problems(raw)
    if problems:
        raise ConfigError(problems)
    template = {k: v for k, v in raw.items() if k != "scheduler"}  # a scheduler left here has all-"auto" params
    return UserDsConfig(cfg.deepspeed_config, template, profile_of(raw, precision), _micro_batch(raw, cfg),
                        tuple(notices))


def _micro_batch(raw: dict, cfg: Config) -> int | None:
    """The micro-batch the JSON implies: its train_micro_batch_size_per_gpu, or the global batch over its
    gradient_accumulation_steps and the ranks (as DeepSpeed derives it). None: the JSON leaves it open."""
    micro, acc = raw.get("train_micro_batch_size_per_gpu", AUTO), raw.get("gradient_accumulation_steps", AUTO)
    if isinstance(micro, int) and not isinstance(micro, bool):
        return micro
    per = (acc if isinstance(acc, int) and not isinstance(acc, bool) else 0) * dist.current().world
    if per and cfg.train.global_batch_size % per == 0:
        return cfg.train.global_batch_size // per
    return None


def run_values(cfg: Config, precision: str, micro_batch: int, accumulation: int, world: int, hidden_size: int,
               pin_memory: bool, lr: float, largest_module: int = 0) -> RunValues:
    t = cfg.train
    return RunValues(precision, micro_batch, accumulation, world, t.grad_clip, lr, (t.beta1, t.beta2), t.eps,
                     t.weight_decay, hidden_size, pin_memory, dict(vars(cfg.loss_scale)), peak_lr=t.lr,
                     largest_module=largest_module)


def resolve(user: UserDsConfig, values: RunValues) -> dict:
    """The config DeepSpeed receives (no "auto" left), or a ConfigError: explicit values that disagree with
    the run's, and anything DeepSpeed's config refuses once the values are in."""
    cfg, problems = fill_auto(user.template, values, SOURCE)
    problems += [f"{SOURCE} {p}: \"auto\" left unresolved; rule: no \"auto\" reaches DeepSpeed; fix: give it a value"
                 for p in find_auto(cfg)]
    if not problems:
        problems = deepspeed_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def precision_for(cfg: Config, vramfit: tuple[str, str], device_type: str, bf16_ok: bool = True) -> tuple[str, str]:
    """:func:`decide_precision` for ``cfg.deepspeed_config`` (read from its file)."""
    raw, problem = read_deepspeed_json(cfg.deepspeed_config)
    if problem:
        raise ConfigError([problem])
    return decide_precision(raw, cfg, vramfit, device_type, bf16_ok)
