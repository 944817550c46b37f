"""Ranks and process groups: the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) is read here once.

``torchrun``, ``deepspeed`` and plain ``python`` all work: without launcher variables the run is rank 0 of
1, and a process group of one is made only when an engine needs one (DeepSpeed, FSDP). Several ranks use
``cuda:nccl,cpu:gloo`` on GPUs (NCCL for the model's tensors, gloo for the loop's small CPU reductions and
FSDP's offloaded gradients), plain gloo on the CPU.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

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


class EnvError(ValueError):
    """Launcher variables that cannot describe a run; printed like a configuration error (value, rule, fix).
    Defined here rather than as a ConfigError because the configuration module sits above this one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the launcher environment:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


_FIX = ("fix: unset RANK WORLD_SIZE LOCAL_RANK for one process, or start the ranks with torchrun or deepspeed, "
        "which set them together")


def read_env(env=os.environ) -> Dist:
    """RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, MASTER_ADDR and MASTER_PORT
    when set) checked together; raises EnvError listing every problem. Unset variables mean one process: rank 0
    of 1."""
    problems: list[str] = []

    def whole(name: str, default: int, lo: int, fix: str = _FIX) -> int | None:
        raw = env.get(name)
        if raw is None:
            return default
        try:
            v = int(raw.strip())
        except ValueError:
            v = None
        if v is None or v < lo:
            problems.append(f"{name}: got {raw!r}; rule: a whole number >= {lo}; {fix}")
            return None
        return v

    world, rank, local = whole("WORLD_SIZE", 1, 1), whole("RANK", 0, 0), whole("LOCAL_RANK", 0, 0)
    # read where ranks share a machine's cores, and by torchrun's restarts: checked here, so no later int() fails
    whole("LOCAL_WORLD_SIZE", 1, 1, "fix: unset LOCAL_WORLD_SIZE (torchrun sets it: the ranks on this machine), or "
                                    "LOCAL_WORLD_SIZE=1 for one process")
    whole("TORCHELASTIC_RESTART_COUNT", 0, 0, "fix: unset TORCHELASTIC_RESTART_COUNT (torchrun sets it on a restart)")
    if world is not None and world > 1 and env.get("RANK") is None:
        problems.append(f"RANK: not set with WORLD_SIZE={world}; rule: each of several processes needs its rank "
                        f"(0 to {world - 1}), or it waits for the others forever; {_FIX}")
    if world is not None and rank is not None and rank >= world:
        problems.append(f"RANK: got {rank} with WORLD_SIZE={world}; rule: 0 <= RANK < WORLD_SIZE; {_FIX}")
    if rank is not None and local is not None and local > rank:
        problems.append(f"LOCAL_RANK: got {local} with RANK={rank}; rule: a process's rank on its machine is never "
                        f"above its rank among all processes; {_FIX}")
    addr = env.get("MASTER_ADDR")
    if addr is not None and not addr.strip():
        problems.append("MASTER_ADDR: got ''; rule: the host name or address of rank 0; fix: MASTER_ADDR=127.0.0.1 on "
                        "one machine, or unset it (one process uses 127.0.0.1)")
    port = env.get("MASTER_PORT")
    if port is not None:
        ok = port.strip().isdigit() and 1 <= int(port) <= 65535
        if not ok:
            problems.append(f"MASTER_PORT: got {port!r}; rule: a TCP port, 1 to 65535; fix: MASTER_PORT=29500, or "
                            "unset it (one process picks a free port)")
    if problems:
        raise EnvError(problems)
    return Dist(rank, world, local)


@functools.lru_cache(maxsize=1)
def current() -> Dist:
    """This process's place among the ranks, from the launcher's environment (read once)."""
    return read_env()


def backend(device: torch.device) -> str:
    """NCCL for the GPU collectives plus gloo for the CPU ones; gloo alone on the CPU."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def shutdown(keep_single: bool = False) -> None:
    """Destroy the default process group while the interpreter is whole (``keep_single``: not a group of one,
    which an in-process caller's next run reuses). A gloo group left to the interpreter's
    teardown can abort the process after a finished run ("terminate called without an active exception",
    SIGABRT; its worker threads still hold tensors, pytorch/pytorch#179291), which a launcher reports as a failed
    rank. Local: no collective, so a rank that fails does not wait here on the others."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if not (keep_single and torch.distributed.get_world_size() == 1):
            gc.collect()  # the run's engine (DDP's reducer holds the group) goes first, while the interpreter is whole
            torch.distributed.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a launched rank of several: exit handlers run and output is flushed, then the process ends without the
    interpreter's own teardown. A gloo group still referenced somewhere (destroy_process_group drops only the
    registry's reference) is otherwise destroyed during that teardown, where its worker threads can abort the
    process (SIGABRT after a finished run, seen in one of three runs of the slow tests even with the group
    destroyed), which the launcher reports as a failed rank and turns into a failed job."""
    atexit._run_exitfuncs()  # swap folders, multiprocessing's finalizers, logging's flush: what sys.exit would run
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def ensure_env() -> None:
    """Single-process defaults, so that an engine that needs a process group works without a launcher."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)


def init(device: torch.device, world: int | None = None) -> None:
    """Make the default process group when there are several ranks and none exists yet.

    A restart by torchrun (``--max-restarts``; the OOM ladder on several ranks asks for one) meets in the launcher's
    store again, where the first start's ranks left their addresses: gloo then connects to a rank that is gone
    ("Connection refused", the kind of failure of pytorch/pytorch#135712). Each restart meets under a prefix of
    its own (``TORCHELASTIC_RESTART_COUNT``, the same on every rank of a restart)."""
    me = current()
    if (world or me.world) <= 1 or torch.distributed.is_initialized():
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        base = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                          is_master=False, use_libuv=True)
        store = torch.distributed.PrefixStore(f"vramfit/restart-{restart}/", base)
        torch.distributed.init_process_group(backend(device), store=store, rank=me.rank, world_size=me.world)
    else:
        torch.distributed.init_process_group(backend(device))
