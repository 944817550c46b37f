"""Fault injection, the way a hostile but realistic user meets vramfit: values that pass the schema but cannot
train, odd launcher variables, odd model directories, damaged checkpoints, a full disk (injected here; a real
one in test_faults_slow.py), a run directory already in use, a bench that would replace earlier results.

Every case runs the command line (``launcher.cli.main``, in this process to stay fast) and asserts: the exit
code; no traceback; the message names the value, the rule and the fix; no file outside the run directory;
nothing of a finished run changed; the newest checkpoint that loads is the one used.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import traceback
import zlib

import pytest
import torch

from launcher import cli
from launcher.machine import dist

RUN = ["train.warmup_steps=1", "train.micro_batch_size=8", "train.global_batch_size=8", "data.seq_len=32",
       "data.num_samples=256", "sample_tokens=0", "log.every_steps=1000", "engine=amp", "device=cpu",
       "log.memory_interval_s=0.1"]
FINISHED = [*RUN, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=3"]


# ------------------------------------------------------------------------------------------------
# The harness


def vramfit(capsys, monkeypatch, *argv, env=None, cwd=None):
    """``vramfit ARGV`` in this process with launcher variables ``env`` (others unset): (exit code, stderr).
    An exception that escapes ``main`` is what a user would see as a traceback: it is returned in stderr."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    if cwd:
        monkeypatch.chdir(cwd)
    dist.current.cache_clear()
    capsys.readouterr()
    tb = ""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    except BaseException:  # noqa: BLE001 -- anything escaping main is a traceback to the user
        rc, tb = None, traceback.format_exc()
    finally:
        dist.current.cache_clear()
    return rc, capsys.readouterr().err + tb


def snapshot(root) -> dict:
    """{relative path: (size, CRC-32)} of every file and {path/: None} of every directory under ``root``."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root) + "/"] = None
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (os.path.getsize(p), zlib.crc32(fh.read()))
    return out


def changes(before: dict, after: dict) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k, "absent") != after.get(k, "absent"))


def only_inside(before: dict, after: dict, run: str) -> None:
    """Every change under the test's directory is inside the run directory ``run`` (relative)."""
    made_for_it = {run[:i + 1] for i, ch in enumerate(run) if ch == "/"}  # output_dir made for the run
    outside = [c for c in changes(before, after) if not (c.startswith(run + "/") or c == run + "/"
                                                         or (c in made_for_it and after.get(c, 0) is None))]
    assert not outside, f"written outside the run directory: {outside}"


def refused(rc, err, *names, code=2) -> None:
    """Exit ``code``, no traceback, and one message line that names the value, the rule and the fix."""
    assert rc == code, f"exit code {rc}, wanted {code}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if "rule:" in ln and "fix:" in ln]
    assert lines, f"no line with rule and fix:\n{err[-3000:]}"
    for n in names:
        assert any(n in ln for ln in lines), f"{n!r} not named in:\n" + "\n".join(lines)


