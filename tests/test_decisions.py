"""The pure decisions, each in its one home, checked without a training run: what can run here (availability),
the resolved run (resolve), the OOM ladder's moves, the weights' dtype, the batch equation and overrides."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from launcher.config.checks import batch_problem
from launcher.config.load import load_config, with_overrides
from launcher.config.profiles import MODULE_IN_COMPUTE_DTYPE, PROFILES
from launcher.config.schema import AUTO, ConfigError, to_dict
from launcher.machine.hardware import GPUInfo, Hardware
from launcher.plan import availability
from launcher.plan import resolve as resolve_module
from launcher.plan.ladder import Rung, next_move
from launcher.precision import weight_dtype

GiB = 1 << 30


def host(gpu_gib: float | None = None, deepspeed: str | None = "0.19.8") -> Hardware:
    gpus = [] if gpu_gib is None else [GPUInfo(0, "Test GPU", int(gpu_gib * GiB), int(gpu_gib * GiB), (8, 0), True,
                                               True)]
    return Hardware(gpus=gpus, ram_total_bytes=64 * GiB, ram_available_bytes=64 * GiB, deepspeed=deepspeed,
                    bitsandbytes=None)


@pytest.mark.parametrize("overrides", [[], ["profile=zero2-fp32"], ["engine=amp"]], ids=["auto", "profile", "engine"])
def test_a_start_assesses_the_machine_once(monkeypatch, overrides):
    calls = []
    real = availability.assess
    monkeypatch.setattr(availability, "assess", lambda *a, **k: calls.append(a) or real(*a, **k))
    spec = resolve_module.resolve(load_config(None, overrides), host())
    assert len(calls) == 1, calls
    assert spec.usable, "the OOM ladder's profiles come from the same answer"


@pytest.mark.parametrize("gpu", [None, 16.0], ids=["cpu", "gpu"])
@pytest.mark.parametrize("asked", [[], ["profile=zero2-bf16"], ["engine=fsdp"], ["engine=deepspeed"]])
def test_a_widened_answer_equals_assessing_the_widened_config(gpu, asked):
    hw = host(gpu)
    cfg = load_config(None, asked)
    try:
        avail = availability.assess(cfg, hw)
    except ConfigError:
        pytest.skip("not a run this host can make")
    for precision in ("fp32", "bf16", "fp16"):
        wide = replace(cfg, profile=AUTO)
        again = availability.assess(replace(wide, precision=precision), hw)
        got = avail.widened(wide, precision)
        assert got.problems == again.problems and got.unwanted == again.unwanted
        assert [p.name for p in got.usable(allow_offload=True)] == [p.name for p in again.usable(allow_offload=True)]


def test_deepspeed_missing_is_why_amp_was_chosen():
    spec = resolve_module.resolve(load_config(None, []), host(deepspeed=None))
    assert spec.engine == "amp"
    assert any("not DeepSpeed: DeepSpeed is not installed" in r for r in spec.reasons), spec.reasons


def test_a_profile_that_cannot_run_here_is_refused_with_one_that_can():
    with pytest.raises(ConfigError) as e:
        resolve_module.resolve(load_config(None, ["profile=zero2-fp32"]), host(deepspeed=None))
    msg = str(e.value)
    assert "profile: got 'zero2-fp32'" in msg and "DeepSpeed is not installed" in msg and "fix: profile=amp-fp32" in msg


def test_the_ladder_halves_the_micro_batch_then_checkpoints_then_offloads_keeping_the_global_batch():
    usable = [PROFILES[n] for n in ("zero2-bf16", "zero2-bf16-offload-opt", "zero3-bf16-offload-all")]
    now, kinds = Rung(8, 2, False, "zero2-bf16"), []
    while (move := next_move(now, usable)) is not None:
        assert move.to.micro_batch * move.to.accumulation == 16, move
        kinds.append((move.kind, move.to.micro_batch, move.to.profile))
        now = move.to
    assert kinds == [("micro_batch", 4, "zero2-bf16"), ("micro_batch", 2, "zero2-bf16"), ("micro_batch", 1, "zero2-bf16"),
                     ("checkpointing", 1, "zero2-bf16"), ("profile", 1, "zero2-bf16-offload-opt"),
                     ("profile", 1, "zero3-bf16-offload-all")]
    assert next_move(Rung(6, 1, True, "amp-fp32", 2), [PROFILES["amp-fp32"]]).to.micro_batch == 3
    assert next_move(Rung(1, 4, True, "amp-fp32", 2), []).reason.endswith("on every layer (was every 2)")


@pytest.mark.parametrize("engine,precision,adapters,dtype", [
    ("deepspeed", "bf16", False, torch.bfloat16), ("deepspeed", "fp16", True, torch.float16),
    ("amp", "bf16", True, torch.bfloat16), ("amp", "bf16", False, torch.float32), ("amp", "fp16", False, torch.float32),
    ("fsdp", "bf16", True, torch.bfloat16), ("fsdp", "bf16", False, torch.float32), ("amp", "fp32", True, torch.float32),
    ("deepspeed", "fp32", False, torch.float32),
])
def test_the_weights_dtype_rule(engine, precision, adapters, dtype):
    assert weight_dtype(MODULE_IN_COMPUTE_DTYPE[engine], precision, adapters) == dtype


def test_the_batch_equation():
    assert batch_problem(8, 2, 2) is None
    msg = batch_problem(10, 4, 1)
    assert "multiple of 4" in msg and "train.global_batch_size=8 or 12" in msg
    assert "multiple of 6" in batch_problem(8, 3, 2)


def test_overrides_are_parsed_once_as_the_command_line_parses_them():
    base = load_config(None, ["data.seq_len=64"])
    changes = ["lora.r=16", "model.gradient_checkpointing=on", "train.micro_batch_size=1", "train.lr=2e-4"]
    assert to_dict(with_overrides(base, changes)) == to_dict(load_config(None, ["data.seq_len=64", *changes]))
    with pytest.raises(ConfigError, match=r"lora\.rr: unknown key.*did you mean lora\.r\?"):
        with_overrides(base, ["lora.rr=16"])
    with pytest.raises(ConfigError, match="not a key=value override"):
        with_overrides(base, ["lora.r"])


def test_without_step_times_a_cpu_and_a_gpu_rank_amp_first():
    """The speed ranks tie AMP and ZeRO-2 (and their optimizer offloads); without step times AMP goes first on a CPU
    (DeepSpeed's engine only adds work to a step) and on a GPU (issue 43: on one H200 ZeRO-2 ran at 0.56x AMP's
    tokens/s with the same memory, ZeRO-2 offload at 0.32x), and the reasons say the choice was not priced."""
    cpu = resolve_module.resolve(load_config(None, []), host())
    assert cpu.profile.name == "amp-fp32", cpu.profile
    assert any("step times not priced" in r and "torch's AMP first" in r for r in cpu.reasons), cpu.reasons
    gpu = [p.name for p in availability.assess(load_config(None, []), host(gpu_gib=80.0)).usable()]
    assert gpu[0] == "amp-bf16", gpu
    if "zero2-bf16" in gpu:
        assert gpu.index("amp-bf16") < gpu.index("zero2-bf16")
        assert gpu.index("amp-bf16-offload-opt") < gpu.index("zero2-bf16-offload-opt") < gpu.index("fsdp-bf16-offload")


def test_a_checkpoint_on_another_number_of_ranks_keeps_the_global_batch_or_is_refused():
    """The rung a resume goes on with on another number of ranks (launcher.plan.resolve.rung_on_ranks): the global
    batch kept with the largest micro-batch that divides each rank's share; ZeRO moves through DeepSpeed's
    universal checkpoint, except with the optimizer on NVMe (refused with the fix); a global batch the ranks
    cannot split refused."""
    from launcher.config.profiles import PROFILES
    from launcher.config.schema import ConfigError
    from launcher.plan.ladder import Rung
    from launcher.plan.resolve import rung_on_ranks

    amp = PROFILES["amp-fp32"]
    rung = Rung(micro_batch=4, accumulation=1, checkpointing=False, profile="amp-fp32")
    assert rung_on_ranks(rung, amp, 2, 1, "ckpt", 8)[0] == Rung(4, 2, False, "amp-fp32")  # 2 ranks -> 1
    assert rung_on_ranks(rung, amp, 1, 4, "ckpt", 8)[0] == Rung(2, 1, False, "amp-fp32")  # each rank's share is 2
    with pytest.raises(ConfigError, match="does not split over 3 ranks"):
        rung_on_ranks(rung, amp, 1, 3, "ckpt", 8)
    zero, note = rung_on_ranks(Rung(4, 1, False, "zero2-fp32"), PROFILES["zero2-fp32"], 2, 1, "ckpt", 8)
    assert zero == Rung(4, 2, False, "zero2-fp32") and "universal checkpoint" in note, note
    nvme = PROFILES["zero3-bf16-offload-nvme-opt"]
    with pytest.raises(ConfigError, match="NVMe swap files.*torchrun --nproc_per_node 2"):
        rung_on_ranks(Rung(4, 1, False, nvme.name), nvme, 2, 1, "ckpt", 8)


def test_the_heap_gives_freed_memory_back_with_several_ranks(monkeypatch):
    """memory.mmap_threshold_mib=auto fixes glibc's mmap threshold at 4 MiB with several ranks, a tight host budget
    or a sharded engine computing on the CPU, and leaves glibc's own otherwise; a number is taken as it is;
    MALLOC_MMAP_THRESHOLD_ in the environment is the user's and wins."""
    from launcher.machine import heap

    assert heap.threshold_mib("auto", 1) == 0 and heap.threshold_mib("auto", 2) == 4.0
    assert heap.threshold_mib(16, 1) == 16.0 and heap.threshold_mib(0, 4) == 0.0
    # one process whose planned host peak leaves the heap little room: fixed too
    assert heap.threshold_mib("auto", 1, 0.8) == 4.0 and heap.threshold_mib("auto", 1, 0.5) == 0.0
    assert heap.threshold_mib(0, 1, 0.99) == 0.0  # the user's 0 stands
    # the CPU computes the step of an engine that gathers each layer at every step (FSDP2, ZeRO-3): fixed too
    assert heap.threshold_mib("auto", 1, 0.5, gathers_on_cpu=True) == 4.0
    assert heap.threshold_mib(0, 1, 0.5, gathers_on_cpu=True) == 0.0
    assert heap.fix_mmap_threshold(0) == "glibc's default mmap threshold"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.fix_mmap_threshold(4) == "MALLOC_MMAP_THRESHOLD_=65536 from the environment"
