"""fp16 with dynamic loss scaling, the mission's headline, on every engine and on the CPU: DeepSpeed's fp16
profiles against torch AMP + GradScaler with overflows injected at chosen steps (the same steps skipped, the
same loss scale step by step, loss curves within a stated tolerance), the stop at the minimum scale, the scale
carried through an OOM-ladder rebuild and restored by a resume.

DeepSpeed's CPU accelerator refuses fp16; the ``deepspeed_fp16_on_cpu`` fixture (tests/conftest.py) lets it run
here, so none of this waits for a GPU. Both paths move the scale by DeepSpeed's rule
(launcher.engines.base.LossScaler): with ``loss_scale.initial_power=4`` (16), ``window=3`` and the default
``hysteresis=2``, overflows at steps 3, 4 and 8 (1-based) give the scales below. GradScaler's own rule would
give 16, 16, 8, 4, 4, 4, 8, 4, ... (no hysteresis, growth one step earlier), and a broken readout none.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from helpers import compare, losses, needs_deepspeed, oom_hook, overflow_at, run_inprocess
from launcher.training.faults import Hooks

OVERFLOWS = {2, 3, 7}  # 0-based steps, as the hooks count them
EXPECTED_SCALES = [16, 16, 16, 8, 8, 8, 8, 4, 4, 4, 4, 8]
EXPECTED_SKIPPED = [i in OVERFLOWS for i in range(12)]
FP16 = ["precision=fp16", "train.max_steps=12", "train.warmup_steps=2", "loss_scale.initial_power=4",
        "loss_scale.window=3", "checkpoint.every_steps=4"]
# DeepSpeed fp16 keeps the weights, the residual stream and the norms in fp16; AMP keeps fp32 weights and runs the
# matmuls in fp16 under autocast. Measured on this tiny model: max 1.8e-4, mean 6.3e-5 relative over 12 steps.
FP16_TOL_MAX, FP16_TOL_MEAN = 3e-3, 1e-3


@needs_deepspeed
def test_the_scale_rule_is_deepspeeds():
    """The torch engines' scale rule against DeepSpeed's own DynamicLossScaler, on random overflow sequences
    over random windows, hysteresis, start and floor: the same scale after every step."""
    from deepspeed.runtime.fp16 import loss_scaler

    from launcher.engines.base import ScaleRule

    rng = random.Random(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)  # it logs each overflow from rank 0
        for _ in range(200):
            window, hysteresis, floor = rng.randint(1, 5), rng.randint(1, 3), float(2 ** rng.randint(0, 2))
            start = max(float(2 ** rng.randint(0, 8)), floor)
            ds = loss_scaler.DynamicLossScaler(start, window, floor, hysteresis, False, raise_error_at_min_scale=False)
            ours = ScaleRule(start, window, hysteresis, floor)
            for _ in range(60):
                overflow = rng.random() < 0.3
                ds.update_scale(overflow)
                assert ours.update(overflow) == ds.cur_scale


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """profile -> (summary, metrics rows) of the FP16 run with OVERFLOWS injected, made once per profile (a
    DeepSpeed profile by a test that asked for ``deepspeed_fp16_on_cpu``)."""
    root, made = tmp_path_factory.mktemp("fp16"), {}

    def run(profile):
        if profile not in made:
            made[profile] = run_inprocess(root, f"profile={profile}", f"run_name={profile}", *FP16,
                                          hooks=overflow_at(OVERFLOWS))
        return made[profile]
    return run


def check_fp16_run(summary, rows):
    assert summary["status"] == "completed" and summary["precision"] == "fp16"
    assert [r["loss_scale"] for r in rows] == EXPECTED_SCALES
    assert [r["skipped"] for r in rows] == EXPECTED_SKIPPED
    assert summary["skipped_steps"] == len(OVERFLOWS) and summary["loss_scale"] == EXPECTED_SCALES[-1]


def test_amp_fp16_follows_the_scale_rule(runs):
    check_fp16_run(*runs("amp-fp16"))


@pytest.mark.parametrize("profile", ["zero2-fp16",
                                     pytest.param("zero2-fp16-offload-opt", marks=pytest.mark.slow),
                                     pytest.param("zero3-fp16-offload-all", marks=pytest.mark.slow)])
def test_deepspeed_fp16_matches_amp_fp16(deepspeed_fp16_on_cpu, runs, profile):
    """Each DeepSpeed fp16 profile of the catalogue against AMP fp16 + GradScaler: the injected overflows are
    skipped on both, the loss scale is the same at every step, and the loss curves agree within the tolerance."""
    s, rows = runs(profile)
    check_fp16_run(s, rows)
    assert s["engine"] == "deepspeed" and s["profile"] == profile
    assert "fp16" in open(os.path.join(s["run_dir"], "ds_config.json")).read()
    mx, mean = compare(losses(rows), losses(runs("amp-fp16")[1]), f"{profile} vs amp-fp16")
    assert mx <= FP16_TOL_MAX and mean <= FP16_TOL_MEAN


@pytest.mark.extended  # a fresh environment JIT-builds async_io first (tests/test_nvme.py)
@pytest.mark.parametrize("profile", ["zero3-fp16-offload-nvme-opt", "zero3-fp16-offload-nvme-all"])
def test_deepspeed_fp16_on_nvme(deepspeed_fp16_on_cpu, runs, tmp_path, profile):
    from launcher.machine.deepspeed_ops import async_io_status

    if async_io_status() != "usable":
        pytest.skip(f"DeepSpeed's async_io op is {async_io_status()}: NVMe offload cannot run here")
    s, rows = run_inprocess(tmp_path, f"profile={profile}", "run_name=nvme", *FP16, f"memory.nvme_path={tmp_path}",
                            hooks=overflow_at(OVERFLOWS))
    check_fp16_run(s, rows)
    mx, mean = compare(losses(rows), losses(runs("amp-fp16")[1]), f"{profile} vs amp-fp16")
    assert mx <= FP16_TOL_MAX and mean <= FP16_TOL_MEAN


def sigterm_after(step_to_stop, then: Hooks) -> Hooks:
    return Hooks(before_step=then.before_step,
                 after_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == step_to_stop else None)


@pytest.mark.parametrize("profile", [pytest.param("amp-fp16", marks=pytest.mark.slow),
                                     pytest.param("zero2-fp16", marks=needs_deepspeed)])
def test_sigterm_then_resume_restores_the_loss_scale(request, runs, tmp_path, profile):
    """Stopped by SIGTERM after step 6 (after two overflows: scale 8, hysteresis used up), resumed: the scale,
    the hysteresis and the growth window come back with the checkpoint, so the resumed run skips and scales
    exactly as the uninterrupted one, and its losses are the same."""
    if profile.startswith("zero"):
        request.getfixturevalue("deepspeed_fp16_on_cpu")
    cut, _ = run_inprocess(tmp_path, f"profile={profile}", "run_name=cut", *FP16,
                           hooks=sigterm_after(6, overflow_at(OVERFLOWS)))
    assert cut["status"] == "interrupted" and cut["steps"] == 6 and cut["loss_scale"] == 8
    again, rows = run_inprocess(tmp_path, f"profile={profile}", "run_name=cut", *FP16, hooks=overflow_at(OVERFLOWS))
    assert again["resumed_from"].endswith("step-000006")
    check_fp16_run(again, rows)
    mx, _ = compare(losses(rows), losses(runs(profile)[1]), f"{profile} resumed vs uninterrupted")
    assert mx == 0.0


@needs_deepspeed
def test_min_scale_stop_on_deepspeed_fp16(deepspeed_fp16_on_cpu, tmp_path):
    """Every step from the third overflows: DeepSpeed's scale goes 8, 8, 8 (hysteresis), 4, 2, 1 and sits at
    the floor; after loss_scale.patience=3 overflows there the run stops as documented (docs/reliability.md):
    status failed, a checkpoint of the last state, a diagnosis, no final/, and DeepSpeed's own exception at the
    minimum scale never raised."""
    s, rows = run_inprocess(tmp_path, "profile=zero2-fp16", "run_name=floor", "loss_scale.initial_power=3",
                            "loss_scale.patience=3", "train.max_steps=50", hooks=overflow_at(set(range(2, 50))))
    assert [r["loss_scale"] for r in rows] == [8, 8, 8, 4, 2, 1, 1, 1]
    assert [r["skipped"] for r in rows] == [False, False] + [True] * 6
    assert s["status"] == "failed" and s["steps"] == 8 and s["skipped_steps"] == 6 and s["loss_scale"] == 1
    assert "overflowed at the minimum loss scale 1" in s["diagnosis"] and "precision=bf16" in s["diagnosis"]
    assert os.path.isdir(s["checkpoint"]) and s["checkpoint"].endswith("step-000008")
    assert not os.path.exists(os.path.join(s["run_dir"], "final"))


@needs_deepspeed
@pytest.mark.slow
def test_oom_ladder_carries_the_scale_on_deepspeed_fp16(deepspeed_fp16_on_cpu, runs, tmp_path):
    """An OOM at step 6 on zero2-fp16 (scale 8 after the overflows at steps 3 and 4) halves the micro-batch,
    which rebuilds the DeepSpeed engine: the new one starts at the scale the old one had reached (8, not the
    configured 16), and from there scales and skips as the run that never moved. What a rebuild does not carry
    is DeepSpeed's hysteresis count and growth window, which start afresh: no overflow or growth falls
    between the move and the next overflow at step 8 here, which halves the scale on both runs because the
    carried scale was already reduced."""
    both = overflow_at(OVERFLOWS)
    oom = oom_hook([5])

    def before_step(step, engine):
        both.before_step(step, engine)
        oom.before_step(step, engine)

    s, rows = run_inprocess(tmp_path, "profile=zero2-fp16", "run_name=ladder", *FP16,
                            hooks=Hooks(before_step=before_step))
    assert s["status"] == "completed" and s["micro_batch"] == 1, s["fallbacks"]
    assert [f["to"]["micro_batch"] for f in s["fallbacks"]] == [1]
    scales = [r["loss_scale"] for r in rows]
    assert scales[:8] == EXPECTED_SCALES[:8], scales
    mx, _ = compare(losses(rows), losses(runs("zero2-fp16")[1]), "zero2-fp16 after an OOM vs without")
    assert mx <= FP16_TOL_MAX


@pytest.mark.gpu
@pytest.mark.parametrize("profile", ["amp-fp16", pytest.param("zero2-fp16", marks=needs_deepspeed)])
def test_fp16_on_a_gpu(tmp_path, profile):
    """On a CUDA GPU (no fixture: DeepSpeed runs fp16 there): the same injected overflows give the same skipped
    steps and loss scales as on the CPU, on both paths, and the loss falls."""
    s, rows = run_inprocess(tmp_path, f"profile={profile}", "run_name=g", *FP16, "device=cuda",
                            hooks=overflow_at(OVERFLOWS))
    check_fp16_run(s, rows)
    assert s["device"].startswith("cuda") and s["peak_gpu_bytes"] > 0
    assert s["final_loss"] < s["first_loss"]
