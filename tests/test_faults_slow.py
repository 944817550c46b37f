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

import pytest
from test_faults import RUN, refused, snapshot

from helpers import needs_deepspeed, run_cli
from helpers.procs import checkpoint_steps, started, vramfit

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
    from launcher.config.load import load_config
    from launcher.training.loop import train

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


def fill(disk, leave: int) -> str:
    """A ballast file that leaves ``leave`` bytes free on ``disk`` (another tenant filling the disk mid-run)."""
    path = os.path.join(str(disk), "ballast.bin")
    free = shutil.disk_usage(disk).free
    with open(path, "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, max(1, free - leave))
    return path


def train_here(disk, *args, hooks=None):
    """Train in this process (hooks fill the disk at a chosen step): the summary."""
    from launcher.config.load import load_config
    from launcher.training.loop import train

    return train(load_config(None, [*RUN, f"output_dir={disk}", "run_name=r", *args]), hooks=hooks)


def test_disk_too_small_is_refused_before_the_first_step(small_disk, sizes, tmp_path):
    """Less room than keep_last + 1 checkpoints and final/: exit 2 with the numbers and the fixes, before
    anything is written (the disk stays empty)."""
    mount, _ = small_disk
    disk = mount(sizes["checkpoint"] // 2)
    p = run_cli("train", *RUN, "train.max_steps=4", "checkpoint.every_steps=2", f"output_dir={disk}", "run_name=r",
                cwd=tmp_path)
    refused(p.returncode, p.stderr, "output_dir", "checkpoint.keep_last")
    assert os.listdir(disk) == []


def test_disk_fills_mid_run_skips_a_checkpoint_then_stops_with_the_last_good_one(small_disk, sizes, tmp_path):
    """Room at the start; after step 3 another writer leaves half a checkpoint free: the checkpoint of step 4 is
    skipped with a warning, the last one (step 6) does not fit and the run fails with step 2's; with space
    freed, the same command resumes from it and completes, metrics going on from step 2."""
    from launcher.training.faults import Hooks

    mount, _ = small_disk
    disk = mount(20 * sizes["checkpoint"] + 2 * sizes["final"] + 8 * MiB)
    ballast = []
    hooks = Hooks(after_step=lambda s: s == 3 and ballast.append(fill(disk, sizes["checkpoint"] // 2)))
    s = train_here(disk, "train.max_steps=6", "checkpoint.every_steps=2", hooks=hooks)
    run = disk / "r"
    assert s["status"] == "failed" and s["checkpoint"].endswith("step-000002") and s["steps"] == 6
    assert "disk full" in s["diagnosis"] and "run the same command again" in s["diagnosis"]
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000002"]
    _no_partials(run)
    os.remove(ballast[0])
    s = train_here(disk, "train.max_steps=6", "checkpoint.every_steps=2")
    assert s["status"] == "completed" and s["resumed_from"].endswith("step-000002") and s["steps"] == 6
    rows = [json.loads(ln) for ln in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 7))
    _no_partials(run)


def test_disk_full_while_writing_final_keeps_the_checkpoint(small_disk, sizes, tmp_path):
    """final/ does not fit (the disk filled while the last checkpoint was written): the run is 'failed' with its last checkpoint;
    once there is room, the same command writes final/ from that checkpoint."""
    from launcher.training.faults import Hooks

    mount, _ = small_disk
    disk = mount(20 * sizes["checkpoint"] + 2 * sizes["final"] + 8 * MiB)
    ballast = []
    # filled while the checkpoint is written (its files are out, its marker not yet): half of final/ stays free
    hooks = Hooks(during_save=lambda tmp: ballast.append(fill(disk, sizes["final"] // 2 + 256 * 1024)))
    s = train_here(disk, "train.max_steps=2", hooks=hooks)
    run = disk / "r"
    assert s["status"] == "failed" and s["checkpoint"].endswith("step-000002") and not (run / "final").exists()
    assert "final/" in s["diagnosis"]
    _no_partials(run)
    os.remove(ballast[0])
    s = train_here(disk, "train.max_steps=2")
    assert s["status"] == "completed" and (run / "final" / "model.safetensors").exists()
    _no_partials(run)


def test_trackers_disk_fills_mid_run_and_the_run_completes(small_disk, tmp_path):
    """The trackers write on their own disk (log.tracker_dir) and another writer fills it after step 2, so the
    first write that meets a full disk is TensorBoard's (from its writer thread, raised again at every later call
    and at close): the tracker is switched off with a warning and the run completes, its own files complete."""
    from launcher.training.faults import Hooks

    mount, _ = small_disk
    logs = mount(4 * MiB)
    hooks = Hooks(after_step=lambda s: s == 2 and fill(logs, 0))
    # 40 steps: TensorBoard's events outgrow the page its file had when the disk filled (a tmpfs counts pages)
    s = train_here(tmp_path / "out", f"log.tracker_dir={logs}", "train.max_steps=40", "checkpoint.every_steps=20",
                   "log.report_to=[tensorboard]", hooks=hooks)
    assert s["status"] == "completed" and s["steps"] == 40 and os.path.isdir(os.path.join(s["run_dir"], "final"))
    assert len(s["tracker_errors"]) == 1 and "No space left on device" in s["tracker_errors"][0], s["tracker_errors"]
    assert os.listdir(logs / "r")  # its events up to the fill are there (TensorBoard reads what was written)


@needs_deepspeed
def test_deepspeed_checkpoint_on_a_full_disk(small_disk, tmp_path, monkeypatch):
    """DeepSpeed's torch.save reports a full disk as 'unexpected pos' or 'iostream error': still 'disk full'.
    (The checks before the run and before the write are turned off, so the write itself meets the full disk.)"""
    from launcher.machine import diskspace
    from launcher.training import checkpoint

    mount, _ = small_disk
    disk = mount(3 * MiB)
    monkeypatch.setattr(checkpoint, "check_disk", lambda *a, **k: None)
    monkeypatch.setattr(diskspace, "refusal", lambda *a, **k: None)
    s = train_here(disk, "engine=deepspeed", "profile=zero2-fp32", "train.max_steps=2")
    assert s["status"] == "failed" and s["checkpoint"] is None and "disk full" in s["diagnosis"]
    assert os.listdir(disk / "r" / "checkpoints") == []
    _no_partials(disk / "r")


# ------------------------------------------------------------------------------------------------
# Two processes, one run directory


def test_second_process_on_a_run_directory_is_refused(tmp_path):
    args = [*RUN, "train.max_steps=100000", "checkpoint.every_steps=3", f"output_dir={tmp_path}/out", "run_name=r"]
    run = tmp_path / "out" / "r"
    with started(vramfit("train", *args), str(tmp_path / "first.log"), cwd=tmp_path) as first:
        # any complete checkpoint: with keep_last=2 a fast machine rotates step 3 away before a poll sees it
        first.wait_until(lambda: checkpoint_steps(run), "checkpoint")
        p = run_cli("train", *args, cwd=tmp_path, timeout=240)  # (a second writer would run until killed)
        refused(p.returncode, p.stderr, f"is in use by pid {first.pid} on host {socket.gethostname()}")
        first.send_signal(signal.SIGTERM)
        assert first.wait(120) == 130, first.output()[-3000:]
    steps = [json.loads(ln)["step"] for ln in open(run / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every step once
    assert not (run / "vramfit.lock").exists()
    p = run_cli("train", *args[:-3], f"train.max_steps={len(steps) + 1}", *args[-2:], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _summary(run)["resumed_from"].endswith(f"step-{len(steps):06d}")


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    args = [*RUN, "train.max_steps=100000", "checkpoint.every_steps=3", f"output_dir={tmp_path}/out", "run_name=r"]
    run = tmp_path / "out" / "r"
    with started(vramfit("train", *args), str(tmp_path / "first.log"), cwd=tmp_path) as first:
        first.wait_until(lambda: checkpoint_steps(run), "checkpoint")
        first.send_signal(signal.SIGKILL)
        first.wait(60)
    assert json.load(open(run / "vramfit.lock"))["pid"] == first.pid  # left behind
    # the newest complete checkpoint (one may have been half-written at the kill, and is not used)
    last = checkpoint_steps(run)[-1]
    p = run_cli("train", *args[:-3], f"train.max_steps={last + 2}", *args[-2:], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"taking over the lock of pid {first.pid}" in p.stderr
    s = _summary(run)
    assert s["status"] == "completed" and s["resumed_from"].endswith(f"step-{last:06d}") and s["steps"] == last + 2
    assert not (run / "vramfit.lock").exists()


# ------------------------------------------------------------------------------------------------
# Damaged DeepSpeed checkpoints


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    from launcher.config.load import load_config
    from launcher.training.loop import train

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
