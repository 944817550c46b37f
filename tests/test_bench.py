"""vramfit bench: timing from metrics rows, the --find search, failures as rows, and the CLI end to end."""

from __future__ import annotations

import json
import os

import pytest

from helpers import has_deepspeed, needs_deepspeed, run_cli
from launcher.measure import bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["data.seq_len=32", "data.num_samples=128", "train.warmup_steps=1"]
ROW_KEYS = {"profile", "tokens_per_s", "step_s", "peak_gpu_bytes", "peak_cpu_rss_bytes", "predicted_gpu_bytes",
            "predicted_cpu_bytes", "ratio_to_fastest", "status", "error"}


def test_timing_leaves_out_the_warmup_steps():
    # 3 warm-up steps of 10 s, then 4 steps of 1 s at 100 tokens each
    rows, t = [], 0.0
    for step in range(1, 8):
        t += 10.0 if step <= 3 else 1.0
        rows.append({"step": step, "time_s": t, "tokens": 100 * step})
    got = bench.timing(rows, warmup=3)
    assert got == {"tokens_per_s": 100.0, "step_s": 1.0, "steps_timed": 4}
    assert bench.timing(rows, warmup=0)["steps_timed"] == 7
    assert bench.timing(rows[:3], warmup=3)["tokens_per_s"] is None  # nothing timed


def test_search_finds_the_largest_fitting_candidate_from_any_start():
    cands = [1, 2, 4, 8, 16, 32]
    for limit in (0, 1, 8, 32):  # fits when c <= limit (0: nothing fits)
        for start in range(len(cands)):
            best, tried = bench.search(cands, start, lambda i, limit=limit: cands[i] <= limit)
            want = max((i for i, c in enumerate(cands) if c <= limit), default=None)
            assert best == want, (limit, start)
            assert len(tried) == len(set(tried))
    # a right guess costs two runs: the guess and the one above it
    assert bench.search(cands, 3, lambda i: cands[i] <= 8)[1] == [3, 4]


def test_candidates_and_failures():
    from launcher.config.load import load_config

    assert bench.micro_batch_candidates(load_config(None, ["train.global_batch_size=24", "train.micro_batch_size=1"])) \
        == [1, 2, 4, 8]
    status, err = bench.classify_failure(1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
                                            "allocate 2.00 GiB", False)
    assert status == "oom" and "Tried to allocate" in err
    assert bench.classify_failure(2, "vramfit: 1 problem in the configuration:\n  - profile: ... DeepSpeed is not "
                                     "installed", False)[0] == "unsupported"
    assert bench.classify_failure(2, "vramfit: 1 problem in the memory plan:\n  - memory: needs 90 GiB", False)[0] \
        == "refused"
    assert bench.classify_failure(-1, "", True)[0] == "timeout"
    assert bench.child_overrides(["profile=x", "train.lr=1", "run_name=r"], bench.OWN_KEYS) == ["train.lr=1"]


def test_find_compares_measured_rss_with_the_cpu_budget(monkeypatch, tmp_path):
    """--find on a CPU: a run over memory.cpu_budget does not fit, whatever the plan said."""
    rss = {1: 0.5, 2: 0.8, 4: 1.5, 8: 3.0}  # GiB per micro-batch

    def fake_run(path, overrides, profile, name, out, steps, warmup, timeout, hw, machine=None):
        mb = int([o for o in overrides if o.startswith("train.micro_batch_size=")][-1].split("=")[1])
        assert not any(o.startswith("memory.cpu_budget") for o in overrides)  # measured, not passed on
        return {"profile": profile, "run": name, "status": "ok", "error": None, "tokens_per_s": 100.0 * mb,
                "peak_cpu_rss_bytes": int(rss[mb] * bench.GiB)}

    def fake_predict(path, overrides, profile, hw, machine=None):
        return {"planned_fits": True, "predicted_cpu_bytes": 1}  # the plan thinks everything fits

    monkeypatch.setattr(bench, "run_one", fake_run)
    monkeypatch.setattr(bench, "predict", fake_predict)
    seen = []
    row = bench.find_for_profile("micro-batch", None, [], ["memory.cpu_budget=1"], "amp-fp32", [1, 2, 4, 8],
                                 str(tmp_path), 1, 1, 60, None, 1 * bench.GiB, seen.append)
    assert row["best_micro_batch"] == 2 and row["planned_best_micro_batch"] == 8
    assert [c["candidate"] for c in row["candidates"]] == [8, 4, 2]  # from the plan's guess down to what fits
    assert row["candidates"][0]["status"] == "over_budget" and row["tokens_per_s"] == 200.0


