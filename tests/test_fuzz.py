"""The hostile user, generated. Every field of the config schema and every numeric option of the command line is
given values no run can take (wrong types, NaN and infinity, values past their bounds, numbers past 64 bits,
unknown keys, sections given a value), on every command that takes them; then, as a table: broken, cut-short and
missing files, read-only and missing folders, broken launcher variables, on every command. Each case asserts what a
refusal must be (tests/helpers/hostile.py): a non-zero exit, no traceback, one line with the value, the rule and the
fix, nothing written. The rows of the table in issue 42 are seeds of their own (``test_issue_42_seed``), each with
the words it must end with.

The default run takes every bad value once, each on the next command in turn, and every table row; the slow set
(``-m slow``) each value on the other commands too. Cases run in this process (``launcher.cli.main``, a few
milliseconds each); a handful run in a fresh interpreter, and the read-only folders once more as folders the kernel
itself refuses to write (``helpers.hostile.really_read_only``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from helpers import ROOT
from helpers.hostile import changes, is_root, read_only, really_read_only, refused, snapshot, vramfit
from launcher import cli
from launcher.config.schema import Config

CONFIG_COMMANDS = ("plan", "train", "tune", "bench")
# a small workload under every config case: a refusal that went missing trains for seconds, not minutes
SMALL = ["train.max_steps=2", "data.num_samples=64", "data.seq_len=16", "train.global_batch_size=8", "sample_tokens=0",
         "device=cpu", "log.every_steps=1000"]
NEEDS = {"export": ["RUN", "--out", "OUT"], "plot": ["RUN"]}  # what a command needs before an option is looked at


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing here may reach the network: a name that reached the hub would wait for its retries, not refuse."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(capsys, monkeypatch, tmp_path, *argv, env=None, console=False):
    """``vramfit ARGV`` in ``tmp_path``: (exit code, stderr, what changed under ``tmp_path``)."""
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, *argv, env=env, cwd=tmp_path, console=console)
    return rc, err, changes(before, snapshot(tmp_path))


def assert_refused(result, *names, code=2):
    rc, err, changed = result
    refused(rc, err, *names, code=code)
    assert changed == [], f"written: {changed}"


# ------------------------------------------------------------------------------------------------
# Generated from the schema


def leaves(cls=Config, prefix=""):
    """(dotted key, dataclass field) of every setting of the schema."""
    obj = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            yield from leaves(type(getattr(obj, f.name)), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def sections(cls=Config, prefix=""):
    obj = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            yield f"{prefix}{f.name}"
            yield from sections(type(getattr(obj, f.name)), f"{prefix}{f.name}.")


def value_type(f) -> str:
    """The kind of value a field takes, as the schema's own conversion reads its annotation."""
    t = f.type if isinstance(f.type, str) else f.type.__name__
    if t == "Any":
        number = f.metadata.get("number")
        return number.__name__ if number else ("int" if isinstance(f.default, int) else "float")
    return t


def shown(kind: str, value) -> str:
    """How a number appears after the schema read it (``got -1.0`` for a float field given -1)."""
    return repr(float(value)) if kind == "float" else repr(int(value))


def bad_values(f) -> list[tuple[str, str, str]]:
    """(kind of badness, text on the command line, what the refusal shows of it) for one field."""
    meta, t = f.metadata, value_type(f)
    if meta.get("items") is not None:  # data.sources: a list of sections
        return [("type", "5", "5"), ("type", "[5]", "5"), ("unknown", "[{path: a.jsonl, nope: 1}]", "nope"),
                ("nonfinite", "[{path: a.jsonl, weight: .nan}]", "nan"),
                ("bound", "[{path: a.jsonl, weight: -1}]", "-1")]
    out = []
    if t in ("float", "int"):
        out += [("nonfinite", "nan", "nan"), ("nonfinite", ".inf", "inf"), ("nonfinite", "-.inf", "-inf"),
                ("nonfinite", "1e400", "inf"), ("type", "abc", "abc"), ("type", "[1]", "[1]")]
        if t == "int":
            out += [("type", "1.5", "1.5"), ("huge", str(2**64), str(2**64))]
        for bound, step in (("min", -1), ("max", +1)):
            if meta.get(bound) is not None:
                v = shown(t, meta[bound] + step)
                out.append(("bound", v, v))
        for bound in ("above", "below"):  # the open bound itself
            if meta.get(bound) is not None:
                v = shown(t, meta[bound])
                out.append(("bound", v, v))
    elif t == "bool":
        out += [("type", "maybe", "maybe"), ("type", "2", "2"), ("type", "[1]", "[1]")]
    elif t == "str":
        if meta.get("choices"):
            out.append(("choice", "no-such-choice", "no-such-choice"))
        out += [("type", "[a, b]", "['a', 'b']"), ("type", "{a: 1}", "{'a': 1}")]
    elif t == "list":
        out += [("type", "{a: 1}", "{'a': 1}"), ("type", "5", "5")]
    else:
        raise AssertionError(f"the fuzzer has no bad values for a {t} field: add them")
    if meta.get("auto"):
        out.append(("type", "automatic", "automatic"))
    return out


