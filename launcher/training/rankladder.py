"""The OOM ladder on several ranks: every rank steps down together, from the last checkpoint.

On one process the loop steps down in place (:func:`launcher.training.loop._climb`). With several ranks it
cannot: when one rank runs out of memory the others are already inside a collective of the same step (DDP's
gradient all-reduce, ZeRO's reduce-scatter, FSDP's all-gather run inside backward), which no rank can leave
or finish alone, and a move rebuilds the engine, a collective too. So the rank that ran out of memory writes the
rung to go on with into the run directory (``oom-ladder.json``: the step, the rank, the rung and why), says so
once, and ends its process with :data:`EXIT_OOM_RESTART`; the launcher then ends the others. The next start of
the same run (torchrun's own restart with ``--max-restarts``, or the same command again) resumes from the last
checkpoint on every rank at that rung: the ranks read the record they can see (a run directory on a disk of each
machine may hold it on one machine only) and agree on the latest. The global batch is kept (a smaller
micro-batch takes more accumulation), so the loss curve is the one the run was on.

A torchrun restart starts the script again without a ``run_name``'s memory: the name an unnamed run chose is
kept beside the run directories for the restarts of the same launch (``.restart-<TORCHELASTIC_RUN_ID>``).
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch

from launcher.machine import dist
from launcher.machine.files import read_json, write_json
from launcher.plan.ladder import Move, Rung

LADDER_FILE = "oom-ladder.json"
EXIT_OOM_RESTART = 75  # EX_TEMPFAIL (sysexits.h): start the run again and it goes on one rung down
FAULT_ENV = "VRAMFIT_FAULT_OOM"  # test-only: "rank=R,step=S", an OOM on rank R at step S of a first start


def record(run_dir: str, step: int, rank: int, world: int, now: Rung, move: Move) -> str:
    """Write the rung the run goes on with after an OOM at ``step`` on ``rank``; returns the file's path."""
    path = os.path.join(run_dir, LADDER_FILE)
    write_json(path, {"step": step, "rank": rank, "world": world, "from": asdict(now), "to": asdict(move.to),
                             "kind": move.kind, "reason": move.reason})
    return path


def pending(run_dir: str, checkpoint_step: int, ranks: dist.Dist) -> dict | None:
    """The OOM record the ranks agree on (the latest any of them sees), when it is newer than the checkpoint the
    run goes on from (a record older than it has been acted on already: that checkpoint carries its rung)."""
    path = os.path.join(run_dir, LADDER_FILE)
    mine = None
    if os.path.exists(path):
        try:
            mine = read_json(path)
        except (OSError, ValueError):  # cut short by a kill while written: no record
            mine = None
    seen = [r for r in ranks.gather(mine) if r]
    latest = max(seen, key=lambda r: (r["step"], r["rank"])) if seen else None
    return latest if latest is not None and latest["step"] > checkpoint_step else None


def restart_name(output_dir: str, ranks: dist.Dist, chosen: str) -> str:
    """The run name of an unnamed run under torchrun: the first start's ``chosen`` name, kept for its restarts
    (elsewhere ``chosen`` as it is). Rank 0 decides; the caller broadcasts."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or ranks.world == 1 or not ranks.is_main:
        return chosen
    marker = os.path.join(output_dir, f".restart-{run_id}")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and os.path.exists(marker):
        with open(marker) as f:
            return f.read().strip() or chosen
    os.makedirs(output_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write(chosen)
    return chosen


def fault_from_env():
    """The test-only OOM of :data:`FAULT_ENV` as a ``before_step`` hook (None when unset): it fires on the first
    start of a launch only (``TORCHELASTIC_RESTART_COUNT`` 0), as a real OOM would not once the rung is lower."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    args = dict(item.split("=", 1) for item in spec.split(","))
    rank, at = int(args.get("rank", 0)), int(args.get("step", 1))

    def before_step(step: int, _engine) -> None:
        if dist.current().rank == rank and step + 1 == at:
            raise torch.OutOfMemoryError(f"injected by {FAULT_ENV}={spec}")

    return before_step
