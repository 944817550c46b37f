"""Every script in scripts/ runs, in a smoke mode (a tiny model, a step or two, a small grid), so that none rots
unseen: a script reaches into the config, the planner and the loop, and those move.

A script is either in SMOKE (its arguments, and a file its run must write) or in COVERED (the test that already
runs it); a new script in neither fails :func:`test_every_script_is_run`. Each smoke runs in its own process with its
caches, temporary files and calibration (a quick one) in a fresh folder, so nothing lands in the checkout or in the
user's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
TINY_RUN = ["data.seq_len=32", "data.num_samples=64", "train.global_batch_size=4"]

# script -> (arguments, with {tmp} for the fresh folder; a file the run writes there, or None if it only prints)
SMOKE: dict[str, tuple[list[str], str | None]] = {
    "bench_calibration.py": (["--runs", "1", "--quick", "--out", "{tmp}"], "calibration_time.json"),
    "bench_checkpoint_size.py": (["--model", "tiny", "--r", "4", "--out", "{tmp}"], "checkpoint_size.json"),
    "bench_checksum.py": (["--gib", "0.01", "--dir", "{tmp}"], None),
    "bench_compile.py": (["--steps", "12", "--repeats", "1", "--engines", "amp", "--compile", "false", "--json",
                          "{tmp}/compile.json"], "compile.json"),
    "bench_data.py": (["--smoke", "--out", "{tmp}/out", "--work", "{tmp}/work"], "out/results.json"),
    "bench_fresh_pages.py": (["--hold", "0", "0.5", "--reps", "1", "--rounds", "1", "--out", "{tmp}"],
                             "fresh_pages.json"),
    "bench_gloo_gather.py": (["--mib", "8", "--out", "{tmp}"], "gloo_gather.json"),
    "bench_heap.py": (["--out", "{tmp}", "--rounds", "1", "--steps", "3", "--profiles", "amp-fp32"], "heap.json"),
    "bench_init.py": (["--gib", "0.01", "--rounds", "1", "--json", "{tmp}/init.json"], "init.json"),
    "bench_load.py": (["--model", "tiny", "--shard", "1MB", "--max-ratio", "inf", "--out", "{tmp}/load"],
                      "load/load.json"),
    "bench_loop_parts.py": (["--steps", "7", "--json", "{tmp}/parts.json", *TINY_RUN, "checkpoint.save=false"],
                            "parts.json"),
    "bench_monitor.py": (["--repeats", "1", "--steps", "3", "--warmup", "1", "--out", "{tmp}", *TINY_RUN],
                         "bench_monitor.json"),
    "bench_optimizers.py": (["--hidden", "64", "--intermediate", "192", "--layers", "1", "--warmup", "1", "--steps",
                             "2", "--no-compile"], None),
    "bench_overhead.py": (["--steps", "6", "--repeats", "1", "--json", "{tmp}/overhead.json", *TINY_RUN,
                           "checkpoint.save=false"], "overhead.json"),
    "bench_plan_time.py": (["--repeats", "1", "--quick-calibration", "--out", "{tmp}", "--", "model.name=tiny",
                            "data.seq_len=32", "train.global_batch_size=2"], "plan_time.json"),
    "bench_process_spread.py": (["--processes", "2", "--blocks", "2", "--steps", "2", "--json", "{tmp}/spread.json"],
                                "spread.json"),
    "bench_threads.py": (["--profiles", "amp-fp32", "--repeats", "1", "--settings", "auto", "--steps", "3", "--json",
                          "{tmp}/threads.json"], "threads.json"),
    "bench_tracking.py": (["--repeats", "1", "--steps", "4", "--warmup", "1", "--out", "{tmp}", *TINY_RUN,
                           "log.progress=off"], "bench_tracking.json"),
    "bench_vs_trainer.py": (["--steps", "3", "--repeats", "1", "--seq-len", "32", "--no-same-ds", "--work",
                             "{tmp}/work", "--json", "{tmp}/vs.json"], "vs.json"),
    "big_model_plans.py": (["--out", "{tmp}/bp", "--models", "llama-3.1-8b", "--gpus", "T4", "--methods", "lora"],
                           "bp/plans.md"),
    "capacity_table.py": (["--out", "{tmp}/cap", "--models", "llama-1b", "--modes", "LoRA", "--cards", "16", "--ram",
                           "32"], "cap/results.json"),
    "check_op_builds.py": (["--runs", "1", "--json", "{tmp}/ops.json"], "ops.json"),
    "host_plans.sh": (["{tmp}/hp", "llama-7b-t4"], "hp/llama-7b-t4.txt"),
    "validate_host_memory.py": (["--models", "llama-125m", "--profiles", "amp-fp32", "--kinds", "lora", "--out",
                                 "{tmp}/hm"], "hm/host_memory.json"),
    "validate_planner.py": (["--cpu", "--quick", "--out", "{tmp}/vp"], "vp/validate_planner.json"),
    "validate_zoo.py": (["--out", "{tmp}/zoo"], "zoo/zoo.json"),
    "validate_steptime.py": (["--points", "tiny-amp32-mb8", "--steps", "1", "--warmup", "1", "--out", "{tmp}/st"],
                             "st/validate_steptime.json"),
    # downloads wheels: its dry run checks that every wheel it would fetch has a pin in the lock
    "gpu_wheels.sh": (["--dry-run"], None),
    # the set-up is the README's, which CI runs first; the demo then trains as it is
    "demo.sh": (["train.max_steps=2", "output_dir={tmp}/runs", "run_name=demo"], "runs/demo/summary.json"),
}

# script -> the test file (or CI script) that runs it already
COVERED = {
    "docs_examples.py": "tests/test_docs_examples.py",
    "gpu_bench.sh": "tests/test_gpu_bench_script.py",
    "gpu_bench_report.py": "tests/test_gpu_bench_script.py",
    "lock.sh": "tests/test_install.py",
    "make_tiny_model.py": "tests/test_install.py",
    "published_plans.py": "tests/test_published.py",
    "published_runs.py": "tests/test_published_runs.py",
    "setup.sh": "scripts/test.sh",  # the README's test command, which .ci/run runs
    "test.sh": ".ci/run",
    "test_floors.sh": ".ci/run",
    "update_docs.py": "tests/test_docs.py",
    "validate_ranks.py": "tests/test_multirank.py",
}


def test_every_script_is_run():
    """A script in scripts/ is smoke-tested here or run by a named test; the named test really runs it."""
    scripts = sorted(f for f in os.listdir(SCRIPTS) if f.endswith((".py", ".sh")))
    missing = [s for s in scripts if s not in SMOKE and s not in COVERED]
    assert not missing, f"scripts no test runs: {missing}; add each to SMOKE (a quick mode) or COVERED in {__file__}"
    assert not set(SMOKE) & set(COVERED)
    for script, where in COVERED.items():
        assert script in open(os.path.join(ROOT, where)).read(), f"{where} does not run scripts/{script}"
    gone = sorted((set(SMOKE) | set(COVERED)) - set(scripts))
    assert not gone, f"listed but not in scripts/: {gone}"


@pytest.mark.slow  # about four minutes for all of them (CI's slow run)
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_script_smoke(script, tmp_path):
    args, made = SMOKE[script]
    tmp = str(tmp_path)
    env = dict(os.environ, VRAMFIT_RECHECK="off", VRAMFIT_CACHE=os.path.join(tmp, "cache"), VRAMFIT_CALIBRATE_QUICK="1",
               TMPDIR=tmp, VRAMFIT_SETUP="skip", PYTHON=sys.executable,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    run = ["bash"] if script.endswith(".sh") else [sys.executable]
    cmd = [*run, os.path.join(SCRIPTS, script), *[a.replace("{tmp}", tmp) for a in args]]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    if made:
        path = os.path.join(tmp, made)
        assert os.path.getsize(path) > 0, f"{script} did not write {made}"
        if path.endswith(".json"):
            json.load(open(path))
