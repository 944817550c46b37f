"""deepspeed_config=PATH: a user's own DeepSpeed JSON as a custom profile, on the CPU.

tests/data/hf_ds_config_zero2.json and hf_ds_config_zero3.json are the full "auto" ZeRO-2 and ZeRO-3
example configs of the Hugging Face Transformers DeepSpeed integration docs ("ZeRO-2 Example" with
optimizer offload and 2e8 buckets, "ZeRO-3 Example" with parameter and optimizer offload), as published
there: fp16 "auto" (no bf16 block), AdamW and WarmupLR with "auto" params, batch sizes and clipping "auto".
DeepSpeed refuses fp16 on the CPU, so the runs ask precision=bf16; with "fp16": {"enabled": "auto"} the JSON
follows it.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers import ROOT, compare, losses, needs_deepspeed, run_cli, run_inprocess
from launcher.config.load import load_config
from launcher.config.profiles import bucket_sizes, find_auto
from launcher.config.schema import ConfigError

pytestmark = needs_deepspeed

DATA = os.path.join(ROOT, "tests", "data")
ZERO2 = os.path.join(DATA, "hf_ds_config_zero2.json")
ZERO3 = os.path.join(DATA, "hf_ds_config_zero3.json")
# Short runs (ZeRO-3 offload is slow on 2 cores); the rest of conftest's FAST overrides apply.
RUN = ["train.max_steps=4", "train.warmup_steps=2", "precision=bf16", "log.memory_interval_s=0"]
CLI = ["train.max_steps=2", "train.warmup_steps=1", "train.micro_batch_size=2", "train.global_batch_size=8",
       "data.seq_len=32", "data.num_samples=256", "device=cpu", "precision=bf16"]



def hf_example(path: str) -> dict:
    return json.load(open(path))


def write(tmp_path, cfg: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg, indent=2))
    return str(path)


def ds_config_of(summary) -> dict:
    return json.load(open(os.path.join(summary["run_dir"], "ds_config.json")))


def check_parity(custom_rows, catalogue_rows, name):
    """Same engine, precision, data and schedule; the JSON differs from the catalogue's template in what does not
    touch the arithmetic on one rank (bucket sizes, which only group the gradient copies; pin_memory, which
    changes nothing on the CPU accelerator; steps_per_print) and in the optimizer: the examples' "optimizer"
    section makes DeepSpeed build DeepSpeedCPUAdam, the catalogue passes torch's fused AdamW. Both do AdamW's
    arithmetic in fp32 on the fp32 master weights, in another order, and the bf16 weights round the last bits
    of that apart, by an amount that depends on the initial weights: over seeds 0-3 of the zero2 example,
    7.2e-6 to 5.0e-5 max and 3.3e-6 to 1.6e-5 mean relative over 4 steps (the same optimizer on both sides
    gives 0). 1e-4 / 3e-5 leave room for that and still catch any real difference (a wrong lr or betas moves the
    loss by 1e-3 and more at step 2)."""
    mx, mean = compare(losses(custom_rows), losses(catalogue_rows), name)
    assert mx < 1e-4 and mean < 3e-5, (mx, mean)


def test_hf_zero2_example_trains_like_zero2_bf16_offload_opt(tmp_path):
    s, rows = run_inprocess(tmp_path, *RUN, f"deepspeed_config={ZERO2}", "run_name=custom", "checkpoint.save=false")
    assert s["status"] == "completed" and s["steps"] == 4
    assert s["engine"] == "deepspeed" and s["profile"] == "custom-zero2-bf16-offload-opt"
    assert s["precision"] == "bf16" and s["optimizer"] == "DeepSpeedCPUAdam"
    assert s["predicted_cpu_bytes"] and s["predicted_cpu_bytes"] > 0  # the planner's custom row
    assert any("scheduler WarmupLR dropped" in r and "train.warmup_steps=2" in r for r in s["reasons"]), s["reasons"]
    ds = ds_config_of(s)
    assert find_auto(ds) == [] and "scheduler" not in ds
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["allgather_bucket_size"] == 2e8 and zero["reduce_bucket_size"] == 2e8
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}  # explicit: kept
    assert ds["steps_per_print"] == 2000 and ds["wall_clock_breakdown"] is False
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (2, 4, 8)
    assert ds["gradient_clipping"] == 1.0 and ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert ds["fp16"]["enabled"] is False and ds["bf16"] == {"enabled": True}
    _, ref = run_inprocess(tmp_path, *RUN, "profile=zero2-bf16-offload-opt", "run_name=catalogue",
                           "checkpoint.save=false")
    check_parity(rows, ref, "hf zero2 example vs zero2-bf16-offload-opt")
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_hf_zero3_example_trains_like_zero3_bf16_offload_all(tmp_path):
    s, rows = run_inprocess(tmp_path, *RUN, f"deepspeed_config={ZERO3}", "run_name=custom")
    assert s["status"] == "completed" and s["profile"] == "custom-zero3-bf16-offload-all"
    assert s["predicted_cpu_bytes"] and s["optimizer"] == "DeepSpeedCPUAdam"
    ds = ds_config_of(s)
    assert find_auto(ds) == []
    zero = ds["zero_optimization"]
    want = bucket_sizes(json.load(open(os.path.join(s["run_dir"], "plan.json")))["model"]["hidden_size"])
    assert zero["reduce_bucket_size"] == want["reduce_bucket_size"]
    assert zero["stage3_prefetch_bucket_size"] == want["stage3_prefetch_bucket_size"]
    assert zero["stage3_param_persistence_threshold"] == want["stage3_param_persistence_threshold"]
    assert zero["sub_group_size"] == 1e9 and zero["stage3_max_live_parameters"] == 1e9
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"
    assert os.path.isfile(os.path.join(s["run_dir"], "final", "model.safetensors"))  # gathered on save
    _, ref = run_inprocess(tmp_path, *RUN, "profile=zero3-bf16-offload-all", "run_name=catalogue",
                           "checkpoint.save=false")
    check_parity(rows, ref, "hf zero3 example vs zero3-bf16-offload-all")


def test_oom_ladder_keeps_the_users_config(tmp_path):
    """An OOM halves the micro-batch of a custom run too: the rebuilt engine gets the user's JSON with the
    new batch numbers (its explicit micro-batch 2 was checked against the run's once, at the start) and
    its own settings; the ladder never swaps it for a catalogue profile."""
    import torch

    from launcher.config.profiles import PROFILES
    from launcher.plan.ladder import Rung, next_move
    from launcher.training.faults import Hooks

    fired = []

    def before_step(step, engine):
        if step == 1 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected by the test")

    cfg = dict(hf_example(ZERO2), train_micro_batch_size_per_gpu=2)
    s, rows = run_inprocess(tmp_path, *RUN, "train.micro_batch_size=auto", "checkpoint.save=false",
                            f"deepspeed_config={write(tmp_path, cfg)}", "run_name=oom", hooks=Hooks(before_step=before_step))
    assert s["status"] == "completed" and s["profile"] == "custom-zero2-bf16-offload-opt"
    assert [r["micro_batch"] for r in rows] == [2, 1, 1, 1]
    ds = ds_config_of(s)  # written by the rebuilt engine
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (1, 8, 8)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2e8
    usable = [p for p in PROFILES.values() if p.precision == "bf16"]
    assert next_move(Rung(1, 8, True, s["profile"]), usable) is None


def test_plan_shows_the_custom_row():
    r = run_cli("plan", *CLI, f"deepspeed_config={ZERO3}")
    assert r.returncode == 0, r.stderr
    assert "custom-zero3-bf16-offload-all *" in r.stdout
    assert f"from deepspeed_config {ZERO3} fits" in r.stdout


def _typo(c):
    c["gradient_clippin"] = c.pop("gradient_clipping")


def _stage7(c):
    c["zero_optimization"]["stage"] = 7


def _micro(c):
    c["train_micro_batch_size_per_gpu"] = 4


def _scheduler(c):
    c["scheduler"]["params"].update(warmup_min_lr=0, warmup_max_lr=3e-5, warmup_num_steps=500)


def _nvme(c):
    c["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}


# (name, change to the HF ZeRO-2 example, extra overrides, what the message must hold: value, rule, fix)
ERRORS = [
    ("typo", _typo, [], ["gradient_clippin: unknown key", "DeepSpeed ignores any other silently",
                         "did you mean gradient_clipping?"]),
    ("stage7", _stage7, [], ["zero_optimization.stage: got 7", "DeepSpeedZeroConfig: Input should be 0, 1, 2, 3",
                             "fix: set zero_optimization.stage"]),
    ("micro", _micro, [], ["train_micro_batch_size_per_gpu: got 4, but train.micro_batch_size is 2",
                           "must agree", "fix: train.micro_batch_size=4, or \"auto\" in the JSON"]),
    ("scheduler", _scheduler, [], ["scheduler: got WarmupLR", "'warmup_num_steps': 500",
                                   "loop owns the learning-rate schedule",
                                   "fix: remove the scheduler block and set train.lr, train.warmup_steps=500"]),
    ("nvme", _nvme, [], ["offload_optimizer.device: got 'nvme'", "not supported by vramfit yet",
                         "fix: \"device\": \"cpu\""]),
    ("profile", None, ["profile=zero2-bf16-offload-opt"],
     ["profile: got 'zero2-bf16-offload-opt' with deepspeed_config=", "profile must be auto",
      "fix: profile=auto, or deepspeed_config=\"\" to run zero2-bf16-offload-opt"]),
]


@pytest.mark.parametrize("name,change,extra,expect", ERRORS, ids=[e[0] for e in ERRORS])
def test_refused_before_anything_is_written(tmp_path, name, change, extra, expect):
    cfg = hf_example(ZERO2)
    if change:
        change(cfg)
    path = write(tmp_path, cfg)
    runs = tmp_path / "runs"
    r = run_cli("train", *CLI, f"output_dir={runs}", "run_name=x", f"deepspeed_config={path}", *extra)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    for text in expect:
        assert text in r.stderr, (text, r.stderr[-2000:])
    assert not runs.exists()  # refused before the run directory was made


# ---- the other rules, in process (the same code path as train and plan: resolve -> planner)


def resolve_with(tmp_path, cfg: dict, *overrides):
    from launcher.machine.hardware import probe
    from launcher.plan.resolve import resolve

    c = load_config(None, [*CLI, f"output_dir={tmp_path / 'runs'}", f"deepspeed_config={write(tmp_path, cfg)}",
                           *overrides])
    return resolve(c, probe())


def problems_of(tmp_path, cfg: dict, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        resolve_with(tmp_path, cfg, *overrides)
    return str(e.value)


def test_rules_for_what_vramfit_cannot_honour(tmp_path):
    z2, z3 = hf_example(ZERO2), hf_example(ZERO3)
    cases = [
        (dict(z2, fp16={"enabled": True}), [], ["fp16.enabled: got true on the CPU",
                                                "DeepSpeed refuses fp16 on the CPU", "\"bf16\": {\"enabled\": true}"]),
        (dict(z2, bf16={"enabled": True}), ["precision=fp32"], ["so the JSON runs bf16", "but precision=fp32",
                                                               "fix: precision=auto or precision=bf16"]),
        (dict(z2, optimizer={"type": "Lamb", "params": {}}), [], ["optimizer.type: got 'Lamb'", "Adam's two moments",
                                                                  "fix: optimizer.type AdamW"]),
        (dict(z2, optimizer={"type": "AdamWW"}), [], ["optimizer.type: got 'AdamWW'", "did you mean AdamW?"]),
        (dict(z3, zero_optimization=dict(z3["zero_optimization"], offload_optimizer={"device": "none"})), [],
         ["got stage 3 with offload_param", "both offload_param and offload_optimizer",
          "add \"offload_optimizer\" and \"offload_param\""]),
        (dict(z2, zero_optimization=dict(z2["zero_optimization"], offload_param={"device": "cpu"})), [],
         ["offload_param: got device cpu with stage 2", "at stage 3 only", "or remove offload_param"]),
        (dict(z2, gradient_accumulation_steps=2), [], ["gradient_accumulation_steps: got 2, but",
                                                       "is 4", "fix: train.global_batch_size=4"]),
        (dict(z2, gradient_clipping=0.5), [], ["gradient_clipping: got 0.5, but train.grad_clip is 1.0",
                                               "fix: train.grad_clip=0.5"]),
        (dict(z2, optimizer={"type": "AdamW", "params": {"lr": 1e-4}}), [],
         ["optimizer.params.lr: got 0.0001, but train.lr is 0.003", "fix: train.lr=0.0001"]),
        (dict(z3, zero_optimization=dict(z3["zero_optimization"], sub_group_size="auto")), [],
         ["zero_optimization.sub_group_size: got \"auto\"", "vramfit fills \"auto\" only in",
          "give zero_optimization.sub_group_size a value"]),
        (dict(z2, activation_checkpointing={"partition_activations": True}), [],
         ["activation_checkpointing: got", "would do nothing", "model.gradient_checkpointing=true"]),
        (dict(z2, zero_optimization=dict(z2["zero_optimization"], reduce_bucket_sise=5)), [],
         ["zero_optimization.reduce_bucket_sise: got 5", "Extra inputs are not permitted",
          "did you mean zero_optimization.reduce_bucket_size?"]),
    ]
    for cfg, overrides, expect in cases:
        msg = problems_of(tmp_path, cfg, *overrides)
        for text in expect:
            assert text in msg, (text, msg)


def test_explicit_values_that_agree_are_accepted(tmp_path):
    """HF's "manually set" style: explicit numbers equal to the run's pass, and the JSON's micro-batch is the
    run's when train.micro_batch_size is auto (accumulation follows from the global batch)."""
    cfg = dict(hf_example(ZERO2), train_micro_batch_size_per_gpu=4, gradient_clipping=1.0,
               fp16={"enabled": False}, bf16={"enabled": True},
               optimizer={"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.0}})
    del cfg["scheduler"]
    res = resolve_with(tmp_path, cfg, "train.micro_batch_size=auto", "precision=auto")
    assert res.profile.name == "custom-zero2-bf16-offload-opt" and res.precision == "bf16"  # bf16 from the JSON
    assert (res.micro_batch, res.accumulation) == (4, 2)
    assert "micro-batch 4 from deepspeed_config" in res.reasons
    assert res.plan.chosen == res.profile.name and res.plan.get(res.profile.name).micro_batch == 4


def test_plan_of_stage_1_and_of_explicit_buckets(tmp_path):
    """Stage 1 on one rank is planned with the stage-2 arithmetic (the same bytes as zero2-bf16 but for the
    buckets: "auto" in a user's JSON is Accelerate's hidden**2, the catalogue's one-rank bucket holds every
    gradient); explicit bucket sizes are what the plan counts (two reduce buffers, overlap_comm)."""
    from launcher.machine.hardware import probe
    from launcher.plan import planner

    hw = probe()
    cat = planner.plan(load_config(None, [*CLI, "profile=zero2-bf16"]), hw).get("zero2-bf16")
    stage1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}}
    buckets = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}
    r1 = planner.plan(load_config(None, [*CLI, f"deepspeed_config={write(tmp_path, stage1, 'a.json')}"]), hw).profiles
    r2 = planner.plan(load_config(None, [*CLI, f"deepspeed_config={write(tmp_path, buckets, 'b.json')}"]), hw).profiles
    assert [r.profile for r in r1 + r2] == ["custom-zero1-bf16", "custom-zero2-bf16"]
    hidden = planner.plan(load_config(None, CLI), hw).model["hidden_size"]
    assert cat.reduce_bucket_size > hidden**2  # one rank: the catalogue's bucket grew into the budget
    moves = ("buffers", "allocator_slack")  # the slack is a fraction of the tensors, buckets included
    same = {k: v for k, v in cat.parts["cpu"].items() if k not in moves}
    assert {k: v for k, v in r1[0].parts["cpu"].items() if k not in moves} == same
    assert cat.parts["cpu"]["buffers"] - r1[0].parts["cpu"]["buffers"] == 2 * (cat.reduce_bucket_size - hidden**2) * 2
    assert r2[0].parts["cpu"]["buffers"] - r1[0].parts["cpu"]["buffers"] == 2 * (2e8 - hidden**2) * 2  # bf16


def test_known_keys_come_from_deepspeed():
    from launcher.config.user_ds_config import known_top_level_keys

    keys = known_top_level_keys()
    assert {"zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "train_batch_size",
            "steps_per_print", "communication_data_type", "flops_profiler"} <= keys
    assert not {"enabled", "params", "type", "stage", "gradient_clippin"} & keys  # nested names are not top-level


def test_example_files_are_the_published_ones():
    """The tests above rely on these being the docs' "auto" examples (fp16 auto, no bf16 block, all-auto
    WarmupLR): a file edited to suit the code would fail here."""
    for path in (ZERO2, ZERO3):
        cfg = hf_example(path)
        assert cfg["fp16"]["enabled"] == "auto" and "bf16" not in cfg
        assert cfg["scheduler"]["type"] == "WarmupLR"
        assert all(v == "auto" for v in cfg["scheduler"]["params"].values())