def disk_full(err: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert "disk full" in err and re.search(r"\d+\.\d (MiB|KiB)", err) and "fix:" in err, err[-3000:]


def metrics(run_dir) -> list[dict]:
    return [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed run (6 steps, checkpoints at 2, 4, 6, final/) that each test copies."""
    from launcher.config.load import load_config
    from launcher.training.loop import train

    root = tmp_path_factory.mktemp("finished")
    s = train(load_config(None, [*FINISHED, f"output_dir={root}", "run_name=done"]))
    assert s["status"] == "completed"
    return root / "done"


@pytest.fixture
def done(finished_run, tmp_path):
    """A fresh copy of the finished run in this test's directory: (output_dir, run_dir, snapshot before)."""
    out = tmp_path / "out"
    shutil.copytree(finished_run, out / "done")
    return out, out / "done", snapshot(tmp_path)


def ckpt(run_dir, step) -> str:
    return str(run_dir / "checkpoints" / f"step-{step:06d}")


# ------------------------------------------------------------------------------------------------
# Values that pass the schema but cannot train: refused by plan and train alike, before anything is written

CANNOT_TRAIN = [
    (["train.beta2=1.0"], ["train.beta2: got 1.0", "must be < 1.0", "fix: train.beta2=0.95"]),
    (["train.beta1=1"], ["train.beta1: got 1.0", "fix: train.beta1=0.9"]),
    (["train.eps=0"], ["train.eps: got 0.0", "must be > 0.0", "fix: train.eps=1e-08"]),
    (["train.lr=0"], ["train.lr: got 0.0", "fix: train.lr=0.003"]),
    (["lora.r=8", "lora.alpha=0"], ["lora.alpha: got 0 with lora.r=8", "fix: lora.alpha=16"]),
    (["lora.r=8", "lora.dropout=1.0"], ["lora.dropout: got 1.0", "fix: lora.dropout=0.0"]),
    (["loss_scale.min_scale=0"], ["loss_scale.min_scale: got 0.0", "fix: loss_scale.min_scale=1.0"]),
    (["loss_scale.min_scale=1000", "loss_scale.initial_power=4"], ["loss_scale.min_scale: got 1000", "2**4"]),
    (["train.lr=0.01", "train.weight_decay=100"], ["train.weight_decay: got 100 with train.lr=0.01"]),
    (["data.seq_len=4096"], ["data.seq_len: got 4096", "maximum of 1024", "fix: data.seq_len=1024"]),
]


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("overrides,names", CANNOT_TRAIN, ids=[c[0][-1] for c in CANNOT_TRAIN])
def test_values_that_cannot_train_are_refused_by_plan_and_train(capsys, monkeypatch, tmp_path, command, overrides,
                                                                 names):
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, command, *RUN, "train.max_steps=2", *overrides,
                      f"output_dir={tmp_path}/runs", "run_name=x", cwd=tmp_path)
    refused(rc, err, *names)
    assert snapshot(tmp_path) == before


def test_every_wrong_name_at_once(capsys, monkeypatch, tmp_path):
    """Enums and the profile name in one message (the profile used to wait until the others were fixed)."""
    rc, err = vramfit(capsys, monkeypatch, "train", "precision=fp8", "engine=foo", "profile=zero9", "log.level=loud",
                      "train.optimizer=sgd", cwd=tmp_path)
    refused(rc, err, "precision: got 'fp8'", "engine: got 'foo'", "profile: got 'zero9'", "log.level: got 'loud'",
            "train.optimizer: got 'sgd'")
    assert "5 problems" in err


@pytest.mark.parametrize("name,fix", [("../x", "run_name=x"), ("a/b", "run_name=a-b"), ("..", "run_name=run"),
                                      ("/tmp/elsewhere", "run_name=tmp-elsewhere")])
def test_run_name_is_one_directory_name(capsys, monkeypatch, tmp_path, name, fix):
    (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=2", f"output_dir={tmp_path}/out",
                      f"run_name={name}", cwd=tmp_path / "out")
    refused(rc, err, f"run_name: got {name!r}", fix)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_output_dir_must_be_a_directory(capsys, monkeypatch, tmp_path, command, where):
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    out = f if where == "file" else f / "runs"
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, command, *RUN, "train.max_steps=2", f"output_dir={out}", cwd=tmp_path)
    refused(rc, err, f"output_dir: got {str(out)!r}")
    assert "planned" not in err and snapshot(tmp_path) == before  # refused before planning


# ------------------------------------------------------------------------------------------------
# Launcher variables

ENVIRONMENTS = [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE: got 'abc'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE: got '0'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK: got 2 with WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2"}, "RANK: not set with WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK: got '-1'"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK: got 'x'"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK: got 1 with RANK=0"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT: got '99999'"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT: got 'http'"),
]


@pytest.mark.parametrize("env,name", ENVIRONMENTS, ids=[n.split(":")[0] + "-" + "-".join(e.values()) for e, n in
                                                        ENVIRONMENTS])
def test_launcher_variables_are_checked(capsys, monkeypatch, tmp_path, env, name):
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=2", f"output_dir={tmp_path}/out",
                      "run_name=x", env=env, cwd=tmp_path)
    refused(rc, err, name)
    assert "launcher environment" in err and snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------------
