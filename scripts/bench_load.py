#!/usr/bin/env python
"""A saved model directory loaded the way a run loads it: the host memory it takes, and the weights it gives.

Writes a model (default llama-1b, random weights) as 16-bit safetensors in several shards, then in a fresh process
each: vramfit's loader (``launcher.model.build.make_model``: the model made on the meta device, each tensor read
from its shard into its place) and transformers' ``from_pretrained`` in the same dtype. Each child reports the
resident set before the load, the high-water mark (VmHWM) after it, and a SHA-256 of every tensor's bytes; the
two loads must give bitwise the same weights, and the load's host peak (high-water mark less the resident set
before it) is compared with the directory's size on disk.

    python scripts/bench_load.py --out bench/results/DATE-MACHINE/load
    python scripts/bench_load.py --model tiny --shard 1MB --max-ratio inf --out DIR   # a quick check that it runs

It fails (exit 1) when the weights differ or the load peak is above ``--max-ratio`` times the size on disk. A
small model's load peak is mostly the modules the load imports, not its weights: ``--max-ratio inf`` for those.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 2 ** 30


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_hwm() -> None:
    # writing 5 to clear_refs resets VmHWM to the current resident set (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make(model: str, directory: str, shard: str) -> None:
    import torch

    from launcher.config.load import load_config
    from launcher.model.build import make_model
    from launcher.model.materialize import Placement

    cfg = load_config(None, [f"model.name={model}"])
    m = make_model(cfg, Placement(torch.device("cpu"), torch.bfloat16, torch.bfloat16))
    m.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)


def child(how: str, directory: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.config.load import load_config
    from launcher.model.build import make_model
    from launcher.model.materialize import Placement

    before = _status("VmRSS")
    _reset_hwm()
    t0 = time.perf_counter()
    if how == "vramfit":
        cfg = load_config(None, [f"model.name={directory}"])
        m = make_model(cfg, Placement(torch.device("cpu"), torch.bfloat16, torch.bfloat16))
    else:
        m = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    hwm = _status("VmHWM")
    hashes = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for k, v in m.state_dict().items()}
    return {"how": how, "rss_before": before, "hwm": hwm, "load_peak": hwm - before, "seconds": round(seconds, 2),
            "hashes": hashes, "dtypes": sorted({str(v.dtype) for v in m.state_dict().values()})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--shard", default="600MB", help="max_shard_size of the saved directory")
    ap.add_argument("--max-ratio", type=float, default=1.2,
                    help="the highest load peak / size on disk that passes (default %(default)s; inf: report only)")
    ap.add_argument("--out", default=None, help="where load.json and load.md go (default: print only)")
    ap.add_argument("--child", nargs=2, metavar=("HOW", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, a.model)
        make(a.model, d, a.shard)
        shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(os.path.join(d, f)) for f in shards)
        runs = {}
        for how in ("vramfit", "from_pretrained"):
            p = subprocess.run([sys.executable, __file__, "--child", how, d], capture_output=True, text=True,
                               env=dict(os.environ, VRAMFIT_RECHECK="off"))
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            runs[how] = json.loads(p.stdout.strip().splitlines()[-1])
    ours, theirs = runs["vramfit"], runs["from_pretrained"]
    same = ours["hashes"] == theirs["hashes"]
    differ = sorted(k for k in set(ours["hashes"]) | set(theirs["hashes"])
                    if ours["hashes"].get(k) != theirs["hashes"].get(k))
    ratio = ours["load_peak"] / size
    lines = [f"model {a.model}: {len(shards)} safetensors shards, {size / GiB:.2f} GiB on disk",
             "| loader | RSS before GiB | high-water mark GiB | load peak GiB | load peak / size on disk | seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for how, r in runs.items():
        lines.append(f"| {how} | {r['rss_before'] / GiB:.2f} | {r['hwm'] / GiB:.2f} | {r['load_peak'] / GiB:.2f} | "
                     f"{r['load_peak'] / size:.2f} | {r['seconds']} |")
    lines.append(f"weights bitwise equal: {'yes' if same else 'NO: ' + ', '.join(differ[:5])} "
                 f"({len(ours['hashes'])} tensors, dtypes {', '.join(ours['dtypes'])})")
    md = "\n".join(lines)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "hashes"} for k, v in runs.items()}
        json.dump({"model": a.model, "shards": len(shards), "size_on_disk": size, "bitwise_equal": same,
                   "differ": differ, "runs": slim, "argv": sys.argv[1:]},
                  open(os.path.join(a.out, "load.json"), "w"), indent=2)
        open(os.path.join(a.out, "load.md"), "w").write(md + "\n")
    return 0 if same and ratio <= a.max_ratio else 1


if __name__ == "__main__":
    raise SystemExit(main())
