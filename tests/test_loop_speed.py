"""The loop's own speed (docs/loop-speed.md): bucket sizes by rank count and memory, torch's fused AdamW under
DeepSpeed, inf/nan updates skipped on the device and a step's numbers read in one transfer, threads chosen on
purpose, one ninja for DeepSpeed's ops and a word before any build, model.compile and model.liger."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, needs_deepspeed, run_cli, run_inprocess
from launcher.config.load import load_config
from launcher.config.profiles import DS_DEFAULT_BUCKET, PROFILES, bucket_sizes, ds_config_template, resolve_ds_config
from launcher.config.schema import ConfigError
from launcher.engines.base import host_values, skip_nonfinite
from launcher.machine import deepspeed_ops, hardware, threads
from launcher.plan.families import optimizer_kind
from launcher.training.faults import Hooks

# ---- bucket sizes


def test_bucket_sizes_follow_the_rank_count():
    h = 512
    assert bucket_sizes(h, world=4, trainable=10**8)["reduce_bucket_size"] == h * h  # overlap with backward
    assert bucket_sizes(h, world=1, trainable=21_000_000)["reduce_bucket_size"] == 21_000_000  # every gradient
    assert bucket_sizes(h, world=1, trainable=7 * 10**9)["allgather_bucket_size"] == DS_DEFAULT_BUCKET  # capped
    assert bucket_sizes(h)["reduce_bucket_size"] == h * h  # no parameter count: Accelerate's rule


def test_resolved_config_has_the_profiles_bucket_and_no_optimizer_section():
    p = PROFILES["zero2-bf16-offload-opt"]
    kw = dict(micro_batch=2, accumulation=2, world=1, grad_clip=1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
              weight_decay=0.0, hidden_size=64, pin_memory=False)
    ds = resolve_ds_config(p, trainable=1_000_000, **kw)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1_000_000
    assert "optimizer" not in ds and ds["zero_force_ds_cpu_optimizer"] is False
    from dataclasses import replace

    ds = resolve_ds_config(replace(p, reduce_bucket_size=123_456), trainable=1_000_000, **kw)
    assert ds["zero_optimization"]["reduce_bucket_size"] == ds["zero_optimization"]["allgather_bucket_size"] == 123_456
    assert "optimizer" not in ds_config_template(p)


def test_planner_grows_the_bucket_into_what_the_setting_leaves():
    """One rank: the chosen setting keeps every gradient in one bucket when memory allows; with a budget just
    below that, a smaller bucket (still above hidden**2) and the same setting."""
    from launcher.plan import planner

    base = ["device=cpu", "profile=zero2-fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            "data.seq_len=64", "model.gradient_checkpointing=false"]
    hw = hardware.probe()
    row = planner.plan(load_config(None, base), hw).get("zero2-fp32")
    h = planner.plan(load_config(None, base), hw).model["hidden_size"]
    trainable = planner.plan(load_config(None, base), hw).model["trainable_params"]
    assert row.fits and row.reduce_bucket_size == trainable > h * h
    budget = (row.cpu_bytes - 1) / 2**30
    tight = planner.plan(load_config(None, [*base, f"memory.cpu_budget={budget}"]), hw).get("zero2-fp32")
    assert tight.fits and h * h <= tight.reduce_bucket_size < trainable
    assert tight.cpu_bytes <= row.cpu_bytes - 1
    assert tight.parts["cpu"]["buffers"] < row.parts["cpu"]["buffers"]  # the buffers are what shrank


def test_several_ranks_keep_hidden_squared_buckets():
    from launcher.plan import planner

    cfg = load_config(None, ["device=cpu", "profile=zero2-fp32", "train.micro_batch_size=1",
                             "train.global_batch_size=4", "data.seq_len=32"], world=2)
    plan = planner.plan(cfg, hardware.probe(), world=2)
    assert plan.get("zero2-fp32").reduce_bucket_size is None  # not the planner's choice: hidden**2


def test_optimizer_kind_is_what_the_engine_steps_with():
    assert optimizer_kind(PROFILES["zero2-bf16"], "cuda") == "torch_fused_adamw@cuda"
    assert optimizer_kind(PROFILES["zero2-bf16-offload-opt"], "cuda") == "torch_fused_adamw@cpu"
    assert optimizer_kind(PROFILES["zero3-bf16-offload-all"], "cuda") == "torch_fused_adamw@cpu"
    from dataclasses import replace

    custom = replace(PROFILES["zero2-bf16-offload-opt"], name="custom-zero2-bf16-offload-opt", ds_optimizer=True)
    assert optimizer_kind(custom, "cuda") == "deepspeed_cpu_adam@cpu"


@needs_deepspeed
def test_deepspeed_profiles_step_with_torch_fused_adamw(tmp_path):
    s, rows = run_inprocess(tmp_path, "profile=zero2-fp32", "train.max_steps=4", "checkpoint.save=false")
    assert s["status"] == "completed" and s["optimizer"] == "torch.optim.AdamW(fused=True)"
    ds = json.load(open(os.path.join(s["run_dir"], "ds_config.json")))
    assert "optimizer" not in ds and ds["zero_optimization"]["reduce_bucket_size"] > 64 * 64
    assert rows[-1]["loss"] < rows[0]["loss"]


# ---- one transfer per step; inf/nan updates skipped on the device


def test_host_values_reads_tensors_and_keeps_the_rest():
    vals = host_values([torch.tensor(1.5), torch.tensor(True), None, 2.0, torch.tensor([3.0])])
    assert vals == [1.5, True, None, 2.0, 3.0] and isinstance(vals[1], bool)


@pytest.mark.parametrize("bad", [False, True])
def test_fused_adamw_skips_a_nonfinite_update_on_the_device(bad):
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.full((4,), float("nan") if bad else 1.0)
    flag = skip_nonfinite(opt, p.grad.norm())
    opt.step()
    assert bool(flag) is bad
    assert torch.equal(p.detach(), torch.ones(4)) is bad  # untouched exactly when the norm was not finite
    assert float(opt.state[p]["step"]) == (0.0 if bad else 1.0)  # Adam's step count too
    assert skip_nonfinite(torch.optim.AdamW([p], lr=0.1, foreach=True), p.grad.norm()) is None


def test_nan_gradient_in_bf16_skips_that_update_and_training_goes_on(tmp_path):
    """A nan in one gradient at step 3 with a finite loss: AMP bf16 skips that update on the device (fused AdamW's
    found_inf), counts it as skipped, and the run completes with finite weights."""
    def poison(step, engine):
        if step == 2:
            dict(engine.module().named_parameters())["lm_head.weight"].grad.view(-1)[0] = float("nan")

    s, rows = run_inprocess(tmp_path, "profile=amp-bf16", "train.max_steps=6", "checkpoint.save=false",
                            hooks=Hooks(after_backward=poison))
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, False]
    assert rows[2]["grad_norm"] is None  # nan is written as null
    assert all(r["loss"] == r["loss"] for r in rows)


# ---- threads


def test_threads_auto_leaves_the_neighbours_cores():
    assert threads.decide("auto", 2, busy=0.1).intra_op == 2
    t = threads.decide("auto", 2, busy=1.0)
    assert t.intra_op == 1 and "busy" in t.reason
    assert threads.decide("auto", 2, busy=3.0).intra_op == 1  # at least one
    assert threads.decide(4, 2).intra_op == 4 and "more than" in threads.decide(4, 2).reason
    assert threads.decide("auto", 1).others_busy_cores is not None  # sampled when not given


def test_threads_key_is_validated_and_reported(tmp_path):
    with pytest.raises(ConfigError, match=r"train.threads: got 0; rule: must be >= 1; fix: train.threads=1"):
        load_config(None, ["train.threads=0"])
    s, _ = run_inprocess(tmp_path, "engine=amp", "train.threads=1", "train.max_steps=2", "train.warmup_steps=0",
                         "checkpoint.save=false")
    assert s["threads"]["intra_op"] == 1 and s["threads"]["reason"] == "train.threads=1"
    assert s["threads"]["data_workers"] == 0 and "wait_policy" in s["threads"]


# ---- DeepSpeed's ops: one ninja, a dry run says whether a load would compile


def _fake_op(root, name):
    d = root / name
    d.mkdir(parents=True)
    (d / "src.txt").write_text("x")
    (d / "build.ninja").write_text(f"rule cp\n  command = cp $in $out\nbuild {name}.so: cp src.txt\n")
    return d


@pytest.mark.skipif(deepspeed_ops.env_ninja() is None, reason="the ninja package is not installed")
def test_op_state_built_then_stale_then_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ninja = deepspeed_ops.env_ninja()
    d = _fake_op(tmp_path, "fake_op")
    assert deepspeed_ops.op_state("fake_op", ninja).state == "not built"
    subprocess.run([ninja], cwd=d, check=True, capture_output=True)
    st = deepspeed_ops.op_state("fake_op", ninja)
    assert st.state == "built" and not st.compiles and st.last_build_s is not None
    (d / "build.ninja").write_text("rule cp\n  command = cp -p $in $out\nbuild fake_op.so: cp src.txt\n")
    st = deepspeed_ops.op_state("fake_op", ninja)
    assert st.state == "stale" and "command line changed" in st.detail and st.compiles
    assert st.notice().startswith("building DeepSpeed op fake_op (its build is out of date")
    assert deepspeed_ops.op_state("fake_op", ninja).state == "stale"  # the dry run changed nothing


def test_use_env_ninja_puts_this_environments_ninja_first(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin" + os.pathsep + "/bin")
    found = deepspeed_ops.use_env_ninja()
    mine = deepspeed_ops.env_ninja()
    if mine is None:
        assert found == shutil.which("ninja")
    else:
        assert found == mine and shutil.which("ninja") == mine
        assert os.environ["PATH"].split(os.pathsep)[0] == os.path.dirname(mine)


def test_remember_cpu_info_probes_the_cpu_once_and_hands_out_copies(monkeypatch):
    """DeepSpeed asks py-cpuinfo for every op it loads, each call a subprocess of seconds: the first answer is
    kept for the process, and no caller can change what the next one gets."""
    import types

    calls = []

    def probe():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    fake = types.ModuleType("cpuinfo")
    fake.get_cpu_info = probe
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    deepspeed_ops.remember_cpu_info()
    deepspeed_ops.remember_cpu_info()  # a second call keeps the first wrapper
    first = fake.get_cpu_info()
    first["arch"] = "changed by a caller"
    first["flags"].append("avx512f")  # what is inside too
    assert fake.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]}
    assert len(calls) == 1


def test_ops_a_deepspeed_engine_loads():
    from launcher.engines.deepspeed import ops_loaded

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert ops_loaded({"zero_optimization": {}}, cpu) == ["deepspeed_shm_comm"]
    assert ops_loaded({"zero_optimization": {}}, gpu) == []  # torch's fused AdamW: nothing to compile
    own = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert ops_loaded(own, gpu) == ["cpu_adam"]
    assert ops_loaded({"optimizer": {"type": "AdamW"}}, gpu) == ["fused_adam"]


def test_doctor_reports_compilers_ninja_ops_and_threads():
    r = run_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert set(doc["compilers"]) == {"cxx", "nvcc"} and doc["ninja"].startswith("ninja")
    assert doc["threads"]["intra_op"] >= 1 and "wait_policy" in doc["threads"]
    if doc["deepspeed"]:
        assert all(v["state"] in ("installed", "built", "stale", "not built") for v in doc["ops"].values())


@pytest.mark.slow
@pytest.mark.extended  # a fresh JIT cache: by hand (CI's time box)
@needs_deepspeed
def test_op_entry_points_reuse_one_build(tmp_path):
    """``vramfit train``, ``python -m launcher``, ``deepspeed launcher/run.py`` and ``vramfit bench`` one after
    another, each started with the system's PATH (which finds another ninja than the environment's, where both
    exist): the first may build DeepSpeed's shared-memory op, none after it compiles anything."""
    from launcher.engines.deepspeed import ops_loaded

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = ["device=cpu", "profile=zero2-fp32", "train.max_steps=2", "data.seq_len=32", "train.micro_batch_size=2",
           "train.global_batch_size=4", "sample_tokens=0", "checkpoint.save=false", f"output_dir={tmp_path}"]
    bindir = os.path.dirname(sys.executable)
    starts = [[os.path.join(bindir, "vramfit"), "train", *run, "run_name=a"],
              [sys.executable, "-m", "launcher", "train", *run, "run_name=b"],
              [os.path.join(bindir, "deepspeed"), "launcher/run.py", *run, "run_name=c"],
              [os.path.join(bindir, "vramfit"), "bench", *run, "--profiles", "zero2-fp32", "--steps", "1",
               "--warmup", "1", "--out", str(tmp_path / "bench")]]

    def logs():
        root = deepspeed_ops.op_cache_dir()
        return {op: open(os.path.join(root, op, ".ninja_log")).read() if os.path.exists(
            os.path.join(root, op, ".ninja_log")) else "" for op in ops_loaded({}, torch.device("cpu"))}

    for i, cmd in enumerate(starts):
        before = logs()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, (cmd, p.stderr[-3000:])
        if i:  # the first start may build what was missing; every later one reuses it
            assert logs() == before, f"{cmd[:2]} rebuilt an op"
            assert "building DeepSpeed op" not in p.stderr


