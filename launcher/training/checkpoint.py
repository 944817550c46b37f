"""Checkpoints that survive a kill, a full disk and later damage: written under a temporary name, marked
complete, then renamed; verified before a resume uses them.

Layout: ``checkpoints/step-000100/`` holds the engine's files and ``vramfit.json`` (the marker, written
last: step, settings hash, the settings themselves, and every file's size and CRC-32). A directory without
the marker, or still under its ``.tmp`` name, is never picked for resume. Only the last ``keep_last`` are
kept, with what an engine made beside one (DeepSpeed's conversion for a resume on another number of ranks,
``step-000100.universal/``). Before a resume, :func:`newest_loadable` checks the newest complete checkpoint's
files against its marker (a truncated, deleted or changed file is found before any library reads it) and
falls back to the one before when it is damaged.

The checksum is zlib's CRC-32, made for finding accidental damage (it is what zip and PNG use): it costs
one read of each file at save time (the files are then still in the page cache) and at resume; its speed is
measured by ``scripts/bench_checksum.py`` (bench/results/2026-12-04-cpu-epyc/checksum/).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import re
import shutil
import zlib

import numpy as np
import torch

from launcher.machine.files import (
    DiskFull,
    disk_full_message,
    free_bytes,
    is_disk_full,
    read_json,
    remove_quietly,
    size_text,
    tree_bytes,
    write_json,
)

MARKER = "vramfit.json"
DAMAGED_SUFFIX = ".damaged"
_NAME = re.compile(r"^step-(\d{6,})$")
_CHUNK = 8 * 2**20

# Settings a checkpoint cannot be resumed across: the shapes of what was saved and what the data is.
FIXED_SETTINGS = ("model.name", "model.quantize", "lora.r", "lora.alpha", "lora.target_modules", "data.source",
                  "data.format", "data.seq_len", "data.packing", "data.num_samples", "data.vocab_size",
                  "data.sources", "data.train_on_prompt", "data.chat_template", "train.global_batch_size", "seed",
                  "lora.experts")
# What a setting was before checkpoints recorded it (a checkpoint that lacks the key was made with this value).
SETTING_DEFAULTS = {"lora.experts": "auto"}


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
    """(step, path) of every complete checkpoint (one with a marker) under ``root``, oldest first."""
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
    saved = {**{k: v for k, v in SETTING_DEFAULTS.items() if k not in saved}, **saved}
    return [f"{k}: checkpoint has {saved.get(k)!r}, now {now.get(k)!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


# ------------------------------------------------------------------------------------------------
# Verification


def crc32_file(path: str) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def manifest(directory: str) -> dict:
    """{relative path: {"bytes", "crc32"}} of every file under ``directory`` but the marker."""
    out = {}
    for d, _, files in os.walk(directory):
        for f in sorted(files):
            full = os.path.join(d, f)
            rel = os.path.relpath(full, directory)
            if rel != MARKER:
                out[rel] = {"bytes": os.path.getsize(full), "crc32": crc32_file(full)}
    return dict(sorted(out.items()))


def verify(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when its files are as its marker recorded
    them. Sizes first (cheap: truncated and deleted files), then checksums (changed bytes)."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        return f"no {MARKER} marker (not a checkpoint of vramfit, or one whose write did not finish)"
    try:
        marker = read_marker(path)
        int(marker["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its marker {MARKER} is unreadable ({type(e).__name__})"
    files = marker.get("files")
    if files is None:
        return None  # written before markers held checksums: nothing to compare (the loop says so)
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        size = os.path.getsize(full)
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, {want['bytes']} were written"
    for rel, want in files.items():
        got = crc32_file(os.path.join(path, rel))
        if got != want["crc32"]:
            return f"{rel} has changed since it was written (CRC-32 {got}, {want['crc32']} recorded)"
    return None


def newest_loadable(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete checkpoint that verifies, or None; [(path, why)] of newer ones that did not)."""
    damaged = []
    for _step, path in reversed(complete_checkpoints(root)):
        why = verify(path)
        if why is None:
            return path, damaged
        damaged.append((path, why))
    return None, damaged


def older_loadable(path: str) -> str | None:
    """The newest checkpoint beside ``path`` and older than it that verifies (None when there is none)."""
    root, name = os.path.split(os.path.normpath(path))
    m = _NAME.match(name)
    for step, other in reversed(complete_checkpoints(root)):
        if (m is None or step < int(m.group(1))) and verify(other) is None:
            return other
    return None


