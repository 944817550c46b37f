"""The OOM ladder: what to change when a step runs out of memory, in order of what it costs.

1. halve the micro-batch and double accumulation (the global batch, hence the math, is unchanged),
   down to 1;
2. turn on gradient checkpointing on every layer (~30% slower, keeps only layer inputs);
3. move to the next profile of the same precision that offloads more (slower, frees GPU memory).
Pure: the loop applies the move and records it in ``summary.json`` ``fallbacks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.profiles import PROFILES, Profile


@dataclass(frozen=True)
class Rung:
    micro_batch: int
    accumulation: int
    checkpointing: bool
    profile: str
    checkpoint_every: int = 1  # with checkpointing: every k-th decoder layer


@dataclass(frozen=True)
class Move:
    to: Rung
    kind: str  # 'micro_batch' | 'checkpointing' | 'profile'
    reason: str


def more_offload(current: Profile, usable: list[Profile]) -> Profile | None:
    """The next profile of the same precision that keeps less on the GPU (higher speed_rank), if any."""
    later = [p for p in usable if p.precision == current.precision and p.speed_rank > current.speed_rank]
    same_engine = [p for p in later if p.engine == current.engine]
    pool = same_engine or later
    return min(pool, key=lambda p: p.speed_rank) if pool else None


def next_move(now: Rung, usable: list[Profile], what: str = "out of memory") -> Move | None:
    if now.micro_batch > 1:
        # the largest divisor of the micro-batch up to half of it, so the global batch stays exact
        micro = max(d for d in range(1, now.micro_batch // 2 + 1) if now.micro_batch % d == 0)
        acc = now.accumulation * (now.micro_batch // micro)
        return Move(Rung(micro, acc, now.checkpointing, now.profile), "micro_batch",
                    f"{what}: micro-batch {now.micro_batch} -> {micro}, accumulation {now.accumulation} -> {acc}")
    if not now.checkpointing or now.checkpoint_every > 1:
        what_now = "on" if not now.checkpointing else f"on every layer (was every {now.checkpoint_every})"
        return Move(Rung(now.micro_batch, now.accumulation, True, now.profile, 1), "checkpointing",
                    f"{what} at micro-batch {now.micro_batch}: gradient checkpointing {what_now}")
    current = PROFILES.get(now.profile)  # None: a deepspeed_config's custom profile, which never moves
    nxt = more_offload(current, usable) if current is not None else None
    if nxt is not None:
        return Move(Rung(now.micro_batch, now.accumulation, True, nxt.name), "profile",
                    f"{what} with checkpointing at micro-batch {now.micro_batch}: profile {now.profile} -> {nxt.name}")
    return None
