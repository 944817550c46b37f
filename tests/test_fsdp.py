"""The FSDP2 engine on CPU: parity with AMP and DeepSpeed offload, fp16 loss scaling, resume, several ranks,
the engine choice when DeepSpeed is missing.

The catalogue has FSDP profiles in fp16 and bf16 only (DESIGN.md: FSDP is the 16-bit offload path). Parity
to 1e-4 needs fp32, so the fp32 checks register a test-only ``fsdp-fp32-offload`` profile for this module:
the whole loop (resolve, engine, checkpoints, final weights) then runs the same FsdpEngine as the shipped
profiles, with ``MixedPrecisionPolicy(param_dtype=None)`` as the only difference.
"""

import json
import os
import signal

import pytest
import torch

from helpers import FAST, ROOT, compare, losses, needs_deepspeed, run_cli, run_inprocess
from helpers.procs import torchrun
from launcher.config.profiles import PROFILES, Profile

FP32 = "fsdp-fp32-offload"
FP32_PROFILE = Profile(FP32, "fsdp", "fp32", offload_optimizer=True, offload_param=True, speed_rank=3)
# bf16 and fp16 are emulated on CPUs without AVX512-BF16/FP16 (3x slower than fp32 here): 20 steps, not 24.
BF16 = ["train.max_steps=20"]
# Resume, OOM and several-rank checks compare runs of one engine (or of two that parity shows equal): 8 steps
# of micro-batch 2 x accumulation 2 are enough there.
SHORT = [f"profile={FP32}", "train.global_batch_size=4", "train.max_steps=8", "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name, *overrides) -> (summary, rows), each run once per module (several tests compare to it)."""
    root = tmp_path_factory.mktemp("fsdp")
    cache = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PROFILES, FP32, FP32_PROFILE)

        def get(name, *overrides, hooks=None):
            if name not in cache:
                cache[name] = run_inprocess(root, f"run_name={name}", *overrides, hooks=hooks)
            return cache[name]

        get.root = root
        yield get


