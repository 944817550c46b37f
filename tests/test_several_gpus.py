"""Plans for several cards and machines (``vramfit plan --gpu NAME --gpus N [--nodes M]``, ``--compare-gpus --gpus
1,2,4``): per-rank memory as each engine partitions it, the host's RAM shared by its ranks, and the engines'
collectives priced over the links between cards and machines. No GPU needed: the arithmetic is checked against
the rules each engine's source states (cited in launcher/plan/steptime.py and launcher/plan/memory/states.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_gpus import fake_host
from test_planner import fake_hw

from helpers import run_cli
from launcher.config.load import load_config
from launcher.config.profiles import PROFILES
from launcher.config.schema import ConfigError
from launcher.plan import compare, gpus, planner, steptime

BASE = ["model.name=llama-125m", "data.seq_len=256", "train.global_batch_size=16", "memory.cpu_budget=64",
        "model.gradient_checkpointing=false", "train.micro_batch_size=2"]


def row(profile: str, world: int, *extra: str, nodes: int = 1):
    cfg = load_config(None, BASE + list(extra))
    hw = fake_hw(gpu_gib=80, ram_gib=128, capability=(8, 0))
    p = planner.plan(cfg, hw, [profile], world=world, nodes=nodes)
    return p.get(profile), p


def test_zero2_partitions_master_states_and_gradients_over_the_ranks():
    one, _ = row("zero2-bf16", 1)
    four, _ = row("zero2-bf16", 4)
    for part in ("master_weights", "optimizer_states"):
        assert four.parts["gpu"][part] == pytest.approx(one.parts["gpu"][part] / 4, rel=1e-6)
    assert four.parts["gpu"]["weights"] == one.parts["gpu"]["weights"]  # 16-bit weights are replicated


def test_zero3_offload_and_fsdp_partition_the_host_side_per_rank():
    for profile in ("zero3-bf16-offload-all", "fsdp-bf16-offload"):
        one, _ = row(profile, 1)
        two, _ = row(profile, 2)
        for part in ("weights", "optimizer_states"):
            assert two.parts["cpu"][part] == pytest.approx(one.parts["cpu"][part] / 2, rel=1e-6), (profile, part)


def test_ddp_replicates_and_adds_its_gradient_buckets():
    one, _ = row("amp-bf16", 1)
    two, _ = row("amp-bf16", 2)
    assert two.parts["gpu"]["weights"] == one.parts["gpu"]["weights"]
    assert two.parts["gpu"]["optimizer_states"] == one.parts["gpu"]["optimizer_states"]
    trainable = one.parts["gpu"]["optimizer_states"] / 8  # AdamW: two fp32 moments
    added = two.parts["gpu"].get("buffers", 0) - one.parts["gpu"].get("buffers", 0)
    assert added == pytest.approx(4 * trainable, rel=1e-6)  # a copy of the fp32 gradients


def test_the_ranks_of_one_machine_share_its_ram():
    _, one = row("amp-bf16", 1)
    _, four = row("amp-bf16", 4)
    _, two_nodes = row("amp-bf16", 4, nodes=2)
    assert four.budget["cpu_bytes"] == one.budget["cpu_bytes"] // 4
    assert two_nodes.budget["cpu_bytes"] == one.budget["cpu_bytes"] // 2
    assert "shared by 4 ranks" in four.budget["cpu_source"]


COUNTS = SimpleNamespace(total=1_000_000_000, adapters=0, trainable_tensors=200)


@pytest.mark.parametrize("profile,micro,step_overlapped,step", [
    ("amp-bf16", 0, 2 * 0.5 * 4e9, 0),  # DDP: one all-reduce of fp32 gradients a step
    ("zero2-bf16", 0.5 * 2e9, 0, 0.5 * 2e9),  # reduce-scatter each micro-batch, all-gather after the step
    ("zero3-bf16-offload-all", 2 * 0.5 * 2e9 + 0.5 * 2e9, 0, 0),  # gather for forward and backward, reduce-scatter
    ("fsdp-bf16-offload", 2 * 0.5 * 2e9 + 0.5 * 2e9, 0, 0),
])
def test_collective_bytes_per_rank_follow_the_ring(profile, micro, step_overlapped, step):
    got = steptime.collectives(PROFILES[profile], COUNTS, lora=False, world=2)
    assert got == pytest.approx((micro, step_overlapped, step))
    assert steptime.collectives(PROFILES[profile], COUNTS, lora=False, world=1) == (0.0, 0.0, 0.0)


def test_communication_is_priced_on_the_slower_link_and_overlaps_compute():
    m = gpus.machine(gpus.find("A100-80GB-SXM"), fake_host())
    ops_small = {("matmul", "bfloat16", 10**9, 10**6): 1}  # a micro-batch of ~3 us: nothing hides the collectives
    links = gpus.links(gpus.find("A100-80GB-SXM"), network_gbps=10)
    kw = dict(ops=ops_small, counts=COUNTS, micro_batch=1, accumulation=1, seq_len=128, pinned=True)
    p = PROFILES["zero2-bf16"]
    one_box = steptime.predict(p, m, world=8, links=links, **kw)
    two_boxes = steptime.predict(p, m, world=8, nodes=2, links=links, **kw)
    # 2 x 7/8 x 2 GB over NVLink (300 GB/s one way) against the same over 10 Gbit/s
    assert one_box.parts["communication"] == pytest.approx(2 * 7 / 8 * 2e9 / 300e9, rel=0.05)
    assert two_boxes.parts["communication"] == pytest.approx(2 * 7 / 8 * 2e9 / 1.25e9, rel=0.05)
    assert "NVLink" in " ".join(one_box.notes) and "10 Gbit/s" in " ".join(two_boxes.notes)
    # a long micro-batch hides ZeRO-2's reduce-scatter; its all-gather after the step stays
    ops_big = {("matmul", "bfloat16", 10**16, 10**6): 1}
    hidden = steptime.predict(p, m, world=8, links=links, **{**kw, "ops": ops_big})
    assert hidden.parts["communication"] == pytest.approx(7 / 8 * 2e9 / 300e9, rel=0.05)
    assert sum(hidden.parts.values()) == pytest.approx(hidden.step_s)


def test_links_come_from_the_catalogue():
    assert gpus.links(gpus.find("H100-SXM"))["intra"] == 450e9  # NVLink 900 GB/s both ways
    t4 = gpus.links(gpus.find("T4"), 25)
    assert t4["intra"] == gpus.find("T4").pcie_bytes_per_s and t4["inter"] == 25e9 / 8
    with pytest.raises(ConfigError, match="--network-gbps"):
        gpus.links(gpus.find("T4"), 0)


def test_compare_over_counts_says_when_more_cards_do_not_pay():
    from launcher.machine.hardware import probe

    cfg = load_config(None, ["model.name=tiny", "data.seq_len=64", "train.global_batch_size=8"])
    hw = probe()
    rows = compare.compare(cfg, hw, fake_host(), {"T4": 0.35}, counts=[1, 2], network_gbps=10)
    t4 = {r.count: r for r in rows if r.gpu == "T4"}
    assert set(t4) == {1, 2} and t4[2].price_per_hour == pytest.approx(0.70)
    # a tiny model: the second card is all communication and cost
    assert t4[2].note and ("slower" in t4[2].note or "cost" in t4[2].note)
    text = compare.table(rows, cfg.train.max_steps)
    assert "cards" in text.splitlines()[0] and "note" in text.splitlines()[0]
    # the host RAM a box of N cards needs: N ranks' planned host peaks
    two = compare.plan_on(cfg, gpus.find("T4"), hw, fake_host(), 2, network_gbps=10, exact_rows=False).chosen_plan
    assert t4[2].host_gib == pytest.approx(2 * two.cpu_bytes / 2**30) and "host GiB" in text.splitlines()[0]
    with pytest.raises(ConfigError, match="split evenly"):
        compare.check_counts(cfg, [3], 1)


def test_cli_refuses_bad_counts_before_anything_is_measured():
    bad = run_cli("plan", "--gpu", "T4", "--gpus", "3", "model.name=tiny")
    assert bad.returncode != 0 and "split evenly" in bad.stderr and "--gpus 1,2,4,8" in bad.stderr
    alone = run_cli("plan", "--gpus", "2", "model.name=tiny")
    assert alone.returncode != 0 and "--gpu NAME" in alone.stderr
    several = run_cli("plan", "--gpu", "T4", "--gpus", "1,2", "model.name=tiny")
    assert several.returncode != 0 and "--compare-gpus" in several.stderr
