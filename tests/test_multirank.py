"""Several ranks on CPU (gloo) through torchrun: same math as one rank with the micro-batches stacked."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import FAST, ROOT, compare, losses, needs_deepspeed, run_inprocess


def torchrun(nproc, *overrides, timeout=600, sigterm_after_step=None, metrics=None):
    """torchrun N ranks of launcher/run.py; optionally SIGTERM every process (as a preemption does) once
    ``metrics`` shows step ``sigterm_after_step``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                          f"--master_port={port}", os.path.join(ROOT, "launcher", "run.py"), *overrides],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         start_new_session=True)
    if sigterm_after_step:
        deadline = time.time() + timeout
        while time.time() < deadline and p.poll() is None:
            if os.path.exists(metrics) and len(open(metrics).readlines()) >= sigterm_after_step:
                os.killpg(p.pid, signal.SIGTERM)
                break
            time.sleep(0.05)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def rows_of(run_dir):
    return [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.slow
@pytest.mark.parametrize("profile", [pytest.param("zero2-fp32", marks=[needs_deepspeed, pytest.mark.extended]), "amp-fp32"])
def test_two_ranks_match_one_rank_and_resume(tmp_path, profile):
    """2 ranks x micro-batch 1 == 1 rank x micro-batch 2 (fp32, 1e-5 relative); the run directory is written
    once; a checkpoint written by 2 ranks resumes on 2 ranks and completes the same curve."""
    common = [*FAST, f"profile={profile}", "train.global_batch_size=4", "train.max_steps=8", "train.warmup_steps=2",
              f"output_dir={tmp_path}", "device=cpu"]
    r = torchrun(2, *common, "train.micro_batch_size=1", "run_name=two", sigterm_after_step=3,
                 metrics=str(tmp_path / "two" / "metrics.jsonl"))
    cut = json.load(open(tmp_path / "two" / "summary.json"))
    assert cut["status"] == "interrupted", (r.stdout + r.stderr)[-3000:]
    r = torchrun(2, *common, "train.micro_batch_size=1", "run_name=two")  # resumes where both ranks stopped
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    s = json.load(open(tmp_path / "two" / "summary.json"))
    assert s["world_size"] == 2 and s["accumulation"] == 2
    assert s["resumed_from"].endswith(f"step-{cut['steps']:06d}") and cut["steps"] < 8
    rows = rows_of(tmp_path / "two")
    assert [x["step"] for x in rows] == list(range(1, 9))  # one line per step: rank 0 alone writes
    assert r.stderr.count("completed: 8 steps") == 1
    one, one_rows = run_inprocess(tmp_path, *common[1:], "train.micro_batch_size=2", "run_name=one", fast=True)
    assert one["accumulation"] == 2
    mx, _ = compare(losses(rows), losses(one_rows), f"{profile}: 2 ranks x micro 1 vs 1 rank x micro 2")
    assert mx < 1e-5
