"""The step-time model and the search it drives: what it adds up, and that the planner picks the fastest
predicted setting that fits (over profiles, micro-batches and every-k-th-layer checkpointing).

The machines here are made up (round numbers), so the tests check the model's arithmetic and the search, not
this CPU's speed; scripts/validate_steptime.py measures the predictions against real steps."""

import dataclasses
import os

import pytest
from test_planner import fake_hw

from helpers import run_inprocess
from launcher.config.load import load_config
from launcher.config.profiles import PROFILES
from launcher.model.presets import preset_config
from launcher.plan import planner, steptime
from launcher.plan.families import family_of
from launcher.plan.memory.estimate import estimate_activations
from launcher.plan.memory.trace import TraceSettings
from launcher.plan.rows import ProfilePlan, simplest_within_error


def machine(device="cuda", op_s=2e-6, matmul=100e12, bw=1e12) -> steptime.Machine:
    rates = steptime.Rates(device=device, matmul={"float32": [[1.0, matmul]], "bfloat16": [[1.0, matmul]],
                                                  "float16": [[1.0, matmul]]},
                           attention={}, memory_bytes_per_s=bw, op_s=op_s, view_s=op_s / 10)
    host = steptime.Rates(device="cpu", matmul={"float32": [[1.0, 1e11]]}, memory_bytes_per_s=2e10, op_s=5e-6,
                          view_s=1e-6)
    return steptime.Machine(name="test", source="made up for the test", compute=rates, host=host,
                            h2d_bytes_per_s={"pinned": 2e10, "pageable": 1e10},
                            d2h_bytes_per_s={"pinned": 2e10, "pageable": 1e10},
                            optimizers={"torch_fused_adamw@cuda": [3e-11, 1e-5], "torch_fused_adamw@cpu": [5e-9, 1e-5],
                                        "deepspeed_cpu_adam@cpu": [5e-9, 1e-5],
                                        "deepspeed_fused_adam@cuda": [3e-11, 1e-5]},
                            engines={"amp": {"micro_s": 1e-3, "micro_tensor_s": 0, "step_s": 1e-3, "step_tensor_s": 1e-6}},
                            threads=2)


def ops(micro=2, seq=64, ckpt=False, every=1):
    s = TraceSettings(batch_size=micro, seq_len=seq, gradient_checkpointing=ckpt, checkpoint_every=every,
                      attention_kernel="flash")
    return estimate_activations(preset_config("tiny"), s).ops


def counts():
    from launcher.plan.memory.shape import count_params

    return count_params(preset_config("tiny"))


def test_parts_add_up_and_scale():
    m = machine()
    one = steptime.predict(PROFILES["amp-bf16"], m, ops=ops(), counts=counts(), micro_batch=2, accumulation=1, seq_len=64)
    assert sum(one.parts.values()) == pytest.approx(one.step_s)
    assert one.tokens_per_s == pytest.approx(2 * 64 / one.step_s)
    four = steptime.predict(PROFILES["amp-bf16"], m, ops=ops(), counts=counts(), micro_batch=2, accumulation=4,
                            seq_len=64)
    assert four.parts["compute"] == pytest.approx(4 * one.parts["compute"])
    assert four.parts["optimizer"] == pytest.approx(one.parts["optimizer"])  # once per step
    assert "no measured fixed costs" not in " ".join(one.notes)
    z2 = steptime.predict(PROFILES["zero2-bf16"], m, ops=ops(), counts=counts(), micro_batch=2, accumulation=1,
                          seq_len=64)
    assert any("those of amp stand in" in n for n in z2.notes)  # no measured zero2 costs in this machine


def test_offload_adds_copies_and_cpu_optimizer():
    m = machine()
    kw = dict(ops=ops(), counts=counts(), micro_batch=2, accumulation=2, seq_len=64)
    plain = steptime.predict(PROFILES["zero2-bf16"], m, **kw)
    off = steptime.predict(PROFILES["zero2-bf16-offload-opt"], m, **kw)
    n = counts().total
    # the updated 16-bit weights go up after each step (not overlapped): 2 bytes each over the pageable link
    assert off.parts["copies"] >= 2 * n / 1e10 * 0.999
    assert off.parts["optimizer"] == pytest.approx(n * 5e-9 + counts().tensors * 1e-5)  # DeepSpeedCPUAdam on the CPU
    assert off.step_s > plain.step_s
    pinned = steptime.predict(PROFILES["zero2-bf16-offload-opt"], m, pinned=True, **kw)
    assert pinned.parts["copies"] < off.parts["copies"]