@dataclass(frozen=True)
class Case:
    command: str
    override: str  # key=value, the last on the command line (it wins over SMALL)
    names: tuple  # what the refusal's line must hold


def config_cases() -> list[Case]:
    cases = []
    for key, f in leaves():
        for kind, text, show in bad_values(f):
            cases.append((kind, Case("", f"{key}={text}", (key.split(".")[0] if kind == "unknown" else key, show))))
    for sec in sections():
        cases.append(("unknown", Case("", f"{sec}.no_such_key=1", (f"{sec}.no_such_key", "unknown key"))))
        cases.append(("type", Case("", f"{sec}=5", (sec, "a section of keys"))))
    cases.append(("unknown", Case("", "no_such_key=1", ("no_such_key", "unknown key"))))
    cases.append(("type", Case("", "train..lr=1", ("train..lr", "not a key"))))
    cases.append(("type", Case("", "train.lr=[1,2", ("train.lr", "[1,2"))))
    cases.append(("type", Case("", "train.lr", ("train.lr", "not found"))))  # no '=': read as CONFIG, no such file
    return cases


def split_cases():
    """(default run, slow set): in the default run every bad value once, each on the next command in turn; in the
    slow set each value on the other commands."""
    default, slow = [], []
    for i, (_kind, c) in enumerate(config_cases()):
        for command in CONFIG_COMMANDS:
            (default if command == CONFIG_COMMANDS[i % len(CONFIG_COMMANDS)] else slow).append(
                dataclasses.replace(c, command=command))
    return default, slow


DEFAULT_CASES, SLOW_CASES = split_cases()


def _config_case(capsys, monkeypatch, tmp_path, case):
    argv = [case.command, *SMALL, case.override] if case.override != "train.lr" else [case.command, case.override]
    assert_refused(run(capsys, monkeypatch, tmp_path, *argv), *case.names)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=[f"{c.command}-{c.override}" for c in DEFAULT_CASES])
def test_config_values_are_refused(capsys, monkeypatch, tmp_path, case):
    _config_case(capsys, monkeypatch, tmp_path, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[f"{c.command}-{c.override}" for c in SLOW_CASES])
def test_config_values_are_refused_everywhere(capsys, monkeypatch, tmp_path, case):
    _config_case(capsys, monkeypatch, tmp_path, case)


def test_every_field_has_cases():
    """The generator covers the schema: a field added without bad values it understands fails here, not silently."""
    keys = {c.override.split("=")[0] for c in DEFAULT_CASES}
    assert {k for k, _ in leaves()} <= keys
    assert {c.command for c in DEFAULT_CASES} == set(CONFIG_COMMANDS)
    assert 300 <= len(DEFAULT_CASES) <= 800, len(DEFAULT_CASES)  # a few hundred in the default run


# ------------------------------------------------------------------------------------------------
# Generated from the command line's arguments


def option_cases() -> list[tuple[str, list[str], tuple]]:
    """(command, argv after it, names) for every numeric option of every command (the bounds its argparse type
    carries), an unknown option and a bad choice on every command."""
    parser = cli.build_parser()
    out = []
    for command, sub in parser.commands.items():
        need = NEEDS.get(command, [])
        for action in sub._actions:  # argparse lists a parser's arguments nowhere public
            t = action.type
            flag = action.option_strings[-1] if action.option_strings else None
            if isinstance(t, cli.Number):
                kind = "int" if t.kind is int else "float"
                values = ["abc", "nan", "inf", "-inf", "1e400", "[1]"] + (["1.5"] if kind == "int" else [])
                values += [shown(kind, t.lo - 1)] if t.lo is not None else []
                values += [shown(kind, t.above)] if t.above is not None else []
                out += [(command, [*need, f"{flag}={v}"], (flag, v)) for v in values]  # '=': '-inf' is no option
            elif action.choices and flag:
                out.append((command, [*need, flag, "no-such-choice"], (flag, "no-such-choice")))
        out.append((command, [*need, "--no-such-option"], ("--no-such-option",)))
    out.append(("no-such-command", [], ("no-such-command",)))
    return out


OPTION_CASES = option_cases()


@pytest.mark.parametrize("command,argv,names", OPTION_CASES, ids=[f"{c}-{' '.join(a)}" for c, a, _ in OPTION_CASES])
def test_options_are_refused(capsys, monkeypatch, tmp_path, command, argv, names):
    assert_refused(run(capsys, monkeypatch, tmp_path, command, *argv), *names)


def test_every_numeric_option_is_checked():
    """A numeric option added with a bare int or float (which takes nan, inf and negatives) fails here."""
    for command, sub in cli.build_parser().commands.items():
        for action in sub._actions:
            assert action.type not in (int, float), f"vramfit {command} {action.option_strings}: use cli.Number"


