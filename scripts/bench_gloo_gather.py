"""What an all-gather over gloo (CPU ranks) holds on each rank beside its output: two processes all-gather a bf16
tensor of each size into one output (``all_gather_into_tensor``, as FSDP2 and DeepSpeed's ZeRO-3 gather their
units), and each rank's RSS high-water mark (VmHWM, reset through ``/proc/self/clear_refs``) is read against its RSS
before. The planner counts the ratio on CPU ranks (``launcher/plan/memory/states.py::model_states``); a GPU's NCCL
gathers into the output alone.

    python scripts/bench_gloo_gather.py --mib 32,128,256 --out bench/results/DATE-MACHINE/gloo-gather

Writes ``gloo_gather.json`` and ``gloo_gather.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import time

MiB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _rank(rank: int, port: int, sizes: list[int], queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ctypes.CDLL(None).mallopt(-3, 4 * MiB)  # M_MMAP_THRESHOLD: freed blocks go back, as vramfit runs CPU ranks
    rows = []
    for mib in sizes:
        n = mib * MiB // 2  # bf16 elements of the gathered output
        shard = torch.ones(n // 2, dtype=torch.bfloat16)
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        out = torch.empty(n, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, shard)
        held = _status("VmHWM") - before
        assert out.float().sum().item() == n  # every element came
        rows.append({"output_mib": mib, "held_mib": round(held / MiB, 1), "held_over_output": held / (mib * MiB)})
        del out, shard
    dist.destroy_process_group()
    queue.put((rank, rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="32,128,256", help="sizes of the gathered output, MiB")
    ap.add_argument("--out", default=None, help="where the JSON and Markdown results go (default: print only)")
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    sizes = [int(x) for x in a.mib.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    lines = ["| output MiB | held on rank 0 MiB | held on rank 1 MiB | held / output |", "| ---: | ---: | ---: | ---: |"]
    for i, mib in enumerate(sizes):
        r0, r1 = results[0][i], results[1][i]
        lines.append(f"| {mib} | {r0['held_mib']} | {r1['held_mib']} | "
                     f"{max(r0['held_over_output'], r1['held_over_output']):.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gloo_gather.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "ranks": results}, f,
                      indent=1)
        with open(os.path.join(a.out, "gloo_gather.md"), "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
