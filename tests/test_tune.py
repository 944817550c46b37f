"""Plans for GPUs that are not here, the comparison across the catalogue, and `vramfit tune`, from the CLI.

A quick calibration of this machine (VRAMFIT_CALIBRATE_QUICK: small sizes, AMP only; not accurate) stands
in for `vramfit doctor --calibrate`, in a private cache folder."""

import json
import os

import pytest
import yaml

from helpers import FAST, run_cli


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    env = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache")), "VRAMFIT_CALIBRATE_QUICK": "1"}
    r = run_cli("doctor", "--calibrate", "--json", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["calibration"]["machine"]["compute"]["memory_bytes_per_s"] > 0
    return env


@pytest.mark.slow  # with the calibration they share, a third of a minute
def test_plan_for_a_gpu_that_is_not_here(calibrated):
    r = run_cli("plan", "model.name=tiny", "lora.r=16", "data.seq_len=256", "memory.cpu_budget=32", "--gpu", "T4",
                "--json", env=calibrated)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["settings"]["precision"] == "fp16"  # a T4 has no bf16
    assert plan["machine"].startswith("NVIDIA T4 (data sheet: step times on paper)")
    chosen = next(p for p in plan["profiles"] if p["profile"] == plan["chosen"])
    assert chosen["step_s"] > 0 and chosen["tokens_per_s"] > 0 and chosen["eta_s"] > 0
    assert plan["budget"]["gpu_bytes"] < 15 * 2**30 and "T4" in plan["budget"]["gpu_source"]


@pytest.mark.slow  # with the calibration they share, a third of a minute
def test_compare_gpus_with_prices(calibrated):
    r = run_cli("plan", "model.name=tiny", "lora.r=16", "data.seq_len=256", "memory.cpu_budget=32",
                "--compare-gpus", "--price", "T4=0.35,L4=0.80", env=calibrated)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("GPU") and "cost USD" in lines[0]
    t4 = next(ln for ln in lines if ln.startswith("T4 "))
    assert "0.35" in t4 and "yes" in t4
    assert any(ln.startswith("H200-SXM") for ln in lines)


@pytest.mark.parametrize("args,message", [
    (["--gpu", "T5"], "--gpu: got 'T5'"),
    (["--gpu", "A100"], "which names 4 cards"),
    (["--compare-gpus", "--price", "T4=-1"], "a price is zero or more"),
    (["--compare-gpus", "--price", "T9=0.3"], "--price: got 'T9'"),  # the option it came from, and its fix
    (["--compare-gpus", "--price", "T9=0.3"], "fix: --price T4=0.3"),
    (["--compare-gpus", "--price", "A100=1"], "fix: one of --price A100-40GB-SXM=1"),
    (["--price", "T4=0.3"], "without --compare-gpus"),
])
def test_bad_gpu_and_price_input(args, message):
    r = run_cli("plan", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in r.stderr and "fix:" in r.stderr, r.stderr


@pytest.mark.slow
def test_tune_measures_the_top_settings_and_keeps_the_fastest(tmp_path, calibrated):
    out = tmp_path / "tuned.yaml"
    args = [a for a in FAST if not a.startswith("train.micro_batch_size")]
    r = run_cli("tune", *args, "engine=amp", "train.micro_batch_size=auto", "--top", "2", "--steps", "2", "--warmup",
                "1", "--out", str(out), "--dir", str(tmp_path / "runs"), env=calibrated)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| profile | setting | predicted s/step | measured s/step" in r.stdout
    tuned = yaml.safe_load(out.read_text())
    assert tuned["profile"].startswith("amp-") and isinstance(tuned["train"]["micro_batch_size"], int)
    # the corrections are kept with this machine's calibration
    cal = [f for f in os.listdir(os.path.join(calibrated["XDG_CACHE_HOME"], "vramfit")) if f.endswith(".json")]
    assert cal and any(json.load(open(os.path.join(calibrated["XDG_CACHE_HOME"], "vramfit", f)))["machine"]
                       .get("corrections") for f in cal)
    # a second tune never overwrites the first one's results
    again = run_cli("tune", *args, "--out", str(out), env=calibrated)
    assert again.returncode == 2 and "never overwrites" in again.stderr


@pytest.mark.slow  # with the calibration they share
def test_plan_for_two_cards_is_per_rank(calibrated):
    r = run_cli("plan", "--gpu", "RTX4090", "--gpus", "2", "model.name=tiny", "data.seq_len=64",
                "memory.cpu_budget=32", "--json", env=calibrated)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["settings"]["world_size"] == 2 and plan["budget"]["cpu_bytes"] == 16 * 2**30
    assert "shared by 2 ranks" in plan["budget"]["cpu_source"]
    chosen = next(p for p in plan["profiles"] if p["profile"] == plan["chosen"])
    assert any("communication" in n for n in chosen["time_notes"])
