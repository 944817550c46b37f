"""How vramfit is installed. requirements/lock.txt pins every package at the version CI tested and
scripts/setup.sh installs with it; requirements/floors.txt pins the oldest versions pyproject.toml allows and
scripts/test_floors.sh tests them; an install without the extras (no DeepSpeed, no bitsandbytes, as in the floors
job) fine-tunes a local model with LoRA and exports it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, "requirements", "lock.txt")
FLOORS = os.path.join(ROOT, "requirements", "floors.txt")
PROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
# Floored by the lock's version: these extras are tested only by the main run (the floors job stays short).
LOCK_FLOORED_EXTRAS = ("deepspeed", "quant")
# CUDA-only extras: nothing of them installs on a CPU machine, so the lock cannot pin them (see pyproject.toml)
GPU_ONLY_EXTRAS = ("kernels",)
# Optional trackers (log.report_to): the user's choice of version, neither locked nor floored (see pyproject.toml)
UNLOCKED_EXTRAS = (*GPU_ONLY_EXTRAS, "wandb", "mlflow", "parity")  # parity: TRL, for tests/test_preference.py


def pins(path: str) -> dict[str, Requirement]:
    """name -> `name==version [; marker]` requirement, for every line of a constraints file."""
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"{path}: {line!r} is not an exact pin"
            out[canonicalize_name(req.name)] = req
        # a comment line, or a blank one
    return out


def pinned(req: Requirement) -> Version:
    return Version(next(iter(req.specifier)).version)


def floor(req: Requirement) -> Version | None:
    lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return lows[0] if lows else None


def requirements(group: str | None = None) -> list[Requirement]:
    reqs = PROJECT["dependencies"] if group is None else PROJECT["optional-dependencies"][group]
    return [Requirement(r) for r in reqs]


def test_lock_pins_every_dependency_and_no_cuda_package():
    lock = pins(LOCK)
    everything = requirements() + [r for g in PROJECT["optional-dependencies"] if g not in UNLOCKED_EXTRAS
                                   for r in requirements(g)]
    for req in everything:
        key = canonicalize_name(req.name)
        assert key in lock, f"{req.name} is in pyproject.toml but not in requirements/lock.txt: run scripts/lock.sh"
        assert pinned(lock[key]) in req.specifier, f"lock {lock[key]} is outside pyproject's {req}"
        assert str(lock[key].marker or "") == str(req.marker or ""), f"{req.name}: the marker should travel to the lock"
    # the CPU build's version: the same pin gives the CUDA build on a CUDA machine, which pins its own nvidia-*
    assert str(pinned(lock["torch"])) == "2.13.0"
    assert not [n for n in lock if n.startswith("nvidia-") or n == "triton"]
    assert "vramfit" not in lock


def test_environment_is_the_lock():
    """The environment the tests run in is the one the lock describes, so the lock holds the versions CI tested.
    scripts/setup.sh notes the constraints file it installed with; other environments are not compared."""
    made_with = os.path.join(sys.prefix, "vramfit-lock")
    if not os.path.isfile(made_with) or open(made_with).read().strip() != "requirements/lock.txt":
        pytest.skip("this environment was not installed from requirements/lock.txt by scripts/setup.sh")
    r = subprocess.run(["bash", "scripts/lock.sh", "--check"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_every_floor_is_a_version_a_ci_job_installs():
    """pyproject's floors are requirements/floors.txt's pins (the floors job), except torch, whose floor is what
    the code needs (see floors.txt), and the DeepSpeed and bitsandbytes extras, whose floors are the lock's pins."""
    floors, lock = pins(FLOORS), pins(LOCK)
    for req in requirements() + requirements("test"):
        key = canonicalize_name(req.name)
        assert floor(req) is not None, f"pyproject.toml: {req} has no floor; add the floors job's version"
        assert key in floors, f"{req.name} has a floor in pyproject.toml but requirements/floors.txt does not pin it"
        if key == "torch":
            assert floor(req) == Version("2.6"), "torch.distributed.fsdp.fully_shard (FSDP2) is public from 2.6"
            assert pinned(floors[key]) == pinned(lock[key]), "the floors job runs the torch build the lock pins"
            continue
        assert floor(req) == pinned(floors[key]), f"pyproject {req} vs floors.txt {floors[key]}"
        assert str(floors[key].marker or "") == str(req.marker or "")
    for group in LOCK_FLOORED_EXTRAS:
        for req in requirements(group):
            if req.specifier:
                assert floor(req) == pinned(lock[canonicalize_name(req.name)]), f"pyproject {req} vs the lock"
    assert set(floors) <= {canonicalize_name(r.name) for r in requirements() + requirements("test")}, \
        "floors.txt pins only what pyproject.toml names (the rest resolves as pip would for a user)"


