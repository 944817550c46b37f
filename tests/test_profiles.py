import json
import os

import pytest

from helpers import needs_deepspeed, run_cli
from launcher.config import profiles
from launcher.config.profiles import PROFILES, find_auto, resolve_ds_config

DS = [p for p in PROFILES.values() if p.is_deepspeed]


def test_ds_configs_match_code():
    assert profiles.check_all() == []
    r = run_cli("profiles", "--check")
    assert r.returncode == 0, r.stderr


def test_check_detects_drift(tmp_path):
    profiles.write_all(str(tmp_path))
    path = tmp_path / "zero2-bf16.json"
    cfg = json.loads(path.read_text())
    cfg["zero_optimization"]["stage"] = 1
    path.write_text(json.dumps(cfg))
    (tmp_path / "zero9-fp8.json").write_text("{}")
    problems = profiles.check_all(str(tmp_path))
    assert any("zero2-bf16.json: differs" in p for p in problems)
    assert any("zero9-fp8.json: no such profile" in p for p in problems)
    r = run_cli("profiles", "--check", "--dir", str(tmp_path))
    assert r.returncode == 1 and "vramfit profiles" in r.stderr


def test_names_follow_the_contract():
    for p in PROFILES.values():
        parts = p.name.split("-")
        assert parts[1] == p.precision
        assert p.offloads == ("offload" in p.name)


@pytest.mark.parametrize("p", [p for p in DS if p.precision == "fp16"], ids=lambda p: p.name)
def test_fp16_profiles_carry_dynamic_loss_scaling(p):
    fp16 = json.load(open(os.path.join(profiles.DS_CONFIG_DIR, f"{p.name}.json")))["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                    "hysteresis": 2, "min_loss_scale": 1}


@needs_deepspeed
@pytest.mark.parametrize("p", DS, ids=lambda p: p.name)
def test_every_profile_resolves_and_deepspeed_accepts_it(p):
    from deepspeed.runtime.config import DeepSpeedConfig

    assert find_auto(profiles.ds_config_template(p))  # the shipped file keeps run-dependent values open
    cfg = resolve_ds_config(p, micro_batch=2, accumulation=4, world=1, grad_clip=1.0, lr=1e-4, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.0, hidden_size=4096, pin_memory=False,
                            nvme_path="/tmp/vramfit-nvme")  # memory.nvme_path: only the NVMe profiles read it
    assert find_auto(cfg) == []
    ds = DeepSpeedConfig(cfg)  # pydantic, extra keys forbidden: a typo in our table fails here
    assert ds.zero_optimization_stage == p.zero_stage
    assert ds.train_batch_size == 8 and ds.gradient_accumulation_steps == 4
    assert ds.zero_config.reduce_bucket_size == 4096 * 4096
    assert bool(ds.zero_config.offload_optimizer) == p.offload_optimizer
    assert bool(ds.zero_config.offload_param) == p.offload_param
