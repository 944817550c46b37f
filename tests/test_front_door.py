"""One front door (launcher/plan/decide.py): `vramfit plan`, `train`, `tune` and `bench` decide the same
configuration the same way: data formats read from the records, memory.nvme_path measured, the machine's speeds
rechecked, the same plan's choice.

Each entrance runs in this process until it has decided (a recording :func:`decide` stops it there), on one
configuration with an instruction dataset, an NVMe folder and a cached (quick) calibration of this machine."""

from __future__ import annotations

import pytest
import torch

from helpers.hf import qa_records, write_jsonl
from launcher import cli
from launcher.plan import decide as front


class Decided(BaseException):  # past every handler of the entrances (they catch Exception for clean errors)
    pass


@pytest.fixture()
def recorded(monkeypatch):
    seen = []
    real = front.decide

    def record(*a, **k):
        d = real(*a, **k)
        seen.append(d)
        raise Decided()

    monkeypatch.setattr(front, "decide", record)
    return seen


@pytest.mark.slow  # a quick calibration of this machine first (about 20 s)
def test_the_four_entrances_decide_alike(tmp_path, monkeypatch, recorded):
    from launcher.measure import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("VRAMFIT_CALIBRATE_QUICK", "1")
    monkeypatch.delenv("VRAMFIT_RECHECK", raising=False)
    calibrate.load_or_calibrate()  # what `vramfit doctor --calibrate` caches; plan and train then read it
    (tmp_path / "nvme").mkdir()
    data = write_jsonl(str(tmp_path / "qa.jsonl"), qa_records("alpaca", repeat=2))
    # train.threads as this process has them: a start on a busy machine takes fewer, and prices the plan at those
    # (its own business, not the front door's)
    args = ["model.name=tiny", "profile=amp-fp32", "device=cpu", f"data.source={data}", "data.seq_len=64",
            f"memory.nvme_path={tmp_path / 'nvme'}", "train.global_batch_size=4",
            f"train.threads={torch.get_num_threads()}"]
    monkeypatch.chdir(tmp_path)  # nothing is written before the decision, and anything after it would land here
    entrances = {"plan": ["plan", *args], "train": ["train", *args],
                 "tune": ["tune", *args, "--top", "1", "--dir", str(tmp_path / "tune")],
                 "bench": ["bench", *args, "--out", str(tmp_path / "bench"), "--steps", "1", "--warmup", "0"]}
    for argv in entrances.values():
        with pytest.raises(Decided):
            cli.main(argv)
    assert len(recorded) == 4
    keys = [d.key for d in recorded]
    first = keys[0]
    assert first["nvme"] and first["nvme"]["path"] == str(tmp_path / "nvme")  # measured by every entrance
    assert first["machine"] is not None  # priced by the cached calibration, rechecked
    assert first["cfg"].data.format != "auto"  # read from the records (instruction samples, packed)
    for name, key in zip(entrances, keys):
        assert key == first, f"{name} decided otherwise than plan: " + ", ".join(
            f"{k}: {key[k]!r} against {first[k]!r}" for k in key if key[k] != first[k])
    assert [d.spec is not None for d in recorded] == [False, True, False, False]  # train's is a run
