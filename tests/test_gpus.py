"""The GPU catalogue: every entry cites its data sheet and holds sane numbers, names resolve, and the machine and
hardware records built from an entry are what the step-time model and the planner expect. No GPU needed."""

from __future__ import annotations

import os

import pytest

import launcher.machine.hardware
from helpers import ROOT
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.machine.speeds import Machine, Rates
from launcher.plan import gpus, planner
from launcher.units import GiB


@pytest.mark.parametrize("spec", gpus.CATALOGUE, ids=lambda s: s.name)
def test_every_entry_cites_a_source_and_has_positive_numbers(spec):
    assert "http" in spec.source and spec.memory_source, f"{spec.name}: no source"
    for field in ("memory_gb", "memory_bytes", "fp16_tflops", "fp32_tflops", "bandwidth_gb_s", "pcie_lanes"):
        assert getattr(spec, field) > 0, f"{spec.name}.{field} = {getattr(spec, field)}"
    assert spec.pcie_gen in gpus.PCIE_GT_PER_S
    # What the card reports is less than the data sheet's capacity, not by much.
    assert 0.9 * spec.memory_gb * GiB <= spec.memory_bytes <= spec.memory_gb * GiB
    # Tensor cores beat the CUDA cores; the 2:4 sparsity number, where printed, is twice the dense one.
    assert spec.fp16_tflops > spec.fp32_tflops
    if spec.sparse_fp16_tflops is not None:
        assert spec.fp16_tflops <= spec.sparse_fp16_tflops
        assert spec.fp16_tflops == pytest.approx(spec.sparse_fp16_tflops / 2, rel=0.01)


@pytest.mark.parametrize("spec", gpus.CATALOGUE, ids=lambda s: s.name)
def test_bf16_iff_capability_8(spec):
    assert spec.bf16 == (spec.capability >= (8, 0))
    assert (spec.bf16_tflops is not None) == spec.bf16
    assert spec.fp16


def test_t4_is_fp16_only():
    t4 = gpus.find("T4")
    assert t4.capability == (7, 5) and not t4.bf16 and t4.bf16_tflops is None
    assert "bfloat16" not in gpus.machine(t4, fake_host()).compute.matmul


def test_the_catalogue_has_the_cards_people_rent():
    for name in ("T4", "L4", "A10G", "RTX 3090", "RTX 4090", "A100 40GB", "A100-40GB-PCIe", "A100 80GB",
                 "H100-SXM", "H100-PCIe", "H200"):
        gpus.find(name)
    assert any(s.memory_gb <= 8 for s in gpus.CATALOGUE), "no 8 GB card"
    assert len(set(gpus.names())) == len(gpus.CATALOGUE)


@pytest.mark.parametrize("names", [("t4", "T4", "tesla-t4", "Tesla T4"),
                                   ("3090", "rtx3090", "RTX 3090", "NVIDIA GeForce RTX 3090"),
                                   ("a100-40gb", "A100 40GB", "NVIDIA A100-SXM4-40GB"),
                                   ("A100 80GB", "a100_80gb_sxm", "NVIDIA A100-SXM4-80GB"),
                                   ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
                                   ("H100 SXM", "NVIDIA H100 80GB HBM3"),
                                   ("h200", "NVIDIA H200")])
def test_aliases_resolve_to_one_entry(names):
    found = {gpus.find(n).name for n in names}
    assert len(found) == 1, found


def test_unknown_name_lists_the_known_names():
    with pytest.raises(ConfigError) as e:
        gpus.find("V100")
    msg = str(e.value)
    assert "'V100'" in msg and "rule:" in msg and "fix:" in msg
    for name in gpus.names():
        assert name in msg


def test_a_name_that_means_several_cards_is_an_error_with_the_choices():
    with pytest.raises(ConfigError) as e:
        gpus.find("A100")
    assert "A100-40GB-SXM" in str(e.value) and "A100-80GB-PCIe" in str(e.value)