# ------------------------------------------------------------------------------------------------
# Files, folders and the environment, as a table


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny local model (config.json, safetensors, tokenizer) that each case copies and damages."""
    from helpers.hf import make_model_dir

    return make_model_dir(str(tmp_path_factory.mktemp("model") / "m"))


def copy_model(model_dir, tmp_path) -> str:
    return shutil.copytree(model_dir, tmp_path / "model")


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _edit_json(path, **changes_):
    doc = json.load(open(path))
    doc.update(changes_)
    json.dump(doc, open(path, "w"))


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)
    return path


def model_damage(m) -> dict:
    """What to do to a model folder ``m``, and what the refusal must say."""
    st = os.path.join(m, "model.safetensors")
    return {
        "truncated": (lambda: _truncate(st), "is cut short"),
        "header-length-garbage": (lambda: _write(st, (2**60).to_bytes(8, "little") + b"{}"), "says its header is"),
        "header-not-json": (lambda: _write(st, (4).to_bytes(8, "little") + b"{x:1"), "not JSON"),
        "empty-weights": (lambda: _write(st, b""), "fewer than a safetensors header's 8"),
        "heads-disagree": (lambda: _edit_json(os.path.join(m, "config.json"), num_key_value_heads=4),
                           "differ in shape"),
        "config-not-json": (lambda: _write(os.path.join(m, "config.json"), '{"model_type": '), "is not valid JSON"),
        "config-no-model-type": (lambda: _write(os.path.join(m, "config.json"), '{"hidden_size": 8}'),
                                 'has no "model_type"'),
        "missing-shard": (lambda: (os.remove(st), _write(os.path.join(m, "model.safetensors.index.json"), json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})),
            _write(os.path.join(m, "model-00001-of-00002.safetensors"), b"x")), "lacks 1 of the 2"),
    }


MODEL_DAMAGE = list(model_damage("m"))


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("damage", MODEL_DAMAGE)
def test_damaged_model_folders(capsys, monkeypatch, tmp_path, model_dir, command, damage):
    m = copy_model(model_dir, tmp_path)
    do, says = model_damage(m)[damage]
    do()
    data = ["data.vocab_size=32"]  # the synthetic task within the tiny model's vocabulary
    assert_refused(run(capsys, monkeypatch, tmp_path, command, *SMALL, *data, f"model.name={m}"), "model.name", says)


def test_plan_takes_a_config_without_weights_and_train_does_not(capsys, monkeypatch, tmp_path, model_dir):
    """A plan for another machine may have config.json alone; a run starts from the weights."""
    m = copy_model(model_dir, tmp_path)
    os.remove(os.path.join(m, "model.safetensors"))
    rc, err, _ = run(capsys, monkeypatch, tmp_path, "plan", *SMALL, "data.vocab_size=32", f"model.name={m}")
    assert rc == 0, err[-2000:]
    assert_refused(run(capsys, monkeypatch, tmp_path, "train", *SMALL, "data.vocab_size=32", f"model.name={m}"),
                   "model.name", "no weights")


CONFIG_FILES = {  # name -> (content, what the refusal says)
    "empty": ("", "empty (no keys)"),
    "only-comments": ("# to be written\n\n", "empty (no keys)"),
    "not-yaml": ("train: [1\n", "not valid YAML"),
    "duplicate-keys": ("seed: 1\nseed: 2\n", "not valid YAML"),
    "not-utf8": (b"\xff\xfe\x00t\x00r\x00a\x00i\x00n", "cannot be read"),
    "a-list": ("- train.lr=1\n", "top level is a list"),
    "nan-in-yaml": ("train:\n  lr: .nan\n", "train.lr"),
    "nul-in-yaml": ('run_name: "a\\0b"\n', "NUL"),
    "unknown-in-sources": ("data:\n  sources:\n    - {path: a.jsonl, wieght: 1}\n", "data.sources[0].wieght"),
}


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_broken_config_files(capsys, monkeypatch, tmp_path, command, name):
    content, says = CONFIG_FILES[name]
    path = _write(str(tmp_path / "c.yaml"), content)
    assert_refused(run(capsys, monkeypatch, tmp_path, command, path, *SMALL), says)


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
@pytest.mark.parametrize("what", ["missing", "a-folder"])
def test_config_file_missing_or_a_folder(capsys, monkeypatch, tmp_path, command, what):
    path = tmp_path / "c.yaml"
    if what == "a-folder":
        path.mkdir()
    assert_refused(run(capsys, monkeypatch, tmp_path, command, path), str(path), "not found" if what == "missing"
                   else "a folder")


FILE_SETTINGS = {  # (key, content of the file it names or None for none, what the refusal says)
    "deepspeed-json-garbage": ("deepspeed_config", "{\"zero_optimization\": ", "not valid JSON"),
    "deepspeed-json-list": ("deepspeed_config", "[1, 2]", "its top level is a list"),
    "deepspeed-json-missing": ("deepspeed_config", None, "no such file"),
    "chat-template-missing": ("data.chat_template", None, "an existing Jinja file"),
    "nvme-path-missing": ("memory.nvme_path", None, "no such folder"),
    "resume-not-a-checkpoint": ("checkpoint.resume", None, "checkpoint.resume"),
}


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
@pytest.mark.parametrize("name", list(FILE_SETTINGS))
def test_settings_naming_broken_or_missing_files(capsys, monkeypatch, tmp_path, command, name):
    key, content, says = FILE_SETTINGS[name]
    path = str(tmp_path / "the-file.json")
    if content is not None:
        _write(path, content)
    assert_refused(run(capsys, monkeypatch, tmp_path, command, *SMALL, f"{key}={path}"), key, says)


DATA_FILES = {  # train reads the data before the run directory exists
    "missing": (None, "not found"),
    "not-utf8": (b"\xff\xfe\x00\x01garbage\n", "not valid utf-8"),
    "empty": ("", "is empty"),
    "too-few-samples": ('{"text": "the cat sat"}\n', "fewer than one global batch"),
}


@pytest.mark.parametrize("name", list(DATA_FILES))
def test_broken_data_files(capsys, monkeypatch, tmp_path, model_dir, name):
    content, says = DATA_FILES[name]
    path = str(tmp_path / "d.jsonl")
    if content is not None:
        _write(path, content)
    m = copy_model(model_dir, tmp_path)
    assert_refused(run(capsys, monkeypatch, tmp_path, "train", *SMALL, f"model.name={m}", f"data.source={path}"),
                   "data", says)


# --- run directories: plot and export


def fake_run(root, *, memory="time_s,phase,cpu_rss_bytes\n0.0,start,100\n", summary=None, metrics=None, final=True):
    """A run directory as train leaves it, small: memory.csv, summary.json, metrics.jsonl, config.yaml, final/."""
    os.makedirs(root)
    _write(os.path.join(root, "config.yaml"), "seed: 1\n")
    if memory is not None:
        _write(os.path.join(root, "memory.csv"), memory)
    _write(os.path.join(root, "summary.json"), summary if summary is not None else json.dumps({"status": "completed"}))
    _write(os.path.join(root, "metrics.jsonl"), metrics if metrics is not None else json.dumps(
        {"step": 1, "time_s": 0.1, "loss": 1.0}) + "\n")
    if final:
        _write(os.path.join(root, "final", "model.safetensors"), b"weights")
    return root


PLOT_CASES = {  # name -> (make RUN_DIR under tmp, what the refusal says)
    "missing": (lambda t: str(t / "nope"), "no such folder"),
    "a-file": (lambda t: _write(str(t / "f"), "x"), "a file"),
    "not-a-run": (lambda t: (os.makedirs(t / "d"), str(t / "d"))[1], "not a run directory"),
    "monitor-off": (lambda t: fake_run(str(t / "r"), memory=None), "log.memory_interval_s=0"),
    "memory-csv-garbage": (lambda t: fake_run(str(t / "r"), memory="time_s,cpu_rss_bytes\nabc,def\n"), "memory.csv"),
    "summary-garbage": (lambda t: fake_run(str(t / "r"), summary="{\"status\": "), "summary.json"),
    "summary-a-list": (lambda t: fake_run(str(t / "r"), summary="[1]"), "summary.json"),
    "metrics-garbage": (lambda t: fake_run(str(t / "r"), metrics="{\"step\": 1}\n"), "metrics.jsonl"),
}


@pytest.mark.parametrize("name", list(PLOT_CASES))
def test_plot_of_what_is_not_a_readable_run(capsys, monkeypatch, tmp_path, name):
    make, says = PLOT_CASES[name]
    assert_refused(run(capsys, monkeypatch, tmp_path, "plot", make(tmp_path)), "RUN_DIR", says)


def test_plot_of_a_run_draws_it(capsys, monkeypatch, tmp_path):
    """The checks pass a run as train leaves it (the refusals above are of bad ones only)."""
    r = fake_run(str(tmp_path / "r"), memory="time_s,phase,cpu_rss_bytes\n0.0,start,100\n0.5,forward,200\n")
    rc, err = vramfit(capsys, monkeypatch, "plot", r, cwd=tmp_path)
    assert rc == 0 and os.path.isfile(os.path.join(r, "memory.png")), err[-2000:]


EXPORT_CASES = {  # name -> (argv after `export` given tmp, what the refusal says)
    "run-missing": (lambda t: [t / "nope", "--out", t / "o"], "no such folder"),
    "no-final": (lambda t: [fake_run(str(t / "r"), final=False, summary='{"status": "failed"}'), "--out", t / "o"],
                 "'failed'"),
    "no-final-summary-garbage": (lambda t: [fake_run(str(t / "r"), final=False, summary="{"), "--out", t / "o"],
                                 "'unreadable'"),
    "out-exists": (lambda t: [fake_run(str(t / "r")), "--out", (os.makedirs(t / "o"), t / "o")[1]], "already exists"),
    "out-under-a-file": (lambda t: [fake_run(str(t / "r")), "--out", t / _write(str(t / "f"), "x") / "o"],
                         "is a file"),
    "base-without-merge": (lambda t: [fake_run(str(t / "r")), "--out", t / "o", "--base", t], "without --merge"),
}


@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_export_refusals_speak_of_what_export_takes(capsys, monkeypatch, tmp_path, name):
    make, says = EXPORT_CASES[name]
    assert_refused(run(capsys, monkeypatch, tmp_path, "export", *make(tmp_path)), says)


# --- folders that cannot be written


RO = {  # name -> (argv given tmp t, with the read-only folder t/ro; what the refusal says)
    "train-output-dir": (lambda t: ["train", *SMALL, f"output_dir={t / 'ro'}"], "output_dir"),
    "train-output-dir-below": (lambda t: ["train", *SMALL, f"output_dir={t / 'ro'}/runs"], "output_dir"),
    "plan-output-dir": (lambda t: ["plan", *SMALL, f"output_dir={t / 'ro'}"], "output_dir"),
    "train-tracker-dir": (lambda t: ["train", *SMALL, f"log.tracker_dir={t / 'ro'}/tb"], "log.tracker_dir"),
    "train-cache-dir": (lambda t: ["train", *SMALL, f"data.cache_dir={t / 'ro'}/cache"], "data.cache_dir"),
    "bench-out": (lambda t: ["bench", *SMALL, "--out", t / "ro" / "x"], "--out"),
    "tune-dir": (lambda t: ["tune", *SMALL, "--dir", t / "ro" / "x"], "--dir"),
    "tune-out": (lambda t: ["tune", *SMALL, "--out", t / "ro" / "t.yaml"], "--out"),
    "profiles-dir": (lambda t: ["profiles", "--dir", t / "ro" / "x"], "--dir"),
    "export-out": (lambda t: ["export", fake_run(str(t / "run")), "--out", t / "ro" / "merged"], "--out"),
    "plot-run": (lambda t: ["plot", fake_run(str(t / "ro" / "run"))], "RUN_DIR"),
}


@pytest.mark.parametrize("name", list(RO))
def test_read_only_folders(capsys, monkeypatch, tmp_path, name):
    (tmp_path / "ro").mkdir()
    make, says = RO[name]
    argv = make(tmp_path)
    with read_only(monkeypatch, tmp_path / "ro", *([tmp_path / "ro" / "run"] if name == "plot-run" else [])):
        assert_refused(run(capsys, monkeypatch, tmp_path, *argv), says, "not writable")


MISSING_FOLDER_CASES = {  # name -> (argv given tmp, what the refusal says, exit code)
    "bench-out-a-file": (lambda t: ["bench", *SMALL, "--out", _write(str(t / "f"), "x")], "which is a file", 2),
    "tune-dir-a-file": (lambda t: ["tune", *SMALL, "--dir", _write(str(t / "f"), "x")], "which is a file", 2),
    "tune-out-folder-missing": (lambda t: ["tune", *SMALL, "--out", t / "no" / "t.yaml"], "does not exist", 2),
    "profiles-dir-under-a-file": (lambda t: ["profiles", "--dir", t / _write(str(t / "f"), "x") / "d"], "is a file", 2),
    "profiles-check-missing": (lambda t: ["profiles", "--check", "--dir", t / "nope"], "differ from the profile", 1),
    "output-dir-under-a-file": (lambda t: ["train", *SMALL, f"output_dir={_write(str(t / 'f'), 'x')}/runs"],
                                "cannot be made", 2),
    "tracker-dir-a-file": (lambda t: ["plan", *SMALL, f"log.tracker_dir={_write(str(t / 'f'), 'x')}"],
                           "which is a file", 2),
}


@pytest.mark.parametrize("name", list(MISSING_FOLDER_CASES))
def test_missing_folders_and_files_in_their_place(capsys, monkeypatch, tmp_path, name):
    make, says, code = MISSING_FOLDER_CASES[name]
    assert_refused(run(capsys, monkeypatch, tmp_path, *make(tmp_path)), says, code=code)


# --- the launcher's environment, on every command

ENVIRONMENTS = {
    "WORLD_SIZE=two": ({"WORLD_SIZE": "two"}, "WORLD_SIZE: got 'two'"),
    "WORLD_SIZE=0": ({"WORLD_SIZE": "0"}, "WORLD_SIZE: got '0'"),
    "RANK=-1": ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK: got '-1'"),
    "RANK=WORLD_SIZE": ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK: got 2 with WORLD_SIZE=2"),
    "LOCAL_RANK=x": ({"LOCAL_RANK": "x"}, "LOCAL_RANK: got 'x'"),
    "LOCAL_WORLD_SIZE=x": ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE: got 'x'"),
    "TORCHELASTIC_RESTART_COUNT=x": ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT: got 'x'"),
    "MASTER_PORT=99999": ({"MASTER_PORT": "99999"}, "MASTER_PORT: got '99999'"),
    "MASTER_ADDR=empty": ({"MASTER_ADDR": ""}, "MASTER_ADDR: got ''"),
}
EVERY_COMMAND = {"doctor": [], "profiles": ["--check"], "train": SMALL, "plan": SMALL, "tune": SMALL, "bench": SMALL,
                 "export": ["RUN", "--out", "OUT"], "plot": ["RUN"], "config-reference": []}


def env_cases():
    names = list(ENVIRONMENTS)
    # every variable on two commands in the default run, every command for each in the slow set
    out = []
    for i, name in enumerate(names):
        for j, command in enumerate(EVERY_COMMAND):
            marks = () if j in (i % len(EVERY_COMMAND), (i + 4) % len(EVERY_COMMAND)) else (pytest.mark.slow,)
            out.append(pytest.param(name, command, marks=marks, id=f"{command}-{name}"))
    return out


@pytest.mark.parametrize("name,command", env_cases())
def test_broken_launcher_variables(capsys, monkeypatch, tmp_path, name, command):
    env, says = ENVIRONMENTS[name]
    assert_refused(run(capsys, monkeypatch, tmp_path, command, *EVERY_COMMAND[command], env=env), says)


@pytest.mark.parametrize("argv,says", [(["--price", "T4=inf"], "--price: got inf for T4"),
                                       (["--price", "T4=nan"], "--price: got nan for T4"),
                                       (["--price", "T4=-1"], "--price: got -1 for T4"),
                                       (["--gpus", "0"], "--gpus: got '0'"), (["--gpus", "x,2"], "--gpus: got 'x'")])
def test_plan_comparison_options(capsys, monkeypatch, tmp_path, argv, says):
    """Options parsed by the planner's own readers (comma lists), refused before this machine is measured."""
    from launcher.measure import calibrate

    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda *a, **k: pytest.fail("measured before refusing"))
    assert_refused(run(capsys, monkeypatch, tmp_path, "plan", "--compare-gpus", *argv, *SMALL), says)


