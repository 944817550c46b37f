"""ZeRO-Infinity's NVMe offload profiles: the catalogue, the planner's disk part and refusals, bad folders, and
(with DeepSpeed's async_io op) training on the CPU like ZeRO-3 CPU offload."""

from __future__ import annotations

import os

import pytest

from helpers import compare, losses, needs_deepspeed, run_cli, run_inprocess
from launcher.config import profiles
from launcher.config.load import load_config
from launcher.config.schema import ConfigError
from launcher.machine.deepspeed_ops import async_io_status
from launcher.machine.hardware import GPUInfo, Hardware
from launcher.plan import planner
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
    # 48 GB of RAM cannot hold 16 B/param of 7B; it holds what NVMe leaves in RAM: ZeRO-3's pinned 16-bit gradient
    # partitions and, at the end, the 16-bit model DeepSpeed gathers on rank 0 for final/ (32 GB would not)
    small = plan_7b(hw_with_disk(free_gib=500, ram_gib=48))
    assert small.chosen and "nvme" in small.chosen, small.reason
    tight = plan_7b(hw_with_disk(free_gib=500, ram_gib=32))
    assert tight.chosen is None and tight.get("zero3-bf16-offload-nvme-all").host_peak_phase == "final"
    # a disk too small: refused, and said so
    short = plan_7b(hw_with_disk(free_gib=20, ram_gib=48))
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
    from launcher.plan.resolve import resolve

    cfg = load_config(None, ["model.name=tiny", "data.seq_len=32", "train.micro_batch_size=2",
                             "train.global_batch_size=8", f"memory.nvme_path={tmp_path}"])
    spec = resolve(cfg, hw_with_disk(free_gib=100, ram_gib=32, tmpfs=True, path=str(tmp_path)))
    assert any("RAM in disguise" in r for r in spec.reasons)


def test_doctor_names_the_async_io_op():
    r = run_cli("doctor")
    assert r.returncode == 0 and "async_io op (NVMe offload):" in r.stdout