# Model directories


def _tiny_dir(path, weights=True):
    from launcher.model.presets import preset_config

    cfg = preset_config("tiny")
    if weights:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    return path


@pytest.mark.parametrize("case", ["no-config", "config-below", "not-json", "no-model-type", "no-weights",
                                  "missing-shard", "rejected-by-transformers", "negative-size"])
def test_odd_model_directories(capsys, monkeypatch, tmp_path, case):
    model = tmp_path / "model"
    model.mkdir()
    names = []
    if case == "no-config":
        (model / "README.md").write_text("weights coming\n")
        names = ["is a directory without config.json", "fix: model.name=DIR"]
    elif case == "config-below":
        _tiny_dir(model / "snapshots" / "abc123", weights=False)
        names = ["without config.json", f"fix: model.name={model}/snapshots/abc123"]
    elif case == "not-json":
        (model / "config.json").write_text('{"model_type": "llama",')
        names = ["config.json is not valid JSON"]
    elif case == "no-model-type":
        (model / "config.json").write_text('{"hidden_size": 64}')
        names = ['has no "model_type"']
    elif case == "no-weights":
        _tiny_dir(model, weights=False)
        names = ["has a config.json but no weights"]
    elif case in ("rejected-by-transformers", "negative-size"):  # values a hand-edited config.json may hold
        _tiny_dir(model)
        doc = json.load(open(model / "config.json"))
        heads = doc["num_attention_heads"]
        doc["hidden_size"] = -5 if case == "rejected-by-transformers" else -2 * heads  # -5: the heads do not divide
        (model / "config.json").write_text(json.dumps(doc))
        names = (["config.json is rejected by transformers", "The hidden size (-5)", "fix: correct that value"]
                 if case == "rejected-by-transformers" else [f"has hidden_size={-2 * heads}", "fix: correct hidden_size"])
    else:
        _tiny_dir(model, weights=False)
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
        (model / "model-00001-of-00002.safetensors").write_bytes(b"x")
        names = ["lacks 1 of the 2 weight shards", "model-00002-of-00002.safetensors"]
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=2", f"model.name={model}",
                      f"output_dir={tmp_path}/out", "run_name=x", cwd=tmp_path)
    refused(rc, err, "model.name", *names)
    assert snapshot(tmp_path) == before  # no run directory made
    if case in ("rejected-by-transformers", "negative-size"):  # the planner reads the config the same way
        rc, err = vramfit(capsys, monkeypatch, "plan", f"model.name={model}", cwd=tmp_path)
        refused(rc, err, "model.name", *names)
        assert snapshot(tmp_path) == before


def test_tune_refuses_an_out_file_it_could_not_write_before_measuring(capsys, monkeypatch, tmp_path):
    """``tune --out`` in a folder that does not exist (or naming a folder) is refused before the measurements,
    which take minutes and would end in a traceback when the file is written; nothing is written."""
    from launcher.measure import calibrate

    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda *a, **k: pytest.fail("measured before refusing"))
    (tmp_path / "a-folder").mkdir()
    before = snapshot(tmp_path)
    for out, names in ((tmp_path / "missing" / "t.yaml", [f"mkdir -p {tmp_path / 'missing'}", "--out t.yaml"]),
                       (tmp_path / "a-folder", ["which is a folder", f"--out {tmp_path / 'a-folder' / 'tuned.yaml'}"])):
        rc, err = vramfit(capsys, monkeypatch, "tune", *RUN, "--out", out, "--dir", tmp_path / "tune-out", cwd=tmp_path)
        refused(rc, err, "--out", *names)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------------
# Damaged checkpoints: the newest one that loads is used; a finished run is never rewritten by a refusal


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _flip_byte(path):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))


