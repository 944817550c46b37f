"""Room for a run's checkpoints on the disk of ``output_dir``, decided before the first step.

The planner predicts the bytes of one checkpoint and of ``final/`` for each profile
(:func:`launcher.plan.memory.states.files_on_disk`); a run needs ``keep_last + 1`` checkpoints at once (the new one
is complete before the oldest is deleted) plus ``final/``, and a margin. A disk without that room refuses the
run before anything is written; ``vramfit plan`` and ``vramfit doctor`` show the same numbers. During the run
:func:`launcher.training.checkpoint.check_disk` still guards every write (other tenants fill disks too).
"""

from __future__ import annotations

import os

from launcher.machine.files import free_bytes, size_text, tree_bytes

MARGIN = 0.10  # as launcher.training.checkpoint.check_disk: file-system overhead and estimates that run a little short


def needed_bytes(checkpoint: int, final: int, keep_last: int) -> int:
    """Bytes a run writes at its fullest moment: keep_last + 1 checkpoints and final/, plus the margin."""
    return int(((keep_last + 1) * checkpoint + final) * (1 + MARGIN))


def room(output_dir: str, checkpoint: int, final: int, keep_last: int, run_dir: str | None = None) -> dict:
    """The disk of ``output_dir`` against what the run needs. ``run_dir``: an existing run being continued,
    whose checkpoints the rotation will delete (their bytes count as free)."""
    free = free_bytes(output_dir)
    reclaim = tree_bytes(os.path.join(run_dir, "checkpoints")) if run_dir and os.path.isdir(run_dir) else 0
    need = needed_bytes(checkpoint, final, keep_last)
    return {"output_dir": output_dir, "free_bytes": free, "reclaimable_bytes": reclaim, "checkpoint_bytes": checkpoint,
            "final_bytes": final, "keep_last": keep_last, "needed_bytes": need,
            "fits": free is None or free + reclaim >= need}


def describe(r: dict) -> str:
    """One line: what the run writes against what the disk holds."""
    free = "unknown" if r["free_bytes"] is None else size_text(r["free_bytes"])
    return (f"disk: one checkpoint ~{size_text(r['checkpoint_bytes'])}, final/ ~{size_text(r['final_bytes'])}; "
            f"keep_last={r['keep_last']} + 1 checkpoints + final/ + {MARGIN:.0%} = {size_text(r['needed_bytes'])}; "
            f"{free} free under {r['output_dir']}" + ("" if r["fits"] else " -- does not fit"))


def refusal(r: dict, lora_r: int) -> str | None:
    """The ConfigError line (value, rule, fix) of a disk without room for the run; None when it fits."""
    if r["fits"]:
        return None
    free = r["free_bytes"] + r["reclaimable_bytes"]
    fixes = []
    room_for = int((free / (1 + MARGIN) - r["final_bytes"]) // max(1, r["checkpoint_bytes"])) - 1
    if room_for >= 1 and room_for < r["keep_last"]:
        fixes.append(f"checkpoint.keep_last={room_for}")
    fixes.append(f"output_dir=DIR on a disk with {size_text(r['needed_bytes'])} free")
    if lora_r == 0:
        fixes.append("lora.r=16 (a LoRA checkpoint holds the adapters, not the whole model)")
    return (f"output_dir: {r['output_dir']} has {size_text(free)} free"
            + (f" (with {size_text(r['reclaimable_bytes'])} of this run's old checkpoints)" if r["reclaimable_bytes"]
               else "") + f"; rule: the run writes up to checkpoint.keep_last + 1 = {r['keep_last'] + 1} checkpoints of "
            f"~{size_text(r['checkpoint_bytes'])} and final/ of ~{size_text(r['final_bytes'])}, "
            f"{size_text(r['needed_bytes'])} with the {MARGIN:.0%} margin; fix: " + ", or ".join(fixes))