def loadable_near(path: str) -> str | None:
    """For a checkpoint.resume that is not a usable checkpoint (a run's final/, the run directory itself, a
    damaged checkpoint): the checkpoint a user most likely meant, or None."""
    path = os.path.normpath(os.path.abspath(path))
    if _NAME.match(os.path.basename(path)):
        return older_loadable(path)
    for root in (os.path.join(path, "checkpoints"), os.path.join(os.path.dirname(path), "checkpoints")):
        found, _ = newest_loadable(root)
        if found:
            return found
    return None


def set_aside(path: str) -> str:
    """Rename a damaged checkpoint out of the resume and rotation order (kept for the user to inspect)."""
    dest, n = path + DAMAGED_SUFFIX, 1
    while os.path.exists(dest):
        n += 1
        dest = f"{path}{DAMAGED_SUFFIX}-{n}"
    os.replace(path, dest)
    return dest


# ------------------------------------------------------------------------------------------------
# Writing


def check_disk(root: str, expected_bytes: int, what: str) -> None:
    """Refuse to start a write that will not fit (10% margin), before a byte is written."""
    free = free_bytes(root)
    if free is not None and expected_bytes * 1.1 > free:
        raise DiskFull(f"disk full: {what} would not fit in {root}: it needs about {size_text(expected_bytes)} "
                       f"(the size of the previous one, or the plan's estimate for the first) plus a 10% margin, and "
                       f"{size_text(free)} are free")


def write_dir_atomic(final: str, write, *, what: str, is_main: bool, barrier, expected_bytes: int | None = None) -> str:
    """Write a directory through ``write(tmp)`` under ``final + '.tmp'``, then rename it to ``final``
    (replacing an earlier one). When the write fails, the partial directory is removed; a full disk
    becomes :class:`DiskFull` (with the MiB), anything else is raised as it was."""
    tmp = final + ".tmp"
    root = os.path.dirname(final)
    free_before = free_bytes(root) if is_main else None
    written = None
    try:
        if is_main:
            if expected_bytes:
                check_disk(root, expected_bytes, what)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        write(tmp)
        barrier()
        if is_main:
            if os.path.exists(final):  # a finished one of the same name (a re-run, a continued run): replace it
                old = f"{final}.old-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        return final
    except DiskFull:
        raise
    except Exception as e:  # noqa: BLE001 -- any library's write error: the partial files must go either way
        if not is_disk_full(e, root):
            remove_quietly(tmp)
            raise
        written = tree_bytes(tmp) if os.path.exists(tmp) else 0
    # Out of the except block, so that the failed write's frames go, and with them a file the library still
    # held open (torch's zip writer does): its space comes back only once it is closed.
    gc.collect()
    remove_quietly(tmp)
    raise DiskFull(disk_full_message(f"writing {what}", root, free_before=free_before, needed=expected_bytes,
                                     written=written))


def save(engine, root: str, step: int, client_state: dict, settings: dict, *, is_main: bool, barrier,
         keep_last: int, extra: dict | None = None, during_save=None, predicted_bytes: int | None = None,
         keep: tuple[str, ...] = ()) -> str:
    """Write a complete checkpoint for ``step`` atomically; returns its path. Before a byte is written, the
    disk must hold the previous checkpoint's size (the first one: ``predicted_bytes``, the plan's) plus 10%.
    Rotation keeps the last ``keep_last`` and the paths in ``keep`` (the best one by eval loss)."""
    previous = complete_checkpoints(root) if is_main else []

    def write(tmp: str) -> None:
        engine.save(tmp, client_state)
        if during_save is not None:  # test hook: e.g. SIGKILL before the checkpoint is marked complete
            during_save(tmp)
        barrier()
        if is_main:
            write_json(os.path.join(tmp, MARKER), {"step": step, "settings_hash": settings_hash(settings),
                                                   "settings": settings, **(extra or {}), "files": manifest(tmp)})

    final = write_dir_atomic(step_dir(root, step), write, what=f"checkpoint step-{step:06d}", is_main=is_main,
                             barrier=barrier, expected_bytes=tree_bytes(previous[-1][1]) if previous else predicted_bytes)
    if is_main:
        kept = {os.path.normpath(k) for k in keep if k}
        for _s, path in complete_checkpoints(root)[:-keep_last]:
            if os.path.normpath(path) not in kept:
                shutil.rmtree(path, ignore_errors=True)
                for suffix in getattr(engine, "beside", ()):  # what was made from it (a conversion) goes with it
                    shutil.rmtree(path + suffix, ignore_errors=True)
        for name in os.listdir(root):  # leftovers of killed writes
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    barrier()
    return final