def test_setup_installs_with_the_lock_and_has_the_unlocked_switch():
    text = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert "VRAMFIT_LOCK:-requirements/lock.txt" in text and '-c "$LOCK"' in text
    assert '"$LOCK" = none' in text and "--upgrade-strategy eager" in text


def test_supported_pythons_agree():
    """requires-python starts at the oldest Python the classifiers list (3.11: transformers >= 5.21 needs it)."""
    from packaging.specifiers import SpecifierSet

    listed = sorted((c.rsplit(" ", 1)[-1] for c in PROJECT["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)),
                    key=Version)
    spec = SpecifierSet(PROJECT["requires-python"])
    assert listed and all(f"{v}.0" in spec for v in listed), (listed, str(spec))
    older = f"3.{Version(listed[0]).minor - 1}.0"
    assert older not in spec, f"requires-python {spec} admits {older}, which the classifiers do not list"


# An install without the extras: LoRA on a local model directory, the path the floors job checks end to end.


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """scripts/make_tiny_model.py's model directory (random Llama, BPE tokenizer trained on the example data)."""
    out = str(tmp_path_factory.mktemp("hf") / "model")
    r = subprocess.run([sys.executable, "scripts/make_tiny_model.py", out, "--data", "examples/data/alpaca-mini.jsonl"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def without_extras(tmp_path) -> dict:
    """An environment in which DeepSpeed and bitsandbytes do not import, as if they were not installed."""
    d = tmp_path / "no_extras"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\nsys.modules['bitsandbytes'] = None\n")
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(d), ROOT, env.get("PYTHONPATH", "")])
    return env


def test_local_model_loads_in_bf16_with_fp32_adapters(tiny_model):
    """from_pretrained(dtype=...) gives the asked dtype (older transformers took torch_dtype= and ignore dtype=
    silently, loading fp32), and peft's autocast_adapter_dtype makes the adapters over the bf16 base fp32."""
    from launcher.config.load import load_config
    from launcher.model.build import make_model
    from launcher.model.materialize import Placement

    cfg = load_config(None, [f"model.name={tiny_model}", "lora.r=8", "model.gradient_checkpointing=true"])
    model = make_model(cfg, Placement(torch.device("cpu"), torch.bfloat16, torch.float32))
    params = dict(model.named_parameters())
    base = {n: p for n, p in params.items() if "lora_" not in n}
    adapters = {n: p for n, p in params.items() if "lora_" in n}
    assert base and {p.dtype for p in base.values()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in base.values())
    assert adapters and {p.dtype for p in adapters.values()} == {torch.float32}
    assert all(p.requires_grad for p in adapters.values())


@pytest.mark.slow
@pytest.mark.extended  # a whole LoRA run and export without the extras: by hand (CI's time box)
def test_lora_without_extras_trains_saves_and_exports(tiny_model, tmp_path):
    """engine=auto without DeepSpeed trains on AMP (with activation checkpointing; fp32, which is quick on any CPU:
    the bf16 load is the test above); the adapter in final/ holds the LoRA weights only (save_embedding_layers=False);
    export --merge writes a model that plain transformers loads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    env = without_extras(tmp_path)
    run = [sys.executable, "-m", "launcher", "train", f"model.name={tiny_model}",
           "data.source=examples/data/alpaca-mini.jsonl", "lora.r=8", "lora.alpha=16", "precision=fp32",
           "model.gradient_checkpointing=true", "train.max_steps=8", "train.warmup_steps=2", "train.lr=2e-2",
           "train.micro_batch_size=4", "train.global_batch_size=8", "data.seq_len=64", "log.every_steps=1000",
           "sample_tokens=4", f"output_dir={tmp_path}", "run_name=lora", "device=cpu"]
    r = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.load(open(tmp_path / "lora" / "summary.json"))
    assert summary["status"] == "completed" and summary["engine"] == "amp"
    assert summary["final_loss"] < summary["first_loss"], (summary["first_loss"], summary["final_loss"])
    adapter = load_file(str(tmp_path / "lora" / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)[:5]
    assert {t.dtype for t in adapter.values()} == {torch.float32}

    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "launcher", "export", str(tmp_path / "lora"), "--out", str(out), "--merge"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert not os.path.exists(out / "adapter_config.json")