# ---- model.compile and model.liger


def test_liger_is_refused_where_it_cannot_run():
    from launcher.model import kernels

    cfg = load_config(None, ["model.liger=true", "model.compile=true"])
    [found] = kernels.problems(cfg, "cpu")
    assert found.startswith("model.liger: got true on device cpu; rule: Liger's kernels are Triton kernels for CUDA")
    assert "fix: model.liger=false" in found
    assert kernels.problems(load_config(None, []), "cpu") == []


def _compile_hw(deepspeed="0.19.8"):
    from launcher.machine.hardware import Hardware

    return Hardware(gpus=[], ram_total_bytes=32 << 30, ram_available_bytes=32 << 30, deepspeed=deepspeed,
                    bitsandbytes=None)


def test_compile_with_engine_auto_picks_a_path_that_compiles():
    """One home for "can this run": model.compile rules DeepSpeed out in availability, so engine=auto on a host
    with DeepSpeed picks AMP instead of choosing a ZeRO profile and refusing it later."""
    from launcher.plan import availability
    from launcher.plan.resolve import resolve

    def engines(*overrides):
        return {p.engine for p in availability.assess(load_config(None, list(overrides)), _compile_hw()).usable()}

    assert "deepspeed" in engines()  # the same host can run DeepSpeed when nothing rules it out
    assert "deepspeed" not in engines("model.compile=true")
    spec = resolve(load_config(None, ["model.compile=true"]), _compile_hw())
    assert spec.engine == "amp", spec
    assert any("model.compile=true" in r for r in spec.reasons), spec.reasons