def test_trace_workers_variable(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VRAMFIT_TRACE_WORKERS", "x")
    assert_refused(run(capsys, monkeypatch, tmp_path, "plan", *SMALL), "VRAMFIT_TRACE_WORKERS: got 'x'")


# ------------------------------------------------------------------------------------------------
# The rows of issue 42's table, each a seed with the words it must end with


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, model_dir):
    """A finished 2-step LoRA run from the local tiny model: (output_dir, run_dir)."""
    from launcher.config.load import load_config
    from launcher.training.loop import train

    out = tmp_path_factory.mktemp("lora-run")
    s = train(load_config(None, [*SMALL, "data.vocab_size=32", f"model.name={model_dir}", "lora.r=4", "engine=amp",
                                 f"output_dir={out}", "run_name=lora", "log.report_to=[none]"]))
    assert s["status"] == "completed"
    return out, out / "lora"


def test_issue_42_seed_truncated_weights(capsys, monkeypatch, tmp_path, model_dir):
    """Row 1: a cut-short model.safetensors ended in SafetensorError after the run directory was made, and the rerun
    was refused. Now: refused before anything is written, as often as it is run."""
    m = copy_model(model_dir, tmp_path)
    _truncate(os.path.join(m, "model.safetensors"))
    for _ in range(2):
        assert_refused(run(capsys, monkeypatch, tmp_path, "train", *SMALL, "data.vocab_size=32", f"model.name={m}",
                           "run_name=same"), "model.safetensors is cut short", "fix: copy or download that file again")


