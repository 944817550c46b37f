import glob
import os

import pytest

from helpers import ROOT, run_cli
from launcher.config.load import load_config
from launcher.config.schema import Config, ConfigError


def problems_of(*overrides, path=None):
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return e.value.problems


def test_defaults_validate():
    cfg = load_config(None, [])
    assert isinstance(cfg, Config) and cfg.model.name == "tiny"


def test_unknown_key_named_with_suggestion():
    (p,) = problems_of("train.lr_max=1")
    assert "train.lr_max" in p and "unknown key" in p and "did you mean train.lr" in p


def test_unknown_top_level_and_nested_all_reported_at_once():
    ps = problems_of("lerning_rate=1", "model.nam=x", "train.micro_batch_size=abc", "precision=fp8")
    assert len(ps) == 4
    joined = "\n".join(ps)
    assert "lerning_rate" in joined and "model.nam" in joined and "did you mean model.name" in joined
    assert "train.micro_batch_size: got 'abc'" in joined and "a whole number or 'auto'" in joined
    assert "precision: got 'fp8'" in joined and "one of auto, fp16, bf16, fp32" in joined


def test_bad_type_says_value_rule_fix():
    (p,) = problems_of("model.gradient_checkpointing=maybe")
    assert "got 'maybe'" in p and "rule: must be true or false" in p and "fix:" in p


def test_bounds():
    (p,) = problems_of("train.max_steps=0")
    assert "must be >= 1" in p and "fix: train.max_steps=1" in p


def test_batch_arithmetic():
    (p,) = problems_of("train.global_batch_size=10", "train.micro_batch_size=4")
    assert "multiple of 4" in p and "global_batch_size=8 or 12" in p


def test_batch_arithmetic_counts_ranks():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.global_batch_size=6", "train.micro_batch_size=2"], world=2)
    assert "2 rank(s)" in str(e.value) and "multiple of 4" in str(e.value)


def test_auto_micro_batch_accepted():
    assert load_config(None, ["train.micro_batch_size=auto"]).train.micro_batch_size == "auto"


def test_profile_engine_mismatch():
    (p,) = problems_of("profile=zero2-bf16", "engine=amp")
    assert "engine: got 'amp' with profile=zero2-bf16" in p


def test_unknown_profile_suggests():
    (p,) = problems_of("profile=zero2-bf17")
    assert "profile: got 'zero2-bf17'" in p and "zero2-bf16-offload-opt" in p  # the value, and the choices
    assert "fix: profile=zero2-bf16" in p


def test_yaml_file_and_missing_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 0.01\n  bogus: 1\nmodel:\n  name: tiny\n")
    (p,) = problems_of(path=str(f))
    assert "train.bogus" in p
    ps = problems_of(path=str(tmp_path / "nope.yaml"))
    assert "not found" in ps[0]


def test_overrides_beat_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 0.01\n")
    assert load_config(str(f), ["train.lr=0.5"]).train.lr == 0.5


def test_cli_config_errors_one_message_nonzero_exit():
    r = run_cli("train", "train.bogus=1", "train.global_batch_size=7", "train.micro_batch_size=x")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "2 problems in the configuration" in r.stderr, r.stderr
    r = run_cli("train", "train.global_batch_size=10", "train.micro_batch_size=4")
    assert r.returncode == 2 and "multiple of 4" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_example_configs_validate(path):
    load_config(path, [])


def test_yaml_booleans_in_string_fields():
    """YAML 1.1 reads `off` as false; a string field with on/off choices takes it back."""
    assert load_config(None, ["log.progress=off"]).log.progress == "off"
    assert load_config(None, ["log.progress=on"]).log.progress == "on"