def test_host_bound_ops_on_a_gpu_cost_the_larger_of_the_two():
    """A GPU runs ahead of the host: an op costs max(device work, host cost), not their sum (a CPU pays both)."""
    key = ("memory", "float32", 0, 1000)
    gpu, cpu = machine("cuda", op_s=1e-5, bw=1e9), machine("cpu", op_s=1e-5, bw=1e9)
    assert steptime.op_seconds({key: 1}, gpu.compute, host_bound=True)[0] == pytest.approx(1e-5)
    assert steptime.op_seconds({key: 1}, cpu.compute, host_bound=False)[0] == pytest.approx(1e-5 + 1e-6)


def test_recompute_costs_time():
    m = machine(matmul=1e12)
    kw = dict(counts=counts(), micro_batch=2, accumulation=1, seq_len=64)
    off = steptime.predict(PROFILES["amp-bf16"], m, ops=ops(), **kw)
    every2 = steptime.predict(PROFILES["amp-bf16"], m, ops=ops(ckpt=True, every=2), **kw)
    full = steptime.predict(PROFILES["amp-bf16"], m, ops=ops(ckpt=True, every=1), **kw)
    assert off.step_s < every2.step_s < full.step_s


def tiny_cfg(*extra):
    return load_config(None, ["model.name=tiny", "data.seq_len=256", "train.global_batch_size=8",
                              "train.micro_batch_size=auto", "memory.cpu_budget=32", *extra])


def test_the_search_picks_the_fastest_setting_that_fits():
    """A budget between every-layer and no checkpointing at micro-batch 8: the priced plan takes the fastest
    setting that fits, the candidates are ordered by predicted time, and the runner-up says why it lost."""
    hw = fake_hw(capability=(8, 0))
    roomy = planner.plan(tiny_cfg("memory.gpu_budget=40", "profile=amp-bf16", "model.gradient_checkpointing=false"),
                         hw, machine=machine())
    tight_row = planner.plan(tiny_cfg("memory.gpu_budget=40", "profile=amp-bf16", "model.gradient_checkpointing=true"),
                             hw, machine=machine()).chosen_plan
    budget = (roomy.chosen_plan.gpu_bytes + tight_row.gpu_bytes) / 2 / 2**30
    p = planner.plan(tiny_cfg(f"memory.gpu_budget={budget}", "profile=amp-bf16"), hw, machine=machine())
    c = p.chosen_plan
    assert c.fits and c.step_s is not None and p.machine == "test"
    times = [x["step_s"] for x in p.candidates]
    assert times == sorted(times) and c.step_s == times[0]
    assert len(p.candidates) >= 2 and p.runner_up and "slower" in p.runner_up["why"]
    assert (p.runner_up["profile"], p.runner_up["setting"]) != (c.profile, c.setting)
    # the choice is one of: a smaller micro-batch without checkpointing, or micro-batch 8 with some checkpointing
    assert (c.micro_batch == 8 and c.checkpointing) or (c.micro_batch < 8 and not c.checkpointing)
    assert "s/step" in p.reason and c.eta_s == pytest.approx(c.step_s * 200)


