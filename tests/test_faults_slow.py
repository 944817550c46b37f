"""The slow fault cases (``pytest -m slow``): a real full disk (a small tmpfs, mounted where this user may
mount; skipped with the reason elsewhere), two processes on one run directory, a holder killed with SIGKILL,
and damaged DeepSpeed checkpoints. Each runs the real command line in its own process where the exit code
and the absence of a traceback are the point.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_faults import RUN, disk_full, refused, snapshot

from helpers import ROOT, needs_deepspeed, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """mount(size_bytes) -> a fresh tmpfs of that size under tmp_path; resize(path, size_bytes)."""
    mounted = []
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: the real full-disk cases need a small tmpfs")

    def mount(size: int):
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'exit ' + str(r.returncode)}): the real "
                        "full-disk cases need root where mounting is allowed; the injected ones run in test_faults.py")
        mounted.append(d)
        return d

    def resize(d, size: int):
        subprocess.run(["mount", "-o", f"remount,size={size}", str(d)], check=True, capture_output=True)

    yield mount, resize
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """Bytes of one AMP checkpoint and of final/ for the RUN settings (measured, so the tmpfs sizes follow
    torch's serialization wherever the test runs)."""
    from launcher.config import load_config
    from launcher.train import train

    root = tmp_path_factory.mktemp("sizes")
    s = train(load_config(None, [*RUN, "train.max_steps=1", f"output_dir={root}", "run_name=r"]))

    def size(p):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)

    return {"checkpoint": size(s["checkpoint"]), "final": size(os.path.join(s["run_dir"], "final"))}


def _summary(run):
    return json.load(open(os.path.join(run, "summary.json")))


def _no_partials(run):
    left = [p for p in snapshot(run) if ".tmp" in p or ".old-" in p or "vramfit.lock" in p]
    assert not left, left


MiB = 2**20