@pytest.mark.parametrize("asked,fix", [("engine=deepspeed", "fix: engine=auto"),
                                       ("profile=zero2-fp32", "fix: profile=amp-fp32")])
def test_compile_on_deepspeed_is_refused_with_the_fix(asked, fix):
    from launcher.plan.resolve import resolve

    with pytest.raises(ConfigError) as e:
        resolve(load_config(None, ["model.compile=true", asked]), _compile_hw())
    assert "model.compile=true compiles the model on the AMP and FSDP paths only" in str(e.value)
    assert fix in str(e.value)
    fixed = resolve(load_config(None, ["model.compile=true", fix.removeprefix("fix: ")]), _compile_hw())
    assert fixed.engine == "amp"


def test_liger_on_the_cpu_stops_before_the_run_directory(tmp_path):
    with pytest.raises(ConfigError, match="model.liger: got true on device cpu"):
        run_inprocess(tmp_path, "engine=amp", "model.liger=true", "run_name=liger")
    assert not (tmp_path / "liger").exists()


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("engine", ["amp", "fsdp"])
def test_compiled_layers_train_like_plain_ones(tmp_path, engine):
    """model.compile=true on the CPU (inductor, about a minute of compilation on 2 cores): the same loss curve as
    the uncompiled model within 1e-3 relative (fused kernels reorder float arithmetic)."""
    from helpers import compare, losses
    from launcher.model.structure import decoder_layers
    from launcher.training.faults import Hooks

    compiled = []  # per run: whether each decoder layer of the engine's model is compiled (the curves agree anyway)

    def look(step, engine):
        if step == 1:
            compiled.append([layer._compiled_call_impl is not None for layer in decoder_layers(engine.module())])

    run = [f"engine={engine}", "train.max_steps=6", "train.warmup_steps=2", "checkpoint.save=false"]
    s, rows = run_inprocess(tmp_path, *run, "model.compile=true", "run_name=on", hooks=Hooks(before_step=look))
    _, ref = run_inprocess(tmp_path, *run, "run_name=off", hooks=Hooks(before_step=look))
    assert s["status"] == "completed"
    assert compiled[0] and all(compiled[0]) and not any(compiled[1]), compiled
    mx, _ = compare(losses(rows), losses(ref), f"{engine} compiled vs plain")
    assert mx < 1e-3