def test_every_kth_layer_when_it_fits_and_is_faster():
    """Recompute is expensive on this machine (slow matmuls): the least checkpointing that fits wins."""
    hw = fake_hw(capability=(8, 0))
    cfg = ["memory.gpu_budget=40", "profile=amp-bf16", "train.micro_batch_size=8"]
    rows = {k: planner.plan(tiny_cfg(*cfg, "model.gradient_checkpointing=true", f"model.checkpoint_every={k}"), hw,
                            machine=machine(matmul=1e11)).chosen_plan for k in (1, 2)}
    off = planner.plan(tiny_cfg(*cfg, "model.gradient_checkpointing=false"), hw, machine=machine(matmul=1e11))
    assert rows[1].gpu_bytes < rows[2].gpu_bytes < off.chosen_plan.gpu_bytes
    # room for every 2nd layer (and every 3rd: with 4 layers both checkpoint two of them), not for none
    p = planner.plan(tiny_cfg(*cfg[1:], f"memory.gpu_budget={rows[2].gpu_bytes / 2**30 + 1e-3}"), hw,
                     machine=machine(matmul=1e11))
    assert p.chosen_plan.micro_batch == 8
    assert p.chosen_plan.checkpointing and p.chosen_plan.checkpoint_every in (2, 3)
    assert p.chosen_plan.step_s < rows[1].step_s


def test_without_machine_speeds_nothing_is_priced():
    p = planner.plan(tiny_cfg("memory.gpu_budget=40"), fake_hw(capability=(8, 0)))
    assert p.machine is None and all(r.step_s is None for r in p.profiles)
    assert "not priced" in p.assumptions["step_time"]
    assert p.chosen == "amp-bf16" and not p.chosen_plan.checkpointing


@pytest.mark.parametrize("profile", ["amp-fp32", pytest.param("zero2-fp32", marks=pytest.mark.slow),
                                     pytest.param("fsdp-bf16-offload", marks=pytest.mark.slow)])
def test_every_second_layer_trains_on_every_engine(tmp_path, profile):
    """Checkpointing every 2nd decoder layer trains on AMP, DeepSpeed and FSDP, and the loss equals the run
    without checkpointing (recompute gives the same numbers)."""
    from helpers import has_deepspeed

    if profile.startswith("zero") and not has_deepspeed():
        pytest.skip("DeepSpeed is not installed")
    from launcher.model.checkpointing import _layers, checkpointed_layers
    from launcher.training.faults import Hooks

    seen = {}  # what the engine's model checkpoints, and how often each decoder layer ran

    def watch(step, engine):
        if step == 1:
            model = engine.module()
            seen["layers"] = checkpointed_layers(model)
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            seen["calls"] = [0] * len(seen["layers"])
            # the layer's first module: recompute runs it again (hooks on the layer itself stay outside the
            # checkpoint, and torch stops a recompute once it has what backward needs, before the MLP's end)
            for i, layer in enumerate(_layers(base)):
                layer.input_layernorm.register_forward_hook(
                    lambda *_, i=i: seen["calls"].__setitem__(i, seen["calls"][i] + 1))

    kw = [f"profile={profile}", "train.max_steps=3", "train.warmup_steps=1"]
    s, rows = run_inprocess(tmp_path, *kw, "model.gradient_checkpointing=true", "model.checkpoint_every=2",
                            "run_name=every2", hooks=Hooks(before_step=watch))
    s0, rows0 = run_inprocess(tmp_path, *kw, "model.gradient_checkpointing=false", "run_name=plain")
    assert s["gradient_checkpointing"] and s["checkpoint_every"] == 2
    n = len(seen["layers"])
    assert n >= 2 and seen["layers"] == [i % 2 == 0 for i in range(n)], seen["layers"]
    # a checkpointed layer runs its forward again in backward: twice as often as the one after it
    assert all(seen["calls"][i] == 2 * seen["calls"][i + 1] > 0 for i in range(0, n - 1, 2)), seen["calls"]
    assert len(rows) == len(rows0) == 3
    tol = 1e-5 if "fp32" in profile else 1e-2
    assert all(abs(a["loss"] - b["loss"]) <= tol * abs(b["loss"]) for a, b in zip(rows, rows0))


def test_config_reference_keys():
    cfg = load_config(None, [])
    assert cfg.model.gradient_checkpointing == "auto" and cfg.model.checkpoint_every == 1
    assert dataclasses.replace(cfg.model, checkpoint_every=3).checkpoint_every == 3


