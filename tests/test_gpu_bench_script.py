"""scripts/gpu_bench.sh is only run on a lent GPU host: its shell parses, and the Python it runs to read its
own results back works on results shaped like vramfit bench's (made up here, so no GPU is needed)."""

import json
import os
import subprocess
import sys

from helpers import ROOT

REPORT = os.path.join(ROOT, "scripts", "gpu_bench_report.py")


def _results(path, rows):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "results.json"), "w") as fh:
        json.dump({"results": rows, "hardware": {}}, fh)


def test_the_shell_script_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "gpu_bench.sh")]).returncode == 0


def test_best_micro_batch_and_summary(tmp_path):
    out = str(tmp_path)
    with open(os.path.join(out, "stages.tsv"), "w") as fh:
        fh.write("stage\tstatus\tseconds\tcap\ncard\tok\t30\t120\nfind_mb\ttimeout\t130\t130\n")
    _results(os.path.join(out, "card"), [
        {"profile": "zero2-bf16", "status": "ok", "tokens_per_s": 2000.0, "ratio_to_fastest": 1.0,
         "peak_gpu_bytes": 3 * 2**30, "predicted_gpu_bytes": 3.2 * 2**30, "peak_cpu_rss_bytes": 2**31}])
    _results(os.path.join(out, "find_mb_16gb"), [
        {"profile": "zero2-bf16", "status": "ok", "best_micro_batch": 8, "planned_best_micro_batch": 8,
         "tokens_per_s": 1000.0, "peak_gpu_bytes": 14 * 2**30},
        {"profile": "zero2-bf16-offload-opt", "status": "ok", "best_micro_batch": 16, "planned_best_micro_batch": 8,
         "tokens_per_s": 750.0, "peak_gpu_bytes": 13 * 2**30}])
    r = subprocess.run([sys.executable, REPORT, "best-micro-batch", os.path.join(out, "find_mb_16gb", "results.json"),
                        "zero2-bf16"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "8"
    r = subprocess.run([sys.executable, REPORT, "summary", out, "zero2-bf16", "zero2-bf16-offload-opt"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "stages: card ok; find_mb timeout" in r.stdout
    assert "zero2-bf16 | ok | 2000 | 1.0 | 3.00 | 3.20 | 2.00" in r.stdout
    assert "offload / no offload, each at its best: 0.75x" in r.stdout
    assert open(os.path.join(out, "summary.md")).read().strip() == r.stdout.strip()
    assert subprocess.run([sys.executable, REPORT, "nonsense"], capture_output=True).returncode == 2


def test_summary_with_the_same_setting_and_both_offloads(tmp_path):
    """The reshaped bench's stages: one setting for no offload and both optimizer offloads (ratios to no offload,
    measured step beside the planned one), both offloads at their largest micro-batch, LoRA and QLoRA."""
    out = str(tmp_path)
    with open(os.path.join(out, "stages.tsv"), "w") as fh:
        fh.write("stage\tstatus\tseconds\tcap\nsame_mb\tok\t90\t150\n")
    _results(os.path.join(out, "same_mb"), [
        {"profile": "amp-bf16", "status": "ok", "tokens_per_s": 1000.0, "step_s": 4.0, "predicted_step_s": 3.5},
        {"profile": "amp-bf16-offload-opt", "status": "ok", "tokens_per_s": 850.0, "step_s": 4.7},
        {"profile": "zero2-bf16-offload-opt", "status": "ok", "tokens_per_s": 400.0}])
    _results(os.path.join(out, "find_mb_16gb"), [
        {"profile": "amp-bf16", "status": "ok", "best_micro_batch": 8, "tokens_per_s": 1000.0},
        {"profile": "amp-bf16-offload-opt", "status": "ok", "best_micro_batch": 32, "tokens_per_s": 900.0},
        {"profile": "zero2-bf16-offload-opt", "status": "ok", "best_micro_batch": 32, "tokens_per_s": 500.0}])
    _results(os.path.join(out, "qlora_16gb"), [{"profile": "amp-bf16", "status": "ok", "tokens_per_s": 300.0}])
    r = subprocess.run([sys.executable, REPORT, "summary", out, "amp-bf16", "amp-bf16-offload-opt",
                        "zero2-bf16-offload-opt"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "amp-bf16 | ok | 1000 | 1.00x | 4 / 3.5 |" in r.stdout
    assert "amp-bf16-offload-opt | ok | 850 | 0.85x | 4.7 / - |" in r.stdout
    assert "zero2-bf16-offload-opt | ok | 400 | 0.40x | - |" in r.stdout
    assert "zero2-bf16-offload-opt / no offload, each at its best: 0.50x" in r.stdout
    assert "QLoRA" in r.stdout