def test_pcie_one_direction_bandwidth():
    assert gpus.find("L4").pcie_bytes_per_s == pytest.approx(31.5e9, rel=0.01)  # 4.0 x16
    assert gpus.find("T4").pcie_bytes_per_s == pytest.approx(15.75e9, rel=0.01)  # 3.0 x16
    assert gpus.find("H100-SXM").pcie_bytes_per_s == pytest.approx(63e9, rel=0.01)  # 5.0 x16


# ------------------------------------------------------------------------------------------------
# machine(): the step-time model's view


def fake_host(op_s=2e-5, view_s=4e-6, host_bw=20e9) -> Machine:
    """A small calibration of a CPU-only machine."""
    cpu = Rates(device="cpu", matmul={"float32": [[1e6, 5e10], [1e9, 1e11]]}, memory_bytes_per_s=host_bw,
                op_s=op_s, view_s=view_s)
    return Machine(name="cpu: test host (2 threads)", source="vramfit doctor --calibrate", compute=cpu, host=cpu,
                   h2d_bytes_per_s={"pinned": 8e9, "pageable": 5e9}, d2h_bytes_per_s={"pinned": 8e9, "pageable": 5e9},
                   optimizers={"torch_fused_adamw@cpu": [2e-9, 3e-5], "deepspeed_cpu_adam@cpu": [1.5e-9, 1e-5]},
                   engines={"amp": {"micro_s": 1e-3, "micro_tensor_s": 0, "step_s": 2e-3, "step_tensor_s": 0}},
                   disk_write_bytes_per_s=1e9, threads=2)


@pytest.mark.parametrize("name", ["L4", "T4", "H100-SXM"])
def test_matmul_rate_is_the_dense_peak_at_any_size(name):
    spec = gpus.find(name)
    m = gpus.machine(spec, fake_host())
    assert m.compute.device == "cuda"
    for flops in (1.0, 1e6, 1e9, 1e12, 1e15):
        assert m.compute.matmul_rate("float16", flops) == spec.fp16_tflops * 1e12
        assert m.compute.matmul_rate("float32", flops) == spec.fp32_tflops * 1e12
        if spec.bf16:
            assert m.compute.matmul_rate("bfloat16", flops) == spec.bf16_tflops * 1e12
    assert m.compute.attention_rate("float16") == spec.fp16_tflops * 1e12
    assert m.compute.memory_bytes_per_s == spec.bandwidth_gb_s * 1e9


def test_copies_over_pcie():
    m = gpus.machine(gpus.find("L4"), fake_host(host_bw=20e9))
    assert m.h2d_bytes_per_s["pinned"] == pytest.approx(31.5e9, rel=0.01)
    assert m.d2h_bytes_per_s["pinned"] == m.h2d_bytes_per_s["pinned"]
    assert m.h2d_bytes_per_s["pageable"] == pytest.approx(10e9)  # host memory: one read and one write per byte
    fast_host = gpus.machine(gpus.find("T4"), fake_host(host_bw=200e9))
    assert fast_host.h2d_bytes_per_s["pageable"] == fast_host.h2d_bytes_per_s["pinned"]  # the link bounds it


def test_gpu_optimizers_priced_from_bandwidth_host_costs_from_the_host():
    host = fake_host()
    spec = gpus.find("A100-80GB-SXM")
    m = gpus.machine(spec, host)
    per_param, per_tensor = m.optimizers["torch_fused_adamw@cuda"]
    assert per_param == pytest.approx(28 / 2039e9) and per_tensor == 3e-5
    assert m.optimizers["deepspeed_fused_adam@cuda"][0] == per_param
    assert m.optimizers["deepspeed_cpu_adam@cpu"] == [1.5e-9, 1e-5]  # runs on the host CPU
    assert m.optimizers["torch_fused_adamw@cpu"] == [2e-9, 3e-5]  # FSDP's offloaded step, on the host CPU
    assert m.host == host.host and m.engines == host.engines and m.threads == 2
    assert (m.compute.op_s, m.compute.view_s) == (2e-5, 4e-6)  # the framework's per-op cost, measured here
    assert m.name == "NVIDIA A100 80GB SXM4 (data sheet: step times on paper)"
    assert "data sheet" in m.source and "test host" in m.source
    assert Machine.from_dict(m.to_dict()) == m


