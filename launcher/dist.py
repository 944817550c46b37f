"""Ranks and process groups: the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) is read here once.

``torchrun``, ``deepspeed`` and plain ``python`` all work: without launcher variables the run is rank 0 of
1, and a process group of one is made only when an engine needs one (DeepSpeed, FSDP). Several ranks use
``cuda:nccl,cpu:gloo`` on GPUs (NCCL for the model's tensors, gloo for the loop's small CPU reductions and
FSDP's offloaded gradients), plain gloo on the CPU.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return self.world > 1 and torch.distributed.is_initialized()

    def barrier(self) -> None:
        if self.initialized:
            torch.distributed.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (ranks agree on stopping)."""
        if self.initialized:
            t = torch.tensor([int(flag)])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return bool(t.item())
        return flag

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a one-item list on one rank)."""
        if self.initialized:
            out = [None] * self.world
            torch.distributed.all_gather_object(out, obj)
            return out
        return [obj]

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.initialized:
            box = [obj]
            torch.distributed.broadcast_object_list(box, src=0)
            return box[0]
        return obj

    def mean(self, x: float) -> float:
        if self.initialized:
            t = torch.tensor([x], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            return float(t) / self.world
        return x


@functools.lru_cache(maxsize=1)
def current() -> Dist:
    """This process's place among the ranks, from the launcher's environment (read once)."""
    return Dist(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                int(os.environ.get("LOCAL_RANK", "0")))


def backend(device: torch.device) -> str:
    """NCCL for the GPU collectives plus gloo for the CPU ones; gloo alone on the CPU."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def ensure_env() -> None:
    """Single-process defaults, so that an engine that needs a process group works without a launcher."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)


def init(device: torch.device, world: int | None = None) -> None:
    """Make the default process group when there are several ranks and none exists yet."""
    if (world or current().world) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend(device))
