"""ZeRO-Infinity's NVMe offload profiles: the catalogue, the planner's disk part and refusals, bad folders, and
(with DeepSpeed's async_io op) training on the CPU like ZeRO-3 CPU offload."""

from __future__ import annotations

import os

import pytest

from helpers import compare, losses, needs_deepspeed, run_cli, run_inprocess
from launcher import planner, profiles
from launcher.config import ConfigError, load_config
from launcher.hardware import GPUInfo, Hardware, async_io_status
from launcher.units import GiB

QUIET = ["log.memory_interval_s=0"]


def hw_with_disk(free_gib: float, ram_gib=16.0, gpu_gib=8.0, tmpfs=False, path="/nvme") -> Hardware:
    gpus = [GPUInfo(0, "Test GPU", int(gpu_gib * GiB), int(gpu_gib * GiB), (8, 0), True, True)]
    hw = Hardware(gpus=gpus, ram_total_bytes=int(ram_gib * GiB), ram_available_bytes=int(ram_gib * GiB),
                  deepspeed="0.19.8", async_io="usable")
    hw.nvme = {"path": path, "free_bytes": int(free_gib * GiB), "fs_type": "tmpfs" if tmpfs else "ext4",
               "tmpfs": tmpfs, "write_bytes_per_s": 2e9, "read_bytes_per_s": 3e9}
    return hw


def test_nvme_profiles_in_the_catalogue_and_their_configs():
    for prec in ("fp16", "bf16"):
        opt, every = profiles.PROFILES[f"zero3-{prec}-offload-nvme-opt"], profiles.PROFILES[f"zero3-{prec}-offload-nvme-all"]
        assert opt.nvme_optimizer and not opt.nvme_param and every.nvme_param
        cfg = profiles.resolve_ds_config(every, micro_batch=1, accumulation=8, world=1, grad_clip=1.0, lr=1e-4,
                                         betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, hidden_size=64,
                                         pin_memory=False, nvme_path="/nvme/run", largest_param=300_000_000)
        z = cfg["zero_optimization"]
        assert z["offload_optimizer"] == {"device": "nvme", "nvme_path": "/nvme/run", "pin_memory": False,
                                          "buffer_count": 4}
        assert z["offload_param"]["nvme_path"] == "/nvme/run" and z["offload_param"]["buffer_size"] == 300_000_000
        assert z["sub_group_size"] == profiles.NVME_SUB_GROUP and "aio" in cfg
    assert "offload_optimizer nvme + offload_param nvme" in profiles.table_markdown()
    assert profiles.check_all() == []


def plan_7b(hw, *extra):
    cfg = load_config(None, ["model.name=llama-7b", "data.seq_len=512", "train.global_batch_size=8",
                             "train.micro_batch_size=1", "model.gradient_checkpointing=true", "precision=bf16",
                             "memory.nvme_path=/tmp", *extra])
    return planner.plan(cfg, hw)


def test_planner_picks_nvme_only_when_ram_cannot_hold_the_offload_and_counts_the_disk():
    p = plan_7b(hw_with_disk(free_gib=500, ram_gib=256))
    row = p.get("zero3-bf16-offload-nvme-opt")
    disk = row.parts["disk"]
    n = p.model["params"]
    assert disk == {"master_weights": 4 * n, "optimizer_states": 8 * n}
    assert row.cpu_bytes < p.get("zero3-bf16-offload-all").cpu_bytes - 10 * n  # 12 B/param left the RAM
    every = p.get("zero3-bf16-offload-nvme-all")
    assert every.parts["disk"]["weights"] == 2 * n and every.cpu_bytes < row.cpu_bytes
    assert "nvme" not in p.chosen  # 256 GB of RAM holds ZeRO-3's CPU offload: NVMe is not needed
    small = plan_7b(hw_with_disk(free_gib=500, ram_gib=32))
    assert small.chosen and "nvme" in small.chosen, small.reason  # 32 GB of RAM cannot hold 16 B/param of 7B
    # a disk too small: refused, and said so
    short = plan_7b(hw_with_disk(free_gib=20, ram_gib=32))
    assert short.chosen is None or "nvme" not in short.chosen
    why = short.get("zero3-bf16-offload-nvme-opt").why_not
    assert "disk" in why and "free at memory.nvme_path" in why


def test_nvme_path_problems_are_named_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="memory.nvme_path: got .*no such folder.*fix: mkdir -p"):
        load_config(None, [f"memory.nvme_path={tmp_path / 'missing'}"])
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root writes anywhere: the rule cannot be shown with permissions here
        pytest.skip("running as root: a read-only folder is still writable")
    with pytest.raises(ConfigError, match="not writable"):
        load_config(None, [f"memory.nvme_path={ro}"])


def test_nvme_profile_without_a_path_and_tmpfs_warning(tmp_path):
    with pytest.raises(ConfigError, match="without memory.nvme_path.*fix: memory.nvme_path="):
        load_config(None, ["profile=zero3-bf16-offload-nvme-opt"])
    from launcher.resolve import resolve

    cfg = load_config(None, ["model.name=tiny", "data.seq_len=32", "train.micro_batch_size=2",
                             "train.global_batch_size=8", f"memory.nvme_path={tmp_path}"])
    spec = resolve(cfg, hw_with_disk(free_gib=100, ram_gib=32, tmpfs=True, path=str(tmp_path)))
    assert any("RAM in disguise" in r for r in spec.reasons)


def test_doctor_names_the_async_io_op():
    r = run_cli("doctor")
    assert r.returncode == 0 and "async_io op (NVMe offload):" in r.stdout


needs_aio = pytest.mark.skipif(async_io_status() != "usable", reason="DeepSpeed's async_io op cannot build here (libaio)")


@pytest.mark.slow
@pytest.mark.extended  # a fresh environment JIT-builds async_io first: about 5 minutes on 2 cores
@needs_deepspeed
@needs_aio
def test_nvme_offload_trains_like_zero3_cpu_offload_and_resumes(tmp_path):
    nv = tmp_path / "nvme"
    nv.mkdir()
    _, ref = run_inprocess(tmp_path, *QUIET, "profile=zero3-bf16-offload-all", "run_name=cpu", "checkpoint.save=false")
    for prof in ("zero3-bf16-offload-nvme-opt", "zero3-bf16-offload-nvme-all"):
        s, rows = run_inprocess(tmp_path, *QUIET, f"profile={prof}", f"memory.nvme_path={nv}", f"run_name={prof}",
                                "checkpoint.save=false")
        mx, _ = compare(losses(rows), losses(ref), f"{prof} vs zero3-bf16-offload-all")
        assert s["status"] == "completed" and mx < 2e-2
