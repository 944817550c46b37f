"""Calibration: the cache (round trip, corrupt, truncated, stale, another machine's, atomic writes), the
mapping to the step-time model's keys, and one quick real calibration through ``vramfit doctor --calibrate
--json`` whose numbers must be positive and sane."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch

from helpers import needs_deepspeed, run_cli
from launcher.config.profiles import PROFILES
from launcher.machine import speeds
from launcher.machine.speeds import Machine, Rates
from launcher.measure import calibrate, engine_costs, timing
from launcher.plan.families import family_of, optimizer_kind


def fake_machine(name: str = "cpu: test (2 threads)") -> Machine:
    cpu = Rates(device="cpu", matmul={"float32": [[5e5, 2e10], [1.7e10, 8e10]]}, attention={"float32": 3e10},
                memory_bytes_per_s=1.2e10, op_s=2e-5, view_s=3e-6)
    return Machine(name=name, source=f"calibrated 2026-01-01 00:00 on {name}", compute=cpu, host=cpu,
                   h2d_bytes_per_s={"pinned": 6e9, "pageable": 6e9}, d2h_bytes_per_s={"pinned": 6e9, "pageable": 6e9},
                   optimizers={"torch_fused_adamw@cpu": [2e-9, 3e-6]},
                   engines={"amp": {"micro_s": 1e-3, "micro_tensor_s": 1e-6, "step_s": 2e-3, "step_tensor_s": 2e-6}},
                   disk_write_bytes_per_s=1e9, threads=2, measured={"seconds": 1.0})


@pytest.fixture
def measured(monkeypatch):
    """calibrate.calibrate replaced by a counter returning fake_machine() (the cache tests measure nothing)."""
    calls = []

    def fake(sizes=None, output_dir=None):
        calls.append(1)
        return fake_machine()

    monkeypatch.setattr(calibrate, "calibrate", fake)
    return calls


def test_cache_round_trip(tmp_path, measured):
    first = calibrate.load_or_calibrate(directory=str(tmp_path))
    assert len(measured) == 1 and first == fake_machine()
    path = speeds.cache_path(directory=str(tmp_path))
    assert os.path.exists(path) and [f for f in os.listdir(tmp_path)] == [os.path.basename(path)]
    again = calibrate.load_or_calibrate(directory=str(tmp_path))
    assert len(measured) == 1, "a usable cached calibration is not measured again"
    assert again == first
    assert calibrate.calibration(measure=False, directory=str(tmp_path)) == first
    found = speeds.read(directory=str(tmp_path))
    assert found.problem is None and found.age_days < 0.01 and found.key == speeds.machine_key()
    assert calibrate.load_or_calibrate(force=True, directory=str(tmp_path)) == first and len(measured) == 2


def test_no_calibration_without_measuring_is_none(tmp_path, measured):
    assert calibrate.calibration(measure=False, directory=str(tmp_path)) is None
    assert not measured and not os.listdir(tmp_path)
    assert "none to use" in speeds.format_report(speeds.read(directory=str(tmp_path)))


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_file_is_measured_again_with_a_message(tmp_path, measured, vramfit_log, damage):
    speeds.write(fake_machine("old"), str(tmp_path))
    path = speeds.cache_path(directory=str(tmp_path))
    text = open(path).read()
    with open(path, "w") as fh:
        fh.write("not json {" if damage == "corrupt" else text[: len(text) // 2])
    assert calibrate.calibration(measure=False, directory=str(tmp_path)) is None
    assert "corrupt or truncated" in vramfit_log.text and "vramfit doctor --calibrate" in vramfit_log.text
    assert not measured
    assert calibrate.load_or_calibrate(directory=str(tmp_path)) == fake_machine()
    assert len(measured) == 1 and "measuring this machine again" in vramfit_log.text
    assert speeds.read(directory=str(tmp_path)).problem is None  # the new one replaced it


def test_a_stale_file_is_measured_again(tmp_path, measured, vramfit_log):
    speeds.write(fake_machine("old"), str(tmp_path), created=time.time() - 40 * 86400)
    found = speeds.read(stale_days=30, directory=str(tmp_path))
    assert found.machine is not None and "40 days old" in found.problem
    assert calibrate.calibration(measure=False, directory=str(tmp_path)) is None
    assert "40 days old" in vramfit_log.text
    assert calibrate.load_or_calibrate(stale_days=60, directory=str(tmp_path)).name == "old"  # young enough for 60
    assert calibrate.load_or_calibrate(stale_days=30, directory=str(tmp_path)).name == fake_machine().name
    assert len(measured) == 1


def test_another_machines_file_is_not_used(tmp_path, measured, vramfit_log):
    path = speeds.cache_path(directory=str(tmp_path))
    key = {**speeds.machine_key(), "threads": 64}
    with open(path, "w") as fh:
        json.dump({"format": speeds.FORMAT, "key": key, "created": time.time(),
                   "machine": fake_machine("elsewhere").to_dict()}, fh)
    assert calibrate.calibration(measure=False, directory=str(tmp_path)) is None
    assert "another machine" in vramfit_log.text and "threads" in vramfit_log.text
    assert calibrate.load_or_calibrate(directory=str(tmp_path)).name == fake_machine().name and len(measured) == 1


def test_another_key_is_another_file(tmp_path, monkeypatch):
    a = speeds.cache_path(directory=str(tmp_path))
    monkeypatch.setattr(speeds.torch, "get_num_threads", lambda: 977)
    assert speeds.cache_path(directory=str(tmp_path)) != a


def test_writes_are_atomic(tmp_path, monkeypatch):
    speeds.write(fake_machine("kept"), str(tmp_path))

    from launcher.machine import files

    def broken(*a, **k):  # the write fails after the temporary file has bytes in it
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "fsync", broken)
    with pytest.raises(OSError):
        speeds.write(fake_machine("lost"), str(tmp_path))
    assert os.listdir(tmp_path) == [os.path.basename(speeds.cache_path(directory=str(tmp_path)))]
    assert speeds.read(directory=str(tmp_path)).machine.name == "kept"


def test_corrections_are_kept_with_the_calibration(tmp_path):
    speeds.write(fake_machine(), str(tmp_path), created=time.time() - 86400)
    before = speeds.read(directory=str(tmp_path))
    speeds.save_corrections(before.machine, {"amp": 1.5}, str(tmp_path))
    m = speeds.save_corrections(before.machine, {"zero2": 0.8}, str(tmp_path))
    after = speeds.read(directory=str(tmp_path))
    assert after.machine.corrections == {"amp": 1.5, "zero2": 0.8} == m.corrections
    assert after.created == before.created  # still the age of the measurement


def test_nonneg_least_squares():
    assert timing.nonneg_lstsq([[1, 1], [1, 3]], [3, 7]) == pytest.approx([1, 2])
    assert timing.nonneg_lstsq([[1, 1], [1, 3]], [5, 3]) == pytest.approx([4, 0])  # falling: no negative slope
    assert timing.nonneg_lstsq([[1, 1], [1, 3]], [-1, -2]) == [0, 0]


def test_a_slowed_round_of_engine_timing_does_not_set_the_engine_costs(monkeypatch):
    """Every model of a family keeps its fastest step over the rounds: the first round here runs 3x slow (a
    neighbour), and the costs fitted are those of the second, as a calibration on a quiet machine gives."""
    micro_s, tensor_s, param_s = 2e-3, 1e-5, 1e-8
    sizes = {1: (12, 82_112), 4: (39, 229_952), 2: (21, 1_705_216)}
    rounds = []

    def timed(p, cfg, hw, device, depth, s, hidden=None):
        slow = 3.0 if len(rounds) < 3 else 1.0  # the three models of round 1 are slowed
        rounds.append(depth)
        tensors, params = sizes[depth]
        cost = micro_s + tensor_s * tensors + param_s * params
        return {"depth": depth, "hidden": hidden or 64, "build_s": 0.0, "micro_s": [slow * cost] * s.engine_steps,
                "boundary_and_step_s": [2 * slow * cost] * s.engine_steps, "pinned": False}

    monkeypatch.setattr(engine_costs, "_time_engine", timed)
    monkeypatch.setattr(engine_costs, "_engine_problem", lambda *a: None)
    monkeypatch.setattr(engine_costs, "_predicted", lambda p, m, depth, *a: (0.0, 0.0, *sizes[depth]))
    s = timing.Sizes(families=("amp",), engine_depths=(1, 4), engine_wide=(2, 256))
    raw, skipped = {}, {}
    found = engine_costs.measure(fake_machine(), torch.device("cpu"), s, raw, skipped)
    assert len(rounds) == 3 * s.engine_rounds and not skipped
    assert [found["amp"][k] for k in ("micro_s", "micro_tensor_s", "micro_param_s")] == pytest.approx(
        [micro_s, tensor_s, param_s], rel=1e-3)
    assert len(raw["engines"]["amp"]["runs"][0]["micro_s"]) == s.engine_steps * s.engine_rounds


def test_each_optimizer_is_made_once_and_steps_both_sets_from_an_empty_state(monkeypatch):
    """DeepSpeed's optimizers load their op and probe the CPU on every construction (seconds each): one
    optimizer per kind times the large tensor and then the small ones, whose moments start anew."""
    made, steps = [], []

    class Recording(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            made.append(self)

        def step(self):
            group = self.param_groups[0]["params"]
            steps.append((len(group), group[0].numel(), sum(1 for p in group if p in self.state)))
            for p in group:
                self.state[p]["seen"] = True

    monkeypatch.setattr(calibrate, "optimizer_factories",
                        lambda gpu, deepspeed=True: [("recording@cpu", "cpu", Recording, None)])
    s = timing.Sizes.quick()
    raw, skipped = {}, {}
    found = calibrate._optimizers(False, s, raw, skipped)
    count, size = s.optimizer_tensors
    assert len(made) == 1 and not skipped and "recording@cpu" in found
    big = [x for x in steps if x[0] == 1]
    small = [x for x in steps if x[0] == count]
    assert big and small and len(big) + len(small) == len(steps)
    assert steps.index(small[0]) == len(big)  # the large tensor first, then the small ones
    assert big[0][1] == s.optimizer_params and small[0][1] == size
    assert big[0][2] == 0 and small[0][2] == 0  # each set's first step finds no state
    samples = raw["optimizers"]["recording@cpu"]
    assert samples["one_tensor"]["params"] == s.optimizer_params and samples["small_tensors"]["tensors"] == count


def test_the_heap_is_frozen_only_while_engines_are_timed():
    """gc.collect() inside walks only what was made inside (a cycle made there is still freed), and the heap is
    unfrozen after, also when the timing fails."""
    import gc
    import weakref

    class Node:
        pass

    with pytest.raises(RuntimeError), engine_costs._frozen_heap():
        assert gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
        raise RuntimeError("an engine failed")
    assert gc.get_freeze_count() == 0


def test_the_keys_are_the_step_time_models():
    """Each family calibrated by the catalogue profile the step-time model files under it, and an optimizer
    measured for every kind a profile steps with."""
    for fam in timing.FAMILIES:
        for gpu_bf16 in (None, True, False):
            assert family_of(engine_costs.profile_for(fam, gpu_bf16)).name == fam
    for gpu, device in ((False, "cpu"), (True, "cuda")):
        keys = {k for k, *_ in calibrate.optimizer_factories(gpu)}
        for p in PROFILES.values():
            assert optimizer_kind(p, device) in keys, (p.name, device)


@pytest.fixture(scope="module")
def doctor_json(tmp_path_factory):
    """`vramfit doctor --calibrate --json` once, quick sizes, into a temporary cache folder."""
    cache = tmp_path_factory.mktemp("cache")
    r = run_cli("doctor", "--calibrate", "--json", env={"XDG_CACHE_HOME": str(cache), "VRAMFIT_CALIBRATE_QUICK": "1"},
                timeout=300)
    return r, cache


def test_doctor_calibrate_json(doctor_json):
    r, cache = doctor_json
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)  # JSON alone on stdout; progress went to stderr
    assert "calibrate:" in r.stderr
    cal = doc["calibration"]
    assert cal["problem"] is None and cal["path"].startswith(str(cache)) and os.path.exists(cal["path"])
    assert cal["age_days"] < 0.1 and cal["summary"]["name"].startswith("cpu: ")
    assert set(cal["summary"]["cpu"]) >= {"matmul_tflops", "memory_gb_s", "op_us", "view_us"}
    assert "torch_fused_adamw@cpu" in cal["summary"]["optimizer_s_per_100m_params"]


def test_calibrated_numbers_are_positive_and_sane(doctor_json):
    r, _ = doctor_json
    assert r.returncode == 0, r.stderr[-3000:]
    m = Machine.from_dict(json.loads(r.stdout)["calibration"]["machine"])
    assert Machine.from_dict(m.to_dict()) == m
    c = m.compute
    assert c.device == "cpu" and m.host == c  # a CPU-only machine: measured once
    assert "float32" in c.matmul and "bfloat16" in c.matmul
    for dtype, curve in c.matmul.items():
        flops = [f for f, _ in curve]
        assert flops == sorted(flops) and len(set(flops)) == len(flops), dtype
        assert all(rate > 0 for _, rate in curve) and c.matmul_rate(dtype, flops[-1]) == pytest.approx(curve[-1][1])
        assert max(rate for _, rate in curve) < 1e14, "a 2-core CPU does not reach 100 TFLOPS"
    assert c.attention["float32"] > 0
    assert 1e8 < c.memory_bytes_per_s < 1e13
    assert 0 <= c.op_s < 1e-2 and 0 < c.view_s < 1e-3
    for links in (m.h2d_bytes_per_s, m.d2h_bytes_per_s):
        assert set(links) == {"pinned", "pageable"} and all(v > 0 for v in links.values())
    per_param, per_tensor = m.optimizers["torch_fused_adamw@cpu"]
    assert per_param >= 0 and per_tensor >= 0 and per_param + per_tensor > 0
    assert set(m.engines["amp"]) == {"micro_s", "micro_tensor_s", "micro_param_s", "step_s", "step_tensor_s",
                                     "step_param_s"}
    assert all(0 <= v < 1 for v in m.engines["amp"].values())
    assert m.disk_write_bytes_per_s > 0 and m.threads >= 1
    assert m.source.startswith("calibrated ") and m.name in m.source
    assert m.measured["versions"]["torch"] and m.measured["load_average_before"]
    assert "deepspeed_cpu_adam@cpu" in m.measured["skipped"]  # quick: DeepSpeed left out, and said so


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_engine_and_optimizers(tmp_path):
    """One DeepSpeed offload family and DeepSpeed's optimizers: measured where DeepSpeed imports (the family) and
    where the op is built already (each optimizer), else skipped with a reason."""
    from launcher.machine.deepspeed_ops import cpu_adam_status

    s = timing.Sizes.quick()
    s = timing.Sizes(**{**s.__dict__, "families": ("amp", "zero2_offload"), "deepspeed": True})
    built = cpu_adam_status(None) == "built"  # scripts/setup.sh builds it; a bare install JIT-builds it on first use
    m = calibrate.calibrate(s, output_dir=str(tmp_path))
    skipped = m.measured["skipped"]
    for key in ("deepspeed_cpu_adam@cpu", "deepspeed_fused_adam@cpu"):
        assert key in m.optimizers or key in skipped
    if built:
        assert "deepspeed_cpu_adam@cpu" in m.optimizers, skipped.get("deepspeed_cpu_adam@cpu")
    assert "zero2_offload" in m.engines, skipped.get("engine zero2_offload")  # DeepSpeed imports here
    assert all(v >= 0 for v in m.engines["zero2_offload"].values())


# ------------------------------------------------------------------------------------------------
# A calibration that knows when the machine was busy


def test_the_doubt_rule():
    assert speeds.doubt(0.2, 0.01, 2) is None
    assert "other processes kept 1.8 of 2 cores busy" in speeds.doubt(1.8, 0.0, 2)
    assert "(steal)" in speeds.doubt(0.0, 0.25, 2)
    assert "contended" in speeds.doubt(0.0, 0.0, 2, contended=True)


def _busy(n: int) -> list:
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
def test_a_calibration_made_beside_busy_processes_is_flagged_and_plans_from_it_say_so(tmp_path, monkeypatch):
    """A process burns a core while a quick calibration runs: it is cached flagged, doctor's report and the
    plan's table say so, and an explicit calibration (force) measured once more before keeping it."""
    from launcher.config.load import load_config
    from launcher.machine.hardware import probe
    from launcher.plan import planner, report

    busy = _busy(1)
    calls = []
    real = calibrate.calibrate

    def counted(sizes=None, output_dir=None):
        calls.append(1)
        return real(timing.Sizes.quick(), output_dir=str(tmp_path))

    monkeypatch.setattr(calibrate, "calibrate", counted)
    try:
        machine = calibrate.calibration(force=True, directory=str(tmp_path))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert len(calls) == 2, "a busy first attempt is measured once more"
    assert machine.doubtful and "cores busy while it was measured" in machine.doubtful, machine.measured.get("cpu_use")
    assert machine.measured["cpu_use"]["others_busy_cores"] > 0.5
    found = speeds.read(directory=str(tmp_path))
    assert found.machine.doubtful == machine.doubtful
    assert "DOUBTFUL: other processes kept" in speeds.format_report(found)
    plan = planner.plan(load_config(None, ["device=cpu"]), probe(), machine=found.machine)
    assert "-- DOUBTFUL calibration: other processes kept" in report.format_table(plan).splitlines()[2]