DAMAGE = {"truncated": lambda c: _truncate(os.path.join(c, "engine.pt")),
          "deleted": lambda c: os.remove(os.path.join(c, "engine.pt")),
          "one-byte-changed": lambda c: _flip_byte(os.path.join(c, "engine.pt")),
          "marker-garbage": lambda c: open(os.path.join(c, "vramfit.json"), "w").write("{\"step\": 6, \"fil")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(capsys, monkeypatch, tmp_path, done, damage):
    """Resume a finished 6-step run to 7 steps with step 6 damaged: step 4 is used, the damaged one is kept
    aside, metrics.jsonl and memory.csv go on from what they held (their earlier lines unchanged)."""
    out, run, _ = done
    DAMAGE[damage](ckpt(run, 6))
    old_metrics = open(run / "metrics.jsonl").read().splitlines(keepends=True)
    old_memory = open(run / "memory.csv").read()
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=7", "checkpoint.every_steps=2",
                      "checkpoint.keep_last=3", f"output_dir={out}", "run_name=done", cwd=tmp_path)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "step-000006 is damaged" in err and "using " + ckpt(run, 4) in err
    s = json.load(open(run / "summary.json"))
    assert s["status"] == "completed" and s["resumed_from"] == ckpt(run, 4) and s["steps"] == 7
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000004", "step-000006", "step-000006.damaged",
                                                       "step-000007"]
    new_metrics = open(run / "metrics.jsonl").read().splitlines(keepends=True)
    assert new_metrics[:4] == old_metrics[:4] and [json.loads(x)["step"] for x in new_metrics] == list(range(1, 8))
    memory = open(run / "memory.csv").read()
    assert memory.startswith(old_memory) and len(memory) > len(old_memory)
    times = [float(ln.split(",")[0]) for ln in memory.splitlines()[1:]]
    assert times == sorted(times)  # the timeline goes on, it does not start again at 0
    only_inside(before, snapshot(tmp_path), "out/done")
    assert not (run / "vramfit.lock").exists()


@pytest.mark.parametrize("case", ["all-damaged", "already-completed", "completed-newest-damaged",
                                  "completed-explicit-checkpoint", "settings-changed", "resume-never", "resume-final",
                                  "resume-damaged-path", "checked-but-unloadable"])
def test_refused_resumes_change_nothing(capsys, monkeypatch, tmp_path, done, case):
    out, run, _ = done
    steps, extra, names = 8, [], []
    if case == "all-damaged":
        for s in (2, 4, 6):
            _truncate(os.path.join(ckpt(run, s), "engine.pt"))
        names = ["whose checkpoints are all damaged", "fix: choose another run_name"]
    elif case == "already-completed":
        steps, names = 6, ["already completed 6 steps", "fix: another run_name, or train.max_steps > 6"]
    elif case == "completed-newest-damaged":  # step 4 loads, but the run finished 6 steps: not redone
        os.remove(os.path.join(ckpt(run, 6), "engine.pt"))
        steps, names = 6, ["already completed 6 steps"]
    elif case == "completed-explicit-checkpoint":
        steps, extra, names = 6, [f"checkpoint.resume={ckpt(run, 6)}"], ["already completed 6 steps"]
    elif case == "settings-changed":
        extra, names = ["data.seq_len=64"], ["data.seq_len: checkpoint has 32, now 64"]
    elif case == "resume-never":
        extra, names = ["checkpoint.resume=never"], ["already holds a run", "fix: choose another run_name"]
    elif case == "resume-final":
        extra = [f"checkpoint.resume={run / 'final'}"]
        names = ["cannot be resumed from: no vramfit.json marker", f"fix: checkpoint.resume={ckpt(run, 6)}"]
    elif case == "resume-damaged-path":
        _truncate(os.path.join(ckpt(run, 6), "engine.pt"))
        extra = [f"checkpoint.resume={ckpt(run, 6)}"]
        names = ["engine.pt has", f"fix: checkpoint.resume={ckpt(run, 4)}"]
    else:  # files as the marker says, but not what the engine wrote: a loader's error, reported, nothing changed
        from launcher.training import checkpoint

        c = ckpt(run, 6)
        torch.save({"something": "else"}, os.path.join(c, "engine.pt"))
        if hasattr(checkpoint, "manifest"):  # (checkpoints without checksums have nothing to update)
            marker = checkpoint.read_marker(c)
            marker["files"] = checkpoint.manifest(c)
            json.dump(marker, open(os.path.join(c, "vramfit.json"), "w"))
        names = ["matches its recorded sizes and checksums but does not load", f"fix: checkpoint.resume={ckpt(run, 4)}"]
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, f"train.max_steps={steps}", "checkpoint.every_steps=2",
                      "checkpoint.keep_last=3", *extra, f"output_dir={out}", "run_name=done", cwd=tmp_path)
    refused(rc, err, *names)
    assert changes(before, snapshot(tmp_path)) == []


