"""The planner's traces kept on disk (launcher/plan/tracestore.py): read back equal, never trusted when damaged or
made by other code, a second `vramfit plan` of the same model traces nothing, and a plan process leaves out
what it does not use."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

import pytest
import torch
from transformers import LlamaConfig

from helpers import run_cli
from launcher.plan import tracestore
from launcher.plan.memory import estimate, trace
from launcher.plan.memory.estimate import trace_at
from launcher.plan.memory.trace import TraceSettings

CFG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
S = TraceSettings(batch_size=2, seq_len=16, target="cpu", gradient_checkpointing=True, lora_r=4,
                  autocast_dtype=torch.bfloat16)


def differences(a, b) -> list:
    """The fields in which two traces differ, but the time each took: where an op record parts, the ops there."""
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "seconds" or x == y:
            continue
        if f.name == "op_list":
            i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            out.append(f"op_list: {len(x)} and {len(y)} ops, first apart at {i}: {x[i:i + 3]} against {y[i:i + 3]}")
        elif f.name == "ops":
            out.append(f"ops: {({k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)})}")
        else:
            out.append(f"{f.name}: {x} against {y}")
    return out


def fresh(store):
    estimate._TRACES.clear()
    trace._META_MODELS.clear()  # each trace on a model built for it, as in a new process
    estimate.set_store(store)


def test_a_kept_trace_reads_back_equal(tmp_path):
    store = tracestore.TraceStore(str(tmp_path))
    try:
        fresh(store)
        made = trace_at(CFG, 2, S)
        assert store.writes == 1 and len(os.listdir(tmp_path)) == 1
        again = tracestore.TraceStore(str(tmp_path))
        fresh(again)
        kept = trace_at(CFG, 2, S)
        assert again.hits == 1 and again.writes == 0
        assert kept is not made and kept == made  # every field, the op list and its counts included
        assert kept.peak == made.peak and kept.op_list[0] == made.op_list[0] and isinstance(kept.op_list[0], tuple)
    finally:
        fresh(None)


def read_back(directory):
    """A new store on ``directory`` and what the trace of ``(CFG, 2, S)`` is through it, as a new process sees it."""
    store = tracestore.TraceStore(str(directory))
    fresh(store)
    return store, trace_at(CFG, 2, S)


def test_damaged_or_foreign_files_are_traced_again(tmp_path):
    """What the store promises, and only that: a damaged file is traced again and rewritten, and the new file reads
    back as what was traced. (Two traces of one setting made apart are not compared here: the planner's traces
    are the same each time, which tests/test_trace_cache.py checks.)"""
    try:
        first, _ = read_back(tmp_path)
        assert first.hits == 0 and first.writes == 1
        (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
        path.write_bytes(path.read_bytes()[:40])  # truncated
        again, retraced = read_back(tmp_path)
        assert again.hits == 0 and again.writes == 1 and retraced.peak > 0  # traced, rewritten
        third, kept = read_back(tmp_path)
        assert third.hits == 1 and kept == retraced, differences(kept, retraced)
        with gzip.open(path, "rt") as fh:
            assert '"key"' in fh.read(200)
        body = bytearray(path.read_bytes())
        body[10] ^= 0xFF  # the first deflate block header, after the 10-byte gzip header: zlib.error, not OSError
        path.write_bytes(bytes(body))
        flipped, traced = read_back(tmp_path)
        assert flipped.hits == 0 and flipped.writes == 1 and traced.peak > 0
        fourth, kept = read_back(tmp_path)
        assert fourth.hits == 1 and kept == traced, differences(kept, traced)
        other = tracestore.TraceStore(str(tmp_path))
        other.version = "another vramfit"  # its file names differ, and a file of the same name is not trusted
        fresh(other)
        trace_at(CFG, 2, S)
        assert other.hits == 0 and len(os.listdir(tmp_path)) == 2
    finally:
        fresh(None)


def test_unwritable_cache_never_stops_a_plan(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = tracestore.TraceStore(str(blocker / "traces"))
    try:
        fresh(store)
        assert trace_at(CFG, 2, S).peak > 0 and store.writes == 0
    finally:
        fresh(None)


@pytest.mark.slow  # three CLI plans
def test_second_plan_traces_nothing(tmp_path):
    env = {"VRAMFIT_CACHE": str(tmp_path / "cache")}
    args = ("plan", "model.name=tiny", "device=cpu", "data.seq_len=64", "--json")
    first = run_cli(*args, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    folder = tmp_path / "cache" / "traces"
    files = {n: os.stat(folder / n).st_mtime_ns for n in os.listdir(folder)}
    assert files
    second = run_cli(*args, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["chosen"] == b["chosen"]
    assert [(r["profile"], r["gpu_bytes"], r["cpu_bytes"]) for r in a["profiles"]] == [
        (r["profile"], r["gpu_bytes"], r["cpu_bytes"]) for r in b["profiles"]]
    assert {n: os.stat(folder / n).st_mtime_ns for n in os.listdir(folder)} == files  # read, not rewritten
    off = run_cli(*args, env={**env, "VRAMFIT_CACHE": str(tmp_path / "off"), "VRAMFIT_TRACE_CACHE": "off"})
    assert off.returncode == 0 and not (tmp_path / "off" / "traces").exists()


def test_a_kept_plan_builds_no_model(tmp_path, monkeypatch):
    """The parameter counts and the chunked-loss check are kept with the traces: in a later process, a plan whose
    traces are all kept builds no meta model (a second and more with the import of its modeling code), and gets
    the same numbers; a kept value that does not read back is made again."""
    from launcher.plan import runshape
    from launcher.plan.memory import shape

    def new_process(store):
        shape._COUNT_CACHE.clear()
        runshape._HEAD_PROBLEMS.clear()
        shape.set_store(store)

    try:
        store = tracestore.TraceStore(str(tmp_path))
        new_process(store)
        counts = shape.count_params(CFG, 4, ("q_proj", "v_proj"))
        problem = runshape._head_problem(CFG, False)
        assert store.writes == 2
        new_process(tracestore.TraceStore(str(tmp_path)))
        with monkeypatch.context() as m:
            m.setattr(shape, "build_meta_model", lambda *a, **k: pytest.fail("a meta model was built"))
            assert shape.count_params(CFG, 4, ("q_proj", "v_proj")) == counts
            assert runshape._head_problem(CFG, False) == problem
        for path in tmp_path.iterdir():  # another layout (an older vramfit's, a damaged write): made again
            d = json.loads(gzip.decompress(path.read_bytes()))
            d["value"] = {"unknown": 1}
            path.write_bytes(gzip.compress(json.dumps(d).encode()))
        new_process(tracestore.TraceStore(str(tmp_path)))
        assert shape.count_params(CFG, 4, ("q_proj", "v_proj")) == counts
        assert shape.count_params(CFG, 0) != counts  # another key, another value
    finally:
        new_process(None)


@pytest.mark.slow
@pytest.mark.extended  # two fresh interpreters: by hand (CI's time box)
def test_a_plan_process_does_not_import_bitsandbytes(tmp_path):
    """``vramfit plan`` started as a process hides bitsandbytes from peft (a plan never uses it, and peft imports
    it eagerly); the QLoRA plan is the one a process with bitsandbytes imported makes. ``main`` called with
    arguments (code that may go on to train) leaves it alone."""
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")  # the quant extra, which scripts/setup.sh installs
    args = ["plan", "model.name=tiny", "device=cpu", "data.seq_len=64", "lora.r=4", "model.quantize=4bit", "--json"]
    code = ("import sys\nfrom launcher.cli import main\n{call}\n"
            "print('BNB', sys.modules.get('bitsandbytes') is not None)")
    out = {}
    for name, call in (("process", f"sys.argv = ['vramfit', *{args!r}]; main()"), ("called", f"main({args!r})")):
        env = {**os.environ, "VRAMFIT_CACHE": str(tmp_path / name), "PYTHONPATH": os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))}
        p = subprocess.run([sys.executable, "-c", code.format(call=call)], capture_output=True, text=True, env=env,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        *plan, flag = p.stdout.strip().splitlines()
        out[name] = (json.loads("\n".join(plan)), flag)
    assert out["process"][1] == "BNB False" and out["called"][1] == "BNB True"
    a, b = out["process"][0], out["called"][0]
    assert a["chosen"] == b["chosen"] and a["profiles"] == b["profiles"]