def _check_outputs(out, n_rows):
    doc = json.load(open(os.path.join(out, "results.json")))
    assert set(doc) >= {"results", "hardware"} and len(doc["results"]) == n_rows
    assert doc["hardware"]["cpu_model"] and "ram_total_bytes" in doc["hardware"]
    md = open(os.path.join(out, "results.md")).read()
    assert open(os.path.join(out, "results.png"), "rb").read(8) == PNG_MAGIC
    return doc, md


@pytest.mark.slow
@pytest.mark.parametrize("profiles", [pytest.param(["amp-fp32", "zero2-fp32"], marks=needs_deepspeed, id="amp+zero2"),
                                      pytest.param(["amp-fp32", "amp-bf16"], id="amp+amp-bf16", marks=pytest.mark.skipif(
                                          has_deepspeed(), reason="DeepSpeed is installed: the amp+zero2 case runs"))])
def test_bench_two_profiles_on_cpu(tmp_path, profiles):
    """Two profiles end to end, one of them ZeRO-2; without DeepSpeed that case skips, saying so, and two AMP
    profiles run instead (one of the two cases always runs)."""
    out = str(tmp_path / "bench")
    p = run_cli("bench", *SMALL, "train.micro_batch_size=2", "train.global_batch_size=4", "--profiles",
                ",".join(profiles), "--steps", "2", "--warmup", "1", "--out", out, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc, md = _check_outputs(out, 2)
    for r in doc["results"]:
        assert ROW_KEYS <= set(r), set(ROW_KEYS) - set(r)
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["peak_gpu_bytes"] is None
        assert r["peak_cpu_rss_bytes"] > 50 * 2**20 and r["predicted_cpu_bytes"] > 0
        assert r["steps_timed"] == 2 and r["memory_warnings"] == []
        assert not os.path.exists(os.path.join(r["run_dir"], "checkpoints", "step-000003"))  # no saves
    assert max(r["ratio_to_fastest"] for r in doc["results"]) == 1.0
    assert [r["profile"] for r in doc["results"]] == profiles
    assert all(f"`{name}`" in md for name in profiles) and "| profile | status | tokens/s" in md
    assert "| profile | status | tokens/s" in p.stdout  # the table is printed last


@pytest.mark.slow
@pytest.mark.extended
def test_bench_find_micro_batch_on_cpu(tmp_path):
    """On a CPU, --find has the measured RSS against memory.cpu_budget: a generous budget fits the largest."""
    out = str(tmp_path / "find")
    p = run_cli("bench", *SMALL, "train.micro_batch_size=1", "train.global_batch_size=4", "memory.cpu_budget=64",
                "--profiles", "amp-fp32", "--find", "micro-batch", "--steps", "1", "--warmup", "1", "--out", out,
                timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc, md = _check_outputs(out, 1)
    r = doc["results"][0]
    assert r["best_micro_batch"] == 4 and r["planned_best_micro_batch"] == 4
    assert [c["candidate"] for c in r["candidates"]] == [4]  # the plan's answer, and nothing above it
    assert r["candidates"][0]["fits"] and r["micro_batch"] == 4
    assert "largest micro-batch (measured)" in md
