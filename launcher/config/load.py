"""Loading a run configuration: a YAML file and ``key=value`` overrides -> a checked :class:`.schema.Config`.

:func:`load_config` walks the user's keys against the schema, converts each value to its field's type (bounds and
choices included), fills the ``lora.*`` keys a loaded adapter decides, then runs :mod:`.checks`; it collects *every*
problem and raises one :class:`.schema.ConfigError` listing them, each with the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, get_origin

from omegaconf import OmegaConf

from launcher.config.checks import check, names_and_paths
from launcher.config.schema import AUTO, Config, ConfigError, auto_warmup_steps, to_dict


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
    ok, out = _convert(value, want, meta.get("choices") or ())
    if not ok:
        kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
                list: "a list of names"}.get(want if want in (bool, int, float, str) else list, str(want))
        if meta.get("auto"):
            kind += " or 'auto'"
        problems.append(f"{key}: got {value!r} ({type(value).__name__}); rule: must be {kind}; "
                        f"fix: {key}=<{kind}>")
        return None
    problem = _value_problem(key, value, out, want, f)
    if problem:
        problems.append(problem)
        return None
    return out


def _convert(value: Any, want, choices) -> tuple[bool, Any]:
    """(whether ``value`` reads as type ``want``, the value so read); a YAML boolean given to a text field with
    ``choices`` reads as on/off when those are among them."""
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
    return ok, out


def _value_problem(key: str, value: Any, out: Any, want, f: dataclasses.Field) -> str | None:
    """What is wrong with ``out``, the user's ``value`` read as type ``want``, against the field's rules (no NUL
    in text, finite numbers, ``choices``, bounds, 64 bits), else None."""
    meta = f.metadata
    if want is str and "\0" in out:  # a path with a NUL byte fails in every os call
        return f"{key}: got {value!r}; rule: text without NUL characters; fix: {key}={out.replace(chr(0), '')!r}"
    if want is float and not math.isfinite(out):
        return (f"{key}: got {value!r}; rule: a finite number (NaN and infinity are not settings: every "
                f"sum, bound and budget that meets one is NaN or infinite too); fix: {key}={_fix_value(f)}")
    choices = meta.get("choices")
    if choices and out not in choices:
        close = difflib.get_close_matches(str(out), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{key}: got {out!r}; rule: one of {', '.join(choices)}; fix: {key}={close[0] if close else choices[0]}{hint}"
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        if lo is not None and out < lo:
            return f"{key}: got {out!r}; rule: must be >= {lo}; fix: {key}={lo}"
        if hi is not None and out > hi:
            return f"{key}: got {out!r}; rule: must be <= {hi}; fix: {key}={hi}"
        # an open bound cannot be offered as the fix: the default is (for lr, betas, eps, dropout, scale)
        if meta.get("above") is not None and out <= meta["above"]:
            return f"{key}: got {out!r}; rule: must be > {meta['above']}; fix: {key}={f.default}"
        if meta.get("below") is not None and out >= meta["below"]:
            return f"{key}: got {out!r}; rule: must be < {meta['below']}; fix: {key}={f.default}"
        if isinstance(out, int) and not -INT64 <= out < INT64:
            return (f"{key}: got {value!r}; rule: a whole number that fits 64 bits (what torch and the data "
                    f"order take), below 2**63; fix: {key}={_fix_value(f)}")
    return None


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