@pytest.mark.slow
def test_an_idle_calibration_is_not_flagged(monkeypatch, tmp_path):
    from launcher.machine import threads

    monkeypatch.setattr(threads.Watch, "stop", lambda self: threads.CpuUse(1.0, 0.1, 0.0))
    m = calibrate.calibrate(timing.Sizes.quick(), output_dir=str(tmp_path))
    contended = m.measured["samples"].get("contention")
    if contended and contended["matmul_256_s"].get("2", 0) > contended["matmul_256_s"]["1"]:
        pytest.skip("this machine's small matmul ran slower on all threads than on one: a contended CPU now")
    assert m.doubtful is None and m.measured["cpu_use"]["others_busy_cores"] == 0.1


def test_a_calibration_at_another_thread_count_is_used_scaled(tmp_path, monkeypatch):
    """train.threads=auto took one thread of two (a busy neighbour): the 2-thread calibration still prices the run,
    its CPU work rates halved and its optimizer's per-parameter cost doubled, fixed costs kept."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    speeds.write(fake_machine(), str(tmp_path))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    found = speeds.read(directory=str(tmp_path))
    m, base = found.machine, fake_machine()
    assert found.problem is None and m.threads == 1 and m.name.endswith("scaled to 1 thread(s)")
    assert m.compute.memory_bytes_per_s == base.compute.memory_bytes_per_s / 2
    assert m.compute.matmul["float32"][-1][1] == base.compute.matmul["float32"][-1][1] / 2
    assert m.compute.op_s == base.compute.op_s and m.engines == base.engines
    assert m.optimizers["torch_fused_adamw@cpu"] == [4e-9, 3e-6]
    assert m.measured["threads_scaled"] == {"measured": 2, "used": 1}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # more threads than measured: no gain assumed
    more = speeds.read(directory=str(tmp_path)).machine
    assert more.compute == base.compute and more.threads == 2


def test_a_run_priced_by_a_doubtful_calibration_says_so_in_its_summary(tmp_path, monkeypatch, capfd):
    from helpers import run_inprocess

    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path / "cache"))
    busy = dataclasses.replace(fake_machine(), measured={"doubtful": "other processes kept 1.9 of 2 cores busy"})
    for n in (1, 2, torch.get_num_threads()):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        speeds.write(busy, str(tmp_path / "cache"))
    monkeypatch.undo()
    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path / "cache"))
    summary, _ = run_inprocess(tmp_path, "train.max_steps=2", "train.warmup_steps=1", "checkpoint.save=false")
    assert summary["calibration_doubtful"] == "other processes kept 1.9 of 2 cores busy"
    assert "the calibration that prices this plan is doubtful" in capfd.readouterr().err


# ------------------------------------------------------------------------------------------------
# The plan-time check that a cached calibration still describes this machine (launcher.machine.recheck)


@pytest.fixture
def any_probe_size(monkeypatch):
    """Every calibrated probe is timed again, however long it took (a loaded test machine stretches them)."""
    from launcher.machine import recheck

    monkeypatch.setattr(recheck, "MIN_CALL_S", 0.0)
    monkeypatch.setattr(recheck, "MAX_CALL_S", 60.0)


def _calibrated(mm_s: float, add_s: float) -> Machine:
    """fake_machine() at this process's threads whose calibration timed a 256 x 256 fp32 matmul in ``mm_s`` and
    the elementwise add over three 1 MiB tensors in ``add_s``."""
    samples = {"matmul": {"float32@cpu": {"sizes": [{"n": 256, "best_s": mm_s}]}},
               "memory": {"cpu": {"bytes": 3 * 1024 * 1024, "best_s": add_s}}}
    return dataclasses.replace(fake_machine(), threads=torch.get_num_threads(), measured={"samples": samples})


# A calibration made on a machine far busier than any this runs on (0.75 GFLOP/s, 70 MB/s: both probes are over
# 2x faster now even under heavy contention, inside the check's window of 1-50 ms), and one of a machine far faster.
SLOW, FAST = (0.045, 0.045), (1e-7, 1e-7)


def _now() -> Machine:
    """A calibration whose samples are this machine's probes timed now."""
    from launcher.machine import recheck, timer

    a = torch.randn(256, 256)
    x, y, z = (torch.rand(1024 * 1024 // 4) for _ in range(3))
    return _calibrated(min(timer.repeat(lambda: torch.mm(a, a), recheck.MIN_TIME_S)),
                       min(timer.repeat(lambda: torch.add(x, y, out=z), recheck.MIN_TIME_S)))


def test_the_recheck_rule():
    from launcher.machine.recheck import judge

    assert judge({"mm": 1.3, "add": 0.7}, 0.1) == (None, None)  # the machine's own two speeds: no verdict
    assert judge({"mm": 3.0, "add": 2.5}, 0.0)[0] == "calibrated_busy"
    assert judge({"mm": 3.0, "add": 1.1}, 0.0)[0] is None  # one noisy kernel is not enough
    assert judge({"mm": 0.3, "add": 0.4}, 0.0)[0] == "busy_now"
    assert judge({"mm": 1.0, "add": 1.0}, 1.2)[0] == "busy_now"  # neighbours busy now, whatever the probes say
    assert judge({"add": 5.0}, 0.0)[0] is None  # one probe only (a calibration whose matmuls were all tiny)


@pytest.mark.parametrize("times,verdict", [(SLOW, "calibrated_busy"), (FAST, "busy_now")])
def test_a_calibration_far_off_is_called_out_by_the_plan(monkeypatch, any_probe_size, times, verdict):
    """Probes timed now against a calibration that read them far slower (it was made on a busy machine: its step
    times are too slow) or far faster (the machine is busy now): the plan's table says which."""
    from launcher.config.load import load_config
    from launcher.machine import recheck
    from launcher.machine.hardware import probe
    from launcher.plan import planner, report

    monkeypatch.setenv(recheck.ENV, "on")
    found = recheck.recheck(_calibrated(*times))
    assert found.verdict == verdict, found
    machine = recheck.checked(_calibrated(*times))
    header = report.format_table(planner.plan(load_config(None, ["device=cpu"]), probe(), machine=machine)).splitlines()[2]
    if verdict == "calibrated_busy":
        assert machine.doubtful and "-- DOUBTFUL calibration: this machine runs its calibration's probes faster" in header
    else:
        assert machine.busy_now and "-- BUSY NOW: other processes keep" in header
    scaled = dataclasses.replace(machine, measured={**machine.measured, "threads_scaled": {"measured": 4, "used": 2}})
    assert recheck.recheck(scaled) is None  # its samples were timed at other threads: nothing to compare
    monkeypatch.setenv(recheck.ENV, "off")
    m = _calibrated(*times)
    assert recheck.checked(m) is m  # off: nothing checked


def test_a_busy_neighbour_now_is_called_out_even_when_the_probes_hold(monkeypatch, any_probe_size):
    from launcher.machine import recheck

    monkeypatch.setenv(recheck.ENV, "on")
    m = _now()
    busy = _busy(2)
    try:
        found = recheck.recheck(m)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert found.verdict == "busy_now" and found.others_busy_cores > recheck.BUSY_CORES, found
    assert f"other processes keep {found.others_busy_cores:.1f} cores busy now" in found.message


def test_vramfit_plan_checks_the_calibration_it_prices_with(tmp_path, monkeypatch):
    """From the command line: a cached calibration that read this machine far slower than it runs now (made while
    it was busy) is called out in the plan's header; a training start logs the same."""
    import os

    from helpers import run_cli, run_inprocess
    from launcher.machine import recheck

    cache = str(tmp_path / "cache")
    monkeypatch.setenv("VRAMFIT_CACHE", cache)
    slow = _calibrated(*SLOW)
    for n in range(1, (os.cpu_count() or 1) + 1):  # at the thread count the command will take
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        speeds.write(dataclasses.replace(slow, threads=n), cache)
    monkeypatch.undo()
    r = run_cli("plan", "device=cpu", env={**os.environ, "VRAMFIT_CACHE": cache, recheck.ENV: "on"})
    assert r.returncode == 0, r.stderr
    assert "-- DOUBTFUL calibration: this machine runs its calibration's probes faster now" in r.stdout.splitlines()[2], r.stdout
    monkeypatch.setenv("VRAMFIT_CACHE", cache)
    monkeypatch.setenv(recheck.ENV, "on")
    summary, _ = run_inprocess(tmp_path, "device=cpu", "train.max_steps=1", "train.warmup_steps=1", "checkpoint.save=false",
                               "train.threads=" + str(torch.get_num_threads()))
    assert "probes faster now" in (summary["calibration_doubtful"] or ""), summary["calibration_doubtful"]