def test_parity_fp32_fsdp_vs_amp(runs):
    """Same seed, data, schedule, micro-batch 2 x accumulation 4: FSDP (fp32 shards, fp32 reduce, CPU fused
    AdamW) computes what AMP computes, so every step agrees to 1e-4 relative; the final
    weights, gathered from the shards and written with save_pretrained, load as the plain HF model."""
    a, ra = runs("amp-fp32", "profile=amp-fp32")
    f, rf = runs("fsdp-fp32", f"profile={FP32}")
    assert f["engine"] == "fsdp" and f["accumulation"] == 4 and len(rf) == 24 and f["status"] == "completed"
    assert f["optimizer"] == "torch.optim.AdamW(fused=True) on cpu"
    mx, mean = compare(losses(rf), losses(ra), "fsdp-fp32 vs amp-fp32 loss")
    assert mx < 1e-4
    mx, _ = compare([r["grad_norm"] for r in rf], [r["grad_norm"] for r in ra], "fsdp-fp32 vs amp-fp32 grad norm")
    assert mx < 1e-4
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(f["run_dir"], "final", "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # not the FSDPLlamaForCausalLM wrapper class
    wf = load_file(os.path.join(f["run_dir"], "final", "model.safetensors"))
    wa = load_file(os.path.join(a["run_dir"], "final", "model.safetensors"))
    assert wf.keys() == wa.keys()
    worst = max(float((wf[k] - wa[k]).abs().max()) for k in wf)
    print(f"final weights: max abs diff {worst:.2e}")
    assert worst < 1e-4


def test_parity_bf16_fsdp_vs_amp(runs):
    """bf16: FSDP's MixedPrecisionPolicy casts whole modules (weights and the residual stream in bf16, like
    DeepSpeed bf16), AMP's autocast casts per op (residual stream fp32). bf16 has 8 bits of mantissa
    (relative step 2**-8 = 0.4%); the curves drift by less than a few such steps: 1e-2 max, 5e-3 mean over 24
    steps (the test prints the measured differences)."""
    _, ra = runs("amp-bf16", "profile=amp-bf16", *BF16)
    f, rf = runs("fsdp-bf16", "profile=fsdp-bf16-offload", *BF16)
    assert f["engine"] == "fsdp" and f["precision"] == "bf16" and f["skipped_steps"] == 0
    mx, mean = compare(losses(rf), losses(ra), "fsdp-bf16-offload vs amp-bf16")
    assert mx < 1e-2 and mean < 5e-3
    assert rf[-1]["loss"] < rf[0]["loss"] - 1.0


@pytest.mark.slow
@needs_deepspeed
def test_parity_bf16_fsdp_vs_deepspeed_offload(runs):
    """Both offload paths keep fp32 masters and Adam moments on the CPU and compute in bf16; DeepSpeed's step
    is torch's fused AdamW as DeepSpeed's client optimizer on the CPU masters, FSDP's the same. Same bound as
    against AMP."""
    d, rd = runs("zero2-bf16-offload", "profile=zero2-bf16-offload-opt", *BF16)
    _, rf = runs("fsdp-bf16", "profile=fsdp-bf16-offload", *BF16)
    assert d["optimizer"] == "torch.optim.AdamW(fused=True)"  # no op to build, as summary.json says
    mx, mean = compare(losses(rf), losses(rd), "fsdp-bf16-offload vs zero2-bf16-offload-opt")
    assert mx < 1e-2 and mean < 5e-3


def test_fp16_loss_scale_matches_amp(tmp_path):
    """fp16 on the CPU through FSDP2 + torch.amp.GradScaler: an inf written into one gradient at chosen steps
    (after backward, into this rank's shard) must skip exactly those steps and move the scale exactly as on
    the AMP path: same numbers (init 2**power, window, hysteresis, backoff 0.5), same trajectory, step by step
    (DeepSpeed's rule, launcher.engines.base.LossScaler; DeepSpeed itself against AMP: tests/test_fp16.py).
    Scale 2**10 and window 2 keep the scale far below where this model's fp16 gradients overflow by themselves
    (2**17 in a run without injection), so only the injected steps overflow. The trajectory grows after 3 clean
    steps, the first overflow only uses up the hysteresis (2), the second halves, it grows again and the next
    overflow uses up the refilled hysteresis."""
    from launcher.training.faults import Hooks

    bad = {3, 4, 9}  # 0-based optimizer steps

    def after_backward(step, engine):
        if step in bad:
            g = dict(engine.module().named_parameters())["model.layers.1.mlp.down_proj.weight"].grad
            g = g.to_local() if hasattr(g, "to_local") else g  # FSDP: the DTensor's local shard
            with torch.no_grad():
                g.view(-1)[0] = float("inf")

    over = ["loss_scale.initial_power=10", "loss_scale.window=2", "train.max_steps=12", "train.warmup_steps=2"]
    want = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048, 2048, 2048, 2048, 2048]
    got = {}
    for prof in ("amp-fp16", "fsdp-fp16-offload"):
        s, rows = run_inprocess(tmp_path, f"profile={prof}", f"run_name={prof}", *over,
                                hooks=Hooks(after_backward=after_backward))
        assert s["status"] == "completed" and s["skipped_steps"] == len(bad)
        assert [r["step"] - 1 for r in rows if r["skipped"]] == sorted(bad), prof
        assert [r["loss_scale"] for r in rows] == want, (prof, [r["loss_scale"] for r in rows])
        got[prof] = rows
    print("loss scale trajectory:", want)
    mx, mean = compare(losses(got["fsdp-fp16-offload"]), losses(got["amp-fp16"]), "fsdp-fp16 vs amp-fp16")
    # fp16 has 11 bits of mantissa, but FSDP keeps the residual stream in fp16 and autocast in fp32: as bf16.
    assert mx < 1e-2 and mean < 5e-3


def test_resume_matches_uninterrupted(runs):
    """SIGTERM at step 4 of 8: the loop finishes the step and writes a DCP checkpoint (model and AdamW shards
    per rank, scaler and client state beside them); the next run with the same run_name resumes it and the
    whole curve equals the uninterrupted run."""
    from launcher.training.faults import Hooks

    _, full = runs("fsdp-fp32-short", *SHORT)
    stop = Hooks(after_step=lambda step: step == 4 and os.kill(os.getpid(), signal.SIGTERM))
    cut, _ = runs("fsdp-fp32-cut", *SHORT, hooks=stop)
    assert cut["status"] == "interrupted" and cut["steps"] == 4
    ck = cut["checkpoint"]
    assert {".metadata", "engine-rank00000.pt", "vramfit.json"} <= set(os.listdir(ck))
    s, rows = run_inprocess(runs.root, "run_name=fsdp-fp32-cut", *SHORT)
    assert s["status"] == "completed" and s["resumed_from"] == ck
    assert [r["step"] for r in rows] == list(range(1, 9))
    mx, _ = compare(losses(rows), losses(full), "fsdp-fp32 resumed at 4 vs uninterrupted")
    assert mx < 1e-6