def test_issue_42_seed_heads_disagree(capsys, monkeypatch, tmp_path, model_dir):
    """Row 2: config.json's heads disagree with the weights (num_attention_heads: the key/value projections change)."""
    m = copy_model(model_dir, tmp_path)
    _edit_json(os.path.join(m, "config.json"), num_attention_heads=8)
    for command in ("train", "plan"):
        assert_refused(run(capsys, monkeypatch, tmp_path, command, *SMALL, "data.vocab_size=32", f"model.name={m}"),
                       "differ in shape", "self_attn", "fix: restore config.json")


@pytest.mark.parametrize("override,shows", [("train.lr=nan", "'nan'"), ("train.lr=.inf", "inf")])
def test_issue_42_seed_lr_not_finite(capsys, monkeypatch, tmp_path, override, shows):
    """Rows 3 and 4: lr=nan reached torch's optimizer (a half-written run), lr=.inf trained into a NaN loss."""
    for command in ("train", "plan"):
        assert_refused(run(capsys, monkeypatch, tmp_path, command, *SMALL, override), f"train.lr: got {shows}",
                       "a finite number", "fix: train.lr=0.003")


@pytest.mark.parametrize("argv", [["memory.cpu_budget=nan"], ["--gpu", "T4", "memory.gpu_budget=nan"]])
def test_issue_42_seed_nan_budgets(capsys, monkeypatch, tmp_path, argv):
    """Row 5: 'cannot convert float NaN to integer' in the planner."""
    from launcher.measure import calibrate

    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda *a, **k: pytest.fail("measured before refusing"))
    key = argv[-1].split("=")[0]
    assert_refused(run(capsys, monkeypatch, tmp_path, "plan", *argv), f"{key}: got 'nan'", f"fix: {key}=auto")