def test_disk_fills_before_the_first_checkpoint(small_disk, sizes, tmp_path):
    mount, resize = small_disk
    disk = mount(sizes["checkpoint"] // 2)
    args = ["train", *RUN, "train.max_steps=4", "checkpoint.every_steps=2", f"output_dir={disk}", "run_name=r"]
    p = run_cli(*args, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    disk_full(p.stderr)
    assert "no checkpoint was written yet" in p.stderr
    run = disk / "r"
    s = _summary(run)
    assert s["status"] == "failed" and s["checkpoint"] is None and "disk full" in s["diagnosis"]
    assert os.listdir(run / "checkpoints") == []
    _no_partials(run)


def test_disk_full_at_the_second_checkpoint_then_resume_after_freeing_space(small_disk, sizes, tmp_path):
    """The pre-check refuses the second checkpoint (MiB in the message); the first one is kept; with space
    freed, the same command resumes from it and completes, metrics going on from step 2."""
    mount, resize = small_disk
    disk = mount(sizes["checkpoint"] * 3 // 2 + MiB)
    args = ["train", *RUN, "train.max_steps=6", "checkpoint.every_steps=2", f"output_dir={disk}", "run_name=r"]
    p = run_cli(*args, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    disk_full(p.stderr)
    assert "would not fit" in p.stderr and "run the same command again" in p.stderr
    run = disk / "r"
    s = _summary(run)
    assert s["status"] == "failed" and s["checkpoint"].endswith("step-000002") and s["steps"] == 4
    _no_partials(run)
    resize(disk, sizes["checkpoint"] * 5 + sizes["final"] + 4 * MiB)
    p = run_cli(*args, cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    s = _summary(run)
    assert s["status"] == "completed" and s["resumed_from"].endswith("step-000002") and s["steps"] == 6
    rows = [json.loads(ln) for ln in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 7))
    _no_partials(run)


def test_disk_full_while_writing_final_keeps_the_checkpoint(small_disk, sizes, tmp_path):
    """final/ does not fit: the run is 'failed' with its last checkpoint; once there is room, the same
    command writes final/ from that checkpoint."""
    mount, resize = small_disk
    disk = mount(sizes["checkpoint"] + sizes["final"] // 2 + MiB)
    args = ["train", *RUN, "train.max_steps=2", f"output_dir={disk}", "run_name=r"]
    p = run_cli(*args, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    disk_full(p.stderr)
    assert "final/" in p.stderr
    run = disk / "r"
    s = _summary(run)
    assert s["status"] == "failed" and s["checkpoint"].endswith("step-000002") and not (run / "final").exists()
    _no_partials(run)
    resize(disk, 3 * sizes["checkpoint"] + 2 * sizes["final"] + 4 * MiB)
    p = run_cli(*args, cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert _summary(run)["status"] == "completed" and (run / "final" / "model.safetensors").exists()
    _no_partials(run)


@needs_deepspeed
def test_deepspeed_checkpoint_on_a_full_disk(small_disk, tmp_path):
    """DeepSpeed's torch.save reports a full disk as 'unexpected pos' or 'iostream error': still 'disk full'."""
    mount, _ = small_disk
    disk = mount(3 * MiB)
    p = run_cli("train", *RUN, "engine=deepspeed", "profile=zero2-fp32", "train.max_steps=2", f"output_dir={disk}",
                "run_name=r", cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    disk_full(p.stderr)
    s = _summary(disk / "r")
    assert s["status"] == "failed" and s["checkpoint"] is None
    assert os.listdir(disk / "r" / "checkpoints") == []
    _no_partials(disk / "r")


# ------------------------------------------------------------------------------------------------
# Two processes, one run directory


def _start(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "launcher", "train", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc, deadline_s=300):
    deadline = time.time() + deadline_s
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def test_second_process_on_a_run_directory_is_refused(tmp_path):
    args = [*RUN, "train.max_steps=100000", "checkpoint.every_steps=3", f"output_dir={tmp_path}/out", "run_name=r"]
    first = _start(tmp_path, *args)
    run = tmp_path / "out" / "r"
    try:
        _wait_for(run / "checkpoints" / "step-000003", first)
        p = run_cli("train", *args, cwd=tmp_path, timeout=240)  # (a second writer would run until killed)
        refused(p.returncode, p.stderr, f"is in use by pid {first.pid} on host {socket.gethostname()}")
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err[-3000:]
    steps = [json.loads(ln)["step"] for ln in open(run / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every step once
    assert not (run / "vramfit.lock").exists()
    p = run_cli("train", *args[:-3], f"train.max_steps={len(steps) + 1}", *args[-2:], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _summary(run)["resumed_from"].endswith(f"step-{len(steps):06d}")


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    args = [*RUN, "train.max_steps=100000", "checkpoint.every_steps=3", f"output_dir={tmp_path}/out", "run_name=r"]
    first = _start(tmp_path, *args)
    run = tmp_path / "out" / "r"
    _wait_for(run / "checkpoints" / "step-000003", first)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    assert json.load(open(run / "vramfit.lock"))["pid"] == first.pid  # left behind
    p = run_cli("train", *args[:-3], "train.max_steps=7", *args[-2:], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"taking over the lock of pid {first.pid}" in p.stderr
    s = _summary(run)
    assert s["status"] == "completed" and s["resumed_from"] and s["steps"] == 7
    assert not (run / "vramfit.lock").exists()


# ------------------------------------------------------------------------------------------------
# Damaged DeepSpeed checkpoints


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    from launcher.config import load_config
    from launcher.train import train

    root = tmp_path_factory.mktemp("ds")
    s = train(load_config(None, [*RUN, "engine=deepspeed", "profile=zero2-fp32", "train.max_steps=4",
                                 "checkpoint.every_steps=2", f"output_dir={root}", "run_name=ds"]))
    assert s["status"] == "completed"
    return root / "ds"


@needs_deepspeed
@pytest.mark.parametrize("damage", ["model-states-deleted", "optimizer-states-truncated"])
def test_damaged_deepspeed_checkpoint_falls_back(ds_run, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(ds_run, out / "ds")
    newest = out / "ds" / "checkpoints" / "step-000004" / "ds"
    if damage == "model-states-deleted":
        os.remove(newest / "mp_rank_00_model_states.pt")
    else:
        (optim,) = [f for f in os.listdir(newest) if "optim_states" in f]
        with open(newest / optim, "r+b") as fh:
            fh.truncate(os.path.getsize(newest / optim) // 3)
    p = run_cli("train", *RUN, "engine=deepspeed", "profile=zero2-fp32", "train.max_steps=5",
                "checkpoint.every_steps=2", f"output_dir={out}", "run_name=ds", cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "step-000004 is damaged" in p.stderr
    s = _summary(out / "ds")
    assert s["status"] == "completed" and s["resumed_from"].endswith("step-000002") and s["steps"] == 5
