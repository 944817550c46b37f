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
    if p.zero_stage == 3:  # not known here (no model): DeepSpeed's own bound on what stays gathered
        assert ds.zero_config.max_live_parameters == 1_000_000_000 and ds.zero_config.max_reuse_distance == 0


def test_zero3_keeps_gathered_what_the_plan_counts():
    """ZeRO-3's stage3_max_live_parameters is the largest module plus one prefetch bucket and its reuse distance 0
    (the plan counts the one and prices the other's second gather), for the catalogue and a user's "auto" alike;
    an explicit value is the user's."""
    p = profiles.PROFILES["zero3-bf16-offload-all"]
    kw = dict(micro_batch=1, accumulation=1, world=2, grad_clip=1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
              weight_decay=0.0, hidden_size=2048, pin_memory=False)
    zero = resolve_ds_config(p, largest_module=262_668_288, **kw)["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 2048 * 2048)
    assert zero["stage3_max_live_parameters"] == 262_668_288 + zero["stage3_prefetch_bucket_size"]
    assert zero["stage3_max_reuse_distance"] == 0
    values = profiles.RunValues("bf16", 1, 1, 2, 1.0, 1e-4, (0.9, 0.95), 1e-8, 0.0, 2048, False, largest_module=1000)
    user = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 500, "stage3_max_live_parameters": "auto",
                                  "stage3_max_reuse_distance": 7}}
    zero = profiles.fill_auto(user, values)[0]["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == 1500 and zero["stage3_max_reuse_distance"] == 7