@pytest.mark.parametrize("override", ["train.lr=nan", "lora.alpha=nan", "train.grad_clip=nan"])
def test_issue_42_seed_plan_accepted_nan(capsys, monkeypatch, tmp_path, override):
    """Row 6: plan accepted these with rc 0."""
    key = override.split("=")[0]
    assert_refused(run(capsys, monkeypatch, tmp_path, "plan", "lora.r=4", override), f"{key}: got 'nan'",
                   "a finite number")


@pytest.mark.parametrize("name", ["export-out", "bench-out", "tune-dir", "profiles-dir"])
def test_issue_42_seed_read_only_folders(capsys, monkeypatch, tmp_path, lora_run, name):
    """Row 7: PermissionError tracebacks (export --merge --out RO/merged, bench --out RO/x, tune --dir RO/x,
    profiles --dir RO/x)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    argv = {"export-out": ["export", lora_run[1], "--merge", "--out", ro / "merged"],
            "bench-out": ["bench", *SMALL, "--out", ro / "x"], "tune-dir": ["tune", *SMALL, "--dir", ro / "x"],
            "profiles-dir": ["profiles", "--dir", ro / "x"]}[name]
    flag = argv[-2]
    with read_only(monkeypatch, ro):
        assert_refused(run(capsys, monkeypatch, tmp_path, *argv), f"{flag}: got '{argv[-1]}'", "not writable",
                       f"fix: {flag} DIR")


@pytest.mark.parametrize("what", ["not-a-run", "missing"])
def test_issue_42_seed_plot_of_no_run(capsys, monkeypatch, tmp_path, what):
    """Row 8: FileNotFoundError: .../memory.csv."""
    d = tmp_path / "d"
    if what == "not-a-run":
        d.mkdir()
    assert_refused(run(capsys, monkeypatch, tmp_path, "plot", d), f"RUN_DIR: got '{d}'" if what == "missing"
                   else f"RUN_DIR: '{d}' has no memory.csv", "fix: vramfit plot runs/<run_name>")


def test_issue_42_seed_world_size_two(capsys, monkeypatch, tmp_path):
    """Row 9: through the console script's path (main() without argv), the launcher's variables were read again
    outside the handler: a traceback ending in EnvError. In this process, then in fresh interpreters (vramfit and
    launcher/run.py, which read them again the same way)."""
    from helpers import run_cli

    assert_refused(run(capsys, monkeypatch, tmp_path, "train", *SMALL, env={"WORLD_SIZE": "two"}, console=True),
                   "WORLD_SIZE: got 'two'", "rule: a whole number >= 1")
    before = snapshot(tmp_path)
    r = run_cli("train", *SMALL, env={"WORLD_SIZE": "two"}, cwd=tmp_path)
    refused(r.returncode, r.stderr, "WORLD_SIZE: got 'two'")
    # the launchers' entry (deepspeed/torchrun launcher/run.py) ends the same way
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_PORT")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launcher", "run.py"), *SMALL], capture_output=True,
                       text=True, env={**env, "WORLD_SIZE": "two"}, cwd=tmp_path, timeout=300)
    refused(r.returncode, r.stderr, "WORLD_SIZE: got 'two'")
    assert changes(before, snapshot(tmp_path)) == []


def test_issue_42_seed_plan_refuses_experts_on_a_dense_model(capsys, monkeypatch, tmp_path):
    """Row 10: plan gave a full plan, rc 0, where train refused the same overrides."""
    for command in ("plan", "train"):
        assert_refused(run(capsys, monkeypatch, tmp_path, command, *SMALL, "lora.r=4", "lora.experts=true"),
                       "lora.experts: got 'true'", "has no expert weights", "fix: lora.experts=auto")


def test_issue_42_seed_empty_yaml(capsys, monkeypatch, tmp_path):
    """Row 11: an empty file trained the built-in demo, rc 0, without a word; '{}' is how to ask for the defaults."""
    empty = _write(str(tmp_path / "empty.yaml"), "")
    assert_refused(run(capsys, monkeypatch, tmp_path, "train", empty), "empty (no keys)", "write `{}` for the defaults")
    braces = _write(str(tmp_path / "defaults.yaml"), "{}\n")
    rc, err = vramfit(capsys, monkeypatch, "plan", braces, cwd=tmp_path)
    assert rc == 0, err[-2000:]


@pytest.mark.parametrize("argv,says", [(["--steps", "0"], "argument --steps: got '0'"),
                                       (["--timeout", "-5"], "argument --timeout: got '-5'")])
def test_issue_42_seed_tune_arguments(capsys, monkeypatch, tmp_path, argv, says):
    """Row 12: accepted, then every setting 'ran' or 'exceeded the time limit'."""
    assert_refused(run(capsys, monkeypatch, tmp_path, "tune", *SMALL, *argv), says, "fix: " + argv[0])


def test_issue_42_seed_bench_candidates(capsys, monkeypatch, tmp_path):
    """Row 13: 197 s of hub look-ups, then every row 'unsupported'. Now refused before any run or lookup."""
    from launcher.measure import bench

    monkeypatch.setattr(bench, "run_one", lambda *a, **k: pytest.fail("a run before the candidates were checked"))
    monkeypatch.setattr(bench, "predict", lambda *a, **k: pytest.fail("a plan before the candidates were checked"))
    assert_refused(run(capsys, monkeypatch, tmp_path, "bench", *SMALL, "--find", "model", "--candidates", "abc,xyz"),
                   "--candidates: got abc, xyz", "hub ids are not searched", "fix: --candidates")


def test_issue_42_seed_override_after_an_option(capfd, monkeypatch, tmp_path):
    """Row 14: 'unrecognized arguments: lora.r=16' for an override after an option. Overrides now go anywhere; the
    literal row (llama-7b on a T4) is in the slow set, as it calibrates this machine first."""
    for argv in (["data.seq_len=64", "--json", "lora.r=16"], ["--json", "data.seq_len=64", "lora.r=16"],
                 ["data.seq_len=64", "lora.r=16", "--json"]):
        rc, err, out = vramfit(capfd, monkeypatch, "plan", *argv, cwd=tmp_path, out=True)
        assert rc == 0, err[-2000:]
        settings = json.loads(out)["settings"]
        assert (settings["lora_r"], settings["seq_len"]) == (16, 64)
    for argv in (["--json", "train.lr=nan"], ["data.seq_len=64", "--json", "train.lr=nan"]):
        assert_refused(run(capfd, monkeypatch, tmp_path, "plan", *argv), "train.lr: got 'nan'")


@pytest.mark.slow
def test_issue_42_seed_override_after_an_option_literal(tmp_path):
    from helpers import run_cli

    r = run_cli("plan", "model.name=llama-7b", "--gpu", "T4", "lora.r=16", "--json", cwd=tmp_path,
                env={"VRAMFIT_CALIBRATE_QUICK": "1"})
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert json.loads(r.stdout)["settings"]["lora_r"] == 16


def test_issue_42_seed_export_base_moved(capsys, monkeypatch, tmp_path, model_dir, lora_run):
    """Row 15: 'model.name: ... is not a directory; fix: check the path', a key export does not take. Now it names
    --base, and --base merges into the folder the weights moved to."""
    _out, run_dir = lora_run
    moved = tmp_path / "run"
    shutil.copytree(run_dir, moved)
    cfg = (moved / "config.yaml").read_text().replace(str(model_dir), str(tmp_path / "gone"))
    (moved / "config.yaml").write_text(cfg)
    _edit_json(moved / "final" / "adapter_config.json", base_model_name_or_path=str(tmp_path / "gone"))
    assert_refused(run(capsys, monkeypatch, tmp_path, "export", moved, "--merge", "--out", tmp_path / "merged"),
                   "is not a folder here", "fix: --base DIR")
    rc, err = vramfit(capsys, monkeypatch, "export", moved, "--merge", "--out", tmp_path / "merged", "--base", model_dir,
                      cwd=tmp_path)
    assert rc == 0 and (tmp_path / "merged" / "config.json").is_file(), err[-3000:]


def test_issue_42_seed_export_base_damaged(capsys, monkeypatch, tmp_path, model_dir, lora_run):
    """--base is checked as model.name is: a cut-short weights file is refused in export's words."""
    base = copy_model(model_dir, tmp_path)
    _truncate(os.path.join(base, "model.safetensors"))
    assert_refused(run(capsys, monkeypatch, tmp_path, "export", lora_run[1], "--merge", "--out", tmp_path / "merged",
                       "--base", base), "--base", "is cut short")