def oom_in_backward(at_steps):
    """Raise a fake OOM in the backward of decoder layer 2 during the second micro-batch of each step in
    ``at_steps``: FSDP is then mid-iteration (some units reduced, the embeddings not, the end-of-backward
    callback never run) and the step is half accumulated."""
    from launcher.training.faults import Hooks

    pending = list(at_steps)

    def before_step(step, engine):
        if not pending or pending[0] != step:
            return
        pending.pop(0)
        calls = {"n": 0}

        def after_forward(_mod, _args, out):
            calls["n"] += 1
            if calls["n"] == 2:
                handle.remove()

                def boom(_grad):
                    raise torch.OutOfMemoryError("CUDA out of memory (injected by test)")

                (out[0] if isinstance(out, tuple) else out).register_hook(boom)

        handle = engine.module().model.layers[2].register_forward_hook(after_forward)

    return Hooks(before_step=before_step)


def test_oom_in_backward_halves_micro_batch_and_keeps_the_math(runs):
    """The OOM ladder on FSDP: an OOM inside backward halves the micro-batch (2 -> 1, accumulation 2 -> 4);
    the engine drops the half step and puts FSDP back to idle, so the curve is the run that kept micro-batch
    2 (fp32: 1e-5; without the reset the embeddings stop receiving gradients and the
    curves part by ~9%)."""
    _, ref = runs("fsdp-fp32-short", *SHORT)
    s, rows = runs("fsdp-fp32-oom", *SHORT, hooks=oom_in_backward([2]))
    assert s["status"] == "completed" and [r["micro_batch"] for r in rows[:4]] == [2, 2, 1, 1]
    assert [(f["to"]["micro_batch"], f["step"]) for f in s["fallbacks"]] == [(1, 3)]
    mx, _ = compare(losses(rows), losses(ref), "fsdp-fp32 after an OOM in backward vs micro-batch 2 throughout")
    assert mx < 1e-5


def test_oom_ladder_moves_amp_to_fsdp_with_its_state(runs):
    """AMP at micro-batch 1 with checkpointing has nothing left but more offload: the ladder moves to the FSDP
    profile of the same precision, carrying fp32 weights, Adam moments and step count (portable_state ->
    load_portable_state, sharded on the way in). fp32 AMP and FSDP compute the same (see the parity test),
    so the curve is the FSDP run's throughout (1e-4)."""
    _, ref = runs("fsdp-fp32-short", *SHORT)
    s, rows = runs("amp-to-fsdp", *SHORT, "profile=amp-fp32", "train.micro_batch_size=1",
                   "model.gradient_checkpointing=true", hooks=oom_in_backward([3]))
    assert s["status"] == "completed" and s["engine"] == "fsdp" and s["profile"] == FP32
    assert [(f["from"]["profile"], f["to"]["profile"], f["step"]) for f in s["fallbacks"]] == [("amp-fp32", FP32, 4)]
    mx, _ = compare(losses(rows), losses(ref), "amp-fp32 moved to fsdp-fp32 at step 4 vs fsdp-fp32")
    assert mx < 1e-4


@pytest.mark.slow
@pytest.mark.extended
def test_two_ranks_match_one_rank(runs, tmp_path):
    """2 ranks (gloo) x micro-batch 1 x accumulation 2 shard every parameter, gradient and Adam moment in two
    and see half of each global batch: the math is that of 1 rank x micro-batch 2 x accumulation 2, so fp32
    curves agree to 1e-5. Gradient checkpointing is on for the 2 ranks (recompute is
    exact in fp32) so that FSDP's unshard during recompute is covered too."""
    one, one_rows = runs("fsdp-fp32-short", *SHORT)
    assert one["accumulation"] == 2
    entry = tmp_path / "entry.py"  # launcher/run.py with the test-only fp32 profile registered
    entry.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom launcher.config.profiles import PROFILES, Profile\n"
                     f"PROFILES[{FP32!r}] = {FP32_PROFILE!r}\nfrom launcher.cli import main\n"
                     "sys.exit(main(['train', *sys.argv[1:]]))\n")
    r = torchrun(2, str(entry), *FAST, *SHORT, "train.micro_batch_size=1", "device=cpu",
                 "model.gradient_checkpointing=true", f"output_dir={tmp_path}", "run_name=two")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    s = json.load(open(tmp_path / "two" / "summary.json"))
    assert s["world_size"] == 2 and s["micro_batch"] == 1 and s["accumulation"] == 2 and s["engine"] == "fsdp"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(s["checkpoint"]))  # each rank wrote its shards
    two = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    mx, _ = compare(losses(two), losses(one_rows), "fsdp-fp32: 2 ranks x micro 1 vs 1 rank x micro 2")
    assert mx < 1e-5