def test_the_runner_up_is_another_setting_when_the_buckets_grow():
    """A one-rank DeepSpeed row is planned again with larger buckets (a new row object): the runner-up is
    still another setting, not the chosen one as it was before its buckets grew."""
    hw = fake_hw(capability=(8, 0))
    rows = [planner.plan(tiny_cfg("memory.gpu_budget=40", "profile=zero2-bf16", f"model.gradient_checkpointing={ck}"),
                         hw, machine=machine()).chosen_plan for ck in ("false", "true")]
    budget = (rows[0].gpu_bytes + rows[1].gpu_bytes) / 2 / 2**30
    p = planner.plan(tiny_cfg(f"memory.gpu_budget={budget}", "profile=zero2-bf16"), hw, machine=machine())
    c = p.chosen_plan
    assert c.profile == "zero2-bf16" and c.reduce_bucket_size and c.reduce_bucket_size > 128 ** 2
    assert len(p.candidates) >= 2 and p.runner_up
    assert (p.runner_up["profile"], p.runner_up["setting"]) != (c.profile, c.setting)


def test_costs_measured_in_steps_price_the_ops_of_their_precision():
    """A CPU's in-step costs (launcher.measure.stepcal) replace the looped op cost and bandwidth for steps of their
    precision, and add what a forward + backward pays once; other precisions keep the looped ones."""
    key = ("memory", "float32", 0, 1000)
    rates = dataclasses.replace(machine("cpu", op_s=1e-5, bw=1e9).compute,
                                step_costs={"bf16": {"op_s": 2e-5, "bytes_per_s": 1e8, "micro_s": 1e-3}})
    assert steptime.op_seconds({key: 2}, rates, host_bound=False, precision="fp32")[0] == pytest.approx(2 * (1e-5 + 1e-6))
    t, fixed = steptime.op_seconds({key: 2}, rates, host_bound=False, precision="bf16")
    assert t == pytest.approx(2 * (2e-5 + 1e-5) + 1e-3) and fixed == pytest.approx(2 * 2e-5 + 1e-3)


def test_validation_grid_keeps_each_points_fastest_pass(monkeypatch, tmp_path):
    """scripts/validate_steptime.py --passes 2: every point measured once per pass over the grid, in grid order,
    and its error taken from its fastest measurement (a slowed stretch of the machine costs one pass)."""
    import importlib.util

    from helpers import ROOT

    spec = importlib.util.spec_from_file_location("validate_steptime", os.path.join(ROOT, "scripts", "validate_steptime.py"))
    vs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs)
    times = {"a": [0.5, 0.2], "b": [0.1, 0.3]}
    order = []

    def run_one(_cfg, _ov, _profile, name, *_a):
        base = name.split("-pass")[0]
        order.append(name)
        return {"status": "ok", "step_s": times[base][len([n for n in order if n.startswith(base)]) - 1], "wall_s": 1.0}

    monkeypatch.setattr(vs.bench, "run_one", run_one)
    monkeypatch.setattr(vs, "predicted", lambda *a: 0.2)
    monkeypatch.setattr(vs, "cannot_run", lambda *a: None)
    points = [(n, "tiny", 128, 8, 2, "off", "amp-fp32", None) for n in ("a", "b")]
    rows = vs.run_grid(points, str(tmp_path), 2, 1, None, None, passes=2)
    assert order == ["a", "b", "a-pass2", "b-pass2"]
    assert [r["measured_passes"] for r in rows] == [[0.5, 0.2], [0.1, 0.3]]
    assert [r["measured_s"] for r in rows] == [0.2, 0.1]
    assert [round(r["error_pct"]) for r in rows] == [0, 100]