def test_engine_costs_per_parameter_measured_on_the_cpu_do_not_price_a_card():
    # ZeRO-3's per-parameter cost measured with DeepSpeed's CPU accelerator is a host-memory copy at this CPU's
    # speed; on a card it is the PCIe copy the model prices from the data sheet (weight_copies), so it is left out,
    # while the host's fixed and per-tensor bookkeeping stays.
    host = fake_host()
    host.engines["zero3_offload"] = {"micro_s": 6e-3, "micro_tensor_s": 4.8e-4, "micro_param_s": 4.8e-9,
                                     "step_s": 2.6e-3, "step_tensor_s": 6.6e-5, "step_param_s": 2.4e-9}
    a4000, quadro = (gpus.machine(gpus.find(n), host) for n in ("RTXA4000", "QuadroRTX4000"))
    for m in (a4000, quadro):
        z3 = m.engines["zero3_offload"]
        assert z3["micro_param_s"] == z3["step_param_s"] == 0.0
        assert (z3["micro_s"], z3["micro_tensor_s"], z3["step_tensor_s"]) == (6e-3, 4.8e-4, 6.6e-5)
        assert "zero3_offload per parameter: left out" in m.measured["on_paper"]
        assert host.engines["zero3_offload"]["micro_param_s"] == 4.8e-9  # the host's record is untouched
    from types import SimpleNamespace

    from launcher.config.profiles import PROFILES
    from launcher.plan import steptime

    counts = SimpleNamespace(total=7_000_000_000, adapters=20_000_000, trainable_tensors=448)
    ops = {("matmul", "float16", 10**15, 10**10): 1}
    times = [steptime.predict(PROFILES["zero3-fp16-offload-all"], m, ops=ops, counts=counts, micro_batch=1,
                              accumulation=1, seq_len=512, pinned=True, lora=True) for m in (a4000, quadro)]
    # a faster card and link is faster; the engine term is bookkeeping (448 tensors), not 7B parameters' copies
    assert times[0].step_s < times[1].step_s
    assert all(t.parts["engine"] < 0.5 for t in times)


def test_without_a_calibration_an_op_costs_a_kernel_launch():
    m = gpus.machine(gpus.find("T4"), fake_host(op_s=0.0, view_s=0.0))
    assert m.compute.op_s == gpus.CUDA_LAUNCH_S and m.compute.view_s == 0.0
    assert "cuda-graphs" in m.source


# ------------------------------------------------------------------------------------------------
# hardware(): the planner's view


@pytest.fixture(scope="module")
def host_hw():
    return launcher.machine.hardware.probe()


def test_hardware_has_the_card_and_the_ram_given(host_hw):
    spec = gpus.find("RTX 3090")
    hw = gpus.hardware(spec, host_hw, 64)
    assert len(hw.gpus) == 1 and hw.has_cuda
    g = hw.gpu(0)
    assert g.total_bytes == g.free_bytes == spec.memory_bytes
    assert g.capability == (8, 6) and g.bf16 and g.fp16
    assert hw.ram_total_bytes == hw.ram_available_bytes == 64 * GiB
    assert hw.cpu_count == host_hw.cpu_count and hw.deepspeed == host_hw.deepspeed
    kept = gpus.hardware(spec, host_hw, None)
    assert kept.ram_available_bytes == host_hw.ram_available_bytes
    assert host_hw.gpus is not hw.gpus  # the host's record is not touched
    with pytest.raises(ConfigError):
        gpus.hardware(spec, host_hw, 0)


