"""What users already have: a DeepSpeed that is installed but broken, machine-readable output that tools
parse, a short smoke run with the defaults, and a launcher that starts several ranks."""

import json
import os

import pytest

from helpers import FAST, needs_deepspeed, run_cli

SHORT = [a for a in FAST if not a.startswith(("train.max_steps", "train.warmup_steps"))]


@pytest.fixture
def broken_deepspeed(tmp_path):
    """A ``deepspeed`` package first on the path whose import raises ImportError, as on a VPS whose CUDA does
    not match the wheel. Returns the environment for run_cli."""
    pkg = tmp_path / "broken" / "deepspeed"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('raise ImportError("libcudart.so.12: cannot open shared object file")\n')
    return {"PYTHONPATH": str(tmp_path / "broken") + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("engine", ["auto", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_broken_deepspeed_is_absent_deepspeed(tmp_path, broken_deepspeed, engine):
    """engine=auto trains on AMP and engine=fsdp on FSDP; saving final/ (transformers unwraps the model through
    accelerate, which imports deepspeed whenever it is found) must not touch the broken install."""
    args = ["train", *SHORT, "train.max_steps=3", f"output_dir={tmp_path}", "run_name=r", f"engine={engine}"]
    if engine == "fsdp":
        args.append("precision=bf16")
    r = run_cli(*args, env=broken_deepspeed)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    s = json.load(open(tmp_path / "r" / "summary.json"))
    assert s["status"] == "completed" and s["engine"] == ("amp" if engine == "auto" else "fsdp")
    assert os.path.isfile(tmp_path / "r" / "final" / "config.json")
    if engine == "auto":
        why = [x for x in s["reasons"] if "not DeepSpeed" in x]
        assert why and "failed to import (ImportError: libcudart.so.12" in why[0], s["reasons"]


def test_broken_deepspeed_plan_and_doctor(broken_deepspeed):
    r = run_cli("plan", "--json", env=broken_deepspeed)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["chosen"] == "amp-fp32"
    ds_rows = [p for p in plan["profiles"] if p["engine"] == "deepspeed"]
    assert ds_rows and all("failed to import" in p["why_not"] for p in ds_rows)
    r = run_cli("doctor", env=broken_deepspeed)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "deepspeed: not usable: DeepSpeed failed to import (ImportError: libcudart.so.12" in r.stdout


@needs_deepspeed
@pytest.mark.parametrize("command", [["plan", "--json"], ["doctor", "--json"]])
def test_json_commands_print_json_alone(command):
    """With DeepSpeed installed (its accelerator warning goes to stdout), stdout is one JSON document."""
    r = run_cli(*command)
    assert r.returncode == 0, r.stderr[-2000:]
    json.loads(r.stdout)  # raises on anything before or after the document


@pytest.mark.slow
def test_a_short_run_works_with_the_default_warmup(tmp_path):
    """train.max_steps=8 alone: the warmup follows the run's length (auto = 10% of it)."""
    r = run_cli("train", "train.max_steps=8", "engine=amp", f"output_dir={tmp_path}", "run_name=s", "sample_tokens=0",
                "data.num_samples=64", "data.seq_len=32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warmup_steps: 0" in open(tmp_path / "s" / "config.yaml").read()


def test_an_explicit_warmup_longer_than_the_run_is_an_error():
    r = run_cli("train", "train.max_steps=8", "train.warmup_steps=20")
    assert r.returncode == 2
    assert "train.warmup_steps: got 20 > train.max_steps=8" in r.stderr and "fix: train.warmup_steps=0" in r.stderr


def test_configuration_errors_are_printed_by_rank_0_only():
    """Under torchrun every rank finds the same problem; one copy is printed, every rank exits 2."""
    for rank, printed in (("0", True), ("1", False)):
        r = run_cli("train", "train.lr=fast", env={"RANK": rank, "WORLD_SIZE": "2"})
        assert r.returncode == 2
        assert ("train.lr: got 'fast'" in r.stderr) is printed, r.stderr


def test_an_engine_without_that_precision_says_so():
    r = run_cli("train", "engine=fsdp", "precision=fp32")
    assert r.returncode == 2
    assert "engine fsdp has no fp32 profile (its profiles: fsdp-fp16-offload, fsdp-bf16-offload)" in r.stderr
    assert "fix: engine=auto, or precision=bf16" in r.stderr