def test_validation_rescore_keeps_each_points_fastest_pass():
    """scripts/validate_steptime.py --rescore: a finished grid's points and choice candidates re-kept at the fastest
    of their passes, errors and picks recomputed, nothing measured."""
    import importlib.util

    from helpers import ROOT

    spec = importlib.util.spec_from_file_location("validate_steptime", os.path.join(ROOT, "scripts", "validate_steptime.py"))
    vs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs)
    grid = [{"name": "a", "status": "ok", "predicted_s": 0.2, "measured_s": 0.4, "measured_passes": [0.4, 0.25],
             "error_pct": -50.0, "speed": 1.0},
            {"name": "b", "status": "ok", "predicted_s": 0.2, "measured_s": None, "measured_passes": [None, None],
             "error_pct": None}]
    cands = [{"profile": "amp-fp32", "setting": "x", "measured_passes": [0.3, 0.1], "measured_s": 0.3},
             {"profile": "zero2-fp32", "setting": "x", "measured_passes": [0.2, 0.2], "measured_s": 0.2}]
    doc = vs.rescore({"grid": grid, "choices": [{"workload": "w", "candidates": cands}],
                      "summary": {"planned_points": 2}})
    assert doc["grid"][0]["measured_s"] == 0.25 and doc["grid"][0]["error_pct"] == pytest.approx(-20.0)
    assert "speed" not in doc["grid"][0] and doc["grid"][1]["measured_s"] is None
    c = doc["choices"][0]
    assert c["measured_fastest"]["profile"] == "amp-fp32" and c["pick_is_fastest"]
    assert doc["summary"]["points"] == 1 and doc["summary"]["max_abs_error_pct"] == pytest.approx(20.0)


# ------------------------------------------------------------------------------------------------
# Choices within the model's measured error


def test_the_model_error_table_is_the_committed_validation():
    """MODEL_ERROR is the median |error| per engine family of the committed grid; recomputed here from its file."""
    import json
    import statistics

    from helpers import ROOT

    doc = json.loads(open(os.path.join(ROOT, steptime.MODEL_ERROR_SOURCE)).read())
    by: dict = {}
    for point in doc["grid"]:
        fam = family_of(PROFILES[point["profile"]]).name
        by.setdefault(fam, []).append(abs(point["error_pct"]) / 100)
    assert {f: round(statistics.median(v), 3) for f, v in by.items()} == steptime.MODEL_ERROR
    assert steptime.model_error(PROFILES["zero3-bf16-offload-all"]) == max(steptime.MODEL_ERROR.values())


def test_moving_parts_order_the_profiles_by_what_they_move():
    mp = steptime.moving_parts
    assert mp(PROFILES["amp-bf16"]) < mp(PROFILES["zero2-bf16"]) < mp(PROFILES["zero2-bf16-offload-opt"])
    assert mp(PROFILES["zero2-bf16-offload-opt"]) < mp(PROFILES["fsdp-bf16-offload"]) \
        < mp(PROFILES["zero3-bf16-offload-all"]) < mp(PROFILES["zero3-bf16-offload-nvme-all"])
    assert mp(PROFILES["amp-bf16"]) < mp(PROFILES["amp-bf16"], offload_activations=True)


class _Avail:
    def profile(self, name):
        return PROFILES[name]


def _row(profile, step_s, offload_activations=False):
    p = PROFILES[profile]
    return ProfilePlan(profile=profile, engine=p.engine, precision=p.precision, device="cuda", gpu_bytes=1,
                       cpu_bytes=1, fits=True, parts={}, speed_rank=p.speed_rank, micro_batch=1,
                       accumulation=1, step_s=step_s, offload_activations=offload_activations)


def test_a_tie_inside_the_models_error_goes_to_the_simpler_setting():
    # the Mistral-on-a-3090 case: every weight over PCIe twice a step to win 2% on paper
    fitting = [_row("zero3-bf16-offload-all", 27.6), _row("zero2-bf16", 28.0), _row("zero2-bf16-offload-opt", 27.9)]
    chosen, why = simplest_within_error(fitting, _Avail())
    assert chosen.profile == "zero2-bf16"
    assert "zero3-bf16-offload-all is predicted 1.01x faster" in why and "within the model's measured error" in why
    # outside the error the fastest stays
    fitting = [_row("zero3-bf16-offload-all", 10.0), _row("zero2-bf16", 20.0)]
    chosen, why = simplest_within_error(fitting, _Avail())
    assert chosen.profile == "zero3-bf16-offload-all" and why is None
    # the fastest already the simplest: nothing to say
    chosen, why = simplest_within_error([_row("amp-bf16", 5.0), _row("zero2-bf16", 5.1)], _Avail())
    assert chosen.profile == "amp-bf16" and why is None
    # activation offload is offload too
    fitting = [_row("amp-bf16", 9.9, offload_activations=True), _row("amp-bf16", 10.2)]
    chosen, _ = simplest_within_error(fitting, _Avail())
    assert not chosen.offload_activations