def test_planning_for_a_t4_picks_fp16_within_its_memory(host_hw):
    t4 = gpus.find("T4")
    cfg = load_config(None, ["model.name=tiny", "data.seq_len=64"])
    p = planner.plan(cfg, gpus.hardware(t4, host_hw, 32))
    assert p.chosen is not None and p.settings["precision"] == "fp16"
    assert p.get(p.chosen).precision == "fp16" and p.settings["device"] == "cuda"
    assert p.budget["gpu_bytes"] == int(t4.memory_bytes * (1 - cfg.memory.margin))
    assert p.budget["cpu_bytes"] == int(32 * GiB * (1 - cfg.memory.margin))
    assert "NVIDIA T4" in p.budget["gpu_source"]


def test_the_docs_page_carries_the_catalogue():
    text = open(os.path.join(ROOT, "docs", "gpus.md")).read()
    body = text.split("<!-- gpus:start -->\n", 1)[1].split("\n<!-- gpus:end -->", 1)[0]
    assert body == gpus.markdown_table(), ("docs/gpus.md: the table differs from launcher/plan/gpus.py; fix: paste the output "
                                           "of python -c 'from launcher.plan import gpus; print(gpus.markdown_table())'")


@pytest.mark.parametrize("gpu,budget", [("RTX 3090", None), ("T4", 0.6), ("T4", 0.58)])
def test_a_plan_per_gpu_keeps_the_exact_plans_choice(host_hw, gpu, budget):
    """`--compare-gpus` plans every card with only the chosen row from exact traces (exact_rows=False): it
    chooses what the full plan chooses, with the same exact row (tight budgets make the search checkpoint every
    2nd layer, then every layer)."""
    spec = gpus.find(gpu)
    over = [f"memory.gpu_budget={budget}"] if budget else []
    cfg = load_config(None, ["model.name=tiny", "data.seq_len=512", "train.global_batch_size=8", *over])
    hw, m = gpus.hardware(spec, host_hw, 32), gpus.machine(spec, fake_host())
    full, lazy = planner.plan(cfg, hw, machine=m), planner.plan(cfg, hw, machine=m, exact_rows=False)
    assert lazy.chosen == full.chosen
    a, b = full.chosen_plan, lazy.chosen_plan
    assert (b.setting, b.micro_batch, b.gpu_bytes, b.cpu_bytes, b.step_s) == \
        (a.setting, a.micro_batch, a.gpu_bytes, a.cpu_bytes, a.step_s)


def test_with_defaults_an_8b_qlora_at_seq_2048_fits_a_t4(host_hw):
    """The micro-batch is the planner's by default: Llama-3.1-8B QLoRA r16 at seq 2048 finds a micro-batch that
    fits a T4 (a fixed micro-batch 8 planned 14.2 GiB against 13.3 and fitted nothing)."""
    if not host_hw.bitsandbytes:
        pytest.skip("bitsandbytes is not installed: 4-bit is refused before planning")
    t4 = gpus.find("T4")
    cfg = load_config(None, [f"model.name={ROOT}/examples/configs/llama-3.1-8b", "model.quantize=4bit", "lora.r=16",
                             "data.seq_len=2048"])
    assert cfg.train.micro_batch_size == "auto"
    p = planner.plan(cfg, gpus.hardware(t4, host_hw, 32), machine=gpus.machine(t4, fake_host()))
    row = p.chosen_plan
    assert row is not None and row.gpu_bytes <= p.budget["gpu_bytes"]
    assert 1 <= row.micro_batch < 8 and row.accumulation * row.micro_batch == cfg.train.global_batch_size
    fixed = planner.plan(load_config(None, [f"model.name={ROOT}/examples/configs/llama-3.1-8b", "model.quantize=4bit",
                                            "lora.r=16", "data.seq_len=2048", "train.micro_batch_size=8",
                                            "profile=amp-fp16"]), gpus.hardware(t4, host_hw, 32))
    assert fixed.get("amp-fp16").micro_batch == 8  # a fixed micro-batch stays possible
