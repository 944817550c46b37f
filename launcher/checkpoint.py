"""Checkpoints that survive a kill: written under a temporary name, marked complete, then renamed.

Layout: ``checkpoints/step-000100/`` holds the engine's files and ``vramfit.json`` (the marker,
written last: step, settings hash, the settings themselves). A directory without the marker, or
still under its ``.tmp`` name, is never picked for resume. Only the last ``keep_last`` are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil

import numpy as np
import torch

from launcher.rundir import read_json, write_json

MARKER = "vramfit.json"
_NAME = re.compile(r"^step-(\d{6,})$")

# Settings a checkpoint cannot be resumed across: the shapes of what was saved and what the data is.
FIXED_SETTINGS = ("model.name", "model.quantize", "lora.r", "lora.alpha", "lora.target_modules", "data.source",
                  "data.format", "data.seq_len", "data.packing", "data.num_samples", "data.vocab_size",
                  "data.sources", "data.train_on_prompt", "data.chat_template", "train.global_batch_size", "seed")


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def fixed_settings(cfg) -> dict:
    return {k: _get(cfg, k) for k in FIXED_SETTINGS}


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MARKER)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(root: str) -> str | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_marker(path: str) -> dict:
    return read_json(os.path.join(path, MARKER))


def diff_settings(saved: dict, now: dict) -> list[str]:
    return [f"{k}: checkpoint has {saved.get(k)!r}, now {now.get(k)!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def check_disk(root: str, expected_bytes: int) -> None:
    free = shutil.disk_usage(root).free
    if expected_bytes * 1.1 > free:
        raise OSError(f"not enough disk for a checkpoint in {root}: about {expected_bytes / 2**30:.2f} GiB needed, "
                      f"{free / 2**30:.2f} GiB free; fix: free space, lower checkpoint.keep_last, or move output_dir")


def save(engine, root: str, step: int, client_state: dict, settings: dict, *, is_main: bool, barrier,
         keep_last: int, extra: dict | None = None, during_save=None) -> str:
    """Write a complete checkpoint for ``step`` atomically; returns its path."""
    final = step_dir(root, step)
    tmp = final + ".tmp"
    if is_main:
        previous = complete_checkpoints(root)
        if previous:
            check_disk(root, dir_size(previous[-1][1]))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    engine.save(tmp, client_state)
    if during_save is not None:  # test hook: e.g. SIGKILL before the checkpoint is marked complete
        during_save(tmp)
    barrier()
    if is_main:
        write_json(os.path.join(tmp, MARKER), {"step": step, "settings_hash": settings_hash(settings),
                                               "settings": settings, **(extra or {})})
        if os.path.exists(final):  # a finished checkpoint of the same step (e.g. a re-run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _s, path in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for name in os.listdir(root):  # leftovers of killed writes
            if name.endswith(".tmp") and name != os.path.basename(tmp):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    barrier()
    return final