def test_auto_picks_fsdp_when_deepspeed_missing_and_offload_needed():
    """The engine choice as it happens on a GPU host, with the hardware probe's answer simulated (8 GB Ampere
    card, 20 GB RAM; a CPU host cannot need offload: with no GPU there is nothing to offload from). llama-350m
    needs ~6 GiB in AMP: more than the 2 GiB budget. With DeepSpeed installed its optimizer offload is the
    fastest that fits; without it, FSDP offload, and the reasons say why (the planner's numbers and
    DeepSpeed's absence)."""
    from launcher.config.load import load_config
    from launcher.machine.hardware import GPUInfo, probe
    from launcher.plan.resolve import resolve
    from launcher.units import GiB

    hw = probe()
    hw.gpus = [GPUInfo(0, "simulated RTX 3070", 8 * GiB, 8 * GiB, (8, 6), fp16=True, bf16=True)]
    hw.ram_total_bytes = hw.ram_available_bytes = 20 * GiB
    cfg = lambda: load_config(None, ["model.name=llama-350m", "memory.gpu_budget=2", "data.seq_len=256",  # noqa: E731
                                     "train.micro_batch_size=1", "train.global_batch_size=8"])
    hw.deepspeed, hw.deepspeed_error = "0.19.8", None
    with_ds = resolve(cfg(), hw)
    assert with_ds.profile.name == "zero2-bf16-offload-opt", with_ds.reasons
    hw.deepspeed, hw.deepspeed_error = None, "is not installed (pip install 'vramfit[deepspeed]')"
    res = resolve(cfg(), hw)
    assert res.profile.name == "fsdp-bf16-offload", res.reasons
    text = " | ".join(res.reasons)
    assert "amp-bf16" in text and "budget" in text, text  # AMP does not fit: the planner says so
    assert "engine fsdp, not DeepSpeed: DeepSpeed is not installed" in text, text


@pytest.mark.slow
def test_fsdp_trains_with_deepspeed_unimportable(tmp_path, no_deepspeed_path):
    """The FSDP engine never imports DeepSpeed: with DeepSpeed unimportable (as if not installed) it trains,
    and summary.json says which engine, optimizer and why."""
    r = run_cli("train", *FAST, "train.max_steps=2", "train.warmup_steps=1", "profile=fsdp-bf16-offload",
                "device=cpu", f"output_dir={tmp_path}", "run_name=nods",
                env={"PYTHONPATH": no_deepspeed_path + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.load(open(tmp_path / "nods" / "summary.json"))
    assert s["engine"] == "fsdp" and s["status"] == "completed" and s["steps"] == 2
    assert s["optimizer"] == "torch.optim.AdamW(fused=True) on cpu"
    assert "profile fsdp-bf16-offload as asked" in s["reasons"]
    # the CPU computes a step that gathers each layer: big blocks go back to the system (launcher/machine/heap.py)
    assert "heap: CPU blocks of 4 MiB and more go back" in r.stderr and "gathers each layer's" in r.stderr, r.stderr


def test_oom_ladder_carries_the_fp16_loss_scale(runs):
    """amp-fp16 -> amp-fp16-offload-opt -> fsdp-fp16-offload: each new engine starts at the scale the old one had
    reached (the scale doubles every 2 clean steps here), not at 2**initial_power again, so no steps are skipped
    finding it."""
    fp16 = ["train.global_batch_size=4", "train.max_steps=6", "train.warmup_steps=2", "loss_scale.initial_power=4",
            "loss_scale.window=2", "precision=fp16"]
    s, rows = runs("amp-fp16-to-fsdp", *fp16, "profile=amp-fp16", "train.micro_batch_size=1",
                   "model.gradient_checkpointing=true", hooks=oom_in_backward([3, 4]))
    assert s["status"] == "completed" and s["profile"] == "fsdp-fp16-offload", s["fallbacks"]
    assert [f["to"]["profile"] for f in s["fallbacks"]] == ["amp-fp16-offload-opt", "fsdp-fp16-offload"]
    scales = [r["loss_scale"] for r in rows]
    assert s["skipped_steps"] == 0 and scales[2] > 16, scales
    assert scales[4] >= scales[3] >= scales[2], scales  # after each move: carried (a fresh scaler would be at 16)