# ------------------------------------------------------------------------------------------------
# A start that fails before its first checkpoint: the next start takes the directory over


def test_a_failed_start_is_taken_over_by_the_next(tmp_path):
    from launcher.config.load import load_config
    from launcher.training.faults import Hooks
    from launcher.training.loop import train
    from launcher.training.rundir import failed_start

    cfg = load_config(None, [*SMALL, "train.max_steps=3", f"output_dir={tmp_path}", "run_name=r", "engine=amp",
                             "log.report_to=[none]"])

    def crash(step, _engine):
        raise RuntimeError("a crash before the first checkpoint")

    with pytest.raises(RuntimeError, match="before the first checkpoint"):
        train(cfg, hooks=Hooks(before_step=crash))
    run_dir = tmp_path / "r"
    left = sorted(os.listdir(run_dir))
    assert "config.yaml" in left and not os.listdir(run_dir / "checkpoints")
    s = train(cfg)
    assert s["status"] == "completed" and s["resumed_from"] is None
    assert sorted(os.listdir(run_dir / "failed-start-1")) == [n for n in left if n != "vramfit.lock"]
    assert (run_dir / "final").is_dir() and os.listdir(run_dir / "checkpoints")
    assert not failed_start(str(run_dir))  # a finished run is never taken over


# ------------------------------------------------------------------------------------------------
# The same refusals for a real user, in a fresh interpreter


@pytest.mark.parametrize("name", ["train-output-dir", "bench-out", "tune-dir", "profiles-dir", "export-out",
                                  "plot-run"])
def test_read_only_for_real(tmp_path, name):
    """In a fresh interpreter, with a folder the kernel itself refuses to write (helpers.hostile.really_read_only):
    the os.access check answers from the kernel, and a write that got past it would fail for real."""
    from helpers import run_cli

    (tmp_path / "ro").mkdir()
    make, says = RO[name]
    argv = make(tmp_path)
    with really_read_only(tmp_path / "ro"):
        before = snapshot(tmp_path)
        r = run_cli(*argv, cwd=tmp_path)
        refused(r.returncode, r.stderr, says, "not writable")
        assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.skipif(is_root(), reason="root reads every file: an unreadable CONFIG cannot be made for this user")
def test_unreadable_config_file(capsys, monkeypatch, tmp_path):
    c = _write(str(tmp_path / "c.yaml"), "seed: 1\n")
    os.chmod(c, 0)
    try:
        assert_refused(run(capsys, monkeypatch, tmp_path, "plan", c), "cannot be read", "Permission denied")
    finally:
        os.chmod(c, 0o644)
