"""The memory monitor: memory.csv, per-phase peaks, the leak check, memory.png, the progress output."""

from __future__ import annotations

import csv
import json
import os
from types import SimpleNamespace

import psutil
import pytest
import torch

from helpers import run_inprocess
from launcher.training.monitor import CSV_COLUMNS, MemoryMonitor, MiB, detect_leak

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_leak_detector_fires_on_growth_and_not_on_flat_or_noise():
    base = 500 * MiB
    growing = [base + i * 8 * MiB for i in range(30)]
    assert detect_leak(growing, window=10, min_growth=64 * MiB) == 72 * MiB
    flat = [base] * 30
    assert detect_leak(flat, window=10, min_growth=64 * MiB) is None
    # allocator noise around a flat level: up and down by a few MiB
    noisy = [base + (3 * MiB if i % 2 else -2 * MiB) for i in range(30)]
    assert detect_leak(noisy, window=10, min_growth=1) is None
    # one real drop inside the window: memory was given back, not a leak
    dip = growing[:25] + [growing[24] - 100 * MiB] + [growing[24] + i * MiB for i in range(4)]
    assert detect_leak(dip, window=10, min_growth=16 * MiB) is None
    # growth below the threshold, too few values, a mostly flat series with one jump
    assert detect_leak(growing, window=10, min_growth=100 * MiB) is None
    assert detect_leak(growing[:5], window=10, min_growth=1) is None
    assert detect_leak([base] * 9 + [base + 200 * MiB], window=10, min_growth=64 * MiB) is None