def test_resume_from_final_into_a_new_run_leaves_nothing_behind(capsys, monkeypatch, tmp_path, done):
    out, run, before = done
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=8", f"checkpoint.resume={run}/final",
                      f"output_dir={out}", "run_name=new", cwd=tmp_path)
    refused(rc, err, "checkpoint.resume", f"fix: checkpoint.resume={ckpt(run, 6)}")
    assert changes(before, snapshot(tmp_path)) == []  # no empty run directory, no empty checkpoints/


def test_torn_metrics_line_is_dropped_on_resume(capsys, monkeypatch, tmp_path, done):
    """A kill or a full disk in the middle of a metrics line: the resume keeps the whole lines only."""
    out, run, _ = done
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "loss": 4.')
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=7", "checkpoint.keep_last=3",
                      f"output_dir={out}", "run_name=done", cwd=tmp_path)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, 8))


# ------------------------------------------------------------------------------------------------
# One process per run directory


def test_run_directory_in_use_is_refused(capsys, monkeypatch, tmp_path, done):
    """Another process holds the lock (here: this test, as a live process elsewhere would)."""
    out, run, _ = done
    lock = run / "vramfit.lock"
    lock.write_text(json.dumps({"pid": 4242, "host": "gpu-box-7", "started": "2026-01-01 00:00:00"}))
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        before = snapshot(tmp_path)
        rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=8", "checkpoint.keep_last=3",
                          f"output_dir={out}", "run_name=done", cwd=tmp_path)
        refused(rc, err, "is in use by pid 4242 on host gpu-box-7", "kill -TERM 4242")
        assert changes(before, snapshot(tmp_path)) == []
    finally:
        os.close(fd)


def test_stale_lock_of_a_dead_process_is_taken_over(capsys, monkeypatch, tmp_path, done):
    out, run, _ = done
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "vramfit.lock").write_text(json.dumps({"pid": dead.pid, "host": "here", "started": "earlier"}))
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=7", "checkpoint.keep_last=3",
                      f"output_dir={out}", "run_name=done", cwd=tmp_path)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert f"taking over the lock of pid {dead.pid}" in err
    assert not (run / "vramfit.lock").exists()


# ------------------------------------------------------------------------------------------------
# A full disk, injected (the real thing on a tmpfs: test_faults_slow.py)


def enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("at", ["first-checkpoint", "second-checkpoint", "final", "metrics", "summary",
                                "pre-check"])
