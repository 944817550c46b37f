"""The committed table of planned against published measurements (scripts/published_plans.py): every row names
its source and states its settings, its error is what its numbers say, and one row planned again today gives the
committed number."""

import json
import os

import pytest

from helpers import ROOT

FOLDER = os.path.join(ROOT, "bench", "results", "2026-12-04-published")


def table() -> dict:
    with open(os.path.join(FOLDER, "published.json")) as f:
        return json.load(f)


def test_every_row_has_its_source_settings_and_error():
    doc = table()
    assert doc["rows"] and doc["summary"]["rows"] == len(doc["rows"])
    for r in doc["rows"]:
        assert r["source"].startswith("https://") and r["setup"], r
        for key in ("model", "quantize", "micro_batch", "seq_len", "gpu", "profile", "command"):
            assert r[key] not in (None, ""), (key, r)
        assert r["planned_trainable"] == r["published_trainable"], r  # the same LoRA targets as the source
        assert r["error"] == pytest.approx(r["planned_tensor_gb"] / r["published_max_allocated_gb"] - 1, abs=2e-3)
    readme = open(os.path.join(FOLDER, "README.md")).read()
    assert "python scripts/published_plans.py" in readme


def test_a_row_planned_again_gives_the_committed_number():
    """Memory needs no calibration: the row's overrides planned in-process for its card (the script runs the same
    through `vramfit plan --gpu`)."""
    from launcher.config.load import load_config
    from launcher.machine.hardware import probe
    from launcher.plan import gpus, planner

    doc = table()
    row = next(r for r in doc["rows"] if r["model"].startswith("Llama 2 7B") and r["quantize"] == "None"
               and r["micro_batch"] == 1)
    words = row["command"].split()
    assert words[:4] == ["vramfit", "plan", "--gpu", row["gpu"]]
    cfg = load_config(None, words[4:])
    p = planner.plan(cfg, gpus.hardware(gpus.find(row["gpu"]), probe(), 64), [row["profile"]])
    assert p.get(row["profile"]).gpu_tensor_bytes / 1e9 == pytest.approx(row["planned_tensor_gb"], rel=0.01)
