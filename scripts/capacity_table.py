"""The capacity table of docs/more-room.md: what the planner says fits for llama-1b/3b/7b (full fine-tune, LoRA,
QLoRA) on an 8, 16 and 24 GB card with 16, 32 and 64 GB of host RAM, before and after the levers of that page
(chunked loss, activation offload, NVMe offload).

Planned on this CPU machine for catalogue GPUs (launcher.plan.gpus: Quadro RTX 4000 8 GB, T4 16 GB, RTX 3090 24 GB),
seq 2048, global batch 8, micro-batch 1 with every layer checkpointed (the setting that needs the least memory
without the levers; the search over micro-batches would multiply the traces of this grid). "before": loss.chunked=off,
memory.offload_activations=off, no memory.nvme_path. "after": loss.chunked=auto, memory.offload_activations=auto,
memory.nvme_path on a disk with 1 TB free (an assumption, stated in the output; its speeds are this machine's
disk, measured by launcher.machine.hardware.probe_disk, and only order the choice). Without machine speeds the planner
chooses by speed rank. Writes results.json and table.md into the output folder.

    python scripts/capacity_table.py --out bench/results/2026-11-30-cpu-epyc/capacity
    python scripts/capacity_table.py --out /tmp/cap --models llama-1b --modes LoRA --cards 16 --ram 32   # one row

``--models``, ``--modes``, ``--cards`` (GB) and ``--ram`` (GB) plan a part of the grid (default: all of it, 162
plans); one row is a check that the script still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.config.load import load_config  # noqa: E402
from launcher.config.schema import ConfigError  # noqa: E402
from launcher.machine.hardware import probe, probe_disk  # noqa: E402
from launcher.plan import (
    gpus,  # noqa: E402
    planner,
)
from launcher.units import GiB  # noqa: E402

CARDS = {"8 GB": "QuadroRTX4000", "16 GB": "T4", "24 GB": "RTX3090"}
RAM = (16, 32, 64)
MODELS = ("llama-1b", "llama-3b", "llama-7b")
MODES = {"full": [], "LoRA": ["lora.r=16"], "QLoRA": ["lora.r=16", "model.quantize=4bit"]}
ASSUMED_FREE_DISK = 1000 * 10**9


def cell(model: str, mode: str, card: str, ram: int, after: bool, disk: dict, host) -> dict:
    over = [f"model.name={model}", "data.seq_len=2048", "train.global_batch_size=8", "train.micro_batch_size=1",
            "model.gradient_checkpointing=true",
            f"memory.cpu_budget={ram * 0.9:.1f}", *MODES[mode]]
    if after:
        over += ["loss.chunked=auto", "memory.offload_activations=auto", f"memory.nvme_path={disk['path']}"]
    else:
        over += ["loss.chunked=off", "memory.offload_activations=off"]
    hw = gpus.hardware(gpus.find(CARDS[card]), host, ram_gib=ram)
    hw.bitsandbytes = hw.bitsandbytes or "planned"  # QLoRA is planned whether or not bitsandbytes is here
    if after:
        hw.nvme = dict(disk, free_bytes=ASSUMED_FREE_DISK)
        hw.async_io = "usable"
    try:
        p = planner.plan(load_config(None, over), hw)
    except ConfigError as e:
        return {"fits": False, "why": str(e).splitlines()[-1]}
    c = p.chosen_plan
    if c is None:
        return {"fits": False, "why": p.reason[:160]}
    return {"fits": True, "profile": c.profile, "setting": c.setting, "gpu_gib": round(c.gpu_bytes / GiB, 2),
            "cpu_gib": round(c.cpu_bytes / GiB, 2),
            "disk_gib": round(sum(c.parts.get("disk", {}).values()) / GiB, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--cards", default=",".join(c.split()[0] for c in CARDS),
                    help="comma-separated card sizes in GB, of: " + ", ".join(c.split()[0] for c in CARDS))
    ap.add_argument("--ram", default=",".join(map(str, RAM)), help="comma-separated host RAM in GB, of: "
                    + ", ".join(map(str, RAM)))
    args = ap.parse_args()
    models, modes = args.models.split(","), args.modes.split(",")
    cards, rams = [f"{c} GB" for c in args.cards.split(",")], args.ram.split(",")
    for flag, got, known in (("--models", models, MODELS), ("--modes", modes, list(MODES)),
                             ("--cards", cards, list(CARDS)), ("--ram", rams, [str(r) for r in RAM])):
        if set(got) - set(known):
            ap.error(f"{flag}: got {vars(args)[flag[2:]]!r}; rule: comma-separated, of "
                     f"{', '.join(k.split()[0] for k in known)}")
    models, modes = [m for m in MODELS if m in models], [m for m in MODES if m in modes]
    cards, rams = [c for c in CARDS if c in cards], [r for r in RAM if str(r) in rams]
    os.makedirs(args.out, exist_ok=True)
    host = probe()
    folder = os.path.join(tempfile.gettempdir(), "vramfit-capacity-nvme")  # the config check wants it to exist
    os.makedirs(folder, exist_ok=True)
    disk = probe_disk(folder)
    t0 = time.perf_counter()
    rows = []
    for model in models:
        for mode in modes:
            for card in cards:
                for ram in rams:
                    for after in (False, True):
                        c = cell(model, mode, card, ram, after, disk, host)
                        rows.append({"model": model, "mode": mode, "card": card, "ram_gb": ram,
                                     "levers": "after" if after else "before", **c})
                        print(json.dumps(rows[-1]), flush=True)
    doc = {"rows": rows, "seconds": round(time.perf_counter() - t0, 1),
           "assumptions": {"seq_len": 2048, "global_batch": 8, "cpu_budget": "90% of the RAM",
                           "cards": CARDS, "nvme_free_bytes": ASSUMED_FREE_DISK,
                           "disk_speeds_measured_here": {k: disk.get(k) for k in ("write_bytes_per_s",
                                                                                   "read_bytes_per_s", "fs_type")}}}
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(table(rows, models, modes, cards, rams))
    print(table(rows, models, modes, cards, rams))


def short(r: dict) -> str:
    if not r["fits"]:
        return "-"
    p = r["profile"].replace("zero3-", "z3-").replace("zero2-", "z2-").replace("-offload", "-off")
    tags = [t for t, k in (("chunked", "chunked loss"), ("act-off", "activations offloaded")) if k in r["setting"]]
    return p + (f" ({', '.join(tags)})" if tags else "")


def table(rows: list[dict], models=MODELS, modes=tuple(MODES), cards=tuple(CARDS), rams=RAM) -> str:
    head = "| model | mode | RAM | " + " | ".join(f"{c} before | {c} after" for c in cards) + " |"
    lines = [head, "|" + " --- |" * (3 + 2 * len(cards))]
    index = {(r["model"], r["mode"], r["card"], r["ram_gb"], r["levers"]): r for r in rows}
    for model in models:
        for mode in modes:
            for ram in rams:
                cells = []
                for card in cards:
                    cells += [short(index[(model, mode, card, ram, "before")]),
                              short(index[(model, mode, card, ram, "after")])]
                lines.append(f"| {model} | {mode} | {ram} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