def test_disk_full(capsys, monkeypatch, tmp_path, at):
    """The run ends 'failed' (exit 1) with a message in MiB, a summary and the last good checkpoint; no
    partial file stays behind; nothing is written outside the run directory. A checkpoint on the way
    (first-checkpoint: step 2 of 4) is skipped with a warning instead, and the run completes."""
    import launcher.training.loop as train_mod
    from launcher.engines import amp
    from launcher.training import rundir
    from launcher.training.faults import Hooks

    saves = []

    def during_save(tmp):
        saves.append(tmp)
        with open(os.path.join(tmp, "partial.bin"), "wb") as fh:
            fh.write(b"\0" * 300_000)
        if (at == "first-checkpoint" and len(saves) == 1) or (at == "second-checkpoint" and len(saves) == 2):
            enospc()

    monkeypatch.setattr(train_mod, "Hooks", lambda: Hooks(during_save=during_save))
    if at == "final":
        def save_final(model, directory, **kw):  # as save_pretrained does: makes the directory, then fails
            os.makedirs(directory, exist_ok=True)
            open(os.path.join(directory, "model.safetensors"), "wb").write(b"\0" * 1000)
            enospc()
        monkeypatch.setattr(amp, "save_final", save_final)
    if at == "metrics":
        real = rundir.RunDir.append_metrics
        monkeypatch.setattr(rundir.RunDir, "append_metrics",
                            lambda self, row: enospc() if row["step"] == 3 else real(self, row))
    if at == "summary":
        real_write = rundir.write_atomic

        def write_atomic(path, text):  # the real write, with the disk full for summary.json only
            with monkeypatch.context() as m:
                if path.endswith("summary.json"):
                    m.setattr(rundir.os, "fsync", enospc)
                real_write(path, text)
        monkeypatch.setattr(rundir, "write_atomic", write_atomic)
    if at == "pre-check":  # after the first checkpoint the disk reports 3 MiB free: less than one checkpoint
        real_usage = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=3 * 2**20) if saves
                            else real_usage(p))
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "train", *RUN, "train.max_steps=4", "checkpoint.every_steps=2",
                      f"output_dir={tmp_path}/out", "run_name=full", cwd=tmp_path)
    if at == "first-checkpoint":  # a checkpoint on the way: skipped, the run goes on to its last one
        assert rc == 0, err[-3000:]
        assert "checkpoint at step 2 skipped: disk full" in err and "the run goes on" in err
        run = tmp_path / "out" / "full"
        assert sorted(os.listdir(run / "checkpoints")) == ["step-000004"]
        assert json.load(open(run / "summary.json"))["status"] == "completed" and (run / "final").is_dir()
        return
    assert rc == 1, err[-3000:]
    disk_full(err)
    run = tmp_path / "out" / "full"
    only_inside(before, snapshot(tmp_path), "out/full")
    left = [p for p in snapshot(run) if ".tmp" in p or ".old" in p or "vramfit.lock" in p]
    assert not left, left
    complete = sorted(os.listdir(run / "checkpoints"))
    want = {"second-checkpoint": ["step-000002"], "final": ["step-000002", "step-000004"],
            "metrics": ["step-000002"], "summary": ["step-000002", "step-000004"], "pre-check": ["step-000002"]}[at]
    assert complete == want
    if at == "summary":
        assert "summary.json not written" in err
        return
    s = json.load(open(run / "summary.json"))
    assert s["status"] == "failed" and "disk full" in s["diagnosis"]
    assert s["checkpoint"] == (os.path.join(run, "checkpoints", want[-1]) if want else None)
    assert not (run / "final").exists()
    if at == "pre-check":
        assert "would not fit" in s["diagnosis"] and "3.0 MiB are free" in s["diagnosis"]


def test_write_atomic_leaves_no_partial_file_on_a_full_disk(tmp_path, monkeypatch):
    from launcher.machine import files

    (tmp_path / "summary.json").write_text('{"status": "completed"}\n')
    monkeypatch.setattr(files.os, "fsync", enospc)
    with pytest.raises(files.DiskFull, match=r"disk full: writing summary.json .*KiB"):
        files.write_atomic(str(tmp_path / "summary.json"), "x" * 5000)
    assert os.listdir(tmp_path) == ["summary.json"]
    assert (tmp_path / "summary.json").read_text() == '{"status": "completed"}\n'


# ------------------------------------------------------------------------------------------------
# bench --out


@pytest.mark.parametrize("what", ["earlier-results", "a-file"])
def test_bench_never_replaces_earlier_results(capsys, monkeypatch, tmp_path, what):
    out = tmp_path / "bench-out"
    if what == "a-file":
        out.write_text("not a directory\n")
    else:
        out.mkdir()
        (out / "results.json").write_text(json.dumps({"results": [], "settings": {"started": "2026-01-02 03:04:05"}}))
        (out / "results.md").write_text("| profile |\n")
    before = snapshot(tmp_path)
    rc, err = vramfit(capsys, monkeypatch, "bench", *RUN, "--profiles", "amp-fp32", "--out", out, cwd=tmp_path)
    refused(rc, err, "--out", f"fix: --out {out}-2")
    if what == "earlier-results":
        assert "started 2026-01-02 03:04:05" in err
    assert snapshot(tmp_path) == before
