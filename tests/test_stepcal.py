"""The CPU's in-step calibration (launcher.measure.stepcal): its arithmetic, and one small measurement whose own
prediction must come back near what was measured."""

import pytest

from launcher.machine.speeds import Rates
from launcher.measure import stepcal, timing
from launcher.plan.steptime import op_seconds


def test_matmul_flops_from_profiler_shapes():
    assert stepcal._matmul_flops("mm", [[128, 64], [64, 32]]) == 2 * 128 * 64 * 32
    assert stepcal._matmul_flops("addmm", [[32], [128, 64], [64, 32]]) == 2 * 128 * 64 * 32
    assert stepcal._matmul_flops("bmm", [[4, 128, 64], [4, 64, 32]]) == 2 * 4 * 128 * 64 * 32


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_self_times_are_the_profilers_own(precision):
    """The matmul and attention calls priced, read from the profiler's raw records, with the same self time to the
    nanosecond as ``prof.events()`` gives after building its tree of every call."""
    from torch.profiler import ProfilerActivity, profile

    step = stepcal.step_fn({**stepcal.REFERENCE[2], "seq": 16}, precision)
    step()
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with stepcal._quiet_stderr():
        prof.start()
    step()
    with stepcal._quiet_stderr():
        prof.stop()
    mine = sorted((n, str(s), round(t * 1e9)) for n, s, t in stepcal.self_times(prof, stepcal._priced))
    theirs = sorted((e.name, str(e.input_shapes), round(e.self_cpu_time_total * 1e3)) for e in prof.events()
                    if stepcal._priced(e.name))
    assert mine == theirs and len(mine) > 20
    assert any("flash_attention" in n for n, *_ in mine)


def test_curve_takes_the_median_per_size_and_continues_with_the_looped_shape():
    points = [[1e6, 1e10], [1e6, 3e10], [1e6, 2e10], [1e8, 5e10]]
    looped = [[1e6, 4e10], [1e8, 1e11], [1e10, 2e11]]
    curve = stepcal._curve(points, looped)
    assert curve[0] == [1e6, 2e10] and curve[1] == [1e8, 5e10]
    # above the largest in-step size: the looped curve's gain (2x from 1e8 to 1e10), from the in-step rate
    assert curve[2] == pytest.approx([1e10, 1e11])


def test_nonneg_lstsq_keeps_every_coefficient_at_or_above_zero():
    rows = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    assert timing.nonneg_lstsq(rows, [2.0, 3.0, 5.0]) == pytest.approx([2.0, 3.0])
    a, b = timing.nonneg_lstsq(rows, [-1.0, 3.0, 2.0])
    assert a == 0.0 and b > 0


def test_a_measured_step_is_priced_back_near_its_time():
    """Measure a small Llama at two depths, then price the planner's trace of the deeper one with the rates
    found: the time comes back within a factor of 1.5 of the measured one (the fit has three unknowns over two
    steps; what is left is the profiler's attribution and the noise of a shared machine). Five steps are
    profiled: with one, a single preempted stretch of it priced this step at 2x its time in one CI run."""
    small = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 batch=1, seq=32)
    refs = ({**small, "layers": 1}, {**small, "layers": 3})
    looped = Rates(device="cpu", matmul={"float32": [[1e5, 1e10], [1e9, 5e10]]}, memory_bytes_per_s=1e10,
                   op_s=1e-5, view_s=2e-6)
    raw, skipped = {}, {}
    found = stepcal.measure(looped, looped.view_s, raw, skipped, steps=4, profiled=5, references=refs,
                            precisions=("fp32",))
    assert not skipped, skipped
    costs = found["step_costs"]["fp32"]
    assert costs["op_s"] >= 0 and costs["bytes_per_s"] > 0 and costs["micro_s"] >= 0
    assert found["matmul"]["float32"] and found["attention"]["float32"] > 0
    rates = Rates(device="cpu", matmul=found["matmul"], attention=found["attention"], memory_bytes_per_s=1e10,
                  op_s=1e-5, view_s=looped.view_s, step_costs=found["step_costs"])
    deep = raw["in_step"]["fp32"][1]
    ops = stepcal._traced_ops(stepcal._config(refs[1]), "fp32", 1, 32)
    predicted = op_seconds(ops, rates, host_bound=False, precision="fp32")[0]
    assert deep["step_s"] / 1.5 < predicted < deep["step_s"] * 1.5


def test_step_costs_come_apart_from_the_steps_each_dominates():
    """Steps made from known costs (4 us an op, 2 ms once, 10 GB/s) give them back; a step dearer per byte than
    the others moves the per-byte cost only as far as the median does, and a cost per byte below the
    streaming floor is raised to it."""
    op_s, once, per_byte = 4e-6, 2e-3, 1e-10
    shapes = [(150, 1e6), (500, 2e6), (270, 6e7), (270, 3e8), (270, 7e8)]
    rows = [([float(k), b, 1.0], k * op_s + once + b * per_byte) for k, b in shapes]
    found = stepcal.fit_step_costs(rows, floor_per_byte=1e-11)
    assert found == pytest.approx((op_s, per_byte, once), rel=0.02)
    rows[-1] = (rows[-1][0], rows[-1][1] * 3)  # one slow large step
    assert stepcal.fit_step_costs(rows, 1e-11)[1] < 1.5 * per_byte
    assert stepcal.fit_step_costs(rows, floor_per_byte=1e-9)[1] == 1e-9


def test_a_step_slowed_by_noise_does_not_price_every_op_above_both_steps():
    """When the deeper of the two small steps grew far more than its ops did (a neighbour slowed it), their
    difference would price each op so high that the shallower step cost less than its ops: both are then
    fitted by an op cost alone, and each is priced within 2x of its time, not 3-5x above both."""
    (k1, k2), op_s, once = (400, 500), 1e-5, 2e-3
    rows = [([float(k1), 0.0, 1.0], k1 * op_s + once), ([float(k2), 0.0, 1.0], 2 * (k2 * op_s + once))]
    op, _, paid_once = stepcal.fit_step_costs(rows, floor_per_byte=1e-11)
    for (k, _, _), y in rows:
        assert y / 2 < k * op + paid_once < 2 * y