def test_phase_peaks_split_at_the_step_and_hooks_mark_backward(tmp_path):
    """A forward that briefly touches 64 MiB and an optimizer step that touches 128 MiB: each peak shows in
    its own phase; the model hooks move the phase from forward to backward when the forward returns."""
    mon = MemoryMonitor(str(tmp_path / "memory.csv"), torch.device("cpu"), interval_s=0.05, leak_steps=0)
    if not mon._hwm.resettable:
        pytest.skip("this kernel does not let a process reset its RSS high-water mark (/proc/self/clear_refs)")

    class Blob(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            tmp = torch.ones(16 * MiB)  # 64 MiB, written; nothing of it is saved for backward
            return (self.w * x).sum() * float(tmp[0])

    model = Blob()
    engine = SimpleNamespace(module=lambda: model)
    mon.start()
    base = psutil.Process().memory_info().rss
    peaks, phases = [], []
    for step in range(1, 4):
        mon.mark("forward", engine)
        phases.append(mon.phase)
        loss = model(torch.ones(4))
        phases.append(mon.phase)
        loss.backward()
        mon.mark("step")
        with torch.no_grad():
            work = torch.ones(32 * MiB)  # 128 MiB in the optimizer step
            model.w -= 0.1 * model.w.grad * float(work[0])
            del work
        model.w.grad = None
        peaks.append(mon.end_step(step, {"cpu_rss_bytes": psutil.Process().memory_info().rss}))
        with torch.no_grad():
            model(torch.ones(4))  # an eval forward: not a phase
        phases.append(mon.phase)
    mon.stop()
    assert phases == ["forward", "backward", "other"] * 3
    for p in peaks[1:]:
        assert p["peak_forward_bytes"] is None and p["peak_step_bytes"] is None  # no GPU
        assert p["peak_step_rss_bytes"] - p["peak_forward_backward_rss_bytes"] >= 48 * MiB, p
        assert p["peak_forward_backward_rss_bytes"] - base >= 48 * MiB, (p, base)
    assert mon.peak_rss_bytes() >= max(p["peak_step_rss_bytes"] for p in peaks)
    rows = list(csv.DictReader(open(tmp_path / "memory.csv")))
    assert len(rows) >= 2 and rows[0]["phase"] == "setup"


def test_training_writes_timeline_peaks_png_and_reports_a_leak(tmp_path):
    """One CPU run with a leak injected (8 MiB kept per step): memory.csv, metrics peaks, memory.png, the warning."""
    kept = []

    def leak(step):
        kept.append(b"\x01" * (8 * MiB))  # touched pages, so RSS grows

    from launcher.training.faults import Hooks

    summary, rows = run_inprocess(tmp_path, "engine=amp", "run_name=m", "log.memory_interval_s=0.05",
                                  "log.leak_steps=6", "log.leak_mib=16", hooks=Hooks(after_step=leak))
    run = summary["run_dir"]
    # memory.csv: header, increasing timestamps, plausible memory
    with open(os.path.join(run, "memory.csv"), newline="") as fh:
        reader = csv.reader(fh)
        assert tuple(next(reader)) == CSV_COLUMNS
        samples = [dict(zip(CSV_COLUMNS, r)) for r in reader]
    assert len(samples) >= 3
    times = [float(s["time_s"]) for s in samples]
    assert all(b > a for a, b in zip(times, times[1:])), times[:10]
    rss_now = psutil.Process().memory_info().rss
    for s in samples:
        rss = int(s["cpu_rss_bytes"])
        assert 50 * MiB < rss < 2 * rss_now + 512 * MiB
        assert int(s["cpu_tree_rss_bytes"]) >= rss
        assert int(s["ram_available_bytes"]) > 0
        assert s["gpu_allocated_bytes"] == ""  # no GPU
    assert {s["phase"] for s in samples} & {"forward", "backward", "step", "other"}
    # per-step, per-phase peaks in metrics.jsonl: RSS high-water marks on the CPU, GPU keys null
    from launcher.training.monitor import _RssHighWater

    resettable = _RssHighWater().resettable
    for r in rows:
        assert r["peak_forward_bytes"] is None and r["peak_step_bytes"] is None
        if resettable:
            assert r["peak_forward_backward_rss_bytes"] >= 50 * MiB and r["peak_step_rss_bytes"] >= 50 * MiB
        else:  # null where the kernel cannot reset the high-water mark (/proc/self/clear_refs)
            assert r["peak_step_rss_bytes"] is None
    # the leak: reported once, for CPU RSS, after the warm-up steps
    warnings = summary["memory_warnings"]
    assert len(warnings) == 1 and warnings[0]["kind"] == "cpu_rss_bytes", warnings
    assert warnings[0]["step"] >= 12 and warnings[0]["growth_bytes"] >= 16 * MiB
    assert json.load(open(os.path.join(run, "summary.json")))["memory_warnings"] == warnings
    assert summary["peak_gpu_bytes"] is None and summary["memory_samples"] == len(samples)
    assert summary["peak_cpu_rss_hwm_bytes"] >= max(r["cpu_rss_bytes"] for r in rows)
    png = os.path.join(run, "memory.png")
    assert open(png, "rb").read(8) == PNG_MAGIC and os.path.getsize(png) > 10_000


@pytest.mark.gpu
def test_gpu_timeline_and_phase_peaks(tmp_path):
    """On CUDA: the timeline's GPU columns (this process and the whole device), per-phase allocated peaks."""
    precision = "bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp16"
    summary, rows = run_inprocess(tmp_path, "device=cuda", f"profile=amp-{precision}", "run_name=g",
                                  "log.memory_interval_s=0.05")
    with open(os.path.join(summary["run_dir"], "memory.csv"), newline="") as fh:
        samples = list(csv.DictReader(fh))
    assert samples and all(s["gpu_allocated_bytes"] != "" and s["gpu_device_used_bytes"] != "" for s in samples)
    assert max(int(s["gpu_device_used_bytes"]) for s in samples) >= max(int(s["gpu_allocated_bytes"]) for s in samples)
    for r in rows:
        assert r["peak_forward_bytes"] > 0 and r["peak_backward_bytes"] > 0 and r["peak_step_bytes"] > 0
        assert r["peak_step_bytes"] >= r["gpu_allocated_bytes"]  # the step's peak includes where it ended
    assert summary["peak_gpu_bytes"] >= max(max(r["peak_forward_bytes"], r["peak_backward_bytes"], r["peak_step_bytes"])
                                            for r in rows)
    assert summary["gpu_device_memory_source"] in ("nvml", "cudaMemGetInfo")
    assert summary["memory_warnings"] == []
    assert open(os.path.join(summary["run_dir"], "memory.png"), "rb").read(8) == PNG_MAGIC


def _cfg(progress="off", every=5, max_steps=12):
    return SimpleNamespace(train=SimpleNamespace(max_steps=max_steps),
                           log=SimpleNamespace(every_steps=every, progress=progress))


def _row(step, skipped=False):
    return {"step": step, "loss": 1.0 / step, "lr": 1e-3, "loss_scale": 65536.0, "skipped": skipped, "grad_norm": 1.0,
            "tokens_per_s": 1000.0, "gpu_allocated_bytes": None, "cpu_rss_bytes": 2**30}


def _lines(caplog) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.name == "vramfit"]
    caplog.clear()
    return out


def test_progress_plain_lines_when_off_or_not_a_terminal(vramfit_log):
    from launcher.training.progress import Progress

    for mode in ("off", "auto"):  # pytest's stderr is not a terminal: auto means plain lines
        vramfit_log.clear()
        p = Progress(_cfg(mode), 0)
        assert p.bar is None
        for s in range(1, 13):
            p.update(_row(s, skipped=(s == 7)))
        p.close()
        lines = _lines(vramfit_log)
        assert [ln.split("/")[0] for ln in lines] == ["step 1", "step 5", "step 7", "step 10", "step 12"]
        assert "(skipped)" in lines[2]


def test_progress_bar_when_on(capsys, vramfit_log):
    from launcher.training.progress import Progress

    p = Progress(_cfg("on"), 2)
    assert p.bar is not None
    for s in range(3, 13):
        p.update(_row(s))
    p.close()
    out = capsys.readouterr().err  # the bar goes where vramfit's lines go
    assert "12/12" in out and "tok/s" in out and "loss" in out and "scale 65536" in out
    assert [ln.split("/")[0] for ln in _lines(vramfit_log)] == ["step 5", "step 10", "step 12"]