def test_each_engine_gets_its_own_swap_folder_and_a_dead_runs_folder_goes(tmp_path):
    """DeepSpeed never deletes its swap files and its checkpoints copy the whole folder: each engine gets a new
    folder (removed when it closes), and a folder whose process on this host is gone (a killed run) is removed by
    the next run; a running process's folder, another host's (a shared disk), and anything not named like ours
    stay."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from launcher.engines.swap import SWAP_PREFIX, _host, nvme_folder

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, here = int(gone.stdout), _host()
    stale = f"{SWAP_PREFIX}{here}-{dead}-abc1_x"
    kept = [f"{SWAP_PREFIX}{here}-{os.getpid()}-mine", f"{SWAP_PREFIX}other-host-{dead}-abc", f"{SWAP_PREFIX}{dead}",
            f"{SWAP_PREFIX}x1", "other"]
    for name in (stale, *kept):
        (tmp_path / name / "zero_stage_3").mkdir(parents=True)
        (tmp_path / name / "zero_stage_3" / "0_38.tensor.swp").write_bytes(b"x" * 4096)
    (tmp_path / f"{SWAP_PREFIX}{here}-{dead}-file").write_text("a file, not a folder")
    cfg = SimpleNamespace(memory=SimpleNamespace(nvme_path=str(tmp_path)))
    spec = SimpleNamespace(profile=profiles.PROFILES["zero3-bf16-offload-nvme-opt"])
    first, second = nvme_folder(cfg, spec), nvme_folder(cfg, spec)
    assert first != second and os.path.dirname(first) == str(tmp_path)
    assert os.path.basename(first).startswith(f"{SWAP_PREFIX}{here}-{os.getpid()}-")
    left = set(os.listdir(tmp_path)) - {os.path.basename(first), os.path.basename(second)}
    assert left == {*kept, f"{SWAP_PREFIX}{here}-{dead}-file"}
    assert nvme_folder(cfg, SimpleNamespace(profile=profiles.PROFILES["zero3-bf16-offload-all"])) == ""


needs_aio = pytest.mark.skipif(async_io_status() != "usable", reason="DeepSpeed's async_io op cannot build here (libaio)")


@pytest.mark.slow
@pytest.mark.extended  # a fresh environment JIT-builds async_io first: minutes on 2 cores
@needs_deepspeed
@needs_aio
def test_nvme_offload_trains_like_zero3_cpu_offload_and_resumes(tmp_path):
    """Each NVMe profile swaps through a folder of its engine's under memory.nvme_path (removed when the run
    ends), trains like ZeRO-3 CPU offload, and a run stopped at step 4 resumes on its uninterrupted curve exactly:
    DeepSpeed's checkpoint restores the swapped fp32 master only if the files carry this engine's names, and
    never the moments or what stays in memory (launcher.engines.deepspeed._resident_optimizer_state)."""
    import signal

    from launcher.training.faults import Hooks

    _, ref = run_inprocess(tmp_path, *QUIET, "profile=zero3-bf16-offload-all", "run_name=cpu", "checkpoint.save=false")
    nv = tmp_path / "nvme"
    nv.mkdir()
    for prof in ("zero3-bf16-offload-nvme-opt", "zero3-bf16-offload-nvme-all"):
        seen = []  # the swap folders and their bytes after each step

        def swapped(step, seen=seen):
            folders = os.listdir(nv)
            seen.append((folders, sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nv) for f in fs)))

        args = [*QUIET, f"profile={prof}", f"memory.nvme_path={nv}", "checkpoint.every_steps=4",
                "train.max_steps=8"]
        s, rows = run_inprocess(tmp_path, *args, f"run_name={prof}", hooks=Hooks(after_step=swapped))
        assert s["status"] == "completed" and all(len(f) == 1 and n > 0 for f, n in seen), seen
        assert os.listdir(nv) == []  # the engine's swap folder goes when it closes
        mx, _ = compare(losses(rows), losses(ref)[:8], f"{prof} vs zero3-bf16-offload-all")
        assert mx < 2e-2

        def stop(step):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

        cut, _ = run_inprocess(tmp_path, *args, f"run_name={prof}-cut", hooks=Hooks(after_step=stop))
        assert cut["status"] == "interrupted" and cut["steps"] == 4
        again, resumed = run_inprocess(tmp_path, *args, f"run_name={prof}-cut")
        assert again["status"] == "completed" and again["resumed_from"] == cut["checkpoint"]
        assert losses(resumed) == losses(rows)  # measured identical, bf16 included
        assert os.listdir(nv) == []


@pytest.mark.slow
@pytest.mark.extended
@needs_deepspeed
@needs_aio
def test_a_checkpoint_missing_swap_files_is_refused_and_a_ladder_moves_onto_nvme(tmp_path, monkeypatch):
    """A checkpoint whose NVMe files are not the ones this engine reads (written by an engine whose parameters
    DeepSpeed numbered from 1000, as a second engine in one process was before vramfit numbered them from 0)
    is refused before anything trains: resuming would start those groups afresh. And the OOM ladder's last rung,
    onto NVMe, carries the fp32 master and Adam's moments over exactly (a fresh engine's swapped state is made
    swap-aware)."""
    import signal

    from deepspeed.runtime.zero.partition_parameters import Init

    from helpers import oom_hook
    from launcher.engines import deepspeed as ds_engine
    from launcher.training.faults import Hooks

    nv = tmp_path / "nvme"
    nv.mkdir()
    args = [*QUIET, "profile=zero3-bf16-offload-nvme-opt", f"memory.nvme_path={nv}", "checkpoint.every_steps=2",
            "train.max_steps=4"]
    numbered = ds_engine._number_parameters_from_zero
    monkeypatch.setattr(ds_engine, "_number_parameters_from_zero", lambda: setattr(Init, "param_id", 1000))
    cut, _ = run_inprocess(tmp_path, *args, "run_name=cut", hooks=Hooks(
        after_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 2 else None))
    monkeypatch.setattr(ds_engine, "_number_parameters_from_zero", numbered)
    written = sorted(os.listdir(os.path.join(cut["checkpoint"], "ds", "offloaded_tensors", "rank00")))
    assert written and all("1000_" in f for f in written), written
    with pytest.raises(ConfigError) as e:
        run_inprocess(tmp_path, *args, "run_name=cut")
    assert "lacks" in str(e.value) and "exp_avg-0_" in str(e.value) and "freshly initialized" in str(e.value)
    assert os.listdir(nv) == []  # the refused engine's swap folder went too

    base = [*QUIET, "profile=zero3-bf16-offload-all", "train.micro_batch_size=1", "train.global_batch_size=8",
            "train.max_steps=6", "train.warmup_steps=2", "model.gradient_checkpointing=true",
            f"memory.nvme_path={nv}", "checkpoint.save=false"]
    s, rows = run_inprocess(tmp_path, *base, "run_name=oom", hooks=oom_hook([3]))
    assert s["status"] == "completed" and [f["to"]["profile"] for f in s["fallbacks"]] == [
        "zero3-bf16-offload-nvme-opt"]
    _, ref = run_inprocess(tmp_path, *base, "run_name=ref")
    assert losses(rows) == losses(ref)  # measured identical
    assert os.listdir(nv) == []


@pytest.mark.slow
@pytest.mark.extended
@needs_deepspeed
@needs_aio
def test_an_oom_on_nvme_rebuilds_the_engine_with_its_swapped_state(tmp_path):
    """The OOM ladder on an NVMe profile halves the micro-batch by rebuilding the engine from the old one's state
    (read through DeepSpeed's swapper) into a new one's (made swap-aware): the run follows one that used the
    smaller micro-batch from the start."""
    from helpers import oom_hook

    nv = tmp_path / "nvme"
    nv.mkdir()
    base = [*QUIET, "profile=zero3-bf16-offload-nvme-opt", "train.global_batch_size=8", "train.max_steps=6",
            "train.warmup_steps=2", f"memory.nvme_path={nv}", "checkpoint.save=false"]
    s, rows = run_inprocess(tmp_path, *base, "train.micro_batch_size=4", "run_name=oom", hooks=oom_hook([3]))
    assert s["status"] == "completed" and [r["micro_batch"] for r in rows] == [4, 4, 4, 2, 2, 2]
    _, ref = run_inprocess(tmp_path, *base, "train.micro_batch_size=2", "run_name=ref")
    mx, _ = compare(losses(rows), losses(ref), "NVMe OOM ladder vs micro-batch 2 from the start")
    assert mx < 1e-3  # bf16, micro-batch 4 x 2 vs 2 x 4 for the first three steps: 3.7e-4 measured
    assert os.listdir(nv) == []
